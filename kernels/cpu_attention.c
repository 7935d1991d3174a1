/* Decode attention over the paged KV cache on CPU, reading each block where it lies (no gather): the CPU's
 * answer to kernels/paged_attention.py, checked against paged_attention_ref. Built at run time by
 * kernels/cpu_attention.py with -DHEAD_DIM=<d> (a multiple of 8) and -march=native.
 *
 * One query token per sequence. A work item is one (sequence, kv head) pair, whose `rep` query heads share each
 * K/V row while it is in L1. Two passes over the context: scores (q . k, soft-cap, sliding window), then fp32
 * exp(s - max) and the weighted sum of V rows, normalized once at the end. fp32 arithmetic throughout; the cache
 * is converted a row at a time (GCC/Clang vector extensions: 8 lanes, whatever the ISA).
 *
 *   q        [G, H, D] fp32, already multiplied by the softmax scale
 *   k, v     [KVH, NB, BS, D] in `cache_dtype`: 0 fp32, 1 bf16, 2 fp16, 3 fp8 e4m3fn times a per-tensor scale
 *   tables   [G, table_stride] int32 block ids; ctx [G] int32 context length, the new token included
 *   sinks    [H] fp32 or NULL: GPT-OSS's per-head logit that joins each softmax's denominator with no value
 *   out      [G, H, D] fp32
 * Threads: OpenMP, `nthreads` of them, in the process's libgomp.so.1, which torch has already loaded: one pool. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NV (HEAD_DIM / 8)
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
typedef _Float16 f8 __attribute__((vector_size(16)));

static float fp8_lut[256];

static float fp8_e4m3fn(uint8_t x) { /* bias 7, no infinities; 0x7f and 0xff are NaN */
    int e = (x >> 3) & 15, m = x & 7;
    float v = (e == 15 && m == 7) ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
    return (x >> 7) ? -v : v;
}

void init_tables(void) {
    for (int i = 0; i < 256; i++) fp8_lut[i] = fp8_e4m3fn((uint8_t)i);
}

/* dst[0:NV] = cache row `idx` as fp32 (times `scale` for fp8) */
static inline void load_row(const void *base, int64_t idx, int dtype, float scale, v8 *dst) {
    if (dtype == 1) { /* bf16 is the top half of an fp32 */
        const uint16_t *p = (const uint16_t *)base + idx * HEAD_DIM;
        for (int c = 0; c < NV; c++) {
            h8 raw;
            memcpy(&raw, p + 8 * c, 16);
            u8 w = __builtin_convertvector(raw, u8) << 16;
            memcpy(&dst[c], &w, 32);
        }
    } else if (dtype == 0) {
        memcpy(dst, (const float *)base + idx * HEAD_DIM, HEAD_DIM * sizeof(float));
    } else if (dtype == 2) {
        const _Float16 *p = (const _Float16 *)base + idx * HEAD_DIM;
        for (int c = 0; c < NV; c++) {
            f8 raw;
            memcpy(&raw, p + 8 * c, 16);
            dst[c] = __builtin_convertvector(raw, v8);
        }
    } else {
        const uint8_t *p = (const uint8_t *)base + idx * HEAD_DIM;
        float *f = (float *)dst;
        for (int i = 0; i < HEAD_DIM; i++) f[i] = fp8_lut[p[i]] * scale;
    }
}

typedef int32_t i8 __attribute__((vector_size(32)));

/* exp(x) for x <= 0 (the softmax's s - max), 8 at a time: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6
 * Taylor polynomial (relative error < 2e-7, as expf's few ulp), 2^n through the exponent bits. Below -87 it gives
 * 2^-126-ish instead of a denormal: a weight that small is 0 beside the max's 1. */
static inline v8 exp_v8(v8 x) {
    const v8 lo = (v8){0} - 87.0f, log2e = (v8){0} + 1.44269504f, round = (v8){0} + 12582912.0f;
    const i8 under = x < lo; /* lanes: -1 where true; C has no vector ?: */
    x = (v8)(((i8)x & ~under) | ((i8)lo & under)); /* same-size vector casts reinterpret the bits */
    v8 n = (x * log2e + round) - round; /* round to nearest */
    v8 r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f; /* ln2 in two parts */
    v8 p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    i8 e = (__builtin_convertvector(n, i8) + 127) << 23;
    v8 scale;
    memcpy(&scale, &e, 32);
    return p * scale;
}

static inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* The horizontal sums of a[0], ..., a[7] in one vector: three rounds of pairwise shuffles and adds (a transpose-and-add),
 * instead of eight horizontal sums. Lane j sums a[j]'s lanes as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). */
static inline v8 hsum8(const v8 *a) {
    v8 t[4], u[2];
    for (int i = 0; i < 4; i++) /* lanes: rows 2i, 2i + 1 alternate, each the sum of two neighbours */
        t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++) /* lanes: rows 4i..4i+3 twice (their first halves, then their second) */
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

