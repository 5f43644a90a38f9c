"""Every bad setting of a judge, a reward model or a teacher, and of the placement each runs in, is one line on
stderr naming its full key and what to give instead (exit code 2), wherever the class sits in the recipe: a reward
inside ``rllight.rewards.Weighted``'s ``rewards`` dict, a placement inside a reward, a teacher in
``trainer.callbacks``. The parser's refusals (``rllight.app.command_line.one_line_parse_error``) and a constructor's
own ``RecipeError`` (``rllight.app.command_line.relocate``) alike."""

import os

import pytest
import yaml

from conftest import RECIPES
from rllight.app.cli import main

JUDGE = os.path.join(RECIPES, "judge-quickstart.yaml")
RM = os.path.join(RECIPES, "reward-model-quickstart.yaml")
DISTILL = os.path.join(RECIPES, "distill-quickstart.yaml")
SMOKE = os.path.join(RECIPES, "overlays", "smoke.yaml")
HELP = " (see: rllight fit --help)"
J = "model.reward.init_args.rewards.judge.init_args"
R = "model.reward.init_args.rewards.rm.init_args"
T = "trainer.callbacks: TeacherLogprobs"


def _nested(key: str, value) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _endpoint(**init_args) -> dict:
    return {"class_path": "rllight.serving.Endpoint", "init_args": {"url": "http://127.0.0.1:9", **init_args}}


def _teacher(**init_args) -> dict:
    model = {"class_path": "rllight.models.HFModel", "init_args": {"path": "runs/quickstart/model"}}
    return {"trainer": {"callbacks": [{"class_path": "rllight.callbacks.TeacherLogprobs",
                                       "init_args": {"model": model, **init_args}}]}}


def _line(capsys, tmp_path, recipe: str, overlay: dict | None = None, *args: str) -> str:
    """The one error line (without ``rllight: error: ``) of a fit of ``recipe`` under the smoke overlay and
    ``overlay``; it must exit with code 2 and print nothing else but the seed."""
    argv = ["fit", "--config", recipe, "--config", SMOKE, "--trainer.default_root_dir", str(tmp_path)]
    if overlay is not None:
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(overlay))
        argv += ["--config", str(tmp_path / "bad.yaml")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv + list(args))
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert len(err) == 1 and err[0].startswith("rllight: error: "), err
    return err[0][len("rllight: error: "):]


@pytest.mark.parametrize("recipe, overlay, args, expected", [
    # a judge in Weighted's rewards: the parser's refusals name the dict's entry
    (JUDGE, _nested(J, {"scale": -3}), (), f"{J}.scale must be a finite number > 0, got -3{HELP}"),
    (JUDGE, None, (f"--{J}.verdict", "maybe"), f"{J}.verdict must be one of number, label, yes_logprob, got 'maybe'"
                                                f"{HELP}"),
    (JUDGE, _nested(J, {"labels": ["yes"]}), (), f"{J}.labels expects a dict[str, float], got ['yes']{HELP}"),
    (JUDGE, _nested(J, {"placement": "foo"}), (),
     f"{J}.placement expects a Placement (class_path and init_args, or a class path), got 'foo'{HELP}"),
    (JUDGE, _nested(J, {"placement": _endpoint(timeout_seconds=-1)}), (),
     f"{J}.placement.init_args.timeout_seconds must be a finite number > 0, got -1{HELP}"),
    (JUDGE, None, (f"--{J}.placement.init_args.timeout_seconds", "5"),  # the recipe's judge is InProcess
     f"{J}.placement.init_args.timeout_seconds: InProcess has no option 'timeout_seconds'{HELP}"),
    (JUDGE, _nested("model.reward.init_args.rewards.judge", {"class_path": "rllight.serving.Endpoint",
                                                               "init_args": {"url": "http://127.0.0.1:9"}}), (),
     f"model.reward.init_args.rewards.judge: rllight.serving.Endpoint is not a subclass of Reward; give the "
     f"class_path of one{HELP}"),
    # a reward model in Weighted's rewards, and its placement
    (RM, _nested(R, {"batch_size": "abc"}), (), f"{R}.batch_size must be an integer >= 1, got abc{HELP}"),
    (RM, _nested(R, {"placement": {"class_path": "rllight.serving.Endpoint"}}), (),
     f"{R}.placement.init_args.url is required: Endpoint has no default for it; give one{HELP}"),
    # a teacher in trainer.callbacks, its model and its placement
    (DISTILL, _teacher(micro_batch_size=-16), (), f"{T}.micro_batch_size must be an integer >= 1, got -16{HELP}"),
    (DISTILL, _teacher(model="foo"), (),
     f"{T}.model expects a HFModel (class_path and init_args, or a class path), got 'foo'{HELP}"),
    (DISTILL, _teacher(placement=_endpoint(retries=-2)), (),
     f"{T}.placement.init_args.retries must be an integer >= 0, got -2{HELP}"),
])
def test_a_refused_setting_is_one_line_naming_its_full_key_and_what_to_give(capsys, tmp_path, recipe, overlay, args,
                                                                           expected):
    assert _line(capsys, tmp_path, recipe, overlay, *args) == expected


