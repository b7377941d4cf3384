/* Runs the launchers of kernels.cu / attention.cu / gemm.cu under the CPU emulator against
 * cpu/ref.c and exact products, mirroring tests/gpu/test_gpu_ops.c (test_embed_norm_silu,
 * test_attention, the GEMM's batch invariance). Host memory stands in for device memory. */
#include "backend/cuda/gemm.h"
#include "backend/cuda/gemm_simt.h"
#include "backend/cuda/kernels.h"
extern "C" {
#include "backend/cpu/ref.h"
#include "core/f16.h"
}
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "test.h"


static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    float f = (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
    return cllm_bf16_to_f32(cllm_f32_to_bf16(f));
}
static std::vector<float> randv(int64_t n, float scale)
{
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; i++) v[i] = cllm_bf16_to_f32(cllm_f32_to_bf16(frand() * scale));
    return v;
}

/* A GEMM scratch of `bytes` as the backend hands one over: its counts zero (gemm.h), the rest
 * NAN, so that a partial sum read before it was written shows. */
static std::vector<float> gemm_scratch(size_t bytes)
{
    std::vector<float> s(bytes / 4 + 1, NAN);
    for (size_t i = 0; i < s.size() && i < CLLM_CUDA_GEMM_COUNT_BYTES / 4; i++)
        s[i] = 0.0f;
    return s;
}

/* Did the GEMMs leave the scratch's counts zero, for the next one? */
static bool counts_zero(const std::vector<float> &s)
{
    for (size_t i = 0; i < s.size() && i < CLLM_CUDA_GEMM_COUNT_BYTES / 4; i++)
        if (s[i] != 0.0f)
            return false;
    return true;
}
static float bf(__nv_bfloat16 h) { return cllm_bf16_to_f32(h.__x); }
static float rbf(float f) { return cllm_bf16_to_f32(cllm_f32_to_bf16(f)); }

/* distance in BF16 ulps between a stored bf16 value and bf16(want); reports histogram */
static void ulp_report(const char *what, const __nv_bfloat16 *got, const float *want, int64_t n, bool strict = true)
{
    int64_t h[3] = {0, 0, 0}; int maxu = 0;
    for (int64_t i = 0; i < n; i++) {
        /* sign-magnitude bits to a signed order, so that neighbours differ by one */
        uint16_t wb = cllm_f32_to_bf16(want[i]);
        int ga = (got[i].__x & 0x8000) ? -(int)(got[i].__x & 0x7fff) : (int)got[i].__x;
        int gb = (wb & 0x8000) ? -(int)(wb & 0x7fff) : (int)wb;
        int u = abs(ga - gb);
        h[u > 1 ? 2 : u]++;
        if (u > maxu) maxu = u;
    }
    printf("  %-28s bf16 ulps vs bf16(ref): 0:%lld 1:%lld >1:%lld (max %d)\n", what, (long long)h[0], (long long)h[1], (long long)h[2], maxu);
    if (strict) CHECKF(maxu <= 1, "%s: %d bf16 ulps from the reference", what, maxu);
}

static void test_embed_norm_silu(int32_t n, int32_t dim)
{
    printf("embed/norm/silu n=%d dim=%d\n", n, dim);
    std::vector<float> embf = randv((int64_t)1000 * dim, 1.0f), g = randv(dim, 1.0f);
    std::vector<__nv_bfloat16> emb(embf.size());
    for (size_t i = 0; i < emb.size(); i++) emb[i].__x = cllm_f32_to_bf16(embf[i]);
    std::vector<int32_t> tok(n);
    for (int32_t i = 0; i < n; i++) tok[i] = (int32_t)((uint32_t)(i * 7919 + 13) % 1000u);
    std::vector<float> x((size_t)n * dim), x_ref((size_t)n * dim);
    memset(x.data(), 0xff, x.size() * 4);
    for (int32_t t = 0; t < n; t++) for (int32_t d = 0; d < dim; d++) x_ref[(size_t)t * dim + d] = embf[(size_t)tok[t] * dim + d];
    CHECK(cllm_cuda_embed(emb.data(), 1000, dim, tok.data(), n, x.data(), 0) == cudaSuccess);
    CHECKF(memcmp(x.data(), x_ref.data(), x.size() * 4) == 0, "embed not exact");

    std::vector<float> out_ref((size_t)n * dim), res = randv((int64_t)n * dim, 2.0f), outf((size_t)n * dim);
    std::vector<__nv_bfloat16> out((size_t)n * dim);
    memset(out.data(), 0xff, out.size() * 2);
    for (int32_t t = 0; t < n; t++) cllm_ref_rmsnorm_row(&x_ref[(size_t)t * dim], g.data(), 1e-6f, dim, &out_ref[(size_t)t * dim]);
    CHECK(cllm_cuda_rmsnorm(NULL, x.data(), g.data(), 1e-6f, n, dim, out.data(), 0) == cudaSuccess);
    for (size_t i = 0; i < out.size(); i++) outf[i] = bf(out[i]);
    test_check_close("rmsnorm", outf.data(), out_ref.data(), (int64_t)n * dim, 1.0 / 128, 1e-6);
    ulp_report("rmsnorm", out.data(), out_ref.data(), (int64_t)n * dim);

    /* add_rmsnorm */
    std::vector<float> res_c = res, res_g = res;
    for (size_t i = 0; i < res_c.size(); i++) res_c[i] = res_c[i] + x_ref[i];
    for (int32_t t = 0; t < n; t++) cllm_ref_rmsnorm_row(&res_c[(size_t)t * dim], g.data(), 1e-6f, dim, &out_ref[(size_t)t * dim]);
    memset(out.data(), 0xff, out.size() * 2);
    CHECK(cllm_cuda_rmsnorm(res_g.data(), x.data(), g.data(), 1e-6f, n, dim, out.data(), 0) == cudaSuccess);
    CHECKF(memcmp(res_g.data(), res_c.data(), res_c.size() * 4) == 0, "add_rmsnorm residual not bit-exact");
    for (size_t i = 0; i < out.size(); i++) outf[i] = bf(out[i]);
    test_check_close("add_rmsnorm", outf.data(), out_ref.data(), (int64_t)n * dim, 1.0 / 128, 1e-6);
    ulp_report("add_rmsnorm", out.data(), out_ref.data(), (int64_t)n * dim);

    /* silu_mul */
    std::vector<float> gu = randv((int64_t)n * 2 * dim, 4.0f);
    for (int32_t t = 0; t < n; t++) cllm_ref_silu_mul(&gu[(size_t)t * 2 * dim], &gu[(size_t)t * 2 * dim + dim], dim, &out_ref[(size_t)t * dim]);
    memset(out.data(), 0xff, out.size() * 2);
    CHECK(cllm_cuda_silu_mul(gu.data(), n, dim, out.data(), 0) == cudaSuccess);
    for (size_t i = 0; i < out.size(); i++) outf[i] = bf(out[i]);
    test_check_close("silu_mul", outf.data(), out_ref.data(), (int64_t)n * dim, 1.0 / 128, 1e-6);
    ulp_report("silu_mul", out.data(), out_ref.data(), (int64_t)n * dim);

    /* gather_rows, add_bias: exact */
    int32_t idx[3] = {n - 1, 0, n / 2};
    std::vector<float> gat((size_t)3 * dim);
    memset(gat.data(), 0xff, gat.size() * 4);
    CHECK(cllm_cuda_gather_rows(res_g.data(), idx, 3, dim, gat.data(), 0) == cudaSuccess);
    for (int i = 0; i < 3; i++)
        CHECK(memcmp(&gat[(size_t)i * dim], &res_g[(size_t)idx[i] * dim], (size_t)dim * 4) == 0);
    int32_t ldy = dim + 7;
    std::vector<float> y = randv((int64_t)n * ldy, 1.0f), y_c = y, bias = randv(dim, 1.0f);
    for (int32_t t = 0; t < n; t++) for (int32_t c = 0; c < dim; c++) y_c[(size_t)t * ldy + c] += bias[c];
    CHECK(cllm_cuda_add_bias(y.data(), ldy, bias.data(), n, dim, 0) == cudaSuccess);
    CHECKF(memcmp(y.data(), y_c.data(), y.size() * 4) == 0, "add_bias not exact");

    /* resolve_tokens: references (-1 - k) to the last draw filled in, known tokens kept, a
     * reference past the draw reads token 0 */
    int32_t drawn[3] = {501, 502, 503};
    int32_t toks[6] = {7, -1, -3, 9, -2, -4};
    const int32_t want[6] = {7, 501, 503, 9, 502, 0};
    CHECK(cllm_cuda_resolve_tokens(toks, 6, drawn, 3, 0) == cudaSuccess);
    CHECKF(memcmp(toks, want, sizeof want) == 0, "resolve_tokens: %d %d %d %d %d %d", toks[0],
           toks[1], toks[2], toks[3], toks[4], toks[5]);
}

