"""Lightning DDP on 2 CPU processes (gloo): training runs, the ranks stay in sync, the loss is normalised
by the global token count, and the checkpoint loads."""

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
        "--model.minibatch_size",
        "null",
        "--model.ppo_epochs",
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
