/* A bf16 linear for few rows on CPUs with AVX512-BF16: y = x W^T (+ bias), fp32 sums, rounded to bf16 once (round
 * to nearest even, as oneDNN). The CPU's answer to a decode step's GEMMs, which are weight-read-bound: oneDNN's packed
 * GEMM reads the weights at 5-9 GB/s at 1-32 rows on a 2-core Xeon VM, this at 9-16 (kernels/cpu_gemm.py,
 * bench/cpu_gemm.py). Checked against thin_linear_ref. Two builds of one layout: AMX tiles where the CPU has them
 * (Intel Sapphire Rapids and later), else AVX512-BF16 dot products (AMD Zen 4 and later): AMX's B tile is, 64 bytes
 * at a time, the operand of vdpbf16ps.
 *
 *   w        [N, K] bf16, packed once (pack) into AMX's B tiles, each tile's K pairs side by side:
 *   wp       [N / 16][K / 32][16 (k pairs)][16 (n)][2] bf16: one N block's K tiles are 1 KiB each, in a row, so a
 *            thread streams its blocks front to back (block nb's k pair p is the 64 bytes at (nb K / 2 + p) 32)
 *   x        [M, K] bf16, rows contiguous; y [M, N] bf16; bias [N] fp32 or NULL
 * gemm reads the packed copy; the dot build's gemm_any also reads w itself, packing each panel as it goes.
 * AMX: each thread takes whole N blocks. Per block, up to 64 rows at a time: four 16x16 fp32 sums (tiles 0-3), a B
 * tile (4) loaded once per K step and multiplied with up to four A tiles (5, 6). A last partial 16-row group of x is
 * copied into a zero-padded buffer first (an A tile always reads 16 rows). Threads: OpenMP, in torch's libgomp. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AVX512BF16__)
#error "this CPU has no AVX512-BF16 (kernels/cpu_gemm.py builds it only where /proc/cpuinfo lists avx512_bf16)"
#endif

/* column block nb of w [N, K] (its 16 rows) -> t [K / 2][16][2]: one block of the packed layout */
static void pack_block(const uint16_t *w, int64_t k, int64_t nb, uint16_t *t) {
    for (int j = 0; j < 16; j++) {
        const uint32_t *src = (const uint32_t *)(w + (nb * 16 + j) * k); /* its K pairs */
        uint32_t *dst = (uint32_t *)t + j;
        for (int64_t p = 0; p < k / 2; p++) dst[p * 16] = src[p];
    }
}

void pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *wp) {
    for (int64_t nb = 0; nb < n / 16; nb++) pack_block(w, k, nb, wp + nb * (k / 2) * 32);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out AMX's tile data per process on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA);
 * 0 on success. oneDNN asks too; asking twice is harmless. */
int amx_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

/* 0 on success, 1 when the tail buffer could not be allocated */
int gemm(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wp, int64_t n, uint16_t *y, const float *bias,
         int nthreads) {
    const int64_t kt = k / 32, nbs = n / 16, full = m / 16 * 16;
    uint16_t *tail = NULL; /* rows full..m-1 of x, then zeros: [16, K] */
    if (full < m) {
        tail = calloc(16 * k, sizeof(uint16_t));
        if (tail == NULL) return 1;
        memcpy(tail, x + full * k, (m - full) * k * sizeof(uint16_t));
    }
#pragma omp parallel num_threads(nthreads)
    {
        tile_config cfg = {0};
        cfg.palette = 1;
        for (int t = 0; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        float sums[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nbs; nb++) {
            const uint16_t *b = wp + nb * kt * 512;
            const __m512 bv = bias ? _mm512_loadu_ps(bias + nb * 16) : _mm512_setzero_ps();
            for (int64_t m0 = 0; m0 < m; m0 += 64) {
                const int64_t left = (m - m0 + 15) / 16, mt = left < 4 ? left : 4;
                /* A tile i: rows m0 + 16 i of x, or the tail buffer */
                const uint16_t *a[4];
                for (int i = 0; i < mt; i++) a[i] = m0 + 16 * i < full ? x + (m0 + 16 * i) * k : tail;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < kt; kb++) {
                    _tile_loadd(4, b + kb * 512, 64);
                    _tile_loadd(5, a[0] + kb * 32, k * 2);
                    _tile_dpbf16ps(0, 5, 4);
                    if (mt > 1) {
                        _tile_loadd(6, a[1] + kb * 32, k * 2);
                        _tile_dpbf16ps(1, 6, 4);
                    }
                    if (mt > 2) {
                        _tile_loadd(5, a[2] + kb * 32, k * 2);
                        _tile_dpbf16ps(2, 5, 4);
                    }
                    if (mt > 3) {
                        _tile_loadd(6, a[3] + kb * 32, k * 2);
                        _tile_dpbf16ps(3, 6, 4);
                    }
                }
                for (int i = 0; i < mt; i++) {
                    switch (i) { /* tile numbers are immediates */
                    case 0: _tile_stored(0, sums, 64); break;
                    case 1: _tile_stored(1, sums, 64); break;
                    case 2: _tile_stored(2, sums, 64); break;
                    default: _tile_stored(3, sums, 64);
                    }
                    for (int r = 0; r < 16 && m0 + 16 * i + r < m; r++) {
                        const __m512 v = _mm512_add_ps(_mm512_load_ps(sums + 16 * r), bv);
                        _mm256_storeu_si256((__m256i *)(y + (m0 + 16 * i + r) * n + nb * 16),
                                            (__m256i)_mm512_cvtneps_pbh(v));
                    }
                }
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}

#else /* AVX512-BF16 alone */

int amx_init(void) { return 0; }

enum { RT = 6, NT = 4 }; /* a tile: 6 rows x 4 blocks of 16 columns = 24 zmm sums, 4 B rows, 1 broadcast A pair */

/* y rows [0, R) x blocks [0, NB) of b: sums over the K pairs in order (one chain per output, whatever M is), + bias;
 * pf: the next panel, whose blocks [pj0, pj1) this tile prefetches */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t k, const uint16_t *b, uint16_t *y,
                                                       int64_t n, const float *bias, const uint16_t *pf, int pj0,
                                                       int pj1, const int R, const int NB) {
    const int64_t kp = k / 2;
    __m512 acc[RT][NT];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp; p++) {
        __m512bh bv[NT];
        for (int j = 0; j < NB; j++) bv[j] = (__m512bh)_mm512_loadu_si512(b + (j * kp + p) * 32);
        if (pf)
            if (pj1 - pj0 == NB) /* the whole panel (one row tile): unrolled, as NB is a constant */
                for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(pf + (j * kp + p) * 32), _MM_HINT_T1);
            else /* this tile's share of its blocks (a runtime loop here cost a 1-row call 5-10 %) */
                for (int j = pj0; j < pj1; j++) _mm_prefetch((const char *)(pf + (j * kp + p) * 32), _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + r * k + 2 * p));
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, bv[j]);
        }
    }
    for (int j = 0; j < NB; j++) {
        const __m512 bj = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++)
            _mm256_storeu_si256((__m256i *)(y + r * n + 16 * j), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], bj)));
    }
}

#define TILE_R(NB)                                                                                                     \
    static void tile_##NB(const uint16_t *x, int64_t k, const uint16_t *b, uint16_t *y, int64_t n, const float *bias, \
                          const uint16_t *pf, int pj0, int pj1, int R) {                                               \
        switch (R) { /* constant R and NB: the sums stay in registers */                                             \
        case 1: tile(x, k, b, y, n, bias, pf, pj0, pj1, 1, NB); break;                                                 \
        case 2: tile(x, k, b, y, n, bias, pf, pj0, pj1, 2, NB); break;                                                 \
        case 3: tile(x, k, b, y, n, bias, pf, pj0, pj1, 3, NB); break;                                                 \
        case 4: tile(x, k, b, y, n, bias, pf, pj0, pj1, 4, NB); break;                                                 \
        case 5: tile(x, k, b, y, n, bias, pf, pj0, pj1, 5, NB); break;                                                 \
        default: tile(x, k, b, y, n, bias, pf, pj0, pj1, 6, NB);                                                       \
        }                                                                                                              \
    }