/* Absolute error allowed beside 1/64 relative (the BF16 output and K/V). The tensor-core
 * kernel also rounds each softmax weight p to BF16 for the P V MMA (relative error <= 2^-9;
 * the sum it divides by adds up the same rounded weights), so its output may move by up to
 * 2^-9 max |v| more. */
static double attention_abs_tol(const std::vector<float> &v, bool simt)
{
    double vmax = 0;
    for (float x : v) vmax = fmax(vmax, fabs(x));
    return 2e-3 + (simt ? 0.0 : vmax / 512);
}

/* The same tokens computed in other steps: in reverse order (every query tile one token) and
 * in chunks of varied sizes, each token's rows must keep their bits. */
static void check_regrouped(const char *kernel, const struct cllm_cuda_batch &all, const float *q, int32_t ldq,
                            const __nv_bfloat16 *kg, const __nv_bfloat16 *vg, int32_t n_head, int32_t n_kv, int32_t hd,
                            bool simt, const std::vector<__nv_bfloat16> &want)
{
    const int32_t n = all.n_tokens, Q = n_head * hd;
    std::vector<int32_t> order(n);
    for (int32_t i = 0; i < n; i++) order[i] = n - 1 - i;
    /* chunk sizes cycle through these: 1-token chunks, tiles cut mid-way, tiles spanning two */
    const int32_t sizes[] = {1, 7, 23, 2, 64, 11};
    /* one scratch for every step, as the model has it (zero-filled once) */
    std::vector<unsigned char> scratch(cllm_cuda_attention_scratch(n, n_head, hd), 0);
    for (int pass = 0; pass < 2; pass++) {
        int64_t bad_tokens = 0;
        for (int32_t start = 0, k = 0; start < n; k++) {
            int32_t len = pass == 0 ? n : sizes[k % 6];
            if (len > n - start) len = n - start;
            std::vector<int32_t> pos(len), seq(len), slot(len);
            std::vector<float> qs((size_t)len * Q);
            for (int32_t i = 0; i < len; i++) {
                int32_t t = pass == 0 ? order[start + i] : start + i;
                pos[i] = all.pos[t], seq[i] = all.seq[t], slot[i] = all.slot[t];
                memcpy(&qs[(size_t)i * Q], q + (size_t)t * ldq, (size_t)Q * 4);
            }
            struct cllm_cuda_batch b = all;
            b.n_tokens = len, b.pos = pos.data(), b.seq = seq.data(), b.slot = slot.data();
            std::vector<__nv_bfloat16> o((size_t)len * Q);
            memset(o.data(), 0xff, o.size() * 2);
            CHECK(cllm_cuda_attention(&b, qs.data(), Q, kg, vg, n_head, n_kv, hd, 1.0f / sqrtf((float)hd), simt, scratch.data(), o.data(), 0) == cudaSuccess);
            for (int32_t i = 0; i < len; i++) {
                int32_t t = pass == 0 ? order[start + i] : start + i;
                bad_tokens += memcmp(&o[(size_t)i * Q], &want[(size_t)t * Q], (size_t)Q * 2) != 0;
            }
            start += len;
        }
        CHECKF(bad_tokens == 0, "%s attention: %lld tokens changed bits %s", kernel, (long long)bad_tokens,
               pass == 0 ? "in reverse order" : "in other chunks");
    }
}

