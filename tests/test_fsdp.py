"""FSDP (``rllight.fsdp.FSDP``, FSDP2 through Lightning's ``ModelParallelStrategy``) on 2 CPU processes with gloo:
each method trains 2 RL steps sharded, and given the same rollouts (``ScriptedEngine``: responses that depend on
the prompt only) its losses and final weights match one process training on the same global batch."""

import os

import pytest
import torch
import yaml

from conftest import RECIPES
from helpers import build, fit_in_child, tiny_overrides

SCRIPTED = {"class_path": "user_strategies.ScriptedEngine", "init_args": {"max_new_tokens": 6}}
FSDP = ["--trainer.strategy", "{class_path: rllight.fsdp.FSDP}", "--trainer.devices", "2"]
# Summation order differs between one process and two shards (float32); Adam's normalised steps at lr 1e-2 carry
# that rounding into the weights, so the bound is loose in absolute terms yet far below one step (about 1e-2).
TOLERANCE = {"rtol": 1e-4, "atol": 2e-5}


def _run(tmp_path, name, recipe, *args, sharded, **model):
    """Two RL steps of two updates each (epochs over one minibatch: one process shuffles minibatches over all rows,
    two over each half, so only whole-rollout minibatches are the same update on both): FSDP on 2 processes, or
    one process (in this one, to save a start)."""
    folder = tmp_path / f"{name}-{'fsdp' if sharded else 'one'}"
    folder.mkdir()
    overlay = tiny_overrides(folder, _run.model_dir, rollout=SCRIPTED, **model)
    common = ["--trainer.max_steps", "4", "--model.batching.minibatch_size", "null", "--model.batching.ppo_epochs", "2",
              "--data.batch_size", "4", "--trainer.callbacks+", "user_strategies.DumpState", *args]
    dump = str(folder / "rank{rank}.pt")
    if sharded:
        run = fit_in_child(recipe, "--config", overlay, *FSDP, *common, timeout=600, RLLIGHT_TEST_DUMP=dump)
        assert run.returncode == 0, run.stderr[-4000:]
    else:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RLLIGHT_TEST_DUMP", dump)
            cli = build(os.path.join(RECIPES, recipe), overlay, *common)
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    dumps = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2 if sharded else 1)]
    # Each rank logs its share of a loss scaled by the world size: their mean is the loss of the global batch.
    dumps[0]["losses"] = {k: sum(d["losses"][k] for d in dumps) / len(dumps) for k in dumps[0]["losses"]}
    return dumps[0]


# VAPO: value pretraining sets the first rollout aside as its probe and fits the second (the probe scored after the
# fit, on every rank), then RL steps with self-imitation replay after each; the replay batch holds every stored success
# (a smaller one is a random draw from each rank's buffer: the same distribution, not the same rows). The tiny task's
# 16 prompts make a second pass over them: the same responses come back, on the other rank, and the buffers must still
# hold each once over both ranks, as one process does. The ranks' replay batches differ in size (a padding pass on one,
# repeated prompts on the other: both must make as many passes through the sharded decoder, or they hang).
VAPO_CALLBACKS = ("[{class_path: rllight.callbacks.ValuePretraining, init_args: {max_steps: 1, patience: null,"
                  " probe: 1}},"
                  " {class_path: rllight.callbacks.SelfImitation, init_args: {every_n_steps: 1, batch_size: 128,"
                  " min_reward: 0.0}}, {class_path: user_strategies.DumpState}]")
# VAPO's run makes more Adam steps than the others (critic, policy and replay updates, six rollouts), and its rounding
# reaches about 4e-5 in a weight (as much without self-imitation); a response held twice moved weights by 1e-3 to 5e-3.
VAPO_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}

