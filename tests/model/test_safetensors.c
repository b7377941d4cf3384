/*
 * safetensors reader: valid single-file and sharded folders written here byte by byte (BF16,
 * F16, F32 with known values), every malformed header the reader must reject with the file and
 * the problem named, and every truncation / single-byte corruption of a valid file (no crash).
 */
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/f16.h"
#include "core/status.h"
#include "model/safetensors.h"
#include "test.h"

static char tmp[64];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void rm_tree(const char *dir)
{
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static void path_in(char *out, size_t n, const char *dir, const char *name)
{
    snprintf(out, n, "%s/%s", dir, name);
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
    fclose(f);
}

/* A safetensors file: le64 header length, the header space-padded to a multiple of 8 (as the
 * safetensors writer does), then data. Returns the file size. */
static size_t write_st(const char *path, const char *header, const void *data, size_t dlen)
{
    size_t hl = strlen(header), padded = (hl + 7) / 8 * 8;
    size_t total = 8 + padded + dlen;
    uint8_t *b = malloc(total);
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(b + 8, header, hl);
    memset(b + 8 + hl, ' ', padded - hl);
    if (dlen)
        memcpy(b + 8 + padded, data, dlen);
    write_bytes(path, b, total);
    free(b);
    return total;
}

/* Raw file with an explicit header length field (for lying lengths). */
static void write_raw(const char *path, uint64_t hlen, const char *header, size_t hbytes)
{
    uint8_t *b = malloc(8 + hbytes);
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(hlen >> (8 * i));
    memcpy(b + 8, header, hbytes);
    write_bytes(path, b, 8 + hbytes);
    free(b);
}

static char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc(*n + 1);
    if (fread(b, 1, *n, f) != *n)
        exit(1);
    fclose(f);
    return b;
}

/* The valid file's data area: a BF16 [2,3], F16 [4], F32 [2,1,3], F32 scalar, F32 [1,2,1,2]. */
struct valid_data {
    uint16_t a[6];
    uint16_t b[4];
    float c[6];
    float s[1];
    float d[4];
};

static const char *VALID_HEADER =
    "{\"__metadata__\": {\"format\": \"pt\"},"
    " \"a\": {\"dtype\": \"BF16\", \"shape\": [2, 3], \"data_offsets\": [0, 12]},"
    " \"b\": {\"dtype\": \"F16\", \"shape\": [4], \"data_offsets\": [12, 20]},"
    " \"c\": {\"dtype\": \"F32\", \"shape\": [2, 1, 3], \"data_offsets\": [20, 44]},"
    " \"s\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [44, 48]},"
    " \"d\": {\"dtype\": \"F32\", \"shape\": [1, 2, 1, 2], \"data_offsets\": [48, 64]}}";

static void fill_valid(struct valid_data *v)
{
    for (int i = 0; i < 6; i++)
        v->a[i] = cllm_f32_to_bf16((float)(i + 1));
    const float bv[4] = {0.5f, -1.0f, 2.0f, 65504.0f};
    for (int i = 0; i < 4; i++)
        v->b[i] = cllm_f32_to_f16(bv[i]);
    const float cv[6] = {1.5f, -2.25f, 3.0f, 4.0f, 5.0f, 6.125f};
    memcpy(v->c, cv, sizeof cv);
    v->s[0] = 42.0f;
    const float dv[4] = {-1.0f, 0.25f, 8.0f, 1e-3f};
    memcpy(v->d, dv, sizeof dv);
}

static float rd_f32(const void *p, size_t i)
{
    float f;
    memcpy(&f, (const char *)p + 4 * i, 4);
    return f;
}

static uint16_t rd_u16(const void *p, size_t i)
{
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    return h;
}

