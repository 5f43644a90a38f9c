"""The processes of a run on several devices or machines: their launch settings, checked before any process group
starts; the process group's timeout; the rendezvous bound to the loopback address on one machine; and a rank that
fails, which stops every rank and is named in one line.

- **Checks** (``launch_problem``, a pure function of the environment, in ``rllight.app.launch_checks``): what
  Lightning's cluster environment will read (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  torchrun's and SLURM's counts) against ``trainer.devices`` and ``trainer.num_nodes``. Each mistake is one
  ``RecipeError`` line, where it used to be a rendezvous that waits out its timeout (``NODE_RANK=5`` of 2 nodes) or
  a long torch traceback.
- **A failing rank** (``rank_failures``, around the command): with Lightning's own launch (one process per device,
  rank 0 starting the others), each rank that raises writes what it raised, where, when, and its traceback to a
  folder rank 0 made (``$RLLIGHT_RANK_FAILURES``) and exits quietly; rank 0 then stops the ranks still running,
  picks the first real cause (not the collective errors it set off on the other ranks, e.g. gloo's "Connection
  closed by peer"), prints its traceback and, last, one line naming the rank. A rank that dies without a word
  (SIGKILL, the out-of-memory killer) is named by rank 0's watcher, which stops every rank too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from datetime import timedelta

from rllight.bounds import PositiveFloat, checked
from rllight.errors import ComponentError, RecipeError
from rllight.app.launch_checks import (env_integer, launch_problem, launch_settings, port_is_free, resolve_error,
                                   unreadable_setting)
from rllight.stopping import leave_promptly

log = logging.getLogger(__name__)

TIMEOUT_MINUTES = 15.0
"""Default of the top-level ``distributed_timeout_minutes``: how long a collective, and the rendezvous, wait for the
slowest rank before the run fails. Long enough for what one rank does while the others wait at a barrier: rank 0
writing a whole checkpoint (float32 weights and Adam's two moments, 12 bytes a parameter, so a 7B model's is some
84 GB: minutes on network storage) or the exported model, a rank's vLLM engine starting. Half Lightning's 30
minutes, which a rank lost before the first step (a wrong NODE_RANK, a node that never started) made the others
wait out; a rank that fails during the run stops the others at once (``rank_failures``), not at the timeout."""

FAILURES_ENV = "RLLIGHT_RANK_FAILURES"
"""The folder where each rank writes its failure; rank 0 sets it before it starts the other ranks."""

WATCH_SECONDS = 1.0  # how often rank 0's watcher looks at the other ranks (Lightning's own looks every 5 s)
GRACE_SECONDS = 3.0  # a rank has ended with an error: how long rank 0 has to fail by itself before the watcher reports
SETTLE_SECONDS = 2.0  # how long rank 0 waits for the other ranks to end by themselves before it kills them
INTERRUPTED_CODES = (130, 143)  # Ctrl-C and SIGTERM: every rank saves and stops together (rllight.safety.Interrupts)
COLLECTIVE_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
COLLECTIVE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "ProcessGroupGloo",
                      "ProcessGroupNCCL", "NCCL communicator", "NCCL error")
"""What marks an error as a collective's (on a rank that was waiting for another one): torch's distributed errors, and
the ``RuntimeError`` gloo raises when a peer's connection closes."""


# ------------------------------------------------------------------------------------------------- failures
def is_collective_error(type_names: list[str], message: str) -> bool:
    """Whether an error (the names of its class and bases, its text) is a collective's: what a rank waiting for
    another one raises when that one fails, not a cause of its own."""
    return any(name in COLLECTIVE_TYPES for name in type_names) or any(m in message for m in COLLECTIVE_MARKERS)


def describe(err: BaseException, rank: int, when: float, cwd: str = "") -> dict:
    """A rank's failure as a record: the rank, the exception's class and first line, where it was raised (the
    innermost frame, relative to ``cwd`` when inside it), when, and whether it is a user's mistake (one line, exit
    code 2) or a collective's error."""
    frames = traceback.extract_tb(err.__traceback__)
    where = ""
    if frames:
        path = frames[-1].filename
        if cwd and path.startswith(cwd.rstrip(os.sep) + os.sep):
            path = os.path.relpath(path, cwd)
        where = f"{path}:{frames[-1].lineno}"
    text = str(err)
    message = next((line.strip() for line in text.splitlines() if line.strip()), "")
    names = [cls.__name__ for cls in type(err).__mro__]
    return {"rank": rank, "type": type(err).__name__, "message": message, "where": where, "time": when,
            "user_error": isinstance(err, (RecipeError, ComponentError)),
            "collective": is_collective_error(names, text)}


