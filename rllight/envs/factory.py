"""Any class written to TRL's ``environment_factory`` contract, as an rllight environment.

The contract (TRL's ``GRPOTrainer(environment_factory=...)``, which OpenEnv, OpenReward and Harbor also plug
into): one object per episode, made with no arguments; ``reset(**row)`` starts it from the prompt row's fields
and may return text added to the prompt; each public method is a tool the model may call, described to the
model by its docstring and type hints; ``get_reward()`` scores the episode. ``FactoryEnvironment`` runs such a
class unchanged:

- the tools' JSON schemas come from ``transformers.utils.get_json_schema`` (the docstring's ``Args:`` section and
  the type hints), and the model's chat template renders them into the prompt in its own format;
- a model turn's tool calls are read in the model's own format (``rllight.envs.tool_calls``), each runs in
  order, and its result (or the error it raised, as text) goes back as a ``tool`` message; a turn without a
  tool call is the answer and ends the episode;
- the episode's reward is ``get_reward()`` when it ends (answered, out of turns or out of tokens), and it
  counts as correct when that reward is positive.

What ``factory`` may name is checked before anything is called (``environment_maker``): a class with ``reset`` and
the reward method, or a Python function whose return annotation is such a class. Nothing of the standard library or
the builtins is imported or called (``os.system``, ``subprocess.run``, ``builtins.eval`` are refused in one line).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import typing

from rllight.bounds import AtLeastTwo, PositiveFiniteFloat, PositiveInt
from rllight.envs.base import Environment, StepResult
from rllight.envs.tool_calls import ToolCall, parse_tool_calls
from rllight.errors import RecipeError

KEY = "model.environment.init_args"
_NOT_TOOLS = {"reset"}


def system_module(module: str) -> bool:
    """Whether ``module`` (a dotted name) is part of the standard library or the builtins: what a recipe's setting
    that names something to call may never name (``os.system``, ``subprocess.run``, ``builtins.eval``)."""
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "builtins"


def refuse_system(path: str, key: str, what: str) -> None:
    """A one-line ``RecipeError`` naming ``key`` where the import path ``path`` (``module:name`` or
    ``module.name``) is in the standard library or the builtins, before anything is imported; ``what`` says what
    the setting must name instead."""
    module = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
    if system_module(module or path):
        raise RecipeError(f"{key}: {path!r} is in Python's standard library, which a recipe may not call; name "
                          f"{what} (docs/guides/security.md)")


def import_object(path: str, key: str):
    """The object at ``package.module:name`` or ``package.module.name``; a one-line ``RecipeError`` naming
    ``key`` when it cannot be imported, or when it is in the standard library or the builtins (not imported)."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise RecipeError(f"{key} must be an import path such as my_pkg.envs.MyEnv, got {path!r}")
    refuse_system(path, key, "a class of your own (or of an installed package) written to the contract")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise RecipeError(f"{key}: cannot import {path!r} ({type(err).__name__}: {err})") from None


def environment_maker(obj, path: str, reward_method: str, key: str):
    """``obj`` (what ``path`` names) if it is what TRL's ``environment_factory`` contract allows, checked without
    calling it: a class with a ``reset`` method and ``reward_method``, or a Python function whose return annotation is
    such a class (``def make_env() -> MyEnv``). Anything else (a builtin, a function that does not say what it makes,
    a class or function of the standard library, an object) is a one-line ``RecipeError`` naming ``key``."""
    _refuse_system_object(obj, path, key)
    made = obj
    if inspect.isfunction(obj):
        try:
            made = typing.get_type_hints(obj).get("return")
        except Exception:  # noqa: BLE001 - an annotation that does not resolve: the function does not say
            made = None
        if not inspect.isclass(made) or made is type(None):
            raise RecipeError(f"{key}: {path} is a function that does not say what it makes; name the environment "
                              f"class itself, or annotate the function's return with it (def {obj.__name__}() -> "
                              "MyEnv)")
        _refuse_system_object(made, path, key)
    elif not inspect.isclass(obj):
        raise RecipeError(f"{key}: {path} is a {type(obj).__name__}, not an environment class; name a class written "
                          "to the contract (reset, tools, get_reward), or a function annotated to return one")
    if not callable(getattr(made, "reset", None)):
        raise RecipeError(f"{key}: {made.__name__} has no reset method; an environment class starts each episode with "
                          "reset(**row) (TRL's environment_factory contract)")
    if not callable(getattr(made, reward_method, None)):
        raise RecipeError(f"{KEY}.reward_method: {path} has no method {reward_method!r}; write one that "
                          "returns the episode's reward, or name it here")
    return obj


