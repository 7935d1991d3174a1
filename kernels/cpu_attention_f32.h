/* kernels/cpu_attention.c's fp32 path (every CPU, every cache dtype): the cache's rows widened to fp32 (a copy all
 * rows of an item read, or for a decode's few rows on a bf16 cache each vector in registers as it is used), q . k
 * summed lane-wise in D's order then by hsum8's tree, the softmax in fp32, and the weighted sum of fp32 V rows in
 * the positions' order. 8-lane vectors (GCC / Clang vector extensions), whatever the ISA. */

/* acc + a * b, one rounding where the CPU has FMA, two where it has not, in every loop. Not left to the compiler:
 * GCC contracted `acc += a * b` into an FMA in some of a loop's unswitched copies and not in others (its avoid-fma
 * tuning for some -march=native targets), so a token's scores differed by an ulp between a prefill and a decode
 * (head_dim 72 with a soft cap; tests/kernels/test_cpu_attention.py) */
static inline v8 mac8(v8 acc, v8 a, v8 b) {
#ifdef __FMA__
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b; /* no FMA instruction: nothing to contract into */
#endif
}

/* x in every lane: a broadcast (`(v8){0} + x` is an add, -0 + 0 being +0) */
static inline v8 bcast8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* 8 bf16 (8 lanes of D) as fp32: bf16 is the top half of an fp32 */
static inline v8 widen8(const uint16_t *p) {
#ifdef __AVX2__ /* one vpmovzxwd to 8 lanes: GCC's convertvector splits it into two halves and a merge */
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    h8 raw;
    memcpy(&raw, p, 16);
    u8 w = __builtin_convertvector(raw, u8) << 16;
    v8 f;
    memcpy(&f, &w, 32);
    return f;
#endif
}