def choose_cause(records: list[dict], exits: Mapping[int, int]) -> dict | None:
    """The failure to report: the earliest one that is not a collective's error; else a rank that ended without a
    record (killed by a signal, or an exit code of its own); else the earliest collective error.

    Args:
        records: Every rank's record (``describe``).
        exits: ``{rank: exit code}`` of the ranks that ended by themselves (not those rank 0 stopped).
    """
    real = sorted((r for r in records if not r["collective"]), key=lambda r: r["time"])
    if real:
        return real[0]
    recorded = {r["rank"] for r in records}
    for rank, code in sorted(exits.items()):
        if code not in (0, None, *INTERRUPTED_CODES) and rank not in recorded:
            return {"rank": rank, "exit_code": code}
    return min(records, key=lambda r: r["time"]) if records else None


def failure_line(cause: dict | None) -> tuple[str, int]:
    """The last line a failed run prints, and its exit code (2 for a user's mistake, as on one process, else 1)."""
    if cause is None:
        return "rllight: error: a training process failed; every rank stopped", 1
    if cause.get("user_error"):
        return f"rllight: error: {cause['message']}", 2
    rank = cause["rank"]
    if "exit_code" in cause:
        code = cause["exit_code"]
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            hint = " (the out-of-memory killer sends it: see dmesg)" if -code == signal.SIGKILL else ""
            return f"rllight: error: rank {rank} was killed by {name}{hint}; every rank stopped", 1
        return (f"rllight: error: rank {rank} exited with code {code} (its own messages above say why); every rank "
                "stopped", 1)
    text = f"{cause['type']}: {cause['message']}" if cause["message"] else cause["type"]
    where = f" (at {cause['where']})" if cause.get("where") else ""
    line = f"rllight: error: rank {rank} failed: {text}{where}; every rank stopped"
    if cause.get("collective"):
        line += (" (a collective failed: another process of the run ended first; on several machines, that node's "
                 "output names the cause)")
    return line, 1


def read_records(folder: str) -> list[dict]:
    """The failure records the ranks wrote to ``folder`` (one ``rank<N>.json`` each)."""
    records = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("rank") and name.endswith(".json"):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(folder, name)) as f:
                records.append(json.load(f))
    return records


# ------------------------------------------------------------------------------------------------- this process
class _Run:
    """What this process knows of its run's ranks."""

    def __init__(self):
        self.rank = 0  # this process's global rank, as Lightning will number it
        self.num_nodes = 1
        self.timeout = timedelta(minutes=TIMEOUT_MINUTES)
        self.role: str | None = None  # "spawner": Lightning starts the other ranks of this machine from here; "spawned"
        self.parent: int | None = None  # a spawned rank's spawner
        self.folder: str | None = None  # the spawner's failures folder
        self.children: dict = {}  # the spawner's other ranks: {global rank: subprocess.Popen}
        self.ending = threading.Event()  # the spawner's main thread ends the run itself: its watcher stands down
        self.lock = threading.Lock()  # one report per process
        self.reported = False
        self.store = None  # the loopback rendezvous store, kept for the process's life


_RUN = _Run()


def _launcher_kind(environment) -> str:
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    for cls, kind in ((TorchElasticEnvironment, "torchrun"), (SLURMEnvironment, "slurm"),
                      (LightningEnvironment, "lightning")):
        if isinstance(environment, cls):
            return kind
    return "other"


