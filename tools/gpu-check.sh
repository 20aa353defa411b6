#!/usr/bin/env bash
# The whole GPU check in one command, on a machine with an NVIDIA GPU (docs/gpu.md).
#
#   tools/gpu-check.sh [--bin DIR] [--out DIR] [--rounds R] [--phases LIST]
#
# DIR holds the binaries built elsewhere (the GPU machine needs no cargo):
#   cargo build --release -p tutti-tools --features nccl --bins     # collbench tutti-run gpucheck
#   cargo test --release -p tutti-collectives --features nccl --test staging --no-run
# copied to DIR with the staging test binary renamed `staging-tests` (tools/gpu-bundle.sh does
# that, stripped). Default DIR: target/release.
#
# Phases (default all, in this order): info suite copy correct fault nccl sanitizer perf tune
# overlap golden moves. Each writes OUT/<phase>.log; the summary table at the end is read from
# those logs. Settings from the environment: PERF_MAX (largest perf size, default 1G),
# PERF_PIECES (TUTTI_STAGE_PIECES values timed in each perf round up to 16 MiB against the
# default, which cuts calls of one host into 4; default "1 2"),
# GOLDEN_REPEAT (runs of each golden case, default 3), MOVES_SIZES (default 1M,16M).
# torch (for the gloo-CUDA comparison), compute-sanitizer and NCCL (a wheel's libnccl.so.2) are
# used when present and reported missing otherwise.
set -u
BIN=target/release
OUT=gpu-check-out
ROUNDS=3
PHASES="info suite copy correct fault nccl sanitizer perf tune overlap golden moves"
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) BIN=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --phases) PHASES=$(echo "$2" | tr , ' '); shift 2 ;;
        -h|--help) sed -n 2,19p "$0"; exit 0 ;;
        *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
    esac
done
HERE=$(cd "$(dirname "$0")" && pwd)

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none); this check only" \
         "runs where a GPU is. Without one, the simulated device's tests cover the staging" \
         "engine: cargo test -p tutti-collectives --test staging" >&2
    exit 2
fi
for b in collbench tutti-run gpucheck; do
    if [ ! -x "$BIN/$b" ]; then
        echo "gpu-check: $BIN/$b is missing: build with --features nccl (see the top of $0)" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}

# NCCL: cudarc opens libnccl.so (or .so.1); the wheel ships libnccl.so.2 only.
NCCL_DIR=""
if ncclso=$("$PY" -c 'import nvidia.nccl, os, glob; d = os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0]; print(glob.glob(os.path.join(d, "lib", "libnccl.so*"))[0])' 2>/dev/null); then
    NCCL_DIR="$OUT/ncclib"
    mkdir -p "$NCCL_DIR"
    ln -sf "$ncclso" "$NCCL_DIR/libnccl.so"
