/*
 * GGUF parsing and validation (the byte layout is in gguf.h). cllm_gguf_open walks the whole
 * header once and checks every length and count against the bytes that remain before trusting
 * it or allocating for it; accessors later re-decode values from the mapping, which open has
 * proven well-formed.
 */
#include "model/gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/hashmap.h"
#include "core/mmap.h"
#include "core/status.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader decodes little-endian fields with memcpy: little-endian hosts only"
#endif

/* The smallest encodings, so that a count can be rejected before anything is allocated. */
#define MIN_KV_BYTES 13     /* key length u64 + value type u32 + a one-byte value */
#define MIN_TENSOR_BYTES 32 /* name length u64 + n_dims u32 + ne u64 + type u32 + offset u64 */
#define MIN_ARRAY_BYTES 12  /* element type u32 + count u64 */
#define SHOW_MAX 64         /* bytes of a file-supplied name quoted in an error message */

typedef char show_buf[SHOW_MAX + 4];

struct cllm_gguf {
    char *path;
    struct cllm_mmap map;
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;
    uint64_t n_kv;
    struct cllm_gguf_kv *kvs; /* [n_kv] */
    uint64_t n_tensors;
    struct cllm_tensor *tensors;     /* [n_tensors] */
    uint64_t *offsets;               /* [n_tensors] data offsets relative to data_offset */
    struct cllm_strmap kv_index;     /* key -> index into kvs */
    struct cllm_strmap tensor_index; /* tensor name -> index into tensors */
    struct cllm_arena names;         /* NUL-terminated copies of keys and tensor names */
};

/* A read position in size bytes at base. err may be NULL (re-decoding validated bytes). */
struct cursor {
    const uint8_t *base;
    uint64_t pos, size;
    const char *path;
    const char *ctx; /* what is being read, for messages: "header", "key 'general.name'" */
    char *err;
    size_t err_len;
};

/* Bytes of a value of a fixed-size type; 0 for STRING, ARRAY and invalid types. */
static uint32_t fixed_size(enum cllm_gguf_type t)
{
    switch (t) {
    case CLLM_GGUF_TYPE_U8:
    case CLLM_GGUF_TYPE_I8:
    case CLLM_GGUF_TYPE_BOOL:
        return 1;
    case CLLM_GGUF_TYPE_U16:
    case CLLM_GGUF_TYPE_I16:
        return 2;
    case CLLM_GGUF_TYPE_U32:
    case CLLM_GGUF_TYPE_I32:
    case CLLM_GGUF_TYPE_F32:
        return 4;
    case CLLM_GGUF_TYPE_U64:
    case CLLM_GGUF_TYPE_I64:
    case CLLM_GGUF_TYPE_F64:
        return 8;
    default:
        return 0;
    }
}

const char *cllm_gguf_type_name(enum cllm_gguf_type t)
{
    static const char *const names[CLLM_GGUF_TYPE_COUNT] = {
        "u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
        "bool", "string", "array", "u64", "i64", "f64",
    };
    return (unsigned)t < CLLM_GGUF_TYPE_COUNT ? names[t] : "?";
}

/* A printable, bounded copy of a name from the file, so that an error stays one short line. */
static const char *show(const char *s, uint64_t n, show_buf buf)
{
    size_t k = 0;
    for (uint64_t i = 0; i < n && k < SHOW_MAX; i++) {
        unsigned char ch = (unsigned char)s[i];
        buf[k++] = (ch >= 0x20 && ch < 0x7f) ? (char)ch : '?';
    }
    if (n > SHOW_MAX) {
        memcpy(buf + k, "...", 3);
        k += 3;
    }
    buf[k] = '\0';
    return buf;
}

static uint64_t remaining(const struct cursor *c)
{
    return c->size - c->pos;
}

static enum cllm_status need(struct cursor *c, uint64_t n, const char *what)
{
    if (n <= remaining(c))
        return CLLM_OK;
    return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                     "%s: truncated file: %s of %s at offset %llu needs %llu bytes, only %llu "
                     "remain",
                     c->path, what, c->ctx, (unsigned long long)c->pos, (unsigned long long)n,
                     (unsigned long long)remaining(c));
}

static enum cllm_status read_u32(struct cursor *c, const char *what, uint32_t *out)
{
    enum cllm_status st = need(c, 4, what);
    if (st)
        return st;
    memcpy(out, c->base + c->pos, 4);
    c->pos += 4;
    return CLLM_OK;
}

