"""Guards: non-finite updates are skipped then stop the run; long prompts are dropped (or, with
``model.prompt_truncation: left``, cut to their last ``max_prompt_tokens`` ids) and counted;
an empty batch after filtering is a no-op step; steps without an update or without a gradient end the run, saved;
token-budget micro-batches leave the update unchanged."""

import json
import os
import re
import threading
import time

import pytest
import torch
from jsonargparse import ArgumentError

from conftest import RECIPES
from helpers import CaptureLogger, build, tiny_overrides
from rllight.app.command_line import one_line_parse_error
from rllight.callbacks import RolloutCallback
from rllight.envs import Environment, StepResult
from rllight.models import HFModel
from rllight.rewards import IntegerMatch, Verifier
from rllight.rollout.base import Generation, RolloutEngine, pad_left
from rllight.rollout.producer import RolloutProducer


def test_non_finite_loss_skips_update_then_stops(tmp_path, tiny_model_dir):
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(
        tmp_path, tiny_model_dir, policy_loss={"class_path": "user_strategies.NaNLoss", "init_args": {"after": 1}},
        guards={"max_consecutive_skips": 2}), "--trainer.max_steps", "10")
    with pytest.raises(FloatingPointError, match="2 consecutive updates"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # The first update was finite; the two NaN ones were skipped and did not move the parameters.
    assert cli.trainer.global_step == 1
    for p in cli.model.policy.parameters():
        assert torch.isfinite(p).all()


def _short_and_long_prompt(recipe, tmp_path, tiny_model_dir):
    """A recipe's module whose max_prompt_tokens admits the short prompt row of the two returned, not the long."""
    module = build(os.path.join(RECIPES, recipe), tiny_overrides(tmp_path, tiny_model_dir)).model
    module.configure_model()
    short = {"messages": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2"}
    long = {"messages": [{"role": "user", "content": "What is 1 + 1? " * 40}], "answer": "2"}
    module.producer.max_prompt_tokens = len(module.producer.encode([short])[0])
    return module, short, long


def test_long_prompts_are_dropped_and_counted_never_truncated(tmp_path, tiny_model_dir):
    module, short, long = _short_and_long_prompt("grpo.yaml", tmp_path, tiny_model_dir)
    rollout = module.producer.sample([short, long, short], n=2)
    assert len(rollout) == 4
    assert rollout.extras["data/dropped_long_prompts"] == 1.0 and module.producer.dropped_prompts == 1
    # Kept prompts are whole: the prompt tokens equal the full encoding.
    kept = rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
    assert kept == module.producer.encode([short])[0]


def test_remax_counts_a_dropped_prompt_once_though_it_samples_twice(tmp_path, tiny_model_dir):
    module, short, long = _short_and_long_prompt("remax.yaml", tmp_path, tiny_model_dir)
    rollout = module.sampler(module.producer, [short, long])  # sampled responses, then the greedy baseline
    assert len(rollout) == module.sampler.group_size
    assert module.producer.dropped_prompts == 1


class RecordingEngine(RolloutEngine):
    """Answers every prompt with ``answer`` (token ids, log-prob -0.5 each); records the prompts of each ``generate``
    and ``prefetch`` call."""

    def __init__(self, answer: list[int]):
        super().__init__(max_new_tokens=len(answer))
        self.answer, self.calls, self.prefetched = answer, [], []

    def prefetch(self, model, tokenizer, prompts, sampling):
        self.prefetched.append([list(p) for p in prompts])

    def generate(self, model, tokenizer, prompts, sampling):
        self.calls.append([list(p) for p in prompts])
        b, t = len(prompts), len(self.answer)
        prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
        return Generation(prompt_ids, prompt_mask, torch.tensor([self.answer] * b), torch.ones(b, t, dtype=torch.long),
                          torch.full((b, t), -0.5), torch.zeros(b, dtype=torch.bool))


def _template_ids(tok, row) -> list[int]:
    """The row's prompt as the chat template renders it, generation prompt included, tokenized here."""
    text = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _long_prompt_producer(model_dir, prompt_truncation):
    """A producer with a ``RecordingEngine`` whose ``max_prompt_tokens`` is 5 more than the short row's prompt."""
    policy, tok = _tokenizer(model_dir)
    short = {"messages": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2"}
    long = {"messages": [{"role": "user", "content": "Count: " + " ".join(map(str, range(60))) + ". What is 1 + 1?"}],
            "answer": "2"}
    limit = len(_template_ids(tok, short)) + 5
    engine = RecordingEngine(tok.encode("2", add_special_tokens=False) + [tok.eos_token_id])
    producer = RolloutProducer(engine, IntegerMatch(), max_prompt_tokens=limit, prompt_truncation=prompt_truncation)
    producer.bind(policy, tok)
    return producer, engine, tok, short, long, limit


def test_left_keeps_a_long_prompt_as_its_last_max_prompt_tokens_ids_and_counts_it(tiny_model_dir, caplog):
    producer, engine, tok, short, long, limit = _long_prompt_producer(tiny_model_dir, "left")
    whole = _template_ids(tok, long)
    assert len(whole) > limit + 20  # cut by many tokens
    cut = whole[-limit:]  # verl's left truncation: the last max_prompt_tokens ids, the template's end included
    rollout = producer.sample([short, long, short], n=2)
    assert engine.calls == [[_template_ids(tok, short)] * 2 + [cut] * 2 + [_template_ids(tok, short)] * 2]
    assert len(rollout) == 6 and rollout.extras["kept_rows"] == (0, 1, 2)
    assert rollout.rewards.tolist() == [1.0] * 6  # every row answered and scored, the cut one too
    assert rollout.extras["data/truncated_long_prompts"] == 1.0 and rollout.extras["data/dropped_long_prompts"] == 0.0
    assert (producer.truncated_prompts, producer.dropped_prompts) == (1, 0)
    producer.prefetch([long], 1)  # what is sent ahead is cut alike, so that the later sample finds it
    assert engine.prefetched == [[cut]]
    producer.sample([long], 1)
    producer.sample([long, long], 1, training=False)  # an evaluation: cut alike, not counted in the run's counters
    assert engine.calls[-1] == [cut, cut] and producer.truncated_prompts == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.getMessage().startswith("cut")]
    assert warnings == [f"cut 1 prompt(s) longer than max_prompt_tokens={limit} to their last {limit} tokens "
                        "(model.prompt_truncation: left); later ones are counted in "
                        "train/data/truncated_long_prompts and not logged again"]
    assert producer.state_dict()["truncated_prompts"] == 2


def test_drop_leaves_a_long_prompt_out_and_counts_it(tiny_model_dir):
    producer, engine, tok, short, long, _ = _long_prompt_producer(tiny_model_dir, "drop")
    rollout = producer.sample([short, long, short], n=2)
    assert engine.calls == [[_template_ids(tok, short)] * 4]
    assert len(rollout) == 4 and rollout.extras["kept_rows"] == (0, 2)
    assert rollout.extras["data/dropped_long_prompts"] == 1.0 and "data/truncated_long_prompts" not in rollout.extras
    assert (producer.truncated_prompts, producer.dropped_prompts) == (0, 1)


def test_empty_batches_after_filtering_are_no_op_steps_then_a_clear_stop(tmp_path, tiny_model_dir):
    from rllight.errors import RecipeError

    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir, max_prompt_tokens=3))
    # Every prompt is longer than 3 tokens: each step is a no-op, and after an epoch with no update the run
    # stops with a message instead of looping forever.
    with pytest.raises(RecipeError, match="epoch 0 made no update.*max_prompt_tokens=3"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 0
    assert cli.model.producer.dropped_prompts == 16  # 8 batches of 2 prompts


def test_steps_without_an_update_stop_the_run_before_the_epoch_ends(tmp_path, tiny_model_dir):
    """A run that trains nothing (every prompt dropped) stops after model.guards.max_steps_without_update RL steps in a
    row, not at the end of an epoch that may be hours away; the message says why and which option sets it."""
    from rllight.errors import RecipeError

    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir, max_prompt_tokens=3,
                                                                    guards={"max_steps_without_update": 3}),
                "--trainer.enable_checkpointing", "true")
    with pytest.raises(RecipeError, match=r"^3 RL steps in a row made no update: .*max_prompt_tokens=3.*"
                                          r"model\.guards\.max_steps_without_update.*; RL step 3 \(0 optimizer updates\) is "
                                          r"saved: resume with: "):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.model.producer.dropped_prompts == 6  # 3 batches of 2 prompts, not the epoch's 8
    with pytest.raises(ArgumentError) as err:  # declared by type (rllight.settings.Guards): the parser refuses it
        build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir,
                                                                 guards={"max_steps_without_update": 0}))
    assert one_line_parse_error(str(err.value)) == ("model.guards.max_steps_without_update must be an integer >= 1, "
                                                     "got 0 (see: rllight fit --help)")


