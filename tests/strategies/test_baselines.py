"""The baselines (RLOO, ReMax, REINFORCE++, GSPO, Dr. GRPO, CISPO, truncated IS, KL in the loss or in the
reward, entropy bonus): hand-computed numbers for each formula, and two-step runs of every recipe and
ablation overlay on a tiny model in which every trainable parameter must change."""

import math
import os

import pytest
import torch
from torch.testing import assert_close

from conftest import RECIPES
from helpers import build, recipe_configs, tiny_overrides, unchanged_parameters
from rllight.algorithms import cispo, clipped_surrogate, gspo, reinforce_pp, remax, rloo, truncated_is_weight
from rllight.errors import RecipeError
from rllight.strategies import (
    CISPO,
    GSPO,
    RLOO,
    ClippedSurrogate,
    GroupRelative,
    ReinforcePP,
    ReMax,
    ReMaxSampler,
    SeqMeanTokenSumNorm,
    TruncatedIS,
)
from rllight.types import Rollout


def _rollout(b=2, t=2, **fields):
    base = dict(
        prompt_ids=torch.ones(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
        response_ids=torch.ones(b, t, dtype=torch.long), response_mask=torch.ones(b, t, dtype=torch.long),
        sample_logprobs=torch.zeros(b, t), truncated=torch.zeros(b, dtype=torch.bool), group_ids=torch.arange(b),
        answers=[""] * b, texts=[""] * b,
    )
    base.update(fields)
    return Rollout(**base)


# --------------------------------------------------------------------------------------------------
# RLOO
# --------------------------------------------------------------------------------------------------


def test_rloo_hand_computed():
    # Group 7: rewards [1, 0, 0, 1]. For R = 1 the others average (0 + 0 + 1) / 3 = 1/3 -> A = 2/3;
    # for R = 0 they average 2/3 -> A = -2/3. Group 3 has one sample: no baseline, A = 0.
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0])
    groups = torch.tensor([7, 7, 3, 7, 7])
    assert_close(rloo(rewards, groups), torch.tensor([2 / 3, -2 / 3, 0.0, -2 / 3, 2 / 3]))


def test_rloo_matches_a_loop_reference():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g, dtype=torch.float64)
    groups = torch.randint(0, 5, (24,), generator=g)
    expected = torch.zeros_like(rewards)
    for i in range(24):
        others = [rewards[j] for j in range(24) if j != i and groups[j] == groups[i]]
        if others:
            expected[i] = rewards[i] - sum(others) / len(others)
    assert_close(rloo(rewards, groups), expected)
    # and it is GRPO's centred reward scaled by G / (G - 1)
    counts = torch.bincount(groups)[groups].double()
    centred = GroupRelative(scale_by_std=False)(_rollout(b=24, t=1, rewards=rewards, group_ids=groups,
                                                         response_mask=torch.ones(24, 1)))[0].squeeze(-1)
    assert_close(rloo(rewards, groups), torch.where(counts > 1, centred * counts / (counts - 1), 0.0))


def test_rloo_strategy_broadcasts_over_the_response():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rollout = _rollout(t=3, rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]), response_mask=mask)
    adv, returns = RLOO()(rollout)
    # Two samples: A = R_i - R_other = [1, -1].
    assert_close(adv, torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]))
    assert returns is None


# --------------------------------------------------------------------------------------------------
# ReMax
# --------------------------------------------------------------------------------------------------


class _FakeModule:
    """Stands in for RolloutProducer.sample: sampled rewards 0.1 * row, greedy rewards 1 + row."""

    def __init__(self):
        self.calls = []

    def sample(self, rows, n, greedy=False, training=True, sampling=None):
        self.calls.append((len(rows), n, greedy))
        b = len(rows) * n
        rewards = torch.arange(len(rows)) + 1.0 if greedy else 0.1 * torch.arange(b, dtype=torch.float32)
        return _rollout(b=b, rewards=rewards, group_ids=torch.arange(len(rows)).repeat_interleave(n),
                        extras={"time/rollout": 1.0, "time/reward": 0.5})


def test_remax_sampler_scores_one_greedy_response_per_prompt():
    module = _FakeModule()
    rollout = ReMaxSampler(group_size=2)(module, [{}, {}, {}])
    assert module.calls == [(3, 2, False), (3, 1, True)]
    # greedy rewards [1, 2, 3], each repeated for the prompt's 2 samples
    assert_close(rollout.extras["greedy_rewards"], torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0]))
    assert rollout.extras["time/rollout"] == 2.0 and rollout.extras["reward/greedy_mean"] == 2.0
    # A = R - R_greedy = [0 - 1, 0.1 - 1, 0.2 - 2, 0.3 - 2, 0.4 - 3, 0.5 - 3]
    adv, _ = ReMax()(rollout)
    assert_close(adv[:, 0], torch.tensor([-1.0, -0.9, -1.8, -1.7, -2.6, -2.5]))
    # the greedy rewards follow the rows when a callback drops some
    assert_close(ReMax()(rollout.select([5, 0]))[0][:, 0], torch.tensor([-2.5, -1.0]))


