#!/usr/bin/env python3
"""Writes a micro Qwen2 model (an HF folder) for running the whole engine on the CUDA backend
under the CPU emulator (tests/emu/test_emu_model.c), where every CUDA thread is a green thread
and a real model's vocabulary alone would take seconds per step:

    python3 tests/emu/make_micro_model.py HF_FOLDER OUT_DIR

Two layers, hidden 128, two query heads over one KV head (head_dim 64, as the tensor-core
attention needs), MLP 256, random F32 weights from a fixed seed (the CUDA backend rounds them
to BF16 at load, the CPU backend keeps them). The tokenizer is HF_FOLDER's (Qwen2's) cut to its
first 500 tokens (the 256 byte tokens and the first merges) plus <|endoftext|>, <|im_start|>
and <|im_end|> as 500-502; vocabulary 512. Idempotent: prints OUT_DIR.
"""
import json
import os
import shutil
import sys

KEEP = 500
VOCAB = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SHAPE = dict(hidden=128, layers=2, heads=2, kv_heads=1, ff=256)
STAMP = "micro v1\n"


def tokenizer(src):
    with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
        t = json.load(f)
    vocab = {s: i for s, i in t["model"]["vocab"].items() if i < KEEP}
    if len(vocab) != KEEP:
        sys.exit(f"make_micro_model: ids 0..{KEEP - 1} are not all in {src}'s vocabulary")
    merges = []
    for m in t["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        if a in vocab and b in vocab and a + b in vocab:
            merges.append([a, b])
    t["model"]["vocab"] = vocab
    t["model"]["merges"] = merges
    added = []
    for e in t["added_tokens"]:
        if e["content"] in SPECIAL:
            added.append(dict(e, id=KEEP + SPECIAL.index(e["content"])))
    if len(added) != len(SPECIAL):
        sys.exit(f"make_micro_model: {src}'s tokenizer lacks one of {SPECIAL}")
    t["added_tokens"] = sorted(added, key=lambda e: e["id"])
    for key in ("post_processor",):  # ids of the big vocabulary would dangle
        t[key] = None
    return t


def weights(seed=1234):
    import numpy as np

    rng = np.random.default_rng(seed)
    h, ff, hd = SHAPE["hidden"], SHAPE["ff"], SHAPE["hidden"] // SHAPE["heads"]
    q, kv = SHAPE["heads"] * hd, SHAPE["kv_heads"] * hd

    def mat(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols)) * gain / cols ** 0.5).astype(np.float32)

    def vec(n, mean, std):
        return (mean + std * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(VOCAB, h), "model.norm.weight": vec(h, 1.0, 0.1)}
    for i in range(SHAPE["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = vec(h, 1.0, 0.1)
        w[p + "post_attention_layernorm.weight"] = vec(h, 1.0, 0.1)
        w[p + "self_attn.q_proj.weight"] = mat(q, h, 1.25)
        w[p + "self_attn.k_proj.weight"] = mat(kv, h, 1.25)
        w[p + "self_attn.v_proj.weight"] = mat(kv, h)
        w[p + "self_attn.q_proj.bias"] = vec(q, 0.0, 0.1)
        w[p + "self_attn.k_proj.bias"] = vec(kv, 0.0, 0.1)
        w[p + "self_attn.v_proj.bias"] = vec(kv, 0.0, 0.1)
        w[p + "self_attn.o_proj.weight"] = mat(h, q, 2.0)
        w[p + "mlp.gate_proj.weight"] = mat(ff, h)
        w[p + "mlp.up_proj.weight"] = mat(ff, h)
        w[p + "mlp.down_proj.weight"] = mat(h, ff, 2.0)
    return w


def config():
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": SHAPE["hidden"], "intermediate_size": SHAPE["ff"],
        "num_hidden_layers": SHAPE["layers"], "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": SHAPE["kv_heads"], "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "bos_token_id": KEEP, "eos_token_id": KEEP + 2,
        "torch_dtype": "float32", "use_sliding_window": False, "sliding_window": None,
        "attention_dropout": 0.0,
    }


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    stamp = os.path.join(out, ".complete")
    if os.path.exists(stamp) and open(stamp).read() == STAMP:
        print(out)
        return 0
    from safetensors.numpy import save_file

    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer(src), f, ensure_ascii=False)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                   "tokenizer_class": "Qwen2Tokenizer"}, f, indent=2)
    if os.path.exists(os.path.join(src, "chat_template.jinja")):
        shutil.copy(os.path.join(src, "chat_template.jinja"), tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config(), f, indent=2)
    save_file(weights(), os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, ".complete"), "w") as f:
        f.write(STAMP)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