def test_a_run_whose_prompts_are_all_too_long_warns_of_the_drops_once(tmp_path, tiny_model_dir, caplog):
    """8 batches, every prompt too long: one warning about dropped prompts (not one per batch), the count in
    the logged metric, then the one-line stop."""
    from rllight.errors import RecipeError

    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir, max_prompt_tokens=3))
    with pytest.raises(RecipeError, match="epoch 0 made no update"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    drops = [r.getMessage() for r in caplog.records
             if r.levelname == "WARNING" and r.getMessage().startswith("dropped")]
    assert drops == ["dropped 2 prompt(s) longer than max_prompt_tokens=3 (raise it to train on them); later drops "
                     "are counted in train/data/dropped_long_prompts and not logged again"]
    assert cli.model.producer.dropped_prompts == 16
    # Each of the 8 steps had an empty rollout: one warning, then counted only.
    empties = [r.getMessage() for r in caplog.records if "empty rollout after filtering" in r.getMessage()
               and r.name == "rllight.rollout.producer" and r.levelname == "WARNING"]
    assert len(empties) == 1


def _tokenizer(model_dir):
    return HFModel(model_dir).load()


class AlwaysSolved(Verifier):
    """Every response correct: with ``retire_after: 1`` every prompt drawn retires."""

    def __call__(self, response: str, answer: str) -> float:
        return 1.0


class EmptiesRollouts(RolloutCallback):
    """Leaves nothing of any rollout: a filter that drops every sample."""

    def on_rollout(self, trainer, context, rollout):
        return rollout.select([])


RETIRES_ALL = {"class_path": "rllight.data.DifficultyPools", "init_args": {"retire_after": 1}}


@pytest.mark.parametrize("case, cause", [
    # every prompt solved once, so retired: after two steps of 8 the 16 rows are retired, and no step draws again
    ("retired", r"2 RL step\(s\) drew no prompt \(data\.curriculum: no prompt of data source 'arithmetic' is left "
                r"to draw in a pool with a positive weight \(16 retired\)\)"),
    # the environment fails in reset, before the model's first turn: no model token to train on
    ("reset", r"32 episode\(s\) whose environment failed before the first turn \(first: Faulty\.reset raised "
              r"KeyError: 'no such task'\)"),
    ("callback", r"2 rollout\(s\) emptied by the rollout callback EmptiesRollouts"),
    # every group's rewards equal: dynamic sampling keeps none
    ("sampler", r"model\.sampler kept none of the 64 response\(s\) it sampled"),  # 2 steps of 2 rounds
])
def test_a_run_without_updates_ends_with_a_line_naming_what_emptied_its_steps(case, cause, tmp_path, tiny_model_dir):
    from rllight.errors import RecipeError

    model = {"guards": {"max_steps_without_update": 2, "max_failed_reward_steps": 5}}
    extra = []
    if case == "retired":
        model["reward"] = {"class_path": "test_guards.AlwaysSolved"}
        extra = ["--data.curriculum", json.dumps(RETIRES_ALL), "--data.batch_size", "8"]
    elif case == "reset":
        model["environment"] = {"class_path": "test_environments.Faulty",
                                "init_args": {"fault": "reset", "always": True}}
    elif case == "callback":
        extra = ["--trainer.callbacks+=test_guards.EmptiesRollouts"]
    else:
        model["reward"] = {"class_path": "user_strategies.ConstantReward"}
        model["sampler"] = {"class_path": "rllight.strategies.DynamicSampling", "init_args": {"group_size": 8,
                                                                                              "max_rounds": 2}}
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir, **model),
                "--trainer.max_steps", "12", *extra)
    with pytest.raises(RecipeError) as err:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    line = str(err.value)
    assert re.match(rf"2 RL steps in a row made no update: {cause}.* \(see train/guard/empty_rollouts\)", line), line
    assert "max_prompt_tokens" not in line and "\n" not in line


