"""Strategies as a user would write them in their own module (not part of rllight)."""

import math
import os

import torch

from rllight.callbacks import RolloutCallback
from rllight.rewards import Verifier
from rllight.errors import ComponentError
from rllight.rollout import HFEngine, RolloutEngine
from rllight.rollout.base import Generation, pad_left
from rllight.strategies import AdvantageEstimator, ClippedSurrogate
from rllight.terms import LossTerm


class DigitReward(Verifier):
    """Fraction of the response's characters that are digits: varies across samples of a random model,
    so group-relative advantages are non-zero."""

    def __call__(self, response: str, answer: str) -> float:
        return sum(c.isdigit() for c in response) / max(len(response), 1) + 0.1 * len(response) / 10


class ConstantReward(Verifier):
    """The same reward for every response: every group-relative advantage is 0, so every update's gradient is."""

    def __call__(self, response: str, answer: str) -> float:
        return 0.0


class FailsOnSync(HFEngine):
    """Hugging Face generate whose ``at``-th weight sync fails after the optimizer stepped, as an engine (a rollout
    worker, a server) that dies while taking the new weights would."""

    def __init__(self, at: int = -1, **kwargs):
        super().__init__(**kwargs)
        self.at, self.syncs = at, 0

    def update_weights(self, model):
        self.syncs += 1
        if self.syncs == self.at:
            raise ComponentError("model.rollout: FailsOnSync died while taking the new weights")
        return super().update_weights(model)


class RawReward(AdvantageEstimator):
    """The outcome reward itself as the advantage of every token (REINFORCE without a baseline)."""

    calls = 0

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, rollout):
        type(self).calls += 1
        adv = self.scale * rollout.rewards.unsqueeze(-1) * rollout.response_mask.float()
        return adv, None


class FlakyReward(Verifier):
    """Raises on the first response and returns NaN on the second."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def __call__(self, response: str, answer: str) -> float:
        self.seen += 1
        if self.seen % 4 == 1:
            raise RuntimeError("verifier crashed")
        if self.seen % 4 == 2:
            return float("nan")
        return 1.0 + torch.rand(()).item()


class EvenAnswer(Verifier):
    """Correct exactly when the reference answer is even, whatever the response: the validation
    accuracy must then equal the share of even answers in the held-out split."""

    def is_correct(self, response: str, answer: str) -> bool:
        return int(answer) % 2 == 0


class NaNLoss(ClippedSurrogate):
    """A policy loss that is NaN from the ``after``-th call on (a diverging run)."""

    def __init__(self, after: int = 0):
        super().__init__()
        self.after = after
        self.calls = 0

    def __call__(self, logprobs, batch):
        self.calls += 1
        loss, stats = super().__call__(logprobs, batch)
        return (loss * float("nan") if self.calls > self.after else loss), stats


class KillAt(RolloutCallback):
    """SIGKILLs its own process in the middle of the RL step that follows global step ``step``."""

    def __init__(self, step: int = -1):
        self.step = step

    def on_rollout(self, trainer, module, rollout):
        if trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return rollout


class DumpState(RolloutCallback):
    """Records, on each rank, the last step's local and global token counts and the final weights
    (to the path in RLLIGHT_TEST_DUMP, with {rank} filled in). A probe: beyond its ``RolloutContext`` it reads the
    policy and the engine of the trainer's module."""

    def __init__(self):
        self.record = {}

    def on_rollout(self, trainer, context, rollout):
        module = trainer.lightning_module
        local = rollout.response_mask.sum().float()
        self.record["local_tokens"] = local.item()
        self.record["global_tokens"] = context.ranks.reduce(local.clone()).item()
        self.record["prompts"] = sorted(rollout.answers)
        self.record.setdefault("prompts_seen", []).extend(sorted(set(rollout.answers)))  # every step's prompts
        self.record.setdefault("rollout_sizes", []).append(len(rollout))
        # Asynchronous rollouts: whether the step's rollout was generated ahead, and its staleness.
        self.record.setdefault("generated_ahead", []).append(float(rollout.extras.get("rollout/generated_ahead", -1)))
        self.record.setdefault("staleness", []).append(float(rollout.extras.get("rollout/staleness", -1)))
        self.record.setdefault("global_steps", []).append(int(trainer.global_step))
        self.record.setdefault("step_answers", []).append(list(rollout.answers))
        self.record.setdefault("step_prompts", []).append(  # each step's prompts, as token ids, in rollout order
            [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask)])
        if "compute_dtype" not in self.record:  # the dtype the first decoder layer computes in (its output's)
            from rllight.fsdp import decoder_layers

            self.record["compute_dtype"] = ""
            hook = lambda layer, args, out: self.record.__setitem__(  # noqa: E731
                "compute_dtype", str((out[0] if isinstance(out, tuple) else out).dtype))
            decoder_layers(module.policy)[0].register_forward_hook(hook)
        if getattr(module.rollout, "tensor_parallel_rank", None) is not None:  # a tensor-parallel engine's part
            self.record["tensor_parallel_rank"] = module.rollout.tensor_parallel_rank
            self.record.setdefault("prompt_ids", []).extend(  # the prompts the rank's rows were generated for
                [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask)])
        tag = getattr(module.rollout, "last_request_id", None)  # a vLLM server's id of the step's completion
        if tag is not None:
            self.record.setdefault("request_ids", []).append(tag)
        if os.environ.get("RLLIGHT_TEST_LOGPROB_GAP"):  # the trainer's log-probs against the engine's sampling ones
            from rllight.rollout.metrics import logprob_mismatch

            with torch.no_grad():
                logprobs = context.scoring.forward(rollout).logprobs
            gap = logprob_mismatch(logprobs, rollout.sample_logprobs, rollout.response_mask)["rollout/logprob_diff_max"]
            self.record.setdefault("logprob_gap", []).append(float(gap))
        return rollout

    def on_train_end(self, trainer, module):
        import os

        import torch

        from rllight.fsdp import decoder_layers, full_tensor, is_dtensor

        params = {f"policy.{n}": full_tensor(p).detach().clone() for n, p in module.policy.named_parameters()}
        if module.critic is not None:
            params.update({f"critic.{n}": full_tensor(p).detach().clone() for n, p in module.critic.named_parameters()})
        losses = {k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith(("policy/loss", "total_loss"))}
        path = os.environ["RLLIGHT_TEST_DUMP"].format(rank=trainer.global_rank)
        stored = str(next(decoder_layers(module.policy)[0].parameters()).dtype)  # the first layer's weights (shards)
        sharded = any(is_dtensor(p) for p in module.policy.parameters())  # FSDP's shards
        source = getattr(module, "prompt_stream", None)  # where the prompts came from: its state at the end
        self.record["prompt_source"] = source.state_dict() if source is not None else {}
        torch.save({**self.record, "params": params, "losses": losses, "final_step": int(trainer.global_step),
                    "stored_dtype": stored, "sharded": sharded}, path)


