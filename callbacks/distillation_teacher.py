"""One distillation teacher (``Teacher``): a frozen model, in the trainer process or at a server (its ``placement``,
``rllight.serving``), that scores the tokens the student sampled, and in the trainer process also gives its top-k
(or full) distribution at each of them. ``rllight.callbacks.TeacherLogprobs`` is the default teacher and routes
each response to the teacher of its data source."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rllight.algorithms import chunked_logprobs_and_entropy, logprobs_and_entropy
from rllight.bounds import PositiveFloat, PositiveInt, bounded
from rllight.errors import ComponentError, RecipeError
from rllight.models import HFModel, disable_dropout, response_hidden_states
from rllight.rollout.base import logprob_fault
from rllight.scoring import micro_batches
from rllight.serving import Failed, InProcess, Placement, PromptLogprobs, Protocol, placed
from rllight.types import Rollout

__all__ = ["Teacher", "TeacherScores", "rows_rollout", "teacher_logprobs", "teacher_scores", "tokenizer_difference",
           "unusable_logprobs"]

_FIXED_TEMPERATURE = ("{key}.placement: the server's log-probs are at temperature {fixed:g} ({protocol} applies no "
                      "other), not at the {what} {temperature:g}; set TeacherLogprobs.temperature: {fixed:g} to "
                      "distil at that temperature, or place the teacher InProcess")
_ROLES = ("bos_token", "eos_token", "unk_token")  # not the pad token: HFModel gives one to a tokenizer without


def tokenizer_difference(policy: Any, teacher: Any) -> str | None:
    """What differs between the policy's and the teacher's tokenizers, in a few words, or None when every token
    id names the same token in both and the special tokens are the same: the teacher is given the student's token
    ids, so an id must mean the same text to both. Compared: the vocabulary's size, each id's token (added tokens
    included), the beginning / end / unknown tokens and the other special tokens. The pad token is not: padding is
    never scored."""
    ours, theirs = policy.get_vocab(), teacher.get_vocab()
    if len(ours) != len(theirs):
        return f"vocabulary size {len(theirs)} (teacher) vs {len(ours)} (policy)"
    if ours != theirs:
        by_id, their_by_id = {i: t for t, i in ours.items()}, {i: t for t, i in theirs.items()}
        i = min(i for i in set(by_id) | set(their_by_id) if by_id.get(i) != their_by_id.get(i))
        return f"token id {i} is {their_by_id.get(i)!r} in the teacher's and {by_id.get(i)!r} in the policy's"
    for role in _ROLES:
        if getattr(policy, role, None) != getattr(teacher, role, None):
            return f"{role} {getattr(teacher, role, None)!r} (teacher) vs {getattr(policy, role, None)!r} (policy)"
    ours, theirs = set(policy.all_special_tokens), set(teacher.all_special_tokens)
    ours.discard(policy.pad_token)
    theirs.discard(teacher.pad_token)
    if ours != theirs:
        return f"special tokens {sorted(theirs - ours)} only in the teacher's, {sorted(ours - theirs)} only in the policy's"
    return None


def _tokenizer(source: HFModel, key: str):
    """``source``'s tokenizer, loaded alone (no weights); a folder that is missing is named under ``key``."""
    from transformers import AutoTokenizer

    try:
        path = source.resolve()
    except RecipeError as err:  # HFModel names the policy's key; this is the teacher's or the policy's
        raise RecipeError(str(err).replace("model.model.init_args.path", f"{key}.init_args.path")) from None
    kwargs: dict[str, Any] = {"trust_remote_code": source.trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    return AutoTokenizer.from_pretrained(path, **kwargs)


@torch.no_grad()
def teacher_logprobs(teacher: torch.nn.Module, rollout: Rollout, temperature: float, micro_batch_size: int,
                     chunk_size: int | None = 1024) -> Tensor:
    """The teacher's log-probs of ``rollout``'s response tokens given their prompts and the responses before them,
    in micro-batches of ``micro_batch_size`` rows, the logits divided by ``temperature``.

    Returns:
        Shape (B, T), float32, zero outside ``rollout.response_mask``.
    """
    mask = rollout.response_mask.to(torch.float32)
    out = torch.zeros_like(mask)
    for rows, micro in micro_batches(rollout, micro_batch_size):
        hidden = response_hidden_states(teacher.get_decoder(), micro)
        head = teacher.get_output_embeddings()
        if chunk_size and type(head) is torch.nn.Linear:  # never the full (b, t, V) float32 logits
            logprobs, _ = chunked_logprobs_and_entropy(hidden, head.weight, micro.response_ids, temperature,
                                                       bias=head.bias, chunk_size=chunk_size)
        else:  # e.g. a float32 output layer (HFModel's float32_lm_head): through its own forward
            logprobs, _ = logprobs_and_entropy(head(hidden), micro.response_ids, temperature)
        out[rows, : logprobs.shape[1]] = logprobs.float()
    return out * mask


@torch.no_grad()
def teacher_scores(teacher: torch.nn.Module, rollout: Rollout, temperature: float, micro_batch_size: int,
                   top_k: int, chunk_size: int = 1024) -> tuple[Tensor, Tensor | None, Tensor]:
    """The teacher's log-probs of ``rollout``'s response tokens (as ``teacher_logprobs``) and its distribution at
    each response position: its ``top_k`` most likely tokens and their log-probs, or with ``top_k`` 0 every token's
    log-prob in id order. The output layer runs ``chunk_size`` positions at a time: one chunk's (chunk, V) float32
    log-probs exist at once besides what is kept.

    Returns:
        ``(logprobs, ids, values)``: shapes (B, T) float32; (B, T, k) int32, None for ``top_k`` 0; (B, T, k) or
        (B, T, V) float32. All zero outside ``rollout.response_mask``.
    """
    mask = rollout.response_mask.bool()
    head = teacher.get_output_embeddings()
    b, t = mask.shape
    width = top_k or head.weight.shape[0]  # the vocabulary's size at top_k 0
    logprobs = torch.zeros(b, t, device=mask.device)
    values = torch.zeros(b, t, width, device=mask.device)
    ids = torch.zeros(b, t, width, dtype=torch.int32, device=mask.device) if top_k else None
    for rows, micro in micro_batches(rollout, micro_batch_size):
        hidden = response_hidden_states(teacher.get_decoder(), micro)
        n = hidden.shape[1]
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), micro.response_ids.reshape(-1)
        sampled, kept, top = [], [], []
        for s in range(0, flat.shape[0], chunk_size):
            logp = torch.log_softmax(head(flat[s:s + chunk_size]).float() / temperature, dim=-1)
            sampled.append(logp.gather(-1, targets[s:s + chunk_size, None])[:, 0])
            if top_k:
                part = logp.topk(top_k, dim=-1)
                kept.append(part.values)
                top.append(part.indices.to(torch.int32))
            else:
                kept.append(logp)
        index = torch.as_tensor(rows, device=mask.device)
        logprobs[index, :n] = torch.cat(sampled).view(len(rows), n)
        values[index, :n] = torch.cat(kept).view(len(rows), n, width)
        if ids is not None:
            ids[index, :n] = torch.cat(top).view(len(rows), n, width)
    logprobs, values = logprobs * mask, values * mask[..., None]
    return logprobs, (ids * mask[..., None] if ids is not None else None), values


