"""Learning-rate schedules per optimizer group, separate gradient clipping of policy and critic, and the
configurations refused before anything loads (a group baseline with one response per prompt, a critic no
estimator reads)."""

import math

import pytest
import torch
from jsonargparse import ArgumentError

from helpers import build, tiny_overrides
from conftest import RECIPES
from rllight.app.command_line import one_line_parse_error
from rllight.errors import RecipeError
from rllight.schedules import WarmupSchedule, warmup_factor


def test_warmup_factor_by_hand():
    # Warm-up 4: (step + 1) / 4 -> 0.25, 0.5, 0.75, 1.0; the first update already moves.
    assert [warmup_factor(s, 4, "constant", None, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # Cosine from step 4 to total 8, min 0: step 6 is half-way -> 0.5 * (1 + cos(pi / 2)) = 0.5; step 8 -> 0.
    assert warmup_factor(6, 4, "cosine", 8, 0.0) == pytest.approx(0.5)
    assert warmup_factor(8, 4, "cosine", 8, 0.0) == pytest.approx(0.0)
    # One quarter of the way (step 5 of 4..8): 0.5 * (1 + cos(pi / 4)) = 0.85355...; with min 0.1:
    # 0.1 + 0.9 * 0.85355 = 0.86820.
    assert warmup_factor(5, 4, "cosine", 8, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    # Linear: step 6 of 4..8 -> 1 - 0.5 = 0.5; past the end it stays at min.
    assert warmup_factor(6, 4, "linear", 8, 0.0) == pytest.approx(0.5)
    assert warmup_factor(20, 4, "linear", 8, 0.2) == pytest.approx(0.2)


def test_policy_and_critic_groups_follow_their_own_schedules():
    w = torch.nn.Parameter(torch.zeros(1))
    v = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"name": "policy", "params": [w], "lr": 1.0}, {"name": "critic", "params": [v], "lr": 10.0}])
    sched = WarmupSchedule(opt, warmup_steps=4, decay="constant", critic_warmup_steps=0)
    seen = []
    for _ in range(5):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    # Policy: 1.0 x (0.25, 0.5, 0.75, 1, 1); critic: no warm-up, 10 throughout.
    assert seen == [[0.25, 10.0], [0.5, 10.0], [0.75, 10.0], [1.0, 10.0], [1.0, 10.0]]
    # The position is in the state, and a fresh scheduler loaded from it continues there.
    state = sched.state_dict()
    opt2 = torch.optim.SGD([{"name": "policy", "params": [w], "lr": 1.0}, {"name": "critic", "params": [v], "lr": 10.0}])
    sched2 = WarmupSchedule(opt2, warmup_steps=4, critic_warmup_steps=0)
    sched2.load_state_dict(state)
    sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == [1.0, 10.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"warmup_steps": -1}, "WarmupSchedule.warmup_steps must be an integer >= 0, got -1"),  # a declared bound
    ({"critic_warmup_steps": -1}, "WarmupSchedule.critic_warmup_steps must be an integer >= 0 or null, got -1"),
    ({"min_lr_ratio": 2.0}, "WarmupSchedule.min_lr_ratio must be a number in [0, 1], got 2.0"),
    ({"decay": "exp"}, "model.lr_scheduler.decay: 'exp' is not one of constant, linear, cosine"),
])
def test_bad_schedule_values_name_the_key(kwargs, message):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(RecipeError) as err:
        WarmupSchedule(opt, **kwargs)
    assert str(err.value) == message


def test_a_warmup_schedule_acts_in_a_run(tmp_path, tiny_model_dir):
    """The logged rate of the policy follows the warm-up in a real (tiny) run; the critic's has none."""
    from lightning.pytorch.loggers import CSVLogger  # noqa: F401  (the run logs through it)

    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    cli = build(
        f"{RECIPES}/ppo.yaml", overlay, "--trainer.max_steps", "3", "--model.batching.minibatch_size", "null",
        "--model.batching.ppo_epochs", "1", "--model.lr_scheduler", "rllight.schedules.WarmupSchedule",
        "--model.lr_scheduler.init_args.warmup_steps", "4", "--model.lr_scheduler.init_args.critic_warmup_steps",
        "0", "--model.critic.init_args.lr", "0.05",
    )
    seen = []
    cli.model._log = lambda metrics: seen.append((float(metrics["lr/policy"]), float(metrics["lr/critic"])))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # Base lr 1e-2 (tiny overlay) x 0.25, 0.5, 0.75; the critic at its own 0.05 from the start.
    assert seen == [(pytest.approx(2.5e-3), 0.05), (pytest.approx(5e-3), 0.05), (pytest.approx(7.5e-3), 0.05)]


