/*
 * A minimal test harness: CHECK records a failure with file:line and goes on; main returns
 * test_summary(), which prints "N passed, N failed" and is non-zero on any failure.
 */
#ifndef CLLM_TESTS_TEST_H
#define CLLM_TESTS_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int test_passed, test_failed;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (cond) {                                                                                \
            test_passed++;                                                                         \
        } else {                                                                                   \
            test_failed++;                                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
        }                                                                                          \
    } while (0)

#define CHECKF(cond, ...)                                                                          \
    do {                                                                                           \
        if (cond) {                                                                                \
            test_passed++;                                                                         \
        } else {                                                                                   \
            test_failed++;                                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

/* The value of a required environment variable; a missing one fails the test (never skips). */
static inline const char *test_env(const char *name)
{
    const char *v = getenv(name);
    if (!v || !*v) {
        fprintf(stderr, "environment variable %s is not set: run the tests through scripts/test\n",
                name);
        exit(1);
    }
    return v;
}

/* Index of the largest value, the lowest index winning ties (as greedy decoding picks). */
static inline int32_t test_argmax(const float *x, int32_t n)
{
    int32_t a = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[a])
            a = i;
    return a;
}

/* A seeded stream of pseudo-random numbers (splitmix64), the same on every machine. */
static inline uint64_t test_splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1), from test_splitmix. */
static inline double test_urand(uint64_t *x)
{
    return (double)(test_splitmix(x) >> 11) * 0x1.0p-53;
}

/* Elementwise |got - want| <= rel * |want| + abs_tol; one failure names the worst element. */
static inline void test_check_close(const char *what, const float *got, const float *want,
                                    int64_t n, double rel, double abs_tol)
{
    int64_t worst = -1;
    double worst_excess = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]), tol = rel * fabs(want[i]) + abs_tol;
        if (!(d <= tol) && (worst < 0 || d - tol > worst_excess))
            worst = i, worst_excess = isnan(d) ? INFINITY : d - tol;
    }
    CHECKF(worst < 0, "%s: element %lld is %.9g, want %.9g", what, (long long)worst,
           worst >= 0 ? got[worst] : 0.0, worst >= 0 ? want[worst] : 0.0);
}

static inline int test_summary(void)
{
    printf("%d passed, %d failed\n", test_passed, test_failed);
    return test_failed ? 1 : 0;
}

#endif
