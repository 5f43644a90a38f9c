"""Data files and the arithmetic task; bad input is one line naming the file, the row and the field."""

import json

import pytest

from rllight.data import ArithmeticTask, RLDataModule
from rllight.errors import RecipeError


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
    from rllight.app.cli import main

    from conftest import RECIPES
    from helpers import tiny_overrides

    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", f"{RECIPES}/grpo.yaml", "--config", overlay,
              "--data.train_files", f"[{tmp_path}/missing.jsonl]"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rllight: error: data.train_files") and "missing.jsonl" in err[-1]


def test_rows_carry_where_they_came_from(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Line 2 is blank, so the second row is on line 3: the source gives both.
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n\n{"prompt": "What is 2 + 2?", "answer": "4"}\n')
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "val.parquet")
    dm = RLDataModule(train_files=[str(path)], val_files=[str(tmp_path / "val.parquet")])
    dm.setup("fit")
    assert [r["source"] for r in dm.train_rows] == [f"{path} row 1", f"{path} row 2 (line 3)"]
    assert [r["source"] for r in dm.val_rows] == [f"{tmp_path}/val.parquet row 1", f"{tmp_path}/val.parquet row 2"]

    task = RLDataModule(task=ArithmeticTask(num_train=3, num_val=2))
    task.setup("fit")
    assert [r["source"] for r in task.train_rows] == ["data.task train row 1", "data.task train row 2",
                                                     "data.task train row 3"]
    assert [r["source"] for r in task.val_rows] == ["data.task val row 1", "data.task val row 2"]


def _empty_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)


@pytest.mark.parametrize("name,write,expected", [
    ("train.jsonl", lambda p: p.write_text(""), "is empty"),
    ("train.jsonl", lambda p: p.write_text("\n  \n"), "is empty"),
    ("train.json", lambda p: p.write_text(""), "is empty"),
    ("train.json", lambda p: p.write_text("[]\n"), "empty JSON array"),
    ("train.parquet", lambda p: p.write_bytes(b""), "is empty (0 bytes)"),
    ("train.parquet", _empty_parquet, "holds no rows"),
])
def test_empty_file_names_the_file(tmp_path, name, write, expected):
    path = tmp_path / name
    write(path)
    with pytest.raises(RecipeError) as exc:
        RLDataModule(train_files=[str(path)]).setup("fit")
    msg = _one_line(exc.value)
    assert msg.startswith(f"data.train_files: '{path}' ") and expected in msg


def test_empty_file_through_the_cli_is_one_line(tmp_path, tiny_model_dir, capsys):
    from rllight.app.cli import main

    from conftest import RECIPES
    from helpers import tiny_overrides

    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", f"{RECIPES}/grpo.yaml", "--config", overlay,
              "--data.train_files", f"[{tmp_path}/empty.jsonl]"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"rllight: error: data.train_files: '{tmp_path}/empty.jsonl' is empty; write one JSON object per line, "
        "every row needs 'prompt' (a string or a list of chat messages) and 'answer'")


def test_malformed_jsonl_line_names_the_line_and_the_problem(tmp_path):
    # Line 1 is good, line 2 blank, line 3 lacks the answer's value: json says "Expecting value" at the
    # closing brace. Columns (1-based): '{"prompt": "What is 2?",' is 1-24, ' "answer": ' is 25-35, '}' is 36.
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "What is 1?", "answer": "1"}\n\n{"prompt": "What is 2?", "answer": }\n')
    with pytest.raises(RecipeError) as exc:
        RLDataModule(train_files=[str(path)]).setup("fit")
    assert _one_line(exc.value) == (f"data.train_files: '{path}' line 3 is not valid JSON (Expecting value at "
                                    "column 36); each line must be one JSON object")


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "What is 1?", "answer": "1"}\n["What is 2?", "2"]\n')
    with pytest.raises(RecipeError) as exc:
        RLDataModule(train_files=[str(path)]).setup("fit")
    msg = _one_line(exc.value)
    assert msg.startswith(f"{path} line 2: a JSON array, not an object")


def test_values_keep_the_text_of_the_file(tmp_path):
    # Read by column (datasets, then pandas when the rows' types disagree) the string prompt "12" became the
    # integer 12, the answer 4 next to 2.50 the float 4.0 ("4.0", which IntegerMatch cannot match), the
    # string "07" the integer 7, and 12345678901234567890 (above 2**63) a float with 17 significant digits.
    path = tmp_path / "train.jsonl"
    path.write_text('\ufeff{"prompt": "12", "answer": 4}\r\n{"prompt": "b", "answer": 2.50}\r\n'
                    '{"prompt": [{"role": "user", "content": "c"}], "answer": 12345678901234567890}\r\n'
                    '{"prompt": "d", "answer": "07"}\r\n',
                    encoding="utf-8")  # with a byte-order mark and CRLF line ends, as some editors save
    dm = RLDataModule(train_files=[str(path)], batch_size=1)
    dm.setup("fit")
    assert [r["prompt"] for r in dm.train_rows] == ["12", "b", [{"role": "user", "content": "c"}], "d"]
    assert [r["answer"] for r in dm.train_rows] == ["4", "2.50", "12345678901234567890", "07"]


def test_malformed_json_array_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"prompt": "What is 1?", "answer": "1"},\n  {"prompt": "What is 2?" "answer": "2"}\n]\n')
    with pytest.raises(RecipeError) as exc:
        RLDataModule(val_files=[str(path)]).setup("fit")
    msg = _one_line(exc.value)
    assert msg.startswith(f"data.val_files: '{path}' line 3 is not valid JSON (Expecting ',' delimiter")


def test_json_array_loads_with_row_numbers(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"prompt": "What is 1?", "answer": 1}, {"prompt": "What is 2?", "answer": 2}]))
    dm = RLDataModule(train_files=[str(path)], batch_size=1)
    dm.setup("fit")
    assert [(r["answer"], r["source"]) for r in dm.train_rows] == [("1", f"{path} row 1"), ("2", f"{path} row 2")]


@pytest.mark.parametrize("prompt,expected", [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "wizard", "content": "Abracadabra"}],
     "prompt[2].role is 'wizard'; use one of system, user, assistant, tool"),
    ([{"role": "user", "content": "Hi"}, {"content": "no role"}], "prompt[1].role is missing"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant"}], "prompt[1].content is missing or not a string"),
    ([], "'prompt' is an empty list"),
    (["Hi"], "prompt[0] is not a chat message"),
    (7, "'prompt' is a number"),
])
def test_bad_chat_prompt_names_row_and_field(tmp_path, prompt, expected):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"},
                                                 {"prompt": prompt, "answer": "4"}])
    with pytest.raises(RecipeError) as exc:
        RLDataModule(train_files=[path]).setup("fit")
    msg = _one_line(exc.value)
    assert msg.startswith(f"{path} row 2: ") and expected in msg
