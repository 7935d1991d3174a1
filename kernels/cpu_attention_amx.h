/* kernels/cpu_attention.c's passes 1 and 3 on AMX tiles where the CPU has them (Intel Sapphire Rapids and later), for
 * a bf16 q on a bf16 cache: the products of cpu_attention_dot.h as tile GEMMs, 16 query rows at a time, positions 32
 * at a time from a multiple of 32, so a row meets the same chunks whatever item it is in.
 *
 *   pass 1  S [16 rows, 32 positions] = Q [16, D] K^T: A tiles are q's rows (32 of D each), B tiles the K rows as
 *           transpose16 leaves them (row i: the 16 positions' pair i, which is AMX's B layout), times the softmax
 *           scale, soft-capped, to the scores of the rows that exist.
 *   pass 3  acc [16 rows, D] += P [16, 32 positions] V: A is the rows' bf16 weights, B the 16 position pairs of V
 *           interleaved as pv_dot interleaves them (so D sits in vpunpck's order until amx_unpermute), four tiles
 *           of 16 of D at a time, each sum loaded from acc and stored back per chunk (exact).
 * Each output is one tile chain over its own row's operands: the rows beside it (a prefill's, or none: a decode's
 * padding) do not change its bits, and a position outside a row's own has weight 0 (a signed zero added). */
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

static int amx_ok; /* Linux gave this process AMX's tile data (init_tables asks) */

