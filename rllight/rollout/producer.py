"""Rollout production: prompt rows in, scored rollouts out.

``RolloutProducer`` encodes chat prompts, drops (or cuts) over-long ones, generates with the engine and scores the
responses with the reward (``Reward.score``, once per batch of ``Sample``s; its verifiers in the reward workers).
Samplers compose it (``producer.sample(rows, n)``, ``producer.more_prompts(n)``); it knows nothing of the
trainer, so a new kind of rollout is a new sampler or producer, not a trainer subclass. The trainer hands it the
policy and tokenizer once they are loaded (``bind``) and a prompt stream for extra draws (the datamodule's
order).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from rllight.distributed import Ranks
from rllight.envs.base import Environment
from rllight.envs.guard import EpisodeGuard, HungCalls
from rllight.errors import ComponentError, RecipeError
from rllight.rewards import Reward, RewardRunner, Sample
from rllight.rollout.ahead import steps_ahead
from rllight.rollout.base import RolloutEngine, Sampling, malformed
from rllight.rollout.empty_steps import (EMPTY_RESPONSES, FAILED_BEFORE_FIRST_TURN, MALFORMED, NO_PROMPTS, SAMPLED,
                                         TOO_LONG, EmptySteps)
from rllight.rollout.episodes import (  # noqa: F401 (encode_chat, with_first_observation: re-exported)
    ChatTurns, encode_chat, episodes_to_rollout, run_episodes, start_episodes, trajectory_rewards,
    with_first_observation)
from rllight.rollout.scoring import mean_metric_keys, reward_metrics, score_samples, token_tensor
from rllight.rollout.source_metrics import source_metrics
from rllight.stopping import end_after_step
from rllight.types import MEAN_EXTRAS, Rollout

log = logging.getLogger(__name__)

DATA_SOURCE = "data_source"
"""``rollout.extras`` key: each response's prompt row's ``data_source`` (a list, per response)."""

SAMPLE_STALENESS = "rollout/sample_staleness"
"""Rollout extra, one value per response: how many optimizer updates the trainer's policy has had since the
weights that generated the response (0 when sampling is on-policy; asynchronous rollouts make it larger)."""

PROMPT_TRUNCATIONS = ("drop", "left")
"""What ``RolloutProducer`` does with a prompt longer than ``max_prompt_tokens`` (``model.prompt_truncation``)."""


class RolloutProducer:
    """Samples responses to prompt rows with a ``RolloutEngine`` and scores them with a ``Reward``.

    Prompts longer than ``max_prompt_tokens`` are dropped and counted (``data/dropped_long_prompts``): a cut prompt
    is a different question. ``prompt_truncation="left"`` keeps such a prompt's last ``max_prompt_tokens``
    token ids instead (the chat template's included, as verl's ``data.truncation='left'``), counted in
    ``data/truncated_long_prompts``; not with an ``environment``, whose turns a cut conversation breaks. A training
    batch on which the reward failed for every sample is a warning; ``max_failed_reward_steps`` of them in a row
    stop the run with one line.

    The reward's verifiers are scored by ``runner`` (``Reward.guarded``: worker processes with a per-sample timeout:
    a verifier that hangs, raises or kills its process costs that sample 0, counted, never the run); None = in this
    process. Any other reward (a reward model, a judge) is called in this process, once per batch (per data source
    under ``PerSource``), with one ``Sample`` per response; if it raises, every sample of the batch is a failure (0).

    With an ``environment`` every sample is a multi-turn episode (``rllight.rollout.episodes``): the environment
    scores it, not ``reward``, and a prompt is dropped as too long also when it leaves no room under the
    environment's ``max_total_tokens``. A call into an environment that raises, hangs past its ``timeout_seconds``
    or returns an unusable result costs its episode (reward 0, counted in ``reward/failures``,
    ``episode/failures`` and ``episode/timeouts``; one warning per batch), see ``rllight.envs.guard``.

    Counters (``reward_failures``, ``dropped_prompts``, ``truncated_prompts``, ``failed_reward_steps``) are part of
    the state saved in checkpoints (``state_dict``). ``empty`` counts why the training steps had nothing to train on
    (``EmptySteps``: prompts dropped, episodes failed before their first turn, a step without prompts, ...), from
    ``begin_step`` on; the lines that end a run without updates name those causes. ``ranks`` are the training
    processes' collectives, for a sampler whose choice spans them (dynamic sampling fills one global target).
    """

    def __init__(self, engine: RolloutEngine, reward: Reward | None, max_prompt_tokens: int | None = None,
                 max_failed_reward_steps: int = 3, runner: RewardRunner | None = None,
                 environment: Environment | None = None, max_steps_without_update: int | None = None,
                 prompt_truncation: str = "drop"):
        if prompt_truncation not in PROMPT_TRUNCATIONS:
            raise RecipeError(f"model.prompt_truncation must be one of {', '.join(PROMPT_TRUNCATIONS)}, "
                              f"got {prompt_truncation!r}")
        if prompt_truncation == "left" and environment is not None:
            raise RecipeError("model.prompt_truncation left cannot be used with model.environment (a cut "
                              "conversation breaks the environment's turns); set model.prompt_truncation: drop")
        self.prompt_truncation = prompt_truncation
        self.max_steps_without_update = max_steps_without_update
        self._no_update = (None, 0)  # (the update count of the current run of steps without an update, its length)
        self.engine = engine
        self.environment = environment
        # the environment's calls given up on and still running, across batches: a bounded number (HungCalls)
        self.hung_calls = HungCalls.of(environment) if environment is not None else None
        self._chat_turns: ChatTurns | None = None
        self.reward = reward
        self.runner = runner
        self.scorer = None if reward is None else reward.guarded(runner)  # the reward as scored: its verifiers guarded
        self.max_prompt_tokens = max_prompt_tokens
        self.max_failed_reward_steps = max_failed_reward_steps
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self._draw: Callable[[int], list[dict]] | None = None
        self._observe: Callable[[list[dict], list[float]], None] | None = None
        self.reward_failures = 0
        self.dropped_prompts = self.truncated_prompts = 0
        self.failed_reward_steps = 0
        self.malformed_steps = 0
        self.empty = EmptySteps()
        self._warned_dropped = self._warned_truncated = self._warned_empty = False
        self.ranks = Ranks()

    def bind(self, policy: torch.nn.Module, tokenizer, draw: Callable[[int], list[dict]] | None = None,
             ranks: Ranks | None = None, observe: Callable[[list[dict], list[float]], None] | None = None) -> None:
        """The policy to sample from, its tokenizer, where extra prompt rows come from, the collectives of the
        training processes, and who hears each training prompt's pass rate (``PromptSource.hear``: every
        group a training ``sample`` scores, also those a sampler then drops)."""
        if tokenizer is not self.tokenizer:
            self._chat_turns = None
        self.policy, self.tokenizer = policy, tokenizer
        if draw is not None:
            self._draw = draw
        if ranks is not None:
            self.ranks = ranks
        if observe is not None:
            self._observe = observe

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def more_prompts(self, n: int) -> list[dict]:
        """``n`` more training prompt rows beyond the step's batch (e.g. for dynamic sampling)."""
        if self._draw is None:
            raise RuntimeError("RolloutProducer.more_prompts: no prompt stream is bound")
        return self._draw(n)

    def encode(self, rows: list[dict]) -> list[list[int]]:
        return [encode_chat(self.tokenizer, r["messages"]) for r in rows]

    def sample(self, rows: list[dict], n: int, greedy: bool = False, training: bool = True,
               sampling: Sampling | None = None) -> Rollout:
        """``n`` responses for each prompt row, scored, sampled as ``sampling`` says (None: the engine's own;
        ``greedy``: at temperature 0). ``training`` False (a second pass over the same rows, or validation) leaves
        the run's counters of dropped (or cut) prompts and failed reward batches alone."""
        sampling = sampling or self.engine.sampling
        sampling = sampling.as_greedy() if greedy else sampling
        if self.environment is not None:
            return self.sample_episodes(rows, n, sampling, training=training)
        keep, prompts, counts = self._fit(rows, training)  # the step's prompts dropped (or cut) as too long
        rows = [rows[i] for i in keep]
        # "kept_rows": which of the given rows the rollout answers (its groups, in order).
        if not prompts:
            return Rollout.empty(extras={**counts, "kept_rows": tuple(keep)})
        t0 = time.perf_counter()
        gen = self.engine.generate(self.policy, self.tokenizer, [p for p in prompts for _ in range(n)], sampling)
        t1 = time.perf_counter()
        problem = malformed(gen, len(prompts) * n, sampling.max_new_tokens) if training else None
        self.count_malformed_batch(problem)
        if problem:  # dropped: the step trains on nothing rather than on what the engine got wrong
            self.empty.add(MALFORMED, 1, problem)
            return Rollout.empty(extras={"rollout/malformed_batches": 1.0, **counts, "kept_rows": ()})
        engine_metrics = dict(self.engine.last_metrics)
        staleness = engine_metrics.get("rollout/staleness")
        texts = self.tokenizer.batch_decode(gen.response_ids, skip_special_tokens=True)
        answers = [r["answer"] for r in rows for _ in range(n)]
        sources = [r.get("data_source") for r in rows for _ in range(n)]
        scores = score_samples(self.scorer, self.samples(rows, prompts, n, gen, texts))
        rewards, correct, failures = scores.values, scores.solved, len(scores.failed)
        self.reward_failures += failures
        if training:
            self.count_failed_reward_batch(failures == len(texts))
            self._heard(rows, correct, n)
        t2 = time.perf_counter()
        if training:
            self.count_sampled(gen.response_mask.sum(-1).tolist())
        device = gen.response_ids.device
        dense = None if scores.token_scores is None else token_tensor(scores.token_scores, gen.response_mask)
        metrics = {**reward_metrics(scores), **source_metrics(sources, rewards, correct)}  # several data sources
        return Rollout(
            prompt_ids=gen.prompt_ids,
            prompt_mask=gen.prompt_mask,
            response_ids=gen.response_ids,
            response_mask=gen.response_mask,
            sample_logprobs=gen.logprobs,
            truncated=gen.truncated,
            group_ids=torch.arange(len(rows), device=device).repeat_interleave(n),
            answers=answers,
            texts=texts,
            rewards=torch.tensor(rewards, dtype=torch.float32, device=device),
            correct=torch.tensor(correct, dtype=torch.float32, device=device),
            dense_rewards=dense,
            extras={
                "time/rollout": t1 - t0,
                "time/reward": t2 - t1,
                **metrics,
                **counts,
                "kept_rows": tuple(keep),  # a tuple: per prompt row, not per response (select leaves it)
                DATA_SOURCE: sources,  # per response, its prompt row's: routes it (TeacherLogprobs.teachers)
                **engine_metrics,
                MEAN_EXTRAS: (*mean_metric_keys(metrics, scores), *engine_metrics),
                # Per response: policy versions between the weights that generated it and the trainer's now.
                **({SAMPLE_STALENESS: torch.full((len(texts),), float(staleness), device=device)}
                   if staleness is not None else {}),
            },
        )

    def _heard(self, rows: list[dict], correct: list, n: int) -> None:
        """Tell the observer each row's pass rate: the share of its ``n`` responses (in order) that are correct."""
        if self._observe is not None:
            self._observe(rows, [sum(float(c) for c in correct[k * n:(k + 1) * n]) / n for k in range(len(rows))])

    def count_sampled(self, lengths: list) -> None:
        """Count a training batch's responses (or episodes played), of ``lengths`` model tokens each, with a token
        and without one."""
        sampled = sum(int(k) > 0 for k in lengths)
        self.empty.add(SAMPLED, sampled)
        self.empty.add(EMPTY_RESPONSES, len(lengths) - sampled)

    def begin_step(self) -> None:
        """A training step starts: ``empty`` counts its causes afresh."""
        self.empty.begin_step()

    def why_empty(self) -> str:
        """Why the steps without an update in a row had nothing to train on, in words (``EmptySteps.describe``)."""
        return self.empty.describe()

    def note_no_prompts(self, reason: str) -> None:
        """The data side gave this training step no prompt, for ``reason`` (e.g. a curriculum's prompts all
        retired)."""
        self.empty.add(NO_PROMPTS, 1, reason)

    def _note_dropped(self, dropped: int, limit: str, training: bool = True) -> None:
        """Count prompts dropped as too long (in a training step) and warn of them the first time only: a data set
        whose every prompt is too long would otherwise print a line per batch before the run stops (the count is
        logged every step)."""
        if training:
            self.dropped_prompts += dropped
            self.empty.add(TOO_LONG, dropped, limit)
        if self._warned_dropped:
            log.debug("dropped %d prompt(s) longer than %s", dropped, limit)
            return
        self._warned_dropped = True
        log.warning("dropped %d prompt(s) longer than %s (raise it to train on them); later drops are counted in "
                    "train/data/dropped_long_prompts and not logged again", dropped, limit)

    def _note_truncated(self, cut: int, training: bool) -> None:
        """Count prompts cut to their last ``max_prompt_tokens`` tokens (in a training step) and warn of them the
        first time only, as ``_note_dropped`` does."""
        if training:
            self.truncated_prompts += cut
        if self._warned_truncated:
            return
        self._warned_truncated = True
        log.warning("cut %d prompt(s) longer than max_prompt_tokens=%d to their last %d tokens "
                    "(model.prompt_truncation: left); later ones are counted in train/data/truncated_long_prompts and not logged again",
                    cut, self.max_prompt_tokens, self.max_prompt_tokens)

    def note_empty_step(self, step: int, emptied_by: str | None = None) -> None:
        """Warn of a step with no update (its rollout was empty after filtering; ``emptied_by``: the rollout
        callback that emptied it, if one did) the first time only, naming why; later ones are counted in
        ``train/guard/empty_rollouts``. ``max_steps_without_update`` of them in a row (the update count ``step`` has
        not moved) end the run after the step (``end_after_step``), the line naming the causes (``why_empty``): it
        would spin to the end of the epoch training nothing."""
        since, count = self._no_update
        self._no_update = (step, count + 1 if since == step else 1)
        self.empty.no_update(new_run=since != step, emptied_by=emptied_by)
        if self.max_steps_without_update and self._no_update[1] >= self.max_steps_without_update:
            end_after_step(  # after this step, saved: a raise here would lose the steps since the last checkpoint
                f"{self._no_update[1]} RL steps in a row made no update: {self.why_empty()} (see "
                "train/guard/empty_rollouts); fix that or relax the filters (model.guards.max_steps_without_update "
                "sets when this stops a run)")
        if self._warned_empty:
            log.debug("step %d: empty rollout after filtering; no update", step)
            return
        self._warned_empty = True
        log.warning("step %d: empty rollout after filtering (%s); no update (later empty steps are counted in "
                    "train/guard/empty_rollouts and not logged again)", step, self.why_empty())

    def _fitting_prompts(self, rows: list[dict]) -> tuple[list[int], list[list[int]], int]:
        """``(keep, prompts, cut)``: the indices of the rows whose prompt fits ``max_prompt_tokens`` (under
        ``left`` every row), their ids (a longer one's last ``max_prompt_tokens``), how many were cut."""
        prompts, limit = self.encode(rows), self.max_prompt_tokens
        long = {i for i, p in enumerate(prompts) if limit is not None and len(p) > limit}
        if self.prompt_truncation == "left":  # verl's left truncation: the end, where the question is, stays
            cut = [p[len(p) - limit:] if i in long else p for i, p in enumerate(prompts)]
            return list(range(len(rows))), cut, len(long)
        keep = [i for i in range(len(rows)) if i not in long]
        return keep, [prompts[i] for i in keep], 0

    def _fit(self, rows: list[dict], training: bool) -> tuple[list[int], list[list[int]], dict[str, float]]:
        """``_fitting_prompts`` with its drops and cuts noted (counted in a training step) and as the step's metrics
        (``data/dropped_long_prompts``; under ``left`` also ``data/truncated_long_prompts``)."""
        keep, prompts, cut = self._fitting_prompts(rows)
        dropped = len(rows) - len(keep)
        if dropped:
            self._note_dropped(dropped, f"max_prompt_tokens={self.max_prompt_tokens}", training)
        if cut:
            self._note_truncated(cut, training)
        counts = {"data/dropped_long_prompts": float(dropped)}
        if self.prompt_truncation == "left":
            counts["data/truncated_long_prompts"] = float(cut)
        return keep, prompts, counts

    def prefetch(self, rows: list[dict], n: int) -> None:
        """Have the engine start on ``n`` responses per row now (see ``RolloutEngine.prefetch``); a later
        ``sample(rows, n)`` collects them. Multi-turn episodes are not prefetched (each turn waits for the
        environment)."""
        if self.environment is not None:
            return
        _, prompts, _ = self._fitting_prompts(rows)
        if prompts:
            self.engine.prefetch(self.policy, self.tokenizer, [p for p in prompts for _ in range(n)],
                                 self.engine.sampling)

    def sample_episodes(self, rows: list[dict], n: int, sampling: Sampling, training: bool = True) -> Rollout:
        """``n`` episodes of the environment for each prompt row, as one multi-turn ``Rollout`` (see
        ``rllight.rollout.episodes``). Metrics: ``episode/turns_mean`` (model turns per episode) and
        ``episode/truncated_ratio`` (episodes stopped by ``max_turns`` or ``max_total_tokens``, or whose last
        turn hit ``max_new_tokens``)."""
        env = self.environment
        guard = EpisodeGuard(env, self.hung_calls)
        self.environment.tokenizer = self.tokenizer  # for tool calls read in the model's own format
        episodes, prompts, failed, conversations, tools = start_episodes(self.environment, self.tokenizer, guard,
                                                                         rows, n)
        limit = env.max_total_tokens - 1  # room for at least one generated token
        if self.max_prompt_tokens is not None:
            limit = min(limit, self.max_prompt_tokens)
        keep = [k for k in range(len(rows)) if all(len(prompts[k * n + j]) <= limit for j in range(n))]
        dropped = len(rows) - len(keep)
        if dropped:
            self._note_dropped(dropped, f"{limit} tokens (max_prompt_tokens, or the environment's max_total_tokens "
                                        "less one)", training)
        if not keep:
            return Rollout.empty(extras={"data/dropped_long_prompts": float(dropped), "kept_rows": tuple(keep)})
        index = [k * n + j for k in keep for j in range(n)]
        episodes, prompts = [episodes[i] for i in index], [prompts[i] for i in index]
        failed, conversations, tools = [failed[i] for i in index], [conversations[i] for i in index], \
            [tools[i] for i in index]
        guard.failures = sum(failed)  # the reset failures of the prompts kept
        if training:
            self.empty.add(FAILED_BEFORE_FIRST_TURN, guard.failures, guard.first_error)
        rows = [rows[k] for k in keep]
        if self._chat_turns is None:
            self._chat_turns = ChatTurns(self.tokenizer)
        t0 = time.perf_counter()
        trajs = run_episodes(self.engine, self.policy, self.tokenizer, episodes, prompts, sampling,
                             turns=self._chat_turns, guard=guard, failed=failed, conversations=conversations,
                             tools=tools)
        rewards = trajectory_rewards(guard, episodes, trajs)
        t1 = time.perf_counter()
        failures = guard.failures
        if failures:
            log.warning(guard.summary(len(trajs)))
        self.reward_failures += failures
        if training:
            self.count_sampled([sum(map(len, t.all_turns)) for t, bad in zip(trajs, failed) if not bad])
            self.count_failed_reward_batch(failures == len(trajs), guard.first_error)
            self._heard(rows, [t.correct for t in trajs], n)
        device = next(self.policy.parameters()).device if self.policy is not None else "cpu"
        turns = torch.tensor([len(t.all_turns) for t in trajs], dtype=torch.float32)
        sources = [r.get("data_source") for r in rows for _ in range(n)]  # per episode, its row's
        means = {"episode/turns_mean": turns.mean().item(), **self.engine.last_metrics,
                 "episode/restarted_ratio": sum(bool(t.earlier) for t in trajs) / len(trajs),
                 "episode/truncated_ratio": sum(t.truncated for t in trajs) / len(trajs),
                 **source_metrics(sources, rewards, [t.correct for t in trajs])}  # each source's share and means
        return episodes_to_rollout(
            trajs,
            rewards=rewards,
            group_ids=torch.arange(len(rows)).repeat_interleave(n),
            answers=[r["answer"] for r in rows for _ in range(n)],
            tokenizer=self.tokenizer,
            device=device,
            extras={
                "time/rollout": t1 - t0,
                "reward/failures": float(failures), "episode/failures": float(failures),
                "episode/timeouts": float(guard.timeouts),
                "data/dropped_long_prompts": float(dropped),
                "kept_rows": tuple(keep),
                DATA_SOURCE: sources,
                **means,
                "episode/turns_max": turns.max().item(),
                MEAN_EXTRAS: tuple(means),
            },
        )

    def samples(self, rows: list[dict], prompts: list[list[int]], n: int, gen, texts: list[str]) -> list[Sample]:
        """One ``Sample`` per response of ``gen`` (``n`` per prompt, in order), for the reward: the prompt
        decoded as the policy saw it (special tokens kept), the row's messages, the response's text and ids (up
        to its end token), the answer, the row (a shallow copy per prompt), the prompt's index as its group."""
        prompt_texts = self.tokenizer.batch_decode(prompts)
        lengths, ids = gen.response_mask.sum(-1).tolist(), gen.response_ids.tolist()
        truncated = gen.truncated.tolist()
        copies = [dict(row) for row in rows]
        return [Sample(prompt=prompt_texts[i // n], messages=copies[i // n].get("messages"), response=texts[i],
                       response_ids=ids[i][:int(lengths[i])], answer=str(copies[i // n].get("answer", "")),
                       row=copies[i // n], group=i // n, truncated=bool(truncated[i])) for i in range(len(texts))]

    def close(self) -> None:
        """Stop the reward worker processes and free what the reward and the environment hold (``close``, e.g. a
        model, a server it started); they start again when next needed."""
        if self.runner is not None:
            self.runner.close()
        if self.scorer is not None:
            self.scorer.close()
        if self.environment is not None:
            self.environment.close()

    def count_malformed_batch(self, problem: str | None) -> None:
        """Count a training batch the engine returned malformed (``rllight.rollout.base.malformed``: log-probs not
        finite or above 0, a row or a log-prob missing, a response over max_new_tokens), one line each; stop after
        ``max_failed_reward_steps`` in a row, as for a reward that fails on every sample."""
        if problem is None:
            self.malformed_steps = 0
            return
        self.malformed_steps += 1
        name = type(self.engine).__name__
        if self.malformed_steps >= self.max_failed_reward_steps:
            raise ComponentError(
                f"model.rollout: {name} returned {self.malformed_steps} batches in a row that cannot be trained on "
                f"(last: {problem}); check the engine or its server (model.guards.max_failed_reward_steps sets how "
                "many batches are tolerated)")
        log.warning("model.rollout: %s returned a batch that cannot be trained on (%s); dropped, %d in a row (the "
                    "run stops at model.guards.max_failed_reward_steps=%d)", name, problem, self.malformed_steps,
                    self.max_failed_reward_steps)

    def count_failed_reward_batch(self, all_failed: bool, last_error: str | None = None) -> None:
        """Count a training batch on which the reward (or the environment) failed for every sample; stop after
        too many in a row."""
        if not all_failed:
            self.failed_reward_steps = 0
            return
        self.failed_reward_steps += 1
        if self.environment is not None:
            name = type(self.environment).__name__
            log.warning("the environment %s failed on every episode (%d batch(es) in a row; the run stops at "
                        "model.guards.max_failed_reward_steps=%d): fix it, its errors are logged above", name,
                        self.failed_reward_steps, self.max_failed_reward_steps)
            if self.failed_reward_steps >= self.max_failed_reward_steps:
                raise ComponentError(
                    f"model.environment: {name} failed on every episode of {self.failed_reward_steps} batches in a "
                    f"row (last: {last_error}); fix the environment (model.guards.max_failed_reward_steps sets how "
                    "many batches are tolerated)")
            return
        log.warning("the reward %s failed on every sample (%d batch(es) in a row; the run stops at "
                    "model.guards.max_failed_reward_steps=%d): fix it, its errors are logged above",
                    type(self.reward).__name__, self.failed_reward_steps, self.max_failed_reward_steps)
        if self.failed_reward_steps >= self.max_failed_reward_steps:
            raise RecipeError(
                f"model.reward: {type(self.reward).__name__} failed on every sample of "
                f"{self.failed_reward_steps} batches in a row (see the warnings above for its error); fix the "
                "reward or the answers' format (model.guards.max_failed_reward_steps sets how many batches are "
                "tolerated)")

    def state_dict(self) -> dict[str, Any]:
        return {"reward_failures": self.reward_failures, "dropped_prompts": self.dropped_prompts,
                "truncated_prompts": self.truncated_prompts, "failed_reward_steps": self.failed_reward_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reward_failures = state.get("reward_failures", 0)
        self.dropped_prompts = state.get("dropped_prompts", 0)
        self.truncated_prompts = state.get("truncated_prompts", 0)
        self.failed_reward_steps = state.get("failed_reward_steps", 0)


def prefetch_ahead(sampler, producer: RolloutProducer, updates_per_step: int, prefetched_through: int,
                   upcoming_batches: Callable[[int, int], list[list[dict]]] | None, current: int,
                   updates_left: int | None) -> int:
    """Asynchronous rollouts (an engine with ``max_staleness`` k > 0): ask the engine now for the rollouts of the
    next ``k // updates_per_step`` training batches, generated with the weights as they are before this step's
    update, so that no response is more than k updates old when its step trains on it; not past the run's
    end, nor again for a batch asked for before (through ``prefetched_through``). Under DDP each rank asks its
    own engine for its own share of the batches. Returns the last batch asked for.

    Args:
        upcoming_batches: ``(first, count)`` -> the rows of this process's training batches ``first ..
            first + count - 1`` (``RLDataModule.upcoming_batches``); None = nothing can be sent ahead.
        current: The index of this step's training batch (counted from the run's first).
        updates_left: Policy updates the run makes from this step on, this step's included (None = no end).
    """
    ahead = steps_ahead(getattr(producer.engine, "max_staleness", 0), updates_per_step)
    if ahead < 1 or upcoming_batches is None:
        return prefetched_through
    if updates_left is not None:  # batches still trained on after this one
        ahead = min(ahead, max(0, math.ceil(updates_left / max(updates_per_step, 1)) - 1))
    first = max(current + 1, prefetched_through + 1)
    upcoming = upcoming_batches(first, current + ahead + 1 - first)  # this process's share
    for index, rows in enumerate(upcoming, start=first):
        sampler.prefetch(producer, rows)
        prefetched_through = index
    return prefetched_through
