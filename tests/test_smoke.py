"""The smoke test (recipes/overlays/smoke.yaml, docs/smoke-test.md): laid on any recipe it builds the tiny model in
place of every model source (the policy's, a critic's own) and keeps the recipe's strategies, sampler, reward and
callbacks; a few recipes run to the end through the ``rllight`` command and train; the walk-through of
docs/guides/own-data-and-reward.md runs as the page writes it (its files, its smoke command)."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
import yaml

from rllight.models import HFModel
from rllight.testing import TinyModel, smoke_models

from conftest import RECIPES
from helpers import TESTS, build, fit_in_child, recipe_configs

ROOT = os.path.dirname(RECIPES)
SMOKE = os.path.join(RECIPES, "overlays", "smoke.yaml")
LOCAL = sorted(glob.glob(os.path.join(RECIPES, "*.yaml"))) + sorted(glob.glob(os.path.join(RECIPES, "ablations",
                                                                                           "*.yaml")))
PAPER = sorted(glob.glob(os.path.join(RECIPES, "paper", "*.yaml"))) + sorted(glob.glob(os.path.join(RECIPES, "paper",
                                                                                                "overlays", "*.yaml")))
# What docs/smoke-test.md adds for a recipe whose engine is vLLM (the paper recipes): the in-process HF engine.
HF_ENGINE = ["--model.rollout", "rllight.rollout.HFEngine"]
# The components a smoke run must keep as the recipe has them (class names), and its rollout callbacks.
KEPT = ("sampler", "advantage", "policy_loss", "aggregation", "reward", "kl", "critic", "environment", "lora")
FINISHED = re.compile(r"rllight: finished: (\d+) RL steps?, (\d+) optimizer updates")
CHECKPOINT = re.compile(r"^\s+checkpoint: (\S+) \(", re.MULTILINE)


def _merged(configs: list[str]) -> dict:
    """The recipe files' settings merged as the parser does for class_path and lists: a later file's mapping
    merges into an earlier one, a list or a scalar replaces it."""

    def merge(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            out = dict(a)
            for key, value in b.items():
                out[key] = merge(a.get(key), value)
            return out
        return b

    out: dict = {}
    for path in configs:
        with open(path) as f:
            out = merge(out, yaml.safe_load(f) or {})
    return out


def _class_name(spec) -> str | None:
    if isinstance(spec, dict) and isinstance(spec.get("class_path"), str):
        return spec["class_path"].rsplit(".", 1)[-1]
    return None


def _leaves(reward) -> list:
    """A reward and those it combines (``Weighted``'s, ``PerSource``'s), depth first."""
    if reward is None:
        return []
    return [reward, *(leaf for part in reward.parts() for leaf in _leaves(part))]


def _smoke_args(recipe: str) -> list[str]:
    return [*recipe_configs(recipe), SMOKE, *(HF_ENGINE if recipe in PAPER else [])]


@pytest.mark.parametrize("recipe", LOCAL + PAPER, ids=lambda r: os.path.relpath(r, RECIPES))
def test_a_recipe_with_the_smoke_overlay_runs_the_tiny_model_with_the_recipes_strategies(recipe, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cli = build(*_smoke_args(recipe))
    module, trainer, data = cli.model, cli.trainer, cli.datamodule
    # Every model source is the tiny model, and nothing was built or loaded yet (constructors stay cheap).
    assert type(module.source) is TinyModel
    critic_source = getattr(module.critic, "source", None)
    assert critic_source is None or type(critic_source) is TinyModel
    assert smoke_models(cli.config.clone()) == []  # no other HFModel left anywhere in the recipe
    assert module.policy is None
    # A judge or reward model that loads a folder gets one made from the tiny model, built when the recipe is read
    # (rllight.app.smoke_mode); nothing else is built.
    served = [r for r in _leaves(module.reward) if type(r).__name__ in ("LLMJudge", "RewardModel")
              and type(r.placement).__name__ != "Endpoint"]
    for reward in served:
        assert reward.model.startswith(str(tmp_path / "cache")) and os.path.isdir(reward.model)
    assert served or not (tmp_path / "cache").exists()
    # The budget of the overlay.
    assert trainer.max_steps == 8 and trainer.num_devices == 1 and trainer.num_nodes == 1
    assert type(trainer.accelerator).__name__ == "CPUAccelerator"
    assert cli.config.trainer.precision == "32-true"
    assert cli.config.trainer.default_root_dir == "runs/smoke"
    assert module.export_dir is None and module.reward_runner.workers == 0
    assert module.rollout.max_new_tokens == 8
    assert data.val_size == 8
    # What it keeps: the recipe's components, its callbacks, its data files, batch sizes and minibatches.
    recipe_settings = _merged(recipe_configs(recipe))
    model_settings = recipe_settings.get("model", {})
    for key in KEPT:
        if key in model_settings:
            expected = _class_name(model_settings[key])
            assert (type(getattr(module, key)).__name__ if getattr(module, key) is not None else None) == expected, key
    callbacks = [_class_name(c) for c in recipe_settings.get("trainer", {}).get("callbacks") or []]
    built = [type(c).__name__ for c in trainer.callbacks]
    assert all(name in built for name in callbacks), (callbacks, built)
    data_settings = recipe_settings.get("data", {})
    assert data.train_files == data_settings.get("train_files")
    assert data.batch_size == data_settings.get("batch_size", data.batch_size)
    minibatch = module.batching.minibatch_size
    assert minibatch == model_settings.get("batching", {}).get("minibatch_size", minibatch)


def test_smoke_true_gives_every_model_source_the_policys_tiny_model():
    # recipes/sppo.yaml's PromptCritic has a model of its own (SmolLM2Package); it becomes the policy's tiny model,
    # with the policy's settings (one tokenizer for both).
    cli = build(os.path.join(RECIPES, "sppo.yaml"), SMOKE, "--model.model.init_args.hidden_size=32")
    policy, critic = cli.model.source, cli.model.critic.source
    assert type(policy) is TinyModel and type(critic) is TinyModel and critic is not policy
    assert (policy.hidden_size, critic.hidden_size) == (32, 32)
    # A recipe without the switch keeps its sources.
    assert type(build(os.path.join(RECIPES, "sppo.yaml")).model.critic.source).__name__ == "SmolLM2Package"


def test_smoke_models_replaces_model_sources_anywhere_in_a_recipe():
    from jsonargparse import Namespace

    config = Namespace(model=Namespace(
        model=Namespace(class_path="rllight.models.SmolLM2Package", init_args=Namespace()),
        critic=Namespace(class_path="rllight.critics.PromptCritic", init_args=Namespace(
            model=Namespace(class_path="rllight.models.HFModel", init_args=Namespace(path="org/big"))))),
        trainer=Namespace(callbacks=[Namespace(class_path="x.Y", init_args=Namespace(
            judge=Namespace(class_path="rllight.models.HFModel", init_args=Namespace(path="org/judge"))))]))
    replaced = smoke_models(config)
    assert replaced == [("model.model", "rllight.models.SmolLM2Package"),
                        ("model.critic.init_args.model", "rllight.models.HFModel"),
                        ("trainer.callbacks.0.init_args.judge", "rllight.models.HFModel")]
    for key in ("model.model", "model.critic.init_args.model"):
        assert config.get(key).class_path == "rllight.testing.TinyModel"
    assert config.trainer.callbacks[0].init_args.judge.class_path == "rllight.testing.TinyModel"
    assert smoke_models(config) == []  # the tiny model stays


def test_the_tiny_model_is_built_on_first_use_answers_briefly_and_is_reused(tmp_path):
    from rllight.data import ArithmeticTask
    from rllight.rollout.producer import encode_chat

    folder = tmp_path / "tiny"
    source = TinyModel(cache_dir=str(folder))
    assert isinstance(source, HFModel) and not folder.exists()  # the constructor builds nothing
    model, tokenizer = source.load()
    assert (folder / "config.json").is_file() and model.config.hidden_size == 64
    written = os.path.getmtime(folder / "config.json")
    _, val = ArithmeticTask(num_train=1, num_val=16).splits()
    ended = 0
    for row in val:
        prompt = torch.tensor([encode_chat(tokenizer, [{"role": "user", "content": row["prompt"]}])])
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        ended += int(tokenizer.eos_token_id in out[0, prompt.shape[1]:].tolist())
    assert ended == len(val)  # the warm-up taught it to answer in a few tokens and stop
    TinyModel(cache_dir=str(folder)).load()
    assert os.path.getmtime(folder / "config.json") == written  # reused, not rebuilt
    with pytest.raises(Exception, match="hidden_size must be even"):
        TinyModel(hidden_size=33)


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def smoke_cache(tmp_path_factory) -> str:
    """One tiny-model cache for this module's runs (the first run builds it)."""
    return str(tmp_path_factory.mktemp("smoke-cache"))


