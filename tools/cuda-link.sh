#!/usr/bin/env bash
# What linking candle's CUDA build (tutti-parallel's `cuda` feature: tutti-golden with CUDA
# tensors) needs on a machine without CUDA: cuBLAS, cuRAND and NVRTC from NVIDIA's PyPI wheels,
# unversioned .so links to them and to the CUDA runtime of tools/cuda-toolchain.sh, and a
# libcuda.so.1 stub (one function per cu* symbol of cudarc's driver bindings; each returns
# CUDA_ERROR_NO_DEVICE). Made once in DIR (default ~/.cache/tutti/cuda13-link); prints the
# environment:
#   eval "$(tools/cuda-link.sh)"
#   cargo build --release -p tutti-parallel --features cuda --bin tutti-golden
# At run time the GPU machine's driver and CUDA 13 libraries take the stub's and links' place.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${1:-$HOME/.cache/tutti/cuda13-link}
TOOLCHAIN=$("$HERE/cuda-toolchain.sh")
eval "$TOOLCHAIN"
LIB=$DIR/lib
if [ ! -e "$LIB/libcuda.so" ]; then
    PY=${PYTHON:-python3}
    mkdir -p "$DIR/whl" "$LIB"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux2010_x86_64 -d "$DIR/whl" \
        nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88 >&2
    for w in "$DIR"/whl/nvidia_cublas-13.0.2.14-*.whl "$DIR"/whl/nvidia_curand-10.4.0.35-*.whl \
        "$DIR"/whl/nvidia_cuda_nvrtc-13.0.88-*.whl; do
        "$PY" -m zipfile -e "$w" "$DIR/x" >&2
    done
    for f in "$DIR"/x/nvidia/cu13/lib/*.so.* "$CUDA_ROOT"/lib/libcudart.so.*; do
        [ -e "$f" ] || continue
        b=$(basename "$f")
        ln -sf "$f" "$LIB/$b"
        ln -sf "$b" "$LIB/${b%%.so*}.so"
    done
    # The driver symbols of the cudarc that candle links (Cargo.lock's 0.19; `cargo fetch`
    # puts its sources in cargo's registry).
    ver=$(awk '/^name = "cudarc"/ { getline; print $3 }' "$HERE/../Cargo.lock" | tr -d '"' \
        | grep '^0\.19\.' | head -1)
    sys=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$ver"/src/driver/sys/mod.rs \
        2>/dev/null | head -1)
    if [ -z "$ver" ] || [ -z "$sys" ]; then
        echo "cuda-link: cudarc 0.19's sources not found in cargo's registry (run cargo fetch)" >&2
        exit 2
    fi
    grep -oE '\bfn cu[A-Za-z0-9_]*\(' "$sys" | sed -E 's/fn (.*)\(/int \1(void) { return 100; }/' \
        | sort -u >"$DIR/stub.c"
    cc -shared -fPIC -o "$LIB/libcuda.so.1" "$DIR/stub.c" -Wl,-soname,libcuda.so.1
    ln -sf libcuda.so.1 "$LIB/libcuda.so"
fi
echo "$TOOLCHAIN"
echo "export LIBRARY_PATH=$LIB\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
