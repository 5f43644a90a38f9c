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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rllight.envs.base import Environment
from rllight.envs.guard import EpisodeFailed, EpisodeGuard
from rllight.errors import RecipeError
from rllight.rollout.base import RolloutEngine, Sampling, pad_left
from rllight.types import Rollout

_SENTINEL = "\u2063rllight-turn\u2063"  # content that no template rewrites, to find where a turn's text ends


EPISODE_ID = "episode/id"
"""Rollout extra, one integer per row: the episode the row belongs to (unique within the process). An episode
whose template rewrote its history is laid out as several rows (``run_episodes``), all with its id."""
EPISODE_MAIN = "episode/main"
"""Rollout extra, one bool per row: the row that stands for its episode (its last sample). The episode's other
rows (earlier samples) follow every main row, are False here, and carry the same reward, group and answer."""

_EPISODES = itertools.count()


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **({"tools": tools} if tools else {}))


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

    def extend(self, conversation: list[dict], content: str, sampled: Sequence[int], observations: list[dict],
               tools: list[dict] | None = None) -> list[int] | None:
        """Ids to append after a model turn, or None when the template does not extend the context.

        ``conversation`` is what the model answered (its context, rendered with the generation prompt),
        ``content`` its turn's text and ``sampled`` its ids, ``observations`` the messages that follow. The turn
        merges into the sample only while the template's rendering of the longer conversation starts with the
        rendering the model saw, then the turn's text and the template's closing of it: then the ids are the
        missing part of the closing (what the model did not sample itself) and the template's text after it,
        tokenised, and the sampled ids stay as sampled. A template that rewrites history (drops reasoning of
        earlier turns, moves a system message, re-renders earlier turns) gives None: the caller starts a new
        sample from the whole conversation rendered, so no sample ever holds tokens its context did not."""
        before = _render(self.tokenizer, conversation, True, tools)
        after = _render(self.tokenizer, [*conversation, {"role": "assistant", "content": content}, *observations],
                        True, tools)
        head = before + content + self.close_text
        if not after.startswith(head):
            return None
        missing = self.missing_close(sampled)
        if len(missing) == len(self.close_ids):
            return self.encode(after[len(before) + len(content):])
        return missing + self.encode(after[len(head):])

    def between(self, sampled: Sequence[int], observation: str, role: str = "user") -> list[int]:
        """Ids to append after a model turn's sampled ids: the rest of its closing, the observation turn, and
        the opening of the next assistant turn. Closing and observation are tokenised as one text when the
        turn lacks its whole closing, so the ids are what the template's text tokenises to."""
        missing = self.missing_close(sampled)
        text = self.observation_text(observation, role)
        if len(missing) == len(self.close_ids):
            return self.encode(self.close_text + text)
        return missing + self.encode(text)


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a chat prompt with the tokenizer's template and the generation prompt (``tools``: the JSON
    schemas the template renders in its own tool-calling format)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **({"tools": tools} if tools else {}))
    if not isinstance(ids, list):  # newer tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def check_tools_rendered(tokenizer, conversation: list[dict], tools: list[dict], environment: str) -> None:
    """A one-line ``RecipeError`` when the chat template renders ``conversation`` the same with and without
    ``tools``: the model would never be told about them."""
    if _render(tokenizer, conversation, True, tools) == _render(tokenizer, conversation, True):
        raise RecipeError(f"model.environment: {environment} offers tools, but the model's chat template does not "
                          "render them; set model.model.init_args.chat_template to one that does (e.g. "
                          "recipes/templates/chatml-tools.jinja for a ChatML model)")


def observation_messages(observation: str | list[dict], role: str) -> list[dict]:
    """An environment's observation as chat messages: text is one message in ``role``."""
    return [{"role": role, "content": observation}] if isinstance(observation, str) else list(observation)


