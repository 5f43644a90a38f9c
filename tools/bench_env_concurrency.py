"""Time a multi-turn rollout whose environment is slow, its episodes stepped one after another and at once.

The environment's ``step`` sleeps ``--sleep`` seconds (a tool call, an HTTP round-trip) and ends the episode. A tiny
random model built in a temporary folder (``rllight.testing.build_tiny_model``) generates ``--new-tokens`` tokens for
``--prompts`` prompts x ``--group`` episodes, through the trainer's own path (``RolloutProducer.sample`` with the
environment). The same rollout runs with ``max_concurrency: 1`` (one step after another) and with ``max_concurrency``
equal to the number of episodes, each ``--repeats`` times, taking turns; the best time of each counts. The line
before the last names the machine (``rllight.machine``); the last line is

    sequential_s=<best time, one at a time> concurrent_s=<best time, at once> episode_sleep_s=<--sleep> speedup=<ratio>

A speedup near the number of episodes, and a concurrent time near one sleep plus the generation, say that a turn
costs its slowest episode rather than the sum. ``--record PATH`` also writes them as a record (id
``bench-env-concurrency``).

Usage: python tools/bench_env_concurrency.py [--prompts 4] [--group 4] [--sleep 0.5] [--record docs/results/]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rllight.envs import Environment, StepResult  # noqa: E402
from rllight.machine import machine_line  # noqa: E402
from rllight.app.records import add_record_options, check_record_options, pairs_record  # noqa: E402


class SlowTool(Environment):
    """Each step sleeps ``sleep`` seconds, then ends the episode with reward 1."""

    def __init__(self, sleep: float, max_concurrency: int):
        super().__init__(max_turns=1, max_total_tokens=512, timeout_seconds=max(30.0, 10 * sleep),
                         max_concurrency=max_concurrency)
        self.sleep = sleep

    def step(self, response_text: str) -> StepResult:
        time.sleep(self.sleep)
        return StepResult(observation=None, reward=1.0, done=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="Episodes per prompt.")
    p.add_argument("--sleep", type=float, default=0.5, help="Seconds each step takes.")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    add_record_options(p, id="bench-env-concurrency", section="Speed and memory")
    args = p.parse_args(argv)
    if min(args.prompts, args.group, args.new_tokens, args.repeats) < 1 or args.sleep < 0:
        p.error("--prompts, --group, --new-tokens and --repeats must be >= 1 and --sleep >= 0")
    check_record_options(p, args, argv, __file__)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from rllight.models import HFModel
    from rllight.rewards import IntegerMatch
    from rllight.rollout import HFEngine
    from rllight.rollout.producer import RolloutProducer
    from rllight.testing import build_tiny_model

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        policy, tokenizer = HFModel(build_tiny_model(os.path.join(tmp, "model"))).load()
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)}
            for i in range(args.prompts)]
    episodes = args.prompts * args.group
    best = {}
    for _ in range(args.repeats):
        for name, limit in (("sequential", 1), ("concurrent", episodes)):
            producer = RolloutProducer(HFEngine(max_new_tokens=args.new_tokens, temperature=1.0), IntegerMatch(),
                                       environment=SlowTool(args.sleep, limit))
            producer.bind(policy, tokenizer)
            start = time.perf_counter()
            rollout = producer.sample(rows, args.group)
            elapsed = time.perf_counter() - start
            if rollout.extras["episode/failures"]:
                raise SystemExit(f"bench_env_concurrency: {rollout.extras['episode/failures']:.0f} episodes failed")
            best[name] = min(best.get(name, float("inf")), elapsed)
    line = (f"sequential_s={best['sequential']:.3f} concurrent_s={best['concurrent']:.3f} "
            f"episode_sleep_s={args.sleep:g} speedup={best['sequential'] / best['concurrent']:.2f}")
    pairs_record(args, line, id="bench-env-concurrency", section="Speed and memory",
                 title=f"A slow environment's rollout, {episodes} episodes one after another and at once",
                 settings={"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
                           "repeats": args.repeats},
                 note="tools/bench_env_concurrency.py: a tiny random model generates one turn per episode through "
                      "RolloutProducer.sample; each step of the environment sleeps episode_sleep_s. The best of "
                      "the repeats with max_concurrency 1 and with max_concurrency equal to the episodes.")
    print(machine_line())
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
