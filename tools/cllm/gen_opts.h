/*
 * Command-line generation options shared by generate, bench and serve: sampling flags, limits
 * and engine sizing, and how they combine with the model's generation_config defaults.
 */
#ifndef CLLM_TOOLS_GEN_OPTS_H
#define CLLM_TOOLS_GEN_OPTS_H

#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>

#include "engine/engine.h"
#include "model/model_files.h"

#define CLLM_MAX_CLI_STOPS 16

/* Option codes (>= 1000 so they never clash with short options). */
enum {
    OPT_MAX_TOKENS = 1000, OPT_TEMPERATURE, OPT_TOP_K, OPT_TOP_P, OPT_MIN_P, OPT_REP_PENALTY,
    OPT_PRESENCE, OPT_FREQUENCY, OPT_SEED, OPT_STOP, OPT_THREADS, OPT_CTX, OPT_KV_MEM,
    OPT_BATCH_TOKENS, OPT_MAX_SEQS, OPT_NO_PREFIX_CACHE, OPT_DEVICE, OPT_GPU_MEM_FRACTION,
    OPT_NO_DEVICE_CHECK, OPT_CPU_WEIGHTS, OPT_MAX_TIME,
};

#define CLLM_GEN_LONG_OPTIONS                                                                      \
    {"max-tokens", required_argument, 0, OPT_MAX_TOKENS},                                          \
        {"max-time", required_argument, 0, OPT_MAX_TIME},                                          \
        {"temperature", required_argument, 0, OPT_TEMPERATURE},                                    \
        {"top-k", required_argument, 0, OPT_TOP_K}, {"top-p", required_argument, 0, OPT_TOP_P},    \
        {"min-p", required_argument, 0, OPT_MIN_P},                                                \
        {"repetition-penalty", required_argument, 0, OPT_REP_PENALTY},                             \
        {"presence-penalty", required_argument, 0, OPT_PRESENCE},                                  \
        {"frequency-penalty", required_argument, 0, OPT_FREQUENCY},                                \
        {"seed", required_argument, 0, OPT_SEED}, {"stop", required_argument, 0, OPT_STOP},        \
        {"threads", required_argument, 0, OPT_THREADS}, {"ctx", required_argument, 0, OPT_CTX},    \
        {"kv-mem", required_argument, 0, OPT_KV_MEM},                                              \
        {"batch-tokens", required_argument, 0, OPT_BATCH_TOKENS},                                  \
        {"max-seqs", required_argument, 0, OPT_MAX_SEQS},                                          \
        {"no-prefix-cache", no_argument, 0, OPT_NO_PREFIX_CACHE},                                  \
        {"device", required_argument, 0, OPT_DEVICE},                                              \
        {"gpu-mem-fraction", required_argument, 0, OPT_GPU_MEM_FRACTION},                          \
        {"no-device-check", no_argument, 0, OPT_NO_DEVICE_CHECK},                                  \
        {"cpu-weights", required_argument, 0, OPT_CPU_WEIGHTS}

#define CLLM_GEN_USAGE                                                                             \
    "  --max-tokens N          tokens to generate at most\n"                                       \
    "  --max-time S            a request still waiting or generating S seconds after it came\n"    \
    "                          ends with the text so far (finish reason length; default: no\n"     \
    "                          limit; requests may set max_time)\n"                                \
    "  --temperature T         0 = greedy (default: the model's generation_config)\n"              \
    "  --top-k K  --top-p P  --min-p P  --repetition-penalty R\n"                                  \
    "  --presence-penalty P  --frequency-penalty P  --seed S\n"                                    \
    "  --stop TEXT             stop string (repeatable)\n"                                         \
    "  --threads N             CPU threads (default: the physical cores this process may\n"        \
    "                          use: its CPU affinity, at most its container's CPU quota)\n"        \
    "  --ctx N                 context window in tokens (default: the model's)\n"                  \
    "  --kv-mem BYTES          KV cache budget, e.g. 2G or 512M\n"                                 \
    "  --batch-tokens N  --max-seqs N  --no-prefix-cache\n"                                        \
    "  --device auto|cpu|cuda|cuda:N   where the model runs (default auto: the GPU if there\n"     \
    "                          is one, else the CPU; musa = cuda in a MUSA build)\n"               \
    "  --gpu-mem-fraction F    share of GPU memory cllm may use in all (default 0.9): the KV\n"    \
    "                          cache gets what the weights leave of it\n"                          \
    "  --no-device-check       skip comparing the GPU's logits with the CPU's at start (a GPU\n"   \
    "                          that fails it: auto runs on the CPU, cuda stops with an error)\n"   \
    "  --cpu-weights stored|q6_k   float weights on the CPU (also after a GPU fails): as the\n"    \
    "                          files store them (default), or quantized to Q6_K at load:\n"        \
    "                          1.3-1.6x faster batches where BF16 weights take F32\n"              \
    "                          activations (all CPUs but AMD's with AVX-512 BF16, whose BF16\n"    \
    "                          kernels are as fast), ~2%% error per weight\n"

/* What the flags said; "set" bits record which sampling values were given explicitly. */
struct cllm_gen_opts {
    int32_t max_tokens;
    double max_time; /* 0: none */
    float temperature, top_p, min_p, rep_penalty, presence, frequency;
    int32_t top_k;
    uint64_t seed;
    bool set_temperature, set_top_p, set_min_p, set_rep, set_top_k, set_max_tokens;
    const char *stops[CLLM_MAX_CLI_STOPS];
    int n_stops;
    struct cllm_engine_config engine;
};

void cllm_gen_opts_init(struct cllm_gen_opts *g);
/* Handles one getopt code; returns 1 if handled, 0 if not one of ours, -1 on a bad value
 * (message printed). */
int cllm_gen_opts_parse(struct cllm_gen_opts *g, int code, const char *arg);
/* Request parameters: the model's generation_config, overridden by explicit flags. Stop ids
 * are the model's EOS ids. */
void cllm_gen_opts_params(const struct cllm_gen_opts *g, const struct cllm_model_files *mf,
                          struct cllm_request_params *p);

#endif
