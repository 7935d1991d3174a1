/* The bf16 linear on CPUs with AVX512-BF16, at every row count: y = x W^T (+ bias), fp32 sums, rounded to bf16 once
 * (round to nearest even, as oneDNN). Each output is one chain over K in order whatever M is, so a token's sums do
 * not depend on the step it came in (a decode's few rows or a prefill chunk's thousands). Checked against
 * thin_linear_ref; timed against oneDNN's packed GEMM by bench/cpu_gemm.py. Two builds of one layout: AMX tiles
 * where the CPU has them (Intel Sapphire Rapids and later), else AVX512-BF16 dot products (AMD Zen 4 and later):
 * AMX's B tile is, 64 bytes at a time, the operand of vdpbf16ps.
 *
 *   w        [N, K] bf16, packed once (pack) into AMX's B tiles, each tile's K pairs side by side:
 *   wp       [N / 16][K / 32][16 (k pairs)][16 (n)][2] bf16: one N block's K tiles are 1 KiB each, in a row, so a
 *            thread streams its blocks front to back (block nb's k pair p is the 64 bytes at (nb K / 2 + p) 32)
 *   x        [M, K] bf16, rows contiguous; y [M, N] bf16; bias [N] fp32 or NULL
 * gemm_any reads the packed copy, or w itself where there is none yet, packing each panel as it goes; gemm is
 * gemm_any on the packed copy. Threads: OpenMP, in torch's libgomp. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_bf16.h" /* the fused SiLU-and-mul's epilogue: silu_at, ld, st, as kernels/cpu_ops.c rounds */

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

/* one row of a fused gate and up block (each 16 columns, rounded to bf16 as the plain GEMM stores them) -> y's 16
 * columns bf16(silu[gate] * up), as silu_and_mul_lut: the bits of silu_and_mul_ref */
static inline void put_silu(__m256i gate, __m256i up, const uint16_t *silu, uint16_t *y) {
    uint16_t g[16] __attribute__((aligned(32))), u[16] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)g, gate);
    _mm256_store_si256((__m256i *)u, up);
    st(y, silu_at(g, silu) * ld(u));
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

enum { MC_BYTES = 1 << 20, STREAM_BYTES = 4 << 20 }; /* the rows of x a thread's column groups pass over at a time: half of L2 */
enum { PF_ROWS = 32 }; /* the next group's panel prefetched only past this many rows (gemm_core) */

/* rows [q0, q1) of a 32-row step's sums ([2 halves][2 blocks][16 rows][16] fp32) + bias -> y's rows r0 + q (n
 * apart), nb blocks of 16 columns, a row's columns in one store (a whole cache line where nb is 2), or with `silu`
 * the 16 columns silu(block 0) * block 1; rows at m and past are not x's */
static inline void put_rows(const float *sums, int64_t q0, int64_t q1, int64_t r0, int64_t m, int nb, __m512 bv0,
                            __m512 bv1, uint16_t *y, int64_t n, int stream, const uint16_t *silu) {
    for (int64_t q = q0; q < q1 && r0 + q < m; q++) {
        const float *s = sums + (q / 16) * 512 + (q % 16) * 16;
        const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(s), bv0));
        if (silu)
            put_silu(lo, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(s + 256), bv1)), silu,
                     y + (r0 + q) * n);
        else if (nb > 1) {
            const __m256i hi = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(s + 256), bv1));
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            if (stream)
                _mm512_stream_si512((__m512i *)(y + (r0 + q) * n), v);
            else
                _mm512_storeu_si512(y + (r0 + q) * n, v);
        } else
            _mm256_storeu_si256((__m256i *)(y + (r0 + q) * n), lo);
    }
}

/* The blocks a group works on: b (K / 32 tiles of 1 KiB each, in a row) and, where nb is 2, b1 (the next block, or
 * with `silu` the up block of b's gate block), their biases (NULL: none); the next group's blocks, asked for into L2
 * during this one (pf_lines of 64 bytes: a block's from pf, then from pf1). */
typedef struct {
    const uint16_t *b, *b1;
    const float *bias, *bias1;
    const char *pf, *pf1;
    int64_t pf_lines;
} group_t;

