/* The bf16 linear on CPUs with AVX2 and FMA where oneDNN has no bf16 GEMM (AMD EPYC before Zen 4, Intel before
 * Skylake-SP), at every row count: y = x W^T (+ bias), fp32 sums rounded to bf16 once (round to nearest even).
 * Checked against thin_linear_ref (kernels/cpu_gemm.py).
 *
 * Every output is one fp32 FMA chain along K, in K's order, from zero, then the bias: whatever the row count, the
 * thread count, the rows beside it, or whether the weight was packed. So a prompt's last row gets the same logits
 * from a prefill of 300 rows, a prefix-cache hit's 5 or a decode's 1, and a greedy request the same tokens streamed
 * or whole. (MKL's fp32 GEMM, which ran here first, picks its blocking per shape: the same request answered
 * differently after a prefix-cache hit.)
 *
 *   x   [M, K] bf16, row stride ldx; widened once per call into xf [M, K] fp32
 *   w   [N, K] bf16 (the parameter), or pw: the same packed by pack() into panels of 16 columns, [NP][K][16],
 *       NP = ceil(N / 16), zeros past N; word j of a panel's K step holds column j (low half), column j + 8 (high)
 *   y   [M, N] bf16; bias [N] fp32 or NULL
 * A tile is up to 6 rows x one panel: 12 accumulators of 8 columns (12 of the 16 AVX registers). Per K step one
 * 32-byte load of the panel, widened to fp32 in two ops (a 16-bit shift: columns 0-7; a mask: 8-15), 6 broadcasts
 * of x, 12 FMAs. Without pw, each panel is packed from w into a thread's buffer as it is reached (the same sums).
 * Each thread takes a contiguous range of panels, and walks the rows in chunks whose xf stays in L2 (unpacked: all
 * rows a panel, which it packs once).
 * Threads: OpenMP, in torch's libgomp. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "this CPU has no AVX2 and FMA (kernels/cpu_gemm.py builds this only where /proc/cpuinfo lists both)"
#endif

#define MR 6              /* rows a tile */
#define NR 16             /* columns a panel */
#define CHUNK (256 << 10) /* bytes of xf a row chunk holds: half an L2 */

/* 8 rows of 8 bf16 -> 8 columns: t[q] = (r[0][q], ..., r[7][q]) */
static inline void transpose8(const __m128i r[8], __m128i t[8]) {
    __m128i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            b[4 * i + 2 * h] = _mm_unpacklo_epi32(a[4 * i + h], a[4 * i + h + 2]);
            b[4 * i + 2 * h + 1] = _mm_unpackhi_epi32(a[4 * i + h], a[4 * i + h + 2]);
        }
    for (int q = 0; q < 4; q++) {
        t[2 * q] = _mm_unpacklo_epi64(b[q], b[q + 4]);
        t[2 * q + 1] = _mm_unpackhi_epi64(b[q], b[q + 4]);
    }
}

/* panel p of w [n, k] -> out [k][16] in the packed order: 8 K steps at a time, two 8 x 8 transposes, then
 * columns j and j + 8 interleaved (the scalar loop for K's last k % 8 and the columns past n) */
static void pack_panel(const uint16_t *w, int64_t n, int64_t k, int64_t p, uint16_t *out) {
    const int64_t c0 = p * NR, whole = c0 + NR <= n ? k & ~(int64_t)7 : 0;
    for (int64_t kk = 0; kk < whole; kk += 8) {
        __m128i r[NR], lo[8], hi[8];
        for (int j = 0; j < NR; j++) r[j] = _mm_loadu_si128((const __m128i *)(w + (c0 + j) * k + kk));
        transpose8(r, lo);
        transpose8(r + 8, hi);
        for (int q = 0; q < 8; q++) {
            _mm_storeu_si128((__m128i *)(out + (kk + q) * NR), _mm_unpacklo_epi16(lo[q], hi[q]));
            _mm_storeu_si128((__m128i *)(out + (kk + q) * NR + 8), _mm_unpackhi_epi16(lo[q], hi[q]));
        }
    }
    for (int j = 0; j < NR; j++) {
        const int slot = j < 8 ? 2 * j : 2 * (j - 8) + 1;
        for (int64_t kk = whole; kk < k; kk++) out[kk * NR + slot] = c0 + j < n ? w[(c0 + j) * k + kk] : 0;
    }
}

/* pw [ceil(n / 16) * k * 16] bf16 */
void pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *pw, int nthreads) {
    const int64_t np = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < np; p++) pack_panel(w, n, k, p, pw + p * k * NR);
}

/* 16 fp32 (columns 0-7 in lo, 8-15 in hi) + bias -> bf16, round to nearest even; NaN stays NaN (quiet bit set) */
static inline __m256i to_bf16x16(__m256 lo, __m256 hi) {
    const __m256i one = _mm256_set1_epi32(1), round = _mm256_set1_epi32(0x7fff), abs = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x400000);
    __m256i r[2];
    const __m256 v[2] = {lo, hi};
    for (int i = 0; i < 2; i++) {
        const __m256i u = _mm256_castps_si256(v[i]);
        const __m256i rne = _mm256_add_epi32(_mm256_add_epi32(u, round), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
        r[i] = _mm256_srli_epi32(_mm256_blendv_epi8(rne, _mm256_or_si256(u, quiet), nan), 16);
    }
    /* packus interleaves 128-bit lanes: [lo0-3 hi0-3 | lo4-7 hi4-7] -> columns 0-15 */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8);
}

