"""Evaluation: pass@k, avg@k and maj@k against hand-computed values and brute force, the recipe's
evaluation settings, and the accumulator the validation loop feeds."""

import itertools
import json
import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from rllight.algorithms import (
    avg_at_k,
    bootstrap_interval,
    maj_at_k,
    majority_vote,
    mean_and_se,
    pass_at_k,
    pass_at_k_over_prompts,
)
from rllight.errors import RecipeError
from rllight.evaluation import EvalAccumulator, EvalSettings, Evaluator, extract_answer


# ------------------------------------------------------------------------------------------------ pass@k
@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 2, 0.7),       # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 1, 0.3),      # pass@1 = c/n
    (10, 1, 5, 0.5),      # 1 - C(9,5)/C(10,5) = 1 - 126/252
    (4, 3, 2, 1.0),       # n - c = 1 < k: every pair holds a correct sample
    (3, 0, 2, 0.0),       # nothing correct
    (6, 2, 3, 0.8),       # 1 - C(4,3)/C(6,3) = 1 - 4/20
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def _brute_force(n: int, c: int, k: int) -> Fraction:
    """The share of all k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_enumeration_of_all_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_brute_force(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_exact_without_overflow():
    # C(10000, 100) has 242 digits: as a float it overflows. Exact: 1 - C(9990, 100) / C(10000, 100) with
    # Python's integers and fractions; the product form must agree to float precision.
    exact = 1 - Fraction(math.comb(9990, 100), math.comb(10000, 100))
    assert pass_at_k(10000, 10, 100) == pytest.approx(float(exact), rel=1e-12)
    assert 0.09 < float(exact) < 0.1  # about 1 - (1 - 0.01)**10 = 0.0956


@pytest.mark.parametrize("n,c,k", [(3, 1, 4), (3, 4, 1), (3, 1, 0), (0, 0, 1)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# Three prompts, four samples each (1 = correct).
CORRECT = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)


def test_pass_at_k_over_prompts():
    # k = 2, n = 4; c = 3, 1, 4. Prompt 1: n - c = 1 < 2 -> 1. Prompt 2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5.
    # Prompt 3: 1. Mean 2.5 / 3. Per-prompt values [1, 0.5, 1]: deviations 1/6, -1/3, 1/6, sample variance
    # (1/36 + 4/36 + 1/36) / 2 = 1/12, se = sqrt(1/12) / sqrt(3) = 1/6.
    est = pass_at_k_over_prompts(CORRECT, 2)
    assert est.per_prompt.tolist() == [1.0, 0.5, 1.0]
    assert est.mean == pytest.approx(2.5 / 3)
    assert est.se == pytest.approx(1 / 6)
    # pass@1 is the mean correctness of all n samples: (3/4 + 1/4 + 1) / 3 = 2/3.
    assert pass_at_k_over_prompts(CORRECT, 1).mean == pytest.approx(2 / 3)


def test_avg_at_k_uses_the_first_k_samples():
    # k = 2: [1, 0] -> 0.5, [0, 0] -> 0, [1, 1] -> 1; mean 0.5. Deviations 0, -0.5, 0.5: sample variance
    # (0 + 0.25 + 0.25) / 2 = 0.25, se = 0.5 / sqrt(3).
    est = avg_at_k(CORRECT, 2)
    assert est.per_prompt.tolist() == [0.5, 0.0, 1.0]
    assert est.mean == pytest.approx(0.5)
    assert est.se == pytest.approx(0.5 / math.sqrt(3))
    # k = 4: 3/4, 1/4, 1 -> mean 2/3.
    assert avg_at_k(CORRECT, 4).mean == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        avg_at_k(CORRECT, 5)


@pytest.mark.parametrize("answers,expected", [
    (["7", "8", "8"], 1),          # "8" has two votes; its first sample is index 1
    (["7", "8", "8", "7"], 0),     # a tie: the answer seen first ("7") wins
    (["8", "7", "7", "8"], 0),     # the same tie the other way round: "8" wins
    ([None, "3", None], 1),        # no answer does not vote
    ([None, None, "4", "4"], 2),
    ([None, None], None),          # nothing to vote for
])
def test_majority_vote(answers, expected):
    assert majority_vote(answers) == expected


def test_maj_at_k():
    answers = [["7", "8", "8", "7"], ["5", "5", None, "6"], [None, None, None, None]]
    correct = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    # k = 4: prompt 1 ties 7/8 -> "7" (first), sample 0 wrong -> 0; prompt 2 "5" (2 votes), sample 0 right
    # -> 1; prompt 3 has no answer -> 0. Mean 1/3.
    assert maj_at_k(answers, correct, 4).per_prompt.tolist() == [0.0, 1.0, 0.0]
    # k = 3: prompt 1 ["7", "8", "8"] -> "8", sample 1 right -> 1; prompt 2 -> 1; prompt 3 -> 0. Mean 2/3.
    est = maj_at_k(answers, correct, 3)
    assert est.per_prompt.tolist() == [1.0, 1.0, 0.0]
    assert est.mean == pytest.approx(2 / 3)


def test_standard_error_and_bootstrap():
    # [0, 1, 1, 1]: mean 0.75, sample variance (0.5625 + 3 * 0.0625) / 3 = 0.25, se = 0.5 / 2 = 0.25.
    values = torch.tensor([0.0, 1.0, 1.0, 1.0])
    assert mean_and_se(values) == pytest.approx((0.75, 0.25))
    mean, se = mean_and_se(torch.tensor([1.0]))
    assert mean == 1.0 and math.isnan(se)  # one prompt: no spread to measure

    # 101 evenly spaced values in [0, 1]: the mean is 0.5 and the resampled means are close to normal, so
    # the 95 % percentile interval is about 0.5 -+ 1.96 se.
    values = torch.linspace(0, 1, 101)
    _, se = mean_and_se(values)
    state = torch.random.get_rng_state()
    low, high = bootstrap_interval(values, resamples=4000, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # a private generator
    assert (low, high) == bootstrap_interval(values, resamples=4000, seed=3)
    assert (low, high) != bootstrap_interval(values, resamples=4000, seed=4)
    assert low == pytest.approx(0.5 - 1.96 * se, abs=0.2 * se)
    assert high == pytest.approx(0.5 + 1.96 * se, abs=0.2 * se)
    assert bootstrap_interval(torch.full((5,), 0.4), resamples=100) == pytest.approx((0.4, 0.4))


# ------------------------------------------------------------------------------------------- settings
def test_eval_settings_defaults_are_greedy():
    s = EvalSettings()
    assert (s.n, s.temperature, s.ks, s.greedy) == (1, 0.0, [1], True)
    s = EvalSettings(n=8, temperature=0.6, top_p=0.95, ks=[8, 1, 4, 4])
    assert s.ks == [1, 4, 8] and not s.greedy
    assert EvalSettings(n=16, temperature=1.0).ks == [1, 16]


@pytest.mark.parametrize("kwargs,expected", [
    ({"n": 4}, "model.evaluation.n is 4 with temperature 0 (greedy)"),
    ({"n": 0}, "EvalSettings.n must be an integer >= 1, got 0"),  # a direct call names Class.parameter
    ({"temperature": -0.1}, "EvalSettings.temperature must be a number >= 0, got -0.1"),
    ({"temperature": float("nan")}, "EvalSettings.temperature must be a number >= 0, got nan"),
    ({"temperature": float("inf")}, "model.evaluation.temperature must be finite, got inf"),
    ({"top_p": 0.0}, "EvalSettings.top_p must be a number in (0, 1], got 0.0"),
    ({"max_new_tokens": 0}, "EvalSettings.max_new_tokens must be an integer >= 1 or null, got 0"),
    ({"n": 4, "temperature": 1.0, "ks": [1, 8]}, "model.evaluation.ks holds 8; each k must be an integer in 1..n = 1..4"),
    ({"n": 4, "temperature": 1.0, "ks": []}, "model.evaluation.ks is empty"),
    ({"bootstrap": -1}, "EvalSettings.bootstrap must be an integer >= 0, got -1"),
    ({"confidence": 1.0}, "EvalSettings.confidence must be a number in (0, 1), got 1.0"),
    ({"n": 1.5}, "EvalSettings.n must be an integer >= 1, got 1.5"),
    ({"sampling_seed": 1.5}, "model.evaluation.sampling_seed must be an integer or null"),
])
def test_eval_settings_errors_are_one_line(kwargs, expected):
    with pytest.raises(RecipeError) as exc:
        EvalSettings(**kwargs)
    assert "\n" not in str(exc.value) and str(exc.value).startswith(expected)


def test_eval_settings_give_their_own_sampling_and_leave_the_engines_alone():
    from rllight.rollout import HFEngine, Sampling

    engine = HFEngine(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20)
    settings = EvalSettings(n=4, temperature=1.0, top_p=0.95, max_new_tokens=128)
    assert settings.sampling(engine.sampling) == Sampling(max_new_tokens=128, temperature=1.0, top_p=0.95, top_k=0)
    greedy = EvalSettings().sampling(engine.sampling)  # greedy, the engine's max_new_tokens
    assert greedy.greedy and greedy.max_new_tokens == 64
    assert engine.sampling == Sampling(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20)  # unchanged


# ---------------------------------------------------------------------------------------- accumulator
@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{ 42 } and then 7", "42"),
    ("\\boxed{1,200.50}", "1200.5"),
    ("She has 1,200 apples", "1200"),
    ("It is 3.50 dollars", "3.5"),
    ("-0", "0"),
    ("no number here", None),
    ("\\boxed{12", "12"),  # an unfinished box: the last number
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


ROWS = [
    {"source": "t.jsonl row 1", "data_source": "a", "prompt": "p1", "answer": "1"},
    {"source": "t.jsonl row 2", "data_source": "a", "prompt": [{"role": "user", "content": "p2"}], "answer": "3"},
    {"source": "t.jsonl row 3", "data_source": "b", "prompt": "p3", "answer": "5"},
]
# n = 2 responses per prompt, prompt-major.
CORRECT2 = [1, 0, 0, 0, 1, 1]
TEXTS = ["1", "2", "3 no, 4", "\\boxed{4}", "5", "it is 5"]
LENGTHS = [3, 5, 2, 2, 4, 6]
TRUNCATED = [False, True, False, False, False, False]
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def _filled() -> EvalAccumulator:
    acc = EvalAccumulator()
    acc.update(ROWS[:2], 2, torch.tensor(CORRECT2[:4], dtype=torch.float32), rewards=REWARDS[:4],
               lengths=torch.tensor(LENGTHS[:4]), truncated=torch.tensor(TRUNCATED[:4]), texts=TEXTS[:4])
    acc.update(ROWS[2:], 2, CORRECT2[4:], rewards=REWARDS[4:], lengths=LENGTHS[4:], truncated=TRUNCATED[4:],
               texts=TEXTS[4:])
    return acc


def test_accumulator_metrics_overall_and_per_source():
    m = _filled().compute([1, 2])
    # avg@1: first samples [1, 0, 1] -> 2/3; deviations 1/3, -2/3, 1/3, sample variance (1/9 + 4/9 + 1/9) / 2
    # = 1/3, se = sqrt(1/3) / sqrt(3) = 1/3.
    assert m["val/avg@1"] == pytest.approx(2 / 3) and m["val/avg@1_se"] == pytest.approx(1 / 3)
    # pass@1 = c / n per prompt: [1/2, 0, 1] -> 0.5; pass@2: [1, 0, 1] -> 2/3; avg@2 = pass@1 = 0.5.
    assert m["val/pass@1"] == pytest.approx(0.5)
    assert m["val/pass@2"] == pytest.approx(2 / 3)
    assert m["val/avg@2"] == pytest.approx(0.5)
    # maj@2: prompt 1 votes "1" vs "2", a tie -> "1" (first), right; prompt 2 "4" twice ("3 no, 4" ends in 4)
    # -> sample 0, wrong; prompt 3 "5" twice -> right. [1, 0, 1] -> 2/3. maj@1 is avg@1.
    assert m["val/maj@2"] == pytest.approx(2 / 3)
    assert m["val/maj@1"] == pytest.approx(m["val/avg@1"])
    # Per source. a: avg@1 [1, 0] -> 0.5, se = sqrt(0.5) / sqrt(2) = 0.5; pass@2 [1, 0] -> 0.5.
    assert m["val/a/avg@1"] == pytest.approx(0.5) and m["val/a/avg@1_se"] == pytest.approx(0.5)
    assert m["val/a/pass@2"] == pytest.approx(0.5)
    # b: one prompt, both right: 1.0, and no standard error from one prompt.
    assert m["val/b/pass@2"] == 1.0 and math.isnan(m["val/b/pass@2_se"])
    assert (m["val/prompts"], m["val/a/prompts"], m["val/b/prompts"]) == (3.0, 2.0, 1.0)
    # Lengths (3 + 5 + 2 + 2 + 4 + 6) / 6 = 22/6; one of six truncated; rewards 3/6. a: 12/4 = 3, 1/4.
    assert m["val/response_length"] == pytest.approx(22 / 6)
    assert m["val/truncated_ratio"] == pytest.approx(1 / 6)
    assert m["val/reward_mean"] == pytest.approx(0.5)
    assert m["val/a/response_length"] == pytest.approx(3.0) and m["val/a/truncated_ratio"] == pytest.approx(0.25)
    assert m["val/dropped_prompts"] == 0.0


def test_accumulator_bootstrap_keys_and_k_above_n():
    acc = _filled()
    m = acc.compute([2], bootstrap=200, seed=1)
    assert m["val/pass@2_ci_low"] <= m["val/pass@2"] <= m["val/pass@2_ci_high"]
    assert "val/pass@1" not in m
    with pytest.raises(ValueError, match="k = 4 needs at least k responses per prompt"):
        acc.compute([4])
    with pytest.raises(ValueError, match="n changed"):
        acc.update(ROWS[:1], 3, [1, 1, 1])


def test_accumulator_without_texts_reports_no_maj():
    acc = EvalAccumulator(key="test")
    acc.update(ROWS[:1], 2, [True, False])
    m = acc.compute([1, 2])
    assert m["test/pass@2"] == 1.0 and "test/maj@1" not in m and "test/response_length" not in m


def test_accumulator_writes_every_number_and_every_response(tmp_path):
    acc = _filled()
    acc.drop([{"source": "t.jsonl row 4"}])
    json_path, rows_path = acc.write(str(tmp_path / "out"), [1, 2], name="step_10", extra={"ckpt": "last.ckpt"})
    with open(json_path) as f:
        summary = json.load(f)
    assert summary["metrics"] == pytest.approx({**acc.compute([1, 2]), "val/b/avg@1_se": None, "val/b/avg@2_se": None,
                                                "val/b/pass@1_se": None, "val/b/pass@2_se": None,
                                                "val/b/maj@1_se": None, "val/b/maj@2_se": None}, nan_ok=True)
    assert summary["metrics"]["val/dropped_prompts"] == 1.0 and summary["dropped"] == ["t.jsonl row 4"]
    assert (summary["n"], summary["ks"], summary["ckpt"]) == (2, [1, 2], "last.ckpt")
    with open(rows_path) as f:
        lines = [json.loads(line) for line in f]
    assert [r["source"] for r in lines] == ["t.jsonl row 1", "t.jsonl row 2", "t.jsonl row 3"]
    assert lines[1] == {"source": "t.jsonl row 2", "data_source": "a", "prompt": [{"role": "user", "content": "p2"}],
                        "answer": "3", "responses": ["3 no, 4", "\\boxed{4}"], "extracted": ["4", "4"],
                        "correct": [False, False], "rewards": [0.0, 0.0], "lengths": [2, 2],
                        "truncated": [False, False]}
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_merge_counts_a_prompt_repeated_across_ranks_once():
    # Rank 0 got rows 1-2; rank 1 got row 3 and, as a distributed sampler pads, row 1 again.
    rank0, rank1 = EvalAccumulator(), EvalAccumulator()
    rank0.update(ROWS[:2], 2, CORRECT2[:4], texts=TEXTS[:4])
    rank1.update([ROWS[2], ROWS[0]], 2, CORRECT2[4:] + CORRECT2[:2], texts=TEXTS[4:] + TEXTS[:2])
    rank0.merge([rank0.state(), rank1.state()])
    assert [r["source"] for r in rank0.records] == ["t.jsonl row 1", "t.jsonl row 2", "t.jsonl row 3"]
    assert rank0.compute([2])["val/pass@2"] == pytest.approx(2 / 3)  # as without the repeat


def test_update_rollout_reads_a_scored_rollout():
    rollout = SimpleNamespace(correct=torch.tensor([1.0, 0.0]), rewards=torch.tensor([1.0, -1.0]),
                              response_lengths=torch.tensor([4, 9]), truncated=torch.tensor([False, True]),
                              texts=["7", "8"])
    acc = EvalAccumulator()
    acc.update_rollout(ROWS[:1], 2, rollout)
    m = acc.compute([1, 2])
    # pass@1 = 1/2, pass@2 = 1; rewards (1 - 1) / 2 = 0; lengths 13/2; one of two truncated.
    assert (m["val/pass@1"], m["val/pass@2"], m["val/reward_mean"]) == (0.5, 1.0, 0.0)
    assert (m["val/response_length"], m["val/truncated_ratio"]) == (6.5, 0.5)
    acc.reset()
    assert acc.compute([1]) == {"val/dropped_prompts": 0.0, "val/prompts": 0.0}


def test_accumulator_reports_the_turns_of_multi_turn_episodes():
    rollout = SimpleNamespace(correct=torch.tensor([1.0, 0.0, 1.0, 1.0]), rewards=torch.tensor([1.0, 0.0, 0.8, 1.0]),
                              response_lengths=torch.tensor([4, 9, 5, 3]), truncated=torch.tensor([0, 1, 0, 0]).bool(),
                              texts=["7", "8", "9", "3"], extras={"episode/turns": torch.tensor([1.0, 3.0, 2.0, 1.0])})
    acc = EvalAccumulator()
    acc.update_rollout(ROWS[:2], 2, rollout)
    m = acc.compute([1])
    assert m["val/turns_mean"] == pytest.approx(7 / 4)
    # Solved at the first turn: episodes 1 and 4; episode 3 was solved after feedback, episode 2 never.
    assert m["val/first_turn_accuracy"] == 0.5
    assert acc.records[0]["turns"] == [1, 3] and acc.records[1]["turns"] == [2, 1]


def test_before_after_table_hand_computed():
    from rllight.evaluation import before_after

    before = {"val/accuracy": 0.25, "val/greedy/avg@1": 0.25, "val/greedy/avg@1_se": 0.03,
              "val/avg@1": 0.2, "val/avg@1_se": 0.02, "val/pass@1": 0.2, "val/pass@1_se": 0.02,
              "val/avg@4": 0.2, "val/avg@4_se": 0.02, "val/pass@4": 0.4, "val/pass@4_se": 0.04,
              "val/arithmetic/pass@4": 0.4, "val/response_length": 10.0}
    after = {k: v + 0.1 for k, v in before.items()}
    after["val/pass@4_se"] = 0.03
    summary, lines = before_after(before, after)
    # pass@1 equals avg@1 and is left out; per-source keys are left out; greedy first, then by k.
    assert list(summary) == ["greedy accuracy", "avg@1", "avg@4", "pass@4", "response_length"]
    assert summary["pass@4"]["difference"] == pytest.approx(0.1)
    assert summary["pass@4"]["difference_se"] == pytest.approx(0.05)  # sqrt(0.04^2 + 0.03^2)
    assert summary["response_length"] == {"before": 10.0, "after": 10.1, "difference": pytest.approx(0.1)}
    assert len(lines) == 6 and lines[4].split()[:2] == ["pass@4", "0.400"] and "+0.100 ± 0.050" in lines[4]


def test_before_after_difference_is_paired_over_the_same_prompts():
    """Two evaluations of the same four prompts: the difference's standard error is the standard error of the
    per-prompt differences (hand-computed), not sqrt(se_b^2 + se_a^2); per-prompt values from
    ``EvalAccumulator.per_prompt`` are keyed by source and agree with ``compute``'s means."""
    from rllight.evaluation import before_after

    rows = [{"source": f"t.jsonl row {i}", "prompt": f"p{i}", "answer": "1"} for i in range(4)]
    accs = []
    for correct in ([0, 1, 0, 1], [1, 1, 1, 0]):
        acc = EvalAccumulator("val/greedy")
        acc.update(rows, 1, correct, texts=["1" if c else "2" for c in correct])
        accs.append(acc)
    before_pp, after_pp = (acc.per_prompt([1]) for acc in accs)
    assert before_pp["val/greedy/avg@1"] == {"t.jsonl row 0": 0.0, "t.jsonl row 1": 1.0, "t.jsonl row 2": 0.0,
                                              "t.jsonl row 3": 1.0}
    before, after = (acc.compute([1]) for acc in accs)
    assert sum(after_pp["val/greedy/avg@1"].values()) / 4 == pytest.approx(after["val/greedy/avg@1"])
    summary, _ = before_after(before, after, before_pp, after_pp)
    row = summary["greedy accuracy"]
    # differences 1, 0, 1, -1: mean 0.25, sample variance 2.75 / 3, se = sqrt(2.75 / 3) / 2
    assert row["paired"] and row["difference"] == pytest.approx(0.25)
    assert row["difference_se"] == pytest.approx(math.sqrt(2.75 / 3) / 2)
    independent = math.sqrt(before["val/greedy/avg@1_se"] ** 2 + after["val/greedy/avg@1_se"] ** 2)
    assert abs(row["difference_se"] - independent) > 0.01
    # different prompts (or none known): the independent formula
    other = {"val/greedy/avg@1": {f"x{i}": 0.0 for i in range(4)}}
    for b_pp, a_pp in ((other, after_pp), (None, None)):
        row = before_after(before, after, b_pp, a_pp)[0]["greedy accuracy"]
        assert not row["paired"] and row["difference_se"] == pytest.approx(independent)
    # a record without a source cannot be paired
    acc = EvalAccumulator()
    acc.update([{"prompt": "p", "answer": "1"}] * 2, 1, [1, 0])
    assert acc.per_prompt([1]) == {}


