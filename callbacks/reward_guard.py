"""A guard against reward hacking: a model-served reward (an LLM judge, a reward model) that rises while the verifier
trained beside it falls means the policy is learning to please the model, not to solve the task (reward
over-optimisation: Gao et al., "Scaling Laws for Reward Model Overoptimization", arXiv:2210.10760); and a model reward
that does not rank right answers above wrong ones is no proxy for the verifier, whatever its mean does.

In a recipe, beside a ``rllight.rewards.Weighted`` reward that holds both (the verifier may weigh 0)::

    trainer:
      callbacks:
        - class_path: rllight.callbacks.RewardHackingGuard
          init_args: {window: 10, min_change: 0.1, min_agreement: 0.0, action: stop}
"""

from __future__ import annotations

import logging
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rllight._compat import rl_steps_done
from rllight.algorithms.evaluation import mean_and_se
from rllight.bounds import AtLeastTwo, Correlation, PositiveFiniteFloat, bounded
from rllight.callbacks.base import RolloutCallback, RolloutContext
from rllight.distributed import Ranks
from rllight.errors import RecipeError
from rllight.rewards import Reward, Weighted
from rllight.rewards.agreement import fitted_change
from rllight.stopping import end_after_step
from rllight.types import Rollout

log = logging.getLogger(__name__)

KEY = "trainer.callbacks: RewardHackingGuard"


