"""Measure a model on held-out games of a textarena recipe: win rate, mean reward, turns, invalid moves, transcripts.

The recipe (``--recipe``, default ``recipes/env-textarena-guess.yaml``, with ``--config`` overlays applied after it)
names the environment (``rllight.envs.textarena.TextArena``), the engine and its sampling, the base model and the
data: the held-out games are the first ``--games`` seeds of its ``data.task``'s held-out range
(``rllight.data.seeded.SeededTask``: from its ``val_seed``), one game each. Each model plays them through the
trainer's own episode runner (``rllight.rollout.episodes.run_episodes``: token in, token out, every call into a
game under the episode guard), greedily (``--temperature 0``, the default) or sampled with a fixed seed
(``--temperature T --sampling-seed S``), with the recipe's ``max_new_tokens``, ``max_turns`` and
``max_total_tokens``.

Models: the recipe's base model ("base"); ``--model PATH`` (a Hugging Face folder, e.g. a run's export) as "trained";
or with ``--train`` the recipe trained first, one ``rllight fit`` subprocess from the repository root with only
``seed_everything`` (``--seed``), ``trainer.default_root_dir`` and ``model.export_dir`` (under ``--out``) and
``trainer.enable_checkpointing: false`` changed, its exported model the "trained" one (its wall time is reported).

Per model: ``win_rate`` (games won: the game's reward reached the environment's ``win_reward``), ``reward_mean`` (the
episode's reward: the game's final reward, 0 for a game cut by the limits), ``turns_mean`` (model turns per game,
resubmissions after invalid moves included), ``invalid_share`` (moves the game refused / moves), ``cut_share`` (games
cut by ``max_turns`` or ``max_total_tokens`` before their end). The table has one row per model with the first
held-out game's transcript, and one more row per model and further example game (``--examples``); the transcripts in
full go to ``<out>/env_measure.md``. The last lines name the machine and give
``win_rate_before=<x> win_rate_after=<y> reward_mean_before=... invalid_share_after=...``.

Full measurement (one training run of the recipe, then 200 held-out games per model; run it alone)::

    .venv/bin/python tools/env_measure.py --train --games 200 --out runs/env-measure \\
        --record docs/results/env-textarena-guess.json --shared no
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rllight.machine import machine_line
from rllight.app.records import add_record_options, check_record_options, printed, tool_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "recipes/env-textarena-guess.yaml"
INVALID = "You attempted an invalid move. Reason: "  # how textarena's single-player games open a refusal
HEADLINE = ("win rate {win_rate_before:.3f} → {win_rate_after:.3f}, invalid moves {invalid_share_before:.3f} → "
            "{invalid_share_after:.3f}")
METRICS = ("win_rate", "reward_mean", "turns_mean", "invalid_share", "cut_share")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=RECIPE, help="The environment recipe (from the repository root).")
    p.add_argument("--config", action="append", default=[], help="An overlay applied after the recipe (repeatable).")
    p.add_argument("--model", help="A trained model folder to measure after the base model.")
    p.add_argument("--train", action="store_true", help="Train the recipe first and measure its exported model.")
    p.add_argument("--seed", type=int, default=0, help="seed_everything of the training run.")
    p.add_argument("--games", type=int, default=100, help="Held-out games per model (the first held-out seeds).")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else sampled with --sampling-seed.")
    p.add_argument("--sampling-seed", type=int, default=0, help="The seed of every sampled turn (temperature > 0).")
    p.add_argument("--examples", type=int, default=3, help="Games whose transcripts are shown, per model.")
    p.add_argument("--out", default="runs/env-measure", help="Folder for the training run and env_measure.md.")
    add_record_options(p, id="env-textarena-guess", section="Environments")
    args = p.parse_args(argv)
    if args.model and args.train:
        p.error("--model and --train both name the trained model; give one")
    if args.games < 1 or args.examples < 0 or args.temperature < 0:
        p.error("--games must be >= 1, --examples >= 0 and --temperature >= 0")
    check_record_options(p, args, argv, __file__)
    return args


def config_args(args: argparse.Namespace, *extra: str) -> list[str]:
    """The CLI arguments of the recipe and its overlays (``extra`` before the user's, so theirs win)."""
    return ["--config", args.recipe, *[a for c in (*extra, *args.config) for a in ("--config", c)]]


# ------------------------------------------------------------------------------------------- training
def train(args: argparse.Namespace) -> tuple[str, float]:
    """``rllight fit`` of the recipe in a subprocess: the exported model's folder and the run's wall time."""
    run_dir = os.path.join(args.out, "train")
    os.makedirs(run_dir, exist_ok=True)
    overlay = os.path.join(run_dir, "overlay.yaml")
    with open(overlay, "w") as f:
        yaml.safe_dump({"seed_everything": args.seed,
                        "trainer": {"default_root_dir": run_dir, "enable_checkpointing": False},
                        "model": {"export_dir": os.path.join(run_dir, "model")}}, f, sort_keys=False)
    cmd = [sys.executable, "-m", "rllight", "fit", *config_args(args, overlay)]
    print(f"env_measure: training: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - start
    model = os.path.join(run_dir, "model")
    if proc.returncode != 0 or not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit(f"env_measure: the training run failed (exit {proc.returncode}); see {run_dir}/stdout.log")
    return model, wall


# ------------------------------------------------------------------------------------------- games
def setup(args: argparse.Namespace):
    """The recipe's parts the games need: ``(environment, engine, base model source, held-out rows)``."""
    from rllight.app.cli import RLLightCLI

    cli = RLLightCLI(args=config_args(args), run=False)
    module, data = cli.model, cli.datamodule
    if module.environment is None:
        raise SystemExit(f"env_measure: {args.recipe} has no model.environment")
    task = data.task
    if callable(getattr(task, "rows", None)) and hasattr(task, "val_seed"):  # a SeededTask: any number of games
        if task.val_seed < task.seed + task.train_size and task.seed < task.val_seed + args.games:
            raise SystemExit(f"env_measure: {args.games} held-out seeds from {task.val_seed} reach the training "
                             f"seeds ({task.seed}..{task.seed + task.train_size - 1}); ask for fewer games")
        rows = task.rows(task.val_seed, args.games)
    else:
        data.setup("validate")
        rows = data.val_rows[: args.games]
        if len(rows) < args.games:
            raise SystemExit(f"env_measure: the recipe holds out {len(rows)} rows, fewer than --games {args.games}")
    for row in rows:
        row.setdefault("messages", data.messages(row["prompt"]))
    return module.environment, module.rollout, module.source, rows


@dataclasses.dataclass
class Game:
    """One held-out game as a model played it: the episode (a ``TextArena`` with its record), its trajectory, the
    episode's reward and whether it was won (both 0 / False for an episode whose call into the game failed)."""

    episode: object
    traj: object
    reward: float
    won: bool

    @property
    def cut(self) -> bool:
        """Cut by ``max_turns`` or ``max_total_tokens`` before the game's end."""
        return not self.traj.failed and not getattr(self.episode, "finished", True)


def play(environment, engine, source, rows: list[dict], args: argparse.Namespace) -> list[Game]:
    """Each row's game played once by the model ``source`` loads, in row order."""
    import torch

    from rllight.envs.guard import EpisodeGuard
    from rllight.rollout.episodes import run_episodes, start_episodes, trajectory_rewards

    policy, tokenizer = source.load()
    policy.eval()
    sampling = dataclasses.replace(engine.sampling, temperature=args.temperature,
                                   seed=args.sampling_seed if args.temperature > 0 else None)
    guard = EpisodeGuard(environment)
    environment.tokenizer = tokenizer
    # As the producer plays them: the same resets, merge rule and tools; one game per row.
    episodes, prompts, failed, conversations, tools = start_episodes(environment, tokenizer, guard, rows, 1)
    with torch.no_grad():
        trajs = run_episodes(engine, policy, tokenizer, episodes, prompts, sampling, guard=guard, failed=failed,
                             conversations=conversations, tools=tools)
    rewards = trajectory_rewards(guard, episodes, trajs)
    games = [Game(episode, traj, reward, bool(traj.correct))
             for episode, traj, reward in zip(episodes, trajs, rewards)]
    if guard.failures:
        print(f"env_measure: {guard.summary(len(trajs))}", file=sys.stderr)
    return games


def summarise(games: list[Game]) -> dict:
    """The metrics of one model's games (see the module's docstring)."""
    moves = sum(getattr(g.episode, "moves", 0) for g in games)
    invalid = sum(getattr(g.episode, "invalid_moves", 0) for g in games)
    return {"games": len(games),
            "win_rate": statistics.fmean(g.won for g in games),
            "reward_mean": statistics.fmean(g.reward for g in games),
            "turns_mean": statistics.fmean(len(g.traj.all_turns) for g in games),
            "invalid_share": invalid / moves if moves else None,
            "cut_share": statistics.fmean(g.cut for g in games)}


def short(text: str, width: int = 48) -> str:
    """``text`` on one line, a refusal's boilerplate dropped, cut to ``width`` characters."""
    text = " ".join(str(text).replace(INVALID, "invalid: ").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def transcript_line(game: Game) -> str:
    """One game in a line: each move and the game's reply, then the end (``"move" → reply · ...``)."""
    record = list(getattr(game.episode, "transcript", []))[1:]  # the opening is the prompt
    parts = []
    for i, (speaker, text) in enumerate(record):
        if speaker == "model":
            reply = record[i + 1][1] if i + 1 < len(record) else ""
            parts.append(f"{json.dumps(short(text, 32), ensure_ascii=False)} → {short(reply)}")
    if game.traj.failed:
        parts.append("(failed)")
    elif game.cut:
        parts.append("(cut by the limits)")
    return " · ".join(parts) + f" [reward {game.reward:.2f}]"


def transcript_block(name: str, row: dict, game: Game) -> str:
    """One game in full, for ``env_measure.md``."""
    lines = [f"### {name}, seed {row.get('seed')} (reward {game.reward:.3f}, {'won' if game.won else 'not won'})", ""]
    for speaker, text in getattr(game.episode, "transcript", []):
        lines += [f"**{speaker}**:", "", "    " + str(text).replace("\n", "\n    "), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- report
COLUMNS = [["model", "model"], ["games", "games"], ["win_rate", "win rate", ".3f"],
           ["reward_mean", "mean reward", ".3f"], ["turns_mean", "mean turns", ".2f"],
           ["invalid_share", "invalid moves", ".3f"], ["cut_share", "cut by limits", ".3f"],
           ["train_wall_s", "training wall time (s)", ".0f"], ["game", "game (seed): moves → replies"]]


def rows_of(name: str, games: list[Game], rows: list[dict], examples: int, wall: float | None) -> list[dict]:
    """The record's rows of one model: its metrics with the first game's transcript, then one row per further
    example game."""
    metrics = summarise(games)
    lines = [f"({row.get('seed')}) {transcript_line(game)}" for game, row in zip(games[:examples], rows)]
    first = {"model": name, "games": metrics["games"],
             **{k: printed(metrics[k], ".2f" if k == "turns_mean" else ".3f") for k in METRICS},
             "train_wall_s": printed(wall, ".0f"), "game": lines[0] if lines else None}
    return [first] + [{"model": name, "game": line} for line in lines[1:]]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = ["" if r.get(c[0]) is None else (format(r[c[0]], c[2]) if len(c) > 2 else str(r[c[0]]))
                 for c in COLUMNS]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def summary_of(measured: dict[str, list]) -> dict:
    """``<metric>_before`` (the base model) and ``<metric>_after`` (the trained one, where measured)."""
    out = {}
    for when, name in (("before", "base"), ("after", "trained")):
        if name in measured:
            metrics = summarise(measured[name])
            out.update({f"{k}_{when}": printed(metrics[k], ".2f" if k == "turns_mean" else ".3f") for k in METRICS})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    trained, wall = (train(args) if args.train else (args.model, None))
    environment, engine, base, rows = setup(args)
    models = [("base", base)]
    if trained:
        from rllight.models import HFModel

        models.append(("trained", HFModel(os.path.abspath(trained))))
    measured, record_rows, blocks = {}, [], []
    for name, source in models:
        print(f"env_measure: {name}: {len(rows)} held-out games", flush=True)
        measured[name] = play(environment, engine, source, rows, args)
        record_rows += rows_of(name, measured[name], rows, args.examples, wall if name == "trained" else None)
        blocks += [transcript_block(name, row, game) for game, row in zip(measured[name][: args.examples], rows)]
    text = table(record_rows)
    print("\n" + text)
    with open(os.path.join(args.out, "env_measure.md"), "w") as f:
        f.write(text + "\n\n## Transcripts\n\n" + "\n".join(blocks) + "\n")
    summary = summary_of(measured)
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}, seed {args.sampling_seed}"
    game = getattr(environment, "game", type(environment).__name__)
    tool_record(
        args, id="env-textarena-guess", section="Environments",
        title=(f"{game} before and after training with {args.recipe}" if trained else
               f"{game}, the base model of {args.recipe}") + f" ({len(rows)} held-out games, {sampling})",
        note="tools/env_measure.py: the recipe's base model"
             + (f" and the model of one run of the recipe as written (seed {args.seed}; no checkpoints)" if args.train
                else " and the given trained model" if trained else "")
             + f" each play the same {len(rows)} held-out games (the first held-out seeds), one episode each, "
             f"{sampling}, through the trainer's episode runner. Win rate: games won; mean reward: the game's final "
             "reward (0 for a game cut by max_turns or max_total_tokens); mean turns: model turns per game, "
             "resubmissions included; invalid moves: moves the game refused, per move. The game column shows held-out "
             "games move by move. The training wall time includes loading the model and the recipe's own evaluations.",
        columns=COLUMNS, rows=record_rows, summary=summary,
        headline=HEADLINE if trained else "win rate {win_rate_before:.3f}")
    print(machine_line())
    print(" ".join(f"{k}={'-' if v is None else v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
