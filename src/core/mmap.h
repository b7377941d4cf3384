/*
 * Read-only file mapping. Model files are mapped, never copied: opening the 1.5B GGUF costs
 * page-table setup, not 1 GB of reads. Also a bounded whole-file reader for small JSON files.
 */
#ifndef CLLM_CORE_MMAP_H
#define CLLM_CORE_MMAP_H

#include <stddef.h>
#include <stdint.h>

#include "cllm.h"

struct cllm_mmap {
    const uint8_t *data; /* mapped bytes; NULL for an empty file */
    uint64_t size;       /* file size in bytes */
};

/* Maps path read-only. Errors name the path and the system error. */
enum cllm_status cllm_mmap_open(struct cllm_mmap *m, const char *path, char *err, size_t err_len);
void cllm_mmap_close(struct cllm_mmap *m);

/* Reads a whole file into a malloc'd NUL-terminated buffer (*out, *len); fails with
 * CLLM_ERR_RANGE if the file is larger than max_bytes. */
enum cllm_status cllm_read_file(const char *path, size_t max_bytes, char **out, size_t *len,
                                char *err, size_t err_len);

#endif
