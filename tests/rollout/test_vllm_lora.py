"""LoRA and the vLLM engine: with ``lora_sync: adapter`` (the default) only the adapter goes to vLLM after an
update and the engine's sampled log-probs equal the trainer's; ``lora_sync: merged`` still pushes the merged
weights; FSDP refuses only the merged sync.

The vLLM tests start two engines in this process on the tiny Llama (hidden 64, as in tests/rollout/test_vllm.py),
one per sync mode, on the same LoRA policy, and train the adapters once for both.
"""

import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from rllight.errors import RecipeError
from rllight.models import HFModel, LoRA
from rllight.module import RLModule
from rllight.rewards import IntegerMatch
from rllight.rollout.metrics import logprob_mismatch
from rllight.rollout.producer import RolloutProducer
from rllight.rollout.vllm import VLLMEngine
from rllight.rollout.vllm.transfer import lora_engine_args
from rllight.rollout.weights import adapter_state_dict, base_state_dict
from rllight.testing import build_tiny_model

ENGINE_ARGS = dict(max_new_tokens=8, temperature=0.7, kv_cache_gb=1 / 16, enforce_eager=True, max_model_len=256)
ROWS = [{"messages": [{"role": "user", "content": "What is 1 + 2?" + " 3" * k}], "answer": "3"} for k in range(5)]


# ------------------------------------------------------------------------------ no vLLM started
@pytest.mark.vllm
def test_lora_sync_is_checked_where_it_enters():
    with pytest.raises(RecipeError, match=r"^model\.rollout\.init_args\.lora_sync must be one of adapter, merged"):
        VLLMEngine(lora_sync="merge")
    from peft import LoraConfig

    assert lora_engine_args(LoraConfig(r=4)) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert lora_engine_args(LoraConfig(r=16, rank_pattern={"q_proj": 32}))["max_lora_rank"] == 32
    with pytest.raises(RecipeError) as err:  # refused before vLLM starts, naming the way out
        lora_engine_args(LoraConfig(r=4, use_dora=True, modules_to_save=["lm_head"]))
    assert str(err.value) == ("model.rollout.init_args.lora_sync: vLLM's LoRA cannot serve an adapter with "
                              "modules_to_save, use_dora; set lora_sync: merged")


@pytest.mark.vllm
def test_fsdp_refuses_a_lora_policy_only_with_the_merged_sync():
    from types import SimpleNamespace

    from rllight.fsdp import FSDP
    from rllight.recipe_checks import check_sharding

    trainer = SimpleNamespace(strategy=FSDP())
    check_sharding(trainer, LoRA(rank=4), VLLMEngine())  # adapter sync: only the adapter tensors are gathered
    check_sharding(trainer, None, VLLMEngine(lora_sync="merged"))  # no LoRA: the full weights are gathered
    with pytest.raises(RecipeError, match=r"model\.lora with trainer\.strategy FSDP: VLLMEngine.*lora_sync: adapter"):
        check_sharding(trainer, LoRA(rank=4), VLLMEngine(lora_sync="merged"))
    from rllight.rollout.worker import ProcessEngine

    check_sharding(trainer, LoRA(rank=4), ProcessEngine(VLLMEngine()))  # per-rank vLLM: the worker gets the adapter
    with pytest.raises(RecipeError, match=r"FSDP: ProcessEngine needs merged weights"):
        check_sharding(trainer, LoRA(rank=4), ProcessEngine(VLLMEngine(lora_sync="merged")))


