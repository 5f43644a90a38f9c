"""Advantage estimators (``model.advantage``): each maps a scored Rollout to ``(advantages, returns)``, both (B, T);
``returns`` are the critic's value targets (None without a critic).

- With a critic: ``GAE`` (PPO), ``DecoupledGAE`` (VC-PPO / VAPO: its policy lambda is a schedule of
  ``rllight.strategies.lambdas``), ``PromptBaseline`` (SPPO: a prompt-level critic).
- From the rewards alone: ``GroupRelative`` (GRPO, Dr. GRPO), ``RLOO``, ``ReMax`` (with ``ReMaxSampler``'s greedy
  rewards), ``ReinforcePP`` (REINFORCE++: discounted token rewards).
- From a teacher: ``OnPolicyDistillation`` (the teacher's minus the student's log-prob of each sampled token, with
  ``rllight.callbacks.TeacherLogprobs``), optionally plus one of the above.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rllight._compat import lazy_default
from rllight.algorithms import gae, group_relative, masked_whiten, reinforce_pp, remax, rloo
from rllight.bounds import ClosedUnitInterval, NonNegativeFloat, PositiveFloat, UpToOne, bounded
from rllight.errors import RecipeError
from rllight.rollout.episodes import EPISODE_ID, EPISODE_MAIN
from rllight.strategies.lambdas import AdaptiveLambda, LambdaSchedule
from rllight.strategies.samplers import GREEDY_REWARDS
from rllight.types import Rollout

__all__ = ["GAE", "RLOO", "TEACHER_LOGPROBS", "TEACHER_TOP_IDS", "TEACHER_TOP_LOGPROBS", "AdvantageEstimator",
           "DecoupledGAE", "GroupRelative", "OnPolicyDistillation", "PromptBaseline", "ReMax", "ReinforcePP",
           "episode_advantages"]

_NORMALIZE = ("none", "batch_std", "bernoulli")  # PromptBaseline's sigma
TEACHER_LOGPROBS = "teacher_logprobs"
"""``rollout.extras`` key of the teacher's log-probs of the sampled tokens, shape (B, T), zero outside the response
mask: ``rllight.callbacks.TeacherLogprobs`` puts them there, ``OnPolicyDistillation`` reads them."""
TEACHER_TOP_LOGPROBS = "teacher_top_logprobs"
"""``rollout.extras`` key of the teacher's log-probs of its k most likely tokens at each response position, shape
(B, T, k), float32, zero outside the response mask; with ``TeacherLogprobs.top_k`` 0, of every token in id order,
shape (B, T, V). ``rllight.callbacks.TeacherLogprobs`` puts them there, ``rllight.terms.TeacherDivergence`` reads
them."""
TEACHER_TOP_IDS = "teacher_top_ids"
"""``rollout.extras`` key of the token ids of ``TEACHER_TOP_LOGPROBS``, shape (B, T, k), int32; absent where those
cover the whole vocabulary in id order (``top_k`` 0)."""


class AdvantageEstimator:
    """Base class. Subclass it in your own module and select it with ``class_path`` in a recipe.

    ``needs_values`` tells the module to run the critic before calling the estimator;
    ``uses_token_rewards`` says that it reads ``rollout.token_rewards`` (where a KL penalty in the
    reward lands) rather than only the outcome ``rollout.rewards``; ``min_group_size`` is the smallest
    number of responses per prompt it can learn from (group baselines: 2, since a group of one has
    advantage 0), checked against the sampler's ``group_size`` when the recipe is built; ``gamma`` is the discount
    of the token rewards (1.0 for estimators without one), which value pretraining's Monte-Carlo returns use.
    """

    needs_values: bool = False
    uses_token_rewards: bool = False
    per_episode: bool = False
    """Its advantage is one number per response, from the outcome rewards of the response's group. Then an
    episode laid out as several rows (a template that rewrote the history, ``rllight.rollout.episodes``) counts
    once in its group, and each of its rows gets its advantage (``episode_advantages``). Otherwise every row is
    its own sequence ending with the episode's outcome (a Monte-Carlo return for the earlier samples)."""
    min_group_size: int = 1
    gamma: float = 1.0
    total = None
    """Sums a tensor over the training processes, set by the module (None = one process): batch statistics such
    as whitening's use it so that they are the global batch's, and every rank calls the estimator (an empty
    rollout too)."""

    def __call__(self, rollout: Rollout) -> tuple[Tensor, Tensor | None]:
        """``(advantages (B, T), returns (B, T) or None)``, zero outside ``rollout.response_mask``."""
        raise NotImplementedError