static void check_valid_set(const struct cllm_st_set *set, const char *path)
{
    CHECK(cllm_st_count(set) == 5);
    const struct cllm_tensor *a = cllm_st_find(set, "a");
    CHECK(a && a->dtype == CLLM_DTYPE_BF16 && a->n_dims == 2 && a->nbytes == 12);
    CHECK(a && a->ne[0] == 3 && a->ne[1] == 2 && a->ne[2] == 1 && a->ne[3] == 1);
    CHECK(a && strcmp(a->name, "a") == 0);
    /* row 1, column 2 of the [2][3] matrix */
    CHECK(a && cllm_bf16_to_f32(rd_u16(a->data, 1 * 3 + 2)) == 6.0f);
    CHECK(a && cllm_bf16_to_f32(rd_u16(a->data, 0)) == 1.0f);
    CHECK(a && cllm_tensor_nelements(a) == 6 && cllm_tensor_nrows(a) == 2);

    const struct cllm_tensor *b = cllm_st_find(set, "b");
    CHECK(b && b->dtype == CLLM_DTYPE_F16 && b->n_dims == 1 && b->ne[0] == 4 && b->ne[1] == 1);
    CHECK(b && cllm_f16_to_f32(rd_u16(b->data, 1)) == -1.0f);
    CHECK(b && cllm_f16_to_f32(rd_u16(b->data, 3)) == 65504.0f);

    const struct cllm_tensor *c = cllm_st_find(set, "c");
    CHECK(c && c->dtype == CLLM_DTYPE_F32 && c->n_dims == 3);
    CHECK(c && c->ne[0] == 3 && c->ne[1] == 1 && c->ne[2] == 2 && c->ne[3] == 1);
    CHECK(c && rd_f32(c->data, 1) == -2.25f && rd_f32(c->data, 5) == 6.125f);

    const struct cllm_tensor *s = cllm_st_find(set, "s");
    CHECK(s && s->n_dims == 1 && s->ne[0] == 1 && s->nbytes == 4 && rd_f32(s->data, 0) == 42.0f);

    const struct cllm_tensor *d = cllm_st_find(set, "d");
    CHECK(d && d->n_dims == 4 && d->ne[0] == 2 && d->ne[1] == 1 && d->ne[2] == 2 && d->ne[3] == 1);
    CHECK(d && rd_f32(d->data, 3) == 1e-3f);

    CHECK(cllm_st_find(set, "__metadata__") == NULL);
    CHECK(cllm_st_find(set, "zzz") == NULL);
    CHECK(cllm_st_tensor(set, 0) == a); /* file order */
    CHECK(cllm_st_tensor(set, 4) == d);
    CHECK(cllm_st_tensor(set, 5) == NULL);
    CHECK(strcmp(cllm_st_tensor_path(set, c), path) == 0);
    struct cllm_tensor other = {0};
    CHECK(strcmp(cllm_st_tensor_path(set, &other), "?") == 0);
}

static void test_valid_single(void)
{
    char dir[128], path[256], err[512] = "";
    snprintf(dir, sizeof dir, "%s/single", tmp);
    mkdir(dir, 0700);
    path_in(path, sizeof path, dir, "model.safetensors");
    struct valid_data v;
    fill_valid(&v);
    write_st(path, VALID_HEADER, &v, sizeof v);

    struct cllm_st_set *set = NULL;
    enum cllm_status st = cllm_st_open_file(&set, path, err, sizeof err);
    CHECKF(st == CLLM_OK && set, "%s", err);
    if (set)
        check_valid_set(set, path);
    cllm_st_free(set);

    set = NULL;
    st = cllm_st_open_dir(&set, dir, err, sizeof err);
    CHECKF(st == CLLM_OK && set, "%s", err);
    if (set)
        check_valid_set(set, path);
    cllm_st_free(set);

    /* A trailing '/' is not doubled in the paths we report. */
    char dir_slash[160];
    snprintf(dir_slash, sizeof dir_slash, "%s/", dir);
    set = NULL;
    st = cllm_st_open_dir(&set, dir_slash, err, sizeof err);
    CHECKF(st == CLLM_OK && set, "%s", err);
    if (set)
        CHECK(strcmp(cllm_st_tensor_path(set, cllm_st_find(set, "a")), path) == 0);
    cllm_st_free(set);

    /* model.safetensors wins over an index, as in transformers (a broken index is not read). */
    char idx[256];
    path_in(idx, sizeof idx, dir, "model.safetensors.index.json");
    write_bytes(idx, "garbage", 7);
    set = NULL;
    st = cllm_st_open_dir(&set, dir, err, sizeof err);
    CHECKF(st == CLLM_OK && cllm_st_count(set) == 5, "%s", err);
    cllm_st_free(set);
    cllm_st_free(NULL);
}

