/* Multi-adapter LoRA delta on the CPU (S-LoRA's MBGMM/MBGMV, gathering rows from the unified pool).
 *
 * One call serves several problems that share x (q, k and v read the same normed hidden state):
 * out_p[t] += scale_g * (x[t] @ A_g^T) @ B_g^T for every token t of every group g of every problem
 * p, where a group is the tokens of one batch that share one adapter and scale (cpu_native.py
 * builds each problem's plan from LoraSegments.groups). A_g row j is pool[a_off[j] : a_off[j] + in]
 * and B_g^T row j is pool[b_off[j] : b_off[j] + out]. One call per shared x instead of one per
 * projection (120 calls in a SmolLM2 decode step instead of 210; each costs a ctypes call and an
 * OpenMP fork and join) gives the threads more groups to balance.
 *
 * Decode batches with many adapters (at least two groups of <= STREAM_TOKENS tokens per thread):
 * each such group is one work item, biggest first, that runs its shrink and then its expand with
 * no barrier in between. Two kinds, by the group's token count:
 *   - 1-2 tokens (memory-bound: each weight feeds one or two FMAs): the A rows and then the B^T
 *     rows are streamed straight from the pool, four rows at a time, widened in registers, each
 *     read once, the next rows software-prefetched (rows of 1-3 KiB end before the hardware
 *     prefetcher ramps up). The B^T rows are read whole (up to 2048 columns per pass) into fp32
 *     sums kept in L1.
 *   - 3-16 tokens (compute-bound: a k = 8 adapter step at batch 32 has 4 tokens per adapter):
 *     register tiles (decode tiles below) that keep 2 rows x 4 tokens (shrink) or 4 tokens x 16
 *     columns (expand) of sums in registers.
 *
 * Other groups go through two phases in the same OpenMP region:
 *   shrink: work items (group, token tile, chunk of rank rows). Each A row of a chunk is widened to
 *           fp32 once and dotted with every token of the tile.
 *   expand: groups of few tokens stream their B^T rows as above, in work items of up to 512
 *           columns; groups of many tokens (prefill) are compute-bound instead: work items (group,
 *           block of 64 columns) widen the block of every B^T row once into a small buffer and
 *           keep each token's sums in registers.
 * Either way out gets one rounding, as the torch reference does.
 *
 * Those paths round differently (a streamed group sums four B^T rows before adding, a tile sums x
 * in chunk order), and which one a token takes depends on how many tokens share its adapter in the
 * batch. A call with `fixed_order` (batch-invariant serving) sends every group through the two
 * phases with the prefill expand, whose sums run over a token's own h in rank order: a token's
 * delta is then the same whatever else is in the batch.
 *
 * The math is fp32 whatever the storage dtype: CPUs without bf16/fp16 arithmetic would emulate it.
 * GCC vector extensions give one source for AVX2 (8 floats per vector) and narrower targets; with
 * -march=native the compiler contracts a * b + c into FMAs.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __F16C__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));

#define SHRINK_ROWS 4   /* A rows dotted together: one x load feeds four FMAs */
#define TOKEN_TILE 64   /* tokens per shrink tile: A rows are re-read once per tile */
#define CHUNK_ROWS 16   /* rank rows per shrink work item (parallelism across a group) */
#define COL_BLOCK 64    /* output columns per prefill expand work item: 8 vectors of accumulators */
#define STREAM_TOKENS 16 /* decode groups: at most this many tokens */
#define TILE_MIN_TOKENS 3 /* decode groups with at least this many tokens use register tiles */
#define STREAM_COLS 512  /* output columns per streaming expand work item (1 KiB of a bf16 row) */
/* Columns per pass of a decode group of 1-2 tokens over its B^T rows: whole rows of the common
 * widths, read as one run each (a k = 32 bf16 step: 25.8 ms with 512, 24.3 ms with 2048). Its
 * sums fit the STREAM_TOKENS * STREAM_COLS buffer. */
#define GROUP_STREAM_COLS 2048
_Static_assert((TILE_MIN_TOKENS - 1) * GROUP_STREAM_COLS <= STREAM_TOKENS * STREAM_COLS, "sums buffer");
/* Below this many multiply-adds one thread finishes in tens of microseconds, less than waking a
 * second thread and meeting it at three barriers costs on a busy 2-core machine. */
#define PARALLEL_MIN_WORK 1000000

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t v) {
    _Float16 h;
    memcpy(&h, &v, 2);
    return (float)h;
}

static inline uint16_t f32_to_f16(float f) {
    _Float16 h = (_Float16)f;
    uint16_t v;
    memcpy(&v, &h, 2);
    return v;
}

/* n elements of a row of `dtype` starting `offset` elements into `base`, as fp32: the row itself
 * when it already is fp32, else widened into `buf`. */
static const float *row_f32(const void *base, int64_t offset, int dtype, int64_t n, float *buf) {
    if (dtype == DT_F32) return (const float *)base + offset;
    const uint16_t *src = (const uint16_t *)base + offset;
    if (dtype == DT_BF16) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)src[i] << 16;
            memcpy(buf + i, &u, 4);
        }
    } else {
        for (int64_t i = 0; i < n; i++) buf[i] = f16_to_f32(src[i]);
    }
    return buf;
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Eight elements of a row of `dtype` from element k, widened to fp32 in registers. Inlined with
 * a constant dtype, so each caller's loop is specialised per dtype. */
typedef uint16_t v8u16_u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef _Float16 v8h_u __attribute__((vector_size(16), aligned(2)));

static inline __attribute__((always_inline)) v8f load8(const void *row, int64_t k, int dtype) {
    if (dtype == DT_F32) return *(const v8f_u *)((const float *)row + k);
    if (dtype == DT_BF16) {
        v8u32 wide = __builtin_convertvector(*(const v8u16_u *)((const uint16_t *)row + k), v8u32) << 16;
        v8f f;
        memcpy(&f, &wide, sizeof f);
        return f;
    }
#ifdef __F16C__
    /* GCC widens a vector of _Float16 one element at a time unless the CPU has AVX512-FP16;
     * F16C's vcvtph2ps does all eight in one instruction. */
    return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
#else
    return __builtin_convertvector(*(const v8h_u *)((const _Float16 *)row + k), v8f);
#endif
}

