"""Masked importance sampling (token, sequence, IcePop): the pure functions against hand-computed values, the
loss wrapper, and a run whose sampler's log-probs differ from the trainer's, where the mask changes the update."""

import math
import os

import pytest
import torch
from torch.testing import assert_close

from conftest import RECIPES
from helpers import build, tiny_overrides
from rllight.algorithms import icepop_weight, sequence_is_mask, token_is_mask
from rllight.errors import RecipeError
from rllight.strategies import GSPO, ClippedSurrogate, MaskedIS

from test_baselines import _rollout

# old - sample = [0, ln 2, -ln 4, 0]: ratios r = [1, 2, 0.25, 1]; the last column is padding.
OLD = torch.tensor([[0.0, math.log(2.0), -math.log(4.0), 0.0]])
SAMPLE = torch.zeros(1, 4)
MASK = torch.tensor([[1, 1, 1, 0]])


def test_token_mask_hand_computed():
    assert_close(token_is_mask(OLD, SAMPLE, 0.5, 2.0), torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    assert_close(token_is_mask(OLD, SAMPLE, 0.5, 1.5), torch.tensor([[1.0, 0.0, 0.0, 1.0]]))


def test_sequence_mask_uses_the_geometric_mean_of_the_response_tokens():
    # mean log r over the 3 response tokens = (0 + ln 2 - ln 4) / 3 = -ln 2 / 3: g = 2 ** (-1/3) = 0.794
    assert_close(sequence_is_mask(OLD, SAMPLE, MASK, 0.5, 2.0), torch.ones(1, 4))
    assert_close(sequence_is_mask(OLD, SAMPLE, MASK, 0.8, 2.0), torch.zeros(1, 4))  # 0.794 < 0.8: all dropped
    # The padding column does not count: with it (log r 0 there) the mean would be -ln 2 / 4, g = 0.84 > 0.8.
    assert_close(sequence_is_mask(OLD, SAMPLE, torch.ones(1, 4), 0.8, 2.0), torch.ones(1, 4))


def test_icepop_keeps_the_ratio_inside_the_band_and_drops_the_rest():
    assert_close(icepop_weight(OLD, SAMPLE, 0.5, 5.0), torch.tensor([[1.0, 2.0, 0.0, 1.0]]))
    assert_close(icepop_weight(OLD, SAMPLE, 0.2, 1.5), torch.tensor([[1.0, 0.0, 0.25, 1.0]]))


def test_masked_is_wraps_a_per_token_loss():
    # ClippedSurrogate at r = 1 (logprobs = old) gives -A per token (A = 1); the token mask [0.5, 2] drops the third.
    logprobs = OLD.clone().requires_grad_()
    batch = _rollout(b=1, t=4, old_logprobs=OLD, sample_logprobs=SAMPLE, advantages=torch.ones(1, 4))
    batch.response_mask = MASK
    loss, stats = MaskedIS(ClippedSurrogate(), mask="token", low=0.5, high=2.0)(logprobs, batch)
    assert_close(loss, torch.tensor([[-1.0, -1.0, 0.0, -1.0]]))
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0, 0.0, -1.0]]))
    assert_close(stats["policy/is_masked_frac"], torch.tensor(1 / 3))
    icepop, _ = MaskedIS(ClippedSurrogate(), mask="icepop")(OLD.clone(), batch)
    assert_close(icepop, torch.tensor([[-1.0, -2.0, 0.0, -1.0]]))
    with pytest.raises(RecipeError, match="per-token"):
        MaskedIS(GSPO())(torch.zeros(1, 4), batch)
    with pytest.raises(RecipeError, match="mask must be one of token, sequence, icepop"):
        MaskedIS(ClippedSurrogate(), mask="tokens")
    with pytest.raises(RecipeError, match="0 <= low < high"):
        MaskedIS(ClippedSurrogate(), low=2.0, high=1.0)


def _trained(tmp_path, tiny_model_dir, policy_loss):
    """Weights after 2 RL steps on the same rollouts (their sampling log-probs are uniform, the trainer's not)."""
    engine = {"class_path": "user_strategies.ScriptedEngine", "init_args": {"max_new_tokens": 6}}
    tmp_path.mkdir()
    overlay = tiny_overrides(tmp_path, tiny_model_dir, rollout=engine, policy_loss=policy_loss)
    cli = build(os.path.join(RECIPES, "grpo.yaml"), overlay, "--trainer.max_steps", "2",
                "--model.batching.minibatch_size", "null", "--data.batch_size", "4")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    params = {n: p.detach().clone() for n, p in cli.model.policy.named_parameters()}
    return params, {k: float(v) for k, v in cli.trainer.callback_metrics.items()}


@pytest.mark.parametrize("mask", ["token", "sequence", "icepop"])
def test_each_mask_changes_the_run(tmp_path, tiny_model_dir, mask):
    plain = {"class_path": "rllight.strategies.ClippedSurrogate"}
    base, _ = _trained(tmp_path / "plain", tiny_model_dir, plain)
    # A band around the typical ratio of these rollouts, so that some tokens or responses fall outside it.
    bounds = {"token": (0.9, 1.2), "sequence": (0.95, 1.05), "icepop": (0.9, 1.2)}[mask]
    masked, metrics = _trained(tmp_path / mask, tiny_model_dir, {
        "class_path": "rllight.strategies.MaskedIS",
        "init_args": {"loss": plain, "mask": mask, "low": bounds[0], "high": bounds[1]}})
    assert 0 < metrics["train/policy/is_masked_frac"] < 1, metrics
    assert any(not torch.equal(base[n], p) for n, p in masked.items())