@pytest.mark.parametrize("recipe, key, overlay, owner", [
    (JUDGE, J, _nested(J, {"bogus": 1}), "LLMJudge"),
    (RM, R, _nested(R, {"placement": {"class_path": "rllight.serving.Worker", "init_args": {"bogus": 1}}}),
     "Worker"),
    (DISTILL, T, _teacher(bogus=1), "TeacherLogprobs"),
    (DISTILL, f"{T}.model.init_args", _teacher(model={"class_path": "rllight.models.HFModel",
                                                      "init_args": {"path": "x", "bogus": 1}}), "HFModel"),
])
def test_an_unknown_option_names_its_key_and_the_options_there_are(capsys, tmp_path, recipe, key, overlay, owner):
    line = _line(capsys, tmp_path, recipe, overlay)
    option_key = f"{key}.placement.init_args.bogus" if owner == "Worker" else f"{key}.bogus"
    assert line.startswith(f"{option_key}: {owner} has no option 'bogus'; it takes "), line
    assert "NoneType" not in line


@pytest.mark.parametrize("recipe, overlay, key", [
    # refused by the class's constructor, which names its key from where the class sits at the top of model.reward
    (JUDGE, _nested(J, {"verdict": "yes_logprob", "mode": "group"}), f"{J}.verdict"),
    (JUDGE, _nested(J, {"placement": _endpoint(url="localhost:8000")}), f"{J}.placement.init_args.url"),
    (RM, _nested(R, {"normalize": "zz"}), f"{R}.normalize"),
    (RM, _nested(R, {"placement": _endpoint(url="nope")}), f"{R}.placement.init_args.url"),
    (DISTILL, _teacher(placement=_endpoint(url="nope")), f"{T}.placement.init_args.url"),
])
def test_a_constructors_refusal_names_where_the_class_sits(capsys, tmp_path, recipe, overlay, key):
    line = _line(capsys, tmp_path, recipe, overlay)
    assert line.startswith(f"{key} ") or line.startswith(f"{key}:"), line


def _two_judges(first: dict, second: dict) -> dict:
    judge = {"class_path": "rllight.rewards.LLMJudge"}
    return {"model": {"reward": {"class_path": "rllight.rewards.Weighted", "init_args": {
        "rewards": {"first": {**judge, "init_args": first}, "second": {**judge, "init_args": second}},
        "weights": {"first": 1.0, "second": 1.0}}}}}


def test_of_two_judges_the_one_with_the_bad_setting_is_named(capsys, tmp_path):
    base = os.path.join(RECIPES, "quickstart.yaml")
    parsed = _line(capsys, tmp_path, base, _two_judges({"model": "a"}, {"model": "b", "scale": 0}))
    assert parsed.startswith("model.reward.init_args.rewards.second.init_args.scale must be"), parsed
    built = _line(capsys, tmp_path, base, _two_judges({"model": "a"}, {"model": "b", "verdict": "yes_logprob",
                                                                        "mode": "group"}))
    assert built.startswith("model.reward.init_args.rewards.second.init_args.verdict"), built


def test_a_judge_model_folder_that_does_not_exist_names_the_judge_inside_weighted(capsys, tmp_path):
    """Refused when the run starts (not by the constructor): the key still says where the judge sits. (``--smoke
    false``: the overlay's tiny policy, but the recipe's judge folder, which smoke mode would replace.)"""
    line = _line(capsys, tmp_path, JUDGE, None, f"--{J}.model", str(tmp_path / "no-such-judge"), "--smoke", "false")
    assert line.startswith(f"{J}.model: "), line


# ------------------------------------------------------------------------------ a key where its NAME goes
KEY = "sk-proj-AbCdEf0123456789xyzXYZ"


@pytest.mark.parametrize("how", ["file", "option", "option="])
def test_a_key_pasted_where_its_variables_name_goes_is_refused_before_print_config_shows_it(how, tmp_path, capsys):
    key = f"{J}.placement.init_args.api_key_env"
    if how == "file":
        overlay = tmp_path / "key.yaml"
        overlay.write_text(yaml.safe_dump(_nested(f"{J}.placement", _endpoint(api_key_env=KEY))))
        args = ["--config", str(overlay)]
    else:
        args = [f"--{key}={KEY}"] if how == "option=" else [f"--{key}", KEY]
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", JUDGE, *args, "--print_config"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert err.strip().endswith(f"{key} looks like an API key, not the NAME of the environment variable that holds "
                                "one; export the key (e.g. JUDGE_API_KEY=...) and give that name; revoke the key if "
                                "this file or command was shared"), err
    assert not any(KEY[i:i + 8] in out + err for i in range(len(KEY) - 7))  # no 8 characters of it printed
