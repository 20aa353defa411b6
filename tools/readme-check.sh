#!/usr/bin/env bash
# Runs the README's code blocks as written, from a scratch copy of the repository, so the README
# cannot drift from what works. CI runs it after the test suite (tools/test.sh). Needs root (a
# two-node Slurm cluster on network namespaces) and what tools/test.sh installs.
#
#   tools/readme-check.sh            every block
#   tools/readme-check.sh --list     print the script it would run, and stop
#
# What it does:
#   - copies the repository's files (tracked, and untracked but not ignored) to a scratch
#     directory, and runs everything there: a fresh build, as a new user's;
#   - checks that the Rust block of "Ten lines" is collectives/examples/ten_lines.rs, byte for
#     byte;
#   - joins every ```sh block into one bash script (-euo pipefail, each command echoed) and runs
#     it, with two changes, both said here and in the script's output:
#       * the line `tools/test.sh` is not run: it is the suite CI runs just before this;
#       * a line starting `srun ` runs on node 0 of a two-node Slurm cluster made of network
#         namespace hosts (tests/slurm/slurm.sh), since `srun -N 2` needs two nodes;
#   - mpirun as root needs Open MPI's consent, and 4 ranks on 2 cores need oversubscription:
#     both are given through the environment (OMPI_ALLOW_RUN_AS_ROOT*, OMPI_MCA_rmaps_base_
#     oversubscribe), as the README's comment says.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
readme="$root/README.md"

# The blocks: ```sh … ``` in order; the Rust block of "Ten lines".
script="$(awk '
    /^```sh$/ { inblock = 1; print "# --- README block " ++n; next }
    /^```$/ { inblock = 0; next }
    inblock {
        if ($0 == "tools/test.sh") { print ": skipped here: tools/test.sh is the suite CI runs before this check"; next }
        if ($0 ~ /^srun /) { print "on_node0 " $0; next }
        print
    }' "$readme")"
if [ "${1:-}" = "--list" ]; then
    printf '%s\n' "$script"
    exit 0
fi

rust_block="$(awk '/^```rust/ { inb = 1; next } /^```$/ { inb = 0 } inb' "$readme")"
if [ "$rust_block" != "$(cat "$root/collectives/examples/ten_lines.rs")" ]; then
    echo "readme-check: the README's Rust block differs from collectives/examples/ten_lines.rs:" >&2
    diff <(printf '%s\n' "$rust_block") "$root/collectives/examples/ten_lines.rs" >&2 || true
    exit 1
fi
echo "readme-check: the Ten lines block is collectives/examples/ten_lines.rs"

[ "$(id -u)" = 0 ] || { echo "readme-check: needs root (a Slurm cluster on namespaces)" >&2; exit 1; }
# What the blocks and the cluster use beyond what tools/test.sh installs.
missing=()
command -v openssl >/dev/null || missing+=(openssl)
command -v ip >/dev/null || missing+=(iproute2)
command -v nsenter >/dev/null || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

scratch="$(mktemp -d "${TMPDIR:-/tmp}/tutti-readme.XXXXXX")"
name="rm$$"
cleanup() {
    bash "$root/tests/slurm/slurm.sh" down "$scratch/slurm" >/dev/null 2>&1 || true
    bash "$root/tests/cluster/cluster.sh" down --name "$name" >/dev/null 2>&1 || true
    rm -rf "$scratch"
}
trap cleanup EXIT

mkdir -p "$scratch/repo"
# Tracked files deleted from the work tree are not copied (a user's clone would not have them).
(cd "$root" && git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do
    [ -e "$f" ] && cp --parents -- "$f" "$scratch/repo"
done; true)
echo "readme-check: a scratch copy in $scratch/repo ($(cd "$scratch/repo" && find . -type f | wc -l) files)"

bash "$root/tests/cluster/cluster.sh" up 2 --name "$name" >/dev/null
bash "$root/tests/slurm/slurm.sh" up "$scratch/slurm" "$name-h0" "$name-h1"

cat >"$scratch/run.sh" <<EOF
set -euo pipefail
# srun from node 0 of the namespace cluster.
on_node0() { SLURM_CONF="$scratch/slurm/slurm.conf" nsenter --net=/run/netns/$name-h0 "\$@"; }
# Each command is echoed, with the job secret the README exports blanked out of the log.
exec {trace}> >(sed -E 's/(TUTTI_TOKEN=)[^ ]+/\1<secret>/g' >&2)
BASH_XTRACEFD=\$trace
# Each command's line starts with the seconds since the script began.
PS4='+ [\${SECONDS} s] '
set -x
$script
EOF
cd "$scratch/repo"
start=$(date +%s)
env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u TUTTI_STORE -u TUTTI_TOKEN \
    -u CARGO_TARGET_DIR \
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
    bash "$scratch/run.sh"
echo "readme-check: every README block ran as written in $(( $(date +%s) - start )) s"
