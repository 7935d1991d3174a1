/* The bf16 linear on CPUs with AVX2 and FMA where oneDNN has no bf16 GEMM (AMD EPYC before Zen 4, Intel before
 * Skylake-SP), at every row count: y = x W^T (+ bias), fp32 sums rounded to bf16 once (round to nearest even).
 * Checked against thin_linear_ref (kernels/cpu_gemm.py).
 *
 * It reads the weight as the model holds it, and sums every output in one order whatever the row count, the
 * thread count or the rows beside it: 8 lanes along K, each lane in K's order, then a fixed tree, then the bias.
 * So a prompt's last row gets the same logits from a prefill of 300 rows, a prefix-cache hit's 5 or a decode's 1,
 * and a greedy request the same tokens streamed or whole. (MKL's fp32 GEMM, which ran here before, picks its
 * blocking per shape: the same request answered differently after a prefix-cache hit.)
 *
 *   x   [M, K] bf16, row stride ldx; widened once per call into xf [M, KP] fp32 (KP: K rounded up to 8, zeros)
 *   w   [N, K] bf16, contiguous rows (the parameter itself: no packed copy)
 *   y   [M, N] bf16; bias [N] fp32 or NULL
 * A tile is 4 rows x 3 weight rows: 12 sums of 8 lanes (12 of the 16 AVX registers); per 8-wide K step 4 row loads,
 * 3 weight loads widened by a 16-bit shift, 12 FMAs. Each thread takes a contiguous range of 3-column groups
 * (whose weight rows stay in L1 across a chunk), and walks the rows in chunks whose xf stays in L2.
 * Threads: OpenMP, in torch's libgomp. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "this CPU has no AVX2 and FMA (kernels/cpu_gemm.py builds this only where /proc/cpuinfo lists both)"
#endif

#define TR 4              /* rows a tile */
#define TC 3              /* weight rows (output columns) a tile */
#define CHUNK (256 << 10) /* bytes of xf a row chunk holds: half an L2 */
#define BC 48             /* columns widened at a time (K = 576: 110 KB of fp32) */
#ifndef WIDEN_ROWS
#define WIDEN_ROWS 32 /* rows from which widening the weight first pays */
#endif

