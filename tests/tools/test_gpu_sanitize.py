#!/usr/bin/env python3
"""tests/gpu/sanitize, the compute-sanitizer wrapper tests/gpu/run calls on a GPU machine,
against a stand-in compute-sanitizer (none exists without a GPU): a clean run passes (0), a
reported error or a failing binary fails (1) and says which binary, a device the sanitizer
refuses (gVisor's "Device not supported") skips (77), as does a machine without the tool; a
binary that skips itself under the sanitizer (it found no device there) is a failure, not a
pass."""
import os
import subprocess
import sys
import tempfile

from check_report import report

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SANITIZE = os.path.join(ROOT, "tests", "gpu", "sanitize")

# What the real tool does, in the cases the wrapper tells apart: its last argument is the
# binary; it exits with --error-exitcode's value when it reports an error.
FAKE = r"""#!/bin/sh
[ "$1" = --version ] && echo "Version 2099.1" && exit 0
for a; do bin=$a; done
case "$FAKE_MODE" in
  unsupported) echo "========= Error: Device not supported"; exit 1 ;;
  report) echo "========= Invalid __global__ write of size 4 bytes"
          echo "========= ERROR SUMMARY: 1 error"; exit 86 ;;
esac
"$bin"; rc=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
"""


def write_exe(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


def main():
    failures = []
    with tempfile.TemporaryDirectory(prefix="cllm-sanitize-test-") as tmp:
        tools = os.path.join(tmp, "tools")
        os.mkdir(tools)
        write_exe(os.path.join(tools, "compute-sanitizer"), FAKE)
        ok = os.path.join(tmp, "ok_test")
        write_exe(ok, "#!/bin/sh\necho 'all passed'\n")
        bad = os.path.join(tmp, "bad_test")
        write_exe(bad, "#!/bin/sh\necho 'FAIL: 1 check'\nexit 1\n")
        skip = os.path.join(tmp, "skip_test")
        write_exe(skip, "#!/bin/sh\necho 'skipped: no CUDA device'\nexit 77\n")

        def run(mode, *bins, tool="memcheck", with_tool=True):
            path = tools + ":/usr/bin:/bin" if with_tool else "/usr/bin:/bin"
            env = dict(os.environ, PATH=path, FAKE_MODE=mode)
            r = subprocess.run([SANITIZE, tool, *bins], env=env, capture_output=True,
                               text=True, timeout=60, check=False)
            return r.returncode, r.stdout + r.stderr

        cases = [
            # (what, mode, binaries, tool, expected status, text the output must hold)
            ("clean run", "", [ok, ok], "racecheck", 0, "racecheck ok_test: clean"),
            ("reported error", "report", [ok], "memcheck", 1, "REPORTED ERRORS"),
            ("failing binary", "", [ok, bad], "synccheck", 1, "bad_test: FAILED (exit 1)"),
            ("binary skipped itself", "", [skip], "memcheck", 1, "skipped itself"),
            ("device refused", "unsupported", [ok], "memcheck", 77, "cannot run on this device"),
        ]
        for what, mode, bins, tool, want, text in cases:
            rc, out = run(mode, *bins, tool=tool)
            if rc != want or text not in out:
                failures.append(f"{what}: exit {rc} (want {want}), output: {out[-600:]}")
        rc, out = run("", ok, with_tool=False)
        if rc != 77 or "no compute-sanitizer" not in out:
            failures.append(f"no tool: exit {rc} (want 77), output: {out[-300:]}")
        rc, out = run("", ok, tool="initcheck")
        if rc != 2:
            failures.append(f"an unknown tool is not refused: exit {rc}")
    return report(failures, "tests/gpu/sanitize with a stand-in compute-sanitizer")


if __name__ == "__main__":
    sys.exit(main())
