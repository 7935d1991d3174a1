/* Paged attention over the KV cache on CPU for a varlen batch (prefill chunks and decodes together), reading each
 * block where it lies (no gather): the CPU's answer to kernels/paged_attention.py, checked against
 * paged_attention_ref. Built at run time by kernels/cpu_attention.py with -DHEAD_DIM=<d> (a multiple of 8) and
 * -march=native.
 *
 * A work item is one kv head of one sequence and up to TQ of its query tokens, whose `rep` query heads share each
 * K/V row while it is in L1. Three passes over the item's positions: scores (q . k, soft-cap), fp32 exp(s - max)
 * per row over the positions it sees (causal, sliding window), then the weighted sum of V rows, normalized once at
 * the end. Two ways to compute them: fp32 arithmetic on rows widened from the cache (cpu_attention_f32.h: any CPU,
 * any cache dtype), or, where the CPU has AVX512-BF16 and a bf16 q meets a bf16 cache, vdpbf16ps on the bf16 rows
 * as they lie, with the softmax's weights rounded to bf16 for the weighted sum (cpu_attention_dot.h). Every sum
 * runs in one order per query row whatever shares its item, in either path: a token's output is the same from a
 * prefill of 300 tokens, a prefix-cache hit's 5, or a decode.
 *
 *   q        [T, H, D] in `q_dtype` (0 fp32, 1 bf16, 2 fp16), tokens q_stride elements apart, heads contiguous;
 *            multiplied by the softmax scale `scale` in fp32 as it is read; sequence s's tokens are rows
 *            qsl[s]..qsl[s+1]
 *   k_new, v_new  [t_new, KVH, D] in the cache's dtype (not fp8), tokens kn_stride / vn_stride elements apart: the
 *            step's new rows, written to the caches at slots [t_new] int64 (-1: none) before anything is read; NULL
 *            when the caller wrote them (an fp8 cache quantizes in torch); a slot past the pool returns 2
 *   k, v     [KVH, NB, BS, D] in `cache_dtype`: 0 fp32, 1 bf16, 2 fp16, 3 fp8 e4m3fn times its kv head's scale
 *   k_scale, v_scale  [KVH] fp32 (read for fp8 only)
 *   tables   [S, table_stride] int32 block ids; ctx [S] int32 context length, the new tokens included
 *   sinks    [H] fp32 or NULL: GPT-OSS's per-head logit that joins each softmax's denominator with no value
 *   out      [T, H, D] in q's dtype (rounded to nearest even, as torch's casts; a NaN's payload aside)
 * Threads: OpenMP, `nthreads` of them, in the process's libgomp.so.1, which torch has already loaded: one pool. */
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NV (HEAD_DIM / 8)
#define TQ 16              /* query tokens an item takes at most */
#define PB 64              /* V rows converted at a time */
#define SCORES (192 << 10) /* bytes of scores an item keeps (in L2) */
#define AHEAD 32           /* positions ahead whose K / V rows are prefetched */
#ifdef __AVX512VL__
#define CW 8 /* vectors of D a weighted-sum tile takes: 32 vector registers hold 3 rows x 8 sums (one pass over V) */
#else
#define CW 4 /* AVX2's 16 hold 3 x 4 (two passes for D = 64) */
#endif
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
typedef _Float16 f8 __attribute__((vector_size(16)));
typedef int32_t i8 __attribute__((vector_size(32)));

static float fp8_lut[256];

static float fp8_e4m3fn(uint8_t x) { /* bias 7, no infinities; 0x7f and 0xff are NaN */
    int e = (x >> 3) & 15, m = x & 7;
    float v = (e == 15 && m == 7) ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
    return (x >> 7) ? -v : v;
}

static void amx_request(void);

void init_tables(void) {
    for (int i = 0; i < 256; i++) fp8_lut[i] = fp8_e4m3fn((uint8_t)i);
    amx_request();
}

#if defined(__AVX512BF16__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && HEAD_DIM % 32 == 0
#define DOT 1 /* a bf16 q against a bf16 cache: scores and weighted sums by vdpbf16ps (kernels/cpu_attention_dot.h) */
#else
#define DOT 0
#endif

#if DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX 1 /* and where the CPU has AMX, those products as tile GEMMs (kernels/cpu_attention_amx.h) */
#else
#define AMX 0
#endif

int rounds_weights(void) { return DOT; } /* bf16 q on a bf16 cache: pass 3 rounds the weights to bf16 */

