"""RLModule: the policy, an optional value head, and one RL step per training batch."""

from __future__ import annotations

import logging
import math
import os
import time

import lightning as L
import torch
from torch.utils.data import DistributedSampler
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from jsonargparse import lazy_instance
from torch import Tensor
from torch.profiler import record_function

from rllight._compat import forget_step_metrics, no_gradient_sync, plain_instance
from rllight.algorithms import chunked_logprobs_and_entropy, explained_variance, logprobs_and_entropy, masked_mean
from rllight.critics import Critic
from rllight.errors import RecipeError
from rllight.evaluation import EvalAccumulator, EvalSettings
from rllight.models import HFModel, LoRA, response_hidden_states
from rllight.data.prompt_stream import PromptStream
from rllight.rewards import IntegerMatch, Reward, RewardRunner, by_source, check_rows
from rllight.envs import Environment
from rllight.rollout import HFEngine, RolloutEngine
from rllight.rollout.producer import SAMPLE_STALENESS, RolloutProducer
from rllight.rollout.metrics import logprob_mismatch
from rllight.strategies import (
    AdvantageEstimator,
    Aggregation,
    ClippedSurrogate,
    GroupRelative,
    GroupSampler,
    KLPenalty,
    PolicyLoss,
    Sampler,
    TokenMean,
)
from rllight.types import Rollout

log = logging.getLogger(__name__)


def _disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere: the importance ratio must compare one deterministic function at two
    parameter values, and generation must sample from the policy being trained."""
    for name in dir(model.config):
        if name.endswith("dropout") and isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if hasattr(module, "attention_dropout") and isinstance(module.attention_dropout, float):
            module.attention_dropout = 0.0


def _rng_state() -> dict:
    """Every random stream a step draws from, as tensors and ints (loadable with weights_only)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _reduce(key: str, values: list[Tensor], micro_batches: bool = False) -> Tensor:
    """One number from per-micro-batch (or per-update) values: the loss of an update is the sum of its
    micro-batches' shares, a ``*_max`` metric is a maximum, everything else a mean."""
    stacked = torch.stack(values).float()
    if micro_batches and key in ("policy/loss", "value/total_loss"):
        return stacked.sum()
    return stacked.max() if key.endswith("_max") else stacked.mean()


def _is_scalar(value) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.dim() == 0)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)


