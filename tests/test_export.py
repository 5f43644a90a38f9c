"""Export never deletes or overwrites what the run did not write: a folder with other files is refused before
training, an earlier export is replaced only once the new one is complete."""

import json
import os

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import RECIPES
from helpers import fit_in_child, tiny_overrides
from rllight.errors import RecipeError
from rllight.export import MARKER, export_policy


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_export_writes_a_marked_folder_and_replaces_only_an_earlier_export(tmp_path, tiny):
    model, tokenizer = tiny
    target = tmp_path / "model"
    export_policy(model, tokenizer, str(target), info={"global_step": 3})
    assert json.loads((target / MARKER).read_text())["global_step"] == 3
    assert (target / "config.json").exists()
    export_policy(model, tokenizer, str(target), info={"global_step": 7})
    assert json.loads((target / MARKER).read_text())["global_step"] == 7
    # No half folders or old copies left next to it.
    assert sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_an_export_has_the_permissions_the_umask_gives_readable_by_a_serving_process(umask, folder_mode, file_mode,
                                                                                      tmp_path, tiny):
    model, tokenizer = tiny
    previous = os.umask(umask)
    try:
        export_policy(model, tokenizer, str(tmp_path / "model"))
    finally:
        os.umask(previous)
    target = tmp_path / "model"
    assert oct(target.stat().st_mode & 0o777) == oct(folder_mode)  # not mkdtemp's 0o700
    files = [p for p in target.rglob("*") if p.is_file()]
    assert {"config.json", MARKER} <= {p.name for p in files}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(file_mode) for p in files}


def test_export_into_a_folder_with_other_files_keeps_them_and_saves_aside(tmp_path, tiny):
    model, tokenizer = tiny
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(RecipeError, match="model.export_dir: .* not an rllight export.*saved in '(.*mine.new-.*)'"):
        export_policy(model, tokenizer, str(target))
    assert (target / "notes.txt").read_text() == "keep me" and os.listdir(target) == ["notes.txt"]
    aside = [p for p in os.listdir(tmp_path) if p.startswith("mine.new-")]
    assert len(aside) == 1 and (tmp_path / aside[0] / "config.json").exists()


def test_an_existing_file_is_never_an_export_target(tmp_path, tiny):
    model, tokenizer = tiny
    target = tmp_path / "weights.bin"
    target.write_text("user data")
    with pytest.raises(RecipeError, match="is a file"):
        export_policy(model, tokenizer, str(target))
    assert target.read_text() == "user data"


def _fit(tmp_path, tiny_model_dir, *extra, steps="1"):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    return fit_in_child("grpo.yaml", "--config", overlay, "--trainer.max_steps", steps, *extra, timeout=600)


def _refused(tmp_path, tiny_model_dir, capsys, *extra) -> str:
    """``rllight fit`` in this process with ``extra``: it must stop with exit code 2 before any step; its last
    line of stderr."""
    from rllight.app.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config",
              tiny_overrides(tmp_path, tiny_model_dir), "--trainer.max_steps", "1", *extra])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and "train/" not in out, err[-2000:]
    return err.strip().splitlines()[-1]


def test_cli_refuses_export_over_user_files_or_the_run_folder_before_training(tmp_path, tiny_model_dir, capsys):
    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    last = _refused(tmp_path, tiny_model_dir, capsys, "--model.export_dir", str(users))
    assert last.startswith("rllight: error: model.export_dir:"), last
    assert os.listdir(users) == ["thesis.tex"]

    # The run's own folder as export folder: the export would replace the logs and checkpoints.
    root = tmp_path / "run"
    last = _refused(tmp_path, tiny_model_dir, capsys, "--trainer.default_root_dir", str(root),
                    "--model.export_dir", str(root))
    assert last.startswith("rllight: error:") and "would hold the run's logs and checkpoints" in last, last

    # A file as the export folder.
    last = _refused(tmp_path, tiny_model_dir, capsys, "--model.export_dir", str(users / "thesis.tex"))
    assert last.startswith("rllight: error:") and "is a file" in last, last
    assert (users / "thesis.tex").read_text() == "years of work"


@pytest.mark.slow
def test_cli_replaces_an_earlier_export_after_training(tmp_path, tiny_model_dir, tiny):
    model, tokenizer = tiny
    target = tmp_path / "export"
    export_policy(model, tokenizer, str(target), info={"global_step": 0})
    run = _fit(tmp_path, tiny_model_dir, "--model.export_dir", str(target), steps="2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((target / MARKER).read_text())["global_step"] == 2
    assert not [p for p in os.listdir(tmp_path) if p.startswith("export.")]
