/* How much memory this process may use: the machine's RAM, at most its cgroup's limit (a
 * container's --memory), which /proc/meminfo and sysconf do not show. */
#ifndef CLLM_CORE_MEMORY_LIMIT_H
#define CLLM_CORE_MEMORY_LIMIT_H

#include <stdint.h>

/* Bytes of RAM, at most the cgroup v2 memory.max or v1 memory.limit_in_bytes; 0 if unknown. */
uint64_t cllm_memory_limit(void);

/* The limit a cgroup memory file states: v2's "max" and v1's huge "no limit" values (2^60 and
 * up) are 0 (none), as is an unreadable text. */
uint64_t cllm_cgroup_memory_limit(const char *text);

#endif
