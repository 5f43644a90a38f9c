"""Data files written for other trainers load unchanged: verl's parquet, TRL's JSONL, GSM8K's worked
solutions, OpenRLHF's input/label keys and folders saved by ``datasets``; and one reward per data source."""

import json

import pytest

from rllight.data import ArithmeticTask, RLDataModule
from rllight.data.module import gsm8k_answer
from rllight.errors import RecipeError
from reward_fixtures import samples_of
from rllight.rewards import IntegerMatch, MathVerify, PerSource, check_rows, scored


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(**kwargs):
    dm = RLDataModule(batch_size=1, **kwargs)
    dm.setup("fit")
    return dm.train_rows


def _error(**kwargs) -> str:
    with pytest.raises(RecipeError) as exc:
        _rows(**kwargs)
    assert "\n" not in str(exc.value)
    return str(exc.value)


# ---------------------------------------------------------------------------------------------- verl
def _verl_parquet(path, ground_truths=("72", "10")):
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"Question {i}? Let's think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": "train", "index": i},
    } for i, gt in enumerate(ground_truths)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_verl_parquet(tmp_path):
    path = _verl_parquet(tmp_path / "train.parquet")
    rows = _rows(train_files=[path], answer_key="reward_model.ground_truth")
    assert [r["answer"] for r in rows] == ["72", "10"]
    assert [r["data_source"] for r in rows] == ["openai/gsm8k"] * 2
    assert rows[0]["prompt"] == [{"role": "user", "content": "Question 0? Let's think step by step."}]
    assert rows[0]["messages"] == rows[0]["prompt"]


def test_verl_parquet_row_without_the_nested_answer(tmp_path):
    path = _verl_parquet(tmp_path / "train.parquet", ground_truths=("72", None))
    msg = _error(train_files=[path], answer_key="reward_model.ground_truth")
    assert msg.startswith(f"{path} row 2: missing field 'reward_model.ground_truth'")


def test_answer_key_naming_an_object_says_which_field_to_use(tmp_path):
    path = _verl_parquet(tmp_path / "train.parquet")
    msg = _error(train_files=[path], answer_key="reward_model")
    assert msg == (f"{path} row 1: 'reward_model' is an object (fields: style, ground_truth); set data.answer_key "
                   "to the field inside it, e.g. 'reward_model.ground_truth'")


# ----------------------------------------------------------------------------------------------- TRL
def test_trl_jsonl_with_string_and_conversational_prompts(tmp_path):
    path = _write_jsonl(tmp_path / "trl_math.jsonl", [
        {"prompt": "What is 6 * 7?", "solution": "42"},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
         "solution": 4},
    ])
    rows = _rows(train_files=[path], answer_key="solution", system_prompt="Think.")
    assert [r["answer"] for r in rows] == ["42", "4"]
    assert [r["data_source"] for r in rows] == ["trl_math", "trl_math"]  # the file's name
    assert rows[0]["messages"] == [{"role": "system", "content": "Think."},
                                   {"role": "user", "content": "What is 6 * 7?"}]
    assert rows[1]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_a_missing_column_lists_the_row_fields(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "What is 6 * 7?", "solution": "42"}])
    assert _error(train_files=[path]) == (
        f"{path} row 1: missing field 'answer'; every row needs 'prompt' (a string or a list of chat messages) "
        "and 'answer' (this row has: prompt, solution; set data.answer_key to the field holding the reference answer)")


# --------------------------------------------------------------------------------------------- GSM8K
GSM8K = [
    {"question": "Natalia sold clips to 48 friends in April, and half as many in May. How many in all?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "A shop has 1,000 pens and buys 200 more. How many now?",
     "answer": "It has 1,000 + 200 = 1,200 pens.\n#### 1,200"},
]


