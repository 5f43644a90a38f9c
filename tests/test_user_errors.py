"""Every mistake a user can make in a recipe, a path or a checkpoint is one line on stderr and exit code 2,
naming the key or file, before any model loads."""

import os

import pytest
import torch

from conftest import RECIPES
from helpers import build, tiny_overrides
from rllight.app.cli import main
from rllight.errors import RecipeError
from rllight.models import HFModel
from rllight.safety import check_resume, check_writable


def _error(capsys, *args) -> str:
    """The one error line of ``rllight <args>``, which must exit with code 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("rllight: error: "), err
    assert "Traceback" not in "\n".join(err)
    return err[-1]


GRPO = os.path.join(RECIPES, "grpo.yaml")


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("model.rollout.init_args.temperature", "0", "model.rollout.init_args.temperature must be a number > 0, got 0"),
        ("model.rollout.init_args.max_new_tokens", "0",
         "model.rollout.init_args.max_new_tokens must be an integer >= 1, got 0 (see: rllight fit --help)"),
        ("model.sampler.init_args.group_size", "0",
         "model.sampler.init_args.group_size must be an integer >= 1, got 0 (see: rllight fit --help)"),
        ("model.optimizer.init_args.lr", "fast", "model.optimizer.init_args.lr expects a float, got 'fast'"),
        ("data.decode_errors", "ignore", "data.decode_errors is 'ignore'; use replace (bad characters become U+FFFD)"),
        ("data.max_row_bytes", "0", "data.max_row_bytes must be an integer >= 1, got 0 (see: rllight fit --help)"),
        ("data.long_prompts", "cut", "data.long_prompts is 'cut'; use refuse (stop with one line), truncate"),
        ("model.prompt_truncation", "truncate", "model.prompt_truncation must be one of drop, left, got 'truncate'"),
        # an inverted clip range: [1.5, 1.2]
        ("model.policy_loss.init_args.clip_low", "-0.5",
         "model.policy_loss.init_args.clip_low must be a number in (0, 1), got -0.5 (see: rllight fit --help)"),
        ("model.policy_loss.init_args.dual_clip", "0.5",
         "model.policy_loss.init_args.dual_clip must be a number > 1, got 0.5 (see: rllight fit --help)"),
    ],
)
def test_bad_values_name_their_key(capsys, key, value, expected):
    line = _error(capsys, "fit", "--config", GRPO, f"--{key}", value)
    assert expected in line
    assert "greedy=True" not in line  # recipes have no such option


@pytest.mark.parametrize("recipe, args, expected", [
    ("dapo.yaml", ("--model.sampler.init_args.group_size", "1"),
     "model.sampler.init_args.group_size must be an integer >= 2, got 1"),
    ("vapo.yaml", ("--model.advantage.init_args.policy_lambda.init_args.lam_min", "2"),  # a class inside a class
     "model.advantage.init_args.policy_lambda.init_args.lam_min must be a number in [0, 1], got 2"),
    ("vapo.yaml", ("--trainer.callbacks+", "rllight.callbacks.SelfImitation", "--trainer.callbacks.coef", "-1"),
     "trainer.callbacks: SelfImitation.coef must be a number >= 0, got -1"),  # an item of a list: its class
    ("grpo.yaml", ("--model.sampler.init_args.group_size", "x"),
     "model.sampler.init_args.group_size must be an integer >= 1, got x"),
    ("grpo.yaml", ("--distributed_timeout_minutes", "0"), "distributed_timeout_minutes must be a number > 0, got 0"),
])
def test_a_value_out_of_its_declared_bound_is_one_line_naming_the_key(capsys, recipe, args, expected):
    """Bounds declared by type (``rllight.bounds``) are refused by the parser, wherever the class sits."""
    line = _error(capsys, "fit", "--config", os.path.join(RECIPES, recipe), *args)
    assert line == f"rllight: error: {expected} (see: rllight fit --help)"


def test_help_shows_the_declared_bounds(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", GRPO, "--model.sampler.help", "GroupSampler"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model.sampler.group_size GROUP_SIZE Responses per prompt" in text
    assert "(type: PositiveInt, default: 4)" in text


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_half_precision_weights_are_refused_with_what_to_use(capsys, precision):
    """bf16-true used to crash in the HF engine with a dtype traceback; it is one line before the model loads."""
    line = _error(capsys, "fit", "--config", GRPO, "--trainer.precision", precision)
    assert line.startswith(f"rllight: error: trainer.precision {precision}: ") and "bf16-mixed" in line


def test_broken_yaml_names_its_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  ppo_epochs: [1\n  x: : y\n")
    line = _error(capsys, "fit", "--config", GRPO, "--config", str(bad))
    # The flow sequence opened on line 2 meets "x: : y" on line 3, column 4 ("  x" then ":").
    assert f"--config '{bad}': not valid YAML at line 3, column 4" in line
    assert "no such file" in _error(capsys, "fit", "--config", str(tmp_path / "missing.yaml"))


def test_missing_vllm_is_reported_before_the_model_loads(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    line = _error(capsys, "fit", "--config", GRPO, "--config", os.path.join(RECIPES, "overlays", "vllm.yaml"))
    assert "model.rollout: vLLM is not installed" in line and "bash tools/install.sh vllm " in line


def test_unwritable_outputs_are_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    # Tests run as root, which chmod does not stop: a path under a regular file cannot be created by anyone.
    args = ["fit", "--config", GRPO, "--config", overlay]
    line = _error(capsys, *args, "--trainer.default_root_dir", str(blocker / "run"))
    assert line.startswith("rllight: error: trainer.default_root_dir:") and "is a file" in line
    line = _error(capsys, *args, "--model.export_dir", str(blocker / "model"))
    assert line.startswith("rllight: error: model.export_dir:")
    line = _error(capsys, *args, "--trainer.enable_checkpointing", "true",
                  "--trainer.callbacks+", "lightning.pytorch.callbacks.ModelCheckpoint",
                  "--trainer.callbacks.dirpath", str(blocker / "ckpt"))
    assert line.startswith("rllight: error: trainer.callbacks (ModelCheckpoint dirpath):")
    # A folder without write permission (as os.access reports it for a non-root user).
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(readonly) else real_access(p, mode))
    line = _error(capsys, *args, "--trainer.default_root_dir", str(readonly / "run"))
    assert line == f"rllight: error: trainer.default_root_dir: '{readonly}' is not writable; give a folder this " \
                   "user can write to"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_export_dir_no_one_can_create_is_refused_even_for_root(tmp_path, capsys, tiny_model_dir):
    """/proc passes os.access for root, but no file can be created there: the check tries one."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    line = _error(capsys, "fit", "--config", GRPO, "--config", overlay, "--model.export_dir", "/proc/x")
    assert line.startswith("rllight: error: model.export_dir: '/proc' is not writable (") and \
        line.endswith("); give a folder this user can write to"), line
    before = set(os.listdir(tmp_path))
    check_writable(str(tmp_path / "new" / "run"), "trainer.default_root_dir")  # a writable place passes
    assert set(os.listdir(tmp_path)) == before  # and the check leaves nothing behind