METHODS = {
    "grpo": ("grpo.yaml", [], {}),
    "ppo": ("ppo.yaml", [], {"critic": {"class_path": "rllight.critics.ValueHead"},
                             "advantage": {"class_path": "rllight.strategies.GAE"}}),
    "dapo": ("dapo.yaml", ["--model.sampler.init_args.group_size", "4", "--model.sampler.init_args.max_rounds", "2"],
             {}),
    "vapo": ("vapo.yaml", ["--trainer.max_steps", "6", "--trainer.callbacks", VAPO_CALLBACKS], {}),
    "sppo": ("sppo.yaml", [], {"critic": {"class_path": "rllight.critics.PromptCritic", "init_args": {
        "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": "TINY"}}, "lr": 5.0e-5}}}),
    "vespo": ("vespo.yaml", [], {}),
    "lora": ("grpo.yaml", [], {"lora": {"class_path": "rllight.models.LoRA", "init_args": {"rank": 4, "alpha": 8}}}),
}


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_fsdp_matches_one_process_on_the_same_rollouts(tmp_path, tiny_model_dir, method):
    _run.model_dir = tiny_model_dir
    recipe, args, model = METHODS[method]
    model = yaml.safe_load(yaml.safe_dump(model).replace("TINY", tiny_model_dir))
    one = _run(tmp_path, method, recipe, *args, sharded=False, **model)
    two = _run(tmp_path, method, recipe, *args, sharded=True, **model)
    # The losses that enter the gradient (normalised by global counts); the per-rank diagnostics such as
    # value/loss, a mean over the rank's own tokens, are not comparable and are left out.
    assert "train/policy/loss" in one["losses"] and one["losses"].keys() == two["losses"].keys()
    for key, value in one["losses"].items():
        assert two["losses"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for name, p in one["params"].items():
        torch.testing.assert_close(two["params"][name], p, **(VAPO_TOLERANCE if method == "vapo" else TOLERANCE),
                                   msg=name)


def _fsdp_fit(tmp_path, overlay, name, steps, *extra, keep_all=False):
    return fit_in_child("grpo.yaml", "--config", overlay, *FSDP, "--trainer.max_steps", str(steps),
                        "--model.batching.minibatch_size", "null", "--data.batch_size", "4",
                        "--trainer.enable_checkpointing", "true",
                        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir",
                        str(tmp_path / name), "--trainer.logger.name", "", "--trainer.callbacks+",
                        "lightning.pytorch.callbacks.ModelCheckpoint", "--trainer.callbacks.dirpath",
                        str(tmp_path / f"{name}_ckpt"), "--trainer.callbacks.every_n_train_steps", "1",
                        "--trainer.callbacks.save_last", "true",
                        *(["--trainer.callbacks.save_top_k", "-1"] if keep_all else []),
                        "--trainer.callbacks+", "user_strategies.DumpState",
                        "--trainer.callbacks+", "user_strategies.RankOwnDraws", *extra, timeout=600,
                        RLLIGHT_TEST_DUMP=str(tmp_path / f"{name}{{rank}}.pt"))


@pytest.mark.slow
def test_fsdp_sampling_checkpoint_resume_and_export(tmp_path, tiny_model_dir):
    """With the in-process engine sampling from its full copy: the sharded checkpoint after 2 of 4 steps, resumed,
    gives the metrics and weights of the 4 steps without a stop (each rank's random streams and self-imitation buffer
    are its own); a full checkpoint holds the whole policy; the export is the full policy, written by rank 0."""
    from transformers import AutoModelForCausalLM

    from test_resume import _metrics

    overlay = tiny_overrides(tmp_path, tiny_model_dir, batching={"micro_batch_size": 4})
    # Self-imitation after every step, its replay batch a draw from each rank's own buffer: the resumed ranks must
    # each get their own buffer back (not rank 0's) for the replay updates of steps 3 and 4 to be the same.
    replay = ["--trainer.callbacks+", "rllight.callbacks.SelfImitation", "--trainer.callbacks.every_n_steps", "1",
              "--trainer.callbacks.batch_size", "2", "--trainer.callbacks.min_reward", "0.0"]
    # The uninterrupted run keeps a sharded checkpoint folder per step; the resumed one writes full checkpoints
    # (one file from rank 0).
    full = _fsdp_fit(tmp_path, overlay, "full", 4, "--model.export_dir", str(tmp_path / "export"), *replay,
                     keep_all=True)
    assert full.returncode == 0, full.stderr[-4000:]
    (second,) = (tmp_path / "full_ckpt").glob("*step=2.ckpt")
    assert second.is_dir() and len(list(second.glob("*.distcp"))) == 2  # one shard file per rank
    resumed = _fsdp_fit(tmp_path, overlay, "resumed", 4, "--ckpt_path", str(second),
                        "--trainer.strategy.init_args.save_distributed_checkpoint", "false", *replay)
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    a = _metrics(tmp_path / "full" / "version_0" / "metrics.csv")
    c = _metrics(tmp_path / "resumed" / "version_0" / "metrics.csv")
    assert sorted(c) == [3, 4]  # RL steps 3 and 4: the logger counts them from 1
    assert all(c[step].get("train/sil/nll") for step in c)  # the replay updated in both
    for step in sorted(c):
        assert c[step] == a[step], (step, {k: (a[step].get(k), v) for k, v in c[step].items() if a[step].get(k) != v})
    whole, parted = (torch.load(tmp_path / f"{name}0.pt", weights_only=True)["params"] for name in ("full", "resumed"))
    for name, p in whole.items():
        torch.testing.assert_close(parted[name], p, rtol=0, atol=0, msg=name)
    saved = torch.load(tmp_path / "resumed_ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    for name, p in whole.items():
        torch.testing.assert_close(saved[name], p, rtol=0, atol=0, msg=name)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    for name, p in whole.items():
        torch.testing.assert_close(exported[name.removeprefix("policy.")], p, rtol=0, atol=0, msg=name)
    assert "exported the policy" in full.stderr and full.stderr.count("exported the policy") == 1


def test_a_sharded_lora_policy_with_an_engine_that_needs_merged_weights_is_refused_before_loading():
    from types import SimpleNamespace

    from rllight.errors import RecipeError
    from rllight.fsdp import FSDP
    from rllight.recipe_checks import check_sharding
    from rllight.models import LoRA
    from rllight.rollout import HFEngine
    from rllight.rollout.worker import ProcessEngine

    trainer = SimpleNamespace(strategy=FSDP())
    check_sharding(trainer, LoRA(rank=4), HFEngine())  # the in-process engine copies the adapters: allowed
    check_sharding(SimpleNamespace(strategy=None), LoRA(rank=4), ProcessEngine(HFEngine()))  # not sharded
    with pytest.raises(RecipeError, match=r"model\.lora with trainer\.strategy FSDP: ProcessEngine needs merged"):
        check_sharding(trainer, LoRA(rank=4), ProcessEngine(HFEngine()))


@pytest.mark.slow
def test_fsdp_param_dtype_computes_the_layers_in_bfloat16_over_float32_shards(tmp_path, tiny_model_dir):
    """FSDP's mixed-precision policy (``param_dtype: bfloat16``, float32 reduction): the decoder layers compute in
    bfloat16 while their shards stay float32, and GRPO's updates on the same rollouts are the float32 one-process
    run's up to bfloat16's rounding: the same direction and size."""
    _run.model_dir = tiny_model_dir
    one = _run(tmp_path, "grpo", "grpo.yaml", sharded=False)
    two = _run(tmp_path, "bf16", "grpo.yaml", "--trainer.strategy.init_args.param_dtype", "bfloat16", sharded=True)
    assert (one["compute_dtype"], one["stored_dtype"]) == ("torch.float32", "torch.float32")
    assert (two["compute_dtype"], two["stored_dtype"]) == ("torch.bfloat16", "torch.float32")
    # The updates (weights after 4 of them less the weights before) point the same way and are as large: bfloat16
    # rounds each layer's products (8-bit mantissa), it does not change what is learned. (Not the policy loss: a
    # mean of advantages that nearly cancel, so a few 1e-3 of bfloat16 rounding are all of its value.)
    from transformers import AutoModelForCausalLM

    start = {f"policy.{n}": p.detach() for n, p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()}
    step_one = torch.cat([(one["params"][n] - start[n]).flatten() for n in start])
    step_two = torch.cat([(two["params"][n] - start[n]).flatten() for n in start])
    cosine = float(torch.nn.functional.cosine_similarity(step_one, step_two, dim=0))
    ratio = float(step_two.norm() / step_one.norm())
    assert cosine > 0.95 and 0.9 < ratio < 1.1, (cosine, ratio)
    moved = max(float((two["params"][n] - p).abs().max()) for n, p in one["params"].items())
    assert moved > 0  # the bfloat16 layers changed the updates


def test_fsdp_param_dtype_is_checked_before_the_model_loads():
    from rllight.errors import RecipeError
    from rllight.fsdp import FSDP

    with pytest.raises(RecipeError, match=r"^trainer\.strategy\.init_args\.param_dtype='bf16' is not a dtype FSDP can "
                                          r"compute in; use one of bfloat16, float16, float32$"):
        FSDP(param_dtype="bf16")