fi
with_nccl() { (export LD_LIBRARY_PATH="${NCCL_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; "$@"); }

# run PHASE SECONDS CMD...: the command's output to OUT/PHASE.log (appended) and the terminal.
log() { echo "$*" | tee -a "$OUT/$PHASE.log"; }
run() {
    local secs=$1; shift
    echo "\$ $*" >>"$OUT/$PHASE.log"
    timeout -k 10 "$secs" "$@" 2>&1 | tee -a "$OUT/$PHASE.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && log "gpu-check: TIMEOUT after ${secs}s: $*"
    return "$rc"
}

phase_info() {
    run 30 nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
    log "cpus $(nproc) mem $(free -g | awk '/Mem/{print $2}') GiB kernel $(uname -r) date $(date -u +%F)"
    log "nccl library: ${NCCL_DIR:-none found}"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tee -a "$OUT/info.log"
}

phase_suite() {
    if [ -x "$BIN/staging-tests" ]; then
        run 300 env TUTTI_TEST_DEVICE=cuda "$BIN/staging-tests" --test-threads 1
        log "suite rc=$?"
    else
        log "suite: $BIN/staging-tests missing"
    fi
}

phase_copy() { run 180 "$BIN/gpucheck" copy; }

phase_correct() {
    run 240 "$BIN/tutti-run" --nproc 2 --no-prefix "$BIN/gpucheck" correct --big 0
    run 300 "$BIN/tutti-run" --nproc 4 --no-prefix "$BIN/gpucheck" correct --counts 1,1000,1048583,16777259 --big 1073741824
}

phase_fault() {
    for what in cuda kill; do
        for n in 2 4; do
            log "fault-case what=$what n=$n"
            run 60 "$BIN/tutti-run" --nproc "$n" --no-prefix "$BIN/gpucheck" fault "$what" --victim 1
            log "fault-rc what=$what n=$n rc=$?"
        done
    done
}

phase_nccl() {
    if [ -z "$NCCL_DIR" ]; then log "nccl: no libnccl found under $PY's site-packages"; return; fi
    with_nccl run 120 "$BIN/tutti-run" --nproc 1 --no-prefix "$BIN/gpucheck" nccl
    log "nccl-world1 rc=$?"
    with_nccl run 120 "$BIN/tutti-run" --nproc 2 --no-prefix "$BIN/gpucheck" nccl --counts 1000
    log "nccl-world2 rc=$?"
    with_nccl run 120 "$BIN/collbench" allreduce -b 1M -e 64M -f 4 -n 5 --np 1 --device nccl
    # Asked for NCCL without the library: hide every copy the loader could open (/dev/null bound
    # over each, in a private mount namespace), and the error must say NCCL is missing.
    local libs
    libs=$( (ldconfig -p | awk '/libnccl\.so/{print $NF}'; find / -xdev -name 'libnccl.so*' \
        -not -path '/proc/*' 2>/dev/null) | sort -u | tr '\n' ' ')
    log "nccl copies hidden for the missing-library case: $libs"
    run 60 unshare -m sh -c 'for f in $0; do mount --bind /dev/null "$f" || exit 3; done;
        exec "$1" allreduce -b 1M -e 1M --np 1 --device nccl' "$libs" "$BIN/collbench"
    log "nccl-missing rc=$?"
}

phase_sanitizer() {
    if ! command -v compute-sanitizer >/dev/null; then log "sanitizer: compute-sanitizer not found"; return; fi
    run 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$BIN/gpucheck" copy --sizes 1048576 --reps 1
    run 150 compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
        "$BIN/tutti-run" --nproc 2 --no-prefix "$BIN/gpucheck" correct --counts 1,1000,65537 --dtypes f32 --big 0
    log "sanitizer-staged rc=$?"
    if [ -n "$NCCL_DIR" ]; then
        with_nccl run 100 compute-sanitizer --tool memcheck --error-exitcode 9 \
            --target-processes all "$BIN/tutti-run" --nproc 1 --no-prefix "$BIN/gpucheck" nccl \
            --counts 1,1000
        log "sanitizer-nccl rc=$?"
    fi
}

# The perf sweep: 1 MiB to PERF_MAX by factors of 4.
PERF_MAX=${PERF_MAX:-1G}
# PERF_MAX_256M=1: stop the timing sweep at 256 MiB (a shorter run).
if [ -n "${PERF_MAX_256M:-}" ]; then PERF_MAX=256M; fi
gloo_sizes=$("$PY" -c 'import sys
u = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
m = sys.argv[1]
top = int(m[:-1]) * u[m[-1]] if m[-1] in u else int(m)
s, out = 1 << 20, []
while s <= top:
    out.append(str(s)); s *= 4
print(",".join(out))' "$PERF_MAX") && [ -n "$gloo_sizes" ] || {
    echo "gpu-check: PERF_MAX=$PERF_MAX: expected a size of at least 1M, such as 256M or 1G" >&2
    exit 2
}
PERF_PIECES=$(echo "${PERF_PIECES-1 2}" | tr , ' ')
phase_perf() {
    local have_torch=1
    "$PY" -c 'import torch, torch.distributed' 2>/dev/null || have_torch=0
    local devs="host cuda"
    for p in $PERF_PIECES; do devs="$devs cudap$p"; done
    for r in $(seq 1 "$ROUNDS"); do
        for n in 2 4; do
            for dev in $devs gloo; do
                log "perf round=$r n=$n dev=$dev"
                case $dev in
                    gloo)
                        [ $have_torch = 1 ] || continue
                        run 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" \
                            "$HERE/bench/gloo_cuda.py" --sizes "$gloo_sizes" --iters 5 \
                            --json "$OUT/perf-r$r-n$n-gloo.json" ;;
                    cudap*)
                        # The same staged allreduce with another TUTTI_STAGE_PIECES, up to 16 MiB.
                        run 240 env TUTTI_STAGE_PIECES="${dev#cudap}" "$BIN/collbench" allreduce \
                            -b 1M -e 16M -f 4 -n 5 -w 1 --np "$n" --device cuda \
                            -J "$OUT/perf-r$r-n$n-$dev.json" ;;
                    *)
                        run 240 "$BIN/collbench" allreduce -b 1M -e "$PERF_MAX" -f 4 -n 5 -w 1 --np "$n" \
                            --device "$dev" -J "$OUT/perf-r$r-n$n-$dev.json" ;;
                esac
            done
        done
    done
}

