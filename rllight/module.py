"""RLModule: the policy, an optional value model, and one RL step per training batch."""

from __future__ import annotations

import logging
import time

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor
from torch.profiler import record_function

from rllight._compat import forget_step_metrics, lazy_default, no_gradient_sync, plain_instance, rl_steps_done
from rllight.callbacks.base import RolloutContext, in_rollout_order, sampler_of_step
from rllight.checkpoint import load_run_state, save_run_state, with_reference, without_reference
from rllight.critics import Critic
from rllight.data.prompt_stream import prompt_source
from rllight.distributed import Ranks, deal_rollout
from rllight.envs import Environment
from rllight.errors import RecipeError
from rllight.evaluation import EvalSettings, Evaluator
from rllight.fsdp import gathered_policy, is_sharded, shard
from rllight.models import HFModel, LoRA, disable_dropout
from rllight.recipe_checks import check_recipe, check_sharding
from rllight.rewards import IntegerMatch, Reward, RewardRunner, check_rows, preflight
from rllight.rollout import HFEngine, RolloutEngine
from rllight.rollout.metrics import critic_explained_variance, logprob_mismatch, rollout_metrics, scalar_extras
from rllight.rollout.producer import RolloutProducer, prefetch_ahead
from rllight.schedules import apply_recipe_rates, recipe_rates
from rllight.scoring import Scoring
from rllight.settings import Batching, CriticFirst, GradClip, Guards
from rllight.strategies import (AdvantageEstimator, Aggregation, ClippedSurrogate, GroupRelative, GroupSampler,
                                KLPenalty, PolicyLoss, Sampler, TokenMean)
from rllight.strategies.advantages import episode_advantages
from rllight.strategies.token_rewards import token_rewards
from rllight.terms import CriticLoss, LossTerm, PolicyObjective
from rllight.types import Rollout
from rllight.update import Updater, ZeroGradientGuard

log = logging.getLogger(__name__)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)


