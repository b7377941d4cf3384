#!/usr/bin/env python3
"""tests/gpu/profile_kernels.py, the per-kernel time summary tests/gpu/run takes of a prefill
on a GPU machine, against a stand-in ncu (none runs without a GPU): kernels are grouped by name
without their arguments, durations in any of ncu's units are added up and ranked with their
shares; the profiled command's own output before and after the table is ignored; ncu failing,
a table without the metric or with a value that is not a number fails (1), no ncu skips (77)."""
import os
import subprocess
import sys
import tempfile

from check_report import report

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROFILE = os.path.join(ROOT, "tests", "gpu", "profile_kernels.py")

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def row(i, kernel, unit, value, metric="gpu__time_duration.sum"):
    return (f'"{i}","7","cllm","127.0.0.1","{kernel}","1","13","(256, 1, 1)","(3, 70, 1)","0",'
            f'"9.0","Command line profiler metrics","{metric}","{unit}","{value}"')


TILED = "void gemm_tiled<tiling<4, 2, 2, 4, 4, 2>, false>(const __nv_bfloat16 *, int, float *)"
GOOD = "\n".join([
    "==PROF== Connected to process 7 (cllm)",
    "cllm: 512 prompt tokens",
    HEADER,
    row(0, TILED, "usecond", "1,200.5"),
    row(1, "void attention_mma<128>(cllm_cuda_batch, const float *)", "nsecond", "300,000"),
    row(2, TILED, "msecond", "0.8"),
    row(3, "rmsnorm_kernel(const float *, float *)", "usecond", "50"),
    row(4, "rmsnorm_kernel(const float *, float *)", "usecond", "1", metric="other__metric"),
    "==PROF== Disconnected from process 7",
])

# Prints the table it is told to (FAKE_CSV) after running the command, as ncu does.
FAKE = r"""#!/bin/sh
while [ "$#" -gt 0 ]; do
  case "$1" in --csv) shift ;; --*) shift 2 ;; *) break ;; esac
done
"$@" || exit $?
[ -n "$FAKE_EXIT" ] && exit "$FAKE_EXIT"
cat "$FAKE_CSV"
"""


def main():
    failures = []
    with tempfile.TemporaryDirectory(prefix="cllm-profile-test-") as tmp:
        tools = os.path.join(tmp, "tools")
        os.mkdir(tools)
        with open(os.path.join(tools, "ncu"), "w") as f:
            f.write(FAKE)
        os.chmod(os.path.join(tools, "ncu"), 0o755)

        def run(csv_text, with_tool=True, exit_code="", args=("--", "true")):
            path_csv = os.path.join(tmp, "table.csv")
            with open(path_csv, "w") as f:
                f.write(csv_text)
            env = dict(os.environ, FAKE_CSV=path_csv, FAKE_EXIT=exit_code,
                       PATH=(tools + ":" if with_tool else "") + "/usr/bin:/bin")
            r = subprocess.run([sys.executable, PROFILE, "--top", "2", *args], env=env,
                               capture_output=True, text=True, timeout=60, check=False)
            return r.returncode, r.stdout + r.stderr

        rc, out = run(GOOD)
        want = [
            "profile: 4 kernel launches, 2.350 ms of kernel time in all",
            # 1.2005 + 0.8 ms in two launches: 85.1% of 2.3505 ms
            " 85.1%    2.001 ms      2 x  1000.25 us  gemm_tiled<tiling<4, 2, 2, 4, 4, 2>, false>",
            " 12.8%    0.300 ms      1 x",
            "  2.1%    0.050 ms in 1 other kernels",
        ]
        for w in want:
            if w not in out:
                failures.append(f"summary lacks {w!r}: {out[-800:]}")
        if rc != 0:
            failures.append(f"a good table: exit {rc}")
        kept = os.path.join(tmp, "kept.csv")
        rc, out = run(GOOD, args=("--csv", kept, "--", "true"))
        if rc != 0 or not os.path.exists(kept):
            failures.append(f"--csv did not keep the table: exit {rc}")
        else:
            rc2 = subprocess.run([sys.executable, PROFILE, "--parse", kept], capture_output=True,
                                 text=True, timeout=60, check=False)
            if rc2.returncode != 0 or "4 kernel launches" not in rc2.stdout:
                failures.append(f"--parse of the kept table: {rc2.stdout[-400:]}")
        cases = [
            ("ncu fails", GOOD, "3", 1, "ncu exited 3"),
            ("no header", "just the program's output\n", "", 1, "no ncu CSV header"),
            ("no duration rows", HEADER + "\n" + row(0, TILED, "usecond", "5", metric="x"), "", 1,
             "no gpu__time_duration.sum rows"),
            ("a value that is no number", HEADER + "\n" + row(0, TILED, "usecond", "n/a"), "", 1,
             "is not a number"),
            ("an unknown unit", HEADER + "\n" + row(0, TILED, "cycle", "5"), "", 1,
             "unknown unit"),
        ]
        for what, text, code, want_rc, msg in cases:
            rc, out = run(text, exit_code=code)
            if rc != want_rc or msg not in out:
                failures.append(f"{what}: exit {rc} (want {want_rc}), output: {out[-500:]}")
        rc, out = run(GOOD, with_tool=False)
        if rc != 77 or "ncu not found" not in out:
            failures.append(f"no ncu: exit {rc} (want 77): {out[-300:]}")
        rc, out = run(GOOD, args=("--", "false"))
        if rc != 1:
            failures.append(f"the profiled command failing: exit {rc} (want 1)")
    return report(failures, "tests/gpu/profile_kernels.py with a stand-in ncu")


if __name__ == "__main__":
    sys.exit(main())