def prepare(trainer, timeout_minutes: float = TIMEOUT_MINUTES) -> None:
    """Before ``trainer`` starts any process group: check the launch settings (a ``RecipeError`` line), set the
    process group's timeout, and where Lightning starts this machine's other ranks from this process, watch them
    (``rank_failures``) and host the rendezvous on the loopback address."""
    timeout_minutes = checked("distributed_timeout_minutes", timeout_minutes, PositiveFloat)
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is None:  # one device: no process group
        return
    from rllight._compat import set_process_group_timeout, watch_ranks_yourself

    kind, devices = _launcher_kind(environment), trainer.num_devices
    problem = launch_problem(os.environ, kind, devices, trainer.num_nodes)
    if problem:
        raise RecipeError(problem)
    _RUN.timeout = timedelta(minutes=timeout_minutes)
    set_process_group_timeout(trainer.strategy, _RUN.timeout)
    if kind != "lightning":
        return
    node = env_integer(os.environ, "NODE_RANK") if "NODE_RANK" in os.environ else env_integer(os.environ, "GROUP_RANK")
    _RUN.rank, _RUN.num_nodes = (node or 0) * devices + (env_integer(os.environ, "LOCAL_RANK") or 0), trainer.num_nodes
    if os.environ.get(FAILURES_ENV) and os.environ.get("LOCAL_RANK", "0") != "0" and _RUN.role != "spawner":
        _RUN.role, _RUN.parent = "spawned", os.getppid()
    elif devices > 1 and not environment.creates_processes_externally and trainer.strategy.launcher is not None:
        watch_ranks_yourself(trainer.strategy.launcher, _before_spawn, _after_spawn)


def _before_spawn() -> None:
    _RUN.folder = tempfile.mkdtemp(prefix="rllight-ranks-")
    os.environ[FAILURES_ENV] = _RUN.folder  # the other ranks inherit it
    _RUN.role = "spawner"


def _after_spawn(procs: list) -> None:
    _RUN.children = {_RUN.rank + i + 1: proc for i, proc in enumerate(procs)}  # local ranks 1, 2, ... in order
    _host_loopback_store()
    threading.Thread(target=_watch, name="rllight-rank-watcher", daemon=True).start()


def _host_loopback_store() -> None:
    """On one machine, rank 0's rendezvous store listens on 127.0.0.1 only. torch's store listens on every interface
    whatever address it is given, and has no setting for it but a socket handed over ready (``master_listen_fd``);
    its ``multi_tenant`` store, which ``init_process_group`` asks for, then reuses this process's server on that port
    rather than start its own. Where that fails (an older torch), the store is torch's own."""
    address, port = os.environ.get("MASTER_ADDR"), env_integer(os.environ, "MASTER_PORT")
    if _RUN.num_nodes != 1 or address != "127.0.0.1" or not isinstance(port, int) or _RUN.store is not None:
        return
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        listener.bind((address, port))
        listener.listen(socket.SOMAXCONN)
        _RUN.store = TCPStore(address, port, None, True, _RUN.timeout, wait_for_workers=False, multi_tenant=True,
                              master_listen_fd=listener.fileno(), use_libuv=os.environ.get("USE_LIBUV", "1") == "1")
    except (OSError, RuntimeError, TypeError, ValueError) as err:
        listener.close()
        log.debug("rendezvous on %s:%s left to torch (%s)", address, port, err)
        return
    listener.detach()  # the store's server owns the socket now


def _global_rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _RUN.rank


def _record(err: BaseException) -> int:
    """Write this rank's failure (record and traceback) to the run's folder; the exit code it calls for."""
    folder = _RUN.folder or os.environ.get(FAILURES_ENV, "")
    rank = _global_rank()
    record = describe(err, rank, time.time(), os.getcwd())
    if not folder:
        return 2 if record["user_error"] else 1
    record.update(pid=os.getpid(), traceback=os.path.join(folder, f"rank{rank}.txt"))
    with contextlib.suppress(OSError):
        with open(record["traceback"], "w") as f:
            f.write("".join(traceback.format_exception(type(err), err, err.__traceback__)))
        part = os.path.join(folder, f".rank{rank}.json")
        with open(part, "w") as f:
            json.dump(record, f)
        os.replace(part, os.path.join(folder, f"rank{rank}.json"))  # whole or absent for the reader
    return 2 if record["user_error"] else 1