def test_help_lists_the_rollout_callbacks_and_the_recipes(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("OverlongFilter", "SoftOverlongPunishment", "SelfImitation", "ValuePretraining"):
        assert f"rllight.callbacks.{name}" in text
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "recipes/" in text and "rllight fit --config recipes/quickstart.yaml" in text


# ------------------------------------------------------------------------------------------------ hub ids
def _fake_cache(root, model_dir, repo="tinyorg/tiny-llama", commit="0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<hash>/...}."""
    import shutil

    repo_dir = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model_dir, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return repo_dir / "snapshots" / commit


def test_a_hub_id_loads_from_the_local_cache_offline(tmp_path, monkeypatch, tiny_model_dir):
    snapshot = _fake_cache(tmp_path, tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = HFModel("tinyorg/tiny-llama")
    assert source.resolve() == str(snapshot)
    model, tokenizer = source.load()
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_a_missing_hub_id_says_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeError) as info:
        HFModel("tinyorg/not-there").load()
    message = str(info.value)
    assert "\n" not in message
    assert f"not a folder and not in the Hugging Face cache ({tmp_path})" in message
    assert "the hub was not tried (HF_HUB_OFFLINE is set)" in message
    with pytest.raises(RecipeError, match="folder './no/such/model' does not exist"):
        HFModel("./no/such/model").load()


# ------------------------------------------------------------------------------------------- checkpoints
def test_a_bad_checkpoint_is_one_line_naming_the_file(tmp_path, capsys, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all" * 10)
    line = _error(capsys, "fit", "--config", GRPO, "--config", overlay, "--ckpt_path", str(garbage))
    assert f"--ckpt_path '{garbage}' is not a readable checkpoint" in line and "weights_only" not in line
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1000)}, "global_step": 3}, whole)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(whole.read_bytes()[: os.path.getsize(whole) // 2])
    line = _error(capsys, "fit", "--config", GRPO, "--config", overlay, "--ckpt_path", str(truncated))
    assert f"--ckpt_path '{truncated}' is not a readable checkpoint" in line
    line = _error(capsys, "fit", "--config", GRPO, "--config", overlay, "--ckpt_path", str(tmp_path / "nope.ckpt"))
    assert "does not exist" in line


def test_resume_refuses_a_changed_model_critic_or_group_size(tmp_path, capsys, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    recipe = build(GRPO, overlay)._recipe()
    ckpt = tmp_path / "grpo.ckpt"
    torch.save({"global_step": 1, "rllight_recipe": recipe}, ckpt)
    args = ["fit", "--config", GRPO, "--config", overlay, "--ckpt_path", str(ckpt)]
    line = _error(capsys, *args, "--model.sampler.init_args.group_size", "4")
    assert "model.sampler.init_args.group_size (8 -> 4)" in line and "--resume_allow_changes true" in line
    line = _error(capsys, "fit", "--config", os.path.join(RECIPES, "ppo.yaml"), "--config", overlay,
                  "--ckpt_path", str(ckpt))
    assert "different model, LoRA, critic or optimizer" in line and "model.critic" in line


def test_check_resume_sorts_differences():
    saved = {"model": {"critic": None, "sampler": {"init_args": {"group_size": 8}}, "entropy_coef": 0.0},
             "data": {"batch_size": 4}, "trainer": {"max_steps": 10}}
    same_but_longer = {**saved, "trainer": {"max_steps": 50}}
    assert check_resume(saved, same_but_longer, "x.ckpt") == []  # a longer run is a continuation
    tweak = {**saved, "model": {**saved["model"], "entropy_coef": 0.01}}
    assert check_resume(saved, tweak, "x.ckpt") == ["resuming with recipe changes: model.entropy_coef (0.0 -> 0.01)"]
    batch = {**saved, "data": {"batch_size": 8}}
    with pytest.raises(RecipeError, match=r"data.batch_size \(4 -> 8\)"):
        check_resume(saved, batch, "x.ckpt")
    assert len(check_resume(saved, batch, "x.ckpt", allow_changes=True)) == 1
    critic = {**saved, "model": {**saved["model"], "critic": {"class_path": "rllight.critics.ValueHead"}}}
    with pytest.raises(RecipeError, match="model.critic"):
        check_resume(saved, critic, "x.ckpt", allow_changes=True)


def test_resuming_from_last_with_no_checkpoint_is_one_line_not_a_fresh_run(capsys, tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    line = _error(capsys, "fit", "--config", GRPO, "--config", overlay, "--trainer.enable_checkpointing", "true",
                  "--ckpt_path", "last")
    assert "--ckpt_path last: no last.ckpt" in line and str(tmp_path) in line


PPO = os.path.join(RECIPES, "ppo.yaml")


@pytest.mark.parametrize("key, value", [("gamma", "1.5"), ("lam", "-0.1")])
def test_gae_settings_out_of_range_name_their_key(capsys, key, value):
    line = _error(capsys, "fit", "--config", PPO, f"--model.advantage.init_args.{key}", value)
    assert line == f"rllight: error: model.advantage.init_args.{key} must be a number in [0, 1], got {value} (see: " \
                   "rllight fit --help)"


def test_an_estimator_that_needs_values_and_gets_none_names_the_key():
    from test_dapo import make_rollout

    from rllight.strategies import GAE, DecoupledGAE

    for estimator in (GAE(), DecoupledGAE()):
        with pytest.raises(RecipeError, match=r"^model\.advantage: \w+ needs .*set model\.critic"):
            estimator(make_rollout([1.0], lengths=[2]))


@pytest.mark.parametrize(("module", "environment", "extra"), [
    ("textarena", None, "textarena"),  # the recipe as shipped
    ("openenv", '{class_path: rllight.envs.OpenEnv, init_args: {url: "http://127.0.0.1:9"}}', "openenv"),
    ("verifiers", "{class_path: rllight.envs.Verifiers, init_args: {env_id: textarena}}", "verifiers"),
])
def test_an_adapter_without_its_extra_is_one_line_before_the_model_loads(module, environment, extra, capsys,
                                                                         monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed

    def no_load(self):
        raise AssertionError("the model loaded before the recipe's environment was checked")

    monkeypatch.setattr(HFModel, "load", no_load)
    recipe = os.path.join(RECIPES, "env-textarena-guess.yaml")
    args = ["fit", "--config", recipe] + ([] if environment is None else ["--model.environment", environment])
    line = _error(capsys, *args)
    assert f"bash tools/install.sh {extra} (in the rllight clone" in line and "model.environment" in line


def test_left_truncation_with_an_environment_is_one_line_before_the_model_loads(capsys, monkeypatch):
    """A cut conversation would break the environment's turns: ``model.prompt_truncation: left`` with an
    environment is refused in one line when the module is built."""

    def no_load(self):
        raise AssertionError("the model loaded before model.prompt_truncation was checked")

    monkeypatch.setattr(HFModel, "load", no_load)
    line = _error(capsys, "fit", "--config", os.path.join(RECIPES, "env-calculator.yaml"), "--model.prompt_truncation",
                  "left")
    assert line == ("rllight: error: model.prompt_truncation left cannot be used with model.environment (a cut "
                    "conversation breaks the environment's turns); set model.prompt_truncation: drop")


def test_a_refused_setting_of_an_optional_component_is_one_line(capsys):
    """jsonargparse refuses a bound of a ``X | None`` component (here model.environment) in a multi-line error
    listing every alternative of the union; the CLI prints one line naming the key."""
    line = _error(capsys, "fit", "--config", os.path.join(RECIPES, "env-calculator.yaml"), "--model.environment",
                  "{class_path: rllight.envs.Calculator, init_args: {max_depth: 0}}")
    assert line == "rllight: error: model.environment.init_args.max_depth must be an integer >= 1, got 0 (see: " \
                   "rllight fit --help)"


def test_a_mix_naming_a_source_no_row_has_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def no_load(self):
        raise AssertionError("the model loaded before the data mix was checked")

    monkeypatch.setattr(HFModel, "load", no_load)
    line = _error(capsys, "fit", "--config", GRPO, "--data.mix",
                  "{class_path: rllight.data.SourceMix, init_args: {weights: {arithmetic: 1, gsm8k: 1}}}")
    assert "data.mix.weights names ['gsm8k'], which no training row has; the sources are ['arithmetic']" in line
