"""An LLM judge: another model reads each response and gives the reward. Where the judge runs is its ``placement``
(``rllight.serving``): an OpenAI-compatible chat-completions server (vLLM, SGLang, llama.cpp's server, OpenAI, a
gateway: ``rllight.serving.Endpoint``, whose protocol defaults to ``ChatCompletions``), or a local Hugging Face causal
LM that answers in the trainer's process (``InProcess``, the default) or in a supervised worker process (``Worker``;
``rllight.rewards.judge_local``). Every placement answers the same request bodies with answers of the same form, and
the same verdicts are read from them (``rllight.rewards.judge_verdicts``).

Select it in a recipe::

    model:
      reward:
        class_path: rllight.rewards.LLMJudge
        init_args:
          model: Qwen/Qwen2.5-7B-Instruct
          placement:
            class_path: rllight.serving.Endpoint
            init_args: {url: "http://127.0.0.1:8000/v1", api_key_env: JUDGE_API_KEY}

How it runs:
- **One request per response** (``mode: pointwise``), or **one per group** (``mode: group``: the responses to one
  prompt listed as ``Response 1``, ``Response 2``, ..., the judge answers one score per response, in order). The
  prompt is ``template`` filled with ``{question}`` (the row's last user message, else the prompt as the policy
  saw it), ``{response}`` (in group mode the numbered list) and ``{answer}`` (the reference answer); ``{count}``
  is the number of responses.
- **The verdict** is parsed from the judge's answer: ``number`` (the last ``Score: N``, or an answer that is only
  a number; divided by ``scale``), ``label`` (the label after the last ``Verdict:``, else the last one named,
  mapped through ``labels``) or ``yes_logprob`` (P(yes) from the first token's top ``top_logprobs`` log-probs,
  normalised over the yes and no variants: ``yes``, `` Yes``, ``YES``...). A verdict that cannot be is a failure,
  never a reward: a score outside 0..``scale`` (``Score: 1e308`` included), an answer without the top log-probs
  P(yes) needs, or log-probs no distribution has (one above 0, yes and no more likely than 1 together:
  ``rllight.rewards.judge_verdicts``).
- **How much a P(yes) knows**: the share of the first token's probability that its yes and no variants hold (the
  *mass*) is logged each step, as ``train/reward/judge/mass_sum`` over the step's ``yes_logprob`` verdicts and
  ``train/reward/judge/mass_count`` of them (mean mass = sum / count; both add up over combined rewards); a verdict
  whose mass is below ``min_mass`` fails, counted in ``train/reward/judge/low_mass``. Where a server's top log-probs
  list only one of yes and no, the other is read at the most it can hold (``yes_no``), never at 0, counted in
  ``train/reward/judge/bounded``.
- **Faults cost a counted failure, never a hung run**: at an ``Endpoint`` each request is bounded, retried and
  rate-limited as its settings say, and the whole batch has a time bound the trainer waits for in short slices
  (``rllight.serving.endpoint``), and an answer longer than its ``max_answer_bytes`` (8 MiB unless set) fails its
  request; a ``Worker`` batch waits at most its ``timeout_seconds``. A response whose request
  failed, or whose verdict cannot be parsed, gets reward 0 and a one-line reason (``Scores.failed``); a batch
  where every response failed counts towards ``model.guards.max_failed_reward_steps``, which ends the run in one line.
- **The API key** (an ``Endpoint``'s ``api_key_env``) is read when each batch starts and never kept, so ``repr``,
  pickles (checkpoints, worker copies), ``--print_config`` and exports cannot hold it; reasons and log lines have
  every run of 8 or more of its characters masked as ``[key]``, before any cut to length, whatever the server echoes.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Sequence
from typing import Literal

from rllight.bounds import ClosedUnitInterval, NonNegativeFloat, PositiveFiniteFloat, PositiveInt, bounded
from rllight.errors import RecipeError, one_line
from rllight.rewards.base import Reward
from rllight.rewards.scores import Sample, Scores
from rllight.rewards.judge_local import LocalChat
from rllight.rewards.judge_verdicts import JudgeFailed, parse_labels, parse_scores, yes_no, yes_probability
from rllight.serving import ChatCompletions, Failed, Placement, Protocol, placed
from rllight.serving.http import clip, snippet

log = logging.getLogger(__name__)

KEY = "model.reward.init_args"

MASS_METRICS = ("judge/mass_sum", "judge/mass_count", "judge/low_mass", "judge/bounded")
"""A ``yes_logprob`` judge's ``Scores.metrics`` (logged as ``train/reward/<key>``), sums and counts over the batch so
that they add up where rewards are combined: the yes/no mass of the verdicts read, how many were read, how many failed
below ``min_mass``, how many had one of yes and no bounded."""

_HEAD = "Grade {what} to a question, using the reference answer.\n\nQuestion:\n{{question}}\n\nReference answer:\n{{answer}}\n\n"
_ASK = {
    ("pointwise", "number"): "Response:\n{response}\n\nHow correct is the response? Reason briefly, then end with a "
                             "line `Score: N`, N an integer from 0 (wrong) to 10 (fully correct).",
    ("pointwise", "label"): "Response:\n{response}\n\nIs the response correct? Reason briefly, then end with a line "
                            "`Verdict: L`, L one of: {labels}.",
    ("pointwise", "yes_logprob"): "Response:\n{response}\n\nIs the response correct? Answer with one word: yes or no.",
    ("group", "number"): "{response}\n\nHow correct is each response? Reason briefly, then end with one line per "
                         "response, in order: `Response K: Score: N`, N an integer from 0 (wrong) to 10 (fully correct).",
    ("group", "label"): "{response}\n\nIs each response correct? Reason briefly, then end with one line per response, "
                        "in order: `Response K: Verdict: L`, L one of: {labels}.",
}


def default_template(mode: str, verdict: str, labels: Sequence[str] = ()) -> str:
    """The prompt the judge gets when the recipe sets no ``template``, for ``mode`` and ``verdict``."""
    what = "a response" if mode == "pointwise" else "{count} responses"
    names = ", ".join(n.replace("{", "{{").replace("}", "}}") for n in labels)
    ask = _ASK[(mode, verdict)].replace("{response}", "{{response}}").format(labels=names)
    return _HEAD.format(what=what) + ask


class LLMJudge(Reward):
    """Rewards from an LLM judge (see ``rllight.rewards.judge``).

    Args:
        model: At an ``Endpoint``: the served model's name (the request's ``model``); ``InProcess`` and ``Worker``:
            the judge model's folder or hub id (a causal LM, its own chat template).
        placement: Where the judge runs (``rllight.serving``): ``InProcess`` (None, the default), ``Worker`` (its
            ``timeout_seconds`` defaults to 60) or ``Endpoint`` (its protocol defaults to ``ChatCompletions``, its
            ``timeout_seconds`` to 60, its ``max_answer_bytes`` to 8 MiB).
        template: The judge's prompt, with ``{question}``, ``{response}`` and ``{answer}`` (and optionally
            ``{count}``) placeholders; literal braces doubled. None = a default for ``mode`` and ``verdict``
            (``default_template``).
        verdict: How the reward is read from the answer: ``number`` (the last ``Score: N``, divided by ``scale``;
            outside 0..scale fails), ``label`` (mapped through ``labels``) or ``yes_logprob`` (P(yes) from the first
            token's top log-probs; pointwise only, a server must return ``logprobs`` with ``top_logprobs``, and one
            token is asked for whatever ``max_tokens`` says; log-probs above 0, or yes and no more likely than 1
            together, fail).
        top_logprobs: ``yes_logprob``: the top log-probs asked for (the request's ``top_logprobs``). 20 is OpenAI's
            maximum and vLLM's default ``--max-logprobs`` (a vLLM server started with a larger one takes more). The
            more are listed, the rarer a yes or a no falls outside them, and the tighter the bound it is read at
            when it does (``rllight.rewards.judge_verdicts.yes_no``). A local judge lists these plus every yes and
            no token of its vocabulary.
        min_mass: ``yes_logprob``: a verdict fails (counted) where yes and no hold less than this share of the first
            token's probability (listed yes and no, an absent one's bound left out). 0.5: the judge answers yes or
            no more often than not, so that P(yes), which is P(yes | the answer starts with yes or no), speaks for
            most of what it would answer; below it the judge mostly starts with something else (a chat template's
            opening, markdown, a sentence), and a P(yes) read from a sliver of its answers says little of its
            verdict. 0 fails only a verdict with neither yes nor no (a judge of the wiring, not of the answers).
        labels: Label mode: each label's reward (case-insensitive). None = ``{correct: 1.0, incorrect: 0.0}``.
        scale: Number mode: the judge's top score, which becomes reward 1.
        mode: ``pointwise`` (one request per response) or ``group`` (one request per prompt, listing its responses;
            an answer with the wrong number of verdicts fails the group's samples).
        temperature: Sampling temperature of the judge (0: the same answer to the same prompt, on most servers).
        max_tokens: Longest judge answer, in tokens.
        solved_at: A response whose reward is at least this counts as solved in ``reward/accuracy``.
        batch_size: ``InProcess`` and ``Worker``: prompts the judge model answers together.
        dtype: ``InProcess`` and ``Worker``: the judge's weights, ``auto`` (the trainer's mixed-precision dtype, else
            float32), ``float32``, ``bfloat16`` or ``float16``.
        device: ``InProcess`` and ``Worker``: ``auto`` (this process's CUDA device, else the CPU) or a torch device.
    """

    what = "the judge"
    default_timeout = 60.0
    default_max_answer_bytes = 8 * 2 ** 20
    """An ``Endpoint``'s ``max_answer_bytes`` where the recipe sets none: a chat completion of ``max_tokens``."""
    worker_target: str | None = "rllight.rewards.judge_local:serve_worker"
    """A ``Worker``'s child function (tests name one that misbehaves)."""

    @bounded
    def __init__(self, model: str | None = None, placement: Placement | None = None, template: str | None = None,
                 verdict: Literal["number", "label", "yes_logprob"] = "number", labels: dict[str, float] | None = None,
                 scale: PositiveFiniteFloat = 10.0, mode: Literal["pointwise", "group"] = "pointwise",
                 temperature: NonNegativeFloat = 0.0, max_tokens: PositiveInt = 512, solved_at: float = 0.5,
                 batch_size: PositiveInt = 8, dtype: str = "auto", device: str = "auto",
                 top_logprobs: PositiveInt = 20, min_mass: ClosedUnitInterval = 0.5):
        self.solved_at = solved_at
        _check_model(model, dtype)
        if verdict not in ("number", "label", "yes_logprob"):
            raise RecipeError(f"{KEY}.verdict must be number, label or yes_logprob, got {verdict!r}")
        if mode not in ("pointwise", "group"):
            raise RecipeError(f"{KEY}.mode must be pointwise or group, got {mode!r}")
        if mode == "group" and verdict == "yes_logprob":
            raise RecipeError(f"{KEY}.verdict yes_logprob reads one verdict per answer: use it with mode pointwise")
        self.labels = _labels(labels, verdict)
        self.template = _template(template, mode, verdict, self.labels)
        self.model, self.batch_size, self.dtype, self.device = model, batch_size, dtype, device
        self.verdict, self.scale, self.mode = verdict, float(scale), mode
        self.temperature, self.max_tokens = temperature, max_tokens
        self.top_logprobs, self.min_mass = top_logprobs, float(min_mass)
        self._local: LocalChat | None = None
        self.placement = placed(placement, f"{KEY}.placement", self)

    def __repr__(self) -> str:  # settings only: the key is not one
        return (f"LLMJudge(model={self.model!r}, placement={self.placement!r}, verdict={self.verdict!r}, "
                f"mode={self.mode!r})")

    def __getstate__(self) -> dict:  # copies (checkpoints, worker processes) carry the settings, not a loaded model
        return {**self.__dict__, "_local": None}

    def close(self) -> None:
        self.placement.close()
        self._local = None

    def check(self) -> None:
        """Before the policy loads: the key's environment variable is set (``Endpoint``), or the judge model is a
        causal LM whose tokenizer loads (``InProcess``, ``Worker``); ``RecipeError`` in one line."""
        self.placement.check(self)

    # What a placement asks of the model it places (``rllight.serving.Served``).
    def _chat(self) -> LocalChat:
        if self._local is None:
            self._local = LocalChat(self.model, self.batch_size, self.dtype, self.device, where=f"{KEY}.model")
        return self._local

    def forward(self, bodies: list[dict]) -> list[dict]:
        return self._chat().complete(bodies)

    def worker_settings(self) -> dict:
        return self._chat().settings()

    def default_protocol(self) -> Protocol:
        return ChatCompletions()

    def served_name(self) -> str | None:
        return self.model

    def check_local(self) -> None:
        self._chat().load_tokenizer()

    # ------------------------------------------------------------------------------ scoring
    def score(self, samples: Sequence[Sample]) -> Scores:
        """One reward per sample, in order; a sample whose request failed or whose verdict could not be read gets
        0 and its reason in ``failed``; ``metrics``: ``MASS_METRICS`` (``yes_logprob``)."""
        if self.mode == "pointwise":
            jobs = [([i], self._prompt(s, s.response, 1)) for i, s in enumerate(samples)]  # (indices, prompt)
        else:
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(samples):
                groups.setdefault(s.group, []).append(i)
            jobs = [(index, self._prompt(samples[index[0]], "\n\n".join(
                f"Response {k + 1}:\n{samples[i].response}" for k, i in enumerate(index)), len(index)))
                for index in groups.values()]
        scores, failed = [0.0] * len(samples), {}
        metrics = dict.fromkeys(MASS_METRICS, 0.0) if self.verdict == "yes_logprob" else {}
        for (index, _), outcome in zip(jobs, self._answers([self._body(prompt) for _, prompt in jobs])):
            try:
                if isinstance(outcome, Failed):
                    raise outcome
                values = self._verdicts(outcome, len(index), metrics)
            except (Failed, JudgeFailed) as err:
                failed.update({i: self.placement.redact(str(err)) for i in index})
                continue
            for i, value in zip(index, values):
                scores[i] = value
        if failed:  # the trainer warns once per batch (``score_samples``); the details for a debug log
            log.debug("LLM judge at %s: %d of %d samples failed (first: %s)", self.placement, len(failed),
                      len(samples), failed[min(failed)])
        return Scores(values=scores, failed=failed, metrics=metrics)

    def _answers(self, bodies: list[dict]) -> list:
        """The placement's answer to each body; where the whole batch failed (a local judge's pass, a worker that
        died), a ``Failed`` for each, as a server's failures are counted."""
        try:
            return self.placement.answer(self, bodies)
        except RecipeError:  # the recipe's fault, not the batch's (Ctrl-C is no Exception: it passes too)
            raise
        except Exception as err:  # noqa: BLE001 - a failed pass is counted, sample by sample
            return [Failed(clip(one_line(err), 300, self.placement.redact))] * len(bodies)

    def _prompt(self, sample: Sample, response: str, count: int) -> str:
        users = [m.get("content") for m in sample.messages or [] if isinstance(m, dict) and m.get("role") == "user"]
        question = users[-1] if users and isinstance(users[-1], str) else sample.prompt
        return self.template.format(question=question, response=response, answer=sample.answer, count=count)

    def _body(self, prompt: str) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.verdict == "yes_logprob":
            body.update(logprobs=True, top_logprobs=self.top_logprobs, max_tokens=1)
        return body

    def _verdicts(self, answer: dict, count: int, metrics: dict[str, float]) -> list[float]:
        """The rewards an OpenAI chat completion ``answer`` gives its ``count`` responses; ``JudgeFailed`` with why.
        A ``yes_logprob`` verdict whose log-probs are read adds to ``metrics`` (``MASS_METRICS``), failed or not."""
        quote = functools.partial(snippet, mask=self.placement.redact)  # the key masked before the cut
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise JudgeFailed(f"the judge's answer has no choices[0].message.content: "
                              f"{quote(json.dumps(answer, default=str))}") from None
        if not isinstance(text, str):
            raise JudgeFailed(f"the judge's answer's content is {quote(json.dumps(text, default=str))}, not text")
        if self.verdict == "yes_logprob":
            read = yes_no(choice, quote)
            metrics["judge/mass_sum"] += read.mass
            metrics["judge/mass_count"] += 1
            metrics["judge/bounded"] += read.bounded
            metrics["judge/low_mass"] += read.mass < self.min_mass
            return [read.p_yes(self.min_mass, quote)]
        if self.verdict == "number":
            values = parse_scores(text, count, quote)
            for v in values:
                if not 0 <= v <= self.scale:
                    raise JudgeFailed(f"score {v:g} is outside 0..{self.scale:g} (scale): {quote(text)}")
            return [v / self.scale for v in values]
        return [self.labels[name] for name in parse_labels(text, list(self.labels), count, quote)]


def _labels(labels: dict[str, float] | None, verdict: str) -> dict[str, float] | None:
    """The label mode's rewards, checked; ``RecipeError`` naming ``labels``."""
    if labels is not None and verdict != "label":
        raise RecipeError(f"{KEY}.labels is read by verdict label only; set verdict: label or drop labels")
    labels = {"correct": 1.0, "incorrect": 0.0} if labels is None and verdict == "label" else labels
    if labels is None:
        return None
    names = [str(n).strip().lower() for n in labels]
    if not names or not all(names) or len(set(names)) != len(names):
        raise RecipeError(f"{KEY}.labels must map distinct, non-empty labels to rewards, got {labels!r}")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in labels.values()):
        raise RecipeError(f"{KEY}.labels' rewards must be finite numbers, got {labels!r}")
    return {str(n).strip(): float(v) for n, v in labels.items()}


