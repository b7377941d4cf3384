/* Level-filtered log lines on stderr, one write per line so threads do not interleave. Each
 * names its process: the server's keeper, the server and its GPU probe share one stderr. */
#include "core/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

static enum cllm_log_level g_level = CLLM_LOG_INFO;

void cllm_log_set_level(enum cllm_log_level level)
{
    g_level = level;
}

void cllm_log(enum cllm_log_level level, const char *fmt, ...)
{
    static const char *const names[] = {"error", "warn", "info", "debug"};
    if (level > g_level)
        return;
    char line[1024];
    int n = snprintf(line, sizeof line, "cllm[%ld] %s: ", (long)getpid(), names[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}
