"""The papers' cluster recipes (recipes/paper/) parse, and their model, data and strategy classes construct
without loading weights or starting vLLM; each keeps the paper's shape: several updates per rollout (the
number the paper states), a step budget, FSDP, bf16 and the vLLM engine.

The Trainer itself cannot be built here as written (Lightning refuses FSDP without a GPU), so only the
trainer's hardware keys are overridden; every model and data key is the recipe's own.
"""

import glob
import importlib.util
import json
import os
import re
import sys

from types import SimpleNamespace

import pytest
import yaml

from rllight.data import ArithmeticTask, RLDataModule
from rllight.distributed import share
from rllight.evaluation import EvalSettings
from rllight.models import HFModel
from rllight.module import RLModule

from conftest import RECIPES
from helpers import build

PAPER = os.path.join(RECIPES, "paper")
PAPER_RECIPES = sorted(glob.glob(os.path.join(PAPER, "*.yaml")))

# Optimizer updates per rollout as each source states it (rollout responses / mini-batch responses).
UPDATES_PER_ROLLOUT = {
    "dapo.yaml": 16,  # arXiv:2503.14476 §4.1: "16 gradient updates for each rollout step"
    "vapo.yaml": 16,  # arXiv:2504.05118 §5.1: 512 prompts x 16 samples, mini-batch 512
    "ppo.yaml": 16,  # arXiv:2504.05118 §5.1: 8192 prompts sampled once, mini-batch 512
    "sppo.yaml": 16,  # authors' 7B script: 512 prompts, N = 1, mini-batch 32
    "vespo.yaml": 8,  # note 002 / authors' script: N = gbs / mbs = 8
    "grpo.yaml": 1,  # arXiv:2402.03300 §4.2: "a single update following each exploration stage"
}
# What each source gives for one rollout over the whole cluster: (prompts, responses per optimizer update).
PAPER_TOTALS = {
    "dapo.yaml": (512, 512),  # §4.1: 512 prompts x 16 responses, mini-batches of 512
    "vapo.yaml": (512, 512),  # §5.1 item 7
    "ppo.yaml": (8192, 512),  # VAPO §5.1: 8192 prompts sampled once, mini-batch 512
    "sppo.yaml": (512, 32),  # the authors' 7B script: global batch 512, ppo_mini_batch_size 32
    "vespo.yaml": (2048, 2048),  # the authors' script: train_batch_size 2048, 256 prompts x 8 per update
    "grpo.yaml": (16, 1024),  # arXiv:2402.03300 §4.2: 1024 responses (16 x 64) in one update
}
# How each source evaluates: (samples per problem, temperature, top-p); SPPO's samples are its note's, its
# temperature and top-p the authors' script's (val_kwargs: 0.6, verl's default top-p 1.0); VESPO's all the
# script's; DeepSeekMath reports greedy accuracy.
PAPER_EVALUATION = {
    "dapo.yaml": (32, 1.0, 0.7),  # §4.1: avg@32, temperature 1.0, top-p 0.7
    "vapo.yaml": (32, 1.0, 0.7),  # §5.1
    "ppo.yaml": (32, 1.0, 0.7),  # VAPO's §5.1, the setting this baseline is compared under
    "sppo.yaml": (16, 0.6, 1.0),  # note 004: Average@16; script: temperature 0.6, top-p 1.0
    "vespo.yaml": (4, 1.0, 0.7),  # the authors' script: 4 samples at top-p 0.7
    "grpo.yaml": (1, 0.0, 1.0),  # greedy
}
# The benchmarks each source note reports, as the validation files the recipe names (data/<name>.parquet: a
# file's name is its rows' data_source, so each is reported apart as val/<name>/...).
NOTE_BENCHMARKS = {
    "dapo.yaml": ["aime-2024"],  # note 003: AIME 2024, avg@32
    "vapo.yaml": ["aime-2024", "amc-2023", "math-500"],  # note 000: AIME 2024 (average@16), AMC 2023, MATH-500
    "sppo.yaml": ["aime-2024", "aime-2025", "amc-2023", "math-500", "minerva-math"],  # note 004's table
    "vespo.yaml": ["aime-2024", "aime-2025", "amc-2023", "math-500"],  # note 002's table
}
# Overlays of the paper recipes (recipes/paper/overlays/): the other form where a note and its sources differ.
PAPER_OVERLAYS = sorted(glob.glob(os.path.join(PAPER, "overlays", "*.yaml")))
# The one paper that makes a single update per rollout; every other recipe must split its rollout.
SINGLE_UPDATE = {"grpo.yaml"}

# Only the hardware: the recipe's own strategy (FSDP) on one CPU process.
CPU_TRAINER = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1"]

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="the paper recipes name rllight.rollout.vllm.VLLMEngine (pip install vllm)")


def raw(recipe: str) -> dict:
    with open(recipe) as f:
        return yaml.safe_load(f)


def header(recipe: str) -> str:
    lines = []
    with open(recipe) as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line)
    return "".join(lines)