def _finished(run: subprocess.CompletedProcess) -> tuple[int, int, str]:
    """``(RL steps, optimizer updates, checkpoint)`` a finished ``rllight fit`` printed."""
    out = run.stdout + run.stderr
    done = FINISHED.search(out)
    saved = CHECKPOINT.search(out)
    assert done and saved, out[-3000:]
    return int(done.group(1)), int(done.group(2)), saved.group(1)


def _policy_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}



@pytest.mark.slow
@pytest.mark.parametrize("recipe,extra", [("quickstart.yaml", []), ("dapo.yaml", [])], ids=["quickstart", "dapo"])
def test_a_smoke_run_trains_to_the_end_through_the_command(recipe, extra, tmp_path, smoke_cache):
    run = fit_in_child(recipe, "--config", SMOKE, *extra, "--trainer.default_root_dir", str(tmp_path / "run"),
                       timeout=600, XDG_CACHE_HOME=smoke_cache, OMP_NUM_THREADS="1")
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    steps, updates, checkpoint = _finished(run)
    assert updates == 8 and steps >= 1  # trainer.max_steps: 8 optimizer updates
    assert re.search(r"^rllight: step 1[/ ]", run.stdout + run.stderr, re.MULTILINE)  # a line per RL step
    if os.path.isdir(checkpoint):  # FSDP's (the paper recipes): a folder of shards
        assert os.listdir(checkpoint)
        return
    assert torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"] == 8
    if recipe == "dapo.yaml":  # dynamic sampling trains on groups with mixed rewards only: the policy moved
        tiny = glob.glob(os.path.join(smoke_cache, "rllight", "tiny-*", "model.safetensors"))
        from safetensors.torch import load_file

        start, trained = load_file(tiny[0]), _policy_weights(checkpoint)
        assert any(not torch.equal(start[k], trained[k]) for k in start if k in trained)


