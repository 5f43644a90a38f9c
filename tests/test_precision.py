"""``trainer.precision: auto`` (rllight.precision): the choice with the hardware faked both ways, an explicit value
over ``auto``, a two-step bf16-mixed fit on the CPU, and the float32 output layer's effect on the engine/trainer
log-prob mismatch."""

import contextlib
import logging
import math
import os

import lightning
import pytest
import torch
import yaml
from conftest import RECIPES
from helpers import CaptureLogger, build, load_tool, tiny_overrides
from transformers import AutoModelForCausalLM, AutoTokenizer

import rllight.precision as precision
from rllight.app.cli import main
from rllight.machine import ONEDNN_ISA_BOUNDS
from rllight.models import HFModel
from rllight.module import RLModule
from rllight.rollout import HFEngine
from rllight.rollout.metrics import logprob_mismatch

QUICKSTART = os.path.join(RECIPES, "quickstart.yaml")


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ONEDNN_ISA_BOUNDS:  # a bound of the machine's would change the choice
        monkeypatch.delenv(name, raising=False)


def test_auto_precision_on_a_cpu_follows_its_bf16_units(cpu_only, monkeypatch):
    for accelerator in ("cpu", "auto", None):
        monkeypatch.setattr(precision, "cpu_bf16_units", lambda: "AVX-512 BF16")
        assert precision.resolve_precision(accelerator) == ("bf16-mixed", "CPU has AVX-512 BF16")
        monkeypatch.setattr(precision, "cpu_bf16_units", lambda: None)
        chosen, reason = precision.resolve_precision(accelerator)
        assert chosen == "32-true" and reason.startswith("CPU has no AVX-512 BF16 or AMX")


@pytest.mark.parametrize("environment, chosen", [
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "32-true"),  # as on an AVX2-only CPU: bfloat16 at about 2 GFLOP/s
    ({"ONEDNN_MAX_CPU_ISA": "avx512_core"}, "32-true"),  # AVX-512 without BF16: emulated, slower than float32
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, "32-true"),
    ({"DNNL_MAX_CPU_ISA": "AVX2"}, "32-true"),  # oneDNN's older name, read where the new one is unset
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "DNNL_MAX_CPU_ISA": "AVX2"}, "bf16-mixed"),  # the new one first
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "bf16-mixed"),
    ({"ONEDNN_MAX_CPU_ISA": "DEFAULT"}, "bf16-mixed"),
    ({"ONEDNN_MAX_CPU_ISA": "NO_SUCH_ISA"}, "bf16-mixed"),  # oneDNN ignores a name it does not know
])
def test_precision_auto_keeps_float32_where_onednn_is_held_below_bf16(environment, chosen, cpu_only, monkeypatch):
    """A CPU with AVX-512 BF16 whose oneDNN the environment holds below its bfloat16 instructions computes bfloat16
    products without those units: ``auto`` chooses float32 there, and says which variable did it."""
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: "AVX-512 BF16")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    resolved, reason = precision.resolve_precision("cpu")
    assert resolved == chosen
    if chosen == "32-true":
        name, value = next(iter(environment.items()))
        assert reason == f"CPU has AVX-512 BF16, which {name}={value.upper()} keeps oneDNN from using", reason
    else:
        assert reason == "CPU has AVX-512 BF16"


ONEDNN_UNITS = """
import ctypes, os, sys, tempfile
import torch
from rllight.precision import cpu_bf16

# oneDNN's verbose mode prints the instruction set its kernels use (the 'isa:' line) to the C stdout, here a file.
log = tempfile.TemporaryFile(mode="w+")
saved = os.dup(1)
sys.stdout.flush()
os.dup2(log.fileno(), 1)
torch.ones(64, 64, dtype=torch.bfloat16) @ torch.ones(64, 64, dtype=torch.bfloat16)
ctypes.CDLL(None).fflush(None)
os.dup2(saved, 1)
log.seek(0)
isa = [line for line in log.read().splitlines() if ",cpu,isa:" in line]
on_units = bool(isa) and ("bfloat16" in isa[0] or "AMX" in isa[0])  # no line: torch did not call oneDNN
print(2 * cpu_bf16()[0] + on_units)
"""