static const uint16_t zero_row[HEAD_DIM]; /* a masked position's K: its scores are dropped in pass 2 */

#include "cpu_attention_cache.h" /* items, cache_row, the prefetches */
#include "cpu_attention_f32.h"
#if DOT
#include "cpu_attention_dot.h"
#endif
#if AMX
#include "cpu_attention_amx.h"
#else
static void amx_request(void) {}
#endif

/* One item. Its rows are R = (i1 - i0) * rep query vectors, row r = query token i0 + r / rep, head kh * rep + r % rep.
 * Token i sits at position pos = n - nq + i and sees [lo_i, pos] (lo_i > 0 with a window): the item's positions
 * span [lo, hi). Scores live in s [R, W] fp32 over the positions [lo8, lo8 + W) (lo rounded down to 8). */
static int run(const item *it, const void *q, int64_t q_stride, int q_dtype, float scale, const void *k, const void *v,
               const int32_t *tables, int64_t table_stride, const int32_t *ctx, const int32_t *qsl, void *out, int64_t h, int64_t kvh,
               int64_t nb, int64_t bs, int dtype, const float *k_scale, const float *v_scale, int64_t window, float softcap,
               const float *sinks) {
    const int64_t rep = h / kvh, s = it->s, kh = it->kh, nq = qsl[s + 1] - qsl[s], n = ctx[s], first = n - nq;
    const int64_t R = (it->i1 - it->i0) * rep;
    const int32_t *bt = tables + s * table_stride;
    const int esize = dtype == 0 ? 4 : dtype == 3 ? 1 : 2;
#define END_T(t) (first + it->i0 + (t) + 1) /* the item's token t sees positions [START_T(t), END_T(t)) */
#define START_T(t) (window > 0 && END_T(t) > window ? END_T(t) - window : 0)
#define END(r) END_T(tok[r]) /* row r's */
#define START(r) START_T(tok[r])
#define HEAD(r) (kh * rep + (r) - tok[r] * rep) /* row r's query head */
    /* a bf16 q on a bf16 cache where AVX512-BF16 is: q kept as bf16 (in qv's room), passes 1 and 3 by vdpbf16ps
     * (kernels/cpu_attention_dot.h) in every path, a prefill's rows and a decode's alike; positions 16 a tile */
    const int dot = DOT && dtype == 1 && q_dtype == 1;
#if AMX
    const int amx = dot && amx_ok; /* its buffers' rows padded to whole tiles of 16 */
#else
    const int amx = 0;
#endif
    const int64_t Rp = amx ? (R + 15) & -16 : R;
    int64_t lo, hi;
    item_span(it, ctx, qsl, window, &lo, &hi); /* START_T(0), END_T(i1 - i0 - 1) */
    const int64_t al = amx ? 32 : dot ? 16 : 8, lo8 = lo & -al;
    const int64_t W = ((hi + al - 1) & -al) - lo8;
    /* q [R, NV] | acc [R, NV] | rows [PB, NV] | scores [R, W] | sums [R] | tokens [R] | dot: bf16 weights [R, W] */
    /* (amx: q, acc and pw of Rp rows, whole tiles; vb [HEAD_DIM / 16, 16, 32] bf16, pass 3's V chunk) */
    const size_t bytes = sizeof(v8) * (2 * Rp + PB) * NV + sizeof(float) * R * (W + 2) + (dot ? 2 * Rp * W : 0) +
                         (amx ? 64 + 2 * 32 * HEAD_DIM : 0);
    v8 *qv = aligned_alloc(64, (bytes + 63) / 64 * 64); /* C11: a multiple of the alignment */
    if (qv == NULL) return 1;
    v8 *acc = qv + Rp * NV, *row = acc + Rp * NV;
    float *sc = (float *)(row + PB * NV), *sums = sc + R * W;
    int32_t *tok = (int32_t *)(sums + R); /* row r's token within the item, r / rep (no division in the loops) */
    uint16_t *pw = (uint16_t *)(tok + R); /* dot: pass 2's weights rounded to bf16, pass 3's operand */
    uint16_t *vb = (uint16_t *)(((uintptr_t)(pw + Rp * W) + 63) & ~(uintptr_t)63); /* amx only */
    (void)vb;
    (void)pw; /* unused where DOT is 0 */
    for (int64_t t = 0, r = 0; r < R; t++)
        for (int64_t j = 0; j < rep; j++) tok[r++] = (int32_t)t;
    const int qsize = q_dtype == 0 ? 4 : 2;
    for (int64_t r = 0; r < R && dot; r++)
        memcpy((uint16_t *)qv + r * HEAD_DIM, (const uint16_t *)q + (qsl[s] + it->i0 + tok[r]) * q_stride +
               HEAD(r) * HEAD_DIM, HEAD_DIM * sizeof(uint16_t));
    if (amx) { /* the padding rows: zeros in q and the weights, sums from 0 */
        memset((uint16_t *)qv + R * HEAD_DIM, 0, (Rp - R) * HEAD_DIM * sizeof(uint16_t));
        memset(pw + R * W, 0, (Rp - R) * W * sizeof(uint16_t));
        memset(acc, 0, sizeof(v8) * Rp * NV);
#if AMX
        amx_config();
#endif
    }
    for (int64_t r = 0; r < R && !dot; r++) /* token i0 + r / rep's query head kh * rep + r % rep */
        load_q((const char *)q + ((qsl[s] + it->i0 + tok[r]) * q_stride + HEAD(r) * HEAD_DIM) * qsize,
               q_dtype, scale, qv + r * NV);
    /* pass 1: scores, 8 positions at a time. A decode's few rows (R <= 3: a token's query heads of one kv head) on a
     * bf16 cache read each K row where it lies, widened in registers, all R rows x 4 positions a tile (`direct`, qk4:
     * an fp32 copy costs more than it saves for 3 uses). Else the K rows are converted to fp32 once for all R rows,
     * two rows x four positions a tile (8 sums of 8 lanes along D). Either way a score is q . k summed lane-wise in
     * D's order, then hsum8's tree: the same whatever rows share the item. */
    const int direct = dtype == 1 && R <= 3;
    /* direct: the first K and V rows, read before the loops' own prefetches are AHEAD (1.1-1.2x, cold) */
    if (direct) prefetch_first(k, v, bt, kh, nb, bs, lo, hi);
#if DOT
    for (int64_t p0 = lo8; p0 < lo8 + W && dot; p0 += 32) { /* K rows where they lie, transposed once for all rows */
        const int g = p0 + 16 < lo8 + W ? 2 : 1; /* tiles of 16 positions */
        for (int64_t p = p0 + AHEAD; p < p0 + AHEAD + 32 && p < hi; p += 8) {
            prefetch_rows(k, bt, kh, nb, bs, p, hi, 2);
            if (direct) prefetch_rows(v, bt, kh, nb, bs, p, hi, 2);
        }
        const uint16_t *kp[32];
        for (int j = 0; j < 16 * g; j++) {
            const int64_t p = p0 + j;
            kp[j] = p >= lo && p < hi ? (const uint16_t *)k + cache_row(bt, kh, nb, bs, p) * HEAD_DIM : zero_row;
        }
        __m512i kt[HEAD_DIM];
        for (int t = 0; t < g; t++) transpose16(kp + 16 * t, kt + t * HEAD_DIM / 2);
#if AMX
        if (amx) /* g is 2: W is whole chunks of 32 */
            pass1_amx((const uint16_t *)qv, kt, R, tok, END_T(0), window, p0, scale, softcap, sc + p0 - lo8, W);
#endif
        for (int64_t r0 = 0; r0 < R && !amx; r0 += DQ_ROWS) {
            const int64_t n = R - r0 < DQ_ROWS ? R - r0 : DQ_ROWS, r1 = r0 + n - 1;
            if (END(r1) <= p0 || START(r0) >= p0 + 16 * g) continue; /* no position of these rows here */
            const uint16_t *qb = (const uint16_t *)qv + r0 * HEAD_DIM; /* the bf16 rows, HEAD_DIM apart */
            float *dst = sc + r0 * W + p0 - lo8;
            /* constant row and tile counts: each tile's sums stay in registers */
            if (n == DQ_ROWS && g == 2)
                scores16(qb, DQ_ROWS, kt, 2, scale, softcap, dst, W);
            else if (n == 3 && g == 2)
                scores16(qb, 3, kt, 2, scale, softcap, dst, W);
            else
                for (int64_t i = 0; i < n; i++)
                    for (int t = 0; t < g; t++)
                        scores16(qb + i * HEAD_DIM, 1, kt + t * HEAD_DIM / 2, 1, scale, softcap, dst + i * W + 16 * t, W);
        }
    }
#endif
    for (int64_t p0 = lo8; p0 < lo8 + W && direct && !dot; p0 += 8) {
        if (p0 + AHEAD < hi) prefetch_rows(k, bt, kh, nb, bs, p0 + AHEAD, hi, esize);
        v8 x[2][3];
        for (int half = 0; half < 2; half++) {
            const uint16_t *kp[4];
            for (int j = 0; j < 4; j++) {
                const int64_t p = p0 + 4 * half + j;
                kp[j] = p >= lo && p < hi ? (const uint16_t *)k + cache_row(bt, kh, nb, bs, p) * HEAD_DIM : zero_row;
            }
            if (R == 3) /* constant row counts: each tile's sums stay in registers */
                qk4(qv, 3, kp, x[half]);
            else if (R == 2)
                qk4(qv, 2, kp, x[half]);
            else
                qk4(qv, 1, kp, x[half]);
        }
        for (int64_t r = 0; r < R; r++) /* qk4's two halves: positions p0.. and p0 + 4.. */
            put_scores(sc + r * W + p0 - lo8, __builtin_shufflevector(x[0][r], x[1][r], 0, 1, 2, 3, 8, 9, 10, 11),
                       softcap);
    }
    for (int64_t p0 = lo8; p0 < lo8 + W && !direct && !dot; p0 += 8) {
        if (p0 + AHEAD < hi) prefetch_rows(k, bt, kh, nb, bs, p0 + AHEAD, hi, esize);
        for (int64_t j = 0; j < 8; j++) {
            const int64_t p = p0 + j;
            if (p >= lo && p < hi)
                load_row(k, cache_row(bt, kh, nb, bs, p), dtype, k_scale[kh], row + j * NV);
            else
                memset(row + j * NV, 0, sizeof(v8) * NV); /* no position of this item: masked below */
        }
        for (int64_t r0 = 0; r0 < R; r0 += 2) {
            const int64_t r1 = r0 + 1 < R ? r0 + 1 : r0; /* an odd last row: computed twice, stored once */
            if (END(r1) <= p0 || START(r0) >= p0 + 8) continue; /* no position of these rows here */
            const v8 *qa = qv + r0 * NV, *qb = qv + r1 * NV;
            v8 x[2];
            for (int half = 0; half < 2; half++) {
                const v8 *kr = row + 4 * half * NV;
                v8 a[8]; /* from 0, as qk4's, by mac8 as qk4's */
                for (int j = 0; j < 8; j++) a[j] = (v8){0};
                for (int c = 0; c < NV; c++)
                    for (int j = 0; j < 4; j++) {
                        a[j] = mac8(a[j], qa[c], kr[j * NV + c]);
                        a[4 + j] = mac8(a[4 + j], qb[c], kr[j * NV + c]);
                    }
                x[half] = hsum8(a); /* row r0's 4 positions, then row r1's */
            }
            v8 xa = __builtin_shufflevector(x[0], x[1], 0, 1, 2, 3, 8, 9, 10, 11);
            v8 xb = __builtin_shufflevector(x[0], x[1], 4, 5, 6, 7, 12, 13, 14, 15);
            if (softcap > 0.0f)
                for (int j = 0; j < 8; j++) {
                    xa[j] = softcap * tanhf(xa[j] / softcap);
                    xb[j] = softcap * tanhf(xb[j] / softcap);
                }
            memcpy(sc + r0 * W + p0 - lo8, &xa, 32);
            memcpy(sc + r1 * W + p0 - lo8, &xb, 32);
        }
    }
    /* pass 2, per row: exp(s - max) over its own positions, 0 elsewhere; the sum lane-wise over 8-aligned
     * positions, then hsum's tree (the same whatever its item) */
    const v8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
#if DOT
    for (int64_t r = 0; r < R && dot; r++)
        sums[r] = softmax_dot(sc + r * W, pw + r * W, W, START(r) - lo8, END(r) - lo8, sinks ? sinks + HEAD(r) : NULL);
#endif
    for (int64_t r = 0; r < R && !dot; r++) {
        float *sr = sc + r * W;
        const int64_t a = START(r) - lo8, b = END(r) - lo8, a8 = a & ~(int64_t)7, b8 = (b + 7) & ~(int64_t)7;
        v8 mv = (v8){0} - INFINITY;
        for (int64_t j = a8; j < b8; j += 8) { /* the max lane-wise (any order: it is exact), masked at the ends */
            v8 x;
            memcpy(&x, sr + j, 32);
            const i8 take = (x > mv) & (lane + (float)j >= (float)a) & (lane + (float)j < (float)b);
            mv = (v8)(((i8)x & take) | ((i8)mv & ~take));
        }
        float m = mv[0];
        for (int l = 1; l < 8; l++) m = mv[l] > m ? mv[l] : m;
        const float sink = sinks ? sinks[HEAD(r)] : -INFINITY;
        m = sink > m ? sink : m;
        v8 sum = (v8){0};
        for (int64_t j = 0; j < W; j += 8) {
            v8 x = (v8){0};
            if (j >= a8 && j < b8) {
                memcpy(&x, sr + j, 32);
                x = exp_v8(x - m);
                if (j < a || j + 8 > b) { /* an end chunk: 0 outside the row's positions */
                    const i8 in = (lane + (float)j >= (float)a) & (lane + (float)j < (float)b);
                    x = (v8)((i8)x & in);
                }
                sum += x;
            }
            memcpy(sr + j, &x, 32);
        }
        sums[r] = hsum(sum) + (sinks ? expf(sink - m) : 0.0f);
    }
    /* pass 3: acc[r] += w[r, p] * v_p in the positions' order, PB V rows converted at a time; three rows x CW
     * vectors of D a tile (12 or 24 sums in registers). A weight outside a row's positions is 0: adding 0 * v (v finite:
     * a real token's) leaves its sums as they were, so a row's output is the same whatever rows share the item. */
    if (!dot) memset(acc, 0, sizeof(v8) * R * NV); /* pv_dot stores its sums whole */
#if AMX
    if (amx)
        pass3_amx((float *)acc, pw, W, lo8, v, bt, kh, nb, bs, lo, hi, R, tok, END_T(0), window, !direct, vb);
#endif
#if DOT
    for (int64_t r0 = 0; r0 < R && dot && !amx; r0 += DV_ROWS) { /* pairs of positions, V rows where they lie */
        const int n = R - r0 < DV_ROWS ? (int)(R - r0) : DV_ROWS;
        const int64_t a = START(r0) & ~(int64_t)1, b = (END(r0 + n - 1) + 1) & ~(int64_t)1;
        float *t = (float *)acc + r0 * HEAD_DIM;
        const uint16_t *w = pw + r0 * W;
        for (int c0 = 0; c0 < HEAD_DIM / 16; c0 += 4) { /* 64 of D a tile */
            const int cc = HEAD_DIM / 16 - c0 < 4 ? HEAD_DIM / 16 - c0 : 4;
            if (n == DV_ROWS && cc == 4) /* constant row counts: each tile's sums stay in registers */
                pv_dot(t, w, W, lo8, v, bt, kh, nb, bs, lo, hi, a, b, DV_ROWS, c0, 4);
            else if (n == 3 && cc == 4)
                pv_dot(t, w, W, lo8, v, bt, kh, nb, bs, lo, hi, a, b, 3, c0, 4);
            else
                pv_dot(t, w, W, lo8, v, bt, kh, nb, bs, lo, hi, a, b, n, c0, cc);
        }
    }
#endif
    for (int c0 = 0; c0 < NV && direct && !dot; c0 += CW) {
        const int cc = NV - c0 < CW ? NV - c0 : CW;
        if (R == 3 && cc == CW)
            pv_bf16(acc, sc, W, lo8, v, bt, kh, nb, bs, lo, hi, hi, 3, c0, CW, c0 == 0);
        else
            pv_bf16(acc, sc, W, lo8, v, bt, kh, nb, bs, lo, hi, hi, (int)R, c0, cc, c0 == 0);
    }
    for (int64_t pb = lo; pb < hi && !direct && !dot; pb += PB) {
        const int64_t pe = pb + PB < hi ? pb + PB : hi;
        for (int64_t p = pb; p < pe; p++) {
            if ((p & 7) == 0 && p + AHEAD < hi) prefetch_rows(v, bt, kh, nb, bs, p + AHEAD, hi, esize);
            load_row(v, cache_row(bt, kh, nb, bs, p), dtype, v_scale[kh], row + (p - pb) * NV);
        }
        for (int64_t r0 = 0; r0 < R; r0 += 3) {
            const int rr = R - r0 < 3 ? (int)(R - r0) : 3;
            const int64_t a = START(r0) > pb ? START(r0) : pb, b = END(r0 + rr - 1) < pe ? END(r0 + rr - 1) : pe;
            for (int c0 = 0; c0 < NV; c0 += CW) {
                const int cc = NV - c0 < CW ? NV - c0 : CW;
                v8 *t = acc + r0 * NV + c0;
                const float *w = sc + r0 * W + pb - lo8; /* position pb's weight of row r0 */
                if (rr == 3 && cc == CW)
                    pv_tile(t, w, W, row + c0, a - pb, b - pb, 3, CW);
                else
                    pv_tile(t, w, W, row + c0, a - pb, b - pb, rr, cc);
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const float inv = 1.0f / sums[r];
        v8 x[NV];
        for (int c = 0; c < NV; c++) x[c] = acc[r * NV + c] * inv;
        store_row((char *)out + ((qsl[s] + it->i0 + tok[r]) * h + HEAD(r)) * HEAD_DIM * qsize, q_dtype, x);
    }
#undef HEAD
#undef START
#undef END
#undef START_T
#undef END_T
    free(qv);
    return 0;
}

/* Query tokens an item takes: its scores ([tokens * rep, W] fp32) within SCORES bytes, 1 to TQ. */
static int64_t tile_tokens(int64_t rep, int64_t w) {
    const int64_t t = SCORES / ((int64_t)sizeof(float) * rep * (w + 8));
    return t < 1 ? 1 : t > TQ ? TQ : t;
}

int paged_attention(const void *q, int64_t q_stride, int q_dtype, float scale, const void *k_new, const void *v_new,
                    int64_t kn_stride, int64_t vn_stride, const int64_t *slots, int64_t t_new, void *k, void *v,
                    const int32_t *tables, int64_t table_stride, const int32_t *ctx, const int32_t *qsl, int64_t nseq,
                    void *out, int64_t h, int64_t kvh, int64_t nb, int64_t bs, int cache_dtype, const float *k_scale,
                    const float *v_scale, int64_t window, float softcap, const float *sinks, int nthreads) {
    const int64_t rep = h / kvh;
    if (k_new != NULL) { /* the step's new rows into the caches first (an implicit barrier ends the loop) */
        for (int64_t t = 0; t < t_new; t++)
            if (slots[t] >= nb * bs) return 2; /* past the pool: refused before anything is written */
        const int64_t esize = cache_dtype == 0 ? 4 : 2, row = HEAD_DIM * esize;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (t_new * kvh >= 512)
        for (int64_t t = 0; t < t_new; t++) {
            if (slots[t] < 0) continue; /* a padding row */
            for (int64_t kh = 0; kh < kvh; kh++) {
                const int64_t at = (kh * nb * bs + slots[t]) * row;
                memcpy((char *)k + at, (const char *)k_new + (t * kn_stride + kh * HEAD_DIM) * esize, row);
                memcpy((char *)v + at, (const char *)v_new + (t * vn_stride + kh * HEAD_DIM) * esize, row);
            }
        }
    }
    int64_t count = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t nq = qsl[s + 1] - qsl[s], tq = tile_tokens(rep, window > 0 && ctx[s] > window ? window : ctx[s]);
        count += kvh * ((nq + tq - 1) / tq);
    }
    item *items = malloc(sizeof(item) * (size_t)(count ? count : 1));
    if (items == NULL) return 1;
    int64_t m = 0;
    for (int64_t s = 0; s < nseq; s++) { /* a sequence's tiles, longest context first; then its kv heads */
        const int64_t nq = qsl[s + 1] - qsl[s], tq = tile_tokens(rep, window > 0 && ctx[s] > window ? window : ctx[s]);
        for (int64_t i1 = nq; i1 > 0; i1 -= tq)
            for (int64_t kh = 0; kh < kvh; kh++) items[m++] = (item){s, kh, i1 - tq > 0 ? i1 - tq : 0, i1};
    }
    int failed = 0;
    int64_t next = 0; /* the next item no thread has taken: each thread takes one ahead, to prefetch its first rows */
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    for (int64_t i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED); i < count;) {
        const int64_t j = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
        if (j < count) prefetch_item(items + j, k, v, tables, table_stride, ctx, qsl, nb, bs, cache_dtype, window, rep);
        failed |= run(items + i, q, q_stride, q_dtype, scale, k, v, tables, table_stride, ctx, qsl, out, h, kvh, nb, bs,
                      cache_dtype, k_scale, v_scale, window, softcap, sinks);
        i = j;
    }
    free(items);
    return failed;
}
