"""VAPO (arXiv:2504.05118, note 000): lambdas and decoupled GAE against hand-computed numbers (arithmetic in the
comments), the positive-example NLL, value pretraining and self-imitation on hand-built rollouts with fake
rollout contexts, the critic-first update order and two-step runs of the VAPO recipes on a tiny in-process model, and
resume from a Lightning checkpoint."""

import copy
import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch.testing import assert_close

from rllight.algorithms import adaptive_lambda, gae, vapo_lambda
from rllight.callbacks import RolloutContext, SelfImitation, ValuePretraining
from rllight.callbacks.replay import build_rollout
from rllight.critics import SeparateCritic, ValueHead
from rllight.errors import RecipeError
from rllight.terms import ResponseNLL
from rllight.strategies import (
    AdaptiveLambda,
    ClippedSurrogate,
    DecoupledGAE,
    FixedLambda,
    PositiveExampleNLL,
    SeqMeanTokenSum,
    TokenMean,
    VAPOLambda,
)

from conftest import RECIPES
from helpers import CaptureLogger, build, load_tool, tiny_overrides, unchanged_parameters
from test_dapo import make_rollout

ABLATIONS = os.path.join(RECIPES, "ablations")
SHARED_CRITIC = os.path.join(ABLATIONS, "vapo-shared-critic.yaml")  # a value head on the policy's backbone
FIGURE_5 = os.path.join(ABLATIONS, "vapo-shared-backbone.yaml")  # ... whose critic-first updates train the backbone

# --------------------------------------------------------------------------------------------------
# Lambdas
# --------------------------------------------------------------------------------------------------


def test_adaptive_lambda_hand_computed():
    # Lengths 10, 20, 30: mean 20, unbiased std 10 -> z = -1, 0, 1.
    # sigmoid(1) = 0.7310585786, sigmoid(-1) = 0.2689414214.
    # lam = 0.3 + 0.65 * sigmoid(z) = 0.3 + 0.1748119239, 0.3 + 0.325, 0.3 + 0.4751880761.
    lam = adaptive_lambda(torch.tensor([10, 20, 30]), 0.3, 0.95)
    assert_close(lam, torch.tensor([0.4748119239, 0.625, 0.7751880761]))


def test_adaptive_lambda_at_the_mean_length_is_the_midpoint():
    # The response at the batch mean has z = 0: (0.3 + 0.95) / 2 = 0.625, whatever the spread.
    assert adaptive_lambda(torch.tensor([2, 8, 14]))[1].item() == pytest.approx(0.625)
    # Equal lengths (std 0, clamped to 1) and a single response: every lambda is the midpoint.
    assert_close(adaptive_lambda(torch.tensor([7, 7, 7])), torch.full((3,), 0.625))
    assert_close(adaptive_lambda(torch.tensor([5])), torch.tensor([0.625]))


def test_adaptive_lambda_clamps_a_small_std_to_one_token():
    # Lengths 10, 11: std = 0.7071 is clamped to 1 -> z = -0.5, 0.5;
    # sigmoid(0.5) = 0.6224593312 -> 0.3 + 0.65 * 0.6224593312 = 0.7045985653; 0.3 + 0.65 * 0.3775406688 = 0.5454014347.
    assert_close(adaptive_lambda(torch.tensor([10.0, 11.0])), torch.tensor([0.5454014347, 0.7045985653]))


def test_vapo_lambda_hand_computed():
    # 1 - 1 / (0.05 L): L = 100 -> 1 - 1/5 = 0.8; L = 1000 -> 1 - 1/50 = 0.98; L = 20 -> 1 - 1/1 = 0;
    # L = 10 -> 1 - 1/0.5 = -1, clamped to 0; L = 0 -> undefined, 0.
    assert_close(vapo_lambda(torch.tensor([100, 1000, 20, 10, 0]), alpha=0.05),
                 torch.tensor([0.8, 0.98, 0.0, 0.0, 0.0]))


def test_lambda_schedules_delegate_to_the_pure_functions():
    lengths = torch.tensor([3, 9, 30])
    assert FixedLambda(0.9)(lengths) == 0.9
    assert_close(AdaptiveLambda(0.2, 0.8)(lengths), adaptive_lambda(lengths, 0.2, 0.8))
    assert_close(VAPOLambda(0.1)(lengths), vapo_lambda(lengths, 0.1))


# --------------------------------------------------------------------------------------------------
# Decoupled GAE
# --------------------------------------------------------------------------------------------------


def _scored(values, token_rewards, lengths):
    rollout = make_rollout([0.0] * len(lengths), lengths, width=len(values[0]))
    rollout.values = torch.tensor(values)
    rollout.token_rewards = torch.tensor(token_rewards)
    return rollout


def test_decoupled_gae_hand_computed():
    # One response of 3 tokens (the 4th column is padding with junk), outcome reward 1 on the last token,
    # V = 0.5, 0.6, 0.7; gamma = 1.
    # Policy lambda 0.5: delta = 0.6-0.5 = 0.1, 0.7-0.6 = 0.1, 1-0.7 = 0.3;
    #   A_2 = 0.3; A_1 = 0.1 + 0.5*0.3 = 0.25; A_0 = 0.1 + 0.5*0.25 = 0.225.
    # Value lambda 1: returns are the Monte-Carlo return G_t = 1 on every token.
    rollout = _scored([[0.5, 0.6, 0.7, 9.0]], [[0.0, 0.0, 1.0, 0.0]], [3])
    adv, ret = DecoupledGAE(policy_lambda=FixedLambda(0.5), value_lam=1.0, whiten=False)(rollout)
    assert_close(adv, torch.tensor([[0.225, 0.25, 0.3, 0.0]]))
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # Coupled (value_lam null): the targets bootstrap with the policy's lambda, returns = A + V
    #   = 0.225 + 0.5, 0.25 + 0.6, 0.3 + 0.7.
    _, ret = DecoupledGAE(policy_lambda=FixedLambda(0.5), value_lam=None, whiten=False)(rollout)
    assert_close(ret, torch.tensor([[0.725, 0.85, 1.0, 0.0]]))
    assert rollout.extras["advantage/lambda_mean"] == pytest.approx(0.5)


def test_decoupled_gae_uses_one_adaptive_lambda_per_sequence_and_reports_its_statistics():
    g = torch.Generator().manual_seed(0)
    lengths = [2, 5, 3, 6]
    rollout = _scored(torch.rand(4, 6, generator=g).tolist(), torch.zeros(4, 6).tolist(), lengths)
    rollout.token_rewards[torch.arange(4), torch.tensor(lengths) - 1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv, ret = DecoupledGAE(whiten=False)(rollout)  # defaults: AdaptiveLambda(0.3, 0.95), value_lam 1.0
    lam = adaptive_lambda(torch.tensor(lengths))
    expected_adv, _ = gae(rollout.token_rewards, rollout.values, rollout.response_mask, 1.0, lam)
    _, mc = gae(rollout.token_rewards, rollout.values, rollout.response_mask, 1.0, 1.0)
    assert_close(adv, expected_adv)
    assert_close(ret, mc)
    # Monte-Carlo returns with gamma = 1: the outcome reward on every valid token.
    assert_close(ret, torch.tensor([1.0, 0.0, 1.0, 1.0]).unsqueeze(-1) * rollout.response_mask)
    assert rollout.extras["advantage/lambda_mean"] == pytest.approx(lam.mean().item())
    assert rollout.extras["advantage/lambda_min"] == pytest.approx(lam.min().item())
    assert rollout.extras["advantage/lambda_max"] == pytest.approx(lam.max().item())


# --------------------------------------------------------------------------------------------------
# Positive-example NLL (the paper's in-batch self-imitation)
# --------------------------------------------------------------------------------------------------


def test_positive_example_nll_hand_computed():
    # Two responses of two tokens; response 0 is correct, response 1 wrong. Zero advantages, so the clipped
    # surrogate is 0 and only the NLL term is left: 0.1 * (-ln 0.5, -ln 0.25) on response 0, 0 on response 1.
    # normalize all_tokens, token-mean over the step's 4 tokens: 0.1 * (0.6931471806 + 1.3862943611) / 4 = 0.0519860385
    # (the paper's default, over the correct tokens only, is tested in tests/strategies/test_positive_nll.py).
    logprobs = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]])).requires_grad_()
    batch = make_rollout([1.0, 0.0], lengths=[2, 2])
    batch.old_logprobs = logprobs.detach().clone()
    batch.advantages = torch.zeros(2, 2)
    per_token, stats = PositiveExampleNLL(ClippedSurrogate(0.2, 0.28), coef=0.1, normalize="all_tokens")(logprobs, batch)
    assert_close(per_token.detach(), torch.tensor([[0.0693147181, 0.1386294361], [0.0, 0.0]]))
    loss = TokenMean()(per_token, batch.response_mask, num_tokens=torch.tensor(4.0))
    assert loss.item() == pytest.approx(0.0519860385)
    loss.backward()
    # d loss / d logp = -0.1 / 4 = -0.025 on the correct response's tokens, 0 on the wrong one's.
    assert_close(logprobs.grad, torch.tensor([[-0.025, -0.025], [0.0, 0.0]]))
    assert stats["policy/positive_nll"].item() == pytest.approx((0.6931471806 + 1.3862943611) / 2)
    # Normalisation: the paper divides by the correct tokens only (2): 0.1 * 2.0794415417 / 2 = 0.1039720771;
    # ours is that times N_correct / N = 2 / 4.
    assert loss.item() == pytest.approx(0.1039720771 * 2 / 4)