def test_precision_cpu_bf16_agrees_with_the_kernels_onednn_runs():
    """``cpu_bf16`` says native exactly where oneDNN's kernels for a bfloat16 product use the CPU's bfloat16
    instructions (its verbose mode names them), as the machine is and under two bounds below them, each in a fresh
    interpreter (oneDNN reads its bound once). On a CPU with AVX-512 BF16 or AMX the first is native, the two
    bounded ones are not; on one without, none is."""
    for isa in (None, "AVX512_CORE_VNNI", "AVX2"):
        answer = _in_a_fresh_interpreter(ONEDNN_UNITS, timeout=120, ONEDNN_VERBOSE="1", ONEDNN_MAX_CPU_ISA=isa,
                                         DNNL_MAX_CPU_ISA=None)
        assert answer in (0, 3), (isa, "cpu_bf16 says native" if answer == 2 else "oneDNN used bfloat16 units")


def test_precision_cpu_units_from_torch_or_from_the_cpu_flags(monkeypatch):
    for avx512_bf16, amx, expected in ((True, False, "AVX-512 BF16"), (False, True, "AMX"), (False, False, None)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert precision.cpu_bf16_units() == expected
    # A torch without those checks: /proc/cpuinfo's flags. AVX-512 without BF16 (e.g. Skylake) has none.
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    for flags, expected in (({"avx2", "avx512f"}, None), ({"avx512f", "avx512_bf16"}, "AVX-512 BF16"),
                            ({"amx_tile", "amx_bf16"}, "AMX")):
        monkeypatch.setattr(precision, "cpu_flags", lambda f=flags: f)
        assert precision.cpu_bf16_units() == expected


def test_auto_precision_on_cuda_follows_its_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: None)
    monkeypatch.setattr(precision, "cuda_bf16", lambda: (True, "NVIDIA A100"))
    for accelerator in ("gpu", "cuda", "auto", None):
        assert precision.resolve_precision(accelerator) == ("bf16-mixed", "CUDA device NVIDIA A100 computes bfloat16")
    monkeypatch.setattr(precision, "cuda_bf16", lambda: (False, "Tesla T4"))
    for accelerator in ("gpu", "auto"):
        assert precision.resolve_precision(accelerator) == ("32-true", "CUDA device Tesla T4 has no native bfloat16")
    # accelerator: cpu on a machine with a GPU follows the CPU; an accelerator without a rule keeps float32.
    monkeypatch.setattr(precision, "cuda_bf16", lambda: (True, "NVIDIA A100"))
    assert precision.resolve_precision("cpu")[0] == "32-true"
    assert precision.resolve_precision("mps")[0] == "32-true"


def _printed(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", QUICKSTART, *args, "--print_config"])
    assert exc.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("units, args, trainer, engine", [
    ("AMX", [], "bf16-mixed", "bfloat16"),  # the recipe's auto on a bf16 CPU: both in bfloat16
    (None, [], "32-true", "auto"),  # on an AVX2 CPU: float32, the engine generates with the policy itself
    ("AMX", ["--trainer.precision", "32-true"], "32-true", "auto"),  # an explicit precision wins
    ("AMX", ["--model.rollout.init_args.dtype", "float32"], "bf16-mixed", "float32"),  # so does the engine's
    ("AMX", ["--config", os.path.join(RECIPES, "overlays", "vllm.yaml")], "bf16-mixed", "bfloat16"),
])
def test_precision_auto_in_a_recipe_and_explicit_values_over_it(units, args, trainer, engine, cpu_only, monkeypatch,
                                                                capsys, caplog):
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: units)
    with caplog.at_level(logging.INFO, logger="rllight"):
        config = _printed(capsys, *args)
    assert config["trainer"]["precision"] == trainer
    assert config["model"]["rollout"]["init_args"]["dtype"] == engine
    chosen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision: ")]
    assert chosen == ([] if "--trainer.precision" in args else
                      [f"precision: {trainer} ({'CPU has AMX' if units else 'CPU has no AVX-512 BF16 or AMX'}"
                       f"{'' if units else ' (' + torch.backends.cpu.get_cpu_capability() + ')'})"])