def test_an_epoch_without_updates_names_its_cause_not_the_prompt_filter(tmp_path, tiny_model_dir):
    """An environment that fails before its first turn on every episode of a 2-step epoch (fewer steps than the
    guards count): the epoch's end is the line, and it names the environment's failure."""
    from rllight.errors import RecipeError

    env = {"class_path": "test_environments.Faulty", "init_args": {"fault": "reset", "always": True}}
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir, environment=env),
                "--data.task.init_args.num_train", "4", "--trainer.max_steps", "10")
    with pytest.raises(RecipeError) as err:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert str(err.value) == ("epoch 0 made no update: 32 episode(s) whose environment failed before the first turn "
                              "(first: Faulty.reset raised KeyError: 'no such task'); fix that or relax the filters")


class HangsUntilReleased(Environment):
    """On rows whose answer is "bad", ``step`` blocks until ``release`` is set (as a call stuck in C, which no
    exception stops); elsewhere it answers reward 1, done."""

    release = threading.Event()

    def __init__(self):
        super().__init__(max_turns=1, max_total_tokens=200, timeout_seconds=0.2, max_concurrency=4)
        self.bad = False

    def reset(self, row):
        self.bad = row["answer"] == "bad"

    def step(self, response_text):
        if self.bad:
            HangsUntilReleased.release.wait(120)
        return StepResult(None, 1.0, done=True, correct=True)


