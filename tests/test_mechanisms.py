"""Each seed component does what its paper says (issue 45, item 6).

tests/test_components_act.py shows that every component a recipe sets changes the run; the tests here check the
quantity the paper says the component controls, where no other test did, mostly through the module's own update
(the gradient that reaches the log-probs, the groups and sizes each update trains on) on the tiny model. Numbers
worked out by hand carry their arithmetic in the comments.

Components whose mechanism is tested elsewhere (ALGORITHMS.md's formulas against hand-computed numbers):

- DAPO soft overlong punishment: tests/strategies/test_dapo.py::test_soft_overlong_punishment_at_the_buffer_edges (R_len at
  16384, 16385, 18432, 20479, 20480, 20481) and ::test_soft_overlong_punishment_adds_R_len_to_the_reward.
- DAPO dynamic sampling's resampling rounds and a_G(p): tests/strategies/test_dapo.py::test_dynamic_sampling_* and
  ::test_group_retention_probability_hand_computed; its cross-rank target: tests/test_global_batch.py.
- VAPO decoupled GAE: tests/strategies/test_vapo.py::test_decoupled_gae_hand_computed (lambda 1 returns, lambda 0.5
  advantages) and ::test_critic_steps_first_recompute_advantages_with_the_updated_critic (note 000's order).
- VAPO length-adaptive lambda: tests/strategies/test_vapo.py::test_vapo_lambda_hand_computed (1 - 1/(0.05 L) at L = 100,
  1000, 20, 10, 0) and ::test_adaptive_lambda_hand_computed (note 000, eq. 7).
- VAPO positive-example NLL: tests/strategies/test_positive_nll.py::test_gradient_of_the_paper_form (only the correct
  response's tokens get the NLL gradient, -mu / N_correct).
- SPPO sequence-level clip: tests/strategies/test_sppo.py::test_sequence_clip_hand_computed (the min taken once per response
  on the summed ratios, and its gradient).
- VESPO asymmetric kernel: tests/strategies/test_vespo.py::test_kernel_hand_computed (phi at W = 0.5, 1, 2 for A > 0 and
  A < 0) and ::test_loss_and_gradient_hand_computed.
- The other objectives of tests/test_components_act.py's clip list: tests/algorithms/test_algorithms.py (PPO clip sides,
  dual clip), tests/strategies/test_baselines.py (GSPO, CISPO, truncated IS), tests/strategies/test_masked_is.py; the bf16 engine:
  tests/rollout/test_rollout.py::test_a_bfloat16_engine_copy_is_the_behaviour_policy_and_follows_updates.
"""

import os
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch.testing import assert_close

from conftest import RECIPES
from helpers import build, tiny_overrides, unchanged_parameters
from rllight.callbacks import RolloutCallback
from rllight.rewards import Verifier
from rllight.scoring import Outputs
from rllight.strategies import ClippedSurrogate, TokenMean
from rllight.terms import PolicyObjective, ResponseNLL
from test_dapo import make_rollout

ABLATIONS = os.path.join(RECIPES, "ablations")


def recipe(name: str) -> str:
    return os.path.join(RECIPES, name)


def ablation(name: str) -> str:
    return os.path.join(ABLATIONS, name)


class HalfMixed(Verifier):
    """Correct when the reference answer is even and the response has an even number of characters: every group of
    an odd-answer prompt is all wrong (a constant group, which dynamic sampling must drop); the others are usually
    mixed."""

    def is_correct(self, response: str, answer: str) -> bool:
        return int(answer) % 2 == 0 and len(response) % 2 == 0