def episode_advantages(estimator: AdvantageEstimator, rollout: Rollout) -> tuple[Tensor, Tensor | None]:
    """``estimator(rollout)``, with each episode counted once when it is laid out as several rows.

    For a ``per_episode`` estimator and a rollout with ``EPISODE_MAIN`` rows: the estimator sees one row per
    episode (its main row), and every row of an episode gets that row's advantage on its own response tokens.
    Anything else is ``estimator(rollout)`` unchanged (one call either way: the estimators' collectives match
    across ranks)."""
    main = rollout.extras.get(EPISODE_MAIN)
    if not estimator.per_episode or main is None or len(main) != len(rollout) or bool(main.all()):
        return estimator(rollout)
    index = main.nonzero().squeeze(-1)
    adv, returns = estimator(rollout.select(index))
    mask = rollout.response_mask[index].to(adv.dtype)
    per_main = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # constant over a response's tokens
    ids = rollout.extras[EPISODE_ID]
    owner = (ids.unsqueeze(1) == ids[index].unsqueeze(0)).float().argmax(1)  # each row's main row, in ``index``
    if returns is not None:
        raise RecipeError(f"model.advantage: {type(estimator).__name__} is per_episode but returns value targets")
    return _broadcast(per_main[owner.to(per_main.device)], rollout), None


def _broadcast(adv: Tensor, rollout: Rollout) -> Tensor:
    return adv.unsqueeze(-1) * rollout.response_mask.to(adv.dtype)


class GAE(AdvantageEstimator):
    """PPO's generalised advantage estimation (arXiv:1506.02438) on token rewards and critic values;
    returns (value targets) are ``advantages + values``.

    Args:
        gamma: Discount.
        lam: GAE lambda.
        whiten: Normalise advantages over the batch's valid tokens (as PPO implementations do).
    """

    needs_values = True
    uses_token_rewards = True

    @bounded
    def __init__(self, gamma: ClosedUnitInterval = 1.0, lam: ClosedUnitInterval = 0.95, whiten: bool = True):
        self.gamma = gamma
        self.lam = lam
        self.whiten = whiten

    def __call__(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        if rollout.values is None:
            raise RecipeError("model.advantage: GAE needs a critic; set model.critic (e.g. rllight.critics.ValueHead)")
        advantages, returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, self.gamma, self.lam)
        if self.whiten:
            advantages = masked_whiten(advantages, rollout.response_mask, total=self.total)
        return advantages, returns


class DecoupledGAE(AdvantageEstimator):
    """GAE with separate lambdas for the policy and the value targets (decoupled GAE of VC-PPO,
    arXiv:2503.01491, used by VAPO, arXiv:2504.05118).

    Policy advantages: ``gae(token_rewards, values, lam = policy_lambda(L))``, optionally whitened.
    Value targets (``returns``): ``gae(..., lam = value_lam) + values``; with ``gamma = value_lam = 1``
    they are the Monte-Carlo returns ``G_t``, so the critic is fitted without bootstrapping on itself.
    ``value_lam: null`` couples them again (targets use the policy's lambda, as plain PPO).

    The update order of note 000 (K_v critic optimizer steps on the fresh rollout, then values and advantages
    recomputed with the updated critic, then the policy update) is ``model.critic_first.steps``.

    Lambda statistics go to ``rollout.extras`` as ``advantage/lambda_{mean,min,max}``.

    Args:
        policy_lambda: The policy's lambda, one per sequence (``AdaptiveLambda``, ``VAPOLambda``) or
            ``FixedLambda``.
        value_lam: Lambda of the value targets (1.0 = Monte-Carlo; null = the policy's lambda).
        gamma: Discount (1.0 for outcome rewards).
        whiten: Normalise advantages over the batch's valid tokens.
    """

    needs_values = True
    uses_token_rewards = True

    @bounded
    def __init__(self, policy_lambda: LambdaSchedule = lazy_default(AdaptiveLambda),
                 value_lam: ClosedUnitInterval | None = 1.0, gamma: ClosedUnitInterval = 1.0, whiten: bool = True):
        self.policy_lambda = policy_lambda
        self.value_lam = value_lam
        self.gamma = gamma
        self.whiten = whiten

    def __call__(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        if rollout.values is None or rollout.values.dim() != 2:
            raise RecipeError("model.advantage: DecoupledGAE needs token-level values; set model.critic (e.g. "
                              "rllight.critics.ValueHead)")
        lengths = rollout.response_lengths
        self.policy_lambda.total = self.total  # a schedule's batch statistics are the global batch's
        lam = self.policy_lambda(lengths)
        advantages, returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, self.gamma, lam)
        if self.value_lam is not None:
            _, returns = gae(rollout.token_rewards, rollout.values, rollout.response_mask, self.gamma, self.value_lam)
        if self.whiten:
            advantages = masked_whiten(advantages, rollout.response_mask, total=self.total)
        lam_t = lam if isinstance(lam, Tensor) else torch.full_like(lengths, lam, dtype=torch.float32)
        if lam_t.numel():
            rollout.extras.update({"advantage/lambda_mean": float(lam_t.float().mean()),
                                   "advantage/lambda_min": float(lam_t.min()),
                                   "advantage/lambda_max": float(lam_t.max())})
        return advantages, returns


