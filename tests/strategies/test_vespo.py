"""VESPO (arXiv:2602.10693): the kernel phi(W) = W^c1 exp(c2 (1 - W)) against hand-computed numbers, its
bound K = sup phi(w)/w against the closed form, finiteness for |log W| up to 500, the per-token loss and
its gradient, which log-probs W is taken against (the trainer's old ones by default, the engine's with
``weight_against: engine``; W exactly 1 on a tiny model's first minibatch), truncated IS around it, and a
two-step run of recipes/vespo.yaml on a tiny model."""

import math
import os

import pytest
import torch
from torch.testing import assert_close

from conftest import RECIPES
from helpers import build, load_tool, tiny_overrides, unchanged_parameters
from rllight.algorithms import effective_sample_size, vespo_weight
from rllight.errors import RecipeError
from rllight.strategies import VESPO, PolicyLoss, TruncatedIS
from rllight.types import Rollout


def closed_form_k(c1, c2):
    """ALGORITHMS.md: K = sup_w phi(w)/w = ((c1-1)/c2)^(c1-1) * exp(c2 - c1 + 1), for c1 >= 1."""
    return ((c1 - 1) / c2) ** (c1 - 1) * math.exp(c2 - c1 + 1)


def test_kernel_hand_computed():
    log_w = torch.log(torch.tensor([1.0, 2.0, 0.5, 1.0, 2.0, 0.5]))
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    # A >= 0, (c1, c2) = (2, 3): phi(1) = 1; phi(2) = 2^2 e^(3(1-2)) = 4 e^-3 = 0.199148;
    #   phi(0.5) = 0.25 e^(1.5) = 1.120422.
    # A < 0, (c1, c2) = (3, 2): phi(1) = 1; phi(2) = 8 e^-2 = 1.082682; phi(0.5) = 0.125 e^1 = 0.339785.
    expected = torch.tensor([1.0, 0.199148, 1.120422, 1.0, 1.082682, 0.339785])
    assert_close(vespo_weight(log_w, adv), expected, rtol=0, atol=1e-6)


def test_zero_advantage_uses_the_positive_kernel():
    # A = 0 counts as A >= 0: W = 2 gives the (2, 3) value 4 e^-3 = 0.199148, not the (3, 2) one 1.082682.
    assert_close(vespo_weight(torch.tensor([math.log(2.0)]), torch.tensor([0.0])), torch.tensor([0.199148]),
                 rtol=0, atol=1e-6)


@pytest.mark.parametrize("c1,c2", [(2.0, 3.0), (3.0, 2.0), (1.5, 0.7), (4.0, 5.0)])
def test_sup_of_phi_over_w_matches_the_closed_form(c1, c2):
    # Scan log w on a grid of step 1e-4 over [-10, 10] in float64: at the maximiser w* = (c1-1)/c2 the log of
    # phi(w)/w has curvature -(c1-1) in log w, so the grid misses the sup by a relative 0.5 (c1-1) (5e-5)^2
    # < 1e-8, well inside the default float64 tolerance (rtol 1e-7).
    log_w = torch.linspace(-10.0, 10.0, 200_001, dtype=torch.float64)
    phi = vespo_weight(log_w, torch.ones_like(log_w), c1_pos=c1, c2_pos=c2)
    ratio = phi / torch.exp(log_w)
    k = torch.tensor(closed_form_k(c1, c2), dtype=torch.float64)
    assert_close(ratio.max(), k)
    assert_close(torch.exp(log_w[ratio.argmax()]), torch.tensor((c1 - 1) / c2, dtype=torch.float64), rtol=2e-4, atol=0)


def test_known_bounds():
    # (2, 3): K = (1/3)^1 e^(3-2+1) = e^2 / 3 = 2.463019; (3, 2): K = (2/2)^2 e^0 = 1.
    assert closed_form_k(2.0, 3.0) == pytest.approx(2.463019, abs=1e-6)
    assert closed_form_k(3.0, 2.0) == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_finite_for_huge_log_weights(dtype):
    log_w = torch.tensor([-500.0, -100.0, -20.0, 0.0, 20.0, 100.0, 500.0, float("inf"), float("-inf")], dtype=dtype)
    for sign in (1.0, -1.0):
        phi = vespo_weight(log_w, torch.full_like(log_w, sign))
        assert torch.isfinite(phi).all(), phi
        assert (phi >= 0).all()
        # Both tails vanish: W^c1 below 1, exp(-c2 W) above.
        assert phi[0] == 0 and phi[6] == 0 and phi[7] == 0 and phi[8] == 0
        assert phi[3] == 1


