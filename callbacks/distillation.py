"""On-policy distillation's teacher, in the trainer process or at a server (its ``placement``, ``rllight.serving``):
a frozen model that scores the tokens the student sampled, for ``rllight.strategies.OnPolicyDistillation``."""

from __future__ import annotations

import copy
import logging
from typing import Any

import lightning as L
import torch
from torch import Tensor

from rllight.algorithms import chunked_logprobs_and_entropy, logprobs_and_entropy
from rllight.bounds import PositiveFloat, PositiveInt, bounded
from rllight.callbacks.base import RolloutCallback, RolloutContext
from rllight.distributed import Ranks
from rllight.errors import ComponentError, RecipeError
from rllight.models import HFModel, disable_dropout, response_hidden_states
from rllight.rollout.base import LOGPROB_SLACK
from rllight.scoring import micro_batches
from rllight.serving import Failed, InProcess, Placement, PromptLogprobs, Protocol, placed
from rllight.stopping import end_after_step
from rllight.strategies.advantages import TEACHER_LOGPROBS
from rllight.types import Rollout

__all__ = ["TEACHER_LOGPROBS", "TeacherLogprobs", "tokenizer_difference", "unusable_logprobs"]

log = logging.getLogger(__name__)

KEY = "trainer.callbacks: TeacherLogprobs.model"
_FIXED_TEMPERATURE = ("trainer.callbacks: TeacherLogprobs.placement: the server's log-probs are at temperature "
                      "{fixed:g} ({protocol} applies no other), not at the {what} {temperature:g}; set "
                      "TeacherLogprobs.temperature: {fixed:g} to distil at that temperature, or place the teacher "
                      "InProcess")
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


def unusable_logprobs(values: Any, kept: Tensor) -> str | None:
    """Why a teacher's log-probs of one response cannot be trained on, or None: one number per response token asked
    (``kept``'s length), and on the tokens in the response mask finite and at most 0 (``LOGPROB_SLACK`` above it for
    float32 rounding), as the engine's sampled log-probs are checked (``rllight.rollout.base.malformed``). A NaN would
    make every later loss NaN, and a log-prob above 0 (or one missing, read as 0) is a teacher surer than certain:
    its advantage would pull the student towards whatever it sampled.

    Args:
        values: What the placement answered for the response (a list of numbers, if well formed).
        kept: Shape (n,), bool, on the CPU: which of the n response tokens asked are in the response mask.
    """
    try:
        values = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        return f"not a list of numbers but {type(values).__name__}"
    if values.dim() != 1 or values.numel() != kept.numel():
        return f"{values.numel()} log-probs for {kept.numel()} response tokens"
    values = values[kept]
    if not torch.isfinite(values).all():
        return f"{int((~torch.isfinite(values)).sum())} log-probs that are not finite (NaN or infinite)"
    if values.numel() and float(values.max()) > LOGPROB_SLACK:
        return f"log-probs above 0 (largest {float(values.max()):.3g}): a log-probability is at most 0"
    return None


