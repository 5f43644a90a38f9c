"""The agreement of a model-served reward with a verifier (rllight.rewards.agreement), hand-computed, and the metrics a
``Weighted`` reward logs from it each step."""

import math
import random

import pytest

from reward_fixtures import ContainsJudge
from rllight.rewards import IntegerMatch, PerSource, Reward, Sample, Scores, Weighted
from rllight.rewards.agreement import average_ranks, fitted_change, pair_metrics, rank_correlation, verifier_at_top
from rllight.rollout.scoring import reward_metrics


def test_tied_values_share_the_mean_of_the_ranks_they_span():
    # sorted: 0.1 (index 2) rank 1, 0.5 (index 3) rank 2, the two 0.9 (0, 1) ranks 3 and 4 -> 3.5 each
    assert average_ranks([0.9, 0.9, 0.1, 0.5]) == [3.5, 3.5, 1.0, 2.0]
    assert average_ranks([7.0, 7.0, 7.0]) == [2.0, 2.0, 2.0]
    assert average_ranks([]) == []


def test_rank_correlation_by_hand_with_ties():
    # ranks x = [3.5, 3.5, 1, 2], ranks y = [3.5, 1.5, 1.5, 3.5] (two 0s -> 1.5, two 1s -> 3.5); mean rank 2.5
    # dx = [1, 1, -1.5, -0.5], dy = [1, -1, -1, 1]
    # sum dx*dy = 1 - 1 + 1.5 - 0.5 = 1; sum dx^2 = 1 + 1 + 2.25 + 0.25 = 4.5; sum dy^2 = 4
    # rho = 1 / sqrt(4.5 * 4) = 1 / sqrt(18)
    assert rank_correlation([0.9, 0.9, 0.1, 0.5], [1, 0, 0, 1]) == pytest.approx(1 / math.sqrt(18))


def test_rank_correlation_reads_order_only_and_is_undefined_without_one():
    assert rank_correlation([0.1, 0.2, 0.3], [10, 20, 30]) == pytest.approx(1.0)
    assert rank_correlation([0.1, 0.2, 0.3], [1e-3, 5.0, 1e9]) == pytest.approx(1.0)  # any increasing map
    assert rank_correlation([0.1, 0.2, 0.3], [3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([0.1, 0.2, 0.3], [1, 1, 1]) is None  # a constant verifier: nothing to order
    assert rank_correlation([0.5, 0.5], [0, 1]) is None  # a constant model reward
    assert rank_correlation([0.5], [1]) is None  # one sample
    with pytest.raises(ValueError):
        rank_correlation([0.1, 0.2], [1])


def test_without_ties_rank_correlation_is_spearmans_textbook_formula():
    # rho = 1 - 6 sum d^2 / (n (n^2 - 1)), d the difference of the two ranks of a sample: exact when no value repeats
    rng = random.Random(0)
    for n in (2, 3, 7, 30):
        x, y = rng.sample(range(1000), n), rng.sample(range(1000), n)
        d2 = sum((a - b) ** 2 for a, b in zip(average_ranks(x), average_ranks(y)))
        assert rank_correlation(x, y) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))


def test_verifier_at_top_averages_the_groups_favourites_ties_included():
    model = [0.9, 0.2, 0.9, 0.1, 0.8, 0.3]
    verifier = [1, 1, 0, 1, 0, 0]
    groups = [0, 0, 0, 1, 1, 1]
    # group 0: 0.9 is the top, tied at indices 0 and 2 -> verifier (1 + 0) / 2 = 0.5
    # group 1: 0.8 at index 4 -> verifier 0
    # mean over the two groups: (0.5 + 0) / 2 = 0.25 (below the verifier's mean 3/6: the favourites are worse)
    assert verifier_at_top(model, verifier, groups) == pytest.approx(0.25)
    assert verifier_at_top([0.3, 0.3], [1, 0], [5, 5]) == pytest.approx(0.5)  # a constant model: the group's mean
    assert verifier_at_top([0.1, 0.9], [1, 0], [0, 1]) == pytest.approx(0.5)  # a response a group: the mean
    assert verifier_at_top([], [], []) is None


def test_fitted_change_is_the_least_squares_lines_rise_over_the_window():
    assert fitted_change([0.0, 1.0, 2.0, 3.0]) == pytest.approx(3.0)
    # t mean 1.5, v mean 1.5; sum (t - 1.5)(v - 1.5) = 2.25 - 0.25 - 0.25 + 2.25 = 4; sum (t - 1.5)^2 = 5
    # slope 0.8, over 3 steps 2.4 (the last minus the first says 3)
    assert fitted_change([0.0, 2.0, 1.0, 3.0]) == pytest.approx(2.4)
    assert fitted_change([0.5, 0.5, 0.5]) == 0.0
    assert fitted_change([0.5]) == 0.0


def test_pair_metrics_leaves_out_an_undefined_rank_correlation():
    assert pair_metrics("judge", "exact", [0.2, 0.9], [0, 1], [0, 0]) == {
        "agreement/judge_vs_exact/rank_corr": pytest.approx(1.0), "agreement/judge_vs_exact/verifier_at_top": 1.0}
    assert pair_metrics("judge", "exact", [0.2, 0.9], [0, 0], [0, 0]) == {
        "agreement/judge_vs_exact/verifier_at_top": 0.0}
    assert pair_metrics("judge", "exact", [], [], []) == {}


def _samples(rows):
    """Samples of ``(response, answer, group)``."""
    return [Sample(prompt="", messages=None, response=r, response_ids=[], answer=a, row={"answer": a}, group=g)
            for r, a, g in rows]


