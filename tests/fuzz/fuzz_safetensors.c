/*
 * Fuzz target: a .safetensors file. The reader (model/safetensors.c) must reject a malformed
 * header or lying offsets with an error text; every tensor it accepts must have a unique name
 * and exactly the bytes its dtype and shape imply, inside the file.
 */
#include "fuzz.h"

#include <unistd.h>

#include "model/safetensors.h"
#include "tensor/dtype.h"

const int fuzz_full_stage = 1;

static uint64_t sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64], err[512];
    const int fd = fuzz_memfile(data, size, path, sizeof path);
    if (fd < 0)
        return 0;
    struct cllm_st_set *set = NULL;
    err[0] = 0;
    const enum cllm_status st = cllm_st_open_file(&set, path, err, sizeof err);
    if (fuzz_accepted(st, err, set == NULL, "the safetensors reader")) {
        for (size_t i = 0; i < cllm_st_count(set); i++) {
            const struct cllm_tensor *t = cllm_st_tensor(set, i);
            FUZZ_ASSERT(cllm_st_find(set, t->name) == t, "tensor %s is not found by its name",
                        t->name);
            uint64_t want = 0;
            FUZZ_ASSERT(cllm_dtype_row_bytes(t->dtype, cllm_tensor_nelements(t), &want) &&
                            want == t->nbytes,
                        "tensor %s: %llu bytes for %lld elements", t->name,
                        (unsigned long long)t->nbytes, (long long)cllm_tensor_nelements(t));
            FUZZ_ASSERT(t->nbytes <= size, "tensor %s is larger than the file", t->name);
            if (t->nbytes)
                sink += ((const uint8_t *)t->data)[0] + ((const uint8_t *)t->data)[t->nbytes - 1];
        }
        cllm_st_free(set);
    }
    close(fd);
    return 0;
}
