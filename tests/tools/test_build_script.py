#!/usr/bin/env python3
"""scripts/build on a machine whose GPU toolkit cannot build cllm: it says so and builds the
CPU-only binary instead, so a deployment still gets a server.

The toolkit is a stand-in MUSA SDK (the build picks MUSA first when $MUSA_PATH/bin/clang++
exists): its CMake package configures, its compiler is the system's g++, which rejects
`-x musa` as a first build on an SDK the code was never compiled with may reject an unknown
intrinsic. So the GPU attempt fails while compiling, in a folder configured for that compiler,
which the fallback must set up afresh. The CPU build then runs and answers --help.

A second stand-in SDK's compiler never returns (a hang, or a crawl past the build stage's
900 s): with CLLM_GPU_BUILD_TIMEOUT=15 the GPU attempt is stopped after 15 s, with every
process it started, and the CPU build follows."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

from check_report import report

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIND_MUSA = """
add_library(MUSA::musart INTERFACE IMPORTED)
add_library(MUSA::mublas INTERFACE IMPORTED)
set(MUSAToolkit_FOUND TRUE)
"""


def fake_sdk(root, hang=False):
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "cmake"))
    cxx = shutil.which("g++") or "/usr/bin/g++"
    clang = os.path.join(root, "bin", "clang++")
    with open(clang, "w") as f:
        # a hanging compiler: a shell (its command line names the SDK) waiting on a sleep
        f.write('#!/bin/sh\nsleep 3600\n' if hang else f'#!/bin/sh\nexec {cxx} "$@"\n')
    os.chmod(clang, 0o755)
    with open(os.path.join(root, "cmake", "FindMUSAToolkit.cmake"), "w") as f:
        f.write(FIND_MUSA)


def check_cpu_fallback(failures, r, build, what):
    """The fallback's announcement, and a CPU-only binary on the last line that runs."""
    err = r.stderr
    lines = r.stdout.strip().splitlines()
    binary = lines[-1] if lines else ""
    if r.returncode != 0:
        failures.append(f"{what}: scripts/build exit {r.returncode}: {err[-1500:]}")
    if "CPU only" not in err or "runs on the CPU" not in err:
        failures.append(f"{what}: the fallback is not announced: {err[-800:]}")
    if binary != os.path.join(build, "cllm") or not os.access(binary, os.X_OK):
        failures.append(f"{what}: the last line is not the built binary: {binary!r}")
        return
    h = subprocess.run([binary, "--help"], capture_output=True, text=True, check=False)
    if "serve" not in h.stdout + h.stderr:
        failures.append(f"{what}: the binary does not run: {h.stdout[-300:]} {h.stderr[-300:]}")
    cache = open(os.path.join(build, "CMakeCache.txt")).read()
    if "CLLM_MUSA:BOOL=OFF" not in cache or "CLLM_CUDA:BOOL=OFF" not in cache:
        failures.append(f"{what}: the fallback build still has a GPU backend configured")


def build_with(sdk, build, **env):
    env = dict(os.environ, MUSA_PATH=sdk, CLLM_BUILD_DIR=build, **env)
    return subprocess.run([os.path.join(ROOT, "scripts", "build")], env=env,
                          capture_output=True, text=True, timeout=1200, check=False)


def main():
    failures = []
    with tempfile.TemporaryDirectory(prefix="cllm-build-test-") as tmp:
        sdk, build = os.path.join(tmp, "musa"), os.path.join(tmp, "build")
        fake_sdk(sdk)
        r = build_with(sdk, build)
        err = r.stderr
        if "the MUSA" not in err or "build failed" not in err:
            failures.append(f"the failed MUSA build is not reported: {err[-1500:]}")
        if "error: unrecognized command-line option" not in err.split("build failed", 1)[-1]:
            failures.append("the report does not quote the compiler's error")
        check_cpu_fallback(failures, r, build, "a failing compiler")

        sdk, build = os.path.join(tmp, "musa-hangs"), os.path.join(tmp, "build-hangs")
        fake_sdk(sdk, hang=True)
        t = time.monotonic()
        r = build_with(sdk, build, CLLM_GPU_BUILD_TIMEOUT="15")
        dt = time.monotonic() - t
        print(f"a hanging compiler: scripts/build returned after {dt:.0f} s")
        if "did not finish within 15 s" not in r.stderr:
            failures.append(f"the stopped MUSA build is not reported: {r.stderr[-1500:]}")
        check_cpu_fallback(failures, r, build, "a hanging compiler")
        left = subprocess.run(["pgrep", "-f", sdk], capture_output=True, text=True, check=False)
        if left.stdout.strip():
            failures.append(f"the stopped build left processes behind: {left.stdout.strip()}")
            subprocess.run(["pkill", "-9", "-f", sdk], check=False)
        if dt < 15:
            failures.append(f"the GPU build was given {dt:.0f} s, not its 15")

        r = build_with(sdk, build, CLLM_GPU_BUILD_TIMEOUT="soon")
        if r.returncode != 2 or "CLLM_GPU_BUILD_TIMEOUT must be" not in r.stderr:
            failures.append(f"a bad CLLM_GPU_BUILD_TIMEOUT is not refused: {r.returncode} "
                            f"{r.stderr[-500:]}")
    return report(failures, "scripts/build with a GPU toolkit that fails or hangs")


if __name__ == "__main__":
    sys.exit(main())
