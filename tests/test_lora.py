"""LoRA: only adapters (and a critic) train, the KL reference is the adapter-free model, export merges."""

import os

import torch
from transformers import AutoModelForCausalLM

from conftest import RECIPES
from helpers import build, tiny_overrides

LORA = {"class_path": "rllight.models.LoRA", "init_args": {"rank": 4, "alpha": 8.0}}


def test_lora_trains_only_adapters_and_exports_merged(tmp_path, tiny_model_dir):
    out = tmp_path / "export"
    cli = build(
        os.path.join(RECIPES, "quickstart-lora.yaml"),
        tiny_overrides(
            tmp_path,
            tiny_model_dir,
            lora=LORA,
            export_dir=str(out),
            critic={"class_path": "rllight.critics.ValueHead"},
            advantage={"class_path": "rllight.strategies.GAE"},
            kl={"class_path": "rllight.strategies.KLPenalty", "init_args": {"coef": 0.1}},
        ),
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    module = cli.model
    assert module.ref_policy is None  # no second copy of the weights
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for name, p in module.policy.named_parameters():
        if "lora_B" in name:
            assert p.abs().sum() > 0, f"{name} did not train"
        if not p.requires_grad:
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            torch.testing.assert_close(p.detach(), base[key], msg=f"frozen {name} moved")
    assert all(p.abs().sum() > 0 for p in module.critic.parameters())

    # The reference log-probs are those of the initial model.
    rows = [{"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]
    rollout = module.producer.sample(rows, n=2)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        ref = module.scoring.reference_logprobs(rollout)
        expected = module.scoring.forward(rollout, policy=initial)[0]
        live = module.scoring.forward(rollout)[0]
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(ref[mask], expected[mask])
    assert (live[mask] - ref[mask]).abs().max() > 1e-4  # the adapters changed the policy

    # The export is a plain model with the adapters merged: same log-probs as the live policy.
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            module.scoring.forward(rollout, policy=merged)[0][mask], live[mask], rtol=1e-4, atol=1e-4
        )
    assert (
        merged.generate(rollout.prompt_ids[:1], max_new_tokens=3, do_sample=False).shape[1]
        > rollout.prompt_ids.shape[1]
    )


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    from rllight.models import HFModel
    from rllight.module import RLModule

    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        module = RLModule(HFModel(tiny_model_dir), gradient_checkpointing=ckpt)
        module.configure_model()
        if not grads:
            rows = [{"messages": [{"role": "user", "content": "What is 5 + 5?"}], "answer": "10"}]
            rollout = module.producer.sample(rows, n=2)
        module.scoring.forward(rollout)[0].sum().backward()
        grads.append({n: p.grad for n, p in module.policy.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g)
