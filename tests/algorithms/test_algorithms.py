"""Unit tests of rllight.algorithms: tiny hand-computed tensors (the arithmetic is in the comments),
loop references against the vectorised code, and the properties of ALGORITHMS.md.

Default ``torch.testing.assert_close`` tolerances throughout; loop-reference comparisons run in float64
so that the default float64 tolerances apply and summation order cannot hide a real difference.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from rllight.algorithms import (
    aggregate,
    clip_fractions,
    clipped_surrogate,
    discounted_cumsum,
    explained_variance,
    gae,
    group_relative,
    kl_penalty,
    logprobs_and_entropy,
    masked_mean,
    masked_whiten,
    value_loss,
)

# --------------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------------


def gae_loop(rewards, values, mask, gamma, lam):
    """Reference GAE as peer trainers write it: one reverse loop over tokens, values after the last
    valid token counted as 0. ``gamma``/``lam`` are floats or (B,) tensors."""
    batch, length = values.shape
    gamma = torch.as_tensor(gamma, dtype=values.dtype).expand(batch)
    lam = torch.as_tensor(lam, dtype=values.dtype).expand(batch)
    m = mask.to(values.dtype)
    v, r = values * m, rewards * m
    last = torch.zeros(batch, dtype=values.dtype)
    adv = torch.zeros_like(values)
    for t in reversed(range(length)):
        next_v = v[:, t + 1] if t + 1 < length else torch.zeros(batch, dtype=values.dtype)
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    adv = adv * m
    return adv, (adv + v) * m


def prefix_mask(lengths, length):
    return torch.arange(length).unsqueeze(0) < torch.as_tensor(lengths).unsqueeze(1)


# Two rows, T = 4. Row 0 has 3 valid tokens (the 4th column is padding with junk in it), row 1 has 4.
HAND_REWARDS = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.0, 0.0, 0.0, 1.0]])
HAND_VALUES = torch.tensor([[0.5, 0.6, 0.7, 9.0], [0.2, 0.4, 0.6, 0.8]])
HAND_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])


def test_gae_hand_computed():
    # gamma = 0.9, lam = 0.5 -> gamma * lam = 0.45; delta_t = r_t + 0.9 V_{t+1} - V_t, V after the end = 0.
    # Row 0: delta_2 = 1 + 0.9*0 - 0.7 = 0.3;  delta_1 = 0.9*0.7 - 0.6 = 0.03;  delta_0 = 0.9*0.6 - 0.5 = 0.04
    #        A_2 = 0.3;  A_1 = 0.03 + 0.45*0.3 = 0.165;  A_0 = 0.04 + 0.45*0.165 = 0.11425
    # Row 1: delta_3 = 1 - 0.8 = 0.2;  delta_2 = 0.72 - 0.6 = 0.12;  delta_1 = 0.54 - 0.4 = 0.14;
    #        delta_0 = 0.36 - 0.2 = 0.16
    #        A_3 = 0.2;  A_2 = 0.12 + 0.45*0.2 = 0.21;  A_1 = 0.14 + 0.45*0.21 = 0.2345;
    #        A_0 = 0.16 + 0.45*0.2345 = 0.265525
    adv, ret = gae(HAND_REWARDS, HAND_VALUES, HAND_MASK, gamma=0.9, lam=0.5)
    assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3, 0.0], [0.265525, 0.2345, 0.21, 0.2]]))
    # returns = A + V on valid tokens: 0.11425 + 0.5, 0.165 + 0.6, 0.3 + 0.7; 0.265525 + 0.2, ...
    assert_close(ret, torch.tensor([[0.61425, 0.765, 1.0, 0.0], [0.465525, 0.6345, 0.81, 1.0]]))


def test_gae_per_sequence_lambda():
    # gamma = 1, lam = (0, 1): row 0 gets the one-step TD error, row 1 the Monte-Carlo advantage.
    # Row 0: A_t = delta_t: 0.6 - 0.5 = 0.1, 0.7 - 0.6 = 0.1, 1 - 0.7 = 0.3
    # Row 1: G_t = 1 everywhere, A_t = 1 - V_t = 0.8, 0.6, 0.4, 0.2
    lam = torch.tensor([0.0, 1.0])
    adv, ret = gae(HAND_REWARDS, HAND_VALUES, HAND_MASK, gamma=1.0, lam=lam)
    assert_close(adv, torch.tensor([[0.1, 0.1, 0.3, 0.0], [0.8, 0.6, 0.4, 0.2]]))
    assert_close(ret, torch.tensor([[0.6, 0.7, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    # Each row equals the float-lambda result for that row alone.
    for i, lam_i in enumerate(lam.tolist()):
        adv_i, _ = gae(HAND_REWARDS[i : i + 1], HAND_VALUES[i : i + 1], HAND_MASK[i : i + 1], 1.0, lam_i)
        assert_close(adv[i : i + 1], adv_i)


def test_gae_padding_is_ignored():
    # Values and rewards after the last valid token count as 0, whatever the tensor holds there.
    torch.manual_seed(0)
    mask = prefix_mask([3, 7, 1, 10], 10)
    rewards, values = torch.randn(4, 10), torch.randn(4, 10)
    junk_r = torch.where(mask, rewards, torch.randn(4, 10) * 1e3)
    junk_v = torch.where(mask, values, torch.randn(4, 10) * 1e3)
    clean = gae(rewards * mask, values * mask, mask, gamma=0.99, lam=0.95)
    for got, want in zip(gae(junk_r, junk_v, mask, gamma=0.99, lam=0.95), clean):
        assert_close(got, want)


def test_gae_monte_carlo_and_returns():
    # gamma = lam = 1: A_t = G_t - V_t with G_t = sum of the rewards from t to the end of the response.
    torch.manual_seed(1)
    mask = prefix_mask([5, 2, 8], 8)
    rewards, values = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    m = mask.double()
    g = torch.flip(torch.cumsum(torch.flip(rewards * m, [1]), 1), [1])
    assert_close(adv, (g - values) * m)
    assert_close(ret, g * m)  # returns are the Monte-Carlo returns
    # In general returns = advantages + values on valid tokens, and both are 0 outside the mask.
    adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.9)
    assert_close(ret[mask], (adv + values)[mask])
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


@pytest.mark.parametrize(
    "batch,length",
    [(3, 1), (4, 63), (3, 64), (5, 65), (4, 200), (2, 64 * 64 + 37)],
)
@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0, "per-row"])
def test_gae_matches_loop_reference(batch, length, lam):
    gen = torch.Generator().manual_seed(batch * 100_000 + length)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0] = length  # at least one full row
    mask = prefix_mask(lengths, length)
    if lam == "per-row":
        lam = torch.rand(batch, generator=gen, dtype=torch.float64)
        lam[0] = 1.0
    for gamma in (1.0, 0.99):
        got = gae(rewards, values, mask, gamma=gamma, lam=lam)
        for g, w in zip(got, gae_loop(rewards, values, mask, gamma, lam)):
            assert_close(g, w)


def test_gae_per_row_gamma_matches_loop_reference():
    gen = torch.Generator().manual_seed(7)
    rewards = torch.randn(3, 130, generator=gen, dtype=torch.float64)
    values = torch.randn(3, 130, generator=gen, dtype=torch.float64)
    mask = prefix_mask([130, 77, 3], 130)
    gamma, lam = torch.tensor([1.0, 0.9, 0.5], dtype=torch.float64), torch.tensor([0.3, 1.0, 0.95], dtype=torch.float64)
    for g, w in zip(gae(rewards, values, mask, gamma, lam), gae_loop(rewards, values, mask, gamma, lam)):
        assert_close(g, w)


def test_gae_float32_close_to_float64_reference():
    # The blocked scan in float32 stays within float32 tolerances of the exact (float64) recurrence.
    gen = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(4, 300, generator=gen), torch.randn(4, 300, generator=gen)
    mask = prefix_mask([300, 250, 64, 1], 300)
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    ref, _ = gae_loop(rewards.double(), values.double(), mask, 1.0, 0.95)
    assert_close(adv, ref.float())


@pytest.mark.parametrize("bad", [torch.full((3,), 0.9), torch.full((2, 1), 0.9)])
def test_gae_rejects_wrong_lambda_shape(bad):
    with pytest.raises(ValueError):
        gae(HAND_REWARDS, HAND_VALUES, HAND_MASK, gamma=1.0, lam=bad)


def test_discounted_cumsum_hand_computed():
    # y_t = x_t + d y_{t+1}; row 0, d = 0.5: y_2 = 1, y_1 = 1 + 0.5 = 1.5, y_0 = 1 + 0.75 = 1.75
    # row 1, d = 0: y = x
    x = torch.tensor([[1.0, 1.0, 1.0], [2.0, 3.0, 4.0]])
    assert_close(discounted_cumsum(x, torch.tensor([0.5, 0.0])), torch.tensor([[1.75, 1.5, 1.0], [2.0, 3.0, 4.0]]))


# --------------------------------------------------------------------------------------------------
# Group-relative advantages (GRPO, Dr. GRPO)
# --------------------------------------------------------------------------------------------------

EPS = 1e-6  # group_relative's default


def test_group_relative_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # Group 0: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = sqrt(1/3) = 0.57735
    # Group 1: mean 0.75, deviations (0.25, 0.25, 0.25, -0.75), sum of squares 3*0.0625 + 0.5625 = 0.75,
    #          unbiased var = 0.75 / 3 = 0.25, std = 0.5
    s0 = math.sqrt(1 / 3)
    want = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s0 + EPS)
    want = torch.cat([want, torch.tensor([0.25, 0.25, 0.25, -0.75]) / (0.5 + EPS)])
    assert_close(group_relative(rewards, groups), want)
    # = (0.866, -0.866, -0.866, 0.866, 0.5, 0.5, 0.5, -1.5) up to eps; std is torch.std (unbiased)
    assert_close(torch.tensor(s0), rewards[:4].std())
    # Dr. GRPO: no division, R - mean.
    dr = group_relative(rewards, groups, scale_by_std=False)
    assert_close(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))


def test_group_relative_degenerate_groups_are_zero():
    # Group 5 is constant (all right), group 9 has one sample: both get advantage 0, in both modes.
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.3, 0.0, 1.0])
    groups = torch.tensor([5, 5, 5, 9, 2, 2])
    for scale in (True, False):
        adv = group_relative(rewards, groups, scale_by_std=scale)
        assert_close(adv[:4], torch.zeros(4))
        assert adv[4] < 0 < adv[5]


def test_group_relative_non_contiguous_labels():
    # The hand example above, interleaved and relabelled (0 -> 42, 1 -> -3): same values, same order.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    base = group_relative(rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    perm = torch.tensor([4, 0, 5, 1, 6, 2, 7, 3])
    labels = torch.tensor([-3, 42, -3, 42, -3, 42, -3, 42])
    assert_close(group_relative(rewards[perm], labels), base[perm])


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_group_relative_matches_loop_reference(scale_by_std):
    gen = torch.Generator().manual_seed(11)
    rewards = torch.randn(40, generator=gen)
    groups = torch.tensor([3, 10, 11, 100, 5])[torch.randint(0, 5, (40,), generator=gen)]
    groups[-1] = 77  # a group of one
    want = torch.zeros(40)
    for g in groups.unique():
        idx = (groups == g).nonzero().squeeze(1)
        if len(idx) > 1:
            r = rewards[idx]
            want[idx] = (r - r.mean()) / (r.std() + EPS) if scale_by_std else r - r.mean()
    assert_close(group_relative(rewards, groups, scale_by_std=scale_by_std), want)


# --------------------------------------------------------------------------------------------------
# Clipped surrogate and clip fractions
# --------------------------------------------------------------------------------------------------


def logprobs_for(ratios, old):
    """Leaf log-probs with exp(logprobs - old) = ratios."""
    return (torch.log(torch.as_tensor(ratios)) + old).requires_grad_()


def test_clipped_surrogate_worked_example():
    # Note 003: A = 1, old p = 0.1, new p = 0.14 -> r = 1.4; clip at 1 + 0.28 = 1.28.
    # objective min(1.4 * 1, 1.28 * 1) = 1.28 -> loss -1.28, and the clip removes the gradient.
    old = torch.log(torch.tensor([[0.1]]))
    new = torch.log(torch.tensor([[0.14]])).requires_grad_()
    loss = clipped_surrogate(new, old, torch.tensor([1.0]), clip_low=0.2, clip_high=0.28)
    assert_close(loss, torch.tensor([[-1.28]]))
    loss.sum().backward()
    assert_close(new.grad, torch.zeros(1, 1))


def test_clipped_surrogate_clips_on_the_right_side():
    # clip range [0.8, 1.28]. d loss / d logp = -A r on the unclipped branch, 0 when clipped.
    old = torch.full((2, 3), -2.0)
    new = logprobs_for([[1.4, 0.5, 1.1], [0.5, 1.4, 0.9]], old)
    adv = torch.tensor([1.0, -1.0])
    loss = clipped_surrogate(new, old, adv, clip_low=0.2, clip_high=0.28)
    # A = +1: r = 1.4 clipped (-1.28); r = 0.5 below the range is NOT clipped for A > 0 (-0.5); 1.1 inside.
    # A = -1: r = 0.5 clipped (max(0.5, 0.8) = 0.8); r = 1.4 above the range NOT clipped for A < 0
    #         (max(1.4, 1.28) = 1.4); 0.9 inside.
    assert_close(loss, torch.tensor([[-1.28, -0.5, -1.1], [0.8, 1.4, 0.9]]))
    loss.sum().backward()
    assert_close(new.grad, torch.tensor([[0.0, -0.5, -1.1], [0.0, 1.4, 0.9]]))


def test_clipped_surrogate_separate_low_and_high():
    old = torch.zeros(2, 1)
    new = logprobs_for([[1.25], [0.75]], old)
    adv = torch.tensor([1.0, -1.0])
    # Symmetric 0.2: A > 0 at r = 1.25 clipped to 1.2 (-1.2); A < 0 at r = 0.75 clipped to 0.8 (0.8).
    sym = clipped_surrogate(new, old, adv, clip_low=0.2, clip_high=0.2)
    assert_close(sym, torch.tensor([[-1.2], [0.8]]))
    (g_sym,) = torch.autograd.grad(sym.sum(), new)
    assert_close(g_sym, torch.zeros(2, 1))
    # clip_high = 0.28 frees the A > 0 token (-1.25, grad -1.25) but leaves A < 0 clipped (low still 0.2).
    hi = clipped_surrogate(new, old, adv, clip_low=0.2, clip_high=0.28)
    assert_close(hi, torch.tensor([[-1.25], [0.8]]))
    (g_hi,) = torch.autograd.grad(hi.sum(), new)
    assert_close(g_hi, torch.tensor([[-1.25], [0.0]]))
    # clip_low = 0.3 frees the A < 0 token: bound 0.7 < 0.75 -> loss 0.75, grad -A r = 0.75.
    lo = clipped_surrogate(new, old, adv, clip_low=0.3, clip_high=0.2)
    assert_close(lo, torch.tensor([[-1.2], [0.75]]))
    (g_lo,) = torch.autograd.grad(lo.sum(), new)
    assert_close(g_lo, torch.tensor([[0.0], [0.75]]))


def test_clipped_surrogate_dual_clip():
    old = torch.zeros(4, 1)
    new = logprobs_for([[5.0], [2.0], [5.0], [5.0]], old)
    adv = torch.tensor([-1.0, -1.0, 1.0, -2.0])
    loss = clipped_surrogate(new, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # A = -1, r = 5: PPO loss max(5, 1.28) = 5, bounded by -c A = 3 -> 3 (no gradient)
    # A = -1, r = 2: max(2, 1.28) = 2 < 3 -> 2 (gradient -A r = 2)
    # A = +1, r = 5: dual clip does not apply -> -1.28 (no gradient)
    # A = -2, r = 5: max(10, 2.56) = 10, bounded by 6 -> 6
    assert_close(loss, torch.tensor([[3.0], [2.0], [-1.28], [6.0]]))
    loss.sum().backward()
    assert_close(new.grad, torch.tensor([[0.0], [2.0], [0.0], [0.0]]))
    # Without the dual clip the first token is unbounded.
    assert_close(clipped_surrogate(new, old, adv, 0.2, 0.28)[0, 0], torch.tensor(5.0))
    with pytest.raises(ValueError):
        clipped_surrogate(new, old, adv, dual_clip=1.0)


def test_clipped_surrogate_sequence_advantages_broadcast():
    gen = torch.Generator().manual_seed(5)
    new, old = torch.randn(3, 6, generator=gen) * 0.3, torch.randn(3, 6, generator=gen) * 0.3
    adv = torch.tensor([0.7, -1.2, 0.0])
    assert_close(
        clipped_surrogate(new, old, adv, 0.2, 0.28, dual_clip=3.0),
        clipped_surrogate(new, old, adv.unsqueeze(1).expand(3, 6), 0.2, 0.28, dual_clip=3.0),
    )


def test_clip_fractions_hand_computed():
    # Range [0.8, 1.28]. Row 0 (A = +1), mask (1, 1, 0): ratios 1.4 (high), 1.1, 2.0 (padding, ignored).
    # Row 1 (A = -1), mask (1, 1, 1): ratios 0.5 (low), 0.7 (low), 1.4 (not clipped for A < 0).
    # 5 valid tokens: low = 2/5, high = 1/5.
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.4, 1.1, 2.0], [0.5, 0.7, 1.4]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    low, high = clip_fractions(new, old, torch.tensor([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert_close(low, torch.tensor(0.4))
    assert_close(high, torch.tensor(0.2))


# --------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------


def test_aggregate_note_003_token_weights():
    # Responses of 100 and 1000 tokens, per-token loss 1 and 2.
    mask = prefix_mask([100, 1000], 1000)
    per_token = torch.stack([torch.ones(1000), torch.full((1000,), 2.0)]).requires_grad_()
    # token-mean: (100*1 + 1000*2) / 1100 = 2100/1100; each valid token weighs 1/1100.
    loss = aggregate(per_token, mask, "token-mean")
    assert_close(loss, torch.tensor(2100 / 1100))
    (grad,) = torch.autograd.grad(loss, per_token)
    assert_close(grad, mask / 1100.0)
    # seq-mean-token-mean: (1 + 2) / 2 = 1.5; tokens weigh 1/(2*100) = 1/200 and 1/(2*1000) = 1/2000.
    loss = aggregate(per_token, mask, "seq-mean-token-mean")
    assert_close(loss, torch.tensor(1.5))
    (grad,) = torch.autograd.grad(loss, per_token)
    assert_close(grad, mask * torch.tensor([[1 / 200], [1 / 2000]]))


def test_aggregate_sum_modes_hand_computed():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -7.0, 8.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # Sums over responses: 1+2+3 = 6 and 4+5 = 9; 5 valid tokens; 2 sequences; T = 4.
    assert_close(aggregate(per_token, mask, "token-mean"), torch.tensor(15 / 5))
    assert_close(aggregate(per_token, mask, "seq-mean-token-mean"), torch.tensor((6 / 3 + 9 / 2) / 2))  # 3.25
    assert_close(aggregate(per_token, mask, "seq-mean-token-sum"), torch.tensor(15 / 2))  # 7.5
    # Dr. GRPO: divide by num_seqs * max_len, max_len defaulting to T.
    assert_close(aggregate(per_token, mask, "seq-mean-token-sum-norm"), torch.tensor(15 / (2 * 4)))  # 1.875
    assert_close(aggregate(per_token, mask, "seq-mean-token-sum-norm", max_len=10), torch.tensor(15 / 20))
    assert_close(
        aggregate(per_token, mask, "seq-mean-token-sum-norm", max_len=10, num_seqs=8), torch.tensor(15 / 80)
    )
    assert_close(aggregate(per_token, mask, "seq-mean-token-sum", num_seqs=6), torch.tensor(15 / 6))


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_padding_does_not_change_loss(mode):
    gen = torch.Generator().manual_seed(2)
    mask = prefix_mask([3, 6, 1], 6)
    per_token = torch.randn(3, 6, generator=gen)
    junk = torch.where(mask, per_token, torch.randn(3, 6, generator=gen) * 1e3)
    # Extra all-padding columns (longer T) do not change it either; max_len fixed for the -norm mode.
    wide = torch.cat([junk, torch.randn(3, 5, generator=gen) * 1e3], 1)
    wide_mask = torch.cat([mask, torch.zeros(3, 5, dtype=torch.bool)], 1)
    want = aggregate(per_token * mask, mask, mode, max_len=16)
    assert_close(aggregate(junk, mask, mode, max_len=16), want)
    assert_close(aggregate(wide, wide_mask, mode, max_len=16), want)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_masked_tokens_get_zero_gradient(mode):
    mask = prefix_mask([3, 6, 1], 6)
    per_token = torch.randn(3, 6).requires_grad_()
    aggregate(per_token, mask, mode).backward()
    assert (per_token.grad[~mask] == 0).all()
    assert (per_token.grad[mask] > 0).all()


def test_aggregate_num_tokens_for_gradient_accumulation():
    # Two micro-batches with num_tokens = the global count must sum to the full-batch token-mean
    # (value and gradient). The micro-batches' own counts (5 and 12 tokens) would not.
    gen = torch.Generator().manual_seed(4)
    mask = prefix_mask([2, 3, 8, 4], 8)  # 17 tokens: 5 in rows 0-1, 12 in rows 2-3
    per_token = torch.randn(4, 8, generator=gen).requires_grad_()
    full = aggregate(per_token, mask, "token-mean")
    (g_full,) = torch.autograd.grad(full, per_token)
    n = mask.sum()
    accumulated = aggregate(per_token[:2], mask[:2], num_tokens=n) + aggregate(per_token[2:], mask[2:], num_tokens=n)
    (g_acc,) = torch.autograd.grad(accumulated, per_token)
    assert_close(accumulated, full)
    assert_close(g_acc, g_full)
    naive = (aggregate(per_token[:2], mask[:2]) + aggregate(per_token[2:], mask[2:])) / 2
    assert not torch.allclose(naive, full)
    # Same for the sequence modes with num_seqs = the global number of sequences.
    for mode in MODES[1:]:
        whole = aggregate(per_token, mask, mode, max_len=8)
        split = sum(aggregate(per_token[i : i + 2], mask[i : i + 2], mode, max_len=8, num_seqs=4) for i in (0, 2))
        assert_close(split, whole)


def test_aggregate_unknown_mode_raises():
    with pytest.raises(ValueError):
        aggregate(torch.ones(2, 3), torch.ones(2, 3), "sequence-mean")


# --------------------------------------------------------------------------------------------------
# KL and masked statistics
# --------------------------------------------------------------------------------------------------


def test_kl_penalty_hand_computed():
    logp = torch.tensor([[-1.0, -2.0, -0.3]])
    ref = torch.tensor([[-1.5, -1.0, -0.3]])
    # d = logp - ref = (0.5, -1.0, 0)
    assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))
    # k2 = d^2 / 2 = (0.125, 0.5, 0)
    assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.125, 0.5, 0.0]]))
    # k3 = exp(ref - logp) - (ref - logp) - 1: exp(-0.5) + 0.5 - 1 = 0.10653; exp(1) - 1 - 1 = 0.71828; 0
    want = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    assert_close(kl_penalty(logp, ref, "k3"), want)
    assert_close(kl_penalty(logp, ref), want)  # k3 is the default


def test_kl_k3_is_non_negative_and_unknown_kind_raises():
    gen = torch.Generator().manual_seed(6)
    k3 = kl_penalty(torch.randn(8, 50, generator=gen) * 3, torch.randn(8, 50, generator=gen) * 3, "k3")
    assert (k3 >= 0).all()
    with pytest.raises(ValueError):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


WHITEN_X = torch.tensor([[1.0, 2.0, 3.0, 50.0], [4.0, -9.0, 70.0, 0.5]])
WHITEN_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


def test_masked_mean_hand_computed():
    # Valid entries 1, 2, 3 | 4: mean 10/4 = 2.5; per row 6/3 = 2 and 4/1 = 4.
    assert_close(masked_mean(WHITEN_X, WHITEN_MASK), torch.tensor(2.5))
    assert_close(masked_mean(WHITEN_X, WHITEN_MASK, dim=-1), torch.tensor([2.0, 4.0]))


def test_masked_whiten():
    # Valid entries 1, 2, 3, 4: mean 2.5, deviations (-1.5, -0.5, 0.5, 1.5), sum of squares 5,
    # unbiased var 5/3 -> whitened = deviation / sqrt(5/3 + 1e-8).
    out = masked_whiten(WHITEN_X, WHITEN_MASK)
    std = math.sqrt(5 / 3 + 1e-8)
    assert_close(out, torch.tensor([[-1.5, -0.5, 0.5, 0.0], [1.5, 0.0, 0.0, 0.0]]) / std)
    valid = out[WHITEN_MASK.bool()]
    assert_close(valid.mean(), torch.tensor(0.0))
    assert_close(valid.var(), torch.tensor(1.0))  # torch.var is unbiased
    # shift_mean=False: only the scale changes, the masked mean stays 2.5; padding still 0.
    kept = masked_whiten(WHITEN_X, WHITEN_MASK, shift_mean=False)
    assert_close(kept, torch.tensor([[-1.5, -0.5, 0.5, 0.0], [1.5, 0.0, 0.0, 0.0]]) / std + 2.5 * WHITEN_MASK)
    assert_close(kept[WHITEN_MASK.bool()].mean(), torch.tensor(2.5))


# --------------------------------------------------------------------------------------------------
# Critic: value loss and explained variance
# --------------------------------------------------------------------------------------------------


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 1.9, 0.5]])
    returns = torch.tensor([[2.0, 1.5, 1.0]])
    # Unclipped: 0.5 (V - R)^2 = 0.5 * (1, 0.25, 1) = (0.5, 0.125, 0.5)
    assert_close(value_loss(values, old, returns), torch.tensor([[0.5, 0.125, 0.5]]))
    # clip 0.2: V_clip = old + clamp(V - old, -0.2, 0.2) = (0.7, 2.0, 0.3)
    # (V_clip - R)^2 = (1.69, 0.25, 0.49); max with (1, 0.25, 1) -> (1.69, 0.25, 1); halved:
    loss = value_loss(values, old, returns, clip=0.2)
    assert_close(loss, torch.tensor([[0.845, 0.125, 0.5]]))
    # Token 0 takes the clipped branch (no gradient); others: d/dV 0.5 (V - R)^2 = V - R = (0.5, -1).
    loss.sum().backward()
    assert_close(values.grad, torch.tensor([[0.0, 0.5, -1.0]]))


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # Perfect critic on the valid tokens (padding differs): 1.
    assert_close(explained_variance(returns * mask, returns, mask), torch.tensor(1.0))
    # Constant critic: Var(R - c) = Var(R) -> 0.
    assert_close(explained_variance(torch.full_like(returns, 1.7), returns, mask), torch.tensor(0.0))
    # V = (1.5, 1.5, 3.5, 3.5): R - V = (-0.5, 0.5, -0.5, 0.5), var 0.25; Var(R) = 5/4 = 1.25
    # -> 1 - 0.25 / 1.25 = 0.8
    values = torch.tensor([[1.5, 1.5, 3.5, 3.5, -40.0]])
    assert_close(explained_variance(values, returns, mask), torch.tensor(0.8))
    # Returns that do not vary on the valid tokens (all-wrong batch): undefined, not a huge negative.
    constant = torch.tensor([[0.0, 0.0, 0.0, 0.0, 5.0]])
    assert torch.isnan(explained_variance(values * 1e-3, constant, mask))
    # A rollout whose rewards are all 0, its returns from gae (lambda 1, gamma 1): exactly 0 in exact arithmetic, a
    # rounding error apart here (the error as gae leaves it: ~1e-4 of values ~0.3). Undefined, not about -1e6.
    rounded = torch.tensor([[2e-4, -1.5e-4, 1e-4, -1.5e-4, 0.0]])  # variance 2.4e-8
    critic = torch.tensor([[0.3, 0.25, 0.35, 0.2, 0.0]])
    assert torch.isnan(explained_variance(critic, rounded, mask))
    # Small returns that do vary (rewards of 0.01 to 0.04) against a critic of their size: defined, 0.8.
    assert_close(explained_variance(values * 0.01, returns * 0.01, mask), torch.tensor(0.8))


# --------------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# --------------------------------------------------------------------------------------------------


def test_logprobs_and_entropy_hand_computed():
    # logits (0, log 3) -> p = (1/4, 3/4); log p(token 1) = log 0.75;
    # entropy = -(0.25 log 0.25 + 0.75 log 0.75) = 0.562335. Temperature 2 on (0, 2 log 3): the same.
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    for logits, temp in (([0.0, math.log(3)], 1.0), ([0.0, 2 * math.log(3)], 2.0)):
        lp, ent = logprobs_and_entropy(torch.tensor([[logits]]), torch.tensor([[1]]), temperature=temp)
        assert_close(lp, torch.tensor([[math.log(0.75)]]))
        assert_close(ent, torch.tensor([[h]]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_direct_computation(temperature):
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    z = logits / temperature
    lse = torch.logsumexp(z, -1)
    want_lp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    want_ent = lse - (torch.softmax(z, -1) * z).sum(-1)  # H = logsumexp(z) - E_p[z]
    lp, ent = logprobs_and_entropy(logits.float(), targets, temperature)
    assert lp.dtype == ent.dtype == torch.float32
    assert_close(lp, want_lp.float())
    assert_close(ent, want_ent.float())
    lp_bf16, _ = logprobs_and_entropy(logits.bfloat16(), targets, temperature)
    assert lp_bf16.dtype == torch.float32  # computed in float32 whatever the logits dtype


def test_non_finite_padding_does_not_leak():
    from rllight.algorithms import aggregate, gae

    mask = torch.tensor([[1, 1, 1, 0]])
    clean, _ = gae(torch.tensor([[0.0, 0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.6, 0.7, 0.0]]), mask, 1.0, 0.95)
    dirty, _ = gae(torch.tensor([[0.0, 0.0, 1.0, float("inf")]]), torch.tensor([[0.5, 0.6, 0.7, float("nan")]]),
                   mask, 1.0, 0.95)
    torch.testing.assert_close(dirty, clean)
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.7 - 0.6 = 0.1 -> 0.1 + 0.95 * 0.3 = 0.385;
    # delta_0 = 0.6 - 0.5 = 0.1 -> 0.1 + 0.95 * 0.385 = 0.46575
    torch.testing.assert_close(clean, torch.tensor([[0.46575, 0.385, 0.3, 0.0]]))
    loss = aggregate(torch.tensor([[1.0, 2.0, float("nan")]]), torch.tensor([[1, 1, 0]]), "token-mean")
    torch.testing.assert_close(loss, torch.tensor(1.5))
