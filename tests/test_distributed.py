"""Lightning DDP on 2 CPU processes (gloo): training runs, the ranks stay in sync, the loss is normalised
by the global token count, and the checkpoint loads. (VAPO's and SPPO's callbacks and critics on 2 processes, and
their match with one process, are in tests/test_fsdp.py.)"""

from types import SimpleNamespace

import pytest
import torch

from helpers import fit_in_child, tiny_overrides


@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(
        tmp_path,
        tiny_model_dir,
        critic={"class_path": "rllight.critics.ValueHead"},
        advantage={"class_path": "rllight.strategies.GAE"},
    )
    out = tmp_path / "export"
    run = fit_in_child(
        "ppo.yaml",
        "--config",
        overlay,
        "--trainer.strategy",
        "ddp",
        "--trainer.devices",
        "2",
        "--trainer.accelerator",
        "cpu",
        "--trainer.max_steps",
        "2",
        "--model.batching.minibatch_size",
        "null",
        "--model.batching.ppo_epochs",
        "1",
        "--model.export_dir",
        str(out),
        "--trainer.enable_checkpointing",
        "true",
        "--trainer.callbacks+",
        "user_strategies.DumpState",
        "--trainer.callbacks+",
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.dirpath",
        str(tmp_path / "ckpt"),
        "--trainer.callbacks.save_last",
        "true",
        timeout=900,
        RLLIGHT_TEST_DUMP=str(tmp_path / "rank{rank}.pt"),
    )
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    # The ranks trained on different prompts...
    assert r0["local_tokens"] != r1["local_tokens"] or r0["prompts"] != r1["prompts"]
    # ...with one global denominator: the sum of both ranks' valid tokens.
    assert r0["global_tokens"] == r1["global_tokens"] == r0["local_tokens"] + r1["local_tokens"]
    # ...and hold identical weights afterwards (policy and value head).
    for name, p in r0["params"].items():
        torch.testing.assert_close(r1["params"][name], p, rtol=0, atol=0, msg=name)
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 2 and any(k.startswith("critic.") for k in state["state_dict"])
    assert (out / "config.json").exists()


def _ddp_overlay(tmp_path, tiny_model_dir, name, **model):
    """The tiny-model overlay plus what every 2-rank run here needs."""
    return tiny_overrides(tmp_path / name, tiny_model_dir, **model)


DDP = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
       "--trainer.callbacks+", "user_strategies.DumpState"]


def _same_weights_on_both_ranks(tmp_path):
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for name, p in r0["params"].items():
        torch.testing.assert_close(r1["params"][name], p, rtol=0, atol=0, msg=name)
    return r0, r1


@pytest.mark.slow
def test_ddp_dapo_with_the_draw_cap_hit_an_empty_rank_and_a_nan_loss_on_the_other(tmp_path, tiny_model_dir):
    """Dynamic sampling where rank 1 keeps no group (its reward is flat) and the draw cap is hit on rank 0,
    so the ranks reach different rollout sizes; rank 0's first loss is NaN. Every rank must make the same
    updates (no hang), skip the NaN update together, and end with identical weights."""
    (tmp_path / "dapo").mkdir()
    overlay = _ddp_overlay(tmp_path, tiny_model_dir, "dapo", reward={"class_path": "user_strategies.FlatOnRank1"},
                           policy_loss={"class_path": "user_strategies.NaNLossOnRank0"})
    run = fit_in_child("dapo.yaml", "--config", overlay, *DDP, "--trainer.max_steps", "3",
                       "--model.sampler.init_args.target_groups", "8", "--model.sampler.init_args.max_rounds", "2",
                       timeout=900, RLLIGHT_TEST_DUMP=str(tmp_path / "rank{rank}.pt"))
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = _same_weights_on_both_ranks(tmp_path)
    assert all(n > 0 for n in r0["rollout_sizes"]) and all(n == 0 for n in r1["rollout_sizes"])
    assert "cap hit" in run.stderr
    # The NaN update was skipped on both ranks, once (each rank logs its skip).
    assert run.stderr.count("non-finite loss or gradient; update skipped (1 in a row)") == 2, run.stderr[-4000:]