class RLModule(L.LightningModule):
    """Reinforcement learning for a causal LM, with manual optimisation.

    Each training batch (a list of prompt rows) is one RL step (``rl_step``): draw a rollout (sample, reward),
    rollout callbacks, score it (old log-probs, values, reference), estimate advantages, run the updates
    (``ppo_epochs`` passes of minibatch updates; ``rllight.update.Updater``), log.

    Args:
        model: Where the policy's weights come from (loaded in ``configure_model``).
        lora: Train LoRA adapters instead of every weight (None = full fine-tuning).
        gradient_checkpointing: Recompute the policy's activations in the backward pass (less memory, more compute).
        rollout: Generation engine and sampling settings.
        sampler: Which responses form a rollout (e.g. G per prompt).
        reward: What scores the responses (``rllight.rewards.Reward``: a verifier of the reference answer, a reward
            model, a judge, a mix). None: ``IntegerMatch``, or with an ``environment`` the environment's own scores
            (its ``verifier``, if it has one, checks the reference answers).
        environment: Multi-turn episodes instead of one response per prompt (e.g. ``rllight.envs.Calculator``): the
            model's turns are trained, the environment's observations are context and the environment scores each
            episode. None = one response per prompt.
        reward_runner: Where verifiers are computed: worker processes with a per-sample timeout (a hanging or crashing
            verifier gives that sample 0, counted); None = in the training process, without a timeout.
        reward_preflight: Before training, this many rows' reference answers must earn the reward's maximum and a
            wrong answer must not, or the run stops with one line (0 = no check).
        advantage: Advantage estimator (GroupRelative for GRPO, GAE for PPO).
        policy_loss: Per-token policy objective.
        loss_terms: Terms of your own added to the loss of every policy update (``rllight.terms.LossTerm``
            subclasses, e.g. ``class_path: my_lab.LengthPenalty``).
        aggregation: How per-token losses are averaged (token-mean, seq-mean-token-mean, ...).
        critic: The value model: ``ValueHead`` on the shared backbone, ``SeparateCritic``, or None.
        critic_first: Critic-only updates on each fresh rollout before the policy's (``rllight.settings.CriticFirst``:
            ``steps``, VAPO's K_v, or ``epochs``; both 0 = joint updates).
        kl: KL to a frozen copy of the initial policy (None = no reference model).
        entropy_coef: Weight of an entropy bonus (0 = off).
        batching: How a rollout is cut into optimizer updates and forward passes (``rllight.settings.Batching``:
            ``ppo_epochs``, ``minibatch_size``, ``micro_batch_size``, ``micro_batch_tokens``, ``logprob_chunk_size``).
        grad_clip: Gradient-norm clipping, the policy's and the critic's parameters each to its own norm so that a
            jointly trained critic does not scale the policy's step (``rllight.settings.GradClip``: ``policy``,
            ``critic``; None = off).
        max_prompt_tokens: Prompts over this many tokens are dropped or cut, as ``prompt_truncation`` says (None: none).
        prompt_truncation: ``drop`` (counted) or ``left`` (keep the last ``max_prompt_tokens`` tokens, counted).
        guards: When a run warns or ends by itself (``rllight.settings.Guards``: non-finite updates, failing rewards,
            steps without an update or with a zero gradient).
        optimizer: Optimizer over the trainable parameters: one group for the policy (``name: policy``) and, with
            a critic, one for the critic (``name: critic``, at ``critic.lr`` when set).
        lr_scheduler: Learning-rate schedule, stepped after each policy update, e.g.
            ``rllight.schedules.WarmupSchedule`` (per-group warm-up then constant or cosine). None = constant.
        evaluation: How the validation loop samples (n responses per prompt, temperature, top-p, max tokens, the
            k of avg@k / pass@k / maj@k); greedy by default.
        export_dir: Save the trained policy as a Hugging Face folder here when fit ends.
    """

    def __init__(
        self,
        model: HFModel,
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        rollout: RolloutEngine = lazy_default(HFEngine),
        sampler: Sampler = lazy_default(GroupSampler),
        reward: Reward | None = None,
        environment: Environment | None = None,
        reward_runner: RewardRunner | None = lazy_default(RewardRunner),
        reward_preflight: int = 4,
        advantage: AdvantageEstimator = lazy_default(GroupRelative),
        policy_loss: PolicyLoss = lazy_default(ClippedSurrogate),
        loss_terms: list[LossTerm] | None = None,
        aggregation: Aggregation = lazy_default(TokenMean),
        critic: Critic | None = None,
        critic_first: CriticFirst = CriticFirst(),
        kl: KLPenalty | None = None,
        entropy_coef: float = 0.0,
        batching: Batching = Batching(),
        grad_clip: GradClip = GradClip(),
        max_prompt_tokens: int | None = None,
        prompt_truncation: str = "drop",
        guards: Guards = Guards(),
        optimizer: OptimizerCallable = _adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        evaluation: EvalSettings = lazy_default(EvalSettings),
        export_dir: str | None = None,
    ):
        super().__init__()
        check_recipe(advantage, critic, kl, sampler, critic_first)
        rollout, reward_runner = plain_instance(rollout), plain_instance(reward_runner)
        reward = IntegerMatch() if reward is None and environment is None else plain_instance(reward)
        if reward is not None and environment is not None:  # e.g. a recipe's reward under an environment's overlay
            log.warning("model.reward (%s) is not used: model.environment (%s) scores every episode; set "
                        "model.reward: null", type(reward).__name__, type(environment).__name__)
        self.automatic_optimization = False
        self.source, self.lora, self.gradient_checkpointing = model, lora, gradient_checkpointing
        self.rollout, self.sampler, self.reward, self.environment = rollout, sampler, reward, environment
        self.reward_runner, self.reward_preflight = reward_runner, reward_preflight
        self.advantage, self.policy_loss, self.aggregation, self.kl = advantage, policy_loss, aggregation, kl
        self.entropy_coef, self.loss_terms, self.critic = entropy_coef, list(loss_terms or []), critic
        self.critic_first, self.batching, self.grad_clip, self.guards = critic_first, batching, grad_clip, guards
        self.optimizer_fn, self.lr_scheduler_fn = optimizer, lr_scheduler
        self.evaluation, self.export_dir = evaluation, export_dir
        self.producer, self.scoring, self.updater = self._layers(max_prompt_tokens, prompt_truncation)
        self.evaluator = Evaluator(evaluation)
        self.policy = self.ref_policy = self.tokenizer = None  # loaded in configure_model
        self.prompt_stream, self._prompt_state = None, {}  # extra training prompts (set up with the data), its state
        self.prefetched_through = -1  # the last training batch whose rollout the engine was asked for ahead
        self._consumed_steps, self._batches_drawn, self._preflight_done = 0, 0, False
        self._epoch_start = (0, 0, 0)  # (updates, consumed steps, batches drawn) as the epoch began

    def _layers(self, max_prompt_tokens: int | None, truncation: str) -> tuple[RolloutProducer, Scoring, Updater]:
        """The layers of a step, wired from the stored settings: the rollout producer (the step's prompts, generation,
        the reward or the environment's episodes), the scoring (old log-probs, values, the reference's log-probs) and
        the updater (minibatch updates, gradient clipping, the guards on non-finite or zero gradients), which reads
        Lightning's optimizer, schedule, backward pass and step count at each update."""
        batching, guards = self.batching, self.guards
        producer = RolloutProducer(self.rollout, self.reward, max_prompt_tokens, guards.max_failed_reward_steps,
                                   self.reward_runner, environment=self.environment, prompt_truncation=truncation,
                                   max_steps_without_update=guards.max_steps_without_update)
        scoring = Scoring(self.rollout, self.critic, self.kl is not None, batching.micro_batch_size,
                          batching.micro_batch_tokens, batching.logprob_chunk_size)
        updater = Updater(scoring, self.aggregation, self.grad_clip.policy, self.grad_clip.critic,
                          guards.max_consecutive_skips, batching.minibatch_size,
                          ZeroGradientGuard(guards.zero_gradient_warning_steps, guards.max_zero_gradient_steps),
                          optimizer=self.optimizers, scheduler=self.lr_schedulers, step=lambda: self.global_step,
                          backward=self.manual_backward, no_sync=lambda: no_gradient_sync(self._trainer),
                          ranks=lambda: self.ranks, policy_moved=lambda: self.rollout.update_weights(self.policy))
        return producer, scoring, updater

    @property
    def ranks(self) -> Ranks:
        """Collectives over this run's processes."""
        return Ranks(self._trainer)

    # ----------------------------------------------------------------------------------- set-up
    def setup(self, stage: str) -> None:
        """Before the model loads: sizes that must divide among the processes do, the engine serves this many
        processes, and every reference answer is one the reward can match (a row whose answer can never be
        matched would only ever teach "wrong")."""
        if stage == "fit":
            self.updater.local_size(self.batching.minibatch_size)
            self.advantage.total = self.ranks.reduce if self.ranks.world_size > 1 else None  # global statistics
        self.rollout.check_processes(self.ranks.world_size)
        check_sharding(self._trainer, self.lora, self.rollout)
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        train_rows = (getattr(datamodule, "train_rows", None) or []) if stage == "fit" else []
        if self.answer_checker is not None:  # per data source
            check_rows(self.answer_checker, [*train_rows, *(getattr(datamodule, "val_rows", None) or [])])
        self.preflight_rewards(train_rows)
        if train_rows:  # the step's prompts: the loader's batch, or a curriculum's choice (data.curriculum)
            source = self.prompt_stream = prompt_source(datamodule, train_rows, self.ranks, self.rollout)
            source.load_state_dict(self._prompt_state)
            self.producer.bind(self.policy, self.tokenizer, source.draw, self.ranks, source.hear)

    def preflight_rewards(self, train_rows: list[dict]) -> None:
        """``Reward.check`` (what can be found wrong before the policy loads), then the pre-flight
        (``rllight.rewards.preflight``) through the reward as the producer scores it, once."""
        if self._preflight_done or self.answer_checker is None:
            return
        self.answer_checker.check()
        if train_rows and self.reward_preflight:
            preflight(self.answer_checker.guarded(self.reward_runner), train_rows, k=self.reward_preflight)
            self._preflight_done = True

    @property
    def answer_checker(self) -> Reward | None:
        """The reward that checks the rows' reference answers: the environment's verifier where an environment
        scores the episodes (None: it has none, nothing is checked), else ``model.reward``."""
        if self.environment is not None:
            return getattr(self.environment, "verifier", None)
        return self.reward

    def teardown(self, stage: str) -> None:
        self.producer.close()  # the reward workers, a batch reward's model: they start again at the next score

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self.policy, self.tokenizer = self.source.load()
        self.policy.config.use_cache = False
        if self.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:
            self.policy = self.lora.apply(self.policy)
        disable_dropout(self.policy)
        self.policy.train()
        if self.critic is not None:
            self.critic.setup(self.policy, self.tokenizer, self.source)
        if self.kl is not None and self.lora is None:  # with LoRA the reference is the adapter-free model
            self.ref_policy, _ = self.source.load()
            self.ref_policy.requires_grad_(False).eval()
        self.scoring.policy, self.scoring.ref_policy = self.policy, self.ref_policy
        self.scoring.adapters = self.lora is not None
        if is_sharded(self._trainer):  # FSDP: the engine copies the full policy first; then each rank keeps a shard
            self.rollout.keep_copy(self.policy)
            models = {"policy": self.policy, **({"critic": self.critic} if self.critic is not None else {})}
            mixed_precision = getattr(self._trainer.strategy, "mixed_precision", lambda: None)()
            self.scoring.net = shard(models, self.device_mesh["data_parallel"], mixed_precision)
        self.producer.bind(self.policy, self.tokenizer)

    def configure_optimizers(self):
        groups = [{"name": "policy", "params": [p for p in self.policy.parameters() if p.requires_grad]}]
        if self.critic is not None:
            groups += self.critic.param_groups()  # e.g. a head with a learning rate of its own
        optimizer = self.optimizer_fn(groups)
        if self.lr_scheduler_fn is None:
            self.recipe_rates = recipe_rates(optimizer)
            return optimizer
        scheduler = self.lr_scheduler_fn(optimizer)
        if getattr(scheduler, "needs_total_steps", False) and scheduler.total_steps is None:
            if self.trainer.max_steps is None or self.trainer.max_steps < 1:
                raise RecipeError("model.lr_scheduler.total_steps: a decaying schedule needs it, or trainer.max_steps")
            scheduler.total_steps = self.trainer.max_steps
        self.recipe_rates = recipe_rates(optimizer, scheduler)  # a resume restores the checkpoint's: see below
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---------------------------------------------------------------------------- checkpoints
    def state_dict(self, *args, **kwargs):  # the frozen reference policy is reloaded from its source, never saved
        return without_reference(super().state_dict(*args, **kwargs))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return super().load_state_dict(with_reference(state_dict, self.ref_policy), strict=strict, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The run's own state besides the weights and the optimizer's: each part's ``state_dict()``, by name.
        prompts = self.prompt_stream.state_dict() if self.prompt_stream is not None else self._prompt_state
        save_run_state(checkpoint, {"updater": self.updater.state_dict(), "prompt_stream": prompts,
                                    "producer": self.producer.state_dict(), "rollout_engine": self.rollout.state_dict(),
                                    "prefetched_through": self.prefetched_through}, self.ranks)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = load_run_state(checkpoint, self.ranks)  # each part's own state, by name: a part missing starts fresh
        self.updater.load_state_dict(state.get("updater", {}))
        self._prompt_state = state.get("prompt_stream", {})
        if self.prompt_stream is not None:
            self.prompt_stream.load_state_dict(self._prompt_state)
        self.producer.load_state_dict(state.get("producer", {}))
        self.rollout.load_state_dict(state.get("rollout_engine", {}))
        self.prefetched_through = state.get("prefetched_through", -1)

    # --------------------------------------------------------------------------------- train
    def training_step(self, rows: list[dict], batch_idx: int) -> None:
        self.rl_step(rows, batch_idx)
        # The data side counts the step here, not in on_train_batch_end, which Lightning runs after the checkpoint
        # callbacks: a checkpoint taken after this step must record it, or a resumed run would replay its batch.
        self.prompt_stream.trained()

    def rl_step(self, rows: list[dict], batch_idx: int) -> None:
        """One RL step on a batch of prompt rows."""
        start, data = time.perf_counter(), self.trainer.datamodule
        self.producer.begin_step()  # why a step may have nothing to train on is counted afresh
        with record_function("rllight.rollout"):  # 1. draw a rollout (the markers name a profile's phases)
            rollout = self.prompt_stream.run(sampler_of_step(self._trainer, self.sampler), self.producer, rows)
        metrics = rollout_metrics(rollout)
        rollout = self._after_rollout_callbacks(rollout, metrics, start)  # 2. shape, filter, store, or consume it
        if rollout is None:
            return
        seed = int(self.global_step) * 1000003 + batch_idx  # the seed orders the minibatches
        plan = self.updater.plan(len(rollout), self.batching.ppo_epochs, self.batching.minibatch_size, seed)
        updates_per_step = sum(len(epoch) for epoch in plan)
        # With a single update per rollout the live log-probs equal the old ones, so the extra forward
        # is skipped (unless a KL penalty in the reward needs them before the update).
        need_old = updates_per_step > 1 or (self.kl is not None and self.kl.in_reward)
        upcoming, end = getattr(data, "upcoming_batches", None), self.trainer.max_steps  # overlapping this update
        left = end - self.global_step if end >= 0 else None
        self.prefetched_through = prefetch_ahead(self.sampler, self.producer, updates_per_step, self.prefetched_through,
                                                 upcoming, getattr(data, "batches_trained", 0), left)
        scored = time.perf_counter()
        with record_function("rllight.score"):  # 3. score it, in the first epoch's minibatches; 4. advantages
            metrics.update(self._score_and_estimate(rollout, need_old, layout=plan[0]))
        # 5. the updates' loss: the policy's objective, the recipe's own terms, and the critic's loss, unless the
        # critic is fitted first (VAPO: critic-only updates, then the advantages again with the fitted critic)
        terms = [PolicyObjective(self.policy_loss, self.kl, self.entropy_coef), *self.loss_terms]
        if self.critic_first.enabled:
            metrics.update(self.updater.critic_first(rollout, self.estimate_advantages, plan[0],
                                                     self.critic_first.steps, self.critic_first.epochs))
        elif self.critic is not None:
            terms.append(CriticLoss(self.critic))
        metrics["time/score"] = time.perf_counter() - scored
        metrics.update(self.updater.learning_rates())  # of this step's updates (after any schedule)
        trained = time.perf_counter()
        metrics.update(self.updater.policy_updates(rollout, terms, plan))  # 6. the updates
        metrics["time/train"] = time.perf_counter() - trained
        metrics["time/step"] = time.perf_counter() - start
        metrics["perf/tokens_per_s"] = rollout.response_mask.sum().float() / metrics["time/step"]
        self._log(metrics)  # 7. log

    def _after_rollout_callbacks(self, rollout: Rollout, metrics: dict, start: float) -> Rollout | None:
        """The rollout callbacks in ``rollout_order`` (stable: equal orders keep the recipe's order), the empty-rollout
        guard, then the groups dealt evenly to the ranks (``deal_rollout``). None (after logging ``metrics``) when a
        callback used the rollout itself (e.g. value pretraining) or every rank's rollout is empty: no update."""
        context, emptied_by = self.rollout_context(), None
        for cb in in_rollout_order(self._trainer.callbacks if self._trainer is not None else []):
            had = len(rollout) > 0 and rollout.response_mask.sum() > 0
            rollout = cb.on_rollout(self.trainer, context, rollout)
            if rollout is None:
                self._consumed_steps += 1
                metrics["time/step"] = time.perf_counter() - start
                self._log(metrics)
                return None
            emptied_by = emptied_by or (type(cb).__name__ if had and not rollout.response_mask.sum() > 0 else None)
        metrics.update(scalar_extras(rollout))  # callbacks' own metrics
        empty = len(rollout) == 0 or rollout.response_mask.sum() == 0
        if empty:
            metrics["guard/empty_rollouts"] = 1.0
        # Under DDP a rank whose rollout is empty is dealt a share of the other ranks' groups (or joins their
        # updates with no rows); only when every rank's rollout is empty is the step skipped, by all ranks together.
        if not self.ranks.any(not empty):
            self.producer.note_empty_step(self.global_step, emptied_by)
            self._log(metrics)
            return None
        if empty:
            log.info("step %d: this rank's rollout is empty; it is dealt others' groups", self.global_step)
            rollout = rollout.select([])
        return deal_rollout(rollout, self.ranks, self.producer.pad_id)  # whole groups, evenly: same updates anywhere

    def rollout_context(self) -> RolloutContext:
        """What a rollout callback may use of this run, passed in the module's place (``RolloutContext``)."""
        return RolloutContext(self.updater, self.scoring, self.ranks, self.tokenizer, self.device, self.critic,
                              lambda metrics: self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1),
                              getattr(self.rollout, "max_new_tokens", None), getattr(self.advantage, "gamma", 1.0))

    def _score_and_estimate(self, rollout: Rollout, need_old: bool, layout: list[Tensor] | None = None) -> dict:
        """Old log-probs, values and reference log-probs without gradients (in the micro-batches of ``layout``,
        the first epoch's minibatches: ``Scoring.score``), then token rewards, advantages and returns; their
        metrics (engine/trainer mismatch, the estimator's statistics, the critic's explained variance as it
        enters the step)."""
        # Every rank, an empty one too: FSDP's passes and the estimators' batch statistics are collectives.
        self.scoring.score(rollout, need_old=need_old, layout=layout)
        self.estimate_advantages(rollout)
        if len(rollout) == 0:
            return {}
        metrics = {}
        if rollout.old_logprobs is not None:  # else measured on the live log-probs in the update
            metrics.update(logprob_mismatch(rollout.old_logprobs, rollout.sample_logprobs, rollout.response_mask))
        metrics.update(scalar_extras(rollout))
        ev = critic_explained_variance(rollout)  # of the critic as it enters the step, on the fresh rollout
        if ev is not None:
            metrics["value/explained_variance"] = ev
        return metrics

    def estimate_advantages(self, rollout: Rollout) -> None:
        """Token rewards (the outcome on the last response token, minus the KL penalty when it is in the
        reward), then advantages and returns on the full rollout (groups need every member)."""
        rollout.token_rewards = token_rewards(rollout, self.advantage, self.kl)
        rollout.advantages, rollout.returns = episode_advantages(self.advantage, rollout)

    def _log(self, metrics: dict) -> None:
        """Log a step's metrics as ``train/<key>`` at its RL step, counted from 1 as the progress lines count (the
        loggers' x axis: ``step``; the ``epoch`` Lightning adds without one, kept); reward, accuracy on the bar."""
        axes = {"step": rl_steps_done(self.trainer) + 1, "epoch": self.current_epoch}
        clean = {k: v.detach().float() if isinstance(v, Tensor) else torch.tensor(float(v))
                 for k, v in {**metrics, **axes}.items()}
        prog = {"reward/mean", "reward/accuracy"}
        self.log_dict({k if k in axes else f"train/{k}": v for k, v in clean.items() if k not in prog},
                      on_step=True, on_epoch=False, batch_size=1)
        self.log_dict({f"train/{k}": v for k, v in clean.items() if k in prog}, on_step=True, on_epoch=False,
                      prog_bar=True, batch_size=1)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        forget_step_metrics(self.trainer)  # a metric of some steps only must not repeat on later steps
        self._batches_drawn += 1

    def on_train_start(self) -> None:
        # The engine's own weights (vLLM, a lower-precision copy) may have been made before a checkpoint
        # was restored (e.g. by a validation before fit): sync them with the restored policy.
        if self.trainer.ckpt_path is not None:
            self.rollout.update_weights(self.policy)
            changes = apply_recipe_rates(self.optimizers().optimizer, self.lr_schedulers(), self.recipe_rates)
            if changes:  # the recipe's rates win over the restored ones
                log.warning("resumed with the recipe's learning rates: %s", ", ".join(changes))

    def on_train_epoch_start(self) -> None:
        self._epoch_start = (self.global_step, self._consumed_steps, self._batches_drawn)

    def on_train_epoch_end(self) -> None:
        # Progress is an update, or a step a callback used (value pretraining makes no policy update). An epoch that
        # drew no batch made none by design: a resume from a checkpoint saved at an epoch's end (validation on)
        # first ends the epoch Lightning restores, with no batch left in it.
        updates, consumed, drawn = self._epoch_start
        if self._batches_drawn > drawn and (self.global_step, self._consumed_steps) == (updates, consumed):
            # Otherwise a run whose every batch is filtered out would loop over epochs forever.
            raise RecipeError(f"epoch {self.current_epoch} made no update: {self.producer.why_empty()}; fix that or "
                              "relax the filters")

    # ---------------------------------------------------------------------------- validate
    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        self.evaluator.run(self.producer, self.rollout, rows)

    def on_validation_epoch_end(self) -> None:
        """The evaluation's metrics (``Evaluator.finish``); ``val/accuracy`` on the progress bar."""
        metrics = self.evaluator.finish(self.trainer, rl_steps_done(self.trainer))
        self.log_dict({k: float(v) for k, v in metrics.items() if k != "val/accuracy"}, sync_dist=False)
        if "val/accuracy" in metrics:
            self.log("val/accuracy", float(metrics["val/accuracy"]), prog_bar=True)

    # ------------------------------------------------------------------------------ export
    def on_fit_end(self) -> None:
        if self.export_dir and (self.trainer.is_global_zero or self.scoring.sharded):  # FSDP: all ranks gather
            self.export(self.export_dir)

    def export(self, path: str) -> None:
        """Save the policy and tokenizer as a Hugging Face folder, LoRA adapters merged
        (``rllight.export.export_policy``: written aside, never over files an export did not write)."""
        from rllight.export import export_policy

        policy = gathered_policy(self.policy, self.lora) if self.scoring.sharded else self.policy
        if policy is not None:  # under FSDP: rank 0
            export_policy(policy, self.tokenizer, path, info={"global_step": int(self.global_step)})