class RLModule(L.LightningModule):
    """Reinforcement learning for a causal LM, with manual optimisation.

    Each training batch (a list of prompt rows) is one RL step:
    sample -> reward -> rollout callbacks -> old log-probs / values / reference -> advantages ->
    ``ppo_epochs`` passes of minibatch updates -> metrics.

    Args:
        model: Where the policy's weights come from (loaded in ``configure_model``).
        lora: Train LoRA adapters instead of every weight (None = full fine-tuning).
        gradient_checkpointing: Recompute the policy's activations in the backward pass (less memory,
            about a third more compute).
        rollout: Generation engine and sampling settings.
        sampler: Which responses form a rollout (e.g. G per prompt).
        reward: Outcome reward of a response against the reference answer.
        environment: Multi-turn episodes instead of one response per prompt (e.g.
            ``rllight.envs.ArithmeticFeedback``, ``rllight.envs.Calculator``): the model's turns are trained,
            the environment's observations are context. None = one response per prompt, scored by ``reward``.
        reward_runner: Where rewards are computed: worker processes with a per-sample timeout (a hanging or
            crashing reward gives that sample 0 and is counted: ``train/reward/timeouts``,
            ``train/reward/worker_deaths``); None = in the training process, without a timeout.
        reward_preflight: Before training, this many rows' reference answers must earn the reward's maximum
            and a wrong answer must not, or the run stops with one line naming the reward and the row
            (0 = no check, e.g. for a reward that scores something other than the answer).
        advantage: Advantage estimator (GroupRelative for GRPO, GAE for PPO).
        policy_loss: Per-token policy objective.
        aggregation: How per-token losses are averaged (token-mean, seq-mean-token-mean, ...).
        critic: The value model: ``ValueHead`` on the shared backbone, ``SeparateCritic``, or None.
        critic_updates_first: Critic-only updates on each fresh rollout before its values and advantages
            are recomputed with the updated critic and the policy is updated (VAPO note 000, K_v = 4);
            0 = critic and policy losses in the same updates.
        kl: KL to a frozen copy of the initial policy (None = no reference model).
        entropy_coef: Weight of an entropy bonus (0 = off).
        ppo_epochs: Passes over each rollout.
        minibatch_size: Responses per optimizer update (None = the whole rollout in one update).
        micro_batch_size: Responses per forward/backward; gradients accumulate over a minibatch, and
            the loss is normalised by the minibatch's global token (or sequence) count.
        micro_batch_tokens: Split minibatches by a token budget instead (rows x padded length per
            micro-batch), rows grouped by length so that little of the budget is padding; the loss
            normalisation is unchanged.
        max_grad_norm: Gradient-norm clipping of the policy's parameters (None = off).
        critic_max_grad_norm: Gradient-norm clipping of the critic's parameters, separate from the policy's so
            that a jointly trained critic does not scale the policy's step (None = off).
        max_consecutive_skips: An update whose loss or gradient is not finite is skipped and logged
            (``guard/skipped_updates``); after this many in a row the run stops with an error.
        max_failed_reward_steps: A training batch on which the reward failed for every sample (it raised or
            returned a non-finite value) is a warning; this many in a row stop the run with one line.
        max_prompt_tokens: Drop (and count) prompts longer than this many tokens (None = no limit).
        logprob_chunk_size: Compute log-probs and entropy from the hidden states this many positions at a
            time, so the full (B, T, V) float32 logits never exist (same values and gradients).
            None = one pass over the full logits.
        optimizer: Optimizer over the trainable parameters: one group for the policy (``name: policy``) and,
            with a critic, one for the critic (``name: critic``, at ``critic.lr`` when set).
        lr_scheduler: Learning-rate schedule, stepped after each policy update, e.g.
            ``rllight.schedules.WarmupSchedule`` (per-group warm-up then constant or cosine). None = constant.
        evaluation: How the validation loop samples, separately from training (n responses per prompt,
            temperature, top-p, max tokens, the k of avg@k / pass@k / maj@k); greedy by default.
        export_dir: Save the trained policy as a Hugging Face folder here when fit ends.
    """

    def __init__(
        self,
        model: HFModel,
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
        rollout: RolloutEngine = lazy_instance(HFEngine),
        sampler: Sampler = lazy_instance(GroupSampler),
        reward: Reward = lazy_instance(IntegerMatch),
        environment: Environment | None = None,
        reward_runner: RewardRunner | None = lazy_instance(RewardRunner),
        reward_preflight: int = 4,
        advantage: AdvantageEstimator = lazy_instance(GroupRelative),
        policy_loss: PolicyLoss = lazy_instance(ClippedSurrogate),
        aggregation: Aggregation = lazy_instance(TokenMean),
        critic: Critic | None = None,
        critic_updates_first: int = 0,
        kl: KLPenalty | None = None,
        entropy_coef: float = 0.0,
        ppo_epochs: int = 1,
        minibatch_size: int | None = None,
        micro_batch_size: int = 8,
        micro_batch_tokens: int | None = None,
        max_grad_norm: float | None = 1.0,
        critic_max_grad_norm: float | None = 1.0,
        max_consecutive_skips: int = 3,
        max_failed_reward_steps: int = 3,
        max_prompt_tokens: int | None = None,
        logprob_chunk_size: int | None = 1024,
        optimizer: OptimizerCallable = _adamw,
        lr_scheduler: LRSchedulerCallable | None = None,
        evaluation: EvalSettings = lazy_instance(EvalSettings),
        export_dir: str | None = None,
    ):
        super().__init__()
        reward, reward_runner = plain_instance(reward), plain_instance(reward_runner)
        self.automatic_optimization = False
        self.source = model
        self.lora = lora
        self.gradient_checkpointing = gradient_checkpointing
        self.rollout = rollout
        self.sampler = sampler
        self.reward = reward
        self.advantage = advantage
        self.policy_loss = policy_loss
        self.aggregation = aggregation
        self.critic = critic
        self.critic_updates_first = critic_updates_first
        self.kl = kl
        self.entropy_coef = entropy_coef
        if ppo_epochs < 1:
            raise RecipeError(f"model.ppo_epochs must be >= 1, got {ppo_epochs}")
        if micro_batch_size < 1:
            raise RecipeError(f"model.micro_batch_size must be >= 1, got {micro_batch_size}")
        self.ppo_epochs = ppo_epochs
        self.minibatch_size = minibatch_size
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.max_grad_norm = max_grad_norm
        self.critic_max_grad_norm = critic_max_grad_norm
        self.max_consecutive_skips = max_consecutive_skips
        if max_failed_reward_steps < 1:
            raise RecipeError(f"model.max_failed_reward_steps must be >= 1, got {max_failed_reward_steps}")
        self.consecutive_skips = 0
        self._consumed_steps = 0
        self._epoch_start = (0, 0)
        self.logprob_chunk_size = logprob_chunk_size
        self.optimizer_fn = optimizer
        self.lr_scheduler_fn = lr_scheduler
        self.export_dir = export_dir
        if self.advantage.needs_values and critic is None:
            raise RecipeError(
                f"model.advantage: {type(self.advantage).__name__} needs a critic; set model.critic "
                "(e.g. class_path: rllight.critics.ValueHead)"
            )
        if kl is not None and kl.in_reward and not advantage.uses_token_rewards:
            raise RecipeError(
                f"model.kl.in_reward: {type(advantage).__name__} reads only the outcome reward, so a KL "
                "penalty in the reward would be ignored; put it in the loss (in_reward: false)"
            )
        if critic_updates_first and critic is None:
            raise RecipeError("model.critic_updates_first needs model.critic")
        if critic is not None and not advantage.needs_values:
            raise RecipeError(
                f"model.critic: {type(advantage).__name__} does not read values, so the critic would train for "
                "nothing; remove model.critic or choose an estimator that uses it (e.g. GAE)"
            )
        # (DynamicSampling refuses a group of one itself, where its group_size enters.)
        group_size = getattr(sampler, "group_size", None)
        if group_size is not None and group_size < advantage.min_group_size:
            raise RecipeError(
                f"model.advantage: {type(advantage).__name__} compares the responses to one prompt, so group_size "
                f"{group_size} cannot learn (every advantage would be 0); set "
                f"model.sampler.init_args.group_size >= {advantage.min_group_size}"
            )
        self.policy: torch.nn.Module | None = None
        self.ref_policy: torch.nn.Module | None = None
        self.tokenizer = None
        self.evaluation = evaluation
        self.val_results = EvalAccumulator("val")
        self.val_greedy = EvalAccumulator("val/greedy")  # model.evaluation.also_greedy
        self.last_val_per_prompt: dict[str, dict[str, float]] = {}
        """The last validation's overall metrics prompt by prompt (``EvalAccumulator.per_prompt``), for the
        paired before/after comparison of ``evaluate_before_after``."""
        # Rollout production (prompts -> generation -> reward) is its own layer; samplers compose it.
        self.producer = RolloutProducer(rollout, reward, max_prompt_tokens, max_failed_reward_steps, reward_runner,
                                        environment=environment)
        self.environment = environment
        self.reward_runner = reward_runner
        self.reward_preflight = reward_preflight
        self.prompt_stream: PromptStream | None = None  # extra training prompts (set up with the data)
        self._extra_cursor = 0
        self._prefetched_through = -1  # the last training batch whose rollout the engine was asked for ahead

    # ----------------------------------------------------------------------------------- set-up
    def setup(self, stage: str) -> None:
        """Before the model loads: every reference answer must be one the reward can match (a row whose
        answer can never be matched would only ever teach "wrong")."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        train_rows = (getattr(datamodule, "train_rows", None) or []) if stage == "fit" else []
        check_rows(self.reward, [*train_rows, *(getattr(datamodule, "val_rows", None) or [])])  # per data source
        if train_rows and self.reward_preflight:
            runner = self.reward_runner or RewardRunner(workers=0)
            for reward, index in by_source(self.reward, [r.get("data_source") for r in train_rows]):
                runner.preflight(reward, [train_rows[i] for i in index], k=self.reward_preflight)
        if train_rows:
            self.prompt_stream = PromptStream(train_rows, world=self.trainer.world_size, rank=self.trainer.global_rank)
            self.prompt_stream.cursor = self._extra_cursor
            self.producer.bind(self.policy, self.tokenizer, draw=self.prompt_stream.draw)

    def teardown(self, stage: str) -> None:
        if self.reward_runner is not None:
            self.reward_runner.close()  # the workers start again at the next score

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        self.policy, self.tokenizer = self.source.load()
        self.policy.config.use_cache = False
        if self.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora is not None:
            self.policy = self.lora.apply(self.policy)
        _disable_dropout(self.policy)
        self.policy.train()
        if self.critic is not None:
            self.critic.setup(self)
        if self.kl is not None and self.lora is None:  # with LoRA the reference is the adapter-free model
            self.ref_policy, _ = self.source.load()
            self.ref_policy.requires_grad_(False).eval()
        self.producer.bind(self.policy, self.tokenizer)

    def configure_optimizers(self):
        groups = [{"name": "policy", "params": [p for p in self.policy.parameters() if p.requires_grad]}]
        if self.critic is not None:
            groups += self.critic.param_groups()  # e.g. a head with a learning rate of its own
        optimizer = self.optimizer_fn(groups)
        if self.lr_scheduler_fn is None:
            return optimizer
        scheduler = self.lr_scheduler_fn(optimizer)
        if getattr(scheduler, "needs_total_steps", False) and scheduler.total_steps is None:
            if self.trainer.max_steps is None or self.trainer.max_steps < 1:
                raise RecipeError("model.lr_scheduler.total_steps: a decaying schedule needs it, or trainer.max_steps")
            scheduler.total_steps = self.trainer.max_steps
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def state_dict(self, *args, **kwargs):
        # The reference policy is the frozen initial model: reloaded from its source, never saved.
        state = super().state_dict(*args, **kwargs)
        return {k: v for k, v in state.items() if not k.startswith("ref_policy.")}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.ref_policy is not None:
            state_dict = dict(state_dict)
            state_dict.update({f"ref_policy.{k}": v for k, v in self.ref_policy.state_dict().items()})
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # ----------------------------------------------------------------------------- rollouts
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rng"] = _rng_state()
        checkpoint["rllight"] = {
            "extra_prompt_cursor": self.prompt_stream.cursor if self.prompt_stream is not None else 0,
            "consecutive_skips": self.consecutive_skips,
            "prefetched_through": self._prefetched_through,
            "rollout_engine": self.rollout.state_dict(),
            **self.producer.state_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "rng" in checkpoint:
            _set_rng_state(checkpoint["rng"])
        state = checkpoint.get("rllight", {})
        self._extra_cursor = state.get("extra_prompt_cursor", 0)  # applied when the stream is built (setup)
        if self.prompt_stream is not None:
            self.prompt_stream.cursor = self._extra_cursor
        self.consecutive_skips = state.get("consecutive_skips", 0)
        self._prefetched_through = state.get("prefetched_through", -1)
        self.rollout.load_state_dict(state.get("rollout_engine", {}))
        self.producer.load_state_dict(state)

    # ------------------------------------------------------------------------------- forward
    def forward_batch(
        self,
        batch: Rollout,
        policy: torch.nn.Module | None = None,
        with_values: bool = False,
        with_logprobs: bool = True,
    ):
        """Log-probs and entropy of the response tokens, and the critic's values when asked.

        Only the response positions go through the output layer, so the (B, P + T, V) logits of the
        prompt are never built.

        Returns:
            ``(logprobs (B, T), entropy (B, T), values (B, T) or (B,) or None)``; the first two are None
            when ``with_logprobs`` is False (and a separate critic then runs alone).
        """
        policy = self.policy if policy is None else policy
        need_hidden = with_logprobs or (with_values and self.critic is not None and self.critic.shared)
        hidden = logprobs = entropy = values = None
        if need_hidden:
            hidden = response_hidden_states(policy.get_decoder(), batch)
        if with_logprobs:
            head = policy.get_output_embeddings()
            if self.logprob_chunk_size and type(head) is torch.nn.Linear:
                logprobs, entropy = chunked_logprobs_and_entropy(
                    hidden,
                    head.weight,
                    batch.response_ids,
                    self.rollout.temperature,
                    bias=head.bias,
                    chunk_size=self.logprob_chunk_size,
                )
            else:  # e.g. an adapter-wrapped output layer: the direct path through its forward
                logprobs, entropy = logprobs_and_entropy(head(hidden), batch.response_ids, self.rollout.temperature)
        if with_values and self.critic is not None:
            values = self.critic.values(self, batch, hidden)
        return logprobs, entropy, values

    @torch.no_grad()
    def score_with_models(
        self, rollout: Rollout, need_old: bool, need_values: bool | None = None, need_ref: bool | None = None
    ) -> None:
        """Fill old log-probs, values and reference log-probs in micro-batches, without gradients.
        ``need_values`` / ``need_ref`` None: whenever there is a critic / a KL reference (and the rollout has
        no reference log-probs yet)."""
        need_values = self.critic is not None if need_values is None else need_values
        if need_ref is None:
            need_ref = self.kl is not None and rollout.ref_logprobs is None
        if not (need_old or need_values or need_ref):
            return
        olds, values, refs, rows = [], [], [], []
        for index, micro in self._micro_batches(rollout):
            rows.append(index)
            if need_old or need_values:
                lp, _, v = self.forward_batch(micro, with_values=need_values, with_logprobs=need_old)
                olds.append(lp)
                values.append(v)
            if need_ref:
                refs.append(self.reference_logprobs(micro))
        mask = rollout.response_mask.float()

        def full(parts: list[Tensor]) -> Tensor:  # each micro-batch's rows back in place, padded to the rollout's T
            shape = (len(rollout), mask.shape[1]) if parts[0].dim() == 2 else (len(rollout),)
            out = parts[0].new_zeros(shape)
            for index, x in zip(rows, parts):
                if x.dim() == 2:
                    out[index, : x.shape[1]] = x
                else:
                    out[index] = x
            return out

        if need_old:
            rollout.old_logprobs = full(olds) * mask
        if need_values:
            v = full(values)
            rollout.values = v * mask if v.dim() == 2 else v
        if need_ref:
            rollout.ref_logprobs = full(refs) * mask

    def reference_logprobs(self, batch: Rollout) -> Tensor:
        """Log-probs under the reference policy: the frozen initial model, or with LoRA the policy with
        its adapters disabled."""
        if self.lora is not None:
            with self.policy.disable_adapter():
                return self.forward_batch(batch)[0]
        return self.forward_batch(batch, policy=self.ref_policy)[0]

    def _micro_batches(self, rollout: Rollout):
        """Micro-batches of ``rollout`` as ``(rows, micro)``, ``rows`` the indices in ``rollout``:
        ``micro_batch_size`` consecutive rows each, or, with ``micro_batch_tokens``, rows ordered by length
        (longest first, so that each micro-batch holds rows of similar length and pads little) taken as many
        as fit the token budget (rows x padded length, at least one row). Each is trimmed to its own longest
        prompt and response."""
        n = len(rollout)
        if n == 0:
            return
        order = list(range(n))
        if not self.micro_batch_tokens:
            bounds = [(s, min(s + self.micro_batch_size, n)) for s in range(0, n, self.micro_batch_size)]
        else:
            prompt_len = rollout.prompt_mask.sum(-1).tolist()
            resp_len = rollout.span_lengths.tolist()  # observations of a multi-turn row included
            order.sort(key=lambda i: prompt_len[i] + resp_len[i], reverse=True)
            bounds, start, width_p, width_t = [], 0, 0, 0
            for k, i in enumerate(order):
                wp, wt = max(width_p, prompt_len[i]), max(width_t, resp_len[i])
                if k > start and (k - start + 1) * (wp + wt) > self.micro_batch_tokens:
                    bounds.append((start, k))
                    start, wp, wt = k, prompt_len[i], resp_len[i]
                width_p, width_t = wp, wt
            bounds.append((start, n))
        for s, e in bounds:
            yield order[s:e], rollout.select(order[s:e]).trim()

    @staticmethod
    def outcome_token_rewards(rollout: Rollout) -> Tensor:
        """(B, T): each response's outcome reward on its last model token, zero elsewhere (and for empty ones).
        In a multi-turn episode that is the model's last token, not an observation's."""
        mask = rollout.response_mask.float()
        last = rollout.last_action_index
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(rollout), device=mask.device), last] = rollout.rewards.to(mask) * (
            rollout.response_lengths > 0
        )
        return token_rewards

    def _token_rewards(self, rollout: Rollout) -> Tensor:
        """Outcome reward on the last response token, minus the KL penalty when it is in the reward."""
        mask = rollout.response_mask.float()
        token_rewards = self.outcome_token_rewards(rollout)
        if self.kl is not None and self.kl.in_reward:
            kl = self.kl(
                rollout.old_logprobs if rollout.old_logprobs is not None else rollout.sample_logprobs,
                rollout.ref_logprobs,
            )
            token_rewards = token_rewards - self.kl.coef * kl * mask
        return token_rewards

    # --------------------------------------------------------------------------------- train
    def _rollout_callbacks(self):
        """The rollout callbacks in ``rollout_order`` (stable: equal orders keep the recipe's order)."""
        trainer = self._trainer
        callbacks = [cb for cb in (trainer.callbacks if trainer is not None else []) if hasattr(cb, "on_rollout")]
        return sorted(callbacks, key=lambda cb: getattr(cb, "rollout_order", 100))

    def training_step(self, rows: list[dict], batch_idx: int) -> None:
        self.rl_step(rows, batch_idx)
        # Counted here, not in on_train_batch_end, which Lightning runs after the checkpoint callbacks: a
        # checkpoint taken after this step must record it, or a resumed run would replay its batch.
        datamodule = self.trainer.datamodule
        if datamodule is not None and hasattr(datamodule, "batches_trained"):
            datamodule.batches_trained += 1

    def rl_step(self, rows: list[dict], batch_idx: int) -> None:
        """One RL step on a batch of prompt rows: sample, score, estimate, update, log."""
        t_start = time.perf_counter()
        with record_function("rllight.rollout"):  # generation and reward (the markers name a profile's phases)
            rollout = self.sampler(self.producer, rows)
        metrics = self.rollout_metrics(rollout)
        for cb in self._rollout_callbacks():
            rollout = cb.on_rollout(self.trainer, self, rollout)
            if rollout is None:  # the callback used the rollout itself (e.g. value pretraining)
                self._consumed_steps += 1
                metrics["time/step"] = time.perf_counter() - t_start
                self._log(metrics)
                return
        metrics.update({k: v for k, v in rollout.extras.items() if _is_scalar(v)})  # callbacks' own metrics
        empty = len(rollout) == 0 or rollout.response_mask.sum() == 0
        if empty:
            metrics["guard/empty_rollouts"] = 1.0
        # Under DDP a rank whose rollout is empty still takes part in the other ranks' updates (with no
        # rows); only when every rank's rollout is empty is the step skipped, by all ranks together.
        if not self.any_rank(not empty):
            log.warning("step %d: empty rollout after filtering; no update", self.global_step)
            self._log(metrics)
            return
        if empty:
            log.warning("step %d: this rank's rollout is empty; it joins the other ranks' updates", self.global_step)
            rollout = rollout.select([])

        minibatch = self.minibatch_size or len(rollout)
        updates_per_step = self.ppo_epochs * math.ceil(len(rollout) / max(minibatch, 1))
        # With a single update per rollout the live log-probs equal the old ones, so the extra forward
        # is skipped (unless a KL penalty in the reward needs them before the update).
        need_old = updates_per_step > 1 or (self.kl is not None and self.kl.in_reward)
        self._prefetch(updates_per_step)  # the next steps' generation overlaps this step's update
        t_score = time.perf_counter()
        if not empty:
            with record_function("rllight.score"):
                self.score_with_models(rollout, need_old=need_old)
            if rollout.old_logprobs is not None:  # else measured on the live log-probs in the update
                metrics.update(logprob_mismatch(rollout.old_logprobs, rollout.sample_logprobs, rollout.response_mask))
            self._estimate_advantages(rollout)
            metrics.update({k: v for k, v in rollout.extras.items() if _is_scalar(v)})  # estimators' statistics
            ev = self._explained_variance(rollout)
            if ev is not None:  # of the critic as it enters the step, on the fresh rollout
                metrics["value/explained_variance"] = ev
        joint_critic = self.critic is not None
        if self.critic_updates_first:
            # VAPO note 000: fit the critic on the fresh rollout first, then recompute values and
            # advantages with it; the policy update that follows leaves the critic alone. A value head
            # on the shared backbone trains alone here: a backbone step would move the policy between
            # sampling and its update (the rollout would no longer be on-policy, the engine stale).
            metrics.update(self.critic_update(rollout, epochs=self.critic_updates_first, train_backbone=False))
            if not empty:
                self.score_with_models(rollout, need_old=False, need_values=True)
                self._estimate_advantages(rollout)
            joint_critic = False
        metrics["time/score"] = time.perf_counter() - t_score

        for group in self.optimizers().param_groups:  # the rates of this step's updates (after any schedule)
            metrics[f"lr/{group.get('name', 'policy')}"] = float(group["lr"])
        t_train = time.perf_counter()
        generator = torch.Generator().manual_seed(int(self.global_step) * 1000003 + batch_idx)
        step_stats: dict[str, list[Tensor]] = {}
        for _ in range(self.ppo_epochs):
            order = (
                torch.randperm(len(rollout), generator=generator)
                if minibatch < len(rollout)
                else torch.arange(len(rollout))
            )
            for index in self.minibatches(len(rollout), minibatch, order):
                stats = self._update(rollout.select(index), policy=True, critic=joint_critic)
                for k, v in stats.items():
                    step_stats.setdefault(k, []).append(v)
        metrics.update({k: _reduce(k, v) for k, v in step_stats.items()})
        metrics["time/train"] = time.perf_counter() - t_train
        metrics["time/step"] = time.perf_counter() - t_start
        metrics["perf/tokens_per_s"] = rollout.response_mask.sum().float() / metrics["time/step"]
        self._log(metrics)

    def _prefetch(self, updates_per_step: int) -> None:
        """Asynchronous rollouts (an engine with ``max_staleness`` k > 0): ask the engine now for the rollouts
        of the next ``k // updates_per_step`` training batches, generated with the weights as they are before
        this step's update, so that no response is more than k updates old when its step trains on it. Not
        past the run's ``max_steps``. Under DDP each rank asks its own engine for its own share of the batches."""
        ahead = getattr(self.rollout, "max_staleness", 0) // max(updates_per_step, 1)
        datamodule = self.trainer.datamodule
        if ahead < 1 or not hasattr(datamodule, "upcoming_batches"):
            return
        current = datamodule.batches_trained  # this step's batch
        max_steps = self.trainer.max_steps
        if max_steps is not None and max_steps >= 0:  # batches still trained on after this one
            ahead = min(ahead, max(0, math.ceil((max_steps - self.global_step) / max(updates_per_step, 1)) - 1))
        first = max(current + 1, self._prefetched_through + 1)
        # Under DDP, Lightning's DistributedSamplerWrapper shards (and by default shuffles) each epoch's order.
        sampler = getattr(self.trainer.train_dataloader, "sampler", None)
        shuffle_seed = sampler.seed if isinstance(sampler, DistributedSampler) and sampler.shuffle else None
        upcoming = datamodule.upcoming_batches(first, current + ahead + 1 - first, rank=self.trainer.global_rank,
                                               world=self.trainer.world_size, shuffle_seed=shuffle_seed)
        for index, rows in enumerate(upcoming, start=first):
            self.sampler.prefetch(self.producer, rows)
            self._prefetched_through = index

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        forget_step_metrics(self.trainer)  # a metric of some steps only must not repeat on later steps

    def on_train_start(self) -> None:
        # The engine's own weights (vLLM, a lower-precision copy) may have been made before a checkpoint
        # was restored (e.g. by a validation before fit): sync them with the restored policy.
        if self.trainer.ckpt_path is not None:
            self.rollout.update_weights(self.policy)

    def on_train_epoch_start(self) -> None:
        self._epoch_start = (self.global_step, self._consumed_steps)

    def on_train_epoch_end(self) -> None:
        # Progress is an update, or a step a callback used (value pretraining makes no policy update).
        if (self.global_step, self._consumed_steps) == self._epoch_start:
            # Otherwise a run whose every batch is filtered out would loop over epochs forever.
            raise RecipeError(
                f"epoch {self.current_epoch} made no update: every batch was empty after filtering "
                f"({self.producer.dropped_prompts} prompts dropped as longer than max_prompt_tokens="
                f"{self.producer.max_prompt_tokens}); relax the filters or check the data"
            )

    def _estimate_advantages(self, rollout: Rollout) -> None:
        """Token rewards, then advantages and returns on the full rollout (groups need every member)."""
        rollout.token_rewards = self._token_rewards(rollout)
        rollout.advantages, rollout.returns = self.advantage(rollout)

    def critic_update(
        self, rollout: Rollout, epochs: int = 1, minibatch_size: int | None = None, train_backbone: bool = True
    ) -> dict[str, Tensor]:
        """Critic-only updates on ``rollout`` (which has ``values`` and ``returns``). A separate critic
        trains whole and the policy does not move. A value head on the shared backbone trains alone with
        ``train_backbone`` False (the backbone runs without gradients, as in VAPO's value pretraining);
        with True the value loss also trains the backbone, which is the policy's, so the policy moves
        (and the rollout engine is synced after each update).

        These updates do not advance ``trainer.global_step``, which counts policy updates.
        """
        stats: dict[str, list[Tensor]] = {}
        ev = self._explained_variance(rollout) if len(rollout) else None
        if ev is not None:
            stats["critic_only/explained_variance"] = [ev]
        # Head only: the backbone does not move, so its hidden states are computed once and reused by
        # every epoch (one (B, T, H) tensor per micro-batch, kept for the duration of this call).
        hidden_cache: dict[int, list[Tensor]] | None = {} if self.critic.shared and not train_backbone else None
        for _ in range(epochs):
            for i, index in enumerate(self.minibatches(len(rollout), minibatch_size or self.minibatch_size)):
                out = self._update(rollout.select(index), policy=False, critic=True, train_backbone=train_backbone,
                                   hidden_cache=None if hidden_cache is None else hidden_cache.setdefault(i, []))
                for k, v in out.items():
                    stats.setdefault(f"critic_only/{k.split('/')[-1]}" if k.startswith("value/") else k, []).append(v)
        return {k: torch.stack(v).float().mean() for k, v in stats.items()}

    @staticmethod
    def _explained_variance(rollout: Rollout) -> Tensor | None:
        """Explained variance of a token-level critic's values on the whole rollout (None without one)."""
        if rollout.values is None or rollout.returns is None or rollout.values.dim() != 2:
            return None
        return explained_variance(rollout.values, rollout.returns, rollout.response_mask)

    def nll_update(self, rollout: Rollout, coef: float = 1.0, minibatch_size: int | None = None) -> dict[str, Tensor]:
        """Supervised updates on the responses of ``rollout``: minimise ``coef * -log pi(response)``
        aggregated like the policy loss (self-imitation on replayed successes, VAPO).

        Like ``critic_update`` these updates do not advance ``trainer.global_step``.
        """
        stats: dict[str, list[Tensor]] = {}
        for index in self.minibatches(len(rollout), minibatch_size or self.minibatch_size):
            out = self._update(rollout.select(index), policy=False, critic=False, nll_coef=coef)
            for k, v in out.items():
                stats.setdefault(k, []).append(v)
        return {k: torch.stack(v).float().mean() for k, v in stats.items()}

    def _global(self, value: Tensor, op: str = "sum") -> Tensor:
        """Sum (or ``op``: max, mean) over ranks (identity on one process)."""
        if self.trainer.world_size > 1:
            return self.trainer.strategy.reduce(value, reduce_op=op)
        return value

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective: every rank must call it)."""
        return bool(self._global(torch.tensor(float(flag)), op="max").item() > 0)

    def sum_over_ranks(self, value: Tensor | float) -> Tensor:
        """The sum of a tensor over ranks (a collective: every rank must call it), e.g. for a decision that all
        ranks must take alike."""
        return self._global(torch.as_tensor(value, dtype=torch.float32).detach().cpu())

    def minibatches(self, n: int, size: int | None, order: Tensor | None = None) -> list[Tensor]:
        """Row indices of the minibatches over ``n`` rows (``size`` rows each; None = one minibatch), in
        ``order`` when given. Under DDP every rank must make the same number of optimizer updates: the count
        is the largest over ranks, and a rank with fewer rows adds empty minibatches (it contributes no
        gradient to those updates but takes part in them)."""
        order = torch.arange(n) if order is None else order
        size = size or max(n, 1)
        parts = [order[s : s + size] for s in range(0, n, size)]
        count = int(self._global(torch.tensor(float(len(parts))), op="max").item())
        return parts + [order[:0]] * (count - len(parts))

    def _sync_gradients(self, optimizer) -> None:
        """Under DDP, sum every trainable parameter's gradient over ranks (a rank without one adds zeros); a
        parameter that no rank has a gradient for keeps none, as on one process. Backward passes run
        outside DDP's reducer (``no_gradient_sync``), so this is the one place gradients meet."""
        if self.trainer.world_size <= 1:
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        has = self._global(torch.tensor([float(p.grad is not None) for p in params]))
        live = [p for p, h in zip(params, has.tolist()) if h > 0]
        if not live:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in live]
        flat = self._global(torch._utils._flatten_dense_tensors(grads))
        for p, g in zip(live, torch._utils._unflatten_dense_tensors(flat, grads)):
            p.grad = g.view_as(p).clone()

    def _update(
        self,
        mb: Rollout,
        policy: bool = True,
        critic: bool = True,
        train_backbone: bool = True,
        nll_coef: float = 0.0,
        hidden_cache: list[Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """One optimizer update over the minibatch ``mb``, accumulated over micro-batches.

        ``policy`` / ``critic`` / ``nll_coef`` select the loss terms (policy objective, critic loss,
        negative log-likelihood of the responses); parameters without a gradient do not move.
        ``hidden_cache`` (head-only critic updates) holds the backbone's hidden states of each micro-batch
        from an earlier call on the same minibatch, or is filled by this one.
        """
        optimizer = self.optimizers()
        num_tokens = self._global(mb.response_mask.sum().float())
        num_seqs = self._global(torch.tensor(float(len(mb)), device=mb.response_mask.device))
        if policy:
            self.policy_loss.begin_update(mb, self.aggregation, self._global)
        if num_tokens.item() == 0:
            # Every response of this minibatch, on every rank, is masked (e.g. all truncated under the overlong
            # filter): nothing to learn from, and a token mean would divide by zero. No update, not a failure.
            return {"guard/empty_updates": torch.tensor(1.0)}

        def agg(per_token: Tensor, mask: Tensor) -> Tensor:
            return self.aggregation(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs)

        optimizer.zero_grad(set_to_none=True)
        stats: dict[str, list[Tensor]] = {}

        def record(key: str, value: Tensor) -> None:
            stats.setdefault(key, []).append(value.detach())

        with_values = critic and self.critic is not None
        finite = True
        for index, (_, micro) in enumerate(self._micro_batches(mb)):
            mask = micro.response_mask.float()
            # The share of the forward's positions that are padding (prompt and response columns alike).
            positions = micro.prompt_mask.numel() + micro.valid_mask.numel()
            real = micro.prompt_mask.sum() + micro.valid_mask.sum()
            record("perf/padding_share", 1.0 - real.float() / max(positions, 1))
            loss = torch.zeros((), device=mask.device)
            if policy:
                with record_function("rllight.update.forward"):
                    logprobs, entropy, values = self.forward_batch(micro, with_values=with_values)
                if micro.old_logprobs is None:
                    # Single update per rollout: the policy has not moved since sampling.
                    micro.old_logprobs = logprobs.detach() * mask
                    for k, v in logprob_mismatch(micro.old_logprobs, micro.sample_logprobs, mask).items():
                        record(k, v)
                pg, pg_stats = self.policy_loss(logprobs, micro)
                loss = loss + agg(pg, mask)
                if self.kl is not None and not self.kl.in_reward:
                    kl = self.kl(logprobs, micro.ref_logprobs)
                    loss = loss + self.kl.coef * agg(kl, mask)
                    record("policy/kl_ref", masked_mean(kl, mask))
                if self.entropy_coef:
                    loss = loss - self.entropy_coef * agg(entropy, mask)
                log_ratio = (logprobs.detach() - micro.old_logprobs) * mask
                record("policy/approx_kl", masked_mean(0.5 * log_ratio**2, mask))
                record("policy/entropy", masked_mean(entropy, mask))
                for k, v in pg_stats.items():
                    record(k, v)
            elif nll_coef:
                logprobs, _, _ = self.forward_batch(micro)
                nll = agg(-logprobs, mask)
                loss = loss + nll_coef * nll
                record("nll/loss", nll)
            elif self.critic.shared and not train_backbone:
                if hidden_cache is not None and index < len(hidden_cache):
                    hidden = hidden_cache[index]
                else:
                    with torch.no_grad():  # head only: the backbone gives fixed features
                        hidden = response_hidden_states(self.policy.get_decoder(), micro)
                    if hidden_cache is not None:
                        hidden_cache.append(hidden)
                values = self.critic.values(self, micro, hidden)
            else:
                _, _, values = self.forward_batch(micro, with_values=True, with_logprobs=False)
            if with_values:
                vl, v_stats = self.critic.loss(values, micro)
                loss = loss + self.critic.loss_coef * agg(vl, mask)
                for k, v in v_stats.items():
                    record(k, v)
            if not torch.isfinite(loss):
                finite = False  # skip the backward; the whole update is skipped below
                continue
            # The denominators are global (all ranks), so the ranks' gradients are summed, not averaged.
            with no_gradient_sync(self.trainer), record_function("rllight.update.backward"):
                self.manual_backward(loss)
            if policy or not nll_coef:
                record("policy/loss" if policy else "value/total_loss", loss * self.trainer.world_size)
        self._sync_gradients(optimizer)
        out = {k: _reduce(k, v, micro_batches=True) for k, v in stats.items()}
        norms = self._clip_gradients(optimizer, policy_key="policy" if policy else "nll" if nll_coef else "value")
        out.update(norms)
        grad_norm = torch.stack(list(norms.values())).sum() if norms else torch.zeros(())
        if self.trainer.world_size > 1:  # every rank must take the same decision
            finite = bool(self._global(torch.tensor(float(not finite), device=grad_norm.device)).item() == 0)
        if not finite or not torch.isfinite(grad_norm):
            self.consecutive_skips += 1
            log.warning(
                "step %d: non-finite loss or gradient; update skipped (%d in a row)",
                self.global_step,
                self.consecutive_skips,
            )
            optimizer.zero_grad(set_to_none=True)
            if self.consecutive_skips >= self.max_consecutive_skips:
                raise FloatingPointError(
                    f"stopping at step {self.global_step}: {self.consecutive_skips} consecutive updates had a "
                    "non-finite loss or gradient; lower the learning rate or check the reward, then resume from the "
                    "last checkpoint"
                )
            out["guard/skipped_updates"] = torch.tensor(1.0)
            return out
        self.consecutive_skips = 0
        out["guard/skipped_updates"] = torch.tensor(0.0)
        if policy:
            with record_function("rllight.update.optimizer"):
                optimizer.step()
            scheduler = self.lr_schedulers()
            if scheduler is not None:
                scheduler.step()
            out.update({k: torch.tensor(float(v)) for k, v in self.rollout.update_weights(self.policy).items()})
        else:
            optimizer.optimizer.step()  # the raw optimizer: these steps do not count as global steps
            if nll_coef or (with_values and self.critic.shared and train_backbone):  # the policy moved
                out.update({k: torch.tensor(float(v)) for k, v in self.rollout.update_weights(self.policy).items()})
        return out

    def _clip_gradients(self, optimizer, policy_key: str) -> dict[str, Tensor]:
        """Clip the policy's and the critic's gradients each to its own norm (``max_grad_norm``,
        ``critic_max_grad_norm``; the critic's groups, e.g. backbone and head, together) and return the norms
        before clipping, as ``<policy_key>/grad_norm`` and ``value/grad_norm`` (parts without gradients are
        left out)."""
        families: dict[bool, list[Tensor]] = {False: [], True: []}
        for group in optimizer.param_groups:
            critic = str(group.get("name", "policy")).startswith("critic")
            families[critic] += [p for p in group["params"] if p.grad is not None]
        norms = {}
        for critic, params in families.items():
            if params:
                limit = self.critic_max_grad_norm if critic else self.max_grad_norm
                norm = torch.nn.utils.clip_grad_norm_(params, limit if limit else float("inf"))
                norms["value/grad_norm" if critic else f"{policy_key}/grad_norm"] = norm.detach()
        return norms

    # ------------------------------------------------------------------------------ metrics
    def rollout_metrics(self, rollout: Rollout) -> dict[str, Tensor | float]:
        """The per-step ledger of a rollout (reward, accuracy, lengths, truncation, groups, timings)."""
        if len(rollout) == 0:
            return {k: v for k, v in rollout.extras.items() if _is_scalar(v)}
        lengths = rollout.response_lengths.float()
        groups = torch.unique(rollout.group_ids)
        mixed = sum(int(rollout.rewards[rollout.group_ids == g].unique().numel() > 1) for g in groups.tolist())
        metrics: dict[str, Tensor | float] = {
            "reward/mean": rollout.rewards.mean(),
            "reward/std": rollout.rewards.std() if len(rollout) > 1 else torch.tensor(0.0),
            "reward/accuracy": rollout.correct.mean(),
            "reward/valid_group_ratio": mixed / max(len(groups), 1),
            "response/length_mean": lengths.mean(),
            "response/length_max": lengths.max(),
            "response/truncated_ratio": rollout.truncated.float().mean(),
            "response/tokens": lengths.sum(),
        }
        staleness = rollout.extras.get(SAMPLE_STALENESS)
        if staleness is not None:
            metrics["rollout/staleness_mean"] = staleness.float().mean()
            metrics["rollout/staleness_max"] = staleness.float().max()
        metrics.update({k: v for k, v in rollout.extras.items() if _is_scalar(v)})
        return metrics

    def _log(self, metrics: dict) -> None:
        clean = {
            k: (v.detach().float() if isinstance(v, Tensor) else torch.tensor(float(v))) for k, v in metrics.items()
        }
        prog = {"reward/mean", "reward/accuracy"}
        self.log_dict(
            {f"train/{k}": v for k, v in clean.items() if k not in prog}, on_step=True, on_epoch=False, batch_size=1
        )
        self.log_dict(
            {f"train/{k}": v for k, v in clean.items() if k in prog},
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            batch_size=1,
        )

    # ---------------------------------------------------------------------------- validate
    def _evaluations(self) -> list[tuple[EvalAccumulator, int, bool, list[int], str]]:
        """Each evaluation pass of a validation as ``(accumulator, n, greedy, ks, file suffix)``: the one
        ``model.evaluation`` describes, and with ``also_greedy`` one greedy answer per prompt."""
        ev = self.evaluation
        passes = [(self.val_results, ev.n, ev.greedy, ev.ks, "")]
        if ev.also_greedy:
            passes.append((self.val_greedy, 1, True, [1], "_greedy"))
        return passes

    def validation_step(self, rows: list[dict], batch_idx: int) -> None:
        ev = self.evaluation
        for results, n, greedy, _, _ in self._evaluations():
            with ev.applied_to(self.rollout):
                rollout = self.producer.sample(rows, n, greedy=greedy, training=False)
            kept = set(rollout.extras["kept_rows"])
            if kept:
                results.update_rollout([rows[i] for i in sorted(kept)], n, rollout)
            results.drop([row for i, row in enumerate(rows) if i not in kept])

    def on_validation_epoch_end(self) -> None:
        """avg@k, pass@k (unbiased) and maj@k with standard errors, overall and per data source, logged as
        ``val/...`` (and ``val/greedy/...`` at k = 1 with ``also_greedy``); ``val/accuracy`` is the greedy
        accuracy where there is one, else the mean correctness of every sampled response. A JSON of every
        number and a per-row JSONL of the responses go to the log folder."""
        ev = self.evaluation
        metrics = {}
        self.last_val_per_prompt = {}
        for results, _, _, ks, suffix in self._evaluations():
            if self.trainer.world_size > 1:  # every rank evaluated its share of the rows
                states = [None] * self.trainer.world_size
                torch.distributed.all_gather_object(states, results.state())
                results.merge(states)
            metrics.update(results.compute(ks, ev.bootstrap, ev.confidence, ev.seed))
            self.last_val_per_prompt.update(results.per_prompt(ks))
            if self.trainer.is_global_zero and results.records and not self.trainer.sanity_checking:
                folder = os.path.join(self.trainer.log_dir or self.trainer.default_root_dir, "evaluation")
                results.write(folder, ks, name=f"val_step{self.global_step}{suffix}", bootstrap=ev.bootstrap,
                              confidence=ev.confidence, seed=ev.seed,
                              extra={"settings": vars(ev), "global_step": int(self.global_step)})
        if self.val_results.records:
            greedy = ev.also_greedy and self.val_greedy.records
            metrics["val/accuracy"] = metrics["val/greedy/avg@1" if greedy else f"val/avg@{ev.n}"]
            metrics["val/truncated_ratio"] = metrics.get("val/truncated_ratio", 0.0)
        self.log_dict({k: float(v) for k, v in metrics.items() if k != "val/accuracy"}, sync_dist=False)
        if "val/accuracy" in metrics:
            self.log("val/accuracy", float(metrics["val/accuracy"]), prog_bar=True)
        for results, *_ in self._evaluations():
            results.reset()

    # ------------------------------------------------------------------------------ export
    def on_fit_end(self) -> None:
        if self.export_dir and self.trainer.is_global_zero:
            self.export(self.export_dir)

    def export(self, path: str) -> None:
        """Save the policy and tokenizer as a Hugging Face folder, LoRA adapters merged
        (``rllight.export.export_policy``: written aside, never over files an export did not write)."""
        from rllight.export import export_policy

        export_policy(self.policy, self.tokenizer, path, info={"global_step": int(self.global_step)})
