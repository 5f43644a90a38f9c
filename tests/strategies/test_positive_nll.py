"""VAPO's positive-example NLL (PositiveExampleNLL): the paper's normalisation by the correct responses'
tokens, the older one by all the step's tokens, global counts under gradient accumulation, and errors."""

import pytest
import torch
from torch.testing import assert_close

from rllight.errors import RecipeError
from rllight.strategies import ClippedSurrogate, PositiveExampleNLL, SeqMeanTokenMean, TokenMean
from rllight.types import Rollout

# Two responses; the first is correct (3 tokens), the second wrong (2 tokens and one pad).
LOGP = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
CORRECT = torch.tensor([1.0, 0.0])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
N_TOKENS = 5.0  # every valid token of the optimizer step


def _batch(rows=(0, 1)) -> Rollout:
    rows = list(rows)
    b, t = len(rows), MASK.shape[1]
    return Rollout(
        prompt_ids=torch.ones(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
        response_ids=torch.ones(b, t, dtype=torch.long), response_mask=MASK[rows], sample_logprobs=LOGP[rows],
        truncated=torch.zeros(b, dtype=torch.bool), group_ids=torch.zeros(b, dtype=torch.long),
        answers=[""] * b, texts=[""] * b, rewards=CORRECT[rows], correct=CORRECT[rows],
        old_logprobs=LOGP[rows].clone(), advantages=ADV[rows],
    )


def _loss(nll: PositiveExampleNLL, rows=(0, 1), logp=None) -> torch.Tensor:
    """The module's token-mean of one micro-batch with the step's global token count."""
    batch = _batch(rows)
    per_token, _ = nll(LOGP[list(rows)] if logp is None else logp, batch)
    return TokenMean()(per_token, batch.response_mask, num_tokens=N_TOKENS)


def _identity(x):
    return x


def test_paper_form_divides_by_the_correct_tokens():
    # The old log-probs equal the live ones, so every ratio is 1 and the surrogate is -A per token:
    #   row 0: -1 x 3 = -3; row 1: +1 x 2 = +2; token-mean over N = 5: -1 / 5 = -0.2.
    # NLL of the correct response: (1 + 2 + 3) / N_correct = 6 / 3 = 2; times mu = 0.1: 0.2.
    # Total: -0.2 + 0.2 = 0.0.
    nll = PositiveExampleNLL(ClippedSurrogate(), coef=0.1)
    assert nll.normalize == "correct_tokens"  # the default is the paper's
    nll.begin_update(_batch(), TokenMean(), _identity)
    assert_close(_loss(nll), torch.tensor(0.0))


def test_all_tokens_form_rides_on_the_aggregation():
    # NLL 6 divided by all N = 5 tokens: 0.1 x 6 / 5 = 0.12, i.e. the paper's 0.2 x N_correct / N = 0.2 x 3 / 5.
    # Total: -0.2 + 0.12 = -0.08.
    nll = PositiveExampleNLL(ClippedSurrogate(), coef=0.1, normalize="all_tokens")
    nll.begin_update(_batch(), TokenMean(), _identity)
    assert_close(_loss(nll), torch.tensor(-0.08))


def test_gradient_of_the_paper_form():
    # d/d logp_t of the token-mean surrogate is -A_t / N: row 0 -1/5 = -0.2, row 1 +1/5 = +0.2.
    # The NLL adds -mu / N_correct = -0.1 / 3 = -0.033333 to each token of the correct response only.
    logp = LOGP.clone().requires_grad_()
    nll = PositiveExampleNLL(ClippedSurrogate(), coef=0.1)
    nll.begin_update(_batch(), TokenMean(), _identity)
    _loss(nll, logp=logp).backward()
    expected = torch.tensor([[-0.2 - 0.1 / 3] * 3, [0.2, 0.2, 0.0]])
    assert_close(logp.grad, expected)


def test_accumulated_micro_batches_use_the_steps_counts():
    # One optimizer update over two micro-batches, [row 0] and [row 1], each aggregated with N = 5:
    #   micro 0: surrogate -3 / 5 = -0.6; NLL 0.1 x (N / N_correct = 5 / 3) x 6 / 5 = 0.2 -> -0.4
    #   micro 1: surrogate +2 / 5 = +0.4; no correct response -> 0.4
    # Sum: 0.0, the loss of the whole minibatch in one micro-batch (the test above).
    nll = PositiveExampleNLL(ClippedSurrogate(), coef=0.1)
    nll.begin_update(_batch(), TokenMean(), _identity)
    parts = [_loss(nll, rows=(0,)), _loss(nll, rows=(1,))]
    assert_close(parts[0], torch.tensor(-0.4))
    assert_close(parts[1], torch.tensor(0.4))
    assert_close(sum(parts), torch.tensor(0.0))


def test_counts_are_summed_over_ranks():
    # Two ranks with the same rows: global N = 10 and N_correct = 6, and the module divides by the global
    # N = 10. Per rank: surrogate -1 / 10 = -0.1; NLL 0.1 x (10 / 6) x 6 / 10 = 0.1 -> 0.0. The ranks' sum
    # (what DDP's gradient is, as the module scales the loss by the world size) is the paper's term over
    # both ranks: 0.1 x 12 / 6 = 0.2 of NLL against -0.2 of surrogate.
    nll = PositiveExampleNLL(ClippedSurrogate(), coef=0.1)
    nll.begin_update(_batch(), TokenMean(), lambda x: 2 * x)
    per_token, _ = nll(LOGP, _batch())
    rank_loss = TokenMean()(per_token, MASK, num_tokens=2 * N_TOKENS)
    assert_close(rank_loss, torch.tensor(0.0))
    nll_part = TokenMean()(per_token - ClippedSurrogate()(LOGP, _batch())[0], MASK, num_tokens=2 * N_TOKENS)
    assert_close(2 * nll_part, torch.tensor(0.2))


def test_without_the_steps_counts_a_single_micro_batch_is_exact():
    # No begin_update: the micro-batch's own counts, which are the step's when it is the whole minibatch.
    nll = PositiveExampleNLL(ClippedSurrogate(), coef=0.1)
    assert_close(_loss(nll), torch.tensor(0.0))


def test_no_correct_response_adds_nothing():
    # Only the wrong row: surrogate +2 / 5 = 0.4 and no NLL (N_correct = 0 is not a division by zero).
    nll = PositiveExampleNLL(ClippedSurrogate(), coef=0.1)
    nll.begin_update(_batch(rows=(1,)), TokenMean(), _identity)
    loss = _loss(nll, rows=(1,))
    assert torch.isfinite(loss)
    assert_close(loss, torch.tensor(0.4))


def test_bad_normalize_is_a_one_line_error():
    with pytest.raises(RecipeError, match="model.policy_loss.normalize") as err:
        PositiveExampleNLL(normalize="correct")
    assert "\n" not in str(err.value)


def test_paper_form_needs_token_mean():
    nll = PositiveExampleNLL()
    with pytest.raises(RecipeError, match="TokenMean") as err:
        nll.begin_update(_batch(), SeqMeanTokenMean(), _identity)
    assert "\n" not in str(err.value)
    PositiveExampleNLL(normalize="all_tokens").begin_update(_batch(), SeqMeanTokenMean(), _identity)  # any aggregation
