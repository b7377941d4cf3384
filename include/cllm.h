/*
 * cllm public API. For now it holds what every layer shares: the status codes that every action
 * returns. Engine and request handles join it with the engine issue.
 */
#ifndef CLLM_H
#define CLLM_H

#define CLLM_VERSION "0.1.0"

/* Every action returns one of these; CLLM_OK is 0 so `if (st)` reads as "if it failed". */
enum cllm_status {
    CLLM_OK = 0,
    CLLM_ERR_NOMEM,       /* an allocation failed or a size overflowed */
    CLLM_ERR_IO,          /* open/read/mmap failed */
    CLLM_ERR_FORMAT,      /* a file or request is malformed */
    CLLM_ERR_UNSUPPORTED, /* well-formed, but something we do not handle (dtype, version, ...) */
    CLLM_ERR_INVALID_ARG, /* a caller passed a value outside the contract */
    CLLM_ERR_NOT_FOUND,   /* a named tensor, key or file is missing */
    CLLM_ERR_RANGE,       /* a value or index is out of its allowed range */
    CLLM_ERR_BUSY,        /* a queue is full: try again later */
    CLLM_ERR_DEVICE,      /* the compute device failed */
};

#endif
