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
process it started, and the CPU build follows.

A third, found through $MUSA_HOME alone (torch_musa's name for the SDK's root), builds: its
compiler turns MUSA sources into empty objects and links cllm into a program the loader
cannot start, as a binary missing a shared library would be (the SDK's, or the GPU driver's
in a build without the GPU). The link names the SDK's library folder (the binary's
DT_RPATH); scripts/build sees that the binary does not start, says what it printed, builds
the CPU-only binary as well and makes build/cllm a launcher: it runs the CPU build while the
GPU build does not start, and the GPU build once it does.

A fourth fails every MUSA source on muBLAS ('mublas.h' not found) unless the build leaves
muBLAS out: scripts/build reports it, tries once more with CLLM_MUSA_BLAS=OFF, and that build
is the result (on the GPU, every GEMM on CUDA cores)."""
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


LOADER_ERROR = ("error while loading shared libraries: libmusart.so: cannot open shared "
                "object file: No such file or directory")

# Compiles as g++ does, except a MUSA source (-x musa), which becomes an empty object, and the
# link of cllm, which writes a program that fails as the loader does; logs each command line.
LINKS_UNSTARTABLE = r"""#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls.log"
out= deps= musa=0 prev=
for a in "$@"; do
  [ "$prev" = -o ] && out=$a
  [ "$prev" = -MF ] && deps=$a
  [ "$prev" = -x ] && [ "$a" = musa ] && musa=1
  prev=$a
done
if [ $musa = 1 ]; then
  [ -z "$deps" ] || echo "$out:" > "$deps"
  exec CXX -c -x c++ /dev/null -o "$out"
fi
case $out in
  cllm | */cllm)
    printf '#!/bin/sh\necho "$0: %s" >&2\nexit 127\n' "ERROR" > "$out"
    chmod +x "$out"
    exit 0 ;;
esac
exec CXX "$@"
"""


# Fails every MUSA source as a compiler does on a muBLAS it does not know, unless the build
# leaves muBLAS out (-DCLLM_NO_BLAS), when it makes empty objects; links cllm into a program
# that starts; logs each command line.
FAILS_ON_MUBLAS = r"""#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls.log"
out= deps= musa=0 noblas=0 prev=
for a in "$@"; do
  [ "$prev" = -o ] && out=$a
  [ "$prev" = -MF ] && deps=$a
  [ "$prev" = -x ] && [ "$a" = musa ] && musa=1
  [ "$a" = -DCLLM_NO_BLAS ] && noblas=1
  prev=$a
done
if [ $musa = 1 ]; then
  if [ $noblas = 0 ]; then
    echo "vendor.h:29:10: fatal error: 'mublas.h' file not found" >&2
    exit 1
  fi
  [ -z "$deps" ] || echo "$out:" > "$deps"
  exec CXX -c -x c++ /dev/null -o "$out"
fi
case $out in
  cllm | */cllm)
    printf '#!/bin/sh\necho "cllm (the GPU build without muBLAS)"\n' > "$out"
    chmod +x "$out"
    exit 0 ;;
