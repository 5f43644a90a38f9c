"""The launch settings of a run on several devices or machines, checked before any process group starts
(``rllight.app.launch`` runs the checks, and reports a failing rank).

- **Checks** (``launch_problem``, a pure function of the environment): what Lightning's cluster environment will read
  (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``, ``WORLD_SIZE``, torchrun's and SLURM's counts)
  against ``trainer.devices`` and ``trainer.num_nodes``. Each mistake is one ``RecipeError`` line, where it used to
  be a rendezvous that waits out its timeout (``NODE_RANK=5`` of 2 nodes) or a long torch traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Callable, Iterator, Mapping

from rllight.errors import RecipeError


def env_integer(env: Mapping[str, str], name: str) -> int | str | None:
    """``env[name]`` as an int, the raw text where it is not one, None where unset."""
    value = env.get(name)
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return value


_INTEGERS = {"NODE_RANK": "set it on each node to that node's index ({nodes})",
             "GROUP_RANK": "it is this node's index ({nodes})",
             "LOCAL_RANK": "it is the process's device index on its node",
             "WORLD_SIZE": "it is the number of processes of the run",
             "LOCAL_WORLD_SIZE": "it is the number of processes on each node",
             "MASTER_PORT": "set it to a free port of node 0 (1 .. 65535)"}
"""The launch settings Lightning reads as integers (some while it builds the ``Trainer``), and what each one is."""


def unreadable_setting(env: Mapping[str, str], num_nodes: int) -> str | None:
    """The first launch setting in ``env`` that is not the integer it must be, in one line, or None."""
    for name, what in _INTEGERS.items():
        value = env_integer(env, name)
        if isinstance(value, str):
            return f"{name}={value!r} is not an integer; " + what.format(nodes=f"0 .. {num_nodes - 1}")
    return None


@contextlib.contextmanager
def launch_settings(num_nodes: int) -> Iterator[None]:
    """Around the building of Lightning's ``Trainer``, which reads ``NODE_RANK`` and ``LOCAL_RANK`` with ``int()``:
    a setting that is not an integer is one line, not Lightning's ``ValueError`` traceback."""
    try:
        yield
    except ValueError as err:
        problem = unreadable_setting(os.environ, num_nodes if isinstance(num_nodes, int) else 1)
        if problem is None or isinstance(err, RecipeError):
            raise
        raise RecipeError(problem) from None


def _node_rank_problem(env: Mapping[str, str], num_nodes: int) -> str | None:
    """``NODE_RANK`` (or ``GROUP_RANK``, which Lightning reads in its place) is this node's index."""
    name = "NODE_RANK" if "NODE_RANK" in env or "GROUP_RANK" not in env else "GROUP_RANK"
    value = env_integer(env, name)
    nodes = f"0 .. {num_nodes - 1}"
    if value is None:
        if num_nodes > 1:
            return (f"trainer.num_nodes is {num_nodes} but NODE_RANK is not set: set it on each node to that node's "
                    f"index ({nodes}), or launch with torchrun or srun")
        return None
    if isinstance(value, str):
        return unreadable_setting({name: value}, num_nodes)
    if not 0 <= value < num_nodes:
        fix = "on one machine, unset it" if num_nodes == 1 else f"each node's {name} is its index, {nodes}"
        return f"{name}={value} is out of range for trainer.num_nodes {num_nodes}: {fix}"
    return None


def _world_problem(env: Mapping[str, str], devices: int, num_nodes: int, launcher: str) -> str | None:
    """``WORLD_SIZE`` and ``LOCAL_RANK`` of processes started by someone else agree with the recipe's counts."""
    world, local = env_integer(env, "WORLD_SIZE"), env_integer(env, "LOCAL_RANK")
    hint = " (torchrun: --nproc-per-node trainer.devices, --nnodes trainer.num_nodes)" if launcher == "torchrun" else ""
    if isinstance(world, str) or (world is not None and world != devices * num_nodes):
        return (f"WORLD_SIZE={world} (the processes the launcher started) but trainer.devices x trainer.num_nodes = "
                f"{devices} x {num_nodes} = {devices * num_nodes}; make them agree{hint}")
    if isinstance(local, str) or (local is not None and not 0 <= local < devices):
        return (f"LOCAL_RANK={local!r} is not a device index of this node: trainer.devices is {devices} "
                f"(0 .. {devices - 1})")
    local_world = env_integer(env, "LOCAL_WORLD_SIZE") if launcher == "torchrun" else None
    if local_world is not None and local_world != devices:
        return (f"LOCAL_WORLD_SIZE={local_world} (torchrun's --nproc-per-node) but trainer.devices is {devices}; "
                "make them agree")
    return None