def test_gsm8k_solutions_are_read_as_their_final_answer(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    path = str(tmp_path / "gsm8k_train.parquet")
    datasets.Dataset.from_list(GSM8K).to_parquet(path)
    # answer_format auto (the default) reads a solution whose last line starts with ####; gsm8k requires it.
    for fmt in ("auto", "gsm8k"):
        rows = _rows(train_files=[path], prompt_key="question", answer_format=fmt)
        assert [r["answer"] for r in rows] == ["72", "1200"]
        assert rows[0]["prompt"].startswith("Natalia sold clips")
        assert rows[0]["data_source"] == "gsm8k_train"
    # plain keeps the text as it is.
    assert _rows(train_files=[path], prompt_key="question", answer_format="plain")[0]["answer"] == GSM8K[0]["answer"]


def test_gsm8k_format_names_a_row_without_the_final_answer(tmp_path):
    path = _write_jsonl(tmp_path / "g.jsonl", [GSM8K[0], {"question": "q", "answer": "no marker, 5"}])
    # auto takes the second answer as plain text...
    assert [r["answer"] for r in _rows(train_files=[path], prompt_key="question")] == ["72", "no marker, 5"]
    # ...gsm8k rejects it.
    msg = _error(train_files=[path], prompt_key="question", answer_format="gsm8k")
    assert msg.startswith(f"{path} row 2: 'answer' has no final answer after '####'")


@pytest.mark.parametrize("text,expected", [
    ("so 5 + 2 = 7\n#### 7", "7"), ("#### -3", "-3"), ("a\n#### 1,234,567", "1234567"), ("#### 2.50", "2.50"),
    ("no mark", None), ("####   ", None), ("#### 1/2", "1/2"),
])
def test_gsm8k_answer(text, expected):
    assert gsm8k_answer(text) == expected


def test_unknown_answer_format_is_one_line():
    with pytest.raises(RecipeError, match="^data.answer_format is 'latex'; use one of auto, plain, gsm8k$"):
        RLDataModule(answer_format="latex")


# ------------------------------------------------------------------------------------------ OpenRLHF
def test_openrlhf_input_and_label_keys(tmp_path):
    path = _write_jsonl(tmp_path / "prompts.jsonl", [
        {"input": "What is 3 + 4?", "label": 7, "datasource": "arith"},
        {"input": [{"role": "user", "content": "What is 5 + 5?"}], "label": "10", "datasource": "arith"},
    ])
    rows = _rows(train_files=[path], prompt_key="input", answer_key="label", data_source_key="datasource")
    assert [(r["answer"], r["data_source"]) for r in rows] == [("7", "arith"), ("10", "arith")]
    assert rows[1]["prompt"] == [{"role": "user", "content": "What is 5 + 5?"}]
    # A bad chat message is named by its own key.
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"input": [{"role": "robot", "content": "hi"}], "label": "1"}])
    msg = _error(train_files=[bad], prompt_key="input", answer_key="label")
    assert msg.startswith(f"{bad} row 1: input[0].role is 'robot'")


# ---------------------------------------------------------------------------------- datasets folders
def test_folder_saved_by_datasets(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    train = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": 2, "data_source": "tiny"},
        {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": 4, "data_source": None},
    ])
    train.save_to_disk(str(tmp_path / "saved"))
    rows = _rows(train_files=[str(tmp_path / "saved")])
    assert [r["answer"] for r in rows] == ["2", "4"]
    assert [r["data_source"] for r in rows] == ["tiny", "saved"]  # a null data source: the folder's name
    assert [r["source"] for r in rows] == [f"{tmp_path}/saved row 1", f"{tmp_path}/saved row 2"]

    # A DatasetDict: one split's folder is named; the whole folder is an error that lists the splits.
    datasets.DatasetDict(train=train, test=train).save_to_disk(str(tmp_path / "dict"))
    assert len(_rows(train_files=[str(tmp_path / "dict" / "train")])) == 2
    msg = _error(train_files=[str(tmp_path / "dict")])
    assert msg == (f"data.train_files: '{tmp_path}/dict' holds the splits train, test; give the folder of one split, "
                   f"e.g. '{tmp_path}/dict/train'")


def test_a_folder_not_saved_by_datasets(tmp_path):
    (tmp_path / "plain").mkdir()
    msg = _error(train_files=[str(tmp_path / "plain")])
    assert msg.startswith(f"data.train_files: '{tmp_path}/plain' is a folder but not one saved by datasets' "
                          "save_to_disk")


def test_every_row_keeps_a_data_source(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "answer": "1", "data_source": "math"},
                                            {"prompt": "q", "answer": "2"}])
    dm = RLDataModule(train_files=[a], val_files=[a], batch_size=1)
    dm.setup("fit")
    assert [r["data_source"] for r in dm.train_rows + dm.val_rows] == ["math", "a", "math", "a"]
    task = RLDataModule(task=ArithmeticTask(num_train=2, num_val=1))
    task.setup("fit")
    assert {r["data_source"] for r in task.train_rows + task.val_rows} == {"arithmetic"}
    bad = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "answer": "1", "data_source": ["x"]}])
    assert _error(train_files=[bad]).startswith(f"{bad} row 1: 'data_source' is an array; give a string")


# ------------------------------------------------------------------------------- reward per source
def _per_source() -> PerSource:
    return PerSource(rewards={"openai/gsm8k": IntegerMatch(correct=1.0, wrong=-1.0), "math": MathVerify()})


