"""Difficulty pools (``rllight.data.DifficultyPools``): pool transitions on scripted pass rates, draws by pool
weight, the admission gates and their replacements, the draw cap, the profiling pass, and a resumed curriculum
drawing exactly what an uninterrupted one draws. (A fit on the tiny model and the 2-process resume are in
tests/data/test_curriculum_fit.py.)"""

from collections import Counter

import pytest
import torch

from rllight.data import DifficultyPools
from rllight.distributed import Ranks
from rllight.errors import RecipeError
from rllight.types import Rollout


def _rows(sizes=None):
    sizes = sizes or {"a": 30}
    return [{"prompt": f"{s} {i}", "answer": str(i), "data_source": s} for s, n in sizes.items() for i in range(n)]


class ScriptedProducer:
    """A producer whose training responses are correct at each row's scripted pass rate (``rates[prompt]``); the
    curriculum hears them as the real producer's ``hear`` call tells them."""

    def __init__(self, curriculum, rates):
        self.curriculum, self.rates, self.ranks = curriculum, rates, Ranks()
        self.profiled, self.no_prompts = [], []

    def note_no_prompts(self, reason):  # the data side's word on a step without prompts
        self.no_prompts.append(reason)

    def sample(self, rows, n, training=True):  # the profiling pass: n responses per row, correct at its rate
        self.profiled.append([r["prompt"] for r in rows])
        correct = [float(j < round(self.rates[r["prompt"]] * n)) for r in rows for j in range(n)]
        rollout = Rollout.empty(extras={"kept_rows": tuple(range(len(rows)))})
        rollout.group_ids = torch.arange(len(rows)).repeat_interleave(n)
        rollout.correct = torch.tensor(correct)
        rollout.rewards = rollout.correct.clone()
        return rollout


class StepData:
    """The data side a curriculum reads: the step counter, and each step's count of each source (set per step from
    the rows a loader's batch would hold)."""

    def __init__(self):
        self.batches_trained, self.counts = 0, {}

    def step_counts(self, step):
        return self.counts


def _step(curriculum, producer, loader_rows, replacements=0):
    """One training step: the curriculum's choice of as many prompts of each source as ``loader_rows`` has, heard
    back at the scripted rates (plus ``replacements`` extra prompts a sampler asks for); returns the prompts trained
    on and the step's metrics."""
    seen = []

    def sampler(prod, rows):
        rows = rows + (prod.curriculum.draw(replacements) if replacements else [])
        seen.extend(r["prompt"] for r in rows)
        prod.curriculum.hear(rows, [prod.rates[r["prompt"]] for r in rows])
        return Rollout.empty()

    if curriculum.data is None:
        curriculum.data = StepData()
    curriculum.data.counts = Counter(r["data_source"] for r in loader_rows)
    rollout = curriculum.run(sampler, producer, loader_rows)
    curriculum.trained()
    return seen, rollout.extras


def test_prompts_move_between_pools_as_their_pass_rates_change_and_draws_follow_the_weights():
    rows = _rows()
    curriculum = DifficultyPools(weights={"hard": 1, "normal": 0, "easy": 0}, unseen="hard", seed=0).bind(rows, 0)
    rates = {r["prompt"]: (0.0, 0.5, 1.0)[i % 3] for i, r in enumerate(rows)}
    producer = ScriptedProducer(curriculum, rates)
    seen, metrics = _step(curriculum, producer, rows[:30])  # every row: all unseen, so in the hard pool
    assert sorted(seen) == sorted(rates)
    # rates 0 / 0.5 / 1: hard (<= 0.2), normal (<= 0.8), easy; worked by hand, 10 each
    assert [metrics[f"curriculum/a/pool/{p}"] for p in ("hard", "normal", "easy")] == [10.0, 10.0, 10.0]
    assert metrics["curriculum/pool/hard/draws"] == 30 and metrics["curriculum/draws"] == 30
    # Only the hard pool has weight: the next step draws its 10 prompts, and only those.
    seen, metrics = _step(curriculum, producer, rows[:12])
    assert sorted(seen) == sorted(p for p, r in rates.items() if r == 0.0)
    assert metrics["curriculum/draws"] == 10 and metrics["curriculum/a/draws"] == 10
    # A prompt solved at last moves to the easy pool; with a window of 2 the mean of its last two groups counts.
    curriculum.record(0, 1.0)
    assert curriculum.pool_of(0) == "easy"
    windowed = DifficultyPools(window=2).bind(rows, 0)
    for rate, pool in ((0.0, "hard"), (1.0, "normal"), (1.0, "easy"), (0.25, "normal")):
        windowed.record(0, rate)
        assert windowed.pool_of(0) == pool, rate