def test_before_after_shows_each_data_source_with_its_own_paired_difference():
    """Two tasks of three prompts each, one greedy answer per prompt: the accuracy (avg@1) per task, before and after, with the standard error of
    that task's per-prompt differences (hand-computed); one task alone gets no per-task rows."""
    from rllight.evaluation import before_after

    rows = [{"source": f"row {i}", "prompt": f"p{i}", "answer": "1", "data_source": "sums" if i < 3 else "legs"}
            for i in range(6)]
    accs = []
    for correct in ([0, 0, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0]):
        acc = EvalAccumulator("val")
        acc.update(rows, 1, correct, texts=["1" if c else "2" for c in correct])
        accs.append(acc)
    (before, after), (before_pp, after_pp) = ([a.compute([1]) for a in accs], [a.per_prompt([1]) for a in accs])
    assert before_pp["val/sums/avg@1"] == {"row 0": 0.0, "row 1": 0.0, "row 2": 1.0}
    summary, lines = before_after(before, after, before_pp, after_pp)
    sums, legs = summary["avg@1 / sums"], summary["avg@1 / legs"]
    # sums: 1/3 -> 1, differences 1, 1, 0 (se sqrt(1/3) / sqrt(3) = 1/3); legs: 0 -> 1/3, differences 0, 1, 0 (1/3)
    assert sums["difference"] == pytest.approx(2 / 3) and sums["difference_se"] == pytest.approx(1 / 3)
    assert legs["difference"] == pytest.approx(1 / 3) and legs["difference_se"] == pytest.approx(1 / 3)
    assert sums["paired"] and legs["paired"]
    assert "avg@1, per data source:" in lines
    assert [line.split()[:3] for line in lines if line.startswith("  ")] == [["legs", "0.000", "±"],
                                                                               ["sums", "0.333", "±"]]
    one = {k: v for k, v in before.items() if "/legs/" not in k}
    assert not any(name.startswith("avg@1 /") for name in before_after(one, after)[0])