/* Opening dir/bad.safetensors written from header+data must fail with want and an error that
 * names the file and contains needle. */
static void expect_bad(const char *header, const void *data, size_t dlen, enum cllm_status want,
                       const char *needle, int line)
{
    char path[256], err[512] = "";
    snprintf(path, sizeof path, "%s/bad.safetensors", tmp);
    write_st(path, header, data, dlen);
    struct cllm_st_set *set = (struct cllm_st_set *)1;
    enum cllm_status st = cllm_st_open_file(&set, path, err, sizeof err);
    CHECKF(st == want && set == NULL, "line %d: status %s, want %s (%s)", line, cllm_status_str(st),
           cllm_status_str(want), err);
    CHECKF(strstr(err, path) && strstr(err, needle), "line %d: error '%s' lacks '%s'", line, err,
           needle);
}

#define BAD(hdr, n, want, needle) expect_bad(hdr, zeros, n, want, needle, __LINE__)

static void test_bad_headers(void)
{
    static uint8_t zeros[64];
    const enum cllm_status F = CLLM_ERR_FORMAT, U = CLLM_ERR_UNSUPPORTED;
    BAD("", 0, F, "not valid JSON");
    BAD("{\"a\": ", 0, F, "not valid JSON");
    BAD("[1, 2]", 0, F, "not a JSON object");
    BAD("{} x", 0, F, "bytes after the JSON object");
    BAD("{\"a\": 5}", 0, F, "tensor 'a': entry is not an object");
    BAD("{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4, F, "'a': \"dtype\" is missing");
    BAD("{\"a\": {\"dtype\": 4, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4, F,
        "\"dtype\" is missing or not a string");
    BAD("{\"w.q\": {\"dtype\": \"I64\", \"shape\": [1], \"data_offsets\": [0, 8]}}", 8, U,
        "tensor 'w.q': dtype I64 is not supported");
    BAD("{\"a\": {\"dtype\": \"F8_E4M3\", \"shape\": [1], \"data_offsets\": [0, 1]}}", 1, U,
        "dtype F8_E4M3");
    BAD("{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 4, F,
        "'a': \"shape\" is missing or not an array");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": 4, \"data_offsets\": [0, 4]}}", 4, F,
        "\"shape\" is missing or not an array");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4, F,
        "shape[0] is not a non-negative integer");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [2, 1.5], \"data_offsets\": [0, 12]}}", 12, F,
        "shape[1] is not a non-negative integer");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [\"2\"], \"data_offsets\": [0, 8]}}", 8, F,
        "shape[0] is not a non-negative integer");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [1e300], \"data_offsets\": [0, 8]}}", 8, F,
        "shape[0] is not a non-negative integer");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [2, 0], \"data_offsets\": [0, 0]}}", 0, U,
        "shape[1] is 0");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [1, 1, 1, 1, 1], \"data_offsets\": [0, 4]}}", 4, U,
        "5 dimensions");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296, 4294967296], "
        "\"data_offsets\": [0, 4]}}",
        4, F, "element count overflows");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [2147483648, 2147483648], "
        "\"data_offsets\": [0, 4]}}",
        4, F, "byte size overflows");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4, F, "\"data_offsets\" is not");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}", 8, F,
        "\"data_offsets\" is not");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}", 4, F,
        "\"data_offsets\" is not");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0.5, 4.5]}}", 8, F,
        "\"data_offsets\" is not");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": {\"b\": 0}}}", 8, F,
        "\"data_offsets\" is not");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 4]}}", 8, F,
        "end before they begin");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", 8, F,
        "span 4 bytes, but 2 F32 elements need 8");
    BAD("{\"a\": {\"dtype\": \"BF16\", \"shape\": [3], \"data_offsets\": [0, 8]}}", 8, F, "need 6");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [60, 68]}}", 64, F,
        "past the 64-byte data area");
    BAD("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
        "\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
        8, F, "tensor 'a' appears twice");
    BAD("{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}, "
        "\"y\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
        8, F, "tensors 'x' and 'y' overlap");
    BAD("{\"x\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
        "\"y\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [16, 20]}, "
        "\"z\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}}",
        20, F, "tensors 'x' and 'z' overlap");
    BAD("{\"__metadata__\": [1]}", 0, F, "\"__metadata__\" is not an object");
    BAD("{\"__metadata__\": {\"format\": 1}}", 0, F, "\"__metadata__\" value 'format'");

    /* Accepted edge cases: holes between tensors, null metadata, an empty header object. */
    char path[256], err[512] = "";
    float hole[4] = {0, 0, 7.0f, 0};
    snprintf(path, sizeof path, "%s/ok.safetensors", tmp);
    write_st(path,
             "{\"__metadata__\": null, \"x\": {\"dtype\": \"F32\", \"shape\": [1], "
             "\"data_offsets\": [8, 12]}}",
             hole, 16);
    struct cllm_st_set *set = NULL;
    CHECKF(cllm_st_open_file(&set, path, err, sizeof err) == CLLM_OK && cllm_st_count(set) == 1,
           "%s", err);
    CHECK(set && rd_f32(cllm_st_find(set, "x")->data, 0) == 7.0f);
    cllm_st_free(set);
    write_st(path, "{}", NULL, 0);
    set = NULL;
    CHECKF(cllm_st_open_file(&set, path, err, sizeof err) == CLLM_OK && cllm_st_count(set) == 0,
           "%s", err);
    cllm_st_free(set);
}

