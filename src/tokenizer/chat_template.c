/*
 * Chat template recognition and rendering (see chat_template.h).
 *
 * Recognition lexes the Jinja source as Jinja does under transformers' settings (trim_blocks,
 * lstrip_blocks, one trailing newline dropped, newlines normalised): the literal text left
 * between tags after whitespace control, then the tokens of each tag. Tokens are made
 * canonical (string literals decoded, `a.b` read as `a['b']`, literals joined by `+` folded)
 * and compared with skeletons of the known templates, written below in the same Jinja. In a
 * skeleton, a literal containing @@SYSTEM@@ captures the default system prompt from the same
 * place in the model's template; the literal '@@ANY@@' matches any literal (the tool-calling
 * text, which is never rendered).
 */
#include "tokenizer/chat_template.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/status.h"
#include "tokenizer/utf8.h"

/* --- the known templates --- */

#define SYSTEM_SLOT "@@SYSTEM@@"
#define ANY_SLOT "@@ANY@@"

/* Qwen2.5-Instruct / Qwen2.5-Coder-Instruct (tokenizer_config.json, GGUF). */
static const char qwen25_skeleton[] =
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" ANY_SLOT "' }}{%- endif %}"
    "{{- '" ANY_SLOT "' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '" ANY_SLOT "' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" SYSTEM_SLOT "<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}"
    "{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}"
    "{{- message.content }}"
    "{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/* Qwen2-Instruct, Qwen1.5-Chat, SmolLM2-Instruct. */
static const char qwen2_skeleton[] =
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" SYSTEM_SLOT "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/* transformers' former default template. */
static const char chatml_skeleton[] =
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

static const struct family {
    enum cllm_chat_format format;
    const char *name;  /* cllm_chat_template_name */
    const char *title; /* in messages */
    const char *skeleton;
} families[] = {
    {CLLM_CHAT_CHATML_QWEN25, "qwen2.5", "Qwen2.5", qwen25_skeleton},
    {CLLM_CHAT_CHATML_QWEN2, "qwen2", "Qwen2", qwen2_skeleton},
    {CLLM_CHAT_CHATML, "chatml", "plain ChatML", chatml_skeleton},
};
#define N_FAMILIES (sizeof families / sizeof families[0])
#define SUPPORTED "supported: Qwen2.5, Qwen2 and plain ChatML templates"

/* Markers of other template families, to say which one a rejected template is. */
static const struct {
    const char *marker;
    const char *family;
} other_families[] = {
    {"<|start_header_id|>", "Llama 3"},
    {"[INST]", "Llama 2 / Mistral"},
    {"<start_of_turn>", "Gemma"},
    {"<\uFF5CUser\uFF5C>", "DeepSeek"},
    {"<|START_OF_TURN_TOKEN|>", "Command-R"},
    {"<|user|>", "Phi-3 / Zephyr / GLM"},
    {"### Instruction", "Alpaca"},
};

struct cllm_chat_template {
    enum cllm_chat_format format;
    char *system;      /* default system prompt (NUL-terminated), NULL for plain ChatML */
    size_t system_len; /* bytes of system */
};

/* --- lexing --- */

enum tok_kind {
    TOK_TEXT, /* literal text between tags after whitespace control; never empty */
    TOK_STMT, /* {% */
    TOK_EXPR, /* {{ */
    TOK_END,  /* %} or }} */
    TOK_NAME,
    TOK_NUM,
    TOK_STR, /* a string literal, decoded */
    TOK_OP,  /* an operator, bracket, or a byte Jinja would not accept there */
};

struct tok {
    enum tok_kind kind;
    size_t off, len; /* the token's text in toks.store */
    size_t src;      /* byte offset in the normalised source, for messages */
};

struct toks {
    struct tok *v; /* [cap] */
    size_t n, cap;
    struct cllm_buf store; /* token texts */
};

static void toks_free(struct toks *t)
{
    free(t->v);
    cllm_buf_free(&t->store);
}

/* Pushes a token whose text is store[off..store.len). */
static enum cllm_status push_stored(struct toks *t, enum tok_kind kind, size_t off, size_t src)
{
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 256;
        struct tok *v = cllm_realloc_array(t->v, cap, sizeof *v);
        if (!v)
            return CLLM_ERR_NOMEM;
        t->v = v;
        t->cap = cap;
    }
    t->v[t->n++] = (struct tok){kind, off, t->store.len - off, src};
    return CLLM_OK;
}

