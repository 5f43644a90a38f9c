"""Reading a judge's verdicts from its answer: scores (``parse_scores``), labels (``parse_labels``) and P(yes) from
the first token's log-probs (``yes_no``: yes, no and the share of the first token they hold; ``yes_probability``).
Each raises ``JudgeFailed`` with a one-line reason where the answer
does not hold what was asked for, or holds what cannot be (a log-prob above 0, yes and no more likely than certain);
``rllight.rewards.judge.LLMJudge`` counts it as the sample's failure. A reason quotes the answer through ``quote``
(``snippet``; the judge's masks its placement's key before the cut)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from rllight.serving.http import snippet

MASS_TOLERANCE = 0.01
"""How far above 1 the probability of yes and no together, or of the listed tokens together (and above 0 a log-prob),
may be read, for the rounding of a server's log-probs; past it the verdict fails."""


class JudgeFailed(Exception):
    """A request or a verdict that gives its samples a counted failure; the message is the reason."""


_NUMBER = r"(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"  # 1e308 is read as itself, and then fails the range
_SCORE = re.compile(r"score[\s:=*]*" + _NUMBER, re.IGNORECASE)
_ONLY_NUMBER = re.compile(r"\s*\**\s*" + _NUMBER + r"\s*(?:/\s*\d+(?:\.\d+)?)?\s*\**\s*\.?\s*")
_NUMBERED_SCORE = re.compile(r"response\s*#?\s*(\d+)\s*[:.)\-]*\s*\**\s*(?:score[\s:=*]*)?" + _NUMBER,
                             re.IGNORECASE)


def parse_scores(text: str, count: int = 1, quote: Callable[..., str] = snippet) -> list[float]:
    """``count`` scores read from a judge's answer, in order; ``JudgeFailed`` when it does not hold exactly that many.

    One score: the last ``Score: N``, else an answer that is only a number (``7``, ``7/10``). Several (group
    mode): ``Response K: [Score:] N`` lines for K = 1..count (the last line for each K wins), else the last JSON list
    of ``count`` numbers, else exactly ``count`` ``Score: N``s in order."""
    if count == 1:
        found = _SCORE.findall(text)
        if found:
            return [float(found[-1])]
        only = _ONLY_NUMBER.fullmatch(text)
        if only:
            return [float(only.group(1))]
        raise JudgeFailed(f"no 'Score: N' in the judge's answer: {quote(text)}")
    numbered = {int(k): float(v) for k, v in _NUMBERED_SCORE.findall(text)}
    if set(numbered) == set(range(1, count + 1)):
        return [numbered[k] for k in range(1, count + 1)]
    for values in reversed(_json_lists(text)):
        if len(values) == count and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return [float(v) for v in values]
    found = _SCORE.findall(text)
    if len(found) == count:
        return [float(v) for v in found]
    given = max(len(numbered), len(found))
    raise JudgeFailed(f"the judge's answer gives {given} scores for {count} responses: {quote(text)}")


def parse_labels(text: str, labels: list[str], count: int = 1, quote: Callable[..., str] = snippet) -> list[str]:
    """``count`` labels (as spelled in ``labels``) read from a judge's answer; ``JudgeFailed`` when it does not hold
    exactly that many. One: the first label after the last ``Verdict:``, else the last label named (whole words,
    case-insensitive). Several: ``Response K: [Verdict:] L`` for K = 1..count, else the last JSON list of labels."""
    spelled = {n.lower(): n for n in labels}
    names = "|".join(re.escape(n) for n in sorted(spelled, key=len, reverse=True))
    label = re.compile(rf"(?<![\w-])({names})(?![\w-])", re.IGNORECASE)
    if count == 1:
        marker = list(re.finditer(r"verdict[\s:=*]*", text, re.IGNORECASE))
        tail = text[marker[-1].end():] if marker else ""
        found = label.search(tail) if tail else None
        found = found or (label.findall(text) or [None])[-1]
        if found is None:
            raise JudgeFailed(f"none of the labels {labels} in the judge's answer: {quote(text)}")
        return [spelled[(found if isinstance(found, str) else found.group(1)).lower()]]
    numbered_re = re.compile(rf"response\s*#?\s*(\d+)\s*[:.)\-]*\s*\**\s*(?:verdict[\s:=*]*)?({names})(?![\w-])",
                             re.IGNORECASE)
    numbered = {int(k): v.lower() for k, v in numbered_re.findall(text)}
    if set(numbered) == set(range(1, count + 1)):
        return [spelled[numbered[k]] for k in range(1, count + 1)]
    for values in reversed(_json_lists(text)):
        if len(values) == count and all(isinstance(v, str) and v.strip().lower() in spelled for v in values):
            return [spelled[v.strip().lower()] for v in values]
    raise JudgeFailed(f"the judge's answer gives {len(numbered)} labels for {count} responses: {quote(text)}")


