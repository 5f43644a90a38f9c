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
``batching: {ppo_epochs: 1, minibatch_size: null}`` (one update per rollout, so ``trainer.max_steps`` = ``--steps``
rollouts), ``batching.micro_batch_size: 16``, ``trainer.precision`` from ``--precision`` (the engine's ``dtype: auto`` follows
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
        --train-prompts 64 --heldout 200 --seed $seed --set model.batching.micro_batch_tokens=400 \
        --out runs/learn/s$seed; done
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

``--record PATH`` also writes what the run printed as a record for docs/results/ (``rllight.app.records``): one row per
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
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import yaml

from rllight.app.records import add_record_options, check_record_options, parse_pairs

# The tool's parts, next to it: tools/bench_step_sides.py, bench_step_learning.py and bench_step_report.py.
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from bench_step_learning import learning, print_learning, record_learning
from bench_step_report import print_async, print_comparison, print_rllight, record_timing
from bench_step_sides import (DEFAULT_REWARD, ENGINES, LEARNING, PRECISIONS, PROMPTS_PER_STEP, REASONING_GYM_TASK, ROOT,
                              TRL_VENV, run_async, run_rllight, run_trl, setup_trl)

# Named as bench_step's too, as before the split (tests/tools/test_bench_step.py, tests/tools/test_tools.py).
from bench_step_learning import blocks, by_task  # noqa: F401
from bench_step_sides import MAX_NEW_TOKENS, TORCH_PIN, data_config, overlay, trl_inputs  # noqa: F401


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
            p.error(f"--set expects KEY=VALUE (e.g. model.batching.micro_batch_size=8), got '{item}'")
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