class AlwaysFails(Verifier):
    """A verifier that raises on every response (e.g. a broken import inside it)."""

    def __call__(self, response: str, answer: str) -> float:
        raise RuntimeError("verifier is broken")


class FlatOnRank1(Verifier):
    """DigitReward on rank 0; on every other rank the same reward for every response, so dynamic sampling
    keeps no group there and that rank's rollout is empty (the DDP path where one rank has nothing)."""

    def __call__(self, response: str, answer: str) -> float:
        import os

        if os.environ.get("LOCAL_RANK", "0") != "0":
            return 0.0
        return DigitReward()(response, answer)


class NaNLossOnRank0(ClippedSurrogate):
    """A non-finite loss on rank 0 at its first update only: every rank must skip that update together."""

    def __init__(self, clip_low: float = 0.2, clip_high: float = 0.28):
        super().__init__(clip_low=clip_low, clip_high=clip_high)
        self.calls = 0

    def __call__(self, logprobs, batch):
        import os

        self.calls += 1
        loss, stats = super().__call__(logprobs, batch)
        if os.environ.get("LOCAL_RANK", "0") == "0" and self.calls == 1:
            loss = loss * float("nan")
        return loss, stats


class HangsOnce(DigitReward):
    """Hangs (sleeps far past any timeout) on the first sample it scores in a run, in whichever worker gets it
    (the marker file named by RLLIGHT_TEST_HANG_ONCE, shared by the workers, says it did); DigitReward
    otherwise. One timeout per run, however the random responses come out."""

    def __call__(self, response: str, answer: str) -> float:
        marker = os.environ["RLLIGHT_TEST_HANG_ONCE"]
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL)  # atomic: only one call ever creates it
        except FileExistsError:
            return super().__call__(response, answer)
        os.close(fd)
        import time

        time.sleep(3600)
        return super().__call__(response, answer)


class EvenLength(Verifier):
    """Correct when the response has an even number of characters: a coin flip per sample of a random
    model, so pass@k differs from avg@k."""

    def is_correct(self, response: str, answer: str) -> bool:
        return len(response) % 2 == 0


class ScriptedEngine(RolloutEngine):
    """Responses that depend on the prompt only, never on the weights: the k-th copy of a prompt in a request
    gets its k-th variant. Two runs that see the same prompts get the same rollouts, whatever their processes
    or sharding, so their updates can be compared. Sampling log-probs are those of a uniform distribution."""

    def generate(self, model, tokenizer, prompts, sampling):
        vocab = len(tokenizer)
        seen, responses = {}, []
        for prompt in prompts:
            k = seen[tuple(prompt)] = seen.get(tuple(prompt), -1) + 1
            base = sum(prompt) * 7 + 13 * k
            length = 2 + base % (self.max_new_tokens - 1)
            tokens = [(base + 31 * j) % vocab for j in range(length)]
            ended = length < self.max_new_tokens and k % 2 == 0
            if ended:
                tokens[-1] = tokenizer.eos_token_id
            responses.append(tokens)
        prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
        width = max(len(r) for r in responses)
        response_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, r in enumerate(responses):
            response_ids[i, : len(r)] = torch.tensor(r)
            response_mask[i, : len(r)] = 1
        truncated = torch.tensor([tokenizer.eos_token_id not in r for r in responses])
        logprobs = -math.log(vocab) * response_mask.float()
        return Generation(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, truncated)