def _call_threads(most: int) -> int:
    """The threads running calls into ``HangsUntilReleased``, once at most ``most`` (or after 5 s)."""
    def count():
        return sum(t.name.startswith("rllight-call:") and "HangsUntilReleased" in t.name for t in threading.enumerate())

    deadline = time.monotonic() + 5
    while count() > most and time.monotonic() < deadline:
        time.sleep(0.05)
    return count()


def test_hung_environment_calls_leave_a_bounded_number_of_threads_across_batches(tiny_model_dir):
    """Each batch's two "bad" episodes hang in ``step`` past the 0.2 s limit; their threads cannot be stopped. At
    most max(3, max_concurrency=4) = 4 calls of a method are left hung across batches: after two batches there are
    four, and from then on ``step`` is not called (every episode fails at once, named) instead of leaving two more
    threads each batch. Once the hung calls return, their threads are gone and the healthy episodes play again."""
    from test_environments import BAD_ROW, ROW, ScriptedEngine, _producer

    HangsUntilReleased.release.clear()
    _, tok = _tokenizer(tiny_model_dir)
    producer, _ = _producer(ScriptedEngine([[40, tok.eos_token_id]] * 20, tok.eos_token_id), HangsUntilReleased(),
                            tiny_model_dir)
    try:
        for batch in range(10):
            rollout = producer.sample([ROW, BAD_ROW], 2, training=False)
            healthy = rollout.rewards[:2].tolist()
            assert healthy == ([1.0, 1.0] if batch < 2 else [0.0, 0.0]), batch
        assert _call_threads(4) == 4  # the four hung calls' threads, not twenty
        assert producer.hung_calls.count("step") == producer.hung_calls.count() == 4
    finally:
        HangsUntilReleased.release.set()
    assert _call_threads(0) == 0
    HangsUntilReleased.release.clear()
    rollout = producer.sample([ROW, BAD_ROW], 2, training=False)
    assert rollout.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]  # called again
    HangsUntilReleased.release.set()