static inline __attribute__((always_inline)) float load1(const void *row, int64_t k, int dtype) {
    if (dtype == DT_F32) return ((const float *)row)[k];
    if (dtype == DT_BF16) return bf16_to_f32(((const uint16_t *)row)[k]);
    return f16_to_f32(((const uint16_t *)row)[k]);
}

/* Prefetch a line of adapter weights, which a call reads once: non-temporal, so the megabytes a
 * call streams do not push the base model's working set (its widened weights, activations) out of
 * L2 and L3. Same kernel time, and 1.7-4.3 ms less extra step time at k = 8 (bf16, in the engine). */
#define prefetch_once(p) __builtin_prefetch((p), 0, 0)

/* The cache lines `offset` bytes into each of the n rows `next`: the rows a caller reads after the
 * current ones. Rows of 1-3 KiB are too short for the hardware prefetcher to ramp up on, so
 * without this every row started with a full memory latency. */
static inline void prefetch_rows(const void *const *next, int n, int64_t offset) {
    for (int i = 0; i < n; i++) prefetch_once((const char *)next[i] + offset);
}

/* h[t * hs + j + i] = scale * dot(a[i], x[t]) for i < nr (nr <= SHRINK_ROWS) and each token; the
 * A rows are read as `dtype` and widened in registers. */
static inline __attribute__((always_inline)) void shrink_rows_t(
    const void *const *a, int nr, const float *const *xs, int ntok, int64_t in, float scale, float *h,
    int hs, int j, const void *const *next, int n_next, int dtype) {
    const int64_t es = dtype == DT_F32 ? 4 : 2;
    const void *r0 = a[0], *r1 = a[nr > 1], *r2 = a[nr > 2 ? 2 : 0], *r3 = a[nr > 3 ? 3 : 0];
    int64_t vec_end = in - in % 8;
    for (int t = 0; t < ntok; t++) {
        const float *x = xs[t];
        /* Two sums per row over alternate vectors: eight independent FMA chains hide the FMA
         * latency that four chains (one per row) left exposed. */
        v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, u0 = {0}, u1 = {0}, u2 = {0}, u3 = {0};
        int64_t k = 0;
        for (; k + 16 <= vec_end; k += 16) {
            if (t == 0 && k * es % 64 == 0) prefetch_rows(next, n_next, k * es);
            v8f xv = *(const v8f_u *)(x + k), xw = *(const v8f_u *)(x + k + 8);
            s0 += xv * load8(r0, k, dtype);
            s1 += xv * load8(r1, k, dtype);
            s2 += xv * load8(r2, k, dtype);
            s3 += xv * load8(r3, k, dtype);
            u0 += xw * load8(r0, k + 8, dtype);
            u1 += xw * load8(r1, k + 8, dtype);
            u2 += xw * load8(r2, k + 8, dtype);
            u3 += xw * load8(r3, k + 8, dtype);
        }
        if (k < vec_end) {
            v8f xv = *(const v8f_u *)(x + k);
            s0 += xv * load8(r0, k, dtype);
            s1 += xv * load8(r1, k, dtype);
            s2 += xv * load8(r2, k, dtype);
            s3 += xv * load8(r3, k, dtype);
        }
        float d[SHRINK_ROWS] = {hsum(s0 + u0), hsum(s1 + u1), hsum(s2 + u2), hsum(s3 + u3)};
        for (int64_t k = vec_end; k < in; k++) {
            d[0] += x[k] * load1(r0, k, dtype);
            d[1] += x[k] * load1(r1, k, dtype);
            d[2] += x[k] * load1(r2, k, dtype);
            d[3] += x[k] * load1(r3, k, dtype);
        }
        for (int i = 0; i < nr; i++) h[(int64_t)t * hs + j + i] = scale * d[i];
    }
}

static void shrink_rows(const void *const *a, int nr, const float *const *xs, int ntok, int64_t in,
                        float scale, float *h, int hs, int j, const void *const *next, int n_next,
                        int dtype) {
    if (dtype == DT_F32) shrink_rows_t(a, nr, xs, ntok, in, scale, h, hs, j, next, n_next, DT_F32);
    else if (dtype == DT_BF16) shrink_rows_t(a, nr, xs, ntok, in, scale, h, hs, j, next, n_next, DT_BF16);
    else shrink_rows_t(a, nr, xs, ntok, in, scale, h, hs, j, next, n_next, DT_F16);
}

