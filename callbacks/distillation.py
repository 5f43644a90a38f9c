"""On-policy distillation's teachers (``TeacherLogprobs``), in the trainer process or at a server (their
``placement``, ``rllight.serving``): frozen models that score the tokens the student sampled, for
``rllight.strategies.OnPolicyDistillation``, and in process give their top-k (or full) distribution at each of them,
for the logit-level loss ``rllight.terms.TeacherDivergence``. One teacher, or one per data source."""

from __future__ import annotations

import logging

import lightning as L
import torch

from rllight.bounds import NonNegativeInt, PositiveFloat, PositiveInt, bounded
from rllight.callbacks.base import RolloutCallback, RolloutContext
from rllight.callbacks.distillation_teacher import Teacher, TeacherScores, tokenizer_difference, unusable_logprobs
from rllight.distributed import Ranks
from rllight.errors import RecipeError
from rllight.models import HFModel
from rllight.rollout.producer import DATA_SOURCE
from rllight.serving import Placement
from rllight.stopping import end_after_step
from rllight.strategies.advantages import TEACHER_LOGPROBS, TEACHER_TOP_IDS, TEACHER_TOP_LOGPROBS
from rllight.terms import TeacherDivergence
from rllight.types import Rollout

__all__ = ["DATA_SOURCE", "TEACHER_LOGPROBS", "TEACHER_TOP_IDS", "TEACHER_TOP_LOGPROBS", "Teacher", "TeacherLogprobs",
           "TeacherScores", "gap_metrics", "tokenizer_difference", "unusable_logprobs"]

log = logging.getLogger(__name__)

KEY = "trainer.callbacks: TeacherLogprobs"
"""``rollout.extras`` key of each response's data source (a list, one per row: the ``data_source`` of the prompt
row it answers), which routes it to its teacher (``TeacherLogprobs.teachers``)."""


