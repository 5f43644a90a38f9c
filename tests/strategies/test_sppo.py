"""SPPO (arXiv:2604.08865): the sequence-level clipped objective and the prompt-baseline advantage
against hand-computed numbers, the scalar prompt critic (BCE, calibration, shared head or a separate
smaller model, re-tokenisation), the token-level variant of the authors' code, and two-step runs of
recipes/sppo.yaml (separate critic), its shared-critic overlay and recipes/sppo-small-critic.yaml."""

import importlib.util
import math
import os
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import RECIPES
from helpers import build, tiny_overrides, unchanged_parameters
from rllight.algorithms import clipped_surrogate, sequence_clipped_surrogate
from rllight.critics import PromptCritic, calibration_corr
from rllight.errors import RecipeError
from rllight.models import HFModel, response_hidden_states
from rllight.rollout.base import pad_left
from rllight.strategies import PromptBaseline, SequenceClippedSurrogate
from rllight.testing import build_tiny_model
from rllight.types import Rollout

# --------------------------------------------------------------------------------------------------
# Sequence-level clipped objective
# --------------------------------------------------------------------------------------------------


def test_sequence_clip_hand_computed():
    # Row 0: ratios [1.5, 0.7], A = +1: sum r A = 2.2; clipped sum = 1.2 + 0.8 = 2.0; min = 2.0 -> loss -2.0.
    #   (Token-level PPO would give -(min(1.5, 1.2) + min(0.7, 0.8)) = -1.9: the clip acts on the sum.)
    # Row 1: ratios [1.5, 0.7], A = -1: sums -2.2 and -2.0, min = -2.2 -> loss 2.2.
    # Row 2: one valid token of ratio 1.1 (the padding holds junk), A = 0.5: min(0.55, 0.55) -> loss -0.55.
    ratios = torch.tensor([[1.5, 0.7], [1.5, 0.7], [1.1, 50.0]])
    old = torch.zeros(3, 2)
    logprobs = torch.log(ratios).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    loss = sequence_clipped_surrogate(logprobs, old, adv, mask)
    assert_close(loss, torch.tensor([-2.0, 2.2, -0.55]))
    token_level = clipped_surrogate(logprobs, old, adv)[0].sum()
    assert_close(token_level, torch.tensor(-1.9))
    loss.sum().backward()
    # d loss / d logp_t = -A r_t where the chosen sum keeps r_t unclipped, 0 where it is clamped:
    # row 0 took the clipped sum: token 0 (1.5 -> 1.2) and token 1 (0.7 -> 0.8) are both clamped: [0, 0].
    # row 1 took the unclipped sum: [1.5, 0.7]. Row 2: [-0.55, 0] (padding gets no gradient).
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0], [1.5, 0.7], [-0.55, 0.0]]))


def test_sequence_clip_strategy_returns_one_loss_per_response():
    logprobs = torch.log(torch.tensor([[1.5, 0.7], [1.0, 1.0]]))
    mask = torch.ones(2, 2, dtype=torch.long)
    batch = _rollout(rewards=torch.zeros(2), mask=mask)
    batch.old_logprobs = torch.zeros(2, 2)
    batch.advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, stats = SequenceClippedSurrogate()(logprobs, batch)
    assert loss.shape == (2,)
    # Row 0's clip acted with A > 0; row 1's ratios are 1, no clip.
    assert stats["policy/clipfrac_high"] == 0.5 and stats["policy/clipfrac_low"] == 0


# --------------------------------------------------------------------------------------------------
# Prompt-baseline advantage
# --------------------------------------------------------------------------------------------------


def _rollout(rewards, mask, values=None, correct=None, group_ids=None, prompt_ids=None, prompt_mask=None):
    b, t = mask.shape
    return Rollout(
        prompt_ids=torch.ones(b, 1, dtype=torch.long) if prompt_ids is None else prompt_ids,
        prompt_mask=torch.ones(b, 1, dtype=torch.long) if prompt_mask is None else prompt_mask,
        response_ids=torch.ones(b, t, dtype=torch.long), response_mask=mask, sample_logprobs=torch.zeros(b, t),
        truncated=torch.zeros(b, dtype=torch.bool), group_ids=torch.arange(b) if group_ids is None else group_ids,
        answers=[""] * b, texts=[""] * b, rewards=rewards, values=values,
        correct=rewards if correct is None else correct,
    )


