"""Exact resume: a run SIGKILLed mid-step and resumed from its last checkpoint logs the same metrics,
step for step, as an uninterrupted run; checkpoints are written atomically."""

import csv
import os
import signal

import pytest
import torch

from helpers import fit_in_child, tiny_overrides


def _fit(tmp_path, name, overlay, *extra, every=1):
    return fit_in_child(
        "grpo.yaml",
        "--config",
        overlay,
        "--trainer.max_steps",
        "6",
        "--trainer.enable_checkpointing",
        "true",
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        str(tmp_path / name),
        "--trainer.logger.name",
        "",
        "--trainer.logger.version",
        "0",
        "--trainer.callbacks+",
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.dirpath",
        str(tmp_path / f"{name}_ckpt"),
        "--trainer.callbacks.every_n_train_steps",
        str(every),
        "--trainer.callbacks.save_last",
        "true",
        # A warm-up then cosine schedule: its position must be restored too (logged as train/lr/policy).
        "--model.lr_scheduler",
        "rllight.schedules.WarmupSchedule",
        "--model.lr_scheduler.init_args.warmup_steps",
        "2",
        "--model.lr_scheduler.init_args.decay",
        "cosine",
        *extra,
        timeout=600,
    )


def _metrics(path):
    """{step: {key: value}} for the training metrics that must match (timings are machine noise)."""
    out: dict[int, dict[str, str]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            kept = {
                k: v
                for k, v in row.items()
                if v
                and k.startswith("train/")
                and "/time/" not in k
                and "/perf/" not in k
                and not k.endswith(("tokens_per_s", "sync_time", "wait_time"))
            }
            if kept:
                out.setdefault(int(row["step"]), {}).update(kept)
    return out


ASYNC_ENGINE = {"class_path": "rllight.rollout.worker.ProcessEngine",
                "init_args": {"engine": {"class_path": "rllight.rollout.HFEngine"}, "max_new_tokens": 6,
                              "max_staleness": 2}}
"""Asynchronous rollouts two steps ahead (one update per step here): at the kill, rollouts of later steps are in
flight; the checkpoint before it holds the ones generated ahead of it and the worker's RNG."""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir):
    """The metrics of 6 steps with the in-process engine and no stop: the reference of the resumed runs below (the
    callbacks that stop them do nothing in it)."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    full = _fit(tmp_path, "full", tiny_overrides(tmp_path, tiny_model_dir, batching={"micro_batch_size": 4}))
    assert full.returncode == 0, full.stderr[-3000:]
    return _metrics(tmp_path / "full" / "version_0" / "metrics.csv")


@pytest.mark.slow
@pytest.mark.parametrize("engine", [None, ASYNC_ENGINE], ids=["in-process", "asynchronous-worker"])
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_dir, engine, request):
    overlay = tiny_overrides(tmp_path, tiny_model_dir, batching={"micro_batch_size": 4},
                             **({"rollout": engine} if engine else {}))
    kill_cb = ["--trainer.callbacks+", "user_strategies.KillAt", "--trainer.callbacks.step"]

    if engine:
        full = _fit(tmp_path, "full", overlay, *kill_cb, "-1")
        assert full.returncode == 0, full.stderr[-3000:]
        a = _metrics(tmp_path / "full" / "version_0" / "metrics.csv")
    else:
        a = request.getfixturevalue("uninterrupted")

    killed = _fit(tmp_path, "killed", overlay, *kill_cb, "3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    last = tmp_path / "killed_ckpt" / "last.ckpt"
    assert last.exists()
    # Loads with weights_only: nothing but tensors and plain containers in the checkpoint.
    state = torch.load(last, weights_only=True)
    assert state["global_step"] == 3 and state["RLDataModule"] == {"batches_trained": 3}

    resumed = _fit(
        tmp_path, "killed", overlay, *kill_cb, "-1", "--ckpt_path", str(last), "--trainer.logger.version", "1"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    b = _metrics(tmp_path / "killed" / "version_0" / "metrics.csv")
    c = _metrics(tmp_path / "killed" / "version_1" / "metrics.csv")
    # Metrics are logged under their RL step, counted from 1 as the progress lines do: 4 is the first after resume.
    assert sorted(c) == [s for s in sorted(a) if s >= 4] and len(c) == 3
    assert sorted(b) == [1, 2, 3]
    if engine:  # from the third step on, each rollout was generated two versions before its step
        assert [a[step]["train/rollout/staleness_max"] for step in sorted(a)] == ["0.0", "1.0"] + ["2.0"] * 4
    for step in sorted(b):  # before the kill: the same run
        assert b[step] == a[step], step
    for step in sorted(c):  # after the resume: the same numbers as never stopping
        assert c[step] == a[step], (step, {k: (a[step].get(k), v) for k, v in c[step].items() if a[step].get(k) != v})


def test_a_crash_while_writing_never_leaves_a_half_checkpoint(tmp_path, monkeypatch):
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    io = TorchCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": torch.tensor(1), "w": torch.ones(1000)}, path)

    import fsspec.implementations.local as local

    real_write = local.LocalFileOpener.write

    def half_then_crash(self, data):
        real_write(self, data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(local.LocalFileOpener, "write", half_then_crash)
    with pytest.raises(OSError):
        io.save_checkpoint({"step": torch.tensor(2), "w": torch.zeros(1000)}, path)
    monkeypatch.undo()
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"].item() == 1 and loaded["w"].sum().item() == 1000
    assert os.listdir(tmp_path) == ["last.ckpt"]


@pytest.mark.slow
def test_a_crash_mid_step_saves_the_last_completed_step_and_resuming_it_matches(tmp_path, tiny_model_dir,
                                                                               uninterrupted):
    """An exception in the step after step 3 (checkpoints every step are off: the last one is far back): the
    last completed step is saved as crashed-step=3.ckpt, the error names it, and the resume from it logs the same
    metrics as a run that never failed."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir, batching={"micro_batch_size": 4})
    fail_cb = ["--trainer.callbacks+", "user_strategies.FailAt", "--trainer.callbacks.step"]
    failed = _fit(tmp_path, "failed", overlay, *fail_cb, "3", every=100)
    assert failed.returncode != 0 and "a failure in the middle of a step" in failed.stderr
    saved = tmp_path / "failed_ckpt" / "crashed-step=3.ckpt"
    assert "step 3 is saved: resume with: " in failed.stderr and str(saved) in failed.stderr, failed.stderr[-3000:]
    assert torch.load(saved, weights_only=True)["global_step"] == 3
    resumed = _fit(tmp_path, "failed", overlay, *fail_cb, "-1", "--ckpt_path", str(saved),
                   "--trainer.logger.version", "1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = uninterrupted
    c = _metrics(tmp_path / "failed" / "version_1" / "metrics.csv")
    assert sorted(c) == [4, 5, 6]
    for step in sorted(c):
        assert c[step] == a[step], (step, {k: (a[step].get(k), v) for k, v in c[step].items() if a[step].get(k) != v})
