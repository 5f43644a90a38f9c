"""The results page and the README's results table are the records under docs/results/, rendered: grouped by
the question each record answers, the current records in full and the earlier ones folded under them."""

import argparse
import json
import os
import re
import shutil

import pytest

from helpers import TESTS, load_tool
from rllight.app.records import (SECTIONS, add_record_options, check_record_options, default_question, load_records,
                                  make_record, tool_record)

RESULTS = os.path.join(os.path.dirname(TESTS), "docs", "results")


def test_results_page_and_readme_table_match_the_records(capsys):
    pages = load_tool("results_pages")
    assert pages.main(["--check"]) == 0, capsys.readouterr().err


def test_every_record_has_its_provenance():
    records = load_records()  # check_record: command, commit, date, machine, shared, source
    assert records
    for record in records:
        assert record["rows"], f"{record['id']}: no values"
        if record["source"] == "transcribed":
            assert record["transcribed_from"].strip()


def test_readme_table_shows_each_current_headline_record_and_no_earlier_one():
    pages = load_tool("results_pages")
    with open(pages.README) as f:
        readme = f.read()
    for record in load_records():
        if "headline" in record:
            shown = f"docs/results/index.md#{record['id']})" in readme
            assert shown == ("superseded_by" not in record), record["id"]


def test_a_changed_record_makes_the_check_fail(tmp_path, monkeypatch, capsys):
    pages = load_tool("results_pages")
    folder = tmp_path / "results"
    shutil.copytree(RESULTS, folder)
    record = sorted(p for p in os.listdir(folder) if p.endswith(".json"))[0]
    data = json.loads((folder / record).read_text())
    first = data["columns"][0][0]
    data["rows"][0][first] = "changed"
    monkeypatch.setattr(pages, "load_records", lambda: load_records(str(folder)))
    monkeypatch.setattr(pages, "PAGE", str(folder / "index.md"))
    assert pages.main(["--check"]) == 0  # the copy as it is matches
    capsys.readouterr()
    (folder / record).write_text(json.dumps(data))
    assert pages.main(["--check"]) == 1
    assert "index.md differ" in capsys.readouterr().err


def test_a_record_without_a_command_is_refused(tmp_path):
    folder = tmp_path / "results"
    shutil.copytree(RESULTS, folder)
    record = sorted(p for p in os.listdir(folder) if p.endswith(".json"))[0]
    data = json.loads((folder / record).read_text())
    del data["command"]
    (folder / record).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing command"):
        load_records(str(folder))


# --------------------------------------------------------------------------- the page groups records by question
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b\d{4}-\d\d-\d\d\b")


def _page() -> str:
    with open(load_tool("results_pages").PAGE) as f:
        return f.read()


def _blocks(page: str) -> list[tuple[str, str]]:
    """``(question, its text)`` for each ``### question`` of ``page``, up to the next heading of level 3 or less."""
    parts = re.split(r"^(#{2,3}) (.+)$", page, flags=re.M)
    return [(parts[i + 1], parts[i + 2]) for i in range(1, len(parts), 3) if parts[i] == "###"]


def _earlier(text: str) -> str:
    """The collapsed blocks of ``text``: each ``??? note`` line and the indented or empty lines under it."""
    kept, inside = [], False
    for line in text.split("\n"):
        if line.startswith("??? note "):
            inside = True
        elif line and not line.startswith("    "):
            inside = False
        if inside:
            kept.append(line)
    return "\n".join(kept)


def test_the_page_groups_the_records_by_question_current_first_earlier_folded():
    records, page = load_records(), _page()
    blocks = dict(_blocks(page))
    assert len(blocks) == len(_blocks(page)), "a question heads one block only"
    assert set(blocks) == {r["question"] for r in records}
    for record in records:
        text = blocks[record["question"]]
        anchor = f'<a id="{record["id"]}"></a>'
        assert page.count(anchor) == text.count(anchor) == 1, record["id"]
        folded = _earlier(text)
        if "superseded_by" in record:
            assert f"    {anchor}" in folded, f"{record['id']}: an earlier measurement sits in the collapsed block"
        else:
            assert anchor not in folded, record["id"]
            assert "??? note" not in text or text.index(anchor) < text.index("??? note"), record["id"]


def test_no_heading_or_title_reads_as_a_notebook_entry():
    """No commit id or date in a heading or a record's title: the provenance line under each table gives them."""
    page = _page()
    titles = [r["title"] for r in load_records()]
    headings = [line for line in page.split("\n") if line.startswith("#")] + [f"**{t}**" for t in titles]
    assert all(f"**{t}**" in page for t in titles)
    for heading in headings:
        assert not COMMIT.search(heading) and not DATE.search(heading), heading
        assert "stale)" not in heading and "before the" not in heading, heading


def test_an_earlier_measurements_block_keeps_its_tables_and_code_inside():
    """pymdownx.details: everything of a collapsed block is indented 4 spaces, the fences' lines included, and it
    says how many records it holds."""
    for _, text in _blocks(_page()):
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if not line.startswith("??? note "):
                continue
            count = int(re.fullmatch(r'\?\?\? note "Earlier measurements \((\d+)\)"', line).group(1))
            body = []
            for below in lines[i + 1:]:
                if below and not below.startswith("    "):
                    break
                body.append(below)
            assert sum(b.startswith('    <a id="') for b in body) == count
            assert body.count("    ```bash") == body.count("    ```") == count


