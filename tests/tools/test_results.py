"""The results page and the README's results table are the records under docs/results/, rendered."""

import json
import os
import shutil

import pytest

from helpers import TESTS, load_tool
from rllight.app.records import load_records

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


def test_readme_table_shows_each_headline_record():
    pages = load_tool("results_pages")
    with open(pages.README) as f:
        readme = f.read()
    for record in load_records():
        if "headline" in record:
            assert f"docs/results/index.md#{record['id']}" in readme, record["id"]


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
