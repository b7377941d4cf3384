/* mmap-based file access with errors that name the file. */
#include "core/mmap.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/status.h"

enum cllm_status cllm_mmap_open(struct cllm_mmap *m, const char *path, char *err, size_t err_len)
{
    m->data = NULL;
    m->size = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return cllm_fail(err, err_len, CLLM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return cllm_fail(err, err_len, CLLM_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return cllm_fail(err, err_len, CLLM_ERR_IO, "%s: not a regular file", path);
    }
    if (sb.st_size > 0) {
        void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return cllm_fail(err, err_len, CLLM_ERR_IO, "%s: cannot mmap: %s", path, strerror(e));
        }
        m->data = p;
        m->size = (uint64_t)sb.st_size;
    }
    close(fd);
    return CLLM_OK;
}

void cllm_mmap_close(struct cllm_mmap *m)
{
    if (m->data)
        munmap((void *)m->data, (size_t)m->size);
    m->data = NULL;
    m->size = 0;
}

enum cllm_status cllm_read_file(const char *path, size_t max_bytes, char **out, size_t *len,
                                char *err, size_t err_len)
{
    *out = NULL;
    if (len)
        *len = 0;
    struct cllm_mmap m;
    enum cllm_status st = cllm_mmap_open(&m, path, err, err_len);
    if (st)
        return st;
    if (m.size > max_bytes) {
        cllm_mmap_close(&m);
        return cllm_fail(err, err_len, CLLM_ERR_RANGE, "%s: file is %llu bytes, limit is %zu",
                         path, (unsigned long long)m.size, max_bytes);
    }
    char *buf = malloc((size_t)m.size + 1);
    if (!buf) {
        cllm_mmap_close(&m);
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", path);
    }
    if (m.size)
        memcpy(buf, m.data, (size_t)m.size);
    buf[m.size] = '\0';
    if (len)
        *len = (size_t)m.size;
    *out = buf;
    cllm_mmap_close(&m);
    return CLLM_OK;
}
