/*
 * Per-request sampling: parameters, their validation, and a sampler that turns one row of
 * logits into the next token. The processors and their order follow transformers' generate()
 * (repetition penalty, temperature, top-k, top-p, min-p), with OpenAI's presence/frequency
 * penalties applied right after the repetition penalty (as vLLM does). Temperature 0 means
 * greedy: argmax after the penalties, lowest index winning ties.
 */
#ifndef CLLM_SAMPLING_SAMPLING_H
#define CLLM_SAMPLING_SAMPLING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cllm.h"
#include "core/token_count.h"

struct cllm_sampling_params {
    float temperature;        /* 0 = greedy (argmax); otherwise > 0, logits are divided by it */
    int32_t top_k;            /* 0 = off; keeps every token >= the k-th largest (ties kept) */
    float top_p;              /* 1 = off; (0, 1]: smallest top set whose mass reaches top_p */
    float min_p;              /* 0 = off; [0, 1]: drops tokens with p < min_p * p_max */
    float repetition_penalty; /* 1 = off; > 0: logit > 0 ? logit / r : logit * r for every
                                 distinct token of prompt + generated (transformers) */
    float presence_penalty;   /* [-2, 2]: logit -= presence if generated at least once (OpenAI) */
    float frequency_penalty;  /* [-2, 2]: logit -= frequency * times generated (OpenAI) */
    uint64_t seed;            /* same seed + same logits => same token sequence */
};

/* The penalties, in place on logits[n_vocab], exactly as the sampler applies them (a GPU
 * sampler repeats this arithmetic): for each entry of seen[n] (distinct tokens; those outside
 * [0, n_vocab) skipped), l = l < 0 ? l * rep : l / rep (rep != 1), then if its count > 0,
 * l -= freq * count and l -= pres, each step rounded to float. extra >= 0 is one more
 * generated token, not in seen yet (its count goes up by one; a token not listed counts 1). */
void cllm_penalize(float *logits, int32_t n_vocab, const struct cllm_token_count *seen, size_t n,
                   int32_t extra, float rep, float pres, float freq);

/* Whether some penalty is on (repetition != 1, presence or frequency != 0): then the sampler
 * keeps the tokens it has seen, and a device drawing for it needs them. */
bool cllm_sampling_penalized(const struct cllm_sampling_params *p);

/* Greedy with every processor off and seed 0. */
void cllm_sampling_params_default(struct cllm_sampling_params *p);

/* CLLM_OK, or CLLM_ERR_RANGE with err naming the field and its allowed range, e.g.
 * "top_p must be in (0, 1], got 1.5". NaN and infinities are rejected everywhere. */
enum cllm_status cllm_sampling_params_check(const struct cllm_sampling_params *p, char *err,
                                            size_t err_len);

/* One request's sampler: its params, RNG state and the distinct tokens seen so far (a sparse
 * table, never O(vocab)). Not thread-safe; one thread samples a request at a time. */
struct cllm_sampler;

/* Checks p (CLLM_ERR_RANGE on a bad value, CLLM_ERR_INVALID_ARG on n_vocab <= 0) and records
 * the prompt's distinct tokens for the repetition penalty. Prompt ids outside [0, n_vocab) are
 * ignored, as transformers ignores ids beyond the logits. prompt is only read during the call. */
enum cllm_status cllm_sampler_new(struct cllm_sampler **out, const struct cllm_sampling_params *p,
                                  int32_t n_vocab, const int32_t *prompt, size_t n_prompt);
void cllm_sampler_free(struct cllm_sampler *s);

/* The sampler's seen tokens (what cllm_penalize takes), in first-seen order, valid until it
 * records another token; *n = 0 when no penalty is on. */
const struct cllm_token_count *cllm_sampler_seen(const struct cllm_sampler *s, size_t *n);

/* Picks the next token from logits[n_vocab] (overwritten: used as scratch) and records it as
 * generated. NaN logits count as -inf; logits with no finite maximum fall back to greedy.
 * Returns the token, or -1 when memory ran out (nothing is recorded then). */
int32_t cllm_sampler_sample(struct cllm_sampler *s, float *logits);

/* Records a token as generated without sampling (e.g. a forced token): it then counts for the
 * penalties. CLLM_ERR_RANGE for a token outside [0, n_vocab), CLLM_ERR_NOMEM if the table
 * could not grow. */
enum cllm_status cllm_sampler_accept(struct cllm_sampler *s, int32_t token);

/* Index of the largest of n logits, the lowest index on ties (greedy's choice); NaNs never
 * win (0 if all are NaN). */
int32_t cllm_argmax(const float *l, int32_t n);

/* The k-th largest of l[0..n) (0 < k < n), with heap[k] as scratch. */
float cllm_kth_largest(float *heap, int32_t k, const float *l, int32_t n);

/* The distribution sample() draws from, for tests and debugging: probs[n_vocab] gets each
 * token's final probability (0 for removed ones; 1 on the argmax when greedy). logits are
 * overwritten as in sample(); nothing is recorded and the RNG does not advance. */
enum cllm_status cllm_sampler_probs(struct cllm_sampler *s, float *logits, double *probs);

#endif