static enum cllm_status read_u64(struct cursor *c, const char *what, uint64_t *out)
{
    enum cllm_status st = need(c, 8, what);
    if (st)
        return st;
    memcpy(out, c->base + c->pos, 8);
    c->pos += 8;
    return CLLM_OK;
}

static enum cllm_status read_str(struct cursor *c, const char *what, struct cllm_gguf_str *out)
{
    uint64_t at = c->pos, len;
    enum cllm_status st = read_u64(c, what, &len);
    if (st)
        return st;
    if (len > remaining(c))
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: %s of %s at offset %llu has length %llu, which runs past the end of "
                         "the file (%llu bytes)",
                         c->path, what, c->ctx, (unsigned long long)at, (unsigned long long)len,
                         (unsigned long long)c->size);
    out->ptr = (const char *)c->base + c->pos;
    out->len = len;
    c->pos += len;
    return CLLM_OK;
}

/* Decodes a fixed-size value from possibly unaligned bytes: the little-endian bytes land in
 * the low end of raw, and the narrowing casts reinterpret them at the value's width. */
static void decode_fixed(enum cllm_gguf_type t, const uint8_t *p, struct cllm_gguf_value *out)
{
    uint64_t raw = 0;
    memcpy(&raw, p, fixed_size(t));
    out->type = t;
    switch (t) {
    case CLLM_GGUF_TYPE_I8:
        out->i = (int8_t)raw;
        break;
    case CLLM_GGUF_TYPE_I16:
        out->i = (int16_t)raw;
        break;
    case CLLM_GGUF_TYPE_I32:
        out->i = (int32_t)raw;
        break;
    case CLLM_GGUF_TYPE_I64:
        out->i = (int64_t)raw;
        break;
    case CLLM_GGUF_TYPE_BOOL:
        out->b = raw != 0;
        break;
    case CLLM_GGUF_TYPE_F32: {
        float f;
        memcpy(&f, p, 4);
        out->f = f;
        break;
    }
    case CLLM_GGUF_TYPE_F64:
        memcpy(&out->f, p, 8);
        break;
    default: /* unsigned */
        out->u = raw;
        break;
    }
}

static enum cllm_status bad_bool(struct cursor *c, uint64_t at, uint8_t byte)
{
    return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                     "%s: bool of %s at offset %llu is %u, not 0 or 1", c->path, c->ctx,
                     (unsigned long long)at, byte);
}

/* Parses one value of type t at the cursor; depth counts the arrays it sits in. Recursion is
 * bounded by CLLM_GGUF_MAX_DEPTH and every element consumes bytes, so the work is bounded by
 * the file size times the depth limit. */
static enum cllm_status parse_value(struct cursor *c, enum cllm_gguf_type t, int depth,
                                    struct cllm_gguf_value *out)
{
    enum cllm_status st;
    uint32_t fs = fixed_size(t);
    out->type = t;
    if (fs) {
        if ((st = need(c, fs, cllm_gguf_type_name(t))))
            return st;
        if (t == CLLM_GGUF_TYPE_BOOL && c->base[c->pos] > 1)
            return bad_bool(c, c->pos, c->base[c->pos]);
        decode_fixed(t, c->base + c->pos, out);
        c->pos += fs;
        return CLLM_OK;
    }
    if (t == CLLM_GGUF_TYPE_STRING)
        return read_str(c, "string", &out->str);