def _template(template: str | None, mode: str, verdict: str, labels: dict[str, float] | None) -> str:
    """``template`` (None: the default for ``mode`` and ``verdict``), checked; ``RecipeError`` naming it."""
    template = default_template(mode, verdict, list(labels or ())) if template is None else template
    try:
        template.format(question="", response="", answer="", count=0)
    except (KeyError, IndexError, ValueError) as err:
        raise RecipeError(f"{KEY}.template: only {{question}}, {{response}}, {{answer}} and {{count}} may be "
                          f"placeholders, literal braces doubled ({type(err).__name__}: {err})") from None
    if "{response}" not in template:
        raise RecipeError(f"{KEY}.template has no {{response}} placeholder: the judge would not see the response")
    return template


def _check_model(model, dtype) -> None:
    """One ``RecipeError`` line, naming the setting, for model settings that cannot work."""
    if not model or not isinstance(model, str):
        raise RecipeError(f"{KEY}.model must be the folder or hub id of the judge model (at an Endpoint: the served "
                          "model's name)")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise RecipeError(f"{KEY}.dtype: {dtype!r} is not one of auto, float32, bfloat16, float16")


__all__ = ["MASS_METRICS", "LLMJudge", "default_template", "parse_labels", "parse_scores", "yes_no", "yes_probability"]
