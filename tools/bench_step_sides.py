"""tools/bench_step.py's two sides and the config they share: the benchmark's settings, the overlay the rllight side
runs on top of its recipe (``overlay``, ``data_config``, ``task_config``), the ``rllight`` child processes and the
medians read from their logs (``run_rllight``, ``run_async``), and TRL's side: its environment (``setup_trl``), its
inputs (``trl_inputs``) and its run (``run_trl``). The tool's docstring says what each measures."""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import subprocess
import sys

import yaml

from rllight.rollout.base import SAMPLING_SETTINGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_VENV = ".venv-trl"
TORCH_PIN = "torch==2.13.0"  # first, so that TRL's dependencies find torch met (a bare one pulls a CUDA build)
ENGINES = {"hf": "rllight.rollout.HFEngine", "vllm": "rllight.rollout.vllm.VLLMEngine"}
ENGINE_ARGS = "model.rollout.init_args."
PRECISIONS = ("32-true", "bf16-mixed", "auto")

PROMPTS_PER_STEP = 4
GROUP_SIZE = 4
MAX_NEW_TOKENS = 64
TEMPERATURE = 1.0
LR = 1e-5
LEARNING = "learning.json"
CURVE_BLOCKS = 6  # --summarize prints each side's reward curve as the means of this many blocks of steps
EVAL_BATCH = 100
REASONING_GYM_TASK = "rllight.data.ReasoningGymTask"
DEFAULT_REWARD = {"class_path": "rllight.rewards.IntegerMatch"}

PHASES = {"rollout": "train/time/rollout", "reward": "train/time/reward", "score": "train/time/score",
          "update": "train/time/train"}
STEP = "train/time/step"
GENERATED_TOKENS_PER_S = "train/rollout/tokens_per_s"
STEP_TOKENS_PER_S = "train/perf/tokens_per_s"
TOKENS = "train/response/tokens"
# Per-step learning signals (--heldout) and the names TRL logs them under: the mean reward of the step's
# responses, the policy's mean per-token entropy on them (at the sampling temperature) and their mean length.
CURVE = {"reward": "train/reward/mean", "entropy": "train/policy/entropy", "length": "train/response/length_mean"}
TRL_CURVE = {"reward": "reward", "entropy": "entropy", "length": "completions/mean_length"}

# Runs ``rllight fit`` in the child and reports the child's own peak memory, also when the run fails.
RLLIGHT_CHILD = """\
import resource, sys
from rllight.app.cli import main
try:
    main()  # reads sys.argv, as the console script does (an explicit list would repeat it and draw Lightning's warning)
finally:
    print(f"bench_step: peak_rss_kb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        print(f"bench_step: peak_cuda_bytes={torch.cuda.max_memory_allocated()}", flush=True)
"""