def test_per_source_picks_the_reward_of_each_row():
    reward = _per_source()
    assert isinstance(reward.for_source("openai/gsm8k"), IntegerMatch)
    with pytest.raises(RecipeError, match="^model.reward: no reward for data_source 'aime'"):
        reward.for_source("aime")
    # IntegerMatch cannot read "1/2" and scores -1 when wrong; MathVerify reads 0.5 = 1/2.
    scores = scored(reward, samples_of(["42", "0.5", "41", "x"], ["42", "1/2", "42", "1/2"],
                                       ["openai/gsm8k", "math", "openai/gsm8k", "math"]))
    assert (scores.values, scores.solved, scores.failed) == ([1.0, 1.0, -1.0, 0.0], [True, True, False, False], {})
    # With a default, an unknown source uses it.
    fallback = PerSource(rewards={"math": MathVerify()}, default=IntegerMatch())
    assert fallback.for_source("aime") is fallback.default
    fallen = scored(fallback, samples_of(["7"], ["7"], ["aime"]))
    assert (fallen.values, fallen.solved, fallen.failed) == ([1.0], [True], {})
    # A plain reward scores every row.
    plain = scored(IntegerMatch(), samples_of(["7", "8"], ["7", "7"], ["a", "b"]))
    assert (plain.values, plain.solved) == ([1.0, 0.0], [True, False])


def test_split_groups_rows_by_the_reward_that_scores_them():
    reward = _per_source()
    groups = reward.split([{"data_source": s} for s in ["math", "openai/gsm8k", "math"]])
    assert [(type(r).__name__, index) for r, index in groups] == [("MathVerify", [0, 2]), ("IntegerMatch", [1])]
    plain = IntegerMatch()
    assert plain.split([{"data_source": "a"}, {"data_source": "b"}]) == [(plain, [0, 1])]


def test_check_rows_uses_each_source_reward():
    reward = _per_source()
    rows = [{"answer": "1/2", "data_source": "math", "source": "f row 1"},
            {"answer": "3", "data_source": "openai/gsm8k", "source": "f row 2"}]
    check_rows(reward, rows)  # "1/2" is fine for MathVerify
    with pytest.raises(RecipeError, match=r"^f row 3: answer '1/2' can never be matched by IntegerMatch"):
        check_rows(reward, rows + [{"answer": "1/2", "data_source": "openai/gsm8k", "source": "f row 3"}])
    with pytest.raises(RecipeError, match=r"^f row 4: model.reward: no reward for data_source 'aime'"):
        check_rows(reward, rows + [{"answer": "1", "data_source": "aime", "source": "f row 4"}])


def test_per_source_needs_a_reward():
    with pytest.raises(RecipeError, match="PerSource needs 'rewards'"):
        PerSource()


PER_SOURCE_YAML = """
model:
  reward:
    class_path: rllight.rewards.PerSource
    init_args:
      rewards:
        openai/gsm8k: {class_path: rllight.rewards.IntegerMatch, init_args: {correct: 2.0}}
        lighteval/MATH: {class_path: rllight.rewards.MathVerify}
      default: {class_path: rllight.rewards.IntegerMatch}
"""


def test_per_source_parses_from_a_recipe(tmp_path):
    from conftest import RECIPES
    from helpers import build

    overlay = tmp_path / "per_source.yaml"
    overlay.write_text(PER_SOURCE_YAML)
    cli = build(f"{RECIPES}/grpo.yaml", str(overlay))
    reward = cli.model.reward
    assert isinstance(reward, PerSource)
    assert isinstance(reward.for_source("openai/gsm8k"), IntegerMatch) and reward.for_source("openai/gsm8k").correct == 2.0
    assert isinstance(reward.for_source("lighteval/MATH"), MathVerify)
    assert isinstance(reward.for_source("other"), IntegerMatch) and reward.for_source("other").correct == 1.0


def test_per_source_round_trips_through_jsonargparse():
    import yaml
    from jsonargparse import ArgumentParser

    from rllight.rewards import Reward

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--reward", type=Reward)
    cfg = parser.parse_string(yaml.safe_dump({"reward": yaml.safe_load(PER_SOURCE_YAML)["model"]["reward"]}))
    again = parser.parse_string(parser.dump(cfg))
    reward = parser.instantiate(again).reward
    assert sorted(reward.rewards) == ["lighteval/MATH", "openai/gsm8k"]
    assert reward.rewards["openai/gsm8k"].correct == 2.0


def test_data_keys_from_a_recipe(tmp_path):
    from conftest import RECIPES
    from helpers import build

    path = _verl_parquet(tmp_path / "train.parquet")
    cli = build(f"{RECIPES}/grpo.yaml", "--data.train_files", f"[{path}]", "--data.answer_key",
                "reward_model.ground_truth", "--data.answer_format", "plain")
    cli.datamodule.setup("fit")
    assert [(r["answer"], r["data_source"]) for r in cli.datamodule.train_rows] == [("72", "openai/gsm8k"),
                                                                                    ("10", "openai/gsm8k")]
