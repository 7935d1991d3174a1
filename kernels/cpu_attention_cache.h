/* kernels/cpu_attention.c's work items and its reads of the paged cache: where a position's K and V rows lie
 * (cache_row), and asking for them early (prefetch_rows, prefetch_first, prefetch_item). Included once, by
 * cpu_attention.c, where HEAD_DIM and AHEAD are defined. */

/* A work item: kv head kh of sequence s, its query tokens [i0, i1) (indices within the sequence's chunk). */
typedef struct {
    int64_t s, kh, i0, i1;
} item;

/* Cache row of position p of sequence s for kv head kh: its block from the table, the row within it. */
static inline int64_t cache_row(const int32_t *bt, int64_t kh, int64_t nb, int64_t bs, int64_t p) {
    if ((bs & (bs - 1)) == 0) { /* a power of two (16, the default): a shift and a mask, not a 64-bit division */
        const int sh = __builtin_ctzll((unsigned long long)bs);
        return (kh * nb + bt[p >> sh]) * bs + (p & (bs - 1));
    }
    return (kh * nb + bt[p / bs]) * bs + p % bs;
}

/* A cache line into L2. An asm statement the compiler keeps: GCC deleted prefetch_rows's loop of __builtin_prefetch
 * as code without effect once cache_row had no division left that might trap (a cold decode ran 1.8x slower) */
static inline void prefetch_l2(const char *p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht1 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

/* Ask for the cache lines of positions p .. p + 7 (p a multiple of 8), AHEAD positions before they are read: a
 * decode's K and V come from memory in 2 KB blocks scattered over the pool, and the hardware's prefetchers stop at
 * each block's end. */
static inline void prefetch_rows(const void *base, const int32_t *bt, int64_t kh, int64_t nb, int64_t bs, int64_t p,
                                 int64_t hi, int esize) {
    if ((bs & 7) == 0) { /* p a multiple of 8: its 8 rows lie in one block, one after another: one lookup */
        const char *row = (const char *)base + cache_row(bt, kh, nb, bs, p) * HEAD_DIM * esize;
        const int64_t end = (hi - p < 8 ? hi - p : 8) * HEAD_DIM * esize;
        for (int64_t off = 0; off < end; off += 64) prefetch_l2(row + off);
        return;
    }
    for (int64_t j = 0; j < 8 && p + j < hi; j++) {
        const char *row = (const char *)base + cache_row(bt, kh, nb, bs, p + j) * HEAD_DIM * esize;
        for (int64_t off = 0; off < HEAD_DIM * esize; off += 64) prefetch_l2(row + off);
    }
}

/* The positions [lo, hi) an item's rows see: its last token's causal end, its first token's window start */
static inline void item_span(const item *it, const int32_t *ctx, const int32_t *qsl, int64_t window, int64_t *lo,
                             int64_t *hi) {
    const int64_t first = ctx[it->s] - (qsl[it->s + 1] - qsl[it->s]), end0 = first + it->i0 + 1;
    *lo = window > 0 && end0 > window ? end0 - window : 0;
    *hi = first + it->i1;
}

/* A `direct` item's (a decode's few rows on a bf16 cache) first AHEAD positions of K and V, from memory into L2 */
static inline void prefetch_first(const void *k, const void *v, const int32_t *bt, int64_t kh, int64_t nb, int64_t bs,
                                  int64_t lo, int64_t hi) {
    for (int64_t p = lo & -8; p < (lo & -8) + AHEAD && p < hi; p += 8) {
        prefetch_rows(k, bt, kh, nb, bs, p, hi, 2);
        prefetch_rows(v, bt, kh, nb, bs, p, hi, 2);
    }
}

/* What run() asks for first on a `direct` item, asked for while the thread's item before it runs: the latency at
 * each item's start, where nothing of it was in flight yet. */
static void prefetch_item(const item *it, const void *k, const void *v, const int32_t *tables, int64_t table_stride,
                          const int32_t *ctx, const int32_t *qsl, int64_t nb, int64_t bs, int dtype, int64_t window,
                          int64_t rep) {
    if (dtype != 1 || (it->i1 - it->i0) * rep > 3) return; /* not `direct`: its rows read each K row many times */
    int64_t lo, hi;
    item_span(it, ctx, qsl, window, &lo, &hi);
    prefetch_first(k, v, tables + it->s * table_stride, it->kh, nb, bs, lo, hi);
}
