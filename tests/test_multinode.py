"""Two nodes simulated on this machine: two launches of the same command with node ranks 0 and 1 (Lightning's
own launch: MASTER_ADDR, MASTER_PORT, NODE_RANK; gloo over localhost), each node in a folder of its own."""

import os
import socket

import pytest
import torch

from helpers import start_fit, tiny_overrides


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path, overlay, *args):
    """Run both nodes to the end; their (returncode, stderr) in node order."""
    port = str(_free_port())
    children = []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir(exist_ok=True)
        children.append(start_fit(
            "grpo.yaml", "--config", overlay, "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--trainer.num_nodes", "2", "--trainer.default_root_dir", "runs",
            "--trainer.logger", "true", "--trainer.enable_checkpointing", "true", "--model.export_dir", "export",
            "--trainer.callbacks+", "user_strategies.DumpState", *args, cwd=str(folder),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node),
            RLLIGHT_TEST_DUMP=str(tmp_path / f"dump_{node}_rank{{rank}}.pt")))
    results = []
    for child in children:
        try:
            _, stderr = child.communicate(timeout=600)
        except Exception:
            for c in children:
                c.kill()
            raise
        results.append((child.returncode, stderr))
    return results


def _written(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(p, f), folder) for p, _, files in os.walk(folder) for f in files)


@pytest.mark.slow
def test_two_nodes_share_the_prompts_only_rank_zero_writes_and_a_resume_continues_on_both(tmp_path, tiny_model_dir):
    overlay = tiny_overrides(tmp_path, tiny_model_dir)  # data.batch_size 2: one prompt per node and step
    for code, stderr in _two_nodes(tmp_path, overlay, "--trainer.max_steps", "2"):
        assert code == 0, stderr[-4000:]
    first = [torch.load(tmp_path / f"dump_{node}_rank{node}.pt", weights_only=True) for node in (0, 1)]
    # The nodes trained on different prompts: each its own share of every step's batch.
    assert len(first[0]["prompts_seen"]) == len(first[1]["prompts_seen"]) == 2
    assert not set(first[0]["prompts_seen"]) & set(first[1]["prompts_seen"])
    for name, p in first[0]["params"].items():  # and hold the same weights
        torch.testing.assert_close(first[1]["params"][name], p, rtol=0, atol=0, msg=name)
    # Only global rank 0 writes: logs, checkpoint, export; node 1's folder stays empty.
    node0 = _written(tmp_path / "node0")
    assert any(f.endswith("last.ckpt") for f in node0) and "export/config.json" in node0
    assert any("events.out.tfevents" in f or f.endswith("metrics.csv") for f in node0), node0
    assert _written(tmp_path / "node1") == []
    checkpoint = next(tmp_path / "node0" / f for f in node0 if f.endswith("last.ckpt"))

    # Both nodes resume from the checkpoint (as from shared storage) and continue to step 4.
    results = _two_nodes(tmp_path, overlay, "--trainer.max_steps", "4", "--model.export_dir", "export2",
                         "--ckpt_path", str(checkpoint))
    for code, stderr in results:
        assert code == 0, stderr[-4000:]
    second = [torch.load(tmp_path / f"dump_{node}_rank{node}.pt", weights_only=True) for node in (0, 1)]
    assert second[0]["global_steps"] == second[1]["global_steps"] == [2, 3]
    resumed = [set(s["prompts_seen"]) for s in second]
    assert not resumed[0] & resumed[1]
    assert not (resumed[0] | resumed[1]) & (set(first[0]["prompts_seen"]) | set(first[1]["prompts_seen"]))
    for name, p in second[0]["params"].items():
        torch.testing.assert_close(second[1]["params"][name], p, rtol=0, atol=0, msg=name)
    assert _written(tmp_path / "node1") == []
