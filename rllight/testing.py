"""A tiny causal LM and tokenizer built in-process (no download), for tests and smoke runs."""

from __future__ import annotations

import os

from rllight.errors import RecipeError
from rllight.models import HFModel, quiet_transformers

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\nTools:\n' }}{%- for tool in tools %}{{ tool | tojson + '\n' }}"
    "{%- endfor %}{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""``CHAT_TEMPLATE`` with tools in the Hermes format (as Qwen2.5's template renders them): the tools' schemas in
a system message, tool results as ``<tool_response>`` blocks in a user turn."""

HISTORY_REWRITING_TEMPLATE = (
    "{%- set ns = namespace(last=-1) %}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""``CHAT_TEMPLATE`` that rewrites history as Qwen3's does: an assistant turn before the last user turn loses its
``<think>...</think>`` reasoning."""


def build_tiny_model(path: str, hidden_size: int = 32, num_layers: int = 2, seed: int = 0,
                     max_positions: int = 512) -> str:
    """Write a randomly initialised Llama-style model and a byte-level BPE tokenizer with a chat
    template to ``path`` (a Hugging Face folder) and return ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} + {b}? The answer is {a + b}. user assistant system" for a in range(30) for b in range(30)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))  # no blank lines in a log file
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True, pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
        bos_token_id=fast.bos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    tmp = f"{path}.tmp{os.getpid()}"
    with quiet_transformers(messages=False):  # a saved shard's bar is noise in a log
        model.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def warm_up(path: str, steps: int, seed: int = 0, batch_size: int = 32, lr: float = 1e-2) -> None:
    """Fine-tune the model in ``path`` (in place) for ``steps`` supervised steps on the embedded arithmetic task's
    answers in the chat template (``rllight.data.ArithmeticTask``, its own seed), so that it answers with a short
    number and ends its turn. It does not learn arithmetic in so few steps: a few answers in a hundred are right by
    chance, which is what a smoke run needs (rewards that vary within a group, responses that end)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rllight.data import ArithmeticTask
    from rllight.rollout.producer import encode_chat

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows, _ = ArithmeticTask(num_train=1000, num_val=0, seed=seed + 1).splits()
    examples = []
    for row in rows:
        prompt = encode_chat(tokenizer, [{"role": "user", "content": row["prompt"]}])
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((prompt, answer))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=generator).tolist()]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, (prompt, answer) in enumerate(batch):
            n = len(prompt) + len(answer)
            ids[j, :n] = torch.tensor(prompt + answer)
            labels[j, len(prompt):n] = torch.tensor(answer)  # the loss on the answer and the end of turn only
            mask[j, :n] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)


def _cache_home() -> str:
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