static enum cllm_status push(struct toks *t, enum tok_kind kind, const char *s, size_t len,
                             size_t src)
{
    size_t off = t->store.len;
    enum cllm_status st = cllm_buf_append(&t->store, s, len);
    return st ? st : push_stored(t, kind, off, src);
}

static const char *tok_text(const struct toks *t, const struct tok *k)
{
    return t->store.data + k->off;
}

static bool tok_is(const struct toks *t, size_t i, enum tok_kind kind, const char *text)
{
    if (i >= t->n || t->v[i].kind != kind)
        return false;
    return !text ||
           (t->v[i].len == strlen(text) && !memcmp(tok_text(t, &t->v[i]), text, t->v[i].len));
}

/* Jinja's \s on the ASCII range; other whitespace is left in place, which can only make a
 * template fail to match, never match wrongly. */
static bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static bool is_name_start(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Python's one-character escapes: each letter, then what it stands for. */
static const char simple_escapes[] = "\\\\''\"\"a\ab\bf\fn\nr\rt\tv\v";

/* Decodes the string literal starting at s[*p] (a quote) into store, as Jinja does (Python's
 * unicode-escape: \n \t \\ \' \xhh \uhhhh \Uhhhhhhhh \ooo ...; unknown escapes stay as they
 * are). Advances *p past the closing quote; CLLM_ERR_FORMAT at an unterminated literal or an
 * escape this decoder does not reproduce exactly. */
static enum cllm_status lex_string(const char *s, size_t n, size_t *p, struct cllm_buf *store)
{
    char quote = s[*p];
    size_t i = *p + 1;
    enum cllm_status st = CLLM_OK;
    while (!st) {
        if (i >= n)
            return CLLM_ERR_FORMAT;
        char c = s[i];
        if (c == quote) {
            *p = i + 1;
            return CLLM_OK;
        }
        if (c != '\\') {
            st = cllm_buf_append_byte(store, c);
            i++;
            continue;
        }
        if (i + 1 >= n)
            return CLLM_ERR_FORMAT;
        char e = s[i + 1];
        i += 2;
        const char *m = NULL;
        for (const char *q = simple_escapes; *q && !m; q += 2)
            m = *q == e ? q : NULL;
        if (m) {
            st = cllm_buf_append_byte(store, m[1]);
            continue;
        }
        if (e == '\n')
            continue; /* a line continuation */
        uint32_t cp;
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (digits) {
            cp = 0;
            for (int d = 0; d < digits; d++) {
                int v = i < n ? hex_value(s[i]) : -1;
                if (v < 0)
                    return CLLM_ERR_FORMAT;
                cp = cp * 16 + (uint32_t)v;
                i++;
            }
        } else if (e >= '0' && e <= '7') {
            cp = (uint32_t)(e - '0');
            for (int d = 0; d < 2 && i < n && s[i] >= '0' && s[i] <= '7'; d++)
                cp = cp * 8 + (uint32_t)(s[i++] - '0');
        } else if (e == 'N' || (unsigned char)e >= 0x80) {
            return CLLM_ERR_FORMAT; /* \N{name}; a backslash before non-ASCII */
        } else {
            char keep[2] = {'\\', e};
            st = cllm_buf_append(store, keep, 2);
            continue;
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return CLLM_ERR_FORMAT;
        char u[4];
        st = cllm_buf_append(store, u, cllm_utf8_encode(cp, u));
    }
    return st;
}

/* Operators Jinja knows, longest first. */
static const char *const operators[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                        "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                        "=",  ".",  ":",  "|",  ",",  ";",  ">", "<"};

/* Lexes the tokens of the tag whose opener ({% or {{) is at s[open], up to its closer, then
 * consumes what the closer's whitespace control removes after it. Returns where the text after
 * the tag starts in *next; CLLM_ERR_FORMAT (at *bad) for an unterminated tag or literal. */
static enum cllm_status lex_tag(const char *s, size_t n, size_t open, struct toks *t, size_t *next,
                                size_t *bad)
{
    bool block = s[open + 1] == '%';
    size_t p = open + 2;
    if (p < n && (s[p] == '-' || s[p] == '+'))
        p++;
    enum cllm_status st = push(t, block ? TOK_STMT : TOK_EXPR, "", 0, open);
    int depth = 0; /* brackets open: Jinja only looks for the closer outside them */
    while (!st) {
        while (p < n && is_space(s[p]))
            p++;
        if (p >= n) {
            *bad = open;
            return CLLM_ERR_FORMAT;
        }
        char c = s[p];
        char end = block ? '%' : '}';
        if (depth == 0) {
            bool minus = c == '-' && p + 2 < n && s[p + 1] == end && s[p + 2] == '}';
            bool plus = block && c == '+' && p + 2 < n && s[p + 1] == end && s[p + 2] == '}';
            bool plain = c == end && p + 1 < n && s[p + 1] == '}';
            if (minus || plus || plain) {
                st = push(t, TOK_END, "", 0, p);
                p += plain ? 2 : 3;
                if (minus) {
                    while (p < n && is_space(s[p]))
                        p++;
                } else if (plain && block && p < n && s[p] == '\n') {
                    p++; /* trim_blocks */
                }
                *next = p;
                return st;
            }
        }
        size_t start = p;
        if (c == '\'' || c == '"') {
            size_t off = t->store.len;
            st = lex_string(s, n, &p, &t->store);
            if (st == CLLM_ERR_FORMAT)
                *bad = start;
            if (!st)
                st = push_stored(t, TOK_STR, off, start);
        } else if (is_name_start(c)) {
            while (p < n && (is_name_start(s[p]) || is_digit(s[p])))
                p++;
            st = push(t, TOK_NAME, s + start, p - start, start);
        } else if (is_digit(c)) {
            while (p < n && (is_digit(s[p]) || s[p] == '_' || s[p] == '.' || s[p] == 'e'))
                p++;
            st = push(t, TOK_NUM, s + start, p - start, start);
        } else if (c == '.' && t->n &&
                   (t->v[t->n - 1].kind == TOK_NAME || tok_is(t, t->n - 1, TOK_OP, "]") ||
                    tok_is(t, t->n - 1, TOK_OP, ")"))) {
            /* a.b is read as a['b']: for the dicts transformers passes they are the same */
            size_t q = p + 1;
            while (q < n && is_space(s[q]))
                q++;
            if (q < n && is_name_start(s[q])) {
                size_t name = q;
                while (q < n && (is_name_start(s[q]) || is_digit(s[q])))
                    q++;
                st = push(t, TOK_OP, "[", 1, start);
                if (!st)
                    st = push(t, TOK_STR, s + name, q - name, name);
                if (!st)
                    st = push(t, TOK_OP, "]", 1, start);
                p = q;
            } else {
                st = push(t, TOK_OP, ".", 1, start);
                p++;
            }
        } else {
            size_t len = 1;
            for (size_t k = 0; k < sizeof operators / sizeof operators[0]; k++) {
                size_t l = strlen(operators[k]);
                if (p + l <= n && !memcmp(s + p, operators[k], l)) {
                    len = l;
                    break;
                }
            }
            if (len == 1 && (c == '(' || c == '[' || c == '{'))
                depth++;
            else if (len == 1 && (c == ')' || c == ']' || c == '}') && depth > 0)
                depth--;
            st = push(t, TOK_OP, s + p, len, start);
            p += len;
        }
    }
    return st;
}

/* Index of the next tag opener ({{, {% or {#) at or after pos, n if none. */
static size_t find_open(const char *s, size_t n, size_t pos)
{
    for (size_t i = pos; i + 1 < n; i++)
        if (s[i] == '{' && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#'))
            return i;
    return n;
}

/* Lexes s[0..n) (already newline-normalised) into t. */
static enum cllm_status lex(const char *s, size_t n, struct toks *t, size_t *bad)
{
    size_t pos = 0;
    for (;;) {
        size_t open = find_open(s, n, pos);
        size_t a = pos, b = open;
        /* Jinja: the previous tag's match ended a line (or this is the start). */
        bool line_starting = a == 0 || s[a - 1] == '\n';
        if (open < n) {
            char mod = open + 2 < n ? s[open + 2] : '\0';
            if (mod == '-') {
                while (b > a && is_space(s[b - 1]))
                    b--;
            } else if (mod != '+' && s[open + 1] != '{') {
                /* lstrip_blocks: blanks between a line start and a block tag go */
                size_t l = b;
                while (l > a && s[l - 1] != '\n')
                    l--;
                bool blank = true;
                for (size_t i = l; i < b; i++)
                    blank = blank && is_space(s[i]);
                if ((l > a || line_starting) && blank)
                    b = l;
            }
        }
        if (b > a) {
            enum cllm_status st = push(t, TOK_TEXT, s + a, b - a, a);
            if (st)
                return st;
        }
        if (open >= n)
            return CLLM_OK;
        if (s[open + 1] == '#') {
            /* A comment renders nothing; its closer controls whitespace like a block's. */
            size_t body = open + 2 + (open + 2 < n && (s[open + 2] == '-' || s[open + 2] == '+'));
            size_t c = body;
            while (c + 1 < n && !(s[c] == '#' && s[c + 1] == '}'))
                c++;
            if (c + 1 >= n) {
                *bad = open;
                return CLLM_ERR_FORMAT;
            }
            char before = c > body ? s[c - 1] : '\0';
            pos = c + 2;
            if (before == '-') {
                while (pos < n && is_space(s[pos]))
                    pos++;
            } else if (before != '+' && pos < n && s[pos] == '\n') {
                pos++;
            }
            continue;
        }
        enum cllm_status st = lex_tag(s, n, open, t, &pos, bad);
        if (st)
            return st;
    }
}

/* Folds 'x' + 'y' into 'xy' where the + can only be string concatenation between these two
 * operands: nothing binding tighter than + on either side. */
static enum cllm_status fold_strings(struct toks *t)
{
    size_t w = 0;
    for (size_t r = 0; r < t->n; r++) {
        struct tok k = t->v[r];
        bool fold = k.kind == TOK_STR && w >= 3 && t->v[w - 1].kind == TOK_OP &&
                    tok_is(t, w - 1, TOK_OP, "+") && t->v[w - 2].kind == TOK_STR;
        if (fold) {
            static const char *const before[] = {"(", "[", "+", "~", ",", "="};
            static const char *const after[] = {")", "]", "+", "~", ","};
            bool ok_before = t->v[w - 3].kind == TOK_EXPR || t->v[w - 3].kind == TOK_STMT;
            for (size_t i = 0; i < sizeof before / sizeof before[0]; i++)
                ok_before = ok_before || tok_is(t, w - 3, TOK_OP, before[i]);
            bool ok_after = r + 1 < t->n && t->v[r + 1].kind == TOK_END;
            for (size_t i = 0; i < sizeof after / sizeof after[0]; i++)
                ok_after = ok_after || tok_is(t, r + 1, TOK_OP, after[i]);
            fold = ok_before && ok_after;
        }
        if (!fold) {
            t->v[w++] = k;
            continue;
        }
        struct tok *left = &t->v[w - 2];
        size_t off = t->store.len;
        /* store may move while appending: copy through offsets */
        enum cllm_status st = cllm_buf_reserve(&t->store, left->len + k.len);
        if (st)
            return st;
        memcpy(t->store.data + off, t->store.data + left->off, left->len);
        memcpy(t->store.data + off + left->len, t->store.data + k.off, k.len);
        t->store.len += left->len + k.len;
        t->store.data[t->store.len] = '\0';
        left->off = off;
        left->len += k.len;
        w--; /* drop the + */
    }
    t->n = w;
    return CLLM_OK;
}

/* Jinja's view of the source: \r\n and \r become \n, and one trailing newline is dropped. */
static enum cllm_status normalise(const char *src, struct cllm_buf *out)
{
    size_t n = strlen(src);
    enum cllm_status st = cllm_buf_reserve(out, n);
    for (size_t i = 0; i < n && !st; i++) {
        if (src[i] == '\r') {
            st = cllm_buf_append_byte(out, '\n');
            if (i + 1 < n && src[i + 1] == '\n')
                i++;
        } else {
            st = cllm_buf_append_byte(out, src[i]);
        }
    }
    if (!st && out->len && out->data[out->len - 1] == '\n')
        out->data[--out->len] = '\0';
    if (!st && !out->data)
        st = cllm_buf_append(out, "", 0);
    return st;
}

static enum cllm_status lex_source(const char *src, struct cllm_buf *norm, struct toks *t,
                                   size_t *bad)
{
    enum cllm_status st = normalise(src, norm);
    if (!st)
        st = lex(norm->data, norm->len, t, bad);
    if (!st)
        st = fold_strings(t);
    return st;
}

/* --- matching --- */

/* Compares the template's tokens with a skeleton's. On a match (*sys, *sys_len) is the captured
 * default system prompt (NULL if the skeleton has none); otherwise *progress is the index of
 * the first template token that differs (t->n if the template stops short). */
static bool match(const struct toks *t, const struct toks *sk, const char **sys, size_t *sys_len,
                  size_t *progress)
{
    *sys = NULL;
    *sys_len = 0;
    size_t i = 0;
    for (; i < t->n && i < sk->n; i++) {
        *progress = i;
        const struct tok *a = &t->v[i], *b = &sk->v[i];
        if (a->kind != b->kind)
            return false;
        const char *at = tok_text(t, a), *bt = tok_text(sk, b);
        if (b->kind == TOK_STR) {
            if (b->len == strlen(ANY_SLOT) && !memcmp(bt, ANY_SLOT, b->len))
                continue;
            const char *slot = memmem(bt, b->len, SYSTEM_SLOT, strlen(SYSTEM_SLOT));
            if (slot) {
                size_t pre = (size_t)(slot - bt), post = b->len - pre - strlen(SYSTEM_SLOT);
                if (a->len < pre + post || memcmp(at, bt, pre) ||
                    memcmp(at + a->len - post, slot + strlen(SYSTEM_SLOT), post))
                    return false;
                *sys = at + pre;
                *sys_len = a->len - pre - post;
                continue;
            }
        }
        if (a->len != b->len || memcmp(at, bt, a->len))
            return false;
    }
    *progress = i;
    return i == sk->n && i == t->n;
}

static void line_col(const char *s, size_t off, size_t *line, size_t *col)
{
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < off; i++) {
        if (s[i] == '\n') {
            (*line)++;
            *col = 1;
        } else {
            (*col)++;
        }
    }
}

/* The error for a template that matched no skeleton: which family it looks like, and for a
 * ChatML variant where it departs from the known template it follows longest. */
static enum cllm_status unrecognised(const char *src, const struct cllm_buf *norm,
                                     const struct toks *t, const size_t *progress, bool lexed,
                                     size_t bad, char *err, size_t err_len)
{
    for (size_t i = 0; i < sizeof other_families / sizeof other_families[0]; i++)
        if (strstr(src, other_families[i].marker))
            return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                             "chat template: the %s template family is not supported (" SUPPORTED
                             ")",
                             other_families[i].family);
    if (!strstr(src, "<|im_start|>"))
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "chat template: not a template family cllm knows (" SUPPORTED ")");
    size_t line, col;
    if (!lexed) {
        line_col(norm->data, bad, &line, &col);
        return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                         "chat template: a ChatML template cllm cannot read (unterminated tag or "
                         "string at line %zu, column %zu; " SUPPORTED ")",
                         line, col);
    }
    size_t best = 0;
    for (size_t f = 1; f < N_FAMILIES; f++)
        if (progress[f] > progress[best])
            best = f;
    size_t off = progress[best] < t->n ? t->v[progress[best]].src : norm->len;
    line_col(norm->data, off, &line, &col);
    return cllm_fail(err, err_len, CLLM_ERR_UNSUPPORTED,
                     "chat template: an unsupported ChatML variant (differs from the %s template "
                     "at line %zu, column %zu; " SUPPORTED ")",
                     families[best].title, line, col);
}