def _slurm_problem(env: Mapping[str, str], devices: int, num_nodes: int) -> str | None:
    """SLURM's task counts agree with the recipe's (Lightning checks the same, later, with a traceback)."""
    for name, option, want, key in (("SLURM_NTASKS_PER_NODE", "--ntasks-per-node", devices, "trainer.devices"),
                                    ("SLURM_NNODES", "--nodes", num_nodes, "trainer.num_nodes"),
                                    ("SLURM_NTASKS", "--ntasks", devices * num_nodes,
                                     "trainer.devices x trainer.num_nodes")):
        value = env_integer(env, name)
        if isinstance(value, int) and value != want:  # other forms ("8(x2)") are Lightning's to read
            return f"{name}={value} (#SBATCH {option}) but {key} is {want}; make them agree"
    return None


def _address_problem(env: Mapping[str, str], num_nodes: int, spawns: bool,
                     resolve: Callable[[str], str | None], port_free: Callable[[int], bool]) -> str | None:
    """Node 0's address and port: given on several nodes, resolvable, a port number, free on node 0 when this process
    is about to host the rendezvous there."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if num_nodes > 1 and name not in env:
            return (f"trainer.num_nodes is {num_nodes} but {name} is not set: set MASTER_ADDR and MASTER_PORT on every "
                    "node to node 0's address and a free port there")
    port = env_integer(env, "MASTER_PORT")
    if isinstance(port, str) or (port is not None and not 0 < port < 65536):
        return f"MASTER_PORT={port!r} is not a port number (1 .. 65535)"
    address = env.get("MASTER_ADDR")
    if address is not None:
        why = resolve(address)
        if why is not None:
            fix = "node 0's address or host name" if num_nodes > 1 else "127.0.0.1 (or unset it on one machine)"
            return f"MASTER_ADDR={address!r} does not resolve to an address ({why}); set it to {fix}"
    node = env_integer(env, "NODE_RANK") if "NODE_RANK" in env else env_integer(env, "GROUP_RANK")
    if spawns and port is not None and not node and not port_free(port):
        return (f"MASTER_PORT={port} is in use on this machine, where node 0 hosts the rendezvous; choose a free port"
                + (" (or unset MASTER_PORT: one is picked)" if num_nodes == 1 else ""))
    return None


def resolve_error(address: str) -> str | None:
    """Why ``address`` does not resolve (the resolver's words), or None where it does."""
    try:
        socket.getaddrinfo(address, None)
    except (OSError, UnicodeError) as err:
        return getattr(err, "strerror", None) or str(err)
    return None


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` on every interface, as torch's rendezvous store does (with the same
    ``SO_REUSEADDR``, so a port left in TIME_WAIT by an earlier run counts as free, as it is for the store)."""
    for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False  # any other error (no IPv6 here) says nothing about the port
    return True


def launch_problem(env: Mapping[str, str], launcher: str, devices: int, num_nodes: int,
                   resolve: Callable[[str], str | None] = resolve_error,
                   port_free: Callable[[int], bool] = port_is_free) -> str | None:
    """What is wrong with the launch settings of a run of ``devices`` processes on each of ``num_nodes`` machines, in
    one line, or None.

    Args:
        env: The environment (``os.environ``).
        launcher: Who starts the processes, as Lightning's cluster environment says: ``lightning`` (Lightning starts
            one per device, or a user's own launcher sets ``LOCAL_RANK``), ``torchrun``, ``slurm``, or ``other``
            (not checked).
        devices: ``trainer.devices`` (processes per machine).
        num_nodes: ``trainer.num_nodes``.
        resolve: Why a host name does not resolve, or None (``resolve_error``).
        port_free: Whether a port is free here (``port_is_free``), asked only of the process that is about to
            host the rendezvous (Lightning's launch on node 0, before it starts the other ranks).
    """
    if launcher == "lightning":
        external = "LOCAL_RANK" in env  # a launcher of the user's own started the processes
        problem = _node_rank_problem(env, num_nodes) or (
            _world_problem(env, devices, num_nodes, launcher) if external else None)
        return problem or _address_problem(env, num_nodes, not external, resolve, port_free)
    if launcher == "torchrun":  # torchrun sets every variable, and its own agent holds the port
        problem = _world_problem(env, devices, num_nodes, launcher)
        return problem or _address_problem(env, num_nodes, False, resolve, port_free)
    if launcher == "slurm":
        return _slurm_problem(env, devices, num_nodes)
    return None