def reasoning_gym_requirement() -> str:
    """reasoning-gym at the version installed here: its generators rebuild the same rows on TRL's side, and
    ``ReasoningGymScore`` refuses a row another version rebuilds differently."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"reasoning-gym=={version('reasoning-gym')}"
    except PackageNotFoundError:
        return "reasoning-gym>=0.1.25"


def setup_trl(python: str) -> None:
    """Create the virtual environment of ``python`` (``<venv>/bin/python``), install the CPU torch, then TRL
    and its dependencies (pip chooses their versions) and reasoning-gym (the version rllight's environment
    has, for ``--recipe recipes/reasoning-gym.yaml``), and print the installed versions."""
    venv = os.path.dirname(os.path.dirname(python))
    steps = [[sys.executable, "-m", "venv", venv],
             [python, "-m", "pip", "install", TORCH_PIN],
             [python, "-m", "pip", "install", "trl"],
             [python, "-m", "pip", "install", reasoning_gym_requirement()]]
    for cmd in steps:
        print(f"bench_step: {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd, cwd=ROOT, check=False).returncode != 0:
            raise SystemExit(f"bench_step: --setup-trl: '{' '.join(cmd)}' failed")
    report = ("import torch, transformers, trl, importlib.metadata as m; "
              "print(f'trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, '"
              "f'reasoning-gym {m.version(\"reasoning-gym\")}')")
    versions = subprocess.run([python, "-c", report], capture_output=True, text=True, check=False)
    if versions.returncode != 0:
        raise SystemExit(f"bench_step: --setup-trl: trl does not import: {versions.stderr.strip().splitlines()[-1]}")
    print(f"bench_step: {venv}: {versions.stdout.strip()}", flush=True)


def overlay(args: argparse.Namespace, name: str = "rllight", staleness: int | None = None) -> dict:
    """The benchmark's config on top of the recipe (logs in ``<out>/<name>``; with ``staleness``, rollouts from
    a worker process up to that many versions ahead)."""
    if args.model_dir is None:
        model = {"class_path": "rllight.models.SmolLM2Package"}
    else:
        model = {"class_path": "rllight.models.HFModel", "init_args": {"path": args.model_dir}}
    rollout_args = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE}
    if args.dtype is not None:
        rollout_args["dtype"] = args.dtype
    if args.fixed_length:  # as long as the longest response, also when --set changes that
        longest = [v for k, _, v in (o.partition("=") for o in args.overrides)
                   if k.strip() == "model.rollout.init_args.max_new_tokens"]
        rollout_args["min_new_tokens"] = int(longest[-1]) if longest else MAX_NEW_TOKENS
    rollout = {"class_path": ENGINES[args.engine], "init_args": rollout_args}
    if staleness is not None:
        # Set on the ProcessEngine too: there they replace the ones it keeps from the recipe's engine.
        sampling = {k: v for k, v in rollout_args.items() if k in SAMPLING_SETTINGS}
        rollout = {"class_path": "rllight.rollout.worker.ProcessEngine",
                   "init_args": {"engine": rollout, "max_staleness": staleness, **sampling}}
    return {
        "seed_everything": args.seed,
        "evaluate_before_after": False,
        "trainer": {
            "max_steps": args.steps,
            "precision": args.precision,
            "limit_val_batches": 0,
            "val_check_interval": None,
            "check_val_every_n_epoch": None,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": os.path.join(args.out, name),
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": args.out, "name": name}},
            **({"callbacks": [{"class_path": "rllight.profiling.ProfileStep",
                               "init_args": {"step": args.profile, "out": os.path.join(args.out, "profile")}}]}
               if args.profile is not None else {}),
        },
        "model": {
            "model": model,
            "rollout": rollout,
            "sampler": {"class_path": "rllight.strategies.GroupSampler", "init_args": {"group_size": GROUP_SIZE}},
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": LR}},
            "batching": {"ppo_epochs": 1, "minibatch_size": None, "micro_batch_size": PROMPTS_PER_STEP * GROUP_SIZE},
            # --heldout: the trained policy, for the evaluation of both sides' final models by the same code
            "export_dir": os.path.join(args.out, name, "final") if args.heldout and staleness is None else None,
        },
        "data": data_config(args, val_size=0),
    }


def data_config(args: argparse.Namespace, val_size: int) -> dict:
    """The data section: ``--train-prompts`` training problems in ``--seed``'s order and ``--heldout`` held-out
    ones (no training question is among them), of which ``val_size`` are evaluated."""
    return {"batch_size": PROMPTS_PER_STEP, "val_size": val_size, "val_batch_size": EVAL_BATCH, "seed": args.seed,
            "task": task_config(args)}


def task_config(args: argparse.Namespace) -> dict:
    """The embedded arithmetic task (the held-out problems drawn first from its stream), or the recipe's
    reasoning-gym task with its tasks, settings and seed, ``--train-prompts`` and ``--heldout`` rows shared
    among its tasks by weight (a training row that is also a held-out question is dropped, so an epoch may hold
    a few rows fewer: the same on both sides)."""
    if args.task is None:
        return {"class_path": "rllight.data.ArithmeticTask",
                "init_args": {"num_train": args.train_prompts, "num_val": args.heldout, "seed": 0}}
    return {"class_path": REASONING_GYM_TASK, "init_args": {**(args.task.get("init_args") or {}),
                                                            "train_size": args.train_prompts,
                                                            "val_size": args.heldout}}


def run_child(cmd: list[str], log_path: str, what: str, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` from the repository root (``env`` added to the environment) with its output in ``log_path``;
    return the output, or exit with one line (the output's last line) when it fails."""
    print(f"bench_step: {what}: running (log: {log_path})", flush=True)
    with open(log_path, "w") as log_file:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, check=False,
                              env={**os.environ, **(env or {})})
    with open(log_path) as f:
        output = f.read()
    if proc.returncode != 0:
        lines = [line for line in output.splitlines() if line.strip() and not line.startswith("bench_step:")]
        raise SystemExit(f"bench_step: {what} failed (exit {proc.returncode}): {lines[-1] if lines else '?'}; "
                         f"see {log_path}")
    return output