static void test_attention(int32_t n_head, int32_t n_kv, int32_t hd, const int32_t *lens, int32_t n_seqs, bool simt,
                           bool regroup = false)
{
    const char *kernel = simt ? "simt" : "mma";
    printf("%s attention %d/%d heads hd %d lens", kernel, n_head, n_kv, hd);
    for (int s = 0; s < n_seqs; s++) printf(" %d", lens[s]);
    printf("\n");
    enum { BS = 16 };
    int32_t n = 0, max_len = 0;
    for (int32_t s = 0; s < n_seqs; s++) { n += lens[s]; max_len = lens[s] > max_len ? lens[s] : max_len; }
    int32_t max_blocks = (max_len + BS - 1) / BS, nb = max_blocks * n_seqs + 3;
    std::vector<int32_t> table((size_t)n_seqs * max_blocks), perm(nb);
    for (int32_t i = 0; i < nb; i++) perm[i] = i;
    for (int32_t i = nb - 1; i > 0; i--) {
        int32_t j = (int32_t)((uint32_t)(frand() * 1e6f + 1e6f) % (uint32_t)(i + 1)), tmp = perm[i];
        perm[i] = perm[j], perm[j] = tmp;
    }
    for (int32_t i = 0; i < n_seqs * max_blocks; i++) table[i] = perm[i];
    int32_t T = n + 1;
    std::vector<int32_t> pos(T), seq(T), slot(T);
    for (int32_t s = 0, t = 0; s < n_seqs; s++)
        for (int32_t p = 0; p < lens[s]; p++, t++) { pos[t] = p, seq[t] = s; slot[t] = table[s * max_blocks + p / BS] * BS + p % BS; }
    pos[n] = 0, seq[n] = 0, slot[n] = -1;
    int32_t Q = n_head * hd, KV = n_kv * hd, ld = Q + 2 * KV;
    int64_t cache_n = (int64_t)nb * BS * KV;
    std::vector<float> qkv = randv((int64_t)T * ld, 2.0f), bias = randv(ld, 0.5f);
    struct cllm_rope rope = {1000000.0f, hd};

    /* CPU reference, as cpu_qkv_rope_store does it */
    std::vector<float> qkv_c = qkv, kc(cache_n, 0.0f), vc(cache_n, 0.0f), cs(hd / 2), sn(hd / 2);
    for (int32_t t = 0; t < T; t++) {
        float *q = &qkv_c[(size_t)t * ld], *k = q + Q, *v = k + KV;
        for (int32_t i = 0; i < ld; i++) q[i] = q[i] + bias[i];
        cllm_ref_rope_cos_sin(&rope, pos[t], cs.data(), sn.data());
        for (int32_t h = 0; h < n_head; h++) cllm_ref_rope_apply(q + (int64_t)h * hd, cs.data(), sn.data(), hd);
        for (int32_t h = 0; h < n_kv; h++) cllm_ref_rope_apply(k + (int64_t)h * hd, cs.data(), sn.data(), hd);
        if (slot[t] < 0) continue;
        memcpy(&kc[(size_t)slot[t] * KV], k, (size_t)KV * 4);
        memcpy(&vc[(size_t)slot[t] * KV], v, (size_t)KV * 4);
    }
    std::vector<float> kc_r(cache_n), vc_r(cache_n);
    for (int64_t i = 0; i < cache_n; i++) kc_r[i] = rbf(kc[i]), vc_r[i] = rbf(vc[i]);
    struct cllm_attn_batch bc = {n, pos.data(), seq.data(), slot.data(), table.data(), max_blocks, BS, max_len};
    std::vector<float> qc((size_t)n * Q), att_c((size_t)n * Q);
    for (int32_t t = 0; t < n; t++) memcpy(&qc[(size_t)t * Q], &qkv_c[(size_t)t * ld], (size_t)Q * 4);
    /* The tensor-core kernel's MMAs take Q as BF16 (as transformers' BF16 model has it) */
    if (!simt)
        for (float &x : qc) x = rbf(x);
    cllm_ref_attention(&bc, qc.data(), kc_r.data(), vc_r.data(), n_head, n_kv, hd, 1.0f / sqrtf((float)hd), att_c.data());

    /* emulated GPU */
    struct cllm_cuda_rope_freqs freqs;
    for (int32_t i = 0; i < hd / 2; i++) freqs.inv_freq[i] = 1.0f / powf(rope.theta, (float)(2 * i) / (float)hd);
    std::vector<__nv_bfloat16> kg(cache_n), vg(cache_n);
    for (int64_t i = 0; i < cache_n; i++) kg[i].__x = vg[i].__x = 0x3f3f;
    std::vector<float> qkv_g = qkv;
    struct cllm_cuda_batch bg = {T, pos.data(), seq.data(), slot.data(), table.data(), max_blocks, BS, max_len};
    CHECK(cllm_cuda_qkv_rope_store(&bg, &freqs, qkv_g.data(), ld, bias.data(), n_head, n_kv, hd, kg.data(), vg.data(), 0) == cudaSuccess);
    int bad_q = 0, q_ulp = 0;
    for (int32_t t = 0; t < T; t++) {
        test_check_close("rope q", &qkv_g[(size_t)t * ld], &qkv_c[(size_t)t * ld], Q, 1e-6, 1e-6);
        for (int32_t i = 0; i < Q; i++) q_ulp += qkv_g[(size_t)t * ld + i] != qkv_c[(size_t)t * ld + i];
        (void)bad_q;
    }
    printf("  rope q: %d of %lld values not bit-identical to the CPU's\n", q_ulp, (long long)T * Q);
    int k_rope_diff = 0;
    for (int32_t t = 0; t < T; t++) for (int32_t i = 0; i < KV; i++) k_rope_diff += qkv_g[(size_t)t * ld + Q + i] != qkv_c[(size_t)t * ld + Q + i];
    printf("  rope k (in qkv): %d values not bit-identical\n", k_rope_diff);
    std::vector<char> written((size_t)nb * BS, 0);
    for (int32_t t = 0; t < n; t++) written[slot[t]] = 1;
    int64_t bad_untouched = 0, kbad = 0, vbad = 0, kulp1 = 0;
    for (int64_t s = 0; s < (int64_t)nb * BS; s++)
        for (int32_t i = 0; i < KV; i++) {
            int64_t e = s * KV + i;
            if (written[s]) {
                uint16_t wk = cllm_f32_to_bf16(kc[e]), wv = cllm_f32_to_bf16(vc[e]);
                int dk = abs((int)kg[e].__x - (int)wk);
                if (dk == 1) kulp1++;
                if (dk > 1 || ((kg[e].__x ^ wk) & 0x8000)) { if (dk) kbad++; }
                if (vg[e].__x != wv) vbad++;
            } else
                bad_untouched += kg[e].__x != 0x3f3f || vg[e].__x != 0x3f3f;
        }
    printf("  k cache: %lld values 1 ulp off, %lld more; v cache: %lld not exact\n", (long long)kulp1, (long long)kbad, (long long)vbad);
    CHECKF(kbad == 0, "k cache: %lld values > 1 bf16 ulp from bf16(cpu)", (long long)kbad);
    CHECKF(vbad == 0, "v cache: %lld values != bf16(cpu)", (long long)vbad);
    CHECKF(bad_untouched == 0, "%lld cache values outside the step's slots changed", (long long)bad_untouched);

    /* attention reads the emulated GPU's own cache; the reference read bf16(CPU cache) */
    size_t scratch_bytes = cllm_cuda_attention_scratch(n, n_head, hd);
    std::vector<unsigned char> scratch(scratch_bytes, 0); /* zero-filled, as backend.h asks */
    std::vector<__nv_bfloat16> att((size_t)n * Q);
    memset(att.data(), 0xff, att.size() * 2);
    bg.n_tokens = n;
    CHECK(cllm_cuda_attention(&bg, qkv_g.data(), ld, kg.data(), vg.data(), n_head, n_kv, hd, 1.0f / sqrtf((float)hd), simt, scratch.data(), att.data(), 0) == cudaSuccess);
    std::vector<float> att_g((size_t)n * Q);
    for (size_t i = 0; i < att.size(); i++) att_g[i] = bf(att[i]);
    char what[96];
    snprintf(what, sizeof what, "%s attention %d/%d heads, hd %d, longest %d", kernel, n_head, n_kv, hd, max_len);
    test_check_close(what, att_g.data(), att_c.data(), (int64_t)n * Q, 1.0 / 64, attention_abs_tol(vc_r, simt));
    /* The same step again with the same scratch: the op left it fit for reuse. */
    std::vector<__nv_bfloat16> again(att.size());
    memset(again.data(), 0xff, again.size() * 2);
    CHECK(cllm_cuda_attention(&bg, qkv_g.data(), ld, kg.data(), vg.data(), n_head, n_kv, hd, 1.0f / sqrtf((float)hd), simt, scratch.data(), again.data(), 0) == cudaSuccess);
    CHECKF(memcmp(again.data(), att.data(), att.size() * 2) == 0, "%s: a second run with the same scratch differs", what);
    double maxrel = 0;
    for (size_t i = 0; i < att_g.size(); i++) { double d = fabs(att_g[i] - att_c[i]) / (fabs(att_c[i]) + 2e-3 * 64); if (d > maxrel) maxrel = d; }
    printf("  attention: max |d|/(|want|+0.128) = %.3g\n", maxrel);
    ulp_report("attention (info)", att.data(), att_c.data(), (int64_t)n * Q, false);

    for (int32_t s = 0, t_last = -1; s < n_seqs; s++) {
        t_last += lens[s];
        struct cllm_cuda_batch one = {1, &pos[t_last], &seq[t_last], &slot[t_last], table.data(), max_blocks, BS, lens[s]};
        std::vector<__nv_bfloat16> o(Q);
        memset(o.data(), 0xff, o.size() * 2);
        std::vector<unsigned char> sc1(cllm_cuda_attention_scratch(1, n_head, hd), 0);
        CHECK(cllm_cuda_attention(&one, &qkv_g[(size_t)t_last * ld], ld, kg.data(), vg.data(), n_head, n_kv, hd, 1.0f / sqrtf((float)hd), simt, sc1.data(), o.data(), 0) == cudaSuccess);
        CHECKF(memcmp(o.data(), &att[(size_t)t_last * Q], (size_t)Q * 2) == 0, "sequence %d (%d tokens): alone != batched", s, lens[s]);
    }
    if (regroup && !simt) /* attention_simt's blocks are one token each: nothing to regroup */
        check_regrouped(kernel, bg, qkv_g.data(), ld, kg.data(), vg.data(), n_head, n_kv, hd, simt, att);
    CHECK(cllm_cuda_attention(&bg, qkv_g.data(), ld, kg.data(), vg.data(), n_head, n_kv, 96, 0.1f, simt, scratch.data(), att.data(), 0) == cudaErrorInvalidValue);
    CHECK(cudaGetLastError() == cudaSuccess);
}

/* One long sequence whose whole prefix is stored, then attention for a few chosen positions
 * only (decode-like): split lengths above SPLIT_MIN (len > 4096) and split boundaries. */
static void test_decode(int32_t n_head, int32_t n_kv, int32_t hd, int32_t L, bool simt)
{
    printf("%s decode %d/%d heads hd %d, sequence of %d\n", simt ? "simt" : "mma", n_head, n_kv, hd, L);
    enum { BS = 16 };
    int32_t max_blocks = (L + BS - 1) / BS, nb = max_blocks + 2;
    std::vector<int32_t> table(max_blocks);
    for (int32_t i = 0; i < max_blocks; i++) table[i] = (i * 7 + 1) % nb; /* nb, 7 coprime-ish: distinct */
    std::vector<int32_t> pos(L), seq(L, 0), slot(L);
    for (int32_t p = 0; p < L; p++) pos[p] = p, slot[p] = table[p / BS] * BS + p % BS;
    int32_t Q = n_head * hd, KV = n_kv * hd, ld = Q + 2 * KV;
    int64_t cache_n = (int64_t)nb * BS * KV;
    std::vector<float> qkv = randv((int64_t)L * ld, 2.0f);
    struct cllm_cuda_rope_freqs freqs;
    for (int32_t i = 0; i < hd / 2; i++) freqs.inv_freq[i] = 1.0f / powf(1000000.0f, (float)(2 * i) / (float)hd);
    std::vector<__nv_bfloat16> kg(cache_n), vg(cache_n);
    for (int64_t i = 0; i < cache_n; i++) kg[i].__x = vg[i].__x = 0x3f3f;
    struct cllm_cuda_batch all = {L, pos.data(), seq.data(), slot.data(), table.data(), max_blocks, BS, L};
    CHECK(cllm_cuda_qkv_rope_store(&all, &freqs, qkv.data(), ld, NULL, n_head, n_kv, hd, kg.data(), vg.data(), 0) == cudaSuccess);
    std::vector<float> kf(cache_n), vf(cache_n);
    for (int64_t i = 0; i < cache_n; i++) kf[i] = bf(kg[i]), vf[i] = bf(vg[i]);
    int32_t pick[] = {0, 255, 256, 257, 511, 512, 4095, 4096, 4097, L - 2, L - 1};
    int32_t n = 0;
    std::vector<int32_t> ppos, pseq, pslot;
    std::vector<float> q;
    for (int32_t p : pick) {
        if (p >= L) continue;
        ppos.push_back(p), pseq.push_back(0), pslot.push_back(slot[p]);
        q.insert(q.end(), &qkv[(size_t)p * ld], &qkv[(size_t)p * ld] + Q);
        n++;
    }
    struct cllm_attn_batch bc = {n, ppos.data(), pseq.data(), pslot.data(), table.data(), max_blocks, BS, L};
    std::vector<float> att_c((size_t)n * Q), q_ref = q;
    if (!simt) /* BF16 Q, as in test_attention */
        for (float &x : q_ref) x = rbf(x);
    cllm_ref_attention(&bc, q_ref.data(), kf.data(), vf.data(), n_head, n_kv, hd, 1.0f / sqrtf((float)hd), att_c.data());
    struct cllm_cuda_batch bg = {n, ppos.data(), pseq.data(), pslot.data(), table.data(), max_blocks, BS, L};
    std::vector<unsigned char> scratch(cllm_cuda_attention_scratch(n, n_head, hd), 0);
    std::vector<__nv_bfloat16> att((size_t)n * Q);
    memset(att.data(), 0xff, att.size() * 2);
    CHECK(cllm_cuda_attention(&bg, q.data(), Q, kg.data(), vg.data(), n_head, n_kv, hd, 1.0f / sqrtf((float)hd), simt, scratch.data(), att.data(), 0) == cudaSuccess);
    std::vector<float> att_g((size_t)n * Q);
    for (size_t i = 0; i < att.size(); i++) att_g[i] = bf(att[i]);
    test_check_close("decode attention", att_g.data(), att_c.data(), (int64_t)n * Q, 1.0 / 64, attention_abs_tol(vf, simt));
    ulp_report("decode attention (info)", att.data(), att_c.data(), (int64_t)n * Q, false);
    for (int32_t i = 0; i < n; i++) {
        struct cllm_cuda_batch one = {1, &ppos[i], &pseq[i], &pslot[i], table.data(), max_blocks, BS, ppos[i] + 1};
        std::vector<__nv_bfloat16> o(Q);
        memset(o.data(), 0xff, o.size() * 2);
        CHECK(cllm_cuda_attention(&one, &q[(size_t)i * Q], Q, kg.data(), vg.data(), n_head, n_kv, hd, 1.0f / sqrtf((float)hd), simt, scratch.data(), o.data(), 0) == cudaSuccess);
        CHECKF(memcmp(o.data(), &att[(size_t)i * Q], (size_t)Q * 2) == 0, "position %d: alone != batched", ppos[i]);
    }
}

