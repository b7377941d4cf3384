/*
 * GGUF reader unit tests on files written here: valid v2/v3 files with every value type, nested
 * arrays, F32/F16/Q8_0/Q4_K tensors and custom alignments are read back value by value; then
 * malformed files (every prefix of a valid file, lying lengths and counts, bad tensor infos)
 * must each fail with a status and one line naming the file and the problem.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/buf.h"
#include "core/f16.h"
#include "model/gguf.h"
#include "test.h"

static char dir[] = "/tmp/cllm_test_gguf_XXXXXX";

/* ---- a small GGUF writer ---- */

static void w_bytes(struct cllm_buf *b, const void *p, size_t n)
{
    if (cllm_buf_append(b, p, n)) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
}

static void w_u8(struct cllm_buf *b, uint8_t v)
{
    w_bytes(b, &v, 1);
}

static void w_u32(struct cllm_buf *b, uint32_t v)
{
    w_bytes(b, &v, 4);
}

static void w_u64(struct cllm_buf *b, uint64_t v)
{
    w_bytes(b, &v, 8);
}

static void w_str(struct cllm_buf *b, const char *s)
{
    w_u64(b, strlen(s));
    w_bytes(b, s, strlen(s));
}

static void w_pad(struct cllm_buf *b, uint64_t align)
{
    while (b->len % align)
        w_u8(b, 0);
}

static void w_hdr(struct cllm_buf *b, const char *magic, uint32_t version, uint64_t n_tensors,
                  uint64_t n_kv)
{
    w_bytes(b, magic, 4);
    w_u32(b, version);
    w_u64(b, n_tensors);
    w_u64(b, n_kv);
}

/* A key and its value type; the caller writes the value. */
static void w_key(struct cllm_buf *b, const char *key, enum cllm_gguf_type t)
{
    w_str(b, key);
    w_u32(b, t);
}

static void w_tinfo(struct cllm_buf *b, const char *name, uint32_t n_dims, const uint64_t *ne,
                    uint32_t ggml_type, uint64_t offset)
{
    w_str(b, name);
    w_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++)
        w_u64(b, ne[d]);
    w_u32(b, ggml_type);
    w_u64(b, offset);
}

static void path_of(char *out, size_t n, const char *name)
{
    snprintf(out, n, "%s/%s", dir, name);
}

static void write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
}

/* ---- the valid file ---- */

struct tspec {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t ggml_type;
    enum cllm_dtype dtype;
    size_t nbytes;
    int alias_of; /* -1, or the tensor whose data this one shares (overlap is legal) */
    uint8_t data[512];
    uint64_t offset; /* filled by the writer, relative to the data section */
};

static struct tspec tensors[] = {
    {"f32", 2, {4, 2}, 0, CLLM_DTYPE_F32, 32, -1, {0}, 0},
    {"f16", 1, {8}, 1, CLLM_DTYPE_F16, 16, -1, {0}, 0},
    {"q8_0", 2, {32, 2}, 8, CLLM_DTYPE_Q8_0, 68, -1, {0}, 0},
    {"blk.0.q4_k", 3, {256, 1, 2}, 12, CLLM_DTYPE_Q4_K, 288, -1, {0}, 0},
    {"alias", 1, {8}, 0, CLLM_DTYPE_F32, 32, 0, {0}, 0},
};
#define N_TENSORS (sizeof tensors / sizeof tensors[0])

static const float f32_vals[8] = {0.f, 1.f, -2.5f, 3.25f, 1e-3f, -1e6f, 7.f, 0.125f};

static void fill_tensor_data(void)
{
    memcpy(tensors[0].data, f32_vals, sizeof f32_vals);
    for (int i = 0; i < 8; i++) {
        uint16_t h = cllm_f32_to_f16(f32_vals[i]);
        memcpy(tensors[1].data + 2 * i, &h, 2);
    }
    for (size_t i = 0; i < tensors[2].nbytes; i++)
        tensors[2].data[i] = (uint8_t)(i * 7 + 1);
    for (size_t i = 0; i < tensors[3].nbytes; i++)
        tensors[3].data[i] = (uint8_t)(i * 13 + 5);
    memcpy(tensors[4].data, f32_vals, sizeof f32_vals);
}

#define N_KV 27 /* without general.alignment */

