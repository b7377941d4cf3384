/*
 * A minimal test harness: CHECK records a failure with file:line and goes on; main returns
 * test_summary(), which prints "N passed, N failed" and is non-zero on any failure.
 */
#ifndef CLLM_TESTS_TEST_H
#define CLLM_TESTS_TEST_H

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
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);              \
        }                                                                                          \
    } while (0)

#define CHECKF(cond, ...)                                                                          \
    do {                                                                                           \
        if (cond) {                                                                                \
            test_passed++;                                                                         \
        } else {                                                                                   \
            test_failed++;                                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);              \
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

static inline int test_summary(void)
{
    printf("%d passed, %d failed\n", test_passed, test_failed);
    return test_failed ? 1 : 0;
}

#endif
