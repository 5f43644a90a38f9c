"""Scoring passes: the policy's log-probs and entropy, the critic's values and the reference's log-probs of a
rollout's response tokens, with gradients (inside an update) or without (before it), in micro-batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from rllight.algorithms import chunked_logprobs_and_entropy, logprobs_and_entropy
from rllight.fsdp import padding_passes, padding_row
from rllight.models import response_hidden_states
from rllight.precision import Float32Head
from rllight.types import Rollout


class Outputs(NamedTuple):
    """What one forward pass computed for a batch of B rows and T response columns (None where not asked)."""

    logprobs: Tensor | None
    """Shape (B, T): log pi(y_t) of the response tokens."""
    entropy: Tensor | None
    """Shape (B, T): entropy of the policy's distribution at each response position."""
    values: Tensor | None
    """Shape (B, T) from a token-level critic, (B,) from a prompt-level one."""


def micro_batches(rollout: Rollout, size: int, tokens: int | None = None) -> Iterator[tuple[list[int], Rollout]]:
    """Micro-batches of ``rollout`` as ``(rows, micro)``, ``rows`` the indices in ``rollout``: ``size``
    consecutive rows each, or, with a token budget ``tokens``, rows ordered by length (longest first, so that
    each micro-batch holds rows of similar length and pads little) taken as many as fit the budget (rows x
    padded length, at least one row). Each is trimmed to its own longest prompt and response."""
    n = len(rollout)
    if n == 0:
        return
    order = list(range(n))
    if not tokens:
        bounds = [(s, min(s + size, n)) for s in range(0, n, size)]
    else:
        prompt_len = rollout.prompt_mask.sum(-1).tolist()
        resp_len = rollout.span_lengths.tolist()  # observations of a multi-turn row included
        order.sort(key=lambda i: prompt_len[i] + resp_len[i], reverse=True)
        bounds, start, width_p, width_t = [], 0, 0, 0
        for k, i in enumerate(order):
            wp, wt = max(width_p, prompt_len[i]), max(width_t, resp_len[i])
            if k > start and (k - start + 1) * (wp + wt) > tokens:
                bounds.append((start, k))
                start, wp, wt = k, prompt_len[i], resp_len[i]
            width_p, width_t = wp, wt
        bounds.append((start, n))
    for s, e in bounds:
        yield order[s:e], rollout.select(order[s:e]).trim()