@dataclass
class Segment:
    """One training sample of an episode: a context and what the model and the environment added to it."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    is_model: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[list[int]] = field(default_factory=list)
    """The sampled ids of each model turn in this sample."""


@dataclass
class Trajectory(Segment):
    """One episode: its current sample (the fields of ``Segment``: its prompt and what came after it) and the
    samples before it (``earlier``, when the template rewrote the history; see ``ChatTurns.extend``)."""

    rewards: list[float] = field(default_factory=list)
    correct: bool = False
    done: bool = False
    truncated: bool = False
    failed: bool = False
    """A call into the environment failed (``rllight.envs.guard``); the episode ended with reward 0."""
    messages: list[dict] | None = None
    """The conversation so far as chat messages (None: the caller gave none; turns then extend the context by
    the template's rendering of the observation alone, ``ChatTurns.between``)."""
    tools: list[dict] | None = None
    """The tools the episode offers (JSON schemas rendered by the template)."""
    earlier: list[Segment] = field(default_factory=list)
    all_turns: list[list[int]] = field(default_factory=list)
    """The sampled ids of every model turn of the episode, across its samples."""

    @property
    def length(self) -> int:
        """Tokens in the current sample's context (what the model sees next)."""
        return len(self.prompt) + len(self.ids)

    def add(self, ids: Sequence[int], model: bool, logprobs: Sequence[float] | None = None) -> None:
        self.ids.extend(ids)
        self.is_model.extend([model] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def add_turn(self, ids: list[int], logprobs: Sequence[float]) -> None:
        """A model turn: its sampled ids and their log-probs."""
        self.add(ids, True, logprobs)
        self.turns.append(ids)
        self.all_turns.append(ids)

    def restart(self, prompt: list[int]) -> None:
        """Close the current sample and start a new one from ``prompt`` (the whole conversation rendered)."""
        self.earlier.append(Segment(self.prompt, self.ids, self.is_model, self.logprobs, self.turns))
        self.prompt, self.ids, self.is_model, self.logprobs, self.turns = list(prompt), [], [], [], []


def _next_context(traj: Trajectory, turns: ChatTurns, tokenizer, text: str, observation, role: str) -> list[int] | None:
    """Add a model turn's observation to ``traj``: the ids that extend its sample (returned), or None when the
    template rewrote the history and the trajectory restarted from the whole conversation."""
    ids = traj.turns[-1]
    if traj.messages is None:
        if not isinstance(observation, str):
            raise ValueError("an observation given as messages needs the episode's conversation (run_episodes' "
                             "conversations)")
        return turns.between(ids, observation, role)
    new = observation_messages(observation, role)
    between = turns.extend(traj.messages, text, ids, new, traj.tools)
    traj.messages = [*traj.messages, {"role": "assistant", "content": text}, *new]
    if between is None:
        traj.restart(encode_chat(tokenizer, traj.messages, traj.tools))
    return between


def run_episodes(engine: RolloutEngine, model, tokenizer, episodes: list[Environment], prompts: list[list[int]],
                 sampling: Sampling | None = None, turns: ChatTurns | None = None, guard: EpisodeGuard | None = None,
                 failed: Sequence[bool] | None = None, conversations: Sequence[list[dict]] | None = None,
                 tools: Sequence[list[dict] | None] | None = None) -> list[Trajectory]:
    """Play ``episodes`` (already ``reset``) from the prompt ids ``prompts``, one ``engine.generate`` call per
    turn over the episodes still running. Limits are each episode's ``max_turns`` and ``max_total_tokens``
    (the context of its current sample, prompt included): a response that would pass the token limit is cut to
    fit and ends the episode, as does an observation that would leave no room for another token; both, and
    running out of turns, set ``truncated``. So does a final model turn cut by ``max_new_tokens``. Each turn
    samples as ``sampling`` says (None: the engine's own).

    ``conversations`` (each prompt's chat messages, as rendered into ``prompts``) and ``tools`` (each episode's
    tool schemas) let a turn merge into its sample only while the template extends the context
    (``ChatTurns.extend``); otherwise the episode goes on in a new sample. Without them every observation
    extends the sample by the template's rendering of it alone.

    Every ``step`` goes through ``guard`` (a new ``EpisodeGuard`` when None): one that fails (raises, times
    out, returns an unusable result) ends its episode, ``failed``, counted by the guard. Episodes marked in
    ``failed`` (their ``reset`` failed) are not played."""
    turns, sampling = turns or ChatTurns(tokenizer), sampling or engine.sampling
    trajs = [Trajectory(prompt=list(p)) for p in prompts]
    for i, traj in enumerate(trajs):
        if conversations is not None:
            traj.messages = list(conversations[i])
            traj.tools = tools[i] if tools is not None else None
    if guard is None and episodes:
        guard = EpisodeGuard(episodes[0])
    for i, bad in enumerate(failed or []):
        trajs[i].failed = trajs[i].done = bool(bad)
    running = [i for i, t in enumerate(trajs) if not t.failed and t.length < episodes[i].max_total_tokens]
    for i in set(range(len(trajs))) - set(running) - {i for i, t in enumerate(trajs) if t.failed}:
        trajs[i].truncated = True  # no room for a single token: should have been filtered by the caller
    while running:
        gen = engine.generate(model, tokenizer, [trajs[i].prompt + trajs[i].ids for i in running], sampling)
        cuts, texts = [], []
        for row, i in enumerate(running):
            traj, env = trajs[i], episodes[i]
            mask = gen.response_mask[row].bool()
            ids = gen.response_ids[row][mask].tolist()
            logprobs = gen.logprobs[row][mask].float().tolist()
            room = env.max_total_tokens - traj.length
            cuts.append(len(ids) > room)
            if cuts[-1]:
                ids, logprobs = ids[:room], logprobs[:room]
            traj.add_turn(ids, logprobs)
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
        # The episodes of the turn step at once (up to the environment's max_concurrency), each under the guard.
        results = guard.step_all([(episodes[i], text) for i, text in zip(running, texts)])
        running = [i for row, i in enumerate(running)
                   if _after_step(trajs[i], episodes[i], results[row], cuts[row], bool(gen.truncated[row]),
                                  texts[row], guard, turns, tokenizer)]
    return trajs


def _after_step(traj: Trajectory, env: Environment, result, cut: bool, length_cut: bool, text: str,
                guard: EpisodeGuard, turns: ChatTurns, tokenizer) -> bool:
    """Apply one step's ``result`` to ``traj``; True when the episode goes on to another model turn."""
    if isinstance(result, EpisodeFailed):  # a faulty environment costs its episode, not the run
        guard.failed(result)
        traj.failed = traj.done = True
        return False
    traj.rewards.append(result.reward)
    if result.correct is not None:
        traj.correct = bool(result.correct)
    if result.done:
        traj.done = True
        traj.truncated = cut or length_cut  # the answer itself was cut
        return False
    if cut or len(traj.all_turns) >= env.max_turns:
        traj.truncated = True
        return False
    between = _next_context(traj, turns, tokenizer, text, result.observation, env.observation_role)
    if between is None:  # a new sample: its prompt is the whole conversation
        if traj.length >= env.max_total_tokens:
            traj.truncated = True
            return False
        return True
    if traj.length + len(between) >= env.max_total_tokens:
        traj.truncated = True  # the observation would leave no room for the next turn
        return False
    traj.add(between, False)
    return True


def _rows(trajs: list[Trajectory]) -> list[tuple[int, Segment, bool]]:
    """``(episode, sample, main)`` of every row: each episode's current sample first (in order), then the
    earlier samples of the episodes that restarted."""
    return [(i, t, True) for i, t in enumerate(trajs)] + [(i, seg, False) for i, t in enumerate(trajs)
                                                         for seg in t.earlier]


def with_first_observation(messages: list[dict], observation: str | None) -> list[dict]:
    """``messages`` with an environment's first observation added to the last message's content (a new
    line between them; the observation alone when that content is empty); unchanged when there is none."""
    if observation is None:
        return messages
    last = messages[-1]
    content = f"{last['content']}\n{observation}" if last["content"] else observation
    return [*messages[:-1], {**last, "content": content}]


def start_episodes(environment: Environment, tokenizer, guard: EpisodeGuard, rows: list[dict], n: int):
    """``(episodes, prompt ids, failed, conversations, tools)``: ``n`` fresh episodes of ``environment`` per row,
    reset through ``guard`` (at once, up to its ``max_concurrency``: a reset may be a round trip to a server), each
    with its prompt's chat messages and the tools it offers; an episode whose ``reset`` (or ``tools``) failed is
    marked (it is not played, and counts as failed) and gets the row's prompt. The first episode with tools
    checks that the chat template renders them (``check_tools_rendered``)."""
    episodes = [environment.spawn() for _ in rows for _ in range(n)]
    started = guard.reset_all([(episodes[k * n + j], row) for k, row in enumerate(rows) for j in range(n)])
    failed, prompts, conversations, tools = [False] * len(episodes), [], [], []
    checked = False
    for i, result in enumerate(started):
        first, schemas = None, None
        if isinstance(result, EpisodeFailed):
            guard.failed(result)
            failed[i] = True
        else:
            first, schemas = result
        conversations.append(with_first_observation(rows[i // n]["messages"], first))
        tools.append(schemas)
        if schemas and not checked:
            check_tools_rendered(tokenizer, conversations[-1], schemas, type(environment).__name__)
            checked = True
        prompts.append(encode_chat(tokenizer, conversations[-1], schemas))
    return episodes, prompts, failed, conversations, tools


def trajectory_rewards(guard: EpisodeGuard, episodes: list[Environment], trajs: list[Trajectory]) -> list[float]:
    """Each trajectory's reward through ``guard``: 0 (and not correct) for a failed episode."""
    rewards = [0.0] * len(trajs)
    for i, (episode, traj) in enumerate(zip(episodes, trajs)):
        if not traj.failed:
            try:
                rewards[i] = guard.trajectory_reward(episode, traj.rewards)
            except EpisodeFailed as failure:
                guard.failed(failure)
                traj.failed = True
        traj.correct = traj.correct and not traj.failed
    return rewards


def episodes_to_rollout(trajs: list[Trajectory], rewards: list[float], group_ids: torch.Tensor, answers: list[str],
                        tokenizer, device: torch.device | str = "cpu", extras: dict | None = None) -> Rollout:
    """The trajectories as a ``Rollout``: prompts left-padded, everything after them right-padded, with
    ``response_mask`` on model tokens, ``context_mask`` on every real token after the prompt and
    ``sample_logprobs`` at model tokens (0 elsewhere). ``texts`` are the decoded model turns, one per line.

    One row per episode, then one more per earlier sample of an episode that restarted (see ``_rows``); the
    extras ``EPISODE_ID`` and ``EPISODE_MAIN`` say which rows belong together, and ``episode/turns`` holds the
    episode's model turns on each of its rows. An extra row has its episode's reward, group, answer and
    correctness."""
    pad = tokenizer.pad_token_id
    rows = _rows(trajs)
    prompt_ids, prompt_mask = pad_left([seg.prompt for _, seg, _ in rows], pad)
    width = max(max((len(seg.ids) for _, seg, _ in rows), default=0), 1)
    b = len(rows)
    response_ids = torch.full((b, width), pad, dtype=torch.long)
    response_mask = torch.zeros((b, width), dtype=torch.long)
    context_mask = torch.zeros((b, width), dtype=torch.long)
    sample_logprobs = torch.zeros((b, width), dtype=torch.float32)
    for r, (_, seg, _) in enumerate(rows):
        n = len(seg.ids)
        if n:
            response_ids[r, :n] = torch.tensor(seg.ids, dtype=torch.long)
            response_mask[r, :n] = torch.tensor(seg.is_model, dtype=torch.long)
            context_mask[r, :n] = 1
            sample_logprobs[r, :n] = torch.tensor(seg.logprobs, dtype=torch.float32)
    episode = [i for i, _, _ in rows]
    texts = ["\n".join(tokenizer.decode(turn, skip_special_tokens=True)
                       for turn in (trajs[i].all_turns if main else seg.turns)) for i, seg, main in rows]
    ids = torch.tensor([next(_EPISODES) for _ in trajs], dtype=torch.long)[episode]
    return Rollout(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        response_ids=response_ids.to(device),
        response_mask=response_mask.to(device),
        context_mask=context_mask.to(device),
        sample_logprobs=sample_logprobs.to(device),
        truncated=torch.tensor([trajs[i].truncated for i in episode], dtype=torch.bool, device=device),
        group_ids=group_ids[episode].to(device),
        answers=[answers[i] for i in episode],
        texts=texts,
        rewards=torch.tensor([rewards[i] for i in episode], dtype=torch.float32, device=device),
        correct=torch.tensor([float(trajs[i].correct) for i in episode], dtype=torch.float32, device=device),
        extras={**dict(extras or {}),
                "episode/turns": torch.tensor([len(trajs[i].all_turns) for i in episode], dtype=torch.float32),
                EPISODE_ID: ids, EPISODE_MAIN: torch.tensor([main for _, _, main in rows], dtype=torch.bool)},
    )


def main_rows(rollout: Rollout) -> Rollout:
    """One row per episode (``EPISODE_MAIN``): the rollout itself unless an episode was laid out as several
    rows. Per-episode statistics (reward, accuracy, evaluation) read these."""
    main = (getattr(rollout, "extras", None) or {}).get(EPISODE_MAIN)
    if main is None or len(main) != len(rollout) or bool(main.all()):
        return rollout
    return rollout.select(main.nonzero().squeeze(-1))
