"""``rllight generate`` and ``rllight chat``: try a model folder (an rllight export, any Hugging Face folder), as
``litgpt generate`` and ``litgpt chat`` do.

Both read a recipe like ``rllight fit`` does (``--config``, ``--model.path DIR``, any ``--key value``): the
model comes from ``model.model``, the chat template's system prompt from ``data.system_prompt`` and the
sampling settings from ``model.rollout`` (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``: the
distribution the policy was trained to sample from), each of which a flag of the command overrides. Without a
recipe, ``--model.path DIR`` alone samples with the engine's defaults. Generation runs with
``rllight.rollout.HFEngine`` in this process, on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
from collections.abc import Callable

import torch

from rllight.bounds import NonNegativeFloat, NonNegativeInt, PositiveInt, UpToOne, checked
from rllight.data.text import TextPolicy, decode
from rllight.errors import RecipeError
from rllight.paths import MODEL_PATH_FLAG, config_files, expand_path

COMMANDS = ("generate", "chat")

EXIT_WORDS = ("/exit", "/quit", "!exit", "!quit")
RESET_WORDS = ("/reset", "!reset")

_RECIPE_HELP = (
    "Recipe options, as for rllight fit: --config R.yaml (sampling settings from model.rollout, system prompt "
    "from data.system_prompt), --model.path DIR (an rllight export folder, a Hugging Face folder or an org/name "
    "hub id; the one flag that points at a model), any --key value. Without --config, --model.path is needed."
)
_DESCRIPTIONS = {
    "generate": "Generate responses to one prompt (--prompt) or a file of prompts (--prompts) with a trained "
                "model. Example: rllight generate --model.path runs/quickstart/model --prompt 'What is 7 * 8?'",
    "chat": "Chat with a trained model: each line read is a user message, the reply is printed; the "
            "conversation is kept until /reset; /exit or end of input (Ctrl-D) ends it. Example: rllight chat "
            "--config recipes/quickstart.yaml --model.path runs/quickstart/model",
}


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (``RecipeError``), as every other CLI error."""

    def error(self, message: str):
        raise RecipeError(f"{self.prog}: {message} (see: {self.prog} --help)")


def _parser(command: str) -> _Parser:
    p = _Parser(prog=f"rllight {command}", description=_DESCRIPTIONS[command], epilog=_RECIPE_HELP,
                allow_abbrev=False)
    if command == "generate":
        which = p.add_mutually_exclusive_group(required=True)
        which.add_argument("--prompt", action="append", metavar="TEXT",
                           help="A prompt, sent as the user's chat message (repeat for several).")
        which.add_argument("--prompts", metavar="FILE",
                           help="A file of prompts: .txt (one per line), or .jsonl / .json / .parquet rows (or a "
                                "datasets folder) with the prompt in data.prompt_key (a string or chat messages).")
        p.add_argument("--output", metavar="FILE",
                       help="Write one JSON object per response here (source, prompt, sample, response, tokens, "
                            "truncated, and answer where the file has one) instead of printing the responses.")
        p.add_argument("--num_samples", type=int, default=1, help="Responses per prompt (default 1).")
    p.add_argument("--max_new_tokens", type=int, help="Longest response in tokens (default: the recipe's).")
    p.add_argument("--temperature", type=float, help="Sampling temperature; 0 = greedy (default: the recipe's).")
    p.add_argument("--top_p", type=float, help="Nucleus sampling threshold (default: the recipe's).")
    p.add_argument("--top_k", type=int, help="Keep the k most likely tokens, 0 = off (default: the recipe's).")
    p.add_argument("--greedy", action="store_true", help="Decode greedily (the same as --temperature 0).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the sampling (default 0).")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="Where the model runs (auto: the GPU when there is one).")
    return p


SAMPLING_BOUNDS = {"max_new_tokens": PositiveInt, "temperature": NonNegativeFloat, "top_p": UpToOne,
                   "top_k": NonNegativeInt}
"""The bound of each sampling flag: the engine's, but a temperature of 0 (greedy) is allowed here."""


def _sampling(flags: argparse.Namespace, engine) -> tuple[dict, bool]:
    """The sampling settings (the recipe's ``model.rollout``, overridden by the flags) and whether greedy."""
    defaults = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0}  # RolloutEngine's
    settings = {name: getattr(engine, name, value) for name, value in defaults.items()}
    for name in settings:
        if getattr(flags, name) is not None:
            settings[name] = getattr(flags, name)
    settings = {name: checked(f"--{name}", value, SAMPLING_BOUNDS[name]) for name, value in settings.items()}
    greedy = flags.greedy or settings["temperature"] == 0
    if greedy:
        settings["temperature"] = 1.0  # unused when greedy; the engine requires a positive value
    return settings, greedy


