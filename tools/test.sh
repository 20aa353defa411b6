#!/usr/bin/env bash
# tutti's whole test suite, set-up included: the README's test command, and what .ci/run runs.
#
#   tools/test.sh [ARGS…]      ARGS go to the test runner (e.g. `-p tutti-collectives`, a test
#                              name)
#
# The runner is cargo-nextest where it is installed (every test in a process of its own, four at
# a time, tests of different binaries side by side; groups in .config/nextest.toml), then, when
# no ARGS are given, the doc tests with `cargo test --doc`; otherwise, or with
# TUTTI_TEST_NO_NEXTEST=1, `cargo test` (one binary after another). Either way every test runs
# even when one fails, so one failure never hides another. It first makes or reuses what the
# process tests need:
#   - torch, for the torchrun tests: a virtualenv outside the clone (TUTTI_TORCH_VENV, default
#     ~/.cache/tutti/venv-torch), made once (about 5 GB and several minutes from PyPI), reused
#     after;
#   - Slurm (slurm-wlm, munge) and Open MPI (openmpi-bin) from Debian, for the srun and mpirun
#     tests (root: installed with apt-get when missing; otherwise install them first). The
#     Slurm tests start and stop clusters of their own (tests/slurm/slurm.sh).
# On 2 cores the first run takes about 15 minutes (the build and torch's download), later ones
# 3–4 (nextest; about 7 under `cargo test`).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "== test.sh: $*" >&2; }

# The daemons live in /usr/sbin, which a non-root user's PATH may lack.
export PATH="$PATH:/usr/sbin:/sbin"

VENV="${TUTTI_TORCH_VENV:-$HOME/.cache/tutti/venv-torch}"
if [ -n "${TUTTI_TEST_NO_TORCH:-}" ]; then
    say "TUTTI_TEST_NO_TORCH set: the torchrun tests will not run"
else
    if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
        say "making the torch virtualenv $VENV (once; several minutes)"
        if ! python3 -m venv "$VENV" 2>/dev/null; then
            # Debian's python3 makes virtualenvs only with python3-venv.
            [ "$(id -u)" = 0 ] || { echo "test.sh: python3 cannot make a virtualenv: install python3-venv" >&2; exit 1; }
            apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
            python3 -m venv "$VENV"
        fi
        "$VENV/bin/pip" install --quiet --disable-pip-version-check torch numpy pytest
    fi
    export TUTTI_TORCH_PYTHON="$VENV/bin/python"
    say "$("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"
fi

need=()
if [ -z "${TUTTI_TEST_NO_SLURM:-}" ]; then
    command -v srun >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null \
        || need+=(slurm-wlm munge)
fi
if [ -z "${TUTTI_TEST_NO_MPI:-}" ]; then
    command -v mpirun >/dev/null || need+=(openmpi-bin)
fi
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "test.sh: the launcher tests need ${need[*]} (Debian packages): install them, run \
this as root, or set TUTTI_TEST_NO_SLURM=1 / TUTTI_TEST_NO_MPI=1 to skip those tests" >&2
        exit 1
    fi
    say "installing ${need[*]} from Debian"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ -z "${TUTTI_TEST_NO_NEXTEST:-}" ] && cargo nextest --version >/dev/null 2>&1; then
    say "cargo nextest run --workspace --release $*"
    rc=0
    cargo nextest run --workspace --release "$@" || rc=$?
    # nextest does not run doc tests; a test-name filter in ARGS would not apply to them.
    if [ $# -eq 0 ]; then
        say "cargo test --workspace --release --doc --no-fail-fast"
        cargo test --workspace --release --doc --no-fail-fast || rc=$?
    fi
    exit $rc
fi
say "cargo test --workspace --release --no-fail-fast $*"
exec cargo test --workspace --release --no-fail-fast "$@"
