/* A Llama-family decoder stack on CPU in one call: every layer of a step (prefill chunks and decodes alike) runs the
 * very kernels the Python path calls, in the same order on the same buffers, so its result is the Python path's bit
 * for bit (tests/test_native_stack.py). What it saves is the Python between them: at a decode step of SmolLM2
 * about ten kernel calls a layer, each a ctypes call, a few torch ops and checks, while the second core waits.
 * Called through kernels/cpu_layers.py, which hands over the other builds' functions as pointers (one OpenMP pool:
 * torch's libgomp), the layers' weights and caches, and the step's tables and scratch buffers.
 *
 * Per layer, with T rows:  x = rms_norm(h + res)            res <- h + res (in place: each element read first)
 *                          qkv = x Wqkv^T (+ b)            [T, Nq + 2 Nkv]
 *                          q, k = rope(qkv's q, k)          [T, H, D], [T, KVH, D]
 *                          a = attention(q; k, v written)   [T, H, D]
 *                          h = a Wo^T (+ b);  x = rms_norm(h + res), res <- h + res
 *                          h = (silu(gate) * up)(x Wgu^T) Wd^T   (one call where gemm_silu is given: the same bits)
 * The first layer has no residual yet: x = rms_norm(h), res = h (the caller's embedding rows, then updated in
 * place). The caller adds the last h and res. */
#include <stdint.h>
#include <string.h>

typedef int (*dot_gemm_fn)(const void *x, int64_t m, int64_t k, const void *wp, const void *w, int64_t n, void *y,
                           const float *bias, int nthreads);
typedef int (*avx2_gemm_fn)(const void *x, int64_t m, int64_t k, int64_t sx, const void *w, const void *wp, int64_t n,
                            void *y, const float *bias, int nthreads);
typedef int (*dot_gemm_silu_fn)(const void *x, int64_t m, int64_t k, const void *wp, const void *w, int64_t n, void *y,
                                const float *bias, const void *silu, int nthreads);
typedef void (*norm_fn)(const void *x, const void *res, const void *w, void *out, void *res_out, int64_t rows,
                        int64_t n, float eps, int nthreads);
typedef void (*rope_fn)(const void *x, int64_t rows, int64_t heads, int64_t sr, int64_t sh, const void *c,
                        const void *s, int64_t sc, int64_t d, void *out, int nthreads);
typedef void (*silu_fn)(const void *x, int64_t rows, int64_t inter, int64_t sx, const void *table, void *out,
                        int nthreads);
typedef int (*attn_fn)(const void *q, int64_t q_stride, int q_dtype, float scale, const void *k_new, const void *v_new,
                       int64_t kn_stride, int64_t vn_stride, const int64_t *slots, int64_t t_new, void *k, void *v,
                       const int32_t *tables, int64_t table_stride, const int32_t *ctx, const int32_t *qsl,
                       int64_t nseq, void *out, int64_t h, int64_t kvh, int64_t nb, int64_t bs, int cache_dtype,
                       const float *k_scale, const float *v_scale, int64_t window, float softcap, const float *sinks,
                       int nthreads);

typedef struct { /* a weight [n, k] bf16 as the model holds it, its packed copy (NULL until made), an fp32 bias */
    const void *w, *packed;
    const float *bias;
    int64_t n, k;
} linear_t;

typedef struct {
    linear_t qkv, o, gate_up, down;
    const void *input_norm, *post_norm; /* [hidden] bf16 */
    void *k_cache, *v_cache;            /* [KVH, blocks, block_size, D] bf16 */
    int64_t window;                     /* 0: none */
} layer_t;

typedef struct {
    void *gemm; /* dot_gemm_fn (AVX512-BF16's gemm_any) or avx2_gemm_fn, by gemm_kind */
    int64_t gemm_kind;
    dot_gemm_silu_fn gemm_silu; /* the thin GEMM's gate_up with SiLU-and-mul in its epilogue, or NULL: two calls */
    norm_fn norm;
    rope_fn rope;
    silu_fn silu;
    attn_fn attn;
    const void *silu_table;
    int64_t hidden, heads, kv_heads, head_dim, inter, blocks, block_size;
    float eps, scale, softcap;
    const float *k_scale, *v_scale; /* [KVH] ones: a bf16 cache has no scale */
} model_t;