R = torch.tensor([1.0, 0.0, 1.0])
V = torch.tensor([0.8, 0.5, 0.2])
MASK = torch.tensor([[1, 1], [1, 0], [1, 1]])


@pytest.mark.parametrize(
    "normalize,expected",
    [
        # A = R - V = [0.2, -0.5, 0.8]
        ("none", [0.2, -0.5, 0.8]),
        # std of [0.2, -0.5, 0.8] (unbiased): mean 0.166667, squares of the deviations
        # 0.001111 + 0.444444 + 0.401111 = 0.846667, / 2 = 0.423333, sqrt = 0.650641 -> A / 0.650641.
        ("batch_std", [0.307389, -0.768473, 1.229557]),
        # sqrt(V (1 - V)) = [0.4, 0.5, 0.4] -> [0.5, -1.0, 2.0]
        ("bernoulli", [0.5, -1.0, 2.0]),
    ],
)
def test_prompt_baseline_hand_computed(normalize, expected):
    adv, returns = PromptBaseline(normalize=normalize)(_rollout(R, MASK, values=V))
    e = torch.tensor(expected)
    assert_close(adv, e.unsqueeze(-1) * MASK, rtol=0, atol=1e-5)
    assert returns is None


def test_bernoulli_sigma_is_floored():
    # V = 0.9999: sqrt(V (1 - V)) = 0.0099995 < 0.05, so A = (0 - 0.9999) / 0.05 = -19.998.
    rollout = _rollout(torch.tensor([0.0]), torch.ones(1, 1), values=torch.tensor([0.9999]))
    adv, _ = PromptBaseline(normalize="bernoulli")(rollout)
    assert_close(adv, torch.tensor([[-19.998]]))


def test_prompt_baseline_rejects_token_level_values():
    with pytest.raises(RecipeError, match="model.critic"):
        PromptBaseline()(_rollout(R, MASK, values=torch.zeros(3, 2)))


def test_bad_normalize_is_a_one_line_error_naming_it():
    with pytest.raises(RecipeError, match="model.advantage.normalize") as err:
        PromptBaseline(normalize="std")
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------------
# Critic: BCE, calibration, learning, placements
# --------------------------------------------------------------------------------------------------


def test_bce_hand_computed():
    # The critic's output is the logit of V. BCE(V = 0.5) = ln 2 = 0.693147 for either target;
    # BCE(0.8, 1) = -ln 0.8 = 0.223144; BCE(0.8, 0) = -ln 0.2 = 1.609438 (logit 0.8 = ln 4).
    critic = PromptCritic()
    batch = _rollout(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(4, 1))
    loss, stats = critic.loss(torch.tensor([0.0, 0.0, math.log(4.0), math.log(4.0)]), batch)
    assert_close(loss, torch.tensor([0.693147, 0.693147, 0.223144, 1.609438]))
    assert_close(stats["value/loss"], loss.mean())
    assert_close(stats["value/mean"], torch.tensor(0.65))  # the mean of V, not of the logits
    assert_close(critic.to_values(torch.tensor([0.0, math.log(4.0)])), torch.tensor([0.5, 0.8]))


def test_bce_keeps_its_gradient_where_the_sigmoid_saturates():
    # A confident wrong critic: logit 30 (V rounds to 1 in float32) for a failed prompt. The BCE's gradient in
    # the logit is V - r = 1; a sigmoid followed by BCE on V gives 0 there.
    logits = torch.tensor([30.0], requires_grad=True)
    loss, _ = PromptCritic().loss(logits, _rollout(torch.tensor([0.0]), torch.ones(1, 1)))
    loss.sum().backward()
    assert_close(logits.grad, torch.tensor([1.0]))


def test_bce_rejects_rewards_outside_the_unit_interval():
    with pytest.raises(RecipeError, match="model.critic") as err:
        PromptCritic().loss(torch.tensor([0.0]), _rollout(torch.tensor([1.5]), torch.ones(1, 1)))
    assert "\n" not in str(err.value)


