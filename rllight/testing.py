"""A tiny causal LM and tokenizer built in-process (no download), for tests and smoke runs."""

from __future__ import annotations

import os

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_model(path: str, hidden_size: int = 32, num_layers: int = 2, seed: int = 0) -> str:
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
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id,
        bos_token_id=fast.bos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    tmp = f"{path}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    os.replace(tmp, path)
    return path