class RecordingSurrogate(ClippedSurrogate):
    """A ClippedSurrogate that keeps, for every call (one per optimizer update where a minibatch is one
    micro-batch), what the update trained on and the gradient of the update's loss with respect to its log-probs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[dict] = []

    def __call__(self, logprobs, batch):
        call = {k: getattr(batch, k).detach().clone()
                for k in ("group_ids", "rewards", "advantages", "response_mask", "old_logprobs", "truncated")}
        call["logprobs"] = logprobs.detach().clone()
        logprobs.register_hook(lambda grad: call.__setitem__("grad", grad.detach().clone()))
        self.calls.append(call)
        return super().__call__(logprobs, batch)


def _callbacks_file(tmp_path, *callbacks) -> str:
    path = os.path.join(tmp_path, "callbacks.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"trainer": {"callbacks": list(callbacks)}}, f)
    return path


# --------------------------------------------------------------------------------------------------
# DAPO: clip-higher
# --------------------------------------------------------------------------------------------------

RATIOS = [0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 1.27, 1.29, 2.0]
# The objective is -min(r A, clip(r, 1 - 0.2, 1 + eps_high) A), and d loss / d logp = -A r where r is not clipped.
# A = -1, either eps_high: the low side clips r = 0.5 and 0.79 at 0.8 (loss 0.8, no gradient); the high side never
# clips (max(r, clip(r)) = r: loss r, gradient r), however far r runs.
NEGATIVE_LOSS = [0.8, 0.8, 0.81, 1.0, 1.19, 1.21, 1.27, 1.29, 2.0]
NEGATIVE_GRAD = [0.0, 0.0, 0.81, 1.0, 1.19, 1.21, 1.27, 1.29, 2.0]
# A = +1, eps_high = 0.28: r up to 1.28 is not clipped (loss -r, gradient -r, below 0.8 included); 1.29 and 2.0 are
# clipped at 1.28 (loss -1.28, no gradient).
POSITIVE_028 = ([-0.5, -0.79, -0.81, -1.0, -1.19, -1.21, -1.27, -1.28, -1.28],
                [-0.5, -0.79, -0.81, -1.0, -1.19, -1.21, -1.27, 0.0, 0.0])
# A = +1, eps_high = 0.2 (the symmetric-clip ablation): 1.21 and 1.27 are clipped too (loss -1.2, no gradient).
POSITIVE_020 = ([-0.5, -0.79, -0.81, -1.0, -1.19, -1.2, -1.2, -1.2, -1.2],
                [-0.5, -0.79, -0.81, -1.0, -1.19, 0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("configs,positive,clipped_high", [
    # 18 tokens; clipped high: A > 0 and r > 1.28 (1.29, 2.0) = 2/18; low: A < 0 and r < 0.8 (0.5, 0.79) = 2/18.
    pytest.param(("dapo.yaml",), POSITIVE_028, 2, id="dapo"),
    pytest.param(("vapo.yaml",), POSITIVE_028, 2, id="vapo"),
    # The control: symmetric 0.2 clips 1.21, 1.27, 1.29, 2.0 for A > 0 = 4/18.
    pytest.param(("dapo.yaml", "ablations/dapo-symmetric-clip.yaml"), POSITIVE_020, 4, id="dapo-symmetric-clip"),
    pytest.param(("vapo.yaml", "ablations/vapo-symmetric-clip.yaml"), POSITIVE_020, 4, id="vapo-symmetric-clip"),
])
def test_clip_higher_clips_the_high_side_at_1_plus_eps_high_for_positive_advantages_only(configs, positive,
                                                                                         clipped_high):
    policy_loss = build(*[recipe(c) for c in configs]).model.policy_loss
    ratios = torch.tensor([RATIOS, RATIOS], dtype=torch.float64)
    logprobs = torch.log(ratios).requires_grad_()  # old log-probs 0: exp(logp - 0) = r
    batch = SimpleNamespace(old_logprobs=torch.zeros_like(ratios), advantages=torch.tensor([1.0, -1.0]),
                            response_mask=torch.ones_like(ratios))
    loss, stats = policy_loss(logprobs, batch)
    loss.sum().backward()
    assert_close(loss.detach(), torch.tensor([positive[0], NEGATIVE_LOSS], dtype=torch.float64))
    assert_close(logprobs.grad, torch.tensor([positive[1], NEGATIVE_GRAD], dtype=torch.float64))
    assert_close(stats["policy/clipfrac_high"], torch.tensor(clipped_high / 18, dtype=torch.float64))
    assert_close(stats["policy/clipfrac_low"], torch.tensor(2 / 18, dtype=torch.float64))


# --------------------------------------------------------------------------------------------------
# DAPO: dynamic sampling in a run (one process)
# --------------------------------------------------------------------------------------------------


def test_dynamic_sampling_trains_only_mixed_groups_the_target_number_in_full_minibatches(tmp_path, tiny_model_dir):
    # recipes/dapo.yaml without the overlong callbacks (the rewards are the task's +1 / -1 alone), 4 prompts per
    # step: the target is 4 mixed groups of G = 8, i.e. 32 responses, trained in minibatches of 16: 2 updates.
    reward = {"class_path": f"{__name__}.HalfMixed", "init_args": {"correct": 1.0, "wrong": -1.0}}
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward=reward)
    cli = build(recipe("dapo.yaml"), overlay, ablation("dapo-no-overlong.yaml"), "--data.batch_size", "4",
                "--model.sampler.init_args.max_rounds", "10", "--trainer.max_steps", "2")
    module = cli.model
    assert (module.sampler.group_size, module.batching.minibatch_size) == (8, 16)
    module.policy_loss = RecordingSurrogate(clip_low=0.2, clip_high=0.28)
    drawn = []  # the rewards of every group the sampler drew, (groups, G) per round
    real_sample = module.producer.sample

    def sample(rows, n, *args, **kwargs):
        part = real_sample(rows, n, *args, **kwargs)
        drawn.append(part.rewards.view(-1, n).clone())
        return part

    module.producer.sample = sample
    cli.trainer.fit(module, datamodule=cli.datamodule)

    assert cli.trainer.global_step == 2
    spread = torch.cat(drawn).amax(-1) - torch.cat(drawn).amin(-1)
    assert (spread == 0).any(), "no constant group was drawn: nothing for dynamic sampling to drop"
    # Every update holds the minibatch size, and the step makes 32 / 16 = 2 of them.
    calls = module.policy_loss.calls
    assert [len(c["group_ids"]) for c in calls] == [16, 16]
    groups = torch.cat([c["group_ids"] for c in calls])
    rewards = torch.cat([c["rewards"] for c in calls])
    # The advantage of each response (GRPO's, broadcast over its tokens): its mean over the valid tokens.
    advantages = torch.cat([(c["advantages"] * c["response_mask"]).sum(-1) / c["response_mask"].sum(-1)
                            for c in calls])
    assert groups.unique().numel() == 4  # the target number of groups (data.batch_size)
    for g in groups.unique():
        rows = groups == g
        assert rows.sum() == 8, "a group reached the update incomplete"
        assert rewards[rows].amax() > rewards[rows].amin(), f"group {int(g)} has one reward for all its responses"
        assert advantages[rows].amax() > advantages[rows].amin(), f"group {int(g)} has no advantage spread"
    assert float(cli.trainer.callback_metrics["train/sampling/cap_hit"]) == 0


# --------------------------------------------------------------------------------------------------
# DAPO: overlong filtering and the token-level loss, in the module's update
# --------------------------------------------------------------------------------------------------


class TruncateOddRows(RolloutCallback):
    """A test double for the generation limit: flags every odd row of the rollout truncated (as a response that hit
    max_new_tokens without ending) and trims even row i to at most i / 2 + 1 tokens, so that the responses left to
    train on differ in length (the random tiny model almost never ends a response before the limit). It runs
    before DAPO's overlong callbacks (rollout_order 10 and 20)."""

    rollout_order = 5

    def __init__(self):
        self.lengths_before_filter = None

    def on_rollout(self, trainer, module, rollout):
        b, t = rollout.response_mask.shape
        rows = torch.arange(b)
        truncated = rows % 2 == 1
        lengths = rollout.response_lengths.cpu()
        keep = torch.where(truncated, lengths, torch.minimum(lengths, rows // 2 + 1))
        trim = (torch.arange(t) < keep.unsqueeze(-1)).to(rollout.response_mask)
        rollout.response_mask = rollout.response_mask * trim
        rollout.truncated = truncated.to(rollout.truncated.device)
        self.lengths_before_filter = rollout.response_lengths.clone()
        return rollout


@pytest.fixture(scope="module")
def dapo_update(tmp_path_factory, tiny_model_dir):
    """One RL step of recipes/dapo.yaml (its overlong callbacks, clip-higher and token-mean; one group sampler of
    G = 8, so that no group is dropped) on the tiny model: 2 prompts x 8 = 16 responses, one update. Returns the
    test double and the update's record (``RecordingSurrogate``)."""
    tmp = tmp_path_factory.mktemp("dapo_update")
    cli = build(recipe("dapo.yaml"), tiny_overrides(tmp, tiny_model_dir), ablation("dapo-no-dynamic-sampling.yaml"),
                "--trainer.max_steps", "1")
    module = cli.model
    module.policy_loss = RecordingSurrogate(clip_low=0.2, clip_high=0.28)
    double = TruncateOddRows()
    cli.trainer.callbacks.append(double)
    cli.trainer.fit(module, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    (call,) = module.policy_loss.calls
    return double, call


def test_overlong_filter_leaves_truncated_responses_exactly_zero_gradient(dapo_update):
    double, call = dapo_update
    truncated = call["truncated"].bool()
    assert truncated.sum() == 8
    assert (double.lengths_before_filter[1::2] > 0).all(), "the truncated responses had no tokens to mask"
    grad = call["grad"]
    assert torch.equal(grad[truncated], torch.zeros_like(grad[truncated]))
    assert (grad[~truncated] != 0).any(), "no response learned: the zero gradient above shows nothing"


def test_token_level_loss_weighs_every_token_of_the_update_alike(dapo_update):
    _, call = dapo_update
    mask = call["response_mask"].float()
    lengths = mask.sum(-1)[~call["truncated"].bool()]
    assert lengths.unique().numel() > 1, "the responses trained on all have one length"
    assert (call["advantages"] != 0).any()
    # One update per rollout: the old log-probs are the live ones, so every ratio is 1 and nothing clips; the
    # token-mean over the update's N valid tokens gives each token d loss / d logp_t = -A_i / N, whatever the length
    # of its response (seq-mean-token-mean would give -A_i / (16 L_i): a 1-token response's token 6 times a
    # 6-token response's). N counts the untruncated responses' tokens only: the filter took the others out.
    assert_close(call["old_logprobs"] * mask, call["logprobs"] * mask)
    n = mask.sum()
    assert_close(call["grad"], -call["advantages"] * mask / n)


# --------------------------------------------------------------------------------------------------
# VAPO: value pretraining, group sampling, self-imitation
# --------------------------------------------------------------------------------------------------


def test_value_pretraining_moves_the_critic_toward_monte_carlo_returns_and_not_the_policy(tmp_path, tiny_model_dir):
    # recipes/vapo.yaml (a critic of its own, a copy of the policy, at its own lr 1e-4) with value pretraining alone,
    # for one rollout of 4 passes: 4 small Adam steps down the value loss's gradient on that rollout.
    callbacks = _callbacks_file(tmp_path, {"class_path": "rllight.callbacks.ValuePretraining",
                                           "init_args": {"max_steps": 1, "patience": None, "epochs": 4}})
    cli = build(recipe("vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), callbacks,
                "--trainer.max_steps", "-1", "--trainer.max_epochs", "1",
                "--trainer.limit_train_batches", "1")
    module = cli.model
    fits = []
    real_update = module.updater.critic_update

    def critic_update(rollout, **kwargs):
        def squared_error() -> float:  # of the critic as it is now, against the targets it is fitted to
            scored = rollout.select(torch.arange(len(rollout)))
            module.scoring.score(scored, need_old=False, need_values=True, need_ref=False)
            valid = rollout.response_mask.bool()
            return float(((scored.values - rollout.returns)[valid] ** 2).mean())

        before = squared_error()
        out = real_update(rollout, **kwargs)
        fits.append({"rollout": rollout, "before": before, "after": squared_error()})
        return out

    module.updater.critic_update = critic_update
    cli.trainer.fit(module, datamodule=cli.datamodule)

    # No policy update: not one policy step, not one policy parameter moved.
    assert cli.trainer.global_step == 0
    trainable = [n for n, p in module.policy.named_parameters() if p.requires_grad]
    assert unchanged_parameters(module.policy, tiny_model_dir) == trainable
    (fit,) = fits
    rollout = fit["rollout"]
    # The targets are Monte-Carlo returns (lambda 1, gamma 1): the outcome reward on every valid token.
    assert_close(rollout.returns, rollout.rewards.unsqueeze(-1) * rollout.response_mask.float())
    assert fit["after"] < fit["before"], fit


def _rows(answers):
    return [{"messages": [{"role": "user", "content": f"What is {a} + 0?"}], "answer": str(a)} for a in answers]


@pytest.mark.parametrize("overlays,group_size,batch_size", [
    pytest.param((), 8, 8, id="vapo"),
    pytest.param(("vapo-no-group-sampling.yaml",), 1, 64, id="vapo-no-group-sampling"),
])
def test_group_sampling_draws_g_distinct_responses_per_prompt_under_one_group_id(overlays, group_size, batch_size,
                                                                                  tmp_path, tiny_model_dir):
    # VAPO samples G = 8 responses per prompt (its no-group-sampling ablation: 1, with 8x the prompts).
    plain = build(recipe("vapo.yaml"), *[ablation(o) for o in overlays])
    assert (plain.model.sampler.group_size, plain.datamodule.batch_size) == (group_size, batch_size)  # 64 a step
    cli = build(recipe("vapo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), *[ablation(o) for o in overlays])
    module = cli.model
    module.configure_model()
    torch.manual_seed(0)
    rollout = module.sampler(module.producer, _rows([3, 14, 25]))
    assert len(rollout) == 3 * group_size
    assert rollout.group_ids.tolist() == [g for g in range(3) for _ in range(group_size)]
    for g in range(3):
        rows = (rollout.group_ids == g).nonzero().flatten()
        prompts = {tuple(rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()) for i in rows.tolist()}
        assert len(prompts) == 1 and rollout.answers[int(rows[0])] == str([3, 14, 25][g])
        responses = {tuple(rollout.response_ids[i][rollout.response_mask[i].bool()].tolist()) for i in rows.tolist()}
        if group_size > 1:  # G samples of the policy, not G copies of one
            assert len(responses) > 1


def test_self_imitation_replays_only_correct_responses_and_raises_their_likelihood(tmp_path, tiny_model_dir):
    # recipes/grpo.yaml with note 000's replay after every step (coef 1), 4 prompts x 8 responses, rewards 1 / 0.
    # Plain SGD: a small gradient step on the NLL lowers it (to first order), whatever the run before.
    callbacks = _callbacks_file(tmp_path, {"class_path": "rllight.callbacks.SelfImitation", "init_args": {
        "capacity": 64, "every_n_steps": 1, "batch_size": 8, "coef": 1.0, "policy": "fifo"}})
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": f"{__name__}.HalfMixed"},
                             optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05}})
    cli = build(recipe("grpo.yaml"), overlay, callbacks, "--data.batch_size", "4", "--trainer.max_steps", "2")
    module = cli.model
    seen = {True: set(), False: set()}  # (prompt, response) ids of the step's correct and wrong responses
    real_sample = module.producer.sample

    def sample(rows, n, *args, **kwargs):
        part = real_sample(rows, n, *args, **kwargs)
        for i in range(len(part)):
            key = (tuple(part.prompt_ids[i][part.prompt_mask[i].bool()].tolist()),
                   tuple(part.response_ids[i][part.response_mask[i].bool()].tolist()))
            seen[bool(part.correct[i] > 0)].add(key)
        return part

    replays = []
    real_nll_update = module.updater.nll_update

    def nll_update(rollout, coef=1.0, minibatch_size=None, aggregation=None):
        def mean_logprob() -> float:
            scored = rollout.select(torch.arange(len(rollout)))
            module.scoring.score(scored, need_old=True, need_values=False, need_ref=False)
            mask = scored.response_mask.float()
            return float((scored.old_logprobs * mask).sum() / mask.sum())

        before = mean_logprob()
        out = real_nll_update(rollout, coef, minibatch_size, aggregation)
        replays.append({"rollout": rollout, "before": before, "after": mean_logprob()})
        return out

    module.producer.sample = sample
    module.updater.nll_update = nll_update
    cli.trainer.fit(module, datamodule=cli.datamodule)

    assert seen[True] and seen[False], "the step needs both correct and wrong responses"
    (replay,) = replays
    replayed = replay["rollout"]
    assert len(replayed) > 0
    for i in range(len(replayed)):
        key = (tuple(replayed.prompt_ids[i][replayed.prompt_mask[i].bool()].tolist()),
               tuple(replayed.response_ids[i][replayed.response_mask[i].bool()].tolist()))
        assert key in seen[True] and key not in seen[False]
    assert replay["after"] > replay["before"], replay


def test_the_replays_nll_gradient_raises_every_replayed_token_alike():
    # ResponseNLL (coef 0.1), token-mean over the update's 4 valid tokens: responses of 3 tokens and 1 token
    # (+ 2 pads). loss = 0.1 * (1 + 2 + 3 + 0.5) / 4 = 0.1625; d loss / d logp_t = -0.1 / 4 = -0.025 on every
    # valid token (a descent step raises each one's log-probability), 0 on padding.
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -7.0, -7.0]], requires_grad=True)
    batch = SimpleNamespace(response_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]))
    loss, stats = ResponseNLL(coef=0.1)(batch, Outputs(logprobs, None, None),
                                        lambda per_token, mask: TokenMean()(per_token, mask, num_tokens=4.0))
    assert_close(loss, torch.tensor(0.1625))
    assert_close(stats["nll/loss"], torch.tensor(6.5 / 4))
    loss.backward()
    assert_close(logprobs.grad, torch.tensor([[-0.025, -0.025, -0.025], [-0.025, 0.0, 0.0]]))


