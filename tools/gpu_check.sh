#!/usr/bin/env bash
# The checks that need a GPU, in one go (under 8 minutes on one modern GPU): the CUDA tests (tests/test_gpu.py:
# training on one GPU in float32 and bf16-mixed, vLLM on the GPU against the trainer's log-probs, DDP on two GPUs
# where there are two), then the quickstart with the vLLM engine. Prints one summary line at the end:
#   gpu_check: tests <pytest's closing line>; quickstart+vllm: <accuracy before -> after> in <s> s (<status>)
# Run it after `bash tools/install.sh dev,quickstart,vllm` on the GPU machine:
#   bash tools/gpu_check.sh            # logs in runs/gpu_check/
# PYTHON=/path/to/python picks another environment than .venv (a python that cannot import torch is an error).
# Exit status: 0 when both parts passed, 1 when one failed, 2 where there is no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${GPU_CHECK_DIR:-runs/gpu_check}
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)" 2>/dev/null
case $? in
    0) ;;
    2) echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing checked"; exit 2 ;;
    *) echo "gpu_check: $PY cannot import torch; run bash tools/install.sh dev,quickstart,vllm first (or set PYTHON)"
       exit 1 ;;
esac
mkdir -p "$OUT"
status=0
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py > "$OUT/tests.log" 2>&1 || status=1
tests=$(grep -E "(passed|failed|skipped|error)" "$OUT/tests.log" | tail -n 1 | tr -d '=' | xargs)
start=$(date +%s)
timeout 420 "$PY" -m rllight.app.cli fit --config recipes/quickstart.yaml --config recipes/overlays/vllm.yaml \
    --trainer.accelerator gpu --trainer.default_root_dir "$OUT/quickstart-$(date +%s)" --model.export_dir null \
    > "$OUT/quickstart.log" 2>&1
code=$?
seconds=$(( $(date +%s) - start ))
result=$(grep -oE "accuracy_before=[0-9.]+ accuracy_after=[0-9.]+" "$OUT/quickstart.log" | tail -n 1)
if [ "$code" -ne 0 ] || [ -z "$result" ]; then
    status=1
    result="exit $code, see $OUT/quickstart.log"
fi
echo "gpu_check: tests ${tests:-none ran}; quickstart+vllm: ${result} in ${seconds} s ($([ $status -eq 0 ] && echo ok || echo FAILED))"
exit $status