def test_one_recipe_per_method():
    assert {os.path.basename(r) for r in PAPER_RECIPES} == set(UPDATES_PER_ROLLOUT) == set(PAPER_TOTALS) == set(
        PAPER_EVALUATION)


@needs_vllm
@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=os.path.basename)
def test_paper_recipe_builds_without_weights(recipe):
    vllm_loaded_before = "vllm" in sys.modules
    cli = build(recipe, *CPU_TRAINER)
    module = cli.model
    assert isinstance(module, RLModule)
    assert isinstance(cli.datamodule, RLDataModule)
    assert module.policy is None and module.tokenizer is None  # weights load in configure_model
    assert isinstance(module.source, HFModel)
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", module.source.path), module.source.path  # a hub id
    assert type(cli.trainer.strategy).__name__ == "FSDP"
    assert type(module.rollout).__name__ == "ProcessEngine"  # one engine per rank, in a worker beside it
    assert type(module.rollout.engine).__name__ == "VLLMEngine"
    assert module.rollout.engine.llm is None  # the engine starts at the first generate, not at construction
    if not vllm_loaded_before:
        assert "vllm" not in sys.modules  # constructing the engine must not import vLLM
    critic = module.critic
    if critic is not None:
        assert getattr(critic, "backbone", None) is None  # a separate critic loads with the policy
    assert cli.trainer.max_steps == raw(recipe)["trainer"]["max_steps"]


@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=os.path.basename)
def test_paper_recipe_updates_per_rollout(recipe):
    config = raw(recipe)
    model, data = config["model"], config["data"]
    sampler = model["sampler"]["init_args"]
    groups = sampler.get("target_groups") or data["batch_size"]
    rollout = groups * sampler["group_size"]
    minibatch = model["batching"]["minibatch_size"]
    assert minibatch is not None and rollout % minibatch == 0, (rollout, minibatch)
    name = os.path.basename(recipe)
    assert model["batching"].get("ppo_epochs", 1) * rollout // minibatch == UPDATES_PER_ROLLOUT[name]
    if name not in SINGLE_UPDATE:
        assert minibatch < rollout  # several updates per rollout


@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=os.path.basename)
def test_paper_recipe_per_process_shares_times_its_world_are_the_papers_totals(recipe):
    """Batch sizes are totals over the processes: on the cluster the recipe declares, each process takes its
    share (as the trainer computes it), and the shares add up to the paper's numbers, not world x them."""
    config = raw(recipe)
    trainer = config["trainer"]
    world = trainer["devices"] * trainer["num_nodes"]
    data = RLDataModule(task=ArithmeticTask(num_train=4 * config["data"]["batch_size"], num_val=0),
                        batch_size=config["data"]["batch_size"])
    data.trainer = SimpleNamespace(global_rank=world - 1, world_size=world)
    data.setup("fit")
    prompts = data.local_batch_size  # what each process's training loader hands it per step
    # the updater's share
    minibatch = share(config["model"]["batching"]["minibatch_size"], world, "model.batching.minibatch_size")
    assert (prompts * world, minibatch * world) == PAPER_TOTALS[os.path.basename(recipe)]
    assert len(next(iter(data.train_dataloader()))) == prompts


@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=os.path.basename)
def test_paper_recipe_evaluates_as_its_paper(recipe):
    settings = EvalSettings(**(raw(recipe)["model"].get("evaluation") or {}))
    n, temperature, top_p = PAPER_EVALUATION[os.path.basename(recipe)]
    assert (settings.n, settings.temperature, settings.top_p) == (n, temperature, top_p)
    assert settings.ks == sorted({1, n})  # avg@n and pass@n are reported, and the per-sample accuracy


@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=os.path.basename)
def test_paper_recipe_is_for_a_cluster(recipe):
    config = raw(recipe)
    trainer, model = config["trainer"], config["model"]
    assert isinstance(trainer["max_steps"], int) and trainer["max_steps"] > 0
    assert trainer["strategy"]["class_path"] == "rllight.fsdp.FSDP"
    assert trainer["precision"] == "bf16-mixed"
    assert model["rollout"]["class_path"] == "rllight.rollout.worker.ProcessEngine"
    assert model["rollout"]["init_args"]["engine"]["class_path"] == "rllight.rollout.vllm.VLLMEngine"
    assert model["model"]["class_path"] == "rllight.models.HFModel"
    assert model["lr_scheduler"]["class_path"] == "rllight.schedules.WarmupSchedule"
    assert model["optimizer"]["init_args"]["lr"] > 0
    assert model["grad_clip"]["policy"] is not None


@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=os.path.basename)
def test_paper_recipe_header_cites_its_sources_and_its_choices(recipe):
    text = header(recipe)
    assert re.search(r"arXiv:\d{4}\.\d{4,5}", text), "the header names the paper"
    assert "§" in text or "note" in text, "the header says where its values come from"
    assert "Chosen here" in text, "the header says which values the sources do not give"