# --------------------------------------------------------------------------------------------------
# SPPO: the scalar prompt critic
# --------------------------------------------------------------------------------------------------


def test_prompt_critic_gives_one_value_per_prompt_and_the_advantage_is_r_minus_v(tmp_path, tiny_model_dir):
    # recipes/sppo.yaml's separate critic (the tiny model here), 2 responses per prompt so that a prompt's
    # responses can be compared, rewards 1 for an even reference answer, else 0.
    critic = {"class_path": "rllight.critics.PromptCritic",
              "init_args": {"model": {"class_path": "rllight.models.HFModel", "init_args": {"path": tiny_model_dir}}}}
    overlay = tiny_overrides(tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.EvenAnswer"},
                             critic=critic)
    cli = build(recipe("sppo.yaml"), overlay, "--model.sampler.init_args.group_size", "2")
    module = cli.model
    module.configure_model()
    critic = module.critic
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.head.weight)  # away from the zero init (V = 0.5 everywhere, a logit of 0)
    rollout = module.sampler(module.producer, _rows([3, 14, 25]))
    module.scoring.score(rollout, need_old=False)
    module.estimate_advantages(rollout)

    # V(prompt) computed here from the prompt alone: sigmoid of the head at the critic's last prompt token.
    with torch.no_grad():
        mask = rollout.prompt_mask
        hidden = critic.backbone(input_ids=rollout.prompt_ids, attention_mask=mask,
                                 position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state[:, -1]
        v = torch.sigmoid(critic.head(hidden).squeeze(-1))
    assert rollout.values.shape == (6,)  # one value per response ...
    assert_close(rollout.values, v)
    # ... the same for the responses to one prompt (up to the rounding of the head's matrix product, about 1e-7,
    # as it runs on every row), different for different prompts.
    assert_close(rollout.values[0::2], rollout.values[1::2])
    per_prompt = rollout.values[0::2]
    assert ((per_prompt.unsqueeze(0) - per_prompt.unsqueeze(1)).abs() + torch.eye(3)).min() > 1e-3
    assert rollout.rewards.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # answers 3, 14, 25
    # A = R - V(prompt) on every response token (normalize: none, the note's simplified form).
    assert_close(rollout.advantages, (rollout.rewards - v).unsqueeze(-1) * rollout.response_mask.float())
    # The value reads the prompt only: other responses to the same prompts leave it unchanged.
    other = rollout.select(torch.arange(6))
    other.response_ids = torch.flip(other.response_ids, [0])
    other.response_mask = torch.flip(other.response_mask, [0])
    module.scoring.score(other, need_old=False, need_values=True)
    assert not torch.equal(other.response_ids, rollout.response_ids)
    assert_close(other.values, rollout.values)


# --------------------------------------------------------------------------------------------------
# Other components of tests/test_components_act.py's ablations: the entropy bonus and the KL penalty
# --------------------------------------------------------------------------------------------------

# One response of two tokens; the policy has not moved (old log-probs = live ones: ratio 1), A = +1, so the clipped
# surrogate is -A r = -1 per token, token-mean -1, and its gradient -A r / N = -1 / 2 = -0.5 per token.
LOGP = [[-1.0, -2.0]]
REF = [[-1.5, -1.0]]


def _objective_batch():
    logprobs = torch.tensor(LOGP, requires_grad=True)
    batch = SimpleNamespace(response_mask=torch.ones(1, 2), old_logprobs=logprobs.detach().clone(),
                            advantages=torch.ones(1, 2), ref_logprobs=torch.tensor(REF), sample_logprobs=None)
    return logprobs, batch


def _token_mean(per_token, mask):
    return TokenMean()(per_token, mask)


def test_kl_in_the_loss_adds_beta_times_the_token_mean_of_k3_and_pulls_toward_the_reference():
    module = build(recipe("grpo.yaml"), ablation("grpo-kl-in-loss.yaml")).model
    assert (module.kl.coef, module.kl.kind, module.kl.in_reward) == (0.04, "k3", False)
    logprobs, batch = _objective_batch()
    loss, stats = PolicyObjective(module.policy_loss, module.kl)(batch, Outputs(logprobs, torch.zeros(1, 2), None),
                                                                  _token_mean)
    # ref - logp = (-0.5, 1.0); k3 = e^d - d - 1 = (0.6065307 + 0.5 - 1, 2.7182818 - 2) = (0.1065307, 0.7182818),
    # token-mean 0.4124063, times beta 0.04 = 0.0164963 -> loss -1 + 0.0164963 = -0.9835037.
    # d k3 / d logp = 1 - e^d = (0.3934693, -1.7182818), times 0.04 / 2: (0.0078694, -0.0343656): the first token,
    # above the reference, is pushed down, the second, below it, up. Gradient: (-0.4921306, -0.5343656).
    assert_close(loss, torch.tensor(-0.9835037))
    assert_close(stats["policy/kl_ref"], torch.tensor(0.4124063))
    loss.backward()
    assert_close(logprobs.grad, torch.tensor([[-0.4921306, -0.5343656]]))


def test_entropy_bonus_subtracts_coef_times_the_token_mean_entropy():
    module = build(recipe("grpo.yaml"), ablation("grpo-entropy-bonus.yaml")).model
    assert module.entropy_coef == 0.001
    logprobs, batch = _objective_batch()
    entropy = torch.tensor([[0.5, 1.5]], requires_grad=True)
    loss, _ = PolicyObjective(module.policy_loss, None, module.entropy_coef)(batch, Outputs(logprobs, entropy, None),
                                                                            _token_mean)
    # -1 - 0.001 * (0.5 + 1.5) / 2 = -1.001; d loss / d entropy_t = -0.001 / 2: descent raises the entropy.
    assert_close(loss, torch.tensor(-1.001))
    loss.backward()
    assert_close(entropy.grad, torch.tensor([[-0.0005, -0.0005]]))


def test_kl_in_the_reward_lowers_each_tokens_reward_by_beta_k1_and_gae_carries_it():
    module = build(recipe("ppo.yaml"), ablation("ppo-kl-in-reward.yaml")).model
    assert (module.kl.coef, module.kl.kind, module.kl.in_reward) == (0.01, "k1", True)
    rollout = make_rollout([1.0], lengths=[3])
    rollout.old_logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout.ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5]])
    rollout.values = torch.zeros(1, 3)
    module.estimate_advantages(rollout)
    # k1 = logp - ref = (0.5, -1.0, 0); token rewards = outcome (1 on the last token) - 0.01 k1
    #   = (-0.005, 0.01, 1.0).
    assert_close(rollout.token_rewards, torch.tensor([[-0.005, 0.01, 1.0]]))
    # GAE with gamma 1, lambda 0.95 and V = 0: delta_t = r_t; A_2 = 1; A_1 = 0.01 + 0.95 = 0.96;
    # A_0 = -0.005 + 0.95 * 0.96 = 0.907; returns = A + V (without the penalty: 0.9025, 0.95, 1).
    assert_close(rollout.returns, torch.tensor([[0.907, 0.96, 1.0]]))
