/*
 * Row dequantizers: bit-exact against gguf-py on tests/fixtures/dequant.json (random blocks of
 * every dtype plus real blocks of the small Qwen GGUF; see gen_dequant.py), block struct sizes
 * against the traits table, rejection of bad lengths, and F16/BF16 over all 65536 patterns.
 * Sources sit in buffers of exactly the row's bytes, so ASan catches any read past the row.
 */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <string.h>

#include "core/f16.h"
#include "core/mmap.h"
#include "tensor/dtype.h"
#include "tensor/quant.h"
#include "test.h"

static void test_block_sizes(void)
{
    static const struct {
        enum cllm_dtype t;
        size_t size;
        uint32_t block;
    } blocks[] = {
        {CLLM_DTYPE_Q8_0, sizeof(struct cllm_block_q8_0), CLLM_QK},
        {CLLM_DTYPE_Q4_0, sizeof(struct cllm_block_q4_0), CLLM_QK},
        {CLLM_DTYPE_Q4_1, sizeof(struct cllm_block_q4_1), CLLM_QK},
        {CLLM_DTYPE_Q5_0, sizeof(struct cllm_block_q5_0), CLLM_QK},
        {CLLM_DTYPE_Q5_1, sizeof(struct cllm_block_q5_1), CLLM_QK},
        {CLLM_DTYPE_Q4_K, sizeof(struct cllm_block_q4_k), CLLM_QK_K},
        {CLLM_DTYPE_Q5_K, sizeof(struct cllm_block_q5_k), CLLM_QK_K},
        {CLLM_DTYPE_Q6_K, sizeof(struct cllm_block_q6_k), CLLM_QK_K},
    };
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) {
        const struct cllm_dtype_traits *tr = cllm_dtype_traits(blocks[i].t);
        CHECKF(tr && tr->type_size == blocks[i].size && tr->block_size == blocks[i].block, "%s",
               cllm_dtype_name(blocks[i].t));
    }
}

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* Decodes len bytes of lowercase hex into out; false on a bad digit. */
static bool hex_decode(const char *s, uint8_t *out, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        int hi = hex_digit(s[2 * i]), lo = hex_digit(s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

static bool dtype_by_name(const char *name, enum cllm_dtype *out)
{
    for (int t = 0; t < CLLM_DTYPE_COUNT; t++) {
        if (strcmp(cllm_dtype_name((enum cllm_dtype)t), name) == 0) {
            *out = (enum cllm_dtype)t;
            return true;
        }
    }
    return false;
}

/* Index of the first element whose bits differ, or -1. */
static int64_t first_mismatch(const float *got, const uint32_t *want, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (cllm_f32_to_bits(got[i]) != want[i])
            return i;
    return -1;
}

/* Dequantizes src (copied into an exact-size buffer at byte offset `shift`) and compares. */
static void check_row(const char *name, enum cllm_dtype t, const uint8_t *src, size_t bytes,
                      const uint32_t *want, int64_t n, size_t shift)
{
    uint8_t *buf = malloc(bytes + shift);
    float *dst = malloc((size_t)n * sizeof(float));
    if (!buf || !dst) {
        CHECK(!"out of memory");
        goto out;
    }
    memcpy(buf + shift, src, bytes);
    CHECKF(cllm_dequant_row(t, buf + shift, dst, n), "%s n=%lld", name, (long long)n);
    int64_t bad = first_mismatch(dst, want, n);
    CHECKF(bad < 0, "%s (n=%lld, shift %zu): element %lld is %08x, gguf-py says %08x", name,
           (long long)n, shift, (long long)bad, bad < 0 ? 0 : cllm_f32_to_bits(dst[bad]),
           bad < 0 ? 0 : want[bad]);
out:
    free(buf);
    free(dst);
}

/* One fixture case: the whole row, the row at an odd address, and its first block alone. */
static void check_case(const cJSON *c, bool covered[CLLM_DTYPE_COUNT], int *n_real)
{
    const cJSON *name = cJSON_GetObjectItem(c, "name");
    const cJSON *dtype = cJSON_GetObjectItem(c, "dtype");
    const cJSON *jn = cJSON_GetObjectItem(c, "n");
    const cJSON *src = cJSON_GetObjectItem(c, "src");
    const cJSON *exp = cJSON_GetObjectItem(c, "expected");
    enum cllm_dtype t;
    uint64_t bytes;
    if (!cJSON_IsString(name) || !cJSON_IsString(dtype) || !cJSON_IsNumber(jn) ||
        !cJSON_IsString(src) || !cJSON_IsArray(exp)) {
        CHECK(!"malformed fixture case");
        return;
    }
    int64_t n = (int64_t)jn->valuedouble;
    if (!dtype_by_name(dtype->valuestring, &t) || !cllm_dtype_row_bytes(t, n, &bytes) ||
        strlen(src->valuestring) != 2 * bytes || cJSON_GetArraySize(exp) != n) {
        CHECKF(false, "%s: dtype, n, src and expected disagree", name->valuestring);
        return;
    }

    uint8_t *raw = malloc(bytes);
    uint32_t *want = malloc((size_t)n * sizeof(uint32_t));
    if (!raw || !want) {
        CHECK(!"out of memory");
        goto out;
    }
    if (!hex_decode(src->valuestring, raw, bytes)) {
        CHECKF(false, "%s: bad hex in src", name->valuestring);
        goto out;
    }
    int64_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, exp)
    {
        uint8_t b[4];
        if (!cJSON_IsString(e) || strlen(e->valuestring) != 8 ||
            !hex_decode(e->valuestring, b, 4)) {
            CHECKF(false, "%s: bad expected value %lld", name->valuestring, (long long)i);
            goto out;
        }
        want[i++] = (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
    }

    const struct cllm_dtype_traits *tr = cllm_dtype_traits(t);
    check_row(name->valuestring, t, raw, bytes, want, n, 0);
    check_row(name->valuestring, t, raw, bytes, want, n, 1);
    if ((int64_t)tr->block_size < n) /* a prefix of the row is a row too */
        check_row(name->valuestring, t, raw, tr->type_size, want, tr->block_size, 0);
    covered[t] = true;
    if (strncmp(name->valuestring, "real ", 5) == 0)
        (*n_real)++;
out:
    free(raw);
    free(want);
}

static void test_fixture(void)
{
    char path[4096], err[256];
    char *text = NULL;
    size_t len;
    snprintf(path, sizeof path, "%s/dequant.json", test_env("CLLM_FIXTURES"));
    if (cllm_read_file(path, 16u << 20, &text, &len, err, sizeof err) != CLLM_OK) {
        CHECKF(false, "%s", err);
        return;
    }
    cJSON *doc = cJSON_Parse(text);
    const cJSON *cases = cJSON_GetObjectItem(doc, "cases");
    CHECKF(cJSON_IsArray(cases), "%s: no cases array", path);

    bool covered[CLLM_DTYPE_COUNT] = {false};
    int n_real = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cases)
    {
        check_case(c, covered, &n_real);
    }
    for (int t = 0; t < CLLM_DTYPE_COUNT; t++)
        CHECKF(covered[t], "the fixture has no case for %s", cllm_dtype_name((enum cllm_dtype)t));
    /* F32, Q5_0, Q8_0, Q4_K and Q6_K blocks of the real model. */
    CHECKF(n_real >= 5, "the fixture has %d real cases; regenerate it with the GGUF present",
           n_real);
    cJSON_Delete(doc);
    free(text);
}

/* Bad lengths and dtypes are refused without touching dst. */
static void test_rejects(void)
{
    uint8_t src[2 * 210] = {0};
    float dst[2 * 256];
    const float sentinel = -12345.0f;
    for (int t = 0; t < CLLM_DTYPE_COUNT; t++) {
        const struct cllm_dtype_traits *tr = cllm_dtype_traits((enum cllm_dtype)t);
        int64_t bs = tr->block_size;
        /* Non-positive lengths for all; partial blocks where blocks have more than 1 element. */
        int64_t bad[] = {0, -bs, -1, INT64_MIN, bs + 1, bs / 2, 3 * bs / 2, bs - 1};
        size_t n_bad = bs > 1 ? sizeof bad / sizeof bad[0] : 4;
        for (size_t i = 0; i < n_bad; i++) {
            for (size_t j = 0; j < sizeof dst / sizeof dst[0]; j++)
                dst[j] = sentinel;
            CHECKF(!cllm_dequant_row((enum cllm_dtype)t, src, dst, bad[i]), "%s n=%lld", tr->name,
                   (long long)bad[i]);
            bool untouched = true;
            for (size_t j = 0; j < sizeof dst / sizeof dst[0]; j++)
                untouched &= dst[j] == sentinel;
            CHECKF(untouched, "%s n=%lld wrote dst", tr->name, (long long)bad[i]);
        }
        CHECKF(cllm_dequant_row((enum cllm_dtype)t, src, dst, 2 * bs), "%s two blocks", tr->name);
    }
    CHECK(!cllm_dequant_row(CLLM_DTYPE_COUNT, src, dst, 32));
    CHECK(!cllm_dequant_row((enum cllm_dtype)(-1), src, dst, 32));
    /* A row whose byte size overflows 64 bits. */
    CHECK(!cllm_dequant_row(CLLM_DTYPE_F32, src, dst, INT64_MAX));
}

/* Every F16 and BF16 pattern in one row: exact widening, and narrowing back gives the input. */
static void test_half_roundtrip(void)
{
    enum { N = 65536 };
    uint8_t *src = malloc(2 * N);
    float *dst = malloc(N * sizeof(float));
    if (!src || !dst) {
        CHECK(!"out of memory");
        goto out;
    }
    for (uint32_t i = 0; i < N; i++) {
        src[2 * i] = (uint8_t)i;
        src[2 * i + 1] = (uint8_t)(i >> 8);
    }
    CHECK(cllm_dequant_row(CLLM_DTYPE_F16, src, dst, N));
    int bad_f16 = 0, bad_bf16 = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint16_t h = (uint16_t)i;
        bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        if (cllm_f32_to_bits(dst[i]) != cllm_f32_to_bits(cllm_f16_to_f32(h)))
            bad_f16++;
        else if (nan ? dst[i] == dst[i] : cllm_f32_to_f16(dst[i]) != h)
            bad_f16++;
    }
    CHECKF(bad_f16 == 0, "%d F16 patterns do not round-trip", bad_f16);
    /* A few known values, independent of core/f16.h. */
    CHECK(dst[0x3c00] == 1.0f && dst[0xc000] == -2.0f && dst[0x7bff] == 65504.0f);
    CHECK(dst[0x0001] == 0x1p-24f && cllm_f32_to_bits(dst[0x8000]) == 0x80000000u);

    CHECK(cllm_dequant_row(CLLM_DTYPE_BF16, src, dst, N));
    for (uint32_t i = 0; i < N; i++) {
        uint16_t h = (uint16_t)i;
        bool nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
        if (cllm_f32_to_bits(dst[i]) != i << 16 || (!nan && cllm_f32_to_bf16(dst[i]) != h))
            bad_bf16++;
    }
    CHECKF(bad_bf16 == 0, "%d BF16 patterns do not round-trip", bad_bf16);
out:
    free(src);
    free(dst);
}