/* The batch-invariant GEMM: close to the exact product, and every token's row bit-identical
 * whatever else shares its step (n from 1 to n_max, the token at any position, the skinny and
 * the tiled kernel alike). */
static void test_gemm(int32_t N, int32_t K, int32_t n_max, bool with_bias)
{
    printf("gemm N=%d K=%d n<=%d bias=%d slices=%d\n", N, K, n_max, with_bias, cllm_cuda_gemm_slices(N, K));
    std::vector<float> wf = randv((int64_t)N * K, 1.0f), xf = randv((int64_t)n_max * K, 2.0f), bias = randv(N, 1.0f);
    std::vector<__nv_bfloat16> w(wf.size()), x(xf.size());
    for (size_t i = 0; i < w.size(); i++) w[i].__x = cllm_f32_to_bf16(wf[i]);
    for (size_t i = 0; i < x.size(); i++) x[i].__x = cllm_f32_to_bf16(xf[i]);
    const int32_t ldy = N + 3;
    const float *b = with_bias ? bias.data() : NULL;
    std::vector<float> y_all((size_t)n_max * ldy, -7.0f);
    CHECK(cllm_cuda_gemm(w.data(), b, N, K, x.data(), n_max, y_all.data(), ldy, NULL, 0, 0) == cudaSuccess);
    /* With scratch the tiled kernel's slices run in parallel blocks: the same bits. */
    size_t scratch_bytes = cllm_cuda_gemm_scratch_bytes(N, K, n_max, false);
    if (cllm_cuda_gemm_slices(N, K) > 1 && n_max > CLLM_CUDA_GEMM_SKINNY_MAX)
        CHECKF(scratch_bytes > 0, "gemm N=%d K=%d: no parallel slices for %d tokens", N, K, n_max);
    if (scratch_bytes) {
        std::vector<float> scratch = gemm_scratch(scratch_bytes), y_par((size_t)n_max * ldy, -7.0f);
        CHECK(cllm_cuda_gemm(w.data(), b, N, K, x.data(), n_max, y_par.data(), ldy, scratch.data(), scratch_bytes, 0) == cudaSuccess);
        CHECKF(memcmp(y_par.data(), y_all.data(), y_all.size() * 4) == 0, "gemm N=%d K=%d: parallel slices differ from sequential", N, K);
    }
    int64_t bad = 0;
    for (int32_t t = 0; t < n_max; t++) {
        for (int32_t i = 0; i < N; i++) {
            double exact = with_bias ? bias[i] : 0.0, mag = fabs(exact);
            for (int32_t k = 0; k < K; k++) {
                double p = (double)wf[(size_t)i * K + k] * xf[(size_t)t * K + k];
                exact += p, mag += fabs(p);
            }
            /* F32 accumulation: a few units of 2^-24 per term at most */
            if (!(fabs(y_all[(size_t)t * ldy + i] - exact) <= 1e-6 * mag * (1 + K / 64) + 1e-30)) bad++;
        }
        for (int32_t i = N; i < ldy; i++)
            if (y_all[(size_t)t * ldy + i] != -7.0f) bad++;
    }
    CHECKF(bad == 0, "gemm N=%d K=%d: %lld elements off the exact product or written past N", N, K, (long long)bad);

    /* Subsets of the tokens, in a scrambled order, against the full run bit for bit. */
    const int32_t sizes[] = {1, 2, 5, 8, 9, 16, 17, 31, 32, 33, 63, 64, 65, n_max};
    for (int32_t n : sizes) {
        if (n > n_max) continue;
        std::vector<int32_t> pick(n);
        for (int32_t i = 0; i < n; i++) pick[i] = (int32_t)(((int64_t)i * 37 + n * 11) % n_max);
        std::vector<__nv_bfloat16> xs((size_t)n * K);
        for (int32_t i = 0; i < n; i++) memcpy(&xs[(size_t)i * K], &x[(size_t)pick[i] * K], (size_t)K * 2);
        std::vector<float> ys((size_t)n * ldy, -7.0f);
        std::vector<float> scratch = gemm_scratch(cllm_cuda_gemm_scratch_bytes(N, K, n, false));
        CHECK(cllm_cuda_gemm(w.data(), b, N, K, xs.data(), n, ys.data(), ldy, scratch.data(), scratch.size() * 4, 0) == cudaSuccess);
        CHECKF(counts_zero(scratch), "gemm N=%d K=%d n=%d: counts left in the scratch", N, K, n);
        int32_t differ = 0;
        for (int32_t i = 0; i < n; i++)
            differ += memcmp(&ys[(size_t)i * ldy], &y_all[(size_t)pick[i] * ldy], (size_t)N * 4) != 0;
        CHECKF(differ == 0, "gemm N=%d K=%d: %d of %d tokens differ from the same tokens in a step of %d", N, K, differ, n, n_max);
    }
}

/* gemm_simt.h's formula computed on the host: lane sums over the lanes' vectors, then the
 * butterfly (all lanes at once, each adding the lane `off` apart). */
static float simt_formula(const float *w, const float *x, int32_t K)
{
    float lane[32];
    for (int l = 0; l < 32; l++) {
        float s = 0.0f;
        for (int32_t v = l; v < K / 8; v += 32)
            for (int e = 0; e < 8; e++)
                s = fmaf(w[v * 8 + e], x[v * 8 + e], s);
        lane[l] = s;
    }
    for (int off = 16; off > 0; off /= 2) {
        float next[32];
        for (int l = 0; l < 32; l++)
            next[l] = lane[l] + lane[l ^ off];
        memcpy(lane, next, sizeof lane);
    }
    return lane[0];
}

/* The GEMM on CUDA cores: the formula's bits exactly (so also batch-invariant: each step size
 * takes another token tiling, 1, 2, 4 or 8 a warp), nothing written past N or n, refusals. */
