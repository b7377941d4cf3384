/* A job's progress as bytes and back (progress.h). */
#include "server/progress.h"

#include <string.h>

static const char magic[4] = {'C', 'L', 'P', 'R'};

struct entry_head {
    uint8_t finished, reason;
    uint16_t zero;
    int32_t n_generated;
    uint32_t len;
};

static bool complete(enum cllm_finish_reason r)
{
    return r == CLLM_FINISH_STOP || r == CLLM_FINISH_LENGTH || r == CLLM_FINISH_TIME;
}

enum cllm_status cllm_progress_encode(struct cllm_buf *out, const struct cllm_request_output *outs,
                                      int32_t n)
{
    size_t total = sizeof magic + sizeof(uint32_t);
    for (int32_t i = 0; i < n; i++)
        total += sizeof(struct entry_head) + outs[i].text.len;
    if (n < 0 || total > CLLM_PROGRESS_MAX_LEN)
        return CLLM_ERR_RANGE;
    enum cllm_status st = cllm_buf_reserve(out, total);
    const uint32_t count = (uint32_t)n;
    if (!st)
        st = cllm_buf_append(out, magic, sizeof magic);
    if (!st)
        st = cllm_buf_append(out, &count, sizeof count);
    for (int32_t i = 0; i < n && !st; i++) {
        const struct cllm_request_output *o = &outs[i];
        const bool done = o->finished && complete(o->reason);
        const struct entry_head h = {
            .finished = done,
            .reason = (uint8_t)(done ? o->reason : CLLM_FINISH_NONE),
            .n_generated = o->n_generated,
            .len = (uint32_t)o->text.len,
        };
        st = cllm_buf_append(out, &h, sizeof h);
        if (!st && o->text.len)
            st = cllm_buf_append(out, o->text.data, o->text.len);
    }
    return st;
}

enum cllm_status cllm_progress_decode(const void *bytes, size_t len, int32_t n,
                                      struct cllm_progress_entry *entries)
{
    const char *p = bytes, *end = p + len;
    uint32_t count;
    if (n < 1 || len < sizeof magic + sizeof count || memcmp(p, magic, sizeof magic))
        return CLLM_ERR_FORMAT;
    memcpy(&count, p + sizeof magic, sizeof count);
    p += sizeof magic + sizeof count;
    if (count != (uint32_t)n)
        return CLLM_ERR_FORMAT;
    for (int32_t i = 0; i < n; i++) {
        struct entry_head h;
        if ((size_t)(end - p) < sizeof h)
            return CLLM_ERR_FORMAT;
        memcpy(&h, p, sizeof h);
        p += sizeof h;
        const bool reason_ok = h.finished == 1   ? complete((enum cllm_finish_reason)h.reason)
                               : h.finished == 0 ? h.reason == CLLM_FINISH_NONE
                                                 : false;
        if (!reason_ok || h.zero || h.n_generated < 0 || h.n_generated > CLLM_PROGRESS_MAX_TOKENS ||
            (h.len && !h.n_generated) || (size_t)(end - p) < h.len)
            return CLLM_ERR_FORMAT;
        entries[i] = (struct cllm_progress_entry){
            .finished = h.finished,
            .reason = (enum cllm_finish_reason)h.reason,
            .n_generated = h.n_generated,
            .text = p,
            .len = h.len,
        };
        p += h.len;
    }
    return p == end ? CLLM_OK : CLLM_ERR_FORMAT;
}
