#!/usr/bin/env python3
"""The MUSA build's sources get past a clang CUDA front end.

The MUSA SDK compiles src/backend/cuda with its clang++ (`-x musa`, CMakeLists.txt), a fork of
clang's CUDA support; nvcc compiles the CUDA build and g++ the emulator's, and neither checks
what clang checks (the __host__/__device__ rules, which overloads its headers declare) nor the
MUSA configuration's API calls. No MUSA SDK is available here, so this compiles every .cu file
with -DCLLM_MUSA under Debian's clang 19 and clang 14 (which LLVM the SDK's fork is based on is
not known here) in CUDA mode, for the host and, to PTX, for the device, against a stand-in
SDK (tests/tools/musa_standin): the MUSA names vendor.h maps to, spelled as their twins in
CUDA 11.8's headers (PyPI's runtime, nvcc and CCCL wheels, fetched by scripts/setup --test),
the API MUSA SDK 3.1 mirrors where CUDA 12 changed it. Every header comes from there or from
the compilers and the C/C++ libraries: none from the machine's own CUDA (checked). It also
checks that no inline assembly (PTX) reaches the MUSA configuration's device code, and runs
controls that show each of these checks failing on code that must fail. Last, CMake
configures the MUSA build with a stand-in SDK whose clang++ runs the same front end on each
compile line CMake writes, and the library of the .cu files must build; and again without
muBLAS (CLLM_MUSA_BLAS=OFF, scripts/build's second try), with no mublas.h in the stand-in.

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
from test_build_script import FIND_MUSA  # the stand-in SDK's CMake package

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
CUDA_DIR = os.path.join(ROOT, "src", "backend", "cuda")
STANDIN = os.path.join(ROOT, "tests", "tools", "musa_standin")
CACHE = os.environ.get("CLLM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "cllm"))
CUDA11 = os.environ.get("CLLM_CUDA11_ROOT", os.path.join(CACHE, "cuda-11.8"))
# (compiler, flags for both passes, flags for the device pass): clang 14 supports CUDA up to
# 11.5 and is told that version (11.8 would make it fall back to pre-9.2 kernel launches); its
# PTX target feature is named because it cannot infer one for an unknown CUDA version.
COMPILERS = [
    ("clang++-19", ["-Xclang", "-target-sdk-version=11.8"], []),
    ("clang++-14", ["-Xclang", "-target-sdk-version=11.5"],
     ["-Xclang", "-target-feature", "-Xclang", "+ptx75"]),
]
ASM = re.compile(r"\b(asm|__asm__|__asm)\b")
MARKER = re.compile(r'^# (\d+) "([^"]+)"')
# where a header may come from besides our sources, the stand-in and CUDA11
SYSTEM = ("/usr/include/", "/usr/lib/gcc/", "/usr/lib/llvm-")


def toolchain_flags(compiler):
    """What stands in for the MUSA SDK: clang's CUDA mode on CUDA11, the stand-in's headers."""
    _, both, _ = compiler
    return ["-x", "cuda", f"--cuda-path={CUDA11}", "--cuda-gpu-arch=sm_80", "-nocudalib", *both,
            "-isystem", STANDIN, "-isystem", os.path.join(CUDA11, "include")]


def clang(compiler, src, *extra):
    """compiler on src in the MUSA configuration (what CMakeLists.txt adds: C++17, CLLM_MUSA,
    our include folders), with extra."""
    cmd = [compiler[0], *toolchain_flags(compiler), "-std=c++17", "-DCLLM_MUSA",
           "-I", os.path.join(ROOT, "src"), "-I", os.path.join(ROOT, "include"), *extra, src]
    return subprocess.run(cmd, capture_output=True, text=True)


def errors(result):
    """The compiler's error lines (or its exit status when it printed none)."""
    lines = [l for l in result.stderr.splitlines() if "error:" in l]
    if result.returncode != 0 and not lines:
        lines = [f"exit status {result.returncode}: {result.stderr.strip()[:300]}"]
    return lines


def compile_errors(compiler, src):
    """Both passes' front end, then the device code generated (PTX: what -fsyntax-only leaves
    out, such as a device function's call that only code generation resolves)."""
    found = errors(clang(compiler, src, "-fsyntax-only"))
    if not found:
        found = errors(clang(compiler, src, "--cuda-device-only", *compiler[2], "-S", "-O1",
                             "-o", os.devnull))
    return found