/* y rows [m0, m1) x one group's nb (1 or 2) column blocks, 32 rows at a time: C tiles 0-3 = A tiles 4, 5 (16 rows
 * each) x B tiles 6, 7, over K's tiles in order. Every output is its own chain over K whatever the rows and columns
 * beside it, so a row's bits do not depend on the step it came in. A step's sums are rounded and stored to y (rows n
 * apart) a few rows per K step of the next one: done after the tiles, that work left the tiles idle for 40 % of the
 * time at K 576 (the instruction has a long latency and leaves the other ports free). */
static void rows_x_group(const uint16_t *x, const uint16_t *tail, int64_t full, int64_t m0, int64_t m1, int64_t m,
                         int64_t k, const group_t *gr, int nb, uint16_t *y, int64_t n, int stream,
                         const uint16_t *silu) {
    const int64_t kt = k / 32, steps = (m1 - m0 + 31) / 32, pf_lines = gr->pf_lines, split = kt * 16;
    /* the next group's panel asked for into L2 at an even rate over this group's K steps */
    const int64_t per_kb = (pf_lines + steps * kt - 1) / (steps * kt), rows_kb = (32 + kt - 1) / kt;
    int64_t line = 0, prev = -1; /* prev: the step whose sums wait to be stored (its first row), or -1 */
    float sums[4 * 256] __attribute__((aligned(64)));
    const uint16_t *b = gr->b, *b1 = gr->b1;
    const __m512 bv0 = gr->bias ? _mm512_loadu_ps(gr->bias) : _mm512_setzero_ps();
    const __m512 bv1 = gr->bias1 && nb > 1 ? _mm512_loadu_ps(gr->bias1) : _mm512_setzero_ps();
    for (int64_t r0 = m0; r0 < m1; r0 += 32) {
        const int two = r0 + 16 < m1;
        const uint16_t *a0 = r0 < full ? x + r0 * k : tail, *a1 = r0 + 16 < full ? x + (r0 + 16) * k : tail;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kt; kb++) {
            for (int64_t e = line + per_kb < pf_lines ? line + per_kb : pf_lines; line < e; line++)
                _mm_prefetch(line < split ? gr->pf + line * 64 : gr->pf1 + (line - split) * 64,
                             _MM_HINT_T1);
            _tile_loadd(6, b + kb * 512, 64);
            _tile_loadd(4, a0 + kb * 32, k * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(5, a1 + kb * 32, k * 2);
                _tile_dpbf16ps(2, 5, 6);
            }
            if (nb > 1) {
                _tile_loadd(7, b1 + kb * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
            if (prev >= 0 && kb * rows_kb < 32) /* (the last K steps may have no row left: 32 is not a multiple) */
                put_rows(sums, kb * rows_kb, (kb + 1) * rows_kb < 32 ? (kb + 1) * rows_kb : 32, prev, m1, nb, bv0, bv1,
                         y, n, stream, silu);
        }
        _tile_stored(0, sums, 64);
        if (nb > 1) _tile_stored(1, sums + 256, 64);
        if (two) {
            _tile_stored(2, sums + 512, 64);
            if (nb > 1) _tile_stored(3, sums + 768, 64);
        }
        prev = r0;
    }
    put_rows(sums, 0, 32, prev, m1, nb, bv0, bv1, y, n, stream, silu);
}

/* y = x W^T (+ bias) at any row count, from the packed copy wp, or where it is NULL from w [N, K] itself, each group's
 * panel packed into a buffer of the thread's as it is reached: the same sums either way. Each thread takes an even
 * share of the column blocks, in groups of 2; rows go in chunks whose A (chunk x K bf16) stays in L2 while the
 * thread's groups pass over it, each group's panel read once per chunk (all rows at once up to a chunk: a decode).
 * A last partial 16-row group of x is copied into a zero-padded buffer first (an A tile always reads 16 rows).
 * With `silu` (gemm_silu): W is [gate; up], each group a gate block and its up block, y [M, N / 2] their
 * silu(gate) * up. 0 on success, 1 when a buffer could not be allocated. */
static int gemm_core(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wp, const uint16_t *w, int64_t n,
                     uint16_t *y, const float *bias, const uint16_t *silu, int nthreads) {
    const int64_t kt = k / 32, nbs = n / 16, full = m / 16 * 16, blk = kt * 512; /* a block's bf16 elements */
    const int64_t half = nbs / 2, units = silu ? half : nbs, per = silu ? 1 : 2, ny = silu ? n / 2 : n;
    const int64_t chunk = (MC_BYTES / (k * 2)) / 32 * 32 > 32 ? (MC_BYTES / (k * 2)) / 32 * 32 : 32;
    uint16_t *tail = NULL; /* rows full..m-1 of x, then zeros: [16, K] */
    /* a y past L2 goes to memory either way: stored past the caches, without reading each line in first, where a
     * group's row is a whole aligned line (its pair of blocks starts 64-byte aligned, as do y's rows: checked per
     * group, since a thread's share may start at an odd block) */
    const int stream = !silu && m * n * 2 > STREAM_BYTES && (n * 2) % 64 == 0;
    int failed = 0;
    if (m == 0) return 0;
    if (full < m) {
        tail = calloc(16 * k, sizeof(uint16_t));
        if (tail == NULL) return 1;
        memcpy(tail, x + full * k, (m - full) * k * sizeof(uint16_t));
    }
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t g1 = units * (id + 1) / nt;
        uint16_t *buf = wp ? NULL : aligned_alloc(64, 2 * blk * sizeof(uint16_t));
        tile_config cfg = {0};
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        failed = !wp && !buf;
        for (int64_t m0 = 0; m0 < m && !failed; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            for (int64_t g = units * id / nt; g < g1; g += per) { /* units: column blocks, or with silu gate blocks */
                const int64_t nu = g1 - g < per ? g1 - g : per, next = g1 - g - nu < per ? g1 - g - nu : per;
                const int nb = silu ? 2 : (int)nu;
                const int64_t b1 = silu ? g + half : g + 1; /* the group's second block */
                if (!wp) {
                    pack_block(w, k, g, buf);
                    if (nb > 1) pack_block(w, k, b1, buf + blk);
                }
                group_t gr = {wp ? wp + g * blk : buf, wp ? wp + b1 * blk : buf + blk, bias ? bias + g * 16 : NULL,
                              bias ? bias + b1 * 16 : NULL, NULL, NULL, 0};
                /* the next group (blocks g + 2, g + 3, or the gate and up blocks after these) asked for into L2
                 * past PF_ROWS rows only: at fewer, a group is over before the requests help, the thread's blocks
                 * are a front-to-back stream the L2's own prefetcher follows, and ours only compete with its (a
                 * decode step's 121 GEMMs in model order 1.03-1.12x faster without them at 1-32 rows; at 128 rows
                 * 0.82x: docs/decisions.md) */
                if (wp && next && m1 - m0 > PF_ROWS) {
                    gr.pf = (const char *)(wp + (g + nu) * blk);
                    gr.pf1 = (const char *)(wp + (silu ? g + nu + half : g + nu + 1) * blk);
                    gr.pf_lines = (silu ? 2 : next) * kt * 16;
                }
                rows_x_group(x, tail, full, m0, m1, m, k, &gr, nb, y + g * 16, ny, stream &&
                             (uintptr_t)(y + g * 16) % 64 == 0, silu);
            }
        }
        if (stream) _mm_sfence(); /* the streamed rows visible before the region's barrier lets y be read */
        _tile_release();
        free(buf);
    }
    free(tail);
    return failed;
}

