"""The chunked log-prob / entropy path equals the direct one, in values and gradients."""

import pytest
import torch

from rllight.algorithms import chunked_logprobs_and_entropy, logprobs_and_entropy


def _direct(hidden, weight, bias, targets, temperature):
    return logprobs_and_entropy(torch.nn.functional.linear(hidden, weight, bias), targets, temperature)


@pytest.mark.parametrize("chunk_size", [1, 5, 21, 1000])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_direct_values_and_gradients(chunk_size, use_bias, temperature):
    g = torch.Generator().manual_seed(chunk_size)
    hidden = torch.randn(3, 7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=True) if use_bias else None
    targets = torch.randint(0, 50, (3, 7), generator=g)
    g_lp, g_ent = (
        torch.randn(3, 7, generator=g, dtype=torch.float64),
        torch.randn(3, 7, generator=g, dtype=torch.float64),
    )
    params = [hidden, weight] + ([bias] if use_bias else [])

    lp, ent = _direct(hidden, weight, bias, targets, temperature)
    expected = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), params)
    lp2, ent2 = chunked_logprobs_and_entropy(hidden, weight, targets, temperature, bias=bias, chunk_size=chunk_size)
    got = torch.autograd.grad((lp2 * g_lp + ent2 * g_ent).sum(), params)

    torch.testing.assert_close(lp2, lp)
    torch.testing.assert_close(ent2, ent)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_chunked_float32_close_to_direct():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 32, generator=g, requires_grad=True)
    weight = torch.randn(300, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, 300, (2, 9), generator=g)
    lp, ent = _direct(hidden, weight, None, targets, 1.0)
    lp2, ent2 = chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=4)
    torch.testing.assert_close(lp2, lp)
    torch.testing.assert_close(ent2, ent)
    assert lp2.dtype == torch.float32


def test_module_paths_agree(tiny_model_dir):
    """The trainer's forward gives the same log-probs and gradients with and without chunking."""
    from rllight.models import HFModel
    from rllight.module import RLModule
    from rllight.settings import Batching

    torch.manual_seed(0)
    grads, outs = [], []
    for chunk in (None, 3):
        module = RLModule(HFModel(tiny_model_dir), batching=Batching(logprob_chunk_size=chunk))
        module.configure_model()
        if not outs:
            rows = [{"messages": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7"}]
            rollout = module.producer.sample(rows, n=3)
        lp, ent, _ = module.scoring.forward(rollout)
        (lp.sum() + ent.sum()).backward()
        outs.append((lp.detach(), ent.detach()))
        grads.append({n: p.grad.clone() for n, p in module.policy.named_parameters()})
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5)


def _grouped_rollout(pad_id, context=False):
    """Six rows, three distinct left-padded prompts (two shared by several rows), responses of different
    lengths; with ``context``, a multi-turn row whose observation tokens are context, not actions."""
    from rllight.rollout.base import pad_left
    from rllight.types import Rollout

    g = torch.Generator().manual_seed(0)
    prompts = [[5, 9, 12, 7], [5, 9, 12, 7], [4, 6], [4, 6], [13, 2, 9, 10, 11], [5, 9, 12, 7]]
    prompt_ids, prompt_mask = pad_left(prompts, pad_id)
    lengths = torch.tensor([6, 3, 1, 5, 6, 2])
    mask = (torch.arange(6)[None] < lengths[:, None]).long()
    context_mask = None
    if context:
        context_mask = mask.clone()
        mask = mask.clone()
        mask[0, 2:4] = 0  # an observation between two model turns
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                   response_ids=torch.randint(3, 60, (6, 6), generator=g) * context_mask_or(mask, context_mask),
                   response_mask=mask, context_mask=context_mask, sample_logprobs=torch.zeros(6, 6),
                   truncated=torch.zeros(6, dtype=torch.bool), group_ids=torch.tensor([0, 0, 1, 1, 2, 0]),
                   answers=["1"] * 6, texts=["x"] * 6, rewards=torch.zeros(6))


def context_mask_or(mask, context_mask):
    return mask if context_mask is None else context_mask


@pytest.mark.parametrize("context", [False, True], ids=["single-turn", "multi-turn"])
def test_shared_prompt_pass_equals_separate_passes_values_and_gradients(tiny_model_dir, context):
    """Rows with the same prompt share one prompt pass (``share_prompts``): the response hidden states
    and every parameter's gradient equal those of one padded pass over every row, to float32 rounding: the
    largest difference of a gradient is at most 1e-5 of that gradient's largest entry (measured 2e-7 for
    the embedding, whose rows sum over the responses in another order)."""
    from rllight.models import HFModel, response_hidden_states

    policy, tok = HFModel(tiny_model_dir).load()
    decoder = policy.get_decoder()
    batch = _grouped_rollout(tok.pad_token_id, context)
    weights = torch.randn(6, 6, policy.config.hidden_size, generator=torch.Generator().manual_seed(1))
    results = []
    for share in (False, True):
        policy.zero_grad(set_to_none=True)
        hidden = response_hidden_states(decoder, batch, share_prompts=share)
        (hidden * weights * batch.valid_mask[..., None]).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((hidden.detach(), grads))
    (plain, plain_grads), (shared, shared_grads) = results
    valid = batch.valid_mask.bool()
    torch.testing.assert_close(shared[valid], plain[valid], rtol=1e-4, atol=1e-5)
    assert shared_grads.keys() == plain_grads.keys() and len(plain_grads) > 10
    for name in plain_grads:
        scale = plain_grads[name].abs().max().item()
        assert (shared_grads[name] - plain_grads[name]).abs().max().item() <= 1e-5 * scale, name