/* dst[0:NV] = cache row `idx` as fp32 (times `scale` for fp8) */
static inline void load_row(const void *base, int64_t idx, int dtype, float scale, v8 *dst) {
    if (dtype == 1) {
        const uint16_t *p = (const uint16_t *)base + idx * HEAD_DIM;
        for (int c = 0; c < NV; c++) dst[c] = widen8(p + 8 * c);
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

/* dst[0:NV] = a query row in `dtype` (0 fp32, 1 bf16, 2 fp16) times `scale`, in fp32 (as torch's q.float() * scale) */
static inline void load_q(const void *src, int dtype, float scale, v8 *dst) {
    if (dtype == 0) {
        memcpy(dst, src, HEAD_DIM * sizeof(float));
    } else {
        load_row(src, 0, dtype, 1.0f, dst);
    }
    for (int c = 0; c < NV; c++) dst[c] *= scale;
}

/* dst[0:HEAD_DIM] in `dtype` = x, rounded to nearest even; a NaN stays a (quiet) NaN */
static inline void store_row(void *dst, int dtype, const v8 *x) {
    if (dtype == 0) {
        memcpy(dst, x, HEAD_DIM * sizeof(float));
    } else if (dtype == 1) {
        for (int c = 0; c < NV; c++) {
            u8 u;
            memcpy(&u, &x[c], 32);
            /* NaN: |u| past inf's bits, from the difference's sign (AVX2 has no unsigned compare) */
            const u8 nan = (u8)(((i8){0} + 0x7f800000 - (i8)(u & 0x7fffffffu)) >> 31);
            const u8 r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | ((u >> 16 | 0x40u) & nan);
            const h8 hv = __builtin_convertvector(r, h8);
            memcpy((uint16_t *)dst + 8 * c, &hv, 16);
        }
    } else {
        for (int c = 0; c < NV; c++) {
            const f8 hv = __builtin_convertvector(x[c], f8);
            memcpy((_Float16 *)dst + 8 * c, &hv, 16);
        }
    }
}

/* exp(x) for x <= 0 (the softmax's s - max), 8 at a time: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6
 * Taylor polynomial (relative error < 2e-7, as expf's few ulp), 2^n through the exponent bits. Below -87 it gives
 * 2^-126-ish instead of a denormal: a weight that small is 0 beside the max's 1. */
static inline v8 exp_v8(v8 x) {
    const v8 lo = (v8){0} - 87.0f, log2e = (v8){0} + 1.44269504f, round = (v8){0} + 12582912.0f;
    const i8 under = x < lo; /* lanes: -1 where true; C has no vector ?: */
    x = (v8)(((i8)x & ~under) | ((i8)lo & under)); /* same-size vector casts reinterpret the bits */
    /* by mac8, as the sums: one rounding per step whatever loop copy the compiler inlines this into */
    const v8 n = mac8(round, x, log2e) - round; /* round to nearest */
    const v8 r = mac8(mac8(x, n, (v8){0} - 0.693145751953125f), n, (v8){0} - 1.428606765330187e-06f); /* ln2 in 2 */
    static const float c[6] = {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    v8 p = (v8){0} + 1.0f / 720;
    for (int i = 0; i < 6; i++) p = mac8((v8){0} + c[i], p, r);
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

/* out[i] lanes 0..3 = the scores of query row i < n (q + i * NV; n 1 to 3, a constant once inlined) against 4 bf16
 * K rows of the cache kp[0..3], widened in registers as they are read: n x 4 sums in registers. A score is q . k
 * summed lane-wise in D's order from 0, then by hsum8's tree, as the fp32 copy's tiles sum it: the same bits. */
static inline __attribute__((always_inline)) void qk4(const v8 *q, int n, const uint16_t *const *kp, v8 *out) {
    v8 a[3][4];
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 4; j++) a[i][j] = (v8){0};
    for (int c = 0; c < NV; c++)
        for (int j = 0; j < 4; j++) {
            const v8 kv = widen8(kp[j] + 8 * c);
            for (int i = 0; i < n; i++) a[i][j] = mac8(a[i][j], q[i * NV + c], kv);
        }
    /* hsum8 takes 8: two rows' 4 sums, or one row's twice (the other half unused) */
    const v8 pair[8] = {a[0][0], a[0][1], a[0][2], a[0][3], a[n > 1][0], a[n > 1][1], a[n > 1][2], a[n > 1][3]};
    out[0] = hsum8(pair);
    out[1] = __builtin_shufflevector(out[0], out[0], 4, 5, 6, 7, 4, 5, 6, 7);
    if (n == 3) {
        const v8 third[8] = {a[2][0], a[2][1], a[2][2], a[2][3], a[2][0], a[2][1], a[2][2], a[2][3]};
        out[2] = hsum8(third);
    }
}

/* A row's 8 scores at positions p0 .. p0 + 7, soft-capped, into dst */
static inline __attribute__((always_inline)) void put_scores(float *dst, v8 x, float softcap) {
    if (softcap > 0.0f)
        for (int j = 0; j < 8; j++) x[j] = softcap * tanhf(x[j] / softcap);
    memcpy(dst, &x, 32);
}

/* acc[i * NV + c] += w[i * W + p] * v[p * NV + c] for rows i < RR, vectors c < CC, rows of v [a, b) in order:
 * RR x CC sums held in registers (constants once inlined) */
static inline __attribute__((always_inline)) void pv_tile(v8 *acc, const float *w, int64_t W, const v8 *v, int64_t a,
                                                          int64_t b, int RR, int CC) {
    v8 t[3][CW];
    for (int i = 0; i < RR; i++)
        for (int c = 0; c < CC; c++) t[i][c] = acc[i * NV + c];
    for (int64_t p = a; p < b; p++)
        for (int i = 0; i < RR; i++) {
            const float x = w[i * W + p];
            for (int c = 0; c < CC; c++) t[i][c] = mac8(t[i][c], bcast8(x), v[p * NV + c]);
        }
    for (int i = 0; i < RR; i++)
        for (int c = 0; c < CC; c++) acc[i * NV + c] = t[i][c];
}

/* pass 3 for a decode's rows (RR <= 3) on a bf16 cache: acc[i * NV + c0 + c] += w[i * W + p - lo8] * v_p[c0 + c] for
 * c < CC, positions [a, b) in order, the V rows read where they lie and widened in registers: pv_tile's sums, bit for
 * bit. RR, CC constants once inlined; `ahead`: prefetch the V rows AHEAD positions on (the first c0 pass). */
static inline __attribute__((always_inline)) void pv_bf16(v8 *acc, const float *w, int64_t W, int64_t lo8,
                                                          const uint16_t *v, const int32_t *bt, int64_t kh, int64_t nb,
                                                          int64_t bs, int64_t a, int64_t b, int64_t hi, int RR, int c0,
                                                          int CC, int ahead) {
    v8 t[3][CW];
    for (int i = 0; i < RR; i++)
        for (int c = 0; c < CC; c++) t[i][c] = acc[i * NV + c0 + c];
    for (int64_t p = a; p < b;) {
        const int64_t end = (p / bs + 1) * bs < b ? (p / bs + 1) * bs : b; /* a block's rows are consecutive */
        const uint16_t *vr = v + cache_row(bt, kh, nb, bs, p) * HEAD_DIM + 8 * c0;
        for (; p < end; p++, vr += HEAD_DIM) {
            if (ahead && (p & 7) == 0 && p + AHEAD < hi) prefetch_rows(v, bt, kh, nb, bs, p + AHEAD, hi, 2);
            float x[3];
            for (int i = 0; i < RR; i++) x[i] = w[i * W + p - lo8];
            for (int c = 0; c < CC; c++) {
                const v8 vv = widen8(vr + 8 * c);
                for (int i = 0; i < RR; i++) t[i][c] = mac8(t[i][c], bcast8(x[i]), vv);
            }
        }
    }
    for (int i = 0; i < RR; i++)
        for (int c = 0; c < CC; c++) acc[i * NV + c0 + c] = t[i][c];
}