#else /* AVX512-BF16 alone */

int amx_init(void) { return 0; }

enum { RT = 6, NT = 4 }; /* a tile: 6 rows x 4 blocks of 16 columns = 24 zmm sums, 4 B rows, 1 broadcast A pair */

/* y rows [0, R) (n apart) x blocks [0, NB): sums over the K pairs in order (one chain per output, whatever M is), +
 * bias. Blocks j < NB / 2 are b's j-th, the others bu's (j - NB / 2)-th, their biases bias's and bias_u's: with
 * `silu` the gate blocks and their up blocks, y's NB / 2 blocks silu(gate) * up, else one panel (bu = b + NB / 2
 * blocks). pf, pfu: the next panel, split as NT blocks are, whose blocks [pj0, pj1) this tile prefetches */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t k, const uint16_t *b,
                                                       const uint16_t *bu, uint16_t *y, int64_t n, const float *bias,
                                                       const float *bias_u, const uint16_t *pf, const uint16_t *pfu,
                                                       int pj0, int pj1, const uint16_t *silu, const int R,
                                                       const int NB) {
    const int64_t kp = k / 2;
    const uint16_t *bp[NT], *pp[NT];
    for (int j = 0; j < NB; j++) bp[j] = j < NB / 2 ? b + j * kp * 32 : bu + (j - NB / 2) * kp * 32;
    for (int j = 0; j < NT; j++) pp[j] = pf == NULL ? NULL : j < NT / 2 ? pf + j * kp * 32 : pfu + (j - NT / 2) * kp * 32;
    __m512 acc[RT][NT];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp; p++) {
        __m512bh bv[NT];
        for (int j = 0; j < NB; j++) bv[j] = (__m512bh)_mm512_loadu_si512(bp[j] + p * 32);
        if (pf)
            if (pj1 - pj0 == NB) /* the whole panel (one row tile): unrolled, as NB is a constant */
                for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(pp[j] + p * 32), _MM_HINT_T1);
            else /* this tile's share of its blocks (a runtime loop here cost a 1-row call 5-10 %) */
                for (int j = pj0; j < pj1; j++) _mm_prefetch((const char *)(pp[j] + p * 32), _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + r * k + 2 * p));
            for (int j = 0; j < NB; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, bv[j]);
        }
    }
    for (int j = 0; j < NB; j++) {
        const __m512 bias_j = !bias ? _mm512_setzero_ps()
                                    : _mm512_loadu_ps(j < NB / 2 ? bias + 16 * j : bias_u + 16 * (j - NB / 2));
        for (int r = 0; r < R; r++) {
            const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], bias_j));
            if (!silu)
                _mm256_storeu_si256((__m256i *)(y + r * n + 16 * j), v);
            else if (j >= NB / 2) /* the up block of gate block j - NB / 2, whose bf16 sums y holds by now */
                put_silu(_mm256_loadu_si256((const __m256i *)(y + r * n + 16 * (j - NB / 2))), v, silu,
                         y + r * n + 16 * (j - NB / 2));
            else
                _mm256_storeu_si256((__m256i *)(y + r * n + 16 * j), v);
        }
    }
}

