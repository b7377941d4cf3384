#!/usr/bin/env python3
"""Every kernel launched with cllm_launch (programmatic dependent launch, vendor.h) calls
cllm_pdl_wait() before anything else: such a kernel may start while the kernel before it
still runs, so one that read or wrote memory first would race with it. No GPU can show the
race reliably; this keeps the rule from being broken silently.

The one exception is reading memory no kernel writes (the weights): a kernel listed in
WEIGHTS_FIRST may load weights before its wait, through the named loader only."""
import os
import re
import sys

from check_report import report

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CUDA_DIR = os.path.join(ROOT, "src", "backend", "cuda")
# kernel -> the only call allowed before its cllm_pdl_wait() (a loader of weights)
WEIGHTS_FIRST = {"gemm_skinny": "load_w_chunks", "gemm_tiled": "load_w_tile"}
LAUNCH = re.compile(r"\bcllm_launch\(\s*(\w+)")
KERNEL = re.compile(r"__global__[^;{]*?\b(\w+)\s*\(([^)]*)\)\s*\{", re.S)


def strip_comments(text):
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


def starts_with_wait(kernel, body):
    """The body starts with the wait, or (WEIGHTS_FIRST) only declarations and the named
    weight loader come before it."""
    if body.startswith("cllm_pdl_wait();"):
        return True
    loader = WEIGHTS_FIRST.get(kernel)
    wait = body.find("cllm_pdl_wait();")
    if loader is None or wait < 0:
        return False
    for stmt in filter(None, (s.strip() for s in body[:wait].split(";"))):
        calls = set(re.findall(r"\b(\w+)\s*(?:<[^;()]*>)?\s*\(", stmt))
        # declarations may call the pure helpers that compute rows and slices, and name the
        # shared-memory ring through a cast
        if calls - {loader, "slice_start", "block_rows", "tile_w_row", "for", "if", "sizeof",
                    "reinterpret_cast"}:
            return False
        if "=" in stmt.replace("==", "").replace("<=", "").replace(">=", "") and \
                re.search(r"\b(x|y|ep)\s*\[", stmt):
            return False
    return True


def main():
    failures, launched, checked = [], set(), 0
    kernels = {}
    for name in sorted(os.listdir(CUDA_DIR)):
        if not name.endswith(".cu"):
            continue
        code = strip_comments(open(os.path.join(CUDA_DIR, name), encoding="utf-8").read())
        for m in LAUNCH.finditer(code):
            launched.add((m.group(1), name))
        for m in KERNEL.finditer(code):
            kernels[m.group(1)] = (name, starts_with_wait(m.group(1), code[m.end():].lstrip()))
    for kernel, where in sorted(launched):
        if kernel not in kernels:
            failures.append(f"{where}: cllm_launch of {kernel}, whose definition was not found")
            continue
        checked += 1
        if not kernels[kernel][1]:
            failures.append(f"{kernels[kernel][0]}: kernel {kernel} is launched with cllm_launch "
                            "but does not start with cllm_pdl_wait(); (WEIGHTS_FIRST kernels: "
                            "its weight loader only before it)")
    if checked < 10:
        failures.append(f"only {checked} launched kernels found: is the scan broken?")
    return report(failures, f"{checked} kernels launched with cllm_launch")


if __name__ == "__main__":
    sys.exit(main())