/* Hand-made blocks whose values follow from the layout alone, so a wrong reading of the layout
 * shared by generator and dequantizer would still show. */
static void test_known_blocks(void)
{
    float y[CLLM_QK_K];

    struct cllm_block_q8_0 q8 = {.d = 0x3800}; /* 0.5 */
    for (int j = 0; j < CLLM_QK; j++)
        q8.qs[j] = (int8_t)(j * 8 - 128);
    CHECK(cllm_dequant_row(CLLM_DTYPE_Q8_0, &q8, y, CLLM_QK));
    CHECK(y[0] == -64.0f && y[16] == 0.0f && y[31] == 60.0f);

    struct cllm_block_q4_0 q4 = {.d = 0x3c00}; /* 1.0 */
    for (int j = 0; j < CLLM_QK / 2; j++)
        q4.qs[j] = (uint8_t)(j | (15 - j) << 4);
    CHECK(cllm_dequant_row(CLLM_DTYPE_Q4_0, &q4, y, CLLM_QK));
    CHECK(y[0] == -8.0f && y[15] == 7.0f && y[16] == 7.0f && y[31] == -8.0f);

    /* Q5_0: element 31's 5th bit set, all nibbles 0xF: element 31 = 31 - 16, the rest -1. */
    struct cllm_block_q5_0 q5 = {.d = 0x3c00, .qh = {0, 0, 0, 0x80}};
    memset(q5.qs, 0xff, sizeof q5.qs);
    CHECK(cllm_dequant_row(CLLM_DTYPE_Q5_0, &q5, y, CLLM_QK));
    CHECK(y[31] == 15.0f && y[30] == -1.0f && y[0] == -1.0f);

    /* Q4_K: d = 1, dmin = 1; sub-block 5 has scale 2 + 16 and minimum 3 + 32 (top bits packed
     * into bytes 1 and 5); its qs nibbles (high nibbles of qs[64..95]) are 1. */
    struct cllm_block_q4_k k4 = {.d = 0x3c00, .dmin = 0x3c00};
    k4.scales[1] = 1 << 6;     /* sc[5] bits 4-5 = 01 */
    k4.scales[5] = 2 << 6;     /* m[5]  bits 4-5 = 10 */
    k4.scales[9] = 2 | 3 << 4; /* sc[5] low = 2, m[5] low = 3 */
    memset(k4.qs + 64, 0x10, 32);
    CHECK(cllm_dequant_row(CLLM_DTYPE_Q4_K, &k4, y, CLLM_QK_K));
    CHECK(y[160] == 18.0f - 35.0f && y[191] == 18.0f - 35.0f && y[128] == 0.0f && y[255] == 0.0f);

    /* Q6_K: d = 1, scale of sub-block 13 (elements 208..223) = -1; element 208 is lane 16 of
     * group 2 of half 1: high nibble of ql[64 + 16], bits 4-5 of qh[32 + 16]. */
    struct cllm_block_q6_k k6 = {.d = 0x3c00};
    memset(k6.ql, 0x22, sizeof k6.ql); /* every q = 2 (high bits 0): x = sc * -30 */
    k6.scales[13] = -1;
    k6.ql[80] = 0xf2;
    k6.qh[48] = 3 << 4;
    CHECK(cllm_dequant_row(CLLM_DTYPE_Q6_K, &k6, y, CLLM_QK_K));
    CHECK(y[208] == -(63.0f - 32.0f) && y[209] == 30.0f && y[0] == 0.0f);
}

int main(void)
{
    test_block_sizes();
    test_fixture();
    test_rejects();
    test_half_roundtrip();
    test_known_blocks();
    return test_summary();
}