@pytest.mark.slow
def test_ddp_ranks_each_generate_their_own_share_ahead(tmp_path, tiny_model_dir):
    """Two DDP ranks, each with its own rollout worker and max_staleness 1 (one update per step here): from the
    second step on, every rank trains on a rollout its worker generated during the previous update, for the
    rows its own loader then hands it (the prefetch computed the rank's share of the batches correctly; a wrong
    guess would be generated again, not ahead), and both ranks end with the same weights."""
    engine = {"class_path": "rllight.rollout.worker.ProcessEngine",
              "init_args": {"engine": {"class_path": "rllight.rollout.HFEngine"}, "max_new_tokens": 6,
                            "max_staleness": 1}}
    (tmp_path / "async").mkdir()
    overlay = _ddp_overlay(tmp_path, tiny_model_dir, "async", rollout=engine)
    run = fit_in_child("grpo.yaml", "--config", overlay, *DDP, "--trainer.max_steps", "3", timeout=900,
                       RLLIGHT_TEST_DUMP=str(tmp_path / "rank{rank}.pt"))
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = _same_weights_on_both_ranks(tmp_path)
    for record in (r0, r1):
        assert record["generated_ahead"] == [0.0, 1.0, 1.0]
        assert record["staleness"] == [0.0, 1.0, 1.0]
    assert r0["prompts"] != r1["prompts"]


@pytest.mark.slow
@pytest.mark.vllm
def test_each_rank_samples_from_its_own_vllm_engine_synced_after_every_update(tmp_path):
    """vLLM on every rank: two FSDP processes (the sync gathers the shards one weight at a time; DDP syncs its
    whole copy as one process does), each with a vLLM engine of its own in its rollout worker, synced after
    every update. Every step (after the first, each follows a sync), each rank's sampled log-probs are its
    trainer's within the single-process test's tolerance, and the ranks end with the same weights."""
    pytest.importorskip("vllm")
    from rllight.testing import build_tiny_model

    model_dir = build_tiny_model(str(tmp_path / "model"), hidden_size=64)  # vLLM's CPU attention: head dim 32
    engine = {"class_path": "rllight.rollout.worker.ProcessEngine",
              "init_args": {"engine": {"class_path": "rllight.rollout.vllm.VLLMEngine",
                                       "init_args": {"kv_cache_gb": 0.0625, "enforce_eager": True,
                                                     "max_model_len": 256}},
                            "max_new_tokens": 6}}
    (tmp_path / "vllm").mkdir()
    overlay = _ddp_overlay(tmp_path, model_dir, "vllm", rollout=engine)
    fsdp = "{class_path: rllight.fsdp.FSDP}"
    run = fit_in_child("grpo.yaml", "--config", overlay, *DDP, "--trainer.strategy", fsdp,
                       "--trainer.max_steps", "3", timeout=900, RLLIGHT_TEST_DUMP=str(tmp_path / "rank{rank}.pt"),
                       RLLIGHT_TEST_LOGPROB_GAP="1")
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = _same_weights_on_both_ranks(tmp_path)
    assert r0["prompts"] != r1["prompts"]
    for record in (r0, r1):
        assert len(record["logprob_gap"]) == 3
        assert max(record["logprob_gap"]) < 1e-5, record["logprob_gap"]


@pytest.mark.slow
@pytest.mark.vllm
def test_two_ranks_share_one_tensor_parallel_vllm_engine_and_each_samples_its_own_prompts(tmp_path):
    """Tensor parallelism inside colocated engines: the two DDP ranks' rollout workers run one vLLM engine split
    in two (``tensor_parallel_size: 2``, vLLM's external launcher over gloo). Each rank still trains on its own
    prompts, its rows of the group's generation; after every sync (steps 2 and 3) each rank's sampled log-probs
    are its trainer's within the single-process test's tolerance, and the ranks end with the same weights."""
    pytest.importorskip("vllm")
    from rllight.testing import build_tiny_model

    model_dir = build_tiny_model(str(tmp_path / "model"), hidden_size=64)  # 2 heads: one on each part
    engine = {"class_path": "rllight.rollout.worker.ProcessEngine",
              "init_args": {"engine": {"class_path": "rllight.rollout.vllm.VLLMEngine",
                                       "init_args": {"kv_cache_gb": 0.0625, "enforce_eager": True,
                                                     "max_model_len": 256, "tensor_parallel_size": 2}},
                            "max_new_tokens": 6}}
    (tmp_path / "tp").mkdir()
    overlay = _ddp_overlay(tmp_path, model_dir, "tp", rollout=engine)
    from rllight.rollout.worker_process import vllm_shm_segments

    before = vllm_shm_segments()
    run = fit_in_child("grpo.yaml", "--config", overlay, *DDP, "--trainer.max_steps", "3", timeout=900,
                       RLLIGHT_TEST_DUMP=str(tmp_path / "rank{rank}.pt"), RLLIGHT_TEST_LOGPROB_GAP="1")
    assert run.returncode == 0, run.stderr[-4000:]
    # vLLM's CPU group leaves its shared-memory segments behind, under the same names in every run: the workers
    # remove their own, or the next run of this test (or a user's) on the machine could not start its group.
    assert vllm_shm_segments() <= before
    r0, r1 = _same_weights_on_both_ranks(tmp_path)
    assert (r0["tensor_parallel_rank"], r1["tensor_parallel_rank"]) == (0, 1)
    assert r0["prompts"] != r1["prompts"]
    # Each rank's rows are the ones generated for its own prompts, not the other rank's.
    assert not {tuple(p) for p in r0["prompt_ids"]} & {tuple(p) for p in r1["prompt_ids"]}
    for record in (r0, r1):
        assert len(record["logprob_gap"]) == 3
        assert max(record["logprob_gap"]) < 1e-5, record["logprob_gap"]