class TinyModel(HFModel):
    """A model source for the tiny model of ``build_tiny_model`` (a random Llama, by default 2 layers of width 64
    with 2 attention heads, and a 300-token BPE tokenizer with a chat template), warmed up for ``warm_up_steps``
    steps (``warm_up``): what ``recipes/overlays/smoke.yaml`` puts in place of a recipe's model, so that any recipe
    runs in seconds with no download.

    Nothing is built when the recipe is parsed: the folder is written on first use (``load``, from the module's
    ``configure_model``), under ``cache_dir``, and reused after that (a few seconds the first time).

    Args:
        cache_dir: The model's folder (default ``$XDG_CACHE_HOME/rllight/tiny-...``, else ``~/.cache/rllight/``,
            named by the settings below).
        hidden_size: Width of the model (64: heads of 32, which vLLM's CPU attention supports).
        num_layers: Decoder layers.
        seed: Seed of the random weights and of the warm-up.
        warm_up_steps: Supervised steps on arithmetic answers (0 = the random model, whose responses rarely end
            before the token cap and are almost never right).
        dtype: Parameter dtype.
        max_positions: Positions of the model (``max_position_embeddings``). The tiny tokenizer spends about a token
            per character, several times a real model's, so a recipe's prompts are longer here: 4096 holds the
            longest prompt of a shipped recipe (the model's rotary positions cost no weights).
        chat_template: A chat template instead of the tiny model's (see ``rllight.models.HFModel``; a smoke run keeps
            the recipe model's). None: ChatML with tools in the Hermes format (``TOOLS_CHAT_TEMPLATE``), so that an
            environment that offers tools runs as on a model whose template renders them.
    """

    def __init__(self, cache_dir: str | None = None, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                 warm_up_steps: int = 150, dtype: str = "float32", max_positions: int = 4096,
                 chat_template: str | None = None):
        super().__init__(path="", dtype=dtype, chat_template=chat_template or TOOLS_CHAT_TEMPLATE)
        if hidden_size < 2 or hidden_size % 2 or num_layers < 1 or warm_up_steps < 0 or max_positions < 16:
            raise RecipeError(f"rllight.testing.TinyModel: hidden_size must be even and >= 2, num_layers >= 1, "
                              f"warm_up_steps >= 0 and max_positions >= 16, got {hidden_size}, {num_layers}, "
                              f"{warm_up_steps}, {max_positions}")
        self.cache_dir = cache_dir
        self.hidden_size, self.num_layers, self.seed, self.warm_up_steps = hidden_size, num_layers, seed, warm_up_steps
        self.max_positions = max_positions

    def resolve(self) -> str:
        name = (f"tiny-h{self.hidden_size}-l{self.num_layers}-seed{self.seed}-warm{self.warm_up_steps}"
                f"-p{self.max_positions}")
        target = os.path.expanduser(self.cache_dir or os.path.join(_cache_home(), "rllight", name))
        if os.path.isfile(os.path.join(target, "config.json")):
            return target
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        import torch

        tmp = f"{target}.build{os.getpid()}"
        with torch.random.fork_rng(devices=[]):  # the run's random stream is the same whether it built the model
            build_tiny_model(tmp, hidden_size=self.hidden_size, num_layers=self.num_layers, seed=self.seed,
                             max_positions=self.max_positions)
            if self.warm_up_steps:
                warm_up(tmp, self.warm_up_steps, seed=self.seed)
        try:
            os.replace(tmp, target)  # atomic: a crash mid-build never leaves a half folder
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)  # another process (a second rank) finished first
        return target


