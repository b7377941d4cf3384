/*
 * Logging to stderr with a process-wide level: the one global the conventions allow.
 */
#ifndef CLLM_CORE_LOG_H
#define CLLM_CORE_LOG_H

enum cllm_log_level {
    CLLM_LOG_ERROR = 0,
    CLLM_LOG_WARN,
    CLLM_LOG_INFO,
    CLLM_LOG_DEBUG,
};

void cllm_log_set_level(enum cllm_log_level level);
void cllm_log(enum cllm_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
