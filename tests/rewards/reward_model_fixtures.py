"""A tiny reward model for the tests of ``rllight.rewards.reward_model``, and worker children that misbehave on
purpose, in a module the reward model's worker process can import (it gets the trainer's sys.path, where the tests'
conftest puts this folder)."""

import os
import signal
import time

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

DIE_MARKER = "RLLIGHT_TEST_DIE_MARKER"
"""The environment variable naming a file: a worker dies on a ``DIE`` text only while that file does not exist (it
makes the file first), so that its restart scores the batch."""


def make_classifier(path, tiny_model_dir: str, head_sign: float = 1.0, num_labels: int = 1) -> str:
    """A tiny ``LlamaForSequenceClassification`` (the tiny Llama's shape, seeded weights) with the tiny model's
    tokenizer, saved to ``path``. ``head_sign`` -1 negates the score head: the same classifier, opposite scores."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.num_labels, config.pad_token_id = num_labels, tokenizer.pad_token_id
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():  # a head large enough that the scores spread over a few units
        model.score.weight.copy_(head_sign * torch.randn_like(model.score.weight))
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def serve_misbehaving(connection) -> None:
    """``serve_worker`` whose scoring never returns on a batch with a text holding ``HANG``, and SIGKILLs its own
    process on one holding ``DIE`` (once per ``DIE_MARKER`` file when that variable is set, else every time)."""
    from rllight.rewards import reward_model

    forward = reward_model.RewardModel.forward

    def misbehaving(self, texts):
        joined = " ".join(t[0] for t in texts)
        while "HANG" in joined:
            time.sleep(1)
        if "DIE" in joined:
            marker = os.environ.get(DIE_MARKER)
            if not marker or not os.path.exists(marker):
                if marker:
                    open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return forward(self, texts)

    reward_model.RewardModel.forward = misbehaving
    reward_model.serve_worker(connection)
