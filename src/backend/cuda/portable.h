/*
 * Calls whose spelling differs between the SDKs (and their versions) that compile these
 * sources: included at the end of vendor.h (and of the emulator's stand-in), after the
 * vendor's names are mapped, so every .cu file has them.
 */
#ifndef CLLM_BACKEND_CUDA_PORTABLE_H
#define CLLM_BACKEND_CUDA_PORTABLE_H

/* cudaGraphInstantiate took (exec, graph, error node, log buffer, log size) until CUDA 12,
 * which replaced those with one flags word; MUSA SDK 3.1's musaGraphInstantiate still takes
 * the five (the form torch_musa and other MUSA ports call). Whichever of the two the headers
 * declare is the one called: the other's expression fails to substitute, which drops its
 * overload (SFINAE); the int argument prefers the flags form where both exist. */
template <typename Exec, typename Graph>
static inline auto cllm_graph_instantiate_as(Exec *exec, Graph graph, int)
    -> decltype(cudaGraphInstantiate(exec, graph, 0ULL))
{
    return cudaGraphInstantiate(exec, graph, 0ULL);
}
template <typename Exec, typename Graph>
static inline auto cllm_graph_instantiate_as(Exec *exec, Graph graph, long)
    -> decltype(cudaGraphInstantiate(exec, graph, nullptr, nullptr, 0))
{
    return cudaGraphInstantiate(exec, graph, nullptr, nullptr, 0);
}
static inline cudaError_t cllm_graph_instantiate(cudaGraphExec_t *exec, cudaGraph_t graph)
{
    return cllm_graph_instantiate_as(exec, graph, 0);
}

/* A load of what another block of the same kernel wrote (the split merges' partials, after
 * the writers' __threadfence and the counter that elected this block): it must not be served
 * from this SM's L1, which does not see other SMs' stores. CUDA says so with __ldcg (cache in
 * L2 only). Clang's CUDA headers, which the MUSA compiler descends from, declare __ldg but
 * not __ldcg up to clang 19, so the MUSA build reads through a volatile pointer instead: a
 * load the compiler may not reuse or move, which on NVIDIA hardware also skips L1. */
template <typename T> static __device__ __forceinline__ T cllm_load_fresh(const T *p)
{
#if defined(CLLM_MUSA) || defined(CLLM_EMU_MUSA)
    return *(const volatile T *)p;
#else
    return __ldcg(p);
#endif
}

#endif