class TeacherScores(NamedTuple):
    """What an in-process teacher answers for one row when its distribution is asked (``Teacher.top_k`` set)."""

    logprobs: list[float]
    """The teacher's log-prob of each response token."""
    ids: Tensor | None
    """Shape (n, k), int32: its top-k tokens at each of the n response positions; None: every token, in id order."""
    values: Tensor
    """Shape (n, k) or (n, V), float32: their log-probs."""


def unusable_logprobs(values: Any, kept: Tensor) -> str | None:
    """Why a teacher's log-probs of one response cannot be trained on, or None: one number per response token asked
    (``kept``'s length), and on the tokens in the response mask finite and at most 0, checked as the engine's sampled
    log-probs are (``rllight.rollout.base.logprob_fault``). A NaN would make every later loss NaN, and a log-prob above
    0 (or one missing, read as 0) is a teacher surer than certain: its advantage would pull the student towards
    whatever it sampled.

    Args:
        values: What the placement answered for the response (a list of numbers, if well formed).
        kept: Shape (n,), bool, on the CPU: which of the n response tokens asked are in the response mask.
    """
    try:
        values = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        return f"not a list of numbers but {type(values).__name__}"
    if values.dim() != 1:  # e.g. one list per token: counted as numbers, as a flat list would be
        return f"{values.numel()} log-probs for {kept.numel()} response tokens"
    return logprob_fault(values, kept, above="log-probs above 0")