def test_remax_function():
    assert_close(remax(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])), torch.tensor([1.0, -1.0]))


def test_remax_without_its_sampler_is_a_one_line_error():
    with pytest.raises(RecipeError, match="model.sampler") as err:
        ReMax()(_rollout(rewards=torch.zeros(2)))
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------------
# REINFORCE++
# --------------------------------------------------------------------------------------------------


def test_reinforce_pp_hand_computed():
    # Row 0: token rewards [-0.1, -0.1, 0.9] (KL -0.1 per token, outcome 1 on the last): gamma = 1 returns
    # [0.7, 0.8, 0.9]. Row 1: one token, reward 0.1 (its padding holds junk rewards that must be ignored).
    # Whitening over the four valid returns [0.7, 0.8, 0.9, 0.1]: mean 0.625, squared deviations
    # 0.005625 + 0.030625 + 0.075625 + 0.275625 = 0.3875, / 3 = 0.129167, std 0.359398:
    # [0.208682, 0.486925, 0.765168, -1.460776].
    rewards = torch.tensor([[-0.1, -0.1, 0.9], [0.1, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, returns = reinforce_pp(rewards, mask, gamma=1.0)
    assert_close(returns, torch.tensor([[0.7, 0.8, 0.9], [0.1, 0.0, 0.0]]))
    assert_close(adv, torch.tensor([[0.208682, 0.486925, 0.765168], [-1.460776, 0.0, 0.0]]), rtol=0, atol=1e-5)
    # gamma = 0.5: G = [-0.1 + 0.5 (-0.1 + 0.5 * 0.9), -0.1 + 0.5 * 0.9, 0.9] = [0.075, 0.35, 0.9]
    _, returns = reinforce_pp(rewards, mask, gamma=0.5)
    assert_close(returns[0], torch.tensor([0.075, 0.35, 0.9]))


def test_reinforce_pp_strategy_reads_the_token_rewards():
    token_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    adv, returns = ReinforcePP()(_rollout(token_rewards=token_rewards, rewards=torch.tensor([1.0, 0.0])))
    assert returns is None
    assert (adv[0] > 0).all() and (adv[1] < 0).all()
    with pytest.raises(RecipeError, match=r"^ReinforcePP\.gamma must be a number in \(0, 1\], got 0\.0$"):
        ReinforcePP(gamma=0.0)


# --------------------------------------------------------------------------------------------------
# GSPO
# --------------------------------------------------------------------------------------------------


def test_gspo_hand_computed_and_clip_sides():
    # Row 0: logp - old = [0.1, 0.3] -> mean 0.2, s = e^0.2 = 1.221403; A = +1 with clip_high 0.2:
    #   min(1.221403, 1.2) = 1.2 -> loss -1.2, and the gradient through s is zero (clipped).
    # Row 1: same ratio, A = -1: max(-(-1) 1.221403, -(-1) 1.2) = 1.221403, unclipped: the gradient of
    #   s A with respect to each logp_t is -A s / L = 1.221403 / 2 = 0.610701.
    # Row 2: one valid token, logp - old = -0.5 (padding: junk), s = e^-0.5 = 0.606531, A = 2, inside
    #   nothing clips on this side for A > 0: loss -1.213061, gradient -A s / 1 = -1.213061.
    logprobs = torch.tensor([[0.1, 0.3], [0.1, 0.3], [-0.5, 9.0]], requires_grad=True)
    old = torch.zeros(3, 2)
    adv = torch.tensor([1.0, -1.0, 2.0])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    loss = gspo(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert_close(loss, torch.tensor([-1.2, 1.221403, -1.213061]))
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0], [0.610701, 0.610701], [-1.213061, 0.0]]))


def test_gspo_strategy_logs_sequence_clip_fractions():
    logprobs = torch.tensor([[0.1, 0.3], [0.0, 0.0]])
    batch = _rollout(old_logprobs=torch.zeros(2, 2), advantages=torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))
    loss, stats = GSPO()(logprobs, batch)
    assert loss.shape == (2,)
    assert stats["policy/clipfrac_high"] == 0.5 and stats["policy/clipfrac_low"] == 0


# --------------------------------------------------------------------------------------------------
# CISPO
# --------------------------------------------------------------------------------------------------


def test_cispo_hand_computed_keeps_every_gradient():
    # Token 0: p = 0.5, old p = 0.25 -> r = 2 -> weight min(2, 1.28) = 1.28; A = 1:
    #   loss = -1.28 * 1 * ln 0.5 = 0.887228; d loss / d logp = -1.28.
    # Token 1: r = 0.25 / 0.5 = 0.5; no lower bound -> weight 0.5; A = 1: loss = -0.5 ln 0.25 = 0.693147;
    #   gradient -0.5. PPO's clip would give token 0 no gradient at all.
    logprobs = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.5]]))
    loss = cispo(logprobs, old, torch.tensor([1.0]))
    assert_close(loss, torch.tensor([[0.887228, 0.693147]]))
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[-1.28, -0.5]]))
    ppo = logprobs.detach().clone().requires_grad_()
    clipped_surrogate(ppo, old, torch.tensor([1.0]), 0.2, 0.28).sum().backward()
    assert ppo.grad[0, 0] == 0