def tiny_classifier(model_dir: str) -> str:
    """A one-label sequence classifier (``LlamaForSequenceClassification``, ``num_labels: 1``) with the tiny model's
    body and tokenizer and a seeded score head, in ``<model_dir>-classifier`` (built once): a smoke run's reward
    model (``rllight.app.smoke_mode``)."""
    target = f"{model_dir.rstrip(os.sep)}-classifier"
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The head is new on purpose: no load report of its weights.
    with quiet_transformers(bars=False), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForSequenceClassification.from_pretrained(model_dir, num_labels=1,
                                                               pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():  # a head whose scores spread over a few units
            model.score.weight.copy_(torch.randn_like(model.score.weight))
    return _save(model, tokenizer, target)


def tiny_judge(model_dir: str) -> str:
    """The tiny model with ``yes`` and ``no`` as tokens of their own (its 300-token BPE has neither), in
    ``<model_dir>-judge`` (built once): a smoke run's judge (``rllight.app.smoke_mode``). Their output rows are
    1.5 times those of two digits, the tokens the warmed-up model answers with, plus a little noise: yes and no
    then hold most of the first token's probability (above ``LLMJudge.min_mass``), so a ``yes_logprob`` verdict
    reads a P(yes) (one that barely depends on the response: the check is of the wiring)."""
    target = f"{model_dir.rstrip(os.sep)}-judge"
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["yes", "no"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        out = model.get_output_embeddings().weight
        with torch.no_grad():
            for token, digit in (("yes", "1"), ("no", "2")):
                row, like = tokenizer.convert_tokens_to_ids(token), tokenizer.convert_tokens_to_ids(digit)
                noise = 0.1 * out[like].norm() / out.shape[1] ** 0.5 * torch.randn_like(out[like])
                out[row].copy_(1.5 * out[like] + noise)
    return _save(model, tokenizer, target)


def _save(model, tokenizer, target: str) -> str:
    """Write ``model`` and ``tokenizer`` to ``target`` atomically (another process may have written it first)."""
    tmp = f"{target}.build{os.getpid()}"
    with quiet_transformers(messages=False):  # a saved shard's bar is noise in a log
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


SMOKE_MODEL = "rllight.testing.TinyModel"
"""What ``smoke: true`` (``recipes/overlays/smoke.yaml``) puts in place of every model source of a recipe."""


def class_of(class_path) -> type | None:
    """The class a recipe's ``class_path`` names, or None (not a dotted name, or not a class that imports: the
    parser has already said whether it imports)."""
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) else None


def _model_class(class_path) -> type | None:
    """The class ``class_path`` names when it is an ``rllight.models.HFModel`` (or a subclass), else None."""
    cls = class_of(class_path)
    return cls if cls is not None and issubclass(cls, HFModel) else None


def smoke_models(config) -> list[tuple[str, str]]:
    """Replace, in place, every model source of a parsed recipe (a jsonargparse ``Namespace``) by the tiny model:
    each ``class_path`` that names ``rllight.models.HFModel`` or a subclass (``model.model``, a critic's own
    ``model``, a model a user's component takes) becomes ``model.model`` when that is a ``TinyModel`` already (so
    that every model shares one tokenizer), else ``TinyModel`` with its defaults. Returns ``(key, class_path)`` of
    each source replaced."""
    from argparse import Namespace

    from jsonargparse import Namespace as Config

    policy = config.get("model.model") if isinstance(config, Namespace) else None
    if not (isinstance(policy, Namespace) and _is_tiny(policy.get("class_path"))):
        policy = Config(class_path=SMOKE_MODEL, init_args=Config())
    replaced: list[tuple[str, str]] = []
    for key, parent, name, value in class_nodes(config):
        class_path = value.get("class_path")
        if _model_class(class_path) is None or _is_tiny(class_path):
            continue
        copy = policy.clone()  # each source its own copy: a later change to one leaves the others
        template = (value.get("init_args") or {}).get("chat_template")
        if template is not None:  # the recipe's template (one that renders tools) stays
            if copy.get("init_args") is None:
                copy.init_args = type(copy)()
            copy.init_args.chat_template = template
        set_value(parent, name, copy)
        replaced.append((key, class_path))
    return replaced


def class_nodes(node, prefix: str = ""):
    """``(key, parent, name, value)`` of every ``{class_path: ...}`` node under a parsed recipe ``node`` (a
    ``Namespace`` or a dict; lists walked), depth first; a node the caller replaces (``set_value(parent, name,
    ...)``) is not walked into."""
    from argparse import Namespace

    items = list(node.items()) if isinstance(node, dict) else list(vars(node).items())
    for name, value in items:
        key = f"{prefix}{name}"
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (dict, Namespace)):
                    yield from class_nodes(item, f"{key}.{i}.")
            continue
        if not isinstance(value, (dict, Namespace)):
            continue
        if isinstance(value.get("class_path"), str):
            yield key, node, name, value
            if (node.get(name) if isinstance(node, dict) else getattr(node, name, None)) is not value:
                continue  # replaced
        yield from class_nodes(value, f"{key}.")


def set_value(node, name: str, value) -> None:
    """Set ``name`` of a parsed recipe's ``node`` (a ``Namespace`` or a dict) to ``value``."""
    if isinstance(node, dict):
        node[name] = value
    else:
        setattr(node, name, value)


def _is_tiny(class_path) -> bool:
    cls = _model_class(class_path)
    return cls is not None and issubclass(cls, TinyModel)
