"""Settings of a recipe that cannot work together, refused with one line before anything loads."""

from __future__ import annotations

from rllight.errors import RecipeError
from rllight.settings import CriticFirst


def check_recipe(advantage, critic, kl, sampler, critic_first: CriticFirst) -> None:
    """One-line errors for settings that cannot work together, before anything loads (each setting's own range is
    declared by its type: ``rllight.bounds``)."""
    if advantage.needs_values and critic is None:
        raise RecipeError(f"model.advantage: {type(advantage).__name__} needs a critic; set model.critic "
                          "(e.g. class_path: rllight.critics.ValueHead)")
    if kl is not None and kl.in_reward and not advantage.uses_token_rewards:
        raise RecipeError(f"model.kl.in_reward: {type(advantage).__name__} reads only the outcome reward, so a KL "
                          "penalty in the reward would be ignored; put it in the loss (in_reward: false)")
    for name in ("steps", "epochs"):
        if getattr(critic_first, name) and critic is None:
            raise RecipeError(f"model.critic_first.{name} needs model.critic")
    if critic_first.steps and critic_first.epochs:
        raise RecipeError("model.critic_first.steps and model.critic_first.epochs are both set: choose one (steps: "
                          "critic optimizer steps per rollout, VAPO's K_v; epochs: passes over all its minibatches)")
    if getattr(critic, "critic_first_trains_backbone", False) and not critic_first.enabled:
        raise RecipeError("model.critic.critic_first_trains_backbone needs model.critic_first.steps (or "
                          "critic_first.epochs) > 0 (with 0 the value loss trains the shared backbone in every update "
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
