"""ProcessEngine: the rollout engine in a worker process, with versioned weight syncs, the trainer's RNG, and
faults (a killed, stale or hanging worker) that never hang or silently corrupt training."""

import copy
import math
import os
import signal
import time

import pytest
import torch
from conftest import RECIPES
from helpers import build, tiny_overrides, unchanged_parameters
from lightning.pytorch import Callback

from rllight.errors import ComponentError, RecipeError
from rllight.evaluation import EvalSettings
from rllight.models import HFModel
from rllight.module import RLModule
from rllight.rollout import HFEngine, ProcessEngine, Sampling
from rllight.rollout.worker_process import RolloutWorker
from rllight.rollout.metrics import rollout_metrics
from rllight.rollout.producer import SAMPLE_STALENESS

ROWS = [{"messages": [{"role": "user", "content": "What is 1 + 2?" + " 3" * k}], "answer": "3"} for k in range(3)]


class HangingEngine(HFEngine):
    """Generates once, then hangs (a stuck engine)."""

    calls = 0

    def generate(self, model, tokenizer, prompts, sampling):
        self.calls += 1
        if self.calls > 1:
            time.sleep(3600)
        return super().generate(model, tokenizer, prompts, sampling)


class DyingEngine(HFEngine):
    """Takes its process down on every request (a crash the worker cannot report)."""

    def generate(self, model, tokenizer, prompts, sampling):
        os._exit(3)


def _module(model_dir, engine) -> RLModule:
    module = RLModule(HFModel(model_dir), rollout=engine)
    module.configure_model()
    return module