@pytest.mark.parametrize("name", sorted(NOTE_BENCHMARKS))
def test_paper_recipe_validates_on_every_benchmark_its_note_reports(name):
    recipe = os.path.join(PAPER, name)
    val_files = raw(recipe)["data"]["val_files"]
    assert [os.path.splitext(os.path.basename(f))[0] for f in val_files] == NOTE_BENCHMARKS[name]
    assert all(f.startswith("data/") for f in val_files)
    text = header(recipe)
    missing = [f for f in val_files if f not in text]
    assert not missing, f"the header does not list the files the user points at: {missing}"


@pytest.mark.parametrize("overlay", PAPER_OVERLAYS, ids=os.path.basename)
def test_paper_overlay_names_its_paper_base_and_how_to_run_it(overlay):
    with open(overlay) as f:
        first = f.readline()
    assert re.fullmatch(r"# base: recipes/paper/\w+\.yaml\n", first), first
    base = first.split()[-1]
    assert os.path.isfile(os.path.join(os.path.dirname(RECIPES), base))
    text = header(overlay)
    assert f"rllight fit --config {base} --config {os.path.relpath(overlay, os.path.dirname(RECIPES))}" in text


def test_vapo_overlay_evaluates_as_note_000_reports():
    # The paper's avg@32 in the recipe, note 000's average@16 in the overlay; the sampling the note does not give
    # stays the paper's.
    overlay = os.path.join(PAPER, "overlays", "vapo-note-average-at-16.yaml")
    base = raw(os.path.join(PAPER, "vapo.yaml"))["model"]["evaluation"]
    settings = EvalSettings(**{**base, **raw(overlay)["model"]["evaluation"]})
    assert (settings.n, settings.temperature, settings.top_p, settings.ks) == (16, 1.0, 0.7, [1, 16])
    assert "average@16" in header(os.path.join(PAPER, "vapo.yaml")) and "avg@32" in header(overlay)


# Samples of the benchmarks' reference answers as their files write them (tests/assets/benchmarks/<data_source>.jsonl):
# MATH-500's first 21 (PRM800K's 500-problem test split), AMC 23's first 20, Minerva Math's first 5. AIME's answers are
# integers from 0 to 999 by the contest's rules, DAPO-Math-17K's integers by its construction (arXiv:2503.14476 §3).
BENCHMARK_SAMPLES = os.path.join(os.path.dirname(RECIPES), "tests", "assets", "benchmarks")
INTEGER_SOURCES = {"aime-2024", "aime-2025", "dapo-math-17k", "dapo-math-17k_dedup"}
# The MATH test set (DeepSeekMath's validation) holds MATH-500; DeepSeekMath's RL data is GSM8K's integers and
# MATH's training answers, of MATH-500's forms.
SAMPLE_OF = {"math-test": ["math-500"], "deepseekmath-rl-gsm8k-math": ["math-500", "aime-2024"]}


def _reward_of(recipe: str):
    """The recipe's ``model.reward``, constructed on its own."""
    from jsonargparse import ArgumentParser

    from rllight.rewards import Reward

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--reward", type=Reward)
    return parser.instantiate_classes(parser.parse_object({"reward": raw(recipe)["model"]["reward"]})).reward


def _answers(source: str) -> list[str]:
    if source in SAMPLE_OF:
        return [a for sample in SAMPLE_OF[source] for a in _answers(sample)]
    if source in INTEGER_SOURCES:
        return ["0", "7", "33", "204", "999"]
    path = os.path.join(BENCHMARK_SAMPLES, f"{source}.jsonl")
    assert os.path.exists(path), f"no sample of {source}'s answers in tests/assets/benchmarks/"
    with open(path) as f:
        return [json.loads(line)["answer"] for line in f]


def _sample_rows(source: str) -> list[dict]:
    answers = _answers(source)
    return [{"prompt": f"{source} {i}", "answer": a, "data_source": source, "source": f"{source} row {i + 1}"}
            for i, a in enumerate(answers)]


@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=os.path.basename)
def test_paper_recipe_reward_matches_every_benchmarks_reference_answers(recipe):
    """Every file a paper recipe trains or validates on: the recipe's reward gives each sampled reference answer,
    written as the model would (``\\boxed{...}``), its full reward, and a wrong one less (the reward pre-flight's
    check, on every sampled row): setup checks every answer of these files, so a recipe whose reward cannot read
    one of them stops at start."""
    from rllight.rewards.base import check_answers
    from rllight.rewards.preflight import check_part

    settings = raw(recipe)["data"]
    sources = [os.path.splitext(os.path.basename(f))[0] for f in settings["train_files"] + settings["val_files"]]
    reward = _reward_of(recipe)
    for source in sources:
        rows = _sample_rows(source)
        for part, index in reward.split(rows):
            picked = [rows[i] for i in index]
            check_answers(part, picked)
            check_part(part, picked, k=len(picked), field="answer")
