"""Turns merge into one sample only while the template extends the context; a template that rewrites history
starts a new sample, each episode still counts once; TRL-contract classes run with tools in the model's own
format; tool calls are read as the template writes them."""

import pytest
import torch
from test_environments import Endless, ScriptedEngine, _producer
from trl_contract_fixtures import Counter

from rllight.envs.factory import FactoryEnvironment
from rllight.envs.tool_calls import parse_tool_calls
from rllight.errors import RecipeError
from rllight.rollout.episodes import EPISODE_ID, EPISODE_MAIN, Segment, Trajectory, encode_chat, episodes_to_rollout
from rllight.rollout.metrics import rollout_metrics
from rllight.strategies import GroupRelative
from rllight.strategies.advantages import episode_advantages
from rllight.testing import CHAT_TEMPLATE, HISTORY_REWRITING_TEMPLATE, TOOLS_CHAT_TEMPLATE

QUESTION = [{"role": "user", "content": "Say something."}]


def _play(tiny_model_dir, template, texts, env, row=None):
    """One episode per call of a scripted policy answering ``texts`` turn by turn, with ``template``."""
    probe = _producer(ScriptedEngine([[0]], eos=0), env, tiny_model_dir)[1]
    eos = probe.eos_token_id
    script = [probe.encode(t, add_special_tokens=False) + [eos] for t in texts]
    engine = ScriptedEngine(script, eos=eos)
    producer, tok = _producer(engine, env, tiny_model_dir)
    tok.chat_template = template
    rollout = producer.sample([row or {"messages": QUESTION, "answer": "1"}], 1)
    return rollout, engine, tok, script


# ------------------------------------------------------------------------------------------------ the merge rule
def test_a_template_that_only_grows_keeps_the_episode_in_one_sample(tiny_model_dir):
    texts = ["A", "<think>h</think>B", "C"]
    rollout, engine, _, script = _play(tiny_model_dir, CHAT_TEMPLATE, texts, Endless(max_turns=3))
    assert len(rollout) == 1 and rollout.extras[EPISODE_MAIN].tolist() == [True]
    for turn in (1, 2):  # each turn's context is the previous one, the sampled ids, then the template's text
        previous = engine.calls[turn - 1][0] + script[turn - 1]
        assert engine.calls[turn][0][: len(previous)] == previous
    model = rollout.response_ids[0][rollout.response_mask[0].bool()].tolist()
    assert model == script[0] + script[1] + script[2]  # the trained tokens are the sampled tokens


def test_a_template_that_rewrites_history_starts_a_new_sample(tiny_model_dir):
    """Turn 1 merges (nothing to rewrite); turn 2 holds reasoning the template drops once a user turn follows,
    so turn 3 starts a new sample from the whole conversation as the template renders it."""
    texts = ["A", "<think>h</think>B", "C"]
    rollout, engine, tok, script = _play(tiny_model_dir, HISTORY_REWRITING_TEMPLATE, texts, Endless(max_turns=3))
    second = engine.calls[1][0]
    assert second[: len(engine.calls[0][0]) + len(script[0])] == engine.calls[0][0] + script[0]  # merged
    third = engine.calls[2][0]
    assert third[: len(second) + len(script[1])] != second + script[1]  # the history was rewritten
    conversation = [*QUESTION, {"role": "assistant", "content": "A"}, {"role": "user", "content": "go on"},
                    {"role": "assistant", "content": "<think>h</think>B"}, {"role": "user", "content": "go on"}]
    assert third == encode_chat(tok, conversation)
    assert "<think>" not in tok.decode(third)
    # Two rows: the episode's last sample (main), then its first; both trained on exactly what was sampled.
    assert len(rollout) == 2 and rollout.extras[EPISODE_MAIN].tolist() == [True, False]
    ids = rollout.extras[EPISODE_ID]
    assert ids[0] == ids[1]
    model = [rollout.response_ids[r][rollout.response_mask[r].bool()].tolist() for r in range(2)]
    assert model == [script[2], script[0] + script[1]]
    assert rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist() == third
    assert rollout.rewards.tolist() == [3.0, 3.0] and rollout.group_ids.tolist() == [0, 0]
    assert rollout.extras["episode/restarted_ratio"] == 1.0
    assert rollout.extras["episode/turns"].tolist() == [3.0, 3.0]


