#!/usr/bin/env python3
"""Makes a random-weight Qwen2 model as an HF folder in BF16, for the GPU tests: the GPU
machine has no network, so instead of the real Qwen2.5-1.5B-Instruct we test and benchmark a
model of exactly its shape (or a tiny one) with random weights.

    python3 tests/gpu/make_model.py DIR --shape tiny|1.5b [--seed N] [--tokenizer .gpu/tokenizer]
        [--device cuda|cpu]

DIR gets config.json (dtype bfloat16), generation_config.json, model.safetensors (BF16, one
file, lm_head tied to the embedding) and the tokenizer files copied from --tokenizer (made by
tests/gpu/prepare). Deterministic for a given seed and device type (CPU and CUDA random
streams differ; the references are always generated from the saved file, so that is enough).
Idempotent: does nothing if DIR/.complete records the same arguments.

The weights are drawn so that the logits are not degenerate and greedy decoding means
something. transformers' default (every matrix N(0, 0.02^2)) is too small: the layers barely
move the residual stream, and with tied embeddings the last input token's own embedding wins
the argmax. Instead every matrix is N(0, gain^2 / fan_in), fan_in being the dimension it is
contracted over (hidden for the tied embedding/lm_head), so activations have the same scale
whatever the shape (std 0.0625 for most of the tiny model's matrices, 0.026 for the 1.5b's):
  - gain 1 for the embedding, v, gate and up: logits get std ~1, a range of ~9 units;
  - gain 1.25 for q and k: attention scores get std ~1.6, so attention picks out positions
    (with std ~1 it is so diffuse that each token's output depends on little but the token
    itself, and greedy decoding falls into repeating one token; with std >= 2 the 28-layer
    model turns chaotic and BF16 rounding moves its logits by up to 3% of their range);
  - gain 2 for o and down: the layers' outputs dominate the residual stream, so the direct
    path (the input token's own embedding, which scores itself |e|^2 / rms(h) through the tied
    lm_head) gives the current token less of a head start.
  Measured on CPU with 28 layers of the tiny width: 18-20 distinct tokens in 24 greedy steps
  (7-10 with all gains 1), and transformers' BF16 logits within 1.2% of the range of F32's.
RMSNorm weights are 1 + 0.1*N(0,1) rather than all ones and the q/k/v biases 0.1*N(0,1) (Qwen2
has them; zeros would leave that code path untested).
"""
import argparse
import json
import os
import shutil
import sys
import time

SHAPES = {
    # Qwen2.5-1.5B-Instruct's config.json, exactly.
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960),
    # Small enough for a CPU run, same vocabulary and GQA ratio structure (head_dim 64).
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=512),
}
COMMON = dict(vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
              max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=151643,
              eos_token_id=151645, hidden_act="silu", use_sliding_window=False,
              sliding_window=None, max_window_layers=28, attention_dropout=0.0, use_cache=True)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def make_config(shape):
    from transformers import Qwen2Config

    # initializer_range is informational only (init_weights draws everything): the embedding's std.
    kw = dict(COMMON, **SHAPES[shape])
    kw["initializer_range"] = round(SHAPES[shape]["hidden_size"] ** -0.5, 6)
    cfg = Qwen2Config(**kw)
    # transformers 5 moves rope_theta into rope_parameters; 4.x keeps it top-level. Check that
    # whichever this version uses got the value (an unknown kwarg would be dropped silently).
    rp = getattr(cfg, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta != COMMON["rope_theta"]:
        sys.exit(f"make_model: rope_theta came out as {theta}, not 1e6 (transformers API change?)")
    return cfg


# Per-matrix gains (see the top of the file); every other matrix gets 1.
GAINS = {"q_proj": 1.25, "k_proj": 1.25, "o_proj": 2.0, "down_proj": 2.0}


def init_weights(model, seed, gain, device):
    """Draws every parameter from one seeded generator, in name order, so the result depends
    only on the seed (and device type), not on transformers' own init scheme."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda x: x[0]):
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.1, generator=g).add_(1.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1, generator=g)
            else:  # [out, in] matrices and the [vocab, hidden] embedding: contracted over dim 1
                k = next((v for m, v in GAINS.items() if f".{m}." in name), 1.0)
                p.normal_(0.0, gain * k / p.shape[1] ** 0.5, generator=g)


def set_dtype_field(cfg_path, dtype="bfloat16"):
    """config.json names the weights' dtype as "dtype" (transformers 5) or "torch_dtype" (4.x);
    make sure whichever is there says bfloat16."""
    with open(cfg_path) as f:
        c = json.load(f)
    key = "dtype" if "dtype" in c or "torch_dtype" not in c else "torch_dtype"
    if c.get(key) != dtype:
        c[key] = dtype
        with open(cfg_path, "w") as f:
            json.dump(c, f, indent=2)
            f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gain", type=float, default=1.0, help="scales every matrix (N(0, (gain*GAINS)^2/fan_in))")
    ap.add_argument("--tokenizer", default=os.path.join(REPO, ".gpu", "tokenizer"))
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    a = ap.parse_args()

    for f in TOKENIZER_FILES[:2]:
        if not os.path.isfile(os.path.join(a.tokenizer, f)):
            sys.exit(f"make_model: {a.tokenizer}/{f} missing (run tests/gpu/prepare here first)")
    stamp = os.path.join(a.dir, ".complete")
    want = f"{a.shape} seed={a.seed} gain={a.gain} {sorted(GAINS.items())}\n"
    if os.path.exists(stamp) and open(stamp).read() == want:
        print(f"make_model: {a.dir} is up to date")
        return 0

    import torch
    from transformers import Qwen2ForCausalLM

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    cfg = make_config(a.shape)
    # Built directly on the device in BF16 (the 1.5b is 3 GB: seconds on a GPU, minutes on CPU).
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    init_weights(model, a.seed, a.gain, device)
    # The config's dtype field: "dtype" in transformers 5, "torch_dtype" in 4.x.
    if "dtype" in type(model.config).__init__.__code__.co_varnames or hasattr(model.config, "dtype"):
        model.config.dtype = torch.bfloat16
    else:
        model.config.torch_dtype = torch.bfloat16
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = 151643, 151645, None

    model.to("cpu")  # safetensors writes from host memory; one explicit copy (3 GB: ~1 s)
    tmp = a.dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # safe_serialization is the default (and in 5.x maybe the only choice)
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size="20GB")
    except TypeError:
        model.save_pretrained(tmp, max_shard_size="20GB")
    set_dtype_field(os.path.join(tmp, "config.json"))
    for f in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(a.tokenizer, f)):
            shutil.copy(os.path.join(a.tokenizer, f), tmp)
    if not os.path.exists(os.path.join(tmp, "model.safetensors")):
        sys.exit(f"make_model: save_pretrained wrote no single model.safetensors in {tmp}")
    with open(os.path.join(tmp, ".complete"), "w") as f:
        f.write(want)
    shutil.rmtree(a.dir, ignore_errors=True)
    os.rename(tmp, a.dir)
    n = sum(p.numel() for p in model.parameters())
    size = os.path.getsize(os.path.join(a.dir, "model.safetensors"))
    print(f"make_model: {a.dir}: {a.shape}, {n / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB, "
          f"on {device} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