    uint64_t at = c->pos;
    if (depth >= CLLM_GGUF_MAX_DEPTH)
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: array in %s at offset %llu nests deeper than %d levels", c->path,
                         c->ctx, (unsigned long long)at, CLLM_GGUF_MAX_DEPTH);
    uint32_t et;
    uint64_t count;
    if ((st = read_u32(c, "array element type", &et)) || (st = read_u64(c, "array length", &count)))
        return st;
    if (et >= CLLM_GGUF_TYPE_COUNT)
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: array in %s at offset %llu has unknown value type %u", c->path,
                         c->ctx, (unsigned long long)at, et);
    uint32_t efs = fixed_size((enum cllm_gguf_type)et);
    uint64_t min = efs ? efs : et == CLLM_GGUF_TYPE_STRING ? 8 : MIN_ARRAY_BYTES;
    if (count > remaining(c) / min)
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: array in %s at offset %llu claims %llu %s elements, more than the "
                         "remaining %llu bytes can hold",
                         c->path, c->ctx, (unsigned long long)at, (unsigned long long)count,
                         cllm_gguf_type_name((enum cllm_gguf_type)et),
                         (unsigned long long)remaining(c));
    out->arr.type = (enum cllm_gguf_type)et;
    out->arr.count = count;
    out->arr.data = c->base + c->pos;
    uint64_t start = c->pos;
    if (efs) {
        c->pos += count * efs; /* cannot overflow: count * efs <= remaining */
        if (et == CLLM_GGUF_TYPE_BOOL) {
            for (uint64_t i = start; i < c->pos; i++)
                if (c->base[i] > 1)
                    return bad_bool(c, i, c->base[i]);
        }
    } else {
        struct cllm_gguf_value elem;
        for (uint64_t i = 0; i < count; i++)
            if ((st = parse_value(c, (enum cllm_gguf_type)et, depth + 1, &elem)))
                return st;
    }
    out->arr.nbytes = c->pos - start;
    return CLLM_OK;
}

static enum cllm_status parse_kv(struct cllm_gguf *g, struct cursor *c, uint64_t i)
{
    char ctx[SHOW_MAX + 32];
    show_buf shown;
    snprintf(ctx, sizeof ctx, "metadata entry %llu", (unsigned long long)i);
    c->ctx = ctx;

    struct cllm_gguf_str key;
    enum cllm_status st = read_str(c, "key", &key);
    if (st)
        return st;
    if (key.len == 0)
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: metadata entry %llu has an empty key", c->path,
                         (unsigned long long)i);
    if (memchr(key.ptr, '\0', key.len))
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT, "%s: key '%s' contains a NUL byte",
                         c->path, show(key.ptr, key.len, shown));
    uint64_t prev;
    if (cllm_strmap_get(&g->kv_index, key.ptr, key.len, &prev))
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: duplicate key '%s' (metadata entries %llu and %llu)", c->path,
                         show(key.ptr, key.len, shown), (unsigned long long)prev,
                         (unsigned long long)i);
    struct cllm_gguf_kv *kv = &g->kvs[i];
    kv->key = cllm_arena_strndup(&g->names, key.ptr, key.len);
    if (!kv->key || cllm_strmap_put(&g->kv_index, kv->key, key.len, i))
        return cllm_fail(c->err, c->err_len, CLLM_ERR_NOMEM, "%s: out of memory", c->path);
    snprintf(ctx, sizeof ctx, "key '%s'", show(key.ptr, key.len, shown));

    uint32_t type;
    if ((st = read_u32(c, "value type", &type)))
        return st;
    if (type >= CLLM_GGUF_TYPE_COUNT)
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT, "%s: %s has unknown value type %u",
                         c->path, ctx, type);
    return parse_value(c, (enum cllm_gguf_type)type, 0, &kv->value);
}

static enum cllm_status read_alignment(struct cllm_gguf *g, char *err, size_t err_len)
{
    g->alignment = CLLM_GGUF_DEFAULT_ALIGNMENT;
    const struct cllm_gguf_value *v = cllm_gguf_find(g, "general.alignment");
    if (!v)
        return CLLM_OK;
    uint64_t a;
    if (!cllm_gguf_value_u64(v, &a))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: general.alignment has type %s, expected an unsigned integer", g->path,
                         cllm_gguf_type_name(v->type));
    if (a == 0 || (a & (a - 1)) || a > UINT32_MAX)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: general.alignment %llu is not a non-zero power of two below 2^32",
                         g->path, (unsigned long long)a);
    g->alignment = (uint32_t)a;
    return CLLM_OK;
}

static enum cllm_status parse_tensor_info(struct cllm_gguf *g, struct cursor *c, uint64_t i)
{
    char ctx[SHOW_MAX + 32];
    show_buf shown;
    snprintf(ctx, sizeof ctx, "tensor info %llu", (unsigned long long)i);
    c->ctx = ctx;