def _stop_and_report() -> int:
    """The spawner's report (under ``_RUN.lock``): let the other ranks end by themselves for a moment, kill those still
    running, print the cause's traceback and, last, its line; returns the exit code."""
    children = _RUN.children
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in children.values()):
        time.sleep(0.05)
    exits = {rank: p.returncode for rank, p in children.items() if p.poll() is not None}
    for proc in children.values():
        if proc.poll() is None:
            proc.kill()  # SIGKILL: a rank inside a collective does not end on SIGTERM
    for proc in children.values():
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
    cause = choose_cause(read_records(_RUN.folder or ""), exits)
    line, code = failure_line(cause)
    _RUN.reported = True
    if cause and not cause.get("user_error") and cause.get("traceback") and os.path.isfile(cause["traceback"]):
        with open(cause["traceback"]) as f:
            sys.stderr.write(f"rllight: rank {cause['rank']}'s traceback:\n{f.read()}")
        sys.stderr.write(f"rllight: the tracebacks of every rank that failed are in {_RUN.folder}\n")
    print(line, file=sys.stderr, flush=True)
    return code


def _watch() -> None:
    """The spawner's watcher thread: once another rank ends with an error, the main thread has ``GRACE_SECONDS`` to
    end the run itself (it does, when a collective fails under it); else (it waits in a collective that never
    returns, as NCCL's can) the watcher reports and ends this process."""
    while True:
        time.sleep(WATCH_SECONDS)
        codes = [proc.poll() for proc in _RUN.children.values()]
        if all(code == 0 for code in codes):
            return
        if any(code not in (None, 0, *INTERRUPTED_CODES) for code in codes):
            break
    if _RUN.ending.wait(GRACE_SECONDS) or not _RUN.lock.acquire(blocking=False):
        return
    code = _stop_and_report()
    sys.stdout.flush()
    os._exit(code)  # the main thread may be inside a collective that never returns


def _wait_for_children() -> None:
    """After a run that ended well on this rank: wait (a while) for the others, and report one that failed."""
    deadline = time.monotonic() + 30
    for proc in _RUN.children.values():
        with contextlib.suppress(Exception):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    if any(p.returncode not in (None, 0, *INTERRUPTED_CODES) for p in _RUN.children.values()):
        with _RUN.lock:
            sys.exit(_stop_and_report())


def _end_process_group() -> None:
    """After a command that ended well: the process group (gloo's threads, NCCL's communicators) ended here, in
    order, rather than by the interpreter's exit, where a rank once aborted ("terminate called without an active
    exception") after its run had finished. Every collective of the run is done by then."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _exit_code(err: Exception) -> int:
    """The exit code of a command that raised ``err`` (``rllight.app.cli``: 143 after SIGTERM, 2 for a user's mistake,
    else 1)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    if isinstance(err, SIGTERMException):
        return 128 + signal.SIGTERM
    return 2 if isinstance(err, (RecipeError, ComponentError)) else 1


@contextlib.contextmanager
def rank_failures() -> Iterator[None]:
    """Around a command: where it runs as one of several ranks started by Lightning's launch, a failure of any rank
    ends every rank, and the last line on stderr names the first real cause (see the module's doc). Elsewhere (one
    process, torchrun, SLURM), errors go on as they are. A command that a stop (Ctrl-C, SIGTERM) ended leaves the
    process within seconds, whatever its threads still wait for (``rllight.stopping.leave_promptly``)."""
    try:
        yield
    except Exception as err:
        _RUN.ending.set()
        leave_promptly(_exit_code(err))  # after Ctrl-C or SIGTERM: within seconds, whatever a thread waits for
        if _RUN.role == "spawned" or (_RUN.role == "spawner" and _RUN.children):
            code = _record(err)
            if _RUN.role == "spawner":
                with _RUN.lock:  # held by the watcher where it reports first: it then ends this process
                    sys.exit(_stop_and_report())
            if os.getppid() == _RUN.parent:  # the spawner reports; else it is gone, and this rank says it itself
                sys.exit(code)
        raise
    except BaseException as err:  # an interrupt's exit (every rank saves and stops), Lightning's after a second Ctrl-C
        _RUN.ending.set()
        leave_promptly(err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 130)
        raise
    else:
        _RUN.ending.set()
        if _RUN.role == "spawner" and _RUN.children:
            _wait_for_children()
        _end_process_group()
    finally:
        if _RUN.role == "spawner" and not _RUN.reported and _RUN.folder:
            shutil.rmtree(_RUN.folder, ignore_errors=True)


__all__ = ["FAILURES_ENV", "TIMEOUT_MINUTES", "choose_cause", "describe", "failure_line", "is_collective_error",
           "launch_problem", "launch_settings", "port_is_free", "prepare", "rank_failures", "read_records",
           "resolve_error", "unreadable_setting"]
