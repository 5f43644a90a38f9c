"""Bounds declared by type: a setting's annotation says its range (``group_size: PositiveInt``), so ``--help`` shows
it, the parser refuses a recipe's value out of range naming the key (``rllight.app.command_line``), and no key is typed
twice.

The types are rllight's own, registered with jsonargparse: its parse checks the value and hands on the plain
``int`` or ``float`` (jsonargparse's constrained types of the same names hand on an instance of the type, which a
YAML dump of the recipe cannot write once a changed ``class_path`` carries it to a plainly typed parameter).
``BOUNDS`` says in words what each allows. A constructor called from Python is not parsed: ``@bounded`` on its
``__init__`` checks each argument against its annotation (``X`` or ``X | None``) and refuses a value out of range
with one ``RecipeError`` naming ``Class.parameter``, before the body runs.
"""

from __future__ import annotations

import functools
import inspect
import math
import types
import typing
from collections.abc import Callable

from jsonargparse.typing import register_type

from rllight.errors import RecipeError

BOUNDS: dict[type, str] = {}
"""Each bound type and its range in words (what an error says the value must be)."""
_TESTS: dict[type, Callable[[float], bool]] = {}


def plain(kind: type, value):
    """``value`` as the plain ``int`` or ``float`` that the bound type ``kind`` allows; a ``ValueError`` saying
    ``got <value>`` where it is not a number of that kind or is out of range (jsonargparse prefixes ``Not of type
    <kind>:``)."""
    base = int if issubclass(kind, int) else float
    try:
        number = base(value)
    except (TypeError, ValueError):
        number = None
    if (number is None or isinstance(value, bool) or (base is int and isinstance(value, float) and value != number)
            or not _TESTS[kind](number)):
        raise ValueError(f"got {value}")
    return number


def _declare(name: str, base: type, words: str, test: Callable[[float], bool]) -> type:
    """A bound type: ``base`` restricted to the numbers that pass ``test``, registered with jsonargparse."""
    kind = type(name, (base,), {"__doc__": f"{base.__name__}, {words}", "__module__": __name__})
    BOUNDS[kind], _TESTS[kind] = words, test
    register_type(kind, serializer=base, deserializer=functools.partial(plain, kind), type_check=lambda v, t: False)
    return kind


PositiveInt = _declare("PositiveInt", int, "an integer >= 1", lambda v: v >= 1)
NonNegativeInt = _declare("NonNegativeInt", int, "an integer >= 0", lambda v: v >= 0)
AtLeastTwo = _declare("AtLeastTwo", int, "an integer >= 2", lambda v: v >= 2)
PositiveFloat = _declare("PositiveFloat", float, "a number > 0", lambda v: v > 0)
PositiveFiniteFloat = _declare("PositiveFiniteFloat", float, "a finite number > 0", lambda v: 0 < v < math.inf)
NonNegativeFloat = _declare("NonNegativeFloat", float, "a number >= 0", lambda v: v >= 0)
NonNegativeFiniteFloat = _declare("NonNegativeFiniteFloat", float, "a finite number >= 0", lambda v: 0 <= v < math.inf)
AboveOne = _declare("AboveOne", float, "a number > 1", lambda v: v > 1)
ClosedUnitInterval = _declare("ClosedUnitInterval", float, "a number in [0, 1]", lambda v: 0 <= v <= 1)
OpenUnitInterval = _declare("OpenUnitInterval", float, "a number in (0, 1)", lambda v: 0 < v < 1)
UpToOne = _declare("UpToOne", float, "a number in (0, 1]", lambda v: 0 < v <= 1)
Correlation = _declare("Correlation", float, "a number in [-1, 1)", lambda v: -1 <= v < 1)

_BY_NAME = {kind.__name__: kind for kind in BOUNDS}


def bound_of(name: str) -> str | None:
    """The range in words of the bound type called ``name`` (as jsonargparse's errors name it), or None."""
    kind = _BY_NAME.get(name)
    return None if kind is None else BOUNDS[kind]


def checked(key: str, value, kind: type, none: bool = False):
    """``value`` as the plain number the bound ``kind`` allows (None where ``none``), or a one-line ``RecipeError``
    naming ``key``, the range and the value."""
    if value is None and none:
        return None
    try:
        return plain(kind, value)
    except ValueError:
        null = " or null" if none else ""
        raise RecipeError(f"{key} must be {BOUNDS[kind]}{null}, got {value!r}") from None


def _declared(annotation: object) -> tuple[type, bool] | None:
    """``(bound type, None allowed)`` where ``annotation`` is a bound type or one of them ``| None``; else None."""
    if annotation in BOUNDS:
        return annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        bounds = [arg for arg in args if arg in BOUNDS]
        if len(bounds) == 1 and set(args) == {bounds[0], type(None)}:
            return bounds[0], True
    return None


def _bounds_of(function) -> dict[str, tuple[type, bool]]:
    """The parameters of ``function`` annotated with a bound (annotations written as strings are evaluated in its
    module; one that names what only type checkers import is not a bound and is skipped)."""
    found = {}
    for name, parameter in inspect.signature(function).parameters.items():
        annotation = parameter.annotation
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, function.__globals__)  # noqa: S307 - the module's own annotation
            except Exception:  # noqa: BLE001 - e.g. a name imported under TYPE_CHECKING: not a bound
                continue
        declared = _declared(annotation)
        if declared is not None:
            found[name] = declared
    return found


def check_declared(owner, where: str) -> None:
    """Check the settings of ``owner`` that its class's ``__init__`` (or a base's) declares bounded, held as the
    attributes of the same names, and set each to its plain number: for a part whose recipe key ``where`` is known
    only when it is bound (a serving placement), so that its one-line ``RecipeError`` names ``where.<parameter>``."""
    bounds: dict[str, tuple[type, bool]] = {}
    for cls in reversed(type(owner).__mro__):
        init = vars(cls).get("__init__")
        if inspect.isfunction(init):
            bounds.update(_bounds_of(inspect.unwrap(init)))
    for name, (kind, none) in bounds.items():
        setattr(owner, name, checked(f"{where}.{name}", getattr(owner, name), kind, none))


def bounded(init):
    """Decorate ``__init__`` so that a call from Python checks each bound its annotations declare (see the module)
    and the body gets plain numbers; the signature and docstring jsonargparse reads are the function's own."""
    bounds: dict[str, tuple[type, bool]] | None = None
    signature = inspect.signature(init)

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        nonlocal bounds
        if bounds is None:  # at the first call: every name of the module is defined by then
            bounds = _bounds_of(init)
        call = signature.bind(self, *args, **kwargs)
        for name, (kind, none) in bounds.items():
            if name in call.arguments:
                call.arguments[name] = checked(f"{type(self).__name__}.{name}", call.arguments[name], kind, none)
        return init(*call.args, **call.kwargs)

    return checked_init


__all__ = ["BOUNDS", "AboveOne", "AtLeastTwo", "ClosedUnitInterval", "Correlation", "NonNegativeFiniteFloat",
           "NonNegativeFloat", "NonNegativeInt", "OpenUnitInterval", "PositiveFiniteFloat", "PositiveFloat",
           "PositiveInt", "UpToOne", "bound_of", "bounded", "check_declared", "checked", "plain"]
