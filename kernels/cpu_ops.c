/* A CPU layer's add + RMSNorm and rotary embedding in bf16, fused, rounding where their torch references round
 * (kernels/rmsnorm.py add_rms_norm_ref, rms_norm_ref; kernels/rotary.py rotate_ref): one pass over memory where a
 * reference makes 5-9 torch ops, each a dispatch and a pass. fp32 arithmetic, 16 lanes (GCC / Clang vector extensions: one AVX-512 register, or two AVX2 ones).
 * Called through kernels/cpu_ops.py.
 *
 *   add_rms_norm: x, res [rows, n] -> res_out = bf16(x + res); out = bf16(w * bf16(res_out * rsqrt(mean(res_out^2)
 *                 + eps))); res NULL: a plain RMSNorm of x (res_out unused); res_out may be res (each element is
 *                 read before it is written: kernels/cpu_layers.c updates the residual in place)
 *   silu_and_mul_lut: x [rows, 2 * inter] = [gate | up] -> out = bf16(silu[gate] * up), as F.silu(gate) * up
 *                 rounds (silu_and_mul_ref): silu a table of torch's own F.silu at every bf16 gate, read by gathers
 * Rows go to OpenMP threads only past PAR_MIN elements: a decode step's few rows cost less than waking them. */
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h" /* f16v, ld, to_bf16, round_bf16, st, silu_at */

#define PAR_MIN (1 << 15)

static inline void st_exact(uint16_t *p, f16v f) { /* f already bf16 values (round_bf16's): their top halves */
    u16v u;
    memcpy(&u, &f, 64);
    h16v h = __builtin_convertvector(u >> 16, h16v);
    memcpy(p, &h, 32);
}

static inline float ld1(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float round1(float f) { /* via the vector path: one rounding rule for every element */
    f16v v = (f16v){0} + f;
    return round_bf16(v)[0];
}

static inline uint16_t bits1(float f) { /* f already a bf16 value: its top half */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

void add_rms_norm(const uint16_t *x, const uint16_t *res, const uint16_t *w, uint16_t *out, uint16_t *res_out,
                  int64_t rows, int64_t n, float eps, int nthreads) {
    const int64_t nv = n / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n, *rr = res ? res + r * n : NULL;
        uint16_t *o = out + r * n, *ro = res_out ? res_out + r * n : NULL;
        const uint16_t *s = res ? ro : xr; /* the normalized input, as bf16 */
        /* the sum of squares, 16 lanes as two halves: a 16-lane vector carried across iterations went through the
         * stack on AVX2 (GCC split it with scalar moves: 6 cycles an element, 37 us for a 32-row decode step) */
        f8v acc_lo = {0}, acc_hi = {0};
        float tail = 0.0f;
        for (int64_t j = 0; j < nv; j += 16) {
            f16v v = ld(xr + j);
            if (res) {
                v = round_bf16(v + ld(rr + j));
                st_exact(ro + j, v);
            }
            const f16v sq = v * v;
            acc_lo += __builtin_shufflevector(sq, sq, 0, 1, 2, 3, 4, 5, 6, 7);
            acc_hi += __builtin_shufflevector(sq, sq, 8, 9, 10, 11, 12, 13, 14, 15);
        }
        for (int64_t j = nv; j < n; j++) {
            float v = ld1(xr + j);
            if (res) {
                v = round1(v + ld1(rr + j));
                ro[j] = bits1(v);
            }
            tail += v * v;
        }
        float total = tail;
        for (int l = 0; l < 8; l++) total += acc_lo[l]; /* lanes 0..15 in order, as one 16-lane sum */
        for (int l = 0; l < 8; l++) total += acc_hi[l];
        const float inv = 1.0f / sqrtf(total / (float)n + eps);
        for (int64_t j = 0; j < nv; j += 16) st(o + j, ld(w + j) * round_bf16(ld(s + j) * inv));
        for (int64_t j = nv; j < n; j++) {
            o[j] = bits1(round1(ld1(w + j) * round1(ld1(s + j) * inv)));
        }
    }
}

void silu_and_mul_lut(const uint16_t *x, int64_t rows, int64_t inter, int64_t sx, const uint16_t *silu, uint16_t *out,
                      int nthreads) {
    /* x rows sx elements apart, out [rows, inter] contiguous; inter a multiple of 16. silu(gate) is a bf16 value and
     * so is up: their product is exact in fp32, rounded once to bf16, as torch rounds F.silu(gate) * up */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * inter >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * sx, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t j = 0; j < inter; j += 16) st(o + j, silu_at(g + j, silu) * ld(u + j));
    }
}

/* rotate_ref (kernels/rotary.py) in bf16: out = x * c + rotate_half(x) * s, each product and the sum rounded to
 * bf16 as torch rounds them (a bf16 product is exact in fp32, so this is bit for bit torch's).
 *   x   [rows, heads, D], rows `sr` and heads `sh` elements apart (q or k, views of the fused qkv)
 *   c, s [rows, D] (rotary_rows, `sc` elements a row); out [rows, heads, D] contiguous. D / 2 a multiple of 16. */
void rope(const uint16_t *x, int64_t rows, int64_t heads, int64_t sr, int64_t sh, const uint16_t *c,
          const uint16_t *s, int64_t sc, int64_t d, uint16_t *out, int nthreads) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * heads * d >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xr = x + r * sr + h * sh, *cr = c + r * sc, *sr_ = s + r * sc;
            uint16_t *o = out + (r * heads + h) * d;
            for (int64_t j = 0; j < half; j += 16) {
                const f16v x1 = ld(xr + j), x2 = ld(xr + half + j);
                st(o + j, round_bf16(x1 * ld(cr + j)) + round_bf16(-x2 * ld(sr_ + j)));
                st(o + half + j, round_bf16(x2 * ld(cr + half + j)) + round_bf16(x1 * ld(sr_ + half + j)));
            }
        }
}
