/*
 * Fuzz target: a request's JSON body and the sampler it configures. An input is the body,
 * optionally followed by the line "@@@@" and raw bytes read as logits (any float bit
 * pattern: NaN, infinities, denormals, ties) with the prompt's token ids. The body goes
 * through cJSON and cllm_job_params_parse (what /predict and the OpenAI routes do with every request);
 * settings it accepts must pass cllm_sampling_params_check and drive a sampler without harm:
 * the distribution sums to 1 and every drawn token is in the vocabulary with a non-zero
 * probability in it.
 */
#include "fuzz.h"

#include <math.h>
#include <string.h>

#include "sampling/sampling.h"
#include "server/job.h"

const int fuzz_full_stage = 1;

static const char separator[] = "\n@@@@\n";
#define MAX_VOCAB 300

static void sample_with(const struct cllm_sampling_params *sp, const uint8_t *tail, size_t n)
{
    /* vocabulary: the tail's floats (at least 1), then the prompt ids from what is left */
    int32_t n_vocab = (int32_t)(n / 4 < MAX_VOCAB ? n / 4 : MAX_VOCAB);
    float logits[MAX_VOCAB], work[MAX_VOCAB];
    double probs[MAX_VOCAB];
    if (n_vocab == 0) {
        n_vocab = 16;
        for (int32_t i = 0; i < n_vocab; i++)
            logits[i] = (float)(i % 5);
    } else {
        memcpy(logits, tail, (size_t)n_vocab * 4);
    }
    int32_t prompt[64];
    size_t n_prompt = 0;
    for (size_t i = (size_t)n_vocab * 4; i < n && n_prompt < 64; i++)
        prompt[n_prompt++] = (int32_t)tail[i] - 8; /* some outside the vocabulary */

    struct cllm_sampler *s = NULL;
    FUZZ_ASSERT(cllm_sampler_new(&s, sp, n_vocab, prompt, n_prompt) == CLLM_OK,
                "accepted settings, refused by the sampler");
    for (int draw = 0; draw < 3; draw++) {
        memcpy(work, logits, sizeof(float) * (size_t)n_vocab);
        FUZZ_ASSERT(cllm_sampler_probs(s, work, probs) == CLLM_OK, "probs failed");
        double sum = 0;
        for (int32_t i = 0; i < n_vocab; i++) {
            FUZZ_ASSERT(probs[i] >= 0 && probs[i] <= 1, "p[%d] = %g", i, probs[i]);
            sum += probs[i];
        }
        FUZZ_ASSERT(fabs(sum - 1) < 1e-6, "probabilities sum to %.9g", sum);
        memcpy(work, logits, sizeof(float) * (size_t)n_vocab);
        const int32_t t = cllm_sampler_sample(s, work);
        FUZZ_ASSERT(t >= 0 && t < n_vocab, "token %d of %d", t, n_vocab);
        FUZZ_ASSERT(probs[t] > 0, "token %d drawn with probability 0", t);
    }
    cllm_sampler_free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *sep = memmem(data, size, separator, sizeof separator - 1);
    const size_t body_len = sep ? (size_t)(sep - data) : size;
    cJSON *body = cJSON_ParseWithLength((const char *)data, body_len);
    if (!body)
        return 0;
    struct cllm_request_params defaults;
    memset(&defaults, 0, sizeof defaults);
    cllm_sampling_params_default(&defaults.sampling);
    /* Qwen2.5-Instruct's generation_config */
    defaults.sampling.temperature = 0.7f;
    defaults.sampling.top_k = 20;
    defaults.sampling.top_p = 0.8f;
    defaults.sampling.repetition_penalty = 1.1f;
    defaults.max_tokens = 512;

    struct cllm_job_params jp;
    char err[256];
    err[0] = 0;
    const enum cllm_status st = cllm_job_params_parse(body, &defaults, &jp, err, sizeof err);
    if (fuzz_accepted(st, err, true, "the request fields")) {
        FUZZ_ASSERT(cllm_sampling_params_check(&jp.p.sampling, err, sizeof err) == CLLM_OK,
                    "accepted, but the sampler's check says: %s", err);
        FUZZ_ASSERT(jp.p.max_tokens >= 1, "max_tokens %d", jp.p.max_tokens);
        for (size_t i = 0; i < jp.p.n_stop; i++)
            FUZZ_ASSERT(jp.p.stop[i] && jp.p.stop[i][0], "stop string %zu is empty", i);
        const size_t skip = sep ? body_len + sizeof separator - 1 : size;
        sample_with(&jp.p.sampling, data + skip, size - skip);
    }
    cJSON_Delete(body);
    return 0;
}
