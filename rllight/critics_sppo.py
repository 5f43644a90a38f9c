"""SPPO's scalar prompt critic: one success probability per prompt, trained with binary cross-entropy.

SPPO (Wang et al., "SPPO: Sequence-Level PPO for Long-Horizon Reasoning Tasks", arXiv:2604.08865)
treats a whole response as one action of a contextual bandit. Its critic only has to judge how solvable
the prompt is, ``V(prompt) = P(success)``, which is why a much smaller model than the policy can do it
(the paper's "decoupled small critic": a 1.5B critic for a 7B policy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rllight.critics import Critic, _zero_linear
from rllight.errors import RecipeError
from rllight.models import HFModel
from rllight.rollout.base import pad_left
from rllight.types import Rollout

if TYPE_CHECKING:
    from rllight.module import RLModule

__all__ = ["PromptCritic"]


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
        loss_coef: Weight of the BCE in the joint loss.
        lr: Learning rate of the critic's parameters (None = the policy optimizer's).
    """

    def __init__(self, model: HFModel | None = None, loss_coef: float = 1.0, lr: float | None = None):
        super().__init__(loss_coef=loss_coef, lr=lr)
        if loss_coef <= 0:
            raise RecipeError(f"model.critic.loss_coef must be > 0 (the critic must learn), got {loss_coef}")
        if lr is not None and lr <= 0:
            raise RecipeError(f"model.critic.lr must be > 0 or null, got {lr}")
        self.source = model
        self.shared = model is None  # instance attribute: read by the module like the class flag of other critics
        self.backbone: nn.Module | None = None
        self.head: nn.Linear | None = None
        self.tokenizer = None
        self.retokenize = False

    def setup(self, module: RLModule) -> None:
        if self.head is not None:
            return
        if self.source is None:
            self.head = _zero_linear(module.policy.config.hidden_size)
            return
        lm, tokenizer = self.source.load()
        self.backbone = lm.get_decoder()  # the LM head is not needed: a value, not a next token, is read out
        self.head = _zero_linear(lm.config.hidden_size)
        self.tokenizer = tokenizer
        self.retokenize = tokenizer.get_vocab() != module.tokenizer.get_vocab()

    # ------------------------------------------------------------------------------- values
    def values(self, module: RLModule, batch: Rollout, hidden: Tensor | None) -> Tensor:
        """Shape (B,): V(prompt) in (0, 1) for each row of ``batch``."""
        if self.shared:
            if hidden is None:
                raise RuntimeError("PromptCritic on the policy's backbone needs the policy's hidden states")
            h = hidden[:, 0]
        else:
            h = self._prompt_states(module, batch)
        return torch.sigmoid(self.head(h.to(self.head.weight.dtype)).squeeze(-1).float())

    def _prompt_states(self, module: RLModule, batch: Rollout) -> Tensor:
        """The critic backbone's last hidden state at the last prompt token, (B, H). Each distinct prompt
        runs once: the G responses to a prompt share its value."""
        device = self.head.weight.device
        # Rows are compared with their mask: a pad id that is also a real token (pad = eos) must not
        # merge two different prompts.
        keys = torch.cat([batch.prompt_ids, batch.prompt_mask.to(batch.prompt_ids.dtype)], dim=1)
        unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
        width = batch.prompt_ids.shape[1]
        ids, mask = unique[:, :width], unique[:, width:]
        if self.retokenize:
            texts = [module.tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=False)
                     for row, m in zip(ids, mask)]
            encoded = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            ids, mask = pad_left(encoded, self.tokenizer.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
        last = out.last_hidden_state[:, -1]  # left padding: the last column is every prompt's last token
        return last[inverse.to(device)]

    # --------------------------------------------------------------------------------- loss
    def loss(self, values: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-sequence BCE against ``batch.rewards``, shape (B,), and metrics."""
        target = batch.rewards.to(values.dtype)
        if ((target < 0) | (target > 1)).any():
            bad = target[(target < 0) | (target > 1)][0].item()
            raise RecipeError(f"model.critic: PromptCritic fits P(success) with BCE, so rewards must lie in [0, 1]; "
                              f"got {bad:g} (use a 0/1 reward, e.g. rllight.rewards.IntegerMatch)")
        bce = F.binary_cross_entropy(values, target, reduction="none")
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
