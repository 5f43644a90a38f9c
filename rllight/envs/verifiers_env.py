"""verifiers' environments (Prime Intellect's ``verifiers`` 0.4, ``verifiers.v1``), played in process by rllight's
policy (``bash tools/install.sh verifiers``).

A verifiers environment is a ``vf.Env`` whose ``run(task, agents)`` drives the conversation: it opens an exchange
with a seat (``agents.<seat>.interaction(task)``), asks for the model's reply (``await exchange.turn(message)``),
and answers it (feedback, a game's next observation); the task's ``@vf.reward`` functions score the finished
trace. verifiers normally serves the model turns from an OpenAI endpoint through its harness programs. Here the
environment's own coroutine runs on an event loop of this process and waits at every model turn for the text
rllight's policy sampled: ``reset`` starts it and returns at its first model turn, each ``step`` hands it one
model turn and returns at the next one (what the environment said since is the observation), and the episode
is done when ``run`` returns; the trace's reward (the weighted sum of the task's rewards) is the trajectory's.
Only text goes back and forth: the trained tokens stay the ones the policy sampled.

What runs as in verifiers: ``Env.setup``, ``Env.run``, ``Env.finalize``; the task's ``setup``, ``finalize``,
``@vf.metric``, ``@vf.reward`` and ``@vf.stop`` (on the trace, the request or the response); the seat's
``max_turns``; the task's ``vf.Toolset`` tool servers (``Task.toolsets``, ``Taskset.toolsets``), served in process
by ``mcp``'s ``MCPServer``, their tools offered to the model as JSON schemas and its calls read in its own format
(``rllight.envs.tool_calls``). A plain taskset (no ``Env``) plays as verifiers' ``SingleAgentEnv``: one answer.
What does not: harness programs (``bash``, ``codex``, ...), runtimes (containers, sandboxes: a hook that needs its
``runtime`` gets None), ``@vf.intercept``, a seat that is not the policy (``trainable = False``, e.g. user-sim's
modeled user), a second exchange of the policy in one episode, a task's prompt changed by ``run`` before it opens
the exchange (the model's prompt is the row's), the seat's sampling and token caps (rllight's engine and limits
apply), a toolset's own ``State`` kept across calls.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import threading
import typing
import weakref

from rllight.bounds import AtLeastTwo, PositiveFiniteFloat, PositiveInt
from rllight.envs.base import Environment, StepResult
from rllight.envs.factory import refuse_system, system_module
from rllight.envs.tool_calls import parse_tool_calls
from rllight.envs.verifiers_play import STOP, Play
from rllight.errors import RecipeError, install_hint

INSTALL = install_hint("verifiers")

TASK_FIELD = "verifiers_task"
"""The field of a row holding its verifiers task data (``TaskData`` as JSON); the rows of
``rllight.data.verifiers_data.VerifiersTask`` have it."""

KEY = "model.environment.init_args"


def require_verifiers(key: str) -> None:
    """A one-line ``RecipeError`` naming ``key`` and the install command unless verifiers 0.4 (``verifiers.v1``) is
    installed; cheap (``verifiers.v1`` itself is not imported), so a recipe fails before the model loads."""
    try:
        import verifiers
    except ImportError:
        raise RecipeError(f"{key} needs verifiers, which is not installed: {INSTALL}") from None
    if importlib.util.find_spec("verifiers.v1") is None:
        version = getattr(verifiers, "__version__", "?")
        raise RecipeError(f"{key} needs verifiers 0.4 (verifiers.v1); verifiers {version} is installed: {INSTALL}")


def import_verifiers(key: str):
    """The ``verifiers.v1`` package (``require_verifiers`` first)."""
    require_verifiers(key)
    import verifiers.v1 as vf

    return vf


def check_settings(load: str | None, env_id: str | None, args: dict | None, key: str) -> dict:
    """The settings naming a verifiers environment, checked without importing it: exactly one of ``load`` (an import
    path ``module:attr`` or ``module.attr``) and ``env_id``, and ``args`` a mapping. Returns ``args`` (a dict)."""
    if (load is None) == (env_id is None):
        raise RecipeError(f"{key}: give exactly one of load (an import path, e.g. my_pkg.envs:load_environment) and "
                          f"env_id (an installed verifiers taskset id, e.g. textarena); got load={load!r}, "
                          f"env_id={env_id!r}")
    if load is not None and (not isinstance(load, str) or not all(_split_path(load))):
        raise RecipeError(f"{key}.load must be an import path module:attr (e.g. my_pkg.envs:load_environment), "
                          f"got {load!r}")
    if load is not None:
        refuse_system(load, f"{key}.load", "your environment module's load_environment, or a vf.Env or vf.Taskset "
                                           "class")
    if env_id is not None and (not isinstance(env_id, str) or not env_id.strip()):
        raise RecipeError(f"{key}.env_id must name a verifiers taskset (e.g. textarena), got {env_id!r}")
    if args is not None and not isinstance(args, dict):
        raise RecipeError(f"{key}.args must be a mapping of keyword arguments, got {type(args).__name__}")
    return dict(args or {})


def _split_path(path: str) -> tuple[str, str]:
    module, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    return module, attr


def loader(vf, load: str, key: str):
    """What ``load`` names, imported and checked without calling it: a ``vf.Env`` or ``vf.Taskset`` class, or a
    Python function that verifiers' convention names ``load_environment`` or whose return annotation is such a class
    (``def load_taskset() -> WordTaskset``). Anything else (a builtin, another function, something of the standard
    library) is a one-line ``RecipeError`` naming ``key``; a module that does not import is one too."""
    module, attr = _split_path(load)
    try:
        obj = getattr(importlib.import_module(module), attr)
    except Exception as err:  # noqa: BLE001 - the module's own import failing is the recipe's to mend
        raise RecipeError(f"{key}: the verifiers environment load={load!r} cannot be imported "
                          f"({type(err).__name__}: {' '.join(str(err).split())[:300]})") from None
    kinds = (vf.Env, vf.Taskset)
    made = obj
    if inspect.isfunction(obj) and obj.__name__ != "load_environment":
        try:
            made = typing.get_type_hints(obj).get("return")
        except Exception:  # noqa: BLE001 - an annotation that does not resolve: the function does not say
            made = None
    ok = (inspect.isclass(made) and issubclass(made, kinds)) or (inspect.isfunction(obj) and made is obj)
    if not ok or system_module(getattr(obj, "__module__", None) or "builtins"):
        raise RecipeError(f"{key}: {load} is not a verifiers loader; name your environment module's "
                          "load_environment, a function annotated to return a vf.Env or vf.Taskset, or such a class "
                          "(docs/guides/security.md)")
    return obj


class Source:
    """A verifiers environment built once per process: its ``Env`` (None for a plain taskset), its ``Taskset``, its
    seats (name -> ``AgentConfig``) and a ``name`` for the rows' ``data_source``. Shared read-only by episodes."""

    def __init__(self, vf, built, name: str, key: str):
        self.vf, self.name = vf, name
        if isinstance(built, vf.Env):
            self.env, self.taskset = built, built.taskset
            from verifiers.v1.configs.agent import agent_config_fields

            self.seats = dict(agent_config_fields(built.config))
        elif isinstance(built, vf.Taskset):
            self.env, self.taskset, self.seats = None, built, {"agent": vf.AgentConfig()}
        else:
            raise RecipeError(f"{key}: the environment is a {type(built).__name__}, not a verifiers Env or Taskset")
        self.task_cls = self.taskset.task_type()
        if self.task_cls.NEEDS_CONTAINER:
            raise RecipeError(f"{key}: {self.task_cls.__name__} needs a container runtime, which rllight does not run")
        if any(hasattr(fn, "intercept") for cls in self.task_cls.__mro__ for fn in vars(cls).values()):
            raise RecipeError(f"{key}: {self.task_cls.__name__} uses @vf.intercept, which rllight does not run")

    def task(self, row: dict):
        """The verifiers task of a row made by ``row``."""
        if TASK_FIELD not in row:
            raise ValueError(f"the row has no '{TASK_FIELD}'; make the rows with "
                             "data.task rllight.data.verifiers_data.VerifiersTask")
        data = self.task_cls.data_type().model_validate(row[TASK_FIELD])
        return self.task_cls(data, self.taskset.config.task)

    def row(self, task) -> dict:
        """An rllight row for a verifiers task: its prompt as chat messages (the system prompt first; one empty user
        message when the environment opens the conversation), its ``answer`` if it has one, and its data."""
        from verifiers.v1.types import content_text

        data = task.data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [{"role": m.role, "content": content_text(m.content)} for m in data.prompt or []]
        if not messages or messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": ""})
        answer = getattr(data, "answer", None)
        return {"prompt": messages, "answer": "" if answer is None else str(answer), "data_source": self.name,
                TASK_FIELD: data.model_dump(mode="json", exclude_defaults=True)}


