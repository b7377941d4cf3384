/* The child-process GPU probe of probe.h. */
#include "server/probe.h"

#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/request.h"

extern char **environ;

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static enum cllm_probe_result result_of(int status, double seconds, char *why, size_t why_len)
{
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        snprintf(why, why_len, "the GPU passed in a child process (%.1f s)", seconds);
        return CLLM_PROBE_GPU;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == CLLM_PROBE_EXIT_GPU_ON_CORES) {
        snprintf(why, why_len,
                 "the GPU passed in a child process (%.1f s) with every GEMM on CUDA cores (it "
                 "failed its device check with its own: its log says how)",
                 seconds);
        return CLLM_PROBE_GPU_ON_CORES;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == CLLM_PROBE_EXIT_NO_GPU) {
        snprintf(why, why_len, "no GPU started in a child process");
        return CLLM_PROBE_NO_GPU;
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == CLLM_PROBE_EXIT_CHECK_FAILED)
        snprintf(why, why_len,
                 "the GPU failed its device check in a child process (its log says how)");
    else if (WIFSIGNALED(status))
        snprintf(why, why_len, "the child process that tried the GPU died of signal %d (%s)",
                 WTERMSIG(status), strsignal(WTERMSIG(status)));
    else
        snprintf(why, why_len,
                 "the child process that tried the GPU failed (exit %d; its log says why)",
                 WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    return CLLM_PROBE_FAILED;
}

enum cllm_probe_result cllm_probe_device(const char *exe, const char *model_path,
                                         const struct cllm_engine_config *c, double timeout_s,
                                         const atomic_bool *stop, char *why, size_t why_len)
{
    /* What shapes the device's work; the KV cache stays small: the child only checks. */
    char threads[16], tokens[16], seqs[16], fraction[32];
    const char *argv[20];
    int n = 0;
    argv[n++] = "cllm";
    argv[n++] = "probe-device";
    argv[n++] = "--model";
    argv[n++] = model_path;
    argv[n++] = "--kv-mem";
    argv[n++] = "256M";
    if (c->n_threads > 0) {
        snprintf(threads, sizeof threads, "%d", (int)c->n_threads);
        argv[n++] = "--threads";
        argv[n++] = threads;
    }
    if (c->max_batch_tokens > 0) {
        snprintf(tokens, sizeof tokens, "%d", (int)c->max_batch_tokens);
        argv[n++] = "--batch-tokens";
        argv[n++] = tokens;
    }
    if (c->max_seqs > 0) {
        snprintf(seqs, sizeof seqs, "%d", (int)c->max_seqs);
        argv[n++] = "--max-seqs";
        argv[n++] = seqs;
    }
    if (c->no_device_check)
        argv[n++] = "--no-device-check";
    if (c->gpu_mem_fraction > 0) {
        snprintf(fraction, sizeof fraction, "%.9g", (double)c->gpu_mem_fraction);
        argv[n++] = "--gpu-mem-fraction";
        argv[n++] = fraction;
    }
    argv[n] = NULL;

    const double t0 = cllm_now();
    pid_t pid;
    int rc = posix_spawn(&pid, exe, NULL, NULL, (char *const *)argv, environ);
    if (rc != 0) {
        snprintf(why, why_len, "cannot start %s for the GPU probe: %s", exe, strerror(rc));
        return CLLM_PROBE_FAILED;
    }
    for (;;) {
        int status = 0;
        pid_t got = waitpid(pid, &status, WNOHANG);
        if (got == pid)
            return result_of(status, cllm_now() - t0, why, why_len);
        if (got < 0 && errno != EINTR) {
            snprintf(why, why_len, "waiting for the GPU probe: %s", strerror(errno));
            return CLLM_PROBE_FAILED;
        }
        const bool stopping = stop && atomic_load(stop);
        if (stopping || cllm_now() - t0 > timeout_s) {
            kill(pid, SIGKILL);
            /* A process stuck in a driver call may not die at once: do not wait for it. */
            for (int i = 0; i < 50 && waitpid(pid, &status, WNOHANG) == 0; i++)
                sleep_ms(20);
            if (stopping)
                snprintf(why, why_len, "the server is stopping");
            else
                snprintf(why, why_len,
                         "the child process that tried the GPU did not finish in %.0f s "
                         "(--gpu-probe-timeout): killed",
                         timeout_s);
            return CLLM_PROBE_FAILED;
        }
        sleep_ms(20);
    }
}