class PromptBaseline(AdvantageEstimator):
    """SPPO's sequence-level advantage (Wang et al., arXiv:2604.08865) ``A = (R - V(prompt)) / sigma``, broadcast
    over every response token. ``V`` comes from a prompt-level critic (``rllight.critics.PromptCritic``, values (B,)).

    ``sigma`` by ``normalize``:
        ``none``: 1 (the note's simplified form, ``A = R - V``);
        ``batch_std``: the std of ``R - V`` over the rollout (unbiased), plus ``eps``;
        ``bernoulli``: ``sqrt(V (1 - V))``, the std of a Bernoulli outcome of success probability V;
        it is floored at ``min_sigma`` so that a confident critic cannot blow the advantage up (the
        floor is ours, not the paper's).

    Returns no value targets: the critic is fitted to the rewards themselves. Reads the outcome reward
    only, so a KL penalty belongs in the loss (``model.kl.in_reward: false``).

    Args:
        normalize: none, batch_std or bernoulli.
        min_sigma: Floor of the Bernoulli sigma.
        eps: Added to the batch std.
    """

    needs_values = True

    @bounded
    def __init__(self, normalize: str = "none", min_sigma: PositiveFloat = 0.05, eps: float = 1e-6):
        if normalize not in _NORMALIZE:
            raise RecipeError(f"model.advantage.normalize: '{normalize}' is not one of {', '.join(_NORMALIZE)}")
        self.normalize = normalize
        self.min_sigma = min_sigma
        self.eps = eps

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        values = rollout.values
        if values is None or values.dim() != 1:
            raise RecipeError("model.critic: PromptBaseline needs a prompt-level critic with one value per response "
                              "(class_path: rllight.critics.PromptCritic)")
        adv = rollout.rewards.to(values.dtype) - values
        if self.normalize == "batch_std":
            total = self.total or (lambda t: t)  # the global batch's standard deviation
            n, s1, s2 = total(torch.stack([adv.new_tensor(float(adv.numel())), adv.sum(), (adv * adv).sum()]))
            std = ((s2 - s1 * s1 / n.clamp(min=1)) / (n - 1).clamp(min=1)).clamp(min=0).sqrt() if n > 1 else n * 0
            adv = adv / (std + self.eps)
        elif self.normalize == "bernoulli":
            adv = adv / torch.sqrt(values * (1.0 - values)).clamp(min=self.min_sigma)
        return adv.unsqueeze(-1) * rollout.response_mask.to(adv.dtype), None


class GroupRelative(AdvantageEstimator):
    """GRPO's group-relative advantage (arXiv:2402.03300), or Dr. GRPO's (arXiv:2503.20783) with
    ``scale_by_std: false``, broadcast to every token of the response.

    Args:
        scale_by_std: Divide by the group's (unbiased) reward std.
        eps: Added to the std.
    """

    min_group_size = 2

    def __init__(self, scale_by_std: bool = True, eps: float = 1e-6):
        self.scale_by_std = scale_by_std
        self.eps = eps

    per_episode = True

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        adv = group_relative(rollout.rewards, rollout.group_ids, self.scale_by_std, self.eps)
        return adv.unsqueeze(-1) * rollout.response_mask.to(adv.dtype), None


class RLOO(AdvantageEstimator):
    """REINFORCE leave-one-out (Ahmadian et al., arXiv:2402.14740): the baseline of a response is the
    mean reward of the other responses to its prompt, ``A_i = R_i - mean_{j != i} R_j``, broadcast to
    every token. Needs ``group_size >= 2``; a group of one gets A = 0. Reads the outcome reward only: a KL
    penalty belongs in the loss (``model.kl.in_reward: false``) with this estimator."""

    min_group_size = 2

    per_episode = True

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        return _broadcast(rloo(rollout.rewards, rollout.group_ids), rollout), None


class ReMax(AdvantageEstimator):
    """ReMax (Li et al., arXiv:2310.10505): ``A_i = R_i - R(greedy response to the same prompt)``,
    broadcast to every token. Needs ``model.sampler: rllight.strategies.ReMaxSampler``, which generates
    and scores the greedy responses. Reads the outcome rewards only (put a KL penalty in the loss)."""

    per_episode = True

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        if GREEDY_REWARDS not in rollout.extras:
            raise RecipeError("model.advantage: ReMax needs the greedy rewards; set model.sampler to "
                              "rllight.strategies.ReMaxSampler")
        return _broadcast(remax(rollout.rewards, rollout.extras[GREEDY_REWARDS]), rollout), None