def test_also_greedy_needs_sampling():
    with pytest.raises(RecipeError, match="also_greedy"):
        EvalSettings(also_greedy=True)
    assert EvalSettings(n=2, temperature=1.0, also_greedy=True).also_greedy


def test_evaluation_table_has_a_column_per_data_source_and_says_what_each_row_is():
    from rllight.evaluation import column_notes, evaluation_table

    metrics = _filled().compute([1, 2])
    greedy = EvalAccumulator("val/greedy")
    greedy.update(ROWS, 1, [1, 1, 0])  # a: both right, b: wrong
    metrics.update(greedy.compute([1]))
    summary, lines = evaluation_table(metrics)
    assert list(summary) == ["all", "a", "b"]
    # pass@1 (= avg@2) and maj@1 are left out; the greedy accuracy first, then by k; plain values last.
    assert list(summary["all"]) == ["prompts", "greedy accuracy", "avg@1", "avg@2", "pass@2", "maj@2",
                                    "response_length", "truncated_ratio"]
    # The values of test_accumulator_metrics_overall_and_per_source; b has one prompt, so no standard error.
    assert summary["all"]["avg@1"] == {"value": pytest.approx(2 / 3), "se": pytest.approx(1 / 3)}
    assert summary["b"]["pass@2"] == {"value": 1.0, "se": None}
    assert summary["a"]["greedy accuracy"] == {"value": 1.0, "se": 0.0}
    assert summary["b"]["prompts"] == 1.0 and summary["a"]["response_length"] == pytest.approx(3.0)
    assert lines[0].split() == ["metric", "all", "a", "b"]
    assert lines[3].split() == ["avg@1", "0.667", "±", "0.333", "0.500", "±", "0.500", "1.000"]
    notes = column_notes(list(summary["all"]), EvalSettings(n=2, temperature=1.0, also_greedy=True))
    assert [note.split(":")[0] for note in notes] == ["greedy accuracy", "avg@k", "pass@k", "maj@k"]
    assert "avg@2 counts all 2 and equals pass@1" in notes[1]
    assert metrics["val/pass@1"] == pytest.approx(metrics["val/avg@2"])  # what the note says
    assert column_notes(["avg@1"], EvalSettings())[0].startswith("avg@1: the share of prompts whose greedy answer")
    assert evaluation_table({"val/prompts": 0.0, "val/dropped_prompts": 0.0}) == ({}, [])


