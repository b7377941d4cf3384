#!/usr/bin/env python3
"""The cllm binary end to end: `cllm tokenize` matches the HF golden ids on GGUF and HF
folders (stdin read exactly as given), `--decode` reverses it, `cllm info` describes both
formats, and every kind of bad model file gives a one-line error naming the file and a
non-zero exit, never a crash; `cllm bench`'s single-sequence mode runs with short prompts. Paths come from CTest's environment (scripts/test)."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

BIN = os.environ["CLLM_BIN"]
GGUF = os.environ["CLLM_TEST_GGUF"]
HF = os.environ["CLLM_TEST_HF"]
FIXTURES = os.environ["CLLM_FIXTURES"]

passed = failed = 0


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAIL: {what}", file=sys.stderr)


def run(args, stdin=b""):
    return subprocess.run([BIN] + args, input=stdin, capture_output=True, timeout=120)


def test_tokenize(model, cases):
    for c in cases:
        raw = bytes.fromhex(c["hex"])
        r = run(["tokenize", "--model", model, "--ids"], raw)
        got = [int(x) for x in r.stdout.split()]
        check(r.returncode == 0 and got == c["ids"], f"tokenize {c['name']} on {model}: {r.stderr[-300:]}")
        d = run(["tokenize", "--model", model, "--decode"], r.stdout)
        want = raw.decode("utf-8", "replace").encode()
        check(d.returncode == 0 and d.stdout == want, f"decode {c['name']} on {model}")


def expect_error(args, needle, what):
    r = run(args)
    err = r.stderr.decode(errors="replace").strip()
    ok = r.returncode not in (0, -6, -11) and r.returncode > 0 and needle in err and len(err.splitlines()) == 1
    check(ok, f"{what}: exit {r.returncode}, stderr {err!r}")


def test_bad_files(tmp):
    head = open(GGUF, "rb").read(1 << 20)
    cases = {}
    cases["truncated.gguf"] = head[:1000]
    cases["empty.gguf"] = b""
    cases["magic.gguf"] = b"GGUX" + head[4:]
    cases["version.gguf"] = head[:4] + struct.pack("<I", 7) + head[8:]
    cases["ntensors.gguf"] = head[:8] + struct.pack("<Q", 1 << 62) + head[16:]
    for name, data in cases.items():
        p = os.path.join(tmp, name)
        open(p, "wb").write(data)
        expect_error(["info", "--model", p], name, f"bad GGUF {name}")
        expect_error(["tokenize", "--model", p], name, f"tokenize with bad GGUF {name}")
    expect_error(["info", "--model", os.path.join(tmp, "absent.gguf")], "absent.gguf", "missing file")

    # HF folders: copies of the real one with one thing broken. Weights are symlinked.
    def hf_copy(name):
        d = os.path.join(tmp, name)
        os.mkdir(d)
        for f in os.listdir(HF):
            src = os.path.join(HF, f)
            if f.endswith(".safetensors"):
                os.symlink(src, os.path.join(d, f))
            elif os.path.isfile(src):
                shutil.copy(src, d)
        return d

    d = hf_copy("noconfig")
    os.remove(os.path.join(d, "config.json"))
    expect_error(["info", "--model", d], "config.json", "missing config.json")
    d = hf_copy("badjson")
    open(os.path.join(d, "config.json"), "w").write('{"model_type": "qwen2", "hidden_size": ')
    expect_error(["info", "--model", d], "config.json", "malformed config.json")
    d = hf_copy("notok")
    os.remove(os.path.join(d, "tokenizer.json"))
    expect_error(["info", "--model", d], "tokenizer.json", "missing tokenizer.json")
    # A safetensors file whose only tensor has an unknown dtype, and one missing a tensor.
    for name, dtype in (("i64", "I64"), ("missing", "F32")):
        d = hf_copy(name)
        for f in os.listdir(d):
            if f.endswith(".safetensors") or f.endswith(".index.json"):
                os.remove(os.path.join(d, f))
        header = json.dumps({"model.norm.weight": {"dtype": dtype, "shape": [2],
                                                   "data_offsets": [0, 16 if dtype == "I64" else 8]}}).encode()
        open(os.path.join(d, "model.safetensors"), "wb").write(
            struct.pack("<Q", len(header)) + header + b"\0" * 16)
        needle = "I64" if dtype == "I64" else "missing"
        expect_error(["info", "--model", d], needle, f"safetensors {name}")


def test_generate_errors():
    # Bad generation input: a clear one-line error and a non-zero exit, never a crash.
    cases = [
        (["--prompt", ""], "empty"),
        (["--prompt", "hi", "--temperature", "-1", "--max-tokens", "2"], "temperature"),
        (["--prompt", "hi", "--top-p", "1.5", "--max-tokens", "2"], "top_p"),
        (["--raw", "--ctx", "8", "--prompt", "one two three four five six seven eight nine ten"],
         "context window"),
    ]
    for args, needle in cases:
        expect_error(["generate", "--model", GGUF] + args, needle, f"generate {args}")
    r = run(["generate", "--model", GGUF, "--prompt", "hi", "--max-tokens", "0"])
    check(r.returncode == 2 and b"invalid value" in r.stderr, "--max-tokens 0 is refused")
    for flag, value in [("--gpu-mem-fraction", "0"), ("--gpu-mem-fraction", "1.5"),
                        ("--device", "tpu"), ("--device", "cuda:x"), ("--cpu-weights", "q8")]:
        r = run(["generate", "--model", GGUF, "--prompt", "hi", flag, value])
        check(r.returncode == 2 and b"invalid value" in r.stderr, f"{flag} {value} is refused")
    # A GPU the machine does not have (no device, or a build without CUDA): a clear error.
    for dev in ["cuda:7", "musa:7"]:
        r = run(["generate", "--model", GGUF, "--prompt", "hi", "--max-tokens", "2",
                 "--device", dev])
        check(r.returncode != 0 and b"CUDA" in r.stderr and len(r.stderr.splitlines()) <= 3,
              f"--device {dev} without such a GPU fails clearly: {r.stderr[-300:]}")
    # auto (the default): the GPU when one starts, else the CPU, saying why.
    for args in [["--device", "auto"], [], ["--no-device-check"]]:
        r = run(["generate", "--model", GGUF, "--raw", "--prompt", "1, 2,", "--max-tokens", "2"]
                + args)
        check(r.returncode == 0 and (b"[cpu]" in r.stderr or b"[cuda]" in r.stderr),
              f"generate {args or '(no --device)'} runs where it can: {r.stderr[-300:]}")
    # Float weights quantized at load on the CPU (test_forward_model checks the logits): it
    # answers.
    r = run(["generate", "--model", HF, "--raw", "--prompt", "1, 2, 3, 4,", "--max-tokens", "4",
             "--device", "cpu", "--cpu-weights", "q6_k"])
    check(r.returncode == 0 and len(r.stdout.strip()) > 0 and b"[cpu]" in r.stderr,
          f"--cpu-weights q6_k runs an HF folder and answers: {r.stderr[-300:]}")
    r = run(["generate", "--model", GGUF, "--raw", "--prompt", "1, 2, 3, 4,", "--max-tokens", "4"])
    check(r.returncode == 0 and len(r.stdout.strip()) > 0 and b"decode" in r.stderr,
          f"generate streams an answer and reports rates: {r.stderr[-300:]}")


def test_bench_single():
    # The single-sequence benchmark decodes after a prompt of at most 16 of the prompt's tokens:
    # a shorter --prompt-tokens once read past the prompt (garbage ids; ASan: heap overflow).
    for n in ("1", "8", "20"):
        r = run(["bench", "--model", GGUF, "--prompt-tokens", n, "--gen-tokens", "3", "--runs", "1",
                 "--device", "cpu"])
        check(r.returncode == 0 and b"prefill" in r.stdout,
              f"bench --prompt-tokens {n}: exit {r.returncode}, {r.stderr[-300:]}")
    r = run(["bench", "--model", GGUF, "--prompt-tokens", "0"])
    check(r.returncode == 2 and b"positive" in r.stderr, "bench --prompt-tokens 0 is refused")


def main():
    golden = json.load(open(os.path.join(FIXTURES, "tokenizer_golden.json")))["cases"]
    pick = {"english", "chinese", "code", "emoji", "whitespace_runs", "newline_runs", "trailing_spaces",
            "special_tokens", "invalid_truncated_mid", "invalid_before_special", "empty", "pmpp_000",
            "pmpp_191", "long_word"}
    cases = [c for c in golden if c["name"] in pick]
    check(len(cases) == len(pick), "fixture has the picked cases")
    for model in (GGUF, HF):
        test_tokenize(model, cases)
        r = run(["info", "--model", model])
        out = r.stdout.decode()
        check(r.returncode == 0 and "qwen2" in out and "ChatML" in out and "151936 tokens" in out,
              f"info on {model}: {out[-500:]} {r.stderr[-300:]}")
    r = run(["tokenize", "--model", GGUF, "--decode"], b"1 2 999999999")
    check(r.returncode == 1 and b"999999999" in r.stderr, "decode rejects an id out of range")
    check(run(["nonsense"]).returncode == 2, "unknown command exits 2")
    check(run(["info"]).returncode != 0, "info without --model fails")
    with tempfile.TemporaryDirectory() as tmp:
        test_bad_files(tmp)
    test_generate_errors()
    test_bench_single()
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
