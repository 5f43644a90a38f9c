"""One meaning per key: a reward's "counts as solved" threshold (``solved_at``) is its own setting. Laid over
``recipes/quickstart.yaml`` (whose ``IntegerMatch`` rewards 1.0), every reward a guide's YAML block writes counts a
sample as solved from the threshold the block gives it, else from its class's documented default, never from a
value of the reward it replaced; and a run with the judges guide's served judge logs as accuracy the share of
responses whose judge reward reaches the judge's 0.5."""

from __future__ import annotations

import glob
import inspect
import os

import pytest
import torch
import yaml

from rllight.callbacks.base import RolloutCallback
from rllight.rewards import Reward

from conftest import RECIPES
from helpers import build, tiny_overrides
from json_server import JSONServer

ROOT = os.path.dirname(RECIPES)
QUICKSTART = os.path.join(RECIPES, "quickstart.yaml")
BASE = "# base: "


def _reward_blocks() -> list[tuple[str, int, str]]:
    """``(page, index, block)`` of every yaml block of the guides that sets ``model.reward`` to a class."""
    import re

    fence = re.compile(r"^([ \t]*)```yaml[^\n]*\n(.*?)^\1```[ \t]*$", re.MULTILINE | re.DOTALL)
    out = []
    for page in sorted(glob.glob(os.path.join(ROOT, "docs", "guides", "*.md"))):
        with open(page) as f:
            text = f.read()
        for i, m in enumerate(fence.finditer(text)):
            indent = len(m.group(1))
            block = "\n".join(line[indent:] for line in m.group(2).splitlines())
            settings = yaml.safe_load(block) or {}
            reward = (settings.get("model") or {}).get("reward") if isinstance(settings, dict) else None
            if isinstance(reward, dict) and "class_path" in reward and _importable(settings):
                out.append((os.path.relpath(page, ROOT), i, block))
    return out


def _importable(node) -> bool:
    """Whether every module a block names (``class_path``, an environment's ``factory`` or ``load``) imports here:
    a block that names the reader's own module (``my_lab``, ``my_envs``) is run with it by tests/docs."""
    import importlib.util

    if isinstance(node, list):
        return all(_importable(item) for item in node)
    if not isinstance(node, dict):
        return True
    for key in ("class_path", "factory", "load"):
        value = node.get(key)
        if isinstance(value, str) and "." in value and importlib.util.find_spec(value.split(".")[0]) is None:
            return False
    return all(_importable(value) for value in node.values())


BLOCKS = _reward_blocks()


def _spec_leaves(spec, path: str = "reward") -> dict[str, dict]:
    """The reward specs of a block's ``model.reward`` by path (``reward``, ``reward.rewards.judge``), with their
    ``init_args``."""
    out = {path: spec.get("init_args") or {}}
    for name, sub in ((spec.get("init_args") or {}).get("rewards") or {}).items():
        out.update(_spec_leaves(sub, f"{path}.rewards.{name}"))
    for name, sub in ((spec.get("init_args") or {}).get("sources") or {}).items():
        if isinstance(sub, dict) and "class_path" in sub:
            out.update(_spec_leaves(sub, f"{path}.sources.{name}"))
    return out


def _built_leaves(reward: Reward, path: str = "reward") -> dict[str, Reward]:
    out = {path: reward}
    for name, sub in (getattr(reward, "rewards", None) or {}).items():
        out.update(_built_leaves(sub, f"{path}.rewards.{name}"))
    for name, sub in (getattr(reward, "sources", None) or {}).items():
        if isinstance(sub, Reward):
            out.update(_built_leaves(sub, f"{path}.sources.{name}"))
    return out


def _documented_default(cls: type) -> float:
    """The threshold a reward class documents: its constructor's ``solved_at`` default, else the class's own."""
    parameter = inspect.signature(cls.__init__).parameters.get("solved_at")
    return parameter.default if parameter is not None else cls.solved_at