class RankOwnDraws(RolloutCallback):
    """Rank 1 draws from the global random stream after each rollout, so the ranks' streams differ (as they do
    whenever the ranks' generations take different numbers of draws): a resume must restore each rank's own."""

    def on_rollout(self, trainer, module, rollout):
        if trainer.global_rank == 1:
            torch.rand(7)
        return rollout


class DumpEveryRollout(DumpState):
    """``DumpState`` before value pretraining consumes the rollout: every rollout is recorded, pretraining's too, with
    its groups' sizes (``group_sizes``)."""

    rollout_order = 10

    def on_rollout(self, trainer, context, rollout):
        sizes = rollout.group_ids.unique(return_counts=True)[1]
        self.record.setdefault("group_sizes", []).append(sorted(sizes.tolist()))
        return super().on_rollout(trainer, context, rollout)


class FailAt(RolloutCallback):
    """Raises in the RL step that follows global step ``step`` (after its rollout, before its updates)."""

    def __init__(self, step: int = -1):
        self.step = step

    def on_rollout(self, trainer, module, rollout):
        if trainer.global_step == self.step:
            raise RuntimeError("a failure in the middle of a step")
        return rollout


class FaultyLogprobEngine(ScriptedEngine):
    """The scripted responses with what a faulty engine or server sends back: ``fault`` ``nan`` (a NaN log-prob),
    ``positive`` (a log-prob above 0) or ``long`` (one response longer than ``max_new_tokens``)."""

    def __init__(self, fault: str = "nan", **kwargs):
        super().__init__(**kwargs)
        self.fault = fault

    def generate(self, model, tokenizer, prompts, sampling):
        gen = super().generate(model, tokenizer, prompts, sampling)
        if self.fault == "nan":
            gen.logprobs[0, 0] = float("nan")
        elif self.fault == "positive":
            gen.logprobs[0, 0] = 0.5
        elif self.fault == "long":
            extra = torch.full((len(prompts), self.max_new_tokens), tokenizer.pad_token_id, dtype=torch.long)
            gen.response_ids = torch.cat([gen.response_ids, extra], dim=1)
            gen.response_mask = torch.cat([gen.response_mask, torch.ones_like(extra)], dim=1)
            gen.logprobs = torch.cat([gen.logprobs, torch.full(extra.shape, -1.0)], dim=1)
        return gen


class FailOnRank(RolloutCallback):
    """Raises ``ValueError`` on global rank ``rank`` only (with ``kill``, SIGKILLs that rank's process instead), in the
    RL step that follows global step ``step``: the other ranks go on to the step's first collective and wait there."""

    def __init__(self, rank: int = 1, step: int = 1, kill: bool = False):
        self.rank, self.step, self.kill = rank, step, kill

    def on_rollout(self, trainer, module, rollout):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            if self.kill:
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"a failure on rank {self.rank} only")
        return rollout


class MixedForAnswers(Verifier):
    """DigitReward for the reference answers listed in RLLIGHT_TEST_MIXED_ANSWERS (comma-separated), else 0 for every
    response: with responses that depend on the prompt only (``ScriptedEngine``), dynamic sampling keeps the groups
    of the same prompts on any number of processes, and a test chooses how many each rank keeps."""

    def __call__(self, response: str, answer: str) -> float:
        mixed = os.environ["RLLIGHT_TEST_MIXED_ANSWERS"].split(",")
        return DigitReward()(response, answer) if str(answer) in mixed else 0.0


class StepTag(RolloutCallback):
    """Tags each rollout with the global step it starts at (``test/step``, a scalar extra: it stays with the rank's
    own rollout, and its minibatches carry it)."""

    def on_rollout(self, trainer, module, rollout):
        rollout.extras["test/step"] = float(trainer.global_step)
        return rollout


class RecordRows(LossTerm):
    """Adds nothing to the loss. At each policy update, records this rank's rows (prompt tokens, response text, the
    advantage summed over the response), the update's global row count and its step's ``test/step``; writes the
    records to RLLIGHT_TEST_ROWS ({rank} filled in) after every update."""

    needs_logprobs = False
    trains = ()

    def __init__(self):
        self.updates = []

    def begin(self, minibatch, aggregation, global_sum):
        import json

        rows = [[p[m.bool()].tolist(), text, float(a.sum())] for p, m, text, a in zip(
            minibatch.prompt_ids, minibatch.prompt_mask, minibatch.texts, minibatch.advantages)]
        total = global_sum(torch.tensor(float(len(minibatch)), device=minibatch.response_mask.device))
        self.updates.append({"step": minibatch.extras.get("test/step", -1.0), "rows": rows, "global_rows": int(total)})
        with open(os.environ["RLLIGHT_TEST_ROWS"].format(rank=os.environ.get("LOCAL_RANK", "0")), "w") as f:
            json.dump(self.updates, f)

    def __call__(self, batch, out, aggregate):
        return torch.zeros((), device=batch.response_mask.device), {}
