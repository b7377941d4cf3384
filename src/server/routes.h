/*
 * The route handlers the routing table in http.c dispatches to. Each gets the whole request
 * (body included) and queues exactly one response through the http.h reply functions, or
 * returns MHD_NO to drop the connection (the client is gone).
 *   GET  /, /health             server.c   readiness and model info (open without API key)
 *   GET  /metrics               server.c   Prometheus text
 *   POST /predict               predict.c  the evaluation contract
 *   POST /v1/completions        openai.c   raw completion, optional SSE stream
 *   POST /v1/chat/completions   openai.c   chat completion, optional SSE stream
 *   GET  /v1/models             openai.c   the one model served
 */
#ifndef CLLM_SERVER_ROUTES_H
#define CLLM_SERVER_ROUTES_H

#include "server/http.h"

enum MHD_Result cllm_route_health(struct cllm_server *s, struct cllm_http_req *hr);
enum MHD_Result cllm_route_metrics(struct cllm_server *s, struct cllm_http_req *hr);
enum MHD_Result cllm_route_predict(struct cllm_server *s, struct cllm_http_req *hr);
enum MHD_Result cllm_route_completions(struct cllm_server *s, struct cllm_http_req *hr);
enum MHD_Result cllm_route_chat(struct cllm_server *s, struct cllm_http_req *hr);
enum MHD_Result cllm_route_models(struct cllm_server *s, struct cllm_http_req *hr);

#endif
