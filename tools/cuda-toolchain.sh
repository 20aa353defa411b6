#!/usr/bin/env bash
# A CUDA 13.0 compiler without a CUDA installation: nvcc, cicc and the headers from NVIDIA's
# PyPI wheels, unpacked into DIR (default ~/.cache/tutti/cuda13; downloaded once). Prints the
# environment that candle's CUDA build (tutti-parallel's `cuda` feature) needs:
#   eval "$(tools/cuda-toolchain.sh)"
#   cargo clippy -p tutti-parallel --features cuda          # compiles the kernels, links nothing
# Linking (cargo build) also needs the CUDA libraries and a libcuda stub: docs/gpu.md.
# CUDA 13.0 on purpose: a 13.0 driver (580) cannot load PTX from a newer compiler.
set -euo pipefail
DIR=${1:-$HOME/.cache/tutti/cuda13}
ROOT=$DIR/x/nvidia/cu13
if [ ! -x "$ROOT/bin/nvcc" ] || [ ! -d "$ROOT/include/nv" ]; then
    # A Python with pip: $PYTHON, else python3, else CI's torch virtualenv.
    PY=${PYTHON:-}
    for p in python3 "${TUTTI_TORCH_PYTHON:-}"; do
        if [ -z "$PY" ] && [ -n "$p" ] && "$p" -m pip --version >/dev/null 2>&1; then PY=$p; fi
    done
    if [ -z "$PY" ]; then
        echo "cuda-toolchain: no Python with pip here (set PYTHON)" >&2
        exit 2
    fi
    mkdir -p "$DIR/whl"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 -d "$DIR/whl" \
        nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 >&2
    for w in "$DIR"/whl/*.whl; do
        "$PY" -m zipfile -e "$w" "$DIR/x" >&2
    done
    chmod +x "$ROOT"/bin/* "$ROOT"/nvvm/bin/*
fi
echo "export CUDA_ROOT=$ROOT CUDA_HOME=$ROOT CUDA_PATH=$ROOT CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}"
echo "export PATH=$ROOT/bin:\$PATH"
