"""Multi-turn episodes, token in and token out.

``run_episodes`` plays many episodes of an ``Environment`` at once: each turn it generates one response for
every episode still running (one ``engine.generate`` call), appends the exact token ids the engine sampled,
asks the episode's environment what comes next, and appends the observation's tokens. Nothing the model
sampled is ever decoded and encoded again: the context of the next turn is the previous context, the sampled
ids, and ids rendered from the chat template around the observation (``ChatTurns``).

``episodes_to_rollout`` lays the trajectories out as a ``Rollout``: the prompt, then every token after it
(model turns and observations) in ``response_ids``; ``response_mask`` marks the model's tokens (the actions
that train), ``context_mask`` every real token after the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rllight.envs.base import Environment
from rllight.envs.guard import EpisodeFailed, EpisodeGuard
from rllight.rollout.base import RolloutEngine, Sampling, pad_left
from rllight.types import Rollout

_SENTINEL = "\u2063rllight-turn\u2063"  # content that no template rewrites, to find where a turn's text ends


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


class ChatTurns:
    """The token ids a chat template puts between two assistant turns around an observation.

    The text is rendered by the template, never guessed: ``close`` is what follows an assistant message's
    content (e.g. ``<|im_end|>\\n``), found by rendering a conversation ending with an assistant message;
    an observation's text is the difference between a conversation with and without a final observation turn
    (with the generation prompt), so whatever the template inserts once at the start (a default system
    message, a date header) cancels. Only this template text is tokenised.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}]
        base = _render(tokenizer, self._base, add_generation_prompt=False)
        end = base.rfind(_SENTINEL)
        if end < 0:
            raise ValueError("the chat template drops the assistant's content; multi-turn episodes need it kept")
        self._base_text = base
        self.close_text = base[end + len(_SENTINEL):]
        self.close_ids = self.encode(self.close_text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def observation_text(self, observation: str, role: str = "user") -> str:
        """The template's text of an observation turn and the opening of the next assistant turn."""
        full = _render(self.tokenizer, [*self._base, {"role": role, "content": observation}], add_generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ValueError("the chat template renders earlier turns differently once a turn follows them; "
                             "multi-turn episodes need a template whose conversation only grows")
        return full[len(self._base_text):]

    def missing_close(self, sampled: Sequence[int]) -> list[int]:
        """The part of ``close_ids`` that the sampled ids do not already end with (the end token sampled by
        the model stays the model's; a turn cut by the length limit gets the whole closing)."""
        close = self.close_ids
        for k in range(min(len(close), len(sampled)), 0, -1):
            if list(sampled[-k:]) == close[:k]:
                return close[k:]
        return list(close)

    def between(self, sampled: Sequence[int], observation: str, role: str = "user") -> list[int]:
        """Ids to append after a model turn's sampled ids: the rest of its closing, the observation turn, and
        the opening of the next assistant turn. Closing and observation are tokenised as one text when the
        turn lacks its whole closing, so the ids are what the template's text tokenises to."""
        missing = self.missing_close(sampled)
        text = self.observation_text(observation, role)
        if len(missing) == len(self.close_ids):
            return self.encode(self.close_text + text)
        return missing + self.encode(text)


@dataclass
class Trajectory:
    """One episode: its prompt and what came after it, one segment per model turn or observation."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    """Every token after the prompt."""
    is_model: list[bool] = field(default_factory=list)
    """Per token of ``ids``: sampled by the model (True) or inserted by the environment and template."""
    logprobs: list[float] = field(default_factory=list)
    """Per token of ``ids``: the engine's sampling log-prob (0 on observation tokens)."""
    turns: list[list[int]] = field(default_factory=list)
    """The sampled ids of each model turn."""
    rewards: list[float] = field(default_factory=list)
    correct: bool = False
    done: bool = False
    truncated: bool = False
    failed: bool = False
    """A call into the environment failed (``rllight.envs.guard``); the episode ended with reward 0."""

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.ids)

    def add(self, ids: Sequence[int], model: bool, logprobs: Sequence[float] | None = None) -> None:
        self.ids.extend(ids)
        self.is_model.extend([model] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


def run_episodes(engine: RolloutEngine, model, tokenizer, episodes: list[Environment], prompts: list[list[int]],
                 sampling: Sampling | None = None, turns: ChatTurns | None = None, guard: EpisodeGuard | None = None,
                 failed: Sequence[bool] | None = None) -> list[Trajectory]:
    """Play ``episodes`` (already ``reset``) from the prompt ids ``prompts``, one ``engine.generate`` call per
    turn over the episodes still running. Limits are each episode's ``max_turns`` and ``max_total_tokens``
    (prompt included): a response that would pass the token limit is cut to fit and ends the episode, as does
    an observation that would leave no room for another token; both, and running out of turns, set
    ``truncated``. So does a final model turn cut by ``max_new_tokens``. Each turn samples as ``sampling`` says
    (None: the engine's own).

    Every ``step`` goes through ``guard`` (a new ``EpisodeGuard`` when None): one that fails (raises, times
    out, returns an unusable result) ends its episode, ``failed``, counted by the guard. Episodes marked in
    ``failed`` (their ``reset`` failed) are not played."""
    turns, sampling = turns or ChatTurns(tokenizer), sampling or engine.sampling
    trajs = [Trajectory(prompt=list(p)) for p in prompts]
    if guard is None and episodes:
        guard = EpisodeGuard(episodes[0])
    for i, bad in enumerate(failed or []):
        trajs[i].failed = trajs[i].done = bool(bad)
    running = [i for i, t in enumerate(trajs) if not t.failed and t.length < episodes[i].max_total_tokens]
    for i in set(range(len(trajs))) - set(running) - {i for i, t in enumerate(trajs) if t.failed}:
        trajs[i].truncated = True  # no room for a single token: should have been filtered by the caller
    while running:
        gen = engine.generate(model, tokenizer, [trajs[i].prompt + trajs[i].ids for i in running], sampling)
        still, cuts = [], []
        for row, i in enumerate(running):
            traj, env = trajs[i], episodes[i]
            mask = gen.response_mask[row].bool()
            ids = gen.response_ids[row][mask].tolist()
            logprobs = gen.logprobs[row][mask].float().tolist()
            room = env.max_total_tokens - traj.length
            cuts.append(len(ids) > room)
            if cuts[-1]:
                ids, logprobs = ids[:room], logprobs[:room]
            traj.add(ids, True, logprobs)
            traj.turns.append(ids)
        # The episodes of the turn step at once (up to the environment's max_concurrency), each under the guard.
        results = guard.step_all([(episodes[i], tokenizer.decode(trajs[i].turns[-1], skip_special_tokens=True))
                                  for i in running])
        for row, (i, cut, result) in enumerate(zip(running, cuts, results)):
            traj, env, ids = trajs[i], episodes[i], trajs[i].turns[-1]
            if isinstance(result, EpisodeFailed):  # a faulty environment costs its episode, not the run
                guard.failed(result)
                traj.failed = traj.done = True
                continue
            traj.rewards.append(result.reward)
            if result.correct is not None:
                traj.correct = bool(result.correct)
            if result.done:
                traj.done = True
                traj.truncated = cut or bool(gen.truncated[row])  # the answer itself was cut
                continue
            if cut or len(traj.turns) >= env.max_turns:
                traj.truncated = True
                continue
            between = turns.between(ids, result.observation, env.observation_role)
            if traj.length + len(between) >= env.max_total_tokens:
                traj.truncated = True  # the observation would leave no room for the next turn
                continue
            traj.add(between, False)
            still.append(i)
        running = still
    return trajs


def episodes_to_rollout(trajs: list[Trajectory], rewards: list[float], group_ids: torch.Tensor, answers: list[str],
                        tokenizer, device: torch.device | str = "cpu", extras: dict | None = None) -> Rollout:
    """The trajectories as a ``Rollout``: prompts left-padded, everything after them right-padded, with
    ``response_mask`` on model tokens, ``context_mask`` on every real token after the prompt and
    ``sample_logprobs`` at model tokens (0 elsewhere). ``texts`` are the decoded model turns, one per line."""
    pad = tokenizer.pad_token_id
    prompt_ids, prompt_mask = pad_left([t.prompt for t in trajs], pad)
    width = max(max((len(t.ids) for t in trajs), default=0), 1)
    b = len(trajs)
    response_ids = torch.full((b, width), pad, dtype=torch.long)
    response_mask = torch.zeros((b, width), dtype=torch.long)
    context_mask = torch.zeros((b, width), dtype=torch.long)
    sample_logprobs = torch.zeros((b, width), dtype=torch.float32)
    for i, t in enumerate(trajs):
        n = len(t.ids)
        if n:
            response_ids[i, :n] = torch.tensor(t.ids, dtype=torch.long)
            response_mask[i, :n] = torch.tensor(t.is_model, dtype=torch.long)
            context_mask[i, :n] = 1
            sample_logprobs[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    texts = ["\n".join(tokenizer.decode(turn, skip_special_tokens=True) for turn in t.turns) for t in trajs]
    return Rollout(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        response_ids=response_ids.to(device),
        response_mask=response_mask.to(device),
        context_mask=context_mask.to(device),
        sample_logprobs=sample_logprobs.to(device),
        truncated=torch.tensor([t.truncated for t in trajs], dtype=torch.bool, device=device),
        group_ids=group_ids.to(device),
        answers=answers,
        texts=texts,
        rewards=torch.tensor(rewards, dtype=torch.float32, device=device),
        correct=torch.tensor([float(t.correct) for t in trajs], dtype=torch.float32, device=device),
        extras=dict(extras or {}),
    )