class ReinforcePP(AdvantageEstimator):
    """REINFORCE++ (Hu et al., arXiv:2501.03262): discounted returns of the token rewards, whitened over
    the batch. The token rewards hold the outcome on the last token and, with
    ``model.kl: {in_reward: true}``, the KL penalty on every token: that is how REINFORCE++ uses KL.
    Returns no value targets (no critic).

    Args:
        gamma: Discount (1.0 in the paper).
    """

    uses_token_rewards = True

    @bounded
    def __init__(self, gamma: UpToOne = 1.0):
        self.gamma = gamma

    def __call__(self, rollout: Rollout) -> tuple[Tensor, None]:
        advantages, _ = reinforce_pp(rollout.token_rewards, rollout.response_mask, self.gamma, total=self.total)
        return advantages, None


class OnPolicyDistillation(AdvantageEstimator):
    """On-policy distillation: the student samples, a teacher scores the sampled tokens, and each token's advantage
    is the teacher's minus the student's log-prob of it (GKD's fully on-policy setting, Agarwal et al.,
    arXiv:2306.13649, with the sampled-token reverse KL as the per-token advantage of Thinking Machines' "On-Policy
    Distillation", 2025; NeMo-RL's distillation loss and TRL's GKD compare whole distributions instead, the logit
    level of ``rllight.terms.TeacherDivergence``):

        A_t = coef * (log pi_T(y_t) - log pi_S(y_t)) + task_weight * A_task_t

    on the response mask, zero elsewhere. The first term is minus the single-sample estimate of the reverse KL at
    token t; it is a constant for the update (no gradient flows through either log-prob), so the policy loss
    raises the tokens the teacher likes more than the student does and lowers the others. It is per token: no
    future tokens' terms are summed into it (a discount of 0).

    The teacher's log-probs are ``rollout.extras["teacher_logprobs"]`` (``TEACHER_LOGPROBS``), which the rollout
    callback ``rllight.callbacks.TeacherLogprobs`` computes; recipes list it in ``trainer.callbacks``. The student's
    are ``rollout.old_logprobs`` when the step computed them (several updates per rollout, or a KL penalty in the
    reward: the trainer's log-probs under the policy that sampled, the ratio's base), else ``rollout.sample_logprobs``
    (the engine's log-probs of the same policy at the same temperature; a step with a single update skips the old
    pass, as these are the same numbers up to rounding). The teacher's are computed at the same temperature.

    This is the sampled-token estimator. The logit-level alternative compares whole distributions at each position:
    the loss term ``rllight.terms.TeacherDivergence`` on the teacher's top-k (or full) distribution, which
    ``TeacherLogprobs(top_k=...)`` stores; with it, ``coef: 0.0`` here leaves the term alone to distil (the
    teacher's sampled-token log-probs are still required and logged).

    Args:
        coef: Weight of the distillation term.
        task: An advantage estimator on the task's reward (e.g. ``GroupRelative``) added to the distillation
            term; None = distillation alone. Its ``min_group_size``, ``needs_values``, ``uses_token_rewards`` and
            ``gamma`` are this estimator's, and its value targets (``returns``) are returned.
        task_weight: Weight of the task's advantage (ignored without ``task``).
    """

    @bounded
    def __init__(self, coef: NonNegativeFloat = 1.0, task: AdvantageEstimator | None = None,
                 task_weight: NonNegativeFloat = 1.0):
        self.coef = coef
        self.task = task
        self.task_weight = task_weight
        if task is not None:  # what the module and the recipe checks read of an estimator is the task's
            self.min_group_size = task.min_group_size
            self.needs_values = task.needs_values
            self.uses_token_rewards = task.uses_token_rewards
            self.gamma = task.gamma

    def __call__(self, rollout: Rollout) -> tuple[Tensor, Tensor | None]:
        teacher = rollout.extras.get(TEACHER_LOGPROBS)
        if teacher is None:
            raise RecipeError("model.advantage: OnPolicyDistillation needs the teacher's log-probs; add "
                              "rllight.callbacks.TeacherLogprobs to trainer.callbacks")
        student = rollout.old_logprobs if rollout.old_logprobs is not None else rollout.sample_logprobs
        mask = rollout.response_mask.to(torch.float32)
        advantages = self.coef * (teacher.to(mask) - student.to(mask)) * mask
        returns = None
        if self.task is not None:
            self.task.total = self.total  # its batch statistics are the global batch's
            task_advantages, returns = self.task(rollout)
            advantages = advantages + self.task_weight * task_advantages.to(mask) * mask
        return advantages, returns