static uint64_t write_kvs(struct cllm_buf *b)
{
    w_key(b, "general.architecture", CLLM_GGUF_TYPE_STRING);
    w_str(b, "qwen2");
    w_key(b, "t.u8", CLLM_GGUF_TYPE_U8);
    w_u8(b, 200);
    w_key(b, "t.i8", CLLM_GGUF_TYPE_I8);
    w_u8(b, (uint8_t)(int8_t)-100);
    w_key(b, "t.u16", CLLM_GGUF_TYPE_U16);
    w_bytes(b, &(uint16_t){60000}, 2);
    w_key(b, "t.i16", CLLM_GGUF_TYPE_I16);
    w_bytes(b, &(int16_t){-30000}, 2);
    w_key(b, "t.u32", CLLM_GGUF_TYPE_U32);
    w_u32(b, 4000000000u);
    w_key(b, "t.i32", CLLM_GGUF_TYPE_I32);
    w_bytes(b, &(int32_t){-2000000000}, 4);
    w_key(b, "t.f32", CLLM_GGUF_TYPE_F32);
    w_bytes(b, &(float){1.5f}, 4);
    w_key(b, "t.bool_t", CLLM_GGUF_TYPE_BOOL);
    w_u8(b, 1);
    w_key(b, "t.bool_f", CLLM_GGUF_TYPE_BOOL);
    w_u8(b, 0);
    w_key(b, "t.str", CLLM_GGUF_TYPE_STRING);
    w_str(b, "h\xc3\xa9llo world");
    w_key(b, "t.empty", CLLM_GGUF_TYPE_STRING);
    w_str(b, "");
    w_key(b, "t.u64", CLLM_GGUF_TYPE_U64);
    w_u64(b, (1ull << 63) + 5);
    w_key(b, "t.i64", CLLM_GGUF_TYPE_I64);
    w_bytes(b, &(int64_t){-(1ll << 62)}, 8);
    w_key(b, "t.f64", CLLM_GGUF_TYPE_F64);
    w_bytes(b, &(double){0.1}, 8);
    w_key(b, "t.small_u64", CLLM_GGUF_TYPE_U64);
    w_u64(b, 7);
    w_key(b, "t.neg_i8", CLLM_GGUF_TYPE_I8);
    w_u8(b, 0xff);
    /* Arrays. */
    w_key(b, "t.arr_i32", CLLM_GGUF_TYPE_ARRAY);
    w_u32(b, CLLM_GGUF_TYPE_I32);
    w_u64(b, 3);
    w_bytes(b, (int32_t[]){1, -2, 2147483647}, 12);
    w_key(b, "t.arr_u8", CLLM_GGUF_TYPE_ARRAY); /* odd length, so the next values are unaligned */
    w_u32(b, CLLM_GGUF_TYPE_U8);
    w_u64(b, 3);
    w_bytes(b, (uint8_t[]){9, 8, 7}, 3);
    w_key(b, "t.arr_f64", CLLM_GGUF_TYPE_ARRAY);
    w_u32(b, CLLM_GGUF_TYPE_F64);
    w_u64(b, 2);
    w_bytes(b, (double[]){-0.5, 1e300}, 16);
    w_key(b, "t.arr_bool", CLLM_GGUF_TYPE_ARRAY);
    w_u32(b, CLLM_GGUF_TYPE_BOOL);
    w_u64(b, 2);
    w_bytes(b, (uint8_t[]){1, 0}, 2);
    w_key(b, "t.arr_str", CLLM_GGUF_TYPE_ARRAY);
    w_u32(b, CLLM_GGUF_TYPE_STRING);
    w_u64(b, 3);
    w_str(b, "a");
    w_str(b, "");
    w_str(b, "\xc4\xa0 \xc4\xa0");
    w_key(b, "t.arr_empty", CLLM_GGUF_TYPE_ARRAY);
    w_u32(b, CLLM_GGUF_TYPE_U32);
    w_u64(b, 0);
    /* [[1, 2], [3]] as i16, then [["x", "yy"], []] */
    w_key(b, "t.nested_i16", CLLM_GGUF_TYPE_ARRAY);
    w_u32(b, CLLM_GGUF_TYPE_ARRAY);
    w_u64(b, 2);
    w_u32(b, CLLM_GGUF_TYPE_I16);
    w_u64(b, 2);
    w_bytes(b, (int16_t[]){1, 2}, 4);
    w_u32(b, CLLM_GGUF_TYPE_I16);
    w_u64(b, 1);
    w_bytes(b, (int16_t[]){3}, 2);
    w_key(b, "t.nested_str", CLLM_GGUF_TYPE_ARRAY);
    w_u32(b, CLLM_GGUF_TYPE_ARRAY);
    w_u64(b, 2);
    w_u32(b, CLLM_GGUF_TYPE_STRING);
    w_u64(b, 2);
    w_str(b, "x");
    w_str(b, "yy");
    w_u32(b, CLLM_GGUF_TYPE_STRING);
    w_u64(b, 0);
    /* 8 levels of arrays: the deepest nesting allowed. */
    w_key(b, "t.deep", CLLM_GGUF_TYPE_ARRAY);
    for (int d = 0; d < CLLM_GGUF_MAX_DEPTH - 1; d++) {
        w_u32(b, CLLM_GGUF_TYPE_ARRAY);
        w_u64(b, 1);
    }
    w_u32(b, CLLM_GGUF_TYPE_U8);
    w_u64(b, 1);
    w_u8(b, 42);
    w_key(b, "t.last", CLLM_GGUF_TYPE_U32);
    w_u32(b, 99);
    return N_KV;
}

/* A valid file; alignment 0 writes no general.alignment key (the default 32 applies). */
static void build_good(struct cllm_buf *b, uint32_t version, uint32_t alignment)
{
    uint64_t align = alignment ? alignment : 32;
    struct cllm_buf kvs = {0};
    uint64_t n_kv = write_kvs(&kvs);
    if (alignment) {
        w_key(&kvs, "general.alignment", CLLM_GGUF_TYPE_U32);
        w_u32(&kvs, alignment);
        n_kv++;
    }
    uint64_t cur = 0;
    for (size_t i = 0; i < N_TENSORS; i++) {
        if (tensors[i].alias_of >= 0) {
            tensors[i].offset = tensors[tensors[i].alias_of].offset;
            continue;
        }
        cur = (cur + align - 1) / align * align;
        tensors[i].offset = cur;
        cur += tensors[i].nbytes;
    }
    w_hdr(b, "GGUF", version, N_TENSORS, n_kv);
    w_bytes(b, kvs.data, kvs.len);
    cllm_buf_free(&kvs);
    for (size_t i = 0; i < N_TENSORS; i++)
        w_tinfo(b, tensors[i].name, tensors[i].n_dims, tensors[i].ne, tensors[i].ggml_type,
                tensors[i].offset);
    w_pad(b, align);
    size_t data_start = b->len;
    for (size_t i = 0; i < N_TENSORS; i++) {
        if (tensors[i].alias_of >= 0)
            continue;
        while (b->len < data_start + tensors[i].offset)
            w_u8(b, 0);
        w_bytes(b, tensors[i].data, tensors[i].nbytes);
    }
}