def test_calibration_correlation_hand_computed():
    # Three prompts with V = [0.2, 0.5, 0.8] and success rates [0, 1, 0.5] (prompt 2 has two responses,
    # one right). Centred: v = [-0.3, 0, 0.3], s = [-0.5, 0.5, 0]; sum v s = 0.15;
    # sqrt(sum v^2 * sum s^2) = sqrt(0.18 * 0.5) = 0.3 -> r = 0.5.
    values = torch.tensor([0.2, 0.5, 0.8, 0.8])
    correct = torch.tensor([0.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 1, 2, 2])
    assert_close(calibration_corr(values, correct, groups), torch.tensor(0.5))
    assert calibration_corr(values[:1], correct[:1], groups[:1]) is None  # one prompt
    assert calibration_corr(torch.full((4,), 0.5), correct, groups) is None  # constant V


def _toy_prompts(tokenizer, n=8):
    """Even-numbered prompts are 'easy' (always solved), odd ones 'hard' (never): a critic can learn it."""
    texts = [f"What is {i} + {i}? {'easy' if i % 2 == 0 else 'hard'}" for i in range(n)]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
           for t in texts]
    ids = [list(x["input_ids"]) if not isinstance(x, list) else x for x in ids]
    prompt_ids, prompt_mask = pad_left(ids, tokenizer.pad_token_id)
    rewards = torch.tensor([1.0 if i % 2 == 0 else 0.0 for i in range(n)])
    return _rollout(rewards, torch.ones(n, 1, dtype=torch.long), prompt_ids=prompt_ids, prompt_mask=prompt_mask)


def _fit_critic(critic, module, batch, hidden_fn, steps=40):
    critic.setup(module.policy, module.tokenizer, None)
    params = list(critic.parameters()) + ([] if hidden_fn is None else list(module.policy.parameters()))
    opt = torch.optim.Adam(params, lr=1e-2)
    losses, corrs = [], []
    for _ in range(steps):
        values = critic.values(batch, None if hidden_fn is None else hidden_fn())
        loss, stats = critic.loss(values, batch)
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
        losses.append(loss.mean().item())
        corrs.append(stats.get("value/calibration_corr"))
    return losses, corrs


def _module(model_dir):
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    return SimpleNamespace(policy=policy, tokenizer=AutoTokenizer.from_pretrained(model_dir))


def test_separate_critic_bce_decreases_on_a_fixed_toy_set(tiny_model_dir):
    torch.manual_seed(0)
    module = _module(tiny_model_dir)
    batch = _toy_prompts(module.tokenizer)
    critic = PromptCritic(model=HFModel(tiny_model_dir))
    losses, corrs = _fit_critic(critic, module, batch, None)
    assert losses[0] == pytest.approx(math.log(2.0), abs=1e-6)  # zero head: V = 0.5 everywhere
    assert losses[-1] < 0.1 < losses[0]
    assert corrs[-1] > 0.9


