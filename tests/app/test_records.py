"""rllight.app.records: a record lacking its provenance or holding a value for no column is refused, naming the field;
what the measuring tools call to write one (``--record``) parses their printed values back exactly and refuses a
path that could not hold the record before anything is measured. (The pages rendered from the records:
tests/tools/test_results.py.)"""

import argparse
import json

import pytest

from rllight.app import records
from rllight.app.records import (add_record_options, check_record, check_record_options, load_records, make_record,
                             pairs_record, parse_pairs, parse_value, printed, tool_record)


def _record(**changes) -> dict:
    record = make_record(id="bench-x", title="A benchmark", section="Speed and memory", columns=[["a", "a", ".2f"]],
                         rows=[{"a": 1.5}], command=".venv/bin/python tools/x.py")
    record.update(changes)
    return record


def test_a_made_record_is_accepted_and_names_its_provenance():
    record = _record()
    check_record(record, "made")
    assert record["source"] == "tool" and record["command"] == ".venv/bin/python tools/x.py"
    assert record["commit"] and record["machine"] and record["shared"].startswith("not stated")


@pytest.mark.parametrize("change, field", [
    ({"command": ""}, "command"),
    ({"command": None}, "command"),
    ({"source": "transcribed"}, "transcribed_from"),
    ({"rows": [{"a": 1.0, "bogus": 2.0}]}, "bogus"),
    ({"id": "Not An Id"}, "id"),
    ({"date": "3 Dec 2026"}, "date"),
    ({"headline": {"label": "x", "template": "{missing:.3f}"}}, "headline"),
])
def test_check_record_refuses_a_bad_field_naming_it(change, field):
    with pytest.raises(ValueError, match=field) as refused:
        check_record(_record(**change), "docs/results/bench-x.json")
    assert str(refused.value).startswith("docs/results/bench-x.json: ")


def test_check_record_refuses_a_record_without_command():
    record = _record()
    del record["command"]
    with pytest.raises(ValueError, match="missing command"):
        check_record(record, "r")


def test_a_transcribed_record_with_its_source_is_accepted():
    check_record(_record(source="transcribed", transcribed_from="README.md at commit abc1234"), "r")


def test_load_records_refuses_a_file_not_named_after_its_id(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps(_record()))
    with pytest.raises(ValueError, match=r"named after its id \(bench-x.json\)"):
        load_records(str(tmp_path))


def test_printed_values_read_back_as_the_tool_printed_them():
    assert [parse_value(t) for t in ("12", "0.0963", "2.38e-06", "-", "", "nan", "inf", "1/1", "yes")] == [
        12, 0.0963, 2.38e-06, None, None, None, None, "1/1", "yes"]
    assert printed(1 / 3, ".3f") == 0.333 and printed(1234.5678, ".4g") == 1235 and printed(None, ".3f") is None
    assert printed(0.5, "+.3f") == 0.5 and printed(float("nan"), ".2f") is None
    assert parse_pairs("speedup=12.03 max_abs_diff=2.38e-06 runs=1/1") == {"speedup": 12.03, "max_abs_diff": 2.38e-06,
                                                                           "runs": "1/1"}
    with pytest.raises(ValueError, match="not a name=value pair: 'all'"):
        parse_pairs("all finite")


def _parser(id="bench-x", section="Speed and memory") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="x.py")
    add_record_options(parser, id=id, section=section)
    return parser


def _parse(argv, **kwargs) -> argparse.Namespace:
    parser = _parser(**kwargs)
    args = parser.parse_args(argv)
    check_record_options(parser, args, argv, "tools/x.py")
    return args


def test_record_options_take_the_id_from_the_file_and_refuse_what_could_not_be_written(tmp_path, capsys):
    assert _parse(["--record", str(tmp_path / "new" / "bench-y.json")]).record_id == "bench-y"
    assert _parse(["--record", str(tmp_path)]).record_id is None  # a folder: the tool's own id
    (tmp_path / "a-file").write_text("")
    for argv, message in ((["--record", str(tmp_path / "x.txt")], "--record"),
                          (["--record", str(tmp_path / "Bench_Y.json")], "--record"),
                          (["--record", str(tmp_path / "a.json"), "--record-id", "b"], "--record-id 'b' differs"),
                          (["--record", str(tmp_path), "--record-id", "B"], "--record-id 'B'"),
                          (["--record", str(tmp_path / "a-file" / "x.json")], "cannot write under")):
        with pytest.raises(SystemExit):
            _parse(argv)
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_tool_record_writes_only_when_asked_with_the_tools_command_and_options(tmp_path, capsys):
    args = _parse([])
    assert tool_record(args, id="bench-x", title="t", section="Speed and memory", columns=[], rows=[]) is None
    folder = str(tmp_path / "made") + "/"  # a folder not made yet
    argv = ["--record", folder, "--shared", "yes", "--title", "Mine", "--headline", "GAE"]
    args = _parse(argv)
    path = pairs_record(args, "speedup=12.03 max_abs_diff=2.38e-06", id="bench-x", section="Speed and memory",
                        title="The tool's", settings={"batch": 4}, formats={"speedup": ".2f"},
                        headline="{speedup:.2f}x")
    assert path == str(tmp_path / "made" / "bench-x.json") and capsys.readouterr().out == f"record: {path}\n"
    (record,) = load_records(str(tmp_path / "made"))
    assert record["command"] == ".venv/bin/python tools/x.py " + " ".join(argv)
    assert (record["title"], record["shared"], record["rows"]) == ("Mine", "shared with other work",
                                                                    [{"batch": 4, "speedup": 12.03,
                                                                      "max_abs_diff": 2.38e-06}])
    assert record["columns"] == [["batch", "batch"], ["speedup", "speedup", ".2f"], ["max_abs_diff", "max_abs_diff"]]
    assert records.headline_value(record) == "12.03x" and record["headline"]["label"] == "GAE"
    assert record["summary"] == {"speedup": 12.03, "max_abs_diff": 2.38e-06}


def test_a_tool_record_that_would_be_malformed_is_refused_before_it_is_written(tmp_path):
    args = _parse(["--record", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="row 1 has values for no column: b"):
        tool_record(args, id="x", title="t", section="Speed and memory", columns=[["a", "a"]],
                    rows=[{"a": 1, "b": 2}])
    assert not (tmp_path / "x.json").exists()


def test_a_record_path_that_holds_another_file_is_refused_before_the_measurement(tmp_path, capsys):
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    with pytest.raises(SystemExit):
        _parse(["--record", str(tmp_path / "notes.json")])
    assert "exists and is not a record" in capsys.readouterr().err
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}'