esac
exec CXX "$@"
"""


def fake_sdk(root, hang=False, links=False, no_mublas=False):
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "cmake"))
    os.makedirs(os.path.join(root, "lib"))
    cxx = shutil.which("g++") or "/usr/bin/g++"
    clang = os.path.join(root, "bin", "clang++")
    with open(clang, "w") as f:
        if hang:  # a shell (its command line names the SDK) waiting on a sleep
            f.write('#!/bin/sh\nsleep 3600\n')
        elif links:
            f.write(LINKS_UNSTARTABLE.replace("CXX", cxx).replace("ERROR", LOADER_ERROR))
        elif no_mublas:
            f.write(FAILS_ON_MUBLAS.replace("CXX", cxx))
        else:
            f.write(f'#!/bin/sh\nexec {cxx} "$@"\n')
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


def check_launcher(failures, r, build):
    """build/cllm: the CPU build while the GPU build does not start, the GPU build once it does."""
    lines = r.stdout.strip().splitlines()
    launcher = os.path.join(build, "cllm")
    if r.returncode != 0 or not lines or lines[-1] != launcher:
        failures.append(f"the launcher is not the result: exit {r.returncode}, {lines[-1:]}, "
                        f"{r.stderr[-800:]}")
        return
    if "CPU only as well" not in r.stderr or "cllm-cpu (the CPU only)" not in r.stderr:
        failures.append(f"the two builds are not announced: {r.stderr[-800:]}")
    h = subprocess.run([launcher, "--help"], capture_output=True, text=True, check=False)
    if h.returncode != 0 or "serve" not in h.stdout + h.stderr or \
            "running the CPU-only build" not in h.stderr:
        failures.append(f"the launcher does not run the CPU build: exit {h.returncode}, "
                        f"{h.stdout[-300:]} {h.stderr[-300:]}")
    cache = open(os.path.join(build, "CMakeCache.txt")).read()
    if "CLLM_MUSA:BOOL=OFF" not in cache:
        failures.append("cllm-cpu was built with the GPU backend configured")
    gpu = os.path.join(build, "cllm-gpu")
    if not os.access(gpu, os.X_OK):
        failures.append("the GPU build was not kept as cllm-gpu")
        return
    with open(gpu, "w") as f:  # now it starts: a driver that came with the GPU, say
        f.write('#!/bin/sh\necho "the GPU build: $*"\n')
    link = os.path.join(os.path.dirname(build), "cllm-link")  # started as a link elsewhere
    os.symlink(launcher, link)
    h = subprocess.run([link, "serve", "--port", "1"], capture_output=True, text=True,
                       check=False)
    if h.stdout.strip() != "the GPU build: serve --port 1" or h.stderr:
        failures.append(f"the launcher does not run a GPU build that starts: {h.stdout[-300:]} "
                        f"{h.stderr[-300:]}")


def build_with(sdk, build, via="MUSA_PATH", **env):
    env = dict(os.environ, CLLM_BUILD_DIR=build, **env)
    env.pop("MUSA_PATH", None)
    env.pop("MUSA_HOME", None)
    env[via] = sdk
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

        sdk, build = os.path.join(tmp, "musa-links"), os.path.join(tmp, "build-links")
        fake_sdk(sdk, links=True)
        r = build_with(sdk, build, via="MUSA_HOME")
        err = r.stderr
        if f"MUSA (SDK {sdk})" not in err:
            failures.append(f"the SDK named by MUSA_HOME is not used: {err[-1500:]}")
        if "binary does not start here" not in err or LOADER_ERROR not in err:
            failures.append(f"a binary that cannot start is not reported: {err[-1500:]}")
        calls = [c.split() for c in open(os.path.join(sdk, "calls.log")).read().splitlines()]
        links = [" ".join(c) for c in calls if any(
            a == "-o" and i + 1 < len(c) and os.path.basename(c[i + 1]) == "cllm"
            for i, a in enumerate(c))]
        rpath = f"-Wl,-rpath,{sdk}/lib"
        if not any(rpath in c and "--disable-new-dtags" in c for c in links):
            failures.append(f"cllm is not linked with {rpath} as DT_RPATH: {links[-1:]}")
        check_launcher(failures, r, build)

        sdk, build = os.path.join(tmp, "musa-no-mublas"), os.path.join(tmp, "build-no-mublas")
        fake_sdk(sdk, no_mublas=True)
        r = build_with(sdk, build)
        err, lines = r.stderr, r.stdout.strip().splitlines()
        if "naming muBLAS" not in err or "'mublas.h' file not found" not in err or \
                "once more without muBLAS" not in err:
            failures.append(f"the MUSA build's failure on muBLAS is not reported: {err[-1500:]}")
        if r.returncode != 0 or not lines or lines[-1] != os.path.join(build, "cllm") or \
                "runs on the GPU" not in err:
            failures.append(f"the MUSA build without muBLAS is not the result: exit "
                            f"{r.returncode}, {lines[-1:]}, {err[-800:]}")
        cache = open(os.path.join(build, "CMakeCache.txt")).read()
        if "CLLM_MUSA:BOOL=ON" not in cache or "CLLM_MUSA_BLAS:BOOL=OFF" not in cache:
            failures.append("the second MUSA build is not configured without muBLAS")
        calls = open(os.path.join(sdk, "calls.log")).read().splitlines()
        if not any("-x musa" in c and "-DCLLM_NO_BLAS" in c for c in calls):
            failures.append("no MUSA source was compiled without muBLAS (-DCLLM_NO_BLAS)")
    return report(failures, "scripts/build with a GPU toolkit that fails, hangs, links a "
                            "binary that cannot start or fails on muBLAS")


if __name__ == "__main__":
    sys.exit(main())