def test_shared_critic_reads_the_last_prompt_token_and_learns(tiny_model_dir):
    torch.manual_seed(0)
    module = _module(tiny_model_dir)
    batch = _toy_prompts(module.tokenizer)
    critic = PromptCritic()
    assert critic.shared
    decoder = module.policy.get_decoder()
    losses, _ = _fit_critic(critic, module, batch, lambda: response_hidden_states(decoder, batch))
    assert losses[-1] < 0.1 < losses[0]
    # hidden[:, 0] is the state at position P - 1, the last prompt token: the same as a prompt-only forward.
    with torch.no_grad():
        full = critic.values(batch, response_hidden_states(decoder, batch))
        mask = batch.prompt_mask
        alone = decoder(input_ids=batch.prompt_ids, attention_mask=mask,
                        position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state[:, -1]
        assert_close(full, critic.head(alone).squeeze(-1))


def test_critic_with_another_tokenizer_retokenises_the_prompt(tmp_path, tiny_model_dir):
    # A critic whose vocabulary has one more token: the prompt is decoded with the policy's tokenizer and
    # encoded with the critic's. Both tokenizers split this text the same way, so the values must equal
    # those of the same critic reading the policy's ids directly.
    critic_dir = str(tmp_path / "critic")
    build_tiny_model(critic_dir, hidden_size=16)
    tok = AutoTokenizer.from_pretrained(critic_dir)
    tok.add_tokens(["<|extra|>"])
    tok.save_pretrained(critic_dir)
    module = _module(tiny_model_dir)
    batch = _toy_prompts(module.tokenizer)
    critic = PromptCritic(model=HFModel(critic_dir))
    critic.setup(module.policy, module.tokenizer, None)
    assert critic.retokenize
    torch.nn.init.normal_(critic.head.weight)  # away from the zero init, so that the values differ by prompt
    with torch.no_grad():
        retokenised = critic.values(batch, None)
        critic.retokenize = False
        direct = critic.values(batch, None)
    assert_close(retokenised, direct)
    assert retokenised.unique().numel() > 1


def test_repeated_prompts_run_once_and_share_their_value(tiny_model_dir):
    module = _module(tiny_model_dir)
    toy = _toy_prompts(module.tokenizer, n=3)
    batch = toy.select([0, 1, 1, 2, 0])
    critic = PromptCritic(model=HFModel(tiny_model_dir))
    critic.setup(module.policy, module.tokenizer, None)
    torch.nn.init.normal_(critic.head.weight)
    calls = []
    critic.backbone.register_forward_hook(lambda mod, args, kwargs_out: calls.append(1))
    with torch.no_grad():
        v = critic.values(batch, None)
        alone = critic.values(toy, None)
    assert len(calls) == 2  # one forward per call, over the distinct prompts only
    assert_close(v, alone[[0, 1, 1, 2, 0]])


# --------------------------------------------------------------------------------------------------
# Recipes: two steps on tiny models, every trainable parameter changes
# --------------------------------------------------------------------------------------------------


def test_sppo_recipe_trains_two_steps_with_a_separate_critic(tmp_path, tiny_model_dir):
    # EvenAnswer: reward 1 when the reference answer is even, else 0 (a {0, 1} outcome that varies by prompt).
    # sppo.yaml's critic has its own model (the note's setting); the tiny model stands in for SmolLM2-135M.
    critic_dir = build_tiny_model(str(tmp_path / "critic"), hidden_size=16, num_layers=1)
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.EvenAnswer"},
                             critic={"class_path": "rllight.critics.PromptCritic", "init_args": {
                                 "model": {"class_path": "rllight.models.HFModel", "init_args": {"path": critic_dir}}}})
    cli = build(os.path.join(RECIPES, "sppo.yaml"), overlay, "--data.batch_size", "4")
    critic = cli.model.critic
    assert critic.lr == 5.0e-05  # the recipe's critic learning rate survives the overlay
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    module = cli.model
    assert module.sampler.group_size == 1 and not critic.shared and critic.backbone is not None
    assert cli.trainer.global_step == 2  # 4 responses, minibatch 8: one update per rollout, two rollouts
    # Separate parameter groups, no parameter shared: the BCE gradient cannot reach the policy.
    groups = module.optimizers().optimizer.param_groups
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in critic.parameters()}
    assert not {id(p) for p in groups[0]["params"]} & {id(p) for p in critic.parameters()}
    assert unchanged_parameters(module.policy, tiny_model_dir) == []
    assert unchanged_parameters(critic.backbone, critic_dir, decoder=True) == []
    assert all(p.abs().sum() > 0 for p in critic.head.parameters()), "the head is still at its zero init"
    logged = cli.trainer.logged_metrics
    assert "train/value/loss" in logged and "train/value/calibration_corr" in logged


