"""Ctrl-C on ``rllight fit ... |& tee log``: the terminal's SIGINT also ends tee, so the run's stdout and stderr are a
pipe without a reader by the time it stops, and each of its writes fails. Sent at random points of a tiny run, many
times, the signal must still leave a resumable ``interrupted-step=N.ckpt`` once training has begun (before, it stops
at once, and nothing was trained); each run resumes from the checkpoint the one before it left.

The runs are forked from one process that has imported rllight (``serve``, this file run with ``--serve``), so that
each costs its own start and training rather than the imports' seconds; each leaves through the interpreter's exit,
as ``python -m rllight`` does."""

from __future__ import annotations

import glob
import json
import os
import random
import select
import signal
import subprocess
import sys
import time

import lightning as L
import pytest

from conftest import RECIPES
from helpers import TESTS, tiny_overrides

RUNS = 20
"""How many runs the test interrupts."""


class TrainingStarted(L.Callback):
    """Writes ``path`` as the first training step begins: by then every callback's ``on_train_start`` (the Ctrl-C
    handler's among them) has run."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not os.path.exists(self.path):
            with open(self.path, "w"):
                pass


def serve() -> None:
    """A fork server: for each JSON line read (``{"argv": [...], "output": FIFO}``), fork a child that runs ``rllight
    <argv>`` with its stdout and stderr on the FIFO; answer ``{"pid": N}`` at once, then ``{"code": exit code}`` (minus
    the signal where one killed it) once the child has ended."""
    import transformers  # noqa: F401 - what a run imports, imported once here
    from transformers import LlamaForCausalLM  # noqa: F401

    import rllight.app.cli  # noqa: F401
    import test_interrupt_pipe  # noqa: F401 - the callback's module, as the runs name it
    import user_strategies  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            break
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
    else:
        return
    output = os.open(request["output"], os.O_WRONLY)  # waits for the reader to open its end
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = ["rllight", *request["argv"]]
    from rllight.app.cli import main

    main()


class Server:
    """The test's side of ``serve``."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, cwd=TESTS,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"))

    def start(self, argv: list[str], output: str) -> int:
        self.process.stdin.write(json.dumps({"argv": argv, "output": output}) + "\n")
        self.process.stdin.flush()
        answer = self.answer(600)
        assert answer is not None, "the fork server did not start a run in 600 s"
        return answer["pid"]

    def answer(self, seconds: float) -> dict | None:
        ready, _, _ = select.select([self.process.stdout], [], [], seconds)
        if not ready:
            return None
        line = self.process.stdout.readline()
        assert line, "the fork server ended"
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def interrupted(root: str) -> set[str]:
    return set(glob.glob(os.path.join(root, "run*", "checkpoints", "interrupted-*.ckpt")))


@pytest.mark.slow
def test_ctrl_c_through_a_pipe_whose_reader_dies_first_saves_every_time(tmp_path, tiny_model_dir):
    import torch

    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    root, marker = str(tmp_path), str(tmp_path / "training")
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    server = Server()
    resume, steps, starting, trained = None, 0, 10.0, 0
    try:
        for run in range(RUNS):
            fifo, log = str(tmp_path / f"out{run}"), str(tmp_path / f"log{run}.txt")
            os.mkfifo(fifo)
            reader = subprocess.Popen(["sh", "-c", 'exec tee "$1" < "$2" > /dev/null', "sh", log, fifo])
            if os.path.exists(marker):
                os.remove(marker)
            # Each run in a folder of its own, resuming from the one before: a Ctrl-C as a run starts can leave its
            # config.yaml empty, which a later run in the same folder refuses.
            argv = ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay,
                    "--trainer.default_root_dir", str(tmp_path / f"run{run}"),
                    "--trainer.enable_checkpointing", "true", "--trainer.max_steps", "100000",
                    "--checkpoint.every_n_steps", "5", "--model.guards.max_zero_gradient_steps", "null",
                    "--trainer.callbacks+", "test_interrupt_pipe.TrainingStarted", "--trainer.callbacks.path", marker,
                    *(["--ckpt_path", resume] if resume else [])]  # the tiny task is learnt in the chain's steps
            began = time.monotonic()
            pid = server.start(argv, fifo)
            if run % 4 == 3:  # a random point of the start: parsing, loading, restoring, the first step
                time.sleep(rng.uniform(0.0, min(starting, 10.0)))
            else:  # a random point of training: a step, its line, a checkpoint every 5 steps
                while not os.path.exists(marker):
                    ended = server.answer(0.02)
                    assert ended is None and time.monotonic() - began < 600, \
                        f"run {run}: no training step began ({ended}): {open(log).read()}"
                starting = time.monotonic() - began
                time.sleep(rng.uniform(0.0, 1.5))
            before, ended = interrupted(root), server.answer(0)
            assert ended is None, f"run {run}: the run of 100000 steps ended by itself ({ended}): {open(log).read()}"
            reader.send_signal(signal.SIGINT)  # the pipe's reader dies first
            reader.wait(timeout=60)
            os.kill(pid, signal.SIGINT)
            answer = server.answer(120)
            with open(log) as f:
                seen = f.read()[-3000:]
            training = os.path.exists(marker)  # a training step began: the signal came after the handler's install
            where = f"run {run} (seed {seed}, {'in training' if training else 'starting'})"
            assert answer is not None, f"{where}: no exit 120 s after Ctrl-C; its output before the pipe closed: {seen}"
            saved = interrupted(root) - before
            partial = glob.glob(os.path.join(root, "run*", "checkpoints", "*.tmp*"))
            assert not partial, f"{where}: a partial checkpoint is left: {partial}"
            if not training:  # stopped at once (130), or before the handler (Python's KeyboardInterrupt, Lightning's 1)
                assert answer["code"] in (130, -signal.SIGINT, 1) and not saved, (where, answer, saved, seen)
                continue
            assert answer["code"] == 130 and len(saved) == 1, (where, answer, saved, seen)
            resume = saved.pop()
            state = torch.load(resume, weights_only=True)
            assert state["optimizer_states"] and state["global_step"] > steps, (where, resume, steps)
            assert state["RLDataModule"]["batches_trained"] == state["global_step"]  # one update a step
            steps, trained = state["global_step"], trained + 1
    finally:
        server.close()
    assert trained >= RUNS // 2, trained


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
