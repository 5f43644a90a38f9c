"""Bounds declared by type (``rllight.bounds``): a direct call from Python is refused in one line naming
``Class.parameter``, the parser and the object hold plain numbers, and each bound reads the same from Python and
from a recipe."""

from __future__ import annotations

import pickle

import pytest
from jsonargparse import ArgumentParser

from rllight.bounds import (BOUNDS, AboveOne, ClosedUnitInterval, PositiveFiniteFloat, PositiveInt, bound_of, bounded,
                            check_declared, checked)
from rllight.errors import RecipeError
from rllight.strategies import ClippedSurrogate, DynamicSampling, GroupSampler


class Settings:
    """A user's class with bounds.

    Args:
        size: A count.
        clip: A bound above one, or none.
        share: A fraction.
    """

    @bounded
    def __init__(self, size: PositiveInt = 2, clip: AboveOne | None = None, share: ClosedUnitInterval = 0.5):
        self.size, self.clip, self.share = size, clip, share


class Child(Settings):
    def __init__(self, size: int = 3):  # not decorated: the parent's check names the child's class
        super().__init__(size=size)


@pytest.mark.parametrize("call, message", [
    (lambda: Settings(0), "Settings.size must be an integer >= 1, got 0"),
    (lambda: Settings(size=2.5), "Settings.size must be an integer >= 1, got 2.5"),
    (lambda: Settings(size=True), "Settings.size must be an integer >= 1, got True"),
    (lambda: Settings(clip=1.0), "Settings.clip must be a number > 1 or null, got 1.0"),
    (lambda: Settings(share=float("nan")), "Settings.share must be a number in [0, 1], got nan"),
    (lambda: Settings(2, None, "half"), "Settings.share must be a number in [0, 1], got 'half'"),
    (lambda: Child(-1), "Child.size must be an integer >= 1, got -1"),
    (lambda: GroupSampler(group_size=0), "GroupSampler.group_size must be an integer >= 1, got 0"),
    (lambda: DynamicSampling(group_size=1), "DynamicSampling.group_size must be an integer >= 2, got 1"),
    (lambda: ClippedSurrogate(clip_low=1.0), "ClippedSurrogate.clip_low must be a number in (0, 1), got 1.0"),
])
def test_a_direct_call_out_of_bounds_is_one_line_naming_the_class_and_parameter(call, message):
    with pytest.raises(RecipeError) as err:
        call()
    assert str(err.value) == message


def test_the_parser_and_the_object_hold_plain_numbers():
    """The parse checks the bound and keeps the plain number (a YAML dump of the recipe writes it whatever the
    parameter it reaches), and the object stores plain numbers: it pickles by value and computes as before."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Settings, "settings")
    config = parser.parse_args(["--settings.size", "3", "--settings.clip", "2", "--settings.share", "1"])
    assert (type(config.settings.size), type(config.settings.clip)) == (int, float)
    assert "size: 3" in parser.dump(config)
    made = parser.instantiate(config).settings
    assert (made.size, made.clip, made.share) == (3, 2.0, 1.0)
    assert (type(made.size), type(made.clip), type(made.share)) == (int, float, float)
    assert vars(pickle.loads(pickle.dumps(made))) == vars(made)
    assert type(Settings(size=4.0).size) is int and Settings(clip=None).clip is None


def test_the_parser_refuses_the_same_values_and_help_shows_the_bound(capsys):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Settings, "settings")
    with pytest.raises(Exception, match="Not of type PositiveInt"):
        parser.parse_args(["--settings.size", "0"])
    parser.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "--settings.size SIZE A count. (type: PositiveInt, default: 2)" in text
    assert "(type: AboveOne | null, default: null)" in text


def test_every_bound_has_its_words_and_refuses_its_edge():
    assert {kind.__name__: bound_of(kind.__name__) for kind in BOUNDS} == {kind.__name__: text for kind, text in
                                                                         BOUNDS.items()}
    assert bound_of("int") is None
    for kind, (inside, outside) in {PositiveInt: (1, 0), AboveOne: (1.5, 1.0), ClosedUnitInterval: (1.0, 1.01),
                                    PositiveFiniteFloat: (1e300, float("inf"))}.items():
        assert checked("key", inside, kind) == inside
        with pytest.raises(RecipeError) as err:
            checked("key", outside, kind)
        assert str(err.value) == f"key must be {BOUNDS[kind]}, got {outside}"


def test_a_value_carried_to_a_plainly_typed_parameter_still_dumps():
    """A changed ``class_path`` carries the init_args its new class shares (``size``) to a parameter typed ``int``:
    the recipe is still written as YAML (with jsonargparse's own constrained types the value stayed an instance of
    the type, which the dump refused)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--thing", type=Settings)
    config = parser.parse_args(["--thing", f"{__name__}.Settings", "--thing.size", "3", "--thing", f"{__name__}.Child"])
    assert config.thing.class_path.endswith(".Child") and config.thing.init_args.size == 3
    assert "size: 3" in parser.dump(config)


class Placed:
    """A part whose recipe key is known only when its owner binds it (as a serving placement): not decorated."""

    def __init__(self, count: PositiveInt = 1, wait: PositiveFiniteFloat | None = None):
        self.count, self.wait = count, wait


class PlacedChild(Placed):
    def __init__(self, share: ClosedUnitInterval = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.share = share


def test_a_part_checked_when_bound_names_its_recipe_key():
    where = "model.reward.init_args.placement.init_args"
    for part, message in [(Placed(count=0), f"{where}.count must be an integer >= 1, got 0"),
                          (Placed(wait=float("inf")), f"{where}.wait must be a finite number > 0 or null, got inf"),
                          (PlacedChild(count=0), f"{where}.count must be an integer >= 1, got 0"),  # a base's bound
                          (PlacedChild(share=2), f"{where}.share must be a number in [0, 1], got 2")]:
        with pytest.raises(RecipeError) as err:
            check_declared(part, where)
        assert str(err.value) == message
    part = PlacedChild(count=2.0, share=1)
    check_declared(part, where)
    assert (type(part.count), type(part.share), part.wait) == (int, float, None)  # plain numbers, None kept
