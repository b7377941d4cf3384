#!/usr/bin/env python3
"""The MUSA build's sources get past a clang CUDA front end.

The MUSA SDK compiles src/backend/cuda with its clang++ (`-x musa`, CMakeLists.txt), a fork of
clang's CUDA support; nvcc compiles the CUDA build and g++ the emulator's, and neither checks
what clang checks (the __host__/__device__ rules, which overloads its headers declare) nor the
MUSA configuration's API calls. No MUSA SDK is available here, so this compiles every .cu file
with -DCLLM_MUSA under Debian's clang 19 in CUDA mode, for the host and, to PTX, for the
device, against a stand-in SDK (tests/tools/musa_standin): the MUSA names vendor.h maps to,
spelled as their twins in CUDA 11.8's runtime headers (PyPI's nvidia-cuda-runtime-cu11,
fetched by scripts/setup --test), the API MUSA SDK 3.1 mirrors where CUDA 12 changed it.
It also checks that no inline assembly (PTX) reaches the MUSA configuration's device code,
and runs controls that show each of these checks failing on code that must fail.

What this cannot see: the SDK's own headers (a name or overload it lacks that CUDA 11.8 has),
the mtgpu back end, anything at run time. It found two things the MUSA build would have
stopped on: CUDA 12's three-argument cudaGraphInstantiate, and __ldcg, which clang's CUDA
headers do not declare (portable.h)."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

from check_report import report

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
CUDA_DIR = os.path.join(ROOT, "src", "backend", "cuda")
STANDIN = os.path.join(ROOT, "tests", "tools", "musa_standin")
CACHE = os.environ.get("CLLM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "cllm"))
CUDA11 = os.environ.get("CLLM_CUDA11_ROOT", os.path.join(CACHE, "cuda-11.8"))
CLANG = os.environ.get("CLLM_CLANG_CUDA", "clang++-19")
ASM = re.compile(r"\b(asm|__asm__|__asm)\b")
MARKER = re.compile(r'^# (\d+) "([^"]+)"')


def clang(src, *extra, include=()):
    cmd = [CLANG, "-x", "cuda", "-std=c++17", "-DCLLM_MUSA", f"--cuda-path={CUDA11}",
           "--cuda-gpu-arch=sm_80", "-nocudalib", "-Xclang", "-target-sdk-version=11.8",
           "-isystem", STANDIN, "-isystem", os.path.join(CUDA11, "include"),
           "-I", os.path.join(ROOT, "src"), "-I", os.path.join(ROOT, "include"),
           *[f"-I{d}" for d in include], *extra, src]
    return subprocess.run(cmd, capture_output=True, text=True)


def errors(result):
    """The compiler's error lines (or its exit status when it printed none)."""
    lines = [l for l in result.stderr.splitlines() if "error:" in l]
    if result.returncode != 0 and not lines:
        lines = [f"exit status {result.returncode}: {result.stderr.strip()[:300]}"]
    return lines


def compile_errors(src, include=()):
    """Both passes' front end, then the device code generated (PTX: what -fsyntax-only leaves
    out, such as a device function's call that only code generation resolves)."""
    found = errors(clang(src, "-fsyntax-only", include=include))
    if not found:
        found = errors(clang(src, "--cuda-device-only", "-S", "-O1", "-o", os.devnull,
                             include=include))
    return found


def asm_in(src, ours, include=()):
    """Inline assembly in the device pass's preprocessed text of files under the folder ours
    (the headers' own, CUDA's here and the SDK's there, do not count)."""
    result = clang(src, "--cuda-device-only", "-E", include=include)
    if result.returncode != 0:
        return [f"cannot preprocess: {errors(result)[:3]}"]
    found, where, line = [], None, 0
    for text in result.stdout.splitlines():
        m = MARKER.match(text)
        if m:
            line, where = int(m.group(1)), os.path.abspath(m.group(2))
            continue
        if where and where.startswith(ours + os.sep) and ASM.search(text):
            found.append(f"{os.path.relpath(where, ROOT)}:{line}: {text.strip()[:80]}")
        line += 1
    return found


CONTROLS = {
    # CUDA 12's form: MUSA SDK 3.1 (and the stand-in) take the five arguments
    "graph_instantiate_flags": (
        "compile",
        "void f(cudaGraph_t g) { cudaGraphExec_t e; (void)cudaGraphInstantiate(&e, g, 0); }\n"),
    # a __device__ function calling a host one: clang's CUDA rules, which g++ does not have
    "host_call_from_device": (
        "compile",
        "int host_only(int x);\n"
        "__device__ int f(int x) { return host_only(x); }\n"
        "__global__ void k(int *p) { p[0] = f(p[1]); }\n"),
    # PTX in device code: the mtgpu back end has none
    "inline_ptx": (
        "asm",
        "__device__ __forceinline__ void trap_now() { asm volatile(\"trap;\"); }\n"
        "__global__ void k(int *p) { if (!p) trap_now(); }\n"),
}


def main():
    failures = []
    if not shutil.which(CLANG):
        return report([f"{CLANG} not found: scripts/setup --test installs it"], "no compiler")
    if not os.path.isfile(os.path.join(CUDA11, "include", "cuda_runtime.h")):
        return report([f"no CUDA 11.8 headers at {CUDA11}: scripts/setup --test fetches them"],
                      "no headers")
    sources = sorted(f for f in os.listdir(CUDA_DIR) if f.endswith(".cu"))
    for name in sources:
        path = os.path.join(CUDA_DIR, name)
        for e in compile_errors(path)[:5]:
            failures.append(f"{name}: {e}")
        for a in asm_in(path, os.path.join(ROOT, "src")):
            failures.append(f"{name}: inline assembly in the MUSA configuration: {a}")
    if len(sources) < 8:
        failures.append(f"only {len(sources)} .cu files found: is the scan broken?")

    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, body) in CONTROLS.items():
            src = os.path.join(tmp, f"{name}.cu")
            with open(src, "w", encoding="utf-8") as f:
                f.write('#include "backend/cuda/vendor.h"\n' + body)
            if kind == "compile":
                caught = compile_errors(src)
            else:
                caught = asm_in(src, tmp)
            if not caught:
                failures.append(f"control {name}: not caught, so the check above could miss it")
            else:
                print(f"control {name}: caught ({caught[0].strip()[:100]})")
    return report(failures, f"{len(sources)} .cu files in the MUSA configuration "
                            f"(clang {CLANG}, CUDA 11.8 headers, {len(CONTROLS)} controls)")


if __name__ == "__main__":
    sys.exit(main())