static void test_gemm_simt(int32_t N, int32_t K, int32_t n_max, bool with_bias)
{
    printf("gemm_simt N=%d K=%d n<=%d bias=%d\n", N, K, n_max, with_bias);
    std::vector<float> wf = randv((int64_t)N * K, 1.0f), xf = randv((int64_t)n_max * K, 2.0f),
                       bias = randv(N, 1.0f);
    std::vector<__nv_bfloat16> w(wf.size()), x(xf.size());
    for (size_t i = 0; i < w.size(); i++)
        w[i].__x = cllm_f32_to_bf16(wf[i]);
    for (size_t i = 0; i < x.size(); i++)
        x[i].__x = cllm_f32_to_bf16(xf[i]);
    const int32_t ldy = N + 3;
    const float *b = with_bias ? bias.data() : NULL;
    std::vector<float> want((size_t)n_max * N);
    for (int32_t t = 0; t < n_max; t++)
        for (int32_t i = 0; i < N; i++) {
            const float s = simt_formula(&wf[(size_t)i * K], &xf[(size_t)t * K], K);
            want[(size_t)t * N + i] = b ? s + b[i] : s;
        }
    const int32_t sizes[] = {1, 2, 3, 4, 5, 8, 9, 17, n_max};
    for (int32_t n : sizes) {
        if (n > n_max)
            continue;
        /* tokens picked in a scrambled order: each must get its own row's bits */
        std::vector<int32_t> pick(n);
        std::vector<__nv_bfloat16> xs((size_t)n * K);
        for (int32_t i = 0; i < n; i++) {
            pick[i] = (int32_t)(((int64_t)i * 37 + n * 11) % n_max);
            memcpy(&xs[(size_t)i * K], &x[(size_t)pick[i] * K], (size_t)K * 2);
        }
        std::vector<float> y((size_t)(n + 1) * ldy, -7.0f); /* a row past n: never written */
        CHECK(cllm_cuda_gemm_simt(w.data(), b, N, K, xs.data(), n, y.data(), ldy, 0) ==
              cudaSuccess);
        int64_t differ = 0, past = 0;
        for (int32_t t = 0; t <= n; t++)
            for (int32_t i = 0; i < ldy; i++) {
                const float got = y[(size_t)t * ldy + i];
                if (t == n || i >= N)
                    past += got != -7.0f;
                else
                    differ += memcmp(&got, &want[(size_t)pick[t] * N + i], 4) != 0;
            }
        CHECKF(differ == 0 && past == 0,
               "gemm_simt N=%d K=%d n=%d: %lld elements not the formula's bits, %lld written past "
               "N or n",
               N, K, n, (long long)differ, (long long)past);
    }
    /* refused: K not a multiple of 8, misaligned operands, ldy short of N */
    std::vector<float> y8((size_t)ldy * 2);
    CHECK(cllm_cuda_gemm_simt(w.data(), b, N, 12, x.data(), 1, y8.data(), ldy, 0) ==
          cudaErrorInvalidValue);
    CHECK(cllm_cuda_gemm_simt(w.data() + 1, b, N, K, x.data(), 1, y8.data(), ldy, 0) ==
          cudaErrorInvalidValue);
    CHECK(cllm_cuda_gemm_simt(w.data(), b, N, K, x.data() + 4, 1, y8.data(), ldy, 0) ==
          cudaErrorInvalidValue);
    CHECK(cllm_cuda_gemm_simt(w.data(), b, N, K, x.data(), 1, y8.data(), N - 1, 0) ==
          cudaErrorInvalidValue);
    CHECK(cllm_cuda_gemm_simt(w.data(), b, N, K, x.data(), 0, y8.data(), ldy, 0) == cudaSuccess);
}

/* The gate/up projection with SiLU in its epilogue equals the GEMM into F32 and then silu_mul,
 * bit for bit, in every kernel (skinny, tiled, parallel slices); columns past F of a wider
 * output are not written. */
static void test_gemm_gate_up_silu(int32_t F, int32_t K)
{
    printf("gemm_gate_up_silu F=%d K=%d slices=%d\n", F, K, cllm_cuda_gemm_slices(2 * F, K));
    const int32_t sizes[] = {1, 9, 32, 70};
    const int32_t N = 2 * F, ldo = F + 5;
    std::vector<float> wf = randv((int64_t)N * K, 1.0f), xf = randv((int64_t)70 * K, 1.0f);
    std::vector<__nv_bfloat16> w(wf.size()), x(xf.size());
    for (size_t i = 0; i < w.size(); i++) w[i].__x = cllm_f32_to_bf16(wf[i]);
    for (size_t i = 0; i < x.size(); i++)
        x[i].__x = cllm_f32_to_bf16(xf[i]);
    for (int32_t n : sizes) {
        for (int parallel = 0; parallel < 2; parallel++) {
            std::vector<float> gu((size_t)n * N, -7.0f);
            std::vector<__nv_bfloat16> ref((size_t)n * F), out((size_t)n * ldo);
            memset(out.data(), 0xff, out.size() * 2);
            const size_t bytes = parallel ? cllm_cuda_gemm_scratch_bytes(N, K, n, false) : 0;
            if (parallel && !bytes)
                continue; /* this step has no parallel slices */
            std::vector<float> scratch = gemm_scratch(bytes);
            CHECK(cllm_cuda_gemm(w.data(), NULL, N, K, x.data(), n, gu.data(), N, NULL, 0, 0) ==
                  cudaSuccess);
            CHECK(cllm_cuda_silu_mul(gu.data(), n, F, ref.data(), 0) == cudaSuccess);
            CHECK(cllm_cuda_gemm_gate_up_silu(w.data(), F, K, x.data(), n, out.data(), ldo,
                                              parallel ? scratch.data() : NULL, bytes, NULL,
                                              0) == cudaSuccess);
            int32_t differ = 0, written = 0;
            for (int32_t t = 0; t < n; t++) {
                differ += memcmp(&out[(size_t)t * ldo], &ref[(size_t)t * F], (size_t)F * 2) != 0;
                for (int32_t c = F; c < ldo; c++)
                    written += out[(size_t)t * ldo + c].__x != 0xffff;
            }
            CHECKF(differ == 0,
                   "gemm_gate_up_silu F=%d K=%d n=%d (parallel %d): %d rows differ from gemm + "
                   "silu_mul",
                   F, K, n, parallel, differ);
            CHECKF(written == 0, "gemm_gate_up_silu F=%d K=%d n=%d: %d elements written past F", F,
                   K, n, written);
            CHECKF(counts_zero(scratch), "gemm_gate_up_silu F=%d K=%d n=%d: counts left", F, K, n);
        }
    }
    std::vector<__nv_bfloat16> out((size_t)F);
    CHECK(cllm_cuda_gemm_gate_up_silu(w.data(), F, K, x.data(), 1, out.data(), F - 1, NULL, 0, NULL,
                                      0) == cudaErrorInvalidValue); /* ldo < F */
}

/* The QKV projection with bias, RoPE and the KV store in its epilogue equals the GEMM and then
 * the RoPE kernel, bit for bit: q and k rotated in y, v as projected, both caches; a padding
 * row (slot -1) writes no cache. Steps the skinny kernel does not take are refused. */
