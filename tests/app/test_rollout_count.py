"""The totals of the per-step lines (``rllight.app.rollout_count.RolloutCount``): fixed from the first line, whatever
the rollouts turn out to make (dynamic sampling's partial batches, value pretraining's rollouts), also after a resume;
the ETA's rollouts left are measured."""

import os
import re
from types import SimpleNamespace

import pytest

import rllight.app.rollout_count
from conftest import RECIPES
from helpers import fit_in_child
from rllight.app.progress import StepLog
from rllight.app.rollout_count import RolloutCount, planned_updates_per_rollout
from rllight.callbacks import ValuePretraining
from rllight.settings import Batching
from rllight.strategies import DynamicSampling, GroupSampler

SMOKE = os.path.join(RECIPES, "overlays", "smoke.yaml")
TOTALS = re.compile(r"^rllight: step \d+(/\S+)? \| updates \d+(/\d+)? \|", re.M)


def fake_trainer(**kw):
    """A trainer as the count reads it: GRPO's plan (4 prompts x 8 responses in minibatches of 16: 2 updates a
    rollout) and ``max_steps`` 80."""
    defaults = dict(max_steps=80, global_step=0, max_epochs=-1, num_training_batches=float("inf"), callbacks=[],
                    datamodule=SimpleNamespace(batches_trained=0, batch_size=4),
                    lightning_module=SimpleNamespace(batching=Batching(minibatch_size=16),
                                                     sampler=GroupSampler(group_size=8)))
    return SimpleNamespace(**{**defaults, **kw})


@pytest.fixture
def step_metrics(monkeypatch) -> dict:
    """The metrics the count reads of the step just done (what ``RLModule`` logged): a test fills them."""
    metrics: dict[str, float] = {}
    monkeypatch.setattr(rllight.app.rollout_count, "step_metrics", lambda trainer: metrics)
    return metrics


def _lines(trainer, updates_per_rollout: list[int], step_metrics: dict, before=lambda i: None) -> list[str]:
    """The per-step lines of rollouts that make ``updates_per_rollout`` updates each (0: empty after filtering,
    unless ``before(i)`` made it a callback's rollout), as ``StepLog`` prints them (1 s a step)."""
    log = StepLog()
    log.on_train_start(trainer, None)
    lines = []
    for i, made in enumerate(updates_per_rollout):
        log.count.batch_start(trainer)
        step_metrics.clear()
        if not before(i) and made == 0:
            step_metrics["train/guard/empty_rollouts"] = 1.0
        trainer.global_step += made
        trainer.datamodule.batches_trained += 1
        log.count.batch_end(trainer)
        log.durations = [1.0]
        lines.append(log.step_line(trainer, {}))
    return lines


def test_the_totals_are_planned_when_training_starts_and_do_not_move(step_metrics):
    # Planned: 4 prompts x 8 responses / minibatch 16 = 2 updates a rollout, 80 updates = 40 rollouts.
    trainer = fake_trainer()
    assert planned_updates_per_rollout(trainer.lightning_module, trainer.datamodule) == 2
    count = RolloutCount()
    count.start(trainer)
    assert (count.total(trainer), count.total_updates(trainer), count.bound) == (40, 80, False)
    # Rollouts that made 4 updates each (a critic's own, say): the totals stay; the ETA's estimate follows the rate.
    lines = _lines(trainer, [4, 4], step_metrics)
    assert [line.split(" | ")[:2] for line in lines] == [["step 1/40", "updates 4/80"], ["step 2/40", "updates 8/80"]]
    assert lines[-1].endswith("| ETA 18s")  # 72 updates left at 4 a rollout: 18 rollouts of 1 s
    # A resume after 3 rollouts and 6 updates: 3 done + 74 updates left / 2 = 40 again.
    resumed = fake_trainer(global_step=6, datamodule=SimpleNamespace(batches_trained=3, batch_size=4))
    count.start(resumed)
    assert (count.done(resumed), count.total(resumed), count.total_updates(resumed)) == (3, 40, 80)
    # max_epochs bounds it too: 2 epochs of 7 batches; nothing bounds it: no totals.
    epochs = fake_trainer(max_steps=-1, max_epochs=2, num_training_batches=7)
    count.start(epochs)
    assert (count.total(epochs), count.total_updates(epochs)) == (14, 28)
    unbounded = fake_trainer(max_steps=-1, max_epochs=-1)
    count.start(unbounded)
    assert (count.total(unbounded), count.total_updates(unbounded), count.left(unbounded)) == (None, None, None)


def test_dynamic_sampling_shows_the_updates_budget_and_no_total_of_rl_steps_that_would_move(step_metrics):
    """DAPO in smoke mode (issue 59): 8 prompts x 8 responses in minibatches of 16 plan 4 updates a rollout, but
    dynamic sampling's partial batches made 1, 1, 1, 0 (empty), 2, 2, 1; its lines said ``step 1/8``, ``step 4/11``,
    ``step 6/7``. The updates' total stays 8, and the lines show no total of RL steps, which only the run can tell."""
    trainer = fake_trainer(max_steps=8, datamodule=SimpleNamespace(batches_trained=0, batch_size=8),
                           lightning_module=SimpleNamespace(batching=Batching(minibatch_size=16),
                                                            sampler=DynamicSampling(group_size=8)))
    lines = _lines(trainer, [1, 1, 1, 0, 2, 2, 1], step_metrics)
    assert [line.split(" | ")[:2] for line in lines] == [
        ["step 1", "updates 1/8"], ["step 2", "updates 2/8"], ["step 3", "updates 3/8"], ["step 4", "updates 3/8"],
        ["step 5", "updates 5/8"], ["step 6", "updates 7/8"], ["step 7", "updates 8/8"]]
    # The ETA counts what is measured: after 3 updates in 4 rollouts, 5 left take 7 more.
    assert lines[3].endswith("| ETA 7.0s")