def test_precision_float32_lm_head_with_an_engine_of_its_own_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", QUICKSTART, "--config", os.path.join(RECIPES, "overlays", "vllm.yaml"),
              "--model.model.init_args.float32_lm_head", "true"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rllight: error: model.model.init_args.float32_lm_head: VLLMEngine holds weights")


def test_two_bf16_mixed_precision_steps_on_cpu(tmp_path, tiny_model_dir, monkeypatch):
    """Two RL steps of two updates each in bf16-mixed: finite losses, a bfloat16 engine copy, and the engine's
    log-probs of its samples within bfloat16 tolerance of the trainer's, after the updates too (a copy that missed
    a sync would be off by the updates' change, at lr 1e-2 far more than that)."""
    overlay = tiny_overrides(tmp_path, tiny_model_dir, batching={"minibatch_size": 8, "micro_batch_size": 8})
    cli = build(os.path.join(RECIPES, "grpo.yaml"), overlay, "--trainer.precision", "bf16-mixed",
                "--trainer.max_steps", "4")
    assert cli.model.rollout.dtype == "bfloat16"  # the engine's auto followed the trainer
    recorder = CaptureLogger(tmp_path)
    cli.trainer.loggers = [recorder]
    recast = []  # the update's linears recast their weights in backward (RecastWeights), not kept by autocast
    forward = precision._RecastLinear.forward
    monkeypatch.setattr(precision._RecastLinear, "forward",
                        staticmethod(lambda ctx, *a: recast.append(a[1].shape) or forward(ctx, *a)))
    lightning.seed_everything(0, verbose=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert type(cli.trainer.precision_plugin).__name__ == "MixedPrecision"
    linears = [m for m in cli.model.policy.modules() if type(m) is torch.nn.Linear]
    assert len(recast) >= 4 * len(linears)  # every linear, in each of the 4 updates
    assert next(cli.model.rollout._copy.parameters()).dtype == torch.bfloat16
    steps = [c for c in recorder.calls if "train/rollout/logprob_diff_mean" in c]
    assert len(steps) == 2
    losses = [c["train/policy/loss"] for c in recorder.calls if "train/policy/loss" in c]
    assert losses and all(math.isfinite(float(v)) for v in losses)
    for step in steps:
        # bfloat16 keeps 8 bits of mantissa: per-token log-prob errors of ~1e-2 at most on this tiny model.
        assert 0 < float(step["train/rollout/logprob_diff_mean"]) < 1e-2
        assert float(step["train/rollout/logprob_diff_max"]) < 5e-2


def _saved_bytes_and_grads(model, ids: torch.Tensor, recast: bool) -> tuple[int, list[torch.Tensor]]:
    """Bytes the forward pass under bfloat16 autocast saves for the backward pass, parameters themselves left out
    (they are alive anyway), and the parameters' gradients after it."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t.untyped_storage().nbytes())
        return t

    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with precision.RecastWeights() if recast else contextlib.nullcontext():
            logits = model(ids).logits
    logits.float().logsumexp(-1).sum().backward()
    return sum(saved), [p.grad.clone() for p in model.parameters()]


def test_precision_bf16_update_keeps_no_bf16_copy_of_the_weights(tiny_model_dir):
    """Under ``bf16-mixed`` the update's forward pass keeps no bfloat16 cast of the weights for the backward pass
    (``RecastWeights``): autocast's own saves one per linear (2 bytes a parameter, 0.2 GB for SmolLM2), which made a
    bfloat16 update peak above a float32 one. The gradients are bit for bit autocast's."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    linear_bytes = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.Linear))
    kept, grads = _saved_bytes_and_grads(model, ids, recast=False)
    recast, recast_grads = _saved_bytes_and_grads(model, ids, recast=True)
    assert kept - recast >= 0.95 * linear_bytes, (kept, recast, linear_bytes)
    assert all(torch.equal(a, b) for a, b in zip(grads, recast_grads))


RSS = """
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
"""


def _in_a_fresh_interpreter(script: str, timeout: float = 300, **env: str | None) -> int:
    """The number ``script`` prints last, run in a new Python (``RSS`` defines ``rss()`` in it); ``env`` changes the
    environment, a None value removing the variable."""
    import subprocess
    import sys

    environment = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    out = subprocess.run([sys.executable, "-c", RSS + script], capture_output=True, text=True, timeout=timeout,
                         check=True, env=environment)
    return int(out.stdout.strip().splitlines()[-1])


FREED_HEAP = """
import torch
from rllight._compat import return_free_memory

block = torch.ones(30 * 2**20 // 4)
del block  # freeing a 30 MB block raises glibc's mmap threshold: 1 MB blocks then go on the heap
parts, pins = [], []
for _ in range(300):  # 300 MB of 1 MB tensors, each followed by a small live one that pins the heap
    parts.append(torch.ones(2**18))
    pins.append(torch.ones(2**12))
del parts
freed = rss()
return_free_memory()
print(freed - rss())
"""


def test_precision_freed_heap_pages_go_back_to_the_system():
    """``return_free_memory`` (called after each generation and update) gives freed heap pages back: glibc keeps
    free blocks between live ones resident, so weight-sized tensors freed by one phase (the engine's bfloat16 copy,
    an update's casts) would count in the RSS through the next. In a fresh interpreter, whose heap is laid out as
    the script says (in this one, earlier tests' free blocks would take the tensors)."""
    returned = _in_a_fresh_interpreter(FREED_HEAP, timeout=120)
    assert returned > 240 * 2**20, returned


def test_precision_bf16_engine_prompt_pass_never_copies_the_output_weight_per_row(tiny_model_dir):
    """bfloat16 costs no extra memory in generation: the prompt pass keeps only the last position's logits, a
    non-contiguous (B, 1, H) view of the hidden states, on which a CPU bfloat16 ``linear`` would broadcast the
    output weight to a (B, H, V) copy (3.4 GB for 64 SmolLM2 prompts; float32 folds the view instead). No single
    allocation of the generation may reach that copy's size."""
    from torch.profiler import ProfilerActivity, profile

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer(f"question {i} is {i * 7} and {i + 3}")["input_ids"] for i in range(16)]
    engine = HFEngine(max_new_tokens=3, dtype="bfloat16")
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    broadcast_copy = len(prompts) * hidden * vocab * 2  # bytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.generate(model, tokenizer, prompts, engine.sampling.as_greedy())
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < broadcast_copy / 2, (largest, broadcast_copy)


