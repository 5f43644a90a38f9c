"""Rewards: verifiers, batch scoring that isolates a bad sample, and the check that every reference answer
can be matched at all."""

import logging

import pytest

from rllight.data import ArithmeticTask, RLDataModule
from rllight.errors import RecipeError
from reward_fixtures import samples_of
from rllight.rewards import IntegerMatch, MathVerify, Reward, RewardRunner, Verifier, check_answers, last_integer
from rllight.rollout.scoring import score_samples


@pytest.mark.parametrize("text,expected", [
    ("42", 42), ("The answer is 1,234.", 1234), ("7 + 5 = 12", 12), ("\\boxed{-3} so 5", -3), ("none", None),
])
def test_last_integer(text, expected):
    assert last_integer(text) == expected


def test_integer_match_and_scale():
    r = IntegerMatch(correct=1.0, wrong=-1.0)
    assert r("so 12 + 5 = 17", "17") == 1.0
    assert r("17 then 18", "17") == -1.0
    assert r("no number", "3") == -1.0


def test_math_verify_equivalence():
    r = MathVerify()
    assert r("The answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert r("The answer is $\\boxed{3}$", "4") == 0.0


def test_a_verifier_that_fails_on_a_sample_costs_that_sample_only():
    class Bad(IntegerMatch):
        def __call__(self, response, answer):
            if response == "boom":
                raise ValueError("boom")
            if response == "nan":
                return float("nan")
            return super().__call__(response, answer)

    scores = score_samples(Bad(), samples_of(["boom", "5", "nan", "4"], ["5", "5", "5", "5"]))
    assert scores.values == [0.0, 1.0, 0.0, 0.0]
    assert scores.solved == [False, True, False, False]
    assert sorted(scores.failed) == [0, 2] and scores.failed[0] == "ValueError: boom"


def test_a_verifier_in_the_reward_workers_is_named_as_itself_in_the_warning(caplog):
    class Bad(IntegerMatch):  # defined here: scored in this process (workers: 0), as the runner wraps it all the same
        def __call__(self, response, answer):
            raise ValueError("boom")

    guarded = Bad().guarded(RewardRunner(workers=0))
    assert type(guarded).__name__ == "Guarded" and guarded.name == "Bad"
    with caplog.at_level(logging.WARNING, logger="rllight"):
        scores = score_samples(guarded, samples_of(["5", "6"], ["5", "5"]))
    assert sorted(scores.failed) == [0, 1]
    [line] = [r.getMessage() for r in caplog.records if "could not score" in r.getMessage()]
    assert line.startswith("reward Bad could not score 2 of 2 samples")


class Echo(Verifier):
    """The reward is the response read as a number."""

    def __call__(self, response, answer):
        return float(response)


def test_scoring_rejects_rewards_that_overflow_float32(caplog):
    # The largest float32 is (2 - 2**-23) * 2**127 = 3.4028235e38. 1e39 and -1e39 are finite doubles but
    # become +-inf in the float32 rollout tensor: failures, reward 0. 3e38 fits: kept, and >= correct (1.0).
    with caplog.at_level(logging.WARNING, logger="rllight"):
        scores = score_samples(Echo(), samples_of(["1e39", "3e38", "-1e39", "1", "inf"], ["0"] * 5))
    assert scores.values == [0.0, 3e38, 0.0, 1.0, 0.0]
    assert scores.solved == [False, True, False, True, False]
    assert sorted(scores.failed) == [0, 2, 4]
    assert all("not finite in float32" in why for why in scores.failed.values())
    warned = [r.getMessage() for r in caplog.records if "could not score" in r.getMessage()]  # one line a batch
    assert len(warned) == 1 and "3 of 5 samples" in warned[0] and "sample 0: ValueError: reward 1e+39" in warned[0]


@pytest.mark.parametrize("answer", ["4", " -12 ", "1,234", "+7"])
def test_integer_match_accepts_integer_answers(answer):
    r = IntegerMatch()
    assert r.check_answer(answer) is None
    # and the check agrees with the verifier: the integer written plainly matches
    assert r.is_correct(f"so {int(answer.strip().replace(',', ''))}", answer)


@pytest.mark.parametrize("answer", ["2.0", "x=3", "", "  ", "1/2", "\\frac{1}{2}"])
def test_integer_match_rejects_answers_no_response_can_match(answer):
    r = IntegerMatch()
    reason = r.check_answer(answer)
    assert "not an integer" in reason and "MathVerify" in reason and "\n" not in reason
    with pytest.raises(ValueError):  # what every response to such a row would hit
        r.is_correct("2", answer)


def test_math_verify_check_answer():
    r = MathVerify()
    assert r.check_answer("\\frac{1}{2}") is None
    assert r.check_answer("0.5") is None
    assert r.check_answer("x=3") is None
    assert "math-verify cannot parse" in r.check_answer("")
    assert "math-verify cannot parse" in r.check_answer("$$")


def test_base_reward_accepts_every_answer():
    assert Reward().check_answer("") is None


def _load(tmp_path, answers):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"prompt": "Q{i}", "answer": {a}}}\n' for i, a in enumerate(answers)))
    dm = RLDataModule(train_files=[str(path)], batch_size=1)
    dm.setup("fit")
    return str(path), dm.train_rows


def test_check_answers_names_file_row_field_and_reward(tmp_path):
    # Row 3 holds the JSON number 2.0, read back as the string "2.0": IntegerMatch can never match it.
    path, rows = _load(tmp_path, ['"4"', "6", "2.0", '"x"'])
    with pytest.raises(RecipeError) as exc:
        check_answers(IntegerMatch(), rows, "answer")
    assert str(exc.value) == (f"{path} row 3: answer '2.0' can never be matched by IntegerMatch: it is not an "
                              "integer; write the answer as an integer, or use rllight.rewards.MathVerify for "
                              "fractions, decimals and expressions")
    check_answers(MathVerify(), rows[:3], "answer")  # MathVerify reads 2.0


def test_check_answers_passes_matchable_rows_and_plain_callables(tmp_path):
    _, rows = _load(tmp_path, ['"4"', "6", '"-1,000"'])
    check_answers(IntegerMatch(), rows, "answer")
    check_answers(lambda response, answer: 1.0, rows + [{"answer": "2.0"}], "answer")
    train, val = ArithmeticTask(num_train=50, num_val=10).splits()
    check_answers(IntegerMatch(), train + val, "answer")


def test_check_answers_without_a_source_gives_the_position():
    with pytest.raises(RecipeError, match=r"^row 2: answer 'two\\nthree' can never be matched by IntegerMatch"):
        check_answers(IntegerMatch(), [{"answer": "2"}, {"answer": "two\nthree"}], "answer")
