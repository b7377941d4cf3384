/* What a container lets this process use, which /proc/meminfo, /proc/cpuinfo and sysconf do
 * not show: its cgroup's memory limit (--memory) and CPU quota (--cpus), cgroup v2 or v1. */
#ifndef CLLM_CORE_LIMITS_H
#define CLLM_CORE_LIMITS_H

#include <stdint.h>

/* Bytes of RAM, at most the cgroup v2 memory.max or v1 memory.limit_in_bytes; 0 if unknown. */
uint64_t cllm_memory_limit(void);

/* The limit a cgroup memory file states: v2's "max" and v1's huge "no limit" values (2^60 and
 * up) are 0 (none), as is an unreadable text. */
uint64_t cllm_cgroup_memory_limit(const char *text);

/* Whole cores of this process's cgroup CPU quota (v2's cpu.max, else v1's cfs files); 0 if it
 * has none. */
int cllm_cpu_quota_cores(void);

/* Whole cores of a quota given as cgroup v2's cpu.max text, "QUOTA PERIOD" (v1's cfs_quota_us
 * and cfs_period_us): floor(QUOTA / PERIOD), at least 1; 0 for no quota ("max", a negative v1
 * quota) or an unreadable text. */
int cllm_cgroup_quota_cores(const char *cpu_max);

#endif