def test_shared_critic_overlay_puts_the_head_on_the_policys_backbone(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.EvenAnswer"})
    cli = build(os.path.join(RECIPES, "sppo.yaml"), os.path.join(RECIPES, "ablations", "sppo-shared-critic.yaml"),
                overlay, "--data.batch_size", "4")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    module = cli.model
    assert module.critic.shared and module.critic.source is None and module.critic.backbone is None
    assert module.critic.lr == 5.0e-05  # the overlay keeps the recipe's other critic settings
    assert unchanged_parameters(module.policy, tiny_model_dir) == []
    assert all(p.abs().sum() > 0 for p in module.critic.parameters()), "the head is still at its zero init"


def test_token_level_overlay_is_the_authors_clip_and_token_mean():
    # recipes/ablations/sppo-token-level.yaml: PPO's per-token clip on A = R - V, token-mean; against the
    # note's per-response sum of clipped terms (recipes/sppo.yaml) on the same numbers.
    # R = [1, 0], V = [0.5, 0.5] -> A = [0.5, -0.5]; ratios row 0 [1.5, 0.7], row 1 [1.5, pad]; clip 0.2.
    #   token level: row 0: -min(0.75, 1.2 x 0.5 = 0.6) = -0.6 and -min(0.35, 0.8 x 0.5 = 0.4) = -0.35;
    #     row 1: -min(-0.75, -0.6) = 0.75; token-mean over 3 tokens: (-0.6 - 0.35 + 0.75) / 3 = -0.066667.
    #   sequence level: row 0: -min(0.5 x 2.2 = 1.1, 0.5 x (1.2 + 0.8) = 1.0) = -1.0; row 1: -min(-0.75, -0.6)
    #     = 0.75; mean over the 2 responses: -0.125.
    mask = torch.tensor([[1, 1], [1, 0]])
    batch = _rollout(torch.tensor([1.0, 0.0]), mask, values=torch.tensor([0.5, 0.5]))
    batch.old_logprobs = torch.zeros(2, 2)
    logprobs = torch.log(torch.tensor([[1.5, 0.7], [1.5, 1.0]]))
    results = {}
    for name, extra in (("sequence", ()), ("token", (os.path.join(RECIPES, "ablations", "sppo-token-level.yaml"),))):
        module = build(os.path.join(RECIPES, "sppo.yaml"), *extra).model
        batch.advantages, _ = module.advantage(batch)
        per_token, _ = module.policy_loss(logprobs, batch)
        results[name] = module.aggregation(per_token, mask, num_tokens=3.0, num_seqs=2.0)
    assert_close(results["token"], torch.tensor(-0.2 / 3))
    assert_close(results["sequence"], torch.tensor(-0.125))


PAPER_SPPO = os.path.join(RECIPES, "paper", "sppo.yaml")
SEQUENCE_OVERLAY = os.path.join(RECIPES, "paper", "overlays", "sppo-sequence-level.yaml")
# Only the hardware (as tests/recipes/test_paper_recipes.py): the paper recipe's FSDP on one CPU process.
CPU_TRAINER = ("--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="the paper recipes name rllight.rollout.vllm.VLLMEngine (pip install vllm)")


def _paper_modules():
    """recipes/paper/sppo.yaml (the authors' token form) and the same with the note's per-response overlay."""
    return {"token": build(PAPER_SPPO, *CPU_TRAINER).model,
            "sequence": build(PAPER_SPPO, SEQUENCE_OVERLAY, *CPU_TRAINER).model}


def _paper_batch(ratios: list[list[float]]):
    # R = [1, 0], V = [0.5, 0.5] -> A = [0.5, -0.5]; response 0 has 3 tokens, response 1 one (then padding).
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    batch = _rollout(torch.tensor([1.0, 0.0]), mask, values=torch.tensor([0.5, 0.5]))
    batch.old_logprobs = torch.zeros(2, 3, dtype=torch.float64)
    return batch, mask, torch.log(torch.tensor(ratios, dtype=torch.float64))


def _paper_loss(module, batch, mask, logprobs):
    """The loss of one update as the module computes it: its objective, aggregated by its aggregation over the
    update's 4 tokens and 2 responses."""
    batch.advantages, _ = module.advantage(batch)
    per_token, _ = module.policy_loss(logprobs, batch)
    return module.aggregation(per_token, mask, num_tokens=4.0, num_seqs=2.0)


@needs_vllm
def test_paper_sequence_overlay_trains_the_notes_per_response_objective():
    # A = [0.5, -0.5]; ratios: response 0 [1.5, 0.5, 1.0], response 1 [5.0]; clip 0.2.
    #   the overlay (note 004): response 0: -min(0.5 x 3.0 = 1.5, 0.5 x (1.2 + 0.8 + 1.0) = 1.5) = -1.5;
    #     response 1: -min(-0.5 x 5 = -2.5, -0.5 x 1.2 = -0.6) = 2.5 (no dual clip); mean over 2: 0.5.
    #   the base (the authors' token form): -min(0.75, 0.6) = -0.6, -min(0.25, 0.4) = -0.25, -0.5, and
    #     -min(-2.5, -0.6) = 2.5 capped by the dual clip at -3 x -0.5 = 1.5; token-mean: (-1.35 + 1.5) / 4 = 0.0375.
    modules = _paper_modules()
    assert type(modules["sequence"].policy_loss).__name__ == "SequenceClippedSurrogate"
    for name, expected in (("sequence", 0.5), ("token", 0.0375)):
        batch, mask, logprobs = _paper_batch([[1.5, 0.5, 1.0], [5.0, 1.0, 1.0]])
        assert_close(_paper_loss(modules[name], batch, mask, logprobs), torch.tensor(expected, dtype=torch.float64))


@needs_vllm
def test_paper_sequence_overlays_lr_is_the_token_forms_as_adamw_steps_alike():
    # The derivation in the overlay's header. Where no clip binds (ratios 1) the per-response gradient is the
    # token form's times Lbar = N / B = 4 tokens / 2 responses = 2: d/dlogp = -A / B = [-0.25 x 3, 0.25] against
    # -A / N = [-0.125 x 3, 0.125]. SGD at one lr would step twice as far; AdamW, which divides by the gradient's
    # own scale, steps alike at one lr, so the recipe's lr (1e-6, weight decay 0.1) carries over.
    modules = _paper_modules()
    grads = {}
    for name, module in modules.items():
        batch, mask, logprobs = _paper_batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
        logprobs.requires_grad_()
        _paper_loss(module, batch, mask, logprobs).backward()
        grads[name] = logprobs.grad
    assert_close(grads["token"], torch.tensor([[-0.125] * 3, [0.125, 0.0, 0.0]], dtype=torch.float64))
    assert_close(grads["sequence"], 2.0 * grads["token"])

    def steps(module, make_optimizer, n=3):
        """The change of the log-probs after n optimizer steps on this module's loss (the batch's advantages)."""
        batch, mask, logprobs = _paper_batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
        start = logprobs.clone()
        logprobs.requires_grad_()
        optimizer = make_optimizer([logprobs])
        for _ in range(n):
            optimizer.zero_grad()
            _paper_loss(module, batch, mask, logprobs).backward()
            optimizer.step()
        return (logprobs - start).detach()

    adamw = {name: module.optimizer_fn for name, module in modules.items()}  # each recipe's own AdamW
    for name, make in adamw.items():
        optimizer = make([torch.zeros(1, requires_grad=True)])
        group = optimizer.param_groups[0]
        assert (type(optimizer).__name__, group["lr"], group["weight_decay"]) == ("AdamW", 1e-6, 0.1), name
    token, sequence = (steps(modules[n], adamw[n]) for n in ("token", "sequence"))
    assert token.abs().max() > 2e-6  # three steps of about lr each
    torch.testing.assert_close(sequence, token, rtol=1e-5, atol=0)  # eps = 1e-8 is far below |g|: alike
    sgd = {n: steps(modules[n], lambda p: torch.optim.SGD(p, lr=1e-3), n=1) for n in modules}
    assert_close(sgd["sequence"], 2.0 * sgd["token"])  # SGD would need lr / Lbar


def test_small_critic_recipe_holds_two_models_of_different_sizes(tmp_path, tiny_model_dir):
    critic_dir = build_tiny_model(str(tmp_path / "critic"), hidden_size=16, num_layers=1)
    critic_lr = 0.05
    overlay = tiny_overrides(
        tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.EvenAnswer"},
        critic={"class_path": "rllight.critics.PromptCritic",
                "init_args": {"model": {"class_path": "rllight.models.HFModel", "init_args": {"path": critic_dir}},
                              "lr": critic_lr}},
    )
    cli = build(os.path.join(RECIPES, "sppo-small-critic.yaml"), overlay, "--data.batch_size", "4")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    module = cli.model
    critic = module.critic
    assert not critic.shared and critic.backbone is not None
    policy_size = sum(p.numel() for p in module.policy.parameters())
    critic_size = sum(p.numel() for p in critic.parameters())
    assert module.policy.config.hidden_size == 32 and critic.head.in_features == 16
    assert critic_size < policy_size / 2
    # The critic's parameters are their own optimizer group with their own learning rate.
    groups = module.optimizers().optimizer.param_groups
    assert len(groups) == 2 and groups[1]["lr"] == critic_lr and groups[0]["lr"] != critic_lr
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in critic.parameters()}
    # Both models trained: every parameter of the policy and of the critic moved.
    assert unchanged_parameters(module.policy, tiny_model_dir) == []
    assert unchanged_parameters(critic.backbone, critic_dir, decoder=True) == []
    assert critic.head.weight.abs().sum() > 0