static void test_gemm_rope_store(int32_t n_head, int32_t n_kv, int32_t hd, int32_t K, bool with_bias)
{
    printf("gemm_rope_store %d/%d heads hd %d K=%d bias=%d\n", n_head, n_kv, hd, K, with_bias);
    const int32_t N = (n_head + 2 * n_kv) * hd, KV = n_kv * hd, n_max = 33, n_slots = 64;
    std::vector<float> wf = randv((int64_t)N * K, 1.0f), xf = randv((int64_t)n_max * K, 1.0f), bias = randv(N, 0.5f);
    std::vector<__nv_bfloat16> w(wf.size()), x(xf.size());
    for (size_t i = 0; i < w.size(); i++) w[i].__x = cllm_f32_to_bf16(wf[i]);
    for (size_t i = 0; i < x.size(); i++) x[i].__x = cllm_f32_to_bf16(xf[i]);
    std::vector<int32_t> pos(n_max), slot(n_max), seq(n_max, 0);
    for (int32_t t = 0; t < n_max; t++) pos[t] = 7 * t + 3, slot[t] = (t * 5 + 1) % n_slots;
    slot[2] = -1; /* a padding row */
    struct cllm_cuda_rope_store r;
    for (int32_t i = 0; i < hd / 2; i++) r.freqs.inv_freq[i] = 1.0f / powf(1000000.0f, (float)(2 * i) / (float)hd);
    r.pos = pos.data(), r.slot = slot.data(), r.bias = with_bias ? bias.data() : NULL;
    r.n_head = n_head, r.n_kv = n_kv, r.head_dim = hd;
    const int32_t sizes[] = {1, 3, 9, 17, 32};
    for (int32_t n : sizes) {
        const int32_t ld = N + 5;
        std::vector<float> y_ref((size_t)n * ld, -3.0f), y((size_t)n * ld, -3.0f);
        std::vector<__nv_bfloat16> k_ref((size_t)n_slots * KV), v_ref(k_ref.size()), k(k_ref.size()), v(k_ref.size());
        for (size_t i = 0; i < k.size(); i++) k_ref[i].__x = v_ref[i].__x = k[i].__x = v[i].__x = 0x3f3f;
        struct cllm_cuda_batch b = {n, pos.data(), seq.data(), slot.data(), NULL, 0, 16, 0};
        CHECK(cllm_cuda_gemm(w.data(), NULL, N, K, x.data(), n, y_ref.data(), ld, NULL, 0, 0) == cudaSuccess);
        CHECK(cllm_cuda_qkv_rope_store(&b, &r.freqs, y_ref.data(), ld, r.bias, n_head, n_kv, hd, k_ref.data(), v_ref.data(), 0) == cudaSuccess);
        r.k_cache = k.data(), r.v_cache = v.data();
        std::vector<float> scratch = gemm_scratch(cllm_cuda_gemm_scratch_bytes(N, K, n, false));
        CHECK(cllm_cuda_gemm_rope_store(w.data(), K, x.data(), n, y.data(), ld, &r, NULL,
                                        scratch.data(), scratch.size() * 4, 0) == cudaSuccess);
        CHECKF(counts_zero(scratch), "gemm_rope_store n=%d: counts left in the scratch", n);
        int64_t bad_y = 0;
        for (int32_t t = 0; t < n; t++)
            bad_y += memcmp(&y[(size_t)t * ld], &y_ref[(size_t)t * ld], (size_t)N * 4) != 0;
        CHECKF(bad_y == 0, "gemm_rope_store n=%d: %lld rows of y differ from gemm + qkv_rope_store", n, (long long)bad_y);
        CHECKF(memcmp(k.data(), k_ref.data(), k.size() * 2) == 0, "gemm_rope_store n=%d: k cache differs", n);
        CHECKF(memcmp(v.data(), v_ref.data(), v.size() * 2) == 0, "gemm_rope_store n=%d: v cache differs", n);
    }
    std::vector<float> y((size_t)n_max * N);
    CHECK(!cllm_cuda_gemm_rope_supported(w.data(), x.data(), K, n_max, hd)); /* 33: the tiled kernel's */
    CHECK(cllm_cuda_gemm_rope_store(w.data(), K, x.data(), n_max, y.data(), N, &r, NULL, NULL, 0,
                                    0) == cudaErrorInvalidValue);
}

/* A norm applied by the projection itself (cllm_cuda_norm_in) equals the rmsnorm kernel and
 * then the projection, bit for bit: the gate/up + SiLU and QKV + RoPE + KV store outputs, the
 * residual it writes (res + add, into another buffer; res left as it was) -- for steps of 1 to
 * CLLM_CUDA_GEMM_NORM_MAX tokens, with and without a residual to add, in blocks of 2 and of 12
 * warps. Larger steps, and a res_out that is res, are refused. */
static void test_gemm_norm(int32_t K)
{
    const int32_t n_head = 4, n_kv = 2, hd = 64, NQ = (n_head + 2 * n_kv) * hd, F = 136;
    printf("gemm with the norm in it K=%d slices %d (QKV) and %d (gate/up)\n", K,
           cllm_cuda_gemm_slices(NQ, K), cllm_cuda_gemm_slices(2 * F, K));
    const int32_t n_max = CLLM_CUDA_GEMM_NORM_MAX, n_slots = 16;
    std::vector<float> wqf = randv((int64_t)NQ * K, 1.0f), wgf = randv((int64_t)2 * F * K, 1.0f);
    std::vector<__nv_bfloat16> wq(wqf.size()), wg(wgf.size());
    for (size_t i = 0; i < wq.size(); i++)
        wq[i].__x = cllm_f32_to_bf16(wqf[i]);
    for (size_t i = 0; i < wg.size(); i++)
        wg[i].__x = cllm_f32_to_bf16(wgf[i]);
    std::vector<float> res = randv((int64_t)n_max * K, 3.0f), add = randv((int64_t)n_max * K, 1.0f);
    std::vector<float> g = randv(K, 1.0f), bias = randv(NQ, 0.5f);
    std::vector<int32_t> pos(n_max), slot(n_max), seq(n_max, 0);
    for (int32_t t = 0; t < n_max; t++)
        pos[t] = 5 * t + 2, slot[t] = (t * 3 + 1) % n_slots;
    struct cllm_cuda_rope_store r;
    for (int32_t i = 0; i < hd / 2; i++)
        r.freqs.inv_freq[i] = 1.0f / powf(1000000.0f, (float)(2 * i) / (float)hd);
    r.pos = pos.data(), r.slot = slot.data(), r.bias = bias.data();
    r.n_head = n_head, r.n_kv = n_kv, r.head_dim = hd;
    for (int32_t n : {1, 3, 8}) {
        for (bool with_add : {true, false}) {
            /* the reference: the rmsnorm kernel (res += add in place), then each projection */
            std::vector<float> res_ref(res.begin(), res.begin() + (size_t)n * K);
            std::vector<__nv_bfloat16> xn((size_t)n * K);
            CHECK(cllm_cuda_rmsnorm(with_add ? res_ref.data() : NULL,
                                    with_add ? add.data() : res_ref.data(), g.data(), 1e-6f, n, K,
                                    xn.data(), 0) == cudaSuccess);
            std::vector<float> q_ref((size_t)n * NQ), q((size_t)n * NQ);
            std::vector<__nv_bfloat16> kc_ref((size_t)n_slots * n_kv * hd), vc_ref(kc_ref.size());
            std::vector<__nv_bfloat16> kc(kc_ref.size()), vc(kc_ref.size());
            r.k_cache = kc_ref.data(), r.v_cache = vc_ref.data();
            CHECK(cllm_cuda_gemm_rope_store(wq.data(), K, xn.data(), n, q_ref.data(), NQ, &r, NULL,
                                            NULL, 0, 0) == cudaSuccess);
            std::vector<__nv_bfloat16> ff_ref((size_t)n * F), ff((size_t)n * F);
            CHECK(cllm_cuda_gemm_gate_up_silu(wg.data(), F, K, xn.data(), n, ff_ref.data(), F, NULL,
                                              0, NULL, 0) == cudaSuccess);
            /* fused, twice: each writes the moved residual */
            std::vector<float> res_in(res.begin(), res.begin() + (size_t)n * K);
            std::vector<float> out1((size_t)n * K, -5.0f), out2((size_t)n * K, -5.0f);
            cllm_cuda_norm_in nin = {res_in.data(), with_add ? add.data() : NULL, g.data(), 1e-6f,
                                     out1.data()};
            r.k_cache = kc.data(), r.v_cache = vc.data();
            /* the norm inside asks for no scratch; given the one a split would take, not split */
            CHECK(cllm_cuda_gemm_scratch_bytes(NQ, K, n, true) == 0 &&
                  cllm_cuda_gemm_scratch_bytes(2 * F, K, n, true) == 0);
            std::vector<float> sq = gemm_scratch(cllm_cuda_gemm_scratch_bytes(NQ, K, n, false));
            std::vector<float> sg = gemm_scratch(cllm_cuda_gemm_scratch_bytes(2 * F, K, n, false));
            CHECK(cllm_cuda_gemm_rope_store(wq.data(), K, NULL, n, q.data(), NQ, &r, &nin,
                                            sq.data(), sq.size() * 4, 0) == cudaSuccess);
            nin.res_out = out2.data();
            CHECK(cllm_cuda_gemm_gate_up_silu(wg.data(), F, K, NULL, n, ff.data(), F, sg.data(),
                                              sg.size() * 4, &nin, 0) == cudaSuccess);
            CHECKF(counts_zero(sq) && counts_zero(sg), "norm in the GEMM, n=%d: counts left", n);
            CHECKF(memcmp(q.data(), q_ref.data(), q.size() * 4) == 0 &&
                       memcmp(kc.data(), kc_ref.data(), kc.size() * 2) == 0 &&
                       memcmp(vc.data(), vc_ref.data(), vc.size() * 2) == 0,
                   "QKV with the norm in it, n=%d add=%d: not the bits of rmsnorm + QKV", n,
                   with_add);
            CHECKF(memcmp(ff.data(), ff_ref.data(), ff.size() * 2) == 0,
                   "gate/up with the norm in it, n=%d add=%d: not the bits of rmsnorm + gate/up", n,
                   with_add);
            CHECKF(memcmp(res_in.data(), res.data(), res_in.size() * 4) == 0,
                   "norm in the GEMM, n=%d: res was written", n);
            for (const std::vector<float> *o : {&out1, &out2}) {
                if (with_add)
                    CHECKF(memcmp(o->data(), res_ref.data(), o->size() * 4) == 0,
                           "norm in the GEMM, n=%d: res_out is not the rmsnorm kernel's res + add",
                           n);
                else
                    CHECKF((*o)[0] == -5.0f && (*o)[o->size() - 1] == -5.0f,
                           "norm in the GEMM without add, n=%d: res_out written", n);
            }
        }
    }
    /* refused: a step past CLLM_CUDA_GEMM_NORM_MAX tokens, res_out = res */
    std::vector<float> big((size_t)(n_max + 1) * K), q((size_t)(n_max + 1) * NQ);
    std::vector<__nv_bfloat16> ff((size_t)(n_max + 1) * F);
    cllm_cuda_norm_in nin = {big.data(), big.data(), g.data(), 1e-6f, q.data()};
    CHECK(cllm_cuda_gemm_norm_supported(&nin, n_max, K));
    CHECK(!cllm_cuda_gemm_norm_supported(&nin, n_max + 1, K));
    CHECK(!cllm_cuda_gemm_norm_supported(&nin, 1, K + 4)); /* K not a multiple of 8 */
    /* an operand off the 16-byte grid */
    for (int bad = 0; bad < 4; bad++) {
        cllm_cuda_norm_in off = nin;
        const float **p[] = {&off.res, &off.add, &off.g, (const float **)&off.res_out};
        *p[bad] += 1;
        CHECKF(!cllm_cuda_gemm_norm_supported(&off, 1, K), "misaligned operand %d taken", bad);
    }
    cllm_cuda_norm_in in_place = nin;
    in_place.res_out = big.data();
    CHECK(!cllm_cuda_gemm_norm_supported(&in_place, 1, K));
    in_place.add = NULL; /* nothing to add: res_out unused */
    CHECK(cllm_cuda_gemm_norm_supported(&in_place, 1, K));
    CHECK(cllm_cuda_gemm_gate_up_silu(wg.data(), F, K, NULL, n_max + 1, ff.data(), F, NULL, 0, &nin,
                                      0) == cudaErrorInvalidValue);
    nin.res_out = big.data();
    CHECK(cllm_cuda_gemm_rope_store(wq.data(), K, NULL, 1, q.data(), NQ, &r, &nin, NULL, 0, 0) ==
          cudaErrorInvalidValue);
}

