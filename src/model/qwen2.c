/* The GGUF <-> HF tensor name table of Qwen2 (the same as Llama's, plus Q/K/V biases). */
#include "model/qwen2.h"

#include <stdio.h>
#include <string.h>

static const struct {
    const char *gguf, *hf;
} global_names[] = {
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
};

/* Per-layer names, after "blk.N." and "model.layers.N." respectively. */
static const struct {
    const char *gguf, *hf;
} layer_names[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
};

#define N(a) (sizeof(a) / sizeof((a)[0]))

/* Maps between the two naming schemes; to_hf picks the direction. */
static bool map_name(const char *in, char *out, size_t out_len, bool to_hf)
{
    for (size_t i = 0; i < N(global_names); i++) {
        const char *from = to_hf ? global_names[i].gguf : global_names[i].hf;
        const char *to = to_hf ? global_names[i].hf : global_names[i].gguf;
        if (strcmp(in, from) == 0)
            return (size_t)snprintf(out, out_len, "%s", to) < out_len;
    }
    const char *prefix_in = to_hf ? "blk." : "model.layers.";
    const char *prefix_out = to_hf ? "model.layers." : "blk.";
    size_t plen = strlen(prefix_in);
    if (strncmp(in, prefix_in, plen) != 0)
        return false;
    const char *p = in + plen;
    unsigned layer = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9' && digits < 6) {
        layer = layer * 10 + (unsigned)(*p++ - '0');
        digits++;
    }
    if (digits == 0 || *p != '.' || (digits > 1 && in[plen] == '0'))
        return false;
    p++;
    for (size_t i = 0; i < N(layer_names); i++) {
        const char *from = to_hf ? layer_names[i].gguf : layer_names[i].hf;
        const char *to = to_hf ? layer_names[i].hf : layer_names[i].gguf;
        if (strcmp(p, from) == 0)
            return (size_t)snprintf(out, out_len, "%s%u.%s", prefix_out, layer, to) < out_len;
    }
    return false;
}

bool cllm_qwen2_hf_name(const char *gguf_name, char *out, size_t out_len)
{
    return map_name(gguf_name, out, out_len, true);
}

bool cllm_qwen2_gguf_name(const char *hf_name, char *out, size_t out_len)
{
    return map_name(hf_name, out, out_len, false);
}