def preprocessed(compiler, src, side):
    """(file, line, text) of each line of one pass's preprocessed source, or an error."""
    result = clang(compiler, src, side, "-E")
    if result.returncode != 0:
        return None, errors(result)[:3]
    lines, where, line = [], None, 0
    for text in result.stdout.splitlines():
        m = MARKER.match(text)
        if m:
            name = m.group(2)  # <built-in>, <command line>: kept as they are
            line, where = int(m.group(1)), name if name.startswith("<") else os.path.abspath(name)
            continue
        lines.append((where, line, text))
        line += 1
    return lines, None


def preprocessed_checks(compiler, src, ours):
    """From both passes' preprocessed text, once: inline assembly in the device pass's lines of
    files under the folder ours (the headers' own, CUDA's here and the SDK's there, do not
    count); and headers from anywhere but our sources, src's folder, the stand-in, CUDA11, the
    compiler and the C/C++ libraries (a CUDA header the stand-in lacks would come from the
    machine's toolkit). A pass that cannot be preprocessed fails both."""
    allowed = (ROOT + os.sep, os.path.abspath(CUDA11) + os.sep,
               os.path.dirname(os.path.abspath(src)) + os.sep, "<") + SYSTEM
    asm, foreign = [], set()
    for side in ("--cuda-host-only", "--cuda-device-only"):
        lines, failed = preprocessed(compiler, src, side)
        if failed:
            return [f"cannot preprocess: {failed}"], [f"cannot preprocess: {failed}"]
        foreign |= {w for w, _, _ in lines if w and not w.startswith(allowed)}
        if side == "--cuda-device-only":
            asm = [f"{os.path.relpath(w, ROOT)}:{n}: {t.strip()[:80]}" for w, n, t in lines
                   if w and w.startswith(ours + os.sep) and ASM.search(t)]
    return asm, sorted(foreign)


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
    # a CUDA header the stand-in lacks: taken from the machine's toolkit (or not found)
    "header_from_elsewhere": ("headers", "#include <cufft.h>\n"),
    # PTX in device code: the mtgpu back end has none
    "inline_ptx": (
        "asm",
        "__device__ __forceinline__ void trap_now() { asm volatile(\"trap;\"); }\n"
        "__global__ void k(int *p) { if (!p) trap_now(); }\n"),
}


# The SDK's clang++ as CMake calls it for the cmake_build check: a MUSA source (-x musa) goes
# through clang 19's front end with the stand-in (the SDK's own flags, -mtgpu, --cuda-gpu-arch=mp_*
# and -Od3, left out; the definitions, include folders and standard are CMake's alone) and
# becomes an empty object; anything else is compiled by clang 19 itself.
SDK_CLANG = r"""#!/usr/bin/env python3
import os, subprocess, sys
args = sys.argv[1:]
if "musa" not in [b for a, b in zip(args, args[1:]) if a == "-x"]:
    os.execvp("clang++-19", ["clang++-19", *args])
keep, out, deps, it = [], None, None, iter(args)
for a in it:
    if a in ("-x", "-MT"):
        next(it)
    elif a == "-o":
        out = next(it)
    elif a == "-MF":
        deps = next(it)
    elif a not in ("-mtgpu", "-Od3", "-c", "-MD") and not a.startswith("--cuda-gpu-arch="):
        keep.append(a)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "calls.log"), "a") as f:
    f.write(" ".join(args) + "\n")
check = subprocess.run(["clang++-19", *TOOLCHAIN, "-fsyntax-only", *keep])
if check.returncode:
    sys.exit(check.returncode)
if deps:
    open(deps, "w").write(out + ":\n")
sys.exit(subprocess.run(["clang++-19", "-c", "-x", "c++", os.devnull, "-o", out]).returncode)
"""


