#!/usr/bin/env python3
"""One self-contained binary: cllm needs no CUDA library to start (the CUDA runtime is linked
statically and finds the driver itself; cuBLAS is opened at run time, src/backend/cuda/blas.cu),
so a CUDA build also runs on a machine without the toolkit."""
import os
import subprocess
import sys

from check_report import report

BIN = os.environ["CLLM_BIN"]


def main():
    out = subprocess.run(["ldd", BIN], capture_output=True, text=True, check=False).stdout
    libs = [line.split()[0] for line in out.splitlines() if line.strip()]
    failures = [f"cllm links {lib}" for lib in libs
                if any(name in lib for name in ("libcublas", "libcudart", "libmublas", "libmusart"))]
    if not libs:
        failures.append(f"ldd printed nothing for {BIN}")
    return report(failures, f"{len(libs)} shared libraries")


if __name__ == "__main__":
    sys.exit(main())
