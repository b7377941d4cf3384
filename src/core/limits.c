#include "core/limits.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* The first line of a small file, or NULL. */
static char *read_line(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char *r = fgets(buf, (int)len, f);
    fclose(f);
    return r;
}

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

uint64_t cllm_memory_limit(void)
{
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t limit = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    const char *const files[] = {"/sys/fs/cgroup/memory.max",
                                 "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char line[64];
        const uint64_t c =
            read_line(files[i], line, sizeof line) ? cllm_cgroup_memory_limit(line) : 0;
        if (c && (!limit || c < limit))
            limit = c;
    }
    return limit;
}

int cllm_cgroup_quota_cores(const char *cpu_max)
{
    long long quota, period;
    if (!cpu_max || sscanf(cpu_max, "%lld %lld", &quota, &period) != 2 || quota <= 0 || period <= 0)
        return 0; /* "max ...": no quota; anything else unreadable */
    const long long cores = quota / period;
    return cores < 1 ? 1 : cores > 4096 ? 4096 : (int)cores;
}

int cllm_cpu_quota_cores(void)
{
    char a[128], b[128], both[256];
    if (read_line("/sys/fs/cgroup/cpu.max", a, sizeof a))
        return cllm_cgroup_quota_cores(a);
    static const char *const v1[] = {"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"};
    for (size_t i = 0; i < sizeof v1 / sizeof v1[0]; i++) {
        char qp[96], pp[96];
        snprintf(qp, sizeof qp, "%s/cpu.cfs_quota_us", v1[i]);
        snprintf(pp, sizeof pp, "%s/cpu.cfs_period_us", v1[i]);
        if (read_line(qp, a, sizeof a) && read_line(pp, b, sizeof b)) {
            snprintf(both, sizeof both, "%lld %lld", atoll(a), atoll(b));
            return cllm_cgroup_quota_cores(both);
        }
    }
    return 0;
}