static void check_str(struct cllm_gguf_str s, const char *want)
{
    CHECKF(s.len == strlen(want) && memcmp(s.ptr, want, s.len) == 0, "got '%.*s' want '%s'",
           (int)s.len, s.ptr, want);
}

static void check_good(const char *path, uint32_t version, uint32_t alignment, size_t file_len)
{
    char err[512] = "";
    struct cllm_gguf *g = NULL;
    enum cllm_status st = cllm_gguf_open(&g, path, err, sizeof err);
    CHECKF(st == CLLM_OK && g, "%s", err);
    if (!g)
        return;
    uint32_t align = alignment ? alignment : 32;
    CHECK(strcmp(cllm_gguf_path(g), path) == 0);
    CHECK(cllm_gguf_version(g) == version);
    CHECK(cllm_gguf_alignment(g) == align);
    CHECK(cllm_gguf_file_size(g) == file_len);
    CHECK(cllm_gguf_data_offset(g) % align == 0);
    CHECK(cllm_gguf_n_kv(g) == N_KV + (alignment ? 1 : 0));
    CHECK(cllm_gguf_n_tensors(g) == N_TENSORS);

    /* Listing keeps file order. */
    CHECK(strcmp(cllm_gguf_kv_at(g, 0)->key, "general.architecture") == 0);
    CHECK(strcmp(cllm_gguf_kv_at(g, N_KV - 1)->key, "t.last") == 0);
    CHECK(cllm_gguf_kv_at(g, N_KV - 1)->value.type == CLLM_GGUF_TYPE_U32);
    CHECK(cllm_gguf_kv_at(g, cllm_gguf_n_kv(g)) == NULL);
    CHECK(cllm_gguf_find(g, "nope") == NULL);
    CHECK(cllm_gguf_find(g, "t.u") == NULL);
    CHECK(cllm_gguf_find(g, "t.u8")->type == CLLM_GGUF_TYPE_U8);

    /* Scalars and conversions. */
    struct cllm_gguf_str s;
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    int64_t i64;
    float f32;
    double f64;
    bool b;
    CHECK(cllm_gguf_get_str(g, "general.architecture", &s));
    check_str(s, "qwen2");
    CHECK(cllm_gguf_get_u32(g, "t.u8", &u32) && u32 == 200);
    CHECK(cllm_gguf_get_i32(g, "t.i8", &i32) && i32 == -100);
    CHECK(!cllm_gguf_get_u32(g, "t.i8", &u32)); /* negative: no unsigned value */
    CHECK(cllm_gguf_get_u32(g, "t.u16", &u32) && u32 == 60000);
    CHECK(cllm_gguf_get_i32(g, "t.i16", &i32) && i32 == -30000);
    CHECK(cllm_gguf_get_u32(g, "t.u32", &u32) && u32 == 4000000000u);
    CHECK(!cllm_gguf_get_i32(g, "t.u32", &i32)); /* does not fit */
    CHECK(cllm_gguf_get_i64(g, "t.u32", &i64) && i64 == 4000000000ll);
    CHECK(cllm_gguf_get_i32(g, "t.i32", &i32) && i32 == -2000000000);
    CHECK(cllm_gguf_get_f32(g, "t.f32", &f32) && f32 == 1.5f);
    CHECK(cllm_gguf_get_f64(g, "t.f32", &f64) && f64 == 1.5);
    CHECK(!cllm_gguf_get_f32(g, "t.u8", &f32)); /* an integer is not a float */
    CHECK(cllm_gguf_get_bool(g, "t.bool_t", &b) && b);
    CHECK(cllm_gguf_get_bool(g, "t.bool_f", &b) && !b);
    CHECK(!cllm_gguf_get_u32(g, "t.bool_t", &u32)); /* a bool is not an integer */
    CHECK(!cllm_gguf_get_bool(g, "t.u8", &b));
    CHECK(cllm_gguf_get_str(g, "t.str", &s));
    check_str(s, "h\xc3\xa9llo world");
    CHECK(cllm_gguf_get_str(g, "t.empty", &s) && s.len == 0);
    CHECK(!cllm_gguf_get_str(g, "t.u8", &s));
    CHECK(!cllm_gguf_get_str(g, "missing", &s));
    CHECK(cllm_gguf_get_u64(g, "t.u64", &u64) && u64 == (1ull << 63) + 5);
    CHECK(!cllm_gguf_get_i64(g, "t.u64", &i64));
    CHECK(!cllm_gguf_get_u32(g, "t.u64", &u32));
    CHECK(cllm_gguf_get_i64(g, "t.i64", &i64) && i64 == -(1ll << 62));
    CHECK(!cllm_gguf_get_u64(g, "t.i64", &u64));
    CHECK(cllm_gguf_get_f64(g, "t.f64", &f64) && f64 == 0.1);
    CHECK(cllm_gguf_get_f32(g, "t.f64", &f32) && f32 == 0.1f);
    CHECK(cllm_gguf_get_u32(g, "t.small_u64", &u32) && u32 == 7);
    CHECK(cllm_gguf_get_i32(g, "t.small_u64", &i32) && i32 == 7);
    CHECK(cllm_gguf_get_i64(g, "t.neg_i8", &i64) && i64 == -1);
    CHECK(cllm_gguf_get_u32(g, "t.last", &u32) && u32 == 99);
    if (alignment)
        CHECK(cllm_gguf_get_u32(g, "general.alignment", &u32) && u32 == alignment);

    /* Fixed-size arrays. */
    struct cllm_gguf_array a;
    struct cllm_gguf_value v;
    CHECK(!cllm_gguf_get_array(g, "t.arr_i32", CLLM_GGUF_TYPE_U32, &a)); /* wrong element type */
    CHECK(!cllm_gguf_get_array(g, "t.u8", CLLM_GGUF_TYPE_U8, &a));       /* not an array */
    CHECK(cllm_gguf_get_array(g, "t.arr_i32", CLLM_GGUF_TYPE_I32, &a) && a.count == 3);
    CHECK(a.nbytes == 12);
    CHECK(cllm_gguf_array_at(&a, 0, &v) && v.type == CLLM_GGUF_TYPE_I32 && v.i == 1);
    CHECK(cllm_gguf_array_at(&a, 1, &v) && cllm_gguf_value_i32(&v, &i32) && i32 == -2);
    CHECK(cllm_gguf_array_at(&a, 2, &v) && v.i == 2147483647);
    CHECK(!cllm_gguf_array_at(&a, 3, &v));
    CHECK(cllm_gguf_get_array(g, "t.arr_u8", CLLM_GGUF_TYPE_U8, &a) && a.count == 3);
    CHECK(cllm_gguf_array_at(&a, 2, &v) && v.u == 7);
    CHECK(cllm_gguf_get_array(g, "t.arr_f64", CLLM_GGUF_TYPE_F64, &a) && a.count == 2);
    CHECK(cllm_gguf_array_at(&a, 0, &v) && v.f == -0.5);
    CHECK(cllm_gguf_array_at(&a, 1, &v) && v.f == 1e300);
    CHECK(cllm_gguf_get_array(g, "t.arr_bool", CLLM_GGUF_TYPE_BOOL, &a) && a.count == 2);
    CHECK(cllm_gguf_array_at(&a, 0, &v) && v.b);
    CHECK(cllm_gguf_array_at(&a, 1, &v) && !v.b);
    CHECK(cllm_gguf_get_array(g, "t.arr_empty", CLLM_GGUF_TYPE_U32, &a) && a.count == 0);
    CHECK(!cllm_gguf_array_at(&a, 0, &v));
    struct cllm_gguf_iter it;
    cllm_gguf_iter_init(&it, &a);
    CHECK(!cllm_gguf_iter_next(&it, &v));

    /* String arrays: iterator and table. */
    CHECK(cllm_gguf_get_array(g, "t.arr_str", CLLM_GGUF_TYPE_STRING, &a) && a.count == 3);
    CHECK(!cllm_gguf_array_at(&a, 0, &v)); /* strings need the iterator */
    const char *want_str[] = {"a", "", "\xc4\xa0 \xc4\xa0"};
    int n = 0;
    cllm_gguf_iter_init(&it, &a);
    while (cllm_gguf_iter_next(&it, &v)) {
        CHECK(v.type == CLLM_GGUF_TYPE_STRING);
        if (n < 3)
            check_str(v.str, want_str[n]);
        n++;
    }
    CHECK(n == 3);
    struct cllm_gguf_str *tab = NULL;
    uint64_t count = 0;
    CHECK(cllm_gguf_get_str_array(g, "t.arr_str", &tab, &count, err, sizeof err) == CLLM_OK);
    CHECK(count == 3);
    for (uint64_t i = 0; tab && i < count && i < 3; i++)
        check_str(tab[i], want_str[i]);
    free(tab);
    CHECK(cllm_gguf_get_str_array(g, "t.arr_i32", &tab, &count, err, sizeof err) ==
          CLLM_ERR_FORMAT);
    CHECK(tab == NULL && count == 0);
    CHECKF(strstr(err, path) && strstr(err, "t.arr_i32") && strstr(err, "i32"), "%s", err);
    CHECK(cllm_gguf_get_str_array(g, "t.nope", &tab, &count, err, sizeof err) ==
          CLLM_ERR_NOT_FOUND);
    CHECKF(strstr(err, "t.nope"), "%s", err);

    /* Nested arrays. */
    CHECK(cllm_gguf_get_array(g, "t.nested_i16", CLLM_GGUF_TYPE_ARRAY, &a) && a.count == 2);
    cllm_gguf_iter_init(&it, &a);
    CHECK(cllm_gguf_iter_next(&it, &v) && v.type == CLLM_GGUF_TYPE_ARRAY);
    CHECK(v.arr.type == CLLM_GGUF_TYPE_I16 && v.arr.count == 2);
    struct cllm_gguf_value e;
    CHECK(cllm_gguf_array_at(&v.arr, 0, &e) && e.i == 1);
    CHECK(cllm_gguf_array_at(&v.arr, 1, &e) && e.i == 2);
    CHECK(cllm_gguf_iter_next(&it, &v) && v.arr.type == CLLM_GGUF_TYPE_I16 && v.arr.count == 1);
    CHECK(cllm_gguf_array_at(&v.arr, 0, &e) && e.i == 3);
    CHECK(!cllm_gguf_iter_next(&it, &v));
    CHECK(cllm_gguf_get_array(g, "t.nested_str", CLLM_GGUF_TYPE_ARRAY, &a) && a.count == 2);
    cllm_gguf_iter_init(&it, &a);
    CHECK(cllm_gguf_iter_next(&it, &v) && v.arr.type == CLLM_GGUF_TYPE_STRING && v.arr.count == 2);
    struct cllm_gguf_iter inner;
    cllm_gguf_iter_init(&inner, &v.arr);
    CHECK(cllm_gguf_iter_next(&inner, &e));
    check_str(e.str, "x");
    CHECK(cllm_gguf_iter_next(&inner, &e));
    check_str(e.str, "yy");
    CHECK(!cllm_gguf_iter_next(&inner, &e));
    CHECK(cllm_gguf_iter_next(&it, &v) && v.arr.type == CLLM_GGUF_TYPE_STRING && v.arr.count == 0);
    CHECK(!cllm_gguf_iter_next(&it, &v));
    /* Walk t.deep down to its one u8. */
    CHECK(cllm_gguf_get_array(g, "t.deep", CLLM_GGUF_TYPE_ARRAY, &a));
    int depth = 1;
    while (a.type == CLLM_GGUF_TYPE_ARRAY) {
        cllm_gguf_iter_init(&it, &a);
        if (!cllm_gguf_iter_next(&it, &v))
            break;
        a = v.arr;
        depth++;
    }
    CHECK(depth == CLLM_GGUF_MAX_DEPTH);
    CHECK(a.type == CLLM_GGUF_TYPE_U8 && cllm_gguf_array_at(&a, 0, &v) && v.u == 42);

    /* Tensors. */
    for (size_t i = 0; i < N_TENSORS; i++) {
        const struct cllm_tensor *t = cllm_gguf_tensor(g, i);
        const struct tspec *ts = &tensors[i];
        CHECK(t && t == cllm_gguf_find_tensor(g, ts->name));
        if (!t)
            continue;
        CHECK(strcmp(t->name, ts->name) == 0);
        CHECK(t->dtype == ts->dtype);
        CHECK(t->n_dims == (int)ts->n_dims);
        for (int d = 0; d < 4; d++)
            CHECK(t->ne[d] == (d < (int)ts->n_dims ? (int64_t)ts->ne[d] : 1));
        CHECKF(t->nbytes == ts->nbytes, "%s: %llu", t->name, (unsigned long long)t->nbytes);
        const struct tspec *src = ts->alias_of >= 0 ? &tensors[ts->alias_of] : ts;
        CHECK(memcmp(t->data, src->data, ts->nbytes) == 0);
        uint64_t off = cllm_gguf_tensor_file_offset(g, i);
        CHECK(off == cllm_gguf_data_offset(g) + ts->offset);
        CHECK(off % align == 0);
    }
    CHECK(cllm_gguf_tensor(g, N_TENSORS) == NULL);
    CHECK(cllm_gguf_find_tensor(g, "f3") == NULL);
    CHECK(cllm_gguf_find_tensor(g, "alias")->data == cllm_gguf_find_tensor(g, "f32")->data);
    const struct cllm_tensor *q4 = cllm_gguf_find_tensor(g, "blk.0.q4_k");
    CHECK(q4 && cllm_tensor_nelements(q4) == 512 && cllm_tensor_nrows(q4) == 2);
    const float *fd = cllm_gguf_find_tensor(g, "f32")->data;
    CHECK(fd[3] == 3.25f); /* aligned data is directly usable */
    cllm_gguf_free(g);
}

