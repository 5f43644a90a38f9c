"""Critics: the optional value model of an RLModule.

A critic is an ``nn.Module`` built lazily in ``setup`` (weights load with the policy), so recipes
instantiate without downloads. Two placements:

- ``ValueHead``: a linear head on the policy's last hidden state (shared backbone; VAPO figure 5);
- ``SeparateCritic``: its own, possibly smaller, causal LM with a head (decoupled critic).

Token-level critics return values (B, T); a prompt-level critic (one value per prompt, e.g. SPPO's)
returns (B,). ``loss`` returns a per-token (B, T) or per-sequence (B,) loss that the module aggregates
like the policy loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from rllight.algorithms import explained_variance, masked_mean, value_loss
from rllight.models import HFModel, response_hidden_states
from rllight.types import Rollout

if TYPE_CHECKING:
    from rllight.module import RLModule


class Critic(nn.Module):
    """Base class.

    Args:
        loss_coef: Weight of the critic's loss in the joint loss.
        lr: Learning rate of the critic's parameters (None = the policy optimizer's).
    """

    shared = True
    """Reads the policy's hidden states (True) or runs its own model (False)."""

    def __init__(self, loss_coef: float = 0.5, lr: float | None = None):
        super().__init__()
        self.loss_coef = loss_coef
        self.lr = lr

    def setup(self, module: RLModule) -> None:
        """Build parameters once the policy is loaded (``module.policy``, ``module.tokenizer``)."""
        raise NotImplementedError

    def values(self, module: RLModule, batch: Rollout, hidden: Tensor | None) -> Tensor:
        """Values for ``batch``; ``hidden`` (B, T, H) is the policy's last hidden state at the positions
        that predict each response token (None when the policy did not run, for non-shared critics)."""
        raise NotImplementedError

    def loss(self, values: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-token (B, T) or per-sequence (B,) loss against ``batch.returns`` and metrics."""
        raise NotImplementedError


class _TokenValueLoss:
    """Clipped squared error against the GAE returns, for token-level critics."""

    clip: float | None

    def loss(self, values: Tensor, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        mask = batch.response_mask
        per_token = value_loss(values, batch.values, batch.returns, self.clip)
        return per_token, {
            "value/loss": masked_mean(per_token.detach(), mask),
            "value/explained_variance": explained_variance(batch.values, batch.returns, mask),
            "value/mean": masked_mean(values.detach(), mask),
        }


class ValueHead(_TokenValueLoss, Critic):
    """``V(s_t) = w . h_t + b`` on the policy's last hidden state, zero-initialised (training starts from
    V = 0, no random bias in the first advantages).

    Args:
        loss_coef: Weight of the value loss.
        clip: Clip range of the value loss around the rollout's values (None = no clip).
        lr: Learning rate of the head (None = the policy's).
    """

    shared = True

    def __init__(self, loss_coef: float = 0.5, clip: float | None = 0.2, lr: float | None = None):
        super().__init__(loss_coef=loss_coef, lr=lr)
        self.clip = clip
        self.head: nn.Linear | None = None

    def setup(self, module: RLModule) -> None:
        if self.head is None:
            self.head = _zero_linear(module.policy.config.hidden_size)

    def values(self, module: RLModule, batch: Rollout, hidden: Tensor | None) -> Tensor:
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


class SeparateCritic(_TokenValueLoss, Critic):
    """A separate causal LM with a linear value head (decoupled critic; may be smaller than the
    policy). It must share the policy's tokenizer (token-level values are per response token).

    Args:
        model: Where the critic's backbone comes from.
        loss_coef: Weight of the value loss.
        clip: Clip range of the value loss (None = no clip).
        lr: Learning rate of the critic (None = the policy's).
    """

    shared = False

    def __init__(self, model: HFModel, loss_coef: float = 0.5, clip: float | None = 0.2, lr: float | None = None):
        super().__init__(loss_coef=loss_coef, lr=lr)
        self.source = model
        self.clip = clip
        self.backbone: nn.Module | None = None
        self.head: nn.Linear | None = None

    def setup(self, module: RLModule) -> None:
        if self.backbone is not None:
            return
        lm, tokenizer = self.source.load()
        if tokenizer.get_vocab() != module.tokenizer.get_vocab():
            from rllight.errors import RecipeError

            raise RecipeError("model.critic: SeparateCritic needs the policy's tokenizer for token-level values; "
                              "use a critic model of the same family")
        self.backbone = lm.get_decoder()
        self.head = _zero_linear(lm.config.hidden_size)

    def values(self, module: RLModule, batch: Rollout, hidden: Tensor | None) -> Tensor:
        h = response_hidden_states(self.backbone, batch)
        return self.head(h.to(self.head.weight.dtype)).squeeze(-1).float()


def _zero_linear(hidden_size: int) -> nn.Linear:
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head
