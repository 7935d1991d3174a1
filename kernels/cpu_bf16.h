/* bf16 in 16 fp32 lanes (GCC / Clang vector extensions: one AVX-512 register, or two AVX2 ones), rounding as torch's
 * casts round, and F.silu by torch's own table: shared by kernels/cpu_ops.c and the GEMM's fused SiLU-and-mul epilogue
 * (kernels/cpu_gemm.c), so that both give the bits of silu_and_mul_ref. Included after immintrin.h where the
 * target has AVX2; includes none of ours. */
typedef float f16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));
typedef float f8v __attribute__((vector_size(32)));

static inline f16v ld(const uint16_t *p) { /* 16 bf16 -> fp32: the top halves */
    h16v h;
    memcpy(&h, p, 32);
    u16v u = __builtin_convertvector(h, u16v) << 16;
    f16v f;
    memcpy(&f, &u, 64);
    return f;
}

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
/* vcvtneps2bf16 rounds as to_bf16 does (to nearest even; a NaN keeps its payload, made quiet), except that it
 * flushes a denormal to zero, which torch's casts keep: 1 instruction for the 16 lanes where none is denormal
 * (fpclass 0x20), else the integer path below */
#define CVTNE 1
static inline int has_denormal(f16v f) { return _mm512_fpclass_ps_mask((__m512)f, 0x20) != 0; }
#else
#define CVTNE 0
#endif

static inline h16v to_bf16(f16v f) { /* round to nearest even, as torch's casts; a NaN stays a (quiet) NaN */
#if CVTNE
    if (!has_denormal(f)) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)f);
        h16v r;
        memcpy(&r, &h, 32);
        return r;
    }
#endif
    u16v u;
    memcpy(&u, &f, 64);
    /* lanes: all ones where NaN (|u| past inf's bits: the difference's sign). Not a vector compare: on AVX2, GCC
     * compared these 16-lane vectors element by element, which made the whole op several times slower */
    const u16v nan = (u16v)(((i16v){0} + 0x7f800000 - (i16v)(u & 0x7fffffffu)) >> 31);
    const u16v r = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16 & ~nan) | ((u >> 16 | 0x40u) & nan);
    return __builtin_convertvector(r, h16v);
}

static inline f16v round_bf16(f16v f) { /* to_bf16's value, kept in fp32 lanes (no narrowing and widening) */
#if CVTNE
    if (!has_denormal(f)) {
        const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)f)), 16);
        memcpy(&f, &w, 64);
        return f;
    }
#endif
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

/* silu[g]: the bf16 bits of F.silu at the bf16 gate whose bits are g, for every g (kernels/cpu_ops.py builds the
 * table with torch: torch's bits by construction), padded by one entry (a lookup reads 32 bits, the entry and the
 * next). */
static inline f16v silu_at(const uint16_t *g, const uint16_t *silu) {
#ifdef __AVX512F__
    const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)g));
    const __m512i t = _mm512_slli_epi32(_mm512_i32gather_epi32(idx, (const void *)silu, 2), 16);
#elif defined(__AVX2__)
    const __m256i i0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)g));
    const __m256i i1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + 8)));
    const __m256i t0 = _mm256_slli_epi32(_mm256_i32gather_epi32((const int *)silu, i0, 2), 16);
    const __m256i t1 = _mm256_slli_epi32(_mm256_i32gather_epi32((const int *)silu, i1, 2), 16);
    u16v t;
    memcpy(&t, &t0, 32);
    memcpy((char *)&t + 32, &t1, 32);
#else
    u16v t;
    for (int l = 0; l < 16; l++) t[l] = (uint32_t)silu[g[l]] << 16;
#endif
    f16v f;
    memcpy(&f, &t, 64);
    return f;
}