# Staging settings: segment sizes (depth 3) and depths (4 MiB segments) over 1 MiB-256 MiB,
# with the host path and gloo-CUDA in the same rounds, so the choice and its margin are same-run.
phase_tune() {
    local have_torch=1
    "$PY" -c 'import torch, torch.distributed' 2>/dev/null || have_torch=0
    for r in 1 2; do
        for n in 2 4; do
            log "tune round=$r n=$n host"
            run 120 "$BIN/collbench" allreduce -b 1M -e 256M -f 4 -n 5 -w 1 --np "$n" \
                -J "$OUT/tune-r$r-n$n-host.json"
            if [ $have_torch = 1 ]; then
                log "tune round=$r n=$n gloo"
                run 180 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" \
                    "$HERE/bench/gloo_cuda.py" --sizes 1048576,4194304,16777216,67108864,268435456 \
                    --iters 5 --json "$OUT/tune-r$r-n$n-gloo.json"
            fi
            for cfg in 1048576:3 2097152:3 4194304:3 8388608:3 16777216:3 4194304:2 4194304:4; do
                seg=${cfg%:*} depth=${cfg#*:}
                log "tune round=$r n=$n seg=$seg depth=$depth"
                # Whole segments (no pieces), as the sweep that set the defaults measured them.
                run 120 env TUTTI_STAGE_SEGMENT_BYTES=$seg TUTTI_STAGE_DEPTH=$depth TUTTI_STAGE_PIECES=1 \
                    "$BIN/collbench" allreduce -b 1M -e 256M -f 4 -n 5 -w 1 --np "$n" --device cuda \
                    -J "$OUT/tune-r$r-n$n-s$seg-d$depth.json"
            done
        done
    done
}

phase_overlap() {
    for n in 2 4; do
        log "overlap n=$n"
        run 120 "$BIN/collbench" allreduce -b 256M -e 256M -n 5 -w 1 --np "$n" --device cuda --copy-timing
    done
}

# The folders of the CUDA 13 libraries tutti-golden's candle links (cuBLAS, cuRAND, the runtime),
# wherever this machine has them, as an LD_LIBRARY_PATH prefix (never tools/cuda-link.sh's
# folder, whose libcuda.so.1 is a stub for linking).
cuda_libdirs() {
    find / \( -path /proc -o -path /sys -o -path /dev -o -name cuda13-link \) -prune -o \( \
        -name 'libcublas.so.13' -o -name 'libcurand.so.10' -o -name 'libcudart.so.13' \) \
        -print 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':'
}

# The parallel layers with CUDA tensors: the golden cases G1-G3 under each strategy at worlds 1,
# 2 and 4 (processes on one host, one GPU shared), against PyTorch's reference within each case's
# tolerance. Needs tutti-golden built with tutti-parallel's `cuda` feature (docs/gpu.md).
phase_golden() {
    if [ ! -x "$BIN/tutti-golden" ]; then log "golden: $BIN/tutti-golden missing"; return; fi
    local libdirs
    libdirs=$(cuda_libdirs)
    log "golden: CUDA libraries from ${libdirs:-nowhere}"
    local g=${GOLDEN_DIR:-$HERE/../parallel/golden}
    for spec in g1_linear_step:dp g1_linear_step:accum g1_linear_step:tp g2_mlp_train:dp \
        g2_mlp_train:tp g3_transformer_block:tp g3_transformer_block:tp-sp \
        g3_transformer_block:ulysses; do
        for n in 1 2 4; do
            log "golden case=${spec%:*} strategy=${spec#*:} n=$n"
            run 120 env LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}" "$BIN/tutti-run" \
                --nproc "$n" --no-prefix "$BIN/tutti-golden" --case "$g/${spec%:*}.json" \
                --strategy "${spec#*:}" --device cuda --repeat "${GOLDEN_REPEAT:-3}"
            log "golden-rc case=${spec%:*} strategy=${spec#*:} n=$n rc=$?"
        done
    done
}

# The communication ops' forward and backward on CUDA tensors (tutti-golden --bench-moves):
# pinned staging (the default) against candle's pageable copies, two interleaved rounds.
phase_moves() {
    if [ ! -x "$BIN/tutti-golden" ]; then log "moves: $BIN/tutti-golden missing"; return; fi
    local libdirs
    libdirs=$(cuda_libdirs)
    for r in 1 2; do
        for n in 2 4; do
            for mode in pinned pageable; do
                log "moves-case round=$r n=$n mode=$mode"
                run 120 env LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}" \
                    TUTTI_CUDA_MOVES=$mode "$BIN/tutti-run" --nproc "$n" --no-prefix \
                    "$BIN/tutti-golden" --bench-moves "${MOVES_SIZES:-1M,16M}" --steps 5 --device cuda
                log "moves-rc round=$r n=$n mode=$mode rc=$?"
            done
        done
    done
}

for PHASE in $PHASES; do
    : >"$OUT/$PHASE.log"
    echo "=== $PHASE ($(date -u +%T))"
    "phase_$PHASE"
done

"$PY" "$HERE/gpu_summary.py" "$OUT"