def test_pools_are_drawn_in_proportion_to_their_weights():
    rows = _rows({"a": 300})
    curriculum = DifficultyPools(weights={"hard": 1, "normal": 3, "easy": 0}, seed=1).bind(rows, 0)
    rates = {r["prompt"]: (0.0, 0.5, 1.0)[i % 3] for i, r in enumerate(rows)}
    for i, r in enumerate(rows):
        curriculum.record(i, rates[r["prompt"]])
    producer = ScriptedProducer(curriculum, rates)
    draws = Counter()
    for _ in range(20):
        _, metrics = _step(curriculum, producer, rows[:10])
        draws.update({p: metrics[f"curriculum/pool/{p}/draws"] for p in ("hard", "normal", "easy")})
    assert draws["easy"] == 0 and sum(draws.values()) == 200
    assert 0.65 < draws["normal"] / 200 < 0.85  # 3 / 4 of the draws; binomial sd 0.03


def test_the_pass_rate_gate_rejects_and_replaces_and_solved_prompts_retire():
    rows = _rows({"a": 10})
    curriculum = DifficultyPools(max_pass_rate=0.5, retire_after=2, seed=0).bind(rows, 0)
    rates = {r["prompt"]: 1.0 if i < 5 else 0.5 for i, r in enumerate(rows)}
    producer = ScriptedProducer(curriculum, rates)
    for i in range(5):
        curriculum.record(i, 1.0)  # solved once each: above the gate
    seen, metrics = _step(curriculum, producer, rows[:5])
    assert sorted(seen) == sorted(p for p, r in rates.items() if r == 0.5)  # the five admissible ones
    gate = "curriculum/gate/max_pass_rate"
    admitted, rejected = metrics[f"{gate}/admitted"], metrics[f"{gate}/rejected"]
    assert admitted == 5 and admitted + rejected == metrics["curriculum/draws"] and metrics["curriculum/cap_hit"] == 0
    assert metrics["curriculum/gate/retire/retired"] == 0
    # Solved a second time, a prompt retires: never drawn again, counted.
    ungated = DifficultyPools(retire_after=2, seed=0).bind(rows, 0)
    producer = ScriptedProducer(ungated, rates)
    _, first = _step(ungated, producer, rows)
    _, second = _step(ungated, producer, rows)
    assert first["curriculum/gate/retire/retired"] == 0 and second["curriculum/gate/retire/retired"] == 5
    assert second["curriculum/a/retired"] == 5
    seen, third = _step(ungated, producer, rows)
    assert sorted(seen) == sorted(p for p, r in rates.items() if r == 0.5) and third["curriculum/draws"] == 5


def test_the_draw_cap_ends_the_steps_draws_replacements_included():
    rows = _rows({"a": 30})
    curriculum = DifficultyPools(max_draws=6, seed=0).bind(rows, 0)
    producer = ScriptedProducer(curriculum, {r["prompt"]: 0.5 for r in rows})
    seen, metrics = _step(curriculum, producer, rows[:4], replacements=4)  # 4 + 4 asked, 6 allowed
    assert len(seen) == 6 and len(set(seen)) == 6
    assert metrics["curriculum/draws"] == 6 and metrics["curriculum/cap_hit"] == 1
    seen, metrics = _step(curriculum, producer, rows[:4])  # a new step: a new allowance
    assert len(seen) == 4 and metrics["curriculum/cap_hit"] == 0


def test_replacements_follow_the_steps_sources():
    rows = _rows({"a": 40, "b": 40})
    curriculum = DifficultyPools(seed=0).bind(rows, 0)
    producer = ScriptedProducer(curriculum, {r["prompt"]: 0.5 for r in rows})
    seen, metrics = _step(curriculum, producer, rows[:3] + rows[40:41], replacements=8)
    assert Counter(p.split()[0] for p in seen) == {"a": 9, "b": 3}  # 3 : 1, the batch's and the replacements'
    assert metrics["curriculum/a/draws"] == 9 and metrics["curriculum/b/draws"] == 3


def test_the_profiling_pass_measures_every_prompt_once_before_the_first_step():
    rows = _rows({"a": 10})
    curriculum = DifficultyPools(profile=4, profile_batch=3, seed=0).bind(rows, 0)
    rates = {r["prompt"]: (0.0, 0.25, 1.0)[i % 3] for i, r in enumerate(rows)}
    producer = ScriptedProducer(curriculum, rates)
    _, metrics = _step(curriculum, producer, rows[:2])
    assert [len(chunk) for chunk in producer.profiled] == [3, 3, 3, 1]
    assert metrics["curriculum/profiled"] == 10
    # rates 0 (rows 0, 3, 6, 9), 0.25 (1, 4, 7), 1 (2, 5, 8); the step's two prompts heard at the same rates
    assert [metrics[f"curriculum/a/pool/{p}"] for p in ("hard", "normal", "easy")] == [4.0, 3.0, 3.0]
    state = curriculum.state_dict()
    resumed = DifficultyPools(profile=4, seed=0).bind(rows, 0)
    resumed.load_state_dict(state)
    producer.profiled.clear()
    _step(resumed, producer, rows[:2])
    assert producer.profiled == []  # profiled once, before the first step only: not again on resume


