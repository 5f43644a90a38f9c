"""A supervised child process (``rllight.supervised``), started either way (a fresh interpreter, a spawn): it
answers; its death mid-request is ``ChildDied`` with its exit code; a hang is the caller's timeout error after the
timeout and a stop asked of the trainer within a second; ``kill`` ends what it started too; and it ends, after its
cleanup, when the trainer is gone."""

import os
import signal
import subprocess
import sys
import time

import pytest
from supervised_targets import start

from rllight import stopping
from rllight.supervised import ChildDied, ChildTimedOut

HOW = ["interpreter", "spawn"]
START = 120.0  # seconds for a child to start on a loaded machine (the first receive waits for it)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process: not gone, and not a zombie that nobody reaped (an orphan's parent in
    a container need not reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("how", HOW)
def test_a_child_answers_ignores_ctrl_c_leads_its_session_and_stops_when_asked(how):
    child = start(how, "echo")
    try:
        child.send(("ping", 1))
        assert child.receive(START, "answer") == ("echo", child.pid, 1)
        assert child.pid != os.getpid() and os.getsid(child.pid) == child.pid  # a session of its own
        os.kill(child.pid, signal.SIGINT)  # a terminal's Ctrl-C is the trainer's to handle
        child.send(("ping", 2))
        assert child.receive(10, "answer") == ("echo", child.pid, 2)
        assert child.stop() == 0  # it left when asked, not killed
    finally:
        child.kill()


@pytest.mark.parametrize("how", HOW)
def test_a_child_that_dies_mid_request_is_child_died_with_its_exit_code(how):
    child = start(how, "die_on_request")
    try:
        assert child.receive(START, "start") == ("ready",)
        child.send(("work",))
        with pytest.raises(ChildDied, match=r"^exit code 3$"):
            child.receive(30, "answer")
        with pytest.raises(ChildDied, match=r"^exit code 3$"):  # a broken pipe
            child.send(("work",))
    finally:
        code = child.kill()
    assert code == 3


@pytest.mark.parametrize("how", HOW)
def test_a_child_that_hangs_is_the_timeout_error_after_the_timeout(how):
    child = start(how, "hang")
    try:
        assert child.receive(START, "start") == ("ready",)
        child.send(("work",))
        with pytest.raises(ChildTimedOut, match=r"^the test child did not answer within 1 s$"):
            child.receive(1.0, "answer")
        child.timed_out = lambda what, timeout: RuntimeError(f"worded by the caller: {what} in {timeout:g}")
        with pytest.raises(RuntimeError, match=r"^worded by the caller: generate in 0.5$"):
            child.receive(0.5, "generate")
    finally:
        code = child.kill()
    assert code == -signal.SIGKILL and not _running(child.pid)


def test_a_stop_asked_of_the_trainer_ends_a_wait_within_a_second(capsys):
    child = start("interpreter", "hang")
    try:
        assert child.receive(START, "start") == ("ready",)
        child.send(("work",))
        stopping._stop["Ctrl-C"] = time.monotonic() - stopping.STOP_GRACE_SECONDS  # Ctrl-C, its grace spent
        with pytest.raises(stopping.Interrupted) as err:  # not ChildTimedOut: the 60 s were not waited out
            child.receive(60, "answer")
        assert err.value.code == 130
        assert "stopped while waiting for the test child" in capsys.readouterr().out
    finally:
        stopping.clear_stop()
        child.kill()


@pytest.mark.parametrize("how", HOW)
def test_kill_also_ends_what_the_child_started(how):
    child = start(how, "start_grandchild")
    try:
        _, grandchild = child.receive(START, "start")
        assert _running(grandchild)
    finally:
        code = child.kill()
    assert code == -signal.SIGKILL and _gone_within(grandchild, 5.0)


@pytest.mark.parametrize("how", HOW)
def test_a_child_ends_after_its_cleanup_when_the_trainer_is_gone(how, tmp_path):
    marker = tmp_path / "cleaned"
    code = f"import sys; sys.path[:] = {sys.path!r}; import supervised_targets; " \
           f"supervised_targets.orphan({how!r}, {str(marker)!r})"
    out = tmp_path / "out"
    with open(out, "w") as f:  # a file, not a pipe: the child inherits it, and a pipe would stay open with it
        trainer = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, timeout=300,
                                 check=False)
    assert trainer.returncode == 0, out.read_text()[-3000:]
    pid = int(out.read_text().split()[-1])
    try:
        assert _gone_within(pid, 5.0)
        assert marker.read_text() == "cleaned"
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