class TeacherLogprobs(RolloutCallback):
    """The teacher of on-policy distillation (``rllight.strategies.OnPolicyDistillation``), in the trainer process:
    after each rollout it computes the teacher's log-prob of every sampled response token and stores them as
    ``rollout.extras["teacher_logprobs"]`` (shape (B, T), zero outside ``response_mask``).

    Placed ``InProcess``, the teacher loads at its first rollout (after ``setup`` at ``fit``), frozen and in eval
    mode, in the policy's dtype
    (``model.model.init_args.dtype``, whatever its own ``dtype`` says) on the trainer's device; it is not saved in
    checkpoints (it is loaded again on resume). Before any weights load, its tokenizer is compared with the
    policy's: the teacher is given the student's token ids, so a tokenizer that differs (vocabulary size, a token,
    the special tokens; see ``tokenizer_difference``) is refused with one line.

    Under several processes each rank scores its own rows with a full copy of the teacher (replicated, not sharded
    under FSDP: it must fit on each device beside the policy's shard).

    **At a server** (``placement: rllight.serving.Endpoint``): the teacher is a vLLM server (``vllm serve <teacher
    folder>``), asked for the log-probs of each row's prompt and response tokens (``rllight.serving.PromptLogprobs``,
    which cites the request and answer fields in vLLM's source; its ``rows_per_request`` defaults to
    ``micro_batch_size``); no weights load in the trainer. ``model`` is then the teacher's folder (or hub id) as the
    recipe knows it, for its tokenizer only, which is compared with the policy's at ``setup`` as above; the
    protocol's ``model`` is the name the server serves it under (None: the first of ``GET /v1/models``). vLLM
    computes prompt log-probs before any temperature, so the teacher's temperature must be 1: an engine sampling at
    another temperature is refused in one line unless ``temperature: 1.0`` is set. Every rank sends its own rows. A
    server that fails after the retries stops the step with one line naming the URL.

    **Checked as the engine's log-probs are**, wherever the teacher runs (``unusable_logprobs``): one per response
    token asked, each finite and at most 0 on the response mask. A sample whose teacher log-probs fail is left out of
    the loss (its ``response_mask`` zeroed, its reward kept for the group statistics, as ``OverlongFilter`` does) and
    counted in ``train/distill/bad_teacher_samples``, with one warning per step naming the teacher and the first
    sample's fault. A step where no sample (on any rank) has usable ones ends the run after the step, saved, in one line
    naming the teacher (``rllight.stopping.end_after_step``): a teacher that gives nothing usable is broken.

    ``rollout_order`` 25: after the reward shaping (10) and the loss masks (20), before the callbacks that train on
    the rollout or store it (``ValuePretraining``: 30, ``SelfImitation``: 40), which then see the teacher's log-probs.

    Args:
        model: The teacher (``rllight.models.HFModel``: a folder or a hub id), with the policy's tokenizer.
        micro_batch_size: Rows per teacher forward pass (at a server: per request, unless the protocol says).
        temperature: The teacher's logits are divided by it. None = the rollout engine's sampling temperature, at
            which the student's log-probs (the engine's and the trainer's) are computed: both log-probs then
            describe distributions at one temperature, and their difference estimates the reverse KL between them.
            At a vLLM server: must come out as 1 (null with an engine at temperature 1, or 1.0).
        placement: Where the teacher runs (``rllight.serving``): ``InProcess`` (None, the default) or ``Endpoint``
            (its protocol defaults to ``PromptLogprobs``, its ``timeout_seconds`` to 600).
    """

    rollout_order = 25
    what = "the teacher"
    default_timeout = 600.0
    worker_target = None  # the teacher computes on the trainer's device or at a server

    @bounded
    def __init__(self, model: HFModel, micro_batch_size: PositiveInt = 8, temperature: PositiveFloat | None = None,
                 placement: Placement | None = None):
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.teacher: torch.nn.Module | None = None
        self.placement = placed(placement, "trainer.callbacks: TeacherLogprobs.placement", self)
        self._check_temperature(temperature, "temperature")
        self.used_temperature = 1.0 if temperature is None else temperature
        """The temperature ``on_rollout`` divides the teacher's logits by (set in ``setup``)."""
        self._checked = False  # check_before_fit has passed
        self._device: torch.device | None = None  # where an InProcess teacher loads (``setup``)
        self._dtype = None  # the policy's dtype, the teacher's (``setup``)

    def _check_temperature(self, temperature: float | None, what: str) -> None:
        """Refuse a temperature the placement's protocol cannot give (vLLM's prompt log-probs: 1 only)."""
        protocol = getattr(self.placement, "protocol", None)
        fixed = getattr(protocol, "temperature", None)
        if fixed is not None and temperature is not None and temperature != fixed:
            raise RecipeError(_FIXED_TEMPERATURE.format(fixed=fixed, protocol=type(protocol).__name__, what=what,
                                                        temperature=temperature))

    # What a placement asks of the model it places (``rllight.serving.Served``).
    def default_protocol(self) -> Protocol:
        return PromptLogprobs(rows_per_request=self.micro_batch_size)

    def served_name(self) -> None:
        return None  # the protocol's model, else the server's first (``PromptLogprobs.prepare``)

    def check_local(self) -> None:
        """Nothing before ``setup``, which compares the tokenizers wherever the teacher runs."""

    def worker_settings(self) -> dict:
        raise NotImplementedError("the teacher does not run in a worker")

    def forward(self, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The loaded teacher's log-prob of each response token of each ``(prompt_ids, response_ids)`` row, given
        its prompt and the response before it, at ``used_temperature``."""
        teacher = self.load()
        batch = rows_rollout(rows, self._device)
        logprobs = teacher_logprobs(teacher, batch, self.used_temperature, self.micro_batch_size)
        return [logprobs[i, : len(response)].tolist() for i, (_, response) in enumerate(rows)]

    def check_tokenizer(self, policy: HFModel) -> None:
        """Refuse, in one line, a teacher whose tokenizer differs from the policy's (``tokenizer_difference``).
        Loads the two tokenizers only."""
        difference = tokenizer_difference(_tokenizer(policy, "model.model"), _tokenizer(self.model, KEY))
        if difference is not None:
            raise RecipeError(f"{KEY}: the teacher's tokenizer differs from the policy's ({difference}); "
                              "distillation compares log-probs of the same token ids, so give a teacher of the "
                              "policy's tokenizer")

    def check_before_fit(self, module: L.LightningModule) -> None:
        """The tokenizers and the temperature, before any model loads (``rllight fit`` calls it first; ``setup``
        does otherwise): a teacher folder that is missing or of another tokenizer costs one line, not the minutes of
        the evaluation that opens a run."""
        if self._checked:
            return
        policy = getattr(module, "source", None)  # the policy's HFModel
        if policy is not None:
            self.check_tokenizer(policy)
        engine_temperature = getattr(getattr(module, "rollout", None), "temperature", None)
        if self.temperature is None and engine_temperature is not None:
            self.used_temperature = float(engine_temperature)
        if self.temperature is None:
            self._check_temperature(self.used_temperature, "engine's sampling temperature")
        self.placement.check(self)
        self._checked = True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.teacher is not None:
            return
        self.check_before_fit(pl_module)
        policy = getattr(pl_module, "source", None)
        self._device = trainer.strategy.root_device
        self._dtype = policy.dtype if policy is not None else None

    def load(self) -> torch.nn.Module:
        """The teacher, loaded once (``InProcess``): frozen, in eval mode, in the policy's dtype, on the trainer's
        device (both read at ``setup``)."""
        if self.teacher is None:
            if self._device is None:
                raise RecipeError("trainer.callbacks: TeacherLogprobs has no teacher loaded; it loads after fit "
                                  "starts")
            source = copy.copy(self.model)
            if self._dtype is not None:
                source.dtype = self._dtype
            teacher, _ = source.load()
            disable_dropout(teacher)
            teacher.config.use_cache = False
            self.teacher = teacher.requires_grad_(False).eval().to(self._device)
        return self.teacher

    def on_rollout(self, trainer: L.Trainer, context: RolloutContext | None, rollout: Rollout) -> Rollout:
        asked = int(rollout.response_mask.bool().any(-1).sum())  # rows with a response token in the loss
        teacher, bad = self.logprobs(rollout)
        if bad:  # their tokens leave the loss, as the overlong filter's do
            keep = torch.ones(len(rollout), dtype=rollout.response_mask.dtype, device=rollout.response_mask.device)
            keep[list(bad)] = 0
            rollout.response_mask = rollout.response_mask * keep.unsqueeze(-1)
        ranks = context.ranks if context is not None else Ranks()
        bad_total, asked_total = (int(n) for n in ranks.sum(torch.tensor([float(len(bad)), float(asked)])).tolist())
        self.note_bad(bad, asked, bad_total, asked_total)
        rollout.extras[TEACHER_LOGPROBS] = teacher
        rollout.extras.update(gap_metrics(teacher, rollout))
        rollout.extras["distill/bad_teacher_samples"] = float(bad_total)
        return rollout

    def teacher_name(self) -> str:
        """The teacher in messages: its folder (or hub id) as the recipe gives it, and where it runs when that is not
        the trainer's process (an endpoint's URL)."""
        name = f"the teacher {getattr(self.model, 'path', None) or type(self.model).__name__}"
        return name if isinstance(self.placement, InProcess) else f"{name} at {self.placement}"

    def note_bad(self, bad: dict[int, str], asked: int, bad_total: int, asked_total: int) -> None:
        """Say what this step's samples with unusable teacher log-probs (``bad``: row -> why, of this rank's
        ``asked``) cost: one warning (they are out of the loss), or, where no sample of the step had usable ones on
        any rank (``bad_total`` of ``asked_total``), the end of the run after the step, saved
        (``rllight.stopping.end_after_step``): a teacher that gives nothing usable is broken, not unlucky."""
        first = f"sample {min(bad)}: {bad[min(bad)]}" if bad else "on another rank"
        if asked_total and bad_total == asked_total:
            end_after_step(f"trainer.callbacks: TeacherLogprobs: {self.teacher_name()} gave no usable log-probs for "
                           f"any of the step's {asked_total} samples (first: {first}); check the teacher's weights "
                           "and, at a server, that it serves the teacher and answers log-probs (its placement's "
                           "protocol)")
        elif bad:
            log.warning("trainer.callbacks: TeacherLogprobs: %s gave log-probs that cannot be trained on for %d of "
                        "%d samples (first: %s); their tokens are left out of the loss and counted in "
                        "train/distill/bad_teacher_samples (a step where none is usable ends the run)",
                        self.teacher_name(), len(bad), asked, first)

    def logprobs(self, rollout: Rollout) -> tuple[Tensor, dict[int, str]]:
        """The teacher's log-probs of ``rollout``'s response tokens given their prompts and the responses before
        them, from where ``placement`` says: each row as its prompt tokens (``prompt_mask``) then its response tokens
        up to the last one in ``response_mask`` (a row with none is not asked). Each row's answer is checked
        (``unusable_logprobs``). A failure stops the step in one line: the teacher's signal is never replaced by
        zeros.

        Returns:
            The log-probs, shape (B, T), float32, zero outside ``rollout.response_mask`` and on the rows whose
            answer cannot be trained on; and, for each of those rows, why.
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
        for k, i in enumerate(index):
            values = answers[k] if len(answers) == len(rows) else None
            if isinstance(values, Failed):
                raise ComponentError(f"trainer.callbacks: TeacherLogprobs: {values}")
            n = len(rows[k][1])
            why = (f"{len(answers)} answer(s) for {len(rows)} samples" if len(answers) != len(rows)
                   else unusable_logprobs(values, mask[i, :n]))
            if why is not None:
                bad[i] = why
            else:
                out[i, :n] = torch.as_tensor(values, dtype=torch.float32)
        return torch.where(mask, out, 0.0).to(rollout.response_mask.device), bad


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


def gap_metrics(teacher: torch.Tensor, rollout: Rollout) -> dict[str, float]:
    """Per response token of the rollout, the means of the teacher's log-prob (``distill/teacher_logprob``) and of
    the sampler's minus the teacher's (``distill/reverse_kl``: the single-sample estimate of KL(student || teacher),
    which distillation drives down), both at the sampling temperature; logged as ``train/distill/...``."""
    mask = rollout.response_mask.float()
    tokens = mask.sum().clamp(min=1.0)
    student = rollout.sample_logprobs.to(teacher)
    return {"distill/teacher_logprob": float((teacher * mask).sum() / tokens),
            "distill/reverse_kl": float(((student - teacher) * mask).sum() / tokens)}