def _scripted_run(curriculum, rows, steps, state=None):
    curriculum.bind(rows, 0)
    if state is not None:
        curriculum.load_state_dict(state)
    rates = {r["prompt"]: (i * 7 % 5) / 4 for i, r in enumerate(rows)}
    producer = ScriptedProducer(curriculum, rates)
    return [_step(curriculum, producer, rows[:4], replacements=2)[0] for _ in range(steps)]


def test_a_resumed_curriculum_draws_exactly_what_the_uninterrupted_one_draws():
    rows = _rows({"a": 20, "b": 12})
    settings = {"max_pass_rate": 0.8, "retire_after": 2, "max_draws": 9, "window": 2}
    whole = _scripted_run(DifficultyPools(**settings), rows, 8)
    first = DifficultyPools(**settings)
    head = _scripted_run(first, rows, 3)
    state = first.state_dict()
    torch.save(state, buffer := __import__("io").BytesIO())  # as a checkpoint holds it
    buffer.seek(0)
    tail = _scripted_run(DifficultyPools(**settings), rows, 5, torch.load(buffer, weights_only=True))
    assert head + tail == whole
    assert len({tuple(s) for s in whole}) > 1  # the steps drew different prompts: the comparison can fail


def test_bad_settings_and_a_changed_data_set_are_one_line():
    with pytest.raises(RecipeError,
                       match=r"^data\.curriculum\.init_args\.pools\.hard must be a number in \[0, 1\], got 2$"):
        DifficultyPools(pools={"hard": 2})
    with pytest.raises(RecipeError, match="no pool holds a pass rate of 1"):
        DifficultyPools(pools={"hard": 0.5})
    with pytest.raises(RecipeError, match="weights must give each pool"):
        DifficultyPools(weights={"hard": 1})
    with pytest.raises(RecipeError, match="unseen is 'medium'"):
        DifficultyPools(unseen="medium")
    with pytest.raises(RecipeError, match=r"^DifficultyPools\.max_draws must be an integer >= 1 or null, got 0$"):
        DifficultyPools(max_draws=0)
    with pytest.raises(RecipeError, match=r"^DifficultyPools\.window must be an integer >= 1, got None$"):
        DifficultyPools(window=None)
    with pytest.raises(RecipeError, match=r"^DifficultyPools\.max_pass_rate must be a number in \[0, 1\] or null"):
        DifficultyPools(max_pass_rate=1.5)
    assert DifficultyPools(pools={"low": 0.5, "high": 1.0}, unseen="low").weights == {"low": 1.0, "high": 1.0}
    state = DifficultyPools().bind(_rows({"a": 5}), 0).state_dict()
    curriculum = DifficultyPools().bind(_rows({"a": 6}), 0)
    curriculum.load_state_dict(state)
    with pytest.raises(RecipeError, match=r"^--ckpt_path: the training rows differ .* \(5 rows then, 6 now\); .*"
                                          r"data\.curriculum\.init_args\.reset_on_changed_rows: true"):
        _step(curriculum, ScriptedProducer(curriculum, {}), [])
    # a checkpoint of a run without a curriculum (its extra-prompt stream's cursor): the curriculum starts fresh
    fresh = DifficultyPools().bind(_rows({"a": 6}), 0)
    fresh.load_state_dict({"cursor": 4})
    _step(fresh, ScriptedProducer(fresh, {r["prompt"]: 0.5 for r in fresh.rows}), fresh.rows[:2])
    assert fresh.steps == 1 and len(fresh.history) == 2


def _learnt(rows, steps=2):
    """A checkpoint's state of difficulty pools that learnt on ``rows`` for ``steps`` steps (every pass rate 1, so
    the prompts drawn retire)."""
    curriculum = DifficultyPools(retire_after=1, seed=0).bind(rows, 0)
    producer = ScriptedProducer(curriculum, {r["prompt"]: 1.0 for r in rows})
    for _ in range(steps):
        _step(curriculum, producer, rows[:2])
    assert curriculum.retired  # something learnt, by row index
    return curriculum.state_dict()


def _resume(rows, state, **settings):
    """Difficulty pools resumed from ``state`` on ``rows``, after their first step (where the state is applied)."""
    curriculum = DifficultyPools(retire_after=1, seed=0, **settings).bind(rows, 0)
    curriculum.load_state_dict(state)
    _step(curriculum, ScriptedProducer(curriculum, {r["prompt"]: 0.0 for r in rows}), rows[:2])
    return curriculum


