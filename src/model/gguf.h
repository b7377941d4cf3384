/*
 * GGUF reader (versions 2 and 3, little-endian). The file is mapped, never copied: strings,
 * arrays and tensor data are pointers into the mapping and live until cllm_gguf_free.
 *
 * Byte layout (all integers little-endian, no padding between fields):
 *   "GGUF" | version u32 | n_tensors u64 | n_kv u64
 *   n_kv x      { key: string | value type u32 | value }
 *   n_tensors x { name: string | n_dims u32 | ne[n_dims] u64 | ggml type u32 | offset u64 }
 *   zero padding to general.alignment (default 32) | data section (tensor offsets relative to it)
 * string = len u64 + bytes (no NUL); array = element type u32 + count u64 + elements.
 * Everything is validated against the file size at open, so accessors never fail on bytes.
 */
#ifndef CLLM_MODEL_GGUF_H
#define CLLM_MODEL_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cllm.h"
#include "tensor/tensor.h"

#define CLLM_GGUF_DEFAULT_ALIGNMENT 32
#define CLLM_GGUF_MAX_DEPTH 8 /* arrays of arrays nest at most this deep */

/* Metadata value types; the values are GGUF's own type ids. */
enum cllm_gguf_type {
    CLLM_GGUF_TYPE_U8 = 0,
    CLLM_GGUF_TYPE_I8 = 1,
    CLLM_GGUF_TYPE_U16 = 2,
    CLLM_GGUF_TYPE_I16 = 3,
    CLLM_GGUF_TYPE_U32 = 4,
    CLLM_GGUF_TYPE_I32 = 5,
    CLLM_GGUF_TYPE_F32 = 6,
    CLLM_GGUF_TYPE_BOOL = 7,
    CLLM_GGUF_TYPE_STRING = 8,
    CLLM_GGUF_TYPE_ARRAY = 9,
    CLLM_GGUF_TYPE_U64 = 10,
    CLLM_GGUF_TYPE_I64 = 11,
    CLLM_GGUF_TYPE_F64 = 12,
    CLLM_GGUF_TYPE_COUNT
};

/* A string in the mapping: len bytes, not NUL-terminated, not checked for UTF-8. */
struct cllm_gguf_str {
    const char *ptr;
    uint64_t len;
};

/* An array in the mapping. Elements of fixed-size types sit back to back (unaligned: read them
 * with cllm_gguf_array_at); strings and nested arrays need cllm_gguf_iter. */
struct cllm_gguf_array {
    enum cllm_gguf_type type; /* element type */
    uint64_t count;           /* elements */
    const uint8_t *data;      /* encoding of the first element */
    uint64_t nbytes;          /* bytes of all element encodings */
};

struct cllm_gguf_value {
    enum cllm_gguf_type type;
    union {
        uint64_t u;                 /* U8, U16, U32, U64 */
        int64_t i;                  /* I8, I16, I32, I64 */
        double f;                   /* F32, F64 (an F32 converts to double exactly) */
        bool b;                     /* BOOL */
        struct cllm_gguf_str str;   /* STRING */
        struct cllm_gguf_array arr; /* ARRAY */
    };
};

struct cllm_gguf_kv {
    const char *key; /* NUL-terminated copy owned by the cllm_gguf */
    struct cllm_gguf_value value;
};

struct cllm_gguf;

/* Maps and validates path. On failure *out is NULL and err holds one line naming the file and
 * the problem: CLLM_ERR_IO (cannot open), CLLM_ERR_FORMAT (malformed), CLLM_ERR_UNSUPPORTED
 * (a version or tensor type we do not read), CLLM_ERR_NOMEM. */
enum cllm_status cllm_gguf_open(struct cllm_gguf **out, const char *path, char *err,
                                size_t err_len);
/* Unmaps the file; every pointer obtained from g dies with it. NULL is a no-op. */
void cllm_gguf_free(struct cllm_gguf *g);

const char *cllm_gguf_path(const struct cllm_gguf *g);
uint32_t cllm_gguf_version(const struct cllm_gguf *g);
uint64_t cllm_gguf_file_size(const struct cllm_gguf *g);
uint32_t cllm_gguf_alignment(const struct cllm_gguf *g);
/* File offset of the data section (after the header, aligned). */
uint64_t cllm_gguf_data_offset(const struct cllm_gguf *g);