#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

/* R rows of xf (stride k) x one packed panel pb -> y (stride n), C <= 16 columns of it; R constant once inlined */
static inline __attribute__((always_inline)) void tile(const float *xf, int64_t k, int R, const uint16_t *pb,
                                                       uint16_t *y, int64_t n, int C, const float *bias) {
#define DECL(r) __m256 s##r##a = _mm256_setzero_ps(), s##r##b = _mm256_setzero_ps();
    ROWS(DECL)
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(pb + kk * NR));
        const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), b1 = _mm256_castsi256_ps(_mm256_and_si256(v, high));
#define STEP(r)                                                                                                       \
    if (R > r) {                                                                                                      \
        const __m256 a = _mm256_broadcast_ss(xf + r * k + kk);                                                        \
        s##r##a = _mm256_fmadd_ps(a, b0, s##r##a);                                                                    \
        s##r##b = _mm256_fmadd_ps(a, b1, s##r##b);                                                                    \
    }
        ROWS(STEP)
    }
    __m256 ba = _mm256_setzero_ps(), bb = _mm256_setzero_ps();
    if (bias != NULL && C == NR) {
        ba = _mm256_loadu_ps(bias);
        bb = _mm256_loadu_ps(bias + 8);
    } else if (bias != NULL) { /* the last panel's C < 16 columns: no read past the bias */
        float t[NR] = {0};
        memcpy(t, bias, (size_t)C * sizeof(float));
        ba = _mm256_loadu_ps(t);
        bb = _mm256_loadu_ps(t + 8);
    }
#define OUT(r)                                                                                                        \
    if (R > r) {                                                                                                      \
        const __m256i h = to_bf16x16(_mm256_add_ps(s##r##a, ba), _mm256_add_ps(s##r##b, bb));                         \
        if (C == NR) {                                                                                                \
            _mm256_storeu_si256((__m256i *)(y + r * n), h);                                                           \
        } else {                                                                                                      \
            uint16_t t[NR];                                                                                           \
            _mm256_storeu_si256((__m256i *)t, h);                                                                     \
            memcpy(y + r * n, t, (size_t)C * 2);                                                                      \
        }                                                                                                             \
    }
    ROWS(OUT)
}

#define CASE(R)                                                                                                       \
    case R:                                                                                                           \
        tile(xf, k, R, pb, y, n, C, bias);                                                                            \
        break;

static void tile_any(const float *xf, int64_t k, int R, const uint16_t *pb, uint16_t *y, int64_t n, int C,
                     const float *bias) {
    switch (R) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) }
}

/* 0 on success, 1 when a temporary (x's fp32 copy, a thread's panel) could not be allocated */
int gemm(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *w, const uint16_t *pw, int64_t n,
         uint16_t *y, const float *bias, int nthreads) {
    if (m == 0 || n == 0) return 0;
    float *xf = aligned_alloc(64, (((size_t)(m * k) * sizeof(float) + 63) & ~(size_t)63) + 64);
    if (xf == NULL) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * k > (1 << 16))
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < k; j++) {
            const uint32_t u = (uint32_t)x[i * ldx + j] << 16;
            memcpy(xf + i * k + j, &u, 4);
        }
    const int64_t np = (n + NR - 1) / NR;
    /* packing a panel on the fly costs about what 6 rows of it do: then one pass over all rows a panel */
    int64_t chunk = pw == NULL || k == 0 ? m : CHUNK / (k * (int64_t)sizeof(float)) / MR * MR;
    if (chunk < MR) chunk = MR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = np * t / nt, p1 = np * (t + 1) / nt;
        uint16_t *buf = pw == NULL && p0 < p1 ? aligned_alloc(64, (size_t)(k * NR * 2 + 63) & ~(size_t)63) : NULL;
        if (pw == NULL && p0 < p1 && buf == NULL) {
            failed = 1;
        } else {
            for (int64_t m0 = 0; m0 < m; m0 += chunk) {
                const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
                for (int64_t p = p0; p < p1; p++) {
                    const uint16_t *pb = pw != NULL ? pw + p * k * NR : buf;
                    if (pw == NULL) pack_panel(w, n, k, p, buf);
                    const int C = n - p * NR < NR ? (int)(n - p * NR) : NR;
                    for (int64_t r0 = m0; r0 < m1; r0 += MR)
                        tile_any(xf + r0 * k, k, m1 - r0 < MR ? (int)(m1 - r0) : MR, pb, y + r0 * n + p * NR, n, C,
                                 bias != NULL ? bias + p * NR : NULL);
                }
            }
        }
        free(buf);
    }
    free(xf);
    return failed;
}
