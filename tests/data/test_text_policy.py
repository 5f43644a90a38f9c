"""Text as rllight reads it (``rllight.data.text``, ``rllight.data.context``): text that is not UTF-8 is replaced,
skipped or refused by one stated policy, never a crash; a prompt longer than the model's context is refused (by
default), cut or dropped before anything is generated; files are read a row at a time, each row bounded."""

import io
import json
import logging
import tracemalloc
from types import SimpleNamespace

import pytest

from conftest import RECIPES
from helpers import tiny_overrides
from rllight.data import RLDataModule
from rllight.errors import RecipeError
from test_user_errors import _error  # the one error line of `rllight <args>` (exit code 2, no traceback)

GRPO = f"{RECIPES}/grpo.yaml"

# Row 1 is clean; row 2 holds an escaped lone surrogate, row 3 a Latin-1 byte, row 4 a bad byte in a chat message.
BAD_ROWS = (b'{"prompt": "What is 1 + 1?", "answer": "2"}\n'
            b'{"prompt": "What is 2 + 2? \\ud800", "answer": "4"}\n'
            b'{"prompt": "Caf\xe9: what is 3 + 3?", "answer": "6"}\n'
            b'{"prompt": [{"role": "user", "content": "What is 4 + 4? \xff"}], "answer": "8"}\n')


def _bad_file(tmp_path, name="train.jsonl"):
    path = tmp_path / name
    path.write_bytes(BAD_ROWS)
    return str(path)


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# ------------------------------------------------------------------------------------------------ decoding
def test_text_that_is_not_utf8_is_replaced_counted_and_tokenizes(tmp_path, tiny_model_dir, caplog):
    """The default policy: each bad character becomes U+FFFD, one warning counts the rows and names the first, and
    the tokenizer takes every row (an escaped "\\ud800" made it raise TypeError in encode_chat)."""
    from rllight.rollout.producer import encode_chat

    path = _bad_file(tmp_path)
    dm = RLDataModule(train_files=[path], batch_size=1)
    with caplog.at_level(logging.WARNING, logger="rllight.data.text"):
        dm.setup("fit")
    assert [r["prompt"] for r in dm.train_rows] == [
        "What is 1 + 1?", "What is 2 + 2? \ufffd", "Caf\ufffd: what is 3 + 3?",
        [{"role": "user", "content": "What is 4 + 4? \ufffd"}]]
    tok = _tokenizer(tiny_model_dir)
    assert all(encode_chat(tok, row["messages"]) for row in dm.train_rows)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{path}: 3 row(s) with text that is not UTF-8: the bad characters were replaced "
                              f"with U+FFFD (first: {path} row 2 'prompt')")


def test_decode_errors_skip_leaves_rows_out_and_error_names_the_row(tmp_path, caplog):
    path = _bad_file(tmp_path)
    dm = RLDataModule(train_files=[path], batch_size=1, decode_errors="skip")
    with caplog.at_level(logging.WARNING, logger="rllight.data.text"):
        dm.setup("fit")
    assert [r["prompt"] for r in dm.train_rows] == ["What is 1 + 1?"]
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"{path}: 3 row(s) with text that is not UTF-8 left out"]
    with pytest.raises(RecipeError) as exc:
        RLDataModule(val_files=[path], decode_errors="error").setup("fit")
    assert str(exc.value) == (f"{path} row 2 'prompt': text that is not UTF-8 (a byte that is not UTF-8, or a lone "
                              "surrogate such as \\ud800); fix the text, or set data.decode_errors to replace (U+FFFD) "
                              "or skip (leave such rows out)")
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_bytes(BAD_ROWS.split(b"\n", 1)[1])
    with pytest.raises(RecipeError, match="holds no row whose text is UTF-8"):
        RLDataModule(train_files=[str(only_bad)], decode_errors="skip").setup("fit")
    with pytest.raises(RecipeError, match="data.decode_errors is 'ignore'; use replace"):
        RLDataModule(decode_errors="ignore")


def test_a_run_on_rows_with_lone_surrogates_trains(tmp_path, tiny_model_dir):
    """Every batch holds a row with an escaped lone surrogate, which the JSON reader took: the run trains (it crashed
    in the tokenizer at the first rollout, and so did every resume from its checkpoint, which read the same rows)."""
    from rllight.app.cli import main

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1? \ud800", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    main(["fit", "--config", GRPO, "--config", tiny_overrides(tmp_path, tiny_model_dir),
          "--data.train_files", f"[{path}]", "--data.batch_size", "2", "--model.sampler.group_size", "2"])