@dataclass(frozen=True)
class YesNo:
    """What the first answer token's log-probs say of yes and no (``yes_no``).

    ``yes`` and ``no`` are the probabilities of their variants (``yes``, `` Yes``, ``YES``..., summed), the absent
    one's read at its bound when only one appears (``bounded``); ``mass`` is what the listed variants hold of the
    first token's probability (the absent one's bound left out: a lower bound where ``bounded``); ``tokens`` the
    listed tokens, likeliest first, for reasons."""

    yes: float
    no: float
    mass: float
    bounded: bool
    tokens: tuple[str, ...]

    def p_yes(self, min_mass: float = 0.0, quote: Callable[..., str] = snippet) -> float:
        """P(yes) = yes / (yes + no); ``JudgeFailed`` where neither appears, or where ``mass`` is below
        ``min_mass``."""
        if not self.yes + self.no > 0:
            raise JudgeFailed(f"neither yes nor no among the first token's top log-probs "
                              f"({quote(list(self.tokens[:5]))})")
        if self.mass < min_mass:
            raise JudgeFailed(f"yes and no hold {self.mass:.3g} of the judge's first-token probability, below "
                              f"min_mass={min_mass:g}: it mostly answers something else (likeliest first tokens: "
                              f"{quote(list(self.tokens[:5]))})")
        return self.yes / (self.yes + self.no)


def yes_no(choice: dict, quote: Callable[..., str] = snippet) -> YesNo:
    """Yes and no from a chat completion's ``choices[0]``: the first token's top log-probs (and the sampled token's
    own), summed over the variants of yes and of no (stripped, case-insensitive).

    A server lists the top k tokens only, so a side may be absent that the judge still gives some probability: the
    absent side is read at its bound, the most one spelling of it can hold, ``min(smallest listed probability,
    1 - the listed probabilities)`` (no token left out of the top k is likelier than one in it), never at 0. So a
    "no" that fell outside the list lowers P(yes) below 1 by as much as it could hold: the verdict errs towards the
    less sure, and by less the more log-probs are asked for (``LLMJudge.top_logprobs``). A local judge lists every
    yes and no token of its vocabulary (``rllight.rewards.judge_local``): nothing is bounded and ``mass`` is exact.

    ``JudgeFailed`` where the answer has no log-probs, no ``top_logprobs`` list (the sampled token alone would give
    P(yes) = 1 or 0 whatever the judge thinks), an entry that is not ``{"token": str, "logprob": number}``, a
    log-prob above 0 or NaN (-inf, probability 0, is one), or yes and no together, or the listed tokens together,
    more likely than 1 (beyond ``MASS_TOLERANCE``)."""
    try:
        first = choice["logprobs"]["content"][0]
    except (KeyError, IndexError, TypeError):
        raise JudgeFailed("the judge's answer has no log-probs (choices[0].logprobs.content); the server must support "
                          "logprobs and top_logprobs") from None
    top = first.get("top_logprobs") if isinstance(first, dict) else None
    if not isinstance(top, list) or not top:
        raise JudgeFailed(f"the judge's answer has no list of top log-probs for its first token "
                          f"(choices[0].logprobs.content[0].top_logprobs: {quote(top, 40)}); the server must "
                          "support top_logprobs")
    for item in [first, *top]:
        value = item.get("logprob") if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("token"), str) or isinstance(value, bool) \
                or not isinstance(value, (int, float)) or math.isnan(value) or value > math.log1p(MASS_TOLERANCE):
            raise JudgeFailed(f"the judge's first-token log-probs hold {quote(item, 60)}, not a token with a "
                              "log-prob <= 0")
    # Probability by text. The top entries are distinct tokens, and several may read the same (a SentencePiece
    # ``yes`` and ``▁yes`` both decode to "yes"): they add up. The sampled token is one of them unless its text
    # is not.
    tokens: dict[str, float] = {}
    for item in top:
        tokens[item["token"]] = tokens.get(item["token"], 0.0) + math.exp(item["logprob"])
    tokens.setdefault(first["token"], math.exp(first["logprob"]))
    words = {t: t.strip().lower() for t in tokens}
    yes = sum(p for t, p in tokens.items() if words[t] == "yes")
    no = sum(p for t, p in tokens.items() if words[t] == "no")
    listed = sum(tokens.values())
    if yes + no > 1 + MASS_TOLERANCE:
        raise JudgeFailed(f"the first token's log-probs give yes and no a probability of {yes + no:.3g} together, "
                          "more than 1: they are not log-probs of one distribution")
    if listed > 1 + MASS_TOLERANCE:
        raise JudgeFailed(f"the first token's top log-probs give its listed tokens a probability of {listed:.3g} "
                          "together, more than 1: they are not log-probs of one distribution")
    likeliest = tuple(sorted(tokens, key=tokens.get, reverse=True))
    has_yes, has_no = "yes" in words.values(), "no" in words.values()
    if has_yes == has_no:  # both listed (a log-prob of -inf too), or neither (which ``YesNo.p_yes`` refuses)
        return YesNo(yes, no, yes + no, False, likeliest)
    bound = min(min(math.exp(item["logprob"]) for item in top), max(0.0, 1.0 - listed))
    return YesNo(yes if has_yes else bound, no if has_no else bound, yes + no, True, likeliest)


def yes_probability(choice: dict, quote: Callable[..., str] = snippet, min_mass: float = 0.0) -> float:
    """P(yes) from a chat completion's ``choices[0]`` (``yes_no``), normalised over yes and no; ``JudgeFailed`` as
    ``yes_no`` says, where neither appears, or where yes and no hold less than ``min_mass`` of the first token's
    probability."""
    return yes_no(choice, quote).p_yes(min_mass, quote)


def _json_lists(text: str) -> list[list]:
    out = []
    for m in re.finditer(r"\[[^\[\]]*\]", text):
        try:
            value = json.loads(m.group(0))
        except ValueError:
            continue
        if isinstance(value, list):
            out.append(value)
    return out


__all__ = ["MASS_TOLERANCE", "JudgeFailed", "YesNo", "parse_labels", "parse_scores", "yes_no", "yes_probability"]
