"""What a stop writes never ends it, and a stopped process ends within seconds (``rllight.stopping``): a signal
handler that speaks while the run is blocked writing to a slow reader, output whose reader went away, and threads
still waiting for a server when the process exits."""

from __future__ import annotations

import fcntl
import io
import os
import signal
import subprocess
import sys
import termios
import textwrap
import threading
import time

import pytest

from rllight import stopping


def blocked_writer_and_signal(handler, stream_of) -> tuple[BaseException | None, bytes]:
    """Write 1 MB through ``stream_of(raw text stream)`` (set as ``sys.stdout``) into a pipe that is read only once it
    is full and the write blocked; then ``handler`` runs for a signal sent to this (the main) thread, inside that
    write. Returns what the write raised (None) and all the pipe received."""
    r, w = os.pipe()
    raw = io.TextIOWrapper(io.BufferedWriter(io.FileIO(w, "w"), buffer_size=8192), encoding="utf-8")
    stream, got, main = stream_of(raw), [], threading.get_ident()

    def reader():
        before = -1
        while True:  # until the pipe is full: the writer waits
            time.sleep(0.1)
            filled = int.from_bytes(fcntl.ioctl(r, termios.FIONREAD, b"\0\0\0\0"), "little")
            if filled and filled == before:
                break
            before = filled
        signal.pthread_kill(main, signal.SIGUSR1)
        time.sleep(0.2)
        while data := os.read(r, 1 << 16):
            got.append(data)

    previous, saved = signal.signal(signal.SIGUSR1, handler), sys.stdout
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    sys.stdout, error = stream, None
    try:
        stream.write("x" * 1_000_000)
        stream.flush()
    except BaseException as err:  # noqa: BLE001 - what the test looks at
        error = err
    finally:
        sys.stdout = saved
        signal.signal(signal.SIGUSR1, previous)
        raw.close()
        thread.join(10)
        os.close(r)
    return error, b"".join(got)


def test_a_signal_handler_speaks_while_the_run_is_blocked_writing_to_a_slow_reader():
    """Ctrl-C's line, said by its handler inside a write that waits for ``| tee`` to read: a print there raises
    ``RuntimeError: reentrant call`` out of the interrupted write; ``say_in_handler`` goes around the buffer."""
    error, got = blocked_writer_and_signal(lambda *_: stopping.say_in_handler("the stop line"), lambda raw: raw)
    assert error is None and b"the stop line\n" in got and got.count(b"x") == 1_000_000


def test_a_print_inside_a_tolerant_streams_own_write_is_dropped_not_raised():
    """Lightning's SIGTERM handler logs through the same stream: the interrupted write goes on."""
    error, got = blocked_writer_and_signal(lambda *_: print("a handler's print", flush=True),
                                           stopping._TolerantStream)
    assert error is None and got.count(b"x") == 1_000_000


def test_output_whose_reader_went_away_never_raises_and_goes_to_devnull():
    r, w = os.pipe()
    os.close(r)  # tee, ended by the same Ctrl-C
    raw = io.TextIOWrapper(io.BufferedWriter(io.FileIO(w, "w")), encoding="utf-8")
    stream = stopping._TolerantStream(raw)
    stream.write("a step's line\n")
    stream.flush()
    assert stream.broken and stream.write("more") == 4
    assert os.write(w, b"anything") == 8  # the descriptor is /dev/null now: a direct write succeeds too
    raw.close()  # its final flush as well


def test_say_ignores_a_closed_stream():
    closed = io.StringIO()
    closed.close()
    stopping.say("a line", closed)


@pytest.mark.slow
@pytest.mark.parametrize("stopped, waits, goes_on, code", [(True, 60, 0, 143), (False, 1, 0, 0), (True, 4, 4, 0)],
                         ids=["stopped", "not-stopped", "the-caller-goes-on"])
def test_a_stopped_process_ends_within_seconds_though_a_thread_still_waits(stopped, waits, goes_on, code):
    """A thread that is not a daemon waits (60 s: a request to a server that never answers), which the interpreter's
    exit waits for. After a stop the process ends ``EXIT_GRACE_SECONDS`` into its exit, with the stop's exit code;
    without a stop, or while the caller goes on (a Python session), ``leave_promptly`` leaves it alone."""
    script = textwrap.dedent(f"""
        import threading, time
        from rllight import stopping
        threading.Thread(target=time.sleep, args=({waits},)).start()
        if {stopped}:
            stopping.request_stop("SIGTERM")
        stopping.leave_promptly(143)
        time.sleep({goes_on})
        print("left", flush=True)
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert (done.returncode, done.stdout) == (code, "left\n"), done.stderr
    assert time.monotonic() - start < stopping.EXIT_GRACE_SECONDS + goes_on + 20
