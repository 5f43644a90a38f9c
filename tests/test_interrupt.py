"""Ctrl-C and SIGTERM: the run finishes its RL step, saves a resumable checkpoint, says how to resume, and a
resume from that file continues where it stopped. Where no step is in progress (the model loading, an evaluation
outside training) the signal stops the run at once; where a step waits for an environment or a server that never
answers, the process ends within seconds, the run saved as that step began. (Ctrl-C through a pipe whose reader
dies first, at random points: ``test_interrupt_pipe.py``.)"""

import json
import os
import re
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import lightning as L
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


class SignalOutsideTraining(L.Callback):
    """Sends ``signum`` to its own process where no training step is in progress: as the fit starts (``fit_start``,
    the model loaded) or as the first evaluation batch begins (``evaluation``)."""

    def __init__(self, where: str = "fit_start", signum: int = 2):
        self.where = where
        self.signum = signum

    def on_fit_start(self, trainer, pl_module):
        if self.where == "fit_start":
            os.kill(os.getpid(), self.signum)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.where == "evaluation":
            os.kill(os.getpid(), self.signum)


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


@pytest.mark.slow
@pytest.mark.parametrize("where, signum, line", [
    ("fit_start", signal.SIGINT, "rllight: Ctrl-C: stopped before training began; nothing was trained"),
    ("evaluation", signal.SIGINT, "rllight: Ctrl-C: stopped during the evaluation"),
    ("evaluation", signal.SIGTERM, "rllight: SIGTERM: stopped during the evaluation"),
], ids=["ctrl-c-loading", "ctrl-c-evaluating", "sigterm-evaluating"])
def test_a_signal_outside_training_stops_at_once_in_one_line(tmp_path, tiny_model_dir, where, signum, line):
    """Before training begins and during evaluate_before_after's first evaluation no step is in progress: the signal
    stops the run at once (Lightning's own handling exited 1 after Ctrl-C there, and forgot a SIGTERM), with no
    traceback and a line saying that nothing is saved."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    stopped = _run(tmp_path, overlay, "--evaluate_before_after", "true", "--trainer.limit_val_batches", "1",
                   "--trainer.callbacks+", "test_interrupt.SignalOutsideTraining", "--trainer.callbacks.where", where,
                   "--trainer.callbacks.signum", str(int(signum)))
    assert stopped.returncode == (130 if signum == signal.SIGINT else 143), stopped.stderr[-3000:]
    assert stopped.stdout.splitlines()[-1] == line, stopped.stdout[-2000:]
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr, stopped.stderr[-3000:]
    assert "rllight: step 1/" not in stopped.stdout and not (tmp_path / "checkpoints").exists()


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
    (plus the exit), with exit code 143, a line naming what it waited for, and one saying what is saved (nothing:
    checkpoints are off)."""
    marker = tmp_path / "in_step"
    env = {"class_path": "test_environments.Faulty",
           "init_args": {"fault": "hang", "always": True, "timeout_seconds": 300, "marker": str(marker)}}
    overlay = tiny_overrides(tmp_path, tiny_model_dir, environment=env)
    child = start_fit("grpo.yaml", "--config", overlay, "--trainer.max_steps", "3")
    wait_for_file(marker, child)
    _, out, err = stop_with_sigterm(child)  # fails the test where the process outlives 30 s of the 300
    assert child.returncode == 143, err[-3000:]
    assert "rllight: SIGTERM: stopped while waiting for the environment Faulty.step, 5 s after the signal\n" \
           "rllight: SIGTERM: nothing saved (trainer.enable_checkpointing: false)" in out, out


class SilentJudge:
    """A chat-completions server on 127.0.0.1 that scores its first ``answered`` requests ("Score: 7") and then never
    answers: it holds each request open without a byte (``drip`` False), or sends its headers and then one byte a
    second of an answer that never ends. ``held`` is set once a request is held."""

    def __init__(self, answered: int, drip: bool = False):
        self.count, self.held, self.stop, lock = 0, threading.Event(), threading.Event(), threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    judge.count += 1
                    n = judge.count
                try:
                    if n <= answered:
                        choice = {"index": 0, "message": {"role": "assistant", "content": "Score: 7"},
                                  "finish_reason": "stop"}
                        data = json.dumps({"id": "c", "object": "chat.completion", "choices": [choice]}).encode()
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                        return
                    judge.held.set()
                    if drip:
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", "100000")
                        self.end_headers()
                        self.wfile.write(b"{")
                    while not judge.stop.wait(1.0):
                        if drip:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
@pytest.mark.parametrize("signum, drip", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["sigterm", "ctrl-c"])
def test_a_stop_while_a_judge_never_answers_ends_within_seconds_and_saves(tmp_path, tiny_model_dir, signum, drip):
    """The judge scores two RL steps (16 responses each) and then holds every request (silent, or a byte a second)
    under a 60 s timeout: the signal ends the process within seconds, not at the timeout (the requests' threads
    still wait), and the run is saved as the cut-short step began: RL step 2, with its optimizer's state."""
    judge = SilentJudge(answered=32, drip=drip)
    placement = {"class_path": "rllight.serving.Endpoint",
                 "init_args": {"url": judge.url, "timeout_seconds": 60, "retries": 0}}
    reward = {"class_path": "rllight.rewards.judge.LLMJudge", "init_args": {"model": "judge", "placement": placement}}
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward=reward)
    try:
        child = start_fit("grpo.yaml", "--config", overlay, "--trainer.enable_checkpointing", "true",
                          "--trainer.max_steps", "6")
        if not judge.held.wait(300):
            child.kill()
            pytest.fail(f"the judge was never held: {child.communicate()}")
        start = time.monotonic()
        child.send_signal(signum)
        try:
            out, err = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            pytest.fail(f"no exit within 60 s of the signal: {out[-2000:]} {err[-3000:]}")
        elapsed = time.monotonic() - start
    finally:
        judge.close()
    assert child.returncode == (143 if signum == signal.SIGTERM else 130), err[-3000:]
    assert elapsed < 20, (elapsed, out[-2000:])
    path = _saved_path(out)
    assert path == str(tmp_path / "checkpoints" / "interrupted-step=2.ckpt"), out[-2000:]
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == 2 and state["RLDataModule"] == {"batches_trained": 2}
    assert state["optimizer_states"] and state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"] == {
        "ready": 2, "started": 2, "processed": 2, "completed": 2}  # the cut-short batch as not begun
