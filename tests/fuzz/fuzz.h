/*
 * What every fuzz target shares. A target defines LLVMFuzzerTestOneInput and fuzz_full_stage
 * (and may define LLVMFuzzerInitialize); it is linked either with libFuzzer (clang,
 * -fsanitize=fuzzer: coverage-guided, scripts/fuzz) or with fuzz_main.c (any compiler: the
 * committed corpus plus seeded random mutations of it, a CTest under ASan/UBSan).
 *
 * Each target has a dictionary, tests/fuzz/dict/<target>.dict in libFuzzer's format: tokens of
 * its format that random bytes would rarely hit, which both drivers splice into inputs.
 *
 * A target checks properties, not just survival: FUZZ_ASSERT aborts with the file and line,
 * which both drivers report as a crash with the input that caused it.
 */
#ifndef CLLM_TESTS_FUZZ_H
#define CLLM_TESTS_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cllm.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_ASSERT(cond, ...)                                                                     \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: fuzz property failed: %s: ", __FILE__, __LINE__, #cond);       \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* How far the last input got: a target sets fuzz_stage to the number of its readers that
 * accepted the input, fuzz_full_stage being all of them. Every seed of the corpus must get all
 * the way (fuzz_main.c checks), so the mutations start from inputs that reach the deep code. */
extern int fuzz_stage;
extern const int fuzz_full_stage;

/* The verdict of a reader that was given err (emptied before the call) and returned st: true
 * if it accepted the input, which then counts as one more reader passed (fuzz_stage). A
 * refusal must name its reason in err and leave no result (refused_clean: the caller's output
 * pointer is NULL, or true where there is none); what names the reader in the failure. */
bool fuzz_accepted(enum cllm_status st, const char *err, bool refused_clean, const char *what);

/* An in-memory file holding data[0..size) and its path in path[0..path_len): the parsers under
 * test open files by path and map them, as they do with models. Returns the descriptor, to
 * close after use, or -1 if the kernel refuses (the target then skips the input). */
int fuzz_memfile(const uint8_t *data, size_t size, char *path, size_t path_len);

#endif
