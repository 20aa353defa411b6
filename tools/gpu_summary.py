#!/usr/bin/env python3
"""The summary table of tools/gpu-check.sh, read from the logs and JSON files it wrote.

    python3 tools/gpu_summary.py OUT_DIR
"""
import glob
import json
import os
import re
import statistics
import sys


def read(out, name):
    p = os.path.join(out, name)
    return open(p, errors="replace").read() if os.path.exists(p) else ""


def med(v):
    return statistics.median(v) if v else float("nan")


def collbench_times(path, mode):
    """{bytes: time_us} of the allreduce run in a collbench JSON file."""
    try:
        doc = json.load(open(path))
    except (OSError, ValueError):
        return {}
    res = {}
    for run in doc.get("runs", []):
        for row in run.get("rows", []):
            m = row.get(mode, {})
            if m.get("wrong", 0) == 0 and m.get("time_us"):
                res[row["bytes"]] = m["time_us"]
    return res


def gloo_times(path):
    try:
        doc = json.load(open(path))
    except (OSError, ValueError):
        return {}
    return {r["bytes"]: r["time_us"] for r in doc.get("rows", []) if r.get("wrong", 0) == 0}


def human(b):
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= k and b % k == 0:
            return f"{b // k}{unit}"
    return str(b)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-check-out"
    ok = True
    print("\n==================== gpu-check summary ====================")
    info = read(out, "info.log")
    for line in info.splitlines():
        if "," in line and not line.startswith("$") and "name" not in line:
            print("gpu:", line.strip())
        if line.startswith(("cpus", "torch", "nccl library")):
            print(line.strip())

    suite = read(out, "suite.log")
    m = re.findall(r"test result: (\w+)\. (\d+) passed; (\d+) failed", suite)
    if m:
        print(f"staging suite on the GPU: {m[-1][0]} ({m[-1][1]} passed, {m[-1][2]} failed)")
        ok &= m[-1][0] == "ok"
    elif "suite" in os.listdir(out) or suite:
        print("staging suite: no result (see suite.log)")

    copy = read(out, "copy.log")
    rows = [l.split() for l in copy.splitlines() if l.startswith("copy ")]
    bw = {}
    if rows:
        print("\ncopy limit (GB/s)      pinned H2D  pinned D2H  pageable H2D  pageable D2H")
        for r in rows:
            b = int(r[1])
            bw[b] = tuple(float(x) for x in r[2:6])
            print(f"  {human(b):>6}               {r[2]:>8}    {r[3]:>8}      {r[4]:>8}      {r[5]:>8}")

    corr = read(out, "correct.log")
    lines = [l for l in corr.splitlines() if l.startswith("correct ")]
    if lines:
        print("\nstaged collectives against the host path and the oracle:")
        for n in sorted({re.search(r"n=(\d+)", l).group(1) for l in lines}):
            ln = [l for l in lines if f"n={n} " in l]
            fails = [l for l in ln if l.endswith("FAIL")]
            biggest = max(int(re.search(r"bytes=(\d+)", l).group(1)) for l in ln)
            print(f"  n={n}: {len(ln) - len(fails)}/{len(ln)} cases bit-exact (largest {human(biggest)})")
            for f in fails:
                print("    FAIL:", f)
            ok &= not fails
    if "TIMEOUT" in corr or "gpucheck:" in corr:
        for l in corr.splitlines():
            if "TIMEOUT" in l or l.startswith("gpucheck:") or "error" in l.lower():
                print("   ", l[:200])

    fault = read(out, "fault.log")
    if fault:
        print("\nfaults mid-allreduce (victim rank 1):")
        for block in re.split(r"^fault-case ", fault, flags=re.M)[1:]:
            head = block.splitlines()[0]
            recs = re.findall(r"^fault rank=(\d+) what=\w+ t_us=(\d+) after_ms=([\d.]+) names_victim=(\w+) error=(.*)$", block, re.M)
            abort = re.search(r"fault victim aborts t_us=(\d+)", block)
            n = int(re.search(r"n=(\d+)", head).group(1))
            survivors = [r for r in recs if r[0] != "1"]
            named = all(r[3] == "true" for r in recs)
            if abort:
                lat = [(int(r[1]) - int(abort.group(1))) / 1e3 for r in survivors]
                when = f"survivors raised {max(lat):.1f} ms after the abort (slowest)" if lat else "no survivor reported"
            else:
                when = f"every rank raised within {max(float(r[2]) for r in recs):.1f} ms of the call's start" if recs else "no rank reported"
            good = named and len(survivors) == n - 1
            ok &= good
            print(f"  {head.strip()}: {len(recs)} ranks reported, all name rank 1: {named}; {when} {'PASS' if good else 'FAIL'}")
            for r in recs[:2]:
                print(f"    rank {r[0]}: {r[4][:160]}")

    nccl = read(out, "nccl.log")
    if nccl:
        nl = [l for l in nccl.splitlines() if l.startswith("nccl n=")]
        fails = [l for l in nl if l.endswith("FAIL")]
        print(f"\nNCCL world 1: {len(nl) - len(fails)}/{len(nl)} cases equal to the host path")
        ok &= bool(nl) and not fails
        for l in nccl.splitlines():
            if "init failed" in l or "init ok" in l or "rc=" in l or "NCCL library" in l:
                print("  ", l[:220])

    san = read(out, "sanitizer.log")
    if san:
        # One block per sanitized command; memcheck also reports CUDA API calls that returned an
        # error ("Program hit ..."), which are not memory errors: count them apart, with the
        # function that made them.
        print("\ncompute-sanitizer memcheck:")
        for block in re.split(r"^\$ ", san, flags=re.M)[1:]:
            cmd = block.splitlines()[0]
            what = "NCCL" if " nccl" in cmd else ("staged, 2 ranks" if "correct" in cmd else "copies")
            summary = re.findall(r"ERROR SUMMARY: (\d+) error", block)
            if not summary:
                print(f"  {what}: no summary (see sanitizer.log)")
                ok = False
                continue
            api = re.findall(r"Program hit (\w+).*?Host Frame: ([A-Za-z_]\w*)", block, re.S)
            total = sum(int(x) for x in summary)
            memory = total - len(api)
            where = sorted({f"{e} in {f}" for e, f in api})
            note = f"; {len(api)} CUDA API errors returned to {', '.join(where)}" if api else ""
            print(f"  {what}: {memory} memory errors{note}")
            ok &= memory == 0

    # Performance: medians over rounds and per-round ratios.
    perf = {}
    for f in glob.glob(os.path.join(out, "perf-r*-n*-*.json")):
        m = re.search(r"perf-r(\d+)-n(\d+)-(\w+)\.json", f)
        if not m:
            continue
        r, n, dev = int(m.group(1)), int(m.group(2)), m.group(3)
        t = gloo_times(f) if dev == "gloo" else collbench_times(f, "ip")
        perf.setdefault((n, dev), {})[r] = t
    if perf:
        print("\nallreduce, in place, float32, mean µs per call (median over rounds); ratios are per-round medians")
        print("   n     size     host µs  staged µs  gloo-cuda µs  staged/host  gloo/staged  bound µs  staged/bound")
        for n in sorted({k[0] for k in perf}):
            host, cuda, gloo = (perf.get((n, d), {}) for d in ("host", "cuda", "gloo"))
            sizes = sorted({b for rr in cuda.values() for b in rr})
            for b in sizes:
                rounds = sorted(cuda)
                h = [host[r][b] for r in rounds if b in host.get(r, {})]
                c = [cuda[r][b] for r in rounds if b in cuda.get(r, {})]
                g = [gloo[r][b] for r in rounds if b in gloo.get(r, {})]
                ch = [cuda[r][b] / host[r][b] for r in rounds if b in host.get(r, {}) and b in cuda[r]]
                gc = [gloo[r][b] / cuda[r][b] for r in rounds if b in gloo.get(r, {}) and b in cuda[r]]
                bound = float("nan")
                near = min(bw, key=lambda x: abs(x - b)) if bw else None
                if near is not None and h:
                    h2d, d2h = bw[near][0], bw[near][1]
                    bound = 1.2 * (med(h) + b / (h2d * 1e3) + b / (d2h * 1e3))
                sb = med(c) / bound if bound == bound else float("nan")
                print(f"  {n:>2}  {human(b):>7}  {med(h):>10.0f} {med(c):>10.0f} {med(g):>13.0f}  {med(ch):>11.2f}  {med(gc):>11.2f}  {bound:>8.0f}  {sb:>12.2f}")

    # Other settings of TUTTI_STAGE_PIECES against the default (4 pieces on one host), same rounds.
    pieces = sorted({d for (_, d) in perf if d.startswith("cudap")}, key=lambda d: int(d[5:]))
    if pieces:
        print("\nstaged allreduce with TUTTI_STAGE_PIECES=P: mean µs per call (median over rounds); pP/d = per-round median ratio to the default")
        print("   n     size     default" + "".join(f"  pieces={d[5:]:<3} p{d[5:]}/d" for d in pieces))
        for n in sorted({k[0] for k in perf}):
            one = perf.get((n, "cuda"), {})
            sizes = sorted({b for d in pieces for rr in perf.get((n, d), {}).values() for b in rr})
            for b in sizes:
                row = f"  {n:>2}  {human(b):>7}  {med([one[r][b] for r in one if b in one[r]]):>10.0f}"
                for d in pieces:
                    pc = perf.get((n, d), {})
                    v = [pc[r][b] for r in pc if b in pc[r]]
                    rat = [pc[r][b] / one[r][b] for r in pc if b in pc[r] and b in one.get(r, {})]
                    row += f"  {med(v):>10.0f} {med(rat):>5.2f}"
                print(row)

    tune = {}
    for f in glob.glob(os.path.join(out, "tune-r*-n*-*.json")):
        m = re.search(r"tune-r(\d+)-n(\d+)-(.+)\.json", f)
        r, n, cfg = int(m.group(1)), int(m.group(2)), m.group(3)
        t = gloo_times(f) if cfg == "gloo" else collbench_times(f, "ip")
        tune.setdefault(n, {}).setdefault(cfg, {})[r] = t
    if tune:
        print("\nstaging settings: allreduce in place, mean µs per call, median over rounds")
        print("(sNNN-dD: segment bytes and depth; best/gloo and best/host are per-round ratios of the best staged setting)")
        for n in sorted(tune):
            cfgs = tune[n]
            staged = sorted((c for c in cfgs if c.startswith("s")),
                            key=lambda c: (int(re.search(r"d(\d+)", c).group(1)) != 3, int(re.search(r"s(\d+)", c).group(1))))
            sizes = sorted({b for c in cfgs.values() for rr in c.values() for b in rr})
            print(f"  n={n}  size   " + "".join(f"{c.replace('-', ' '):>14}" for c in ["host", "gloo"] + staged) + "   best        best/gloo  best/host")
            for b in sizes:
                meds = {c: med([cfgs[c][r][b] for r in cfgs[c] if b in cfgs[c][r]]) for c in ["host", "gloo"] + staged if c in cfgs}
                cand = {c: v for c, v in meds.items() if c.startswith("s") and v == v}
                best = min(cand, key=cand.get) if cand else None
                rg = [cfgs[best][r][b] / cfgs["gloo"][r][b] for r in cfgs.get(best, {}) if b in cfgs.get("gloo", {}).get(r, {}) and b in cfgs[best][r]] if best else []
                rh = [cfgs[best][r][b] / cfgs["host"][r][b] for r in cfgs.get(best, {}) if b in cfgs.get("host", {}).get(r, {}) and b in cfgs[best][r]] if best else []
                print(f"       {human(b):>6} " + "".join(f"{meds.get(c, float('nan')):>14.0f}" for c in ["host", "gloo"] + staged) + f"   {best or '-':<12} {med(rg):>8.2f}  {med(rh):>8.2f}")

    ov = read(out, "overlap.log")
    lines = [l for l in ov.splitlines() if "of the copy time ran" in l]
    if lines:
        print("\ncopy/network overlap, measured with CUDA events:")
        for l in lines:
            print("  ", l.lstrip("# "))
    gold = read(out, "golden.log")
    if gold:
        rcs = re.findall(r"^golden-rc case=(\S+) strategy=(\S+) n=(\d+) rc=(\d+)", gold, re.M)
        good = [r for r in rcs if r[3] == "0"]
        print(f"\nparallel layers with CUDA tensors (golden cases vs PyTorch): {len(good)}/{len(rcs)} runs PASS")
        for r in rcs:
            if r[3] != "0":
                print(f"  FAIL {r[0]} {r[1]} n={r[2]} rc={r[3]}")
        ok &= bool(rcs) and len(good) == len(rcs)
        # --repeat: pinned buffers allocated by each run of a case; after the first, none.
        runs = re.findall(r"^run (\d+) of (\d+): [\d.]+ ms, pinned allocations (\d+)", gold, re.M)
        if runs:
            first = [int(p) for (i, _, p) in runs if i == "1"]
            later = [int(p) for (i, _, p) in runs if i != "1"]
            print(f"  pinned allocations per run (rank 0): first runs {min(first, default=0)}-{max(first, default=0)}, "
                  f"later runs {min(later, default=0)}-{max(later, default=0)} over {len(later)} runs")
            ok &= all(p == 0 for p in later)

    mv = read(out, "moves.log")
    if mv:
        cur, res, warm = None, {}, []
        for line in mv.splitlines():
            m = re.match(r"moves-case round=(\d+) n=(\d+) mode=(\w+)", line)
            if m:
                cur = (int(m.group(1)), int(m.group(2)), m.group(3))
                continue
            m = re.match(r"moves bytes=(\d+) median_ms=([\d.]+) pinned_after_warmup=(\S+) op=(\S+)", line)
            if m and cur:
                r, n, mode = cur
                res.setdefault((n, m.group(4), int(m.group(1))), {}).setdefault(mode, {})[r] = float(m.group(2))
                if mode == "pinned" and m.group(3) != "-":
                    warm.append(int(m.group(3)))
        if res:
            print("\nparallel ops on CUDA tensors, forward + backward, median ms over steps (median over rounds); pinned/pageable per-round median")
            print("   n     size  pinned  pageable  ratio  op")
            for (n, op, b) in sorted(res):
                d = res[(n, op, b)]
                pi, pa = d.get("pinned", {}), d.get("pageable", {})
                rat = [pi[r] / pa[r] for r in pi if r in pa and pa[r] > 0]
                print(f"  {n:>2}  {human(b):>7}  {med(list(pi.values())):>6.2f}  {med(list(pa.values())):>8.2f}  {med(rat):>5.2f}  {op}")
            print(f"  pinned allocations after warm-up (every rank 0 op and size): {sorted(set(warm))}")
            ok &= all(w == 0 for w in warm)
        rcs = re.findall(r"^moves-rc round=(\d+) n=(\d+) mode=(\w+) rc=(\d+)", mv, re.M)
        bad = [r for r in rcs if r[3] != "0"]
        for r in bad:
            print(f"  FAIL moves round={r[0]} n={r[1]} mode={r[2]} rc={r[3]}")
        ok &= bool(res) and bool(rcs) and not bad
    print(f"\ngpu-check: {'all checks passed' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