def _peaky_model(tmp_path, tiny_model_dir: str) -> str:
    """The tiny model with its output layer scaled 8x: logits of a trained model's size (a few units, entropy about
    3.5 nats), where rounding them to bfloat16 shows; the random model's are near 0, where it does not."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    folder = str(tmp_path / "peaky")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def _engine_trainer_gap(model_dir: str, float32_lm_head: bool) -> dict[str, float]:
    """Sample 8 prompts x 4 from a bfloat16 engine copy, score the samples under bf16 autocast (the trainer under
    bf16-mixed), and return the mismatch of the two log-probs."""
    torch.manual_seed(0)
    module = RLModule(HFModel(model_dir, float32_lm_head=float32_lm_head),
                      rollout=HFEngine(max_new_tokens=8, dtype="bfloat16"))
    module.configure_model()
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i + 2}?"}], "answer": "3"} for i in range(8)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rollout = module.producer.sample(rows, n=4)
        module.scoring.score(rollout, need_old=True, need_values=False, need_ref=False)
    if float32_lm_head:  # the copy's output layer kept a float32 weight of its own, the rest is bfloat16
        head = module.rollout._copy.get_output_embeddings()
        assert head.weight.dtype == torch.float32 and module.rollout._copy.get_input_embeddings().weight.dtype \
            == torch.bfloat16
    gap = logprob_mismatch(rollout.old_logprobs, rollout.sample_logprobs, rollout.response_mask)
    return {k: float(v) for k, v in gap.items()}


def test_float32_lm_head_narrows_the_engine_trainer_gap_under_bf16_precision(tmp_path, tiny_model_dir):
    folder = _peaky_model(tmp_path, tiny_model_dir)
    without, with_head = _engine_trainer_gap(folder, False), _engine_trainer_gap(folder, True)
    logging.getLogger("rllight").info("engine/trainer log-prob gap in bf16: output layer in bfloat16 %s, in float32 %s",
                                      without, with_head)
    print(f"bf16 output layer: {without}\nfloat32 output layer: {with_head}")
    # Measured (torch 2.13, AVX-512 BF16 CPU): mean 0.0026 -> 0.0020, max 0.023 -> 0.010.
    assert with_head["rollout/logprob_diff_mean"] < without["rollout/logprob_diff_mean"]
    assert with_head["rollout/logprob_diff_max"] < without["rollout/logprob_diff_max"]


def test_bench_step_precision_reaches_both_sides(tmp_path, tiny_model_dir, cpu_only, monkeypatch):
    """tools/bench_step.py --precision: rllight's trainer.precision and TRL's bf16 setting (TRL itself runs in its
    own environment, which the tests do not have); auto is resolved once, for both."""
    import json

    bench = load_tool("bench_step")
    monkeypatch.setattr(precision, "cpu_bf16_units", lambda: None)
    for given, chosen in (("bf16-mixed", "bf16-mixed"), ("32-true", "32-true"), ("auto", "32-true")):
        args = bench.parse_args(["--model-dir", tiny_model_dir, "--precision", given, "--out", str(tmp_path / given)])
        assert bench.overlay(args)["trainer"]["precision"] == chosen
        with open(bench.trl_inputs(args)) as f:
            assert json.load(f)["bf16"] is (chosen == "bf16-mixed")
    assert bench.parse_args(["--model-dir", tiny_model_dir]).precision == "32-true"  # the README's float32 table


@pytest.mark.parametrize("variable, bound", [("ONEDNN_PRIMITIVE_CACHE_CAPACITY", precision.ONEDNN_CACHE),
                                             ("LRU_CACHE_CAPACITY", precision.IDEEP_CACHE)])
def test_precision_rllight_bounds_onednn_cache_unless_the_environment_names_one(variable, bound, monkeypatch,
                                                                                  tmp_path):
    """The command bounds oneDNN's and ideep's primitive caches (bfloat16 products on a CPU compile a kernel per
    shape, and the defaults of 1024 each held 0.8 GB over 600 shapes); a value in the environment is kept."""
    missing = str(tmp_path / "missing.yaml")
    for preset, expected in ((None, bound), ("4096", "4096")):
        monkeypatch.setenv(variable, "x")  # restored at teardown
        monkeypatch.delenv(variable)
        if preset is not None:
            monkeypatch.setenv(variable, preset)
        with pytest.raises(SystemExit):
            main(["validate", "--config", missing])
        assert os.environ[variable] == expected


NEW_SHAPES = """
import rllight.precision
import torch
from rllight._compat import return_free_memory

