#!/usr/bin/env python3
"""Reference logits for the GPU model test (test_gpu_model), made with transformers on the same
machine from a BF16 HF folder (tests/gpu/make_model.py). The GPU counterpart of
tests/fixtures/gen_logits.py.

    python3 tests/gpu/gen_reference.py DIR OUT.json [--device cuda|cpu] [--workload FILE]

Five prompts: one_token, random_64, workload_chat (the first workload question under the chat
template), random_300, long_1000 (random ids are drawn below <|endoftext|>, the first special id:
151643 in Qwen2's vocabulary, 500 in the micro model's of tests/emu/make_micro_model.py).
Each runs through two models:
  ref32    the BF16 checkpoint upcast to F32, eager attention, no TF32: exact math, the only
           differences from a correct implementation are summation order;
  hf_bf16  BF16 as transformers runs it by default (SDPA attention): what a BF16 engine can be
           expected to match, and a measure of how far BF16 moves the logits.
Per case OUT.json has: name, ids, argmax_ref32 / argmax_bf16 (every position), sample_ids (512:
ref32's top 64 at the last position + 448 others from a fixed permutation), ref32_logits /
bf16_logits (last position, at sample_ids), range (max - min of ref32's last logits),
greedy_ref32 (32 tokens of ref32 greedy generate, no EOS), greedy_bf16 (the same from hf_bf16:
check_greedy.py judges it like cllm's tokens, to show what BF16 alone does), and two
diagnostics: bf16_max_abs_diff (over the sampled last logits) and bf16_argmax_agree (fraction
of positions).
"""
import argparse
import json
import os
import sys
import time
import warnings

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
FIRST_SPECIAL = 151643  # Qwen2's <|endoftext|> (bench_transformers.py's random prompts)


def exact_math():
    """F32 matmuls in full precision: TF32 would round the inputs to 10 mantissa bits and turn
    the reference into an approximation. (torch >= 2.9 also has the fp32_precision API; the
    legacy switches still work there, and set_float32_matmul_precision covers both.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")


def load_model(folder, dtype, device, attn=None):
    """from_pretrained with dtype= (transformers >= 4.56) or torch_dtype= (older), checked."""
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": attn} if attn else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            m = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
        except TypeError:
            m = None
        if m is None or next(m.parameters()).dtype != dtype:
            m = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype, **kw)
    if next(m.parameters()).dtype != dtype:
        sys.exit(f"gen_reference: could not load {folder} as {dtype}")
    return m.to(device).eval()


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def first_special(tok):
    """<|endoftext|>'s id: every id from it on is special (or padding in the vocabulary)."""
    return tok.convert_tokens_to_ids("<|endoftext|>")


def prompts(tok, workload):
    """The five cases' prompt ids; the random ones come from per-case fixed generators, so
    adding or changing one case never changes another."""
    def rand(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, first_special(tok), (n,), generator=g).tolist()

    with open(workload, encoding="utf-8") as f:
        question = json.load(f)[0]
    chat = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    hello = tok("Hello", add_special_tokens=False)["input_ids"][:1]
    return [
        ("one_token", hello),
        ("random_64", rand(64, 64)),
        ("workload_chat", tok(chat, add_special_tokens=False)["input_ids"]),
        ("random_300", rand(300, 300)),
        ("long_1000", rand(1000, 1000)),
    ]


@torch.no_grad()
def all_logits(model, ids, device):
    return model(torch.tensor([ids], device=device)).logits[0].float()


@torch.no_grad()
def greedy(model, ids, n, device, pad):
    x = torch.tensor([ids], device=device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, num_beams=1, eos_token_id=None,
                         pad_token_id=pad)
    return out[0, len(ids):].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("out")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--workload", default=os.path.join(REPO, ".gpu", "workload", "pmpp_questions.json"))
    a = ap.parse_args()
    if not os.path.exists(a.workload):  # a checkout next to ../shared, without tests/gpu/prepare
        a.workload = os.path.join(REPO, "..", "shared", "workload", "pmpp_questions.json")
    device = a.device or default_device()
    exact_math()
    from transformers import AutoTokenizer

    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(a.dir)
    cases = [{"name": n, "ids": ids} for n, ids in prompts(tok, a.workload)]

    ref = load_model(a.dir, torch.float32, device, attn="eager")
    vocab = ref.config.vocab_size
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
    for c in cases:
        logits = all_logits(ref, c["ids"], device)
        last = logits[-1]
        top = torch.topk(last, 64).indices.cpu()
        rest = perm[~torch.isin(perm, top)][:448]  # distinct from the top 64
        c["sample_ids"] = torch.cat([top, rest]).tolist()
        c["argmax_ref32"] = logits.argmax(-1).tolist()
        c["ref32_logits"] = last.cpu()[c["sample_ids"]].tolist()
        c["range"] = float(last.max() - last.min())
        c["greedy_ref32"] = greedy(ref, c["ids"], 32, device, first_special(tok))
        del logits
    del ref
    if device == "cuda":
        torch.cuda.empty_cache()

    bf = load_model(a.dir, torch.bfloat16, device)
    for c in cases:
        logits = all_logits(bf, c["ids"], device)
        c["argmax_bf16"] = logits.argmax(-1).tolist()
        c["bf16_logits"] = logits[-1].cpu()[c["sample_ids"]].tolist()
        diff = torch.tensor(c["bf16_logits"]) - torch.tensor(c["ref32_logits"])
        c["bf16_max_abs_diff"] = float(diff.abs().max())
        c["bf16_argmax_agree"] = sum(x == y for x, y in zip(c["argmax_bf16"], c["argmax_ref32"])) / len(c["ids"])
        del logits
        c["greedy_bf16"] = greedy(bf, c["ids"], 32, device, first_special(tok))
        print(f"{c['name']:14s} {len(c['ids']):5d} tokens, range {c['range']:5.2f}; bf16 vs f32: "
              f"max |dlogit| {c['bf16_max_abs_diff']:.4f}, argmax agree {c['bf16_argmax_agree']:.3f}; "
              f"greedy: {len(set(c['greedy_ref32']))} distinct of 32")
    keys = ["name", "ids", "argmax_ref32", "argmax_bf16", "sample_ids", "ref32_logits",
            "bf16_logits", "range", "greedy_ref32", "greedy_bf16", "bf16_max_abs_diff",
            "bf16_argmax_agree"]
    with open(a.out, "w") as f:
        json.dump({"generator": "tests/gpu/gen_reference.py", "model": a.dir,
                   "cases": [{k: c[k] for k in keys} for c in cases]}, f)
        f.write("\n")
    print(f"gen_reference: {a.out} ({os.path.getsize(a.out) / 1024:.0f} KiB) on {device} in "
          f"{time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
