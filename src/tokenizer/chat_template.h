/*
 * Chat templates: turning a conversation into the prompt text a chat model was trained on,
 * byte for byte what transformers' tokenizer.apply_chat_template(messages, tokenize=False,
 * add_generation_prompt=...) renders. There is no Jinja engine: the model's Jinja source is
 * recognised as one of the template families below (by its tokens, so quoting, whitespace
 * inside tags and `a.b` versus `a['b']` do not matter) and that family is rendered in C. The
 * default system prompt is read from the source, so a fine-tune that changed it renders its
 * own. Anything else fails at init with CLLM_ERR_UNSUPPORTED rather than render wrongly.
 * Tool calling (tools, tool_calls, role "tool") is not supported.
 */
#ifndef CLLM_TOKENIZER_CHAT_TEMPLATE_H
#define CLLM_TOKENIZER_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

#include "cllm.h"
#include "core/buf.h"

enum cllm_chat_format {
    /* Qwen2.5 (and Qwen2.5-Coder): ChatML; when the first message is not a system message a
     * default one goes first. Tool branches are recognised but never rendered. */
    CLLM_CHAT_CHATML_QWEN25,
    /* Qwen2 / Qwen1.5 / SmolLM2: the one-loop ChatML template with a default system prompt;
     * renders like Qwen2.5 for system, user and assistant messages. */
    CLLM_CHAT_CHATML_QWEN2,
    /* Plain ChatML (transformers' old default template): no default system prompt. */
    CLLM_CHAT_CHATML,
};

struct cllm_chat_message {
    const char *role;    /* "system", "user" or "assistant" (NUL-terminated) */
    const char *content; /* any bytes, rendered verbatim (special-token text included) */
    size_t content_len;  /* bytes of content; content may be NULL when 0 */
};

/* A recognised template; immutable after init, so threads may share it. */
struct cllm_chat_template;

/* Recognises jinja_source (the model's tokenizer.chat_template / chat_template.jinja; it is
 * not kept). NULL -> CLLM_ERR_NOT_FOUND (the model has no template); a template of another
 * family or a ChatML variant that renders differently -> CLLM_ERR_UNSUPPORTED, err naming the
 * family it looks like and, for ChatML variants, where it departs from the nearest known one. */
enum cllm_status cllm_chat_template_init(struct cllm_chat_template **out, const char *jinja_source,
                                         char *err, size_t err_len);
void cllm_chat_template_free(struct cllm_chat_template *t);

enum cllm_chat_format cllm_chat_template_format(const struct cllm_chat_template *t);
/* The family as a short name: "qwen2.5", "qwen2" or "chatml". */
const char *cllm_chat_template_name(const struct cllm_chat_template *t);
/* The default system prompt (*len set; NUL-terminated), NULL for plain ChatML. Borrowed: lives
 * as long as t. */
const char *cllm_chat_template_default_system(const struct cllm_chat_template *t, size_t *len);

/* Appends the prompt for msgs[0..n) to out; with add_generation_prompt the assistant turn is
 * opened for the model to continue. An empty conversation, a missing role or content, or a
 * role other than system/user/assistant -> CLLM_ERR_INVALID_ARG with err naming the message.
 * On any error out is left as it was. */
enum cllm_status cllm_chat_template_render(const struct cllm_chat_template *t,
                                           const struct cllm_chat_message *msgs, size_t n,
                                           bool add_generation_prompt, struct cllm_buf *out,
                                           char *err, size_t err_len);

#endif