static void test_bad_lengths(void)
{
    char path[256], err[512] = "";
    snprintf(path, sizeof path, "%s/len.safetensors", tmp);
    struct cllm_st_set *set = NULL;

    write_bytes(path, "abc", 3);
    CHECK(cllm_st_open_file(&set, path, err, sizeof err) == CLLM_ERR_FORMAT && !set);
    CHECKF(strstr(err, path) && strstr(err, "too short"), "%s", err);

    write_raw(path, 100, "{}", 2);
    CHECK(cllm_st_open_file(&set, path, err, sizeof err) == CLLM_ERR_FORMAT && !set);
    CHECKF(strstr(err, path) && strstr(err, "header length 100 exceeds the 2 bytes"), "%s", err);

    write_raw(path, UINT64_MAX, "{}", 2);
    CHECK(cllm_st_open_file(&set, path, err, sizeof err) == CLLM_ERR_FORMAT && !set);
    CHECKF(strstr(err, path) && strstr(err, "exceeds"), "%s", err);

    /* A header over the cap in a sparse file (no 100 MB written). */
    uint64_t big = (uint64_t)CLLM_ST_MAX_HEADER + 1;
    write_raw(path, big, "{", 1);
    CHECK(truncate(path, (off_t)(8 + big)) == 0);
    CHECK(cllm_st_open_file(&set, path, err, sizeof err) == CLLM_ERR_RANGE && !set);
    CHECKF(strstr(err, path) && strstr(err, "exceeds the limit"), "%s", err);

    snprintf(path, sizeof path, "%s/does-not-exist.safetensors", tmp);
    CHECK(cllm_st_open_file(&set, path, err, sizeof err) == CLLM_ERR_IO && !set);
    CHECKF(strstr(err, path) && strstr(err, "No such file"), "%s", err);
}

