"""Prompts longer than the model's context: refused, cut or dropped before anything is generated from them
(``data.long_prompts``).

A prompt fits when its tokens (the chat template's, the generation prompt included) plus the longest response
(``max_new_tokens``) fit the model's positions (``config.max_position_embeddings``, or the config's other name for
it). The response counts because the engine generates it after the prompt and the trainer's forward pass takes
both: a prompt that leaves less room than ``max_new_tokens`` would have its responses run past the positions the
model has (an index error for learned position embeddings, quietly worse outputs for rotary ones).

- ``refuse`` (the default): one line naming the first such row (and how many more), and the setting to change;
- ``truncate``: the start of the prompt's last user message is cut, token by token, until the prompt fits; its
  end is kept, since that is where a question usually is (the problem, then "put the answer in ..."), and the
  template's system message and earlier turns are kept whole. A row whose other messages leave no room is
  refused;
- ``drop``: the rows are left out, counted in one warning that names the first.

``model.max_prompt_tokens`` is a separate limit, counted as the run goes (``train/data/dropped_long_prompts``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rllight.errors import RecipeError

log = logging.getLogger(__name__)

LONG_PROMPTS = ("refuse", "truncate", "drop")
"""What is done with a prompt too long for the model's context: see the module's docstring."""

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
"""The names model configs give their number of positions, in the order they are looked for."""


def model_context(config) -> tuple[int, str] | None:
    """``(positions, key)``: how many positions the model has and the config key that says so; None when the
    config names none (then nothing is checked)."""
    if config is None:
        return None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in CONTEXT_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"config.{key}"
    return None


class ContextFit:
    """Fits prompt rows (each with ``messages`` and ``source``) into ``context`` positions less a budget.

    ``encode(messages)`` gives a conversation's prompt ids as the engine will see them. A row is tokenized only
    when it could be too long: a token covers at least one byte of text, so a prompt is at most its structure's
    tokens (the template around messages of one character) plus its messages' UTF-8 bytes, plus two a message
    for tokens merged across their edges.
    """

    def __init__(self, tokenizer, encode: Callable[[list[dict]], list[int]], context: tuple[int, str], mode: str):
        self.tokenizer, self.encode, self.mode = tokenizer, encode, mode
        self.context, self.key = context
        self._frame: dict[tuple, int | None] = {}

    def fit(self, rows: list[dict], budget: int, budget_key: str, name: str) -> list[dict]:
        """The rows that fit with ``budget`` positions left (``budget_key`` names that setting), cut to fit or
        dropped as ``mode`` says (refused: a ``RecipeError``); ``name`` names the rows in the warning."""
        limit = self.context - budget
        if limit < 1:
            raise RecipeError(f"{budget_key}={budget} leaves no room for a prompt in the model's {self.context} "
                              f"positions ({self.key}); lower {budget_key}")
        long = [(i, n) for i, row in enumerate(rows) if (n := self.length(row["messages"], limit)) > limit]
        if not long:
            return rows
        (i, n), more = long[0], len(long) - 1
        first = rows[i].get("source", f"row {i + 1}")
        need = (f"the prompt is {n} tokens, and with {budget_key}={budget} it needs {n + budget} positions, over "
                f"the model's {self.context} ({self.key})")
        if self.mode == "refuse":
            others = f" (and {more} more row{'s' if more > 1 else ''})" if more else ""
            raise RecipeError(f"{first}{others}: {need}; set data.long_prompts to truncate (cut the prompt's start) "
                              f"or drop (leave such rows out), shorten the prompts, or lower {budget_key}")
        if self.mode == "drop":
            dropped = {j for j, _ in long}
            log.warning("%s: %d prompt(s) too long for the model's context left out (first: %s: %s); "
                        "data.long_prompts truncate cuts them instead", name, len(long), first, need)
            return [row for j, row in enumerate(rows) if j not in dropped]
        for j, m in long:
            if not self.truncate(rows[j], limit):
                raise RecipeError(f"{rows[j].get('source', f'row {j + 1}')}: the prompt is {m} tokens, over the "
                                  f"{limit} that {budget_key}={budget} leaves of the model's {self.context} "
                                  f"({self.key}), and its other messages alone leave no room for its last user "
                                  "message; shorten them, or set data.long_prompts to drop")
        log.warning("%s: %d prompt(s) too long for the model's context cut at the start of their last user message "
                    "(first: %s: %s); data.long_prompts drop leaves them out instead", name, len(long), first, need)
        return rows

    def length(self, messages: list[dict], limit: int) -> int:
        """The prompt's tokens, or a bound at most ``limit`` when it surely fits (then it is not tokenized)."""
        plain = all(set(m) == {"role", "content"} for m in messages)  # other fields may change the template's text
        structure = tuple(m["role"] for m in messages) if plain else None
        if structure is not None:
            if structure not in self._frame:
                try:
                    self._frame[structure] = len(self.encode([{"role": r, "content": "x"} for r in structure]))
                except Exception:  # a template that refuses the shape: every such row is tokenized
                    self._frame[structure] = None
            frame = self._frame[structure]
            if frame is not None:
                bound = frame + sum(len(m["content"].encode("utf-8")) + 2 for m in messages)
                if bound <= limit:
                    return bound
        return len(self.encode(messages))

    def truncate(self, row: dict, limit: int) -> bool:
        """Cut the start of ``row``'s last user message (the last message when none is a user's) until the prompt
        is at most ``limit`` tokens; False, leaving the row as it was, when the message cannot give enough."""
        messages = [dict(m) for m in row["messages"]]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        last = users[-1] if users else len(messages) - 1
        ids = list(self.tokenizer(messages[last]["content"], add_special_tokens=False)["input_ids"])
        for _ in range(8):  # decoding and encoding again can merge a token or two differently: measure again
            over = len(self.encode(messages)) - limit
            if over <= 0:
                row["messages"] = messages
                return True
            if over >= len(ids):
                return False
            ids = ids[over:]
            messages[last]["content"] = self.tokenizer.decode(ids)
        return False


def fit_to_context(module, rows: list[dict], mode: str, split: str, name: str) -> list[dict]:
    """``rows`` fitted to the context of ``module``'s loaded model (an ``RLModule``: its ``tokenizer``, its
    ``policy``'s config, and the ``max_new_tokens`` of its ``rollout`` for ``split`` "train", of its
    ``evaluation`` (else the rollout's) for "val"); the rows as they are when any of these is unknown."""
    from rllight.rollout.producer import encode_chat

    tokenizer, policy = getattr(module, "tokenizer", None), getattr(module, "policy", None)
    context = model_context(getattr(policy, "config", None))
    budget, key = getattr(getattr(module, "rollout", None), "max_new_tokens", None), "model.rollout.max_new_tokens"
    if split == "val" and getattr(getattr(module, "evaluation", None), "max_new_tokens", None) is not None:
        budget, key = module.evaluation.max_new_tokens, "model.evaluation.max_new_tokens"
    if tokenizer is None or context is None or not isinstance(budget, int) or not rows:
        return rows
    return ContextFit(tokenizer, lambda m: encode_chat(tokenizer, m), context, mode).fit(rows, budget, key, name)
