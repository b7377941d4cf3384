#include "core/memory_limit.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

uint64_t cllm_cgroup_memory_limit(const char *text)
{
    if (!text)
        return 0;
    char *end;
    const unsigned long long v = strtoull(text, &end, 10);
    if (end == text || (*end && *end != '\n') || v >= (1ull << 60))
        return 0; /* "max", garbage, or v1's PAGE_COUNTER_MAX-like "unlimited" */
    return (uint64_t)v;
}

/* The limit in a cgroup file, 0 if there is none or no file. */
static uint64_t cgroup_file_limit(const char *path)
{
    char line[64];
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    const char *r = fgets(line, sizeof line, f);
    fclose(f);
    return r ? cllm_cgroup_memory_limit(line) : 0;
}

uint64_t cllm_memory_limit(void)
{
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t limit = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    const char *const files[] = {"/sys/fs/cgroup/memory.max",
                                 "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        const uint64_t c = cgroup_file_limit(files[i]);
        if (c && (!limit || c < limit))
            limit = c;
    }
    return limit;
}
