"""Peak memory and time of the chunked log-prob / entropy path against the direct one.

Both compute per-token log-probs and entropy of ``targets`` from hidden states (B, T, H) and an output
layer (V, H), then backpropagate a random linear function of both into the hidden states and the
weight. The direct path builds the full (B, T, V) float32 logits; the chunked path
(``rllight.algorithms.chunked_logprobs_and_entropy``) holds one chunk at a time.

Each path runs in a fresh process so that peak memory is its own: on CUDA the allocator's peak, on CPU
the process's peak resident set minus the resident set just before the computation. The line before the last
names the machine (``rllight.machine``); the last line is

    memory_ratio=<chunked/direct> time_ratio=<chunked/direct> max_abs_diff=<x>

where max_abs_diff covers log-probs, entropy and both gradients.

``--record PATH`` also writes them as a record for docs/results/ (``rllight.app.records``; id ``bench-logprobs``): one
row, the settings, each path's peak memory and time and the last line's values.

Usage: python tools/bench_logprobs.py [--batch 8] [--length 1024] [--vocab 49152] [--hidden 576] [--record PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

from rllight.app.records import add_record_options, check_record_options, pairs_record, printed


def _inputs(args, device):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.batch, args.length, args.hidden, generator=g).mul_(0.5).to(device)
    weight = torch.randn(args.vocab, args.hidden, generator=g).mul_(0.05).to(device)
    targets = torch.randint(0, args.vocab, (args.batch, args.length), generator=g).to(device)
    g_lp = torch.randn(args.batch, args.length, generator=g).to(device)
    g_ent = torch.randn(args.batch, args.length, generator=g).to(device)
    return hidden.requires_grad_(), weight.requires_grad_(), targets, g_lp, g_ent


def _run_one(args) -> None:
    from rllight.algorithms import chunked_logprobs_and_entropy, logprobs_and_entropy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden, weight, targets, g_lp, g_ent = _inputs(args, device)

    def step():
        if args.path == "direct":
            lp, ent = logprobs_and_entropy(torch.nn.functional.linear(hidden, weight), targets)
        else:
            lp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=args.chunk_size)
        (lp * g_lp + ent * g_ent).sum().backward()
        return lp.detach(), ent.detach()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    start = time.perf_counter()
    lp, ent = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _peak_rss_bytes()) - base
    # Time again, warm (the first run pays for page faults and allocator growth).
    hidden.grad = weight.grad = None
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = min(elapsed, time.perf_counter() - start)
    torch.save({"lp": lp.cpu(), "ent": ent.cpu(), "gh": hidden.grad.cpu(), "gw": weight.grad.cpu()}, args.out)
    print(json.dumps({"peak": peak, "time": elapsed}))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> float:
    """Run the benchmark; returns the memory ratio (chunked / direct)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--path", choices=["direct", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    add_record_options(parser, id="bench-logprobs", section="Speed and memory")
    args = parser.parse_args(argv)
    for name in ("batch", "length", "vocab", "hidden", "chunk_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    check_record_options(parser, args, argv, __file__)
    if args.path:
        _run_one(args)
        return 0.0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in ("direct", "chunked"):
            out = os.path.join(tmp, f"{path}.pt")
            cmd = [sys.executable, __file__, "--path", path, "--out", out, "--batch", str(args.batch), "--length",
                   str(args.length), "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk-size",
                   str(args.chunk_size)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            results[path] = {**json.loads(line), **torch.load(out)}
            print(f"{path:8s} peak_memory={results[path]['peak'] / 2**20:9.1f} MiB time={results[path]['time']:.3f} s")
    d, c = results["direct"], results["chunked"]
    diff = max((d[k] - c[k]).abs().max().item() for k in ("lp", "ent", "gh", "gw"))
    from rllight.machine import machine_line

    last = f"memory_ratio={c['peak'] / d['peak']:.4f} time_ratio={c['time'] / d['time']:.4f} max_abs_diff={diff:.3e}"
    record(args, results, last)
    print(machine_line())
    print(last)
    return c["peak"] / d["peak"]


def record(args, results: dict, last: str) -> None:
    """The record of the run (``--record``): the settings, each path's peak memory and time as printed, ``last``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    measured = {}
    for path in ("direct", "chunked"):
        measured[f"{path}_peak_mib"] = printed(results[path]["peak"] / 2**20, ".1f")
        measured[f"{path}_time_s"] = printed(results[path]["time"], ".3f")
    pairs_record(
        args, last, id="bench-logprobs", section="Speed and memory",
        title=f"Chunked log-probs and entropy against the full logits, B={args.batch} T={args.length} "
              f"V={args.vocab} H={args.hidden}, chunks of {args.chunk_size}, on {device}",
        note="Per-token log-probs and entropy from hidden states and the output layer, then the backward pass into "
             "both; each path in a fresh process, its peak memory its own (CUDA: the allocator's peak; CPU: peak RSS "
             "less the RSS before), its time the faster of two runs. Ratios are chunked / direct; max_abs_diff "
             "covers log-probs, entropy and both gradients.",
        settings={"device": device, "batch": args.batch, "length": args.length, "vocab": args.vocab,
                  "hidden": args.hidden, "chunk_size": args.chunk_size, **measured},
        labels={"chunk_size": "chunk", "direct_peak_mib": "direct peak (MiB)", "chunked_peak_mib": "chunked peak (MiB)",
                "direct_time_s": "direct time (s)", "chunked_time_s": "chunked time (s)",
                "memory_ratio": "memory ratio", "time_ratio": "time ratio", "max_abs_diff": "max abs diff"},
        formats={"direct_peak_mib": ".1f", "chunked_peak_mib": ".1f", "direct_time_s": ".3f",
                 "chunked_time_s": ".3f", "memory_ratio": ".4f", "time_ratio": ".4f"},
        headline="{memory_ratio:.4f} of the direct path's peak memory, {time_ratio:.4f} of its time")


if __name__ == "__main__":
    main()
