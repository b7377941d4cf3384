/*
 * safetensors reader (layout in safetensors.h). The JSON header is copied out of the mapping and
 * parsed with cJSON; every number in it is checked to be an exact non-negative integer and every
 * size is computed in overflow-checked 64-bit arithmetic before a pointer into the data area is
 * formed. Like the safetensors crate, we reject tensors whose bytes overlap; unlike it, we allow
 * holes between tensors (they cost nothing to read around) and reject empty (zero-sized)
 * tensors, which no decoder weight is and which would make every consumer guard ne[i] == 0.
 */
#include "model/safetensors.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "core/alloc.h"
#include "core/hashmap.h"
#include "core/mmap.h"
#include "core/path.h"
#include "core/status.h"

#define SINGLE_NAME "model.safetensors"
#define INDEX_NAME "model.safetensors.index.json"
/* 2^53: JSON numbers beyond it may already have been rounded by the parser. */
#define MAX_EXACT_INT 9007199254740992.0

struct st_file {
    char *path;           /* malloc'd, as given or joined from the folder */
    struct cllm_mmap map; /* the whole file */
};

struct cllm_st_set {
    struct st_file *files; /* [n_files] */
    size_t n_files, cap_files;
    struct cllm_tensor *tensors; /* [n_tensors], file order */
    uint32_t *file_of;           /* [n_tensors]: index into files */
    size_t n_tensors, cap_tensors;
    struct cllm_strmap by_name; /* tensor name -> index into tensors (keys live in names) */
    struct cllm_arena names;    /* tensor names */
};

static uint64_t read_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* A JSON number that is a non-negative integer small enough to be exact in a double. */
static bool json_u64(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v))
        return false;
    double d = v->valuedouble;
    if (!(d >= 0.0) || d > MAX_EXACT_INT || d != floor(d))
        return false;
    *out = (uint64_t)d;
    return true;
}

static bool is_json_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static struct cllm_st_set *set_new(void)
{
    struct cllm_st_set *s = calloc(1, sizeof *s);
    if (s)
        cllm_arena_init(&s->names, 0);
    return s;
}

void cllm_st_free(struct cllm_st_set *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n_files; i++) {
        cllm_mmap_close(&s->files[i].map);
        free(s->files[i].path);
    }
    free(s->files);
    free(s->tensors);
    free(s->file_of);
    cllm_strmap_free(&s->by_name);
    cllm_arena_free(&s->names);
    free(s);
}

/* Maps path as the next file of the set; takes ownership of path (freed on failure too). */
static enum cllm_status add_file(struct cllm_st_set *s, char *path, uint32_t *fi, char *err,
                                 size_t err_len)
{
    if (s->n_files == s->cap_files) {
        size_t cap = s->cap_files ? s->cap_files * 2 : 4;
        struct st_file *f = cllm_realloc_array(s->files, cap, sizeof *f);
        if (!f) {
            free(path);
            return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "out of memory");
        }
        s->files = f;
        s->cap_files = cap;
    }
    struct st_file *f = &s->files[s->n_files];
    enum cllm_status st = cllm_mmap_open(&f->map, path, err, err_len);
    if (st) {
        free(path);
        return st;
    }
    f->path = path;
    *fi = (uint32_t)s->n_files++;
    return CLLM_OK;
}

static enum cllm_status push_tensor(struct cllm_st_set *s, const struct cllm_tensor *t, uint32_t fi)
{
    if (s->n_tensors == s->cap_tensors) {
        size_t cap = s->cap_tensors ? s->cap_tensors * 2 : 64;
        struct cllm_tensor *nt = cllm_realloc_array(s->tensors, cap, sizeof *nt);
        if (!nt)
            return CLLM_ERR_NOMEM;
        s->tensors = nt;
        uint32_t *nf = cllm_realloc_array(s->file_of, cap, sizeof *nf);
        if (!nf)
            return CLLM_ERR_NOMEM;
        s->file_of = nf;
        s->cap_tensors = cap;
    }
    enum cllm_status st = cllm_strmap_put(&s->by_name, t->name, strlen(t->name), s->n_tensors);
    if (st)
        return st;
    s->tensors[s->n_tensors] = *t;
    s->file_of[s->n_tensors] = fi;
    s->n_tensors++;
    return CLLM_OK;
}