static void test_good(void)
{
    struct {
        uint32_t version, alignment;
    } cases[] = {{3, 0}, {2, 0}, {3, 64}, {2, 1}, {3, 4096}};
    char path[256];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct cllm_buf b = {0};
        build_good(&b, cases[c].version, cases[c].alignment);
        path_of(path, sizeof path, "good.gguf");
        write_file(path, b.data, b.len);
        check_good(path, cases[c].version, cases[c].alignment, b.len);
        unlink(path);
        cllm_buf_free(&b);
    }
    cllm_gguf_free(NULL);
}

/* ---- malformed files ---- */

/* Writes b as name, opens it and checks the failure: the status, no handle, and an error text
 * that names the file and contains word. */
static void expect_fail(const struct cllm_buf *b, const char *name, enum cllm_status want,
                        const char *word)
{
    char path[256], err[512] = "";
    path_of(path, sizeof path, name);
    write_file(path, b->data, b->len);
    struct cllm_gguf *g = (struct cllm_gguf *)&g; /* must be reset to NULL */
    enum cllm_status st = cllm_gguf_open(&g, path, err, sizeof err);
    CHECKF(st == want, "%s: status %d, want %d (%s)", name, st, want, err);
    CHECKF(g == NULL, "%s", name);
    CHECKF(strstr(err, path) != NULL, "%s: error does not name the file: %s", name, err);
    CHECKF(strstr(err, word) != NULL, "%s: error lacks '%s': %s", name, word, err);
    CHECKF(strchr(err, '\n') == NULL, "%s: error is not one line: %s", name, err);
    if (getenv("CLLM_TEST_VERBOSE"))
        printf("%s\n", err);
    if (st == CLLM_OK)
        cllm_gguf_free(g);
    unlink(path);
}