/* Every prefix of a valid file fails cleanly; every single-byte corruption of its header
 * neither crashes nor leaks (the sanitizers watch). */
static void test_truncation_and_corruption(void)
{
    char full[256], cut[256], err[512];
    snprintf(full, sizeof full, "%s/full.safetensors", tmp);
    snprintf(cut, sizeof cut, "%s/cut.safetensors", tmp);
    struct valid_data v;
    fill_valid(&v);
    size_t n = write_st(full, VALID_HEADER, &v, sizeof v);
    size_t got;
    char *bytes = read_all(full, &got);
    CHECK(got == n);
    int failed = 0, named = 0;
    for (size_t len = 0; len < n; len++) {
        write_bytes(cut, bytes, len);
        struct cllm_st_set *set = NULL;
        err[0] = '\0';
        if (cllm_st_open_file(&set, cut, err, sizeof err) != CLLM_OK && !set)
            failed++;
        if (strstr(err, cut))
            named++;
        cllm_st_free(set);
    }
    CHECKF(failed == (int)n && named == (int)n, "%d/%zu prefixes failed, %d named the file", failed,
           n, named);

    const uint8_t subst[] = {'"', '{', '}', '[', ']', ',', ':', '9', '-', '.', 'e', ' ', 0, 0xff};
    size_t hdr_end = 8 + strlen(VALID_HEADER);
    int ok = 0, total = 0;
    for (size_t i = 0; i < hdr_end; i++) {
        for (size_t k = 0; k < sizeof subst; k++) {
            char saved = bytes[i];
            bytes[i] = (char)subst[k];
            write_bytes(cut, bytes, n);
            bytes[i] = saved;
            struct cllm_st_set *set = NULL;
            err[0] = '\0';
            enum cllm_status st = cllm_st_open_file(&set, cut, err, sizeof err);
            total++;
            if (st == CLLM_OK) {
                ok++;
                /* whatever was accepted must lie inside the file */
                for (size_t t = 0; t < cllm_st_count(set); t++) {
                    const struct cllm_tensor *tt = cllm_st_tensor(set, t);
                    CHECK(tt->nbytes > 0 && tt->nbytes <= n);
                }
            } else {
                CHECK(set == NULL && err[0] != '\0');
            }
            cllm_st_free(set);
        }
    }
    CHECK(ok > 0 && ok < total);
    free(bytes);
}

/* --- sharded folders ------------------------------------------------------------------- */

static const char *SHARD1 = "model-00001-of-00002.safetensors";
static const char *SHARD2 = "model-00002-of-00002.safetensors";

static void make_shards(const char *dir)
{
    char p[256];
    float x[4] = {1, 2, 3, 4}, y[2] = {-5, -6};
    uint16_t zy[6];
    for (int i = 0; i < 6; i++)
        zy[i] = cllm_f32_to_bf16((float)(10 + i));
    uint8_t d1[16 + 12];
    memcpy(d1, x, 16);
    memcpy(d1 + 16, zy, 12);
    path_in(p, sizeof p, dir, SHARD1);
    write_st(p,
             "{\"x\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 16]}, "
             "\"z\": {\"dtype\": \"BF16\", \"shape\": [3, 2], \"data_offsets\": [16, 28]}}",
             d1, sizeof d1);
    path_in(p, sizeof p, dir, SHARD2);
    write_st(p, "{\"y\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", y, 8);
}

static void write_index(const char *dir, const char *json)
{
    char p[256];
    path_in(p, sizeof p, dir, "model.safetensors.index.json");
    write_bytes(p, json, strlen(json));
}