def _episode(prompt, turns_ids, restart_at=None):
    traj = Trajectory(prompt=list(prompt))
    for k, ids in enumerate(turns_ids):
        if k == restart_at:
            traj.restart([9, 9])
        traj.add_turn(list(ids), [-0.1] * len(ids))
    return traj


def test_an_episode_in_two_rows_counts_once_in_its_group(tiny_model_dir):
    tok = _producer(ScriptedEngine([[0]], eos=0), Endless(), tiny_model_dir)[1]
    trajs = [_episode([5], [[1, 2], [3]], restart_at=1), _episode([5], [[4]])]
    rollout = episodes_to_rollout(trajs, [1.0, 0.0], torch.tensor([0, 0]), ["1", "1"], tok)
    assert rollout.extras[EPISODE_MAIN].tolist() == [True, True, False]
    adv, returns = episode_advantages(GroupRelative(), rollout)
    # One group of two episodes, rewards 1 and 0: mean 0.5, unbiased std sqrt(0.5) -> +-0.5/0.7071 = +-0.7071.
    # Counting the extra row would give mean 2/3 and other values.
    per_row = [adv[r][rollout.response_mask[r].bool()].unique().tolist() for r in range(3)]
    assert [len(v) for v in per_row] == [1, 1, 1]  # one number over each row's response tokens
    assert [v[0] for v in per_row] == pytest.approx([0.70710, -0.70710, 0.70710], abs=1e-4)
    assert returns is None
    assert (adv[rollout.response_mask == 0] == 0).all()
    metrics = rollout_metrics(rollout)
    assert float(metrics["reward/mean"]) == pytest.approx(0.5)  # per episode, not per row (2/3)
    assert isinstance(trajs[0].earlier[0], Segment) and trajs[0].earlier[0].turns == [[1, 2]]


# ------------------------------------------------------------------------------------- TRL's environment contract
def _counter_call(a):
    return f'<tool_call>{{"name": "increment", "arguments": {{"a": {a}}}}}</tool_call>'


