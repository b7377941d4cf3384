#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus (tests/fuzz/corpus/<target>/), committed small:

  python tests/fuzz/make_corpus.py MICRO_DIR

MICRO_DIR is the micro Qwen2 folder of tests/emu/make_micro_model.py (a 500-token byte-level
vocabulary): its tokenizer.json, config and chat template seed the HF target, and its
vocabulary and merges go into a tiny Qwen2 GGUF (one layer, hidden size 32) written with
gguf-py, so the GGUF seed opens as a whole model. The other seeds are written here: a GGUF
with a value of every metadata type and a tensor of every weight type, safetensors files,
request bodies with logits, prompt texts. The files have no extension (.gguf and .safetensors
are ignored by git: weights never go in). Seeds are valid inputs: the mutations start from
files that reach the deep code, and a seed that stops opening fails its fuzz test."""
import json
import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, GGUFWriter

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
SEP = b"\n@@@@\n"


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def raw(nbytes, seed):
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# Bytes per block and elements per block of the weight types the seed carries.
BLOCK = {Q.Q8_0: (34, 32), Q.Q4_0: (18, 32), Q.Q4_1: (20, 32), Q.Q5_0: (22, 32),
         Q.Q5_1: (24, 32), Q.Q4_K: (144, 256), Q.Q5_K: (176, 256), Q.Q6_K: (210, 256)}


def quant(rows, cols, qtype, seed):
    nb, ne = BLOCK[qtype]
    q = raw(rows * cols // ne * nb, seed).reshape(rows, cols // ne * nb)
    if qtype == Q.Q8_0:  # small finite scales (F16 1/64) in each block
        for b in range(cols // ne):
            q[:, b * nb:b * nb + 2] = [0x00, 0x24]
    return q


def tiny_qwen2(micro, path, extra=None):
    tj = json.load(open(os.path.join(micro, "tokenizer.json"), encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    added = {t["id"]: t["content"] for t in tj["added_tokens"]}
    n_vocab = json.load(open(os.path.join(micro, "config.json")))["vocab_size"]
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        if i in added:
            tokens.append(added[i])
            types.append(3)  # control
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(1)  # normal
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # unused
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    template = open(os.path.join(micro, "chat_template.jinja"), encoding="utf-8").read()

    w = GGUFWriter(path, "qwen2")
    e, ff, heads, kv, hd = 32, 64, 4, 2, 8
    w.add_context_length(4096)
    w.add_embedding_length(e)
    w.add_feed_forward_length(ff)
    w.add_block_count(1)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(502)
    w.add_bos_token_id(500)
    w.add_chat_template(template)
    rng = np.random.default_rng(1)

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w.add_tensor("token_embd.weight", quant(n_vocab, e, Q.Q8_0, 2), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", f32(e))
    w.add_tensor("blk.0.attn_q.weight", f32(heads * hd, e).astype(np.float16))
    w.add_tensor("blk.0.attn_q.bias", f32(heads * hd))
    bf16 = (f32(kv * hd, e).view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("blk.0.attn_k.weight", bf16.view(np.uint8), raw_dtype=Q.BF16)
    w.add_tensor("blk.0.attn_k.bias", f32(kv * hd))
    w.add_tensor("blk.0.attn_v.weight", quant(kv * hd, e, Q.Q8_0, 3), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_v.bias", f32(kv * hd))
    w.add_tensor("blk.0.attn_output.weight", quant(e, heads * hd, Q.Q8_0, 4), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.ffn_norm.weight", f32(e))
    w.add_tensor("blk.0.ffn_gate.weight", quant(ff, e, Q.Q8_0, 5), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", quant(ff, e, Q.Q8_0, 6), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.ffn_down.weight", quant(e, ff, Q.Q8_0, 7), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", f32(e))
    if extra:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def all_types(w):
    """Every metadata value type (nested arrays too) and every weight type, one small tensor each."""
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "h\u00e9llo \u4e16\u754c")
    w.add_uint64("t.u64", 2**63)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -2.25)
    w.add_array("t.arr.i32", [1, -2, 3])
    w.add_array("t.arr.str", ["a", "", "\u00e9\u00e9"])
    w.add_array("t.arr.nested", [[1, 2], [3]])
    w.add_key_value("t.arr.f32", [0.5, -1.0], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    w.add_tensor("f32", np.arange(8, dtype=np.float32))
    w.add_tensor("f16", np.arange(8, dtype=np.float16).reshape(2, 4))
    for i, qt in enumerate(BLOCK):
        ne = BLOCK[qt][1]
        w.add_tensor(qt.name.lower(), quant(1, ne, qt, 10 + i), raw_dtype=qt)


def safetensors(tensors, metadata=None):
    """A .safetensors file of (name, dtype, shape, bytes) in order."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, b in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def main():
    micro = sys.argv[1]
    os.makedirs(OUT, exist_ok=True)
    d = os.path.join(OUT, "gguf")
    os.makedirs(d, exist_ok=True)
    tiny_qwen2(micro, os.path.join(d, "tiny_qwen2"))
    tiny_qwen2(micro, os.path.join(d, "all_types"), all_types)

    f = np.arange(6, dtype=np.float32)
    put("safetensors", "three", safetensors([
        ("model.norm.weight", "F32", [6], f.tobytes()),
        ("model.embed_tokens.weight", "BF16", [2, 3], (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()),
        ("lm_head.weight", "F16", [3, 2], f.astype(np.float16).tobytes()),
    ], {"format": "pt"}))
    put("safetensors", "scalar", safetensors([("s", "F32", [], f[:1].tobytes())]))

    def read(name):
        p = os.path.join(micro, name)
        return open(p, "rb").read() if os.path.exists(p) else b""

    index = json.dumps({"metadata": {"total_size": 8},
                        "weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}})
    gen = json.dumps({"bos_token_id": 500, "eos_token_id": [502, 500], "do_sample": True,
                      "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1,
                      "max_new_tokens": 512, "pad_token_id": 500})
    put("hf", "micro", SEP.join([read("config.json"), gen.encode(), read("tokenizer_config.json"),
                                 read("chat_template.jinja"), index.encode(), read("tokenizer.json")]))
    tc = json.loads(read("tokenizer_config.json"))
    tc["chat_template"] = read("chat_template.jinja").decode()
    put("hf", "template_in_config", SEP.join([read("config.json"), b"", json.dumps(tc).encode(), b"",
                                             index.encode(), read("tokenizer.json")]))

    logits = np.array([0.5, 2.0, 2.0, -1.0, float("inf"), float("nan"), -float("inf"), 3.0,
                       1e-30, -0.0, 7.5, 7.5], dtype=np.float32).tobytes()
    prompt = bytes([9, 10, 10, 11, 0, 255])
    put("request", "qwen", b'{"prompt": "hi", "temperature": 0.7, "top_p": 0.8, "top_k": 20, '
        b'"repetition_penalty": 1.1, "seed": 7}' + SEP + logits + prompt)
    put("request", "greedy_stop", b'{"prompt": ["a", "b"], "max_tokens": 16, "temperature": 0, '
        b'"stop": ["\\n\\n", "END"], "presence_penalty": -2, "frequency_penalty": 2}' + SEP + logits)
    put("request", "openai", b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], '
        b'"max_completion_tokens": 3, "min_p": 0.1, "top_k": -1, "stop": null, "seed": null}'
        + SEP + logits[:20])

    def stops(strings, text):
        b = bytes([len(strings) - 1])
        for s in strings:
            s = s.encode() if isinstance(s, str) else s
            b += bytes([len(s)]) + s
        return b + (text.encode() if isinstance(text, str) else text)

    put("stop", "paragraph", stops(["\n\n"], "Hello\nworld\n\nmore"))
    put("stop", "two", stops(["END", "\u4e2d\u6587"], "abc \u4e2d \u6587\u4e2d\u6587 EN END"))
    put("stop", "overlap", stops(["abab", "bab", "", "<|im_end|>"], "aababab <|im_"))
    put("stop", "bytes", stops([b"\xe4", b"\xb8\xad"], b"x\xe4\xb8\xad\xff"))

    # scheduler: config (blocks, block size, budget, sequences, prefix cache), then operations
    # (0/1 add: length, max tokens, prompt; 2 cancel: which; 3 step)
    shared = [0, 23, 11] + [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    put("sched", "pressure", bytes([10, 2, 16, 4, 1] + shared * 6 + [3, 3, 2, 1, 3] + shared + [3] * 8))
    put("sched", "tiny_budget", bytes([30, 0, 1, 2, 1] + [0, 5, 3, 1, 1, 1, 1, 1, 1] * 3 + [3, 2, 0, 3]))
    put("sched", "no_prefix", bytes([5, 1, 7, 1, 0] + [1, 7, 5, 4, 4, 4, 4, 4, 4, 4, 4, 3] * 4))

    workload = os.path.join(HERE, "..", "..", "..", "shared", "workload", "pmpp_questions.json")
    q = json.load(open(workload, encoding="utf-8"))
    first = q[0] if isinstance(q[0], str) else json.dumps(q[0], ensure_ascii=False)
    put("tokenizer", "workload_question", first)
    put("tokenizer", "chat", "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\n"
        "Hello!<|im_end|>\n<|im_start|>assistant\n")
    put("tokenizer", "code", "def f(x):\n\treturn x ** 2  # it's 12345 \r\n\n   \u3000done")
    put("tokenizer", "unicode", "e\u0301 \u00e9 \U0001F600 \uFB01 \u0130 \u4e2d\u6587 \u00a0")
    put("tokenizer", "invalid", b"ok \xff \xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80 \xe4\xb8 end\xe6")


if __name__ == "__main__":
    main()
