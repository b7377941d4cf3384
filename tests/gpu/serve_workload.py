#!/usr/bin/env python3
"""The evaluation's own path, end to end: `cllm serve` on the GPU answering the HTTP contract
(../shared/SPEC.md) -- GET / until 200, one question, then the 192 workload questions in one
POST /predict -- timed, with the answers checked against the contract:

    python3 tests/gpu/serve_workload.py CLLM_BINARY MODEL WORKLOAD_JSON [--device cuda]
        [--limit N] [--max-tokens N] [--timeout S]

The requests carry Qwen2.5-1.5B-Instruct's sampling (its generation_config: temperature 0.7,
top-p 0.8, top-k 20, repetition penalty 1.1): the random-weight test model has none of its
own. Without --max-tokens the server's default (512) applies, as in the evaluation. Prints
one line per request and the output tokens the server counted (/metrics); exits 1 if the
server did not become ready, died, or broke the contract (a missing, reordered or non-string
answer). Without a GPU, --device cpu --limit 3 tries the script here."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from time_startup import free_port, stop  # noqa: E402

QWEN_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}


def http(port, method, path, body=None, timeout=600):
    """(status, parsed JSON or text) of one request."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(errors="replace"), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def generated_tokens(port):
    """cllm_generation_tokens_total from /metrics (None if absent)."""
    status, text = http(port, "GET", "/metrics", timeout=30)
    if status != 200 or not isinstance(text, str):
        return None
    for line in text.splitlines():
        if line.startswith("cllm_generation_tokens_total"):
            return float(line.split()[-1])
    return None


def check_answers(prompts, got):
    """Contract problems of a /predict answer to `prompts` (a list or one string), or []."""
    if not isinstance(got, dict) or "response" not in got:
        return [f"no 'response' in {str(got)[:200]}"]
    r = got["response"]
    if isinstance(prompts, str):
        return [] if isinstance(r, str) else [f"response is {type(r).__name__}, not a string"]
    if not isinstance(r, list) or len(r) != len(prompts):
        return [f"response is not a list of {len(prompts)}: {str(r)[:200]}"]
    return [f"answer {i} is {type(a).__name__}" for i, a in enumerate(r) if not isinstance(a, str)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("model")
    ap.add_argument("workload")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--limit", type=int, default=0, help="the first N questions only")
    ap.add_argument("--max-tokens", type=int, default=0, help="default: the server's")
    ap.add_argument("--timeout", type=float, default=360, help="the evaluation's batch deadline")
    a = ap.parse_args()
    with open(a.workload) as f:
        questions = json.load(f)
    if a.limit:
        questions = questions[:a.limit]
    extra = dict(QWEN_SAMPLING, **({"max_tokens": a.max_tokens} if a.max_tokens else {}))

    port = free_port()
    log = tempfile.TemporaryFile()
    t0 = time.monotonic()
    proc = subprocess.Popen([os.path.abspath(a.binary), "serve", "--model", a.model, "--host",
                             "127.0.0.1", "--port", str(port), "--device", a.device],
                            stdout=subprocess.DEVNULL, stderr=log)
    problems = []
    try:
        ready = None
        while time.monotonic() - t0 < 180 and proc.poll() is None:  # the health deadline
            try:
                if http(port, "GET", "/", timeout=2)[0] == 200:
                    ready = time.monotonic() - t0
                    break
            except OSError:
                pass
            time.sleep(0.02)
        if ready is None:
            problems.append("not ready within 180 s" if proc.poll() is None else
                            f"exited with {proc.returncode} before it was ready")
            return 1
        backend = http(port, "GET", "/health", timeout=10)[1]
        backend = backend.get("backend") if isinstance(backend, dict) else backend
        print(f"serve: ready in {ready:.2f} s on {backend} ({a.device})", flush=True)

        for prompts in (questions[0], questions):
            before = generated_tokens(port)
            t = time.monotonic()
            status, got = http(port, "POST", "/predict", dict(extra, prompt=prompts),
                               timeout=a.timeout)
            secs = time.monotonic() - t
            after = generated_tokens(port)
            what = "1 question" if isinstance(prompts, str) else f"{len(prompts)} questions"
            bad = [f"HTTP {status}: {str(got)[:300]}"] if status != 200 else \
                check_answers(prompts, got)
            if bad:
                problems += [f"{what}: {b}" for b in bad]
                continue
            answers = [got["response"]] if isinstance(prompts, str) else got["response"]
            empty = sum(1 for x in answers if not x)
            tokens = after - before if before is not None and after is not None else None
            rate = f", {tokens:.0f} output tokens, {tokens / secs:.0f} tok/s" if tokens else ""
            print(f"serve: {what} in {secs:.2f} s{rate}; {len(answers) - empty} of "
                  f"{len(answers)} answers non-empty, {sum(len(x) for x in answers)} characters",
                  flush=True)
            if secs > a.timeout:
                problems.append(f"{what}: {secs:.0f} s, past the {a.timeout:.0f} s deadline")
        if proc.poll() is not None:
            problems.append(f"the server exited with {proc.returncode}")
    finally:
        stop(proc)
        for p in problems:
            print(f"serve: FAIL: {p}")
        if problems:
            log.seek(0)
            sys.stdout.write(log.read().decode(errors="replace")[-3000:])
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