def test_generate_reads_prompts_that_are_not_utf8(tmp_path, tiny_model_dir, restore_sys_path):
    """A .txt file with a Latin-1 byte and a CESU-8 surrogate, and ``--prompt`` text from a shell that passed bytes
    that are not UTF-8 (Python gives them as lone surrogates): replaced, and answered."""
    from rllight.app.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"Caf\xe9?\n\nWhat is \xed\xa0\x80?\n")
    out = tmp_path / "out.jsonl"
    main(["generate", "--model.path", tiny_model_dir, "--prompts", str(prompts), "--output", str(out),
          "--max_new_tokens", "2", "--greedy"])
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [(r["source"], r["prompt"]) for r in records] == [
        (f"{prompts} line 1", "Caf\ufffd?"), (f"{prompts} line 3", "What is \ufffd\ufffd\ufffd?")]
    main(["generate", "--model.path", tiny_model_dir, "--prompt", "Caf\udce9?", "--output", str(out),
          "--max_new_tokens", "2", "--greedy"])
    assert json.loads(out.read_text(encoding="utf-8"))["prompt"] == "Caf\ufffd?"


@pytest.fixture
def restore_sys_path(monkeypatch):
    """``main`` puts the working directory on ``sys.path``; give it back after the test."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))


class _Session:
    """What ``chat`` uses of a loaded model: the conversations it is asked to answer."""

    system: list = []

    def __init__(self):
        self.asked = []

    def reply(self, conversations):
        self.asked.extend(conversations)
        return [("ok", 1, False) for _ in conversations]


@pytest.mark.parametrize("mode, expected", [("replace", ["Caf\ufffd?", "\ufffd\ufffd 2 + 2"]), ("skip", [])])
def test_chat_input_that_is_not_utf8(mode, expected, capsys):
    """Piped chat input with bytes that are not UTF-8 (a strict stdin raised UnicodeDecodeError): each line is
    replaced or skipped by the policy; the conversation goes on."""
    from rllight.data.text import TextPolicy
    from rllight.app.generate import chat

    stdin = io.TextIOWrapper(io.BytesIO(b"Caf\xe9?\n\xff\xfe 2 + 2\n/exit\n"), encoding="utf-8")
    session = _Session()
    chat(session, stdin, TextPolicy(mode))
    users = [m["content"] for m in (session.asked[-1] if session.asked else []) if m["role"] == "user"]
    assert users == expected
    assert capsys.readouterr().out == "ok\n" * len(expected)


# -------------------------------------------------------------------------------------------- row size bound
def test_a_jsonl_line_over_max_row_bytes_is_one_line_before_it_is_read_whole(tmp_path):
    path = tmp_path / "train.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"prompt": "What is 1 + 1?", "answer": "2"}\n\n')
        f.write(b'{"prompt": "' + b"x" * 8_000_000 + b'", "answer": "2"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(RecipeError) as exc:
            RLDataModule(train_files=[str(path)], max_row_bytes=4096).setup("fit")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(exc.value) == (f"data.train_files: '{path}' line 3 is longer than data.max_row_bytes (4096 bytes); "
                              "shorten or split that row, or raise data.max_row_bytes")
    assert peak < 1_000_000  # the 8 MB line was never held
    RLDataModule(train_files=[str(path)], max_row_bytes=8_000_100).setup("fit")  # under a larger bound: read
    with pytest.raises(RecipeError, match=r"^RLDataModule\.max_row_bytes must be an integer >= 1, got 0$"):
        RLDataModule(max_row_bytes=0)


def _array(path):
    path.write_text(json.dumps([{"prompt": "short", "answer": "1"}, {"prompt": "y" * 5000, "answer": "2"}], indent=2))


def _parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["short", "y" * 5000], "answer": ["1", "2"]}), path)


@pytest.mark.parametrize("name, write", [("train.json", _array), ("train.parquet", _parquet)])
def test_a_row_over_max_row_bytes_in_an_array_or_parquet(tmp_path, name, write):
    path = tmp_path / name
    write(path)
    with pytest.raises(RecipeError) as exc:
        RLDataModule(train_files=[str(path)], max_row_bytes=1000).setup("fit")
    assert str(exc.value).startswith(f"{path} row 2 is longer than data.max_row_bytes (1000 bytes)")


def test_a_txt_prompt_over_max_row_bytes(tmp_path):
    from argparse import Namespace

    from rllight.app.generate import _prompt_rows

    path = tmp_path / "prompts.txt"
    path.write_bytes(b"short\n" + b"z" * 5000 + b"\n")
    with pytest.raises(RecipeError) as exc:
        _prompt_rows(Namespace(prompt=None, prompts=str(path)), RLDataModule(max_row_bytes=1000))
    assert str(exc.value).startswith(f"--prompts: '{path}' line 2 is longer than data.max_row_bytes (1000 bytes)")


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 11, 13, 64])
def test_a_json_array_streamed_in_any_chunk_size_reads_as_a_whole(tmp_path, monkeypatch, chunk):
    """Items cut anywhere between two reads (mid-escape, mid-number, mid-surrogate pair) parse as ``json.loads``
    parses the whole file; a bad line is still named."""
    import rllight.data.files as data_files

    rows = [{"prompt": "q \u00e9\u4e2d\U0001F600 \\\" \u2028", "answer": 12345678901234567890, "x": [1.5e3, True, None]},
            {"prompt": [{"role": "user", "content": "hi"}], "answer": "07"}, {"prompt": "\U0001F600", "answer": -2}]
    monkeypatch.setattr(data_files, "_CHUNK", chunk)
    for text in (json.dumps(rows), "\ufeff" + json.dumps(rows, indent=2, ensure_ascii=False)):
        path = tmp_path / "train.json"
        path.write_text(text, encoding="utf-8")
        dm = RLDataModule(train_files=[str(path)], batch_size=1, answer_format="plain")
        dm.setup("fit")
        assert [(r["prompt"], r["answer"]) for r in dm.train_rows] == [(r["prompt"], str(r["answer"])) for r in rows]
    path.write_text('[\n  {"prompt": "What is 1?", "answer": "1"},\n  {"prompt": "What is 2?" "answer": "2"}\n]\n')
    with pytest.raises(RecipeError, match="line 3 is not valid JSON \\(Expecting ',' delimiter at column 27\\)"):
        RLDataModule(train_files=[str(path)]).setup("fit")


# ------------------------------------------------------------------------------------------- model's context
def _trained_on(dm, tokenizer, max_new_tokens=6, eval_max_new_tokens=None, positions=512):
    """``dm`` set up, as a trainer would have it once the model is loaded (the module's tokenizer, its policy's
    config and its engines' ``max_new_tokens``), its loaders made."""
    module = SimpleNamespace(tokenizer=tokenizer, policy=SimpleNamespace(config=SimpleNamespace(
        max_position_embeddings=positions)), rollout=SimpleNamespace(max_new_tokens=max_new_tokens),
        evaluation=SimpleNamespace(max_new_tokens=eval_max_new_tokens))
    dm.setup("fit")
    dm.trainer = SimpleNamespace(lightning_module=module, global_rank=0, world_size=1)
    dm.val_dataloader()
    dm.train_dataloader()
    return dm


def _rows_file(tmp_path, name, prompts):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return str(path)


LONG = "Some context. " * 200 + "What is 2 + 3?"  # about 600 tokens of the tiny model's tokenizer


def test_a_prompt_longer_than_the_context_is_refused_by_default(tmp_path, tiny_model_dir):
    train = _rows_file(tmp_path, "train.jsonl", ["What is 1 + 1?", LONG, LONG, "What is 2 + 2?"])
    with pytest.raises(RecipeError) as exc:
        _trained_on(RLDataModule(train_files=[train], batch_size=1), _tokenizer(tiny_model_dir))
    message = str(exc.value)
    assert message.startswith(f"{train} row 2 (and 1 more row): the prompt is ")
    assert message.endswith("over the model's 512 (config.max_position_embeddings); set data.long_prompts to "
                            "truncate (cut the prompt's start) or drop (leave such rows out), shorten the prompts, or "
                            "lower model.rollout.max_new_tokens")
    # The validation rows too, against the evaluation's own max_new_tokens when it has one.
    short = _rows_file(tmp_path, "short.jsonl", ["What is 1 + 1?"])
    val = _rows_file(tmp_path, "val.jsonl", ["What is 1 + 1?", "What is 2 + 2?" + " 7" * 200])
    _trained_on(RLDataModule(train_files=[short], val_files=[val], batch_size=1), _tokenizer(tiny_model_dir))
    with pytest.raises(RecipeError, match=f"^{val} row 2: .*with model.evaluation.max_new_tokens=300 it needs"):
        _trained_on(RLDataModule(train_files=[short], val_files=[val], batch_size=1), _tokenizer(tiny_model_dir),
                    eval_max_new_tokens=300)
    with pytest.raises(RecipeError, match="^model.rollout.max_new_tokens=512 leaves no room for a prompt"):
        _trained_on(RLDataModule(train_files=[short], batch_size=1), _tokenizer(tiny_model_dir), max_new_tokens=512)


def test_text_of_many_bytes_a_character_is_measured(tmp_path, tiny_model_dir):
    """300 characters of two bytes each are 600 tokens of a byte-level tokenizer: refused, though a count of
    characters would pass them."""
    train = _rows_file(tmp_path, "train.jsonl", ["\u00e9" * 300])
    with pytest.raises(RecipeError, match="row 1: the prompt is 6.. tokens"):
        _trained_on(RLDataModule(train_files=[train], batch_size=1), _tokenizer(tiny_model_dir))


def test_truncate_cuts_the_start_of_the_last_user_message_and_drop_leaves_the_row_out(tmp_path, tiny_model_dir,
                                                                                        caplog):
    from rllight.rollout.producer import encode_chat

    tok = _tokenizer(tiny_model_dir)
    train = _rows_file(tmp_path, "train.jsonl", ["What is 1 + 1?", LONG])
    dm = _trained_on(RLDataModule(train_files=[train], batch_size=1, long_prompts="truncate",
                                  system_prompt="Be brief."), tok)
    cut = dm.train_rows[1]["messages"]
    assert len(encode_chat(tok, cut)) + 6 <= 512 < len(encode_chat(tok, dm.messages(LONG))) + 6
    assert cut[0] == {"role": "system", "content": "Be brief."}
    assert cut[1]["content"].endswith("Some context. What is 2 + 3?") and len(cut[1]["content"]) < len(LONG)
    assert dm.train_rows[0]["messages"][1]["content"] == "What is 1 + 1?"  # a row that fits is left as it is
    with caplog.at_level(logging.WARNING, logger="rllight.data.context"):
        dm = _trained_on(RLDataModule(train_files=[train], batch_size=1, long_prompts="drop"), tok)
    assert [r["prompt"] for r in dm.train_rows] == ["What is 1 + 1?"]
    assert caplog.records[-1].getMessage().startswith(
        f"training rows: 1 prompt(s) too long for the model's context left out (first: {train} row 2: the prompt is ")
    with pytest.raises(RecipeError, match="data.long_prompts is 'cut'; use refuse"):
        RLDataModule(long_prompts="cut")


def test_a_run_refuses_a_prompt_longer_than_the_context_before_training(tmp_path, tiny_model_dir, capsys):
    train = _rows_file(tmp_path, "train.jsonl", ["What is 1 + 1?", "What is 2 + 2?", LONG])
    line = _error(capsys, "fit", "--config", GRPO, "--config", tiny_overrides(tmp_path, tiny_model_dir),
                  "--data.train_files", f"[{train}]")
    assert line.startswith(f"rllight: error: {train} row 3: the prompt is ")
    assert "data.long_prompts" in line


def test_generate_refuses_or_cuts_a_prompt_longer_than_the_context(tmp_path, tiny_model_dir, capsys,
                                                                    restore_sys_path):
    from rllight.app.cli import main

    line = _error(capsys, "generate", "--model.path", tiny_model_dir, "--prompt", LONG, "--max_new_tokens", "2")
    assert line.startswith("rllight: error: --prompt 1: the prompt is ") and "--max_new_tokens=2" in line
    out = tmp_path / "out.jsonl"
    main(["generate", "--model.path", tiny_model_dir, "--prompt", LONG, "--max_new_tokens", "2", "--greedy",
          "--data.long_prompts", "truncate", "--output", str(out)])
    assert json.loads(out.read_text())["source"] == "--prompt 1"
