#!/usr/bin/env python3
"""Every kernel launched with cllm_launch (programmatic dependent launch, vendor.h) calls
cllm_pdl_wait() before anything else: such a kernel may start while the kernel before it
still runs, so one that read or wrote memory first would race with it. No GPU can show the
race reliably; this keeps the rule from being broken silently."""
import os
import re
import sys

from check_report import report

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CUDA_DIR = os.path.join(ROOT, "src", "backend", "cuda")
LAUNCH = re.compile(r"\bcllm_launch\(\s*(\w+)")
KERNEL = re.compile(r"__global__[^;{]*?\b(\w+)\s*\(([^)]*)\)\s*\{", re.S)


def strip_comments(text):
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)


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
            body = code[m.end():].lstrip()
            kernels[m.group(1)] = (name, body.startswith("cllm_pdl_wait();"))
    for kernel, where in sorted(launched):
        if kernel not in kernels:
            failures.append(f"{where}: cllm_launch of {kernel}, whose definition was not found")
            continue
        checked += 1
        if not kernels[kernel][1]:
            failures.append(f"{kernels[kernel][0]}: kernel {kernel} is launched with cllm_launch "
                            "but does not start with cllm_pdl_wait();")
    if checked < 10:
        failures.append(f"only {checked} launched kernels found: is the scan broken?")
    return report(failures, f"{checked} kernels launched with cllm_launch")


if __name__ == "__main__":
    sys.exit(main())
