"""Seconds per RL step of rllight, by phase, and optionally against TRL's GRPOTrainer on the same config and data.

The config (TRL's GRPOTrainer baseline): SmolLM2-135M-Instruct (or ``--model-dir``), 4 prompts x 4 responses
per step, at most 64 new tokens, temperature 1.0, lr 1e-5, one optimizer update per rollout, float32 (or
bf16-mixed on both sides with ``--precision``), the embedded arithmetic task
(``ArithmeticTask(num_train=4 * steps, num_val=0, seed=0)``) and the recipe's reward (recipes/grpo.yaml's
integer match, ``rllight.rewards.IntegerMatch``), on both sides. A recipe whose ``data.task`` is
``rllight.data.ReasoningGymTask`` (``--recipe recipes/reasoning-gym.yaml``) keeps its reasoning-gym tasks
instead, their settings and seed, with ``--train-prompts`` training rows and ``--heldout`` held-out ones shared
among the tasks by weight; see "reasoning-gym" below.

rllight side: ``rllight fit --config <recipe> --config <overlay>`` runs in a child process (cwd = the
repository root). The overlay, written to ``<out>/overlay.yaml``, sets the config above on top of
``--recipe`` (default recipes/grpo.yaml: its GRPO, no KL, clip 0.2, seq-mean-token-mean), with
``ppo_epochs: 1`` and ``minibatch_size: null`` (one update per rollout, so ``trainer.max_steps`` = ``--steps``
rollouts), ``micro_batch_size: 16``, ``trainer.precision`` from ``--precision`` (the engine's ``dtype: auto`` follows
it: a bfloat16 copy of the policy generates under ``bf16-mixed``), no validation, no checkpoints, no export and a
CSVLogger in ``<out>``;
``--set KEY=VALUE`` adds CLI overrides after it (to the rllight side only). Per-step numbers come from the
logger's metrics.csv: ``train/time/step`` (the whole RL step) and its phases ``train/time/rollout``
(generation), ``train/time/reward`` (scoring the responses), ``train/time/score`` (log-probs, values and
advantages before the update) and ``train/time/train`` (the optimizer update); "other" is what the step
spends outside them (rollout metrics and callbacks). Generated tokens/s is ``train/rollout/tokens_per_s``
(generated tokens / wall time of generation); step tokens/s is ``train/perf/tokens_per_s`` (generated
tokens / step time). Every number is the median over steps 2..N: the first step (warm-up) is left out.
Peak memory is the peak RSS of the training process (``ru_maxrss``; rllight's vLLM engine runs inside it,
the reward worker processes do not) and, when it used CUDA, torch's peak allocated GPU memory.

TRL side (``--trl``): tools/trl_step.py runs with the python of TRL's own virtual environment
(``--trl-python``; ``--setup-trl`` creates it: the CPU torch, then TRL with the newest transformers it
accepts, which may lie outside rllight's ``transformers<5.20``, so TRL's dependencies never change rllight's).
It gets, in ``<out>/trl/``, the plain Hugging Face model folder, the same prompts as a JSONL in TRL's
conversational format, in the order rllight's dataloader draws them (TRL's shuffling off), so that step k of
both sees the same 4 prompts, and the settings; see tools/trl_step.py for how GRPOConfig matches rllight's
GRPO and where it differs. ``--precision bf16-mixed`` runs both sides in bfloat16 mixed precision: rllight's
``trainer.precision: bf16-mixed`` and TRL's ``bf16=True`` (float32 weights, ``torch.autocast`` in bfloat16);
``--precision 32-true`` (the default) both in float32; ``auto`` is what ``trainer.precision: auto`` chooses on this
machine (``rllight.precision``). Each run prints ``rllight_over_trl`` for its precision: one run per precision.
TRL's step is timed from ``on_step_begin`` to
``on_step_end`` of a TrainerCallback: it includes generation (TRL generates in ``_prepare_inputs`` of
``training_step``), reward, loss and the optimizer update. Its peak RSS is that of its process. The two sides
sample independently, so their responses, and the tokens each step generates, differ: the comparison table
prints tokens per step and step tokens/s (generated tokens / step time) of both next to the seconds.

Asynchronous rollouts (``--async K``): the rllight side runs twice on the same config, data and seed. First
synchronously, the engine in the training process with every core (the default set-up). Then with
``rllight.rollout.worker.ProcessEngine(max_staleness=K)``: the engine in a worker process that generates the
next ``K`` steps' rollouts (one update per step here) while the trainer updates, the cores split between them
(``OMP_NUM_THREADS`` = half the cores each; the worker takes the trainer's thread count; on CUDA both share the
device); ``--set model.rollout.init_args.X=V`` then sets the worker's engine's X. The per-step time of the
asynchronous run is what the trainer waits: for its rollout (often already generated), its scoring and its
update. It prints both and ends with

    async_over_sync=<synchronous median s/step / asynchronous median s/step>

(training steps per second, asynchronous over synchronous). The two runs train on different samples (the
asynchronous one on responses up to K versions old), so their tokens per step differ and are printed too.

Learning per step (``--heldout N``): besides the timing, each side's per-step mean reward, policy entropy and
response length, and the greedy accuracy on N held-out problems (drawn first from the task's stream, so no
training question is among them) of the starting model and of each side's final model (rllight's exported
with ``model.export_dir``, TRL's saved by trl_step.py), all evaluated by the same code: ``rllight validate`` on
the model folder, one greedy response of at most 64 tokens per problem. The gain's standard error is paired
over the problems. ``--train-prompts`` fewer than 4 x ``--steps`` makes later epochs repeat them, each epoch in
its own ``--seed``-ed order, the same on both sides; ``--seed`` also seeds both sides' sampling. The numbers go
to ``<out>/learning.json``; ``--summarize OUT...`` prints several runs (e.g. seeds) and the mean of each side
and loss over them. The comparison in the README:

    for seed in 0 1 2; do .venv/bin/python tools/bench_step.py --trl --trl-loss-type dapo --steps 36 \
        --train-prompts 64 --heldout 200 --seed $seed --set model.micro_batch_tokens=400 --out runs/learn/s$seed; done
    .venv/bin/python tools/bench_step.py --summarize runs/learn/s0 runs/learn/s1 runs/learn/s2

reasoning-gym (``--recipe recipes/reasoning-gym.yaml``): the recipe's mix (chain_sum, basic_arithmetic,
leg_counting, gsm_symbolic) on both sides. TRL's prompt file carries each row's reasoning-gym key as its
answer (task, generator settings, seed, size, index and expected answer: what rebuilds the row's entry) and
its task as ``data_source``, and TRL's reward function is the recipe's ``model.reward``,
``rllight.rewards.ReasoningGymScore``: the task's own ``score_answer`` on the final answer that rllight
extracts (``rllight.rewards.reasoning_gym.final_answer``), the code rllight's reward workers run (it needs only
the standard library and reasoning-gym, which ``--setup-trl`` installs in TRL's environment at the version
rllight's has, so that both rebuild the same entries). rllight's reward pre-flight boxes the answer a row's key
stands for (``ReasoningGymScore.reference_answer``); TRL has no such check. The held-out evaluation scores
with the same reward and reports the accuracy on each task's problems too (``start_by_task`` and each side's
``accuracy_by_task`` in learning.json; ``--summarize`` prints the mean per task). The overlay replaces the
recipe's sampling (4 x 4 responses of at most 64 tokens at temperature 1.0, lr 1e-5, one update per rollout),
so that only its tasks, reward and loss aggregation remain: its token-level mean (``TokenMean``) is TRL's
``--trl-loss-type dapo``; its clip-higher (0.28) never acts with one update per rollout (the ratio is 1), nor
does TRL's clip. Three seeds each side (the README has the result); a seed took 38 minutes alone on 2 cores of an Intel Xeon with AVX-512 BF16
(36 steps of 20 s for rllight and 36 s for TRL, both in float32, and three evaluations of 200 problems of about 1.5
minutes each):

    for seed in 0 1 2; do .venv/bin/python tools/bench_step.py --recipe recipes/reasoning-gym.yaml --trl \
        --trl-loss-type dapo --steps 36 --train-prompts 144 --heldout 200 --seed $seed --out runs/learn-rg/s$seed; done
    .venv/bin/python tools/bench_step.py --summarize runs/learn-rg/s0 runs/learn-rg/s1 runs/learn-rg/s2

The last line is ``rllight_step_s=<rllight median s/step>`` or, with ``--trl``,

    rllight_over_trl=<TRL median s/step / rllight median s/step>

(2.0: an rllight step takes half the time of a TRL step).

``--record PATH`` also writes what the run printed as a record for docs/results/ (``rllight.records``): one row per
side (rllight; its asynchronous run with ``--async``; TRL with ``--trl``), the medians and peak memory as printed,
the held-out accuracies with ``--heldout``, the ratio of the last line on its side's row; id ``bench-step``
("Speed and memory"), ``bench-step-async`` ("Asynchronous and stale rollouts") or ``bench-step-trl`` ("Against
TRL"). With ``--summarize``, the learning table's rows (id ``bench-step-learning``, "Against TRL"), the mean gain of
each side and loss over the runs in the summary.

Usage:
    .venv/bin/python tools/bench_step.py [--steps 6] [--engine hf|vllm] [--dtype bfloat16] [--out runs/bench_step]
    .venv/bin/python tools/bench_step.py --setup-trl        # once: TRL's environment in .venv-trl
    .venv/bin/python tools/bench_step.py --trl [--steps 6] [--precision bf16-mixed]
    .venv/bin/python tools/bench_step.py --recipe recipes/reasoning-gym.yaml --trl --trl-loss-type dapo \
        --heldout 200 [--steps 36]   # reasoning-gym's tasks, held-out accuracy per task on both sides
    .venv/bin/python tools/bench_step.py --profile 2      # where step 2's time goes: <out>/profile/profile.md
    .venv/bin/python tools/bench_step.py --async 1 [--steps 8]   # async_over_sync
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import yaml

from rllight.records import add_record_options, check_record_options, parse_pairs, printed, tool_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_VENV = ".venv-trl"
TORCH_PIN = "torch==2.13.0"  # first, so that TRL's dependencies find torch met (a bare one pulls a CUDA build)
ENGINES = {"hf": "rllight.rollout.HFEngine", "vllm": "rllight.rollout.vllm.VLLMEngine"}
ENGINE_ARGS = "model.rollout.init_args."
PRECISIONS = ("32-true", "bf16-mixed", "auto")
# Set on a ProcessEngine too: there they replace the ones it keeps from the recipe's engine.
SAMPLING_SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k")

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
from rllight.cli import main
try:
    main()  # reads sys.argv, as the console script does (an explicit list would repeat it and draw Lightning's warning)
finally:
    print(f"bench_step: peak_rss_kb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        print(f"bench_step: peak_cuda_bytes={torch.cuda.max_memory_allocated()}", flush=True)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/grpo.yaml", help="Base recipe of the rllight side.")
    p.add_argument("--steps", type=int, default=6, help="RL steps (rollouts with one update each) per side.")
    p.add_argument("--engine", choices=list(ENGINES), default="hf", help="rllight's rollout engine.")
    p.add_argument("--dtype", help="Generate with a copy of the policy in this dtype (model.rollout.init_args.dtype, "
                                   "e.g. bfloat16); default: auto, which follows --precision (the policy itself "
                                   "in float32, a bfloat16 copy under bf16-mixed).")
    p.add_argument("--precision", choices=PRECISIONS, default="32-true",
                   help="Both sides' precision: 32-true (float32), bf16-mixed (rllight's trainer.precision, TRL's "
                        "bf16=True), or auto (what rllight's trainer.precision: auto chooses on this machine).")
    p.add_argument("--model-dir", help="A Hugging Face model folder to use instead of the quickstart model.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="Extra rllight CLI override, e.g. model.rollout.init_args.max_new_tokens=8 (repeatable; "
                        "rllight side only).")
    p.add_argument("--profile", type=int, metavar="STEP",
                   help="Also profile rollout STEP (0-based) of the rllight side with rllight.profiling.ProfileStep: "
                        "<out>/profile/profile.md lists the time of each phase and the top operators.")
    p.add_argument("--out", default="runs/bench_step", help="Folder for the overlay, logs and TRL inputs.")
    p.add_argument("--async", type=int, metavar="K", dest="staleness",
                   help="Also run the rllight side with asynchronous rollouts (a worker process, max_staleness K, "
                        "the cores split) and print async_over_sync.")
    p.add_argument("--fixed-length", action="store_true",
                   help="Every response exactly max_new_tokens long on both sides (the end tokens cannot be drawn: "
                        "the HF engine's min_new_tokens, TRL's generation_kwargs min_new_tokens), so that the two "
                        "sides time the same work.")
    p.add_argument("--seed", type=int, default=0,
                   help="Seed of both sides: sampling, initial state and the order of the training prompts.")
    p.add_argument("--train-prompts", type=int, metavar="N",
                   help="Training problems (default 4 x --steps: each drawn once); fewer are drawn again in later "
                        "epochs, each epoch in its own seeded order, the same on both sides.")
    p.add_argument("--heldout", type=int, default=0, metavar="N",
                   help="Also measure learning: N held-out problems (never trained on), each side's greedy accuracy "
                        "on them before and after training, and its reward and entropy per step "
                        "(<out>/learning.json; --summarize averages several seeds).")
    p.add_argument("--trl-loss-type", default="grpo",
                   help="TRL's GRPOConfig.loss_type (default grpo: per-response mean, as recipes/grpo.yaml; TRL's "
                        "own default is dapo, token-level).")
    p.add_argument("--summarize", nargs="+", metavar="OUT",
                   help="Only print the learning table of earlier --heldout runs (their --out folders), one row "
                        "per run and the mean over them, then exit.")
    p.add_argument("--trl", action="store_true", help="Also run TRL's GRPOTrainer on the same config and data.")
    p.add_argument("--trl-python", default=os.path.join(ROOT, TRL_VENV, "bin", "python"),
                   help="Python of TRL's virtual environment.")
    p.add_argument("--setup-trl", action="store_true",
                   help="Create TRL's virtual environment (the folder above --trl-python's bin/) and install TRL; "
                        "without --trl, only that.")
    add_record_options(p, id=None, section=None)
    args = p.parse_args(argv)
    check_record_options(p, args, argv, __file__)
    if args.summarize:
        for folder in args.summarize:
            if not os.path.isfile(os.path.join(folder, LEARNING)):
                p.error(f"--summarize '{folder}': no {LEARNING} (run bench_step with --heldout and --out there)")
        return args
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is left out of the medians)")
    if args.profile is not None and not 0 <= args.profile < args.steps:
        p.error(f"--profile must name a step in 0..{args.steps - 1} (0-based), got {args.profile}")
    recipe = args.recipe if os.path.isfile(args.recipe) else os.path.join(ROOT, args.recipe)
    if not os.path.isfile(recipe):
        p.error(f"--recipe '{args.recipe}': no such file")
    args.recipe = os.path.abspath(recipe)
    try:
        args.task, args.reward = recipe_task_and_reward(args.recipe, args.trl)
    except ValueError as err:
        p.error(f"--recipe '{args.recipe}': {err}")
    if args.model_dir is not None:
        args.model_dir = os.path.abspath(args.model_dir)
        if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
            p.error(f"--model-dir '{args.model_dir}': not a Hugging Face model folder (no config.json)")
    for item in args.overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip() or key.startswith("-"):
            p.error(f"--set expects KEY=VALUE (e.g. model.micro_batch_size=8), got '{item}'")
    if args.train_prompts is None:
        args.train_prompts = PROMPTS_PER_STEP * args.steps
    if args.train_prompts < PROMPTS_PER_STEP:
        p.error(f"--train-prompts must be >= {PROMPTS_PER_STEP} (one step's prompts), got {args.train_prompts}")
    if args.heldout < 0:
        p.error(f"--heldout must be >= 0 (held-out problems), got {args.heldout}")
    if args.staleness is not None and args.staleness < 1:
        p.error(f"--async must be >= 1 (policy versions a rollout may lag), got {args.staleness}")
    if args.fixed_length and args.engine != "hf":
        p.error("--fixed-length uses the HF engine's min_new_tokens; leave --engine at hf")
    if args.staleness is not None and args.engine != "hf":
        p.error("--async runs the Hugging Face engine in the worker; leave --engine at hf")
    if args.precision == "auto":  # resolved here, so that both sides get the same value
        from rllight.precision import resolve_precision

        args.precision, reason = resolve_precision()
        print(f"bench_step: --precision auto: {args.precision} ({reason})", flush=True)
    args.trl_python = os.path.abspath(args.trl_python)
    if args.trl and not args.setup_trl and not os.path.isfile(args.trl_python):
        p.error(f"--trl-python '{args.trl_python}': no such file; create TRL's environment with --setup-trl")
    args.out = os.path.abspath(args.out)
    return args


def recipe_task_and_reward(recipe: str, trl: bool) -> tuple[dict | None, dict]:
    """The recipe's ``data.task`` when it is ``rllight.data.ReasoningGymTask`` (else None: the embedded
    arithmetic task) and its ``model.reward`` (``IntegerMatch`` when it names none), the reward TRL's side
    scores with; ValueError when ``trl`` and tools/trl_step.py cannot build that reward (it imports only
    ``rllight.rewards``, and takes one class with plain settings)."""
    with open(recipe) as f:
        config = yaml.safe_load(f) or {}
    task = (config.get("data") or {}).get("task")
    task = task if isinstance(task, dict) and task.get("class_path") == REASONING_GYM_TASK else None
    reward = (config.get("model") or {}).get("reward") or DEFAULT_REWARD
    reward = {"class_path": reward} if isinstance(reward, str) else reward
    settings = reward.get("init_args") or {}
    if trl and (not str(reward.get("class_path")).startswith("rllight.rewards.")
                or any(isinstance(v, (dict, list)) for v in settings.values())):
        raise ValueError(f"TRL's side cannot score with its model.reward {reward.get('class_path')} (tools/trl_step.py "
                         "takes one rllight.rewards class with plain settings); use a recipe with such a reward")
    return task, {"class_path": reward["class_path"], "init_args": dict(settings)}


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
            "ppo_epochs": 1,
            "minibatch_size": None,
            "micro_batch_size": PROMPTS_PER_STEP * GROUP_SIZE,
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


def evaluate(args: argparse.Namespace, name: str, model_dir: str) -> tuple[dict[str, float], dict[str, str]]:
    """Greedy correctness (0/1) of the model folder on each of the ``--heldout`` problems, by ``rllight
    validate`` (the recipe with the HF engine at ``MAX_NEW_TOKENS``, one greedy response per problem, scored by
    the recipe's reward), keyed by the problem's source row, and each problem's task (its ``data_source``).
    Every side's final model and the starting model go through this same code."""
    config = {
        "seed_everything": args.seed,
        # float32 whatever --precision: every model folder evaluated by the same computation
        "trainer": {"precision": "32-true", "limit_val_batches": 1.0, "enable_progress_bar": False,
                    "enable_model_summary": False,
                    "default_root_dir": os.path.join(args.out, name),
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": args.out, "name": name}}},
        "model": {"model": {"class_path": "rllight.models.HFModel", "init_args": {"path": model_dir}},
                  "rollout": {"class_path": ENGINES["hf"],
                              "init_args": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE}},
                  "evaluation": {"n": 1, "temperature": 0.0, "ks": [1], "also_greedy": False},
                  "export_dir": None},
        "data": data_config(args, val_size=args.heldout),
    }
    path = os.path.join(args.out, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    _, logs = run_logged(args, name, [sys.executable, "-c", RLLIGHT_CHILD, "validate", "--config", args.recipe,
                                      "--config", path])
    rows = glob.glob(os.path.join(logs, "**", "val_step0_rows.jsonl"), recursive=True) if logs else []
    if not rows:
        raise SystemExit(f"bench_step: {name} wrote no val_step0_rows.jsonl under {os.path.join(args.out, name)}")
    with open(rows[0]) as f:
        records = [json.loads(line) for line in f]
    if len(records) != args.heldout:
        raise SystemExit(f"bench_step: {name} evaluated {len(records)} of the {args.heldout} held-out problems; "
                         f"see {rows[0]}")
    return {r["source"]: float(r["correct"][0]) for r in records}, {r["source"]: r["data_source"] for r in records}


def by_task(correct: dict[str, float], tasks: dict[str, str]) -> dict[str, float]:
    """Accuracy on each task's problems (``correct`` and ``tasks`` keyed by problem), tasks by name."""
    grouped: dict[str, list[float]] = {}
    for source, value in correct.items():
        grouped.setdefault(tasks[source], []).append(value)
    return {task: statistics.fmean(grouped[task]) for task in sorted(grouped)}


def learning(args: argparse.Namespace, rllight: dict, trl: dict | None) -> dict:
    """Held-out greedy accuracy of the starting model and of each side's final model (the gain's standard error
    paired over the problems), and each side's per-step reward, entropy and length; written to
    ``<out>/learning.json``."""
    from rllight.evaluation import paired_se
    from rllight.models import SmolLM2Package

    base, tasks = evaluate(args, "eval-start", args.model_dir or SmolLM2Package().resolve())
    out = {"seed": args.seed, "steps": args.steps, "train_prompts": args.train_prompts, "heldout": args.heldout,
           "recipe": os.path.relpath(args.recipe, ROOT), "overrides": args.overrides,
           "trl_loss_type": args.trl_loss_type if trl is not None else None,
           "start": statistics.fmean(base.values()), "start_by_task": by_task(base, tasks),
           "task_sizes": {task: sum(t == task for t in tasks.values()) for task in sorted(set(tasks.values()))},
           "sides": {}}
    sides = [("rllight", os.path.join(args.out, "rllight", "final"), rllight["curve"])]
    if trl is not None:
        sides.append(("trl", os.path.join(args.out, "trl", "final"),
                      {name: trl["logs"][key] for name, key in TRL_CURVE.items()}))
    for name, folder, curve in sides:
        after, _ = evaluate(args, f"eval-{name}", folder)
        out["sides"][name] = {"accuracy": statistics.fmean(after.values()), "accuracy_by_task": by_task(after, tasks),
                              "gain_se": paired_se(base, after), **curve}
    with open(os.path.join(args.out, LEARNING), "w") as f:
        json.dump(out, f, indent=2)
    return out


def thirds(values: list[float | None]) -> tuple[float, float]:
    """Mean of the first and of the last third of the steps (missing values left out)."""
    k = max(1, len(values) // 3)
    first, last = [v for v in values[:k] if v is not None], [v for v in values[-k:] if v is not None]
    return (statistics.fmean(first) if first else float("nan"), statistics.fmean(last) if last else float("nan"))


def blocks(values: list[float | None], n: int = CURVE_BLOCKS) -> list[float]:
    """The mean of each of ``n`` consecutive blocks of the steps (missing values left out; NaN for a block
    without any), the last block taking the remainder: a reward curve short enough to print."""
    n = max(1, min(n, len(values)))
    size = len(values) // n
    edges = [i * size for i in range(n)] + [len(values)]
    means = []
    for lo, hi in zip(edges, edges[1:]):
        present = [v for v in values[lo:hi] if v is not None]
        means.append(statistics.fmean(present) if present else float("nan"))
    return means


def rllight_loss(out: str) -> str:
    """``rllight/<aggregation>`` of the rllight run in ``out`` (from the config it saved), e.g.
    ``rllight/SeqMeanTokenMean``: the loss aggregation is what the learning comparison varies."""
    configs = [c for c in (os.path.join(v, "config.yaml") for v in versions(os.path.join(out, "rllight")))
               if os.path.isfile(c)]
    if not configs:
        return "rllight"
    with open(configs[-1]) as f:
        aggregation = (yaml.safe_load(f)["model"].get("aggregation") or {}).get("class_path", "")
    return f"rllight/{aggregation.rsplit('.', 1)[-1]}" if aggregation else "rllight"


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error over them (NaN for one value)."""
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def print_learning(runs: list[dict], folders: list[str], record: list[dict] | None = None) -> None:
    """One row per run (its ``--out`` folder) and side: held-out greedy accuracy before -> after (± paired
    standard error of the gain), and the first -> last third of the steps' reward, entropy and response length,
    then, with several tasks (reasoning-gym's), the accuracy on each task's held-out problems; with several
    runs, the mean over the runs of each side and loss (± standard error over the runs), also per task, and its
    reward curve (the mean reward of ``CURVE_BLOCKS`` consecutive blocks of the steps, averaged over the runs).
    ``record``, a list, gets each printed row as a record's row (``LEARNING_COLUMNS``), its values as printed."""
    record = [] if record is None else record
    first = runs[0]
    print(f"\nlearning: {first['steps']} steps on {first['train_prompts']} training problems, greedy accuracy on "
          f"{first['heldout']} held-out ones; reward, entropy and length: first -> last third of the steps")
    print(f"  {'side/loss':<26}{'seed':>5}  {'held-out accuracy':<26}{'reward':<15}{'entropy':<15}{'length':<13}")
    by_side: dict[str, list[dict]] = {}
    for run, folder in zip(runs, folders):
        for side, r in run["sides"].items():
            row = {"start": run["start"], "accuracy": r["accuracy"], "start_by_task": run.get("start_by_task", {}),
                   "by_task": r.get("accuracy_by_task", {}), "reward_blocks": blocks(r["reward"])}
            for key in CURVE:
                row[key] = thirds(r[key])
            label = rllight_loss(folder) if side == "rllight" else f"trl/{run['trl_loss_type']}"
            by_side.setdefault(label, []).append(row)
            se = f" ± {r['gain_se']:.3f}" if r.get("gain_se") is not None else ""
            print(f"  {label:<26}{run['seed']:>5}  {run['start']:.3f} -> {r['accuracy']:.3f}{se:<10}"
                  + "".join(f"{row[key][0]:.2f} -> {row[key][1]:<7.2f}" for key in ("reward", "entropy"))
                  + f"{row['length'][0]:.0f} -> {row['length'][1]:.0f}")
            record.append({"side": label, "seed": run["seed"], "start": printed(run["start"], ".3f"),
                           "accuracy": printed(r["accuracy"], ".3f"), "gain_se": printed(r.get("gain_se"), ".3f"),
                           **{f"{key}_{part}": printed(row[key][i], ".0f" if key == "length" else ".2f")
                              for key in CURVE for i, part in enumerate(("first", "last"))}})
            if len(row["by_task"]) > 1:
                sizes = run.get("task_sizes", {})
                for task, accuracy in row["by_task"].items():
                    print(f"    {task:<31}{row['start_by_task'][task]:.3f} -> {accuracy:.3f}  "
                          f"({sizes.get(task, '?')} problems)")
                    record.append({"side": label, "seed": run["seed"], "task": task, "problems": sizes.get(task),
                                   "start": printed(row["start_by_task"][task], ".3f"),
                                   "accuracy": printed(accuracy, ".3f")})
    if len(runs) < 2:
        return
    print("  mean over the runs of each (± standard error over the runs):")
    for side, rows in by_side.items():
        def mean(values: list[float]) -> str:
            return "{:.3f} ± {:.3f}".format(*mean_se(values))

        gains = [r["accuracy"] - r["start"] for r in rows]
        print(f"  {side:<26}{len(rows)} runs: held-out gain {mean(gains)}; last-third reward "
              f"{mean([r['reward'][1] for r in rows])}; last-third entropy {mean([r['entropy'][1] for r in rows])}")
        runs_row = {"side": side, "seed": f"mean of {len(rows)} runs"}
        for key, values in (("gain", gains), ("reward_last_mean", [r["reward"][1] for r in rows]),
                            ("entropy_last_mean", [r["entropy"][1] for r in rows])):
            runs_row[key], runs_row[f"{key}_se"] = (printed(v, ".3f") for v in mean_se(values))
        tasks = set(rows[0]["by_task"]) if all(r["by_task"].keys() == rows[0]["by_task"].keys() for r in rows) else ()
        curve = [statistics.fmean(column) for column in zip(*(r["reward_blocks"] for r in rows))]
        record.append({**runs_row, "reward_curve": " ".join(f"{v:.3f}" for v in curve)})
        for task in sorted(tasks) if len(tasks) > 1 else ():
            accuracies = [r["by_task"][task] for r in rows]
            task_gains = [r["by_task"][task] - r["start_by_task"][task] for r in rows]
            print(f"    {task:<31}accuracy {mean(accuracies)}, gain {mean(task_gains)}")
            (accuracy, accuracy_se), (gain, gain_se) = mean_se(accuracies), mean_se(task_gains)
            record.append({"side": side, "seed": f"mean of {len(rows)} runs", "task": task,
                           "accuracy": printed(accuracy, ".3f"), "accuracy_se": printed(accuracy_se, ".3f"),
                           "gain": printed(gain, ".3f"), "gain_se": printed(gain_se, ".3f")})
        print(f"    {'reward curve':<31}" + " ".join(f"{v:.3f}" for v in curve)
              + f"  (mean reward of {len(curve)} consecutive blocks of the steps)")


LEARNING_COLUMNS = [
    ["side", "side/loss"], ["seed", "seed"], ["task", "task"], ["problems", "problems"],
    ["start", "held-out accuracy before", ".3f"], ["accuracy", "after", ".3f"], ["accuracy_se", "± se", ".3f"],
    ["gain", "gain", "+.3f"], ["gain_se", "± se", ".3f"], ["reward_first", "reward, first third", ".2f"],
    ["reward_last", "reward, last third", ".2f"], ["entropy_first", "entropy, first third", ".2f"],
    ["entropy_last", "entropy, last third", ".2f"], ["length_first", "length, first third", ".0f"],
    ["length_last", "length, last third", ".0f"], ["reward_last_mean", "mean last-third reward", ".3f"],
    ["reward_last_mean_se", "± se", ".3f"], ["entropy_last_mean", "mean last-third entropy", ".3f"],
    ["entropy_last_mean_se", "± se", ".3f"], ["reward_curve", "reward curve (block means)"]]
"""The columns of the record of the learning table (``--summarize``, or one run's ``--heldout``)."""


def gib(kb: float | None) -> str:
    return "-" if kb is None else f"{kb / 1024**2:.2f}"


def describe(config_yaml: str) -> str:
    """The benchmarked settings as the rllight run resolved them (its saved config.yaml, ``--set`` included)."""
    with open(config_yaml) as f:
        config = yaml.safe_load(f)
    model = config["model"]
    source = model["model"].get("init_args") or {}
    rollout = model["rollout"]
    sampling = rollout.get("init_args") or {}
    engine_dtype = sampling.get("dtype") or source.get("dtype")
    if engine_dtype == "auto":  # the engine generates with the policy itself
        engine_dtype = source.get("dtype")
    return (f"{source.get('path') or 'SmolLM2-135M-Instruct'} ({source.get('dtype')}), "
            f"trainer.precision {config['trainer'].get('precision')}, "
            f"{rollout['class_path'].rsplit('.', 1)[-1]} (dtype {engine_dtype}), "
            f"{config['data']['batch_size']} prompts x {model['sampler']['init_args']['group_size']} responses, "
            f"max_new_tokens {sampling.get('max_new_tokens')}, temperature {sampling.get('temperature')}, "
            f"lr {model['optimizer']['init_args']['lr']}, ppo_epochs {model['ppo_epochs']}, "
            f"minibatch_size {model['minibatch_size']}, micro_batch_size {model['micro_batch_size']}")


def print_rllight(r: dict) -> None:
    print(f"\nrllight: {r['settings']}")
    print(f"median of steps 2..{r['steps'] + 1}:")
    print(f"  {'step s':<22}{r['step']:.4g}")
    for name in (*PHASES, "other"):
        print(f"  {name + ' s':<22}{r[name]:.4g}")
    print(f"  {'generated tokens/s':<22}{r['generated_tokens_per_s']:.4g}")
    print(f"  {'step tokens/s':<22}{r['step_tokens_per_s']:.4g}")
    print(f"  {'tokens per step':<22}{r['tokens_per_step']:.0f}")
    print(f"  {'peak RSS GiB':<22}{gib(r['peak_rss_kb'])}")
    if r["peak_cuda_bytes"] is not None:
        print(f"  {'peak CUDA GiB':<22}{r['peak_cuda_bytes'] / 1024**3:.2f}")


def print_comparison(args: argparse.Namespace, rllight: dict, trl: dict) -> None:
    print(f"\nTRL {trl['trl']} (transformers {trl['transformers']}, torch {trl['torch']}): GRPOTrainer, same config "
          f"and prompts, both sides in {args.precision}"
          + (" (TRL's bf16=True)" if args.precision == "bf16-mixed" else ""))
    rllight_only = [option for option, given in (("--set", args.overrides), ("--dtype", args.dtype),
                                                  (f"--engine {args.engine}", args.engine != "hf")) if given]
    if rllight_only:
        print(f"  note: {', '.join(rllight_only)} changed the rllight side only")
    if rllight["peak_cuda_bytes"] is not None:
        print("  note: rllight ran on CUDA, TRL on the CPU")
    print(f"  {'':<22}{'rllight':>10}{'trl':>10}")
    print(f"  {'step s':<22}{rllight['step']:>10.4g}{trl['step']:>10.4g}")
    print(f"  {'tokens per step':<22}{rllight['tokens_per_step']:>10.0f}{trl['tokens_per_step']:>10.0f}")
    print(f"  {'step tokens/s':<22}{rllight['step_tokens_per_s']:>10.4g}{trl['step_tokens_per_s']:>10.4g}")
    print(f"  {'peak RSS GiB':<22}{gib(rllight['peak_rss_kb']):>10}{gib(trl['peak_rss_kb']):>10}")


def run_async(args: argparse.Namespace) -> dict:
    """The rllight side again with asynchronous rollouts, the cores split between trainer and worker."""
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    result = run_rllight(args, "rllight-async", args.staleness, env={"OMP_NUM_THREADS": threads})
    result["threads"] = threads
    return result


def print_async(args: argparse.Namespace, sync: dict, asynchronous: dict) -> None:
    print(f"\nasynchronous rollouts (worker process, max_staleness {args.staleness}; {asynchronous['threads']} "
          f"thread(s) each for trainer and worker) against synchronous (in-process engine, every core):")
    print(f"  {'':<22}{'sync':>10}{'async':>10}")
    for label, key, spec in (("step s", "step", ".4g"), ("rollout wait s", "rollout", ".4g"),
                             ("update s", "update", ".4g"), ("tokens per step", "tokens_per_step", ".0f"),
                             ("step tokens/s", "step_tokens_per_s", ".4g")):
        print(f"  {label:<22}{sync[key]:>10{spec}}{asynchronous[key]:>10{spec}}")
    print(f"  {'peak RSS GiB':<22}{gib(sync['peak_rss_kb']):>10}{gib(asynchronous['peak_rss_kb']):>10}"
          "  (the trainer's process; the worker holds another copy of the policy)")


TIMING_COLUMNS = [
    ["side", "side"], ["step_s", "step s", ".4g"], ["rollout_s", "rollout s (async: wait)", ".4g"],
    ["reward_s", "reward s", ".4g"], ["score_s", "score s", ".4g"], ["update_s", "update s", ".4g"],
    ["other_s", "other s", ".4g"], ["generated_tokens_per_s", "generated tokens/s", ".4g"],
    ["step_tokens_per_s", "step tokens/s", ".4g"], ["tokens_per_step", "tokens per step", ".0f"],
    ["peak_rss_gib", "peak RSS GiB", ".2f"], ["peak_cuda_gib", "peak CUDA GiB", ".2f"],
    ["heldout_before", "held-out accuracy before", ".3f"], ["heldout_after", "after", ".3f"],
    ["heldout_gain_se", "± se of the gain", ".3f"], ["async_over_sync", "async / sync (steps per second)", ".2f"],
    ["rllight_over_trl", "TRL s/step / rllight s/step", ".2f"]]
"""The columns of a timing run's record; those no row fills are left out."""
TIMED = ("step", *PHASES, "other", "generated_tokens_per_s", "step_tokens_per_s", "tokens_per_step")


def timing_row(side: str, r: dict, keys: tuple[str, ...], cuda: bool = False) -> dict:
    """One side's row of the record: ``keys`` of its medians and its peak RSS (and CUDA memory), as printed."""
    row = {"side": side}
    for key in keys:
        row[f"{key}_s" if key in ("step", *PHASES, "other") else key] = printed(
            r[key], ".0f" if key == "tokens_per_step" else ".4g")
    row["peak_rss_gib"] = printed(None if r["peak_rss_kb"] is None else r["peak_rss_kb"] / 1024**2, ".2f")
    if cuda and r.get("peak_cuda_bytes") is not None:
        row["peak_cuda_gib"] = printed(r["peak_cuda_bytes"] / 1024**3, ".2f")
    return row


def record_timing(args: argparse.Namespace, rllight: dict, asynchronous: dict | None, trl: dict | None,
                  learned: dict | None, last: dict) -> None:
    """The record of a timing run (``--record``): a row per side, ``last`` (the last lines' values) as summary."""
    if not args.record:
        return
    def heldout(side: str) -> dict:  # the side's held-out accuracy before and after (--heldout), as printed
        if learned is None:
            return {}
        return {"heldout_before": printed(learned["start"], ".3f"),
                "heldout_after": printed(learned["sides"][side]["accuracy"], ".3f"),
                "heldout_gain_se": printed(learned["sides"][side]["gain_se"], ".3f")}

    rows = [{**timing_row("rllight" + (" synchronous" if asynchronous else ""), rllight, TIMED, cuda=True),
             **heldout("rllight")}]
    if asynchronous is not None:
        rows.append({**timing_row(f"rllight asynchronous (max_staleness {args.staleness}, "
                                  f"{asynchronous['threads']} threads each)", asynchronous,
                                  ("step", "rollout", "update", "tokens_per_step", "step_tokens_per_s")),
                     "async_over_sync": last["async_over_sync"]})
    if trl is not None:
        rows.append({**timing_row(f"TRL {trl['trl']}", trl, ("step", "tokens_per_step", "step_tokens_per_s")),
                     **heldout("trl"), "rllight_over_trl": last["rllight_over_trl"]})
    model = os.path.basename(args.model_dir) if args.model_dir else "SmolLM2-135M-Instruct"
    setup = f"{model}, {os.path.relpath(args.recipe, ROOT)}, {args.precision}, {args.steps} steps, seed {args.seed}"
    if trl is not None:
        id, section, headline = "bench-step-trl", "Against TRL", "{rllight_over_trl:.2f}x TRL's steps per second"
        title = f"rllight against TRL {trl['trl']}'s GRPOTrainer, seconds per RL step: {setup}"
    elif asynchronous is not None:
        id, section = "bench-step-async", "Asynchronous and stale rollouts"
        headline = "{async_over_sync:.2f}x the synchronous steps per second"
        title = (f"Asynchronous rollouts (max_staleness {args.staleness}) against synchronous, seconds per RL step: "
                 f"{setup}")
    else:
        id, section, headline = "bench-step", "Speed and memory", "{rllight_step_s:.4g} s per RL step"
        title = f"Seconds per RL step by phase: {setup}"
    used = {k for row in rows for k, v in row.items() if v is not None}
    tool_record(args, id=id, section=section, title=title, headline=headline, summary=last, rows=rows,
                columns=[c for c in TIMING_COLUMNS if c[0] in used],
                note=f"rllight: {rllight['settings']}. Each number is the median over steps 2..{args.steps} (the first "
                     "step, a warm-up, left out); peak RSS is the training process's"
                     + (f"; TRL {trl['trl']} (transformers {trl['transformers']}, torch {trl['torch']}) on the same "
                        "config and prompts, sampling independently" if trl is not None else "")
                     + (f"; held-out: greedy accuracy on {args.heldout} problems, the gain's standard error paired"
                        if learned is not None else "") + ".")


def record_learning(args: argparse.Namespace, runs: list[dict], rows: list[dict]) -> None:
    """The record of ``--summarize`` (``--record``): the learning table's rows; the summary each side's gain, the
    mean over the runs as printed (of one run: after - before, as printed)."""
    if not args.record:
        return
    gains: dict[str, float] = {}
    for row in rows:
        if "task" in row:
            continue
        if isinstance(row["seed"], int):  # one run's row; a mean row, later, replaces it
            gains.setdefault(row["side"], printed(row["accuracy"] - row["start"], ".3f"))
        else:
            gains[row["side"]] = row["gain"]
    summary = {f"{side}_gain": gain for side, gain in gains.items()}
    used = {k for row in rows for k, v in row.items() if v is not None}
    first = runs[0]
    tool_record(args, id="bench-step-learning", section="Against TRL", rows=rows, summary=summary,
                columns=[c for c in LEARNING_COLUMNS if c[0] in used],
                title=f"Learning per step: {' against '.join(gains)}, {len(runs)} run{'s' if len(runs) > 1 else ''} "
                      f"of {first['steps']} steps on {first['train_prompts']} training problems",
                note=f"Greedy accuracy on {first['heldout']} held-out problems before and after training (the gain's "
                     "standard error paired over the problems for a run, over the runs for their mean), and the mean "
                     "reward, entropy and response length over the first and the last third of the steps.",
                headline=", ".join(f"{side} {{{side}_gain:+.3f}}" for side in gains))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        runs = []
        for folder in args.summarize:
            with open(os.path.join(folder, LEARNING)) as f:
                runs.append(json.load(f))
        rows: list[dict] = []
        print_learning(runs, args.summarize, rows)
        record_learning(args, runs, rows)
        return 0
    if args.setup_trl:
        setup_trl(args.trl_python)
        if not args.trl:
            return 0
    os.makedirs(args.out, exist_ok=True)
    rllight = run_rllight(args)
    asynchronous = run_async(args) if args.staleness is not None else None
    trl = run_trl(args) if args.trl else None
    learned = learning(args, rllight, trl) if args.heldout else None
    print_rllight(rllight)
    if asynchronous is not None:
        print_async(args, rllight, asynchronous)
    if trl is not None:
        print_comparison(args, rllight, trl)
    if learned is not None:
        print_learning([learned], [args.out])
    last = [f"rllight_step_s={rllight['step']:.4g}"]
    if asynchronous is not None:
        last.append(f"async_over_sync={rllight['step'] / asynchronous['step']:.2f}")
    if trl is not None:
        last.append(f"rllight_over_trl={trl['step'] / rllight['step']:.2f}")
    record_timing(args, rllight, asynchronous, trl, learned, parse_pairs(" ".join(last)))
    for line in last:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