# --------------------------------------------------------------------------------------------------
# Bad values: one line naming the field
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,field", [
    (lambda: FixedLambda(1.5), "lam"),
    (lambda: AdaptiveLambda(0.9, 0.3), "lam_min"),
    (lambda: VAPOLambda(0.0), "alpha"),
    (lambda: DecoupledGAE(value_lam=2.0), "value_lam"),
    (lambda: PositiveExampleNLL(coef=-1.0), "coef"),
    (lambda: ValuePretraining(max_steps=-1), "max_steps"),
    (lambda: ValuePretraining(patience=0), "patience"),
    (lambda: ValuePretraining(min_delta_explained_variance=-0.1), "min_delta_explained_variance"),
    (lambda: ValuePretraining(min_explained_variance=1.0), "min_explained_variance"),
    (lambda: ValuePretraining(probe=-1), "probe"),
    (lambda: ValuePretraining(epochs=0), "epochs"),
    (lambda: SelfImitation(capacity=0), "capacity"),
    (lambda: SelfImitation(every_n_steps=0), "every_n_steps"),
    (lambda: SelfImitation(policy="lifo"), "policy"),
    (lambda: SelfImitation(coef=-0.1), "coef"),
    (lambda: ValueHead(clip=0.0), "clip"),
    (lambda: SeparateCritic(clip=-0.2), "clip"),
])
def test_bad_values_are_one_line_recipe_errors_naming_the_field(make, field):
    with pytest.raises(RecipeError, match=field) as err:
        make()
    assert len(str(err.value).splitlines()) == 1


# --------------------------------------------------------------------------------------------------
# Value pretraining with a fake context
# --------------------------------------------------------------------------------------------------


class FakeCriticContext(RolloutContext):
    """The RolloutContext ValuePretraining uses: a critic, the estimator's gamma, ``scoring.score`` (values 0.3 on
    every token), ``updater.critic_update`` (records its call, returns the next scripted loss), ``ranks`` (one
    process), ``log`` (records)."""

    def __init__(self, losses, gamma=1.0):
        self.losses = list(losses)
        self.updates = []
        self.logged = []
        super().__init__(updater=SimpleNamespace(critic_update=self.critic_update),
                         scoring=SimpleNamespace(score=self.score),
                         ranks=SimpleNamespace(any=lambda flag: flag, sum=lambda value: value, rank=0),
                         critic=object(),
                         log=self.logged.append, gamma=gamma)

    def score(self, rollout, need_old, need_values=None, need_ref=None):
        assert need_values and not need_old and need_ref is False
        rollout.values = 0.3 * rollout.response_mask.float()

    def critic_update(self, rollout, epochs=1, minibatch_size=None, train_backbone=True):
        self.updates.append({"rollout": rollout, "epochs": epochs, "minibatch_size": minibatch_size,
                             "train_backbone": train_backbone})
        return {"critic_only/loss": torch.tensor(self.losses.pop(0)),
                "critic_only/explained_variance": torch.tensor(0.5)}


def test_value_pretraining_fits_the_head_on_monte_carlo_returns_and_consumes_the_rollout():
    module = FakeCriticContext(losses=[0.4])
    rollout = make_rollout([1.0, 0.0, 1.0], lengths=[3, 1, 2])
    out = ValuePretraining(max_steps=5, epochs=2, minibatch_size=4).on_rollout(None, module, rollout)
    assert out is None  # no policy update this step
    call = module.updates[0]
    assert (call["epochs"], call["minibatch_size"], call["train_backbone"]) == (2, 4, False)  # head only
    fitted = call["rollout"]
    # Monte-Carlo returns (lambda 1, gamma 1): the outcome reward on every valid token, 0 on padding.
    assert_close(fitted.returns, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert_close(fitted.values, 0.3 * fitted.response_mask.float())
    logged = module.logged[0]
    # Held out, before the update, on the 6 valid tokens: V = 0.3, returns 1 (5 tokens) and 0 (1 token).
    # Loss 0.5 * (5 * 0.7^2 + 0.3^2) / 6 = 0.5 * 2.54 / 6 = 0.2116666667.
    assert logged["train/value_pretraining/loss"] == pytest.approx(0.2116666667)
    # A constant V explains none of the variance: 1 - Var(R - 0.3) / Var(R) = 0.
    assert logged["train/value_pretraining/explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert logged["train/value_pretraining/fit_loss"] == pytest.approx(0.4)  # what critic_update reported


def test_value_pretraining_discounts_the_returns_with_the_estimators_gamma():
    # gamma = 0.5, reward 1 on the 3rd token: G = 0.25, 0.5, 1.
    module = FakeCriticContext(losses=[0.4], gamma=0.5)
    ValuePretraining().on_rollout(None, module, make_rollout([1.0], lengths=[3]))
    assert_close(module.updates[0]["rollout"].returns, torch.tensor([[0.25, 0.5, 1.0]]))


def test_value_pretraining_reads_an_estimators_declared_discount_or_none(tmp_path, tiny_model_dir):
    # A user's estimator that declares no discount inherits AdvantageEstimator.gamma = 1.0: the module's context
    # says 1.0 (as for an estimator that has no gamma at all), and the returns are undiscounted.
    from rllight.strategies import AdvantageEstimator

    class NoDiscount(AdvantageEstimator):
        needs_values = True

    module = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir)).model
    assert module.rollout_context().gamma == module.advantage.gamma == 1.0  # vapo.yaml's decoupled GAE: gamma 1
    module.advantage = NoDiscount()
    assert module.rollout_context().gamma == 1.0
    module.advantage = object()  # no gamma declared at all
    assert module.rollout_context().gamma == 1.0
    context = FakeCriticContext(losses=[0.4], gamma=module.rollout_context().gamma)
    ValuePretraining().on_rollout(None, context, make_rollout([1.0], lengths=[3]))
    assert_close(context.updates[0]["rollout"].returns, torch.tensor([[1.0, 1.0, 1.0]]))


@pytest.mark.parametrize("rank", [0, 1])
def test_value_pretraining_says_once_that_it_finished_and_when_its_explained_variance_is_undefined(rank, caplog):
    # Every reward 1: the returns never vary, so no explained variance is defined; the line says so instead of
    # "-inf", on the first process only (every process decides alike).
    module = FakeCriticContext(losses=[0.4])
    module.ranks.rank = rank
    with caplog.at_level(logging.INFO, logger="rllight"):
        ValuePretraining(max_steps=1).on_rollout(None, module, make_rollout([1.0, 1.0], lengths=[2, 3]))
    lines = [r.getMessage() for r in caplog.records if "value pretraining finished" in r.getMessage()]
    assert lines == ([] if rank else [
        "value pretraining finished after 1 rollouts (max_steps); best held-out value loss 0.24500, explained "
        "variance undefined (the returns never varied within a window); RL starts"])