/* Parts of the test (0-9, see main) named on the command line, or all. */
/* The GEMM of one shape for n tokens (paired: the gate/up weight with SiLU, BF16 out widened). */
static std::vector<float> gemm_of(const std::vector<__nv_bfloat16> &w, int32_t N, int32_t K,
                                  const std::vector<__nv_bfloat16> &x, int32_t n, bool paired)
{
    const int32_t cols = paired ? N / 2 : N;
    std::vector<float> scratch = gemm_scratch(cllm_cuda_gemm_scratch_bytes(N, K, n, false));
    std::vector<float> y((size_t)n * cols);
    if (paired) {
        std::vector<__nv_bfloat16> out((size_t)n * cols);
        CHECK(cllm_cuda_gemm_gate_up_silu(w.data(), cols, K, x.data(), n, out.data(), cols,
                                          scratch.data(), scratch.size() * 4, NULL,
                                          0) == cudaSuccess);
        for (size_t i = 0; i < y.size(); i++)
            y[i] = bf(out[i]);
    } else
        CHECK(cllm_cuda_gemm(w.data(), NULL, N, K, x.data(), n, y.data(), cols, scratch.data(),
                             scratch.size() * 4, 0) == cudaSuccess);
    return y;
}

/* Start-up tuning (gemm.h): every bucket up to n_max gets a way that was timed -- one of the
 * ways open to the tuner -- and the GEMM gives the same bits after as before; with the
 * tiling closed, only the process's tiling is taken; forgetting the plans brings the default
 * ways back. */
static void test_gemm_tune(int32_t N, int32_t K, int32_t n_max, bool paired)
{
    printf("gemm tuning N=%d K=%d n<=%d paired=%d slices=%d\n", N, K, n_max, paired,
           cllm_cuda_gemm_slices(N, K));
    std::vector<__nv_bfloat16> w((size_t)N * K), w2((size_t)N * K), x((size_t)n_max * K);
    std::vector<float> wf = randv((int64_t)w.size(), 1.0f), xf = randv((int64_t)x.size(), 2.0f);
    for (size_t i = 0; i < w.size(); i++) {
        w[i].__x = cllm_f32_to_bf16(wf[i]);
        w2[i].__x = cllm_f32_to_bf16(-wf[i]);
    }
    for (size_t i = 0; i < x.size(); i++)
        x[i].__x = cllm_f32_to_bf16(xf[i]);
    const int32_t sizes[] = {1, 12, 32, 33, n_max};
    std::vector<std::vector<float>> before;
    char defaults[5][32];
    for (int i = 0; i < 5; i++) {
        before.push_back(gemm_of(w, N, K, x, sizes[i], paired));
        cllm_cuda_gemm_way(N, K, sizes[i], defaults[i], sizeof defaults[i]);
    }
    cudaStream_t stream = NULL; /* a stream of its own: the legacy stream cannot be recorded */
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
    const unsigned opens[] = {
        CLLM_CUDA_GEMM_TUNE_TILING | CLLM_CUDA_GEMM_TUNE_AHEAD | CLLM_CUDA_GEMM_TUNE_SPLIT, 0u};
    for (unsigned open : opens) {
        /* the tuner's operands: its own x (it only reads it) and y, which it overwrites */
        std::vector<float> y((size_t)n_max * N, -1.0f);
        std::vector<float> scratch = gemm_scratch(cllm_cuda_gemm_tune_scratch_bytes(N, K, n_max));
        if (cllm_cuda_gemm_slices(N, K) > 1)
            CHECKF(scratch.size() > 1, "gemm tuning N=%d K=%d: no scratch for the parallel ways", N,
                   K);
        char report[1024];
        const __nv_bfloat16 *ws[] = {w.data(), w2.data()}; /* two layers' weights, in turn */
        CHECK(cllm_cuda_gemm_tune(ws, 2, N, K, paired, x.data(), n_max, y.data(),
                                  paired ? N / 2 : N, scratch.data(), scratch.size() * 4, open,
                                  stream, report, sizeof report) == cudaSuccess);
        printf("  open %u: %s\n", open, report);
        char shape[32];
        snprintf(shape, sizeof shape, "%dx%d", N, K);
        CHECKF(strncmp(report, shape, strlen(shape)) == 0,
               "tuning report starts with the shape: %s", report);
        /* the skinny prefetch is timed both ways only when it is open */
        CHECKF((strstr(report, "n<=8: ") != NULL) == ((open & CLLM_CUDA_GEMM_TUNE_AHEAD) != 0),
               "tuning report: %s", report);
        for (int i = 0; i < 5; i++) {
            char way[32];
            cllm_cuda_gemm_way(N, K, sizes[i], way, sizeof way);
            if (sizes[i] <= CLLM_CUDA_GEMM_SKINNY_MAX)
                CHECKF(strcmp(way, "ahead") == 0 || strcmp(way, "not ahead") == 0 ||
                           strstr(way, "ahead, 2 blocks a tile") ||
                           strstr(way, "ahead, 4 blocks a tile"),
                       "n=%d: way %s", sizes[i], way);
            else if (open & CLLM_CUDA_GEMM_TUNE_TILING)
                CHECKF(strncmp(way, "128x64", 6) == 0 || strncmp(way, "256x64", 6) == 0 ||
                           strncmp(way, "128x128", 7) == 0,
                       "n=%d: way %s", sizes[i], way);
            else
                CHECKF(strncmp(way, cllm_cuda_gemm_tiling(), strlen(cllm_cuda_gemm_tiling())) ==
                               0 &&
                           (way[strlen(cllm_cuda_gemm_tiling())] == '\0' ||
                            way[strlen(cllm_cuda_gemm_tiling())] == ' '),
                       "n=%d: way %s with the tiling closed", sizes[i], way);
            if (sizes[i] <= CLLM_CUDA_GEMM_SKINNY_MAX && !(open & CLLM_CUDA_GEMM_TUNE_AHEAD))
                CHECKF(strcmp(way, defaults[i]) == 0,
                       "n=%d: way %s, not the default %s, with the prefetch closed", sizes[i], way,
                       defaults[i]);
            std::vector<float> after = gemm_of(w, N, K, x, sizes[i], paired);
            CHECKF(memcmp(after.data(), before[i].data(), after.size() * 4) == 0,
                   "gemm N=%d K=%d n=%d: tuned way %s gives other bits", N, K, sizes[i], way);
        }
    }
    CHECK(cllm_cuda_gemm_tuned(N, K, n_max) && cllm_cuda_gemm_tuned(N, K, 1));
    CHECK(!cllm_cuda_gemm_tuned(N, K, 1000) && !cllm_cuda_gemm_tuned(N + 8, K, 1));
    cllm_cuda_gemm_forget_plans();
    CHECK(!cllm_cuda_gemm_tuned(N, K, 1));
    for (int i = 0; i < 5; i++) {
        char way[32];
        cllm_cuda_gemm_way(N, K, sizes[i], way, sizeof way);
        CHECKF(strcmp(way, defaults[i]) == 0, "n=%d: way %s after forgetting, not the default %s",
               sizes[i], way, defaults[i]);
    }
    /* refused operands */
    char report[8];
    const __nv_bfloat16 *ws[] = {w.data()};
    CHECK(cllm_cuda_gemm_tune(ws, 1, N, K, paired, x.data(), 0, NULL, N, NULL, 0,
                              CLLM_CUDA_GEMM_TUNE_TILING, 0, report,
                              sizeof report) == cudaErrorInvalidValue);
    CHECK(cllm_cuda_gemm_tune(ws, 0, N, K, paired, x.data(), 4, NULL, N, NULL, 0,
                              CLLM_CUDA_GEMM_TUNE_TILING, 0, report,
                              sizeof report) == cudaErrorInvalidValue); /* no weights */
    CHECK(cllm_cuda_gemm_tune(ws, 1, 7, K, 1, x.data(), 4, NULL, 7, NULL, 0,
                              CLLM_CUDA_GEMM_TUNE_TILING, 0, report,
                              sizeof report) == cudaErrorInvalidValue); /* odd paired */
    CHECK(cudaStreamDestroy(stream) == cudaSuccess);
}

