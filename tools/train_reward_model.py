"""Train an outcome reward model for the quickstart task: a sequence classifier that predicts whether a response of
the base policy is correct, for recipes/reward-model-quickstart.yaml.

1. **Samples**: the base policy (``--base``, default the quickstart's SmolLM2-135M-Instruct) answers ``--prompts``
   training problems of the quickstart's arithmetic task (``rllight.data.ArithmeticTask``, the rows the RL run
   trains on) ``--samples`` times each, at the quickstart's sampling (temperature 0.7, at most 24 new tokens,
   ``rllight.rollout.HFEngine``). The exact match (``IntegerMatch``) labels each response 1 or 0.
2. **Classifier**: the base model with a one-label score head (``AutoModelForSequenceClassification``, the head
   initialised by transformers), trained ``--epochs`` passes with the logistic loss on those labels, AdamW at
   ``--lr``, batches of ``--batch-size``. Each text is the row's messages and the response as the assistant's turn in
   the chat template, tokenized as ``rllight.rewards.RewardModel`` renders it when it scores, so the classifier is
   trained on exactly what it reads in a run.
3. **Held-out check**: the same sampling on the task's first ``--heldout`` held-out problems (the quickstart's
   evaluation split); the classifier's AUC (the chance that a correct response outscores a wrong one) and its
   accuracy at score 0, before training (the fresh head) and after.

The folder ``--out`` (default ``runs/reward-model/model``) holds the classifier and its tokenizer. The last line is
``auc_before=<x> auc_after=<x> accuracy_after=<x> positives=<fraction of correct training responses>``.

    .venv/bin/python tools/train_reward_model.py                        # about half an hour on 2 cores
    .venv/bin/python tools/train_reward_model.py --record docs/results/reward-model-quickstart.json --shared no
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rllight.machine import machine_line  # noqa: E402
from rllight.app.records import add_record_options, check_record_options, pairs_record  # noqa: E402
from rllight.models import quiet_transformers  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="The base policy's folder (default: the quickstart's SmolLM2-135M-Instruct).")
    p.add_argument("--out", default="runs/reward-model/model", help="The classifier's folder (must not exist).")
    p.add_argument("--prompts", type=int, default=400, help="Training problems sampled.")
    p.add_argument("--samples", type=int, default=8, help="Responses per problem.")
    p.add_argument("--heldout", type=int, default=100, help="Held-out problems for the check.")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    add_record_options(p, id="reward-model-quickstart", section="Methods on the quickstart task")
    args = p.parse_args(argv)
    for name in ("prompts", "samples", "heldout", "epochs", "batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if os.path.exists(args.out):
        p.error(f"--out {args.out} exists; give a new folder (this tool does not overwrite one)")
    check_record_options(p, args, argv, __file__)
    return args


def labelled_samples(policy, tokenizer, rows: list[dict], n: int, max_new_tokens: int, seed: int) -> list:
    """``n`` responses of ``policy`` per row at the quickstart's sampling, as ``Sample``s with their exact-match
    label in ``row["label"]``."""
    from rllight.rewards import IntegerMatch, Sample
    from rllight.rollout import HFEngine
    from rllight.rollout.base import Sampling
    from rllight.rollout.producer import encode_chat

    engine, reward = HFEngine(max_new_tokens=max_new_tokens, temperature=0.7, batch_size=64), IntegerMatch()
    out = []
    for start in range(0, len(rows), 16):
        chunk = rows[start:start + 16]
        messages = [[{"role": "user", "content": r["prompt"]}] for r in chunk]
        prompts = [encode_chat(tokenizer, m) for m in messages for _ in range(n)]
        gen = engine.generate(policy, tokenizer, prompts, Sampling(max_new_tokens, 0.7, seed=seed + start))
        texts = tokenizer.batch_decode(gen.response_ids, skip_special_tokens=True)
        for i, text in enumerate(texts):
            row = chunk[i // n]
            label = float(reward(text, row["answer"]) >= reward.correct)
            out.append(Sample(prompt="", messages=messages[i // n], response=text, response_ids=[],
                              answer=row["answer"], row={"label": label}, group=start + i // n))
    return out


def auc(scores: list[float], labels: list[float]) -> float | None:
    """P(a correct response's score > a wrong one's), ties half; None without both kinds."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with quiet_transformers():
        return train(args)