    struct cllm_gguf_str name;
    enum cllm_status st = read_str(c, "tensor name", &name);
    if (st)
        return st;
    const char *nm = show(name.ptr, name.len, shown);
    if (memchr(name.ptr, '\0', name.len))
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: tensor '%s' has a name containing a NUL byte", c->path, nm);
    uint64_t prev;
    if (cllm_strmap_get(&g->tensor_index, name.ptr, name.len, &prev))
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: duplicate tensor name '%s' (tensors %llu and %llu)", c->path, nm,
                         (unsigned long long)prev, (unsigned long long)i);
    struct cllm_tensor *t = &g->tensors[i];
    t->name = cllm_arena_strndup(&g->names, name.ptr, name.len);
    if (!t->name || cllm_strmap_put(&g->tensor_index, t->name, name.len, i))
        return cllm_fail(c->err, c->err_len, CLLM_ERR_NOMEM, "%s: out of memory", c->path);
    snprintf(ctx, sizeof ctx, "tensor '%s'", nm);

    uint32_t n_dims;
    if ((st = read_u32(c, "n_dims", &n_dims)))
        return st;
    if (n_dims == 0 || n_dims > CLLM_MAX_DIMS)
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: tensor '%s' has %u dimensions (1 to %d are supported)", c->path, nm,
                         n_dims, CLLM_MAX_DIMS);
    uint64_t nelem = 1;
    for (int d = 0; d < CLLM_MAX_DIMS; d++)
        t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t ne;
        if ((st = read_u64(c, "dimension", &ne)))
            return st;
        if (ne == 0)
            return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                             "%s: tensor '%s' has a zero-sized dimension ne[%u]", c->path, nm, d);
        if (!cllm_mul_u64(nelem, ne, &nelem) || nelem > (uint64_t)INT64_MAX)
            return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                             "%s: tensor '%s' element count overflows at ne[%u] = %llu", c->path,
                             nm, d, (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
    }
    t->n_dims = (int)n_dims;

    uint32_t ggml_type;
    if ((st = read_u32(c, "type", &ggml_type)) || (st = read_u64(c, "offset", &g->offsets[i])))
        return st;
    if (!cllm_dtype_from_ggml(ggml_type, &t->dtype))
        return cllm_fail(c->err, c->err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: tensor '%s' has type %s (ggml type %u), which is not supported",
                         c->path, nm, cllm_ggml_type_name(ggml_type), ggml_type);
    uint32_t block = cllm_dtype_traits(t->dtype)->block_size;
    if ((uint64_t)t->ne[0] % block)
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT,
                         "%s: tensor '%s' has ne[0] = %lld, not a multiple of the %s block size %u",
                         c->path, nm, (long long)t->ne[0], cllm_dtype_name(t->dtype), block);
    uint64_t row;
    if (!cllm_dtype_row_bytes(t->dtype, t->ne[0], &row) ||
        !cllm_mul_u64(row, nelem / (uint64_t)t->ne[0], &t->nbytes))
        return cllm_fail(c->err, c->err_len, CLLM_ERR_FORMAT, "%s: tensor '%s' byte size overflows",
                         c->path, nm);
    return CLLM_OK;
}

/* Places every tensor in the data section, which starts at the first aligned offset after the
 * tensor infos; offsets must be aligned and data must end inside the file (overlap is legal). */
static enum cllm_status place_tensors(struct cllm_gguf *g, uint64_t header_end, char *err,
                                      size_t err_len)
{
    uint64_t a = g->alignment, size = g->map.size;
    show_buf shown;
    if (!cllm_add_u64(header_end, (a - header_end % a) % a, &g->data_offset))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: data section offset overflows",
                         g->path);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct cllm_tensor *t = &g->tensors[i];
        uint64_t off = g->offsets[i], start, end;
        const char *nm = show(t->name, strlen(t->name), shown);
        if (off % a)
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: tensor '%s' data offset %llu is not a multiple of the "
                             "alignment %llu",
                             g->path, nm, (unsigned long long)off, (unsigned long long)a);
        if (!cllm_add_u64(g->data_offset, off, &start) || !cllm_add_u64(start, t->nbytes, &end) ||
            end > size)
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: tensor '%s' data [offset %llu in the data section at %llu, %llu "
                             "bytes] runs past the end of the file (%llu bytes)",
                             g->path, nm, (unsigned long long)off,
                             (unsigned long long)g->data_offset, (unsigned long long)t->nbytes,
                             (unsigned long long)size);
        t->data = g->map.data + start;
    }
    return CLLM_OK;
}