# What docs/smoke-test.md adds for a paper recipe on a CPU: the HF engine, the arithmetic task in place of the
# paper's data files (not in the repository), and a small batch (tests/app/test_hardware.py checks the hint).
PAPER_ON_CPU = [*HF_ENGINE, "--data.train_files", "null", "--data.val_files", "null", "--data.batch_size", "8"]


# ------------------------------------------------------------------ docs/guides/own-data-and-reward.md
GUIDE = os.path.join(ROOT, "docs", "guides", "own-data-and-reward.md")
TITLED = re.compile(r'^```(\w+)[ \t]+title="([^"]+)"[ \t]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)
FENCED = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def guide_files() -> dict[str, str]:
    """The files the guide asks the reader to write: each fenced block with a ``title="<file>"``, by file name
    (``my_lab.py`` is its ``# my_lab.py`` blocks, in order)."""
    with open(GUIDE) as f:
        text = f.read()
    files = {name: body for _, name, body in TITLED.findall(text)}
    lab = [body for lang, body in FENCED.findall(text) if lang == "python" and body.startswith("# my_lab.py")]
    assert lab, "the guide has no # my_lab.py block"
    files["my_lab.py"] = "\n\n".join(lab)
    return files


def guide_commands(*words: str) -> list[list[str]]:
    """The guide's ``rllight`` command lines (in its bash and text blocks) that name every one of ``words``."""
    with open(GUIDE) as f:
        text = f.read()
    commands = []
    for lang, body in FENCED.findall(text):
        if lang not in ("bash", "text"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True) if line.strip() else []
            if tokens[:2] == [".venv/bin/rllight", "fit"] and all(w in tokens for w in words):
                commands.append(tokens)
    return commands


@pytest.mark.slow
def test_the_guides_data_and_reward_pass_the_preflight_and_train_in_smoke_mode(tmp_path, smoke_cache):
    files = guide_files()
    assert {"my_lab.py", "data/train.jsonl", "data/val.jsonl"} <= set(files), sorted(files)
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    # The page's smoke runs as it writes them: the built-in reward on its data, then its own overlays and reward.
    commands = guide_commands("recipes/overlays/smoke.yaml")
    assert len(commands) == 2 and any("my_reward.yaml" in c for c in commands), commands
    with open(tmp_path / "data" / "val.jsonl") as f:
        n_val = sum(1 for line in f if line.strip())
    env = dict(os.environ, XDG_CACHE_HOME=smoke_cache, OMP_NUM_THREADS="1", PYTHONPATH=TESTS)
    for command in commands:
        configs = [b for a, b in zip(command, command[1:]) if a == "--config"]
        assert configs[-1] == "recipes/overlays/smoke.yaml"  # the overlay comes last: it must win
        args = [os.path.join(ROOT, a) if a.startswith("recipes/") else a for a in command[1:]]
        run = subprocess.run([sys.executable, "-m", "rllight", *args], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
        out = run.stdout + run.stderr
        assert run.returncode == 0 and "Traceback" not in out, out[-3000:]
        _, updates, checkpoint = _finished(run)
        assert updates == 8 and os.path.isfile(os.path.join(tmp_path, checkpoint))
        # It read the page's files: the reference-answer check and the pre-flight passed on its rows, and the
        # evaluations asked its held-out questions.
        assert f"{n_val} held-out prompts" in out, out[-3000:]
    sys.path.insert(0, str(tmp_path))
    sys.modules.pop("my_lab", None)  # another page's, imported by an earlier test
    try:
        import my_lab

        reward = next(getattr(my_lab, n) for n in dir(my_lab) if isinstance(getattr(my_lab, n), type)
                      and getattr(my_lab, n).__module__ == "my_lab")()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_lab", None)
    assert reward("... so she has 12 left.\n#### 12", "12") == reward.correct  # verl's GSM8K format
    assert reward("The answer is \\boxed{12}.", "12") == reward.correct  # the pre-flight's
    assert reward("#### 13", "12") == reward.wrong


def test_building_the_tiny_model_prints_nothing_into_a_log_file(tmp_path):
    # The tokenizer trainer's progress bar, written to a file, was a run of blank lines at the top of a smoke log.
    code = f"from rllight.testing import build_tiny_model; build_tiny_model({str(tmp_path / 'model')!r})"
    with open(tmp_path / "log", "w") as log:
        run = subprocess.run([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, timeout=300,
                             env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)
    assert run.returncode == 0 and (tmp_path / "log").read_text() == ""
