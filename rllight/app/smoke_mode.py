"""What ``smoke: true`` (``recipes/overlays/smoke.yaml``) changes in a parsed recipe before anything is built, so
that every shipped recipe runs to its end on the tiny model (``rllight.testing.TinyModel``) in seconds:

- every model source (``model.model``, a critic's or a teacher's ``HFModel``) becomes the tiny model
  (``rllight.testing.smoke_models``);
- a judge or a reward model that runs in the trainer's process or a worker gets a folder of the tiny model for its
  ``model``: a judge the tiny model with ``yes`` and ``no`` tokens (``rllight.testing.tiny_judge``), a reward model
  the tiny model with a one-label classifier head (``tiny_classifier``). These folders are built when the recipe is
  read, the policy's on first use. One at an ``Endpoint`` keeps its server;
- limits counted in tokens that drop prompts are raised to the tiny model's positions: ``model.max_prompt_tokens``
  and each environment's ``max_total_tokens``. The tiny tokenizer spends about a token per character, several
  times what a real model's spends, so a recipe's limits, chosen for its model, would drop every prompt; the
  smoke run checks the recipe's wiring, not its budgets.

Each change is logged as one ``smoke:`` info line.
"""

from __future__ import annotations

import logging
from argparse import Namespace

from rllight.testing import TinyModel, class_nodes, class_of, set_value, smoke_models, tiny_classifier, tiny_judge

log = logging.getLogger(__name__)


def apply_smoke(config) -> None:
    """Make the parsed recipe ``config`` (a jsonargparse ``Namespace``) a smoke run, in place."""
    for key, class_path in smoke_models(config):
        log.info("smoke: %s (%s) is the tiny model", key, class_path)
    positions = _policy(config).max_positions
    for key, was in _token_limits(config, positions):
        log.info("smoke: %s %s -> %d (the tiny tokenizer's tokens are shorter)", key, was, positions)
    for key, was, folder in _served_folders(config):
        log.info("smoke: %s %r -> the tiny model %s", key, was, folder)


def _policy(config):
    """The tiny model the policy is (``smoke_models`` made it one)."""
    spec = config.get("model.model")
    init = spec.get("init_args") if isinstance(spec, Namespace) else None
    return TinyModel(**({k: v for k, v in vars(init).items()} if isinstance(init, Namespace) else {}))


def _token_limits(config, positions: int) -> list[tuple[str, object]]:
    from rllight.envs.base import Environment

    raised = []
    limit = config.get("model.max_prompt_tokens") if isinstance(config.get("model"), Namespace) else None
    if isinstance(limit, int) and limit < positions:
        config.model.max_prompt_tokens = positions
        raised.append(("model.max_prompt_tokens", limit))
    for key, _, _, node in class_nodes(config):
        cls, init = class_of(node.get("class_path")), node.get("init_args")
        if cls is None or not issubclass(cls, Environment) or init is None:
            continue
        limit = init.get("max_total_tokens")
        if isinstance(limit, int) and limit < positions:
            set_value(init, "max_total_tokens", positions)
            raised.append((f"{key}.init_args.max_total_tokens", limit))
    return raised


def _served_folders(config) -> list[tuple[str, object, str]]:
    """Give each judge and reward model that loads its own ``model`` folder the tiny model's."""
    from rllight.rewards.judge import LLMJudge
    from rllight.rewards.reward_model import RewardModel
    from rllight.serving.endpoint import Endpoint

    changed, folders = [], {}
    for key, _, _, node in list(class_nodes(config)):
        cls, init = class_of(node.get("class_path")), node.get("init_args")
        if cls is None or not issubclass(cls, (LLMJudge, RewardModel)) or init is None:
            continue
        placement = init.get("placement")
        where = class_of(placement.get("class_path")) if isinstance(placement, (dict, Namespace)) else None
        if where is not None and issubclass(where, Endpoint):
            continue  # a served model keeps its server: the smoke run asks it as the recipe does
        kind = "classifier" if issubclass(cls, RewardModel) else "causal"
        if kind not in folders:
            folders[kind] = _folder(config, kind)
        changed.append((f"{key}.init_args.model", init.get("model"), folders[kind]))
        set_value(init, "model", folders[kind])
    return changed


def _folder(config, kind: str) -> str:
    """A judge's or a reward model's folder, made from the tiny policy's (built now)."""
    folder = _policy(config).resolve()
    return tiny_judge(folder) if kind == "causal" else tiny_classifier(folder)


__all__ = ["apply_smoke"]