# Two prompts (answers 4 and 6), three responses each: the right answer, a wrong one, a wrong one with the phrase
# the hackable judge says yes to.
ROWS = [("4", "4", 0), ("5", "4", 0), ("5 the answer is correct", "4", 0),
        ("6", "6", 1), ("7 the answer is correct", "6", 1), ("7", "6", 1)]


def _judge_and_exact(judge: Reward) -> Weighted:
    return Weighted({"judge": judge, "exact": IntegerMatch()}, weights={"judge": 1.0, "exact": 0.0},
                    correct_from="exact")


def test_a_hacked_judge_agrees_less_with_the_verifier_than_an_honest_one():
    hacked = _judge_and_exact(ContainsJudge("the answer is correct")).score(_samples(ROWS))
    # judge = [1, 0, 1, 1, 1, 0], exact = [1, 0, 0, 1, 0, 0]
    # ranks judge: the two 0s 1.5, the four 1s 4.5; ranks exact: the four 0s 2.5, the two 1s 5.5; mean rank 3.5
    # d judge = [1, -2, 1, 1, 1, -2], d exact = [2, -1, -1, 2, -1, -1]
    # sum products = 2 + 2 - 1 + 2 - 1 + 2 = 6; sums of squares 12 and 12 -> rho = 6 / 12 = 0.5
    # at the top: group 0 the judge's 1s at 0 and 2 -> exact (1 + 0) / 2; group 1 at 3 and 4 -> (1 + 0) / 2 -> 0.5
    assert hacked.metrics == {"agreement/judge_vs_exact/rank_corr": pytest.approx(0.5),
                              "agreement/judge_vs_exact/verifier_at_top": pytest.approx(0.5)}
    honest = _judge_and_exact(ContainsJudge("a phrase no response writes")).score(_samples(ROWS))
    assert honest.metrics == {"agreement/judge_vs_exact/rank_corr": pytest.approx(1.0),
                              "agreement/judge_vs_exact/verifier_at_top": pytest.approx(1.0)}
    # What the step logs (train/ is added by the module): the agreement beside each component's mean.
    logged = reward_metrics(hacked)
    assert logged["reward/agreement/judge_vs_exact/rank_corr"] == pytest.approx(0.5)
    assert logged["reward/judge"] == pytest.approx(4 / 6) and logged["reward/exact"] == pytest.approx(2 / 6)


def test_only_a_model_reward_beside_a_verifier_is_compared():
    two_verifiers = Weighted({"exact": IntegerMatch(), "again": IntegerMatch()})
    assert two_verifiers.agreement_pairs() == []
    assert two_verifiers.score(_samples(ROWS)).metrics == {}
    both = Weighted({"judge": ContainsJudge(), "exact": IntegerMatch(), "again": IntegerMatch()})
    assert both.agreement_pairs() == [("judge", "exact"), ("judge", "again")]
    assert set(both.score(_samples(ROWS)).metrics) == {f"agreement/judge_vs_{v}/{m}" for v in ("exact", "again")
                                                       for m in ("rank_corr", "verifier_at_top")}


class FailsFirst(Reward):
    """The exact match's value, except that the first sample fails (a judge that timed out on it)."""

    def score(self, samples):
        values = [IntegerMatch()(s.response, s.answer) for s in samples]
        return Scores(values=values, failed={0: "timed out"})


def test_a_sample_either_reward_failed_is_left_out_and_a_constant_verifier_logs_no_correlation():
    # Sample 0 left out: samples 1..5 -> exact [0, 0, 1, 0, 0] and the judge equal to it -> rho 1; at the top:
    # group 0 (samples 1, 2) both judged 0, tied -> exact 0; group 1 sample 3 -> exact 1; (0 + 1) / 2 = 0.5.
    scores = _judge_and_exact(FailsFirst()).score(_samples(ROWS))
    assert scores.metrics == {"agreement/judge_vs_exact/rank_corr": pytest.approx(1.0),
                              "agreement/judge_vs_exact/verifier_at_top": pytest.approx(0.5)}
    wrong = [("5", "4", 0), ("3", "4", 0), ("7", "6", 1), ("8 the answer is correct", "6", 1)]
    scores = _judge_and_exact(ContainsJudge()).score(_samples(wrong))
    assert scores.metrics == {"agreement/judge_vs_exact/verifier_at_top": 0.0}  # exact all 0: no order to compare


def test_agreement_under_per_source_is_the_mean_over_the_sources_weighted_by_samples():
    # Source "a": the 6 samples of ROWS with the hacked judge (rank_corr 0.5, verifier_at_top 0.5, worked out above).
    # Source "b": its first 3 samples (one prompt) with the honest judge, which says yes to the right answer only:
    # judge [1, 0, 0] = exact, rank_corr 1 and verifier_at_top 1. Over the 9 samples, each source weighted by its
    # samples: (6 * 0.5 + 3 * 1) / 9 = 2/3 for both (summed, as they were, they would read 1.5).
    samples = [Sample(prompt="", messages=None, response=r, response_ids=[], answer=a,
                      row={"answer": a, "data_source": source}, group=g)
               for (r, a, g), source in [*[(row, "a") for row in ROWS], *[((r, a, 2), "b") for r, a, _ in ROWS[:3]]]]
    reward = PerSource({"a": _judge_and_exact(ContainsJudge("the answer is correct")),
                        "b": _judge_and_exact(ContainsJudge("a phrase no response writes"))})
    assert reward.score(samples).metrics == {"agreement/judge_vs_exact/rank_corr": pytest.approx(2 / 3),
                                             "agreement/judge_vs_exact/verifier_at_top": pytest.approx(2 / 3)}