def _updates_by_step(tmp_path, world):
    """Each step's updates (in order) of a run's RecordRows records: per update, each rank's rows and the global
    row count."""
    import json

    ranks = [json.loads((tmp_path / f"rows{r}.json").read_text()) for r in range(world)]
    assert len({len(records) for records in ranks}) == 1  # every rank takes part in every update
    steps: dict[float, list] = {}
    for parts in zip(*ranks):
        assert len({p["step"] for p in parts}) == 1 and len({p["global_rows"] for p in parts}) == 1
        steps.setdefault(parts[0]["step"], []).append(([p["rows"] for p in parts], parts[0]["global_rows"]))
    return list(steps.values())


@pytest.mark.slow
def test_ddp_dapo_with_uneven_retention_makes_the_updates_of_one_process_on_the_same_rows(tmp_path, tiny_model_dir):
    """Dynamic sampling on 2 processes where rank 0 keeps its 4 groups a step and rank 1 one (a reward flat but for
    rank 0's prompts and one of rank 1's, responses that depend on the prompt only, one sampling round: the same
    prompts and groups as one process). Each rank cutting its own rows into its share of the minibatch made more
    updates than one process. The kept groups are dealt evenly to the ranks, so every step makes the updates of
    one process on the same global batch: as many, of the same global sizes, over the same rows with the same
    advantages, each update taking about half its rows from each rank; and the ranks end with the same weights."""
    from rllight.data import ArithmeticTask, RLDataModule

    answers = []  # of the prompts each rank draws, step by step (64 problems: one epoch; 8 prompts a step)
    for rank in (0, 1):
        data = RLDataModule(task=ArithmeticTask(num_train=64, num_val=4), batch_size=8, val_size=4)
        data.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        data.setup("fit")
        answers.append([[str(row["answer"]) for row in batch] for batch in data.upcoming_batches(0, 6)])
    flat = {a for step in answers[1] for a in step[1:]}  # answers repeat: the flat ones stay flat on rank 0 too
    mixed = {a for step in answers[0] for a in step if a not in flat} | {step[0] for step in answers[1]}
    runs = {}
    model = dict(reward={"class_path": "user_strategies.MixedForAnswers"},
                 rollout={"class_path": "user_strategies.ScriptedEngine", "init_args": {"max_new_tokens": 6}},
                 loss_terms=[{"class_path": "user_strategies.RecordRows"}])
    for world in (1, 2):
        folder = tmp_path / f"world{world}"
        (folder / "run").mkdir(parents=True)
        overlay = _ddp_overlay(folder, tiny_model_dir, "run", **model)
        args = DDP if world == 2 else ["--trainer.callbacks+", "user_strategies.DumpState"]
        run = fit_in_child("dapo.yaml", "--config", overlay, *args, "--trainer.callbacks+", "user_strategies.StepTag",
                           "--trainer.max_steps", "9", "--data.batch_size", "8", "--data.task.init_args.num_train", "64",
                           "--model.batching.minibatch_size", "8",
                           "--model.sampler.init_args.group_size", "4", "--model.sampler.init_args.max_rounds", "1",
                           timeout=900, RLLIGHT_TEST_DUMP=str(folder / "rank{rank}.pt"),
                           RLLIGHT_TEST_ROWS=str(folder / "rows{rank}.json"),
                           RLLIGHT_TEST_MIXED_ANSWERS=",".join(sorted(mixed)))
        assert run.returncode == 0, run.stderr[-4000:]
        runs[world] = _updates_by_step(folder, world)
    _same_weights_on_both_ranks(tmp_path / "world2")
    kept = [torch.load(tmp_path / "world2" / f"rank{r}.pt", weights_only=True)["rollout_sizes"] for r in (0, 1)]
    one, two = runs[1], runs[2]
    assert len(one) == len(kept[0])
    # Cutting each rank's kept rows into its own 4-row shares would have made more updates than one process.
    assert any(max(-(-a // 4), -(-b // 4)) > len(step) for a, b, step in zip(*kept, one)), (kept, one)
    assert [len(step) for step in two] == [len(step) for step in one]  # as many updates per step
    for step_one, step_two in zip(one, two):
        assert [n for _, n in step_two] == [n for _, n in step_one]  # of the same global sizes
        rows_one = sorted((row for parts, _ in step_one for row in parts[0]), key=lambda r: r[:2])
        rows_two = sorted((row for parts, _ in step_two for part in parts for row in part), key=lambda r: r[:2])
        assert [r[:2] for r in rows_two] == [r[:2] for r in rows_one]  # the same rows...
        assert [r[2] for r in rows_two] == pytest.approx([r[2] for r in rows_one], abs=1e-5)  # ...and advantages
        for parts, n in step_two:  # each update takes its rows from both ranks, at most one group (4) apart
            assert abs(len(parts[0]) - len(parts[1])) <= 4, [len(p) for p in parts]


@pytest.mark.slow
def test_ddp_two_cpu_processes_evaluate_before_and_after(tmp_path, tiny_model_dir):
    """Validation under DDP: every rank asks for the log folder (a collective), so the evaluation before training
    and after it end instead of rank 0 waiting alone (it once did, until the gloo timeout)."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir)
    run = fit_in_child("grpo.yaml", "--config", overlay, "--trainer.strategy", "ddp", "--trainer.devices", "2",
                       "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1.0",
                       "--data.val_size", "4", "--evaluate_before_after", "true",
                       "--trainer.default_root_dir", str(tmp_path / "run"), timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "rllight: accuracy_before=" in run.stdout + run.stderr
    written = list((tmp_path / "run").rglob("evaluation/val_step*"))
    assert written, list((tmp_path / "run").rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "{class_path: rllight.fsdp.FSDP}"], ids=["ddp", "fsdp"])
def test_value_pretraining_spreads_each_ranks_rollout_over_prompts_of_its_own(tmp_path, tiny_model_dir, strategy):
    """ValuePretraining.group_size under DDP and FSDP: each rank's pretraining rollout takes its one batch row and 3
    more drawn from its own share of the prompt stream, 2 responses each; RL's rollouts then take the recipe's 8; both
    ranks make the same updates (no hang) and end on the same weights."""
    (tmp_path / "spread").mkdir()
    overlay = _ddp_overlay(tmp_path, tiny_model_dir, "spread")
    callbacks = ("[{class_path: rllight.callbacks.ValuePretraining, init_args: {max_steps: 2, patience: null,"
                 " group_size: 2}}, {class_path: user_strategies.DumpEveryRollout}]")
    run = fit_in_child("vapo.yaml", "--config", overlay, "--trainer.strategy", strategy, "--trainer.devices", "2",
                       "--trainer.accelerator", "cpu", "--trainer.callbacks", callbacks, "--trainer.max_steps", "1",
                       "--model.critic_first.steps", "1", timeout=900,
                       RLLIGHT_TEST_DUMP=str(tmp_path / "rank{rank}.pt"))
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = _same_weights_on_both_ranks(tmp_path)
    assert r0["sharded"] == (strategy != "ddp")  # FSDP's weights are DTensor shards, DDP's whole
    for record in (r0, r1):  # responses per group of each rollout: two pretraining ones, then RL's
        assert record["group_sizes"] == [[2, 2, 2, 2], [2, 2, 2, 2], [8]], record["group_sizes"]
    for step in range(2):  # the extra prompts of a pretraining rollout: each rank's own, none shared
        extra = [{tuple(p) for p in record["step_prompts"][step][2:]} for record in (r0, r1)]
        assert not extra[0] & extra[1], step
