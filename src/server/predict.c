/*
 * POST /predict, the evaluation contract: {"prompt": "q"} -> {"response": "a"} and
 * {"prompt": ["q1", ...]} -> {"response": ["a1", ...]} in the same order. Each prompt is a user
 * message under the model's chat template (with "system" as the system message, else the
 * template's default). Every prompt of a list is checked before any is submitted; then all go
 * to the engine at once so they are batched.
 */
#include <stdio.h>
#include <string.h>

#include "server/http.h"
#include "server/routes.h"

/* Rejects the request (queuing the reply) unless every prompt is a non-empty string; *n gets
 * the number of prompts. */
static bool check_prompts(struct cllm_http_req *hr, const cJSON *prompt, int32_t *n,
                          enum MHD_Result *ret)
{
    if (!prompt || cJSON_IsNull(prompt)) {
        *ret = cllm_http_reply_error(hr, 400, "prompt is required (a string or a list of strings)");
        return false;
    }
    if (cJSON_IsString(prompt)) {
        if (!prompt->valuestring[0]) {
            *ret = cllm_http_reply_error(hr, 400, "prompt is empty");
            return false;
        }
        *n = 1;
        return true;
    }
    if (!cJSON_IsArray(prompt)) {
        *ret = cllm_http_reply_error(hr, 400, "prompt must be a string or a list of strings");
        return false;
    }
    int32_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, prompt)
    {
        if (!cJSON_IsString(it)) {
            *ret = cllm_http_reply_error(hr, 400, "prompt[%d] must be a string", (int)i);
            return false;
        }
        if (!it->valuestring[0]) {
            *ret = cllm_http_reply_error(hr, 400, "prompt[%d] is empty", (int)i);
            return false;
        }
        i++;
    }
    if (i == 0) {
        *ret = cllm_http_reply_error(hr, 400, "prompt is an empty list");
        return false;
    }
    *n = i;
    return true;
}

enum MHD_Result cllm_route_predict(struct cllm_server *s, struct cllm_http_req *hr)
{
    enum MHD_Result ret;
    cJSON *root = cllm_http_parse_object(hr, &ret);
    if (!root)
        return ret;
    char err[512];
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    const cJSON *system = cJSON_GetObjectItemCaseSensitive(root, "system");
    int32_t n = 0;
    struct cllm_job_params jp;
    enum cllm_status st;
    if (!check_prompts(hr, prompt, &n, &ret))
        goto done;
    if (system && !cJSON_IsNull(system) && !cJSON_IsString(system)) {
        ret = cllm_http_reply_error(hr, 400, "system must be a string");
        goto done;
    }
    if ((st = cllm_job_params_parse(root, &s->defaults, &jp, err, sizeof err))) {
        ret = cllm_http_reply_status(hr, st, err);
        goto done;
    }
    if ((st = cllm_job_init(&hr->job, n))) {
        ret = cllm_http_reply_error(hr, 500, "out of memory");
        goto done;
    }
    bool list = cJSON_IsArray(prompt);
    const cJSON *it = list ? prompt->child : prompt;
    for (int32_t i = 0; i < n; i++, it = it->next) {
        struct cllm_chat_message msgs[2];
        size_t m = 0;
        if (cJSON_IsString(system))
            msgs[m++] = (struct cllm_chat_message){"system", system->valuestring,
                                                   strlen(system->valuestring)};
        msgs[m++] = (struct cllm_chat_message){"user", it->valuestring, strlen(it->valuestring)};
        char what[32];
        snprintf(what, sizeof what, list ? "prompt[%d]" : "prompt", (int)i);
        if ((st = cllm_job_set_chat(s, &hr->job, i, what, msgs, m, err, sizeof err))) {
            ret = cllm_http_reply_status(hr, st, err);
            goto done;
        }
    }
    if (!cllm_http_run_job(s, hr, &jp.p, list, &ret))
        goto done;
    cJSON *out = cJSON_CreateObject();
    cJSON *resp = list ? cJSON_AddArrayToObject(out, "response") : NULL;
    bool ok = out && (!list || resp);
    for (int32_t i = 0; ok && i < n; i++) {
        const char *text = hr->job.outs[i].text.data ? hr->job.outs[i].text.data : "";
        cJSON *str = cJSON_CreateString(text);
        ok = str &&
             (list ? cJSON_AddItemToArray(resp, str) : cJSON_AddItemToObject(out, "response", str));
        if (!ok)
            cJSON_Delete(str);
    }
    if (!ok) {
        cJSON_Delete(out);
        ret = cllm_http_reply_error(hr, 500, "out of memory building the response");
        goto done;
    }
    ret = cllm_http_reply_json(hr, 200, out);
done:
    cJSON_Delete(root);
    return ret;
}
