"""Settings of a recipe that cannot work together, refused with one line before anything loads."""

from __future__ import annotations

from rllight.errors import RecipeError


def check_recipe(advantage, critic, kl, sampler, critic_first: tuple[int, int], counts: dict[str, int | None]) -> None:
    """One-line errors for settings that cannot work together, before anything loads. ``critic_first``: the
    module's ``(critic_steps_first, critic_epochs_first)``. ``counts``: the module's options that count something
    (``{"ppo_epochs": 1, ...}``), each at least 1 where set (None: never, for a guard)."""
    for name, value in counts.items():
        if value is not None and value < 1:
            raise RecipeError(f"model.{name} must be >= 1, got {value}")
    if advantage.needs_values and critic is None:
        raise RecipeError(f"model.advantage: {type(advantage).__name__} needs a critic; set model.critic "
                          "(e.g. class_path: rllight.critics.ValueHead)")
    if kl is not None and kl.in_reward and not advantage.uses_token_rewards:
        raise RecipeError(f"model.kl.in_reward: {type(advantage).__name__} reads only the outcome reward, so a KL "
                          "penalty in the reward would be ignored; put it in the loss (in_reward: false)")
    for name, value in zip(("critic_steps_first", "critic_epochs_first"), critic_first):
        if value < 0:
            raise RecipeError(f"model.{name} must be >= 0 (0 = no critic-only updates first), got {value}")
        if value and critic is None:
            raise RecipeError(f"model.{name} needs model.critic")
    if all(critic_first):
        raise RecipeError("model.critic_steps_first and model.critic_epochs_first are both set: choose one (steps: "
                          "critic optimizer steps per rollout, VAPO's K_v; epochs: passes over all its minibatches)")
    if getattr(critic, "critic_first_trains_backbone", False) and not any(critic_first):
        raise RecipeError("model.critic.critic_first_trains_backbone needs model.critic_steps_first (or "
                          "critic_epochs_first) > 0 (with 0 the value loss trains the shared backbone in every update "
                          "anyway)")
    if critic is not None and not advantage.needs_values:
        raise RecipeError(f"model.critic: {type(advantage).__name__} does not read values, so the critic would train "
                          "for nothing; remove model.critic or choose an estimator that uses it (e.g. GAE)")
    # (DynamicSampling refuses a group of one itself, where its group_size enters.)
    group_size = getattr(sampler, "group_size", None)
    if group_size is not None and group_size < advantage.min_group_size:
        raise RecipeError(
            f"model.advantage: {type(advantage).__name__} compares the responses to one prompt, so group_size "
            f"{group_size} cannot learn (every advantage would be 0); set "
            f"model.sampler.init_args.group_size >= {advantage.min_group_size}")


def check_sharding(trainer, lora, engine) -> None:
    """Refuse with one line, before the model loads, what FSDP does not support yet: a LoRA policy with an
    engine that holds merged weights of its own (vLLM with ``lora_sync: merged``, a rollout worker around an
    engine that needs them, a server), which a sharded peft model cannot give yet. ``HFEngine`` keeps a copy of
    the policy, adapters and all; an engine that syncs the adapter only (``syncs_lora_adapters``: ``VLLMEngine``'s
    default) gathers the adapter tensors alone."""
    from rllight.fsdp import is_sharded

    if not (is_sharded(trainer) and lora is not None and getattr(engine, "syncs_merged_weights", False)):
        return
    if not getattr(engine, "syncs_lora_adapters", False):
        raise RecipeError(f"model.lora with trainer.strategy FSDP: {type(engine).__name__} needs merged weights, "
                          "which a sharded LoRA policy cannot give yet; use model.rollout: rllight.rollout.HFEngine "
                          "or rllight.rollout.vllm.VLLMEngine with lora_sync: adapter")


def with_token_scores(token_rewards, dense_rewards, advantage):
    """``token_rewards`` plus the scores a reward gave per response token (``Rollout.dense_rewards``; None: none).
    One line where ``advantage`` reads only the outcome reward, which would drop them without a word."""
    if dense_rewards is None:
        return token_rewards
    if not advantage.uses_token_rewards:
        raise RecipeError(f"model.reward gives scores per response token, which model.advantage "
                          f"{type(advantage).__name__} does not read (it reads one reward per response); choose an "
                          "estimator that reads token rewards (GAE, VAPO, REINFORCE++) or give one score per response")
    return token_rewards + dense_rewards