def test_weight_is_detached():
    log_w = torch.tensor([0.3, -0.2], requires_grad=True)
    assert not vespo_weight(log_w, torch.tensor([1.0, -1.0])).requires_grad


def test_effective_sample_size():
    # weights [1, 3]: (1 + 3)^2 / (2 (1 + 9)) = 16 / 20 = 0.8; equal weights give 1.
    assert_close(effective_sample_size(torch.log(torch.tensor([1.0, 3.0]))), torch.tensor(0.8))
    assert_close(effective_sample_size(torch.full((5,), 400.0)), torch.tensor(1.0))
    # One weight dominating by e^500 is a sample size of one out of three: 1/3, without overflow.
    assert_close(effective_sample_size(torch.tensor([500.0, 0.0, -500.0])), torch.tensor(1 / 3))
    assert effective_sample_size(torch.full((3,), float("-inf"))) == 0


def _rollout(logprobs, sample_logprobs, advantages, mask, old_logprobs=None):
    """``old_logprobs`` None: the sampling log-probs + 7, which a loss against the engine must not read."""
    b, t = logprobs.shape
    return Rollout(
        prompt_ids=torch.ones(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
        response_ids=torch.ones(b, t, dtype=torch.long), response_mask=mask,
        sample_logprobs=sample_logprobs, truncated=torch.zeros(b, dtype=torch.bool),
        group_ids=torch.arange(b), answers=[""] * b, texts=[""] * b,
        advantages=advantages, old_logprobs=sample_logprobs + 7.0 if old_logprobs is None else old_logprobs,
    )


@pytest.mark.parametrize("against", ["trainer", "engine"])
def test_loss_and_gradient_hand_computed(against):
    # The same numbers as the behaviour log-probs: the old ones (default) or the engine's (note 002's form); the
    # other field holds values 7 nats off, which would change every weight if it were read.
    ln2 = math.log(2.0)
    # Row 0: log W = (-1 - -1) + (-2 - (-2 - ln2)) = ln 2, W = 2, A = +1 -> phi = 4 e^-3 = 0.199148;
    #   loss_t = -phi * A * logp_t = [0.199148, 0.398297]; d loss / d logp_t = -phi A = -0.199148.
    # Row 1: one valid token, log W = -0.5 - (-0.5 + ln2) = -ln 2, W = 0.5, A = -1 -> phi = 0.125 e = 0.339785;
    #   loss = -0.339785 * -1 * -0.5 = -0.169893; gradient +0.339785; the padding column gets 0.
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    sample = torch.tensor([[-1.0, -2.0 - ln2], [-0.5 + ln2, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    batch = _rollout(logprobs, sample, adv, mask) if against == "engine" else \
        _rollout(logprobs, sample + 7.0, adv, mask, old_logprobs=sample)
    loss, stats = VESPO(weight_against=against)(logprobs, batch)
    assert_close(loss, torch.tensor([[0.199148, 0.398297], [-0.169893, 0.0]]), rtol=0, atol=1e-6)
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[-0.199148, -0.199148], [0.339785, 0.0]]), rtol=0, atol=1e-6)
    # mean phi = (0.199148 + 0.339785) / 2 = 0.269467
    assert_close(stats["policy/vespo_phi_mean"], torch.tensor(0.269467), rtol=0, atol=1e-6)
    # ESS of [0.199148, 0.339785] = 0.538933^2 / (2 (0.039660 + 0.115454)) = 0.290449 / 0.310228 = 0.936243
    assert_close(stats["policy/vespo_ess"], torch.tensor(0.936243), rtol=0, atol=1e-5)


def test_engine_form_reads_the_sampling_logprobs_not_the_old_ones():
    logprobs = torch.tensor([[-1.0, -2.0]])
    mask = torch.tensor([[1, 1]])
    adv = torch.tensor([[1.0, 1.0]])
    engine = VESPO(weight_against="engine")
    base = _rollout(logprobs, torch.tensor([[-1.0, -2.5]]), adv, mask)
    loss, _ = engine(logprobs, base)
    base.old_logprobs = torch.zeros_like(logprobs)
    assert torch.equal(engine(logprobs, base)[0], loss)
    base.sample_logprobs = torch.tensor([[-1.0, -2.0]])
    assert not torch.equal(engine(logprobs, base)[0], loss)


def test_default_weight_is_against_the_old_logprobs_not_the_engines():
    # The policy unmoved (live == old) and an engine 0.5 nats off on each token: log W = 0 and phi = 1 exactly
    # for every response, so the loss is -A logp; against the engine log W would be 2 x 0.5 = 1 (row 0).
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    batch = _rollout(logprobs, logprobs - 0.5, adv, mask, old_logprobs=logprobs.clone())
    assert VESPO().weight_against == "trainer"
    loss, stats = VESPO()(logprobs, batch)
    assert torch.equal(loss, -adv * logprobs)
    assert stats["policy/vespo_log_weight_absmax"] == 0 and stats["policy/vespo_phi_mean"] == 1
    assert stats["policy/vespo_ess"] == 1
    _, engine = VESPO(weight_against="engine")(logprobs, batch)
    assert engine["policy/vespo_log_weight_absmax"] == pytest.approx(1.0)  # row 0: 0.5 + 0.5


def test_truncated_is_corrects_the_engine_mismatch_outside_the_kernel():
    # TruncatedIS around VESPO: VESPO's per-token loss (W against the old log-probs: here unmoved, phi = 1, loss
    # -A logp = [-1, -2] for A = -1) times min(exp(old - sample), 2) per token: exp(0.5) = 1.648721 on token 0,
    # exp(1) = 2.718282 capped at 2 on token 1 -> [-1.648721, -4.0].
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logprobs.detach().clone()
    batch = _rollout(logprobs, old - torch.tensor([[0.5, 1.0]]), torch.tensor([[-1.0, -1.0]]),
                     torch.tensor([[1, 1]]), old_logprobs=old)
    loss, stats = TruncatedIS(VESPO(), cap=2.0)(logprobs, batch)
    assert_close(loss, torch.tensor([[-1.648721, -4.0]]), rtol=0, atol=1e-6)
    assert stats["policy/vespo_phi_mean"] == 1 and stats["policy/tis_capped_frac"] == 0.5


@pytest.mark.parametrize("against", ["trainer", "engine"])
def test_stale_sequence_stays_finite(against):
    # A response 500 nats more likely under the trainer than under the behaviour log-probs: phi = 0, the loss is
    # 0, finite.
    logprobs = torch.tensor([[-0.1] * 5], requires_grad=True)
    behaviour = torch.full((1, 5), -100.1)
    rollout = _rollout(logprobs, behaviour, torch.ones(1, 5), torch.ones(1, 5, dtype=torch.long),
                       old_logprobs=behaviour)
    loss, stats = VESPO(weight_against=against)(logprobs, rollout)
    assert torch.isfinite(loss).all() and all(torch.isfinite(v) for v in stats.values())
    assert stats["policy/vespo_log_weight_absmax"] == pytest.approx(500.0)


@pytest.mark.parametrize("field, value, message", [
    ("c2_pos", -1.0, "VESPO.c2_pos must be a number > 0, got -1.0"),
    ("c2_neg", 0.0, "VESPO.c2_neg must be a number > 0, got 0.0"),
    ("c1_pos", -1.0, "VESPO.c1_pos must be a number >= 0, got -1.0"),
    ("weight_against", "sampler", "model.policy_loss.weight_against must be one of trainer, engine, got 'sampler'"),
])
def test_bad_parameter_is_a_one_line_error_naming_it(field, value, message):
    with pytest.raises(RecipeError) as err:
        VESPO(**{field: value})
    assert str(err.value) == message


def test_recipe_sets_staleness_eight():
    cli = build(os.path.join(RECIPES, "vespo.yaml"))
    m = cli.model
    responses = cli.datamodule.batch_size * m.sampler.group_size
    assert m.batching.ppo_epochs * responses // m.batching.minibatch_size == 8
    assert (m.policy_loss.c1_pos, m.policy_loss.c2_pos, m.policy_loss.c1_neg, m.policy_loss.c2_neg) == (2, 3, 3, 2)


def test_vespo_recipe_trains_two_steps_and_changes_every_parameter(tmp_path, tiny_model_dir):
    # 2 prompts x 8 samples = 16 responses, minibatch 8: two sequential updates on one rollout.
    cli = build(os.path.join(RECIPES, "vespo.yaml"), tiny_overrides(tmp_path, tiny_model_dir))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []
    logged = cli.trainer.logged_metrics
    assert 0 < logged["train/policy/vespo_phi_mean"] and 0 < logged["train/policy/vespo_ess"] <= 1


class _Recorded(PolicyLoss):
    """The recipe's loss, recording for every micro-batch the update it belongs to (0, 1, ... in the run) and
    its log W against the old log-probs, W's statistics and, for a check, the old and sampling log-probs."""

    def __init__(self, loss):
        self.loss, self.update, self.calls = loss, -1, []

    def begin_update(self, minibatch, aggregation, global_sum):
        self.update += 1
        self.loss.begin_update(minibatch, aggregation, global_sum)

    def __call__(self, logprobs, batch):
        per_token, stats = self.loss(logprobs, batch)
        mask = batch.response_mask.bool()
        self.calls.append({
            "update": self.update, **{k: float(v) for k, v in stats.items()},
            "engine_log_w": torch.where(mask, batch.old_logprobs - batch.sample_logprobs, 0.0).sum(-1),
        })
        return per_token, stats


@pytest.mark.parametrize("engine, precision", [("hf", "32-true"), ("scripted", "32-true"), ("hf", "bf16-mixed")])
@pytest.mark.parametrize("against", ["trainer", "engine"])
def test_weight_is_one_on_the_first_minibatch_against_the_old_logprobs(tmp_path, tiny_model_dir, engine, precision,
                                                                       against):
    # recipes/vespo.yaml on the tiny model: a rollout of 2 x 8 responses, 2 sequential updates (N = 2) of 8 rows in
    # 3 micro-batches each; the old log-probs are scored before the updates. "scripted": responses and uniform
    # sampling log-probs from user_strategies.ScriptedEngine, far from the trainer's; "hf": the policy samples
    # itself (its log-probs equal the trainer's up to rounding in float32, bfloat16's rounding under bf16-mixed).
    rollout = {"hf": {"class_path": "rllight.rollout.HFEngine", "init_args": {"max_new_tokens": 6}},
               "scripted": {"class_path": "user_strategies.ScriptedEngine", "init_args": {"max_new_tokens": 6}}}
    overlay = tiny_overrides(tmp_path, tiny_model_dir, rollout=rollout[engine], batching={"micro_batch_size": 3})
    cli = build(os.path.join(RECIPES, "vespo.yaml"), overlay, f"--model.policy_loss.init_args.weight_against={against}",
                "--trainer.precision", precision)
    recorded = cli.model.policy_loss = _Recorded(cli.model.policy_loss)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2 and {c["update"] for c in recorded.calls} == {0, 1}
    first = [c for c in recorded.calls if c["update"] == 0]  # the first minibatch: the policy has not moved
    assert len(first) == 3
    if against == "trainer":
        # log W = 0 and phi = 1 for every response, exactly, whatever the engine's log-probs
        assert all(c["policy/vespo_log_weight_absmax"] == 0.0 and c["policy/vespo_phi_mean"] == 1.0 for c in first)
        assert all(c["policy/vespo_ess"] == 1.0 for c in first)
        # the second minibatch's W measures the first update's step (the test sees a moved policy)
        assert max(c["policy/vespo_log_weight_absmax"] for c in recorded.calls if c["update"] == 1) > 1e-4
    else:  # note 002's form: log W = sum_t (old - sample), the engine/trainer mismatch (old == live here)
        for c in first:
            assert c["policy/vespo_log_weight_absmax"] == pytest.approx(float(c["engine_log_w"].abs().max()),
                                                                         rel=1e-5, abs=1e-6)
        if engine == "scripted":
            assert all(c["policy/vespo_log_weight_absmax"] > 1e-2 for c in first)


def test_staleness_tool_runs_and_reports(tiny_model_dir):
    staleness = load_tool("staleness")
    result = staleness.run(tiny_model_dir, "vespo", n=4, steps=2, lr=1e-3, seed=0)
    assert result["finite"] and result["skipped_steps"] == 0
    assert len(result["rewards"]) == 2 and all(0 <= r <= 1 for r in result["rewards"])
    assert "train/policy/vespo_phi_mean" in result["last"]