enum cllm_status cllm_chat_template_init(struct cllm_chat_template **out, const char *jinja_source,
                                         char *err, size_t err_len)
{
    *out = NULL;
    if (!jinja_source)
        return cllm_fail(err, err_len, CLLM_ERR_NOT_FOUND,
                         "chat template: the model has none (no tokenizer.chat_template in the "
                         "GGUF, no chat_template in tokenizer_config.json or chat_template.jinja)");
    struct cllm_buf norm = {0}, sk_norm = {0};
    struct toks t = {0};
    size_t bad = 0, progress[N_FAMILIES] = {0};
    const struct family *found = NULL;
    const char *sys = NULL;
    size_t sys_len = 0;

    enum cllm_status st = lex_source(jinja_source, &norm, &t, &bad);
    bool lexed = st == CLLM_OK;
    if (st && st != CLLM_ERR_FORMAT)
        goto free_toks;
    for (size_t f = 0; lexed && f < N_FAMILIES && !found; f++) {
        struct toks sk = {0};
        size_t sk_bad;
        sk_norm.len = 0;
        st = lex_source(families[f].skeleton, &sk_norm, &sk, &sk_bad);
        if (st) {
            toks_free(&sk);
            goto free_toks;
        }
        if (match(&t, &sk, &sys, &sys_len, &progress[f]))
            found = &families[f]; /* sys points into t's store, which outlives sk */
        toks_free(&sk);
    }
    if (!found) {
        st = unrecognised(jinja_source, &norm, &t, progress, lexed, bad, err, err_len);
        goto free_toks;
    }

    struct cllm_chat_template *tp = calloc(1, sizeof *tp);
    if (!tp) {
        st = CLLM_ERR_NOMEM;
        goto free_toks;
    }
    tp->format = found->format;
    if (sys) {
        tp->system = cllm_strndup(sys, sys_len);
        tp->system_len = sys_len;
        if (!tp->system) {
            free(tp);
            st = CLLM_ERR_NOMEM;
            goto free_toks;
        }
    }
    *out = tp;
    st = CLLM_OK;

free_toks:
    toks_free(&t);
    cllm_buf_free(&norm);
    cllm_buf_free(&sk_norm);
    if (st == CLLM_ERR_NOMEM)
        cllm_fail(err, err_len, st, "chat template: out of memory");
    return st;
}