def _observe_all(cb, sequence):
    """Feed (loss, explained variance) pairs; the reasons returned, one per pair."""
    return [cb.observe(loss, ev) for loss, ev in sequence]


class ScriptedValues(FakeCriticContext):
    """FakeCriticContext whose critic gives each scored row the next value of a script (one per row, on every token);
    with a tokenizer and a device, for the replayed rollouts."""

    def __init__(self, values):
        super().__init__(losses=[0.1] * 10)
        self.script = list(values)
        self.tokenizer, self.device = SimpleNamespace(pad_token_id=0), torch.device("cpu")

    def score(self, rollout, need_old, need_values=None, need_ref=None):
        rows = torch.tensor([self.script.pop(0) for _ in range(len(rollout))])
        rollout.values = rows[:, None] * rollout.response_mask.float()


def test_value_pretraining_pools_its_window_for_the_stopping_criterion():
    # Two rollouts of one-token responses, rewards (1, 0) each. The critic says (0.5, 0.5) on the first, a constant:
    # explained variance 0; (1, 0) on the second, exact: 1. Pooled over the window of 2: V = (0.5, 0.5, 1, 0),
    # R = (1, 0, 1, 0), R - V = (0.5, -0.5, 0, 0): Var(R - V) = 0.125, Var(R) = 0.25, explained variance 0.5;
    # loss 0.5 * mean((R - V)^2) = 0.5 * 0.125 = 0.0625.
    module = ScriptedValues([0.5, 0.5, 1.0, 0.0])
    cb = ValuePretraining(max_steps=5, patience=None, window=2)
    for _ in range(2):
        cb.on_rollout(None, module, make_rollout([1.0, 0.0], [1, 1]))
    logged = module.logged[-1]
    assert logged["train/value_pretraining/explained_variance"] == pytest.approx(1.0)
    assert logged["train/value_pretraining/window_explained_variance"] == pytest.approx(0.5)
    assert logged["train/value_pretraining/window_loss"] == pytest.approx(0.0625)
    assert cb.best_explained_variance == pytest.approx(0.5)  # the criterion read the window, not the latest


def test_value_pretraining_starts_its_criterion_once_the_window_is_full():
    # Window 3, patience 2. The first rollout's loss is low only because its returns hardly vary (no explained
    # variance). Read from the first rollout it would stay the best loss, and the criterion would stop at the 4th
    # rollout (the explained variance improved once, at the 2nd). From a full window (the 3rd rollout on), the
    # bests are the window's, and two rollouts in a row without an improvement come at the 5th.
    cb = ValuePretraining(max_steps=30, patience=2, window=3)
    sequence = [(0.01, math.nan), (0.05, 0.1), (0.05, 0.1), (0.05, 0.1), (0.05, 0.1), (0.05, 0.1)]
    assert _observe_all(cb, sequence[:5]) == [None, None, None, None, "settled"]
    assert cb.best_loss == pytest.approx(0.05) and cb.best_explained_variance == pytest.approx(0.1)
    assert cb.steps_done == 5