def cmake_build(failures, n_sources, blas=True):
    """The MUSA configuration as CMakeLists.txt compiles it (its flags, definitions, include
    folders and C++ standard), through a stand-in SDK whose clang++ runs the front end above:
    the library of the .cu files (cllm_backend_cuda) must build, every source through it.
    Without muBLAS (blas=False: CLLM_MUSA_BLAS=OFF, scripts/build's second try), with a stand-in
    SDK that has no mublas.h: every source must build without it."""
    what = "CMake's MUSA build" + ("" if blas else " without muBLAS")
    with tempfile.TemporaryDirectory(prefix="cllm-musa-cmake-") as tmp:
        sdk, build = os.path.join(tmp, "musa"), os.path.join(tmp, "build")
        for d in ("bin", "cmake"):
            os.makedirs(os.path.join(sdk, d))
        flags = toolchain_flags(COMPILERS[0])
        if not blas:
            standin = os.path.join(tmp, "standin")
            shutil.copytree(STANDIN, standin, ignore=shutil.ignore_patterns("mublas.h"))
            flags = [standin if f == STANDIN else f for f in flags]
        clang_path = os.path.join(sdk, "bin", "clang++")
        with open(clang_path, "w", encoding="utf-8") as f:
            f.write(SDK_CLANG.replace("TOOLCHAIN", repr(flags)))
        os.chmod(clang_path, 0o755)
        with open(os.path.join(sdk, "cmake", "FindMUSAToolkit.cmake"), "w") as f:
            f.write(FIND_MUSA)
        steps = [["cmake", "-S", ROOT, "-B", build, "-DCLLM_MUSA=ON", f"-DMUSA_PATH={sdk}",
                  "-DCMAKE_BUILD_TYPE=Release", f"-DCLLM_MUSA_BLAS={'ON' if blas else 'OFF'}"],
                 ["cmake", "--build", build, "--target", "cllm_backend_cuda", "-j2"]]
        for step in steps:
            r = subprocess.run(step, capture_output=True, text=True, check=False)
            if r.returncode:
                failures.append(f"{what}: {' '.join(step[:2])} failed: "
                                f"{(r.stdout + r.stderr)[-2000:]}")
                return
        log = os.path.join(sdk, "calls.log")
        calls = open(log).read().splitlines() if os.path.exists(log) else []
        if len(calls) != n_sources:
            failures.append(f"{what} compiled {len(calls)} MUSA sources, not {n_sources}")
        for c in calls:
            words = c.split()
            if "-DCLLM_MUSA" not in words or not any(w in ("-std=c++17", "-std=gnu++17")
                                                     for w in words):
                failures.append(f"a MUSA compile without -DCLLM_MUSA or C++17: {c[:300]}")
            if ("-DCLLM_NO_BLAS" in words) == blas:
                failures.append(f"{what}: a compile {'with' if blas else 'without'} "
                                f"-DCLLM_NO_BLAS: {c[:300]}")
        print(f"{what}: {len(calls)} sources through the front end")


def main():
    failures = []
    if not os.path.isfile(os.path.join(CUDA11, "include", "crt", "host_defines.h")):
        return report([f"no CUDA 11.8 headers at {CUDA11}: scripts/setup --test fetches them"],
                      "no headers")
    sources = sorted(f for f in os.listdir(CUDA_DIR) if f.endswith(".cu"))
    if len(sources) < 8:
        failures.append(f"only {len(sources)} .cu files found: is the scan broken?")
    for compiler in COMPILERS:
        name = compiler[0]
        if not shutil.which(name):
            failures.append(f"{name} not found: scripts/setup --test installs it")
            continue
        for source in sources:
            path = os.path.join(CUDA_DIR, source)
            for e in compile_errors(compiler, path)[:5]:
                failures.append(f"{name} {source}: {e}")
            asm, foreign = preprocessed_checks(compiler, path, os.path.join(ROOT, "src"))
            for a in asm:
                failures.append(f"{name} {source}: inline assembly in the MUSA configuration: {a}")
            for h in foreign:
                failures.append(f"{name} {source}: {h} is not the stand-in's: add it there")
        with tempfile.TemporaryDirectory() as tmp:
            for control, (kind, body) in CONTROLS.items():
                src = os.path.join(tmp, f"{control}.cu")
                with open(src, "w", encoding="utf-8") as f:
                    f.write('#include "backend/cuda/vendor.h"\n' + body)
                if kind == "compile":
                    caught = compile_errors(compiler, src)
                else:
                    asm, foreign = preprocessed_checks(compiler, src, tmp)
                    caught = asm if kind == "asm" else foreign
                if not caught:
                    failures.append(f"{name} control {control}: not caught, so the check "
                                    "above could miss it")
                else:
                    print(f"{name} control {control}: caught ({caught[0].strip()[:90]})")
    if shutil.which("clang++-19"):
        cmake_build(failures, len(sources))
        cmake_build(failures, len(sources), blas=False)
    return report(failures, f"{len(sources)} .cu files in the MUSA configuration under "
                            f"{len(COMPILERS)} compilers, CUDA 11.8 headers, "
                            f"{len(CONTROLS)} controls each")


if __name__ == "__main__":
    sys.exit(main())