def _device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RecipeError("--device cuda: no CUDA device is available here; use --device cpu")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def encode(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the tokenizer's chat template and the generation prompt; a tokenizer
    without a template (a base model) gets the messages' text, one per line."""
    if getattr(tokenizer, "chat_template", None):
        from rllight.rollout.producer import encode_chat

        return encode_chat(tokenizer, messages)
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])


class Session:
    """A loaded model with its tokenizer, sampling settings and system prompt."""

    def __init__(self, policy, tokenizer, settings: dict, greedy: bool, messages: Callable[[object], list[dict]]):
        from rllight.rollout import HFEngine

        self.policy, self.tokenizer, self.messages = policy, tokenizer, messages
        self.system = messages("")[:-1]
        """The recipe's system message (``data.system_prompt``) that starts a chat, if any."""
        self.engine = HFEngine(**settings, batch_size=16)
        self.sampling = self.engine.sampling.as_greedy() if greedy else self.engine.sampling

    def reply(self, conversations: list[list[dict]]) -> list[tuple[str, int, bool]]:
        """For each conversation (chat messages), the model's next message: ``(text, tokens, truncated)``."""
        gen = self.engine.generate(self.policy, self.tokenizer, [encode(self.tokenizer, c) for c in conversations],
                                   self.sampling)
        out = []
        for ids, mask, cut in zip(gen.response_ids, gen.response_mask, gen.truncated):
            tokens = ids[mask.bool()].tolist()
            out.append((self.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens), bool(cut)))
        return out


def _recipe(argv: list[str], make_cli: Callable[[list[str]], object]):
    """The recipe part of the command line, parsed and built (nothing loaded yet)."""
    if not config_files(argv) and not any(a.split("=", 1)[0] in (MODEL_PATH_FLAG, "--model.model") for a in argv):
        raise RecipeError(f"give the model: {MODEL_PATH_FLAG} DIR (an rllight export folder, a Hugging Face folder "
                          "or an org/name hub id), or --config RECIPE")
    quiet = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:  # the trainer the recipe builds is not used: its device and seed messages would mislead
        lg.setLevel(logging.WARNING)
    try:
        return make_cli(argv)
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)


def _load(cli, flags: argparse.Namespace) -> Session:
    """Settle the sampling settings and load the recipe's model."""
    module, data = cli.model, cli.datamodule
    settings, greedy = _sampling(flags, module.rollout)
    device = _device(flags.device)
    source = module.source
    where = source.resolve()
    shown = ", ".join(f"{k} {v}" for k, v in settings.items() if not (greedy and k == "temperature"))
    print(f"rllight {flags.command}: {where} on {device.type} ({'greedy, ' if greedy else ''}{shown})",
          file=sys.stderr, flush=True)
    policy, tokenizer = source.load()
    policy.to(device).eval().requires_grad_(False)
    torch.manual_seed(flags.seed)
    return Session(policy, tokenizer, settings, greedy, data.messages)


def _prompt_rows(flags: argparse.Namespace, data) -> list[dict]:
    """The prompts to answer, read with the recipe's datamodule ``data``'s prompt field and text policy
    (``data.decode_errors``, ``data.max_row_bytes``: ``rllight.data.text``)."""
    text: TextPolicy = data.text
    if flags.prompt:
        items = text.clean([(f"--prompt {i + 1}", p) for i, p in enumerate(flags.prompt)], "--prompt")
        if not items:
            raise RecipeError("--prompt: no prompt is UTF-8 text (data.decode_errors is skip)")
        return [{"prompt": p, "source": where} for where, p in items]
    path = expand_path(flags.prompts, "--prompts")
    if path.lower().endswith(".txt"):
        if not os.path.isfile(path):
            raise RecipeError(f"--prompts: file '{path}' does not exist")
        with open(path, "rb") as f:  # a line at a time, each at most data.max_row_bytes
            lines = [(f"{path} line {n}", line) for n, raw in text.lines(f, lambda n: f"--prompts: '{path}' line {n}")
                     if (line := decode(raw)).strip()]
        if not lines:
            raise RecipeError(f"--prompts: '{path}' holds no prompt; write one prompt per line")
        lines = text.clean(lines, path)
        if not lines:
            raise RecipeError(f"--prompts: '{path}' holds no prompt that is UTF-8 text (data.decode_errors is skip)")
        return [{"prompt": line, "source": where} for where, line in lines]
    from rllight.data.module import read_prompts

    return read_prompts(path, "--prompts", data.fields.prompt_key, text)


