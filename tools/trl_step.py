"""TRL's GRPOTrainer on tools/bench_step.py's config: seconds per optimizer step and peak RSS.

Runs with the python of TRL's own virtual environment (tools/bench_step.py --setup-trl makes it), which
lacks rllight's dependencies: it imports only ``rllight.rewards`` from this checkout (the standard library
suffices for it, and reasoning-gym for ``ReasoningGymScore``), so that both sides score with the same code.
tools/bench_step.py --trl writes the inputs and runs it. Its one argument is the settings file (JSON): the
Hugging Face model folder, a JSONL of prompts in TRL's conversational format with their answers and
``data_source`` (in the order rllight's dataloader draws them), the reward (the recipe's ``model.reward``: a
``class_path`` in ``rllight.rewards`` and its ``init_args``), the number of steps, prompts per step, responses
per prompt, response length (with ``--fixed-length`` also its least length), temperature, learning rate, seed,
TRL's loss type, ``bf16`` (bench_step's ``--precision bf16-mixed``) and an output folder (and, for bench_step's
held-out evaluation, ``final_dir``: the trained model and tokenizer are saved there).

GRPOConfig, matched to rllight's GRPO recipe (recipes/grpo.yaml) under bench_step's overlay:
- one step = ``prompts_per_step`` x ``group_size`` completions: ``per_device_train_batch_size`` = 16 completions,
  ``num_generations`` 4, ``steps_per_generation`` 1, ``gradient_accumulation_steps`` 1 and ``num_iterations`` 1,
  so that every optimizer step generates its own batch and makes one update on it (no old log-prob pass, as
  rllight skips it with one update per rollout);
- sampling at ``temperature``, ``top_k`` 0, ``top_p`` 1.0, at most ``max_new_tokens`` new tokens, with
  Hugging Face ``generate`` (no vLLM) on the CPU (``use_cpu``; rllight's ``accelerator: auto`` is the CPU too
  on a machine without a GPU);
- ``beta`` 0 (no KL and no reference model, like the recipe), clip 0.2 (``epsilon``), advantages scaled by the
  group's standard deviation (``scale_rewards="group"``, the recipe's ``scale_by_std``), ``loss_type="grpo"``
  (per-response mean, then the mean over responses: the recipe's seq-mean-token-mean);
- AdamW (``adamw_torch``: torch's AdamW, as rllight's optimizer) at ``lr``, weight decay 0, a constant
  learning rate (TRL's default decays linearly), gradient clipping at 1.0 (rllight's default), the model loaded
  in float32 and ``fp16`` off; ``bf16`` as the settings say: off (float32, rllight's ``trainer.precision:
  32-true``) or on (bfloat16 autocast over float32 weights, as rllight's ``bf16-mixed``), no gradient
  checkpointing, dropout off;
- the prompts in the file's order (``shuffle_dataset=False``), logging every step, no saving, report_to none.
The reward is the recipe's rllight reward, called on each completion's text and its row's answer, as rllight's
reward workers call it (``reward_function``): recipes/grpo.yaml's ``IntegerMatch`` gives 1.0 when the last
integer of the completion (or of its last ``\\boxed{}``) equals the answer, else 0.0; recipes/reasoning-gym.yaml's
``ReasoningGymScore`` rebuilds the row's reasoning-gym entry from the key in its answer and gives the task's own
``score_answer`` on the completion's final answer (its last ``\\boxed{}``, else ``<answer>`` tag, else last
line). The comparison on reasoning-gym's tasks (one seed; tools/bench_step.py's docstring has the two-seed
command and the README, Data, its result; the recipe's token-level loss is TRL's ``dapo``):

    .venv/bin/python tools/bench_step.py --recipe recipes/reasoning-gym.yaml --trl --trl-loss-type dapo \
        --steps 36 --train-prompts 144 --heldout 200 --seed 0 --out runs/learn-rg/s0

Differences that remain: TRL's generation and loss code are its own (e.g. TRL computes the per-token entropy
in the loss pass, as rllight does for its metrics), and rllight scores rewards in worker processes while TRL
scores them in the training process.

Timing: a TrainerCallback takes the wall clock at ``on_step_begin`` and ``on_step_end``. TRL generates the
completions in ``_prepare_inputs``, called by ``training_step``, so a step covers generation, reward,
advantages, the forward/backward pass, gradient clipping and the optimizer update; it leaves out the
dataloader's fetch of the raw prompts and the logging after the step. The last line printed is

    trl_result={"step_s": [...], "completion_tokens": [...], "logs": {...}, "peak_rss_kb": ..., "trl": ..., ...}

(JSON: seconds and generated tokens of each step, the per-step reward, entropy and completion length TRL
logged, the process's peak RSS in KiB and the versions).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rllight.rewards  # this checkout's, found through the path above

# torch, transformers, TRL and datasets are imported in main() and step_timer(): the reward functions import
# without them (rllight's tests run them in rllight's environment, which has no TRL).
LOGGED = ("reward", "entropy", "completions/mean_length")
"""TRL's per-step metrics returned in ``logs``: mean reward, mean per-token entropy and mean completion length."""
DEFAULT_REWARD = {"class_path": "rllight.rewards.IntegerMatch"}