static const char *VALID_INDEX = "{\"metadata\": {\"total_size\": 36}, \"weight_map\": {"
                                 "\"x\": \"model-00001-of-00002.safetensors\", "
                                 "\"y\": \"model-00002-of-00002.safetensors\", "
                                 "\"z\": \"model-00001-of-00002.safetensors\"}}";

static void test_sharded_valid(void)
{
    char dir[128], err[512] = "", p1[256], p2[256];
    snprintf(dir, sizeof dir, "%s/sharded", tmp);
    mkdir(dir, 0700);
    make_shards(dir);
    write_index(dir, VALID_INDEX);
    path_in(p1, sizeof p1, dir, SHARD1);
    path_in(p2, sizeof p2, dir, SHARD2);

    struct cllm_st_set *set = NULL;
    enum cllm_status st = cllm_st_open_dir(&set, dir, err, sizeof err);
    CHECKF(st == CLLM_OK && set, "%s", err);
    if (!set)
        return;
    CHECK(cllm_st_count(set) == 3);
    const struct cllm_tensor *x = cllm_st_find(set, "x"), *y = cllm_st_find(set, "y"),
                             *z = cllm_st_find(set, "z");
    CHECK(x && y && z);
    if (x && y && z) {
        CHECK(x->ne[0] == 2 && x->ne[1] == 2 && rd_f32(x->data, 3) == 4.0f);
        CHECK(z->dtype == CLLM_DTYPE_BF16 && z->ne[0] == 2 && z->ne[1] == 3);
        CHECK(cllm_bf16_to_f32(rd_u16(z->data, 5)) == 15.0f);
        CHECK(y->ne[0] == 2 && rd_f32(y->data, 1) == -6.0f);
        CHECK(strcmp(cllm_st_tensor_path(set, x), p1) == 0);
        CHECK(strcmp(cllm_st_tensor_path(set, y), p2) == 0);
        /* one mapping per distinct shard: x and z share the file (the same path string) */
        CHECK(cllm_st_tensor_path(set, x) == cllm_st_tensor_path(set, z));
    }
    cllm_st_free(set);
}

static void expect_dir_bad(const char *dir, enum cllm_status want, const char *name,
                           const char *needle, int line)
{
    char err[512] = "";
    struct cllm_st_set *set = (struct cllm_st_set *)1;
    enum cllm_status st = cllm_st_open_dir(&set, dir, err, sizeof err);
    char path[256];
    path_in(path, sizeof path, dir, name);
    CHECKF(st == want && set == NULL, "line %d: status %s, want %s (%s)", line, cllm_status_str(st),
           cllm_status_str(want), err);
    CHECKF(strstr(err, name ? path : dir) && strstr(err, needle), "line %d: '%s' lacks '%s'", line,
           err, needle);
}

#define DIR_BAD(index_json, want, name, needle)                                                    \
    do {                                                                                           \
        write_index(dir, index_json);                                                              \
        expect_dir_bad(dir, want, name, needle, __LINE__);                                         \
    } while (0)