static bool part(int argc, char **argv, int k)
{
    for (int i = 1; i < argc; i++)
        if (atoi(argv[i]) == k)
            return true;
    return argc < 2;
}

int main(int argc, char **argv)
{
    /* These tests call the kernels on host memory and read it back at once. */
    emu_host_waits(true);
    if (part(argc, argv, 0)) {
        test_embed_norm_silu(1, 256);
        test_embed_norm_silu(5, 300);
        test_embed_norm_silu(3, 896);
    }
    int32_t lens_a[] = {1, 17, 300};
    int32_t lens_b[] = {600, 2, 40};
    for (int k = 0; k < 2; k++) {
        const bool simt = k == 1; /* the tensor-core kernel first: the default */
        /* regrouped: the emulator's slowest part, so on two shapes only */
        if (part(argc, argv, 1)) test_attention(12, 2, 128, lens_a, 3, simt, true); /* group 6 */
        if (part(argc, argv, 2)) test_attention(12, 2, 64, lens_a, 3, simt);
        if (part(argc, argv, 3)) test_attention(4, 2, 64, lens_b, 3, simt, true); /* group 2, split */
        if (part(argc, argv, 4)) test_attention(2, 2, 128, lens_b, 3, simt);  /* no grouping, split */
        if (part(argc, argv, 5)) test_attention(6, 1, 128, lens_b, 3, simt);  /* group 6, split */
        if (part(argc, argv, 9)) test_attention(14, 2, 64, lens_a, 3, simt);  /* group 7: 63-row tiles */
        if (part(argc, argv, 6)) test_decode(4, 2, 64, 4700, simt);
        if (part(argc, argv, 7)) test_decode(6, 1, 128, 4700, simt);
    }
    if (part(argc, argv, 8)) {
        /* every shape of the tiled kernel: each must give the skinny kernel's bits */
        for (const char *tiling : {"128x64", "256x64", "128x128", "256x128"}) {
            CHECK(cllm_cuda_gemm_use_tiling(tiling) == cudaSuccess);
            CHECK(strcmp(cllm_cuda_gemm_tiling(), tiling) == 0);
            printf("tiled GEMM in blocks of %s\n", tiling);
            test_gemm(40, 72, 70, true);     /* K not a multiple of 32, N not of 16, one slice */
            test_gemm(300, 1024, 70, false); /* several slices, two token tiles (one of 128) */
            test_gemm(136, 520, 33, true);   /* skinny's largest tile and the tiled kernel at 33 */
            test_gemm_gate_up_silu(50, 72);  /* F not a multiple of 8, one slice */
            test_gemm_gate_up_silu(100, 1024); /* several slices */
            test_gemm_gate_up_silu(300, 264);  /* several row tiles in every shape */
        }
        CHECK(cllm_cuda_gemm_use_tiling("64x64") == cudaErrorInvalidValue);
        CHECK(cllm_cuda_gemm_use_tiling(NULL) == cudaErrorInvalidValue);
        CHECK(strcmp(cllm_cuda_gemm_tiling(), "256x128") == 0); /* a refused name changes nothing */
        CHECK(cllm_cuda_gemm_use_tiling("128x64") == cudaSuccess);
        test_gemm_rope_store(12, 2, 128, 264, true); /* Qwen2.5-1.5B's heads */
        test_gemm_rope_store(14, 2, 64, 520, false); /* Qwen2.5-0.5B's, several slices */
        test_gemm_norm(264);                         /* 2 slices of QKV, 2 of gate/up */
        test_gemm_norm(1536);                        /* Qwen2.5-1.5B's width: 12 and 2 slices */
        /* the skinny kernel's W prefetch forced on (slices of 1-2 warps) and off (many) */
        for (int ahead : {1, -1}) {
            printf("skinny prefetch %s\n", ahead > 0 ? "always" : "never");
            cllm_cuda_gemm_force_ahead(ahead);
            test_gemm(40, 72, 40, true);
            test_gemm(300, 1024, 40, false);
            test_gemm_gate_up_silu(100, 1024);
            test_gemm_rope_store(14, 2, 64, 520, false);
        }
        cllm_cuda_gemm_force_ahead(0);
        /* a skinny row tile's slices over 2 and 4 blocks, the last of them adding them up */
        for (int parts : {2, 4}) {
            printf("skinny row tiles in %d blocks\n", parts);
            cllm_cuda_gemm_force_split(parts);
            char way[48], want[24];
            cllm_cuda_gemm_way(300, 1024, 1, way, sizeof way);
            snprintf(want, sizeof want, ", %d blocks a tile", parts);
            CHECKF(strstr(way, want) != NULL, "split %d: way %s", parts, way);
            cllm_cuda_gemm_way(40, 72, 1, way, sizeof way); /* one slice: nothing to split */
            CHECKF(strstr(way, "blocks") == NULL, "split %d, one slice: way %s", parts, way);
            test_gemm(300, 1024, 40, false); /* 8 slices */
            test_gemm(136, 520, 33, true);   /* 4 slices: blocks of one warp at 4 */
            test_gemm_gate_up_silu(100, 1024);
            test_gemm_rope_store(14, 2, 64, 520, false); /* 4 slices */
            test_gemm_rope_store(12, 2, 128, 264, true); /* 2 slices: not split in 4 */
            test_gemm_norm(1536); /* 12 slices: with the norm inside, not split (same bits) */
        }
        cllm_cuda_gemm_force_split(1);
    }
    if (part(argc, argv, 11)) {
        test_gemm_simt(40, 72, 20, true);     /* K/8 < 32: idle lanes; N not a multiple of 32 */
        test_gemm_simt(300, 1024, 20, false); /* 4 vectors a lane */
        test_gemm_simt(33, 2056, 12, true);   /* 257 vectors: lane 0 takes one more */
    }
    if (part(argc, argv, 10)) {
        test_gemm_tune(136, 256, 40, false); /* several slices: the parallel ways too */
        test_gemm_tune(72, 264, 40, true);   /* gate/up + SiLU */
    }
    /* refused operands */
    std::vector<__nv_bfloat16> w8(64), x8(64);
    std::vector<float> y8(64);
    CHECK(cllm_cuda_gemm(w8.data(), NULL, 4, 12, x8.data(), 2, y8.data(), 4, NULL, 0, 0) == cudaErrorInvalidValue); /* K % 8 */
    CHECK(cllm_cuda_gemm(w8.data() + 1, NULL, 4, 8, x8.data(), 2, y8.data(), 4, NULL, 0, 0) == cudaErrorInvalidValue); /* alignment */
    CHECK(cllm_cuda_gemm(w8.data(), NULL, 4, 8, x8.data(), 2, y8.data(), 3, NULL, 0, 0) == cudaErrorInvalidValue);     /* ldy < N */
    return test_summary();
}