class RewardHackingGuard(RolloutCallback):
    """Warns, or ends the run saved, when over the last ``window`` RL steps the mean of a model-served reward rose
    while the mean of a verifier fell, or when the model reward's rank correlation with the verifier was not clearly
    above ``min_agreement``.

    Each RL step it reads the two rewards' means over the step's responses (``train/reward/<model_reward>`` and
    ``train/reward/<verifier>``: components of the recipe's ``rllight.rewards.Weighted``), averaged over the training
    processes; a step that scored nothing is not counted. Once it holds ``window`` steps it fits a least-squares line
    to each reward's means (``rllight.rewards.agreement.fitted_change``: the line's change from the window's first
    step to its last, in the reward's own units) and fires when the model reward's change is at least
    ``min_change`` and the verifier's at most ``-min_change``. A model reward equal to the verifier, or one whose mean
    rises and falls with it, never fires it: the two changes have one sign. After it fires the window starts afresh,
    so a run that goes on warns at most once every ``window`` steps. The state (the window, the verifier's best step)
    is saved in checkpoints and restored on resume.

    The agreement test reads ``train/reward/agreement/<model_reward>_vs_<verifier>/rank_corr`` (Spearman's, over a
    step's responses; a step where either reward is constant has none and is not counted). Once it holds ``window``
    steps' correlations it fires when their mean less two standard errors (the steps' spread / sqrt(window)) is at
    most ``min_agreement``: over the window, the evidence that the model reward orders responses as the verifier does
    is too weak. With the default 0 that is a one-sided test, at two standard errors, of "no relation at all": it
    says within ``window`` steps that a judge which cannot tell right answers from wrong ones is no reward to train
    on, before its mean has had time to rise, and where the verifier starts too low for its fall to cross
    ``min_change``. A model reward that tracks the verifier, even noisily, passes it once the window shows so. None
    turns the test off.

    ``action: warn`` logs one warning naming both rewards and their changes. ``action: stop`` ends the run after the
    step, saved (``rllight.stopping.end_after_step``: ``stopped-step=N.ckpt``), with one line that also names the best
    checkpoint by the verifier: that of a ``ModelCheckpoint`` in ``trainer.callbacks`` monitoring
    ``train/reward/<verifier>`` (mode ``max``), where the recipe has one; otherwise the RL step at which the
    verifier's mean was highest, which no checkpoint keeps.

    Metrics, each step once the window is full: ``train/guard/reward_hacking/model_change`` and
    ``train/guard/reward_hacking/verifier_change``.

    Args:
        model_reward: The model-served component of the ``Weighted`` reward to watch (None: the first component
            whose score the stated answer does not decide, ``answers_decide`` False: an ``LLMJudge``, a
            ``RewardModel``).
        verifier: The verifier component to watch it against (None: the ``Weighted``'s ``correct_from`` where it is
            a verifier, else its first verifier).
        window: RL steps fitted.
        min_change: The smallest fitted change over the window, up for the model reward and down for the verifier,
            that fires the guard.
        min_agreement: The rank correlation with the verifier that the window's mean, less two standard errors, must
            exceed (None: no agreement test).
        action: ``warn`` (one warning line) or ``stop`` (the run ends, saved, with one line).
    """

    @bounded
    def __init__(self, model_reward: str | None = None, verifier: str | None = None, window: AtLeastTwo = 10,
                 min_change: PositiveFiniteFloat = 0.1, min_agreement: Correlation | None = 0.0,
                 action: Literal["warn", "stop"] = "warn"):
        if action not in ("warn", "stop"):
            raise RecipeError(f"{KEY}.action is {action!r}; give warn or stop")
        self.model_reward, self.verifier = model_reward, verifier
        self.window, self.min_change, self.min_agreement, self.action = window, min_change, min_agreement, action
        self.recent: list[tuple[int, float, float]] = []  # (RL step, model reward's mean, verifier's mean)
        self.agreements: list[tuple[int, float]] = []  # (RL step, rank correlation), steps that have one
        self.best: tuple[int, float] | None = None  # (RL step, the verifier's highest mean)
        self.steps = 0  # steps counted: an RL step's number where no trainer says it

    def check_before_fit(self, module: L.LightningModule) -> None:
        """The two rewards' names, found in ``module.reward`` (``watched_pair``): a reward without a model reward
        beside a verifier, or a name that is not a component, is one line before any model loads."""
        self.model_reward, self.verifier = watched_pair(getattr(module, "reward", None), self.model_reward,
                                                        self.verifier)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.check_before_fit(pl_module)

    def on_rollout(self, trainer: L.Trainer | None, context: RolloutContext | None, rollout: Rollout) -> Rollout:
        if self.model_reward is None or self.verifier is None:
            raise RecipeError(f"{KEY} has no rewards to watch; it finds them in model.reward as the run starts")
        ranks = context.ranks if context is not None else Ranks()
        model, verifier = (rollout.extras.get(f"reward/{name}") for name in (self.model_reward, self.verifier))
        means = _mean_over_ranks(ranks, model, verifier)
        corr = _mean_over_ranks(ranks, rollout.extras.get(f"reward/{self.agreement_key}"))
        if means is None:
            return rollout
        model, verifier = means
        self.steps += 1
        step = rl_steps_done(trainer) + 1 if trainer is not None else self.steps  # as the loggers count
        if self.best is None or verifier > self.best[1]:
            self.best = (step, verifier)
        self.recent = [*self.recent, (step, model, verifier)][-self.window:]
        if corr is not None:
            self.agreements = [*self.agreements, (step, corr[0])][-self.window:]
        diverged, disagreed = self._diverged(rollout), self._disagreed(rollout)  # both, to log both tests
        if diverged or disagreed:
            self._fire(trainer, diverged or disagreed)
            self.recent, self.agreements = [], []
        return rollout

    @property
    def agreement_key(self) -> str:
        return f"agreement/{self.model_reward}_vs_{self.verifier}/rank_corr"

    def _diverged(self, rollout: Rollout) -> str | None:
        """The trend test on a full window: the line that says the model reward rose while the verifier fell, or
        None; logs both fitted changes."""
        if len(self.recent) < self.window:
            return None
        model_change = fitted_change([m for _, m, _ in self.recent])
        verifier_change = fitted_change([v for _, _, v in self.recent])
        rollout.extras["guard/reward_hacking/model_change"] = model_change
        rollout.extras["guard/reward_hacking/verifier_change"] = verifier_change
        if model_change < self.min_change or verifier_change > -self.min_change:
            return None
        first, last, model, verifier = self.recent[0][0], self.recent[-1][0], self.model_reward, self.verifier
        return (f"reward hacking: over RL steps {first}-{last} the model reward {model!r} rose by {model_change:.3g} "
                f"while the verifier {verifier!r} fell by {-verifier_change:.3g} (least-squares fits of "
                f"train/reward/{model} and train/reward/{verifier}): the policy is learning what {model!r} likes, not "
                f"the task; see train/reward/{self.agreement_key}")

    def _disagreed(self, rollout: Rollout) -> str | None:
        """The agreement test on a full window of correlations: the line that says the model reward does not rank
        responses as the verifier does, or None; logs the mean less two standard errors."""
        if self.min_agreement is None or len(self.agreements) < self.window:
            return None
        mean, se = mean_and_se(torch.tensor([c for _, c in self.agreements]))
        rollout.extras["guard/reward_hacking/agreement_lower"] = mean - 2 * se
        if mean - 2 * se > self.min_agreement:
            return None
        first, last, model, verifier = self.agreements[0][0], self.agreements[-1][0], self.model_reward, self.verifier
        return (f"reward hacking: over RL steps {first}-{last} the model reward {model!r} did not rank responses as "
                f"the verifier {verifier!r} does (rank correlation {mean:.3g} ± {se:.2g} a step, not clearly above "
                f"min_agreement {self.min_agreement:g}; train/reward/{self.agreement_key}): it is no proxy for the "
                "task, and training on it teaches what it likes")

    def _fire(self, trainer: L.Trainer | None, what: str) -> None:
        settings = f"{KEY}'s window, min_change, min_agreement and action set when this fires"
        if self.action == "stop":
            end_after_step(f"{what}; {self.best_by_verifier(trainer)} ({settings})")
        elif trainer is None or trainer.is_global_zero:
            log.warning("%s; training goes on (%s; action: stop ends the run)", what, settings)

    def best_by_verifier(self, trainer: L.Trainer | None) -> str:
        """The best checkpoint by the verifier, in words: the best one kept by a ``ModelCheckpoint`` that monitors
        ``train/reward/<verifier>`` with mode ``max``; else the RL step at which the verifier's mean was highest."""
        key = f"train/reward/{self.verifier}"
        for callback in getattr(trainer, "checkpoint_callbacks", None) or ():
            if (isinstance(callback, ModelCheckpoint) and callback.monitor == key and callback.mode == "max"
                    and callback.best_model_path):
                score = callback.best_model_score
                shown = f" ({key} {float(score):.3g})" if score is not None else ""
                return f"the best checkpoint by {self.verifier!r} is {callback.best_model_path}{shown}"
        if self.best is None:
            return f"no checkpoint is kept by {key}"
        step, value = self.best
        return (f"{self.verifier!r} was highest at RL step {step} ({value:.3g}), which no checkpoint keeps (a "
                f"ModelCheckpoint monitoring {key}, mode max, would)")

    def state_dict(self) -> dict:
        return {"recent": [list(r) for r in self.recent], "best": list(self.best) if self.best else None,
                "steps": self.steps, "agreements": [list(a) for a in self.agreements]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = int(state_dict["steps"])
        self.recent = [(int(s), float(m), float(v)) for s, m, v in state_dict["recent"]]
        self.agreements = [(int(s), float(c)) for s, c in state_dict.get("agreements", [])]
        best = state_dict["best"]
        self.best = (int(best[0]), float(best[1])) if best else None


def _mean_over_ranks(ranks: Ranks, *values: float | None) -> list[float] | None:
    """The mean over the training processes of ``values`` (one step's means), counting the processes that have all
    of them; None where none has. A collective on every rank, with or without values, so the ranks decide alike."""
    here = all(v is not None for v in values)
    total = ranks.reduce(torch.tensor([*(float(v) if here else 0.0 for v in values), float(here)],
                                      dtype=torch.float64))
    if total[-1] == 0:
        return None
    return (total[:-1] / total[-1]).tolist()


def watched_pair(reward: Reward | None, model_reward: str | None = None,
                 verifier: str | None = None) -> tuple[str, str]:
    """``(model reward, verifier)``: two component names of a ``Weighted`` reward within ``reward`` (itself, or a
    reward it combines: ``PerSource``'s), ``model_reward`` and ``verifier`` where given, else the first of its
    ``agreement_pairs`` that fits them, the verifier ``correct_from`` where that is one. A one-line ``RecipeError``
    where there is no such pair."""
    found: list[Weighted] = []
    stack = [reward] if reward is not None else []
    while stack:
        part = stack.pop(0)
        if isinstance(part, Weighted):
            found.append(part)
        stack.extend(part.parts())
    for weighted in found:
        if model_reward in weighted.rewards and verifier in weighted.rewards:
            return model_reward, verifier
        pairs = sorted(weighted.agreement_pairs(), key=lambda pair: pair[1] != weighted.correct_from)
        for pair in pairs:
            if model_reward in (None, pair[0]) and verifier in (None, pair[1]):
                return pair
    given = ", ".join(f"{k}: {v!r}" for k, v in (("model_reward", model_reward), ("verifier", verifier)) if v)
    where = "; ".join(f"Weighted components {', '.join(_roles(w))}" for w in found) or (
        f"model.reward is {type(reward).__name__ if reward is not None else 'not set'}, no rllight.rewards.Weighted")
    raise RecipeError(f"{KEY}{f' ({given})' if given else ''} finds no model-served reward beside a verifier to "
                      f"watch ({where}); put both in a rllight.rewards.Weighted (a verifier of weight 0 is scored and "
                      "logged without training on it) and name them, or remove the guard")


def _roles(weighted: Weighted) -> list[str]:
    """Each component's name and whether it is a verifier or a model reward, for a message."""
    return [f"{name} ({'verifier' if reward.answers_decide else 'model reward'})"
            for name, reward in weighted.rewards.items()]
