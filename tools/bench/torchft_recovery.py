#!/usr/bin/env python3
"""Recovery under torchft: tutti's process group against gloo's, the same job in the same run.

    python tools/bench/torchft_recovery.py [--rounds 3] [--modes kill,stop] [--timeout 10]

Each round runs, for every mode and both backends (alternating which goes first), the job of
tools/python/tests/worker_torchft.py: three replica processes under one torchft lighthouse
(heartbeat timeout 1 s), each averaging a 16 MiB gradient per step with `manager.allreduce`;
replica 2 SIGKILLs (`kill`) or SIGSTOPs (`stop`) itself 5 ms into step 3's allreduce. For each
survivor it takes, from the victim's own timestamp:

  error   the time until that allreduce returned with the manager's error set;
  commit  the time until the survivor's next committed step.

It prints the medians over rounds and survivors, and checks that the survivors ended with
equal parameters. The process groups' timeout is `--timeout` seconds (gloo's error on a stopped
peer is that timeout). Needs torch and torchft-nightly in the interpreter running it.
"""
import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "python", "tests"))

from test_torchft import replicas  # noqa: E402


def one(backend, mode, timeout):
    res = replicas(3, victim=2, backend=backend, mode=mode, timeout_s=timeout)
    _, ev, _, out = res[2]
    key = mode.upper()
    if key not in ev:
        raise RuntimeError(f"{backend}/{mode}: the victim did not fail:\n{out[-2000:]}")
    (failed_at,) = ev[key][0]
    errors, commits, digests = [], [], set()
    for r in (0, 1):
        rc, ev, digest, out = res[r]
        if rc != 0:
            raise RuntimeError(f"{backend}/{mode}: replica {r} exited {rc}:\n{out[-3000:]}")
        bad = [t for (_, t, ok) in ev["DONE"] if ok == 0 and t > failed_at]
        errors.append(bad[0] - failed_at if bad else float("nan"))
        later = [t for (_, t) in ev["COMMIT"] if t > failed_at]
        commits.append(later[0] - failed_at if later else float("nan"))
        digests.add(digest)
    if len(digests) != 1:
        raise RuntimeError(f"{backend}/{mode}: the survivors' parameters differ: {digests}")
    return errors, commits


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="kill,stop")
    ap.add_argument("--timeout", type=float, default=10.0)
    a = ap.parse_args()
    modes = a.modes.split(",")
    got = {(b, m): ([], []) for b in ("tutti", "gloo") for m in modes}
    for k in range(a.rounds):
        for m in modes:
            order = ("tutti", "gloo") if k % 2 == 0 else ("gloo", "tutti")
            for b in order:
                e, c = one(b, m, a.timeout)
                got[(b, m)][0].extend(e)
                got[(b, m)][1].extend(c)
                print(f"round {k} {m:4} {b:5}: error {', '.join(f'{x:.3f}' for x in e)} s; "
                      f"next commit {', '.join(f'{x:.3f}' for x in c)} s", flush=True)
    print(f"\n{'mode':5} {'backend':7} {'error (median)':>15} {'next commit (median)':>21}")
    for m in modes:
        for b in ("tutti", "gloo"):
            e, c = got[(b, m)]
            print(f"{m:5} {b:7} {statistics.median(e):14.3f}s {statistics.median(c):20.3f}s")


if __name__ == "__main__":
    main()
