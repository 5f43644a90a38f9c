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

    torch.manual_seed(0)
    grads, outs = [], []
    for chunk in (None, 3):
        module = RLModule(HFModel(tiny_model_dir), logprob_chunk_size=chunk)
        module.configure_model()
        if not outs:
            rows = [{"messages": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7"}]
            rollout = module.producer.sample(rows, n=3)
        lp, ent, _ = module.forward_batch(rollout)
        (lp.sum() + ent.sum()).backward()
        outs.append((lp.detach(), ent.detach()))
        grads.append({n: p.grad.clone() for n, p in module.policy.named_parameters()})
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5)