static inline __m256 widen(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum(__m256 v) { /* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): the one tree */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static inline uint16_t to_bf16(float f) { /* round to nearest even; NaN stays NaN (its quiet bit set) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* R rows of xf (stride kp) x C weight rows -> y (stride n); R, C and WIDE constants once inlined. The weight rows
 * are bf16 at stride k (WIDE 0), or already widened to fp32 at stride kp, zeros past k (WIDE 1): the same sums. */
static inline __attribute__((always_inline)) void tile(const float *xf, int64_t kp, int R, const void *w, int64_t k,
                                                       int C, int WIDE, uint16_t *y, int64_t n, const float *bias) {
    const uint16_t *wb = w;
    const float *wf = w;
    __m256 s[TR][TC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) s[r][c] = _mm256_setzero_ps();
    const int64_t whole = WIDE ? kp : k & ~(int64_t)7;
    for (int64_t kk = 0; kk < whole; kk += 8) {
        __m256 b[TC];
        for (int c = 0; c < C; c++) {
            b[c] = WIDE ? _mm256_loadu_ps(wf + c * kp + kk) : widen(wb + c * k + kk);
            __asm__("" : "+x"(b[c])); /* held, not reloaded by each FMA: 7 loads a step, not 16 */
        }
        for (int r = 0; r < R; r++) {
            __m256 a = _mm256_loadu_ps(xf + r * kp + kk);
            __asm__("" : "+x"(a)); /* likewise */
            for (int c = 0; c < C; c++) s[r][c] = _mm256_fmadd_ps(a, b[c], s[r][c]);
        }
    }
    if (!WIDE && whole < k) { /* K's last k % 8: the weight's tail copied beside zeros (xf is zero there already) */
        __m256 b[TC];
        for (int c = 0; c < C; c++) {
            uint16_t t[8] = {0};
            memcpy(t, wb + c * k + whole, (size_t)(k - whole) * 2);
            b[c] = widen(t);
        }
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_loadu_ps(xf + r * kp + whole);
            for (int c = 0; c < C; c++) s[r][c] = _mm256_fmadd_ps(a, b[c], s[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * n + c] = to_bf16(hsum(s[r][c]) + (bias ? bias[c] : 0.0f));
}

#define CASE(R, C)                                                                                                    \
    case (R) * 8 + (C):                                                                                               \
        if (wide)                                                                                                     \
            tile(xf, kp, R, (const float *)w + c0 * kp, k, C, 1, y, n, bias);                                         \
        else                                                                                                          \
            tile(xf, kp, R, (const uint16_t *)w + c0 * k, k, C, 0, y, n, bias);                                       \
        break;

/* the tile at rows xf.., columns c0.. of w (bf16 [N, k], or fp32 [.., kp] rows from c0's block when wide) */
static void tile_any(const float *xf, int64_t kp, int R, const void *w, int wide, int64_t c0, int64_t k, int C,
                     uint16_t *y, int64_t n, const float *bias) {
    switch (R * 8 + C) {
        CASE(4, 3) CASE(4, 2) CASE(4, 1) CASE(3, 3) CASE(3, 2) CASE(3, 1)
        CASE(2, 3) CASE(2, 2) CASE(2, 1) CASE(1, 3) CASE(1, 2) CASE(1, 1)
    }
}

/* One thread's columns [c0, c1) at every row. Few rows read the bf16 weight in place, a group of TC columns
 * at a time, the rows in chunks whose xf stays in L2. Many rows first widen a block of BC columns into wf
 * ([BC, kp] fp32, in L2), then sweep it with each 4 rows' xf held in L1: the FMAs no longer wait on the shifts. */
static void columns(const float *xf, int64_t m, int64_t kp, const uint16_t *w, int64_t k, int64_t c0, int64_t c1,
                    uint16_t *y, int64_t n, const float *bias, float *wf) {
    if (wf == NULL) {
        int64_t chunk = CHUNK / (kp * (int64_t)sizeof(float)) / TR * TR;
        if (chunk < TR) chunk = TR;
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            for (int64_t c = c0; c < c1; c += TC)
                for (int64_t r0 = m0; r0 < m1; r0 += TR)
                    tile_any(xf + r0 * kp, kp, m1 - r0 < TR ? (int)(m1 - r0) : TR, w, 0, c, k,
                             c1 - c < TC ? (int)(c1 - c) : TC, y + r0 * n + c, n, bias ? bias + c : NULL);
        }
        return;
    }
    for (int64_t b0 = c0; b0 < c1; b0 += BC) {
        const int64_t b1 = b0 + BC < c1 ? b0 + BC : c1;
        for (int64_t c = b0; c < b1; c++) {
            float *row = wf + (c - b0) * kp;
            for (int64_t j = 0; j < k; j++) {
                const uint32_t u = (uint32_t)w[c * k + j] << 16;
                memcpy(row + j, &u, 4);
            }
            for (int64_t j = k; j < kp; j++) row[j] = 0.0f;
        }
        for (int64_t r0 = 0; r0 < m; r0 += TR)
            for (int64_t c = b0; c < b1; c += TC)
                tile_any(xf + r0 * kp, kp, m - r0 < TR ? (int)(m - r0) : TR, wf - b0 * kp, 1, c, k,
                         b1 - c < TC ? (int)(b1 - c) : TC, y + r0 * n + c, n, bias ? bias + c : NULL);
    }
}

/* 0 on success, 1 when a temporary (x's fp32 copy, a thread's widened weights) could not be allocated */
int gemm(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *w, int64_t n, uint16_t *y,
         const float *bias, int nthreads) {
    if (m == 0 || n == 0) return 0;
    const int64_t kp = (k + 7) & ~(int64_t)7;
    float *xf = aligned_alloc(64, (((size_t)(m * kp) * sizeof(float) + 63) & ~(size_t)63) + 64); /* no split loads */
    if (xf == NULL) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * k > (1 << 16))
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = 0; j < k; j++) {
            const uint32_t u = (uint32_t)x[i * ldx + j] << 16;
            memcpy(xf + i * kp + j, &u, 4);
        }
        for (int64_t j = k; j < kp; j++) xf[i * kp + j] = 0.0f;
    }
    const int64_t groups = (n + TC - 1) / TC;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t c0 = groups * t / nt * TC, c1 = groups * (t + 1) / nt * TC < n ? groups * (t + 1) / nt * TC : n;
        float *wf = m >= WIDEN_ROWS ? aligned_alloc(64, (size_t)(BC * kp) * sizeof(float)) : NULL;
        if (m >= WIDEN_ROWS && wf == NULL)
            failed = 1;
        else if (c0 < c1)
            columns(xf, m, kp, w, k, c0, c1, y, n, bias, wf);
        free(wf);
    }
    free(xf);
    return failed;
}
