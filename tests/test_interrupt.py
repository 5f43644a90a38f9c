"""Ctrl-C and SIGTERM: the run finishes its RL step, saves a resumable checkpoint, says how to resume, and a
resume from that file continues where it stopped."""

import os
import re
import signal
import time

import subprocess

import pytest
import torch

from helpers import fit_in_child, start_fit, tiny_overrides
from rllight.callbacks import RolloutCallback


class SignalAt(RolloutCallback):
    """Sends ``signum`` to its own process in the middle of the RL step that follows global step ``step``
    (as a user's Ctrl-C or a scheduler's SIGTERM would arrive)."""

    def __init__(self, step: int = -1, signum: int = 15):
        self.step = step
        self.signum = signum

    def on_rollout(self, trainer, module, rollout):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)
        return rollout


def _run(tmp_path, overlay, *extra):
    return fit_in_child("grpo.yaml", "--config", overlay, "--trainer.enable_checkpointing", "true", *extra,
                        timeout=600)


def _saved_path(stdout: str) -> str:
    match = re.search(r"resume with: rllight .* --ckpt_path (\S+)", stdout)
    assert match, stdout[-2000:]
    return match.group(1)


@pytest.mark.slow
def test_sigterm_saves_after_the_step_and_the_run_resumes_from_it(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    signal_cb = ["--trainer.callbacks+", "test_interrupt.SignalAt", "--trainer.callbacks.step", "1",
                 "--trainer.callbacks.signum", str(int(signal.SIGTERM))]
    stopped = _run(tmp_path, overlay, "--trainer.max_steps", "4", *signal_cb)
    # 128 + 15: a process ended by SIGTERM, as a shell reports it.
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    path = _saved_path(stopped.stdout)
    assert path == str(tmp_path / "checkpoints" / "interrupted-step=2.ckpt")
    state = torch.load(path, weights_only=True)
    # The signal arrived during the step after global step 1; that step finished and counted: 2 updates,
    # 2 batches trained, and the recipe is stored for the resume check.
    assert state["global_step"] == 2 and state["RLDataModule"] == {"batches_trained": 2}
    assert state["rllight_recipe"]["model"]["sampler"]["init_args"]["group_size"] == 8

    resumed = _run(tmp_path, overlay, "--trainer.max_steps", "4", "--ckpt_path", path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The default checkpoint (save_last) at the end of the resumed run: steps 3 and 4 were trained, no more.
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 4 and last["RLDataModule"] == {"batches_trained": 4}
    assert os.path.exists(path)  # the interrupted checkpoint is not overwritten or removed


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_saves_and_exits_130(tmp_path, tiny_model_dir):
    """2 updates a rollout: the message and the file count RL steps as the step lines do, and name the updates."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir, batching={"ppo_epochs": 2})
    signal_cb = ["--trainer.callbacks+", "test_interrupt.SignalAt", "--trainer.callbacks.step", "0",
                 "--trainer.callbacks.signum", str(int(signal.SIGINT))]
    stopped = _run(tmp_path, overlay, "--trainer.max_steps", "6", *signal_cb)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "KeyboardInterrupt" not in stopped.stderr
    path = _saved_path(stopped.stdout)
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == 2 and state["RLDataModule"] == {"batches_trained": 1}
    assert path.endswith("interrupted-step=1.ckpt")
    assert "rllight: step 1/3 | updates 2/6 |" in stopped.stdout
    assert "rllight: Ctrl-C: stopped after RL step 1 (2 optimizer updates); resume with: " in stopped.stdout


@pytest.mark.slow
def test_ctrl_c_saves_also_when_the_pipe_to_the_log_is_gone(tmp_path, tiny_model_dir):
    """``rllight fit ... | tee log`` and Ctrl-C: the same signal ends tee, so stdout and stderr are closed pipes
    when the run finishes its step. Their write errors must not end the run before it saves and exits 130."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    signal_cb = ["--trainer.callbacks+", "test_interrupt.SignalAt", "--trainer.callbacks.step", "0",
                 "--trainer.callbacks.signum", str(int(signal.SIGINT))]
    child = start_fit("grpo.yaml", "--config", overlay, "--trainer.enable_checkpointing", "true",
                      "--trainer.max_steps", "3", *signal_cb)
    child.stdout.close()  # the reader is gone before the run writes anything
    child.stderr.close()
    assert child.wait(timeout=600) == 130
    state = torch.load(tmp_path / "checkpoints" / "interrupted-step=1.ckpt", weights_only=True)
    assert state["global_step"] == 1 and state["RLDataModule"] == {"batches_trained": 1}


def wait_for_file(path, child, seconds: float = 300) -> None:
    """Wait until ``path`` exists (the child reached the point the test waits for), or fail with its output."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            out, err = child.communicate()
            pytest.fail(f"the child never reached {path}: {out[-2000:]} {err[-3000:]}")
        time.sleep(0.2)


def stop_with_sigterm(child, seconds: float = 30) -> tuple[float, str, str]:
    """Send SIGTERM to the child; ``(seconds it took to exit, stdout, stderr)``."""
    start = time.monotonic()
    child.send_signal(signal.SIGTERM)
    try:
        out, err = child.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        pytest.fail(f"SIGTERM not honoured within {seconds} s: {out[-2000:]} {err[-3000:]}")
    return time.monotonic() - start, out, err


@pytest.mark.slow
def test_sigterm_is_honoured_within_seconds_while_an_environment_hangs(tmp_path, tiny_model_dir):
    """An environment's step sleeps 600 s under a 300 s timeout: SIGTERM ends the run within the 5 s grace
    (plus the exit), with exit code 143 and a line saying that the step in progress is not saved."""
    marker = tmp_path / "in_step"
    env = {"class_path": "test_environments.Faulty",
           "init_args": {"fault": "hang", "always": True, "timeout_seconds": 300, "marker": str(marker)}}
    overlay = tiny_overrides(tmp_path, tiny_model_dir, environment=env)
    child = start_fit("grpo.yaml", "--config", overlay, "--trainer.max_steps", "3")
    wait_for_file(marker, child)
    elapsed, out, err = stop_with_sigterm(child)
    assert child.returncode == 143, err[-3000:]
    assert elapsed < 20, elapsed
    assert "rllight: SIGTERM: stopped while waiting for the environment Faulty.step; the step in progress is " \
           "not saved" in out