static void test_truncated(void)
{
    struct cllm_buf good = {0};
    build_good(&good, 3, 64);
    char path[256], err[512];
    path_of(path, sizeof path, "prefix.gguf");
    int bad = 0;
    /* Every proper prefix must fail cleanly: the last tensor's data ends at the end of file. */
    for (size_t n = 0; n < good.len; n++) {
        write_file(path, good.data, n);
        struct cllm_gguf *g = NULL;
        err[0] = '\0';
        enum cllm_status st = cllm_gguf_open(&g, path, err, sizeof err);
        bool ok = st == CLLM_ERR_FORMAT && g == NULL && strstr(err, path) &&
                  (strstr(err, "truncated") || strstr(err, "past the end") ||
                   strstr(err, "remaining") || strstr(err, "empty"));
        if (!ok && bad++ < 5)
            fprintf(stderr, "prefix %zu: status %d: %s\n", n, st, err);
        cllm_gguf_free(g);
    }
    CHECKF(bad == 0, "%d prefixes misreported", bad);
    write_file(path, good.data, good.len);
    struct cllm_gguf *g = NULL;
    CHECK(cllm_gguf_open(&g, path, err, sizeof err) == CLLM_OK);
    cllm_gguf_free(g);
    unlink(path);
    cllm_buf_free(&good);
}