static void test_sharded_bad(void)
{
    char dir[128], p[256];
    snprintf(dir, sizeof dir, "%s/badshard", tmp);
    mkdir(dir, 0700);
    const char *IDX = "model.safetensors.index.json";
    const enum cllm_status F = CLLM_ERR_FORMAT;

    /* neither file */
    expect_dir_bad(dir, CLLM_ERR_NOT_FOUND, NULL, "no model.safetensors", __LINE__);

    make_shards(dir);
    DIR_BAD("{\"weight_map\": ", F, IDX, "not valid JSON");
    DIR_BAD("{\"metadata\": {}}", F, IDX, "\"weight_map\" is missing");
    DIR_BAD("{\"weight_map\": [\"x\"]}", F, IDX, "\"weight_map\" is missing or not an object");
    DIR_BAD("{\"weight_map\": {}}", F, IDX, "\"weight_map\" is empty");
    DIR_BAD("{\"weight_map\": {\"x\": 1}}", F, IDX, "entry for tensor 'x' is not a string");
    DIR_BAD("{\"weight_map\": {\"x\": \"../model-00001-of-00002.safetensors\"}}", F, IDX,
            "is not a file name inside the folder");
    DIR_BAD("{\"weight_map\": {\"x\": \"sub/x.safetensors\"}}", F, IDX, "'sub/x.safetensors'");
    DIR_BAD("{\"weight_map\": {\"x\": \"/etc/passwd\"}}", F, IDX, "not a file name");
    DIR_BAD("{\"weight_map\": {\"x\": \"..\"}}", F, IDX, "not a file name");
    DIR_BAD("{\"weight_map\": {\"x\": \"\"}}", F, IDX, "not a file name");
    DIR_BAD("{\"weight_map\": {\"x\": \"model-00003-of-00002.safetensors\"}}", CLLM_ERR_IO,
            "model-00003-of-00002.safetensors", "cannot open");
    DIR_BAD("{\"weight_map\": {\"x\": \"model-00001-of-00002.safetensors\", "
            "\"w\": \"model-00002-of-00002.safetensors\"}}",
            F, IDX, "tensor 'w' is listed in model-00002-of-00002.safetensors but is not in it");
    DIR_BAD("{\"weight_map\": {\"x\": \"model-00002-of-00002.safetensors\", "
            "\"y\": \"model-00002-of-00002.safetensors\"}}",
            F, IDX, "tensor 'x' is listed in model-00002-of-00002.safetensors but is not in it");
    DIR_BAD("{\"weight_map\": {\"x\": \"model-00001-of-00002.safetensors\", "
            "\"y\": \"model-00001-of-00002.safetensors\", "
            "\"q\": \"model-00002-of-00002.safetensors\"}}",
            F, IDX, "tensor 'y' is listed in model-00001-of-00002.safetensors but is in another");

    /* a tensor in two shards */
    path_in(p, sizeof p, dir, SHARD2);
    float y[2] = {0};
    write_st(p,
             "{\"y\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
             "\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
             y, 8);
    DIR_BAD(VALID_INDEX, F, SHARD2, "tensor 'x' is also in");

    /* a broken shard is reported by its own name */
    write_st(p, "{\"y\": {\"dtype\": \"I8\", \"shape\": [1], \"data_offsets\": [0, 1]}}", y, 1);
    DIR_BAD(VALID_INDEX, CLLM_ERR_UNSUPPORTED, SHARD2, "dtype I8 is not supported");

    /* every prefix of a valid index fails (never crashes); the whole one opens */
    make_shards(dir);
    size_t n = strlen(VALID_INDEX);
    int failed = 0;
    char *buf = malloc(n + 1);
    for (size_t len = 0; len < n; len++) {
        memcpy(buf, VALID_INDEX, len);
        buf[len] = '\0';
        write_index(dir, buf);
        char err[512];
        struct cllm_st_set *set = NULL;
        if (cllm_st_open_dir(&set, dir, err, sizeof err) != CLLM_OK && !set)
            failed++;
        cllm_st_free(set);
    }
    free(buf);
    CHECK(failed == (int)n);
    write_index(dir, VALID_INDEX);
    char err[512] = "";
    struct cllm_st_set *set = NULL;
    CHECKF(cllm_st_open_dir(&set, dir, err, sizeof err) == CLLM_OK, "%s", err);
    cllm_st_free(set);
}

int main(void)
{
    snprintf(tmp, sizeof tmp, "/tmp/cllm_test_st_XXXXXX");
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    test_valid_single();
    test_bad_headers();
    test_bad_lengths();
    test_truncation_and_corruption();
    test_sharded_valid();
    test_sharded_bad();
    rm_tree(tmp);
    struct stat sb;
    CHECK(stat(tmp, &sb) != 0);
    return test_summary();
}