int paged_decode(const float *q, const void *k, const void *v, const int32_t *tables, int64_t table_stride,
                 const int32_t *ctx, float *out, int64_t g_count, int64_t h, int64_t kvh, int64_t nb, int64_t bs,
                 int cache_dtype, float k_scale, float v_scale, int64_t window, float softcap, const float *sinks,
                 int nthreads) {
    const int64_t rep = h / kvh;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t g = 0; g < g_count; g++) {
        for (int64_t kh = 0; kh < kvh; kh++) {
            const int64_t n = ctx[g], start = (window > 0 && n > window) ? n - window : 0, len = n - start;
            const int64_t lenp = (len + 7) & ~(int64_t)7; /* a score row padded to whole vectors */
            const int32_t *bt = tables + g * table_stride;
            int64_t base = 0; /* row of position p in the cache: base + p, within p's block */
            /* q [rep, NV] | acc [rep, NV] | rows [8, NV] | scores [rep, lenp] | sums [rep] */
            const size_t bytes = sizeof(v8) * (2 * rep + 8) * NV + sizeof(float) * rep * (lenp + 1);
            v8 *qv = aligned_alloc(32, (bytes + 31) / 32 * 32); /* C11: a multiple of the alignment */
            if (qv == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            v8 *acc = qv + rep * NV, *row = acc + rep * NV;
            float *s = (float *)(row + 8 * NV), *sums = s + rep * lenp;
            memcpy(qv, q + (g * h + kh * rep) * HEAD_DIM, sizeof(v8) * rep * NV);
            for (int64_t p0 = start, next = start; p0 < n; p0 += 8) { /* pass 1: scores, 8 rows at a time */
                const int64_t cnt = n - p0 < 8 ? n - p0 : 8;
                for (int64_t j = 0; j < cnt; j++) { /* the 8 rows as fp32, converted once for the rep heads */
                    const int64_t p = p0 + j;
                    if (p == next) { /* a block's first row: one division per block, not per row */
                        base = (kh * nb + bt[p / bs]) * bs + p % bs - p;
                        next = p - p % bs + bs;
                    }
                    load_row(k, base + p, cache_dtype, k_scale, row + j * NV);
                }
                if (cnt < 8) memset(row + cnt * NV, 0, sizeof(v8) * (8 - cnt) * NV); /* scores past n: unused */
                for (int64_t r = 0; r < rep; r++) {
                    const v8 *qr = qv + r * NV;
                    v8 a[8];
                    for (int j = 0; j < 8; j++) a[j] = qr[0] * row[j * NV];
                    for (int c = 1; c < NV; c++) /* eight independent chains */
                        for (int j = 0; j < 8; j++) a[j] += qr[c] * row[j * NV + c];
                    v8 x = hsum8(a);
                    if (softcap > 0.0f)
                        for (int j = 0; j < 8; j++) x[j] = softcap * tanhf(x[j] / softcap);
                    memcpy(s + r * lenp + p0 - start, &x, 32); /* lenp is a multiple of 8: past len is padding */
                }
            }
            for (int64_t r = 0; r < rep; r++) { /* exp(s - max) in place, 8 at a time (scores padded to 8) */
                float *sr = s + r * lenp, m = -INFINITY;
                for (int64_t j = 0; j < len; j++) m = sr[j] > m ? sr[j] : m;
                const float sink = sinks ? sinks[kh * rep + r] : -INFINITY;
                m = sink > m ? sink : m;
                for (int64_t j = len; j < lenp; j++) sr[j] = -INFINITY; /* exp gives ~0: not summed below */
                v8 sum = (v8){0};
                for (int64_t j = 0; j < lenp; j += 8) {
                    v8 x;
                    memcpy(&x, sr + j, 32);
                    x = exp_v8(x - m);
                    memcpy(sr + j, &x, 32);
                    sum += j + 8 <= len ? x : (v8){0};
                }
                float total = hsum(sum);
                for (int64_t j = len & ~(int64_t)7; j < len; j++) total += sr[j]; /* the partial last 8 */
                if (sinks) total += expf(sink - m);
                sums[r] = total;
                for (int c = 0; c < NV; c++) acc[r * NV + c] = (v8){0};
            }
            for (int64_t p = start, next = start; p < n; p++) { /* pass 2: acc[r] += w[r, p] * v_p */
                if (p == next) {
                    base = (kh * nb + bt[p / bs]) * bs + p % bs - p;
                    next = p - p % bs + bs;
                }
                load_row(v, base + p, cache_dtype, v_scale, row);
                for (int64_t r = 0; r < rep; r++) {
                    const float w = s[r * lenp + p - start];
                    for (int c = 0; c < NV; c++) acc[r * NV + c] += w * row[c];
                }
            }
            float *og = out + (g * h + kh * rep) * HEAD_DIM;
            for (int64_t r = 0; r < rep; r++) {
                const float inv = 1.0f / sums[r];
                for (int c = 0; c < NV; c++) {
                    v8 o = acc[r * NV + c] * inv;
                    memcpy(og + r * HEAD_DIM + 8 * c, &o, 32);
                }
            }
            free(qv);
        }
    }
    return failed;
}