def test_value_pretraining_replays_its_latest_rollouts_with_values_scored_again():
    # replay 1: the 2nd fit takes the 2nd rollout (rewards 1, 0) and the 1st (rewards 0, 1), the 1st's values
    # scored again (0.7, 0.8: the critic as it is, not the 0.1, 0.2 it gave before its fit); the 3rd fit replays
    # the 2nd rollout only.
    module = ScriptedValues([0.1, 0.2, 0.3, 0.4, 0.7, 0.8, 0.5, 0.6, 0.9, 0.9])
    cb = ValuePretraining(max_steps=5, patience=None, replay=1)
    cb.on_rollout(None, module, make_rollout([0.0, 1.0], [1, 1]))
    assert len(module.updates[0]["rollout"]) == 2 and module.logged[0]["train/value_pretraining/replayed"] == 0.0
    cb.on_rollout(None, module, make_rollout([1.0, 0.0], [1, 1]))
    fitted = module.updates[1]["rollout"]
    assert fitted.rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and module.logged[1]["train/value_pretraining/replayed"] == 2
    assert_close(fitted.values[:, 0], torch.tensor([0.3, 0.4, 0.7, 0.8]))
    assert_close(fitted.returns[:, 0], torch.tensor([1.0, 0.0, 0.0, 1.0]))
    cb.on_rollout(None, module, make_rollout([1.0, 1.0], [1, 1]))
    assert module.updates[2]["rollout"].rewards.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_value_pretraining_sets_a_probe_aside_and_its_criterion_reads_the_probe():
    # probe 1: the 1st rollout (rewards 1, 0) is set aside, not fitted (its values 0.5, 0.5 score it for its returns).
    # The 2nd (rewards 0, 1) is fitted: held out it gets 0.3, 0.3 (a constant: explained variance 0); after the fit
    # the critic gives the probe 1.0, 0.0 = its returns: explained variance 1, loss 0. The 3rd (rewards 1, 1): held
    # out 0.2, 0.2; the probe after the fit 0.5, 0.5: explained variance 0, loss 0.5 * mean(0.5^2, 0.5^2) = 0.125.
    module = ScriptedValues([0.5, 0.5, 0.3, 0.3, 1.0, 0.0, 0.2, 0.2, 0.5, 0.5])
    cb = ValuePretraining(max_steps=5, patience=None, probe=1)
    assert cb.rollouts_to_take() == 6  # the 5 fitted and the probe's
    assert cb.on_rollout(None, module, make_rollout([1.0, 0.0], [1, 1])) is None
    assert module.updates == [] and cb.steps_done == 0 and cb.rollouts_to_take() == 5
    assert module.logged[-1] == {"train/value_pretraining/probe_rollouts": 1.0}
    cb.on_rollout(None, module, make_rollout([0.0, 1.0], [1, 1]))
    assert [u["rollout"].rewards.tolist() for u in module.updates] == [[0.0, 1.0]]  # the probe is never fitted
    logged = module.logged[-1]
    assert logged["train/value_pretraining/window_explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert logged["train/value_pretraining/probe_explained_variance"] == pytest.approx(1.0)
    assert logged["train/value_pretraining/probe_loss"] == pytest.approx(0.0)
    assert cb.best_explained_variance == pytest.approx(1.0)  # the criterion read the probe, not the window
    cb.on_rollout(None, module, make_rollout([1.0, 1.0], [1, 1]))
    logged = module.logged[-1]
    assert logged["train/value_pretraining/probe_explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert logged["train/value_pretraining/probe_loss"] == pytest.approx(0.125)
    assert cb.bad_steps == 1 and cb.rollouts_to_take() == 3


def test_value_pretraining_resumed_with_a_probe_sets_aside_a_new_one_and_starts_its_criterion_again():
    module = ScriptedValues([0.5, 0.5, 0.3, 0.3, 1.0, 0.0])
    cb = ValuePretraining(max_steps=5, patience=2, probe=1)
    for rewards in ([1.0, 0.0], [0.0, 1.0]):
        cb.on_rollout(None, module, make_rollout(rewards, [1, 1]))
    assert cb.best_explained_variance == pytest.approx(1.0)
    restored = ValuePretraining(max_steps=5, patience=2, probe=1)
    restored.load_state_dict(cb.state_dict())
    assert restored.steps_done == 1 and restored.rollouts_to_take() == 5  # 4 to fit and a new probe
    assert (restored.best_loss, restored.best_explained_variance, restored.bad_steps) == (math.inf, -math.inf, 0)
    plain = ValuePretraining(max_steps=5, patience=2)  # without a probe the bests carry over
    plain.load_state_dict(cb.state_dict())
    assert plain.best_explained_variance == pytest.approx(1.0)


def test_value_pretraining_stops_when_loss_and_explained_variance_have_both_settled():
    # patience 2, tolerances 1e-3 (loss) and 1e-2 (explained variance):
    # (1.0, 0.10): both best. (0.5, 0.30): both improve. (0.4995, 0.305): 0.4995 is not below 0.5 - 0.001 and
    # 0.305 not above 0.30 + 0.01 -> 1 rollout without improvement. (0.6, 0.2): 2 -> settled after 4 rollouts.
    cb = ValuePretraining(max_steps=100, patience=2, min_delta=1e-3, min_delta_explained_variance=1e-2)
    reasons = _observe_all(cb, [(1.0, 0.10), (0.5, 0.30), (0.4995, 0.305), (0.6, 0.2)])
    assert reasons == [None, None, None, "settled"]
    assert (cb.finished, cb.steps_done, cb.best_loss, cb.best_explained_variance, cb.bad_steps) == \
        (True, 4, 0.5, 0.30, 2)


def test_value_pretraining_does_not_stop_while_the_explained_variance_still_improves():
    # The loss is flat from the 1st rollout, the explained variance rises by 0.1 (> 0.01) each time: every
    # rollout improves one of the two, so patience 2 never runs out. Then it flattens (0.505 is not above
    # 0.5 + 0.01): 2 more rollouts and it has settled.
    cb = ValuePretraining(max_steps=100, patience=2, min_delta=1e-3, min_delta_explained_variance=1e-2)
    rising = [(1.0, 0.1), (1.0, 0.2), (1.0, 0.3), (1.0, 0.4), (1.0, 0.5)]
    assert _observe_all(cb, rising) == [None] * 5 and not cb.finished
    assert _observe_all(cb, [(1.0, 0.505), (1.0, 0.5)]) == [None, "settled"]
    assert cb.steps_done == 7


def test_value_pretraining_does_not_stop_while_the_loss_still_improves():
    # Explained variance flat (or undefined: NaN when the returns do not vary, which never counts as an
    # improvement); the loss falls by 0.1 (> 1e-3) each rollout, so it goes on until it stops falling.
    cb = ValuePretraining(max_steps=100, patience=2, min_delta=1e-3, min_delta_explained_variance=1e-2)
    falling = [(0.9, 0.2), (0.8, 0.2), (0.7, math.nan), (0.6, 0.2), (0.5, math.nan)]
    assert _observe_all(cb, falling) == [None] * 5 and not cb.finished
    assert _observe_all(cb, [(0.5, 0.2), (0.5, math.nan)]) == [None, "settled"]
    assert cb.best_explained_variance == 0.2


def test_value_pretraining_with_a_minimum_explained_variance_waits_for_it_on_a_low_plateau():
    # patience 2: the paper's criterion settles on the flat 3rd rollout although the critic explains 5 % of the
    # returns. With a minimum of 0.2 it goes on: 0.06 is no improvement (bad 3), NaN is below any minimum, 0.2
    # improves (bad 0), 0.19 and 0.2 do not (bad 2) and 0.2 reaches the minimum: settled after 8.
    plateau = [(1.0, 0.05), (1.0, 0.05), (1.0, 0.05)]
    assert _observe_all(ValuePretraining(max_steps=100, patience=2), plateau) == [None, None, "settled"]
    cb = ValuePretraining(max_steps=100, patience=2, min_explained_variance=0.2)
    assert _observe_all(cb, plateau + [(1.0, 0.06), (1.0, math.nan)]) == [None] * 5 and cb.bad_steps == 4
    assert _observe_all(cb, [(1.0, 0.2), (1.0, 0.19), (1.0, 0.2)]) == [None, None, "settled"]
    assert cb.steps_done == 8
    capped = ValuePretraining(max_steps=4, patience=2, min_explained_variance=0.2)
    assert _observe_all(capped, plateau + [(1.0, 0.05)]) == [None, None, None, "max_steps"]


def test_value_pretraining_stops_at_its_cap_while_both_still_improve():
    cb = ValuePretraining(max_steps=3, patience=2)
    assert _observe_all(cb, [(0.9, 0.1), (0.8, 0.2), (0.7, 0.3)]) == [None, None, "max_steps"]
    assert cb.finished and cb.bad_steps == 0


def test_value_pretraining_hands_over_once_settled():
    # patience 1: the 1st rollout sets both bests; the 2nd is the same rollout with the same values (the
    # fake critic does not learn), so neither improves and pretraining ends; the 3rd passes through untouched.
    module = FakeCriticContext(losses=[1.0, 0.9])
    cb = ValuePretraining(max_steps=100, patience=1)
    for _ in range(2):
        assert cb.on_rollout(None, module, make_rollout([1.0, 0.0], [2, 2])) is None
    assert (cb.finished, cb.steps_done, cb.bad_steps) == (True, 2, 1)
    rollout = make_rollout([1.0, 0.0], [2, 2])
    assert cb.on_rollout(None, module, rollout) is rollout
    assert len(module.updates) == 2
    assert [m["train/value_pretraining/finished"] for m in module.logged] == [0.0, 1.0]


def test_value_pretraining_runs_max_steps_without_patience_and_zero_steps_is_off():
    module = FakeCriticContext(losses=[3.0, 2.0, 1.0])
    cb = ValuePretraining(max_steps=2, patience=None)
    for _ in range(2):
        assert cb.on_rollout(None, module, make_rollout([1.0], [1])) is None
    assert cb.finished and len(module.updates) == 2
    off = ValuePretraining(max_steps=0)
    rollout = make_rollout([1.0], [1])
    assert off.on_rollout(None, module, rollout) is rollout and len(module.updates) == 2


def test_value_pretraining_state_dict_round_trip_resumes_the_count():
    module = FakeCriticContext(losses=[1.0, 0.9, 0.8])
    cb = ValuePretraining(max_steps=3, patience=None)
    for _ in range(2):
        cb.on_rollout(None, module, make_rollout([1.0, 0.0], [1, 1]))
    restored = ValuePretraining(max_steps=3, patience=None)
    restored.load_state_dict(cb.state_dict())
    # V = 0.3 against returns 1 and 0: loss 0.5 * (0.49 + 0.09) / 2 = 0.145, explained variance 0 (constant V);
    # the 2nd, identical rollout improved neither.
    state = restored.state_dict()
    held_out = state.pop("held_out")
    assert state == {"steps_done": 2, "finished": False, "best_loss": pytest.approx(0.145),
                     "best_explained_variance": pytest.approx(0.0, abs=1e-6), "bad_steps": 1}
    # The window (1 rollout) keeps the latest rollout's held-out values and returns.
    assert len(held_out) == 1 and held_out[0][0] == pytest.approx([0.3, 0.3]) and held_out[0][1] == [1.0, 0.0]
    assert restored.on_rollout(None, module, make_rollout([1.0], [1])) is None
    assert restored.finished and restored.steps_done == 3


def test_value_pretraining_loads_a_state_saved_before_the_explained_variance_criterion():
    cb = ValuePretraining()
    cb.load_state_dict({"steps_done": 2, "finished": False, "best_loss": 0.2, "bad_steps": 1})
    assert cb.best_explained_variance == -math.inf and cb.steps_done == 2
    assert cb.observe(0.3, 0.05) is None and cb.bad_steps == 0  # any explained variance beats "none yet"


def test_value_pretraining_without_a_critic_is_a_recipe_error():
    module = FakeCriticContext(losses=[])
    module.critic = None
    with pytest.raises(RecipeError, match="model.critic"):
        ValuePretraining().on_rollout(None, module, make_rollout([1.0], [1]))


# --------------------------------------------------------------------------------------------------
# Self-imitation replay buffer with a fake context
# --------------------------------------------------------------------------------------------------


class FakeNLLContext(RolloutContext):
    """The RolloutContext SelfImitation uses: ``tokenizer``, ``device``, ``updater.nll_update`` (records), ``ranks``
    (one process), ``log`` (records)."""

    def __init__(self):
        self.replayed = []
        self.logged = []
        super().__init__(updater=SimpleNamespace(nll_update=self.nll_update),
                         ranks=SimpleNamespace(any=lambda flag: flag, world_size=1),
                         tokenizer=SimpleNamespace(pad_token_id=0), device=torch.device("cpu"), log=self.logged.append)

    def nll_update(self, rollout, coef=1.0, minibatch_size=None, aggregation=None):
        self.replayed.append((rollout, coef))
        self.aggregations = getattr(self, "aggregations", []) + [aggregation]
        return {"nll/loss": torch.tensor(1.5)}


def _entry(i, reward=1.0):
    return {"prompt_ids": torch.tensor([1, i]), "response_ids": torch.tensor([i, i + 1]), "reward": reward,
            "answer": str(i), "text": f"t{i}"}


def test_self_imitation_stores_unpadded_successes_and_replays_them_after_the_update():
    # Row 0: correct, prompt of 3 tokens (1 left pad), response of 2 (2 right pads); row 1: wrong;
    # row 2: correct, prompt of 4 tokens, response of 4.
    rollout = make_rollout([1.0, 0.0, 1.0], lengths=[2, 3, 4], prompt_lengths=[3, 2, 4])
    module = FakeNLLContext()
    cb = SelfImitation(every_n_steps=2, batch_size=8, coef=0.3)
    out = cb.on_rollout(None, module, rollout)
    assert out is rollout and out.extras["sil/buffer_size"] == 2.0 and out.extras["sil/added"] == 2.0
    assert [e["prompt_ids"].tolist() for e in cb.entries] == [[100, 101, 102], [300, 301, 302, 303]]
    assert [e["response_ids"].tolist() for e in cb.entries] == [[150, 151], [350, 351, 352, 353]]
    assert all(e["prompt_ids"].device.type == "cpu" for e in cb.entries)
    cb.on_train_batch_end(None, None, None, None, 0)  # the replay uses the step's context
    assert module.replayed == []  # step 1 of every 2
    cb.on_rollout(None, module, make_rollout([0.0], [1]))
    cb.on_train_batch_end(None, None, None, None, 1)  # the replay uses the step's context
    assert len(module.replayed) == 1
    replayed, coef = module.replayed[0]
    assert coef == 0.3
    order = [0, 1] if replayed.prompt_ids[0, -1] == 102 else [1, 0]  # replay order is random
    replayed = replayed.select(order)
    assert replayed.prompt_ids.tolist() == [[0, 100, 101, 102], [300, 301, 302, 303]]
    assert replayed.prompt_mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    assert replayed.response_ids.tolist() == [[150, 151, 0, 0], [350, 351, 352, 353]]
    assert replayed.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert module.logged[-1] == {"train/sil/replayed": 2.0, "train/sil/nll": 1.5}
    # No rollout reached the callback this step (e.g. value pretraining consumed it): no replay.
    cb.on_train_batch_end(None, None, None, None, 2)
    assert len(module.replayed) == 1


def test_self_imitation_nll_sums_over_tokens_as_eq_11_when_asked():
    # Two replayed responses of 2 and 4 tokens, every token at log-prob ln 0.5 (NLL 0.6931471806 each).
    # Eq. 11 (SeqMeanTokenSum): the mean over responses of each response's sum, (2 + 4) / 2 * 0.6931471806 =
    # 2.0794415417; the policy's token mean: 0.6931471806. coef 0.1 scales both.
    batch = make_rollout([1.0, 1.0], lengths=[2, 4])
    out = SimpleNamespace(logprobs=torch.full((2, 4), math.log(0.5)) * batch.response_mask)

    def aggregate(per_token, mask, how=None):  # as the updater's: the step's global counts, 6 tokens, 2 responses
        return (how or TokenMean())(per_token, mask, num_tokens=torch.tensor(6.0), num_seqs=torch.tensor(2.0))

    summed, stats = ResponseNLL(0.1, SeqMeanTokenSum())(batch, out, aggregate)
    assert summed.item() == pytest.approx(0.1 * 3 * 0.6931471806) and stats["nll/loss"].item() == pytest.approx(
        3 * 0.6931471806)
    assert ResponseNLL(0.1)(batch, out, aggregate)[0].item() == pytest.approx(0.1 * 0.6931471806)
    # The callback hands its aggregation to the replay update.
    module, cb = FakeNLLContext(), SelfImitation(every_n_steps=1, aggregation=SeqMeanTokenSum())
    cb.on_rollout(None, module, make_rollout([1.0], lengths=[2]))
    cb.on_train_batch_end(None, None, None, None, 0)
    assert isinstance(module.aggregations[0], SeqMeanTokenSum)


def test_self_imitation_min_reward_and_duplicates():
    cb = SelfImitation(min_reward=0.5)
    rollout = make_rollout([0.7, 0.2, 0.5], lengths=[1, 1, 1], correct=[0, 1, 0])
    cb.on_rollout(None, FakeNLLContext(), rollout)
    assert [e["reward"] for e in cb.entries] == [pytest.approx(0.7), 0.5]  # the reward decides, not `correct`
    cb.on_rollout(None, FakeNLLContext(), rollout)  # the same responses again: not stored twice
    assert len(cb.entries) == 2
    keep_all = SelfImitation(unique=False)
    assert keep_all.add(_entry(1)) and keep_all.add(_entry(1)) and len(keep_all.entries) == 2


def test_self_imitation_fifo_drops_the_oldest():
    cb = SelfImitation(capacity=2, policy="fifo")
    for i in range(3):
        cb.add(_entry(i))
    assert sorted(int(e["answer"]) for e in cb.entries) == [1, 2]
    cb.add(_entry(3))
    assert sorted(int(e["answer"]) for e in cb.entries) == [2, 3]


def test_self_imitation_highest_reward_replaces_the_lowest_and_the_oldest_among_equals():
    cb = SelfImitation(capacity=2, policy="highest_reward")
    cb.add(_entry(0, 0.5))
    cb.add(_entry(1, 0.9))
    assert cb.add(_entry(2, 0.7))  # replaces 0.5
    assert not cb.add(_entry(3, 0.6))  # lower than everything kept
    assert sorted(e["reward"] for e in cb.entries) == [0.7, 0.9]
    assert cb.add(_entry(4, 0.7))  # ties the lowest: replaces the older 0.7
    assert sorted(int(e["answer"]) for e in cb.entries) == [1, 4]


def test_self_imitation_reservoir_keeps_a_uniform_sample_of_every_success():
    # Algorithm R: after 100 offers to a buffer of 10, each offer is kept with probability 10 / 100. Over 200
    # seeds, the early and the late half are each kept 0.1 of the time (standard error about 0.003).
    kept = torch.zeros(100)
    for seed in range(200):
        cb = SelfImitation(capacity=10, policy="reservoir", seed=seed)
        for i in range(100):
            cb.add(_entry(i))
        assert len(cb.entries) == 10
        kept[[int(e["answer"]) for e in cb.entries]] += 1
    share = kept / 200
    assert share[:50].mean().item() == pytest.approx(0.1, abs=0.015)
    assert share[50:].mean().item() == pytest.approx(0.1, abs=0.015)


def test_self_imitation_state_dict_round_trip_restores_buffer_and_sampling():
    cb = SelfImitation(capacity=5, policy="reservoir", seed=3)
    for i in range(12):
        cb.add(_entry(i))
    state = cb.state_dict()
    restored = SelfImitation(capacity=5, policy="reservoir", seed=99)
    restored.load_state_dict(state)
    assert [e["answer"] for e in restored.entries] == [e["answer"] for e in cb.entries]
    assert (restored.offered, restored.insertions, restored.steps_seen) == (cb.offered, cb.insertions, cb.steps_seen)
    # The generator's state travels too: both draw the same replay sample and reservoir slots.
    assert [e["answer"] for e in restored.sample(3)] == [e["answer"] for e in cb.sample(3)]
    assert restored.add(_entry(50)) == cb.add(_entry(50))
    assert [e["answer"] for e in restored.entries] == [e["answer"] for e in cb.entries]


def test_build_rollout_pads_and_masks():
    rollout = build_rollout([_entry(5), {**_entry(7), "prompt_ids": torch.tensor([9]),
                                         "response_ids": torch.tensor([1, 2, 3])}], pad_id=0)
    assert rollout.prompt_ids.tolist() == [[1, 5], [0, 9]]
    assert rollout.response_ids.tolist() == [[5, 6, 0], [1, 2, 3]]
    assert rollout.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert rollout.correct.tolist() == [1.0, 1.0]


# --------------------------------------------------------------------------------------------------
# Tiny-model runs
# --------------------------------------------------------------------------------------------------


def _write(tmp_path, name, cfg):
    path = os.path.join(tmp_path, name)
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _callbacks(tmp_path, *callbacks):
    return _write(tmp_path, "callbacks.yaml", {"trainer": {"callbacks": list(callbacks)}})


def _pretraining(**init_args):
    return {"class_path": "rllight.callbacks.ValuePretraining", "init_args": init_args}


def _replay(**init_args):
    return {"class_path": "rllight.callbacks.SelfImitation", "init_args": init_args}


# The tiny overlay's 16 training prompts make 8 batches per epoch; value pretraining may consume up to 10
# batches (recipes/vapo.yaml), and an epoch without any policy update stops the run. 64 prompts: 32 batches.
MORE_PROMPTS = ("--data.task.init_args.num_train", "64")


@pytest.mark.parametrize("recipe", ["vapo.yaml", "vapo-paper-lambda.yaml"])
def test_vapo_two_steps_change_every_trainable_parameter(recipe, tmp_path, tiny_model_dir):
    cli = build(os.path.join(RECIPES, recipe), tiny_overrides(tmp_path, tiny_model_dir), *MORE_PROMPTS)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    pretraining = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ValuePretraining))
    assert pretraining.finished and pretraining.steps_done >= 1
    assert cli.trainer.global_step == 2  # policy updates; pretraining rollouts do not count
    assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []
    # The critic is a value model of its own (a copy of the initial policy): value pretraining and the
    # critic-first updates train all of it, backbone included, and the head has left its zero init.
    assert unchanged_parameters(cli.model.critic.backbone, tiny_model_dir, decoder=True) == []
    assert cli.model.critic.head.weight.abs().sum() > 0 and cli.model.critic.head.bias.abs().sum() > 0
    logged = cli.trainer.callback_metrics
    assert "train/value_pretraining/loss" in logged and "train/value_pretraining/explained_variance" in logged
    assert 0.0 <= logged["train/advantage/lambda_min"] <= logged["train/advantage/lambda_mean"] \
        <= logged["train/advantage/lambda_max"] < 1.0


