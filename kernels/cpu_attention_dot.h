/* kernels/cpu_attention.c's passes 1 and 3 where the CPU has AVX512-BF16, for a bf16 q on a bf16 cache (DOT): both
 * products by vdpbf16ps on the bf16 pairs as they lie, 16 fp32 lanes a vector.
 *
 *   pass 1  16 positions a tile, their K rows transposed (kt[i] lane j: K row j's pair i, D 2i and 2i + 1): a row's
 *           16 scores are one chain of HEAD_DIM / 2 vdpbf16ps, pair 0 first, then times the softmax scale. No
 *           horizontal sum: lanes are positions, each sum runs in D's order whatever shares the tile.
 *   pass 3  two positions a step: their V rows interleaved (vpunpck{l,h}wd: lane i of a 32-bit pair = V[p][d],
 *           V[p + 1][d]) against the row's two weights rounded to bf16 (as flash attention rounds P for its PV
 *           GEMM; pass 2 sums the rounded weights, so each output is a weighted mean of V). Pairs start at even
 *           positions; a position outside a row's own has weight 0, which adds a signed zero: a row's sums are the
 *           same whatever rows share its tile, so a token's output is the same bits in a prefill and a decode.
 * The sums hold D in vpunpck's order (lanes 4L .. 4L + 3 of a 32-of-D chunk's low vector are D 8L + 0..3, of its
 * high one D 8L + 4..7) until pv_dot stores them. */
#include <immintrin.h>

#define DQ_ROWS 6 /* query rows a pass-1 tile takes, against two tiles of 16 positions: 12 sums in registers */
#define DQ_SUMS 12
#define DV_ROWS 6 /* rows a pass-3 tile takes: 6 x 4 sums (64 of D) and 4 V pairs in registers */

/* kt[i] lane j = kp[j]'s bf16 pair i, for i < HEAD_DIM / 2: four rounds of 16 shuffles per 16 x 16 block */
static inline void transpose16(const uint16_t *const *kp, __m512i *kt) {
    for (int c = 0; c < HEAD_DIM / 32; c++) { /* pairs 16c .. 16c + 15 */
        __m512i r[16], t[16];
        for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(kp[j] + 32 * c);
        for (int j = 0; j < 16; j += 2) { /* in each 128-bit lane L: rows j, j + 1 of columns 4L + 0..1, 4L + 2..3 */
            t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
            t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
        }
        for (int j = 0; j < 16; j += 4) { /* r[j + k] lane L: rows j .. j + 3 of column 4L + k */
            r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
            r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
            r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
            r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
        }
        for (int k = 0; k < 4; k++) { /* the four row groups' lanes L into one column each */
            t[k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);      /* lanes: (k, 0) (k, 2) (4 + k, 0) (4 + k, 2) */
            t[4 + k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);  /* the odd lanes */
            t[8 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
            t[12 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
        }
        for (int k = 0; k < 4; k++) {
            kt[16 * c + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
            kt[16 * c + 8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
            kt[16 * c + 4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
            kt[16 * c + 12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
        }
    }
}

/* 16 scores to dst: times scale, then softcap * tanh(x / softcap) where softcap > 0 (the order the reference uses) */
static inline void scale_cap16(__m512 x, float scale, float softcap, float *dst) {
    x = _mm512_mul_ps(x, _mm512_set1_ps(scale));
    if (softcap > 0.0f) {
        float f[16];
        _mm512_storeu_ps(f, x);
        for (int j = 0; j < 16; j++) f[j] = softcap * tanhf(f[j] / softcap);
        x = _mm512_loadu_ps(f);
    }
    _mm512_storeu_ps(dst, x);
}

/* n bf16 q rows (HEAD_DIM apart) against g transposed tiles (kt, HEAD_DIM / 2 vectors each): 16 scores a row and
 * tile, times `scale`, soft-capped, to dst + i * W + 16 * t. n x g chains of vdpbf16ps (n, g constants once inlined,
 * n x g <= DQ_SUMS): a decode's 3 rows take two tiles, so that 6 chains hide the instruction's latency. */
static inline __attribute__((always_inline)) void scores16(const uint16_t *qb, int n, const __m512i *kt, int g,
                                                           float scale, float softcap, float *dst, int64_t W) {
    __m512 acc[DQ_SUMS];
    for (int i = 0; i < n * g; i++) acc[i] = _mm512_setzero_ps();
    typedef uint32_t u32a __attribute__((may_alias)); /* the bf16 pairs of q, read as 32-bit words */
    const u32a *q32 = (const u32a *)qb;
    for (int p = 0; p < HEAD_DIM / 2; p++) {
        __m512bh kv[2];
        for (int t = 0; t < g; t++) kv[t] = (__m512bh)kt[t * HEAD_DIM / 2 + p];
        for (int i = 0; i < n; i++) {
            const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)q32[i * HEAD_DIM / 2 + p]);
            for (int t = 0; t < g; t++) acc[i * g + t] = _mm512_dpbf16_ps(acc[i * g + t], qp, kv[t]);
        }
    }
    for (int i = 0; i < n; i++)
        for (int t = 0; t < g; t++) scale_cap16(acc[i * g + t], scale, softcap, dst + i * W + 16 * t);
}

/* exp(x) 16 at a time, as exp_v8 (degree-6 Taylor polynomial on x - n ln2, |r| <= ln2 / 2; relative error < 2e-7),
 * 2^n by vscalefps; x clamped below at -87 (a NaN stays NaN) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x); /* vmaxps returns its second operand where either is NaN */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x); /* ln2 in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    static const float c[6] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

/* lanes l of the 16 positions from j with a <= j + l < b */
static inline __mmask16 lanes_in(int64_t j, int64_t a, int64_t b) {
    const uint32_t lo = j >= a ? 0xffffu : 0xffffu << (a - j), hi = j + 16 <= b ? 0xffffu : 0xffffu >> (16 - (b - j));
    return (__mmask16)(lo & hi);
}

/* pass 2 of one row: pw[j] = bf16(exp(s[j] - max)) over its positions [a, b) (offsets from the item's first, a
 * multiple of 16), 0 elsewhere in [0, W). Returns the sum of the rounded weights (lane-wise over 16-aligned positions,
 * then one fixed tree), plus exp(sink - max) where there is a sink. Lanes outside [a, b) are never used (pass 1 left
 * them unwritten where no row of their tile saw them). */
static inline float softmax_dot(const float *sr, uint16_t *pw, int64_t W, int64_t a, int64_t b, const float *sink) {
    const int64_t a16 = a & ~(int64_t)15, b16 = (b + 15) & ~(int64_t)15;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = a16; j < b16; j += 16) mv = _mm512_mask_max_ps(mv, lanes_in(j, a, b), mv, _mm512_loadu_ps(sr + j));
    float m = _mm512_reduce_max_ps(mv);
    m = sink && *sink > m ? *sink : m;
    const __m512 mm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < W; j += 16) {
        if (j < a16 || j >= b16) {
            memset(pw + j, 0, 32);
            continue;
        }
        const __m512 x = _mm512_maskz_mov_ps(lanes_in(j, a, b), exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mm)));
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
        _mm256_storeu_si256((__m256i *)(pw + j), h);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    return _mm512_reduce_add_ps(sum) + (sink ? expf(*sink - m) : 0.0f);
}

