"""Time ``rllight.algorithms.gae`` against a reverse loop over tokens.

Both compute GAE with one lambda per sequence (a (B,) tensor, as VAPO's length-adaptive lambda) on the
same (B, T) float32 batch, on the GPU when there is one. The loop is how peer trainers write it:
``for t in reversed(range(T)): delta = r_t + gamma V_{t+1} - V_t; lastgaelam = delta + gamma lam lastgaelam``.
Each is warmed up once, then timed ``--repeats`` times; the best (minimum) time counts. The line before the
last names the machine (``rllight.machine``); the last line is

    speedup=<loop time / gae time> max_abs_diff=<max |A_gae - A_loop|>

``--record PATH`` also writes them as a record for docs/results/ (``rllight.app.records``; id ``bench-gae``): one row,
the settings, both times and the last line's values.

Usage: python tools/bench_gae.py [--batch 256] [--length 4096] [--repeats 5] [--record docs/results/] [--shared no]
"""

import argparse
import time

import torch

from rllight.algorithms import gae
from rllight.machine import machine_line
from rllight.app.records import add_record_options, check_record_options, pairs_record, printed


def gae_loop(rewards, values, gamma, lam):
    """Reverse loop over tokens; rewards and values are already zero after each response."""
    batch, length = values.shape
    lastgaelam = torch.zeros(batch, dtype=values.dtype, device=values.device)
    advantages = []
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t + 1 < length else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages.append(lastgaelam)
    return torch.stack(advantages[::-1], dim=1)


def best_time(fn, repeats, device):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times), out


def main(argv: list[str] | None = None) -> float:
    """Run the benchmark; returns the speedup."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    add_record_options(parser, id="bench-gae", section="Speed and memory")
    args = parser.parse_args(argv)
    for name in ("batch", "length", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    check_record_options(parser, args, argv, __file__)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    b, t = args.batch, args.length
    lengths = torch.randint(1, t + 1, (b,), device=device)
    mask = torch.arange(t, device=device) < lengths.unsqueeze(1)
    values = torch.randn(b, t, device=device) * mask
    # Outcome reward (0 or 1) on the last response token.
    rewards = torch.zeros(b, t, device=device)
    rewards[torch.arange(b, device=device), lengths - 1] = torch.randint(0, 2, (b,), device=device).float()
    gamma = 1.0
    lam = torch.empty(b, device=device).uniform_(0.3, 0.95)  # one lambda per sequence

    with torch.no_grad():
        t_gae, (adv, _) = best_time(lambda: gae(rewards, values, mask, gamma, lam), args.repeats, device)
        t_loop, adv_loop = best_time(lambda: gae_loop(rewards, values, gamma, lam), args.repeats, device)
    diff = ((adv - adv_loop * mask).abs().max()).item()
    print(f"device={device} B={b} T={t} gae={t_gae * 1e3:.2f}ms loop={t_loop * 1e3:.2f}ms (best of {args.repeats})")
    last = f"speedup={t_loop / t_gae:.2f} max_abs_diff={diff:.3g}"
    pairs_record(args, last, id="bench-gae", section="Speed and memory",
                 title=f"GAE: rllight's blocked scan against a reverse loop over tokens, B={b} T={t} on {device}",
                 note=f"Both on the same (B, T) float32 batch with one lambda per sequence; best of {args.repeats} "
                      "timed runs each after a warm-up; speedup = loop time / gae time; max_abs_diff = "
                      "max |A_gae - A_loop|.",
                 settings={"device": str(device), "batch": b, "length": t, "repeats": args.repeats,
                           "gae_ms": printed(t_gae * 1e3, ".2f"), "loop_ms": printed(t_loop * 1e3, ".2f")},
                 labels={"gae_ms": "gae (ms)", "loop_ms": "loop (ms)", "max_abs_diff": "max abs diff"},
                 formats={"gae_ms": ".2f", "loop_ms": ".2f", "speedup": ".2f"},
                 headline="{speedup:.2f}x the speed of a reverse loop over tokens")
    print(machine_line())
    print(last)
    return t_loop / t_gae


if __name__ == "__main__":
    main()