#define TILE_ARGS x, k, b, bu, y, n, bias, bias_u, pf, pfu, pj0, pj1, silu
#define TILE_R(NB)                                                                                                     \
    static void tile_##NB(const uint16_t *x, int64_t k, const uint16_t *b, const uint16_t *bu, uint16_t *y, int64_t n, \
                          const float *bias, const float *bias_u, const uint16_t *pf, const uint16_t *pfu, int pj0,    \
                          int pj1, const uint16_t *silu, int R) {                                                      \
        switch (R) { /* constant R and NB: the sums stay in registers */                                             \
        case 1: tile(TILE_ARGS, 1, NB); break;                                                                         \
        case 2: tile(TILE_ARGS, 2, NB); break;                                                                         \
        case 3: tile(TILE_ARGS, 3, NB); break;                                                                         \
        case 4: tile(TILE_ARGS, 4, NB); break;                                                                         \
        case 5: tile(TILE_ARGS, 5, NB); break;                                                                         \
        default: tile(TILE_ARGS, 6, NB);                                                                               \
        }                                                                                                              \
    }
TILE_R(1)
TILE_R(2)
TILE_R(3)
TILE_R(4)

/* y = x W^T (+ bias) from the packed copy wp, or where it is NULL from w [N, K] itself, each group's panel packed
 * into a buffer of the thread's as it is reached: the same sums either way (a server's first steps, before its
 * copies are packed, give what its later ones give). With `silu` (gemm_silu): W is [gate; up], y [M, N / 2] their
 * silu(gate) * up, each group NT / 2 gate blocks and their up blocks. 0 on success, 1 when a thread's buffer could
 * not be allocated */