/* acc[i * HEAD_DIM + 16 * c0 ...] (D 16 c0 .. 16 (c0 + cc)) = the weighted sum of the V rows over the position
 * pairs [a, b) (a, b even), for rows i < n (a constant once inlined, <= DV_ROWS), cc (<= 4, even) 16-lane vectors:
 * P [n, W] bf16 weights from position base, V rows read where they lie (zero_row outside [lo, hi); a decode's were
 * prefetched by pass 1). */
static inline __attribute__((always_inline)) void pv_dot(float *acc, const uint16_t *P, int64_t W, int64_t base,
                                                         const uint16_t *v, const int32_t *bt, int64_t kh, int64_t nb,
                                                         int64_t bs, int64_t lo, int64_t hi, int64_t a, int64_t b,
                                                         int n, int c0, int cc) {
    __m512 t[DV_ROWS][4];
    for (int i = 0; i < n; i++)
        for (int c = 0; c < cc; c++) t[i][c] = _mm512_setzero_ps();
    for (int64_t p = a; p < b; p += 2) {
        const uint16_t *v0 = p >= lo ? v + cache_row(bt, kh, nb, bs, p) * HEAD_DIM : zero_row;
        const uint16_t *v1 = p + 1 < hi ? v + cache_row(bt, kh, nb, bs, p + 1) * HEAD_DIM : zero_row;
        __m512bh vp[4];
        for (int c = 0; c < cc; c += 2) { /* 32 of D: two 16-lane vectors of pairs */
            const __m512i x0 = _mm512_loadu_si512(v0 + 16 * (c0 + c)), x1 = _mm512_loadu_si512(v1 + 16 * (c0 + c));
            vp[c] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
            vp[c + 1] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
        }
        for (int i = 0; i < n; i++) {
            uint32_t w2;
            memcpy(&w2, P + i * W + p - base, 4);
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)w2);
            for (int c = 0; c < cc; c++) t[i][c] = _mm512_dpbf16_ps(t[i][c], vp[c], w);
        }
    }
    /* back in D's order: of 32 of D, lanes 0..3 of the low vector, 0..3 of the high one, 4..7 of each, ... */
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < n; i++)
        for (int c = 0; c < cc; c += 2) {
            float *o = acc + i * HEAD_DIM + 16 * (c0 + c);
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(t[i][c], i0, t[i][c + 1]));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(t[i][c], i1, t[i][c + 1]));
        }
}