/* Tensors, in file order. Names are NUL-terminated; data points into the mapping. */
uint64_t cllm_gguf_n_tensors(const struct cllm_gguf *g);
/* NULL if i is out of range / if no tensor has that name. */
const struct cllm_tensor *cllm_gguf_tensor(const struct cllm_gguf *g, uint64_t i);
const struct cllm_tensor *cllm_gguf_find_tensor(const struct cllm_gguf *g, const char *name);
/* File offset of tensor i's data. */
uint64_t cllm_gguf_tensor_file_offset(const struct cllm_gguf *g, uint64_t i);

/* Metadata, in file order (for listing), and by key. */
uint64_t cllm_gguf_n_kv(const struct cllm_gguf *g);
/* NULL if i is out of range / if the key is missing. */
const struct cllm_gguf_kv *cllm_gguf_kv_at(const struct cllm_gguf *g, uint64_t i);
const struct cllm_gguf_value *cllm_gguf_find(const struct cllm_gguf *g, const char *key);
/* "u32", "string", "array", ...; "?" for an invalid type. */
const char *cllm_gguf_type_name(enum cllm_gguf_type t);

/* Value conversions: true and *out set when v holds that kind of value and it fits exactly.
 * Integers convert between widths and signedness when the value is in range (a BOOL is not an
 * integer); f32/f64 accept F32 and F64; str borrows the mapping. */
bool cllm_gguf_value_u32(const struct cllm_gguf_value *v, uint32_t *out);
bool cllm_gguf_value_i32(const struct cllm_gguf_value *v, int32_t *out);
bool cllm_gguf_value_u64(const struct cllm_gguf_value *v, uint64_t *out);
bool cllm_gguf_value_i64(const struct cllm_gguf_value *v, int64_t *out);
bool cllm_gguf_value_f32(const struct cllm_gguf_value *v, float *out);
bool cllm_gguf_value_f64(const struct cllm_gguf_value *v, double *out);
bool cllm_gguf_value_bool(const struct cllm_gguf_value *v, bool *out);
bool cllm_gguf_value_str(const struct cllm_gguf_value *v, struct cllm_gguf_str *out);

/* The same by key: false if the key is missing or the value does not convert. */
bool cllm_gguf_get_u32(const struct cllm_gguf *g, const char *key, uint32_t *out);
bool cllm_gguf_get_i32(const struct cllm_gguf *g, const char *key, int32_t *out);
bool cllm_gguf_get_u64(const struct cllm_gguf *g, const char *key, uint64_t *out);
bool cllm_gguf_get_i64(const struct cllm_gguf *g, const char *key, int64_t *out);
bool cllm_gguf_get_f32(const struct cllm_gguf *g, const char *key, float *out);
bool cllm_gguf_get_f64(const struct cllm_gguf *g, const char *key, double *out);
bool cllm_gguf_get_bool(const struct cllm_gguf *g, const char *key, bool *out);
bool cllm_gguf_get_str(const struct cllm_gguf *g, const char *key, struct cllm_gguf_str *out);
/* An array whose elements have type elem; false if missing, not an array or of another type. */
bool cllm_gguf_get_array(const struct cllm_gguf *g, const char *key, enum cllm_gguf_type elem,
                         struct cllm_gguf_array *out);

/* Element i of an array of a fixed-size type (numbers, BOOL), read safely from unaligned bytes;
 * false if i is out of range or the elements are strings or arrays. */
bool cllm_gguf_array_at(const struct cllm_gguf_array *a, uint64_t i, struct cllm_gguf_value *out);

/* Sequential access to the elements of any array (the way to walk strings and nested arrays):
 *   struct cllm_gguf_iter it; struct cllm_gguf_value v;
 *   cllm_gguf_iter_init(&it, &arr); while (cllm_gguf_iter_next(&it, &v)) ... */
struct cllm_gguf_iter {
    const uint8_t *p;         /* next element */
    const uint8_t *end;       /* end of the array's elements */
    enum cllm_gguf_type type; /* element type */
    uint64_t left;            /* elements not yet returned */
};

void cllm_gguf_iter_init(struct cllm_gguf_iter *it, const struct cllm_gguf_array *a);
bool cllm_gguf_iter_next(struct cllm_gguf_iter *it, struct cllm_gguf_value *out);

/* All strings of a string array in one malloc'd table (*out, free() it; *count entries)
 * pointing into the mapping. CLLM_ERR_NOT_FOUND if the key is missing, CLLM_ERR_FORMAT if it
 * is not an array of strings, CLLM_ERR_NOMEM; err names the file and the key. */
enum cllm_status cllm_gguf_get_str_array(const struct cllm_gguf *g, const char *key,
                                         struct cllm_gguf_str **out, uint64_t *count, char *err,
                                         size_t err_len);

#endif