def test_a_call_past_the_limit_of_hung_calls_is_named_as_not_made():
    from rllight.envs.guard import EpisodeFailed, EpisodeGuard, HungCalls

    env = HangsUntilReleased()
    hung = HungCalls(1)
    held = hung.start()
    hung.abandon(held, "step")
    guard = EpisodeGuard(env, hung)
    with pytest.raises(EpisodeFailed, match=r"^HangsUntilReleased\.step not called: 1 earlier calls of it are "
                                            r"still running past timeout_seconds=0\.2 "
                                            r"\(at most 1 are left running\)$"):
        guard.step(env.spawn(), "hi")
    assert guard.reset(env.spawn(), {"answer": "3"}) is None  # the limit is per method: reset is still called
    hung.end(held)  # the hung call returned: calls are made again
    assert hung.count() == 0 and isinstance(guard.step(env.spawn(), "hi"), StepResult)


def _one_update(tiny_model_dir, tmp_path, **micro):
    """Parameters after one RL step (one SGD update) from the same seed: the same rollout each time."""
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(
        tmp_path, tiny_model_dir, aggregation={"class_path": "rllight.strategies.TokenMean"},
        optimizer={"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0}}, **micro),
        "--trainer.max_steps", "1", "--data.batch_size", "4")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return {n: p.detach().clone() for n, p in cli.model.policy.named_parameters()}


def test_micro_batching_by_count_or_token_budget_leaves_the_update_unchanged(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    whole = _one_update(tiny_model_dir, tmp_path, batching={"micro_batch_size": 64})
    singles = _one_update(tiny_model_dir, tmp_path, batching={"micro_batch_size": 1})
    budget = _one_update(tiny_model_dir, tmp_path, batching={"micro_batch_tokens": 40})
    assert sum((whole[n] - initial[n]).abs().sum() for n in whole) > 0
    for name in whole:
        torch.testing.assert_close(singles[name], whole[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(budget[name], whole[name], rtol=1e-5, atol=1e-6)


def test_token_budget_groups_rows_by_length_and_packs_them(tiny_model_dir):
    from rllight.models import HFModel
    from rllight.module import RLModule
    from rllight.settings import Batching
    from rllight.types import Rollout

    module = RLModule(HFModel(tiny_model_dir), batching=Batching(micro_batch_tokens=20))
    b = 5
    prompt_len, resp_len = [4, 4, 2, 6, 3], [6, 2, 8, 1, 3]
    p_mask = torch.tensor([[0] * (6 - n) + [1] * n for n in prompt_len])
    r_mask = torch.tensor([[1] * n + [0] * (8 - n) for n in resp_len])
    rollout = Rollout(prompt_ids=p_mask * 7, prompt_mask=p_mask, response_ids=r_mask * 9, response_mask=r_mask,
                      sample_logprobs=torch.zeros(b, 8), truncated=torch.zeros(b, dtype=torch.bool),
                      group_ids=torch.arange(b), answers=["1"] * b, texts=[""] * b)
    rows, micro = zip(*module.scoring.micro_batches(rollout))
    # By length (prompt + response), longest first: rows 0 (10), 2 (10), 3 (7), 1 (6), 4 (6).
    # row 0 alone 10; with row 2: 2 x (4 + 8) = 24 > 20. row 2 alone; with row 3: 2 x (6 + 8) = 28 > 20.
    # rows 3, 1: 2 x (6 + 2) = 16 fits; with row 4: 3 x (6 + 3) = 27 > 20. row 4 alone.
    assert list(rows) == [[0], [2], [3, 1], [4]]
    assert [tuple(m.prompt_ids.shape) + tuple(m.response_ids.shape) for m in micro] == [
        (1, 4, 1, 6), (1, 2, 1, 8), (2, 6, 2, 2), (1, 3, 1, 3)]
    for index, m in zip(rows, micro):  # each micro-batch holds its rows, trimmed
        assert torch.equal(m.response_mask, rollout.response_mask[index][:, : m.response_mask.shape[1]])


def test_scoring_in_length_grouped_micro_batches_puts_every_row_back_in_place(tiny_model_dir):
    """The no-gradient scoring pass in micro-batches reordered by length fills each row's own log-probs:
    the same as one pass over the whole rollout."""
    from rllight.models import HFModel
    from rllight.module import RLModule
    from rllight.settings import Batching

    torch.manual_seed(0)
    whole = RLModule(HFModel(tiny_model_dir), batching=Batching(micro_batch_size=64))
    whole.configure_model()
    rows = [{"messages": [{"role": "user", "content": "What is 1 + 2?" + " 3" * k}], "answer": "3"} for k in range(6)]
    rollout = whole.producer.sample(rows, n=2)
    assert len(set(rollout.response_mask.sum(-1).tolist())) > 1  # lengths differ, so the order changes
    whole.scoring.score(rollout, need_old=True, need_values=False)
    expected = rollout.old_logprobs.clone()
    budget = RLModule(HFModel(tiny_model_dir), batching=Batching(micro_batch_tokens=60))
    budget.configure_model()
    assert len(list(budget.scoring.micro_batches(rollout))) > 2
    budget.scoring.score(rollout, need_old=True, need_values=False)
    torch.testing.assert_close(rollout.old_logprobs, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fault,reason", [("nan", "not finite"), ("positive", "positive log-probs"),
                                          ("long", "over max_new_tokens=6")])
def test_an_engine_batch_that_cannot_be_trained_on_is_dropped_then_the_run_stops(fault, reason, tmp_path,
                                                                                 tiny_model_dir, caplog):
    """What a faulty server sends (NaN or positive log-probs, a response past max_new_tokens) is checked on
    arrival: each such batch is dropped with one line, and max_failed_reward_steps of them in a row stop the run."""
    from rllight.errors import ComponentError

    engine = {"class_path": "user_strategies.FaultyLogprobEngine", "init_args": {"fault": fault, "max_new_tokens": 6}}
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir, rollout=engine))
    recorder = CaptureLogger(tmp_path)
    cli.trainer.loggers = [recorder]
    with pytest.raises(ComponentError, match=rf"^model.rollout: FaultyLogprobEngine returned 3 batches in a row that "
                                             rf"cannot be trained on \(last: .*{reason}"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 0  # nothing was trained on
    dropped = [r.getMessage() for r in caplog.records if "cannot be trained on" in r.getMessage()]
    assert len(dropped) == 2 and all(reason in m and "dropped" in m for m in dropped)
    assert [c.get("train/rollout/malformed_batches") for c in recorder.calls] == [1.0, 1.0]  # the dropped steps


def test_malformed_names_what_is_wrong_with_a_generation():
    from rllight.rollout.base import Generation, malformed

    def gen(logprobs, mask=None):
        logprobs = torch.tensor(logprobs)
        mask = torch.ones_like(logprobs, dtype=torch.long) if mask is None else torch.tensor(mask)
        return Generation(torch.ones(len(logprobs), 2, dtype=torch.long), torch.ones(len(logprobs), 2),
                          torch.ones_like(mask), mask, logprobs, torch.zeros(len(logprobs), dtype=torch.bool))

    assert malformed(gen([[-0.5, -1.0], [-2.0, 0.0]]), 2, 2) is None
    assert malformed(gen([[-0.5, float("nan")], [-2.0, 0.0]], [[1, 0], [1, 1]]), 2, 2) is None  # padding: unread
    assert "not finite" in malformed(gen([[-0.5, float("inf")], [-2.0, 0.0]]), 2, 2)
    assert "positive" in malformed(gen([[-0.5, 0.01], [-2.0, 0.0]]), 2, 2)
    assert "over max_new_tokens=1" in malformed(gen([[-0.5, -1.0], [-2.0, 0.0]]), 2, 1)
    assert "3 responses expected" in malformed(gen([[-0.5, -1.0], [-2.0, 0.0]]), 3, 2)


def test_steps_whose_updates_have_no_gradient_warn_then_end_the_run_saved(tmp_path, tiny_model_dir, caplog):
    """One reward for every response: every advantage and so every update's gradient is exactly 0, and the policy
    never moves. A warning after zero_gradient_warning_steps such RL steps in a row; after max_zero_gradient_steps the
    run ends after the step, saved, with one line naming the option and the checkpoint that resumes it."""
    from rllight.errors import RunStopped

    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(
        tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.ConstantReward"},
        guards={"zero_gradient_warning_steps": 2, "max_zero_gradient_steps": 3}),
        "--trainer.max_steps", "12", "--trainer.enable_checkpointing", "true")
    with pytest.raises(RunStopped, match=r"^3 RL steps in a row had a zero policy gradient in every update.*"
                                         r"model\.guards\.max_zero_gradient_steps.*; RL step 3 \(3 optimizer updates\) "
                                         r"is saved: "
                                         r"resume with: rllight .* --ckpt_path \S+$") as stopped:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    path = str(stopped.value).rsplit("--ckpt_path ", 1)[1]
    assert path == str(tmp_path / "checkpoints" / "stopped-step=3.ckpt")
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == 3 and state["RLDataModule"] == {"batches_trained": 3}
    warned = [r.getMessage() for r in caplog.records if "zero policy gradient" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("after update 2: 2 RL steps in a row had a zero policy gradient")


def test_the_zero_gradient_count_restarts_at_a_step_that_learned():
    from rllight.update import ZeroGradientGuard

    guard = ZeroGradientGuard(warn_after=None, stop_after=3)
    zero, some = torch.tensor(0.0), torch.tensor(0.25)
    for norms in ([zero, zero], [zero], [zero, some], [zero], [], [zero]):  # [] : a step without a policy update
        guard.note(norms, step=0)
    assert guard.in_a_row == 2  # counted again from the step that learned, the step without an update skipped


def test_zero_gradient_guard_settings_are_checked_at_parse_time(tmp_path, tiny_model_dir):
    with pytest.raises(ArgumentError) as err:
        build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(tmp_path, tiny_model_dir,
                                                                 guards={"max_zero_gradient_steps": 0}))
    assert one_line_parse_error(str(err.value)) == ("model.guards.max_zero_gradient_steps must be an integer >= 1, "
                                                     "got 0 (see: rllight fit --help)")


def test_an_update_whose_gradient_is_exactly_zero_leaves_the_weights_as_they_were(tmp_path, tiny_model_dir):
    """One reward for every response: every gradient is exactly 0. AdamW with weight decay (and momentum, after a
    step that learned) would still move the weights on a zero gradient; the update removes such a gradient, so the
    weights stay exactly as they were, while the updates still count."""
    cli = build(os.path.join(RECIPES, "grpo.yaml"), tiny_overrides(
        tmp_path, tiny_model_dir, reward={"class_path": "user_strategies.ConstantReward"}),
        "--trainer.max_steps", "4", "--model.optimizer.init_args.weight_decay", "0.1")
    module = cli.model
    cli.trainer.fit(module, datamodule=cli.datamodule)
    from safetensors.torch import load_file

    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    trained = {k: v for k, v in module.policy.state_dict().items()}
    assert cli.trainer.global_step == 4
    assert start.keys() <= trained.keys()
    changed = [k for k in start if not torch.equal(start[k], trained[k].to(start[k].dtype))]
    assert changed == []
