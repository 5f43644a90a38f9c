"""The learning sanity check's task for the tiny model (``tests/test_sanity_check.py``): what it rewards, the fixed
prompts it trains on, and the overlay that runs ``recipes/quickstart.yaml`` on them.

The tiny model (``rllight.testing.build_tiny_model``: random weights, a 300-token byte-level vocabulary) cannot do
arithmetic, so its task is one it can learn in a few dozen steps: two response tokens, the first beginning with an
ASCII letter or digit and the second ending with another ASCII character (punctuation, a space, a control
character). Each is true of about a quarter of the vocabulary, so the random model earns half the reward often and
the whole of it in about one sample of fifteen: groups of 8 have some spread, and training must move both tokens'
distributions, towards opposite kinds of character, to pass. The opposite kinds are what make a misaligned mask
fail: a model this small carries a preference learnt at one position over to the other, so a task that wanted the
same kind of token at both would be learnt through either token alone, and one whose second token may be most
characters would be right half the time with the first token alone. Each bug the check must catch leaves the task
short: a flipped advantage sign unlearns it, an engine that never gets the weights keeps sampling the random model,
and a response mask one token off (either way) trains one of the two tokens only, which drags the other the wrong
way.
"""

from __future__ import annotations

import json
import os

import yaml

from rllight.rewards import Verifier

PROMPTS = ["What is 2 + 3?", "What is 7 + 1?", "What is 4 + 4?", "What is 9 + 6?"]
"""The fixed prompt set: one training batch (``data.batch_size`` 4), so every step sees every prompt."""
RESPONSE_TOKENS = 2
UPDATES_PER_STEP = 2
"""The quickstart's minibatches: 4 prompts x 8 responses, minibatches of 16 (``trainer.max_steps`` counts updates)."""


def _letter_or_digit(char: str) -> bool:
    return char.isascii() and char.isalnum()


def _other_ascii(char: str) -> bool:
    return char != "" and char.isascii() and not char.isalnum()


class OpensAlnumEndsOther(Verifier):
    """Half the reward for a response whose first character is an ASCII letter or digit, half for one whose last
    character is another ASCII character: with two response tokens, one half for each token. Correct with both
    (the full reward, 1.0)."""

    def __call__(self, response: str, answer: str) -> float:
        return 0.5 * _letter_or_digit(response[:1]) + 0.5 * _other_ascii(response[-1:])


def sanity_overlay(tmp_path, steps: int, seed: int = 0, worker: bool = False) -> str:
    """An overlay (after ``tests.helpers.tiny_overrides``) that trains the tiny model on ``PROMPTS`` with
    ``OpensAlnumEndsOther`` for ``steps`` RL steps, two response tokens each at temperature 1, logging to
    TensorBoard in ``tmp_path``: the logs the sanity check tool reads. With ``worker``, the engine generates in a
    worker process holding its own copy of the weights (``rllight.rollout.worker.ProcessEngine``), which only a
    weight sync updates. Returns its path."""
    data = os.path.join(tmp_path, "sanity_prompts.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"prompt": p, "answer": str(i), "data_source": "sanity"}) + "\n"
                     for i, p in enumerate(PROMPTS))
    sampling = {"max_new_tokens": RESPONSE_TOKENS, "temperature": 1.0}
    engine = {"class_path": "rllight.rollout.HFEngine", "init_args": sampling}
    if worker:
        engine = {"class_path": "rllight.rollout.worker.ProcessEngine",
                  "init_args": {"engine": {"class_path": "rllight.rollout.HFEngine"}, **sampling, "sync_every": 1,
                                "timeout_seconds": 120}}
    cfg = {
        "seed_everything": seed,
        "trainer": {"max_steps": steps * UPDATES_PER_STEP, "logger": True},
        "model": {"rollout": engine, "reward": {"class_path": "sanity_task.OpensAlnumEndsOther"}},
        "data": {"train_files": [data], "batch_size": len(PROMPTS)},
    }
    path = os.path.join(tmp_path, "sanity_overlay.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path