/* One "<name>": {...} entry of file fi's header. */
static enum cllm_status parse_entry(struct cllm_st_set *s, uint32_t fi, const cJSON *e,
                                    const uint8_t *data, uint64_t data_size, char *err,
                                    size_t err_len)
{
    const char *path = s->files[fi].path;
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: tensor '%s': entry is not an object",
                         path, name);

    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    if (!cJSON_IsString(jd))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: tensor '%s': \"dtype\" is missing or not a string", path, name);
    struct cllm_tensor t = {.name = NULL, .n_dims = 1, .ne = {1, 1, 1, 1}};
    if (!cllm_dtype_from_safetensors(jd->valuestring, &t.dtype))
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: tensor '%s': dtype %s is not supported (only BF16, F16, F32)", path,
                         name, jd->valuestring);

    const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
    if (!cJSON_IsArray(js))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: tensor '%s': \"shape\" is missing or not an array", path, name);
    int rank = cJSON_GetArraySize(js);
    if (rank > CLLM_MAX_DIMS)
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "%s: tensor '%s': %d dimensions, at most %d are supported", path, name,
                         rank, CLLM_MAX_DIMS);
    /* A scalar (shape []) becomes a one-element vector: n_dims is 1..4 by contract. */
    t.n_dims = rank > 0 ? rank : 1;
    uint64_t numel = 1;
    int i = 0;
    for (const cJSON *d = js->child; d; d = d->next, i++) {
        uint64_t v;
        if (!json_u64(d, &v))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: tensor '%s': shape[%d] is not a non-negative integer", path, name,
                             i);
        if (v == 0)
            return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                             "%s: tensor '%s': shape[%d] is 0 (empty tensors are not supported)",
                             path, name, i);
        if (!cllm_mul_u64(numel, v, &numel) || numel > (uint64_t)INT64_MAX)
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: tensor '%s': element count overflows", path, name);
        t.ne[rank - 1 - i] = (int64_t)v;
    }
    const struct cllm_dtype_traits *tr = cllm_dtype_traits(t.dtype);
    if (!cllm_mul_u64(numel, tr->type_size, &t.nbytes))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: tensor '%s': byte size overflows",
                         path, name);

    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    uint64_t begin, end;
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2 || !json_u64(jo->child, &begin) ||
        !json_u64(jo->child->next, &end))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: tensor '%s': \"data_offsets\" is not [begin, end] with non-negative "
                         "integers",
                         path, name);
    if (begin > end)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets [%llu, %llu] end before they begin", path,
                         name, (unsigned long long)begin, (unsigned long long)end);
    if (end - begin != t.nbytes)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets span %llu bytes, but %llu %s elements "
                         "need %llu",
                         path, name, (unsigned long long)(end - begin), (unsigned long long)numel,
                         tr->name, (unsigned long long)t.nbytes);
    if (end > data_size)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: tensor '%s': data ends at byte %llu, past the %llu-byte data area",
                         path, name, (unsigned long long)end, (unsigned long long)data_size);

    uint64_t other;
    if (cllm_strmap_get(&s->by_name, name, strlen(name), &other)) {
        uint32_t ofi = s->file_of[other];
        if (ofi == fi)
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: tensor '%s' appears twice", path,
                             name);
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: tensor '%s' is also in %s", path, name,
                         s->files[ofi].path);
    }
    t.name = cllm_arena_strndup(&s->names, name, strlen(name));
    if (!t.name)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", path);
    t.data = data + begin;
    if (push_tensor(s, &t, fi) != CLLM_OK)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", path);
    return CLLM_OK;
}

struct span {
    uint64_t begin, end;
    size_t idx; /* into tensors */
};

static int span_cmp(const void *a, const void *b)
{
    const struct span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* Tensors [first, n_tensors) of file fi must not share bytes (all are non-empty). */
static enum cllm_status check_overlap(struct cllm_st_set *s, uint32_t fi, size_t first,
                                      const uint8_t *data, char *err, size_t err_len)
{
    size_t n = s->n_tensors - first;
    if (n < 2)
        return CLLM_OK;
    struct span *sp = cllm_malloc_array(n, sizeof *sp);
    if (!sp)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", s->files[fi].path);
    for (size_t i = 0; i < n; i++) {
        const struct cllm_tensor *t = &s->tensors[first + i];
        sp[i].begin = (uint64_t)((const uint8_t *)t->data - data);
        sp[i].end = sp[i].begin + t->nbytes;
        sp[i].idx = first + i;
    }
    qsort(sp, n, sizeof *sp, span_cmp);
    enum cllm_status st = CLLM_OK;
    size_t last = 0; /* the span reaching furthest so far */
    for (size_t i = 1; i < n; i++) {
        if (sp[i].begin < sp[last].end) {
            st = cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                           "%s: tensors '%s' and '%s' overlap in the data area", s->files[fi].path,
                           s->tensors[sp[last].idx].name, s->tensors[sp[i].idx].name);
            break;
        }
        if (sp[i].end > sp[last].end)
            last = i;
    }
    free(sp);
    return st;
}