/* Recursively touches every value, so ASan sees any read the reader lets out of the mapping. */
static uint64_t touch_value(const struct cllm_gguf_value *v)
{
    uint64_t h = v->type;
    if (v->type == CLLM_GGUF_TYPE_STRING) {
        for (uint64_t i = 0; i < v->str.len; i++)
            h += (uint8_t)v->str.ptr[i];
    } else if (v->type == CLLM_GGUF_TYPE_ARRAY) {
        struct cllm_gguf_iter it;
        struct cllm_gguf_value e;
        uint64_t n = 0;
        cllm_gguf_iter_init(&it, &v->arr);
        while (cllm_gguf_iter_next(&it, &e)) {
            h += touch_value(&e);
            n++;
        }
        CHECK(n == v->arr.count);
        for (uint64_t i = 0; i < v->arr.count && cllm_gguf_array_at(&v->arr, i, &e); i++)
            h += e.u;
    } else {
        h += v->u;
    }
    return h;
}

/* Random byte changes to a valid file: each open must succeed with in-bounds data or fail
 * with a message naming the file. Deterministic (fixed LCG seed). */
static void test_mutations(void)
{
    struct cllm_buf good = {0};
    build_good(&good, 3, 64);
    uint8_t *buf = malloc(good.len);
    char path[256], err[512];
    path_of(path, sizeof path, "mutant.gguf");
    uint64_t rng = 0x9e3779b97f4a7c15ull, sink = 0;
    int opened = 0, bad = 0;
    for (int round = 0; round < 3000 && buf; round++) {
        memcpy(buf, good.data, good.len);
        int flips = 1 + round % 4;
        for (int k = 0; k < flips; k++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            size_t at = (size_t)(rng >> 33) % good.len;
            /* Mostly small values and all-ones bytes: they hit lengths, counts and types. */
            uint8_t vals[] = {0, 1, 0xff, 0x7f, 0x80, 3, 9, 13, (uint8_t)(rng >> 20)};
            buf[at] = vals[(rng >> 13) % sizeof vals];
        }
        size_t len = good.len - (round % 7 == 0 ? (size_t)(rng >> 40) % 64 : 0);
        write_file(path, buf, len);
        struct cllm_gguf *g = NULL;
        err[0] = '\0';
        enum cllm_status st = cllm_gguf_open(&g, path, err, sizeof err);
        if (st == CLLM_OK) {
            opened++;
            for (uint64_t i = 0; i < cllm_gguf_n_kv(g); i++)
                sink += touch_value(&cllm_gguf_kv_at(g, i)->value);
            for (uint64_t i = 0; i < cllm_gguf_n_tensors(g); i++) {
                const struct cllm_tensor *t = cllm_gguf_tensor(g, i);
                const uint8_t *d = t->data;
                sink += d[0] + d[t->nbytes - 1] + strlen(t->name);
            }
            cllm_gguf_free(g);
        } else if (g || !strstr(err, path) || strchr(err, '\n')) {
            if (bad++ < 5)
                fprintf(stderr, "mutant %d: status %d: %s\n", round, st, err);
        }
    }
    printf("mutations: %d of 3000 opened\n", opened);
    CHECKF(bad == 0, "%d mutants misreported", bad);
    CHECKF(opened > 0 && opened < 3000, "%d of 3000 mutants opened (sink %llu)", opened,
           (unsigned long long)sink);
    free(buf);
    unlink(path);
    cllm_buf_free(&good);
}

static void one_tensor(struct cllm_buf *b, const char *name, uint32_t n_dims, const uint64_t *ne,
                       uint32_t type, uint64_t offset, size_t data_bytes)
{
    w_hdr(b, "GGUF", 3, 1, 0);
    w_tinfo(b, name, n_dims, ne, type, offset);
    w_pad(b, 32);
    for (size_t i = 0; i < data_bytes; i++)
        w_u8(b, 0);
}

static void kv_file(struct cllm_buf *b, uint64_t n_kv)
{
    w_hdr(b, "GGUF", 3, 0, n_kv);
}

