/*
 * A fuzz target's driver for builds without libFuzzer (gcc, the sanitizer suite in CI):
 *
 *   fuzz_X [--mutations N] [--seed S] [--dict FILE] CORPUS...
 *
 * runs every file under the CORPUS folders (or files) through the target, then N inputs made
 * from them by stacked random mutations -- bit flips, interesting integers written over
 * length and offset fields, cut / inserted / repeated ranges, splices of two inputs, words of
 * the dictionary (libFuzzer's format) -- from a seeded generator, so a run is the same every
 * time and a failure reproduces. Not coverage-guided (that is libFuzzer's job, scripts/fuzz),
 * but it reaches the error paths of every field of the seeds on every CI run. A crash, a
 * sanitizer's report or a failed property ends the run after the input is saved as
 * fuzz-crash-<target>.bin in the working folder.
 */
#include "fuzz.h"

#include <dirent.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));
/* Present when a sanitizer is linked: called before it ends the process on an error. */
void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

struct input {
    uint8_t *data;
    size_t size;
    char *path;
};

static struct input *corpus;
static size_t n_corpus, cap_corpus;
static const char *target_name = "target";

/* The input being run, written out by the abort handler. */
static const uint8_t *cur_data;
static size_t cur_size;

static void save_input(void)
{
    char name[256];
    snprintf(name, sizeof name, "fuzz-crash-%s.bin", target_name);
    FILE *f = fopen(name, "wb");
    if (f) {
        fwrite(cur_data, 1, cur_size, f);
        fclose(f);
        fprintf(stderr, "fuzz: the failing input (%zu bytes) is in %s\n", cur_size, name);
    }
}

static void save_and_die(int sig)
{
    save_input();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void run_one(const uint8_t *data, size_t size)
{
    cur_data = data;
    cur_size = size;
    LLVMFuzzerTestOneInput(data, size);
}

static void add_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fuzz: cannot open %s\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *d = malloc(n > 0 ? (size_t)n : 1);
    if (!d || (n > 0 && fread(d, 1, (size_t)n, f) != (size_t)n)) {
        fprintf(stderr, "fuzz: cannot read %s\n", path);
        exit(2);
    }
    fclose(f);
    if (n_corpus == cap_corpus) {
        cap_corpus = cap_corpus ? 2 * cap_corpus : 16;
        corpus = realloc(corpus, cap_corpus * sizeof *corpus);
        if (!corpus)
            exit(2);
    }
    corpus[n_corpus++] = (struct input){d, (size_t)n, strdup(path)};
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Files of a folder in name order (readdir's order differs between file systems, and the
 * mutations depend on the corpus order). */
static void add_path(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "fuzz: no such corpus %s\n", path);
        exit(2);
    }
    if (!S_ISDIR(st.st_mode)) {
        add_file(path);
        return;
    }
    DIR *d = opendir(path);
    if (!d)
        exit(2);
    char **names = NULL;
    size_t n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.')
            continue;
        names = realloc(names, (n + 1) * sizeof *names);
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof *names, by_name);
    for (size_t i = 0; i < n; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", path, names[i]);
        add_file(p);
        free(names[i]);
    }
    free(names);
}

/* The dictionary's words (bytes, may hold NUL). */
static struct input *dict;
static size_t n_dict;

/* One line of a libFuzzer dictionary: [name=]"bytes" with \\, \" and \xHH escapes; blank
 * lines and # comments are skipped. */
static void add_dict_line(const char *line, const char *file)
{
    const char *q = strchr(line, '"');
    while (*line == ' ' || *line == '\t')
        line++;
    if (*line == '#' || *line == '\n' || *line == 0)
        return;
    if (!q) {
        fprintf(stderr, "fuzz: %s: not a dictionary line: %s", file, line);
        exit(2);
    }
    uint8_t word[256];
    size_t n = 0;
    for (const char *p = q + 1; *p && *p != '"'; p++) {
        unsigned v = (uint8_t)*p;
        if (*p == '\\' && p[1] == 'x' && sscanf(p + 2, "%2x", &v) == 1)
            p += 3;
        else if (*p == '\\' && p[1])
            v = (uint8_t)*++p;
        if (n < sizeof word)
            word[n++] = (uint8_t)v;
    }
    dict = realloc(dict, (n_dict + 1) * sizeof *dict);
    uint8_t *copy = malloc(n ? n : 1);
    if (!dict || !copy)
        exit(2);
    memcpy(copy, word, n);
    dict[n_dict++] = (struct input){copy, n, NULL};
}

static void read_dict(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "fuzz: cannot open the dictionary %s\n", path);
        exit(2);
    }
    char line[1024];
    while (fgets(line, sizeof line, f))
        add_dict_line(line, path);
    fclose(f);
}

static uint64_t rng_state;