def _fit_prompts(session: Session, rows: list[dict], mode: str) -> list[dict]:
    """The rows, each with its chat ``messages``, fitted to the model's context as ``data.long_prompts`` (``mode``)
    says: a prompt's tokens plus ``max_new_tokens`` within the model's positions (``rllight.data.context``)."""
    from rllight.data.context import ContextFit, model_context

    for row in rows:
        row["messages"] = session.messages(row["prompt"])
    context = model_context(getattr(session.policy, "config", None))
    if context is None:
        return rows
    fit = ContextFit(session.tokenizer, lambda messages: encode(session.tokenizer, messages), context, mode)
    return fit.fit(rows, session.engine.max_new_tokens, "--max_new_tokens", "the prompts")


def generate(session: Session, rows: list[dict], num_samples: int, output: str | None) -> None:
    """Generate ``num_samples`` responses per row, written as JSON lines to ``output`` or printed."""
    sink = None
    if output:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
            sink = open(output, "w", encoding="utf-8")
        except OSError as err:
            raise RecipeError(f"--output: cannot write '{output}' ({err.strerror or err}); give a file path this "
                              "user can write to") from None
    several = len(rows) * num_samples > 1
    try:
        for start in range(0, len(rows), 16):  # written as they come, a batch of prompts at a time
            batch = [(row, k) for row in rows[start : start + 16] for k in range(num_samples)]
            replies = session.reply([row.get("messages") or session.messages(row["prompt"]) for row, _ in batch])
            for (row, k), (text, tokens, cut) in zip(batch, replies):
                if sink is not None:
                    record = {"source": row["source"], "prompt": row["prompt"], "sample": k, "response": text,
                              "tokens": tokens, "truncated": cut}
                    if "answer" in row:
                        record["answer"] = row["answer"]
                    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                    sink.flush()
                else:
                    if several:
                        print(f"### {row['source']}" + (f", sample {k + 1}" if num_samples > 1 else ""))
                    print(text, flush=True)
    finally:
        if sink is not None:
            sink.close()
    if output:
        print(f"rllight generate: {len(rows) * num_samples} responses written to {output}", file=sys.stderr)


def chat(session: Session, stdin=None, policy: TextPolicy | None = None) -> None:
    """Read user messages line by line and print each reply; the conversation is kept until ``/reset``;
    ``/exit`` or the end of input ends it. The ``>>`` prompt is shown only at a terminal, so piped output is
    the replies alone. Each line is read under ``policy`` (``data.decode_errors``, ``data.max_row_bytes``:
    ``rllight.data.text``): bytes that are not UTF-8 reach it as lone surrogates, never as an exception."""
    stdin, policy = stdin or sys.stdin, policy or TextPolicy()
    if hasattr(stdin, "reconfigure"):
        stdin.reconfigure(errors="surrogateescape")
    interactive = stdin.isatty()
    if interactive:
        print("rllight chat: /reset starts a new conversation, /exit or Ctrl-D ends", file=sys.stderr)
    history: list[dict] = []
    for number in itertools.count(1):
        if interactive:
            try:
                line = input(">> ")
            except EOFError:
                print(file=sys.stderr)
                return
        else:
            line = stdin.readline(policy.max_row_bytes + 2)
            if not line:
                return
            if len(line.rstrip("\r\n")) > policy.max_row_bytes:
                raise policy.too_long(f"rllight chat: input line {number}")
        kept = policy.clean([(f"input line {number}", line.strip())], "rllight chat")
        text = kept[0][1] if kept else ""
        if not text:
            continue
        if text in EXIT_WORDS:
            return
        if text in RESET_WORDS:
            history = []
            continue
        history.append({"role": "user", "content": text})
        reply, _, _ = session.reply([session.system + history])[0]
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def run(command: str, argv: list[str], make_cli: Callable[[list[str]], object]) -> None:
    """``rllight generate|chat <argv>``; ``make_cli`` parses and builds a recipe (without running it) from the
    options that are not the command's own."""
    flags, recipe_argv = _parser(command).parse_known_args(argv)
    flags.command = command
    cli = _recipe(recipe_argv, make_cli)
    if command == "generate":
        checked("--num_samples", flags.num_samples, PositiveInt)
        rows = _prompt_rows(flags, cli.datamodule)  # a bad file fails before the model loads
    session = _load(cli, flags)
    if command == "generate":
        rows = _fit_prompts(session, rows, cli.datamodule.long_prompts)
        generate(session, rows, flags.num_samples, flags.output and expand_path(flags.output, "--output"))
        return
    if not getattr(session.tokenizer, "chat_template", None):
        raise RecipeError("rllight chat: the model's tokenizer has no chat template (a base model?); use "
                          "rllight generate --prompt TEXT, which gives it the text as it is")
    chat(session, policy=cli.datamodule.text)
