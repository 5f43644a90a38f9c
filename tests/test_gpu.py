"""Checks that need a CUDA device (run by tools/gpu_check.sh; skipped where there is none): training on one GPU in
float32 and bf16-mixed, the vLLM engine on a GPU against the trainer's log-probs before and after a sync, and DDP
over two GPUs."""

import copy
import os

import pytest
import torch

from conftest import RECIPES
from helpers import build, fit_in_child, tiny_overrides, unchanged_parameters

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu_check.sh)"),
]

ON_GPU = ["--trainer.accelerator", "gpu", "--trainer.devices", "1"]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_two_steps_on_one_gpu_change_every_trainable_parameter(precision, tmp_path, tiny_model_dir):
    cli = build(os.path.join(RECIPES, "ppo.yaml"), tiny_overrides(tmp_path, tiny_model_dir), *ON_GPU,
                "--trainer.precision", precision)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step >= 2
    assert next(cli.model.policy.parameters()).device.type == "cuda"
    assert unchanged_parameters(cli.model.policy.cpu(), tiny_model_dir) == []
    assert torch.isfinite(cli.trainer.callback_metrics["train/policy/loss"])


def test_vllm_on_a_gpu_samples_the_trainers_policy_before_and_after_a_sync(tmp_path):
    pytest.importorskip("vllm")
    from rllight.models import HFModel
    from rllight.module import RLModule
    from rllight.rollout.metrics import logprob_mismatch
    from rllight.rollout.vllm import VLLMEngine
    from rllight.testing import build_tiny_model

    model_dir = build_tiny_model(str(tmp_path / "model"), hidden_size=64)
    engine = VLLMEngine(max_new_tokens=8, temperature=0.7, gpu_memory_utilization=0.2, enforce_eager=True,
                        max_model_len=256, dtype="float32")
    module = RLModule(HFModel(model_dir), rollout=engine)
    module.configure_model()
    module.policy.cuda()
    rows = [{"messages": [{"role": "user", "content": "What is 1 + 2?" + " 3" * k}], "answer": "3"} for k in range(5)]

    def gap(rollout, policy=None):
        with torch.no_grad():
            logprobs = module.scoring.forward(rollout.to("cuda"), policy=policy).logprobs
        return float(logprob_mismatch(logprobs, rollout.sample_logprobs.cuda(), rollout.response_mask.cuda())[
            "rollout/logprob_diff_max"])

    try:
        # GPU kernels differ between the two sides (vLLM's attention, cuBLAS): float32 agreement to 1e-3.
        assert gap(module.producer.sample(rows, n=2)) < 1e-3
        before = copy.deepcopy(module.policy)
        optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-2)
        ids = torch.arange(3, 19, device="cuda")[None]
        (-module.policy(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()).backward()
        optimizer.step()
        engine.update_weights(module.policy)
        fresh = module.producer.sample(rows, n=2)
        assert gap(fresh) < 1e-3 < gap(fresh, policy=before)
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ddp_on_two_gpus_ends_with_the_same_weights_on_both_ranks(tmp_path, tiny_model_dir):
    run = fit_in_child("grpo.yaml", "--config", tiny_overrides(tmp_path, tiny_model_dir), "--trainer.strategy", "ddp",
                       "--trainer.accelerator", "gpu", "--trainer.devices", "2", "--trainer.max_steps", "2",
                       "--trainer.callbacks+", "user_strategies.DumpState", timeout=600,
                       RLLIGHT_TEST_DUMP=str(tmp_path / "rank{rank}.pt"))
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["prompts"] != r1["prompts"]
    for name, p in r0["params"].items():
        torch.testing.assert_close(r1["params"][name].cpu(), p.cpu(), rtol=0, atol=0, msg=name)