def test_value_pretraining_makes_the_total_a_bound_fixed_from_the_first_line(step_metrics):
    """VAPO in smoke mode (issue 59): up to 10 value-pretraining rollouts (no policy update), then 2 rollouts of 4
    updates for max_steps 8; its lines said ``step 1/3``, ``step 2/4``, ... ``step 8/8`` as pretraining went on. The
    total is the bound 10 + 2 from the first line to the last, though pretraining settled after 6."""
    pretraining = ValuePretraining(max_steps=10)
    trainer = fake_trainer(max_steps=8, callbacks=[pretraining],
                           datamodule=SimpleNamespace(batches_trained=0, batch_size=8))

    def pretrain(i: int) -> bool:
        if pretraining.finished:
            return False
        pretraining.steps_done += 1
        pretraining.finished = pretraining.steps_done == 6
        return True

    lines = _lines(trainer, [0] * 6 + [4, 4], step_metrics, before=pretrain)
    assert [line.split(" | ")[:2] for line in lines] == [[f"step {i}/≤12", f"updates {u}/8"] for i, u in
                                                         [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 4), (8, 8)]]
    assert lines[0].endswith("| ETA 11s") and lines[5].endswith("| ETA 2.0s")  # 9 + 2 left, then 2 (1 s a step)
    # A resume after pretraining: the callback's restored state takes nothing more, the total is exact again.
    resumed = fake_trainer(max_steps=16, global_step=8, callbacks=[pretraining],
                           datamodule=SimpleNamespace(batches_trained=8, batch_size=8))
    count = RolloutCount()
    count.start(resumed)
    assert (count.total(resumed), count.bound, count.total_updates(resumed)) == (10, False, 16)


def test_a_total_the_run_goes_past_is_left_out(step_metrics):
    """A rollout empty after filtering makes no update under a sampler that fixes the rollouts' size: the run takes
    one rollout more than planned, and its last line shows no total rather than ``3/2``."""
    trainer = fake_trainer(max_steps=4)
    lines = _lines(trainer, [2, 0, 2], step_metrics)
    assert [line.split(" | ")[:2] for line in lines] == [["step 1/2", "updates 2/4"], ["step 2/2", "updates 2/4"],
                                                         ["step 3", "updates 4/4"]]


def test_steps_that_trained_nothing_count_in_the_eta_and_the_updates_total_is_whole_rollouts(step_metrics):
    """A rollout empty after filtering makes no update and costs a step all the same: the updates per rollout are
    measured over those too, so a run that trains every other step shows twice the steps left (not the 1 step its
    max_steps would take at full rate); with no update made yet the ETA is unknown. The updates shown against their
    total are what the run will make: whole rollouts (max_steps 1 at 4 a rollout: 4/4)."""
    trainer = fake_trainer(lightning_module=SimpleNamespace(batching=Batching(minibatch_size=16),
                                                            sampler=DynamicSampling(group_size=8)))
    log = StepLog()
    log.on_train_start(trainer, None)
    log.durations = [12.0]
    log.count.batch_start(trainer)
    step_metrics["train/guard/empty_rollouts"] = 1.0
    trainer.datamodule.batches_trained = 1
    log.count.batch_end(trainer)
    assert log.count.left(trainer) is None  # one rollout, no update: no rate to count on
    line = log.step_line(trainer, {})
    assert line.startswith("step 1 | updates 0/80 |") and line.endswith("| 12.0s/step | ETA ?"), line
    step_metrics.clear()
    log.count.batch_start(trainer)
    trainer.global_step, trainer.datamodule.batches_trained = 2, 2
    log.count.batch_end(trainer)
    assert log.count.per_rollout(trainer) == 1.0 and log.count.left(trainer) == 78  # not 39
    assert log.step_line(trainer, {}).endswith("| ETA 15m36s")  # 78 steps left x 12 s
    # A value-pretraining step (no update, not empty: a callback used the rollout) leaves the rate alone.
    log.count.batch_start(trainer)
    trainer.datamodule.batches_trained = 3
    log.count.batch_end(trainer)
    assert log.count.per_rollout(trainer) == 1.0
    small = fake_trainer(max_steps=1, global_step=4, datamodule=SimpleNamespace(batches_trained=1, batch_size=16),
                         lightning_module=SimpleNamespace(batching=Batching(minibatch_size=16),
                                                          sampler=GroupSampler(group_size=4)))
    log = StepLog()
    log.durations = [1.0]
    assert log.step_line(small, {}).startswith("step 1/1 | updates 4/4 |")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["dapo.yaml", "vapo.yaml"])
def test_a_smoke_runs_step_lines_keep_their_totals(recipe, tmp_path):
    """The runs of issue 59 through the command, in a log file: every per-step line has the totals of the first."""
    log_file = tmp_path / "fit.log"
    run = fit_in_child(recipe, "--config", SMOKE, "--trainer.default_root_dir", str(tmp_path / "run"), timeout=600,
                       log_file=str(log_file), XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    text = log_file.read_text()
    assert run.returncode == 0, text[-3000:]
    totals = TOTALS.findall(text)
    assert len(totals) >= 2, text[-3000:]
    # One total of each kind (a line whose count went past its total shows none: tested above).
    assert len({steps for steps, _ in totals if steps}) <= 1 and {updates for _, updates in totals} <= {"/8", ""}
    assert totals[0][1] == "/8", text[-3000:]  # trainer.max_steps of the smoke overlay