def test_a_sampling_seed_gives_the_evaluation_a_random_stream_of_its_own():
    """Draws inside an evaluation come from its seed, go on from batch to batch, start again at the next
    validation, and leave the run's stream where it was; without a seed they are the run's."""
    evaluator = Evaluator(EvalSettings(n=2, temperature=1.0, sampling_seed=3))
    torch.manual_seed(0)
    run_state = torch.get_rng_state()
    with evaluator._own_stream():  # one batch
        first = torch.rand(4)
    with evaluator._own_stream():  # the next
        second = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), run_state)
    torch.manual_seed(3)
    assert torch.equal(torch.cat([first, second]), torch.rand(8))
    evaluator.finish(SimpleNamespace(world_size=1, is_global_zero=False, sanity_checking=False), 0)
    torch.manual_seed(5)
    with evaluator._own_stream():  # the next validation
        assert torch.equal(torch.rand(4), first)
    plain = Evaluator(EvalSettings(n=2, temperature=1.0))
    torch.manual_seed(0)
    with plain._own_stream():
        drawn = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(4))


def test_ks_without_n_still_report_the_mean_over_every_sample_as_val_accuracy():
    """``ks: [1]`` with n = 2 used to end the validation with KeyError 'val/avg@2' (val/accuracy reads avg@n)."""
    settings = EvalSettings(n=2, temperature=1.0, ks=[1])
    assert settings.ks == [1, 2]
    evaluator = Evaluator(settings)
    rows = [{"source": "r1", "data_source": "d", "prompt": "p", "answer": "1"}]
    # two samples of one prompt: one correct, one not -> mean correctness 0.5
    evaluator.results.update(rows, 2, torch.tensor([1.0, 0.0]))
    metrics = evaluator.finish(SimpleNamespace(world_size=1, is_global_zero=False, sanity_checking=False), 0)
    assert metrics["val/accuracy"] == metrics["val/avg@2"] == 0.5