def test_cispo_lower_bound():
    # With clip_low 0.2 the weight of r = 0.5 is raised to 0.8: loss = -0.8 * 1 * ln 0.25 = 1.109035.
    loss = cispo(torch.log(torch.tensor([[0.25]])), torch.log(torch.tensor([[0.5]])), torch.tensor([1.0]), clip_low=0.2)
    assert_close(loss, torch.tensor([[1.109035]]))
    with pytest.raises(RecipeError, match=r"^CISPO\.clip_high must be a number > 0, got 0\.0$"):
        CISPO(clip_high=0.0)


# --------------------------------------------------------------------------------------------------
# Truncated importance sampling
# --------------------------------------------------------------------------------------------------


def test_truncated_is_weight_hand_computed():
    # old - sample = [ln 3, ln 0.5, 0, 800] -> exp = [3, 0.5, 1, inf] -> min(., 2) = [2, 0.5, 1, 2]
    old = torch.tensor([math.log(3.0), math.log(0.5), 0.0, 800.0])
    assert_close(truncated_is_weight(old, torch.zeros(4), cap=2.0), torch.tensor([2.0, 0.5, 1.0, 2.0]))


def test_truncated_is_wraps_a_per_token_loss():
    # ClippedSurrogate at r = 1 gives -A per token; A = 1 -> [-1, -1]; the weights are [2, 0.5]
    # (old - sample = [ln 3, ln 0.5], cap 2) -> [-2, -0.5]; the gradient is scaled the same way.
    logprobs = torch.zeros(1, 2, requires_grad=True)
    sample = torch.tensor([[-math.log(3.0), math.log(2.0)]])
    batch = _rollout(b=1, old_logprobs=torch.zeros(1, 2), sample_logprobs=sample, advantages=torch.ones(1, 2))
    loss, stats = TruncatedIS(ClippedSurrogate(), cap=2.0)(logprobs, batch)
    assert_close(loss, torch.tensor([[-2.0, -0.5]]))
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[-2.0, -0.5]]))
    assert_close(stats["policy/tis_weight_mean"], torch.tensor(1.25))
    assert stats["policy/tis_capped_frac"] == 0.5 and "policy/clipfrac_high" in stats


def test_truncated_is_rejects_a_sequence_level_loss():
    batch = _rollout(old_logprobs=torch.zeros(2, 2), advantages=torch.ones(2, 2))
    with pytest.raises(RecipeError, match="per-token"):
        TruncatedIS(GSPO())(torch.zeros(2, 2), batch)
    with pytest.raises(RecipeError, match=r"^TruncatedIS\.cap must be a number > 0, got 0\.0$"):
        TruncatedIS(ClippedSurrogate(), cap=0.0)


# --------------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------------


def test_dr_grpo_recipe_is_group_relative_without_std_and_a_constant_normaliser():
    m = build(os.path.join(RECIPES, "dr_grpo.yaml")).model
    assert type(m.advantage) is GroupRelative and m.advantage.scale_by_std is False
    assert type(m.aggregation) is SeqMeanTokenSumNorm and m.aggregation.max_len == m.rollout.max_new_tokens


# The overlays this file owns (other ablations are tested with their own algorithms).
ABLATIONS = [os.path.join(RECIPES, "ablations", name) for name in
             ("grpo-kl-in-loss.yaml", "ppo-kl-in-reward.yaml", "grpo-tis.yaml", "grpo-entropy-bonus.yaml")]


def test_kl_overlays_show_both_placements():
    kl = {os.path.basename(o): build(*recipe_configs(o)).model.kl for o in ABLATIONS}
    assert kl["grpo-kl-in-loss.yaml"].in_reward is False and kl["grpo-kl-in-loss.yaml"].kind == "k3"
    assert kl["ppo-kl-in-reward.yaml"].in_reward is True and kl["ppo-kl-in-reward.yaml"].kind == "k1"
    assert build(os.path.join(RECIPES, "reinforce_pp.yaml")).model.kl.in_reward is True


TRAINED = ["rloo.yaml", "remax.yaml", "reinforce_pp.yaml", "gspo.yaml", "dr_grpo.yaml", "cispo.yaml"]


@pytest.mark.parametrize("recipe", TRAINED + [os.path.join("ablations", os.path.basename(o)) for o in ABLATIONS])
def test_recipe_trains_two_steps_and_changes_every_parameter(recipe, tmp_path, tiny_model_dir):
    path = os.path.join(RECIPES, recipe)
    configs = recipe_configs(path)
    cli = build(*configs, tiny_overrides(tmp_path, tiny_model_dir))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []
    logged = cli.trainer.logged_metrics
    assert all(torch.isfinite(v) for k, v in logged.items() if k.startswith("train/policy/"))
    if cli.model.kl is not None and not cli.model.kl.in_reward:
        assert "train/policy/kl_ref" in logged
    if isinstance(cli.model.policy_loss, TruncatedIS):
        assert "train/policy/tis_weight_mean" in logged
    if isinstance(cli.model.sampler, ReMaxSampler):
        assert "train/reward/greedy_mean" in logged
