/* Parsing and defaulting of the generation flags shared by several subcommands. */
#include "gen_opts.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void cllm_gen_opts_init(struct cllm_gen_opts *g)
{
    memset(g, 0, sizeof *g);
    g->max_tokens = 512;
    cllm_engine_config_default(&g->engine);
}

static bool parse_long(const char *s, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static bool parse_float(const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v))
        return false;
    *out = v;
    return true;
}

/* "2G", "512M", "100000" -> bytes. */
static bool parse_bytes(const char *s, long long *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v <= 0)
        return false;
    double mul = 1;
    if (*end == 'K' || *end == 'k')
        mul = 1024.0, end++;
    else if (*end == 'M' || *end == 'm')
        mul = 1024.0 * 1024, end++;
    else if (*end == 'G' || *end == 'g')
        mul = 1024.0 * 1024 * 1024, end++;
    if (*end == 'B' || *end == 'b')
        end++;
    if (*end || v * mul > 9e18)
        return false;
    *out = (long long)(v * mul);
    return true;
}

int cllm_gen_opts_parse(struct cllm_gen_opts *g, int code, const char *arg)
{
    long long v = 0;
    bool ok = true;
    switch (code) {
    case OPT_MAX_TOKENS:
        ok = parse_long(arg, 1, 1 << 24, &v);
        g->max_tokens = (int32_t)v;
        g->set_max_tokens = true;
        break;
    case OPT_MAX_TIME: {
        float t = 0.0f;
        ok = parse_float(arg, &t) && t > 0.0f && t <= 1e9f;
        g->max_time = t;
        break;
    }
    case OPT_TEMPERATURE: ok = parse_float(arg, &g->temperature), g->set_temperature = true; break;
    case OPT_TOP_P: ok = parse_float(arg, &g->top_p), g->set_top_p = true; break;
    case OPT_MIN_P: ok = parse_float(arg, &g->min_p), g->set_min_p = true; break;
    case OPT_REP_PENALTY: ok = parse_float(arg, &g->rep_penalty), g->set_rep = true; break;
    case OPT_PRESENCE: ok = parse_float(arg, &g->presence); break;
    case OPT_FREQUENCY: ok = parse_float(arg, &g->frequency); break;
    case OPT_TOP_K:
        ok = parse_long(arg, 0, 1 << 30, &v);
        g->top_k = (int32_t)v;
        g->set_top_k = true;
        break;
    case OPT_SEED:
        ok = parse_long(arg, 0, INT64_MAX, &v);
        g->seed = (uint64_t)v;
        break;
    case OPT_STOP:
        if (g->n_stops == CLLM_MAX_CLI_STOPS) {
            fprintf(stderr, "cllm: at most %d --stop strings\n", CLLM_MAX_CLI_STOPS);
            return -1;
        }
        g->stops[g->n_stops++] = arg;
        break;
    case OPT_THREADS:
        ok = parse_long(arg, 1, 256, &v);
        g->engine.n_threads = (int32_t)v;
        break;
    case OPT_CTX:
        ok = parse_long(arg, 2, 1 << 24, &v);
        g->engine.n_ctx = (int32_t)v;
        break;
    case OPT_KV_MEM:
        ok = parse_bytes(arg, &v);
        g->engine.kv_bytes = v;
        break;
    case OPT_BATCH_TOKENS:
        ok = parse_long(arg, 1, 1 << 16, &v);
        g->engine.max_batch_tokens = (int32_t)v;
        break;
    case OPT_MAX_SEQS:
        ok = parse_long(arg, 1, 4096, &v);
        g->engine.max_seqs = (int32_t)v;
        break;
    case OPT_NO_PREFIX_CACHE: g->engine.prefix_cache = false; break;
    case OPT_NO_DEVICE_CHECK: g->engine.no_device_check = true; break;
    case OPT_DEVICE:
        /* "musa" names the same backend built with the MUSA SDK */
        if (strcmp(arg, "auto") == 0) {
            g->engine.backend = CLLM_BACKEND_AUTO;
        } else if (strcmp(arg, "cpu") == 0) {
            g->engine.backend = CLLM_BACKEND_CPU;
        } else if (strcmp(arg, "cuda") == 0 || strcmp(arg, "musa") == 0) {
            g->engine.backend = CLLM_BACKEND_CUDA;
        } else if ((strncmp(arg, "cuda:", 5) == 0 || strncmp(arg, "musa:", 5) == 0) &&
                   parse_long(arg + 5, 0, 1023, &v)) {
            g->engine.backend = CLLM_BACKEND_CUDA;
            g->engine.device = (int32_t)v;
        } else {
            ok = false;
        }
        break;
    case OPT_CPU_WEIGHTS:
        if (strcmp(arg, "stored") == 0)
            g->engine.cpu_weights = CLLM_CPU_WEIGHTS_STORED;
        else if (strcmp(arg, "q6_k") == 0)
            g->engine.cpu_weights = CLLM_CPU_WEIGHTS_Q6_K;
        else
            ok = false;
        break;
    case OPT_GPU_MEM_FRACTION: {
        float f = 0.0f;
        ok = parse_float(arg, &f) && f > 0.0f && f <= 1.0f;
        g->engine.gpu_mem_fraction = f;
        break;
    }
    default: return 0;
    }
    if (!ok) {
        fprintf(stderr, "cllm: invalid value '%s' for an option\n", arg);
        return -1;
    }
    return 1;
}

void cllm_gen_opts_params(const struct cllm_gen_opts *g, const struct cllm_model_files *mf,
                          struct cllm_request_params *p)
{
    memset(p, 0, sizeof *p);
    struct cllm_sampling_params *s = &p->sampling;
    cllm_sampling_params_default(s);
    const struct cllm_gen_defaults *d = &mf->gen;
    /* As transformers' generate(): sampling settings apply only when do_sample is set. */
    if (d->do_sample) {
        s->temperature = d->temperature;
        s->top_p = d->top_p;
        s->top_k = d->top_k;
    }
    s->repetition_penalty = d->repetition_penalty;
    if (g->set_temperature)
        s->temperature = g->temperature;
    if (g->set_top_p)
        s->top_p = g->top_p;
    if (g->set_top_k)
        s->top_k = g->top_k;
    if (g->set_min_p)
        s->min_p = g->min_p;
    if (g->set_rep)
        s->repetition_penalty = g->rep_penalty;
    s->presence_penalty = g->presence;
    s->frequency_penalty = g->frequency;
    s->seed = g->seed;
    p->max_tokens = g->set_max_tokens || !d->max_new_tokens ? g->max_tokens : d->max_new_tokens;
    for (int i = 0; i < d->n_eos && i < CLLM_MAX_STOP_IDS; i++)
        p->stop_ids[p->n_stop_ids++] = d->eos_ids[i];
    p->stop = g->stops;
    p->n_stop = (size_t)g->n_stops;
    p->max_time = g->max_time;
}