@pytest.mark.parametrize("target, reward", [(3, 1.0), (4, 0.0)])
def test_a_trl_contract_class_runs_its_tools_in_the_models_format(target, reward, tiny_model_dir):
    env = FactoryEnvironment("trl_contract_fixtures.Counter", max_turns=3)
    row = {"messages": QUESTION, "answer": "", "target": target}
    rollout, engine, tok, script = _play(tiny_model_dir, TOOLS_CHAT_TEMPLATE, [_counter_call(3), "Done."], env, row)
    first = tok.decode(engine.calls[0][0])
    assert '"name": "increment"' in first and '"description": "Add to the counter."' in first
    assert '"description": "How much to add."' in first  # the docstring's Args section is the tool schema
    assert f"Reach {target}." in first  # what reset returned is added to the prompt
    second = engine.calls[1][0]
    assert second[: len(engine.calls[0][0]) + len(script[0])] == engine.calls[0][0] + script[0]
    assert tok.decode(second[len(engine.calls[0][0]) + len(script[0]):]).endswith(
        "<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert rollout.rewards.tolist() == [reward] and rollout.correct.tolist() == [reward]
    assert len(rollout) == 1 and rollout.extras["episode/turns"].tolist() == [2.0]


@pytest.mark.parametrize("call, seen", [
    ('<tool_call>{"name": "increment", "arguments": {"a": -1}}</tool_call>', "error: ValueError: a must be >= 0"),
    ('<tool_call>{"name": "decrement", "arguments": {}}</tool_call>', "error: there is no tool 'decrement'"),
    ("<tool_call>{not json</tool_call>", "error: the tool call is not JSON"),
    ('<tool_call>{"name": "increment", "arguments": {"b": 1}}</tool_call>', "error: TypeError"),
])
def test_a_failing_tool_call_is_shown_to_the_model_and_the_episode_goes_on(call, seen):
    env = FactoryEnvironment("trl_contract_fixtures.Counter").spawn()
    env.reset({"messages": QUESTION, "target": 1})
    result = env.step(call)
    assert not result.done and result.observation[0]["role"] == "tool"
    assert result.observation[0]["content"].startswith(seen)
    assert env.step(_counter_call(1)).observation[0]["content"] == "1"
    final = env.step("Done.")
    assert final.done and final.reward == 1.0 and final.correct


def test_reset_gets_only_the_fields_it_takes_and_episodes_do_not_share_state():
    factory = FactoryEnvironment("trl_contract_fixtures.NoArgsReset")
    a, b = factory.spawn(), factory.spawn()
    assert a.reset({"messages": QUESTION, "answer": "x", "target": 9}) is None
    b.reset({"messages": QUESTION})
    a.step(_counter_call(2))
    assert a.trajectory_reward([]) == 1.0 and b.trajectory_reward([]) == 0.0
    assert [t["function"]["name"] for t in a.tools()] == ["increment"]  # reset and get_reward are not tools
    assert isinstance(a.obj, Counter) and a.obj is not b.obj


@pytest.mark.parametrize("kwargs, message", [
    ({"factory": "trl_contract_fixtures.NoReward"}, "reward_method: trl_contract_fixtures.NoReward has no method"),
    ({"factory": "trl_contract_fixtures.Missing"}, "init_args.factory: cannot import 'trl_contract_fixtures.Missing'"),
    ({"factory": "nope"}, "init_args.factory must be an import path"),
])
def test_a_wrong_factory_is_one_line_naming_the_key(kwargs, message):
    with pytest.raises(RecipeError) as err:
        FactoryEnvironment(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


# -------------------------------------------------------------------------------------------------- tool calls
def test_tool_calls_are_read_in_the_hermes_format():
    text = ('Let me add. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call><tool_call>[1]</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls[:2]] == [("a", {"x": 1}, None), ("b", {"y": 2}, None)]
    assert calls[2].error.startswith("a tool call is")
    assert parse_tool_calls("no call here") == []
    assert calls[0].message() == {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}}


# ------------------------------------------------------------------------------------------------ end to end
FORGETFUL_TEMPLATE = (
    "{%- set ns = namespace(last=-1) %}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for message in messages %}"
    "{%- set content = '' if message['role'] == 'assistant' and loop.index0 < ns.last else message['content'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Drops the content of every assistant turn before the last user turn: every turn after the first restarts."""


def test_a_run_whose_template_forgets_trains_on_every_sample_of_each_episode(tmp_path, tiny_model_dir):
    """GRPO on two-turn episodes with a template that rewrites history: an episode is two rows, the update
    changes every parameter."""
    import shutil

    from conftest import RECIPES
    from helpers import build, fit_recording_rollouts, tiny_overrides, unchanged_parameters
    from transformers import AutoTokenizer

    model_dir = str(tmp_path / "forgetful")
    shutil.copytree(tiny_model_dir, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = FORGETFUL_TEMPLATE
    tok.save_pretrained(model_dir)
    env = {"class_path": "test_environments.DigitFeedback", "init_args": {"max_turns": 2}}
    cli = build(f"{RECIPES}/env-arithmetic-feedback.yaml", tiny_overrides(tmp_path, model_dir, environment=env),
                "--trainer.max_steps", "2", "--model.batching.minibatch_size", "null")
    seen = fit_recording_rollouts(cli)
    assert len(seen) == 2
    for rollout in seen:
        episodes, restarted = int(rollout.extras[EPISODE_MAIN].sum()), rollout.extras["episode/restarted_ratio"]
        # An episode restarts unless its first turn was empty (nothing to forget): then it is one row.
        assert restarted >= 0.5 and len(rollout) == episodes + round(restarted * episodes)
    assert float(cli.trainer.callback_metrics["train/episode/restarted_ratio"]) >= 0.5
    assert unchanged_parameters(cli.model.policy, model_dir) == []


def test_tools_the_template_does_not_render_are_one_line(tiny_model_dir):
    env = FactoryEnvironment("trl_contract_fixtures.Counter")
    with pytest.raises(RecipeError) as err:
        _play(tiny_model_dir, CHAT_TEMPLATE, ["Done."], env, {"messages": QUESTION, "answer": "", "target": 1})
    assert "FactoryEnvironment offers tools, but the model's chat template does not render them" in str(err.value)
    assert "chat_template" in str(err.value) and "\n" not in str(err.value)


def test_a_recipe_chat_template_is_a_jinja_file_or_text(tmp_path):
    from rllight.models import HFModel, read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(TOOLS_CHAT_TEMPLATE)
    assert HFModel("x", chat_template=str(path)).chat_template == TOOLS_CHAT_TEMPLATE
    assert read_chat_template(CHAT_TEMPLATE) == CHAT_TEMPLATE
    for bad, message in ((str(tmp_path / "missing.jinja"), "cannot read"), ("chatml", "neither a .jinja file")):
        with pytest.raises(RecipeError, match=f"model.model.init_args.chat_template: .*{message}"):
            HFModel("x", chat_template=bad)


def test_the_shipped_tools_template_renders_tools_and_keeps_the_conversation_growing(tiny_model_dir):
    from transformers import AutoTokenizer

    from conftest import RECIPES
    from rllight.models import read_chat_template
    from rllight.rollout.episodes import ChatTurns

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = read_chat_template(f"{RECIPES}/templates/chatml-tools.jinja")
    env = FactoryEnvironment("trl_contract_fixtures.Counter").spawn()
    env.reset({"target": 1})
    conversation = [*QUESTION, {"role": "assistant", "content": _counter_call(1)}]
    observations = env.step(_counter_call(1)).observation
    ids = ChatTurns(tok).extend(conversation[:1], conversation[1]["content"], tok.encode(_counter_call(1)),
                                observations, env.tools())
    assert ids is not None  # the template extends the context: the turn merges
    text = tok.apply_chat_template([*conversation, *observations], tools=env.tools(), tokenize=False,
                                   add_generation_prompt=True)
    assert '"name": "increment"' in text and "<tool_response>\n1\n</tool_response>" in text


def test_a_trl_contract_class_trains_from_a_recipe(tmp_path, tiny_model_dir):
    """``FactoryEnvironment`` by class_path in a recipe, on the tiny model with a template that renders tools:
    two GRPO steps of tool-calling episodes, every parameter changed, no episode failed."""
    from conftest import RECIPES
    from helpers import build, fit_recording_rollouts, tiny_overrides, unchanged_parameters

    template = tmp_path / "tools.jinja"  # short: the tiny model's context is 512 tokens of mostly bytes
    template.write_text(TOOLS_CHAT_TEMPLATE)
    env = {"class_path": "rllight.envs.FactoryEnvironment",
           "init_args": {"factory": "trl_contract_fixtures.NoisyCounter", "max_turns": 2, "max_total_tokens": 500}}
    model = {"class_path": "rllight.models.HFModel", "init_args": {"path": tiny_model_dir, "chat_template": str(template)}}
    cli = build(f"{RECIPES}/env-arithmetic-feedback.yaml",
                tiny_overrides(tmp_path, tiny_model_dir, environment=env, model=model),
                "--trainer.max_steps", "2", "--model.batching.minibatch_size", "null",
                "--model.max_prompt_tokens", "480")
    seen = fit_recording_rollouts(cli)
    assert float(cli.trainer.callback_metrics["train/episode/failures"]) == 0.0
    assert len(seen) == 2 and all(len(r) == 16 for r in seen)  # 2 prompts x G = 8, one sample per episode
    prompt = cli.model.tokenizer.decode(seen[0].prompt_ids[0][seen[0].prompt_mask[0].bool()])
    assert '"name": "increment"' in prompt and "Reach " in prompt  # the tools and what reset returned
    assert unchanged_parameters(cli.model.policy, tiny_model_dir) == []
