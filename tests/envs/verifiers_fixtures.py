"""Small verifiers (``verifiers.v1``) environments for the adapter's tests, built in memory, no downloads.

``WordEnv``: the model must say a word (asked by the task's prompt, or with ``opening`` by the environment's first
message); until it does, the environment replies with feedback (at most ``attempts`` model turns); the task's reward
is 1 when a reply holds the word. A reply holding "boom" and not the word makes the environment raise.
``load_environment`` builds it (its taskset is this module, id ``verifiers_fixtures``); ``load_taskset`` gives the
taskset alone (one answer per episode); ``load_tool_taskset`` a taskset whose tasks have a tool server (``spell``
spells a word); ``load_textarena`` verifiers' own TextArena environment (its tasks are made by the test: the
taskset's games need word lists downloaded). ``write_probe`` writes a file: a function no recipe may call."""

from __future__ import annotations

import datasets
import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger"]
FEEDBACK = "Not yet: say '{word}'."
SYSTEM = "Answer in one word."


class WordData(vf.TaskData):
    answer: str
    """The word the model must say."""


class WordTask(vf.Task[WordData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def said_it(self, task: WordData, trace: vf.Trace) -> float:
        return float(any(task.answer in (m.content or "").lower() for m in trace.assistant_messages))

    @vf.metric
    async def replies(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class WordConfig(vf.TasksetConfig):
    opening: bool = False
    """The environment opens the conversation (the tasks have no prompt)."""


class WordTaskset(vf.Taskset[WordTask, WordConfig]):
    def load(self):
        rows = datasets.Dataset.from_dict({"word": WORDS})  # in memory, as a hub dataset would be read
        for row in rows:
            prompt = None if self.config.opening else f"Say the word '{row['word']}'."
            yield WordTask(WordData(prompt=prompt, system_prompt=SYSTEM, answer=row["word"]), self.config.task)


class WordEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    attempts: int = 3


class WordEnv(vf.Env[WordEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as exchange:
            opening = f"Say the word '{task.data.answer}'." if task.data.prompt is None else None
            segment = await exchange.turn(opening)
            tries = 1
            while not segment.terminated:
                reply = segment.last_reply.lower()
                if task.data.answer in reply:
                    break
                if "boom" in reply:
                    raise RuntimeError("the word environment broke")
                if tries >= self.config.attempts:
                    break
                segment = await exchange.turn(FEEDBACK.format(word=task.data.answer))
                tries += 1


def load_environment(attempts: int = 3, opening: bool = False) -> WordEnv:
    return WordEnv(WordEnvConfig(taskset=WordConfig(id="verifiers_fixtures", opening=opening), attempts=attempts))


def load_taskset() -> WordTaskset:
    return WordTaskset(WordConfig(id="verifiers_fixtures"))


class Speller(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    async def spell(self, word: str) -> str:
        """Spell a word, letter by letter."""
        return "-".join(word.upper())


class SpellTask(vf.Task[WordData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Speller(vf.ToolsetConfig())]

    @vf.reward
    async def spelled(self, task: WordData, trace: vf.Trace) -> float:
        return float("-".join(task.answer.upper()) in (trace.assistant_messages[-1].content or ""))


class SpellTaskset(vf.Taskset[SpellTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            yield SpellTask(WordData(prompt=f"Spell '{word}' with the tool.", answer=word), self.config.task)


def load_tool_taskset() -> SpellTaskset:
    return SpellTaskset(vf.TasksetConfig(id="verifiers_fixtures"))


def load_textarena() -> vf.Env:
    from verifiers.v1.tasksets.textarena import TextArenaConfig, TextArenaEnv, TextArenaEnvConfig

    return TextArenaEnv(TextArenaEnvConfig(taskset=TextArenaConfig(id="textarena", game="Wordle-v0")))


def write_probe(path: str, text: str = "ran") -> None:
    """Writes ``path``: a function that is no verifiers loader, which a recipe's ``load`` must not get to call."""
    with open(path, "w") as f:
        f.write(text)


__all__ = ["WordEnv", "WordTaskset", "load_environment", "load_taskset", "load_textarena", "load_tool_taskset",
           "write_probe"]
