/* Helpers the fuzz targets share (fuzz.h), linked into both drivers. */
#include "fuzz.h"

#include <sys/mman.h>
#include <unistd.h>

int fuzz_stage;

bool fuzz_accepted(enum cllm_status st, const char *err, bool refused_clean, const char *what)
{
    if (st == CLLM_OK) {
        fuzz_stage++;
        return true;
    }
    FUZZ_ASSERT(err[0] && refused_clean, "%s refused without an error text or left a result",
                what);
    return false;
}

int fuzz_memfile(const uint8_t *data, size_t size, char *path, size_t path_len)
{
    int fd = memfd_create("cllm-fuzz", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t done = 0;
    while (done < size) {
        ssize_t w = write(fd, data + done, size - done);
        if (w <= 0) {
            close(fd);
            return -1;
        }
        done += (size_t)w;
    }
    snprintf(path, path_len, "/proc/self/fd/%d", fd);
    return fd;
}