@pytest.mark.skipif(not BLOCKS, reason="no guide sets model.reward")
@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{p}:{i}" for p, i, _ in BLOCKS])
def test_a_guides_reward_over_the_quickstart_counts_solved_from_its_own_threshold(page, index, block, tmp_path,
                                                                                   monkeypatch):
    first = block.splitlines()[0]
    bases = [os.path.join(ROOT, p) for p in first[len(BASE):].split()] if first.startswith(BASE) else [QUICKSTART]
    overlay = tmp_path / "block.yaml"
    overlay.write_text(block)
    monkeypatch.chdir(ROOT)
    cli = build(*bases, str(overlay))
    specs = _spec_leaves(yaml.safe_load(block)["model"]["reward"])
    built = _built_leaves(cli.model.reward.wrapped if hasattr(cli.model.reward, "wrapped") else cli.model.reward)
    checked = 0
    for path, init_args in specs.items():
        reward = built.get(path)
        if reward is None:
            continue
        expected = init_args.get("solved_at", _documented_default(type(reward)))
        assert reward.solved_at == expected, (f"{page} block {index + 1}: {path} ({type(reward).__name__}) counts "
                                              f"solved from {reward.solved_at}, not {expected}")
        below, above = reward.solved_from([expected - 1e-6, expected])
        assert (below, above) == (False, True)
        checked += 1
    assert checked, f"{page} block {index + 1}: no reward of the block was built"


class RewardsSeen(RolloutCallback):
    """Keeps each scored rollout's rewards and solved flags."""

    def __init__(self):
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_rollout(self, trainer, context, rollout):
        self.seen.append((rollout.rewards.clone(), rollout.correct.clone()))
        return rollout


class ScoresThreeAndSeven(JSONServer):
    """A judge server: the chat completions answer ``Score: 3`` and ``Score: 7`` in turn (rewards 0.3 and 0.7)."""

    def answer(self, path, body):
        score = 3 if len(self.requests) % 2 else 7
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"Score: {score}"},
                                  "finish_reason": "stop"}]}

    def get(self, path, authorization):
        return 200, {"object": "list", "data": [{"id": "judge", "object": "model"}]}


@pytest.mark.slow
def test_the_judges_guide_judge_over_the_quickstart_counts_a_score_of_7_solved_and_3_not(tmp_path, tiny_model_dir,
                                                                                       monkeypatch):
    """The served judge of docs/guides/judges.md (``Score: N`` out of 10) over the quickstart, its server answering
    3 and 7 in turn: the responses scored 0.7 count as solved (the judge's 0.5), those scored 0.3 do not, and the
    logged accuracy is their share; with IntegerMatch's 1.0 inherited it would be 0."""
    judge = next(b for p, _, b in BLOCKS if p.endswith("judges.md") and "Endpoint" in b)
    spec = yaml.safe_load(judge)["model"]["reward"]
    server = ScoresThreeAndSeven()
    try:
        spec["init_args"]["placement"]["init_args"]["url"] = f"{server.url}/v1"
        monkeypatch.setenv(spec["init_args"]["placement"]["init_args"]["api_key_env"], "test-key")
        overlay = tmp_path / "judge.yaml"
        overlay.write_text(yaml.safe_dump({"model": {"reward": spec, "reward_preflight": 0}}))
        cli = build(QUICKSTART, tiny_overrides(tmp_path, tiny_model_dir), str(overlay))
        seen = RewardsSeen()
        cli.trainer.callbacks.append(seen)
        cli.trainer.fit(cli.model, cli.datamodule)
    finally:
        server.close()
    rewards = torch.cat([r for r, _ in seen.seen])
    correct = torch.cat([c for _, c in seen.seen])
    assert sorted(set(rewards.tolist())) == pytest.approx([0.3, 0.7])  # the judge's scores, divided by its scale
    assert torch.equal(correct.bool(), rewards >= 0.5)
    last_rewards, _ = seen.seen[-1]
    logged = float(cli.trainer.callback_metrics["train/reward/accuracy"])
    assert logged == pytest.approx(float((last_rewards >= 0.5).float().mean()), abs=1e-6)
    assert 0.0 < logged < 1.0
