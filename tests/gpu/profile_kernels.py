#!/usr/bin/env python3
"""Where a command's GPU time goes, kernel by kernel: runs it under Nsight Compute (ncu) with
one metric (each kernel's duration), then prints the kernels grouped by name, the most time
first, with their share of the total. tests/gpu/run uses it on a 512-token prefill, whose
first-token time (issue 5: <= 15 ms) is mostly GEMMs and attention in an unknown split.

    profile_kernels.py [--csv FILE] [--top N] -- COMMAND [ARGS...]
    profile_kernels.py --parse FILE [--top N]      (a CSV ncu wrote before)

ncu serializes the kernels and times each alone (no overlap between them, no programmatic
dependent launch), with caches and clocks left as they are: the sum is not the run's time,
but each kernel's share of it says where to work. Exit 77 (skipped) if ncu is not installed.
"""
import argparse
import csv
import glob
import io
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict

METRIC = "gpu__time_duration.sum"
UNIT_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
           "second": 1e9, "s": 1e9}


def short_name(name):
    """A kernel's name without its argument list: 'gemm_tiled<tiling<4, 2, ...>, true>'."""
    depth, out = 0, []
    for ch in name:
        if ch == "(" and depth == 0:
            break
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        out.append(ch)
    s = "".join(out).strip()
    return re.sub(r"^void ", "", s)


def parse(text):
    """{kernel: [count, total ns]} from ncu's --csv output (one row per kernel and metric)."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if '"Kernel Name"' in l and '"Metric Value"' in l),
                 None)
    if start is None:
        raise ValueError("no ncu CSV header (\"Kernel Name\" ... \"Metric Value\") in the output")
    rows = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    kernels = defaultdict(lambda: [0, 0.0])
    for r in rows:  # (the program's own lines after the table, if any, name no metric)
        if r.get("Metric Name") != METRIC:
            continue
        unit = (r.get("Metric Unit") or "nsecond").strip()
        if unit not in UNIT_NS:
            raise ValueError(f"unknown unit {unit!r} for {METRIC}")
        try:
            value = float((r.get("Metric Value") or "").replace(",", ""))
        except ValueError:
            raise ValueError(f"{METRIC} of {r.get('Kernel Name')!r} is not a number") from None
        k = kernels[short_name(r["Kernel Name"])]
        k[0] += 1
        k[1] += value * UNIT_NS[unit]
    if not kernels:
        raise ValueError(f"no {METRIC} rows in the ncu CSV")
    return kernels


def report(kernels, top):
    total = sum(ns for _, ns in kernels.values())
    launches = sum(n for n, _ in kernels.values())
    print(f"profile: {launches} kernel launches, {total / 1e6:.3f} ms of kernel time in all")
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    for name, (n, ns) in ranked[:top]:
        print(f"profile: {100 * ns / total:5.1f}% {ns / 1e6:8.3f} ms {n:6d} x "
              f"{ns / n / 1e3:8.2f} us  {name}")
    rest = ranked[top:]
    if rest:
        ns = sum(v[1] for _, v in rest)
        print(f"profile: {100 * ns / total:5.1f}% {ns / 1e6:8.3f} ms in {len(rest)} other kernels")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", help="where to keep ncu's CSV")
    ap.add_argument("--parse", help="summarize a CSV written before instead of running ncu")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.parse:
        with open(a.parse, encoding="utf-8", errors="replace") as f:
            report(parse(f.read()), a.top)
        return 0
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command to profile")
    # on PATH, or where CUDA and Nsight Compute install it (the device image has it under /opt)
    found = [shutil.which("ncu"), "/usr/local/cuda/bin/ncu",
             *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)]
    ncu = next((p for p in found if p and os.access(p, os.X_OK)), None)
    if not ncu:
        print("profile_kernels: ncu not found: skipped")
        return 77
    run = subprocess.run([ncu, "--csv", "--metrics", METRIC, "--cache-control", "none",
                          "--clock-control", "none", *cmd],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         errors="replace")
    if a.csv:
        with open(a.csv, "w", encoding="utf-8") as f:
            f.write(run.stdout)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-4000:])
        print(f"profile_kernels: ncu exited {run.returncode}")
        return 1
    try:
        report(parse(run.stdout), a.top)
    except ValueError as e:
        print(f"profile_kernels: {e}; the first lines were:")
        print("\n".join(run.stdout.splitlines()[:10]))
        sys.stderr.write(run.stderr[-2000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