@pytest.mark.parametrize("change", ["answer", "order", "prompt"])
def test_a_resume_on_changed_training_rows_is_refused_in_one_line_whatever_the_count(change):
    """The same file, the same row count, other rows: the pools' pass rates are kept by row index, so applying them
    would credit one prompt with another's; refused in one line naming the source, where its rows come from, and
    the option; with ``reset_on_changed_rows`` the pools start afresh (a warning says so)."""
    rows = [{**row, "source": f"train.jsonl row {i + 1}"} for i, row in enumerate(_rows({"a": 6, "b": 4}))]
    state = _learnt(rows)
    assert set(state["fingerprint"]) == {"a", "b"}
    changed = [dict(row) for row in rows]
    if change == "answer":
        changed[1]["answer"] = "41"
    elif change == "order":
        changed[0], changed[2] = changed[2], changed[0]
    else:
        changed[3]["prompt"] = "a 3 (edited)"
    with pytest.raises(RecipeError) as err:
        _resume(changed, state)
    assert str(err.value) == (
        "--ckpt_path: the training rows differ from those the checkpoint's data.curriculum learnt on by row index "
        "(data source 'a' from train.jsonl: 6 rows then, 6 now, other text, answers or order); resume with the same "
        "training rows, or set data.curriculum.init_args.reset_on_changed_rows: true to start the curriculum afresh "
        "on these")
    fresh = _resume(changed, state, reset_on_changed_rows=True)
    assert fresh.steps == state["steps"] + 1 and not fresh.retired  # the draws' seed goes on; nothing learnt kept
    assert _resume(rows, state).retired == set(state["retired"])  # the same rows: the state applies as saved


def test_a_checkpoint_without_a_fingerprint_resumes_by_row_count_with_a_warning(caplog):
    rows = _rows({"a": 6})
    state = {k: v for k, v in _learnt(rows).items() if k != "fingerprint"}  # saved by an earlier version
    resumed = _resume(rows, state)
    assert resumed.retired == set(state["retired"])
    assert any("holds no fingerprint of its training rows" in r.getMessage() for r in caplog.records)
    with pytest.raises(RecipeError, match=r"\(6 rows then, 7 now\)"):
        _resume(_rows({"a": 7}), state)


def test_a_step_without_prompts_tells_the_producer_why():
    """Every prompt retired: the step draws none and the producer hears the curriculum's reason (for the line that
    ends a run without updates)."""
    rows = _rows({"a": 4})
    curriculum = DifficultyPools(retire_after=1, seed=0).bind(rows, 0)
    producer = ScriptedProducer(curriculum, {r["prompt"]: 1.0 for r in rows})
    seen, _ = _step(curriculum, producer, rows)  # all four drawn, all solved: all retired
    assert len(seen) == 4 and producer.no_prompts == []
    seen, _ = _step(curriculum, producer, rows[:2])
    assert seen == [] and producer.no_prompts == [
        "data.curriculum: no prompt of data source 'a' is left to draw in a pool with a positive weight (4 retired)"]


def test_a_rule_of_ones_own_gets_the_cap_the_gate_and_the_replacements_of_the_base_and_its_state_back():
    from test_curriculum_fit import HardestFirst

    class OddRowsOnly(HardestFirst):
        def admit(self, index):
            return index % 2 == 1

    rows = _rows({"a": 10, "b": 6})  # a: rows 0..9, b: rows 10..15
    rule = OddRowsOnly(max_draws=5, seed=0).bind(rows, 0)
    producer = ScriptedProducer(rule, {r["prompt"]: 0.5 for r in rows})
    seen, metrics = _step(rule, producer, [rows[0], rows[1], rows[10]], replacements=2)
    # all unseen, so by row: a draws 0 (rejected), 1, 2 (rejected), 3; b draws 10 (rejected): 5 draws, the cap;
    # the replacements find the cap reached
    assert sorted(seen) == ["a 1", "a 3"]
    assert (metrics["curriculum/draws"], metrics["curriculum/cap_hit"]) == (5, 1)
    assert (metrics["curriculum/a/draws"], metrics["curriculum/b/draws"]) == (4, 1)
    assert rule.state_dict() == {"steps": 1, "rows": 16, "profiled": False, "fingerprint": rule.fingerprint(),
                                 "rates": {1: 0.5, 3: 0.5}}
    # the next step: the rows not seen yet first (0, 2, 4 rejected, then 5; 6 rejected at the cap), and a rule
    # resumed from the state draws the same, where a fresh one would draw rows 1 and 3 again
    resumed = OddRowsOnly(max_draws=5, seed=0).bind(rows, 0)
    resumed.load_state_dict(rule.state_dict())
    for curriculum in (rule, resumed):
        seen, _ = _step(curriculum, ScriptedProducer(curriculum, producer.rates), [rows[0], rows[1], rows[10]])
        assert seen == ["a 5"]
