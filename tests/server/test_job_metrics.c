/*
 * The server's model-free parts: request fields -> request params (types, ranges, null as
 * absent, stop strings, defaults kept) and the Prometheus exposition of the metrics (every
 * sample line is `name{labels} value`, histogram buckets are cumulative).
 */
#include <math.h>
#include <string.h>

#include "server/job.h"
#include "server/metrics.h"
#include "test.h"

static struct cllm_request_params defaults(void)
{
    struct cllm_request_params p;
    memset(&p, 0, sizeof p);
    cllm_sampling_params_default(&p.sampling);
    p.max_tokens = 77;
    p.sampling.temperature = 0.5f;
    return p;
}

/* Parses body; returns the status and leaves err / out filled. */
static enum cllm_status parse(const char *body, struct cllm_job_params *out, char *err,
                              size_t err_len)
{
    struct cllm_request_params d = defaults();
    cJSON *j = cJSON_Parse(body);
    if (!j)
        return CLLM_ERR_FORMAT;
    err[0] = 0;
    enum cllm_status st = cllm_job_params_parse(j, &d, out, err, err_len);
    cJSON_Delete(j);
    return st;
}

static void test_params(void)
{
    struct cllm_job_params jp;
    char err[256];
    CHECK(parse("{}", &jp, err, sizeof err) == CLLM_OK);
    CHECK(jp.p.max_tokens == 77 && jp.p.sampling.temperature == 0.5f && jp.p.n_stop == 0);
    CHECK(parse("{\"max_tokens\": null, \"temperature\": null, \"x\": [1]}", &jp, err,
                sizeof err) == CLLM_OK);
    CHECK(jp.p.max_tokens == 77 && jp.p.sampling.temperature == 0.5f);

    const char *ok = "{\"max_tokens\": 5, \"temperature\": 0, \"top_p\": 0.9, \"top_k\": 40, "
                     "\"repetition_penalty\": 1.1, \"seed\": 42, \"min_p\": 0.05, "
                     "\"presence_penalty\": 0.5, \"frequency_penalty\": -0.5}";
    CHECKF(parse(ok, &jp, err, sizeof err) == CLLM_OK, "%s", err);
    CHECK(jp.p.max_tokens == 5 && jp.p.sampling.temperature == 0.0f);
    CHECK(fabsf(jp.p.sampling.top_p - 0.9f) < 1e-6f && jp.p.sampling.top_k == 40);
    CHECK(fabsf(jp.p.sampling.repetition_penalty - 1.1f) < 1e-6f && jp.p.sampling.seed == 42);
    CHECK(fabsf(jp.p.sampling.min_p - 0.05f) < 1e-6f);
    CHECK(jp.p.sampling.presence_penalty == 0.5f && jp.p.sampling.frequency_penalty == -0.5f);
    CHECK(parse("{\"max_completion_tokens\": 9}", &jp, err, sizeof err) == CLLM_OK &&
          jp.p.max_tokens == 9);
    CHECK(parse("{\"top_k\": -1}", &jp, err, sizeof err) == CLLM_OK && jp.p.sampling.top_k == 0);
    CHECK(parse("{}", &jp, err, sizeof err) == CLLM_OK && jp.p.max_time == 0);
    CHECK(parse("{\"max_time\": 2.5}", &jp, err, sizeof err) == CLLM_OK && jp.p.max_time == 2.5);
    CHECK(parse("{\"max_time\": null}", &jp, err, sizeof err) == CLLM_OK && jp.p.max_time == 0);

    /* Stop strings point into the document, so keep it alive while looking at them. */
    struct cllm_request_params d = defaults();
    cJSON *doc = cJSON_Parse("{\"stop\": \"END\"}");
    CHECK(cllm_job_params_parse(doc, &d, &jp, err, sizeof err) == CLLM_OK);
    CHECK(jp.p.n_stop == 1 && jp.p.stop == jp.stops && !strcmp(jp.stops[0], "END"));
    cJSON_Delete(doc);
    doc = cJSON_Parse("{\"stop\": [\"a\", \"bb\"]}");
    CHECK(cllm_job_params_parse(doc, &d, &jp, err, sizeof err) == CLLM_OK);
    CHECK(jp.p.n_stop == 2 && !strcmp(jp.p.stop[1], "bb"));
    cJSON_Delete(doc);

    /* Each bad field is named in the message. */
    static const struct {
        const char *body, *needle;
    } bad[] = {
        {"{\"max_tokens\": \"ten\"}", "max_tokens"},
        {"{\"max_tokens\": 0}", "max_tokens"},
        {"{\"max_tokens\": 1.5}", "max_tokens"},
        {"{\"max_tokens\": true}", "max_tokens"},
        {"{\"max_completion_tokens\": -2}", "max_completion_tokens"},
        {"{\"temperature\": \"hot\"}", "temperature"},
        {"{\"temperature\": -0.5}", "temperature"},
        {"{\"top_p\": 0}", "top_p"},
        {"{\"top_p\": 1.5}", "top_p"},
        {"{\"top_k\": \"x\"}", "top_k"},
        {"{\"top_k\": -2}", "top_k"},
        {"{\"seed\": -1}", "seed"},
        {"{\"seed\": 0.5}", "seed"},
        {"{\"repetition_penalty\": [1]}", "repetition_penalty"},
        {"{\"min_p\": 2}", "min_p"},
        {"{\"presence_penalty\": 5}", "presence_penalty"},
        {"{\"stop\": 5}", "stop"},
        {"{\"max_time\": 0}", "max_time"},
        {"{\"max_time\": -1}", "max_time"},
        {"{\"max_time\": \"5\"}", "max_time"},
        {"{\"max_time\": 1e10}", "max_time"},
        {"{\"stop\": [\"a\", 1]}", "stop"},
        {"{\"stop\": [\"\"]}", "stop"},
        {"{\"stop\": [\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\",\"12\","
         "\"13\",\"14\",\"15\",\"16\",\"17\"]}",
         "stop"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        enum cllm_status st = parse(bad[i].body, &jp, err, sizeof err);
        CHECKF(st == CLLM_ERR_INVALID_ARG || st == CLLM_ERR_RANGE, "%s -> %d", bad[i].body,
               (int)st);
        CHECKF(strstr(err, bad[i].needle) != NULL, "%s -> '%s'", bad[i].body, err);
    }
}

/* Every non-comment line is `name{labels} value` with a number value. */
static bool well_formed(const char *text)
{
    const char *line = text;
    while (*line) {
        const char *end = strchr(line, '\n');
        if (!end)
            return false; /* the exposition ends with a newline */
        if (line[0] != '#') {
            const char *sp = memchr(line, ' ', (size_t)(end - line));
            if (!sp)
                return false;
            char value[64];
            size_t n = (size_t)(end - sp - 1);
            if (n == 0 || n >= sizeof value)
                return false;
            memcpy(value, sp + 1, n);
            value[n] = 0;
            char *e;
            strtod(value, &e);
            if (*e && strcmp(value, "+Inf"))
                return false;
        }
        line = end + 1;
    }
    return true;
}

static void test_metrics(void)
{
    struct cllm_metrics m;
    cllm_metrics_init(&m);
    struct cllm_buf b = {0};
    CHECK(cllm_metrics_render(&m, NULL, &b) == CLLM_OK && well_formed(b.data));
    CHECK(strstr(b.data, "cllm_requests_running 0\n") != NULL);
    cllm_metrics_count_request(&m, "/predict", 200, 0.3);
    cllm_metrics_count_request(&m, "/predict", 200, 3);
    cllm_metrics_count_request(&m, "/predict", 400, 0.001);
    cllm_metrics_observe_generation(&m, 0.2, 0.04);
    cllm_metrics_observe_generation(&m, 0.7, -1);
    m.restarts = 2;
    struct cllm_engine_stats es = {.running = 2,
                                   .waiting = 3,
                                   .kv_blocks_total = 100,
                                   .kv_blocks_used = 25,
                                   .prefix_queries = 9,
                                   .prefix_hits = 4,
                                   .preemptions = 1,
                                   .prompt_tokens = 40,
                                   .generated_tokens = 17,
                                   .step_tokens = 128,
                                   .step_seqs = 64,
                                   .unrecorded_steps = 4096};
    b.len = 0;
    CHECK(cllm_metrics_render(&m, &es, &b) == CLLM_OK && well_formed(b.data));
    const char *want[] = {
        "cllm_requests_total{route=\"/predict\",status=\"200\"} 2\n",
        "cllm_requests_total{route=\"/predict\",status=\"400\"} 1\n",
        "cllm_prompt_tokens_total 40\n",
        "cllm_generation_tokens_total 17\n",
        "cllm_time_to_first_token_seconds_bucket{le=\"0.25\"} 1\n",
        "cllm_time_to_first_token_seconds_bucket{le=\"1\"} 2\n",
        "cllm_time_to_first_token_seconds_count 2\n",
        "cllm_inter_token_latency_seconds_count 1\n",
        "cllm_request_duration_seconds_bucket{le=\"0.5\"} 2\n",
        "cllm_request_duration_seconds_bucket{le=\"+Inf\"} 3\n",
        "cllm_requests_running 2\n",
        "cllm_server_restarts_total 2\n",
        "cllm_requests_waiting 3\n",
        "cllm_kv_cache_usage_ratio 0.250000\n",
        "cllm_prefix_cache_queries_total 9\n",
        "cllm_prefix_cache_hits_total 4\n",
        "cllm_preemptions_total 1\n",
        "cllm_step_tokens_limit 128\n",
        "cllm_step_sequences_limit 64\n",
        "cllm_unrecorded_steps 4096\n",
        "# TYPE cllm_time_to_first_token_seconds histogram\n",
        "# TYPE cllm_requests_total counter\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        CHECKF(strstr(b.data, want[i]) != NULL, "missing %s", want[i]);
    cllm_buf_free(&b);
    cllm_metrics_free(&m);
}

int main(void)
{
    test_params();
    test_metrics();
    return test_summary();
}
