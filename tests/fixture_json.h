/*
 * Loading a JSON fixture from tests/fixtures (CLLM_FIXTURES): the parsed document, or exit(1)
 * with the reason when the file is missing or malformed (a missing fixture is a failure,
 * never a skip). Free with cJSON_Delete.
 */
#ifndef CLLM_TESTS_FIXTURE_JSON_H
#define CLLM_TESTS_FIXTURE_JSON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cjson/cJSON.h>

#include "core/mmap.h"
#include "test.h"

static inline cJSON *test_fixture_json(const char *name)
{
    char path[4096], err[512] = "";
    snprintf(path, sizeof path, "%s/%s", test_env("CLLM_FIXTURES"), name);
    char *text;
    size_t len;
    if (cllm_read_file(path, 64u << 20, &text, &len, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        exit(1);
    }
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root) {
        fprintf(stderr, "%s: not valid JSON\n", path);
        exit(1);
    }
    return root;
}

/* A JSON array of numbers as token ids (malloc'ed; at least one element of room). */
static inline int32_t *test_json_ids(const cJSON *arr, int32_t *n)
{
    *n = cJSON_GetArraySize(arr);
    int32_t *v = malloc((size_t)(*n ? *n : 1) * sizeof *v);
    int32_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) v[i++] = (int32_t)e->valuedouble;
    return v;
}

#endif