def _optimizer_step(policy: torch.nn.Module) -> None:
    """One AdamW step (lr 1e-2: every weight moves by about 1e-2) on the log-likelihood of a few tokens."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.0)
    ids = torch.arange(3, 19)[None]
    loss = -policy(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _assert_sampled_under(module: RLModule, rollout, policy=None) -> None:
    """The rollout's sampling log-probs equal the log-probs ``policy`` (default: the trainer's) gives its tokens.
    Tolerance as in test_rollout.py: the engine decodes token by token with a KV cache, the trainer runs one
    forward over the whole sequence, so float32 sums are ordered differently."""
    with torch.no_grad():
        logprobs, _, _ = module.scoring.forward(rollout, policy=policy)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(logprobs[mask], rollout.sample_logprobs[mask], atol=1e-4, rtol=1e-4)


def test_settings_are_the_inner_engines_and_bad_values_are_one_line_errors():
    inner = HFEngine(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=4)
    engine = ProcessEngine(inner)
    assert (engine.max_new_tokens, engine.temperature, engine.top_p, engine.top_k) == (5, 0.7, 0.9, 4)
    assert EvalSettings(temperature=0.3, max_new_tokens=2).sampling(engine.sampling) == Sampling(2, 0.3, 1.0, 0)
    assert (inner.max_new_tokens, inner.temperature) == (5, 0.7)  # evaluation passes its own; nothing changes
    for kwargs, message in [({"sync_every": 0}, "ProcessEngine.sync_every must be an integer >= 1, got 0"),
                            ({"timeout_seconds": 0}, "ProcessEngine.timeout_seconds must be a finite number > 0, got 0"),
                            ({"timeout_seconds": math.inf},
                             "ProcessEngine.timeout_seconds must be a finite number > 0, got inf")]:
        with pytest.raises(RecipeError) as err:
            ProcessEngine(HFEngine(), **kwargs)
        assert str(err.value) == message


def test_after_an_update_and_a_sync_the_worker_samples_from_the_trainers_policy(tiny_model_dir):
    engine = ProcessEngine(HFEngine(max_new_tokens=8, temperature=0.7))
    module = _module(tiny_model_dir, engine)
    try:
        torch.manual_seed(0)
        _assert_sampled_under(module, module.producer.sample(ROWS, n=2))
        assert engine.last_metrics["rollout/policy_version"] == 0
        before = copy.deepcopy(module.policy)
        _optimizer_step(module.policy)
        assert set(engine.update_weights(module.policy)) == {"rollout/sync_time"}
        rollout = module.producer.sample(ROWS, n=2)
        assert engine.last_metrics["rollout/policy_version"] == 1
        assert engine.last_metrics["rollout/staleness"] == 0
        assert engine.last_metrics["rollout/sync_time"] > 0
        assert engine.last_metrics["rollout/tokens_per_s"] > 0  # the inner engine's own metric
        _assert_sampled_under(module, rollout)
        with pytest.raises(AssertionError):  # the update moved the log-probs by more than the tolerance
            _assert_sampled_under(module, rollout, policy=before)
        # Settings changed on the trainer's side (as evaluation does) reach the worker with the request.
        engine.temperature, engine.max_new_tokens = 1.3, 3
        rollout = module.producer.sample(ROWS, n=2)
        assert rollout.response_ids.shape[1] <= 3
        _assert_sampled_under(module, rollout)  # forward_batch divides by the engine's (new) temperature
    finally:
        engine.close()


def test_with_sync_every_2_the_worker_is_one_update_behind_and_says_so(tiny_model_dir):
    engine = ProcessEngine(HFEngine(max_new_tokens=4), sync_every=2)
    module = _module(tiny_model_dir, engine)
    try:
        module.producer.sample(ROWS, n=1)
        before = copy.deepcopy(module.policy)
        _optimizer_step(module.policy)
        assert engine.update_weights(module.policy) == {}  # update 1: not sent
        rollout = module.producer.sample(ROWS, n=1)
        assert (engine.last_metrics["rollout/policy_version"], engine.last_metrics["rollout/staleness"]) == (0, 1)
        _assert_sampled_under(module, rollout, policy=before)
        _optimizer_step(module.policy)
        assert "rollout/sync_time" in engine.update_weights(module.policy)  # update 2: sent
        rollout = module.producer.sample(ROWS, n=1)
        assert (engine.last_metrics["rollout/policy_version"], engine.last_metrics["rollout/staleness"]) == (2, 0)
        _assert_sampled_under(module, rollout)
    finally:
        engine.close()


def test_a_killed_worker_is_restarted_with_the_synced_weights(tiny_model_dir, caplog):
    engine = ProcessEngine(HFEngine(max_new_tokens=8))
    module = _module(tiny_model_dir, engine)
    try:
        module.producer.sample(ROWS, n=1)
        before = copy.deepcopy(module.policy)
        _optimizer_step(module.policy)
        engine.update_weights(module.policy)
        module.producer.sample(ROWS, n=1)
        killed = engine._worker.process
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(timeout=10)
        rollout = module.producer.sample(ROWS, n=2)
        assert engine._worker.process.pid != killed.pid
        assert "restarting it with policy version 1" in caplog.text
        assert engine.last_metrics["rollout/policy_version"] == 1
        _assert_sampled_under(module, rollout)
        with pytest.raises(AssertionError):  # not the weights it first started with
            _assert_sampled_under(module, rollout, policy=before)
    finally:
        engine.close()
    assert not killed.is_alive()


def test_a_worker_that_dies_again_is_a_one_line_error(tiny_model_dir):
    engine = ProcessEngine(DyingEngine(max_new_tokens=4))
    module = _module(tiny_model_dir, engine)
    with pytest.raises(RuntimeError, match=r"^model\.rollout: the rollout worker died twice in a row \(exit code 3\)")\
            as err:
        module.producer.sample(ROWS, n=1)
    assert "\n" not in str(err.value)
    assert engine._worker is None  # nothing left running


def test_a_worker_that_does_not_start_in_time_is_one_line_saying_what_to_do(tiny_model_dir):
    engine = ProcessEngine(HFEngine(max_new_tokens=4), timeout_seconds=0.5)  # a fresh interpreter takes longer
    module = _module(tiny_model_dir, engine)
    with pytest.raises(ComponentError) as err:
        module.producer.sample(ROWS, n=1)
    assert str(err.value) == ("model.rollout: the rollout worker did not start within timeout_seconds=0.5 and was "
                              "stopped; raise model.rollout.init_args.timeout_seconds if it is only slow, or check "
                              "the inner engine (model.rollout.init_args.engine)")
    assert engine._worker is None  # nothing left running


def test_a_worker_that_dies_twice_ends_the_cli_with_one_line_and_exit_2(tmp_path, capsys, tiny_model_dir):
    from helpers import one_line_error

    rollout = {"class_path": "rllight.rollout.ProcessEngine",
               "init_args": {"engine": {"class_path": "test_worker.DyingEngine"}, "max_new_tokens": 4}}
    err = [one_line_error(tmp_path, tiny_model_dir, capsys, rollout=rollout)]
    assert err[-1].startswith("rllight: error: model.rollout: the rollout worker died twice in a row (exit code 3) "
                              "trying to generate; look for an out-of-memory kill"), err[-1]


def test_a_stale_worker_is_detected_never_trusted(tiny_model_dir, monkeypatch):
    engine = ProcessEngine(HFEngine(max_new_tokens=4))
    module = _module(tiny_model_dir, engine)
    try:
        module.producer.sample(ROWS, n=1)
        # The worker refuses a request for a version it does not hold (as if a sync had been lost).
        engine._version += 1
        with pytest.raises(RuntimeError, match=r"^model\.rollout: .*policy version 0 where 1 was sent") as err:
            module.producer.sample(ROWS, n=1)
        assert "\n" not in str(err.value)
        engine._version -= 1
        module.producer.sample(ROWS, n=1)
        # The trainer checks the version the reply names, too.
        receive = RolloutWorker.receive

        def tampered(self, timeout, what):
            reply = receive(self, timeout, what)
            return (reply[0], reply[1] + 5, *reply[2:]) if reply[0] == "generated" else reply

        monkeypatch.setattr(RolloutWorker, "receive", tampered)
        with pytest.raises(RuntimeError, match="policy version 5 where 0 was sent"):
            module.producer.sample(ROWS, n=1)
    finally:
        engine.close()


def test_a_hanging_worker_times_out_with_one_line(tiny_model_dir):
    engine = ProcessEngine(HangingEngine(max_new_tokens=4))
    module = _module(tiny_model_dir, engine)
    try:
        module.producer.sample(ROWS, n=1)  # starts the worker (imports and all) under the default timeout
        engine.timeout_seconds = 2.0
        process = engine._worker.process
        with pytest.raises(ComponentError, match=r"^model\.rollout: .* within timeout_seconds=2 ") as err:
            module.producer.sample(ROWS, n=1)
        assert "\n" not in str(err.value)
        assert not process.is_alive()
    finally:
        engine.close()


NOT_COMPARED = ("train/time/", "train/perf/tokens_per_s", "train/rollout/tokens_per_s", "train/rollout/sync_time",
                "train/rollout/policy_version", "train/rollout/staleness")
"""Metrics that are timings, or that only the worker reports."""


class _Recorder(Callback):
    """Every training step's logged metrics, and the rollout worker's process."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.worker_process = None

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.steps.append({k: v.item() for k, v in trainer.callback_metrics.items() if k.startswith("train/")})
        worker = getattr(pl_module.rollout, "_worker", None)
        if worker is not None:
            self.worker_process = worker.process