_SOURCES: dict[str, Source] = {}
_SOURCES_LOCK = threading.Lock()


def load_source(load: str | None, env_id: str | None, args: dict, key: str) -> Source:
    """The verifiers environment the settings name (see ``check_settings``), built on first use and then shared by
    every caller in this process: ``load`` is called with ``args``; ``env_id`` is a taskset id, built as
    ``vf.load_environment`` builds it, with ``args`` its taskset settings."""
    cache = json.dumps([load, env_id, args], sort_keys=True, default=repr)
    with _SOURCES_LOCK:
        if cache in _SOURCES:
            return _SOURCES[cache]
        vf = import_verifiers(key)
        make = loader(vf, load, key) if load is not None else None  # checked before it is called
        try:
            if make is not None:
                built = make(**args)
            else:
                config = vf.resolve_env_config({"taskset": {"id": env_id, **args}})
                built = vf.load_environment(config)
        except Exception as err:  # noqa: BLE001 - an import path, an id or a setting the environment refuses
            what = f"load={load!r}" if load is not None else f"env_id={env_id!r}"
            reason = " ".join(str(err).split())[:300] or type(err).__name__
            raise RecipeError(f"{key}: the verifiers environment {what} with args {args} cannot be built "
                              f"({type(err).__name__}: {reason})") from None
        _SOURCES[cache] = Source(vf, built, load or env_id, key)
        return _SOURCES[cache]