static uint64_t rnd(void)
{
    /* splitmix64: a seed of 0 is fine */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static size_t below(size_t n)
{
    return n ? (size_t)(rnd() % n) : 0;
}

/* The values most likely to break a length, count or offset check. */
static const uint64_t interesting[] = {
    0,          1,          2,           0x7f,        0x80,         0xff,
    0x100,      0x7fff,     0x8000,      0xffff,      0x10000,      0x7fffffff,
    0x80000000, 0xffffffff, 0x100000000, 1ull << 40,  1ull << 62,   0x7fffffffffffffffull,
    1ull << 63, ~0ull,      ~0ull - 7,   0xfffffff0u, 0x1000000u - 1,
};

/* One mutation of b[0..*n) in place; cap bytes are available. */
static void mutate_once(uint8_t *b, size_t *n, size_t cap)
{
    size_t size = *n;
    switch (below(size ? 9 : 2)) {
    case 0: { /* insert a dictionary word or random bytes */
        const uint8_t *w = NULL;
        size_t wl = 0;
        if (n_dict && below(2)) {
            const struct input *d = &dict[below(n_dict)];
            w = d->data;
            wl = d->size;
        } else {
            wl = 1 + below(8);
        }
        if (size + wl > cap)
            return;
        size_t at = below(size + 1);
        memmove(b + at + wl, b + at, size - at);
        for (size_t i = 0; i < wl; i++)
            b[at + i] = w ? w[i] : (uint8_t)rnd();
        *n = size + wl;
        return;
    }
    case 1: { /* repeat a range */
        if (!size)
            return;
        size_t from = below(size), len = 1 + below(size - from < 64 ? size - from : 64);
        if (size + len > cap)
            return;
        size_t at = below(size + 1);
        uint8_t tmp[64];
        memcpy(tmp, b + from, len);
        memmove(b + at + len, b + at, size - at);
        memcpy(b + at, tmp, len);
        *n = size + len;
        return;
    }
    case 2: /* flip a bit */
        b[below(size)] ^= (uint8_t)(1u << below(8));
        return;
    case 3: /* a random byte */
        b[below(size)] = (uint8_t)rnd();
        return;
    case 4:
    case 5: { /* an interesting integer, 1/2/4/8 bytes little-endian, maybe off by a little */
        size_t width = (size_t)1 << below(4);
        if (width > size)
            width = size;
        uint64_t v = interesting[below(sizeof interesting / sizeof *interesting)];
        if (below(4) == 0)
            v += (uint64_t)(int64_t)(below(17) - 8);
        size_t at = below(size - width + 1);
        for (size_t i = 0; i < width; i++)
            b[at + i] = (uint8_t)(v >> (8 * i));
        return;
    }
    case 6: { /* cut a range */
        size_t at = below(size), len = 1 + below(size - at < 256 ? size - at : 256);
        memmove(b + at, b + at + len, size - at - len);
        *n = size - len;
        return;
    }
    case 7: /* truncate */
        *n = below(size);
        return;
    default: { /* splice: the head of this input, the tail of another */
        const struct input *o = &corpus[below(n_corpus)];
        size_t at = below(size + 1), from = below(o->size + 1);
        size_t len = o->size - from;
        if (at + len > cap)
            len = cap - at;
        memcpy(b + at, o->data + from, len);
        *n = at + len;
        return;
    }
    }
}

int main(int argc, char **argv)
{
    uint64_t n_mutations = 0, seed = 1;
    const char *slash = strrchr(argv[0], '/');
    target_name = slash ? slash + 1 : argv[0];
    if (LLVMFuzzerInitialize)
        LLVMFuzzerInitialize(&argc, &argv);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mutations") && i + 1 < argc)
            n_mutations = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--dict") && i + 1 < argc)
            read_dict(argv[++i]);
        else
            add_path(argv[i]);
    }
    if (n_corpus == 0) {
        fprintf(stderr, "usage: %s [--mutations N] [--seed S] [--dict FILE] CORPUS...\n",
                argv[0]);
        return 2;
    }
    signal(SIGABRT, save_and_die);
    signal(SIGSEGV, save_and_die);
    signal(SIGBUS, save_and_die);
    signal(SIGFPE, save_and_die);
    if (__sanitizer_set_death_callback)
        __sanitizer_set_death_callback(save_input);

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    size_t max = 0;
    for (size_t i = 0; i < n_corpus; i++) {
        fuzz_stage = 0;
        run_one(corpus[i].data, corpus[i].size);
        if (fuzz_stage < fuzz_full_stage) {
            fprintf(stderr, "%s: corpus input %zu (%s) got through %d of %d readers: seeds must "
                            "be valid inputs\n", target_name, i, corpus[i].path, fuzz_stage,
                    fuzz_full_stage);
            return 1;
        }
        if (corpus[i].size > max)
            max = corpus[i].size;
    }
    rng_state = seed;
    const size_t cap = 2 * max + 1024;
    uint8_t *buf = malloc(cap);
    if (!buf)
        return 2;
    uint64_t reached[9] = {0}; /* mutations by the number of readers that accepted them */
    for (uint64_t k = 0; k < n_mutations; k++) {
        const struct input *in = &corpus[below(n_corpus)];
        size_t n = in->size;
        memcpy(buf, in->data, n);
        for (size_t m = 1 + below(4); m > 0; m--)
            mutate_once(buf, &n, cap);
        /* an exact-size heap copy, so ASan sees a read past the end of the input */
        uint8_t *exact = malloc(n ? n : 1);
        if (!exact)
            return 2;
        memcpy(exact, buf, n);
        fuzz_stage = 0;
        run_one(exact, n);
        reached[fuzz_stage < 8 ? fuzz_stage : 8]++;
        free(exact);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%s: %zu corpus inputs and %llu mutations (seed %llu) in %.1f s, no failure\n",
           target_name, n_corpus, (unsigned long long)n_mutations, (unsigned long long)seed,
           (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    printf("mutations accepted by k of the %d readers:", fuzz_full_stage);
    for (int k = 0; k <= fuzz_full_stage && k < 9; k++)
        printf(" %d: %llu", k, (unsigned long long)reached[k]);
    printf("\n");
    free(buf);
    for (size_t i = 0; i < n_corpus; i++) {
        free(corpus[i].data);
        free(corpus[i].path);
    }
    for (size_t i = 0; i < n_dict; i++)
        free(dict[i].data);
    free(dict);
    free(corpus);
    return 0;
}