typedef struct {
    int64_t t, nseq, table_stride;
    const void *cos, *sin; /* [T, D] bf16: the step's rotary rows */
    const int64_t *slots;  /* [T]: each new row's cache slot */
    const int32_t *tables, *ctx, *qsl;
    void *x, *qkv, *q, *k, *attn, *gu, *act; /* scratch: [T, hidden], [T, Nq + 2 Nkv], [T, H, D], [T, KVH, D],
                                               * [T, H, D], [T, 2 I], [T, I] */
} step_t;

static int linear(const model_t *m, const linear_t *l, const void *x, int64_t rows, void *y, int nthreads) {
    if (m->gemm_kind == 0)
        return ((dot_gemm_fn)m->gemm)(x, rows, l->k, l->packed, l->packed ? 0 : l->w, l->n, y, l->bias, nthreads);
    return ((avx2_gemm_fn)m->gemm)(x, rows, l->k, l->k, l->packed ? 0 : l->w, l->packed, l->n, y, l->bias, nthreads);
}

/* h [T, hidden]: the embedding rows in, the last layer's output out; res [T, hidden]: the residual out. 0 on success,
 * else 16 * the layer's index + what failed: 1 a GEMM's buffers, 1 + the attention's code (2 its buffers, 3 a slot
 * past the pool). */
int run_layers(const model_t *m, const layer_t *layers, int64_t n_layers, const step_t *s, void *h, void *res,
               int nthreads) {
    const int64_t t = s->t, d = m->head_dim, nq = m->heads * d, nkv = m->kv_heads * d;
    for (int64_t i = 0; i < n_layers; i++) {
        const layer_t *l = &layers[i];
        const int64_t nqkv = l->qkv.n;
        int rc;
        if (i == 0) { /* res = h, then x = rms_norm(h): h's rows are the embedding's, res's start as them */
            m->norm(h, 0, l->input_norm, s->x, 0, t, m->hidden, m->eps, nthreads);
            memcpy(res, h, (size_t)(t * m->hidden) * 2);
        } else {
            m->norm(h, res, l->input_norm, s->x, res, t, m->hidden, m->eps, nthreads);
        }
        if (linear(m, &l->qkv, s->x, t, s->qkv, nthreads)) return 1 + 16 * (int)i;
        m->rope(s->qkv, t, m->heads, nqkv, d, s->cos, s->sin, d, d, s->q, nthreads);
        m->rope((const uint16_t *)s->qkv + nq, t, m->kv_heads, nqkv, d, s->cos, s->sin, d, d, s->k, nthreads);
        rc = m->attn(s->q, nq, 1, m->scale, s->k, (const uint16_t *)s->qkv + nq + nkv, nkv, nqkv, s->slots, t,
                     l->k_cache, l->v_cache, s->tables, s->table_stride, s->ctx, s->qsl, s->nseq, s->attn, m->heads,
                     m->kv_heads, m->blocks, m->block_size, 1, m->k_scale, m->v_scale, l->window, m->softcap, 0,
                     nthreads);
        if (rc) return 1 + rc + 16 * (int)i;
        if (linear(m, &l->o, s->attn, t, h, nthreads)) return 1 + 16 * (int)i;
        m->norm(h, res, l->post_norm, s->x, res, t, m->hidden, m->eps, nthreads);
        if (m->gemm_silu && m->gemm_kind == 0) {
            const linear_t *gu = &l->gate_up;
            if (m->gemm_silu(s->x, t, gu->k, gu->packed, gu->packed ? 0 : gu->w, gu->n, s->act, gu->bias, m->silu_table,
                             nthreads))
                return 1 + 16 * (int)i;
        } else {
            if (linear(m, &l->gate_up, s->x, t, s->gu, nthreads)) return 1 + 16 * (int)i;
            m->silu(s->gu, t, m->inter, 2 * m->inter, m->silu_table, s->act, nthreads);
        }
        if (linear(m, &l->down, s->act, t, h, nthreads)) return 1 + 16 * (int)i;
    }
    return 0;
}