def test_policy_and_critic_gradients_are_clipped_separately(tmp_path, tiny_model_dir):
    """A tiny critic clip must not scale the policy's step: the policy's gradient norm after clipping is
    its own (below grad_clip.policy 1e9, untouched), the critic's is cut to 1e-3."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    cli = build(f"{RECIPES}/ppo.yaml", overlay, "--trainer.max_steps", "1", "--model.batching.minibatch_size", "null",
                "--model.batching.ppo_epochs", "1", "--model.grad_clip.policy", "1e9",
                "--model.grad_clip.critic", "1e-3")
    module = cli.model
    after = {}
    real = module.updater.clip_gradients

    def spy(optimizer, policy_key):
        norms = real(optimizer, policy_key)
        for group in optimizer.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            after[group["name"]] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        after["before"] = {k: float(v) for k, v in norms.items()}
        return norms

    module.updater.clip_gradients = spy
    cli.trainer.fit(module, datamodule=cli.datamodule)
    assert after["before"]["value/grad_norm"] > 1e-3  # the clip binds on the critic...
    assert after["critic"] == pytest.approx(1e-3, rel=1e-3)
    # ...and the policy keeps its own norm (a joint clip would have scaled it by 1e-3 / total norm).
    assert after["policy"] == pytest.approx(after["before"]["policy/grad_norm"], rel=1e-5)


@pytest.mark.parametrize("recipe", ["grpo.yaml", "rloo.yaml"])
def test_group_baselines_with_one_response_per_prompt_are_refused(recipe):
    with pytest.raises(RecipeError, match=r"group_size 1 cannot learn"):
        build(f"{RECIPES}/{recipe}", "--model.sampler.init_args.group_size", "1")


def test_dynamic_sampling_refuses_a_group_of_one_as_the_recipe_is_read():
    """DAPO's sampler declares group_size >= 2 (a group of one is never mixed): the parser refuses it."""
    with pytest.raises(ArgumentError) as err:
        build(f"{RECIPES}/dapo.yaml", "--model.sampler.init_args.group_size", "1")
    assert one_line_parse_error(str(err.value)) == ("model.sampler.init_args.group_size must be an integer >= 2, "
                                                     "got 1 (see: rllight fit --help)")


def test_a_critic_that_no_estimator_reads_is_refused():
    with pytest.raises(RecipeError, match="model.critic: GroupRelative does not read values"):
        build(f"{RECIPES}/grpo.yaml", "--model.critic", "rllight.critics.ValueHead")


def test_a_separate_critic_head_learns_at_its_own_rate(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    cli = build(f"{RECIPES}/vapo.yaml", overlay, "--model.critic.init_args.lr", "1e-4",
                "--model.critic.init_args.head_lr", "1e-3")
    module = cli.model
    module.configure_model()
    module._trainer = cli.trainer
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert set(groups) == {"policy", "critic", "critic_head"}
    assert groups["critic"]["lr"] == 1e-4 and groups["critic_head"]["lr"] == 1e-3
    assert groups["policy"]["lr"] == 1e-2  # the tiny overlay's policy rate
    head = {id(p) for p in module.critic.head.parameters()}
    assert {id(p) for p in groups["critic_head"]["params"]} == head
    assert not head & {id(p) for p in groups["critic"]["params"]}


def test_a_critic_decays_its_weights_at_its_own_rate(tmp_path, tiny_model_dir):
    """SPPO's script decays the critic's weights by 0.01 and the actor's by 0.1 (recipes/paper/sppo.yaml): the critic's
    weight_decay sets its optimizer groups', the policy's stays the optimizer's."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    cli = build(f"{RECIPES}/vapo.yaml", overlay, "--model.optimizer.init_args.weight_decay", "0.1",
                "--model.critic.init_args.head_lr", "1e-3", "--model.critic.init_args.weight_decay", "0.01")
    module = cli.model
    module.configure_model()
    module._trainer = cli.trainer
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    decay = {g["name"]: g["weight_decay"] for g in optimizer.param_groups}
    assert decay == {"policy": 0.1, "critic": 0.01, "critic_head": 0.01}
