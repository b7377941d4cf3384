/*
 * `cllm tokenize --model PATH [--ids | --decode] [--bench N]`: stdin, read whole and exactly
 * as given (no trailing newline stripped), becomes token ids printed space-separated; with
 * --decode, ids on stdin become the raw text bytes. --bench N encodes the input N times and
 * reports throughput on stderr.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "core/buf.h"

static int encode(const struct cllm_model_files *mf, const struct cllm_buf *in, long bench)
{
    struct cllm_ids ids = {0};
    if (cllm_tokenize(mf->tok, in->data ? in->data : "", in->len, &ids) != CLLM_OK) {
        fprintf(stderr, "cllm: tokenize: out of memory\n");
        return 1;
    }
    if (bench > 0) {
        double t0 = cllm_cmd_now();
        for (long i = 0; i < bench; i++) {
            ids.n = 0;
            cllm_tokenize(mf->tok, in->data ? in->data : "", in->len, &ids);
        }
        double dt = cllm_cmd_now() - t0;
        fprintf(stderr, "tokenize: %zu bytes -> %zu tokens, %ld runs in %.3f s: %.2f MB/s, %.0f tokens/s\n",
                in->len, ids.n, bench, dt, (double)in->len * (double)bench / dt / 1e6,
                (double)ids.n * (double)bench / dt);
    }
    struct cllm_buf out = {0};
    for (size_t i = 0; i < ids.n; i++)
        cllm_buf_appendf(&out, i ? " %d" : "%d", (int)ids.v[i]);
    cllm_buf_append_byte(&out, '\n');
    fwrite(out.data, 1, out.len, stdout);
    cllm_buf_free(&out);
    cllm_ids_free(&ids);
    return 0;
}

static int decode(const struct cllm_model_files *mf, const struct cllm_buf *in)
{
    struct cllm_ids ids = {0};
    const char *p = in->data ? in->data : "";
    int rc = 0;
    for (;;) {
        while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r' || *p == ',')
            p++;
        if (!*p)
            break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v >= cllm_tokenizer_n_vocab(mf->tok)) {
            fprintf(stderr, "cllm: --decode: \"%.20s\" is not a token id (0..%d)\n", p,
                    (int)cllm_tokenizer_n_vocab(mf->tok) - 1);
            rc = 1;
            goto free_ids;
        }
        cllm_ids_push(&ids, (int32_t)v);
        p = end;
    }
    struct cllm_buf out = {0};
    cllm_detokenize(mf->tok, ids.v, ids.n, false, &out);
    fwrite(out.data ? out.data : "", 1, out.len, stdout);
    cllm_buf_free(&out);
free_ids:
    cllm_ids_free(&ids);
    return rc;
}

int cllm_cmd_tokenize(int argc, char **argv)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"ids", no_argument, 0, 'i'},
                                         {"decode", no_argument, 0, 'd'},
                                         {"bench", required_argument, 0, 'b'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model = NULL;
    bool do_decode = false;
    long bench = 0;
    int c;
    while ((c = getopt_long(argc, argv, "m:idb:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'i': break; /* ids are the default output */
        case 'd': do_decode = true; break;
        case 'b': bench = strtol(optarg, NULL, 10); break;
        default:
            fprintf(c == 'h' ? stdout : stderr,
                    "usage: cllm tokenize --model PATH [--ids | --decode] [--bench N] < input\n");
            return c == 'h' ? 0 : 2;
        }
    }
    struct cllm_model_files *mf = cllm_cmd_open_model(model);
    if (!mf)
        return 1;
    struct cllm_buf in = {0};
    int rc;
    if (cllm_cmd_read_all(stdin, &in) != CLLM_OK) {
        fprintf(stderr, "cllm: tokenize: cannot read stdin\n");
        rc = 1;
    } else {
        rc = do_decode ? decode(mf, &in) : encode(mf, &in, bench);
    }
    cllm_buf_free(&in);
    cllm_model_files_free(mf);
    return rc;
}