def train(args: argparse.Namespace) -> int:
    """Sample, label, train and check (the module's docstring); prints the result line last."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rllight.data import ArithmeticTask
    from rllight.models import HFModel, SmolLM2Package
    from rllight.rewards import RewardModel

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    base = args.base or SmolLM2Package().resolve()
    train_rows, val_rows = ArithmeticTask().splits()
    policy, tokenizer = HFModel(base).load()
    t0 = time.perf_counter()
    train = labelled_samples(policy, tokenizer, train_rows[:args.prompts], args.samples, args.max_new_tokens, args.seed)
    heldout = labelled_samples(policy, tokenizer, val_rows[:args.heldout], args.samples, args.max_new_tokens,
                               args.seed + 10**6)
    del policy
    print(f"train_reward_model: {len(train)} training and {len(heldout)} held-out responses sampled in "
          f"{time.perf_counter() - t0:.0f} s; {sum(s.row['label'] for s in train) / len(train):.3f} of the training "
          "ones correct", flush=True)
    net = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    net.config.pad_token_id = tokenizer.pad_token_id
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    net.save_pretrained(args.out)  # the fresh head: RewardModel renders and scores from this folder
    tokenizer.save_pretrained(args.out)
    scorer = RewardModel(args.out, batch_size=32, dtype="float32", device="cpu")
    scorer.load_tokenizer()
    before = auc(scorer.forward([scorer.text(s) for s in heldout]), [s.row["label"] for s in heldout])
    encoded = [(scorer._ids(s), s.row["label"]) for s in train]
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    net.train()
    order = list(range(len(encoded)))
    for epoch in range(args.epochs):
        random.shuffle(order)
        total = 0.0
        for start in range(0, len(order), args.batch_size):
            batch = [encoded[i] for i in order[start:start + args.batch_size]]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for j, (ids, _) in enumerate(batch):
                input_ids[j, :len(ids)], mask[j, :len(ids)] = torch.tensor(ids), 1
            logits = net(input_ids=input_ids, attention_mask=mask).logits[:, 0]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor([y for _, y in batch]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        print(f"train_reward_model: epoch {epoch + 1}/{args.epochs} loss {total / len(order):.4f}", flush=True)
    net.eval()
    net.save_pretrained(args.out)
    scorer = RewardModel(args.out, batch_size=32, dtype="float32", device="cpu")
    scorer.load_tokenizer()
    scores = scorer.forward([scorer.text(s) for s in heldout])
    labels = [s.row["label"] for s in heldout]
    after = auc(scores, labels)
    accuracy = sum((s > 0) == bool(y) for s, y in zip(scores, labels)) / len(labels)
    positives = sum(s.row["label"] for s in train) / len(train)
    print(f"train_reward_model: the classifier is in {args.out}")
    line = (f"auc_before={'-' if before is None else format(before, '.3f')} "
            f"auc_after={'-' if after is None else format(after, '.3f')} accuracy_after={accuracy:.3f} "
            f"positives={positives:.3f}")
    pairs_record(args, line, id="reward-model-quickstart", section="Methods on the quickstart task",
                 title="An outcome reward model for the quickstart task, trained on the base policy's responses",
                 settings={"prompts": args.prompts, "samples": args.samples, "epochs": args.epochs, "lr": args.lr,
                           "heldout_responses": len(heldout)},
                 note="tools/train_reward_model.py: the base policy's responses to training problems labelled by the "
                      "exact match; a one-label classifier from the base model trained with the logistic loss; AUC "
                      "and accuracy (score > 0 means correct) on responses to held-out problems, before (the fresh "
                      "head) and after training; positives: the fraction of correct training responses.")
    print(machine_line())
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
