"""Data files, the arithmetic task and rewards; bad input is one line naming the problem."""

import json

import pytest

from rllight.data import ArithmeticTask, RLDataModule
from rllight.errors import RecipeError
from rllight.rewards import IntegerMatch, MathVerify, last_integer, score_batch


def test_arithmetic_task_is_deterministic_disjoint_and_mixed():
    train, val = ArithmeticTask(num_train=500, num_val=100, seed=3).splits()
    again, _ = ArithmeticTask(num_train=500, num_val=100, seed=3).splits()
    other, _ = ArithmeticTask(num_train=500, num_val=100, seed=4).splits()
    assert train == again and train != other
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    lengths = {len(r["answer"]) for r in train}
    assert {1, 2, 3} <= lengths
    for row in train[:50]:  # the answers are right
        expr = row["prompt"].split("What is ")[1].split("?")[0]
        assert str(eval(expr)) == row["answer"]


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_and_parquet_with_chat_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = _write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "What is 2 + 2?", "answer": 4},
        {"prompt": [{"role": "user", "content": "What is 3 + 3?"}], "answer": "6"},
    ])
    pq.write_table(pa.table({"prompt": ["What is 1 + 1?"], "answer": ["2"]}), tmp_path / "val.parquet")
    dm = RLDataModule(train_files=[train], val_files=[str(tmp_path / "val.parquet")], system_prompt="Be brief.")
    dm.setup("fit")
    assert [r["answer"] for r in dm.train_rows] == ["4", "6"]
    assert dm.train_rows[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "What is 2 + 2?"}]
    assert dm.train_rows[1]["messages"] == [{"role": "user", "content": "What is 3 + 3?"}]
    assert dm.val_rows[0]["answer"] == "2"


def _one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def test_missing_data_file_is_one_line(tmp_path):
    dm = RLDataModule(train_files=[str(tmp_path / "nope.jsonl")])
    with pytest.raises(RecipeError) as exc:
        dm.setup("fit")
    msg = _one_line(exc.value)
    assert "data.train_files" in msg and "nope.jsonl" in msg and "does not exist" in msg


def test_row_without_prompt_names_file_and_row(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"},
                                                 {"question": "What is 2 + 2?", "answer": "4"}])
    with pytest.raises(RecipeError) as exc:
        RLDataModule(train_files=[path]).setup("fit")
    msg = _one_line(exc.value)
    assert "bad.jsonl row 2" in msg and "'prompt'" in msg


def test_row_without_answer_names_row(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "What is 1 + 1?"}])
    with pytest.raises(RecipeError) as exc:
        RLDataModule(train_files=[path]).setup("fit")
    assert "row 1" in _one_line(exc.value) and "'answer'" in str(exc.value)


def test_missing_data_file_through_the_cli_is_one_line(tmp_path, tiny_model_dir, capsys):
    from rllight.cli import main

    from conftest import RECIPES
    from helpers import tiny_overrides

    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", f"{RECIPES}/grpo.yaml", "--config", overlay,
              "--data.train_files", f"[{tmp_path}/missing.jsonl]"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rllight: error: data.train_files") and "missing.jsonl" in err[-1]


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


def test_score_batch_isolates_failures():
    class Bad(IntegerMatch):
        def __call__(self, response, answer):
            if response == "boom":
                raise ValueError("boom")
            if response == "nan":
                return float("nan")
            return super().__call__(response, answer)

    rewards, correct, failures = score_batch(Bad(), ["boom", "5", "nan", "4"], ["5", "5", "5", "5"])
    assert rewards == [0.0, 1.0, 0.0, 0.0]
    assert correct == [False, True, False, False]
    assert failures == 2