def rows_rollout(rows: list[tuple[list[int], list[int]]], device: torch.device) -> Rollout:
    """A rollout of ``(prompt_ids, response_ids)`` rows, prompts left-padded and responses right-padded (with id 0,
    masked), every response token in ``response_mask``: what the teacher's forward pass reads."""
    p, t, n = max(len(a) for a, _ in rows), max(len(b) for _, b in rows), len(rows)
    prompt_ids, prompt_mask = torch.zeros(n, p, dtype=torch.long), torch.zeros(n, p, dtype=torch.long)
    response_ids, response_mask = torch.zeros(n, t, dtype=torch.long), torch.zeros(n, t, dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        prompt_ids[i, p - len(prompt):], prompt_mask[i, p - len(prompt):] = torch.tensor(prompt), 1
        response_ids[i, : len(response)], response_mask[i, : len(response)] = torch.tensor(response), 1
    return Rollout(prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
                   response_ids=response_ids.to(device), response_mask=response_mask.to(device),
                   sample_logprobs=torch.zeros(n, t, device=device), truncated=torch.zeros(n, dtype=torch.bool),
                   group_ids=torch.arange(n), answers=[""] * n, texts=[""] * n)


class Teacher:
    """A frozen teacher model for on-policy distillation, and where it runs: one of ``TeacherLogprobs``' teachers
    by data source (its ``teachers``), which names it in a recipe as ``class_path: rllight.callbacks.distillation.
    Teacher``. ``TeacherLogprobs`` is itself the default teacher: its own ``model``, ``micro_batch_size``,
    ``temperature`` and ``placement`` mean what they mean here.

    Placed ``InProcess`` (the default), the teacher loads at its first rollout, frozen and in eval mode, in the
    policy's dtype on the trainer's device, and is not saved in checkpoints. At a server (``rllight.serving.
    Endpoint``, protocol ``PromptLogprobs``) nothing loads in the trainer and its log-probs are at temperature 1.

    Args:
        model: The teacher (``rllight.models.HFModel``: a folder or a hub id), with the policy's tokenizer.
        micro_batch_size: Rows per teacher forward pass (at a server: per request, unless the protocol says).
        temperature: The teacher's logits are divided by it. None = the rollout engine's sampling temperature.
        placement: Where the teacher runs: ``InProcess`` (None, the default) or ``Endpoint``.
    """

    what = "the teacher"
    default_timeout = 600.0
    worker_target = None  # the teacher computes on the trainer's device or at a server
    key = "trainer.callbacks: TeacherLogprobs"
    """The teacher's settings in messages (``bind``)."""
    top_k: int | None = None
    """The distribution asked of it besides the sampled tokens' log-probs (``TeacherLogprobs.top_k``)."""

    @bounded
    def __init__(self, model: HFModel, micro_batch_size: PositiveInt = 8, temperature: PositiveFloat | None = None,
                 placement: Placement | None = None):
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.placement = placement
        self.teacher: torch.nn.Module | None = None
        self.used_temperature = 1.0 if temperature is None else temperature
        """The temperature the teacher's logits are divided by (set in ``check_before_fit``)."""
        self._checked = False  # check_before_fit has passed
        self._device: torch.device | None = None  # where an InProcess teacher loads (``setup_teacher``)
        self._dtype = None  # the policy's dtype, the teacher's (``setup_teacher``)

    def bind(self, key: str, top_k: int | None) -> None:
        """Name the teacher's settings ``key`` in messages, place it, and ask it for its ``top_k`` distribution (a
        served teacher cannot give one: refused in one line)."""
        self.key, self.top_k = key, top_k
        self.placement = placed(self.placement, f"{key}.placement", self)
        self._check_temperature(self.temperature, "temperature")
        if top_k is not None and not isinstance(self.placement, InProcess):
            raise RecipeError(f"{key}.placement: TeacherLogprobs.top_k needs the teacher's distribution, which "
                              f"{type(self.placement).__name__} does not give (rllight.serving.PromptLogprobs asks "
                              "vLLM for prompt_logprobs: 0, the sampled tokens' log-probs only); place the teacher "
                              "InProcess or leave top_k unset")

    def _check_temperature(self, temperature: float | None, what: str) -> None:
        """Refuse a temperature the placement's protocol cannot give (vLLM's prompt log-probs: 1 only)."""
        protocol = getattr(self.placement, "protocol", None)
        fixed = getattr(protocol, "temperature", None)
        if fixed is not None and temperature is not None and temperature != fixed:
            raise RecipeError(_FIXED_TEMPERATURE.format(key=self.key, fixed=fixed, protocol=type(protocol).__name__,
                                                        what=what, temperature=temperature))

    # What a placement asks of the model it places (``rllight.serving.Served``).
    def default_protocol(self) -> Protocol:
        return PromptLogprobs(rows_per_request=self.micro_batch_size)

    def served_name(self) -> None:
        return None  # the protocol's model, else the server's first (``PromptLogprobs.prepare``)

    def check_local(self) -> None:
        """Nothing before ``setup``, which compares the tokenizers wherever the teacher runs."""

    def worker_settings(self) -> dict:
        raise NotImplementedError("the teacher does not run in a worker")

    def forward(self, rows: list[tuple[list[int], list[int]]]) -> list:
        """The loaded teacher's log-prob of each response token of each ``(prompt_ids, response_ids)`` row, given
        its prompt and the response before it, at ``used_temperature``; with ``top_k`` set, each row's
        ``TeacherScores`` (its distribution at each response position too)."""
        teacher = self.load()
        batch = rows_rollout(rows, self._device)
        if self.top_k is None:
            logprobs = teacher_logprobs(teacher, batch, self.used_temperature, self.micro_batch_size)
            return [logprobs[i, : len(response)].tolist() for i, (_, response) in enumerate(rows)]
        logprobs, ids, values = teacher_scores(teacher, batch, self.used_temperature, self.micro_batch_size,
                                               self.top_k)
        return [TeacherScores(logprobs[i, :len(r)].tolist(), None if ids is None else ids[i, :len(r)],
                              values[i, :len(r)]) for i, (_, r) in enumerate(rows)]

    def check_tokenizer(self, policy: HFModel) -> None:
        """Refuse, in one line, a teacher whose tokenizer differs from the policy's (``tokenizer_difference``).
        Loads the two tokenizers only."""
        key = f"{self.key}.model"
        difference = tokenizer_difference(_tokenizer(policy, "model.model"), _tokenizer(self.model, key))
        if difference is not None:
            raise RecipeError(f"{key}: the teacher's tokenizer differs from the policy's ({difference}); "
                              "distillation compares log-probs of the same token ids, so give a teacher of the "
                              "policy's tokenizer")

    def check_teacher(self, policy: HFModel | None, engine_temperature: float | None) -> None:
        """The tokenizers and the temperature, before any model loads (once)."""
        if self._checked:
            return
        if policy is not None:
            self.check_tokenizer(policy)
        if self.temperature is None and engine_temperature is not None:
            self.used_temperature = float(engine_temperature)
        if self.temperature is None:
            self._check_temperature(self.used_temperature, "engine's sampling temperature")
        self.placement.check(self)
        self._checked = True

    def setup_teacher(self, device: torch.device, dtype) -> None:
        """Where an ``InProcess`` teacher will load, and in which dtype (the policy's)."""
        self._device, self._dtype = device, dtype

    def load(self) -> torch.nn.Module:
        """The teacher, loaded once (``InProcess``): frozen, in eval mode, in the policy's dtype, on the trainer's
        device (both read at ``setup``)."""
        if self.teacher is None:
            if self._device is None:
                raise RecipeError(f"{self.key} has no teacher loaded; it loads after fit starts")
            source = copy.copy(self.model)
            if self._dtype is not None:
                source.dtype = self._dtype
            teacher, _ = source.load()
            disable_dropout(teacher)
            teacher.config.use_cache = False
            self.teacher = teacher.requires_grad_(False).eval().to(self._device)
        return self.teacher

    def teacher_name(self) -> str:
        """The teacher in messages: its folder (or hub id) as the recipe gives it, and where it runs when that is not
        the trainer's process (an endpoint's URL)."""
        name = f"the teacher {getattr(self.model, 'path', None) or type(self.model).__name__}"
        return name if isinstance(self.placement, InProcess) else f"{name} at {self.placement}"

    def scores(self, rollout: Rollout) -> tuple[Tensor, dict[int, str], Tensor | None, Tensor | None]:
        """The teacher's log-probs of ``rollout``'s response tokens given their prompts and the responses before
        them, from where ``placement`` says: each row as its prompt tokens (``prompt_mask``) then its response tokens
        up to the last one in ``response_mask`` (a row with none is not asked). Each row's answer is checked
        (``unusable_logprobs``; a distribution, finite and at most 0 too). A failure stops the step in one line: the
        teacher's signal is never replaced by zeros.

        Returns:
            The log-probs, shape (B, T), float32, zero outside ``rollout.response_mask`` and on the rows whose answer
            cannot be trained on; for each of those rows, why; with ``top_k`` set, the distribution's ids (B, T, k)
            int32 (None at ``top_k`` 0) and log-probs (B, T, k or V), zero where the log-probs are.
        """
        # Read row by row: on the host, copied once.
        mask, prompt_ids, prompt_mask, response_ids = (t.cpu() for t in (
            rollout.response_mask.bool(), rollout.prompt_ids, rollout.prompt_mask.bool(), rollout.response_ids))
        out = torch.zeros(mask.shape, dtype=torch.float32)
        index, rows = [], []
        for i in range(mask.shape[0]):
            kept = mask[i].nonzero()
            if len(kept):
                index.append(i)
                rows.append((prompt_ids[i][prompt_mask[i]].tolist(), response_ids[i, : int(kept[-1]) + 1].tolist()))
        answers = list(self.placement.answer(self, rows))
        bad: dict[int, str] = {}
        dist: dict[int, TeacherScores] = {}
        for k, i in enumerate(index):
            values = answers[k] if len(answers) == len(rows) else None
            if isinstance(values, Failed):
                raise ComponentError(f"trainer.callbacks: TeacherLogprobs: {values}")
            n = len(rows[k][1])
            if isinstance(values, TeacherScores):
                dist[i], values = values, values.logprobs
            why = (f"{len(answers)} answer(s) for {len(rows)} samples" if len(answers) != len(rows)
                   else unusable_logprobs(values, mask[i, :n]))
            if why is None and i in dist:  # checked where it is (a (n, V) copy to the host would cost)
                values_i = dist[i].values
                kept = mask[i, :n, None].to(values_i.device).expand(values_i.shape)
                why = logprob_fault(values_i, kept, above="log-probs above 0")
                why = None if why is None else f"its distribution: {why}"
            if why is not None:
                bad[i] = why
            else:
                out[i, :n] = torch.as_tensor(values, dtype=torch.float32)
        device = rollout.response_mask.device
        ids, values = self._distribution(rollout, dist, bad)
        return torch.where(mask, out, 0.0).to(device), bad, ids, values

    def _distribution(self, rollout: Rollout, dist: dict[int, TeacherScores], bad: dict[int, str]
                      ) -> tuple[Tensor | None, Tensor | None]:
        """The rows' distributions (``scores``) as (B, T, k) tensors, zero outside the response mask and on ``bad``
        rows; (None, None) without ``top_k``."""
        if self.top_k is None:
            return None, None
        mask = rollout.response_mask.bool()
        b, t = mask.shape
        width = self.top_k or self.load().get_output_embeddings().weight.shape[0]
        values = torch.zeros(b, t, width, device=mask.device)
        ids = torch.zeros(b, t, width, dtype=torch.int32, device=mask.device) if self.top_k else None
        for i, scores in dist.items():
            if i not in bad:
                n = scores.values.shape[0]
                values[i, :n] = scores.values.to(values.device)
                if ids is not None:
                    ids[i, :n] = scores.ids.to(ids.device)
        keep = mask[..., None]
        return (None if ids is None else ids * keep), values * keep