def test_vapo_critic_starts_as_a_separate_copy_of_the_initial_policy(tmp_path, tiny_model_dir):
    cli = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir))
    module = cli.model
    module.configure_model()
    critic, decoder = module.critic, module.policy.get_decoder()
    assert type(critic).__name__ == "SeparateCritic" and critic.source is None  # null: the policy's own source
    policy_state = decoder.state_dict()
    critic_state = critic.backbone.state_dict()
    assert critic_state.keys() == policy_state.keys()
    assert all(torch.equal(critic_state[k], policy_state[k]) for k in policy_state)  # same initial weights ...
    policy_ids = {id(p) for p in module.policy.parameters()}
    assert not policy_ids & {id(p) for p in critic.parameters()}  # ... in parameters of its own
    assert critic.lr == 1e-5 and critic.head_lr == 1e-4  # the backbone at the policy's rate, the zero head faster


def test_vapo_with_the_critic_on_the_shared_backbone(tmp_path, tiny_model_dir):
    cli = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), SHARED_CRITIC,
                *MORE_PROMPTS)
    assert type(cli.model.critic).__name__ == "ValueHead" and cli.model.critic.lr == 1e-4
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []
    assert [n for n, _ in cli.model.critic.named_parameters()] == ["head.weight", "head.bias"]  # no backbone
    assert cli.model.critic.head.weight.abs().sum() > 0