def _refuse_system_object(obj, path: str, key: str) -> None:
    """A one-line ``RecipeError`` where ``obj`` was defined in the standard library or the builtins (``os.system``
    imported into a user's module under another name)."""
    module = getattr(obj, "__module__", None) or "builtins"
    if system_module(module):
        raise RecipeError(f"{key}: {path} is {module}.{getattr(obj, '__name__', type(obj).__name__)} of Python's "
                          "standard library, which a recipe may not call; name an environment class of your own "
                          "(docs/guides/security.md)")


def tool_methods(obj, exclude: set[str]) -> dict:
    """The public methods of ``obj`` that are tools: callables whose name does not start with ``_``, other than
    ``exclude``, in the order the class defines them."""
    names = [n for n in dict.fromkeys(n for c in reversed(type(obj).__mro__[:-1]) for n in vars(c))
             if not n.startswith("_") and n not in exclude]
    return {n: getattr(obj, n) for n in names if inspect.ismethod(getattr(obj, n, None))}


def _render(value) -> str:
    """A tool's return value as the text the model reads (JSON for structured values)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class FactoryEnvironment(Environment):
    """Episodes of a class written to TRL's environment contract (see the module's docstring).

    Args:
        factory: Import path of the class (``my_pkg.envs.IncrementEnv``), or of a Python function annotated to
            return it (``def make_env() -> IncrementEnv``); checked before it is called, never in the standard library.
        factory_args: Keyword arguments of ``factory`` (TRL calls it without any).
        reward_method: The method that scores the episode.
        max_turns: Most model turns per episode (tool calls and the answer).
        max_total_tokens: Most tokens in an episode's context, prompt included.
        timeout_seconds: Wall-clock limit of one call into an episode (see ``Environment``).
        max_concurrency: Episodes stepped at once within a turn (see ``Environment``).
    """

    observation_role = "tool"

    def __init__(self, factory: str, factory_args: dict | None = None, reward_method: str = "get_reward",
                 max_turns: PositiveInt = 4, max_total_tokens: AtLeastTwo = 1024,
                 timeout_seconds: PositiveFiniteFloat | None = Environment.DEFAULT_TIMEOUT,
                 max_concurrency: PositiveInt = 8):
        super().__init__(max_turns=max_turns, max_total_tokens=max_total_tokens, timeout_seconds=timeout_seconds,
                         max_concurrency=max_concurrency)
        self.factory = factory
        if not isinstance(reward_method, str) or not reward_method.isidentifier() or reward_method.startswith("_"):
            raise RecipeError(f"{KEY}.reward_method must name a public method (e.g. get_reward), got {reward_method!r}")
        self._make = environment_maker(import_object(factory, f"{KEY}.factory"), factory, reward_method,
                                       f"{KEY}.factory")
        self.factory_args = dict(factory_args or {})
        self.reward_method = reward_method
        self.obj = None
        self._tools: dict = {}
        self._schemas: list[dict] | None = None

    def reset(self, row: dict) -> str | None:
        self.obj = self._make(**self.factory_args)
        self._tools = tool_methods(self.obj, _NOT_TOOLS | {self.reward_method})
        from transformers.utils import get_json_schema

        self._schemas = [get_json_schema(fn) for fn in self._tools.values()] or None
        fields = {k: v for k, v in row.items() if k != "messages"}
        reset = self.obj.reset
        params = inspect.signature(reset).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            fields = {k: v for k, v in fields.items() if k in {p.name for p in params}}
        return reset(**fields)

    def tools(self) -> list[dict] | None:
        return self._schemas

    def _call(self, call: ToolCall) -> dict:
        """One tool call's ``tool`` message: its result, or what went wrong (the model reads it and may retry)."""
        if call.error is not None:
            text = f"error: {call.error}"
        elif call.name not in self._tools:
            text = f"error: there is no tool {call.name!r}; the tools are {', '.join(self._tools) or 'none'}"
        else:
            try:
                text = _render(self._tools[call.name](**call.arguments))
            except Exception as err:  # noqa: BLE001 - a tool's error is an observation, as in TRL
                text = f"error: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
        return {"role": "tool", "name": call.name, "content": text}

    def step(self, response_text: str) -> StepResult:
        calls = parse_tool_calls(response_text, self.tokenizer, self._schemas)
        if not calls:
            reward = self.episode_reward()
            return StepResult(None, reward, done=True, correct=reward > 0)
        return StepResult([self._call(call) for call in calls], 0.0, done=False)

    def episode_reward(self) -> float:
        """The object's own score of the episode (``reward_method``)."""
        return float(getattr(self.obj, self.reward_method)())

    def trajectory_reward(self, rewards: list[float]) -> float:
        """``get_reward()`` of the episode's final state, however it ended (an answer, or a limit)."""
        return self.episode_reward()