def _fit(tmp_path, model_dir, *configs, **overrides):
    tmp_path.mkdir(exist_ok=True)
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, model_dir, **overrides), *configs)
    recorder = _Recorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli, recorder


def test_training_through_the_worker_gives_the_in_process_numbers(tmp_path, tiny_model_dir):
    """Same seed, 3 steps: every logged metric but timings (loss, mean reward, entropy, gradient norm, lengths,
    ...) and the final weights equal the in-process run's.

    Observed equal bit for bit. Tolerance 1e-6 absolute: MKL's float32 kernels may round differently with the
    memory alignment of their operands (the trainer's weights are loaded from safetensors, the worker's freshly
    allocated). A run that sampled from another RNG state or from stale weights differs by far more (other
    tokens: other rewards, entropies, gradients; weights apart by the size of an update, ~1e-2 here). The
    rewards, fixed by the sampled tokens, are compared exactly. The loss is ~1e-8 on its own (one update per
    rollout: ratio 1 and zero-mean advantages), so the other metrics and the weights carry the comparison."""
    inner = {"class_path": "rllight.rollout.HFEngine", "init_args": {"max_new_tokens": 6, "temperature": 1.0}}
    steps = ["--trainer.max_steps", "3"]
    local, local_run = _fit(tmp_path / "local", tiny_model_dir, *steps, rollout=inner)
    remote, remote_run = _fit(tmp_path / "worker", tiny_model_dir, *steps, rollout={  # the same settings
        "class_path": "rllight.rollout.worker.ProcessEngine",
        "init_args": {"engine": {"class_path": inner["class_path"]}, **inner["init_args"]}})
    assert isinstance(remote.model.rollout, ProcessEngine) and isinstance(local.model.rollout, HFEngine)
    assert len(local_run.steps) == len(remote_run.steps) == 3
    for local_step, remote_step in zip(local_run.steps, remote_run.steps):
        assert {"train/policy/loss", "train/reward/mean", "train/policy/grad_norm"} <= set(local_step)
        assert remote_step["train/reward/mean"] == local_step["train/reward/mean"]
        torch.testing.assert_close({k: v for k, v in remote_step.items() if not k.startswith(NOT_COMPARED)},
                                   {k: v for k, v in local_step.items() if not k.startswith(NOT_COMPARED)},
                                   atol=1e-6, rtol=0)
    assert len({step["train/reward/mean"] for step in local_run.steps}) == 3  # the steps differ from each other
    remote_weights = remote.model.policy.state_dict()
    for name, value in local.model.policy.state_dict().items():
        torch.testing.assert_close(remote_weights[name], value, atol=1e-6, rtol=0)
    assert remote_run.steps[-1]["train/rollout/policy_version"] == 2  # the third rollout, after two updates


