"""The HF engine, the Rollout batch, and the trainer's log-probs agree with the sampler's."""

import pytest
import torch

from rllight.models import HFModel
from rllight.module import RLModule
from rllight.rollout import HFEngine, Sampling
from rllight.rollout.base import pad_left, response_mask_from_ids
from rllight.types import Rollout


def test_response_mask_stops_after_first_end_token():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9]])
    mask, truncated = response_mask_from_ids(ids, [2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_pad_left():
    ids, mask = pad_left([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def _module(model_dir, temperature=1.0, max_new_tokens=8):
    module = RLModule(
        HFModel(model_dir), rollout=HFEngine(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=3)
    )
    module.configure_model()
    return module


def test_engine_logprobs_match_trainer_logprobs(tiny_model_dir):
    """Sampling log-probs (from the engine's decode loop, left-padded prompts, KV cache) equal the
    trainer's log-probs of the same tokens (one forward, explicit position ids, temperature applied)."""
    torch.manual_seed(0)
    module = _module(tiny_model_dir, temperature=0.7)
    rows = [{"messages": [{"role": "user", "content": "What is 1 + 2?" + " 3" * k}], "answer": "3"} for k in range(5)]
    rollout = module.producer.sample(rows, n=2)
    # Prompts of different lengths: left padding is exercised, and several generate calls (batch_size 3).
    assert (rollout.prompt_mask == 0).any()
    assert rollout.response_ids.shape == rollout.sample_logprobs.shape == rollout.response_mask.shape
    with torch.no_grad():
        logprobs, entropy, _ = module.scoring.forward(rollout)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(logprobs[mask], rollout.sample_logprobs[mask], atol=1e-4, rtol=1e-4)
    assert (rollout.sample_logprobs[~mask] == 0).all()
    assert (entropy[mask] > 0).all()


def test_truncated_flag_and_greedy_is_deterministic(tiny_model_dir):
    module = _module(tiny_model_dir, max_new_tokens=3)
    rows = [{"messages": [{"role": "user", "content": "What is 4 + 4?"}], "answer": "8"}]
    a = module.producer.sample(rows, n=2, greedy=True)
    b = module.producer.sample(rows, n=2, greedy=True)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(
        a.truncated,
        a.response_mask.sum(-1).eq(3)
        & ~torch.isin(a.response_ids[:, -1], torch.tensor([module.tokenizer.eos_token_id])),
    )
    assert a.group_ids.tolist() == [0, 0]


def _toy(b, p, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return Rollout(
        prompt_ids=torch.randint(3, 50, (b, p), generator=g),
        prompt_mask=torch.ones(b, p, dtype=torch.long),
        response_ids=torch.randint(3, 50, (b, t), generator=g) * mask,
        response_mask=mask,
        sample_logprobs=-torch.rand(b, t, generator=g) * mask,
        truncated=lengths.eq(t),
        group_ids=torch.arange(b) // 2,
        answers=[str(i) for i in range(b)],
        texts=["x"] * b,
        rewards=torch.rand(b, generator=g),
        extras={"w": torch.arange(b), "note": "kept"},
    )


def test_select_and_cat_round_trip():
    r = _toy(6, 4, 5)
    part = r.select([4, 1])
    assert part.answers == ["4", "1"]
    assert torch.equal(part.response_ids, r.response_ids[[4, 1]])
    assert part.extras["w"].tolist() == [4, 1] and part.extras["note"] == "kept"
    a, b = _toy(2, 3, 2, seed=1), _toy(3, 4, 5, seed=2)
    both = Rollout.cat([a, b], pad_id=0)
    assert both.prompt_ids.shape == (5, 4) and both.response_ids.shape == (5, 5)
    # Prompts pad on the left, responses on the right.
    assert torch.equal(both.prompt_ids[:2, 1:], a.prompt_ids) and (both.prompt_mask[:2, 0] == 0).all()
    assert torch.equal(both.response_mask[:2, :2], a.response_mask) and (both.response_mask[:2, 2:] == 0).all()
    assert both.answers == a.answers + b.answers


def test_a_bfloat16_engine_copy_is_the_behaviour_policy_and_follows_updates(tiny_model_dir):
    """HFEngine(dtype=bfloat16) samples from a bfloat16 copy of the policy: its log-probs differ from the
    float32 trainer's (an off-policy gap that truncated IS corrects), and after an update the copy follows (its
    weights are made from the policy's at each generation)."""
    torch.manual_seed(0)
    module = RLModule(HFModel(tiny_model_dir), rollout=HFEngine(max_new_tokens=6, dtype="bfloat16"))
    module.configure_model()
    rows = [{"messages": [{"role": "user", "content": "What is 1 + 2?"}], "answer": "3"}] * 2
    rollout = module.producer.sample(rows, n=2)
    module.scoring.score(rollout, need_old=True, need_values=False, need_ref=False)
    mask = rollout.response_mask.bool()
    gap = (rollout.old_logprobs - rollout.sample_logprobs)[mask].abs()
    assert gap.max() > 1e-4  # bfloat16 against float32: not equal...
    assert gap.max() < 0.5  # ...but the same policy
    copy = module.rollout._copy
    assert copy is not None and next(copy.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.5)  # an "update"
    # Between generations the copy holds no weights (the update runs without them) and has nothing to sync...
    assert all(q.numel() == 0 for q in copy.parameters())
    assert module.rollout.update_weights(module.policy) == {}
    # ...the next generation fills it from the updated policy.
    assert module.rollout._generator(module.policy) is copy
    for p, q in zip(module.policy.parameters(), copy.parameters()):
        torch.testing.assert_close(q, p.to(torch.bfloat16))


def test_greedy_decoding_equals_model_generate_on_left_padded_prompts(tiny_model_dir):
    """The engine's own decode loop (KV cache, positions of left-padded prompts, rows that end early fed
    the pad id, one prompt pass shared by the rows of the same prompt) picks the same tokens as
    ``model.generate`` for prompts of different lengths, some repeated."""
    policy, tok = HFModel(tiny_model_dir).load()
    policy.eval()
    prompts = [[5, 9, 12, 7, 3, 8, 11], [4, 6], [13, 2, 9, 10], [4, 6], [5, 9, 12, 7, 3, 8, 11]]
    ids, mask = pad_left(prompts, tok.pad_token_id)
    from rllight.rollout.hf import eos_token_ids

    # A random model rarely ends: make the token the second prompt's row picks at its second step an end
    # token too, so that some rows end early and leave the batch while others run on.
    with torch.no_grad():
        free = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    policy.generation_config.eos_token_id = [tok.eos_token_id, int(free[1, 1])]
    eos = eos_token_ids(policy, tok)
    out = HFEngine().generate(policy, tok, prompts, Sampling(max_new_tokens=10, temperature=0.0))
    assert out.response_mask.sum(-1).min() < out.response_mask.shape[1] and out.truncated.any()
    with torch.no_grad():
        reference = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                    eos_token_id=eos, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    ref_mask, _ = response_mask_from_ids(reference, eos)
    width = out.response_ids.shape[1]
    assert torch.equal(out.response_mask, ref_mask[:, :width]) and ref_mask[:, width:].sum() == 0
    assert torch.equal(out.response_ids[out.response_mask.bool()], reference[:, :width][ref_mask[:, :width].bool()])


def test_min_new_tokens_forbids_the_end_tokens_as_model_generate_does(tiny_model_dir):
    """With an end token the rows pick early, ``min_new_tokens`` keeps them running: greedy decoding equals
    ``model.generate(min_new_tokens=...)``, and at ``min_new_tokens == max_new_tokens`` every sampled
    response has exactly that many tokens with no end token among them."""
    from rllight.errors import RecipeError
    from rllight.rollout.hf import eos_token_ids

    policy, tok = HFModel(tiny_model_dir).load()
    policy.eval()
    prompts = [[5, 9, 12, 7], [4, 6], [13, 2, 9, 10]]
    ids, mask = pad_left(prompts, tok.pad_token_id)
    with torch.no_grad():
        free = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    policy.generation_config.eos_token_id = [tok.eos_token_id, int(free[1, 0]), int(free[0, 1])]
    eos = eos_token_ids(policy, tok)
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    assert HFEngine().generate(policy, tok, prompts, greedy).response_mask.sum(-1).min() <= 2
    out = HFEngine(max_new_tokens=8, min_new_tokens=5).generate(policy, tok, prompts, greedy)
    with torch.no_grad():
        reference = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=5,
                                    do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    ref_mask, _ = response_mask_from_ids(reference, eos)
    assert out.response_mask.sum(-1).min() >= 5
    width = out.response_ids.shape[1]
    assert torch.equal(out.response_mask, ref_mask[:, :width])
    assert torch.equal(out.response_ids[out.response_mask.bool()], reference[:, :width][ref_mask[:, :width].bool()])
    torch.manual_seed(0)
    engine = HFEngine(max_new_tokens=8, min_new_tokens=8, temperature=1.0)
    sampled = engine.generate(policy, tok, prompts * 4, engine.sampling)
    assert sampled.response_mask.shape == (12, 8) and bool(sampled.response_mask.all())
    assert not torch.isin(sampled.response_ids, torch.tensor(eos)).any() and sampled.truncated.all()
    with pytest.raises(RecipeError, match="min_new_tokens"):
        HFEngine(max_new_tokens=8, min_new_tokens=9)


def test_sampling_distribution_equals_the_transformers_warpers():
    """``sample_next`` draws from, and reports the log-prob of, the distribution ``model.generate`` samples
    from after temperature, top-k and top-p (in that order): every drawn token is one the warpers keep, and
    its log-prob is theirs."""
    from transformers.generation.logits_process import (
        LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from rllight.rollout.hf import sample_next

    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    for temperature, top_k, top_p in [(0.7, 10, 0.8), (1.3, 0, 0.5), (1.0, 5, 1.0), (0.5, 0, 1.0)]:
        warpers = [TemperatureLogitsWarper(temperature)]
        warpers += [TopKLogitsWarper(top_k)] if top_k else []
        warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
        reference = torch.log_softmax(LogitsProcessorList(warpers)(None, logits.clone()), -1)
        for _ in range(20):
            token, logprob = sample_next(logits, temperature, top_k, top_p, greedy=False)
            expected = reference.gather(-1, token[:, None]).squeeze(-1)
            assert torch.isfinite(expected).all()  # never a token the warpers remove
            torch.testing.assert_close(logprob, expected)
    token, logprob = sample_next(logits, 0.7, 10, 0.8, greedy=True)
    assert torch.equal(token, logits.argmax(-1))
    torch.testing.assert_close(logprob, torch.log_softmax(logits, -1).amax(-1))


def test_a_low_precision_copy_on_a_cpu_without_units_for_it_warns(tiny_model_dir, monkeypatch, caplog):
    import rllight.rollout.hf as hf

    policy, tok = HFModel(tiny_model_dir).load()
    for native, warned in ((False, True), (True, False)):
        monkeypatch.setattr(hf, "cpu_bf16", lambda: (native, "CPU has no AVX-512 BF16 or AMX (AVX2)"))
        caplog.clear()
        HFEngine(dtype="bfloat16").generate(policy, tok, [[5, 6]], Sampling(max_new_tokens=2, temperature=0.0))
        assert ("much slower" in caplog.text) == warned
        assert ("the CPU has no AVX-512 BF16 or AMX (AVX2): generation" in caplog.text) == warned


def test_a_call_samples_as_its_sampling_says_not_as_the_engines_settings(tiny_model_dir):
    # The engine's own settings (8 tokens, temperature 1.0) stay; each call's Sampling decides: a limit of 3 tokens,
    # the arg-max at temperature 0, and a seed that gives the same responses whatever the process's stream, and
    # leaves that stream as it was.
    policy, tok = HFModel(tiny_model_dir).load()
    engine = HFEngine(max_new_tokens=8, temperature=1.0)
    prompts = [[5, 9, 12, 7], [4, 6]] * 4
    short = engine.generate(policy, tok, prompts, Sampling(max_new_tokens=3, temperature=1.0))
    assert short.response_ids.shape[1] <= 3 and engine.max_new_tokens == 8
    greedy = [engine.generate(policy, tok, prompts, engine.sampling.as_greedy()).response_ids for _ in range(2)]
    assert torch.equal(*greedy) and torch.equal(greedy[0][0::2], greedy[0][0:1].expand(4, -1))
    seeded = Sampling(max_new_tokens=8, temperature=1.0, seed=7)
    torch.manual_seed(0)
    a = engine.generate(policy, tok, prompts, seeded).response_ids
    torch.manual_seed(1)
    untouched = torch.rand(3)
    torch.manual_seed(1)
    b = engine.generate(policy, tok, prompts, seeded).response_ids
    assert torch.equal(a, b)  # the same seed from another state of the process's stream: the same responses
    assert torch.equal(torch.rand(3), untouched)  # and the process's stream is where it was
    other = engine.generate(policy, tok, prompts, Sampling(max_new_tokens=8, temperature=1.0, seed=8)).response_ids
    assert not torch.equal(other, a)


def test_each_module_has_its_own_default_engine_ready_to_say_how_it_samples(tiny_model_dir):
    # The recipe's default engine is a lazy default, one object for every module that takes it; a module makes its
    # own plain engine of it, so that its sampling can be read before anything generated (and no state is shared).
    a, b = RLModule(HFModel(tiny_model_dir)), RLModule(HFModel(tiny_model_dir))
    assert a.rollout is not b.rollout and type(a.rollout) is HFEngine
    assert a.rollout.sampling == Sampling(max_new_tokens=64, temperature=1.0)