void cllm_chat_template_free(struct cllm_chat_template *t)
{
    if (!t)
        return;
    free(t->system);
    free(t);
}

enum cllm_chat_format cllm_chat_template_format(const struct cllm_chat_template *t)
{
    return t->format;
}

const char *cllm_chat_template_name(const struct cllm_chat_template *t)
{
    for (size_t f = 0; f < N_FAMILIES; f++)
        if (families[f].format == t->format)
            return families[f].name;
    return "unknown";
}

const char *cllm_chat_template_default_system(const struct cllm_chat_template *t, size_t *len)
{
    *len = t->system_len;
    return t->system;
}

/* --- rendering --- */

/* Up to 32 bytes of s for a message, anything but printable ASCII shown as '?'. */
static void shown(const char *s, char out[36])
{
    size_t i = 0;
    for (; s[i] && i < 32; i++)
        out[i] = s[i] >= 0x20 && s[i] < 0x7f ? s[i] : '?';
    if (s[i])
        out[i++] = '.', out[i++] = '.', out[i++] = '.';
    out[i] = '\0';
}

static enum cllm_status append_turn(struct cllm_buf *out, const char *role, const char *content,
                                    size_t len)
{
    enum cllm_status st = cllm_buf_append(out, "<|im_start|>", 12);
    if (!st)
        st = cllm_buf_append(out, role, strlen(role));
    if (!st)
        st = cllm_buf_append_byte(out, '\n');
    if (!st)
        st = cllm_buf_append(out, content, len);
    if (!st)
        st = cllm_buf_append(out, "<|im_end|>\n", 11);
    return st;
}