def test_vapo_with_a_critic_model_named_by_the_recipe(tmp_path, tiny_model_dir):
    critic = {"critic": {"class_path": "rllight.critics.SeparateCritic",
                         "init_args": {"model": {"class_path": "rllight.models.HFModel",
                                                 "init_args": {"path": tiny_model_dir}}, "lr": 1e-2}}}
    overlay = _write(tmp_path, "critic.yaml", {"model": critic})
    cli = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), overlay, *MORE_PROMPTS)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.model.critic.source.path == tiny_model_dir
    assert cli.trainer.global_step == 2
    assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []
    # Value pretraining and the critic-first updates train the whole separate critic, backbone included.
    assert unchanged_parameters(cli.model.critic.backbone, tiny_model_dir, decoder=True) == []
    assert cli.model.critic.head.weight.abs().sum() > 0


class SpyGAE(DecoupledGAE):
    """Records the values it was given and the advantages it returned."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = []

    def __call__(self, rollout):
        adv, ret = super().__call__(rollout)
        self.calls.append((rollout.values.detach().clone(), adv.detach().clone()))
        return adv, ret


class SpyLoss(ClippedSurrogate):
    """Records the advantages each policy-loss call trains on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def __call__(self, logprobs, batch):
        self.seen.append(batch.advantages.detach().clone())
        return super().__call__(logprobs, batch)


@pytest.mark.parametrize("critic_first", [2, 0])
def test_critic_steps_first_recompute_advantages_with_the_updated_critic(critic_first, tmp_path, tiny_model_dir):
    # One RL step of vapo.yaml (no pretraining, no replay, to isolate the update order), 16 responses in one
    # minibatch and one micro-batch. With critic_first.steps = K: the estimator runs on the fresh values,
    # the critic takes K steps, the estimator runs again on the new values, and the policy trains on
    # those second advantages. With 0 the estimator runs once and critic and policy train together.
    cli = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), _callbacks(tmp_path),
                "--trainer.max_steps", "1", "--model.critic_first.steps", str(critic_first))
    module = cli.model
    module.advantage = SpyGAE(policy_lambda=AdaptiveLambda(), value_lam=1.0)
    module.policy_loss = SpyLoss(clip_low=0.2, clip_high=0.28)
    critic_calls = []
    original = module.updater.critic_update

    def critic_update(rollout, steps=0, **kwargs):
        critic_calls.append(steps)
        return original(rollout, steps=steps, **kwargs)

    module.updater.critic_update = critic_update
    cli.trainer.fit(module, datamodule=cli.datamodule)
    assert len(module.policy_loss.seen) == 1
    if critic_first:
        assert critic_calls == [critic_first]
        assert len(module.advantage.calls) == 2
        (v0, a0), (v1, a1) = module.advantage.calls
        assert not torch.equal(v0, v1)  # the critic moved before the advantages were recomputed
        assert not torch.equal(a0, a1)
        assert_close(module.policy_loss.seen[0], a1)  # the policy trained on the recomputed advantages
    else:
        assert critic_calls == []
        assert len(module.advantage.calls) == 1
        assert_close(module.policy_loss.seen[0], module.advantage.calls[0][1])


@pytest.mark.parametrize("steps_first, epochs_first, expected_steps", [(4, 0, 4), (6, 0, 6), (0, 2, 8)])
def test_critic_steps_first_takes_k_v_optimizer_steps_per_rollout(steps_first, epochs_first, expected_steps,
                                                                   tmp_path, tiny_model_dir):
    # One RL step of vapo.yaml (no pretraining, no replay): 2 prompts x 8 = 16 responses in 4 minibatches of 4.
    # Note 000's K_v counts the critic's optimizer steps per rollout: critic_first.steps K takes K steps, one
    # minibatch each in the order of the policy's first epoch, cycling (6: the 4 minibatches, then the first 2
    # again). critic_first.epochs E takes E passes over all 4 minibatches in row order: 2 x 4 = 8 steps (the
    # reading of rllight's former critic_updates_first, whose K_v = 4 took 4 x 4 = 16 steps here).
    overlay = tiny_overrides(tmp_path, tiny_model_dir, batching={"minibatch_size": 4, "micro_batch_size": 4})
    cli = build(os.path.join(RECIPES, "vapo.yaml"), overlay, _callbacks(tmp_path), "--trainer.max_steps", "4",
                "--model.critic_first.steps", str(steps_first), "--model.critic_first.epochs", str(epochs_first))
    module = cli.model
    seen, calls = [], []
    update, critic_update = module.updater.update, module.updater.critic_update

    def spy_update(mb, terms, name, *args, **kwargs):
        if name == "value":
            seen.append(mb)
        return update(mb, terms, name, *args, **kwargs)

    def spy_critic_update(rollout, **kwargs):
        calls.append((rollout, kwargs["layout"]))
        return critic_update(rollout, **kwargs)

    module.updater.update, module.updater.critic_update = spy_update, spy_critic_update
    cli.trainer.fit(module, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 4  # one rollout: 4 policy updates
    optimizer = module.optimizers().optimizer
    critic_params = [p for g in optimizer.param_groups if g["name"].startswith("critic") for p in g["params"]]
    # The optimizer's own count: every critic parameter took exactly that many steps in this one rollout.
    assert {int(optimizer.state[p]["step"]) for p in critic_params} == {expected_steps}
    assert len(seen) == expected_steps
    ((rollout, layout),) = calls
    assert [len(index) for index in layout] == [4] * 4
    assert sorted(torch.cat(layout).tolist()) == list(range(16))
    if steps_first:
        expected = [layout[i % 4] for i in range(steps_first)]
    else:
        expected = [torch.arange(4 * i, 4 * i + 4) for i in range(4)] * epochs_first
    for mb, index in zip(seen, expected):
        assert torch.equal(mb.response_ids, rollout.select(index).response_ids)
        assert torch.equal(mb.sample_logprobs, rollout.select(index).sample_logprobs)


@pytest.mark.parametrize("args, message", [
    (("--model.critic_first.epochs", "4"), "critic_first.steps and model.critic_first.epochs are both set"),
])
def test_critic_first_schedule_errors_are_one_line_recipe_errors(args, message, tmp_path, tiny_model_dir):
    # vapo.yaml sets critic_first.steps: 4; adding epochs would leave the schedule ambiguous.
    with pytest.raises(RecipeError, match=message):
        build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), *args)


