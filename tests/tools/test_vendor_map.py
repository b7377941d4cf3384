#!/usr/bin/env python3
"""The MUSA seam stays complete: every CUDA runtime / cuBLAS name that src/backend/cuda uses
(cuda*, cublas*, CUBLAS_*, CUDA_R_*) has its #define to a MUSA twin in vendor.h, and CUDA
headers are included only by vendor.h; and no kernel calls a warp intrinsic whose result
depends on the warp's width except through warp.h. We cannot build for MUSA here; this keeps
the mapping from silently falling behind the code."""
import os
import re
import sys

from check_report import report

# Warp collectives whose meaning depends on the hardware's warp width (32 on NVIDIA, 128 on
# Moore Threads' QY1/QY2): kernels call warp.h's 32-lane wrappers instead.
RAW_WARP = re.compile(r"\b(__shfl\w*_sync|__ballot_sync|__any_sync|__all_sync|__activemask|__match\w*_sync|warpSize)\b")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CUDA_DIR = os.path.join(ROOT, "src", "backend", "cuda")
NAME = re.compile(r"\b(cuda[A-Z]\w*|cublas[A-Z]\w*|CUBLAS_[A-Z0-9_]+|CUDA_R_[0-9A-Z]+)\b")
INCLUDE = re.compile(r'#include\s*[<"](cuda\w*\.h|cublas\w*\.h|cuda_runtime\w*\.h)[>"]')


def main():
    vendor = open(os.path.join(CUDA_DIR, "vendor.h"), encoding="utf-8").read()
    musa = vendor.split("#if defined(CLLM_MUSA)", 1)[1].split("#else", 1)[0]
    mapped = set(re.findall(r"#define\s+(\w+)\s+\w+", musa))
    used, failures = {}, []
    for name in sorted(os.listdir(CUDA_DIR)):
        if not name.endswith((".cu", ".h")) or name == "vendor.h":
            continue
        text = open(os.path.join(CUDA_DIR, name), encoding="utf-8").read()
        no_comments = re.sub(r"/\*.*?\*/|//[^\n]*", "", text, flags=re.S)
        code = re.sub(r'"(\\.|[^"\\])*"', '""', no_comments)  # names in messages do not count
        for n in NAME.findall(code):
            used.setdefault(n, name)
        if name != "warp.h":
            for raw in sorted(set(RAW_WARP.findall(code))):
                failures.append(f"{name} calls {raw}: use warp.h's 32-lane wrappers")
        for inc in INCLUDE.findall(no_comments):
            failures.append(f"{name} includes {inc} itself: only vendor.h may")
        first = re.search(r'#include\s*[<"]([^>"]+)[>"]', no_comments)
        if name.endswith(".cu") and (not first or first.group(1) != "backend/cuda/vendor.h"):
            failures.append(f"{name} does not include backend/cuda/vendor.h first")
    for n, where in sorted(used.items()):
        if n not in mapped:
            failures.append(f"{n} (used in {where}) has no MUSA mapping in vendor.h")
    if len(used) < 20:
        failures.append(f"only {len(used)} CUDA names found: is the scan broken?")
    return report(failures, f"{len(used)} CUDA names used, {len(mapped)} mapped")


if __name__ == "__main__":
    sys.exit(main())
