/* A bf16 linear for few rows on CPUs with AVX2 and FMA but no bf16 GEMM in oneDNN (AMD EPYC before Zen 4, Intel
 * before Skylake-SP): y = x W^T (+ bias), fp32 sums, rounded to bf16 once (round to nearest even). There the bf16
 * linears otherwise run MKL's fp32 GEMM on fp32 copies (engine/layers/dense.py), which reads 4 bytes a weight where
 * a decode step is bound by reading them; this reads the bf16 copy, 2. Checked against thin_linear_ref.
 *
 *   w    [N, K] bf16, packed once (pack) into [N / 8][K][8]: one 8-column block's K rows in a row, so a thread
 *        streams its blocks front to back
 *   x    [M, K] bf16, rows contiguous; widened to fp32 once per call
 *   y    [M, N] bf16; bias [N] fp32 or NULL
 * Each thread takes whole 16-column blocks (two 8-lane sums a row), and up to 4 rows at a time: 8 sums, 2 weight
 * vectors and a broadcast row value, 11 of the 16 AVX registers. A bf16 widens to fp32 by a 16-bit shift.
 * Threads: OpenMP, in torch's libgomp. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "this CPU has no AVX2 and FMA (kernels/cpu_gemm.py builds this only where /proc/cpuinfo lists both)"
#endif

void pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *wp) {
    for (int64_t nb = 0; nb < n / 8; nb++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < 8; j++) wp[(nb * k + kk) * 8 + j] = w[(nb * 8 + j) * k + kk];
}

static inline __m256 widen(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m128i to_bf16(__m256 v) { /* round to nearest even; NaN stays NaN (its quiet bit set) */
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* rows r0 .. r0 + R - 1 of 16 columns from nb2 * 16; R a constant once inlined */
static inline __attribute__((always_inline)) void block(const float *xf, int64_t r0, int R, int64_t k,
                                                        const uint16_t *w0, int64_t n, int64_t c0, uint16_t *y,
                                                        const float *bias) {
    const uint16_t *w1 = w0 + k * 8;
    __m256 s[4][2];
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 b0 = widen(w0 + kk * 8), b1 = widen(w1 + kk * 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(xf + (r0 + r) * k + kk);
            s[r][0] = _mm256_fmadd_ps(a, b0, s[r][0]);
            s[r][1] = _mm256_fmadd_ps(a, b1, s[r][1]);
        }
    }
    const __m256 c0v = bias ? _mm256_loadu_ps(bias + c0) : _mm256_setzero_ps();
    const __m256 c1v = bias ? _mm256_loadu_ps(bias + c0 + 8) : _mm256_setzero_ps();
    for (int r = 0; r < R; r++) {
        _mm_storeu_si128((__m128i *)(y + (r0 + r) * n + c0), to_bf16(_mm256_add_ps(s[r][0], c0v)));
        _mm_storeu_si128((__m128i *)(y + (r0 + r) * n + c0 + 8), to_bf16(_mm256_add_ps(s[r][1], c1v)));
    }
}

/* 0 on success, 1 when x's fp32 copy could not be allocated */
int gemm(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wp, int64_t n, uint16_t *y, const float *bias,
         int nthreads) {
    float *xf = malloc(m * k * sizeof(float));
    if (xf == NULL) return 1;
    for (int64_t i = 0; i < m * k; i++) {
        const union { uint32_t u; float f; } v = {.u = (uint32_t)x[i] << 16};
        xf[i] = v.f;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t nb2 = 0; nb2 < n / 16; nb2++) {
        const uint16_t *w0 = wp + nb2 * 2 * k * 8;
        int64_t r0 = 0;
        for (; r0 + 4 <= m; r0 += 4) block(xf, r0, 4, k, w0, n, nb2 * 16, y, bias);
        switch (m - r0) {
        case 3: block(xf, r0, 3, k, w0, n, nb2 * 16, y, bias); break;
        case 2: block(xf, r0, 2, k, w0, n, nb2 * 16, y, bias); break;
        case 1: block(xf, r0, 1, k, w0, n, nb2 * 16, y, bias); break;
        }
    }
    free(xf);
    return 0;
}