def versions(folder: str) -> list[str]:
    """The CSVLogger's ``version_N`` folders in ``folder``, oldest first."""
    return sorted(glob.glob(os.path.join(folder, "version_*")), key=lambda p: int(p.rsplit("_", 1)[-1]))


def run_logged(args: argparse.Namespace, name: str, cmd: list[str],
               env: dict[str, str] | None = None) -> tuple[str, str | None]:
    """Run an ``rllight`` child whose CSVLogger writes into ``<out>/<name>`` (output in ``<out>/<name>.log``);
    return its output and the log folder it created (None when it created none)."""
    before = set(versions(os.path.join(args.out, name)))
    output = run_child(cmd, os.path.join(args.out, f"{name}.log"), name, env)
    new = [v for v in versions(os.path.join(args.out, name)) if v not in before]
    return output, new[-1] if new else None


def reported(output: str, key: str) -> float | None:
    """The value of the child's last ``bench_step: key=value`` line (None when absent)."""
    values = [line.split("=", 1)[1] for line in output.splitlines() if line.startswith(f"bench_step: {key}=")]
    return float(values[-1]) if values else None


def step_rows(metrics_csv: str) -> list[dict[str, float]]:
    """One dict per RL step from the CSVLogger's file: the rows that carry ``train/time/step``."""
    with open(metrics_csv) as f:
        rows = [r for r in csv.DictReader(f) if r.get(STEP)]
    return [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in rows]