def reward_function(spec: dict | None):
    """TRL's reward function for an rllight reward (``{"class_path": "rllight.rewards.<Name>", "init_args":
    {...}}``, default ``IntegerMatch``): the reward of each completion (its last message's text) against its
    row's ``answer`` column, as rllight scores one response. TRL logs it as ``rewards/<Name>/mean``."""
    spec = spec or DEFAULT_REWARD
    module, _, name = spec["class_path"].rpartition(".")
    if module != "rllight.rewards" or not isinstance(getattr(rllight.rewards, name, None), type):
        raise SystemExit(f"trl_step: reward {spec['class_path']!r} is not a class of rllight.rewards")
    reward = getattr(rllight.rewards, name)(**(spec.get("init_args") or {}))

    def score(completions, answer, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(reward(text, expected)) for text, expected in zip(texts, answer)]

    score.__name__ = name
    return score


def step_timer(completions_per_step: int):
    """A TrainerCallback that takes the wall-clock seconds of each optimizer step and the completion tokens it
    generated."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.completions_per_step = completions_per_step
            self.step_s: list[float] = []
            self.completion_tokens: list[float] = []
            self.logs: dict[str, list[float]] = {key: [] for key in LOGGED}
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._start)
            print(f"trl_step: step {len(self.step_s)}: {self.step_s[-1]:.3f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.completion_tokens.append(logs["completions/mean_length"] * self.completions_per_step)
                for key, values in self.logs.items():
                    values.append(logs.get(key))

    return StepTimer()


def main(settings_path: str) -> None:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(settings_path) as f:
        s = json.load(f)
    with open(s["prompts"]) as f:
        rows = [json.loads(line) for line in f]
    completions_per_step = s["prompts_per_step"] * s["group_size"]
    # transformers 5 renamed gradient checkpointing (the old name still works, with a warning).
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    config = trl.GRPOConfig(
        output_dir=s["output_dir"],
        max_steps=s["steps"],
        per_device_train_batch_size=completions_per_step,
        num_generations=s["group_size"],
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=s["max_new_tokens"],
        # bench_step --fixed-length: no end token before max_new_tokens, as rllight's HF engine's min_new_tokens
        **({"generation_kwargs": {"min_new_tokens": s["min_new_tokens"]}} if s.get("min_new_tokens") else {}),
        temperature=s["temperature"],
        top_k=0,
        top_p=1.0,
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        loss_type=s.get("loss_type", "grpo"),
        bf16=bool(s.get("bf16", False)),
        fp16=False,
        use_cpu=True,
        use_vllm=False,
        **{checkpointing: False},
        disable_dropout=True,
        shuffle_dataset=False,
        seed=s["seed"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(s["model_dir"])
    timer = step_timer(completions_per_step)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_function(s.get("reward")), args=config,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    if s.get("final_dir"):  # the trained model, for bench_step's held-out evaluation
        trainer.save_model(s["final_dir"])
        tokenizer.save_pretrained(s["final_dir"])
    result = {"step_s": timer.step_s, "completion_tokens": timer.completion_tokens, "logs": timer.logs,
              "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "trl": trl.__version__,
              "transformers": transformers.__version__, "torch": torch.__version__, "bf16": config.bf16,
              "torch_threads": torch.get_num_threads()}
    print("trl_result=" + json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: trl_step.py SETTINGS.json (written by tools/bench_step.py --trl)")
    main(sys.argv[1])