def test_the_overlay_runs_grpo_in_a_worker_that_close_stops(tmp_path, tiny_model_dir):
    """The worker outlives ``fit`` (a validation after it reuses the engine, as with vLLM) and ``close()``
    stops it; a worker also ends with the training process (a daemon that watches its parent)."""
    cli, recorder = _fit(tmp_path, tiny_model_dir, os.path.join(RECIPES, "overlays", "process-worker.yaml"))
    engine = cli.model.rollout
    assert isinstance(engine, ProcessEngine) and isinstance(engine.engine, HFEngine)
    assert (engine.max_new_tokens, engine.temperature, engine.sync_every) == (6, 1.0, 1)  # the recipe's, kept
    assert cli.trainer.global_step == 2
    assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []
    assert recorder.worker_process is not None and recorder.worker_process.is_alive()
    engine.close()
    recorder.worker_process.join(timeout=10)
    assert not recorder.worker_process.is_alive()
    assert engine._worker is None


# ------------------------------------------------------------------------------------- asynchronous rollouts
def test_a_rollout_generated_ahead_is_the_old_policys_tagged_and_never_older_than_max_staleness(tiny_model_dir):
    engine = ProcessEngine(HFEngine(max_new_tokens=8, temperature=0.7), max_staleness=1)
    module = _module(tiny_model_dir, engine)
    try:
        torch.manual_seed(0)
        rollout = module.producer.sample(ROWS, n=2)  # nothing sent ahead: generated now
        assert (engine.last_metrics["rollout/generated_ahead"], engine.last_metrics["rollout/staleness"]) == (0, 0)
        _assert_sampled_under(module, rollout)

        # Sent ahead, then the trainer updates: the rollout collected is the old policy's, one version old.
        module.producer.prefetch(ROWS, 2)
        before = copy.deepcopy(module.policy)
        _optimizer_step(module.policy)
        engine.update_weights(module.policy)
        rollout = module.producer.sample(ROWS, n=2)
        assert engine.last_metrics["rollout/generated_ahead"] == 1
        assert (engine.last_metrics["rollout/policy_version"], engine.last_metrics["rollout/staleness"]) == (0, 1)
        assert rollout.extras[SAMPLE_STALENESS].tolist() == [1.0] * len(rollout)
        assert rollout_metrics(rollout)["rollout/staleness_max"] == 1
        _assert_sampled_under(module, rollout, policy=before)  # the behaviour log-probs are the worker's own
        with pytest.raises(AssertionError):
            _assert_sampled_under(module, rollout)

        # Two updates while it waited: older than max_staleness=1, so it is dropped and generated again.
        module.producer.prefetch(ROWS, 2)
        for _ in range(2):
            _optimizer_step(module.policy)
            engine.update_weights(module.policy)
        rollout = module.producer.sample(ROWS, n=2)
        metrics = engine.last_metrics
        assert (metrics["rollout/generated_ahead"], metrics["rollout/stale_discarded"]) == (0, 1)
        assert (metrics["rollout/policy_version"], metrics["rollout/staleness"]) == (3, 0)
        _assert_sampled_under(module, rollout)

        # Asked for other prompts than those sent ahead: generated now; the one sent ahead stays for later.
        module.producer.prefetch(ROWS[:1], 2)
        module.producer.sample(ROWS[1:], n=1)
        assert engine.last_metrics["rollout/generated_ahead"] == 0
        module.producer.sample(ROWS[:1], n=2)
        assert engine.last_metrics["rollout/generated_ahead"] == 1
    finally:
        engine.close()


