#!/usr/bin/env bash
# Build what tools/gpu-check.sh runs and copy it, stripped, to DIR (default .gpu/), for a GPU
# machine without cargo:  tools/gpu-bundle.sh [DIR]  then there:  tools/gpu-check.sh --bin DIR
set -eu
DIR=${1:-.gpu}
cargo build --release -p tutti-tools --features nccl --bins
test_bin=$(cargo test --release -p tutti-collectives --features nccl --test staging --no-run \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "staging" and m.get("executable"):
        print(m["executable"])')
mkdir -p "$DIR"
for b in collbench tutti-run gpucheck; do
    strip -o "$DIR/$b" "target/release/$b"
done
strip -o "$DIR/staging-tests" "$test_bin"
# tutti-golden with CUDA tensors needs candle's CUDA build (nvcc and the CUDA libraries to link,
# from NVIDIA's wheels: tools/cuda-link.sh, docs/gpu.md); bundled when built.
if [ -n "${WITH_GOLDEN:-}" ]; then
    envs=$("$(dirname "$0")/cuda-link.sh")
    eval "$envs"
    cargo build --release -p tutti-parallel --features cuda --bin tutti-golden
    strip -o "$DIR/tutti-golden" target/release/tutti-golden
fi
du -sh "$DIR"