class Verifiers(Environment):
    """A verifiers environment (``verifiers.v1``), played in process by the policy (see the module's docstring).

    Its rows come from ``rllight.data.verifiers_data.VerifiersTask`` with the same ``load`` / ``env_id`` and
    ``args``: each row carries its verifiers task, and the model's prompt is the row's. ``reset`` starts the
    environment on the row's task and returns at the policy's first turn (with the environment's opening message
    when it opens the conversation); each ``step`` hands the environment the policy's turn and returns what it said
    next (text, or chat messages such as tool results), reward 0, until the environment is done: then the reward is
    the trace's (the weighted sum of the task's ``@vf.reward`` scores) and the episode is correct when it is at
    least ``solved_at``. An episode rllight ends (``max_turns``, ``max_total_tokens``) is ended in verifiers as its
    own limits end a run (stop condition ``max_turns`` or ``max_total_tokens``) and scored as it stands. The
    environment is built once per process, on first use; every episode has its own task, trace and tool servers.

    Args:
        load: Import path (``module:attr``) of a function or class that returns a ``vf.Env`` (or a ``vf.Taskset``,
            played as verifiers' single-agent environment), called with ``args``: a ``vf.Env`` or ``vf.Taskset``
            class, a function named ``load_environment`` (verifiers' convention) or one annotated to return such a
            class; checked before it is called, never in the standard library.
        env_id: Instead of ``load``: the id of a verifiers taskset (built in, e.g. ``textarena``, or an installed
            environment package), built as ``vf.load_environment`` builds it, with ``args`` its taskset settings.
        args: Keyword arguments of ``load``, or the taskset settings of ``env_id``.
        solved_at: Reward from which an episode counts as correct (for the accuracy metrics).
        max_turns: Most model turns per episode (tool calls included).
        max_total_tokens: Most tokens in an episode's context, prompt included.
        timeout_seconds: Wall-clock limit of one call into an episode (see ``Environment``).
        max_concurrency: Episodes stepped at once within a turn (see ``Environment``).
    """

    def __init__(self, load: str | None = None, env_id: str | None = None, args: dict | None = None,
                 solved_at: float = 1.0, max_turns: PositiveInt = 8, max_total_tokens: AtLeastTwo = 2048,
                 timeout_seconds: PositiveFiniteFloat | None = Environment.DEFAULT_TIMEOUT,
                 max_concurrency: PositiveInt = 8):
        super().__init__(max_turns=max_turns, max_total_tokens=max_total_tokens, timeout_seconds=timeout_seconds,
                         max_concurrency=max_concurrency)
        self.args = check_settings(load, env_id, args, KEY)
        if isinstance(solved_at, bool) or not isinstance(solved_at, (int, float)) or not math.isfinite(solved_at):
            raise RecipeError(f"{KEY}.solved_at must be a number, got {solved_at!r}")
        require_verifiers(KEY)
        self.load, self.env_id, self.solved_at = load, env_id, float(solved_at)
        self._play: Play | None = None
        self._turns = 0

    def reset(self, row: dict) -> str | None:
        if self._play is not None:
            self._play.cancel()
        source = load_source(self.load, self.env_id, self.args, KEY)
        play = self._play = Play(source, source.task(row))
        self._turns = 0
        weakref.finalize(self, play.cancel)  # an episode dropped unfinished (it failed) leaves nothing waiting
        play.start()
        kind, value = play.wait()
        if kind == "ask":
            return "\n".join(m["content"] for m in value) if isinstance(value, list) else value
        if kind == "end":
            raise RuntimeError("the environment ended the episode before the policy's first turn")
        raise value

    def tools(self) -> list[dict] | None:
        return self._play.tools if self._play is not None else None

    def step(self, response_text: str) -> StepResult:
        play = self._play
        self._turns += 1
        play.send((response_text, self._calls(response_text) if play.tools else []))
        kind, value = play.wait()
        if kind == "ask":
            return StepResult(value, 0.0, done=False)
        if kind == "end":
            return StepResult(None, play.reward, done=True, correct=play.reward >= self.solved_at)
        raise value

    def _calls(self, text: str) -> list[tuple]:
        """The tool calls of a model turn, read in the model's own format: ``(verifiers ToolCall, error)`` pairs."""
        from verifiers.v1.types import ToolCall

        calls = parse_tool_calls(text, self.tokenizer, self._play.tools)
        return [(ToolCall(id=f"call_{self._turns}_{k}", name=call.name,
                          arguments="" if call.error else json.dumps(call.arguments)), call.error)
                for k, call in enumerate(calls)]

    def trajectory_reward(self, rewards: list[float]) -> float:
        """The trace's reward; an episode rllight ended while the environment waited for a turn is first ended in
        verifiers (its exchange stopped, then scored)."""
        play = self._play
        if play.reward is None:
            play.stop_reason = "max_turns" if self._turns >= self.max_turns else "max_total_tokens"
            play.send(STOP)
            kind, value = play.wait()
            if kind == "ask":
                play.cancel()
                raise RuntimeError("the environment asked for another turn after its exchange had ended")
            if kind == "error":
                raise value
        return float(play.reward)


__all__ = ["Verifiers", "load_source", "require_verifiers"]
