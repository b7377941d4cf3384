/*
 * The default thread count (cllm_cpu_physical_cores): physical cores from /proc/cpuinfo text
 * among the CPUs an affinity mask allows (hyperthread siblings count once), a cgroup CPU
 * quota's whole cores, and the process itself pinned to one CPU getting one thread.
 */
#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "backend/cpu/threadpool.h"
#include "core/limits.h"
#include "test.h"

/* Two sockets of two cores of two hyperthreads: processor p is socket p / 4, core (p / 2) % 2
 * (siblings p and p + 1 share a core). */
static const char cpuinfo_2x2x2[] = "processor\t: 0\nphysical id\t: 0\ncore id\t\t: 0\n\n"
                                    "processor\t: 1\nphysical id\t: 0\ncore id\t\t: 0\n\n"
                                    "processor\t: 2\nphysical id\t: 0\ncore id\t\t: 1\n\n"
                                    "processor\t: 3\nphysical id\t: 0\ncore id\t\t: 1\n\n"
                                    "processor\t: 4\nphysical id\t: 1\ncore id\t\t: 0\n\n"
                                    "processor\t: 5\nphysical id\t: 1\ncore id\t\t: 0\n\n"
                                    "processor\t: 6\nphysical id\t: 1\ncore id\t\t: 1\n\n"
                                    "processor\t: 7\nphysical id\t: 1\ncore id\t\t: 1\n";

static int cores_of(const char *text, const int *cpus, int n_cpus)
{
    FILE *f = fmemopen((void *)text, strlen(text), "r");
    if (!f)
        return -1;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = 0; i < n_cpus; i++)
        CPU_SET((size_t)cpus[i], &set);
    int n = cllm_cpuinfo_cores(f, n_cpus >= 0 ? &set : NULL);
    fclose(f);
    return n;
}

static void test_cpuinfo(void)
{
    CHECK(cores_of(cpuinfo_2x2x2, NULL, -1) == 4);
    CHECK(cores_of(cpuinfo_2x2x2, (const int[]){0, 1}, 2) == 1); /* siblings */
    CHECK(cores_of(cpuinfo_2x2x2, (const int[]){0, 2}, 2) == 2);
    CHECK(cores_of(cpuinfo_2x2x2, (const int[]){1, 5}, 2) == 2); /* two sockets' core 0 */
    CHECK(cores_of(cpuinfo_2x2x2, (const int[]){4, 5, 6, 7}, 4) == 2);
    CHECK(cores_of(cpuinfo_2x2x2, (const int[]){9}, 1) == 0); /* a CPU it does not list */
    /* no core ids (some VMs): the caller falls back to counting CPUs */
    CHECK(cores_of("processor\t: 0\nmodel name\t: x\n", NULL, -1) == 0);
}

static void test_quota(void)
{
    CHECK(cllm_cgroup_quota_cores("max 100000\n") == 0);
    CHECK(cllm_cgroup_quota_cores("1500000 100000\n") == 15); /* docker --cpus 15 */
    CHECK(cllm_cgroup_quota_cores("1550000 100000") == 15);   /* whole cores only */
    CHECK(cllm_cgroup_quota_cores("50000 100000") == 1);      /* at least one */
    CHECK(cllm_cgroup_quota_cores("-1 100000") == 0);         /* v1: no quota */
    CHECK(cllm_cgroup_quota_cores("") == 0);
    CHECK(cllm_cgroup_quota_cores("garbage") == 0);
    CHECK(cllm_cgroup_quota_cores("100000 0") == 0);
    CHECK(cllm_cgroup_quota_cores(NULL) == 0);
}

/* Pinned to one CPU, the process gets one thread whatever the machine has. */
static void test_pinned(void)
{
    cpu_set_t old, one;
    CHECK(sched_getaffinity(0, sizeof old, &old) == 0);
    const int all = cllm_cpu_physical_cores();
    CHECKF(all >= 1 && all <= CPU_COUNT(&old), "%d cores of %d CPUs", all, CPU_COUNT(&old));
    int first = 0;
    while (first < CPU_SETSIZE && !CPU_ISSET((size_t)first, &old))
        first++;
    CPU_ZERO(&one);
    CPU_SET((size_t)first, &one);
    CHECK(sched_setaffinity(0, sizeof one, &one) == 0);
    CHECKF(cllm_cpu_physical_cores() == 1, "pinned to CPU %d: %d cores", first,
           cllm_cpu_physical_cores());
    CHECK(sched_setaffinity(0, sizeof old, &old) == 0);
    printf("default threads here: %d (of %d CPUs allowed)\n", all, CPU_COUNT(&old));
}

int main(void)
{
    test_cpuinfo();
    test_quota();
    test_pinned();
    return test_summary();
}
