"""Scores per response token (``Scores.token_scores``): checked against each sample's response tokens, mixed by
``Weighted``, laid on the rollout's response tokens (``Rollout.dense_rewards``), added to the outcome's token
rewards so that GAE at lambda = gamma = 1 with a zero critic gives each token the outcome plus the token scores from it
on (the return of a process reward), refused in one line by an estimator that reads only the outcome."""

from types import SimpleNamespace

import pytest
import torch

from rllight.errors import RecipeError
from rllight.models import HFModel
from rllight.module import RLModule
from rllight.rewards import IntegerMatch, Reward, Sample, Scores, Weighted, checked
from rllight.rollout import HFEngine
from rllight.rollout.producer import RolloutProducer
from rllight.strategies import GAE, GroupRelative, ReinforcePP
from rllight.types import Rollout


def sample(n_tokens: int, response: str = "7") -> Sample:
    return Sample(prompt="Q", messages=None, response=response, response_ids=list(range(n_tokens)), answer="7",
                  row={}, group=0)


class PerToken(Reward):
    """Score 1 per response; token t of a response scores 0.1 * (t + 1)."""

    def score(self, samples):
        return Scores(values=[1.0] * len(samples),
                      token_scores=[[0.1 * (t + 1) for t in range(len(s.response_ids))] for s in samples])


def test_token_scores_are_checked_against_each_samples_response_tokens():
    samples = [sample(2), sample(3)]
    out = checked(PerToken(), samples, Scores(values=[1, 2], token_scores=[[1, 2], None]))
    assert out.token_scores == [[1.0, 2.0], None]
    with pytest.raises(RecipeError, match=r"returned 2 token scores for sample 1, whose response has 3 tokens"):
        checked(PerToken(), samples, Scores(values=[1, 2], token_scores=[[1, 2], [1, 2]]))
    with pytest.raises(RecipeError, match=r"token scores for 1 samples of 2"):
        checked(PerToken(), samples, Scores(values=[1, 2], token_scores=[[1, 2]]))
    out = checked(PerToken(), samples, Scores(values=[1, 2], token_scores=[[1, float("nan")], [1, 2, 3]],
                                                           failed={1: "judge down"}))
    assert out.token_scores == [None, None]  # the first not finite, the second failed: neither trains
    assert out.failed == {0: "a token score is not finite", 1: "judge down"} and out.values == [0.0, 0.0]


def test_weighted_weighs_the_token_scores_of_the_components_that_give_them():
    mix = Weighted({"steps": PerToken(), "exact": IntegerMatch()}, weights={"steps": 2.0, "exact": 1.0},
                        correct_from="exact")
    out = checked(mix, [sample(3), sample(2, response="8")], mix.score([sample(3), sample(2, response="8")]))
    assert out.values == pytest.approx([2.0 + 1.0, 2.0 + 0.0])
    assert out.token_scores == [pytest.approx([0.2, 0.4, 0.6]), pytest.approx([0.2, 0.4])]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return HFModel(tiny_model_dir).load()


def test_the_rollout_holds_each_token_score_on_its_response_token(policy):
    torch.manual_seed(0)
    producer = RolloutProducer(HFEngine(max_new_tokens=5), PerToken())
    producer.bind(*policy)
    rows = [{"messages": [{"role": "user", "content": q}], "answer": a}
            for q, a in (("1 + 1 =", "2"), ("2 + 5 =", "7"))]
    rollout = producer.sample(rows, 2)
    lengths = rollout.response_mask.sum(-1).tolist()
    for i, n in enumerate(lengths):
        assert rollout.dense_rewards[i, :n].tolist() == pytest.approx([0.1 * (t + 1) for t in range(int(n))])
        assert rollout.dense_rewards[i, int(n):].abs().sum() == 0
    assert rollout.extras["reward/token_scores_sum"] == pytest.approx(
        sum(sum(0.1 * (t + 1) for t in range(int(n))) for n in lengths) / len(lengths))


def _rollout(dense: torch.Tensor | None) -> Rollout:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return Rollout(prompt_ids=torch.zeros((2, 1), dtype=torch.long), prompt_mask=torch.ones((2, 1), dtype=torch.long),
                   response_ids=torch.ones((2, 4), dtype=torch.long), response_mask=mask,
                   sample_logprobs=torch.zeros((2, 4)), truncated=torch.zeros(2, dtype=torch.bool),
                   group_ids=torch.tensor([0, 0]), answers=["", ""], texts=["", ""], rewards=torch.tensor([1.0, 0.0]),
                   correct=torch.tensor([1.0, 0.0]), values=torch.zeros((2, 4)), dense_rewards=dense)


def test_gae_at_lambda_one_gives_each_token_the_outcome_plus_the_token_scores_from_it_on():
    dense = torch.tensor([[0.5, -0.25, 0.125, 0.0], [0.3, 0.2, 0.0, 0.0]])
    rollout = _rollout(dense)
    RLModule.estimate_advantages(SimpleNamespace(kl=None, advantage=GAE(gamma=1.0, lam=1.0, whiten=False)), rollout)
    expected = torch.tensor([[1.375, 0.875, 1.125, 0.0], [0.5, 0.2, 0.0, 0.0]])  # outcome + suffix sums of dense
    assert torch.allclose(rollout.returns * rollout.response_mask, expected)
    assert torch.allclose(rollout.advantages * rollout.response_mask, expected)
    without = _rollout(None)
    RLModule.estimate_advantages(SimpleNamespace(kl=None, advantage=GAE(gamma=1.0, lam=1.0, whiten=False)), without)
    assert torch.allclose(without.returns * without.response_mask,
                          torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_an_estimator_of_the_outcome_alone_refuses_token_scores_in_one_line():
    module = SimpleNamespace(kl=None, advantage=GroupRelative())
    with pytest.raises(RecipeError, match=r"^model.reward gives scores per response token, which model.advantage "
                                          r"GroupRelative does not read"):
        RLModule.estimate_advantages(module, _rollout(torch.zeros((2, 4))))
    RLModule.estimate_advantages(SimpleNamespace(kl=None, advantage=ReinforcePP()), _rollout(torch.ones((2, 4))))


def test_a_rollout_part_without_token_scores_joins_one_with_them_as_zeros():
    joined = Rollout.cat([_rollout(torch.ones((2, 4))), _rollout(None)], pad_id=0)
    assert joined.dense_rewards.shape == (4, 4)
    assert joined.dense_rewards[:2].sum() == 8 and joined.dense_rewards[2:].sum() == 0