class TeacherLogprobs(Teacher, RolloutCallback):
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

    **Its distribution** (``top_k``, in process only): with ``top_k: k`` it also stores, at each response token, the
    teacher's k most likely tokens and their log-probs (``rollout.extras["teacher_top_ids"]``, (B, T, k) int32, and
    ``["teacher_top_logprobs"]``, (B, T, k) float32), and with ``top_k: 0`` every token's log-prob (B, T, V): what
    the logit-level loss ``rllight.terms.TeacherDivergence`` (in ``model.loss_terms``, which then must list one)
    reads. They cost B x T x k x 8 bytes (x V x 4 at 0: 151 MB for 32 responses of 24 tokens over SmolLM2's 49152
    tokens). A served teacher gives no distribution: ``top_k`` with an ``Endpoint`` is refused in one line.

    **Several teachers** (``teachers``): a teacher per data source (``rllight.callbacks.distillation.Teacher``, each
    with its own model, placement and temperature), as ``rllight.rewards.PerSource`` gives a reward per source: each
    response is scored by the teacher of its row's ``data_source`` (``rollout.extras["data_source"]``), one call per
    teacher on its rows; ``model`` (and this callback's other settings) is the teacher of the other sources, and
    without it a source with no teacher is refused in one line. Every teacher's tokenizer must be the policy's.

    **Checked as the engine's log-probs are**, wherever the teacher runs (``unusable_logprobs``): one per response
    token asked, each finite and at most 0 on the response mask (a distribution's log-probs too). A sample whose
    teacher log-probs fail is left out of
    the loss (its ``response_mask`` zeroed, its reward kept for the group statistics, as ``OverlongFilter`` does) and
    counted in ``train/distill/bad_teacher_samples``, with one warning per step naming the teacher and the first
    sample's fault. A step where no sample (on any rank) has usable ones ends the run after the step, saved, in one line
    naming the teacher (``rllight.stopping.end_after_step``): a teacher that gives nothing usable is broken.

    ``rollout_order`` 25: after the reward shaping (10) and the loss masks (20), before the callbacks that train on
    the rollout or store it (``ValuePretraining``: 30, ``SelfImitation``: 40), which then see the teacher's log-probs.

    Args:
        model: The teacher (``rllight.models.HFModel``: a folder or a hub id), with the policy's tokenizer; with
            ``teachers``, the teacher of the data sources they do not name (None: those are refused).
        micro_batch_size: Rows per teacher forward pass (at a server: per request, unless the protocol says).
        temperature: The teacher's logits are divided by it. None = the rollout engine's sampling temperature, at
            which the student's log-probs (the engine's and the trainer's) are computed: both log-probs then
            describe distributions at one temperature, and their difference estimates the reverse KL between them.
            At a vLLM server: must come out as 1 (null with an engine at temperature 1, or 1.0).
        placement: Where the teacher runs (``rllight.serving``): ``InProcess`` (None, the default) or ``Endpoint``
            (its protocol defaults to ``PromptLogprobs``, its ``timeout_seconds`` to 600).
        top_k: The teacher's distribution stored for ``TeacherDivergence``: None (the default) none, only the
            sampled tokens' log-probs; k its k most likely tokens at each response token; 0 every token (as an
            engine's ``top_k`` 0 keeps every token). In process only.
        teachers: A ``Teacher`` per data source, as the rows spell it (None: one teacher, ``model``, for all).
    """

    rollout_order = 25

    @bounded
    def __init__(self, model: HFModel | None = None, micro_batch_size: PositiveInt = 8,
                 temperature: PositiveFloat | None = None, placement: Placement | None = None,
                 top_k: NonNegativeInt | None = None, teachers: dict[str, Teacher] | None = None):
        if model is None and not teachers:
            raise RecipeError(f"{KEY}: give the teacher (model) or a teacher per data source (teachers)")
        super().__init__(model, micro_batch_size, temperature, placement)
        self.teachers = dict(teachers or {})
        for source, teacher in self.teachers.items():
            if not isinstance(teacher, Teacher):
                raise RecipeError(f"{KEY}.teachers.{source} is a {type(teacher).__name__}, not a teacher; give "
                                  "class_path: rllight.callbacks.distillation.Teacher")
            teacher.bind(f"{KEY}.teachers.{source}.init_args", top_k)
        if model is not None:
            self.bind(KEY, top_k)
        self.top_k = top_k

    def check_before_fit(self, module: L.LightningModule) -> None:
        """The tokenizers and the temperature of every teacher, before any model loads (``rllight fit`` calls it
        first; ``setup`` does otherwise): a teacher folder that is missing or of another tokenizer costs one line,
        not the minutes of the evaluation that opens a run. Then ``TeacherDivergence`` terms in ``model.loss_terms``
        are given the policy's scoring; a distribution (``top_k``) that no term reads, or a term without one, is
        refused."""
        policy = getattr(module, "source", None)  # the policy's HFModel
        engine_temperature = getattr(getattr(module, "rollout", None), "temperature", None)
        for teacher in self.all_teachers():
            teacher.check_teacher(policy, engine_temperature)
        terms = [t for t in getattr(module, "loss_terms", None) or [] if isinstance(t, TeacherDivergence)]
        if self.top_k is not None and not terms:
            raise RecipeError(f"{KEY}.top_k stores the teacher's distribution for rllight.terms.TeacherDivergence; "
                              "add it to model.loss_terms, or leave top_k unset")
        if self.top_k is None and terms:
            raise RecipeError(f"model.loss_terms: TeacherDivergence reads the teacher's distribution; set {KEY}.top_k "
                              "(e.g. 64: its 64 most likely tokens at each response token; 0: every token)")
        scoring = getattr(module, "scoring", None)
        for term in terms if scoring is not None else []:
            term.bind(scoring)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.check_before_fit(pl_module)
        policy = getattr(pl_module, "source", None)
        for teacher in self.all_teachers():
            teacher.setup_teacher(trainer.strategy.root_device, policy.dtype if policy is not None else None)

    def all_teachers(self) -> list[Teacher]:
        """Every teacher: the default (this callback, when it has a ``model``), then those of ``teachers``."""
        return ([self] if self.model is not None else []) + list(self.teachers.values())

    def for_source(self, source: str) -> Teacher:
        """The teacher of the responses whose data source is ``source``."""
        if source in self.teachers:
            return self.teachers[source]
        if self.model is None:
            known = ", ".join(repr(s) for s in self.teachers)
            raise RecipeError(f"{KEY}: no teacher for data_source {source!r} (teachers has {known}); add it under "
                              f"{KEY}.teachers or give the default teacher (model)")
        return self

    def on_rollout(self, trainer: L.Trainer, context: RolloutContext | None, rollout: Rollout) -> Rollout:
        asked = int(rollout.response_mask.bool().any(-1).sum())  # rows with a response token in the loss
        teacher, bad, ids, values = self.logprobs(rollout)
        if bad:  # their tokens leave the loss, as the overlong filter's do
            keep = torch.ones(len(rollout), dtype=rollout.response_mask.dtype, device=rollout.response_mask.device)
            keep[list(bad)] = 0
            rollout.response_mask = rollout.response_mask * keep.unsqueeze(-1)
        ranks = context.ranks if context is not None else Ranks()
        bad_total, asked_total = (int(n) for n in ranks.sum(torch.tensor([float(len(bad)), float(asked)])).tolist())
        self.note_bad(bad, asked, bad_total, asked_total)
        rollout.extras[TEACHER_LOGPROBS] = teacher
        if values is not None:
            rollout.extras[TEACHER_TOP_LOGPROBS] = values
        if ids is not None:
            rollout.extras[TEACHER_TOP_IDS] = ids
        rollout.extras.update(gap_metrics(teacher, rollout))
        rollout.extras["distill/bad_teacher_samples"] = float(bad_total)
        return rollout

    def note_bad(self, bad: dict[int, str], asked: int, bad_total: int, asked_total: int) -> None:
        """Say what this step's samples with unusable teacher log-probs (``bad``: row -> why, of this rank's
        ``asked``) cost: one warning (they are out of the loss), or, where no sample of the step had usable ones on
        any rank (``bad_total`` of ``asked_total``), the end of the run after the step, saved
        (``rllight.stopping.end_after_step``): a teacher that gives nothing usable is broken, not unlucky."""
        first = f"sample {min(bad)}: {bad[min(bad)]}" if bad else "on another rank"
        name = self.teacher_name() if not self.teachers else "the teachers"
        if asked_total and bad_total == asked_total:
            end_after_step(f"{KEY}: {name} gave no usable log-probs for any of the step's {asked_total} samples "
                           f"(first: {first}); check the teacher's weights and, at a server, that it serves the "
                           "teacher and answers log-probs (its placement's protocol)")
        elif bad:
            log.warning("%s: %s gave log-probs that cannot be trained on for %d of %d samples (first: %s); their "
                        "tokens are left out of the loss and counted in train/distill/bad_teacher_samples (a step "
                        "where none is usable ends the run)", KEY, name, len(bad), asked, first)

    def logprobs(self, rollout: Rollout) -> tuple[torch.Tensor, dict[int, str], torch.Tensor | None,
                                                  torch.Tensor | None]:
        """The teachers' log-probs of ``rollout``'s response tokens and their distributions (``Teacher.scores``):
        each row from the teacher of its data source (``for_source``), one call per teacher on its rows, put back in
        place; a bad row's reason names its teacher when there are several."""
        if not self.teachers:
            return self.scores(rollout)
        if len(rollout) == 0:  # nothing to route (an empty rollout carries no sources): the shapes of any teacher's
            return self.all_teachers()[0].scores(rollout)
        sources = rollout.extras.get(DATA_SOURCE)
        if not isinstance(sources, list) or len(sources) != len(rollout):
            raise RecipeError(f"{KEY}.teachers: the rollout carries no data_source per response "
                              f"(rollout.extras[{DATA_SOURCE!r}]), so its rows cannot be routed to their teachers")
        by_teacher: dict[int, tuple[Teacher, list[int]]] = {}
        for i, source in enumerate(sources):
            teacher = self.for_source(str(source))
            by_teacher.setdefault(id(teacher), (teacher, []))[1].append(i)
        out = torch.zeros(rollout.response_mask.shape, dtype=torch.float32, device=rollout.response_mask.device)
        bad: dict[int, str] = {}
        ids = values = None
        for teacher, rows in by_teacher.values():
            part, part_bad, part_ids, part_values = teacher.scores(rollout.select(rows))
            index = torch.tensor(rows, device=out.device)
            out[index] = part
            bad.update({rows[r]: f"{teacher.teacher_name()}: {why}" for r, why in part_bad.items()})
            if part_values is not None:
                if values is None:
                    values = part_values.new_zeros((len(rollout), *part_values.shape[1:]))
                values[index] = part_values
            if part_ids is not None:
                if ids is None:
                    ids = part_ids.new_zeros((len(rollout), *part_ids.shape[1:]))
                ids[index] = part_ids
        return out, bad, ids, values


def gap_metrics(teacher: torch.Tensor, rollout: Rollout) -> dict[str, float]:
    """Per response token of the rollout, the means of the teacher's log-prob (``distill/teacher_logprob``) and of
    the sampler's minus the teacher's (``distill/reverse_kl``: the single-sample estimate of KL(student || teacher),
    which distillation drives down), both at the sampling temperature; logged as ``train/distill/...``."""
    mask = rollout.response_mask.float()
    tokens = mask.sum().clamp(min=1.0)
    student = rollout.sample_logprobs.to(teacher)
    return {"distill/teacher_logprob": float((teacher * mask).sum() / tokens),
            "distill/reverse_kl": float(((student - teacher) * mask).sum() / tokens)}