enum cllm_status cllm_chat_template_render(const struct cllm_chat_template *t,
                                           const struct cllm_chat_message *msgs, size_t n,
                                           bool add_generation_prompt, struct cllm_buf *out,
                                           char *err, size_t err_len)
{
    if (!t || !out || (n && !msgs))
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                         "chat template: render called without a template, messages or output");
    if (n == 0)
        return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                         "chat template: the conversation has no messages");
    for (size_t i = 0; i < n; i++) {
        const char *role = msgs[i].role;
        if (!role)
            return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                             "chat template: message %zu has no role", i);
        if (!strcmp(role, "tool"))
            return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                             "chat template: message %zu: role \"tool\" (tool calling) is not "
                             "supported",
                             i);
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant")) {
            char buf[36];
            shown(role, buf);
            return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                             "chat template: message %zu: unknown role \"%s\" (expected system, "
                             "user or assistant)",
                             i, buf);
        }
        if (!msgs[i].content && msgs[i].content_len)
            return cllm_fail(err, err_len, CLLM_ERR_INVALID_ARG,
                             "chat template: message %zu has no content", i);
    }

    size_t old_len = out->len;
    enum cllm_status st = CLLM_OK;
    /* Both Qwen templates put the default system turn first unless the conversation starts
     * with its own; a later system message is rendered like any other. */
    if (t->system && strcmp(msgs[0].role, "system"))
        st = append_turn(out, "system", t->system, t->system_len);
    for (size_t i = 0; i < n && !st; i++)
        st = append_turn(out, msgs[i].role, msgs[i].content ? msgs[i].content : "",
                         msgs[i].content_len);
    if (!st && add_generation_prompt)
        st = cllm_buf_append(out, "<|im_start|>assistant\n", 22);
    if (st) {
        if (out->data) {
            out->len = old_len;
            out->data[old_len] = '\0';
        }
        return cllm_fail(err, err_len, st, "chat template: out of memory rendering the prompt");
    }
    return CLLM_OK;
}
