/* Core utilities: overflow-checked sizes, buffers, hash maps, f16/bf16 conversions, mmap,
 * the retry backoff. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "core/alloc.h"
#include "core/backoff.h"
#include "core/buf.h"
#include "core/f16.h"
#include "core/hashmap.h"
#include "core/limits.h"
#include "core/mmap.h"
#include "core/status.h"
#include "test.h"

static void test_overflow(void)
{
    uint64_t r;
    CHECK(cllm_mul_u64(1ULL << 32, 1ULL << 31, &r) && r == 1ULL << 63);
    CHECK(!cllm_mul_u64(1ULL << 32, 1ULL << 32, &r));
    /* growing arrays: doubling from the first capacity, need itself past SIZE_MAX / 2 */
    CHECK(cllm_grow_cap(0, 5, 16) == 16 && cllm_grow_cap(16, 17, 16) == 32);
    CHECK(cllm_grow_cap(0, 100, 16) == 128 && cllm_grow_cap(64, 10, 16) == 64);
    CHECK(cllm_grow_cap(0, 0, 0) == 1);
    CHECK(cllm_grow_cap(SIZE_MAX / 2 + 1, SIZE_MAX, 1) == SIZE_MAX);
    CHECK(!cllm_add_u64(UINT64_MAX, 1, &r));
    CHECK(cllm_malloc_array(SIZE_MAX / 2, 3) == NULL);
    CHECK(cllm_calloc_array(SIZE_MAX / 2, 3) == NULL);
}

static void test_buf(void)
{
    struct cllm_buf b = {0};
    for (int i = 0; i < 1000; i++)
        CHECK(cllm_buf_appendf(&b, "%d,", i) == CLLM_OK);
    CHECK(strncmp(b.data, "0,1,2,", 6) == 0);
    CHECK(b.data[b.len] == '\0');
    cllm_buf_free(&b);
    struct cllm_ids ids = {0};
    for (int32_t i = 0; i < 100000; i++)
        cllm_ids_push(&ids, i);
    CHECK(ids.n == 100000 && ids.v[99999] == 99999);
    cllm_ids_free(&ids);
}

static void test_maps(void)
{
    struct cllm_strmap m = {0};
    static char keys[5000][16];
    for (int i = 0; i < 5000; i++) {
        snprintf(keys[i], sizeof keys[i], "k%d", i);
        CHECK(cllm_strmap_put(&m, keys[i], strlen(keys[i]), (uint64_t)i * 7) == CLLM_OK);
    }
    uint64_t v = 0;
    CHECK(cllm_strmap_get(&m, "k4321", 5, &v) && v == 4321 * 7);
    CHECK(!cllm_strmap_get(&m, "k5000", 5, &v));
    CHECK(cllm_strmap_put(&m, "", 0, 42) == CLLM_OK);
    CHECK(cllm_strmap_get(&m, "", 0, &v) && v == 42);
    CHECK(m.len == 5001);
    cllm_strmap_free(&m);

    struct cllm_u64map u = {0};
    for (uint64_t i = 0; i < 20000; i++)
        cllm_u64map_put(&u, i << 32 | (i * 3), i);
    CHECK(cllm_u64map_get(&u, 777ULL << 32 | 2331, &v) && v == 777);
    CHECK(!cllm_u64map_get(&u, 777ULL << 32 | 2332, &v));
    cllm_u64map_free(&u);

    /* Random inserts and deletes against a plain array: deletion must keep every other key
     * findable (backward-shift deletion across wrap-around). */
    enum { KEYS = 3000 };
    static bool present[KEYS];
    struct cllm_u64map d = {0};
    uint64_t r = 12345;
    int bad = 0;
    for (int step = 0; step < 200000; step++) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        uint64_t key = (r >> 33) % KEYS;
        if ((r >> 20) & 1) {
            cllm_u64map_put(&d, key * 0x10001, key);
            present[key] = true;
        } else {
            bool was = cllm_u64map_del(&d, key * 0x10001);
            bad += was != present[key];
            present[key] = false;
        }
        if (step % 20000 == 0)
            for (uint64_t k = 0; k < KEYS; k++)
                bad += cllm_u64map_get(&d, k * 0x10001, &v) != present[k];
    }
    size_t n_present = 0;
    for (int k = 0; k < KEYS; k++)
        n_present += present[k];
    CHECK(bad == 0 && d.len == n_present);
    cllm_u64map_free(&d);
}