static enum cllm_status check_metadata(const char *path, const cJSON *m, char *err, size_t err_len)
{
    if (cJSON_IsNull(m))
        return CLLM_OK;
    if (!cJSON_IsObject(m))
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: \"__metadata__\" is not an object",
                         path);
    for (const cJSON *v = m->child; v; v = v->next)
        if (!cJSON_IsString(v))
            return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                             "%s: \"__metadata__\" value '%s' is not a string", path, v->string);
    return CLLM_OK;
}

/* Parses the header of the already-mapped file fi and adds its tensors to the set. */
static enum cllm_status parse_file(struct cllm_st_set *s, uint32_t fi, char *err, size_t err_len)
{
    const char *path = s->files[fi].path;
    const struct cllm_mmap *m = &s->files[fi].map;
    if (m->size < 8)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: file is %llu bytes, too short for the 8-byte header length", path,
                         (unsigned long long)m->size);
    uint64_t n = read_le64(m->data);
    if (n > m->size - 8)
        return cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                         "%s: header length %llu exceeds the %llu bytes that follow it", path,
                         (unsigned long long)n, (unsigned long long)(m->size - 8));
    if (n > CLLM_ST_MAX_HEADER)
        return cllm_fail(err, err_len, CLLM_ERR_RANGE,
                         "%s: header length %llu exceeds the limit of %u bytes", path,
                         (unsigned long long)n, CLLM_ST_MAX_HEADER);
    const uint8_t *data = m->data + 8 + n;
    uint64_t data_size = m->size - 8 - n;

    /* A NUL-terminated private copy: the parser never reads the mapping past the header. */
    char *hdr = cllm_strndup((const char *)m->data + 8, (size_t)n);
    if (!hdr)
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", path);
    enum cllm_status st = CLLM_OK;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)n, &end, 0);
    if (!root) {
        size_t at = end && end >= hdr ? (size_t)(end - hdr) : 0;
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: header is not valid JSON (at byte %zu)",
                       path, at);
        goto free_hdr;
    }
    for (const char *p = end; p < hdr + n; p++) {
        if (!is_json_space(*p)) {
            st = cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                           "%s: header has bytes after the JSON object (at byte %zu)", path,
                           (size_t)(p - hdr));
            goto free_json;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: header is not a JSON object", path);
        goto free_json;
    }
    size_t first = s->n_tensors;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0)
            st = check_metadata(path, e, err, err_len);
        else
            st = parse_entry(s, fi, e, data, data_size, err, err_len);
        if (st)
            goto free_json;
    }
    st = check_overlap(s, fi, first, data, err, err_len);
free_json:
    cJSON_Delete(root);
free_hdr:
    free(hdr);
    return st;
}

enum cllm_status cllm_st_open_file(struct cllm_st_set **out, const char *path, char *err,
                                   size_t err_len)
{
    *out = NULL;
    struct cllm_st_set *s = set_new();
    char *p = strdup(path);
    if (!s || !p) {
        free(p);
        cllm_st_free(s);
        return cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", path);
    }
    uint32_t fi;
    enum cllm_status st = add_file(s, p, &fi, err, err_len);
    if (!st)
        st = parse_file(s, fi, err, err_len);
    if (st) {
        cllm_st_free(s);
        return st;
    }
    *out = s;
    return CLLM_OK;
}

/* A shard name must stay inside the folder. */
static bool plain_file_name(const char *n)
{
    return n[0] != '\0' && strchr(n, '/') == NULL && strcmp(n, ".") != 0 && strcmp(n, "..") != 0;
}

