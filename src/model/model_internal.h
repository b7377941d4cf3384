/*
 * Inside the model (not its interface, which is model.h): the state model_load.c builds --
 * weights on the backend, activation buffers, the recorded steps' bookkeeping -- and model.c's
 * forward pass and draws run on.
 */
#ifndef CLLM_MODEL_MODEL_INTERNAL_H
#define CLLM_MODEL_MODEL_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/backoff.h"
#include "model/hparams.h"
#include "model/model.h"

/* A projection: one stacked weight when the backend can stack, else its parts. */
struct proj {
    struct cllm_weight stacked;  /* used when stacked.host != NULL */
    struct cllm_weight parts[3]; /* otherwise: parts[0..n) into consecutive column ranges */
    int n_parts;
};

struct layer {
    struct cllm_weight attn_norm, ffn_norm, b_qkv, wo, w_down;
    struct proj qkv, gate_up;
};

struct cllm_model {
    struct cllm_hparams hp;
    struct cllm_backend *be;
    size_t act_size; /* bytes of one act_dtype element */
    struct cllm_weight tok_embd, output_norm, output;
    bool tied; /* output is tok_embd: do not free it twice */
    struct layer *layers;
    int32_t max_tokens, max_outputs;
    /* activations (device), sized for max_tokens rows; F32 unless noted */
    float *x, *x_alt, *qkv, *gate_up, *ffo; /* x_alt: see issue_ops */
    void *xn, *attn, *ff;                   /* act_dtype */
    float *out_x, *out_ffo;                 /* [max_outputs][n_embd] */
    void *out_n;                            /* act_dtype */
    float *logits_dev;                      /* [max_outputs][n_vocab] */
    void *attn_scratch;                     /* the backend's attention workspace, or NULL */
    float *logits_host;
    struct cllm_sample_row *rows; /* [max_outputs] what the device sampler is given */
    /* steps queued by cllm_model_launch_sample, oldest first: flights[(head + i) % 2] */
    struct flight {
        int32_t n_outputs;
        bool caller_rows; /* some rows are the caller's: their logits are downloaded */
        int32_t *tokens;  /* the caller's array the wait fills */
        int32_t *drawn;   /* [max_outputs] tokens drawn on the host (backends without sample) */
    } flights[2];
    int32_t n_flights, flight_head;
    int32_t *resolved; /* [max_tokens] a step's tokens with the references filled in (host) */
    /* step index arrays: device copy and the host staging of padded steps */
    int32_t *step_i32;
    size_t step_i32_cap;
    uint64_t step_i32_gen; /* bumped when step_i32 moves: old recordings are stale */
    int32_t *step_host;    /* host staging of step_i32's contents */
    size_t step_host_cap;
    int32_t *pad_i32;
    size_t pad_i32_cap;
    bool graphs_off; /* CLLM_NO_GRAPHS, or a recording failed for want of anything but memory */
    /* a recording that found no room: steps still to run op by op, and how many the next
     * such failure gives */
    int64_t unrecorded_left;
    struct cllm_backoff unrecorded_wait;
    bool norms_apart; /* CLLM_NORMS_APART: never a norm in a projection (struct cllm_norm_in) */
};

#endif
