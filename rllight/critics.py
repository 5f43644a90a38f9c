"""Critics: the optional value model of an RLModule.

A critic is an ``nn.Module`` built lazily in ``setup`` (weights load with the policy), so recipes
instantiate without downloads. Two placements:

- ``ValueHead``: a linear head on the policy's last hidden state (shared backbone; VAPO figure 5);
- ``SeparateCritic``: its own causal LM with a head (decoupled critic; by default a copy of the
  initial policy, as VAPO's value model);
- ``PromptCritic``: SPPO's scalar prompt critic, on the shared backbone or a separate smaller model.

Token-level critics return values (B, T); a prompt-level critic (one value per prompt, e.g. SPPO's)
returns (B,). ``loss`` returns a per-token (B, T) or per-sequence (B,) loss that the module aggregates
like the policy loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rllight.algorithms import masked_mean, value_loss
from rllight.bounds import NonNegativeFloat, PositiveFloat, bounded
from rllight.errors import RecipeError
from rllight.models import HFModel, response_hidden_states
from rllight.rollout.base import distinct_prompts, pad_left, position_ids
from rllight.types import Rollout


class Critic(nn.Module):
    """Base class.

    Args:
        loss_coef: Weight of the critic's loss in the joint loss.
        lr: Learning rate of the critic's parameters (None = the policy optimizer's).
        weight_decay: The optimizer's weight decay for the critic's parameters (None = the policy optimizer's).
    """

    shared = True
    """Reads the policy's hidden states (True) or runs its own model (False)."""
    per_prompt = False
    """One value per response (shape (B,)) rather than one per token (B, T)."""

    def __init__(self, loss_coef: float = 0.5, lr: float | None = None, weight_decay: float | None = None):
        super().__init__()
        self.loss_coef = loss_coef
        self.lr = lr
        self.weight_decay = weight_decay

    def setup(self, policy: nn.Module, tokenizer, source: HFModel) -> None:
        """Build parameters once the policy is loaded: ``policy`` (the causal LM being trained), its
        ``tokenizer``, and ``source``, where the policy's weights came from (e.g. for a critic that starts as a
        copy of it)."""
        raise NotImplementedError

    def values(self, batch: Rollout, hidden: Tensor | None) -> Tensor:
        """The critic's output for ``batch``, as its ``loss`` takes it; ``hidden`` (B, T, H) is the policy's last
        hidden state at the positions that predict each response token (None when the policy did not run, for
        non-shared critics)."""
        raise NotImplementedError

    def to_values(self, out: Tensor) -> Tensor:
        """The values a rollout stores and the advantage estimators read, from what ``values`` returned (the
        same by default; ``PromptCritic``: probabilities from its logits)."""
        return out

    def loss(self, values: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-token (B, T) or per-sequence (B,) loss of ``values`` (as ``values`` returned them) against
        ``batch.returns`` and metrics."""
        raise NotImplementedError

    def param_groups(self) -> list[dict]:
        """The critic's optimizer groups, each ``{"name": "critic...", "params": [...]}`` with an ``lr`` where
        it has its own. One group by default; a critic whose head learns at another rate than its backbone
        returns two."""
        group = {"name": "critic", "params": [p for p in self.parameters() if p.requires_grad]}
        if self.lr is not None:
            group["lr"] = self.lr
        return [self._decayed(group)]

    def _decayed(self, group: dict) -> dict:
        """``group`` with the critic's own ``weight_decay`` where it has one."""
        if getattr(self, "weight_decay", None) is not None:  # a critic pickled before the setting had none
            group["weight_decay"] = self.weight_decay
        return group


class _TokenValueLoss:
    """Clipped squared error against the GAE returns, for token-level critics."""

    clip: float | None

    def loss(self, values: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        mask = batch.response_mask
        per_token = value_loss(values, batch.values, batch.returns, self.clip)
        return per_token, {
            "value/loss": masked_mean(per_token.detach(), mask),
            "value/mean": masked_mean(values.detach(), mask),
        }


class ValueHead(_TokenValueLoss, Critic):
    """``V(s_t) = w . h_t + b`` on the policy's last hidden state, zero-initialised (training starts from
    V = 0, no random bias in the first advantages).

    Where the value loss trains the shared backbone: in joint updates (``model.critic_first.steps`` and
    ``critic_first.epochs`` 0) always; in the critic-only updates that come first (VAPO's K_v steps, or epochs) only
    with ``critic_first_trains_backbone``, else the head trains alone on fixed features there. That option is
    the form of note 000's figure 5 (a shared backbone with a policy head and a linear value head; the note, in
    translation: "in the RL phase the whole network trains, value and policy updates kept apart in time"); in value
    pretraining the note keeps the backbone frozen (``ValuePretraining.train_backbone``). The price: the K_v
    updates move the policy between sampling and its own update, so the rollout is slightly off-policy; its old
    log-probs are then taken before them, from the policy that sampled, so that the policy update's ratio and
    clip are against the sampler.

    Args:
        loss_coef: Weight of the value loss.
        clip: Clip range of the value loss around the rollout's values (None = no clip). Not from VAPO's note
            or the PPO paper: OpenAI baselines' ppo2 (its ``vpredclipped``, at the policy's clip range), carried
            into verl (``cliprange_value``). Engstrom et al. (arXiv:2005.12729) found no evidence that it helps,
            Andrychowicz et al. (arXiv:2006.05990, decision C13) that it hurts; 0.2 is ppo2's default.
        lr: Learning rate of the head (None = the policy's).
        weight_decay: The optimizer's weight decay for the head (None = the policy optimizer's).
        critic_first_trains_backbone: Let the critic-only updates of ``model.critic_first.steps`` (or
            ``critic_first.epochs``) train the shared backbone too (note 000's figure 5; False = the head alone there).
    """

    shared = True

    @bounded
    def __init__(self, loss_coef: float = 0.5, clip: PositiveFloat | None = 0.2, lr: PositiveFloat | None = None,
                 critic_first_trains_backbone: bool = False, weight_decay: NonNegativeFloat | None = None):
        super().__init__(loss_coef=loss_coef, lr=lr, weight_decay=weight_decay)
        self.clip = clip
        self.critic_first_trains_backbone = critic_first_trains_backbone
        self.head: nn.Linear | None = None

    def setup(self, policy: nn.Module, tokenizer, source: HFModel) -> None:
        if self.head is None:
            self.head = _zero_linear(policy.config.hidden_size)

    def values(self, batch: Rollout, hidden: Tensor | None) -> Tensor:
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


class SeparateCritic(_TokenValueLoss, Critic):
    """A causal LM of its own with a linear value head (decoupled critic): the value loss trains the whole
    critic, and neither the value loss nor the policy's updates reach the other model. By default it starts
    as a copy of the policy's initial weights, as VAPO (arXiv:2504.05118) initialises its value model
    (note 000, algorithm 2: ``V <- copy of pi + value head``); ``model`` may name another, possibly smaller,
    model instead. It must share the policy's tokenizer (token-level values are per response token).
    The head is zero-initialised (training starts from V = 0).

    Args:
        model: Where the critic's backbone comes from (None = the policy's own source, ``model.model``: a
            second copy of the initial policy).
        loss_coef: Weight of the value loss.
        clip: Clip range of the value loss around the rollout's values (None = no clip; not from VAPO: PPO2's
            value clipping, see ``ValueHead``).
        lr: Learning rate of the critic's backbone (None = the policy's).
        head_lr: Learning rate of the value head (None = ``lr``). A zero-initialised head passes no gradient to
            the backbone until it has grown, so a head that learns faster than the backbone lets the whole
            critic start learning within a few rollouts.
        weight_decay: The optimizer's weight decay for the backbone and the head (None = the policy optimizer's).
    """

    shared = False

    @bounded
    def __init__(self, model: HFModel | None = None, loss_coef: float = 0.5, clip: PositiveFloat | None = 0.2,
                 lr: PositiveFloat | None = None, head_lr: PositiveFloat | None = None,
                 weight_decay: NonNegativeFloat | None = None):
        super().__init__(loss_coef=loss_coef, lr=lr, weight_decay=weight_decay)
        self.head_lr = head_lr
        self.source = model
        self.clip = clip
        self.backbone: nn.Module | None = None
        self.head: nn.Linear | None = None

    def setup(self, policy: nn.Module, tokenizer, source: HFModel) -> None:
        if self.backbone is not None:
            return
        lm, own_tokenizer = (self.source if self.source is not None else source).load()
        if own_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise RecipeError("model.critic: SeparateCritic needs the policy's tokenizer for token-level values; "
                              "use a critic model of the same family")
        self.backbone = lm.get_decoder()  # the LM head is not needed: a value, not a next token, is read out
        self.head = _zero_linear(lm.config.hidden_size)

    def values(self, batch: Rollout, hidden: Tensor | None) -> Tensor:
        h = response_hidden_states(self.backbone, batch)
        return self.head(h.to(self.head.weight.dtype)).squeeze(-1).float()

    def param_groups(self) -> list[dict]:
        if self.head_lr is None:
            return super().param_groups()
        backbone = {"name": "critic", "params": [p for p in self.backbone.parameters() if p.requires_grad]}
        if self.lr is not None:
            backbone["lr"] = self.lr
        head = {"name": "critic_head", "params": list(self.head.parameters()), "lr": self.head_lr}
        return [self._decayed(backbone), self._decayed(head)]


def _zero_linear(hidden_size: int) -> nn.Linear:
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class PromptCritic(Critic):
    """``V(prompt) = sigmoid(w . h + b)``, with ``h`` the last hidden state at the last prompt token,
    fitted with BCE to the binary outcome: ``L_V = -[R log V + (1 - R) log(1 - V)]`` (SPPO,
    arXiv:2604.08865). ``values`` has shape (B,) (one value per response, equal for responses to the
    same prompt) and ``loss`` returns the per-sequence BCE, shape (B,). The head is zero-initialised, so
    training starts from V = 0.5.

    Two placements:

    - ``model`` None: a head on the policy's own backbone (``hidden[:, 0]`` of the response-aligned
      hidden states is the state at the last prompt token, since prompts are left-padded); the BCE
      gradient also reaches the shared backbone.
    - ``model`` set: a separate causal LM (SPPO's decoupled critic, typically smaller than the policy)
      that reads only the prompt. Its ``lr`` puts it in its own optimizer parameter group (the paper
      uses 5e-6 for the critic, 1e-6 for the actor). If its tokenizer differs from the policy's, the
      prompt is decoded with the policy's tokenizer (chat-template markers kept as text) and encoded
      again with the critic's.

    Targets are ``rollout.rewards``, which must lie in [0, 1] (SPPO's {0, 1} outcome; BCE with a soft
    target in [0, 1] is still minimised at V = E[R]).

    Logged: ``value/loss`` (BCE), ``value/mean``, and ``value/calibration_corr``, the Pearson
    correlation, over the prompts of a micro-batch, between V and the observed success rate of the
    prompt (the mean of ``rollout.correct`` over its responses); it is left out when undefined (fewer
    than two prompts, or constant V or success).

    Args:
        model: The critic's own backbone (None = a head on the policy's backbone).
        loss_coef: Weight of the BCE in the joint loss (above 0: the critic must learn).
        lr: Learning rate of the critic's parameters (None = the policy optimizer's).
        weight_decay: The optimizer's weight decay for the critic's parameters (None = the policy optimizer's).
    """

    per_prompt = True

    @bounded
    def __init__(self, model: HFModel | None = None, loss_coef: PositiveFloat = 1.0, lr: PositiveFloat | None = None,
                 weight_decay: NonNegativeFloat | None = None):
        super().__init__(loss_coef=loss_coef, lr=lr, weight_decay=weight_decay)
        self.source = model
        self.shared = model is None  # instance attribute: read by the module like the class flag of other critics
        self.backbone: nn.Module | None = None
        self.head: nn.Linear | None = None
        self.tokenizer = None
        self.policy_tokenizer = None
        self.retokenize = False

    def setup(self, policy: nn.Module, tokenizer, source: HFModel) -> None:
        if self.head is not None:
            return
        if self.source is None:
            self.head = _zero_linear(policy.config.hidden_size)
            return
        lm, own_tokenizer = self.source.load()
        self.backbone = lm.get_decoder()  # the LM head is not needed: a value, not a next token, is read out
        self.head = _zero_linear(lm.config.hidden_size)
        self.tokenizer, self.policy_tokenizer = own_tokenizer, tokenizer
        self.retokenize = own_tokenizer.get_vocab() != tokenizer.get_vocab()

    # ------------------------------------------------------------------------------- values
    def values(self, batch: Rollout, hidden: Tensor | None) -> Tensor:
        """Shape (B,): the logit of V(prompt) for each row of ``batch`` (``to_values`` gives V in (0, 1)); the
        BCE is taken on the logit, whose gradient ``V - r`` does not vanish where the sigmoid saturates."""
        if self.shared:
            if hidden is None:
                raise RuntimeError("PromptCritic on the policy's backbone needs the policy's hidden states")
            h = hidden[:, 0]
        else:
            h = self._prompt_states(batch)
        return self.head(h.to(self.head.weight.dtype)).squeeze(-1).float()

    def to_values(self, out: Tensor) -> Tensor:
        return torch.sigmoid(out)

    def _prompt_states(self, batch: Rollout) -> Tensor:
        """The critic backbone's last hidden state at the last prompt token, (B, H). Each distinct prompt
        runs once: the G responses to a prompt share its value."""
        device = self.head.weight.device
        # Rows are compared with their mask: a pad id that is also a real token (pad = eos) must not
        # merge two different prompts.
        ids, mask, inverse = distinct_prompts(batch.prompt_ids, batch.prompt_mask)
        if self.retokenize:
            texts = [self.policy_tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=False)
                     for row, m in zip(ids, mask)]
            encoded = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            ids, mask = pad_left(encoded, self.tokenizer.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        out = self.backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False)
        last = out.last_hidden_state[:, -1]  # left padding: the last column is every prompt's last token
        return last[inverse.to(device)]

    # --------------------------------------------------------------------------------- loss
    def loss(self, values: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-sequence BCE of the logits ``values`` against ``batch.rewards``, shape (B,), and metrics (as the
        authors' code: BCE on logits; a sigmoid and then BCE has a zero gradient once the logit passes about 17
        in float32, where the sigmoid rounds to 1)."""
        logits = values
        values = torch.sigmoid(logits)
        target = batch.rewards.to(values.dtype)
        if ((target < 0) | (target > 1)).any():
            bad = target[(target < 0) | (target > 1)][0].item()
            raise RecipeError(f"model.critic: PromptCritic fits P(success) with BCE, so rewards must lie in [0, 1]; "
                              f"got {bad:g} (use a 0/1 reward, e.g. rllight.rewards.IntegerMatch)")
        bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        stats = {"value/loss": bce.detach().mean(), "value/mean": values.detach().mean()}
        corr = calibration_corr(values.detach(), batch.correct, batch.group_ids)
        if corr is not None:
            stats["value/calibration_corr"] = corr
        return bce, stats


def calibration_corr(values: Tensor, correct: Tensor, group_ids: Tensor) -> Tensor | None:
    """Pearson correlation between each prompt's value and its observed success rate.

    Args:
        values: Shape (B,), V(prompt) of each row.
        correct: Shape (B,), 0/1.
        group_ids: Shape (B,), rows with equal ids answer the same prompt.

    Returns:
        A scalar, or None when fewer than two prompts or a constant series leave it undefined.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if counts.numel() < 2:
        return None
    n = counts.to(torch.float64)
    v = torch.zeros_like(n).index_add_(0, inverse, values.double()) / n
    s = torch.zeros_like(n).index_add_(0, inverse, correct.to(values.device).double()) / n
    v, s = v - v.mean(), s - s.mean()
    denom = torch.sqrt((v * v).sum() * (s * s).sum())
    if denom <= 1e-12:
        return None
    return ((v * s).sum() / denom).float()
