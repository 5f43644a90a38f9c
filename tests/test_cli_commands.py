"""The command line around ``fit``: ``--version``, ``python -m rllight``, ``--model.path``, ``~`` and ``$VARIABLES``
in recipe paths, a user's own module next to the recipe or in the working directory, ``generate`` and ``chat``
on a model folder, and ``test`` / ``predict``, which are not offered."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import RECIPES
from helpers import TESTS, build, tiny_overrides
from rllight import __version__
from rllight.app.cli import main
from test_docs_examples import my_lab_code  # a docs page's my_lab.py
from test_user_errors import _error  # the one error line of `rllight <args>` (exit code 2, no traceback)

GRPO = os.path.join(RECIPES, "grpo.yaml")


def _rllight(*args, cwd, stdin: str | None = None, isolated: bool = False) -> subprocess.CompletedProcess:
    """``python -m rllight <args>`` in a child process (bytes out). ``isolated`` (``python -P``) keeps the working
    directory off the import path, as for the ``rllight`` console script, so only rllight can put it there."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
               PYTHONIOENCODING="utf-8")
    cmd = [sys.executable, *(["-P"] if isolated else []), "-m", "rllight", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, input=None if stdin is None else stdin.encode(),
                          capture_output=True, timeout=600)


@pytest.fixture
def restore_sys_path(monkeypatch):
    """``main`` puts the working directory on ``sys.path``; give it back after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))


# ------------------------------------------------------------------------------------- the command itself
def test_python_m_rllight_prints_the_version_of_what_it_runs_on_without_importing_it(tmp_path, capsys):
    """``--version`` names the versions that import (torch's local tag included), and answers from the packages'
    metadata: torch, Lightning and transformers, seconds to import, stay unloaded."""
    import lightning
    import torch
    import transformers

    expected = (f"rllight {__version__} (python {sys.version.split()[0]}, torch {torch.__version__}, "
                f"lightning {lightning.__version__}, transformers {transformers.__version__})")
    run = _rllight("--version", cwd=tmp_path)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.decode().strip() == expected
    probe = ("import sys; sys.argv = ['rllight', '-V']; from rllight.__main__ import main; main(); "
             "print(sorted({'torch', 'lightning', 'transformers'} & set(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [expected, "[]"]
    main(["--version"])  # the in-process entry point gives the same line
    assert capsys.readouterr().out.strip() == expected


def test_version_names_a_package_that_is_not_installed(monkeypatch):
    from importlib import metadata

    from rllight.app import versions as entry

    real = metadata.version

    def version(name):
        if name == "transformers":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(entry.metadata, "version", version)
    assert entry.version().endswith(", transformers not installed)")


def test_help_offers_fit_validate_generate_and_chat_but_not_test_or_predict(capsys, restore_sys_path):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{fit,validate,generate,chat}" in text and "predict" not in text
    assert "rllight generate --model.path DIR" in text and "rllight chat --model.path DIR" in text
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--prompts FILE" in text and "--model.path DIR" in text and "--temperature" in text


def test_help_answers_before_anything_heavy_loads_and_names_every_command():
    """``rllight --help`` imports neither torch, Lightning nor transformers, and its usage line lists every
    command the console script runs."""
    probe = ("import sys; sys.argv = ['rllight', '--help']; from rllight.__main__ import main; main(); "
             "print(sorted({'torch', 'lightning', 'transformers'} & set(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "usage: rllight {fit,validate,generate,chat} ... | rllight --version"
    assert lines[-1] == "[]"
    for command in ("fit", "validate", "generate", "chat"):
        assert any(line.startswith(f"  {command} ") for line in lines), command


def test_test_and_predict_say_what_to_use_instead(capsys, restore_sys_path):
    assert "rllight validate --config R.yaml --data.val_files" in _error(capsys, "test", "--config", GRPO)
    assert "rllight generate --model.path DIR --prompts FILE" in _error(capsys, "predict", "--config", GRPO)


# ---------------------------------------------------------------------------------------------- paths
def test_recipe_paths_expand_home_and_environment_variables(tmp_path, monkeypatch, tiny_model_dir, capsys,
                                                            restore_sys_path):
    home, runs = tmp_path / "home", tmp_path / "runs"
    (home / "data").mkdir(parents=True)
    (home / "data" / "train.jsonl").write_text('{"prompt": "What is 2 + 3?", "answer": "5"}\n' * 4)
    os.symlink(tiny_model_dir, home / "tiny")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RLLIGHT_TEST_RUNS", str(runs))
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    cli = build(GRPO, overlay, "--model.path", "~/tiny", "--data.train_files", "[~/data/train.jsonl]",
                "--trainer.default_root_dir", "$RLLIGHT_TEST_RUNS", "--model.export_dir", "${RLLIGHT_TEST_RUNS}/model",
                "--trainer.enable_checkpointing", "true",
                "--trainer.callbacks+", "lightning.pytorch.callbacks.ModelCheckpoint",
                "--trainer.callbacks.dirpath", "$RLLIGHT_TEST_RUNS/ckpt")
    assert cli.model.source.path == str(home / "tiny")
    assert cli.datamodule.train_files == [str(home / "data" / "train.jsonl")]
    assert cli.trainer.default_root_dir == str(runs)
    assert cli.model.export_dir == str(runs / "model")
    assert str(runs / "ckpt") in [cb.dirpath for cb in cli.trainer.checkpoint_callbacks]
    cli.datamodule.setup("fit")  # the verl-style "~/data/..." file is read
    assert [r["answer"] for r in cli.datamodule.train_rows] == ["5"] * 4
    # A variable that is not set is one line naming the key, not a folder named "$RLLIGHT_UNSET".
    monkeypatch.delenv("RLLIGHT_UNSET", raising=False)
    line = _error(capsys, "fit", "--config", GRPO, "--config", overlay, "--model.export_dir", "$RLLIGHT_UNSET/model")
    assert "model.export_dir: '$RLLIGHT_UNSET/model' names the environment variable $RLLIGHT_UNSET" in line


def test_model_path_is_one_flag_for_a_model_folder(tmp_path, tiny_model_dir):
    from rllight.models import HFModel

    # The quickstart names the packaged model; --model.path replaces it with a folder.
    cli = build(os.path.join(RECIPES, "quickstart.yaml"), "--model.path", tiny_model_dir)
    assert type(cli.model.source) is HFModel and cli.model.source.path == tiny_model_dir
    # A recipe's own HFModel settings other than the folder carry over; its GGUF file does not.
    recipe = tmp_path / "bf16.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"model": {"class_path": "rllight.models.HFModel", "init_args": {
        "path": "elsewhere", "dtype": "bfloat16", "gguf_file": "model.gguf"}}}}))
    cli = build(GRPO, str(recipe), f"--model.path={tiny_model_dir}")
    assert (cli.model.source.path, cli.model.source.dtype, cli.model.source.gguf_file) == (
        tiny_model_dir, "bfloat16", None)


@pytest.mark.slow
def test_a_users_module_next_to_the_recipe_or_in_the_working_directory_is_importable(tmp_path):
    """The strategy of docs/extending/strategy.md, with its ``my_lab.py`` next to the recipe and a reward of the
    user's own in the working directory, run as the console script runs (``python -P``: no working directory on
    the path)."""
    lab, work = tmp_path / "lab", tmp_path / "work"
    lab.mkdir()
    work.mkdir()
    (lab / "my_lab.py").write_text(my_lab_code("extending/strategy.md"))
    (work / "my_rewards.py").write_text(
        "from rllight.rewards import Verifier\n\n\n"
        "class Length(Verifier):\n"
        "    def __call__(self, response, answer):\n"
        "        return float(len(response))\n")
    with open(GRPO) as f:
        recipe = yaml.safe_load(f)  # the user's own recipe: grpo.yaml with their advantage and reward
    recipe["model"].update({"advantage": {"class_path": "my_lab.MedianBaseline"},
                            "reward": {"class_path": "my_rewards.Length"}})
    (lab / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = _rllight("fit", "--config", str(lab / "recipe.yaml"), "--print_config", cwd=work, isolated=True)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    printed = yaml.safe_load(run.stdout.decode())
    assert printed["model"]["advantage"]["class_path"] == "my_lab.MedianBaseline"
    assert printed["model"]["reward"]["class_path"] == "my_rewards.Length"


# ----------------------------------------------------------------------------------- generate and chat
def _generated(tmp_path, name: str, *args) -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    main(["generate", *args, "--output", str(out)])
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_generate_uses_the_recipes_sampling_settings_and_its_flags(tmp_path, tiny_model_dir, restore_sys_path):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)  # model.rollout.max_new_tokens 6
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 3?\n\nWhat is 7 + 8?\n")
    recipe = ["--config", GRPO, "--config", overlay]
    rows = _generated(tmp_path, "recipe", *recipe, "--prompts", str(prompts), "--num_samples", "3")
    assert [(r["source"], r["sample"]) for r in rows] == [(f"{prompts} line {n}", k) for n in (1, 3) for k in range(3)]
    assert rows[0]["prompt"] == "What is 2 + 3?" and all(isinstance(r["response"], str) for r in rows)
    # A random tiny model rarely ends within 6 tokens: the recipe's cap binds, and a flag's tighter one replaces it.
    assert max(r["tokens"] for r in rows) == 6 and any(r["truncated"] for r in rows)
    rows = _generated(tmp_path, "flag", *recipe, "--prompts", str(prompts), "--max_new_tokens", "3")
    assert max(r["tokens"] for r in rows) == 3
    # Sampling (the recipe's temperature 1.0) differs between samples; greedy gives one answer per prompt.
    sampled = _generated(tmp_path, "sampled", *recipe, "--prompt", "What is 2 + 3?", "--num_samples", "4")
    assert len({r["response"] for r in sampled}) > 1
    greedy = _generated(tmp_path, "greedy", *recipe, "--prompt", "What is 2 + 3?", "--num_samples", "4",
                        "--temperature", "0")
    assert len({r["response"] for r in greedy}) == 1


def test_generate_reads_an_rllight_export_and_a_jsonl_file(tmp_path, tiny_model_dir, restore_sys_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rllight.export import MARKER, export_policy

    export = tmp_path / "export"
    export_policy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir),
                  str(export))
    assert (export / MARKER).is_file()
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "5"}) + "\n"
                    + json.dumps({"question": [{"role": "user", "content": "What is 7 + 8?"}]}) + "\n")
    args = ["--prompts", str(data), "--data.prompt_key", "question", "--greedy", "--max_new_tokens", "5"]
    from_export = _generated(tmp_path, "export", "--model.path", str(export), *args)
    from_folder = _generated(tmp_path, "folder", "--model.path", tiny_model_dir, *args)
    assert [r["response"] for r in from_export] == [r["response"] for r in from_folder]
    assert [r.get("answer") for r in from_export] == ["5", None]
    assert from_export[1]["prompt"] == [{"role": "user", "content": "What is 7 + 8?"}]
    # Printed instead of written: the response alone for one prompt.
    main(["generate", "--model.path", str(export), "--prompt", "What is 2 + 3?", "--greedy", "--max_new_tokens", "5"])
    assert capsys.readouterr().out == from_export[0]["response"] + "\n"


def test_generate_errors_are_one_line(tmp_path, capsys, restore_sys_path, tiny_model_dir):
    assert "give the model: --model.path DIR" in _error(capsys, "generate", "--prompt", "hi")
    assert "one of the arguments --prompt --prompts is required" in _error(
        capsys, "generate", "--model.path", tiny_model_dir)
    assert "--model.path needs a folder" in _error(capsys, "generate", "--prompt", "hi", "--model.path")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "hi"}) + "\n")
    line = _error(capsys, "generate", "--model.path", tiny_model_dir, "--prompts", str(bad))
    assert f"{bad} row 1: missing field 'prompt'" in line and "this row has: text" in line
    line = _error(capsys, "generate", "--model.path", tiny_model_dir, "--prompt", "hi", "--top_p", "0")
    assert line.endswith("--top_p must be a number in (0, 1], got 0.0")


def test_chat_keeps_the_conversation_until_reset(tiny_model_dir, restore_sys_path, monkeypatch, capsys):
    """Each line read is a user turn, answered with the whole conversation so far as the prompt (the recipe's
    system prompt first); ``/reset`` starts again, ``/exit`` ends (the line after it is never read)."""
    import io

    from transformers import AutoTokenizer

    from rllight.rollout.hf import HFEngine
    from rllight.rollout.producer import encode_chat

    prompts, replies = [], []
    real = HFEngine.generate

    def spy(self, model, tokenizer, ids, sampling):
        gen = real(self, model, tokenizer, ids, sampling)
        prompts.extend(ids)
        replies.extend(tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
                       for r, m in zip(gen.response_ids, gen.response_mask))
        return gen

    monkeypatch.setattr(HFEngine, "generate", spy)
    q1, q2 = "What is 2 + 3?", "And 7 + 8?"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{q1}\n{q2}\n\n/reset\n{q1}\n/exit\nnever read\n"))
    main(["chat", "--model.path", tiny_model_dir, "--max_new_tokens", "5", "--data.system_prompt", "Be brief."])
    assert capsys.readouterr().out == "".join(f"{r}\n" for r in replies)  # the replies alone, no prompt marks
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    system, user1 = {"role": "system", "content": "Be brief."}, {"role": "user", "content": q1}
    assert len(prompts) == 3  # the empty line is skipped, /reset and /exit are commands
    assert prompts[0] == prompts[2] == encode_chat(tok, [system, user1])
    assert prompts[1] == encode_chat(tok, [system, user1, {"role": "assistant", "content": replies[0]},
                                           {"role": "user", "content": q2}])


@pytest.mark.slow
def test_chat_reads_piped_lines_and_prints_the_replies(tmp_path, tiny_model_dir, restore_sys_path):
    """``echo ... | rllight chat``: the replies are those ``generate`` gives to the same conversations."""
    flags = ["--model.path", tiny_model_dir, "--greedy", "--max_new_tokens", "5"]
    q1, q2 = "What is 2 + 3?", "And 7 + 8?"
    (r1,) = [r["response"] for r in _generated(tmp_path, "r1", *flags, "--prompt", q1)]
    conversation = tmp_path / "conversation.jsonl"
    conversation.write_text(json.dumps({"prompt": [{"role": "user", "content": q1},
                                                   {"role": "assistant", "content": r1},
                                                   {"role": "user", "content": q2}]}) + "\n")
    (r2,) = [r["response"] for r in _generated(tmp_path, "r2", *flags, "--prompts", str(conversation))]
    run = _rllight("chat", *flags, cwd=tmp_path, stdin=f"{q1}\n{q2}\n/reset\n{q1}\n/exit\nnever read\n")
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.decode() == f"{r1}\n{r2}\n{r1}\n"


def test_only_the_working_directory_and_the_recipes_folder_join_the_import_path_after_installed_packages(
        tmp_path, restore_sys_path, monkeypatch):
    """A stray module beside a recipe (a ``tensorboard.py``) must not stand in for an installed package, and an
    overlay's folder is not trusted: only the working directory and the first --config file's folder are added,
    at the end of sys.path."""
    from rllight.paths import add_user_import_paths

    recipe_dir, overlay_dir, work = tmp_path / "recipes", tmp_path / "overlays", tmp_path / "work"
    for d in (recipe_dir, overlay_dir, work):
        d.mkdir()
    monkeypatch.chdir(work)
    before = list(sys.path)
    added = add_user_import_paths(["fit", "--config", str(recipe_dir / "r.yaml"), "--config",
                                   str(overlay_dir / "o.yaml")])
    assert added == [str(work), str(recipe_dir)]
    assert sys.path == before + added  # after the standard library and site-packages, never before them
    assert str(overlay_dir) not in sys.path
