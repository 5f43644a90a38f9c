"""The launch of several processes (rllight.app.launch): settings checked in one line before any process group starts,
the process group's timeout from the recipe, a failing rank that stops every rank with one line naming it and its
cause, and a single machine's rendezvous on the loopback address."""

import json
import os
import re
import signal
import socket
import subprocess
import time
from datetime import timedelta

import pytest
import torch
from jsonargparse import ArgumentError

from conftest import RECIPES
from helpers import build, start_fit, tiny_overrides
from rllight.app.cli import main
from rllight.errors import RecipeError
from rllight.app.launch import (TIMEOUT_MINUTES, choose_cause, describe, failure_line, is_collective_error,
                            launch_problem, port_is_free, prepare, resolve_error, unreadable_setting)


def _never(*_):
    raise AssertionError("asked where it must not be")


def _problem(env, launcher="lightning", devices=1, num_nodes=2, resolve=lambda host: None, port_free=lambda p: True):
    return launch_problem(env, launcher, devices, num_nodes, resolve=resolve, port_free=port_free)


NODES = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # what a manual launch of 2 nodes sets on each


@pytest.mark.parametrize("env, num_nodes, expected", [
    ({**NODES, "NODE_RANK": "5"}, 2,
     "NODE_RANK=5 is out of range for trainer.num_nodes 2: each node's NODE_RANK is its index, 0 .. 1"),
    ({**NODES, "NODE_RANK": "abc"}, 2, "NODE_RANK='abc' is not an integer; set it on each node to that node's index "
                                       "(0 .. 1)"),
    ({**NODES, "NODE_RANK": "-1"}, 2,
     "NODE_RANK=-1 is out of range for trainer.num_nodes 2: each node's NODE_RANK is its index, 0 .. 1"),
    (NODES, 2, "trainer.num_nodes is 2 but NODE_RANK is not set: set it on each node to that node's index (0 .. 1), "
               "or launch with torchrun or srun"),
    ({"NODE_RANK": "1"}, 1, "NODE_RANK=1 is out of range for trainer.num_nodes 1: on one machine, unset it"),
    ({"GROUP_RANK": "2", **NODES}, 2,  # Lightning reads GROUP_RANK where NODE_RANK is unset
     "GROUP_RANK=2 is out of range for trainer.num_nodes 2: each node's GROUP_RANK is its index, 0 .. 1"),
    ({"NODE_RANK": "1", "MASTER_PORT": "29500"}, 2, "trainer.num_nodes is 2 but MASTER_ADDR is not set: set "
     "MASTER_ADDR and MASTER_PORT on every node to node 0's address and a free port there"),
    ({"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}, 2, "trainer.num_nodes is 2 but MASTER_PORT is not set: set "
     "MASTER_ADDR and MASTER_PORT on every node to node 0's address and a free port there"),
    ({**NODES, "NODE_RANK": "0", "MASTER_PORT": "http"}, 2, "MASTER_PORT='http' is not a port number (1 .. 65535)"),
    ({**NODES, "NODE_RANK": "0", "MASTER_PORT": "70000"}, 2, "MASTER_PORT=70000 is not a port number (1 .. 65535)"),
])
def test_node_rank_and_address_mistakes_are_one_line_each(env, num_nodes, expected):
    assert _problem(env, num_nodes=num_nodes) == expected


def test_an_unresolvable_address_and_a_busy_port_are_named():
    unknown = lambda host: "Name or service not known" if host == "head.invalid" else None  # noqa: E731
    env = {"NODE_RANK": "1", "MASTER_ADDR": "head.invalid", "MASTER_PORT": "29500"}
    assert _problem(env, resolve=unknown) == ("MASTER_ADDR='head.invalid' does not resolve to an address (Name or "
                                              "service not known); set it to node 0's address or host name")
    assert _problem({"MASTER_ADDR": "head.invalid"}, num_nodes=1, resolve=unknown) == (
        "MASTER_ADDR='head.invalid' does not resolve to an address (Name or service not known); set it to 127.0.0.1 "
        "(or unset it on one machine)")
    busy = {**NODES, "NODE_RANK": "0"}
    assert _problem(busy, port_free=lambda port: port != 29500) == (
        "MASTER_PORT=29500 is in use on this machine, where node 0 hosts the rendezvous; choose a free port")
    assert _problem({"MASTER_PORT": "29500"}, num_nodes=1, port_free=lambda port: False) == (
        "MASTER_PORT=29500 is in use on this machine, where node 0 hosts the rendezvous; choose a free port (or unset "
        "MASTER_PORT: one is picked)")
    # Only node 0's launching process hosts the rendezvous: node 1 and the processes Lightning started never ask.
    assert _problem({**NODES, "NODE_RANK": "1"}, port_free=_never) is None
    started = {**NODES, "NODE_RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    assert _problem(started, devices=2, port_free=_never) is None
    assert _problem({}, devices=2, num_nodes=1, resolve=_never, port_free=_never) is None  # one machine, defaults


def test_counts_of_an_outside_launcher_must_match_the_recipe():
    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    # A consistent torchrun launch passes, and its port (held by torchrun's own agent) is never probed.
    assert _problem(torchrun, "torchrun", devices=2, num_nodes=2, port_free=_never) is None
    assert _problem({**torchrun, "WORLD_SIZE": "8"}, "torchrun", devices=2, num_nodes=2) == (
        "WORLD_SIZE=8 (the processes the launcher started) but trainer.devices x trainer.num_nodes = 2 x 2 = 4; make "
        "them agree (torchrun: --nproc-per-node trainer.devices, --nnodes trainer.num_nodes)")
    assert _problem(torchrun, "torchrun", devices=4, num_nodes=1) == (
        "LOCAL_WORLD_SIZE=2 (torchrun's --nproc-per-node) but trainer.devices is 4; make them agree")
    assert _problem({**torchrun, "LOCAL_RANK": "2"}, "torchrun", devices=2, num_nodes=2) == (
        "LOCAL_RANK=2 is not a device index of this node: trainer.devices is 2 (0 .. 1)")
    # A launcher of the user's own under Lightning's default environment (LOCAL_RANK set).
    own = {**NODES, "NODE_RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3"}
    assert _problem(own, devices=2, num_nodes=2).startswith("WORLD_SIZE=3 (the processes the launcher started) but "
                                                            "trainer.devices x trainer.num_nodes = 2 x 2 = 4")
    slurm = {"SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_NNODES": "2", "SLURM_PROCID": "9"}
    assert _problem(slurm, "slurm", devices=8, num_nodes=2, resolve=_never, port_free=_never) is None
    assert _problem(slurm, "slurm", devices=4, num_nodes=2) == (
        "SLURM_NTASKS_PER_NODE=8 (#SBATCH --ntasks-per-node) but trainer.devices is 4; make them agree")
    assert _problem(slurm, "slurm", devices=8, num_nodes=1) == (
        "SLURM_NNODES=2 (#SBATCH --nodes) but trainer.num_nodes is 1; make them agree")
    assert _problem({**slurm, "SLURM_NTASKS_PER_NODE": "8(x2)"}, "slurm", devices=8, num_nodes=2) is None
    # What Lightning reads with int() while it builds the Trainer, before these checks can run (launch_settings).
    assert unreadable_setting({"NODE_RANK": "0", "LOCAL_RANK": "one"}, 2) == (
        "LOCAL_RANK='one' is not an integer; it is the process's device index on its node")


def test_the_real_port_and_address_probes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not port_is_free(port)
    assert port_is_free(port)
    assert resolve_error("127.0.0.1") is None


def _raised(err: BaseException) -> BaseException:
    try:
        raise err
    except BaseException as caught:
        return caught


def test_a_failure_record_names_where_and_tells_a_collective_error_from_a_cause():
    cwd = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    record = describe(_raised(ValueError("bad row\nmore detail")), 1, 5.0, cwd)
    assert record["type"] == "ValueError" and record["message"] == "bad row" and record["rank"] == 1
    assert re.fullmatch(r"tests/app/test_launch\.py:\d+", record["where"]), record["where"]
    assert not record["collective"] and not record["user_error"]
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4822")
    assert describe(_raised(gloo), 0, 6.0)["collective"]
    assert describe(_raised(torch.distributed.DistBackendError("NCCL watchdog")), 0, 6.0)["collective"]
    assert describe(_raised(RecipeError("data.train_files: row 3 has no answer")), 0, 6.0)["user_error"]
    assert not is_collective_error(["ValueError", "Exception"], "a connection to the vLLM server was refused")


def _record(rank, when, collective=False, user_error=False, kind="ValueError", message="boom", where="my_lab.py:7"):
    return {"rank": rank, "type": kind, "message": message, "where": where, "time": when, "collective": collective,
            "user_error": user_error}


def test_the_first_real_cause_is_reported_not_the_collective_errors_it_set_off():
    gloo = _record(0, 1.0, collective=True, kind="RuntimeError", message="Connection closed by peer")
    cause = choose_cause([gloo, _record(1, 2.0), _record(2, 3.0, message="later")], {1: 1, 2: 1})
    assert failure_line(cause) == (
        "rllight: error: rank 1 failed: ValueError: boom (at my_lab.py:7); every rank stopped", 1)
    # A rank killed without a word (SIGKILL, the out-of-memory killer) comes before the others' collective errors.
    assert failure_line(choose_cause([gloo], {1: -signal.SIGKILL})) == (
        "rllight: error: rank 1 was killed by SIGKILL (the out-of-memory killer sends it: see dmesg); every rank "
        "stopped", 1)
    assert failure_line(choose_cause([], {3: 7}))[0] == ("rllight: error: rank 3 exited with code 7 (its own messages "
                                                         "above say why); every rank stopped")
    # Only collective errors (the cause was on another machine): the earliest, said to be one.
    line, code = failure_line(choose_cause([gloo], {1: 130}))
    assert code == 1 and line.startswith("rllight: error: rank 0 failed: RuntimeError: Connection closed by peer (at "
                                         "my_lab.py:7); every rank stopped (a collective failed: another process of "
                                         "the run ended first")
    # A user's mistake stays the one line it is on one process, with exit code 2.
    mistake = _record(1, 2.0, user_error=True, kind="RecipeError", message="data.train_files: row 3 has no answer")
    assert failure_line(choose_cause([gloo, mistake], {})) == (
        "rllight: error: data.train_files: row 3 has no answer", 2)


def test_a_wrong_node_rank_is_one_line_before_any_process_group(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("NODE_RANK", "abc")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", overlay, "--trainer.strategy", "ddp",
              "--trainer.num_nodes", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1] == ("rllight: error: NODE_RANK='abc' is not an integer; set it on each node to that node's index "
                       "(0 .. 1)")


@pytest.mark.parametrize("strategy", ["ddp", "{class_path: rllight.fsdp.FSDP}"])
def test_the_process_group_timeout_is_a_recipe_setting(tmp_path, tiny_model_dir, strategy):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    common = ("--trainer.strategy", strategy, "--trainer.devices", "2")
    assert build(os.path.join(RECIPES, "grpo.yaml"), overlay, *common).trainer.strategy._timeout == timedelta(
        minutes=TIMEOUT_MINUTES)
    cli = build(os.path.join(RECIPES, "grpo.yaml"), overlay, *common, "--distributed_timeout_minutes", "2.5")
    assert cli.trainer.strategy._timeout == timedelta(minutes=2.5)
    with pytest.raises(ArgumentError, match="PositiveFloat"):  # declared: the parser refuses it (test_user_errors)
        build(os.path.join(RECIPES, "grpo.yaml"), overlay, *common, "--distributed_timeout_minutes", "0")
    with pytest.raises(RecipeError, match=r"^distributed_timeout_minutes must be a number > 0, got 0$"):
        prepare(cli.trainer, 0)  # a call from Python


# ------------------------------------------------------------------------------------------------- 2 processes
def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net writes them) of every TCP socket listening on ``port`` here."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                address, hex_port = fields[1].split(":")
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.add(address)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(tmp_path, model_dir, *args) -> dict:
    """A 2-process DDP run (``args`` added) to its end, watching which addresses its rendezvous port listens on."""
    overlay = tiny_overrides(tmp_path, model_dir)
    port = _free_port()
    child = start_fit("grpo.yaml", "--config", overlay, "--trainer.strategy", "ddp", "--trainer.devices", "2",
                      "--trainer.max_steps", "3", *args, MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    listening, deadline = set(), time.time() + 600
    while True:
        listening |= _listening_addresses(port)
        try:  # reads the output as it comes; returns once every rank has ended (they all hold the pipes)
            _, stderr = child.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if time.time() > deadline:
                child.kill()
                raise
    return {"code": child.returncode, "stderr": stderr, "ended": time.time(), "listening": listening}


@pytest.fixture(scope="module")
def rank_one_raises(tmp_path_factory, tiny_model_dir):
    return _two_ranks(tmp_path_factory.mktemp("raises"), tiny_model_dir, "--trainer.callbacks+",
                      "user_strategies.FailOnRank")


@pytest.mark.slow
def test_a_rank_that_raises_stops_every_rank_with_one_line_naming_it(rank_one_raises):
    run = rank_one_raises
    lines = run["stderr"].strip().splitlines()
    assert run["code"] == 1, run["stderr"][-4000:]
    assert re.fullmatch(r"rllight: error: rank 1 failed: ValueError: a failure on rank 1 only \(at "
                        r"tests/user_strategies\.py:\d+\); every rank stopped", lines[-1]), lines[-3:]
    assert "Connection closed by peer" not in "\n".join(lines[-3:])
    folder = next(m.group(1) for m in map(re.compile(r"are in (\S+)$").search, lines) if m)
    with open(os.path.join(folder, "rank1.json")) as f:
        failed = json.load(f)
    # Every process ended within seconds of the failure (the parent's pipes stay open while any rank runs).
    assert run["ended"] - failed["time"] < 20, run["ended"] - failed["time"]
    assert not os.path.exists(f"/proc/{failed['pid']}")
    with open(failed["traceback"]) as f:
        assert f.read().rstrip().endswith("ValueError: a failure on rank 1 only")


@pytest.mark.slow
def test_one_machine_s_rendezvous_listens_on_the_loopback_address_only(rank_one_raises):
    assert rank_one_raises["listening"] == {"0100007F"}, rank_one_raises["listening"]  # 127.0.0.1, not :: or 0.0.0.0


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_stops_every_rank_with_one_line(tmp_path, tiny_model_dir):
    run = _two_ranks(tmp_path, tiny_model_dir, "--trainer.callbacks+", "user_strategies.FailOnRank",
                     "--trainer.callbacks.kill", "true")
    assert run["code"] == 1, run["stderr"][-4000:]
    assert run["stderr"].strip().splitlines()[-1] == (
        "rllight: error: rank 1 was killed by SIGKILL (the out-of-memory killer sends it: see dmesg); every rank "
        "stopped")