def test_the_asynchronous_workers_first_batch_is_the_synchronous_runs_at_the_same_seed(tiny_model_dir):
    """Paired arms of a staleness comparison: the asynchronous worker's stream starts where the trainer's is, so its
    first, on-policy batch is the one the synchronous worker and the in-process engine draw at the same seed; and
    starting it draws nothing from the trainer's stream."""
    responses = {}
    for name, engine in (("in-process", HFEngine(max_new_tokens=8, temperature=1.0)),
                         ("synchronous", ProcessEngine(HFEngine(max_new_tokens=8, temperature=1.0))),
                         ("asynchronous", ProcessEngine(HFEngine(max_new_tokens=8, temperature=1.0), max_staleness=1))):
        module = _module(tiny_model_dir, engine)
        try:
            torch.manual_seed(0)
            responses[name] = module.producer.sample(ROWS, n=4).response_ids.tolist()
            if name == "asynchronous":  # the trainer's stream is where seed 0 left it: nothing was drawn from it
                after = torch.rand(3)
                torch.manual_seed(0)
                assert torch.equal(after, torch.rand(3))
        finally:
            if isinstance(engine, ProcessEngine):
                engine.close()
    assert len({str(r) for r in responses.values()}) == 1, responses
    assert len({str(r) for r in responses["in-process"]}) > 1  # sampled: the responses differ among themselves


def test_asynchronous_settings_are_checked():
    with pytest.raises(RecipeError, match=r"model\.rollout\.init_args\.max_staleness must be an integer >= 0"):
        ProcessEngine(HFEngine(), max_staleness=-1)
    with pytest.raises(RecipeError, match=r"max_staleness=2 with sync_every=3"):
        ProcessEngine(HFEngine(), max_staleness=2, sync_every=3)


def test_a_worker_killed_with_rollouts_sent_ahead_is_restarted_and_they_are_generated_again(tiny_model_dir,
                                                                                            caplog):
    engine = ProcessEngine(HFEngine(max_new_tokens=8), max_staleness=2)
    module = _module(tiny_model_dir, engine)
    try:
        module.producer.sample(ROWS, n=1)
        _optimizer_step(module.policy)
        engine.update_weights(module.policy)
        module.producer.prefetch(ROWS, 2)
        killed = engine._worker.process
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(timeout=10)
        rollout = module.producer.sample(ROWS, n=2)
        assert "1 generation(s) sent ahead are lost" in caplog.text
        assert engine._worker.process.pid != killed.pid
        assert (engine.last_metrics["rollout/generated_ahead"], engine.last_metrics["rollout/staleness"]) == (0, 0)
        _assert_sampled_under(module, rollout)
    finally:
        engine.close()


def test_asynchronous_training_overlaps_generation_and_bounds_staleness(tmp_path, tiny_model_dir):
    """Tiny recipe: 1 optimizer update per step, so max_staleness=2 runs two steps ahead: from the third step
    on, every rollout was sent two steps before and is exactly two versions old; none is older."""
    inner = {"class_path": "rllight.rollout.HFEngine", "init_args": {"max_new_tokens": 6, "temperature": 1.0}}
    cli, run = _fit(tmp_path, tiny_model_dir, "--trainer.max_steps", "5", rollout={
        "class_path": "rllight.rollout.worker.ProcessEngine",
        "init_args": {"engine": {"class_path": inner["class_path"]}, **inner["init_args"], "max_staleness": 2}})
    try:
        assert cli.trainer.global_step == 5
        ahead = [step["train/rollout/generated_ahead"] for step in run.steps]
        staleness = [(step["train/rollout/staleness_mean"], step["train/rollout/staleness_max"]) for step in run.steps]
        assert ahead == [0, 1, 1, 1, 1]
        assert staleness == [(0, 0), (1, 1), (2, 2), (2, 2), (2, 2)]
        assert all(step["train/rollout/stale_discarded"] == 0 for step in run.steps)
        assert cli.model.prefetched_through == 4  # nothing asked for past the run's last step
        assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []
    finally:
        cli.model.rollout.close()