static void amx_request(void) { amx_ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

static inline void amx_config(void) { /* every tile 16 rows x 64 bytes */
    amx_cfg cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* pass 1 for one group: qg [16, HEAD_DIM] bf16 (rows n.. are zeros) against kt (two transposed tiles of 16
 * positions); rows i < n get their 32 scores, times `scale`, soft-capped, at dst + i * W */
static inline void scores_amx(const uint16_t *qg, const __m512i *kt, int64_t n, float scale, float softcap,
                              float *dst, int64_t W) {
    float t[2][256] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < HEAD_DIM / 32; c++) { /* 32 of D */
        _tile_loadd(2, qg + 32 * c, HEAD_DIM * 2);
        _tile_loadd(3, kt + 16 * c, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(4, kt + HEAD_DIM / 2 + 16 * c, 64);
        _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, t[0], 64);
    _tile_stored(1, t[1], 64);
    for (int64_t i = 0; i < n; i++)
        for (int g = 0; g < 2; g++) scale_cap16(_mm512_load_ps(t[g] + 16 * i), scale, softcap, dst + i * W + 16 * g);
}

/* V's positions [p0, p0 + 32) as pass 3's B tiles: vb [HEAD_DIM / 16][16 pairs][16 of D][2], tile 2c the low and
 * 2c + 1 the high vpunpck half of D 32c .. 32c + 31 (zero_row outside [lo, hi)) */
static inline void vnni32(const uint16_t *v, const int32_t *bt, int64_t kh, int64_t nb, int64_t bs, int64_t lo,
                          int64_t hi, int64_t p0, uint16_t *vb) {
    for (int q = 0; q < 16; q++) {
        const int64_t p = p0 + 2 * q;
        const uint16_t *v0 = p >= lo && p < hi ? v + cache_row(bt, kh, nb, bs, p) * HEAD_DIM : zero_row;
        const uint16_t *v1 = p + 1 >= lo && p + 1 < hi ? v + cache_row(bt, kh, nb, bs, p + 1) * HEAD_DIM : zero_row;
        for (int c = 0; c < HEAD_DIM / 32; c++) {
            const __m512i x0 = _mm512_loadu_si512(v0 + 32 * c), x1 = _mm512_loadu_si512(v1 + 32 * c);
            _mm512_store_si512(vb + ((2 * c) * 16 + q) * 32, _mm512_unpacklo_epi16(x0, x1));
            _mm512_store_si512(vb + ((2 * c + 1) * 16 + q) * 32, _mm512_unpackhi_epi16(x0, x1));
        }
    }
}

/* pass 3 for one group and chunk: acc [16, HEAD_DIM] fp32 += pg [16, 32] bf16 (row stride W) x vb */
static inline void pv_amx(float *acc, const uint16_t *pg, int64_t W, const uint16_t *vb) {
    _tile_loadd(4, pg, W * 2);
    for (int c0 = 0; c0 < HEAD_DIM / 16; c0 += 4) { /* 64 of D: four sums, B tiles 5 and 6 in turn */
        const int cc = HEAD_DIM / 16 - c0 < 4 ? HEAD_DIM / 16 - c0 : 4;
        float *a = acc + 16 * c0;
        const uint16_t *b = vb + c0 * 512;
        _tile_loadd(0, a, HEAD_DIM * 4);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_stored(0, a, HEAD_DIM * 4);
        _tile_loadd(1, a + 16, HEAD_DIM * 4);
        _tile_loadd(6, b + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_stored(1, a + 16, HEAD_DIM * 4);
        if (cc > 2) {
            _tile_loadd(2, a + 32, HEAD_DIM * 4);
            _tile_loadd(5, b + 1024, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_stored(2, a + 32, HEAD_DIM * 4);
            _tile_loadd(3, a + 48, HEAD_DIM * 4);
            _tile_loadd(6, b + 1536, 64);
            _tile_dpbf16ps(3, 4, 6);
            _tile_stored(3, a + 48, HEAD_DIM * 4);
        }
    }
}

/* Whether rows [r0, r0 + n) of an item see no position of the chunk [p0, p0 + 32): row r is token tok[r], which
 * sees [its window's start, e0 + tok[r]) (e0: the item's first token's end, run()'s END_T(0)) */
static inline int amx_skip(const int32_t *tok, int64_t r0, int64_t n, int64_t e0, int64_t window, int64_t p0) {
    const int64_t s = e0 + tok[r0], start = window > 0 && s > window ? s - window : 0;
    return e0 + tok[r0 + n - 1] <= p0 || start >= p0 + 32;
}

/* pass 1 over one chunk of 32 positions at p0, for every group of 16 rows that sees one of them: q [Rp, HEAD_DIM]
 * bf16, scores to dst + r * W (dst: the chunk's first score of row 0) */
static void pass1_amx(const uint16_t *q, const __m512i *kt, int64_t R, const int32_t *tok, int64_t e0, int64_t window,
                      int64_t p0, float scale, float softcap, float *dst, int64_t W) {
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
        const int64_t n = R - r0 < 16 ? R - r0 : 16;
        if (!amx_skip(tok, r0, n, e0, window, p0)) scores_amx(q + r0 * HEAD_DIM, kt, n, scale, softcap, dst + r0 * W, W);
    }
}

static inline void amx_unpermute(float *row);

/* pass 3 of an item, positions [lo8, lo8 + W) in chunks of 32 (lo8 a multiple of 32): acc [Rp, HEAD_DIM] fp32 (zeros
 * in) += pw [Rp, W] x V, a group skipped where its weights are all 0; then acc's rows in D's order and the tiles
 * released. `ahead`: V's rows asked for AHEAD positions early (a decode's were, with its K, in pass 1). */
static void pass3_amx(float *acc, const uint16_t *pw, int64_t W, int64_t lo8, const void *v, const int32_t *bt,
                      int64_t kh, int64_t nb, int64_t bs, int64_t lo, int64_t hi, int64_t R, const int32_t *tok,
                      int64_t e0, int64_t window, int ahead, uint16_t *vb) {
    for (int64_t p0 = lo8; p0 < lo8 + W; p0 += 32) {
        for (int64_t p = p0 + AHEAD; p < p0 + AHEAD + 32 && p < hi && ahead; p += 8)
            prefetch_rows(v, bt, kh, nb, bs, p, hi, 2);
        vnni32((const uint16_t *)v, bt, kh, nb, bs, lo, hi, p0, vb);
        for (int64_t r0 = 0; r0 < R; r0 += 16) {
            const int64_t n = R - r0 < 16 ? R - r0 : 16;
            if (!amx_skip(tok, r0, n, e0, window, p0)) pv_amx(acc + r0 * HEAD_DIM, pw + r0 * W + p0 - lo8, W, vb);
        }
    }
    for (int64_t r = 0; r < R; r++) amx_unpermute(acc + r * HEAD_DIM);
    _tile_release();
}

/* acc's row back in D's order from vpunpck's (as pv_dot stores its sums) */
static inline void amx_unpermute(float *row) {
    const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int c = 0; c < HEAD_DIM / 32; c++) {
        const __m512 lo = _mm512_loadu_ps(row + 32 * c), hi = _mm512_loadu_ps(row + 32 * c + 16);
        _mm512_storeu_ps(row + 32 * c, _mm512_permutex2var_ps(lo, i0, hi));
        _mm512_storeu_ps(row + 32 * c + 16, _mm512_permutex2var_ps(lo, i1, hi));
    }
}
