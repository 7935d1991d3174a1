/* A CPU layer's add + RMSNorm and rotary embedding in bf16, fused, rounding where their torch references round
 * (kernels/rmsnorm.py add_rms_norm_ref, rms_norm_ref; kernels/rotary.py rotate_ref): one pass over memory where a
 * reference makes 5-9 torch ops, each a dispatch and a pass. fp32 arithmetic, 16 lanes (GCC / Clang vector extensions: one AVX-512 register, or two AVX2 ones).
 * Called through kernels/cpu_ops.py.
 *
 *   add_rms_norm: x, res [rows, n] -> res_out = bf16(x + res); out = bf16(w * bf16(res_out * rsqrt(mean(res_out^2)
 *                 + eps))); res NULL: a plain RMSNorm of x (res_out unused)
 *   silu_and_mul: x [rows, 2 * inter] = [gate | up] -> out = bf16(bf16(gate / (1 + exp(-gate))) * up), as
 *                 F.silu(gate) * up rounds (silu_and_mul_ref); exp is a polynomial's (exp16), which gave torch's
 *                 bits at every bf16 gate (tests/kernels/test_cpu_ops.py)
 * Rows go to OpenMP threads only past PAR_MIN elements: a decode step's few rows cost less than waking them. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float f16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));
typedef float f8v __attribute__((vector_size(32)));

#define PAR_MIN (1 << 15)

static inline f16v ld(const uint16_t *p) { /* 16 bf16 -> fp32: the top halves */
    h16v h;
    memcpy(&h, p, 32);
    u16v u = __builtin_convertvector(h, u16v) << 16;
    f16v f;
    memcpy(&f, &u, 64);
    return f;
}

static inline h16v to_bf16(f16v f) { /* round to nearest even, as torch's casts; a NaN stays a (quiet) NaN */
    u16v u;
    memcpy(&u, &f, 64);
    /* lanes: all ones where NaN (|u| past inf's bits: the difference's sign). Not a vector compare: on AVX2, GCC
     * compared these 16-lane vectors element by element, which made the whole op several times slower */
    const u16v nan = (u16v)(((i16v){0} + 0x7f800000 - (i16v)(u & 0x7fffffffu)) >> 31);
    const u16v r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | ((u >> 16 | 0x40u) & nan);
    return __builtin_convertvector(r, h16v);
}

static inline f16v round_bf16(f16v f) { /* to_bf16's value, kept in fp32 lanes (no narrowing and widening) */
    u16v u;
    memcpy(&u, &f, 64);
    const u16v nan = (u16v)(((i16v){0} + 0x7f800000 - (i16v)(u & 0x7fffffffu)) >> 31);
    const u16v r = (((u + 0x7fffu + ((u >> 16) & 1u)) & ~nan) | ((u | 0x400000u) & nan)) & 0xffff0000u;
    memcpy(&f, &r, 64);
    return f;
}

static inline void st(uint16_t *p, f16v f) {
    h16v h = to_bf16(f);
    memcpy(p, &h, 32);
}

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

/* exp(x) 16 at a time: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error
 * about 2e-7, a few ulp), times 2^(n - 1) * 2 through the exponent bits (n - 1 fits one for n = 128). x is clamped
 * to [-87, 88.8]: above 88.72 the result is inf, as expf's; at -87 and below it is 0 where expf's is a tiny normal
 * or denormal (1 + it is 1 either way, the only use here). */
static inline f16v exp16(f16v x) {
    /* lanes: -1 below -87 / above 88.8, from the differences' signs: a 16-lane float compare went lane by lane on
     * AVX2, as the unsigned one in to_bf16 (a NaN lane gets some finite x: the gate it came from makes the output
     * NaN anyway) */
    const f16v dlo = x + 87.0f, dhi = 88.8f - x;
    i16v lo, hi, xi;
    memcpy(&lo, &dlo, 64);
    memcpy(&hi, &dhi, 64);
    lo >>= 31;
    hi >>= 31;
    memcpy(&xi, &x, 64);
    const f16v flo = (f16v){0} - 87.0f, fhi = (f16v){0} + 88.8f;
    i16v ilo, ihi;
    memcpy(&ilo, &flo, 64);
    memcpy(&ihi, &fhi, 64);
    xi = (xi & ~(lo | hi)) | (ilo & lo) | (ihi & hi);
    memcpy(&x, &xi, 64);
    const f16v n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const f16v r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f; /* ln2 in two parts */
    const f16v p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    const i16v e = (__builtin_convertvector(n, i16v) + 126) << 23;
    f16v scale;
    memcpy(&scale, &e, 64);
    return p * scale * 2.0f;
}

void silu_and_mul(const uint16_t *x, int64_t rows, int64_t inter, int64_t sx, uint16_t *out, int nthreads) {
    /* x rows sx elements apart, out [rows, inter] contiguous; inter a multiple of 16 */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * inter >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * sx, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t j = 0; j < inter; j += 16) {
            const f16v gv = ld(g + j);
            st(o + j, round_bf16(gv / (1.0f + exp16(-gv))) * ld(u + j));
        }
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