static enum cllm_status parse(struct cllm_gguf *g, char *err, size_t err_len)
{
    struct cursor c = {g->map.data, 0, g->map.size, g->path, "header", err, err_len};
    enum cllm_status st;
    if (c.size == 0)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: file is empty, not a GGUF file",
                         g->path);
    if ((st = need(&c, 4, "magic")))
        return st;
    if (memcmp(c.base, "GGUF", 4) != 0)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: not a GGUF file (magic bytes %02x %02x %02x %02x, expected \"GGUF\")",
                         g->path, c.base[0], c.base[1], c.base[2], c.base[3]);
    c.pos = 4;
    if ((st = read_u32(&c, "version", &g->version)))
        return st;
    if (g->version == 0x02000000u || g->version == 0x03000000u)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: big-endian GGUF files are not supported", g->path);
    if (g->version != 2 && g->version != 3)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: GGUF version %u is not supported (only versions 2 and 3)", g->path,
                         g->version);
    if ((st = read_u64(&c, "tensor count", &g->n_tensors)) ||
        (st = read_u64(&c, "metadata count", &g->n_kv)))
        return st;
    if (g->n_kv > remaining(&c) / MIN_KV_BYTES)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: header claims %llu metadata entries, more than the remaining %llu "
                         "bytes can hold",
                         g->path, (unsigned long long)g->n_kv, (unsigned long long)remaining(&c));
    if (g->n_tensors > remaining(&c) / MIN_TENSOR_BYTES)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: header claims %llu tensors, more than the remaining %llu bytes can "
                         "hold",
                         g->path, (unsigned long long)g->n_tensors,
                         (unsigned long long)remaining(&c));

    g->kvs = cllm_calloc_array((size_t)g->n_kv, sizeof *g->kvs);
    if (!g->kvs)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < g->n_kv; i++)
        if ((st = parse_kv(g, &c, i)))
            return st;
    if ((st = read_alignment(g, err, err_len)))
        return st;

    c.ctx = "tensor infos";
    if (g->n_tensors > remaining(&c) / MIN_TENSOR_BYTES)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: header claims %llu tensors, more than the remaining %llu bytes after "
                         "the metadata can hold",
                         g->path, (unsigned long long)g->n_tensors,
                         (unsigned long long)remaining(&c));
    g->tensors = cllm_calloc_array((size_t)g->n_tensors, sizeof *g->tensors);
    g->offsets = cllm_calloc_array((size_t)g->n_tensors, sizeof *g->offsets);
    if (!g->tensors || !g->offsets)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if ((st = parse_tensor_info(g, &c, i)))
            return st;
    return place_tensors(g, c.pos, err, err_len);
}

enum cllm_status cllm_gguf_open(struct cllm_gguf **out, const char *path, char *err, size_t err_len)
{
    *out = NULL;
    if (!path)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG, "gguf: no path given");
    struct cllm_gguf *g = calloc(1, sizeof *g);
    if (!g)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", path);
    cllm_arena_init(&g->names, 0);
    enum cllm_status st;
    g->path = cllm_strndup(path, strlen(path));
    if (!g->path) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", path);
        goto fail_free;
    }
    if ((st = cllm_mmap_open(&g->map, path, err, err_len)))
        goto fail_free;
    if ((st = parse(g, err, err_len)))
        goto fail_free;
    *out = g;
    return CLLM_OK;

fail_free:
    cllm_gguf_free(g);
    return st;
}

void cllm_gguf_free(struct cllm_gguf *g)
{
    if (!g)
        return;
    cllm_mmap_close(&g->map);
    cllm_strmap_free(&g->kv_index);
    cllm_strmap_free(&g->tensor_index);
    cllm_arena_free(&g->names);
    free(g->kvs);
    free(g->tensors);
    free(g->offsets);
    free(g->path);
    free(g);
}

const char *cllm_gguf_path(const struct cllm_gguf *g)
{
    return g->path;
}

uint32_t cllm_gguf_version(const struct cllm_gguf *g)
{
    return g->version;
}

uint64_t cllm_gguf_file_size(const struct cllm_gguf *g)
{
    return g->map.size;
}

uint32_t cllm_gguf_alignment(const struct cllm_gguf *g)
{
    return g->alignment;
}

uint64_t cllm_gguf_data_offset(const struct cllm_gguf *g)
{
    return g->data_offset;
}

uint64_t cllm_gguf_n_tensors(const struct cllm_gguf *g)
{
    return g->n_tensors;
}

