#!/usr/bin/env python3
"""transformers' speed on the same GPU, in the same run, as the baseline for `cllm bench`:
BF16, default attention (SDPA), plain model.generate, greedy.

    python3 tests/gpu/bench_transformers.py DIR [--batch-sizes 1,160,192] [--prompt-tokens 64]
        [--new-tokens 256] [--prefill 512] [--json OUT.json] [--quick] [--device cuda|cpu]

Measures, after a warm-up:
  batch 1    decode tok/s: (N-1) / (time of generate(N) - time of generate(1)), so the prompt's
             prefill and the first token are not counted (what `cllm bench` calls decode);
  batch B>1  output tok/s: B * N / wall time of one generate(N) over B random prompts of
             --prompt-tokens ids (all the same length, so the left padding the tokenizer would
             add is not needed; the attention mask is passed anyway);
  prefill    one forward of --prefill tokens (only the last position's logits, as generate
             does), median of 5 (3 with --quick), torch.cuda.synchronize around each.
min_new_tokens = max_new_tokens and no eos_token_id, so every sequence makes exactly N tokens.
On an H200 the default run (1.5B, batches 1/160/192, 256 tokens) takes about 1-2 minutes;
--quick makes 32 tokens per sequence instead.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_reference import FIRST_SPECIAL, default_device, load_model  # noqa: E402


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def gen_time(model, ids, n, device):
    """Wall time of one generate of exactly n tokens for every row of ids."""
    mask = torch.ones_like(ids)
    sync(device)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, num_beams=1, eos_token_id=None,
                         pad_token_id=FIRST_SPECIAL)
    sync(device)
    t = time.perf_counter() - t
    if out.shape[1] != ids.shape[1] + n:
        sys.exit(f"bench_transformers: generate made {out.shape[1] - ids.shape[1]} tokens, not {n}")
    return t


@torch.no_grad()
def prefill_time(model, ids, device):
    sync(device)
    t = time.perf_counter()
    try:
        model(ids, logits_to_keep=1)
    except TypeError:  # transformers < 4.50 calls it num_logits_to_keep
        model(ids, num_logits_to_keep=1)
    sync(device)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--batch-sizes", default="1,160,192")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--quick", action="store_true", help="32 new tokens, 3 prefill repeats")
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    device = a.device or default_device()
    n_new = 32 if a.quick else a.new_tokens
    reps = 3 if a.quick else 5
    batches = [int(b) for b in a.batch_sizes.split(",") if b]
    if n_new < 2:
        sys.exit("bench_transformers: --new-tokens must be >= 2")

    import transformers

    t_start = time.time()
    model = load_model(a.dir, torch.bfloat16, device)
    g = torch.Generator().manual_seed(0)

    def rand(b, n):
        return torch.randint(0, FIRST_SPECIAL, (b, n), generator=g).to(device)

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    res = {"generator": "tests/gpu/bench_transformers.py", "model": a.dir, "device": name,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "attn_implementation": getattr(model.config, "_attn_implementation", None),
           "prompt_tokens": a.prompt_tokens, "new_tokens": n_new, "batches": {}}
    # Warm-up: CUDA context, cuBLAS handles, the allocator, and generate's first-call setup.
    gen_time(model, rand(1, a.prompt_tokens), 4, device)
    prefill_time(model, rand(1, a.prefill), device)
    if any(b > 1 for b in batches):
        gen_time(model, rand(max(batches), a.prompt_tokens), 2, device)

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {name}, bf16, "
          f"{res['attn_implementation']}; {a.prompt_tokens}-token prompts, {n_new} new tokens")
    for b in batches:
        ids = rand(b, a.prompt_tokens)
        if b == 1:
            t1 = gen_time(model, ids, 1, device)
            tn = gen_time(model, ids, n_new, device)
            r = {"decode_tok_s": (n_new - 1) / (tn - t1), "wall_s": tn,
                 "end_to_end_tok_s": n_new / tn}
            print(f"  batch {b:4d}: decode {r['decode_tok_s']:8.1f} tok/s "
                  f"(generate end to end {r['end_to_end_tok_s']:.1f} tok/s, {tn:.2f} s)")
        else:
            tn = gen_time(model, ids, n_new, device)
            r = {"output_tok_s": b * n_new / tn, "wall_s": tn}
            print(f"  batch {b:4d}: {r['output_tok_s']:8.1f} output tok/s ({tn:.2f} s)")
        res["batches"][str(b)] = r
    if device == "cuda":
        torch.cuda.empty_cache()
    ids = rand(1, a.prefill)
    ts = [prefill_time(model, ids, device) for _ in range(reps)]
    med = statistics.median(ts)
    res["prefill"] = {"tokens": a.prefill, "median_ms": med * 1e3, "tok_s": a.prefill / med,
                      "runs": reps}
    print(f"  prefill {a.prefill} tokens: {med * 1e3:.1f} ms ({a.prefill / med:.0f} tok/s), "
          f"median of {reps}")
    res["total_s"] = time.time() - t_start
    print(f"bench_transformers: {res['total_s']:.0f} s in all")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
