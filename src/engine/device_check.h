/*
 * Before a GPU serves: its logits for fixed token sequences against the CPU backend's.
 *
 * A GPU backend is only as right as the vendor stack under it. A build for a platform this
 * project cannot test (MUSA) may compile and start and still compute garbage (a warp that is
 * wider than the kernels assume, a BLAS that is wrong for some shapes); a user would get
 * well-formed nonsense for every answer. So the engine runs short sequences through both the
 * device's model and a CPU model of the same files (which borrows the mapped weights, so it
 * costs a forward pass, not a second copy) and compares every output row: two sequences'
 * prompts in one step of 64 tokens (the GEMMs' tiled path, prefill attention over up to three
 * KV blocks each), then two decode steps of both (the skinny GEMMs, the fused epilogues,
 * decode attention), then draws from the last step's logits with the device's sampler (twelve
 * draws: greedy, top-k, penalized greedy, top-p alone, min-p alone, Qwen2.5's sampling
 * defaults), then
 * runs the attention op alone at contexts of up to 4,200 keys (cllm_attention_compare).
 *
 * The bound: a row agrees when no logit differs from the CPU's by more than
 * CLLM_DEVICE_CHECK_BOUND of the row's range (max - min of the CPU's row) and every logit is
 * finite. A right device differs by BF16 rounding of weights and activations (and, for a
 * quantized GGUF, by the CPU's 8-bit activations): about 1% of the range (docs/measured.md);
 * a wrong op, head, position or lane moves logits by tens of percent. A draw is right when its
 * row's processors allow it on the device's own logits (cllm_draw_allowed: a greedy token is
 * the penalized argmax, a top-k token among the k best, ...), within 1% of the row's range (the
 * draw's step computes its logits once more, and a vendor BLAS need not repeat its bits).
 */
#ifndef CLLM_ENGINE_DEVICE_CHECK_H
#define CLLM_ENGINE_DEVICE_CHECK_H

#include <stdbool.h>
#include <stdint.h>

#include "model/model.h"
#include "model/model_files.h"

#define CLLM_DEVICE_CHECK_BOUND 0.1f

/* How two models' logits compare over the check sequences (b is the reference). */
struct cllm_agreement {
    int32_t rows;      /* logit rows compared */
    int32_t top1_same; /* rows whose argmax (lowest index on ties) is the same */
    float worst;       /* max over rows of max_i |a_i - b_i| / (max b - min b); +inf for a
                          non-finite logit of a, or a row of b with no range */
    int32_t worst_row; /* the row where it is */
    int32_t draws;     /* tokens a drew from its last step's logits (its sampler) ... */
    int32_t bad_draws; /* ... of which outside what the row allows (cllm_draw_allowed,
                          within 1% of the row's range) */
    const char *first_bad_kind; /* the kind of draw of the first bad one (NULL: none) */
};

/* Error in a's row against the reference row b of n logits, as a share of b's range: +inf if
 * a holds a NaN or infinity, or b's range is zero while a differs. */
float cllm_logit_row_error(const float *a, const float *b, int32_t n);

/* Runs the check sequences through a and b (each with a small KV cache of its own, allocated
 * and freed here) and compares their output rows; then draws tokens from a's last step with
 * a's own sampler (the device's, where it has one), twelve draws of six kinds (check_draws). When
 * both models take steps of 64 tokens and max_seqs (their max outputs) is at least 2, two
 * sequences share every step (rows: 2 for the prefill, 2 per decode step); else one sequence
 * runs alone, its prefill cut into steps the models take (rows: 1 per step). An error of a's
 * forward comes back as it is with *a_failed set (a device failure); any other error leaves
 * it clear. */
enum cllm_status cllm_models_compare(struct cllm_model *a, struct cllm_model *b, int32_t max_seqs,
                                     struct cllm_agreement *r, bool *a_failed, char *err,
                                     size_t err_len);

/* Whether token t is a draw that row k may give from logits want[n_vocab] before its
 * penalties (which apply over seen[n_seen], generated tokens or not, as cllm_penalize has
 * them), with slack for logits computed once more (logits within slack of each other may
 * change places): greedy is the penalized row's argmax; top-k among its k best; top-p among
 * the tokens before which less than top_p of the mass (after temperature and top-k) lies;
 * min-p among those with at least min_p of the top token's probability (after temperature).
 * scratch holds 2 * n_vocab floats. */
bool cllm_draw_allowed(const float *want, int32_t n_vocab, const struct cllm_sample_row *k,
                       const struct cllm_token_count *seen, int32_t n_seen, int32_t t, float slack,
                       float *scratch);

/* How one backend's attention op agrees with a reference backend's (b) at long contexts. */
struct cllm_attn_agreement {
    int32_t rows;      /* (query token, head) rows compared, over both calls of a */
    float worst;       /* max over rows of max_i |a_i - b_i| / max_i |b_i|; +inf for a
                          non-finite output of a, or a zero row of b that a does not match */
    int32_t worst_len; /* the context length (keys) of the token where it is */
    int32_t longest;   /* the longest context compared */
};

/* The model check's sequences are short (up to 42 keys), and a GPU's attention takes another
 * path past 64 keys: each (token, head) is split over up to 16 blocks whose partial results
 * a second kernel merges through a scratch buffer the op must leave fit for its next call
 * (cuda/attention.cu). Served answers reach that path after ~30 tokens of text;
 * a vendor stack that breaks it (a memory order, a warp width) would pass the model check and
 * garble every long answer. So this runs a's and b's attention op, with the model's head
 * shapes and rope_theta, over the same random keys, values and queries in paged caches of
 * two sequences (4,200 and 300 keys, blocks shuffled): decode tokens at 4,200 keys (splits
 * not on tile bounds), 1,100 and 300, one at the first key, and a prefill chunk of 16 tokens
 * across a split boundary (256 keys); a's op twice, with the same scratch. A row agrees within
 * CLLM_DEVICE_CHECK_BOUND of the reference row's largest magnitude: BF16 keys, values, queries
 * and softmax weights move a right row by ~1% (the random data makes half the heads peaked,
 * half flat); a lost or repeated split moves it by tens of percent. Host memory: ~2 MB; on
 * each backend ~5 MB for the 1.5B (F32 caches on the CPU: ~10 MB). An error of an op of a
 * comes back with *a_failed set. */
enum cllm_status cllm_attention_compare(struct cllm_backend *a, struct cllm_backend *b,
                                        const struct cllm_hparams *hp,
                                        struct cllm_attn_agreement *r, bool *a_failed, char *err,
                                        size_t err_len);

/* The engine's check of dev, a model of mf on a GPU backend whose steps hold up to max_seqs
 * sequences, against a CPU model of mf with n_threads threads (0 = physical cores). CLLM_OK
 * when every row and draw agrees and so does dev's attention at long contexts (r filled,
 * logged); CLLM_ERR_DEVICE when one does not or
 * dev's forward fails (err says which and by how much); another status when the check itself
 * cannot run (the CPU model: out of memory). dev's own KV cache is not touched. */
enum cllm_status cllm_device_check(struct cllm_model *dev, const char *dev_name, int32_t max_seqs,
                                   const struct cllm_model_files *mf, int32_t n_threads,
                                   struct cllm_agreement *r, char *err, size_t err_len);

#endif