class Scoring:
    """The passes of the policy, its critic and its reference over response tokens.

    Only the response positions go through the output layer, so the (B, P + T, V) logits of the prompt are
    never built; with ``chunk_size`` the (B, T, V) float32 logits never exist either.

    Args:
        engine: The rollout engine; its ``temperature`` is the sampling distribution the log-probs are of.
        critic: The value model (None = no values).
        with_reference: A KL term needs reference log-probs.
        micro_batch_size: Rows per forward.
        micro_batch_tokens: A token budget per forward instead (see ``micro_batches``).
        chunk_size: Positions per chunk of the log-prob computation (None = the full logits at once).

    ``policy``, ``ref_policy`` and ``adapters`` are set once the weights load: the reference is the frozen
    ``ref_policy``, or with LoRA (``adapters`` True) the policy with its adapters disabled. Under FSDP, ``net``
    is the root unit that every pass runs inside (``run``; see ``rllight.fsdp``).
    """

    def __init__(self, engine, critic=None, with_reference: bool = False, micro_batch_size: int = 8,
                 micro_batch_tokens: int | None = None, chunk_size: int | None = 1024):
        self.engine = engine
        self.critic = critic
        self.with_reference = with_reference
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.chunk_size = chunk_size
        self.policy: torch.nn.Module | None = None
        self.ref_policy: torch.nn.Module | None = None
        self.adapters = False
        self.net: torch.nn.Module | None = None

    @property
    def sharded(self) -> bool:
        return self.net is not None

    def run(self, fn):
        """``fn()`` (a pass over the models), under FSDP inside the root unit, which gathers its weights."""
        return fn() if self.net is None else self.net(fn)

    def micro_batches(self, rollout: Rollout, layout: Sequence[Tensor] | None = None
                      ) -> Iterator[tuple[list[int], Rollout]]:
        """``micro_batches`` with this scoring's size or token budget. With ``layout`` (row indices of
        ``rollout``, e.g. the minibatches of an update's first epoch) each part is cut into micro-batches on its
        own, as an update over ``rollout.select(part)`` cuts it, and ``rows`` index ``rollout``: each row then
        meets the same other rows, with the same padding, as in that update (see ``score``)."""
        if layout is None:
            yield from micro_batches(rollout, self.micro_batch_size, self.micro_batch_tokens)
            return
        for part in layout:
            index = part.tolist()
            for rows, micro in micro_batches(rollout.select(index), self.micro_batch_size, self.micro_batch_tokens):
                yield [index[r] for r in rows], micro

    def padded_micro_batches(self, rollout: Rollout, layout: Sequence[Tensor] | None = None
                             ) -> list[tuple[list[int] | None, Rollout]]:
        """``micro_batches`` plus, under FSDP, passes on a padding row (rows None) so that this rank runs as many
        as the rank with the most: every rank must call it (a collective), an empty rollout included."""
        parts = list(self.micro_batches(rollout, layout))
        padding = padding_passes(len(parts), self.sharded, rollout.response_mask.device)
        return parts + [(None, padding_row(rollout))] * padding

    def forward(self, batch: Rollout, policy: torch.nn.Module | None = None, with_values: bool = False,
                with_logprobs: bool = True) -> Outputs:
        """Log-probs and entropy of the response tokens under ``policy`` (default: the policy being trained),
        and the critic's values when asked; log-probs and entropy are None when ``with_logprobs`` is False
        (and a separate critic then runs alone)."""
        return self.run(lambda: self._forward(batch, policy, with_values, with_logprobs))

    def _forward(self, batch: Rollout, policy: torch.nn.Module | None, with_values: bool,
                 with_logprobs: bool) -> Outputs:
        policy = self.policy if policy is None else policy
        critic = self.critic if with_values else None
        hidden = logprobs = entropy = values = None
        if with_logprobs or (critic is not None and critic.shared):
            hidden = response_hidden_states(policy.get_decoder(), batch)
        if with_logprobs:
            head = policy.get_output_embeddings()
            if self.chunk_size and isinstance(head, Float32Head):  # HFModel's float32_lm_head
                logprobs, entropy = head.chunked_logprobs_and_entropy(hidden, batch.response_ids,
                                                                      self.engine.temperature, self.chunk_size)
            elif self.chunk_size and type(head) is torch.nn.Linear:
                logprobs, entropy = chunked_logprobs_and_entropy(hidden, head.weight, batch.response_ids,
                                                                 self.engine.temperature, bias=head.bias,
                                                                 chunk_size=self.chunk_size)
            else:  # e.g. an adapter-wrapped output layer: the direct path through its forward
                logprobs, entropy = logprobs_and_entropy(head(hidden), batch.response_ids, self.engine.temperature)
        if critic is not None:
            values = critic.values(batch, hidden)
        return Outputs(logprobs, entropy, values)

    def reference_logprobs(self, batch: Rollout) -> Tensor:
        """Shape (B, T): log-probs under the reference policy."""
        if self.adapters:
            with self.policy.disable_adapter():
                return self.forward(batch).logprobs
        return self.forward(batch, policy=self.ref_policy).logprobs

    @torch.no_grad()
    def score(self, rollout: Rollout, need_old: bool, need_values: bool | None = None,
              need_ref: bool | None = None, layout: Sequence[Tensor] | None = None) -> None:
        """Fill ``rollout``'s old log-probs, values and reference log-probs in micro-batches, without gradients.
        ``need_values`` / ``need_ref`` None: whenever there is a critic / a reference (and the rollout has no
        reference log-probs yet). Every rank calls it, an empty rollout included (under FSDP it runs padding
        passes).

        ``layout``: the update's minibatches (``Updater.plan``), so that each row is scored in the micro-batch
        the update will compute it in. A row's log-prob depends on its micro-batch in low precision: under
        ``bf16-mixed`` the same weights gave log-probs 0.016 apart on average (up to 0.46) in different
        micro-batches of a SmolLM2 rollout (other rows beside it, other padding), against about 1e-6 in float32,
        so old log-probs scored in other micro-batches made the first update's ratio differ from 1 by that
        rounding, and the clip acted on it. Scored in the update's micro-batches, the ratio is exactly 1 where
        the policy has not moved (``tests/test_precision.py``)."""
        need_values = self.critic is not None if need_values is None else need_values
        if need_ref is None:
            need_ref = self.with_reference and rollout.ref_logprobs is None
        if not (need_old or need_values or need_ref):
            return
        olds, values, refs, rows = [], [], [], []
        for index, micro in self.padded_micro_batches(rollout, layout):
            if need_old or need_values:
                out = self.forward(micro, with_values=need_values, with_logprobs=need_old)
                olds.append(out.logprobs)
                values.append(None if out.values is None else self.critic.to_values(out.values))
            if need_ref:
                refs.append(self.reference_logprobs(micro))
            rows.append(index)
        if not len(rollout):  # an empty rank: fields of the right shape, for the estimators every rank runs
            t = rollout.response_mask.shape[1]
            empty = rollout.response_mask.new_zeros((0, t), dtype=torch.float32)
            if need_old:
                rollout.old_logprobs = empty
            if need_values:
                rollout.values = empty[:, 0] if getattr(self.critic, "per_prompt", False) else empty
            if need_ref:
                rollout.ref_logprobs = empty
            return
        n = rows.index(None) if None in rows else len(rows)  # the padding passes (last) give nothing to keep
        olds, values, refs, rows = olds[:n], values[:n], refs[:n], rows[:n]
        mask = rollout.response_mask.float()

        def full(parts: list[Tensor]) -> Tensor:  # each micro-batch's rows back in place, padded to the rollout's T
            shape = (len(rollout), mask.shape[1]) if parts[0].dim() == 2 else (len(rollout),)
            out = parts[0].new_zeros(shape)
            for index, x in zip(rows, parts):
                if x.dim() == 2:
                    out[index, : x.shape[1]] = x
                else:
                    out[index] = x
            return out

        if need_old:
            rollout.old_logprobs = full(olds) * mask
        if need_values:
            v = full(values)
            rollout.values = v * mask if v.dim() == 2 else v
        if need_ref:
            rollout.ref_logprobs = full(refs) * mask
