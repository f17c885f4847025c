#!/usr/bin/env bash
# Builds llama-cpp-python once into a wheel directory that later runs (make, CI) reuse.
#
# Why a build of our own, and why these flags (the one place this is decided):
# - llama-cpp-python ships only a source distribution; it compiles llama.cpp (5-7 min on 2 cores).
# - A native build (-march=native) on a CPU with AMX (Intel Sapphire Rapids and later) turns on
#   ggml's AMX kernels, and any decode of 2+ tokens then segfaults in ggml_backend_amx_mul_mat
#   (llama.cpp tile-config bug, upstream issue 20824 / PR 26954). We keep -march=native (the best
#   kernels the machine has, AVX-512 where present, AVX2 elsewhere) and switch the AMX ISA off
#   with -mno-amx-*: GCC and Clang honour an explicit -mno-X over what -march implies, whatever
#   the order, so this works on any x86-64 CPU, with or without AMX or AVX-512.
#   A fixed list of -DGGML_AVX512=ON... flags would instead die with SIGILL on AVX2-only CPUs.
# - The wheel directory is keyed by the CPU's flags, so a native wheel is never reused on a
#   machine whose instruction set differs.
# - pip's own wheel cache ignores CMAKE_ARGS, so we build with --no-cache-dir into our own dir.
set -euo pipefail
version="${LLAMA_CPP_VERSION:-0.3.36}"
python="${PYTHON:-python3}"
cpu_key=$( (grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || uname -m) | sha256sum | cut -c1-12)
wheel_dir="${CASCADE_WHEEL_DIR:-$HOME/.cache/cascade/wheels}/$(uname -m)-$cpu_key"
mkdir -p "$wheel_dir"
if ls "$wheel_dir"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
  echo "$wheel_dir"
  exit 0
fi
cmake_args="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
if [ "$(uname -m)" = "x86_64" ]; then
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake_args="$cmake_args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  cmake_args="$cmake_args -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
fi
echo "building llama-cpp-python $version into $wheel_dir (takes several minutes)" >&2
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$python" -m pip wheel --no-cache-dir --no-deps "llama-cpp-python==$version" -w "$wheel_dir" >&2
echo "$wheel_dir"