/* The weights h[i] of the nr (<= 4) rows of one token, broadcast; rows past nr get weight 0. */
#define BROADCAST4(ht, nr, w0, w1, w2, w3)                                                        \
    float ht##0 = (ht)[0], ht##1 = (nr) > 1 ? (ht)[1] : 0.0f, ht##2 = (nr) > 2 ? (ht)[2] : 0.0f,  \
          ht##3 = (nr) > 3 ? (ht)[3] : 0.0f;                                                      \
    v8f w0 = {ht##0, ht##0, ht##0, ht##0, ht##0, ht##0, ht##0, ht##0};                            \
    v8f w1 = {ht##1, ht##1, ht##1, ht##1, ht##1, ht##1, ht##1, ht##1};                            \
    v8f w2 = {ht##2, ht##2, ht##2, ht##2, ht##2, ht##2, ht##2, ht##2};                            \
    v8f w3 = {ht##3, ht##3, ht##3, ht##3, ht##3, ht##3, ht##3, ht##3}

/* sums[t][c] += sum over the nr (<= 4) rows b[i] of h[t * hs + i] * b[i][c], for c < cw, reading
 * the B^T rows straight from the pool (widened in registers): one pass over each row chunk for
 * all of a group's tokens, two tokens per pass so each widened vector feeds eight FMAs. */
static inline __attribute__((always_inline)) void expand_rows_t(
    const void *const *b, int nr, const float *hj, int64_t hs, int64_t ntok, float *sums, int cw,
    const void *const *next, int n_next, int dtype) {
    const int64_t es = dtype == DT_F32 ? 4 : 2;
    const void *r0 = b[0], *r1 = b[nr > 1], *r2 = b[nr > 2 ? 2 : 0], *r3 = b[nr > 3 ? 3 : 0];
    int vec_end = cw - cw % 8;
    int64_t t = 0;
    for (; t + 2 <= ntok; t += 2) {
        const float *ha = hj + t * hs, *hb = ha + hs;
        BROADCAST4(ha, nr, a0, a1, a2, a3);
        BROADCAST4(hb, nr, c0, c1, c2, c3);
        float *acc_a = sums + t * cw, *acc_b = acc_a + cw;
        for (int c = 0; c < vec_end; c += 8) {
            if (t == 0 && c * es % 64 == 0) prefetch_rows(next, n_next, c * es);
            v8f b0 = load8(r0, c, dtype), b1 = load8(r1, c, dtype);
            v8f b2 = load8(r2, c, dtype), b3 = load8(r3, c, dtype);
            *(v8f_u *)(acc_a + c) += (a0 * b0 + a1 * b1) + (a2 * b2 + a3 * b3);
            *(v8f_u *)(acc_b + c) += (c0 * b0 + c1 * b1) + (c2 * b2 + c3 * b3);
        }
        for (int c = vec_end; c < cw; c++) {
            float e0 = load1(r0, c, dtype), e1 = load1(r1, c, dtype);
            float e2 = load1(r2, c, dtype), e3 = load1(r3, c, dtype);
            acc_a[c] += (ha0 * e0 + ha1 * e1) + (ha2 * e2 + ha3 * e3);
            acc_b[c] += (hb0 * e0 + hb1 * e1) + (hb2 * e2 + hb3 * e3);
        }
    }
    if (t < ntok) {
        const float *ha = hj + t * hs;
        BROADCAST4(ha, nr, a0, a1, a2, a3);
        float *acc = sums + t * cw;
        for (int c = 0; c < vec_end; c += 8) {
            if (t == 0 && c * es % 64 == 0) prefetch_rows(next, n_next, c * es);
            v8f b0 = load8(r0, c, dtype), b1 = load8(r1, c, dtype);
            v8f b2 = load8(r2, c, dtype), b3 = load8(r3, c, dtype);
            *(v8f_u *)(acc + c) += (a0 * b0 + a1 * b1) + (a2 * b2 + a3 * b3);
        }
        for (int c = vec_end; c < cw; c++)
            acc[c] += (ha0 * load1(r0, c, dtype) + ha1 * load1(r1, c, dtype)) +
                      (ha2 * load1(r2, c, dtype) + ha3 * load1(r3, c, dtype));
    }
}

static void expand_rows(const void *const *b, int nr, const float *hj, int64_t hs, int64_t ntok, float *sums,
                        int cw, const void *const *next, int n_next, int dtype) {
    if (dtype == DT_F32) expand_rows_t(b, nr, hj, hs, ntok, sums, cw, next, n_next, DT_F32);
    else if (dtype == DT_BF16) expand_rows_t(b, nr, hj, hs, ntok, sums, cw, next, n_next, DT_BF16);
    else expand_rows_t(b, nr, hj, hs, ntok, sums, cw, next, n_next, DT_F16);
}

/* out row += acc (fp32 sum) for `n` columns, rounding once into the row's dtype. */
static void add_into(void *out_row, int dtype, const float *acc, int n) {
    if (dtype == DT_F32) {
        float *o = (float *)out_row;
        for (int c = 0; c < n; c++) o[c] += acc[c];
    } else if (dtype == DT_BF16) {
        uint16_t *o = (uint16_t *)out_row;
        for (int c = 0; c < n; c++) o[c] = f32_to_bf16(bf16_to_f32(o[c]) + acc[c]);
    } else {
        uint16_t *o = (uint16_t *)out_row;
        for (int c = 0; c < n; c++) o[c] = f32_to_f16(f16_to_f32(o[c]) + acc[c]);
    }
}

/* out rows of a group's n (<= STREAM_TOKENS) tokens toks[] += h @ B^T over columns [c0, c0 + cw),
 * h being [n, r] fp32 and B^T row j at b_off[j]: each row's chunk is read once as one run. */
static void stream_expand(const void *pool, int pool_dtype, const int64_t *b_off, int64_t r,
                          const float *h, int64_t n, const int64_t *toks, int64_t c0, int cw, int64_t out_f,
                          float *sums, void *out, int out_dtype, int64_t out_stride) {
    const size_t pool_esize = pool_dtype == DT_F32 ? 4 : 2, out_esize = out_dtype == DT_F32 ? 4 : 2;
    memset(sums, 0, sizeof(float) * n * cw);
    for (int64_t j = 0; j < r; j += 4) {
        int nr = (int)(r - j < 4 ? r - j : 4);
        const void *b[4] = {0}, *next[4] = {0};
        for (int i = 0; i < nr; i++) b[i] = (const char *)pool + (b_off[j + i] + c0) * pool_esize;
        /* Next: the following rows of this chunk, else the first rows of the next chunk. */
        int64_t nj = j + 4 < r ? j + 4 : 0, nc = j + 4 < r ? c0 : c0 + cw;
        int n_next = nc < out_f ? (int)(r - nj < 4 ? r - nj : 4) : 0;
        for (int i = 0; i < n_next; i++) next[i] = (const char *)pool + (b_off[nj + i] + nc) * pool_esize;
        expand_rows(b, nr, h + j, r, n, sums, cw, next, n_next, pool_dtype);
    }
    for (int64_t t = 0; t < n; t++)
        add_into((char *)out + ((size_t)toks[t] * out_stride + c0) * out_esize, out_dtype, sums + t * cw, cw);
}


/* ---- decode tiles: register tiles over 16-element chunks -----------------------------------------
 * A chunk is 16 elements of a row widened into two fp32 vectors. For bf16 they are the even and the
 * odd elements (one 32-byte load and three shifts, instead of two widening loads and two shifts);
 * a dot product does not mind the order of its terms as long as x is in the same order, so x is put
 * in chunk order once per token, and the expand puts its sums back in natural order in registers.
 * The shrink keeps TILE_ROWS rows x up to TILE_TOKENS tokens of sums in registers, the expand up to
 * TILE_TOKENS tokens x 16 columns. Tile shapes are compile-time constants and the arrays below have
 * fixed sizes, so the compiler keeps them in registers (variable-length arrays put them on the
 * stack: 2.4x slower). */

#define TILE_TOKENS 4 /* tokens per register tile */
#define TILE_ROWS 2   /* A rows per shrink tile: 2 x 4 sums, 2 widened chunks, x from L1 */
#define LINE 64       /* cache line bytes */

typedef uint32_t v8u32_u __attribute__((vector_size(32), aligned(2)));

static inline __attribute__((always_inline)) void load16(const void *row, int64_t k, int dtype, v8f *lo,
                                                         v8f *hi) {
    if (dtype == DT_BF16) {
        v8u32 w = *(const v8u32_u *)((const uint16_t *)row + k);
        v8u32 even = w << 16, odd = (w >> 16) << 16;
        memcpy(lo, &even, sizeof *lo);
        memcpy(hi, &odd, sizeof *hi);
    } else {
        *lo = load8(row, k, dtype);
        *hi = load8(row, k + 8, dtype);
    }
}

/* x (n fp32 values) in the chunk order of `dtype` rows: full chunks permuted, the tail as is. */
static const float *to_chunk_order(const float *x, int64_t n, int dtype, float *buf) {
    if (dtype != DT_BF16) return x;
    int64_t n16 = n - n % 16;
    for (int64_t k = 0; k < n16; k += 16) {
        v8f a = *(const v8f_u *)(x + k), b = *(const v8f_u *)(x + k + 8);
        *(v8f_u *)(buf + k) = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
        *(v8f_u *)(buf + k + 8) = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
    }
    for (int64_t k = n16; k < n; k++) buf[k] = x[k];
    return buf;
}

/* d[i * NT + t] = dot(a[i], x[t]) for TILE_ROWS rows and NT tokens (x in chunk order), while the
 * TILE_ROWS rows `next` are prefetched line by line at the same pace. */
static inline __attribute__((always_inline)) void shrink_tile_t(const void *const *a, const float *const *x,
                                                                int64_t in, float *d, const void *const *next,
                                                                int dtype, const int NT) {
    const int64_t es = dtype == DT_F32 ? 4 : 2, per_line = LINE / es;
    const int64_t n16 = in - in % 16, lines_end = in - in % per_line;
    v8f acc[TILE_ROWS][TILE_TOKENS];
    for (int i = 0; i < TILE_ROWS; i++)
        for (int t = 0; t < NT; t++) acc[i][t] = (v8f){0};
    for (int64_t k = 0; k < n16; k += 16) {
        if (k % per_line == 0 && k < lines_end)
            for (int i = 0; i < TILE_ROWS; i++) prefetch_once((const char *)next[i] + k * es);
        v8f lo[TILE_ROWS], hi[TILE_ROWS];
        for (int i = 0; i < TILE_ROWS; i++) load16(a[i], k, dtype, &lo[i], &hi[i]);
        for (int t = 0; t < NT; t++) {
            v8f xv = *(const v8f_u *)(x[t] + k);
            for (int i = 0; i < TILE_ROWS; i++) acc[i][t] += lo[i] * xv;
        }
        for (int t = 0; t < NT; t++) {
            v8f xv = *(const v8f_u *)(x[t] + k + 8);
            for (int i = 0; i < TILE_ROWS; i++) acc[i][t] += hi[i] * xv;
        }
    }
    for (int i = 0; i < TILE_ROWS; i++)
        for (int t = 0; t < NT; t++) {
            float s = hsum(acc[i][t]);
            for (int64_t k = n16; k < in; k++) s += x[t][k] * load1(a[i], k, dtype);
            d[i * NT + t] = s;
        }
}

#define SHRINK_TILE(NT)                                                                             \
    do {                                                                                            \
        if (dtype == DT_F32) shrink_tile_t(a, x, in, d, next, DT_F32, NT);                          \
        else if (dtype == DT_BF16) shrink_tile_t(a, x, in, d, next, DT_BF16, NT);                   \
        else shrink_tile_t(a, x, in, d, next, DT_F16, NT);                                          \
    } while (0)

static void shrink_tile(const void *const *a, const float *const *x, int nt, int64_t in, float *d,
                        const void *const *next, int dtype) {
    if (nt == 4) SHRINK_TILE(4);
    else if (nt == 3) SHRINK_TILE(3);
    else if (nt == 2) SHRINK_TILE(2);
    else SHRINK_TILE(1);
}

/* o[t][c0 .. c0 + 16) += sum over the r rows j of h[t * hs + j] * b[j][c0 ..] for NT tokens whose
 * fp32 out rows are o[t]. With `ahead`, each row is also prefetched `ahead` bytes on. */
static inline __attribute__((always_inline)) void expand_tile_t(const char *const *b, int64_t r, int64_t c0,
                                                                const float *h, int64_t hs, float *const *o,
                                                                int64_t ahead, int dtype, const int NT) {
    const int64_t off = c0 * (dtype == DT_F32 ? 4 : 2);
    v8f acc[TILE_TOKENS][2];
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = (v8f){0};
    for (int64_t j = 0; j < r; j++) {
        const char *row = b[j] + off;
        if (ahead) prefetch_once(row + ahead);
        v8f lo, hi;
        load16(row, 0, dtype, &lo, &hi);
        for (int t = 0; t < NT; t++) {
            float hv = h[t * hs + j];
            v8f hb = {hv, hv, hv, hv, hv, hv, hv, hv};
            acc[t][0] += hb * lo;
            acc[t][1] += hb * hi;
        }
    }
    for (int t = 0; t < NT; t++) {
        v8f first = acc[t][0], second = acc[t][1];
        if (dtype == DT_BF16) {
            first = __builtin_shufflevector(acc[t][0], acc[t][1], 0, 8, 1, 9, 2, 10, 3, 11);
            second = __builtin_shufflevector(acc[t][0], acc[t][1], 4, 12, 5, 13, 6, 14, 7, 15);
        }
        *(v8f_u *)(o[t] + c0) += first;
        *(v8f_u *)(o[t] + c0 + 8) += second;
    }
}

#define EXPAND_TILE(NT)                                                                             \
    do {                                                                                            \
        if (dtype == DT_F32) expand_tile_t(b, r, c0, h, hs, o, ahead, DT_F32, NT);                  \
        else if (dtype == DT_BF16) expand_tile_t(b, r, c0, h, hs, o, ahead, DT_BF16, NT);           \
        else expand_tile_t(b, r, c0, h, hs, o, ahead, DT_F16, NT);                                  \
    } while (0)

static void expand_tile(const char *const *b, int64_t r, int64_t c0, const float *h, int64_t hs, int nt,
                        float *const *o, int64_t ahead, int dtype) {
    if (nt == 4) EXPAND_TILE(4);
    else if (nt == 3) EXPAND_TILE(3);
    else if (nt == 2) EXPAND_TILE(2);
    else EXPAND_TILE(1);
}

/* Scratch of one thread for tile_group. */
typedef struct {
    float *h;          /* STREAM_TOKENS * max rank: scale * x @ A^T */
    float *sums;       /* STREAM_TOKENS * max out: the delta in fp32 when out is not fp32 */
    const char **rows; /* max rank: the group's B^T rows */
} tile_scratch;

/* One decode group of n (TILE_MIN_TOKENS..STREAM_TOKENS) tokens: h = scale * x @ A^T, then
 * out += h @ B^T, with one rounding into out. x: the tokens' rows in chunk order. */
static void tile_group(const void *pool, int pool_dtype, const int64_t *a_off, const int64_t *b_off, int64_t r,
                       float scale, const float *const *x, int64_t n, const int64_t *toks, int64_t in,
                       int64_t out_f, void *out, int out_dtype, int64_t out_stride, tile_scratch *s) {
    const size_t es = pool_dtype == DT_F32 ? 4 : 2, out_es = out_dtype == DT_F32 ? 4 : 2;
    float *o[STREAM_TOKENS];
    for (int64_t t = 0; t < n; t++) {
        if (out_dtype == DT_F32) o[t] = (float *)out + toks[t] * out_stride;
        else memset(o[t] = s->sums + t * out_f, 0, sizeof(float) * out_f);
    }
    for (int64_t j = 0; j < r; j++) s->rows[j] = (const char *)pool + b_off[j] * es;
    /* The expand prefetches each B^T row `ahead` bytes on, about 64 lines in all, once per line;
     * the lines before that are prefetched while the shrink runs, spread over its tiles. */
    const int64_t ahead = LINE * (r < 64 ? 64 / r : 1);

    for (int64_t j = 0; j < r; j += TILE_ROWS) {
        int nr = (int)(r - j < TILE_ROWS ? r - j : TILE_ROWS);
        /* Rows past nr repeat row j. Next: the following A rows, else the first B^T rows. */
        const void *a[TILE_ROWS], *next[TILE_ROWS];
        for (int i = 0; i < TILE_ROWS; i++) {
            int64_t nj = j + nr + i;
            a[i] = (const char *)pool + a_off[j + (i < nr ? i : 0)] * es;
            next[i] = nj < r ? (const void *)((const char *)pool + a_off[nj] * es) : s->rows[(nj - r) % r];
        }
        /* The expand starts on all r rows at once (k = 8 bf16 step in C: 7.9 -> 7.6 ms). */
        for (int64_t b = j; b < r && b < j + TILE_ROWS; b++)
            for (int64_t l = 0; l < ahead; l += LINE) prefetch_once(s->rows[b] + l);
        for (int64_t t0 = 0; t0 < n; t0 += TILE_TOKENS) {
            int nt = (int)(n - t0 < TILE_TOKENS ? n - t0 : TILE_TOKENS);
            float d[TILE_ROWS * TILE_TOKENS];
            shrink_tile(a, x + t0, nt, in, d, next, pool_dtype);
            for (int i = 0; i < nr; i++)
                for (int t = 0; t < nt; t++) s->h[(t0 + t) * r + j + i] = scale * d[i * nt + t];
        }
    }

    int64_t c0 = 0;
    for (; c0 + 16 <= out_f; c0 += 16)
        for (int64_t t0 = 0; t0 < n; t0 += TILE_TOKENS) {
            int nt = (int)(n - t0 < TILE_TOKENS ? n - t0 : TILE_TOKENS);
            int first_on_line = t0 == 0 && (c0 * es) % LINE == 0;
            expand_tile(s->rows, r, c0, s->h + t0 * r, r, nt, o + t0, first_on_line ? ahead : 0, pool_dtype);
        }
    for (; c0 < out_f; c0++) /* the last out_f % 16 columns */
        for (int64_t t = 0; t < n; t++) {
            float v = 0.0f;
            for (int64_t j = 0; j < r; j++) v += s->h[t * r + j] * load1(s->rows[j], c0, pool_dtype);
            o[t][c0] += v;
        }
    if (out_dtype != DT_F32)
        for (int64_t t = 0; t < n; t++)
            add_into((char *)out + (size_t)toks[t] * out_stride * out_es, out_dtype, o[t], (int)out_f);
}

/* One decode group of 1..TILE_MIN_TOKENS-1 tokens, streamed: its A rows straight from the pool
 * (each read once for all its tokens, so widening it into a buffer first would only add a pass),
 * then its B^T rows in runs of GROUP_STREAM_COLS columns. h: room for n * r, sums: for
 * n * GROUP_STREAM_COLS. */
static void stream_group(const void *pool, int pool_dtype, const int64_t *a_off, const int64_t *b_off, int64_t r,
                         float scale, const float *const *xs, int64_t n, const int64_t *toks, int64_t in,
                         int64_t out_f, void *out, int out_dtype, int64_t out_stride, float *h, float *sums) {
    const size_t es = pool_dtype == DT_F32 ? 4 : 2;
    for (int64_t j = 0; j < r; j += SHRINK_ROWS) {
        int nr = (int)(r - j < SHRINK_ROWS ? r - j : SHRINK_ROWS);
        const void *a[SHRINK_ROWS] = {0}, *next[SHRINK_ROWS] = {0};
        for (int i = 0; i < nr; i++) a[i] = (const char *)pool + a_off[j + i] * es;
        /* Next: the following A rows, else the first B^T rows the expand reads. */
        int64_t nj = j + nr < r ? j + nr : 0;
        const int64_t *next_off = j + nr < r ? a_off : b_off;
        int n_next = (int)(r - nj < SHRINK_ROWS ? r - nj : SHRINK_ROWS);
        for (int i = 0; i < n_next; i++) next[i] = (const char *)pool + next_off[nj + i] * es;
        shrink_rows(a, nr, xs, (int)n, in, scale, h, (int)r, (int)j, next, n_next, pool_dtype);
    }
    for (int64_t c0 = 0; c0 < out_f; c0 += GROUP_STREAM_COLS)
        stream_expand(pool, pool_dtype, b_off, r, h, n, toks, c0,
                      (int)(out_f - c0 < GROUP_STREAM_COLS ? out_f - c0 : GROUP_STREAM_COLS), out_f, sums, out,
                      out_dtype, out_stride);
}

/* One problem of a call: where its delta goes and its groups (see lora_delta). Every field is 8
 * bytes, so the ctypes mirror in cpu_native.py has no padding to get wrong. */
typedef struct {
    void *out;                  /* rows of out_features elements of out_dtype, out_stride apart */
    int64_t out_dtype;
    int64_t out_stride;
    int64_t out_features;
    const int64_t *a_offsets;   /* pool offset of each A row */
    const int64_t *b_offsets;   /* pool offset of each B^T row */
    int64_t num_groups;         /* G */
    const int64_t *plan;        /* [3G + 1]: rank-row starts, rank-row ends, token-list starts */
    const int64_t *tokens;      /* rows of x (and out) of group 0, then of group 1, ... */
    const float *scales;        /* [G] */
} lora_problem;

/* A group of one problem, resolved once from the problem's plan for every work item to use. */
typedef struct {
    const lora_problem *p;
    const int64_t *a_off, *b_off; /* its rank rows' pool offsets (rank of each) */
    const int64_t *tokens;        /* its rows of x and out (num_tokens of them) */
    int64_t rank, num_tokens;
    float scale;
    int64_t h_start; /* its block of the two-phase h buffer ([tokens, rank] fp32) */
    int64_t work;    /* multiply-adds */
} group_ref;

/* A two-phase work item: shrink (group, first token, first rank row) or expand (group, first
 * column, width). */
typedef struct {
    const group_ref *ref;
    int64_t start, extent;
} item;

static int by_work_desc(const void *p, const void *q) {
    int64_t a = (*(const group_ref *const *)p)->work, b = (*(const group_ref *const *)q)->work;
    return (a < b) - (a > b);
}

/* ---- scratch memory ------------------------------------------------------------------------------
 * Each thread keeps grow-only arenas across calls: a decode step makes ~120 calls, and buffers of
 * ~100 KB malloc'd and freed in every call went back to the OS and were faulted in again. An
 * arena is never freed: it is as big as the largest call needed, and OpenMP threads live as long
 * as the process. */
typedef struct {
    char *base;
    size_t size, used;
} arena;

static __thread arena plan_arena, work_arena;

#define ARENA_ALIGN 64
#define ARENA_BYTES(n, type) ((((size_t)(n) * sizeof(type)) + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN)

/* Empty the arena and make room for `bytes`; -1 when out of memory. */
static int arena_reset(arena *a, size_t bytes) {
    a->used = 0;
    if (a->size >= bytes) return 0;
    free(a->base);
    a->base = aligned_alloc(ARENA_ALIGN, bytes);
    a->size = a->base ? bytes : 0;
    return a->base ? 0 : -1;
}

/* The next ARENA_BYTES(n, type) of an arena reset for at least that much more. */
#define ARENA_TAKE(a, n, type) ((type *)arena_take((a), ARENA_BYTES(n, type)))
static void *arena_take(arena *a, size_t bytes) {
    void *p = a->base + a->used;
    a->used += bytes;
    return p;
}

/* The delta of every problem, for x rows of `in` elements (x_stride apart). Returns 0, or -1 when
 * out of memory. */
static int run_call(const void *x, int x_dtype, int64_t x_stride, int64_t num_tokens, int64_t in, const void *pool,
                    int pool_dtype, const lora_problem *const *problems, int num_problems, int num_threads,
                    int fixed_order) {
    /* Sizes first (work lists at their largest, as if nothing were fused), then one arena. */
    int64_t G = 0, max_rank = 0, max_out = 0, work = 0, n_decode = 0, n_tile = 0, max_shrink = 0, max_expand = 0,
            max_h = 0;
    for (int p = 0; p < num_problems; p++) {
        const lora_problem *pr = problems[p];
        const int64_t *plan = pr->plan, Gp = pr->num_groups;
        if (pr->out_features > max_out) max_out = pr->out_features;
        for (int64_t g = 0; g < Gp; g++) {
            int64_t r = plan[Gp + g] - plan[g], n = plan[2 * Gp + g + 1] - plan[2 * Gp + g];
            G++;
            if (r > max_rank) max_rank = r;
            work += r * n * (in + pr->out_features);
            n_decode += n <= STREAM_TOKENS;
            n_tile += n >= TILE_MIN_TOKENS && n <= STREAM_TOKENS;
            max_shrink += ((n + TOKEN_TILE - 1) / TOKEN_TILE) * ((r + CHUNK_ROWS - 1) / CHUNK_ROWS);
            max_expand += (pr->out_features + COL_BLOCK - 1) / COL_BLOCK;
            max_h += r * n;
        }
    }
    if (G == 0) return 0;
    /* Tiles read x in the chunk order of bf16 rows: every token is put in that order once per call,
     * not once per group of each problem (q, k and v share x). */
    const int64_t chunk_rows = n_tile && pool_dtype == DT_BF16 ? num_tokens : 0;
    size_t plan_bytes = ARENA_BYTES(G, group_ref) + ARENA_BYTES(max_shrink, item) + ARENA_BYTES(max_expand, item) +
                        ARENA_BYTES(G, group_ref *) + ARENA_BYTES(max_h, float) +
                        ARENA_BYTES(num_tokens, float *) +
                        (x_dtype == DT_F32 ? 0 : ARENA_BYTES(num_tokens * in, float)) +
                        ARENA_BYTES(num_tokens, const float *) + ARENA_BYTES(chunk_rows * in, float);
    if (arena_reset(&plan_arena, plan_bytes)) return -1;
    group_ref *refs = ARENA_TAKE(&plan_arena, G, group_ref);
    item *shrink_items = ARENA_TAKE(&plan_arena, max_shrink, item);
    item *expand_items = ARENA_TAKE(&plan_arena, max_expand, item);
    const group_ref **fused = ARENA_TAKE(&plan_arena, G, const group_ref *);
    float *h = ARENA_TAKE(&plan_arena, max_h, float);
    /* x rows as fp32: pointers into x itself, or into a widened copy. */
    const float **x_rows = ARENA_TAKE(&plan_arena, num_tokens, const float *);
    float *x_wide = x_dtype == DT_F32 ? NULL : ARENA_TAKE(&plan_arena, num_tokens * in, float);
    /* The rows tiles read: x_rows, or the same rows in chunk order. */
    const float **tile_rows = chunk_rows ? ARENA_TAKE(&plan_arena, num_tokens, const float *) : x_rows;
    float *x_chunk = ARENA_TAKE(&plan_arena, chunk_rows * in, float);

    int64_t k = 0;
    for (int p = 0; p < num_problems; p++) {
        const lora_problem *pr = problems[p];
        const int64_t *plan = pr->plan, Gp = pr->num_groups;
        for (int64_t g = 0; g < Gp; g++, k++) {
            int64_t r = plan[Gp + g] - plan[g], n = plan[2 * Gp + g + 1] - plan[2 * Gp + g];
            refs[k] = (group_ref){pr,
                                  pr->a_offsets + plan[g],
                                  pr->b_offsets + plan[g],
                                  pr->tokens + plan[2 * Gp + g],
                                  r,
                                  n,
                                  pr->scales[g],
                                  0,
                                  r * n * (in + pr->out_features)};
        }
    }
    if (work < PARALLEL_MIN_WORK) num_threads = 1;
    /* With enough few-token groups to share out, each is one work item that runs its shrink and
     * then its expand with no barrier in between, and the groups, biggest first, balance the
     * threads. With fewer, a group's rows are split over the threads in the two phases below. */
    int fuse = !fixed_order && n_decode >= 2 * num_threads;
    /* Groups of at most this many tokens expand by streaming their B^T rows (none in fixed order). */
    const int64_t stream_tokens = fixed_order ? 0 : STREAM_TOKENS;
    const int reorder = fuse && chunk_rows;

    int64_t n_shrink = 0, n_expand = 0, n_fused = 0, h_size = 0;
    for (int64_t i = 0; i < G; i++) {
        group_ref *ref = &refs[i];
        int64_t r = ref->rank, n = ref->num_tokens, out_f = ref->p->out_features;
        int stream = n <= stream_tokens;
        if (fuse && stream) {
            n_fused++;
            continue;
        }
        ref->h_start = h_size;
        h_size += r * n;
        n_shrink += ((n + TOKEN_TILE - 1) / TOKEN_TILE) * ((r + CHUNK_ROWS - 1) / CHUNK_ROWS);
        n_expand += (out_f + (stream ? STREAM_COLS : COL_BLOCK) - 1) / (stream ? STREAM_COLS : COL_BLOCK);
    }
    int64_t s_item = 0, e_item = 0, f_item = 0;
    for (int64_t i = 0; i < G; i++) {
        const group_ref *ref = &refs[i];
        int64_t r = ref->rank, n = ref->num_tokens, out_f = ref->p->out_features;
        if (fuse && n <= STREAM_TOKENS) {
            fused[f_item++] = ref;
            continue;
        }
        for (int64_t t0 = 0; t0 < n; t0 += TOKEN_TILE)
            for (int64_t j0 = 0; j0 < r; j0 += CHUNK_ROWS) shrink_items[s_item++] = (item){ref, t0, j0};
        int64_t width = n <= stream_tokens ? STREAM_COLS : COL_BLOCK;
        for (int64_t c0 = 0; c0 < out_f; c0 += width)
            expand_items[e_item++] = (item){ref, c0, out_f - c0 < width ? out_f - c0 : width};
    }
    qsort(fused, n_fused, sizeof(group_ref *), by_work_desc);
    int failed = 0;
    const size_t esize = x_dtype == DT_F32 ? 4 : 2;
    /* fp32 x needs no widening: its row pointers are set here rather than behind a barrier. */
    if (x_dtype == DT_F32)
        for (int64_t t = 0; t < num_tokens; t++) x_rows[t] = (const float *)((const char *)x + t * x_stride * esize);

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int64_t rank_room = max_rank ? max_rank : 1;
        size_t work_bytes = ARENA_BYTES(SHRINK_ROWS * in, float) + ARENA_BYTES(rank_room * COL_BLOCK, float) +
                            ARENA_BYTES(STREAM_TOKENS * STREAM_COLS, float) +
                            ARENA_BYTES(STREAM_TOKENS * rank_room, float) + ARENA_BYTES(TOKEN_TILE, float *) +
                            ARENA_BYTES(STREAM_TOKENS * max_out, float) +
                            ARENA_BYTES(rank_room, char *);
        int mine_ok = arena_reset(&work_arena, work_bytes) == 0;
        float *a_buf = NULL, *b_buf = NULL, *sums = NULL, *h_fused = NULL;
        const float **xs = NULL;
        tile_scratch tiles = {0};
        if (mine_ok) {
            a_buf = ARENA_TAKE(&work_arena, SHRINK_ROWS * in, float);
            b_buf = ARENA_TAKE(&work_arena, rank_room * COL_BLOCK, float);
            sums = ARENA_TAKE(&work_arena, STREAM_TOKENS * STREAM_COLS, float);
            h_fused = ARENA_TAKE(&work_arena, STREAM_TOKENS * rank_room, float);
            xs = ARENA_TAKE(&work_arena, TOKEN_TILE, const float *);
            tiles = (tile_scratch){h_fused,
                                   ARENA_TAKE(&work_arena, STREAM_TOKENS * max_out, float),
                                   ARENA_TAKE(&work_arena, rank_room, const char *)};
        } else {
#pragma omp atomic write
            failed = 1;
        }
        float acc_out[COL_BLOCK];

        if (x_dtype != DT_F32 || reorder) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < num_tokens; t++) {
                if (x_dtype != DT_F32) {
                    const void *src = (const char *)x + (size_t)t * x_stride * esize;
                    x_rows[t] = row_f32(src, 0, x_dtype, in, x_wide + t * in);
                }
                if (reorder) tile_rows[t] = to_chunk_order(x_rows[t], in, pool_dtype, x_chunk + t * in);
            }
        }

        /* nowait: these items share nothing with the two phases below. */
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t it = 0; it < n_fused; it++) {
            if (!mine_ok) continue;
            const group_ref *ref = fused[it];
            const lora_problem *pr = ref->p;
            int64_t n = ref->num_tokens;
            const float *const *rows = n >= TILE_MIN_TOKENS ? tile_rows : x_rows;
            const float *gx[STREAM_TOKENS];
            for (int64_t t = 0; t < n; t++) gx[t] = rows[ref->tokens[t]];
            if (n >= TILE_MIN_TOKENS)
                tile_group(pool, pool_dtype, ref->a_off, ref->b_off, ref->rank, ref->scale, gx, n, ref->tokens, in,
                           pr->out_features, pr->out, (int)pr->out_dtype, pr->out_stride, &tiles);
            else
                stream_group(pool, pool_dtype, ref->a_off, ref->b_off, ref->rank, ref->scale, gx, n, ref->tokens,
                             in, pr->out_features, pr->out, (int)pr->out_dtype, pr->out_stride, h_fused, sums);
        }

        if (n_shrink) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_shrink; it++) {
                if (!mine_ok) continue;
                const group_ref *ref = shrink_items[it].ref;
                int64_t r = ref->rank, n = ref->num_tokens;
                int64_t t0 = shrink_items[it].start, j0 = shrink_items[it].extent;
                int ntok = (int)(n - t0 < TOKEN_TILE ? n - t0 : TOKEN_TILE);
                int64_t j_end = j0 + CHUNK_ROWS < r ? j0 + CHUNK_ROWS : r;
                for (int t = 0; t < ntok; t++) xs[t] = x_rows[ref->tokens[t0 + t]];
                for (int64_t j = j0; j < j_end; j += SHRINK_ROWS) {
                    int nr = (int)(j_end - j < SHRINK_ROWS ? j_end - j : SHRINK_ROWS);
                    float *hg = h + ref->h_start + t0 * r;
                    const void *a[SHRINK_ROWS] = {0};
                    /* Widened once into a_buf: a tile re-reads each row for up to 64 tokens. */
                    for (int i = 0; i < nr; i++)
                        a[i] = row_f32(pool, ref->a_off[j + i], pool_dtype, in, a_buf + i * in);
                    shrink_rows(a, nr, xs, ntok, in, ref->scale, hg, (int)r, (int)j, NULL, 0, DT_F32);
                }
            }
        }

        if (n_expand) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_expand; it++) {
                if (!mine_ok) continue;
                const group_ref *ref = expand_items[it].ref;
                const lora_problem *pr = ref->p;
                int64_t r = ref->rank, n = ref->num_tokens, c0 = expand_items[it].start;
                int cw = (int)expand_items[it].extent;
                const int64_t *toks = ref->tokens, *b_off = ref->b_off;
                int out_dtype = (int)pr->out_dtype;
                if (n <= stream_tokens) {
                    stream_expand(pool, pool_dtype, b_off, r, h + ref->h_start, n, toks, c0, cw,
                                  pr->out_features, sums, pr->out, out_dtype, pr->out_stride);
                    continue;
                }
                /* B^T block [r, COL_BLOCK] in fp32, zero-padded past the last column. */
                for (int64_t j = 0; j < r; j++) {
                    float *dst = b_buf + j * COL_BLOCK;
                    const float *row = row_f32(pool, b_off[j] + c0, pool_dtype, cw, dst);
                    if (row != dst) memcpy(dst, row, sizeof(float) * cw);
                    for (int c = cw; c < COL_BLOCK; c++) dst[c] = 0.0f;
                }
                const float *hg = h + ref->h_start;
                for (int64_t t = 0; t < n; t++) {
                    v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, s4 = {0}, s5 = {0}, s6 = {0}, s7 = {0};
                    for (int64_t j = 0; j < r; j++) {
                        const float *b = b_buf + j * COL_BLOCK;
                        float hv = hg[t * r + j];
                        v8f hb = {hv, hv, hv, hv, hv, hv, hv, hv};
                        s0 += hb * *(const v8f_u *)(b + 0);
                        s1 += hb * *(const v8f_u *)(b + 8);
                        s2 += hb * *(const v8f_u *)(b + 16);
                        s3 += hb * *(const v8f_u *)(b + 24);
                        s4 += hb * *(const v8f_u *)(b + 32);
                        s5 += hb * *(const v8f_u *)(b + 40);
                        s6 += hb * *(const v8f_u *)(b + 48);
                        s7 += hb * *(const v8f_u *)(b + 56);
                    }
                    *(v8f_u *)(acc_out + 0) = s0, *(v8f_u *)(acc_out + 8) = s1;
                    *(v8f_u *)(acc_out + 16) = s2, *(v8f_u *)(acc_out + 24) = s3;
                    *(v8f_u *)(acc_out + 32) = s4, *(v8f_u *)(acc_out + 40) = s5;
                    *(v8f_u *)(acc_out + 48) = s6, *(v8f_u *)(acc_out + 56) = s7;
                    const size_t out_esize = out_dtype == DT_F32 ? 4 : 2;
                    char *dst = (char *)pr->out + ((size_t)toks[t] * pr->out_stride + c0) * out_esize;
                    add_into(dst, out_dtype, acc_out, cw);
                }
            }
        }
    }
    return failed ? -1 : 0;
}

/* The arguments of one call, in one struct: the ctypes caller prepares it once per set of problems
 * and then sets only x and the outs, instead of converting ten arguments on every call. Every field
 * is 8 bytes, as in lora_problem. */
typedef struct {
    const void *x;      /* num_tokens rows of `in` elements of x_dtype, x_stride apart */
    int64_t x_dtype;
    int64_t x_stride;
    int64_t num_tokens;
    int64_t in;
    const void *pool;   /* the unified pool, of pool_dtype */
    int64_t pool_dtype;
    const lora_problem *const *problems;
    int64_t num_problems;
    int64_t num_threads;
    int64_t fixed_order; /* nonzero: every token's delta in one order, whatever its group (see top) */
} lora_call;

/* The delta of every problem of the call. Returns 0, or -1 when out of memory. */
int lora_delta(const lora_call *c) {
    return run_call(c->x, (int)c->x_dtype, c->x_stride, c->num_tokens, c->in, c->pool, (int)c->pool_dtype,
                    c->problems, (int)c->num_problems, (int)c->num_threads, (int)c->fixed_order);
}