rllight.precision.bound_onednn_cache()  # as the rllight command does, before the first product
torch.set_num_threads(1)

up, down = torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576, bias=False)
for rows in (1, 8):
    down(torch.relu(up(torch.randn(rows, 576))))
return_free_memory()
start = rss()
for rows in range(20, 320):  # 300 new shapes, as micro-batches of new lengths make
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = down(torch.relu(up(torch.randn(rows, 576, requires_grad=True)))).float().sum()
    loss.backward()
return_free_memory()
print(rss() - start)
"""


def test_precision_bf16_products_of_new_shapes_keep_little_memory():
    """Under rllight's cache bounds, 300 bfloat16 forward and backward passes of new shapes (a SmolLM2-sized layer
    pair) leave under 64 MB resident; at the libraries' defaults they left about 400 MB on a CPU with AMX (oneDNN
    computes its bfloat16 products; on a CPU without bfloat16 units nothing is cached to begin with). In a fresh
    interpreter, whose caches start empty."""
    kept = _in_a_fresh_interpreter(NEW_SHAPES, ONEDNN_PRIMITIVE_CACHE_CAPACITY=None, LRU_CACHE_CAPACITY=None)
    assert kept < 64 * 2**20, kept


def test_precision_phase_memory_reports_each_phase_peak(capsys):
    """``tools/phase_memory.py`` prints a phase's peak RSS, not the RSS after it: 256 MB allocated and freed inside
    the call show in its peak only."""
    tool = load_tool("phase_memory")

    class Phase:
        def run(self):
            block = torch.ones(64 * 2**20)  # 256 MB, touched
            del block

    calls = {}
    tool.wrap(Phase, "run", "run", calls)
    Phase().run()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    before, peak, after = (float(line.split(word)[1].split()[0]) for word in (" before ", " peak ", " after "))
    assert peak - before >= 250 and peak - after >= 250, line
    assert tool.summary(calls).startswith("memory summary: run peak")


def test_precision_bf16_chunked_head_matches_autocast_without_a_bf16_copy_of_the_output_layer(monkeypatch):
    """Under ``bf16-mixed`` the chunked output layer (``chunked_logprobs_and_entropy``) computes in bfloat16 as
    autocast's direct path does, within bfloat16 rounding of its products, but casts the weight a slice at a time:
    a whole bfloat16 copy of it (57 MB for SmolLM2, live next to the update's peak in the backward pass) made a
    bfloat16 update hold more than a float32 one. No allocation of the forward or backward pass is that copy's
    size."""
    from torch.profiler import ProfilerActivity, profile

    from rllight.algorithms import chunked_logprobs_and_entropy, logprobs, logprobs_and_entropy

    monkeypatch.setattr(logprobs, "LOW_PRECISION_SLICE", 1000)
    g = torch.Generator().manual_seed(0)
    vocab, width = 5003, 48  # 6 slices, the last one short
    hidden = torch.randn(2, 5, width, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, width, generator=g) / 2).requires_grad_()
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    g_lp, g_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)

    def run(chunked: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if chunked:
                lp, ent = chunked_logprobs_and_entropy(hidden, weight, targets, 0.7, chunk_size=4)
            else:
                lp, ent = logprobs_and_entropy(torch.nn.functional.linear(hidden, weight), targets, 0.7)
            grads = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), [hidden, weight])
        return lp, ent, grads

    lp, ent, grads = run(chunked=False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        lp2, ent2, grads2 = run(chunked=True)
    torch.testing.assert_close(lp2, lp)  # the same bfloat16 products: the logits agree to float32 rounding
    torch.testing.assert_close(ent2, ent)
    for got, expected in zip(grads2, grads):  # bfloat16 gradients: 2**-8 relative per product
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    weight_copy = vocab * width * 2
    sizes = [e.cpu_memory_usage for e in prof.events() if e.name in ("aten::_to_copy", "aten::empty_strided")]
    assert sizes and max(sizes) < weight_copy / 4, (max(sizes), weight_copy)


def test_precision_bf16_first_update_ratio_is_exactly_one(tmp_path, tiny_model_dir, monkeypatch):
    """Under bf16-mixed a row's log-prob depends on the micro-batch it is computed in (the other rows beside it,
    the padding), so the old log-probs are scored in the micro-batches of the update's first epoch: the first
    update of each step, where the policy has not moved, sees a ratio of exactly 1 on every token, as in float32
    (scored in other micro-batches, the clip acted on bfloat16 rounding). The second update, after a step at
    lr 1e-2, must see the policy's change."""
    from rllight.terms import PolicyObjective
    from rllight.update import Updater

    overlay = tiny_overrides(tmp_path, tiny_model_dir, batching={"minibatch_size": 8, "micro_batch_size": 3})
    cli = build(os.path.join(RECIPES, "grpo.yaml"), overlay, "--trainer.precision", "bf16-mixed",
                "--trainer.max_steps", "4", "--data.batch_size", "4", "--model.sampler.init_args.group_size", "4")
    updates: list[list[float]] = []  # per update: the largest |log ratio| of each micro-batch
    update, objective = Updater.update, PolicyObjective.__call__

    def recording_update(self, *args, **kwargs):
        updates.append([])
        return update(self, *args, **kwargs)

    def recording_objective(self, batch, out, aggregate):
        result = objective(self, batch, out, aggregate)
        mask = batch.response_mask.bool()
        updates[-1].append(float((out.logprobs.detach() - batch.old_logprobs)[mask].abs().max()))
        return result

    monkeypatch.setattr(Updater, "update", recording_update)
    monkeypatch.setattr(PolicyObjective, "__call__", recording_objective)
    lightning.seed_everything(0, verbose=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert len(updates) == 4 and all(len(u) == 3 for u in updates)  # 2 steps x 2 updates of 8 rows in 3 passes
    for first, second in (updates[0:2], updates[2:4]):
        assert first == [0.0, 0.0, 0.0]
        assert max(second) > 1e-3
