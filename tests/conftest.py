import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from rllight.testing import build_tiny_model  # noqa: E402

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama and BPE tokenizer with a chat template, built in-process."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))
