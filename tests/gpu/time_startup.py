#!/usr/bin/env python3
"""Start-up to ready of `cllm serve` (issue 5's target: <= 5 s for the 1.5B on the GPU), timed
from process start to the first 200 of GET /health, in the ways a deployment starts it:

    python3 tests/gpu/time_startup.py CLLM_BINARY MODEL [--runs N] [--device D]

  auto   --device auto: the GPU probe in a child process first, then the server's own start
         (src/server/probe.h)
  check  --device cuda: no probe, the server's own device check (device_check.h)
  none   --device cuda --no-device-check: the model on the GPU and the warm-up only

Prints one line per way with each run's seconds and the backend /health names; exits 1 if a
server did not become ready (its log's tail is printed). Without a GPU, --device cpu times the
CPU start (what the dev machine can check of this script)."""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_once(binary, model, flags, timeout):
    """Seconds from the process start to GET /health = 200, and the backend it names."""
    port = free_port()
    log = tempfile.TemporaryFile()
    t0 = time.monotonic()
    proc = subprocess.Popen([binary, "serve", "--model", model, "--host", "127.0.0.1",
                             "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0, json.loads(r.read()).get("backend")
            except OSError:
                pass
            time.sleep(0.01)
        log.seek(0)
        sys.stdout.write(log.read().decode(errors="replace")[-3000:])
        return None, None
    finally:
        stop(proc)


def stop(proc):
    """SIGTERM, and SIGKILL after 30 s, for a server that has not exited yet."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cuda (the GPU), or cpu to try the script")
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    ways = [("auto", ["--device", "auto"] if a.device == "cuda" else ["--device", "cpu"]),
            ("check", ["--device", a.device]),
            ("none", ["--device", a.device, "--no-device-check"])]
    ok = True
    for name, flags in ways:
        times, backends = [], set()
        for _ in range(a.runs):
            t, backend = start_once(os.path.abspath(a.binary), a.model, flags, a.timeout)
            if t is None:
                print(f"startup {name}: NOT READY within {a.timeout:.0f} s ({' '.join(flags)})")
                ok = False
                break
            times.append(t)
            backends.add(backend)
        if times:
            print(f"startup {name:5s} ({' '.join(flags)}): ready in "
                  + ", ".join(f"{t:.2f}" for t in times) + f" s on {', '.join(sorted(backends))}",
                  flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