static int gemm_core(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wp, const uint16_t *w, int64_t n,
                     uint16_t *y, const float *bias, const uint16_t *silu, int nthreads) {
    const int64_t kp = k / 2, nbs = n / 16, blk = kp * 32, panel = NT * blk, tiles = (m + RT - 1) / RT;
    const int64_t half = nbs / 2, units = silu ? half : nbs, per = silu ? NT / 2 : NT, ny = silu ? n / 2 : n;
    int failed = 0;
    if (m == 0) return 0; /* nothing to pack a panel for */
    /* each thread takes an even share of the column blocks (576 columns: 18 and 18, not 5 groups of 4 and 4), in
     * groups of 4; per group every row tile re-reads the group's panel (4 blocks x K x 32 bytes: 72-192 KiB for K
     * 576-1536) from L2, so the weight comes from memory once */
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t u1 = units * (id + 1) / nt;
        uint16_t *buf = wp ? NULL : aligned_alloc(64, panel * sizeof(uint16_t));
        failed = !wp && !buf;
        for (int64_t g0 = units * id / nt; g0 < u1 && !failed; g0 += per) { /* units: blocks, or gate blocks */
            const int64_t nu = u1 - g0 < per ? u1 - g0 : per, nb = silu ? 2 * nu : nu;
            const int64_t up0 = silu ? g0 + half : g0 + nb / 2; /* the block of the panel's second half */
            for (int64_t j = 0; j < nb && !wp; j++) pack_block(w, k, j < nb / 2 ? g0 + j : up0 + j - nb / 2, buf + j * blk);
            const uint16_t *b = wp ? wp + g0 * blk : buf, *bu = wp ? wp + up0 * blk : buf + nb / 2 * blk;
            const float *bg = bias ? bias + g0 * 16 : NULL, *bgu = bias ? bias + up0 * 16 : NULL;
            /* the next group's panel: its first NT / 2 blocks and its second (contiguous, or with silu the up blocks) */
            const uint16_t *pf0 = wp && g0 + per < u1 ? wp + (g0 + per) * blk : NULL;
            const uint16_t *pfu = pf0 ? wp + (silu ? g0 + per + half : g0 + per + NT / 2) * blk : NULL;
            /* row tiles as even as they go (8 rows: 4 + 4, not 6 + 2): a short tile pays a whole panel pass */
            for (int64_t t = 0, m0 = 0; t < tiles; t++) {
                const int R = (int)((m - m0) / (tiles - t) + ((m - m0) % (tiles - t) != 0));
                /* the next group's packed panel comes from memory while this one's row tiles compute from L2, its
                 * blocks asked for a share in each of the first (up to) NT tiles. All in one tile (the second), as
                 * before, the prefetches came in a burst the core's misses in flight could not hold, and 8-24 rows
                 * ran up to 1.1-1.3x slower (python -m bench.cpu_gemm --against REV) */
                const int64_t ts = tiles < NT ? tiles : NT;
                const uint16_t *pf = t < ts ? pf0 : NULL;
                const int pj0 = (int)(t * NT / ts), pj1 = (int)((t + 1) * NT / ts);
                const uint16_t *xt = x + m0 * k;
                uint16_t *yt = y + m0 * ny + g0 * 16;
                switch (nb) { /* a thread's last group may be short */
                case 4: tile_4(xt, k, b, bu, yt, ny, bg, bgu, pf, pfu, pj0, pj1, silu, R); break;
                case 3: tile_3(xt, k, b, bu, yt, ny, bg, bgu, pf, pfu, pj0, pj1, silu, R); break;
                case 2: tile_2(xt, k, b, bu, yt, ny, bg, bgu, pf, pfu, pj0, pj1, silu, R); break;
                default: tile_1(xt, k, b, bu, yt, ny, bg, bgu, pf, pfu, pj0, pj1, silu, R);
                }
                m0 += R;
            }
        }
        free(buf);
    }
    return failed;
}
#endif

int gemm_any(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wp, const uint16_t *w, int64_t n, uint16_t *y,
             const float *bias, int nthreads) {
    return gemm_core(x, m, k, wp, w, n, y, bias, NULL, nthreads);
}

int gemm(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wp, int64_t n, uint16_t *y, const float *bias,
         int nthreads) {
    return gemm_core(x, m, k, wp, NULL, n, y, bias, NULL, nthreads);
}

/* y [M, N / 2] = bf16(silu(gate) * up) for [gate | up] = x W^T (+ bias) as gemm_any rounds it, W = [Wgate; Wup]
 * (N / 16 even): silu_and_mul_lut's bits over gemm_any's, in one pass (the [M, N] product is never stored). silu:
 * kernels/cpu_ops.py's table. */
int gemm_silu(const uint16_t *x, int64_t m, int64_t k, const uint16_t *wp, const uint16_t *w, int64_t n, uint16_t *y,
              const float *bias, const uint16_t *silu, int nthreads) {
    return gemm_core(x, m, k, wp, w, n, y, bias, silu, nthreads);
}