static enum cllm_status open_sharded(struct cllm_st_set *s, const char *dir, const char *index,
                                     char *err, size_t err_len)
{
    char *text = NULL;
    size_t len = 0;
    enum cllm_status st = cllm_read_file(index, CLLM_ST_MAX_INDEX, &text, &len, err, err_len);
    if (st)
        return st;
    struct cllm_strmap shards = {0}; /* shard file name (borrowed from the JSON) -> file index */
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (!root) {
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: not valid JSON", index);
        goto free_text;
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                       "%s: \"weight_map\" is missing or not an object", index);
        goto free_json;
    }
    if (!wm->child) {
        st = cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: \"weight_map\" is empty", index);
        goto free_json;
    }
    for (const cJSON *e = wm->child; e; e = e->next) {
        if (!cJSON_IsString(e)) {
            st =
                cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                          "%s: weight_map entry for tensor '%s' is not a string", index, e->string);
            goto free_shards;
        }
        const char *fname = e->valuestring;
        if (!plain_file_name(fname)) {
            st = cllm_fail(err, err_len, CLLM_ERR_FORMAT,
                           "%s: shard name '%s' (tensor '%s') is not a file name inside the "
                           "folder",
                           index, fname, e->string);
            goto free_shards;
        }
        uint64_t fi64;
        if (cllm_strmap_get(&shards, fname, strlen(fname), &fi64))
            continue;
        char *path = cllm_path_join(dir, fname);
        if (!path) {
            st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", index);
            goto free_shards;
        }
        uint32_t fi;
        st = add_file(s, path, &fi, err, err_len);
        if (!st)
            st = parse_file(s, fi, err, err_len);
        if (!st && cllm_strmap_put(&shards, fname, strlen(fname), fi) != CLLM_OK)
            st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", index);
        if (st)
            goto free_shards;
    }
    for (const cJSON *e = wm->child; e; e = e->next) {
        uint64_t fi = 0, ti = 0;
        cllm_strmap_get(&shards, e->valuestring, strlen(e->valuestring), &fi);
        bool found = cllm_strmap_get(&s->by_name, e->string, strlen(e->string), &ti);
        if (!found || s->file_of[ti] != fi) {
            st = cllm_fail(err, err_len, CLLM_ERR_FORMAT, "%s: tensor '%s' is listed in %s but %s",
                           index, e->string, e->valuestring,
                           found ? "is in another shard" : "is not in it");
            goto free_shards;
        }
    }
free_shards:
    cllm_strmap_free(&shards);
free_json:
    cJSON_Delete(root);
free_text:
    free(text);
    return st;
}

static bool may_exist(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 || errno != ENOENT;
}

enum cllm_status cllm_st_open_dir(struct cllm_st_set **out, const char *dir, char *err,
                                  size_t err_len)
{
    *out = NULL;
    enum cllm_status st = CLLM_OK;
    char *single = cllm_path_join(dir, SINGLE_NAME);
    char *index = cllm_path_join(dir, INDEX_NAME);
    if (!single || !index) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", dir);
        goto free_paths;
    }
    if (may_exist(single)) {
        st = cllm_st_open_file(out, single, err, err_len);
        goto free_paths;
    }
    if (!may_exist(index)) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOT_FOUND, "%s: no %s or %s in the folder", dir,
                       SINGLE_NAME, INDEX_NAME);
        goto free_paths;
    }
    struct cllm_st_set *s = set_new();
    if (!s) {
        st = cllm_fail(err, err_len, CLLM_ERR_NOMEM, "%s: out of memory", dir);
        goto free_paths;
    }
    st = open_sharded(s, dir, index, err, err_len);
    if (st)
        cllm_st_free(s);
    else
        *out = s;
free_paths:
    free(single);
    free(index);
    return st;
}

const struct cllm_tensor *cllm_st_find(const struct cllm_st_set *s, const char *name)
{
    uint64_t i;
    if (!s || !cllm_strmap_get(&s->by_name, name, strlen(name), &i))
        return NULL;
    return &s->tensors[i];
}

size_t cllm_st_count(const struct cllm_st_set *s)
{
    return s ? s->n_tensors : 0;
}

const struct cllm_tensor *cllm_st_tensor(const struct cllm_st_set *s, size_t i)
{
    return s && i < s->n_tensors ? &s->tensors[i] : NULL;
}

const char *cllm_st_tensor_path(const struct cllm_st_set *s, const struct cllm_tensor *t)
{
    if (!s || !t || s->n_tensors == 0)
        return "?";
    uintptr_t base = (uintptr_t)s->tensors, p = (uintptr_t)t;
    if (p < base || p >= base + s->n_tensors * sizeof *t || (p - base) % sizeof *t != 0)
        return "?";
    return s->files[s->file_of[(p - base) / sizeof *t]].path;
}