const struct cllm_tensor *cllm_gguf_tensor(const struct cllm_gguf *g, uint64_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const struct cllm_tensor *cllm_gguf_find_tensor(const struct cllm_gguf *g, const char *name)
{
    uint64_t i;
    if (!name || !cllm_strmap_get(&g->tensor_index, name, strlen(name), &i))
        return NULL;
    return &g->tensors[i];
}

uint64_t cllm_gguf_tensor_file_offset(const struct cllm_gguf *g, uint64_t i)
{
    return i < g->n_tensors ? g->data_offset + g->offsets[i] : 0;
}

uint64_t cllm_gguf_n_kv(const struct cllm_gguf *g)
{
    return g->n_kv;
}

const struct cllm_gguf_kv *cllm_gguf_kv_at(const struct cllm_gguf *g, uint64_t i)
{
    return i < g->n_kv ? &g->kvs[i] : NULL;
}

const struct cllm_gguf_value *cllm_gguf_find(const struct cllm_gguf *g, const char *key)
{
    uint64_t i;
    if (!key || !cllm_strmap_get(&g->kv_index, key, strlen(key), &i))
        return NULL;
    return &g->kvs[i].value;
}

static bool is_unsigned(enum cllm_gguf_type t)
{
    return t == CLLM_GGUF_TYPE_U8 || t == CLLM_GGUF_TYPE_U16 || t == CLLM_GGUF_TYPE_U32 ||
           t == CLLM_GGUF_TYPE_U64;
}

static bool is_signed(enum cllm_gguf_type t)
{
    return t == CLLM_GGUF_TYPE_I8 || t == CLLM_GGUF_TYPE_I16 || t == CLLM_GGUF_TYPE_I32 ||
           t == CLLM_GGUF_TYPE_I64;
}

bool cllm_gguf_value_u64(const struct cllm_gguf_value *v, uint64_t *out)
{
    if (v && is_unsigned(v->type)) {
        *out = v->u;
        return true;
    }
    if (v && is_signed(v->type) && v->i >= 0) {
        *out = (uint64_t)v->i;
        return true;
    }
    return false;
}

bool cllm_gguf_value_i64(const struct cllm_gguf_value *v, int64_t *out)
{
    if (v && is_signed(v->type)) {
        *out = v->i;
        return true;
    }
    if (v && is_unsigned(v->type) && v->u <= (uint64_t)INT64_MAX) {
        *out = (int64_t)v->u;
        return true;
    }
    return false;
}

bool cllm_gguf_value_u32(const struct cllm_gguf_value *v, uint32_t *out)
{
    uint64_t x;
    if (!cllm_gguf_value_u64(v, &x) || x > UINT32_MAX)
        return false;
    *out = (uint32_t)x;
    return true;
}

bool cllm_gguf_value_i32(const struct cllm_gguf_value *v, int32_t *out)
{
    int64_t x;
    if (!cllm_gguf_value_i64(v, &x) || x < INT32_MIN || x > INT32_MAX)
        return false;
    *out = (int32_t)x;
    return true;
}

bool cllm_gguf_value_f64(const struct cllm_gguf_value *v, double *out)
{
    if (!v || (v->type != CLLM_GGUF_TYPE_F32 && v->type != CLLM_GGUF_TYPE_F64))
        return false;
    *out = v->f;
    return true;
}

bool cllm_gguf_value_f32(const struct cllm_gguf_value *v, float *out)
{
    double x;
    if (!cllm_gguf_value_f64(v, &x))
        return false;
    *out = (float)x;
    return true;
}

bool cllm_gguf_value_bool(const struct cllm_gguf_value *v, bool *out)
{
    if (!v || v->type != CLLM_GGUF_TYPE_BOOL)
        return false;
    *out = v->b;
    return true;
}

bool cllm_gguf_value_str(const struct cllm_gguf_value *v, struct cllm_gguf_str *out)
{
    if (!v || v->type != CLLM_GGUF_TYPE_STRING)
        return false;
    *out = v->str;
    return true;
}

bool cllm_gguf_get_u32(const struct cllm_gguf *g, const char *key, uint32_t *out)
{
    return cllm_gguf_value_u32(cllm_gguf_find(g, key), out);
}

bool cllm_gguf_get_i32(const struct cllm_gguf *g, const char *key, int32_t *out)
{
    return cllm_gguf_value_i32(cllm_gguf_find(g, key), out);
}

bool cllm_gguf_get_u64(const struct cllm_gguf *g, const char *key, uint64_t *out)
{
    return cllm_gguf_value_u64(cllm_gguf_find(g, key), out);
}

bool cllm_gguf_get_i64(const struct cllm_gguf *g, const char *key, int64_t *out)
{
    return cllm_gguf_value_i64(cllm_gguf_find(g, key), out);
}

bool cllm_gguf_get_f32(const struct cllm_gguf *g, const char *key, float *out)
{
    return cllm_gguf_value_f32(cllm_gguf_find(g, key), out);
}

bool cllm_gguf_get_f64(const struct cllm_gguf *g, const char *key, double *out)
{
    return cllm_gguf_value_f64(cllm_gguf_find(g, key), out);
}

bool cllm_gguf_get_bool(const struct cllm_gguf *g, const char *key, bool *out)
{
    return cllm_gguf_value_bool(cllm_gguf_find(g, key), out);
}

bool cllm_gguf_get_str(const struct cllm_gguf *g, const char *key, struct cllm_gguf_str *out)
{
    return cllm_gguf_value_str(cllm_gguf_find(g, key), out);
}

bool cllm_gguf_get_array(const struct cllm_gguf *g, const char *key, enum cllm_gguf_type elem,
                         struct cllm_gguf_array *out)
{
    const struct cllm_gguf_value *v = cllm_gguf_find(g, key);
    if (!v || v->type != CLLM_GGUF_TYPE_ARRAY || v->arr.type != elem)
        return false;
    *out = v->arr;
    return true;
}

bool cllm_gguf_array_at(const struct cllm_gguf_array *a, uint64_t i, struct cllm_gguf_value *out)
{
    uint32_t fs = fixed_size(a->type);
    if (!fs || i >= a->count)
        return false;
    decode_fixed(a->type, a->data + i * fs, out);
    return true;
}

void cllm_gguf_iter_init(struct cllm_gguf_iter *it, const struct cllm_gguf_array *a)
{
    it->p = a->data;
    it->end = a->data + a->nbytes;
    it->type = a->type;
    it->left = a->count;
}

bool cllm_gguf_iter_next(struct cllm_gguf_iter *it, struct cllm_gguf_value *out)
{
    if (it->left == 0)
        return false;
    /* The bytes were validated at open; the cursor still bounds the read, and depth 1 is no
     * deeper than the element really sits, so nothing open accepted is refused here. */
    struct cursor c = {it->p, 0, (uint64_t)(it->end - it->p), "", "array element", NULL, 0};
    if (parse_value(&c, it->type, 1, out)) {
        it->left = 0;
        return false;
    }
    it->p += c.pos;
    it->left--;
    return true;
}

enum cllm_status cllm_gguf_get_str_array(const struct cllm_gguf *g, const char *key,
                                         struct cllm_gguf_str **out, uint64_t *count, char *err,
                                         size_t err_len)
{
    *out = NULL;
    *count = 0;
    const struct cllm_gguf_value *v = cllm_gguf_find(g, key);
    if (!v)
        return cllm_fail(err, err_len, CLLM_ERR_NOT_FOUND, "%s: no key '%s'", g->path, key);
    if (v->type != CLLM_GGUF_TYPE_ARRAY || v->arr.type != CLLM_GGUF_TYPE_STRING)
        return cllm_fail(
            err, err_len, CLLM_ERR_FORMAT, "%s: key '%s' is %s%s, expected an array of strings",
            g->path, key, v->type == CLLM_GGUF_TYPE_ARRAY ? "an array of " : "a ",
            cllm_gguf_type_name(v->type == CLLM_GGUF_TYPE_ARRAY ? v->arr.type : v->type));
    struct cllm_gguf_str *t = cllm_malloc_array((size_t)v->arr.count, sizeof *t);
    if (!t)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory for key '%s'", g->path,
                         key);
    struct cllm_gguf_iter it;
    struct cllm_gguf_value e;
    uint64_t n = 0;
    cllm_gguf_iter_init(&it, &v->arr);
    while (n < v->arr.count && cllm_gguf_iter_next(&it, &e))
        t[n++] = e.str;
    *out = t;
    *count = n;
    return CLLM_OK;
}