static void test_bad(void)
{
    struct cllm_buf b = {0};
#define RESET() (cllm_buf_free(&b), b = (struct cllm_buf){0})

    expect_fail(&b, "empty.gguf", CLLM_ERR_FORMAT, "empty");

    w_hdr(&b, "GGUG", 3, 0, 0);
    expect_fail(&b, "magic.gguf", CLLM_ERR_FORMAT, "magic");
    RESET();
    w_bytes(&b, "GG", 2);
    expect_fail(&b, "short.gguf", CLLM_ERR_FORMAT, "truncated");
    RESET();

    w_hdr(&b, "GGUF", 1, 0, 0);
    expect_fail(&b, "v1.gguf", CLLM_ERR_UNSUPPORTED, "version 1 ");
    RESET();
    w_hdr(&b, "GGUF", 4, 0, 0);
    expect_fail(&b, "v4.gguf", CLLM_ERR_UNSUPPORTED, "version 4 ");
    RESET();
    w_hdr(&b, "GGUF", 0x03000000u, 0, 0);
    expect_fail(&b, "bigendian.gguf", CLLM_ERR_UNSUPPORTED, "big-endian");
    RESET();

    w_hdr(&b, "GGUF", 3, 0, UINT64_MAX);
    expect_fail(&b, "nkv_huge.gguf", CLLM_ERR_FORMAT, "metadata entries");
    RESET();
    w_hdr(&b, "GGUF", 3, 1ull << 40, 0);
    expect_fail(&b, "ntensors_huge.gguf", CLLM_ERR_FORMAT, "tensors");
    RESET();
    /* Counts that the header's remaining bytes could hold but the bytes after metadata cannot. */
    w_hdr(&b, "GGUF", 3, 2, 1);
    w_key(&b, "a", CLLM_GGUF_TYPE_STRING);
    w_str(&b, "0123456789012345678901234567890123456789012345678901234567");
    expect_fail(&b, "ntensors_after_kv.gguf", CLLM_ERR_FORMAT, "tensors");
    RESET();

    kv_file(&b, 1);
    w_key(&b, "k", CLLM_GGUF_TYPE_STRING);
    w_u64(&b, 1ull << 40);
    w_bytes(&b, "abc", 3);
    expect_fail(&b, "strlen_huge.gguf", CLLM_ERR_FORMAT, "past the end");
    RESET();
    kv_file(&b, 1);
    w_u64(&b, UINT64_MAX); /* key length */
    w_bytes(&b, "0123456789abcdef", 16);
    expect_fail(&b, "keylen_huge.gguf", CLLM_ERR_FORMAT, "past the end");
    RESET();

    kv_file(&b, 1);
    w_key(&b, "k", CLLM_GGUF_TYPE_ARRAY);
    w_u32(&b, CLLM_GGUF_TYPE_U32);
    w_u64(&b, 1ull << 62);
    w_u32(&b, 0);
    expect_fail(&b, "arrcount_huge.gguf", CLLM_ERR_FORMAT, "more than the remaining");
    RESET();
    /* A string array whose count fits 8-byte length fields only on paper. */
    kv_file(&b, 1);
    w_key(&b, "k", CLLM_GGUF_TYPE_ARRAY);
    w_u32(&b, CLLM_GGUF_TYPE_STRING);
    w_u64(&b, 2);
    w_str(&b, "abcdefghij");
    w_u32(&b, 0); /* half of the second string's length */
    expect_fail(&b, "strarr_short.gguf", CLLM_ERR_FORMAT, "truncated");
    RESET();
    kv_file(&b, 1);
    w_key(&b, "k", CLLM_GGUF_TYPE_ARRAY);
    w_u32(&b, CLLM_GGUF_TYPE_STRING);
    w_u64(&b, 2);
    w_str(&b, "a");
    w_u64(&b, 100); /* longer than the file */
    w_bytes(&b, "bc", 2);
    expect_fail(&b, "strarr_lying.gguf", CLLM_ERR_FORMAT, "past the end");
    RESET();

    kv_file(&b, 1);
    w_key(&b, "deep", CLLM_GGUF_TYPE_ARRAY);
    for (int d = 0; d < CLLM_GGUF_MAX_DEPTH; d++) {
        w_u32(&b, CLLM_GGUF_TYPE_ARRAY);
        w_u64(&b, 1);
    }
    w_u32(&b, CLLM_GGUF_TYPE_U8);
    w_u64(&b, 0);
    expect_fail(&b, "too_deep.gguf", CLLM_ERR_FORMAT, "deeper");
    RESET();

    kv_file(&b, 1);
    w_key(&b, "k", 13);
    w_u32(&b, 0);
    expect_fail(&b, "valtype.gguf", CLLM_ERR_FORMAT, "unknown value type 13");
    RESET();
    kv_file(&b, 1);
    w_key(&b, "k", CLLM_GGUF_TYPE_ARRAY);
    w_u32(&b, 77);
    w_u64(&b, 0);
    expect_fail(&b, "arrtype.gguf", CLLM_ERR_FORMAT, "unknown value type 77");
    RESET();
    kv_file(&b, 1);
    w_key(&b, "k", CLLM_GGUF_TYPE_BOOL);
    w_u8(&b, 2);
    expect_fail(&b, "bool.gguf", CLLM_ERR_FORMAT, "not 0 or 1");
    RESET();
    kv_file(&b, 1);
    w_key(&b, "k", CLLM_GGUF_TYPE_ARRAY);
    w_u32(&b, CLLM_GGUF_TYPE_BOOL);
    w_u64(&b, 2);
    w_bytes(&b, (uint8_t[]){0, 5}, 2);
    expect_fail(&b, "boolarr.gguf", CLLM_ERR_FORMAT, "not 0 or 1");
    RESET();

    kv_file(&b, 2);
    w_key(&b, "general.name", CLLM_GGUF_TYPE_STRING);
    w_str(&b, "x");
    w_key(&b, "general.name", CLLM_GGUF_TYPE_U32);
    w_u32(&b, 1);
    expect_fail(&b, "dupkey.gguf", CLLM_ERR_FORMAT, "duplicate key 'general.name'");
    RESET();
    kv_file(&b, 1);
    w_u64(&b, 3);
    w_bytes(&b, "a\0b", 3);
    w_u32(&b, CLLM_GGUF_TYPE_U8);
    w_u8(&b, 0);
    expect_fail(&b, "nulkey.gguf", CLLM_ERR_FORMAT, "NUL");
    RESET();
    kv_file(&b, 1);
    w_key(&b, "", CLLM_GGUF_TYPE_U8);
    w_u8(&b, 0);
    expect_fail(&b, "emptykey.gguf", CLLM_ERR_FORMAT, "empty key");
    RESET();

    const uint32_t bad_align[] = {0, 3, 48};
    for (size_t i = 0; i < 3; i++) {
        kv_file(&b, 1);
        w_key(&b, "general.alignment", CLLM_GGUF_TYPE_U32);
        w_u32(&b, bad_align[i]);
        expect_fail(&b, "align.gguf", CLLM_ERR_FORMAT, "power of two");
        RESET();
    }
    kv_file(&b, 1);
    w_key(&b, "general.alignment", CLLM_GGUF_TYPE_STRING);
    w_str(&b, "32");
    expect_fail(&b, "align_type.gguf", CLLM_ERR_FORMAT, "general.alignment has type string");
    RESET();

    /* Tensor infos. */
    const char *tn = "blk.0.attn_q.weight";
    one_tensor(&b, tn, 2, (uint64_t[]){32, 2}, 16, 0, 128);
    expect_fail(&b, "iq2.gguf", CLLM_ERR_UNSUPPORTED,
                "tensor 'blk.0.attn_q.weight' has type IQ2_XXS");
    RESET();
    one_tensor(&b, tn, 1, (uint64_t[]){32}, 1000, 0, 128);
    expect_fail(&b, "type1000.gguf", CLLM_ERR_UNSUPPORTED, "unknown (ggml type 1000)");
    RESET();
    one_tensor(&b, tn, 0, NULL, 0, 0, 128);
    expect_fail(&b, "ndims0.gguf", CLLM_ERR_FORMAT, "0 dimensions");
    RESET();
    one_tensor(&b, tn, 5, (uint64_t[]){1, 1, 1, 1, 1}, 0, 0, 128);
    expect_fail(&b, "ndims5.gguf", CLLM_ERR_FORMAT, "5 dimensions");
    RESET();
    one_tensor(&b, tn, 2, (uint64_t[]){4, 0}, 0, 0, 128);
    expect_fail(&b, "zerodim.gguf", CLLM_ERR_FORMAT, "zero-sized");
    RESET();
    one_tensor(&b, tn, 2, (uint64_t[]){1ull << 32, 1ull << 32}, 0, 0, 128);
    expect_fail(&b, "overflow.gguf", CLLM_ERR_FORMAT, "overflows");
    RESET();
    one_tensor(&b, tn, 1, (uint64_t[]){UINT64_MAX}, 0, 0, 128);
    expect_fail(&b, "overflow1.gguf", CLLM_ERR_FORMAT, "overflows");
    RESET();
    one_tensor(&b, tn, 1, (uint64_t[]){1ull << 62}, 0, 0, 128); /* elements fit, bytes do not */
    expect_fail(&b, "bytes_overflow.gguf", CLLM_ERR_FORMAT, "overflows");
    RESET();
    one_tensor(&b, tn, 2, (uint64_t[]){100, 2}, 12, 0, 1024);
    expect_fail(&b, "block.gguf", CLLM_ERR_FORMAT, "not a multiple of the Q4_K block size 256");
    RESET();
    one_tensor(&b, tn, 1, (uint64_t[]){8}, 0, 4, 128);
    expect_fail(&b, "misaligned.gguf", CLLM_ERR_FORMAT, "not a multiple of the alignment 32");
    RESET();
    one_tensor(&b, tn, 2, (uint64_t[]){32, 4}, 0, 0, 511); /* one byte short */
    expect_fail(&b, "pasteof.gguf", CLLM_ERR_FORMAT,
                "tensor 'blk.0.attn_q.weight' data [offset 0 in the data section at 96, 512 "
                "bytes] runs past the end of the file (607 bytes)");
    RESET();
    one_tensor(&b, tn, 1, (uint64_t[]){8}, 0, UINT64_MAX - 31, 128);
    expect_fail(&b, "offset_overflow.gguf", CLLM_ERR_FORMAT, "past the end of the file");
    RESET();
    w_hdr(&b, "GGUF", 3, 2, 0);
    w_tinfo(&b, tn, 1, (uint64_t[]){8}, 0, 0);
    w_tinfo(&b, tn, 1, (uint64_t[]){8}, 0, 32);
    w_pad(&b, 32);
    for (int i = 0; i < 64; i++)
        w_u8(&b, 0);
    expect_fail(&b, "duptensor.gguf", CLLM_ERR_FORMAT,
                "duplicate tensor name 'blk.0.attn_q.weight'");
    RESET();
    /* A long name is cut in the message, which stays short. */
    char longname[300];
    memset(longname, 'n', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    one_tensor(&b, longname, 1, (uint64_t[]){8}, 16, 0, 128);
    expect_fail(&b, "longname.gguf", CLLM_ERR_UNSUPPORTED, "nnn...' has type IQ2_XXS");
    RESET();

    /* Missing file: an I/O error naming it. */
    char path[256], err[512] = "";
    path_of(path, sizeof path, "missing.gguf");
    struct cllm_gguf *g = NULL;
    CHECK(cllm_gguf_open(&g, path, err, sizeof err) == CLLM_ERR_IO && g == NULL);
    CHECKF(strstr(err, path), "%s", err);
    /* NULL err buffer is allowed. */
    CHECK(cllm_gguf_open(&g, path, NULL, 0) == CLLM_ERR_IO);
#undef RESET
}

/* A file with no tensors and no padding after its metadata is valid. */
static void test_minimal(void)
{
    struct cllm_buf b = {0};
    kv_file(&b, 1);
    w_key(&b, "general.architecture", CLLM_GGUF_TYPE_STRING);
    w_str(&b, "qwen2");
    char path[256], err[512] = "";
    path_of(path, sizeof path, "minimal.gguf");
    write_file(path, b.data, b.len);
    struct cllm_gguf *g = NULL;
    CHECKF(cllm_gguf_open(&g, path, err, sizeof err) == CLLM_OK, "%s", err);
    if (g) {
        CHECK(cllm_gguf_n_tensors(g) == 0 && cllm_gguf_n_kv(g) == 1);
        CHECK(cllm_gguf_alignment(g) == 32 && cllm_gguf_data_offset(g) % 32 == 0);
        CHECK(cllm_gguf_tensor(g, 0) == NULL);
        cllm_gguf_free(g);
    }
    unlink(path);
    cllm_buf_free(&b);
}

int main(void)
{
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    fill_tensor_data();
    test_good();
    test_minimal();
    test_truncated();
    test_mutations();
    test_bad();
    rmdir(dir);
    return test_summary();
}