def run_rllight(args: argparse.Namespace, name: str = "rllight", staleness: int | None = None,
                env: dict[str, str] | None = None) -> dict:
    """Run the rllight side (see ``overlay``); return its per-step medians (steps 2..N) and peak memory."""
    path = os.path.join(args.out, f"{name}-overlay.yaml" if name != "rllight" else "overlay.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(overlay(args, name, staleness), f, sort_keys=False)
    cmd = [sys.executable, "-c", RLLIGHT_CHILD, "fit", "--config", args.recipe, "--config", path]
    for item in args.overrides:
        key, _, value = item.partition("=")
        key = key.strip()
        if staleness is not None and key.startswith(ENGINE_ARGS):  # the engine's settings: the worker's engine's
            if key[len(ENGINE_ARGS):] in SAMPLING_SETTINGS:
                cmd += [f"--{key}", value]
            key = ENGINE_ARGS + "engine.init_args." + key[len(ENGINE_ARGS):]
        cmd += [f"--{key}", value]
    output, logs = run_logged(args, name, cmd, env)
    if logs is None:
        raise SystemExit(f"bench_step: {name} wrote no metrics.csv under {os.path.join(args.out, name)}")
    steps = step_rows(os.path.join(logs, "metrics.csv"))
    if len(steps) < 2:
        raise SystemExit(f"bench_step: rllight logged {len(steps)} step(s); the medians need at least 2 (--steps)")
    timed = steps[1:]
    for key in (STEP, *PHASES.values(), GENERATED_TOKENS_PER_S, STEP_TOKENS_PER_S, TOKENS):
        if any(key not in r for r in timed):
            raise SystemExit(f"bench_step: {os.path.join(logs, 'metrics.csv')} lacks '{key}' on some steps")
    result = {"steps": len(timed), "step": statistics.median(r[STEP] for r in timed)}
    result.update({name: statistics.median(r[key] for r in timed) for name, key in PHASES.items()})
    result["other"] = statistics.median(r[STEP] - sum(r[k] for k in PHASES.values()) for r in timed)
    result["generated_tokens_per_s"] = statistics.median(r[GENERATED_TOKENS_PER_S] for r in timed)
    result["step_tokens_per_s"] = statistics.median(r[STEP_TOKENS_PER_S] for r in timed)
    result["tokens_per_step"] = statistics.median(r[TOKENS] for r in timed)
    result["peak_rss_kb"] = reported(output, "peak_rss_kb")
    result["peak_cuda_bytes"] = reported(output, "peak_cuda_bytes")
    result["settings"] = describe(os.path.join(logs, "config.yaml"))
    result["curve"] = {name: [r.get(key) for r in steps] for name, key in CURVE.items()}
    return result


def describe(config_yaml: str) -> str:
    """The benchmarked settings as the rllight run resolved them (its saved config.yaml, ``--set`` included)."""
    with open(config_yaml) as f:
        config = yaml.safe_load(f)
    model = config["model"]
    source = model["model"].get("init_args") or {}
    rollout = model["rollout"]
    sampling = rollout.get("init_args") or {}
    engine_dtype = sampling.get("dtype") or source.get("dtype")
    batching = model.get("batching") or {}
    if engine_dtype == "auto":  # the engine generates with the policy itself
        engine_dtype = source.get("dtype")
    return (f"{source.get('path') or 'SmolLM2-135M-Instruct'} ({source.get('dtype')}), "
            f"trainer.precision {config['trainer'].get('precision')}, "
            f"{rollout['class_path'].rsplit('.', 1)[-1]} (dtype {engine_dtype}), "
            f"{config['data']['batch_size']} prompts x {model['sampler']['init_args']['group_size']} responses, "
            f"max_new_tokens {sampling.get('max_new_tokens')}, temperature {sampling.get('temperature')}, "
            f"lr {model['optimizer']['init_args']['lr']}, ppo_epochs {batching.get('ppo_epochs')}, "
            f"minibatch_size {batching.get('minibatch_size')}, micro_batch_size {batching.get('micro_batch_size')}")


def run_async(args: argparse.Namespace) -> dict:
    """The rllight side again with asynchronous rollouts, the cores split between trainer and worker."""
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    result = run_rllight(args, "rllight-async", args.staleness, env={"OMP_NUM_THREADS": threads})
    result["threads"] = threads
    return result


def trl_inputs(args: argparse.Namespace) -> str:
    """Write what tools/trl_step.py reads into ``<out>/trl/`` and return the settings file: the model folder, the
    prompts in rllight's order (conversational format) and the config."""
    import importlib

    from rllight.data import RLDataModule
    from rllight.models import SmolLM2Package

    folder = os.path.join(args.out, "trl")
    os.makedirs(folder, exist_ok=True)
    # The batches rllight's dataloader yields for --steps steps (its data section, epoch after epoch).
    task = task_config(args)
    module, _, name = task["class_path"].rpartition(".")
    data = RLDataModule(task=getattr(importlib.import_module(module), name)(**task["init_args"]),
                        batch_size=PROMPTS_PER_STEP, seed=args.seed)
    data.setup()
    prompts = os.path.join(folder, "prompts.jsonl")
    # Each row's answer is what rllight's reward reads (a reasoning-gym row's: the key that rebuilds its entry).
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt": row["messages"], "answer": row["answer"],
                                 "data_source": row["data_source"]}) + "\n"
                     for batch in data.upcoming_batches(0, args.steps) for row in batch)
    settings = {
        "model_dir": args.model_dir or SmolLM2Package().resolve(),
        "prompts": prompts,
        "reward": args.reward,  # the recipe's model.reward, as rllight scores with it
        "output_dir": os.path.join(folder, "trainer"),
        "steps": args.steps,
        "prompts_per_step": PROMPTS_PER_STEP,
        "group_size": GROUP_SIZE,
        "max_new_tokens": MAX_NEW_TOKENS,
        "min_new_tokens": MAX_NEW_TOKENS if args.fixed_length else 0,
        "temperature": TEMPERATURE,
        "lr": LR,
        "seed": args.seed,
        "loss_type": args.trl_loss_type,
        "bf16": args.precision == "bf16-mixed",  # TRL's bf16=True: float32 weights, bfloat16 autocast
        # --heldout: where TRL saves its trained model, for the evaluation both sides share
        "final_dir": os.path.join(folder, "final") if args.heldout else None,
    }
    path = os.path.join(folder, "settings.json")
    with open(path, "w") as f:
        json.dump(settings, f, indent=2)
    return path


def run_trl(args: argparse.Namespace) -> dict:
    """Run tools/trl_step.py with TRL's python; return its median step (steps 2..N), peak RSS and versions."""
    settings = trl_inputs(args)
    cmd = [args.trl_python, os.path.join(ROOT, "tools", "trl_step.py"), settings]
    output = run_child(cmd, os.path.join(args.out, "trl.log"), "trl")
    lines = [line for line in output.splitlines() if line.startswith("trl_result=")]
    if not lines:
        raise SystemExit(f"bench_step: trl printed no trl_result= line; see {os.path.join(args.out, 'trl.log')}")
    result = json.loads(lines[-1].split("=", 1)[1])
    timed = result["step_s"][1:]
    if not timed:
        raise SystemExit(f"bench_step: trl timed {len(result['step_s'])} step(s); the medians need at least 2")
    result["steps"] = len(timed)
    result["step"] = statistics.median(timed)
    result["tokens_per_step"] = statistics.median(result["completion_tokens"][1:])
    result["step_tokens_per_s"] = statistics.median(
        tokens / seconds for tokens, seconds in zip(result["completion_tokens"][1:], timed))
    return result
