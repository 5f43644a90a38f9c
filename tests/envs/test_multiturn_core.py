"""What the trainer does with a multi-turn trajectory: observation tokens are context (attended to, never
trained), the outcome reward sits on the model's last token, GAE skips observations."""

import torch
from torch.testing import assert_close

from rllight.algorithms import gae
from rllight.types import Rollout


def _two_turns():
    # Response region of one row: model m m | observation o o | model m | padding.
    #   position:       0  1  2  3  4  5
    response_mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    context_mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    return Rollout(prompt_ids=torch.tensor([[5, 6]]), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                   response_ids=torch.tensor([[7, 8, 9, 10, 11, 0]]), response_mask=response_mask,
                   sample_logprobs=torch.zeros(1, 6), truncated=torch.tensor([False]), group_ids=torch.tensor([0]),
                   answers=["1"], texts=["x"], rewards=torch.tensor([1.0]), context_mask=context_mask)


def test_observations_are_attended_to_and_the_reward_sits_on_the_last_model_token():
    r = _two_turns()
    assert r.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0]]  # prompt, both turns and the observation
    assert r.last_action_index.tolist() == [4]  # not response_lengths - 1 = 2
    assert r.response_lengths.tolist() == [3]  # the model's tokens
    assert r.outcome_token_rewards().tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]
    # trim keeps the columns up to the last real token (4), observation included.
    assert r.trim().response_ids.shape[1] == 5


def test_gae_skips_observation_tokens():
    # Model tokens at 0, 1, 4 with values 0.5, 0.6, 0.8; reward 1 on position 4; gamma 1, lambda 0.5.
    # Packed: V = [0.5, 0.6, 0.8], r = [0, 0, 1]:
    #   delta_2 = 1 - 0.8 = 0.2;  delta_1 = 0 + 0.8 - 0.6 = 0.2;  delta_0 = 0 + 0.6 - 0.5 = 0.1
    #   A_2 = 0.2;  A_1 = 0.2 + 0.5 * 0.2 = 0.3;  A_0 = 0.1 + 0.5 * 0.3 = 0.25
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    values = torch.tensor([[0.5, 0.6, 9.0, 9.0, 0.8, 9.0]])  # values at observations must not leak in
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, 1.0, 0.5)
    assert_close(adv, torch.tensor([[0.25, 0.3, 0.0, 0.0, 0.2, 0.0]]))
    assert_close(ret, torch.tensor([[0.75, 0.9, 0.0, 0.0, 1.0, 0.0]]))
    # A row without gaps in the same batch is computed as before.
    mask2 = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    values2 = torch.cat([values, torch.tensor([[0.5, 0.6, 0.8, 0.0, 0.0, 0.0]])])
    rewards2 = torch.cat([rewards, torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])])
    adv2, _ = gae(rewards2, values2, mask2, 1.0, 0.5)
    assert_close(adv2[1], torch.tensor([0.25, 0.3, 0.2, 0.0, 0.0, 0.0]))
    assert_close(adv2[0], adv[0])


def test_log_probs_of_model_tokens_see_the_observation(tiny_model_dir):
    """The trainer's forward pass reads a multi-turn row as one sequence: the log-prob of the second
    model turn depends on the observation before it (it is attended to), and matches a plain forward of
    prompt + response over the real tokens."""
    from transformers import AutoModelForCausalLM

    from rllight.models import response_hidden_states

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    r = _two_turns()
    with torch.no_grad():
        hidden = response_hidden_states(model.get_decoder(), r)
        logits = model.get_output_embeddings()(hidden)
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
        full = model(ids).logits  # the same sequence, no padding
    # Position 4 of the response (token 11) is predicted from position 2 + 4 - 1 = 5 of the full sequence.
    assert_close(logits[0, 4], full[0, 5], rtol=1e-4, atol=1e-4)
    changed = _two_turns()
    changed.response_ids[0, 2] = 3  # a different observation token
    with torch.no_grad():
        logits2 = model.get_output_embeddings()(response_hidden_states(model.get_decoder(), changed))
    assert not torch.allclose(logits2[0, 4], logits[0, 4])


def test_self_imitation_replays_a_multi_turn_episode_whole():
    """A stored episode keeps its observations (as context) and replays with the same masks: the model's
    turns are trained, the observation between them is attended to, not joined away."""
    from rllight.callbacks import SelfImitation
    from rllight.callbacks.replay import build_rollout

    r = _two_turns()
    r.correct = torch.tensor([1.0])
    cb = SelfImitation(every_n_steps=1, batch_size=4)
    cb.on_rollout(None, None, r)
    (entry,) = cb.entries
    assert entry["response_ids"].tolist() == [7, 8, 9, 10, 11]  # padding dropped, the observation kept
    assert entry["action_mask"].tolist() == [1, 1, 0, 0, 1]
    replayed = build_rollout(cb.entries, pad_id=0)
    assert replayed.response_mask.tolist() == [[1, 1, 0, 0, 1]]
    assert replayed.context_mask.tolist() == [[1, 1, 1, 1, 1]]


def test_cat_of_single_and_multi_turn_parts_keeps_every_context():
    multi = _two_turns()
    single = _two_turns()
    single.context_mask = None
    single.response_mask = torch.tensor([[1, 1, 1, 0, 0, 0]])
    for parts in ((single, multi), (multi, single)):
        out = Rollout.cat(list(parts), pad_id=0)
        expected = {id(single): [1, 1, 1, 0, 0, 0], id(multi): [1, 1, 1, 1, 1, 0]}
        assert out.context_mask.tolist() == [expected[id(p)] for p in parts]