class OldLogprobsSpy(ClippedSurrogate):
    """Records the old log-probs each policy-loss call takes its ratio against."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def __call__(self, logprobs, batch):
        self.seen.append(batch.old_logprobs.detach().clone())
        return super().__call__(logprobs, batch)


@pytest.mark.parametrize("figure_5", [False, True])
def test_critic_first_updates_train_the_shared_backbone_only_in_figure_5s_form(figure_5, tmp_path, tiny_model_dir):
    # The K_v critic updates run between sampling and the policy update. With the head alone there
    # (vapo-shared-critic.yaml) the backbone, which is the policy, stays where it sampled. In note 000's figure-5
    # form (vapo-shared-backbone.yaml) the value loss trains the backbone too: the policy moves before its own
    # update, so its old log-probs must be the sampling policy's, taken before those updates (one policy update
    # per rollout here, where old log-probs are otherwise the live ones of the policy at its update).
    cli = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), SHARED_CRITIC,
                *([FIGURE_5] if figure_5 else []), _callbacks(tmp_path), "--trainer.max_steps", "1",
                "--model.critic_first.steps", "3", "--model.critic.init_args.lr", "0.1")
    module = cli.model
    assert module.critic.critic_first_trains_backbone is figure_5
    assert module.critic.clip == 0.2  # the overlays merge: figure 5's keeps the shared critic's settings
    module.policy_loss = OldLogprobsSpy(clip_low=0.2, clip_high=0.28)
    snapshots = []
    original = module.updater.critic_update

    def critic_update(rollout, **kwargs):
        before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
        sampler = rollout.select(torch.arange(len(rollout)))
        module.scoring.score(sampler, need_old=True, need_values=False, need_ref=False)  # the sampling policy's
        head = module.critic.head.weight.detach().clone()
        out = original(rollout, **kwargs)
        after = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
        snapshots.append(([n for n in before if not torch.equal(before[n], after[n])], head, sampler.old_logprobs))
        return out

    module.updater.critic_update = critic_update
    cli.trainer.fit(module, datamodule=cli.datamodule)
    ((moved, head, sampler_logprobs),) = snapshots
    if figure_5:  # the head's first update makes it non-zero, the next ones pass a gradient into the backbone
        assert any(".layers." in n for n in moved)
    else:
        assert moved == []
    assert not torch.equal(head, module.critic.head.weight)  # the head did train
    # In both forms the policy update's ratio is against the policy that sampled.
    (seen,) = module.policy_loss.seen
    assert_close(seen, sampler_logprobs)
    assert "train/critic_only/explained_variance" in cli.trainer.callback_metrics


def test_figure_5s_backbone_option_without_critic_first_updates_is_a_recipe_error(tmp_path, tiny_model_dir):
    # With critic_first.steps 0 the value loss trains the shared backbone in every joint update anyway.
    with pytest.raises(RecipeError, match="critic_first_trains_backbone needs model.critic_first.steps"):
        build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), SHARED_CRITIC, FIGURE_5,
              "--model.critic_first.steps", "0")


def test_value_loss_clip_of_the_critics_is_optional_and_acts():
    # Rollout values 0, returns 1; the critic now says 0.5 and 0.1. Clip 0.2 around the rollout's values:
    # token 0 moved 0.5 > 0.2, V_clip = 0.2: max((0.5 - 1)^2, (0.2 - 1)^2) = 0.64 -> 0.32, gradient 0 (the
    # clipped branch is constant); token 1 moved 0.1, within: 0.5 * 0.81 = 0.405, gradient V - R = -0.9.
    # No clip: 0.5 * (0.25, 0.81) = (0.125, 0.405), gradient (-0.5, -0.9).
    batch = SimpleNamespace(response_mask=torch.ones(1, 2), values=torch.zeros(1, 2), returns=torch.ones(1, 2))
    for critic, loss, grad in ((ValueHead(clip=0.2), [0.32, 0.405], [0.0, -0.9]),
                               (ValueHead(clip=None), [0.125, 0.405], [-0.5, -0.9]),
                               (SeparateCritic(clip=None), [0.125, 0.405], [-0.5, -0.9])):
        values = torch.tensor([[0.5, 0.1]], requires_grad=True)
        per_token, _ = critic.loss(values, batch)
        assert_close(per_token, torch.tensor([loss]))
        per_token.sum().backward()
        assert_close(values.grad, torch.tensor([grad]))


def _vapo_module_and_scored_rollout(tmp_path, tiny_model_dir):
    """A vapo.yaml module with the shared value head after one policy step, and a fresh rollout of 16 responses
    with values and returns."""
    cli = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), SHARED_CRITIC,
                _callbacks(tmp_path), "--trainer.max_steps", "1", "--model.batching.micro_batch_size", "4")
    module = cli.model
    cli.trainer.fit(module, datamodule=cli.datamodule)
    rollout = module.sampler(module.producer, cli.datamodule.train_rows[:2])
    module.scoring.score(rollout, need_old=False, need_values=True)
    module.estimate_advantages(rollout)
    rollout.returns = rollout.returns + 1.0  # a target the critic cannot already meet
    return module, rollout


def test_head_only_critic_epochs_reuse_the_backbone_hidden_states(tmp_path, tiny_model_dir, monkeypatch):
    import rllight.terms

    module, rollout = _vapo_module_and_scored_rollout(tmp_path, tiny_model_dir)
    start = {k: v.clone() for k, v in module.critic.state_dict().items()}
    optimizer_state = copy.deepcopy(module.optimizers().optimizer.state_dict())
    # Reference: three one-epoch calls, each computing the hidden states afresh.
    for _ in range(3):
        module.updater.critic_update(rollout, epochs=1, train_backbone=False)
    expected = module.critic.head.weight.detach().clone()
    module.critic.load_state_dict(start)
    module.optimizers().optimizer.load_state_dict(optimizer_state)

    calls = []
    original = rllight.terms.response_hidden_states
    monkeypatch.setattr(rllight.terms, "response_hidden_states", lambda *a: calls.append(1) or original(*a))
    module.updater.critic_update(rollout, epochs=3, train_backbone=False)
    assert len(calls) == 4  # 16 responses in micro-batches of 4: one backbone pass each, not three
    assert not torch.equal(expected, start["head.weight"])
    assert_close(module.critic.head.weight.detach(), expected)


def test_critic_update_of_the_shared_backbone_moves_the_policy_and_syncs_the_engine(tmp_path, tiny_model_dir):
    module, rollout = _vapo_module_and_scored_rollout(tmp_path, tiny_model_dir)
    synced = []
    module.rollout.update_weights = lambda policy: synced.append(policy) or {}
    embed = module.policy.get_input_embeddings().weight

    before = embed.detach().clone()
    module.updater.critic_update(rollout, train_backbone=False)
    assert torch.equal(embed, before) and synced == []  # head only: the policy stays, nothing to sync
    module.updater.critic_update(rollout, train_backbone=True)
    assert not torch.equal(embed, before) and synced == [module.policy]


def test_metrics_of_some_steps_only_are_logged_on_those_steps_not_repeated(tmp_path, tiny_model_dir):
    # 1 value-pretraining rollout, then 3 policy steps with a replay on every second one: each metric must
    # reach the logger on the steps that produced it, not again (stale) on every later step.
    callbacks = _callbacks(tmp_path, _pretraining(max_steps=1, patience=None),
                           _replay(every_n_steps=2, batch_size=2, min_reward=0.0))
    cli = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), callbacks,
                "--trainer.max_steps", "3", "--trainer.log_every_n_steps", "1")
    logger = CaptureLogger(tmp_path)
    cli.trainer.loggers = [logger]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    def logged(key):
        return [key in call for call in logger.calls if "train/time/step" in call]

    assert logged("train/time/step") == [True] * 4
    assert logged("train/value_pretraining/loss") == [True, False, False, False]
    assert logged("train/policy/loss") == [False, True, True, True]
    assert logged("train/sil/nll") == [False, False, True, False]


@pytest.mark.parametrize("init_args,rollouts", [
    # Tolerances no rollout can beat after the first (a loss 10 below its best, an explained variance 10
    # above): the 2nd rollout improves neither, patience 1 -> settled after 2 of the 20 allowed.
    ({"max_steps": 20, "patience": 1, "min_delta": 10.0, "min_delta_explained_variance": 10.0}, 2),
    # Patience longer than the cap: it ends at max_steps = 3 whatever the numbers.
    ({"max_steps": 3, "patience": 5}, 3),
])
def test_value_pretraining_ends_in_a_run_then_rl_starts(init_args, rollouts, tmp_path, tiny_model_dir):
    cli = build(os.path.join(RECIPES, "vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir),
                _callbacks(tmp_path, _pretraining(**init_args)), "--trainer.max_steps", "2")
    logger = CaptureLogger(tmp_path)
    cli.trainer.loggers = [logger]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    pretraining = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ValuePretraining))
    assert pretraining.finished and pretraining.steps_done == rollouts
    assert cli.trainer.global_step == 2  # then the 2 policy updates (one per rollout of 16 at minibatch 16)
    steps = [call for call in logger.calls if "train/time/step" in call]
    assert len(steps) == rollouts + 2
    for key in ("train/value_pretraining/loss", "train/value_pretraining/explained_variance"):
        assert [key in call for call in steps] == [True] * rollouts + [False, False]
    assert [call["train/value_pretraining/finished"] for call in steps[:rollouts]] == [0.0] * (rollouts - 1) + [1.0]


def test_replay_buffer_and_value_pretraining_state_survive_a_checkpoint(tmp_path, tiny_model_dir):
    # Pretrain for 1 rollout, then 2 policy steps whose responses all count as successes (min_reward 0: the
    # test reward is >= 0), replayed every step. Save a Lightning checkpoint; a new trainer resumes from it.
    callbacks = _callbacks(tmp_path, _pretraining(max_steps=1, patience=None),
                           _replay(capacity=256, every_n_steps=1, batch_size=4, coef=1.0, policy="reservoir",
                                   min_reward=0.0))
    overlay = tiny_overrides(tmp_path, tiny_model_dir)

    def run(max_steps, ckpt_path=None):
        cli = build(os.path.join(RECIPES, "vapo.yaml"), overlay, callbacks, "--trainer.max_steps", str(max_steps))
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
        pre = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ValuePretraining))
        sil = next(cb for cb in cli.trainer.callbacks if isinstance(cb, SelfImitation))
        return cli, pre, sil

    cli, pre, sil = run(2)
    assert pre.finished and pre.steps_done == 1 and math.isfinite(pre.best_loss)
    assert sil.steps_seen == 2 and len(sil.entries) > 0
    assert "train/sil/nll" in cli.trainer.callback_metrics  # the replay ran inside fit
    ckpt = str(tmp_path / "step2.ckpt")
    cli.trainer.save_checkpoint(ckpt)
    saved_pre, saved_sil = pre.state_dict(), sil.state_dict()
    stored = torch.load(ckpt, weights_only=False)["callbacks"]
    assert {"ValuePretraining", "SelfImitation"} <= set(stored)

    # Resume with nothing left to do: the restored states equal the saved ones.
    _, pre2, sil2 = run(2, ckpt)
    assert pre2.state_dict() == saved_pre
    assert [(e["prompt_ids"].tolist(), e["response_ids"].tolist()) for e in sil2.entries] == \
        [(e["prompt_ids"].tolist(), e["response_ids"].tolist()) for e in saved_sil["entries"]]
    assert (sil2.offered, sil2.steps_seen) == (saved_sil["offered"], saved_sil["steps_seen"])
    assert torch.equal(sil2.state_dict()["generator"], saved_sil["generator"])

    # Resume for one more step: no second pretraining phase, the buffer keeps growing from the saved one.
    cli3, pre3, sil3 = run(3, ckpt)
    assert cli3.trainer.global_step == 3
    assert pre3.steps_done == 1
    assert sil3.steps_seen == saved_sil["steps_seen"] + 1
    assert len(sil3.entries) > len(saved_sil["entries"])
    old = {(tuple(e["prompt_ids"].tolist()), tuple(e["response_ids"].tolist())) for e in saved_sil["entries"]}
    assert old <= {(tuple(e["prompt_ids"].tolist()), tuple(e["response_ids"].tolist())) for e in sil3.entries}


# --------------------------------------------------------------------------------------------------
# tools/compare.py: the budget in rollouts and the critic's summary
# --------------------------------------------------------------------------------------------------


def test_compare_counts_the_budget_in_rollouts():
    compare = load_tool("compare")

    def config(batch_size, group_size, minibatch_size, ppo_epochs):
        return {"data": {"batch_size": batch_size}, "model": {"sampler": {"init_args": {"group_size": group_size}},
                                                              "batching": {"minibatch_size": minibatch_size,
                                                                           "ppo_epochs": ppo_epochs}}}

    assert compare.updates_per_rollout(config(4, 8, 16, 1)) == 2  # 32 responses / 16
    assert compare.updates_per_rollout(config(4, 8, None, 1)) == 1  # the whole rollout in one update
    assert compare.updates_per_rollout(config(4, 8, 10, 2)) == 8  # 2 epochs x ceil(32 / 10) = 2 x 4
    assert compare.updates_per_rollout(config(16, None, 8, 1)) == 2  # no group: 16 responses / 8
    args = compare.parse_args(["--steps", "5"])
    assert compare.shared_overlay(args, "runs/x", updates_per_rollout=4)["trainer"]["max_steps"] == 20


def test_compare_summarises_the_critic():
    compare = load_tool("compare")
    nan = math.nan
    summary = compare.critic_summary({
        "train/value_pretraining/explained_variance": [0.0, 0.2, 0.35],
        # Last half of 5 RL steps: from index 2, [0.3, nan, 0.5]; NaN (returns that did not vary) left out.
        "train/value/explained_variance": [nan, 0.1, 0.3, nan, 0.5],
    })
    assert summary == {"pretraining_rollouts": 3, "ev_pretraining_end": 0.35, "ev_rl_last_half": pytest.approx(0.4)}
    assert compare.critic_summary({"train/reward/mean": [0.5]}) == {}  # no critic
    # With a probe: the probe's explained variance after the last fit, beside the window's.
    probed = compare.critic_summary({"train/value_pretraining/explained_variance": [0.1, 0.2],
                                     "train/value_pretraining/window_explained_variance": [0.1, 0.15],
                                     "train/value_pretraining/probe_explained_variance": [0.05, 0.25]})
    assert (probed["ev_pretraining_window_end"], probed["ev_pretraining_probe_end"]) == (0.15, 0.25)