static void test_half(void)
{
    /* Exhaustive: every finite half widens and narrows back to itself. */
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = cllm_f16_to_f32((uint16_t)h);
        if (isnan(f))
            continue;
        if (cllm_f32_to_f16(f) != h)
            bad++;
    }
    CHECK(bad == 0);
    CHECK(cllm_f16_to_f32(0x3c00) == 1.0f);
    CHECK(cllm_f16_to_f32(0x0001) == 5.9604645e-8f);
    CHECK(cllm_f32_to_f16(65520.0f) == 0x7c00);
    CHECK(cllm_f32_to_f16(65519.0f) == 0x7bff);
    CHECK(cllm_f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00);   /* tie rounds to even */
    CHECK(cllm_f32_to_f16(1.0f + 3.0f / 2048) == 0x3c02);   /* tie rounds to even (up) */
    CHECK(cllm_bf16_to_f32(0x3f80) == 1.0f);
    CHECK(cllm_f32_to_bf16(1.0f + 1.0f / 256) == 0x3f80);   /* tie to even */
    CHECK(cllm_f32_to_bf16(1.0f + 3.0f / 256) == 0x3f82);
    CHECK(isnan(cllm_bf16_to_f32(cllm_f32_to_bf16(NAN))));
}

static void test_mmap_errors(void)
{
    char err[256] = "";
    struct cllm_mmap m;
    CHECK(cllm_mmap_open(&m, "/nonexistent/file", err, sizeof err) == CLLM_ERR_IO);
    CHECK(strstr(err, "/nonexistent/file") != NULL);
    CHECK(cllm_mmap_open(&m, "/tmp", err, sizeof err) == CLLM_ERR_IO);
    char *data;
    size_t len;
    CHECK(cllm_read_file("/proc/self/exe", 10, &data, &len, err, sizeof err) == CLLM_ERR_RANGE);
}

/* The memory limit: cgroup texts parsed as the kernel writes them; the process's own limit is
 * known and no more than the machine's RAM. */
static void test_memory_limit(void)
{
    CHECK(cllm_cgroup_memory_limit("max\n") == 0);
    CHECK(cllm_cgroup_memory_limit("17179869184\n") == 17179869184ull); /* --memory 16g */
    CHECK(cllm_cgroup_memory_limit("9223372036854771712\n") == 0);       /* v1: no limit */
    CHECK(cllm_cgroup_memory_limit("") == 0);
    CHECK(cllm_cgroup_memory_limit("12k") == 0);
    CHECK(cllm_cgroup_memory_limit(NULL) == 0);
    const uint64_t ram = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    const uint64_t limit = cllm_memory_limit();
    CHECKF(limit > 0 && limit <= ram, "limit %llu of %llu bytes of RAM",
           (unsigned long long)limit, (unsigned long long)ram);
}

/* Waits after failures: the first, then doubled only by the failure of a try, up to 16x. */
static void test_backoff(void)
{
    struct cllm_backoff b;
    cllm_backoff_init(&b, 256);
    CHECK(cllm_backoff_failed(&b) == 256);
    CHECK(cllm_backoff_failed(&b) == 256); /* failed again before any try: no doubling */
    const int64_t want[] = {512, 1024, 2048, 4096, 4096, 4096};
    for (int i = 0; i < 6; i++) {
        cllm_backoff_tried(&b);
        int64_t w = cllm_backoff_failed(&b);
        CHECKF(w == want[i], "try %d failed: wait %lld, want %lld", i, (long long)w,
               (long long)want[i]);
    }
    cllm_backoff_init(&b, 3); /* not a power of two: the cap is still 16x */
    for (int i = 0; i < 8; i++) {
        cllm_backoff_tried(&b);
        (void)cllm_backoff_failed(&b);
    }
    CHECK(b.wait == 48);
    cllm_backoff_init(&b, 5); /* a reset forgets the doubling */
    CHECK(cllm_backoff_failed(&b) == 5);
    cllm_backoff_init(&b, 0);
    CHECK(cllm_backoff_failed(&b) == 1);
    cllm_backoff_init(&b, -7);
    CHECK(cllm_backoff_failed(&b) == 1);
    cllm_backoff_init(&b, INT64_MAX); /* no overflow at the cap */
    cllm_backoff_tried(&b);
    CHECK(cllm_backoff_failed(&b) > 0);
}

int main(void)
{
    test_backoff();
    test_memory_limit();
    test_overflow();
    test_buf();
    test_maps();
    test_half();
    test_mmap_errors();
    return test_summary();
}
