"""What the distillation tests share: held-out responses of the student to score its distance to the teacher on."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def held_out(student_dir: str, n: int = 6) -> list[tuple[list[int], list[int]]]:
    """Responses the untrained student samples to prompts it never trains on (fixed seed), as token ids."""
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    model = AutoModelForCausalLM.from_pretrained(student_dir)
    torch.manual_seed(1234)
    rows = []
    for a, b in [(41, 17), (58, 33), (76, 29)]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                            add_generation_prompt=True, return_dict=True)["input_ids"]
        out = model.generate(torch.tensor([ids]), do_sample=True, max_new_tokens=6, num_return_sequences=n // 3,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for seq in out[:, len(ids):].tolist():
            end = seq.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in seq else len(seq)
            rows.append((ids, seq[:end]))
    return rows
