/* `cllm info --model PATH`: what a model is, from its files alone. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

#include "cmd.h"

/* A short name for a chat template we recognise by its markers. */
static const char *template_kind(const char *t)
{
    if (!t)
        return "none";
    if (strstr(t, "<|im_start|>") && strstr(t, "<|im_end|>"))
        return "ChatML (Qwen2.5 style)";
    return "unrecognised";
}

static void print_tensors(const struct cllm_model_files *mf)
{
    uint64_t bytes[CLLM_DTYPE_COUNT] = {0}, count[CLLM_DTYPE_COUNT] = {0};
    uint64_t params = 0, total = 0;
    size_t n = cllm_model_files_n_tensors(mf);
    for (size_t i = 0; i < n; i++) {
        const struct cllm_tensor *t = cllm_model_files_tensor_at(mf, i);
        bytes[t->dtype] += t->nbytes;
        count[t->dtype]++;
        params += (uint64_t)cllm_tensor_nelements(t);
        total += t->nbytes;
    }
    printf("tensors:       %zu, %.3f B parameters, %.1f MiB\n", n, (double)params / 1e9,
           (double)total / (1 << 20));
    for (int d = 0; d < CLLM_DTYPE_COUNT; d++)
        if (count[d])
            printf("  %-6s       %4llu tensors, %9.1f MiB\n", cllm_dtype_name((enum cllm_dtype)d),
                   (unsigned long long)count[d], (double)bytes[d] / (1 << 20));
}

static void print_tokenizer(const struct cllm_model_files *mf)
{
    const struct cllm_tokenizer *tok = mf->tok;
    int32_t nv = cllm_tokenizer_n_vocab(tok);
    int specials = 0, added = 0;
    for (int32_t id = 0; id < nv; id++) {
        enum cllm_token_kind k = cllm_tokenizer_kind(tok, id);
        specials += k == CLLM_TOKEN_SPECIAL;
        added += k == CLLM_TOKEN_ADDED;
    }
    printf("tokenizer:     byte-level BPE (Qwen2 pre-tokenizer), %d tokens, %d merges, "
           "normalizer %s\n",
           (int)nv, (int)cllm_tokenizer_n_merges(tok),
           cllm_tokenizer_normalizer(tok) == CLLM_NORMALIZER_NFC ? "NFC" : "none");
    printf("  special:     %d special, %d other added tokens\n", specials, added);
    for (int i = 0; i < mf->gen.n_eos; i++) {
        size_t len = 0;
        const char *b = cllm_tokenizer_token_bytes(tok, mf->gen.eos_ids[i], &len);
        printf("  eos:         %d %.*s\n", (int)mf->gen.eos_ids[i], (int)(b ? len : 1),
               b ? b : "?");
    }
}

int cllm_cmd_info(int argc, char **argv)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model = NULL;
    int c;
    while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
        if (c == 'm') {
            model = optarg;
        } else {
            fprintf(c == 'h' ? stdout : stderr, "usage: cllm info --model PATH\n");
            return c == 'h' ? 0 : 2;
        }
    }
    double t0 = cllm_cmd_now();
    struct cllm_model_files *mf = cllm_cmd_open_model(model);
    if (!mf)
        return 1;
    double t1 = cllm_cmd_now();
    char err[512] = "";
    enum cllm_status complete = cllm_model_files_check_tensors(mf, err, sizeof err);

    const struct cllm_hparams *hp = &mf->hp;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("model:         %s\n", mf->path);
    printf("format:        %s\n", mf->format == CLLM_MODEL_FORMAT_GGUF ? "GGUF" : "HF folder");
    printf("opened in:     %.1f ms (peak RSS %.1f MiB)\n", (t1 - t0) * 1e3,
           (double)ru.ru_maxrss / 1024);
    printf("architecture:  %s\n", hp->arch);
    printf("  layers %d, hidden %d, ffn %d, heads %d (kv %d, dim %d), vocab %d\n", (int)hp->n_layer,
           (int)hp->n_embd, (int)hp->n_ff, (int)hp->n_head, (int)hp->n_head_kv,
           (int)hp->head_dim, (int)hp->n_vocab);
    printf("  context %d, rope theta %g, rms eps %g, tied embeddings %s\n", (int)hp->n_ctx_train,
           (double)hp->rope_theta, (double)hp->rms_eps, hp->tie_embeddings ? "yes" : "no");
    print_tensors(mf);
    printf("weights:       %s\n", complete == CLLM_OK ? "complete for the forward pass" : "INCOMPLETE");
    print_tokenizer(mf);
    printf("chat template: %s\n", template_kind(mf->chat_template));
    const struct cllm_gen_defaults *g = &mf->gen;
    printf("generation:    do_sample %s, temperature %g, top_p %g, top_k %d, repetition_penalty "
           "%g\n",
           g->do_sample ? "true" : "false", (double)g->temperature, (double)g->top_p,
           (int)g->top_k, (double)g->repetition_penalty);
    cllm_model_files_free(mf);
    if (complete != CLLM_OK) {
        fprintf(stderr, "cllm: %s\n", err);
        return 1;
    }
    return 0;
}
