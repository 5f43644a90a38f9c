"""The learning sanity check (``tools/sanity_check.py``) shortened to the tiny model, and the bugs it must catch.

Each case trains ``recipes/quickstart.yaml`` on the tiny model's fixed task (``sanity_task``: 4 prompts, 8 samples
each, two response tokens) for ``STEPS`` RL steps in this process, then reads the run's training accuracy from its
TensorBoard log and judges it as the tool does (``accuracy_curve``, ``judge``): a correct trainer must bring the
``WINDOW``-step moving average to ``BAR``, and a trainer with one of three bugs must not. Each bug is injected by
patching the code under test for the one run, never by editing it:

- the advantage's sign flipped: ``rllight.module.episode_advantages`` (where the module gets every estimator's
  advantages) returns them negated;
- the response mask one token late, or one token early: ``rllight.module.deal_rollout`` (the last step before the
  rollout is scored and trained on; the rewards and the logged accuracy are already computed) hands on the rollout
  with its ``response_mask`` shifted by one column, zero-filled: the loss and the attention miss each response's
  first token (late; and take the padding after a response that ended early) or its last token (early);
- the engine stops receiving the weights: ``ProcessEngine.update_weights`` does nothing. The Hugging Face engine in
  the training process samples from the live policy, or from a lower-precision copy it refills from the policy at
  every generation (its ``update_weights`` has nothing to do unless it keeps a copy under FSDP), so it cannot lose
  the weights; the engine in a worker process holds its own copy, which only
  ``update_weights`` refreshes. That case and its correct twin run with it.

The settings keep every case to a few seconds (the worker's start adds a few) with a margin either side, measured
over ten seeds when they were chosen: a correct trainer passes the bar well within the steps, and every bug's best
window stays far below it (``CLEAR_FAIL``).
"""

import os

import pytest
import torch
from conftest import RECIPES
from helpers import load_tool, tiny_overrides
from sanity_task import sanity_overlay

import rllight.module
from rllight.app.cli import main
from rllight.rollout.worker import ProcessEngine

STEPS, WINDOW, BAR = 60, 5, 0.8
CLEAR_FAIL = 0.3
"""A bug's best window average stays below this: it fails by a wide margin, not by a hair under the bar."""


def flip_advantage_sign(monkeypatch) -> None:
    real = rllight.module.episode_advantages

    def negated(estimator, rollout):
        advantages, returns = real(estimator, rollout)
        return -advantages, returns

    monkeypatch.setattr(rllight.module, "episode_advantages", negated)


def shift_response_mask(monkeypatch, by: int) -> None:
    """The rollout entering scoring and the updates has its response mask ``by`` columns later (1) or earlier (-1)."""
    real = rllight.module.deal_rollout

    def shifted(rollout, ranks, pad_id):
        rollout = real(rollout, ranks, pad_id)
        mask = rollout.response_mask
        padded = torch.nn.functional.pad(mask, (1, 0) if by > 0 else (0, 1))
        rollout.response_mask = padded[:, :-1] if by > 0 else padded[:, 1:]
        return rollout

    monkeypatch.setattr(rllight.module, "deal_rollout", shifted)


def stop_weight_syncs(monkeypatch) -> None:
    monkeypatch.setattr(ProcessEngine, "update_weights", lambda self, model: {})


CASES = {  # name: (the bug, or None; generate in a worker process)
    "correct": (None, False),
    "correct, engine in a worker": (None, True),
    "advantage sign flipped": (flip_advantage_sign, False),
    "response mask one token late": (lambda mp: shift_response_mask(mp, 1), False),
    "response mask one token early": (lambda mp: shift_response_mask(mp, -1), False),
    "engine gets no weights": (stop_weight_syncs, True),
}


@pytest.mark.slow  # six short training runs in this process, two with a worker process (about half a minute)
@pytest.mark.parametrize("case", list(CASES))
def test_sanity_check_passes_a_correct_trainer_and_fails_each_bug(case, tiny_model_dir, tmp_path, monkeypatch):
    bug, worker = CASES[case]
    if bug is not None:
        bug(monkeypatch)
    tool = load_tool("sanity_check")
    overlays = [tiny_overrides(tmp_path, tiny_model_dir), sanity_overlay(tmp_path, STEPS, worker=worker)]
    main(["fit", "--config", os.path.join(RECIPES, "quickstart.yaml"), *[a for o in overlays for a in ("--config", o)]])
    curve = tool.accuracy_curve(str(tmp_path), STEPS)
    assert len(curve) == STEPS
    verdict = tool.judge(curve, BAR, WINDOW)
    shown = f"{case}: best {WINDOW}-step average {verdict['best']:.2f}, curve {[round(a, 2) for a in curve]}"
    if bug is None:
        assert verdict["passed"], shown
    else:
        assert not verdict["passed"] and verdict["best"] < CLEAR_FAIL, shown
