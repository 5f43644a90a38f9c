"""DAPO (arXiv:2503.14476): the formulas against hand-computed numbers (arithmetic in the comments), dynamic
sampling and the overlong callbacks on hand-built rollouts with fakes, token-mean under gradient
accumulation and a two-step run of recipes/dapo.yaml on a tiny in-process model."""

import json
import logging
import os

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from rllight.algorithms import group_retention_probability, mixed_groups, soft_overlong_punishment
from rllight.callbacks import OverlongFilter, RolloutContext, SoftOverlongPunishment
from rllight.callbacks.base import in_rollout_order
from rllight.distributed import Ranks
from rllight.errors import RecipeError
from rllight.strategies import DynamicSampling, SeqMeanTokenMean, TokenMean
from rllight.types import MEAN_EXTRAS, Rollout

from conftest import RECIPES
from helpers import build, tiny_overrides, unchanged_parameters

ABLATIONS = os.path.join(RECIPES, "ablations")


def make_rollout(rewards, lengths, group_ids=None, truncated=None, correct=None, prompt_lengths=None, width=None,
                 answers=None):
    """A scored rollout built by hand: prompt i has ``prompt_lengths[i]`` tokens (left-padded with 0),
    response i has ``lengths[i]`` tokens (right-padded with 0); token ids are distinct per row."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    b = len(rewards)
    lengths = torch.as_tensor(lengths)
    width = width or max(int(lengths.max()), 1)
    prompt_lengths = prompt_lengths or [2] * b
    p = max(prompt_lengths)
    prompt_ids = torch.zeros(b, p, dtype=torch.long)
    prompt_mask = torch.zeros(b, p, dtype=torch.long)
    response_ids = torch.zeros(b, width, dtype=torch.long)
    response_mask = torch.zeros(b, width, dtype=torch.long)
    for i in range(b):
        n = prompt_lengths[i]
        prompt_ids[i, p - n:] = torch.arange(n) + 100 * (i + 1)
        prompt_mask[i, p - n:] = 1
        response_ids[i, : lengths[i]] = torch.arange(int(lengths[i])) + 100 * (i + 1) + 50
        response_mask[i, : lengths[i]] = 1
    return Rollout(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        sample_logprobs=torch.zeros(b, width),
        truncated=torch.zeros(b, dtype=torch.bool) if truncated is None else torch.as_tensor(truncated),
        group_ids=torch.arange(b) if group_ids is None else torch.as_tensor(group_ids),
        answers=answers or [str(i) for i in range(b)], texts=[f"text {i}" for i in range(b)], rewards=rewards,
        correct=(rewards > 0).float() if correct is None else torch.as_tensor(correct, dtype=torch.float32),
        extras={"time/rollout": 0.5, "time/reward": 0.25, "reward/failures": 0.0},
    )


# --------------------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------------------


def test_group_retention_probability_hand_computed():
    # a_G(p) = 1 - (1-p)^G - p^G. G = 16, p = 0.01: 0.99^16 = 0.8514577711, 0.01^16 = 1e-32
    #   -> a = 1 - 0.8514577711 = 0.1485422289 (the note's 0.14854), 1 / a = 6.7321 groups drawn per kept.
    a = group_retention_probability(0.01, 16)
    assert a == pytest.approx(0.1485422289)
    assert round(a, 5) == 0.14854
    assert 1 / a == pytest.approx(6.7321, abs=5e-5)
    # p = 0.5: 1 - 2 * 0.5^16 = 1 - 2/65536 = 0.999969482421875 (almost every group is kept).
    assert group_retention_probability(0.5, 16) == pytest.approx(0.999969482421875)
    # p = 0 or 1: every group is all wrong or all right; G = 1: a single response is never mixed.
    p = torch.tensor([0.0, 0.01, 0.99, 1.0], dtype=torch.float64)
    assert_close(group_retention_probability(p, 16),
                 torch.tensor([0.0, 0.1485422289, 0.1485422289, 0.0], dtype=torch.float64))
    assert group_retention_probability(0.3, 1) == pytest.approx(0.0)


def test_soft_overlong_punishment_at_the_buffer_edges():
    # L_max = 20480, L_cache = 4096 -> expected length E = 16384.
    #   L <= 16384: 0;  16385: -(1)/4096 = -0.000244140625;  18432: -(2048)/4096 = -0.5;
    #   20479: -(4095)/4096 = -0.999755859375;  20480: -(4096)/4096 = -1;  beyond 20480: -1.
    lengths = torch.tensor([0, 100, 16384, 16385, 18432, 20479, 20480, 20481, 30000])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.000244140625, -0.5, -0.999755859375, -1.0, -1.0, -1.0])
    assert_close(soft_overlong_punishment(lengths, max_len=20480, cache_len=4096), expected)
    with pytest.raises(ValueError, match="cache_len"):
        soft_overlong_punishment(lengths, max_len=10, cache_len=11)


def test_mixed_groups_marks_rows_of_groups_with_unequal_rewards():
    # Groups (any labels): 7 -> {1, 1, 0} mixed; 3 -> {2, 2} equal; 9 -> {5} a single response: not mixed.
    rewards = torch.tensor([1.0, 2.0, 1.0, 0.0, 2.0, 5.0])
    groups = torch.tensor([7, 3, 7, 7, 3, 9])
    assert mixed_groups(rewards, groups).tolist() == [True, False, True, True, False, False]
    assert mixed_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long)).tolist() == []


def test_token_mean_weighs_every_token_1_over_1100_also_across_micro_batches():
    # Note 003: responses of 100 and 1000 tokens. token-mean: every token weighs 1 / 1100;
    # seq-mean-token-mean: 1 / (2 * 100) = 1/200 and 1 / (2 * 1000) = 1/2000.
    mask = torch.zeros(2, 1000)
    mask[0, :100] = 1
    mask[1, :] = 1
    per_token = torch.ones(2, 1000, requires_grad=True)
    TokenMean()(per_token, mask).backward()
    assert_close(per_token.grad[0, :100], torch.full((100,), 1 / 1100))
    assert_close(per_token.grad[1], torch.full((1000,), 1 / 1100))
    assert per_token.grad[0, 100:].abs().sum() == 0  # padding gets no gradient

    # Gradient accumulation: one micro-batch per response, each normalised by the step's 1100 tokens.
    acc = torch.ones(2, 1000, requires_grad=True)
    for i in range(2):
        TokenMean()(acc[i : i + 1], mask[i : i + 1], num_tokens=torch.tensor(1100.0)).backward()
    assert_close(acc.grad, per_token.grad)
    # The bug class of ALGORITHMS.md: each micro-batch normalised by its own token count gives 1/100 and
    # 1/1000, which is seq-mean-token-mean's weighting times 2, not token-mean.
    local = torch.ones(2, 1000, requires_grad=True)
    for i in range(2):
        TokenMean()(local[i : i + 1], mask[i : i + 1]).backward()
    assert local.grad[0, 0] == pytest.approx(1 / 100) and local.grad[1, 0] == pytest.approx(1 / 1000)

    seq = torch.ones(2, 1000, requires_grad=True)
    SeqMeanTokenMean()(seq, mask).backward()
    assert seq.grad[0, 0] == pytest.approx(1 / 200) and seq.grad[1, 0] == pytest.approx(1 / 2000)


# --------------------------------------------------------------------------------------------------
# Dynamic sampling with a fake module
# --------------------------------------------------------------------------------------------------


class FakeSamplerModule:
    """What DynamicSampling uses of the rollout producer: ``sample``, ``more_prompts``, ``pad_id``, ``ranks`` (one
    process). Each call to ``sample`` takes the next rewards (and response lengths) of the script."""

    def __init__(self, rewards, lengths=None, correct=None):
        self.rewards = list(rewards)
        self.lengths = list(lengths) if lengths is not None else None
        self.correct = list(correct) if correct is not None else None
        self.pad_id = 0
        self.ranks = Ranks()
        self.generated_for: list[list[str]] = []
        self.drawn = 0

    def more_prompts(self, n):
        rows = [{"answer": f"extra{self.drawn + i}"} for i in range(n)]
        self.drawn += n
        return rows

    def sample(self, rows, n):
        rewards = self.rewards.pop(0)
        assert len(rewards) == len(rows) * n
        lengths = self.lengths.pop(0) if self.lengths else [1] * len(rewards)
        correct = self.correct.pop(0) if self.correct else None
        self.generated_for.append([r["answer"] for r in rows])
        return make_rollout(rewards, lengths, group_ids=torch.arange(len(rows)).repeat_interleave(n), correct=correct,
                            answers=[r["answer"] for r in rows for _ in range(n)])


def test_dynamic_sampling_resamples_until_the_target_of_mixed_groups():
    # Round 1: prompts p0, p1 (G = 2): rewards p0 {1, 0} mixed, p1 {1, 1} dropped -> 1 of 2 kept.
    # Round 2: two fresh prompts: extra0 {0, 0} dropped, extra1 {0, 1} mixed -> 2 kept, stop.
    module = FakeSamplerModule(rewards=[[1, 0, 1, 1], [0, 0, 0, 1]], lengths=[[1, 2, 3, 4], [2, 2, 2, 2]])
    rollout = DynamicSampling(group_size=2, max_rounds=5)(module, [{"answer": "p0"}, {"answer": "p1"}])
    assert module.generated_for == [["p0", "p1"], ["extra0", "extra1"]]
    assert rollout.answers == ["p0", "p0", "extra1", "extra1"]
    assert rollout.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    # Group ids stay distinct across rounds (round 2's ids are shifted by the 2 prompts of round 1).
    assert rollout.group_ids.tolist() == [0, 0, 3, 3]
    e = rollout.extras
    assert (e["sampling/groups_drawn"], e["sampling/groups_kept"], e["sampling/rounds"]) == (4.0, 2.0, 2.0)
    assert e["sampling/cap_hit"] == 0.0
    assert e["sampling/retention"] == pytest.approx(2 / 4)
    assert e["sampling/responses_drawn"] == 8.0
    # Every generated token counts, discarded groups included: (1+2+3+4) + (2+2+2+2) = 18.
    assert e["sampling/generated_tokens"] == 18.0
    assert rollout.response_lengths.sum() == 1 + 2 + 2 + 2  # kept: p0 (1, 2), extra1 (2, 2)
    assert e["time/rollout"] == pytest.approx(1.0)  # 0.5 per round, summed


def test_dynamic_sampling_weights_the_rounds_means_by_responses_and_adds_their_counts():
    # Round 1: 2 prompts x 2 responses (4), round 2: 1 prompt x 2 (2). A component's mean reward and an agreement's
    # mean (named in MEAN_EXTRAS) are the rounds' means weighted by responses: judge (0.9 * 4 + 0.3 * 2) / 6 = 0.7;
    # the count of failures and the times add up; a maximum is the largest.
    module = FakeSamplerModule(rewards=[[1, 0, 0, 0], [0, 1]])
    scripted = iter([{"reward/judge": 0.9, "reward/agreement/judge_vs_exact/rank_corr": 0.5, "reward/failures": 1.0,
                      "response/turns_max": 3.0},
                     {"reward/judge": 0.3, "reward/agreement/judge_vs_exact/rank_corr": -0.1, "reward/failures": 2.0,
                      "response/turns_max": 2.0}])
    sample = module.sample

    def with_metrics(rows, n):
        rollout = sample(rows, n)
        metrics = next(scripted)
        rollout.extras.update(metrics)
        rollout.extras[MEAN_EXTRAS] = ("reward/agreement/judge_vs_exact/rank_corr", "reward/judge")
        return rollout

    module.sample = with_metrics
    rollout = DynamicSampling(group_size=2, max_rounds=5, prompts_per_round=1)(module, [{"answer": "a"},
                                                                                        {"answer": "b"}])
    e = rollout.extras
    assert e["sampling/rounds"] == 2.0
    assert e["reward/judge"] == pytest.approx(0.7)
    assert e["reward/agreement/judge_vs_exact/rank_corr"] == pytest.approx((0.5 * 4 - 0.1 * 2) / 6)
    assert e["reward/failures"] == 3.0 and e["response/turns_max"] == 3.0
    assert e["time/rollout"] == pytest.approx(1.0)


def test_the_producer_names_its_means_for_a_sampler_that_joins_rounds():
    from rllight.rewards import Scores
    from rllight.rollout.scoring import mean_metric_keys, reward_metrics
    from rllight.rollout.source_metrics import source_metrics

    scores = Scores([1.0, 0.0], metrics={"judge/mass_sum": 1.5, "agreement/judge_vs_exact/verifier_at_top": 1.0},
                    components={"judge": [1.0, 0.0], "exact": [1.0, 1.0]})
    metrics = {**reward_metrics(scores), **source_metrics(["gsm8k", "math"], [1.0, 0.0], [True, False])}
    assert mean_metric_keys(metrics, scores) == (
        "data/gsm8k/share", "data/math/share", "reward/agreement/judge_vs_exact/verifier_at_top",
        "reward/exact", "reward/gsm8k/accuracy", "reward/gsm8k/mean", "reward/judge", "reward/math/accuracy",
        "reward/math/mean")  # not reward/failures, nor reward/judge/mass_sum: counts


def test_dynamic_sampling_keeps_exactly_the_target_and_stops_after_one_round():
    # Three mixed groups, target 2: the first two are kept, no extra prompt is drawn.
    module = FakeSamplerModule(rewards=[[1, 0, 0, 1, 1, 0]])
    rollout = DynamicSampling(group_size=2, target_groups=2)(module, [{"answer": a} for a in ("a", "b", "c")])
    assert rollout.answers == ["a", "a", "b", "b"]
    assert module.drawn == 0
    assert rollout.extras["sampling/groups_kept"] == 2.0
    assert rollout.extras["sampling/retention"] == pytest.approx(3 / 3)


def test_dynamic_sampling_cap_is_logged_and_trains_on_what_it_has(caplog):
    # Round 1: one mixed of two; rounds 2 and 3: nothing mixed; max_rounds = 3 -> cap hit with 1 of 2.
    module = FakeSamplerModule(rewards=[[1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]])
    with caplog.at_level(logging.WARNING, logger="rllight.strategies.samplers"):
        rollout = DynamicSampling(group_size=2, max_rounds=3)(module, [{"answer": "p0"}, {"answer": "p1"}])
    assert "cap hit" in caplog.text and "max_rounds=3" in caplog.text
    assert rollout.answers == ["p0", "p0"]
    assert rollout.extras["sampling/cap_hit"] == 1.0
    assert rollout.extras["sampling/groups_short"] == 1.0  # 1 of the 2 wanted
    assert rollout.extras["sampling/rounds"] == 3.0
    assert rollout.extras["sampling/groups_drawn"] == 6.0


def test_dynamic_sampling_stops_when_no_prompt_is_left_to_draw(caplog):
    # Round 1: one mixed of two; then the prompts' source (a curriculum at its max_draws) gives none: no empty rounds.
    module = FakeSamplerModule(rewards=[[1, 0, 1, 1]])
    module.more_prompts = lambda n: []
    with caplog.at_level(logging.WARNING, logger="rllight.strategies.samplers"):
        rollout = DynamicSampling(group_size=2, max_rounds=5)(module, [{"answer": "p0"}, {"answer": "p1"}])
    assert "no more prompts to draw" in caplog.text and "max_rounds" not in caplog.text
    assert rollout.answers == ["p0", "p0"] and module.generated_for == [["p0", "p1"]]
    e = rollout.extras
    assert (e["sampling/rounds"], e["sampling/cap_hit"], e["sampling/out_of_prompts"]) == (1.0, 1.0, 1.0)
    assert e["sampling/groups_short"] == 1.0


def test_dynamic_sampling_with_no_mixed_group_returns_an_empty_rollout():
    module = FakeSamplerModule(rewards=[[1, 1, 0, 0], [1, 1, 1, 1]])
    rollout = DynamicSampling(group_size=2, max_rounds=2)(module, [{"answer": "p0"}, {"answer": "p1"}])
    assert len(rollout) == 0
    assert rollout.extras["sampling/cap_hit"] == 1.0
    assert rollout.extras["sampling/generated_tokens"] == 8.0


def test_dynamic_sampling_on_correctness_ignores_reward_differences():
    # Rewards differ inside both groups, but correctness only in the second one.
    module = FakeSamplerModule(rewards=[[0.2, 0.7, 0.1, 0.9]], correct=[[0, 0, 0, 1]])
    rollout = DynamicSampling(group_size=2, target_groups=2, max_rounds=1, metric="correct")(
        module, [{"answer": "p0"}, {"answer": "p1"}])
    assert rollout.answers == ["p1", "p1"]


def test_dynamic_sampling_retention_matches_a_G_of_p():
    # 400 groups of G = 4 with success rate 0.3: a_4(0.3) = 1 - 0.7^4 - 0.3^4 = 1 - 0.2401 - 0.0081 = 0.7518.
    # The binomial standard error of the observed share is sqrt(0.75 * 0.25 / 400) = 0.022.
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(400 * 4, generator=g) < 0.3).float().tolist()
    module = FakeSamplerModule(rewards=[rewards])
    rollout = DynamicSampling(group_size=4, target_groups=400, max_rounds=1)(
        module, [{"answer": str(i)} for i in range(400)])
    assert rollout.extras["sampling/retention"] == pytest.approx(group_retention_probability(0.3, 4), abs=0.066)


@pytest.mark.parametrize("kwargs,message", [  # a call from Python names Class.parameter (a recipe: its key)
    ({"group_size": 1}, "DynamicSampling.group_size must be an integer >= 2, got 1"),
    ({"max_rounds": 0}, "DynamicSampling.max_rounds must be an integer >= 1, got 0"),
    ({"target_groups": 0}, "DynamicSampling.target_groups must be an integer >= 1 or null, got 0"),
    ({"prompts_per_round": 0}, "DynamicSampling.prompts_per_round must be an integer >= 1 or null, got 0"),
    ({"metric": "acc"}, "model.sampler.init_args.metric must be one of reward, correct, got 'acc'"),
])
def test_dynamic_sampling_bad_values_name_the_field(kwargs, message):
    with pytest.raises(RecipeError) as err:
        DynamicSampling(**kwargs)
    assert str(err.value) == message


# --------------------------------------------------------------------------------------------------
# Overlong callbacks
# --------------------------------------------------------------------------------------------------


def test_overlong_filter_masks_truncated_responses_and_keeps_their_reward():
    rollout = make_rollout([1.0, -1.0, 1.0], lengths=[2, 4, 3], truncated=[False, True, False])
    out = OverlongFilter().on_rollout(None, None, rollout)
    assert out.response_mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert out.rewards.tolist() == [1.0, -1.0, 1.0]  # the group baseline still counts it
    assert out.extras["overlong/masked_ratio"] == pytest.approx(1 / 3)
    assert out.extras["overlong/masked_tokens"] == 4.0


def test_soft_overlong_punishment_adds_R_len_to_the_reward():
    # max_len = max_new_tokens = 10, cache_len = 4 -> E = 6. Lengths 5, 6, 7, 9, 10:
    #   R_len = 0, 0, -(7-6)/4 = -0.25, -(9-6)/4 = -0.75, -(10-6)/4 = -1.
    context = RolloutContext(max_new_tokens=10)
    rollout = make_rollout([1.0, 1.0, -1.0, 1.0, -1.0], lengths=[5, 6, 7, 9, 10])
    out = SoftOverlongPunishment(cache_len=4).on_rollout(None, context, rollout)
    assert_close(out.rewards, torch.tensor([1.0, 1.0, -1.25, 0.25, -2.0]))
    assert out.correct.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]  # accuracy is about the task, not the length
    assert out.extras["overlong/penalized_ratio"] == pytest.approx(3 / 5)
    assert out.extras["overlong/penalty_mean"] == pytest.approx(-2.0 / 5)
    # An explicit max_len wins over max_new_tokens; coef scales: 0.5 * -(7 - 5)/3 at L = 7 with E = 5.
    out = SoftOverlongPunishment(cache_len=3, max_len=8, coef=0.5).on_rollout(None, context, make_rollout([0.0], [7]))
    assert_close(out.rewards, torch.tensor([-1.0 / 3]))


@pytest.mark.parametrize("kwargs,field", [({"cache_len": 0}, "cache_len"), ({"cache_len": 8, "max_len": 4}, "max_len"),
                                          ({"coef": -1.0}, "coef")])
def test_soft_overlong_punishment_bad_values_name_the_field(kwargs, field):
    with pytest.raises(RecipeError, match=f"SoftOverlongPunishment.{field}"):
        SoftOverlongPunishment(**kwargs)


def test_soft_overlong_punishment_buffer_longer_than_the_generation_limit_is_a_recipe_error():
    with pytest.raises(RecipeError, match="cache_len"):
        SoftOverlongPunishment(cache_len=7).on_rollout(None, RolloutContext(max_new_tokens=6), make_rollout([0.0], [3]))
    with pytest.raises(RecipeError, match="max_len is needed"):  # an engine without a limit: max_len must be set
        SoftOverlongPunishment(cache_len=7).on_rollout(None, RolloutContext(), make_rollout([0.0], [3]))


# --------------------------------------------------------------------------------------------------
# Tiny-model runs of recipes/dapo.yaml
# --------------------------------------------------------------------------------------------------

# The random tiny model almost never ends a response within the 6 tokens of the test budget, so the overlong
# filter would mask every token and no update would happen: the runs below drop the filter (the soft
# punishment stays). The filter itself is tested on hand-built rollouts above.
NO_FILTER = os.path.join(ABLATIONS, "dapo-no-overlong-filter.yaml")


def _fit(tmp_path, model_dir, *extra, **overrides):
    cli = build(os.path.join(RECIPES, "dapo.yaml"), tiny_overrides(tmp_path, model_dir, **overrides), NO_FILTER, *extra)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli


def test_dapo_two_steps_change_every_trainable_parameter(tmp_path, tiny_model_dir):
    cli = _fit(tmp_path, tiny_model_dir)
    assert cli.trainer.global_step == 2
    assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []
    assert isinstance(cli.model.sampler, DynamicSampling)
    logged = cli.trainer.callback_metrics
    for key in ("groups_drawn", "groups_kept", "generated_tokens", "cap_hit"):
        assert f"train/sampling/{key}" in logged, key
    assert "train/overlong/penalty_mean" in logged
    assert logged["train/sampling/generated_tokens"] >= logged["train/response/tokens"]


def test_token_mean_update_is_the_same_with_and_without_gradient_accumulation(tmp_path, tiny_model_dir):
    # One DAPO step with plain SGD (the update is -lr * gradient, so a wrong loss normalisation shows up; Adam's
    # first step would hide it) and no gradient clipping: 16 responses in one micro-batch, then 16
    # micro-batches of one response. Same seed, same samples; the updates must agree.
    sgd = {"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0}}
    deltas = []
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for micro in (16, 1):
        run_dir = tmp_path / f"micro{micro}"
        run_dir.mkdir()
        cli = _fit(run_dir, tiny_model_dir, "--trainer.max_steps", "1", optimizer=sgd, grad_clip={"policy": None},
                   batching={"micro_batch_size": micro})
        assert cli.trainer.global_step == 1
        deltas.append({n: p.detach() - before[n] for n, p in cli.model.policy.named_parameters()})
    assert any(d.abs().max() > 1e-4 for d in deltas[0].values())  # the step did move the weights
    for name in deltas[0]:
        assert_close(deltas[1][name], deltas[0][name], msg=name)


def test_dynamic_sampling_draws_extra_prompts_from_the_module_and_skips_a_step_with_no_mixed_group(
        tmp_path, tiny_model_dir):
    # Filter on correctness: the test reward never reaches 1.0, so no group is ever mixed. One training batch:
    # the sampler runs all 3 rounds, drawing 2 extra prompts (the batch size) per extra round from the
    # module's own prompt stream, then hits the cap; the empty rollout makes no update.
    cli = build(os.path.join(RECIPES, "dapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), NO_FILTER,
                "--model.sampler.init_args.metric", "correct", "--model.sampler.init_args.max_rounds", "3",
                "--trainer.max_steps", "-1", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1")
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    except RecipeError as err:  # the module may stop a run whose whole epoch made no update
        assert "no update" in str(err)
    logged = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 0
    assert logged["train/sampling/rounds"] == 3 and logged["train/sampling/cap_hit"] == 1
    assert logged["train/sampling/groups_drawn"] == 6 and logged["train/sampling/groups_kept"] == 0
    assert logged["train/sampling/responses_drawn"] == 6 * 8
    assert logged["train/guard/empty_rollouts"] == 1
    assert cli.model.prompt_stream.cursor == 2 * 2  # two extra rounds of 2 prompts
    assert _unchanged_policy_count(cli.model, tiny_model_dir) == len(list(cli.model.policy.parameters()))


def _unchanged_policy_count(module, model_dir):
    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    return sum(torch.equal(p.detach(), before[n]) for n, p in module.policy.named_parameters())


def test_overlong_callbacks_listed_in_the_other_order_still_punish_then_filter():
    """Listing OverlongFilter before SoftOverlongPunishment in a recipe used to change DAPO silently (the
    filter zeroed the masks the punishment reads lengths from: truncated responses went unpunished). The
    module runs rollout callbacks in their rollout_order, so both listings give the same rollout."""
    from helpers import build
    from conftest import RECIPES

    reversed_cfg = "--trainer.callbacks=" + json.dumps([
        {"class_path": "rllight.callbacks.OverlongFilter"},
        {"class_path": "rllight.callbacks.SoftOverlongPunishment", "init_args": {"cache_len": 4}},
    ])
    outcomes = []
    for args in ((), (reversed_cfg,)):
        cli = build(f"{RECIPES}/dapo.yaml", *args, "--model.rollout.init_args.max_new_tokens", "10")
        module = cli.model
        # max_len 10, cache 4 (dapo.yaml's cache_len is 6: E = 4, so both truncated rows of length 10 get -1;
        # the reversed overlay's cache 4: E = 6, also -1 at length 10).
        rollout = make_rollout([1.0, -1.0, 1.0], lengths=[3, 10, 10], truncated=[False, True, True])
        for cb in in_rollout_order(cli.trainer.callbacks):
            rollout = cb.on_rollout(cli.trainer, module.rollout_context(), rollout)
        outcomes.append((rollout.rewards.tolist(), rollout.response_mask.sum(-1).tolist(),
                         rollout.extras["overlong/penalized_ratio"]))
    # Punished first (R_len = -1 at the cap), then masked: rewards 1, -2, 0; masks 3, 0, 0; 2 of 3 punished.
    assert outcomes[0] == outcomes[1] == ([1.0, -2.0, 0.0], [3, 0, 0], pytest.approx(2 / 3))
