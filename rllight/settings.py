"""Groups of ``RLModule``'s options, one dataclass each: ``model.batching`` (how a rollout is cut into updates and
forward passes), ``model.grad_clip`` (the gradient norms the policy's and the critic's updates are clipped to),
``model.guards`` (when a run warns or ends by itself) and ``model.critic_first`` (critic-only updates before the
policy's). In a recipe a group is a mapping (``batching: {minibatch_size: 16}``), merged key by
key over the recipe it overlays; on the command line each field is a key (``--model.batching.ppo_epochs 2``), and
``rllight fit --help`` shows each group with the docstring under each field.

Each field's annotation declares its bound (``rllight.bounds``): the parser refuses a recipe's value out of range
naming the key (``model.batching.ppo_epochs must be an integer >= 1, got 0``), and a group built in Python refuses
it naming ``Class.field``.
"""

from __future__ import annotations

from dataclasses import dataclass

import docstring_parser

from rllight.bounds import NonNegativeInt, PositiveFloat, PositiveInt, bounded


def option_group(cls: type) -> type:
    """The dataclass ``cls`` as a group of options: its generated ``__init__`` checks the bounds its fields declare,
    and the docstring under each field is also written into an ``Args:`` section of the class's docstring, where
    jsonargparse reads each option's help without parsing every class's source for attribute docstrings (its
    ``docstring_parse_attribute_docstrings``, about a second more per parse)."""
    cls.__init__ = bounded(cls.__init__)
    fields = docstring_parser.parse_from_object(cls).params
    args = "\n".join(f"    {field.arg_name}: {' '.join(field.description.split())}" for field in fields)
    cls.__doc__ = f"{cls.__doc__.rstrip()}\n\nArgs:\n{args}\n"
    return cls


@option_group
@dataclass(frozen=True)
class Batching:
    """How a rollout is cut into optimizer updates and forward passes (``model.batching``)."""

    ppo_epochs: PositiveInt = 1
    """Passes over each rollout."""
    minibatch_size: PositiveInt | None = None
    """Responses per optimizer update over all processes, each taking an equal share (None = the whole rollout in
    one update)."""
    micro_batch_size: PositiveInt = 8
    """Responses per forward/backward; gradients accumulate over a minibatch, and the loss is normalised by the
    minibatch's global token (or sequence) count."""
    micro_batch_tokens: PositiveInt | None = None
    """Split minibatches by a token budget instead (rows x padded length per micro-batch), rows grouped by length
    so that little of the budget is padding; the loss normalisation is unchanged (None = by micro_batch_size)."""
    logprob_chunk_size: PositiveInt | None = 1024
    """Compute log-probs and entropy from the hidden states this many positions at a time, so the full (B, T, V)
    float32 logits never exist (same values and gradients); None = one pass over the full logits."""


@option_group
@dataclass(frozen=True)
class GradClip:
    """Gradient-norm clipping of each update (``model.grad_clip``): the policy's and the critic's parameters are
    clipped each to its own norm, so that a jointly trained critic does not scale the policy's step."""

    policy: PositiveFloat | None = 1.0
    """The largest norm of the policy's gradients (``train/policy/grad_norm`` is the norm before clipping; None =
    no clipping)."""
    critic: PositiveFloat | None = 1.0
    """The largest norm of the critic's gradients, its groups (e.g. backbone and head) together
    (``train/value/grad_norm``; None = no clipping)."""


@option_group
@dataclass(frozen=True)
class Guards:
    """When a run warns or ends by itself (``model.guards``): updates that are not finite, rewards that fail,
    rollouts with nothing to learn from. A run that ends by a guard is saved and says why in one line."""

    max_consecutive_skips: PositiveInt = 3
    """An update whose loss or gradient is not finite is skipped and logged (``guard/skipped_updates``); this many
    in a row stop the run."""
    max_failed_reward_steps: PositiveInt = 3
    """A training batch on which the reward failed for every sample (it raised or returned a non-finite value) is a
    warning; this many in a row stop the run with one line."""
    max_steps_without_update: PositiveInt | None = 20
    """This many RL steps in a row with no update (every rollout empty after the filters) end the run, saved, with
    one line (None = never)."""
    zero_gradient_warning_steps: PositiveInt | None = 5
    """Warn after this many RL steps in a row whose every policy update had a zero gradient (every advantage 0, or
    every token masked or clipped; None = never)."""
    max_zero_gradient_steps: PositiveInt | None = 50
    """End the run, saved, after this many such RL steps in a row (None = never)."""


@option_group
@dataclass(frozen=True)
class CriticFirst:
    """Critic-only updates on each fresh rollout before its values and advantages are recomputed and the policy
    updates (``model.critic_first``; needs ``model.critic``). Set one of the two; both 0 = joint updates."""

    steps: NonNegativeInt = 0
    """Critic-only optimizer steps, one minibatch each (the first epoch's in turn, cycling): VAPO's K_v = 4."""
    epochs: NonNegativeInt = 0
    """Instead, passes of critic-only updates over all the rollout's minibatches."""

    @property
    def enabled(self) -> bool:
        """Whether critic-only updates come first (either count set)."""
        return bool(self.steps or self.epochs)


__all__ = ["Batching", "CriticFirst", "GradClip", "Guards", "option_group"]