def test_every_link_to_the_page_finds_its_anchor():
    from markdown.extensions.toc import slugify

    page = _page()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', page))
    anchors |= {slugify(line.lstrip("#").strip(), "-") for line in page.split("\n") if line.startswith("#")}
    docs = os.path.dirname(RESULTS)
    files = [os.path.join(os.path.dirname(docs), "README.md")]
    files += [os.path.join(d, f) for d, _, names in os.walk(docs) for f in names if f.endswith(".md")]
    linked = set()
    for path in files:
        with open(path) as f:
            linked |= set(re.findall(r"results/index\.md#([\w-]+)", f.read()))
    assert linked and linked <= anchors, sorted(linked - anchors)


@pytest.mark.parametrize("change, message", [
    ({"question": None}, "missing question"),
    ({"question": "  "}, "'question' must be non-empty text"),
    ({"question": "Speed"}, "does not end with '?'"),
    ({"superseded_by": "no-such-record"}, "superseded_by 'no-such-record' names no record"),
    ({"superseded_by": "install-quickstart-time"}, "a record of another question"),
    ({"superseded_by": "bench-gae-2026-11-29"}, "itself superseded by 'bench-gae'"),
    ({"section": "Quickstart"}, "sits under section"),
])
def test_a_record_without_its_question_or_with_a_bad_superseded_by_is_refused_naming_its_file(tmp_path, change,
                                                                                               message):
    folder = tmp_path / "results"
    shutil.copytree(RESULTS, folder)
    path = folder / "bench-gae-shared.json"  # an earlier measurement of bench-gae's question
    data = json.loads(path.read_text())
    for key, value in change.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        load_records(str(folder))
    assert len(str(refused.value).splitlines()) == 1 and str(refused.value).startswith(f"{path}: ")


def test_a_tool_writes_the_question_its_records_answer():
    """A rerun with ``--record`` writes the question of the record it replaces (``QUESTIONS`` by id, and the file
    it overwrites); a tool's own default id answers a question of the section it writes to."""
    records = load_records()
    for record in records:
        assert default_question(record["id"], section=record["section"]) == record["question"], record["id"]
    sections = {r["question"]: r["section"] for r in records}
    tools = os.path.join(os.path.dirname(TESTS), "tools")
    found = set()
    for name in os.listdir(tools):
        if name.endswith(".py"):
            with open(os.path.join(tools, name)) as f:
                source = f.read()
            found |= set(re.findall(r'\bid="([a-z0-9-]+)", section="([^"]+)"', source))
            found |= set(re.findall(r'\bid, section(?:, headline)? = "([a-z0-9-]+)", "([^"]+)"', source))
    assert len(found) > 10
    for id, section in found:
        question = default_question(id, section=section)
        assert question and sections.get(question, section) == section, (id, section, question)


def test_a_rerun_into_a_records_file_keeps_its_question_unless_told(tmp_path):
    path = tmp_path / "bench-gae.json"
    shutil.copy(os.path.join(RESULTS, "install-quickstart-time.json"), path)
    original = json.loads(path.read_text())
    data = {**original, "id": "bench-gae"}
    path.write_text(json.dumps(data))
    assert default_question("bench-gae", section="Speed and memory") != original["question"]
    for where, argv, question in ((path, [], original["question"]), (tmp_path, [], original["question"]),
                                  (path, ["--question", "Is it fast?"], "Is it fast?")):
        parser = argparse.ArgumentParser()
        add_record_options(parser, id="bench-gae", section="Speed and memory")
        args = parser.parse_args(["--record", str(where), *argv])
        check_record_options(parser, args, argv, "tools/bench_gae.py")
        tool_record(args, id="bench-gae", title="t", section="Speed and memory", columns=[["a", "a"]], rows=[{"a": 1}])
        assert json.loads(path.read_text())["question"] == question


def test_a_records_figure_is_shown_under_its_table_and_must_lie_beside_it(tmp_path):
    folder = tmp_path / "results"
    shutil.copytree(RESULTS, folder)
    name = sorted(p for p in os.listdir(folder) if p.endswith(".json"))[0]
    data = json.loads((folder / name).read_text())
    data["figure"] = "curves.png"
    (folder / name).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{name}: its figure curves.png is not in .*draw it again"):
        load_records(str(folder))
    (folder / "curves.png").write_bytes(b"\x89PNG")
    (record,) = [r for r in load_records(str(folder)) if r["id"] == data["id"]]
    card = load_tool("results_pages").card(record, "**t**")
    last_row = max(i for i, line in enumerate(card) if line.startswith("| "))
    assert card[last_row + 1:last_row + 3] == ["", f"![{record['title']}](curves.png)"]
    data["figure"] = "../elsewhere.png"
    (folder / name).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"figure '../elsewhere.png' is not the name of a .png file beside"):
        load_records(str(folder))


def test_a_record_of_many_columns_is_shown_as_its_tables_each_under_its_caption():
    columns = [["method", "method"], ["gain", "gain", "+.3f"], ["ev", "critic EV", ".2f"], ["ess", "ESS", ".2f"]]
    record = make_record(id="t", title="t", section=SECTIONS[0], columns=columns, command="x",
                         rows=[{"method": "a", "gain": 0.1, "ev": 0.5}, {"method": "b", "gain": -0.2}],
                         tables=[["Accuracy", ["method", "gain"]], ["Signals", ["method", "ev", "ess"]]])
    lines = load_tool("results_pages").tables(record)
    # Each table under its caption; the ESS column, which no row has, is left out; a missing value is blank.
    assert lines == ["Accuracy:", "", "| method | gain |", "|---|---|", "| a | +0.100 |", "| b | −0.200 |", "",
                     "Signals:", "", "| method | critic EV |", "|---|---|", "| a | 0.50 |", "| b |  |"]
    with pytest.raises(ValueError, match="record t: table 'Signals' names no column evv"):
        make_record(id="t", title="t", section=SECTIONS[0], columns=columns, rows=[], command="x",
                    tables=[["Signals", ["method", "evv"]]])