TILE_R(1)
TILE_R(2)
TILE_R(3)
TILE_R(4)

/* y = x W^T (+ bias) from the packed copy wp, or where it is NULL from w [N, K] itself, each group's panel packed
 * into a buffer of the thread's as it is reached: the same sums either way (a server's first steps, before its
 * copies are packed, give what its later ones give). 0 on success, 1 when a thread's buffer could not be allocated */
int gemm_any(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wp, const uint16_t *w, int64_t n, uint16_t *y,
             const float *bias, int nthreads) {
    const int64_t nbs = n / 16, panel = NT * (k / 2) * 32, tiles = (m + RT - 1) / RT;
    int failed = 0;
    if (m == 0) return 0; /* nothing to pack a panel for */
    /* each thread takes an even share of the column blocks (576 columns: 18 and 18, not 5 groups of 4 and 4), in
     * groups of 4; per group every row tile re-reads the group's panel (4 blocks x K x 32 bytes: 72-192 KiB for K
     * 576-1536) from L2, so the weight comes from memory once */
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t b1 = nbs * (id + 1) / nt;
        uint16_t *buf = wp ? NULL : aligned_alloc(64, panel * sizeof(uint16_t));
        failed = !wp && !buf;
        for (int64_t g0 = nbs * id / nt; g0 < b1 && !failed; g0 += NT) {
            const int64_t nb = b1 - g0 < NT ? b1 - g0 : NT;
            for (int64_t j = 0; j < nb && !wp; j++) pack_block(w, k, g0 + j, buf + j * (k / 2) * 32);
            const uint16_t *b = wp ? wp + g0 * (k / 2) * 32 : buf;
            const float *bg = bias ? bias + g0 * 16 : NULL;
            /* row tiles as even as they go (8 rows: 4 + 4, not 6 + 2): a short tile pays a whole panel pass */
            for (int64_t t = 0, m0 = 0; t < tiles; t++) {
                const int R = (int)((m - m0) / (tiles - t) + ((m - m0) % (tiles - t) != 0));
                /* the next group's packed panel comes from memory while this one's row tiles compute from L2, its
                 * blocks asked for a share in each of the first (up to) NT tiles. All in one tile (the second), as
                 * before, the prefetches came in a burst the core's misses in flight could not hold, and 8-24 rows
                 * ran up to 1.1-1.3x slower (python -m bench.cpu_gemm --against REV) */
                const int64_t ts = tiles < NT ? tiles : NT;
                const uint16_t *pf = wp && t < ts && g0 + NT < b1 ? b + panel : NULL;
                const int pj0 = (int)(t * NT / ts), pj1 = (int)((t + 1) * NT / ts);
                uint16_t *yt = y + m0 * n + g0 * 16;
                switch (nb) { /* a thread's last group may be short */
                case 4: tile_4(x + m0 * k, k, b, yt, n, bg, pf, pj0, pj1, R); break;
                case 3: tile_3(x + m0 * k, k, b, yt, n, bg, pf, pj0, pj1, R); break;
                case 2: tile_2(x + m0 * k, k, b, yt, n, bg, pf, pj0, pj1, R); break;
                default: tile_1(x + m0 * k, k, b, yt, n, bg, pf, pj0, pj1, R);
                }
                m0 += R;
            }
        }
        free(buf);
    }
    return failed;
}

int gemm(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wp, int64_t n, uint16_t *y, const float *bias,
         int nthreads) {
    return gemm_any(x, m, k, wp, NULL, n, y, bias, nthreads);
}
#endif