def test_adapter_and_base_weights_are_split_without_merging(tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain = {name: value.clone() for name, value in base.state_dict().items()}
    policy = LoRA(rank=4, alpha=8.0, target_modules=["q_proj", "up_proj"]).apply(base)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B != 0: merged weights would differ from the base weights
    weights = base_state_dict(policy)
    assert set(weights) == set(plain) and all(torch.equal(weights[k], v) for k, v in plain.items())
    adapter = adapter_state_dict(policy)
    # 2 layers x 2 modules x (A, B), under the names of a peft adapter checkpoint
    assert sorted(adapter) == sorted(f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight" for i in range(2)
                                     for m in ("self_attn.q_proj", "mlp.up_proj") for ab in "AB")
    q_proj = policy.base_model.model.model.layers[1].self_attn.q_proj
    assert torch.equal(adapter["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"],
                       q_proj.lora_B["default"].weight)


# ------------------------------------------------------------------------------ with vLLM
def _gap(module, rollout, policy=None) -> float:
    with torch.no_grad():
        logprobs = module.scoring.forward(rollout, policy=policy)[0]
    return logprob_mismatch(logprobs, rollout.sample_logprobs, rollout.response_mask)["rollout/logprob_diff_max"].item()


def _train(policy) -> torch.nn.Module:
    """5 Adam steps on the adapters (large enough to move the log-probs by far more than the tolerance); returns
    a copy of the policy from before."""
    before = copy.deepcopy(policy)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=5e-2)
    ids = torch.arange(3, 19)[None]
    for _ in range(5):
        optimizer.zero_grad()
        (-policy(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()).backward()
        optimizer.step()
    return before


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_vllm_lora") / "model"), hidden_size=64)


@pytest.fixture(scope="module")
def engines(model_dir):
    """A LoRA policy (rank 4, every linear layer) and two started engines on it, one per ``lora_sync`` (the
    gap between their log-probs and the trainer's at the start); then the adapters trained by 5 Adam steps
    and pushed into both, each engine's sync calls recorded."""
    module = RLModule(HFModel(model_dir), rollout=VLLMEngine(**ENGINE_ARGS), lora=LoRA(rank=4, alpha=8.0))
    torch.manual_seed(0)  # the adapters' initial A, whatever ran before
    module.configure_model()
    merged = VLLMEngine(**ENGINE_ARGS, lora_sync="merged")
    producers = {"adapter": module.producer, "merged": RolloutProducer(merged, IntegerMatch())}
    producers["merged"].bind(module.policy, module.tokenizer)
    try:
        start = {}
        for mode, producer in producers.items():
            torch.manual_seed(0)
            start[mode] = _gap(module, producer.sample(ROWS, n=2))  # starts the engine on the untrained adapters
        before = _train(module.policy)
        calls = {}
        for mode, producer in producers.items():
            engine = producer.engine
            calls[mode], rpc = [], engine.llm.collective_rpc
            engine.llm.collective_rpc = lambda method, *a, _rpc=rpc, _calls=calls[mode], **k: (
                _calls.append(method), _rpc(method, *a, **k))[1]
            assert "rollout/sync_time" in engine.update_weights(module.policy)
        yield module, producers, before, start, calls
    finally:
        module.rollout.close()
        merged.close()


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_sampled_logprobs_equal_the_trainers_before_and_after_the_sync(engines, mode):
    module, producers, before, start, _ = engines
    assert start[mode] < 1e-5
    torch.manual_seed(1)
    rollout = producers[mode].sample(ROWS, n=2)
    now, old = _gap(module, rollout), _gap(module, rollout, policy=before)
    print(f"lora_sync={mode}: max |delta logp| engine vs trained policy {now:.3g}, vs the policy before {old:.3g}")
    # Same float32 function on both sides (tests/rollout/test_vllm.py's tolerance); the update moved it by far more.
    assert now < 1e-5 and old > 1e-2


@pytest.mark.vllm
def test_the_adapter_sync_sends_the_adapter_only(engines):
    module, producers, _, _, calls = engines
    engine = producers["adapter"].engine
    assert calls["adapter"] == []  # no reload_weights: the engine's base weights were not sent again
    assert engine._lora.lora_int_id == 2 and engine.llm.llm_engine.list_loras() == {2}  # the first one removed
    from safetensors.torch import load_file

    sent = load_file(os.path.join(engine._lora.lora_path, "adapter_model.safetensors"))
    trainable = {n: p for n, p in module.policy.named_parameters() if p.requires_grad}
    assert len(sent) == len(trainable) == 2 * 7 * 2  # 2 layers x 7 linear layers x (A, B)
    for name, p in trainable.items():
        torch.testing.assert_close(sent[name.replace(".default.", ".")], p.detach(), rtol=0, atol=0)
    size = sum(v.numel() for v in sent.values())
    total = sum(p.numel() for p in module.policy.parameters())
    assert size < total / 10
    assert calls["merged"] == ["reload_weights"] and producers["merged"].engine._lora is None


@pytest.mark.vllm
def test_a_rollout_worker_running_vllm_gets_the_base_weights_once_and_then_the_adapter(model_dir):
    """``ProcessEngine`` around ``VLLMEngine``: the shared buffer a sync rewrites holds the adapter tensors only
    (the base weights have buffers of their own, written at the start), and the worker's vLLM samples with the
    trainer's log-probs before and after a sync."""
    from rllight.rollout.worker import ProcessEngine

    engine = ProcessEngine(VLLMEngine(**ENGINE_ARGS))
    module = RLModule(HFModel(model_dir), rollout=engine, lora=LoRA(rank=4, alpha=8.0))
    torch.manual_seed(0)  # the adapters' initial A, whatever ran before
    module.configure_model()
    try:
        assert _gap(module, module.producer.sample(ROWS, n=2)) < 1e-5
        adapter = adapter_state_dict(module.policy)
        assert set(engine._weights.layout) == set(adapter) and len(adapter) == 2 * 7 * 2
        assert set(engine._base.layout) == set(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
        before = _train(module.policy)
        assert "rollout/sync_time" in engine.update_weights(module.policy)
        for name, value in adapter_state_dict(module.policy).items():
            torch.testing.assert_close(engine._weights.tensor(name), value, rtol=0, atol=0)
        torch.manual_seed(1)
        rollout = module.producer.sample(ROWS, n=2)
        assert engine.last_metrics["rollout/policy_version"] == 1
        now, old = _gap(module, rollout), _gap(module, rollout, policy=before)
        print(f"worker: max |delta logp| engine vs trained policy {now:.3g}, vs the policy before {old:.3g}")
        assert now < 1e-5 and old > 1e-2
    finally:
        engine.close()


def _sharded_split(rank: int, world: int, model_dir: str, init: str, out: str) -> None:
    """One FSDP rank: the adapter and base weights of a sharded LoRA policy, gathered, against the unsharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rllight.fsdp import is_dtensor, shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    policy = LoRA(rank=4, alpha=8.0).apply(AutoModelForCausalLM.from_pretrained(model_dir))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    adapter, base = adapter_state_dict(policy), {k: v.clone() for k, v in base_state_dict(policy).items()}
    shard({"policy": policy}, init_device_mesh("cpu", (world,)))
    assert any(is_dtensor(p) for n, p in policy.named_parameters() if "lora_A" in n)
    gathered = adapter_state_dict(policy)
    lazy = base_state_dict(policy)
    ok = set(gathered) == set(adapter) and all(torch.equal(gathered[k], v) for k, v in adapter.items())
    ok = ok and set(lazy) == set(base) and all(torch.equal(lazy[k], v) for k, v in base.items())
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{ok} {len(gathered)} {type(lazy).__name__}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_sharded_lora_policy_gives_its_adapter_and_base_weights_gathered(tmp_path, tiny_model_dir):
    """Under FSDP (2 CPU processes, gloo) the adapter sync gathers the adapter tensors and the engine's start the
    base weights, one at a time: both equal the unsharded policy's."""
    out = tmp_path / "out.txt"
    torch.multiprocessing.spawn(_sharded_split, args=(2, tiny_model_dir, f"file://{tmp_path}/store", str(out)),
                                nprocs=2)
    assert out.read_text() == "True 28 GatheredState"  # 2 layers x 7 linear layers x (A, B)
