/* The fault-injecting wrapper of fault.h. It shares the wrapped backend's ctx, so the wrapped
 * ops run unchanged; only the calls a lost device would fail on are replaced, and matmul (a
 * device short of memory). Enabled by CLLM_FAULT_FILE (backend.c): never on unless a test
 * asks. */
#include "backend/fault.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"

struct fault {
    struct cllm_backend be; /* first: the ops get this pointer back */
    struct cllm_backend_iface iface;
    struct cllm_backend *inner;
    char *trigger;
    bool lost;
};

static struct fault *fault_of(struct cllm_backend *be)
{
    return (struct fault *)be;
}

static bool lost(struct fault *f)
{
    if (!f->lost && access(f->trigger, F_OK) == 0) {
        cllm_log(CLLM_LOG_ERROR, "fault: %s exists: the device is lost from now on", f->trigger);
        f->lost = true;
    }
    return f->lost;
}

/* CLLM_FAULT_ONCE=1: the file fails one sync and is removed; the device works on. */
static bool fails_once(struct fault *f)
{
    const char *once = getenv("CLLM_FAULT_ONCE");
    if (!once || strcmp(once, "1") != 0 || unlink(f->trigger) != 0)
        return false;
    cllm_log(CLLM_LOG_ERROR, "fault: %s existed: one sync fails", f->trigger);
    return true;
}

/* CLLM_FAULT_STALL=1: a sync waits for as long as the file exists, then works on: a device
 * that stops answering without an error. */
static bool stalls(struct fault *f)
{
    const char *stall = getenv("CLLM_FAULT_STALL");
    if (!stall || strcmp(stall, "1") != 0)
        return false;
    if (access(f->trigger, F_OK) == 0) {
        cllm_log(CLLM_LOG_ERROR, "fault: %s exists: the device stalls until it is gone",
                 f->trigger);
        while (access(f->trigger, F_OK) == 0)
            usleep(10000);
    }
    return true;
}

/* CLLM_FAULT_CRASH=1: a sync that finds the file removes it and aborts the process: a
 * driver or runtime that takes the process down (the file is gone for the next one). */
static void crashes(struct fault *f)
{
    const char *crash = getenv("CLLM_FAULT_CRASH");
    if (!crash || strcmp(crash, "1") != 0 || unlink(f->trigger) != 0)
        return;
    cllm_log(CLLM_LOG_ERROR, "fault: %s existed: the process aborts", f->trigger);
    abort();
}

/* CLLM_FAULT_NOMEM_TOKENS=N: while the file exists, a matmul over more than N tokens finds no
 * room (CLLM_ERR_NOMEM), as on a device whose memory is too short for the buffers of a large
 * step, and smaller steps run; nothing else fails. -1 when not asked for. */
static long nomem_tokens(void)
{
    const char *limit = getenv("CLLM_FAULT_NOMEM_TOKENS");
    return limit && *limit ? strtol(limit, NULL, 10) : -1;
}

/* CLLM_FAULT_WRONG_MATMUL=1: while the file exists, matmul does nothing and says it did (its
 * output keeps what it held): a device that computes wrong whichever way its GEMMs run, for
 * the device check to catch; nothing fails. */
static bool wrong_matmul(void)
{
    const char *wrong = getenv("CLLM_FAULT_WRONG_MATMUL");
    return wrong && !strcmp(wrong, "1");
}

static enum cllm_status fault_matmul(struct cllm_backend *be, const struct cllm_weight *w,
                                     const struct cllm_weight *bias, const void *x, int32_t n,
                                     float *y, int32_t ldy)
{
    struct fault *f = fault_of(be);
    const long limit = nomem_tokens();
    if (limit >= 0 && n > limit && access(f->trigger, F_OK) == 0)
        return CLLM_ERR_NOMEM;
    if (wrong_matmul() && access(f->trigger, F_OK) == 0)
        return CLLM_OK;
    return f->inner->iface->matmul(be, w, bias, x, n, y, ldy);
}

static enum cllm_status fault_sync(struct cllm_backend *be)
{
    struct fault *f = fault_of(be);
    crashes(f);
    if (stalls(f) || nomem_tokens() >= 0 || wrong_matmul())
        return f->inner->iface->sync(be);
    return fails_once(f) || lost(f) ? CLLM_ERR_DEVICE : f->inner->iface->sync(be);
}

static enum cllm_status fault_upload(struct cllm_backend *be, void *dst, const void *src, size_t n)
{
    struct fault *f = fault_of(be);
    return f->lost ? CLLM_ERR_DEVICE : f->inner->iface->upload(be, dst, src, n);
}

static enum cllm_status fault_download(struct cllm_backend *be, void *dst, const void *src,
                                       size_t n)
{
    struct fault *f = fault_of(be);
    return f->lost ? CLLM_ERR_DEVICE : f->inner->iface->download(be, dst, src, n);
}

static void fault_free(struct cllm_backend *be)
{
    struct fault *f = fault_of(be);
    cllm_backend_free(f->inner);
    free(f->trigger);
    free(f);
}

enum cllm_status cllm_backend_fault_wrap(struct cllm_backend **be, const char *trigger)
{
    struct fault *f = calloc(1, sizeof *f);
    char *t = strdup(trigger);
    if (!f || !t) {
        free(f);
        free(t);
        return CLLM_ERR_NOMEM;
    }
    f->inner = *be;
    f->trigger = t;
    f->iface = *(*be)->iface;
    f->iface.free = fault_free;
    f->iface.sync = fault_sync;
    f->iface.upload = fault_upload;
    f->iface.download = fault_download;
    f->iface.matmul = fault_matmul;
    const char *name = getenv("CLLM_FAULT_NAME"); /* the environment outlives the wrapper */
    if (name && *name)
        f->iface.name = name;
    f->be.iface = &f->iface;
    f->be.ctx = (*be)->ctx;
    *be = &f->be;
    return CLLM_OK;
}
