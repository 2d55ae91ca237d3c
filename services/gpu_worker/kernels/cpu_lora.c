/* Multi-adapter LoRA delta on the CPU (S-LoRA's MBGMM/MBGMV, gathering rows from the unified pool).
 *
 * out[t] += scale_g * (x[t] @ A_g^T) @ B_g^T for every token t of every group g, where a group is
 * the tokens of one batch that share one adapter and scale (cpu_native.py builds the plan from
 * LoraSegments.groups). A_g row j is pool[a_off[j] : a_off[j] + in] and B_g^T row j is
 * pool[b_off[j] : b_off[j] + out].
 *
 * Decode batches with many adapters (at least two groups of <= STREAM_TOKENS tokens per thread):
 * each such group is one work item, biggest first, that streams its A rows straight from the pool
 * (widened in registers, each row read once for all its tokens) and then its B^T rows as the
 * expand below does, with no barrier in between; the next rows are software-prefetched, since
 * rows of 1-3 KiB end before the hardware prefetcher ramps up (a k = 32 bf16 decode step: 46 ms
 * of kernel time with adapters out of cache, 12.7 GB/s, became 34 ms, 17 GB/s).
 *
 * Other groups go through two phases in the same OpenMP region:
 *   shrink: work items (group, token tile, chunk of rank rows). Each A row of a chunk is widened to
 *           fp32 once and dotted with every token of the tile, so in a decode step (tiles hold all
 *           of a group's tokens) every A row is read from memory once.
 *   expand: groups of few tokens (decode) stream their B^T rows: work items (group, chunk of up
 *           to 512 columns) read each row's chunk as one contiguous run, four rows at a time
 *           widened in registers, into fp32 sums per token kept in L1 (64-column stripes of
 *           every row, the prefill layout below, made a k = 32 decode step's kernel time 1.5x
 *           longer: each stripe is only two cache lines of a row).
 *           Groups of many tokens (prefill) are compute-bound instead: work items (group, block
 *           of 64 columns) widen the block of every B^T row once into a small buffer and keep
 *           each token's sums in registers. Either way out gets one rounding, as the torch
 *           reference does.
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
#define STREAM_TOKENS 16 /* groups with at most this many tokens stream their B^T rows */
#define STREAM_COLS 512  /* output columns per streaming expand work item (1 KiB of a bf16 row) */
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

/* The cache lines `offset` bytes into each of the n rows `next`: the rows a caller reads after the
 * current ones. Rows of 1-3 KiB are too short for the hardware prefetcher to ramp up on, so
 * without this every row started with a full memory latency. */
static inline void prefetch_rows(const void *const *next, int n, int64_t offset) {
    for (int i = 0; i < n; i++) __builtin_prefetch((const char *)next[i] + offset);
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

typedef struct {
    int64_t work, group;
} fused_item;

static int by_work_desc(const void *p, const void *q) {
    int64_t a = ((const fused_item *)p)->work, b = ((const fused_item *)q)->work;
    return (a < b) - (a > b);
}

/* Per group g: rank rows plan[0*G + g] .. plan[1*G + g] (indices into a_off/b_off), tokens
 * tok_idx[plan[2*G + g] .. plan[2*G + g + 1]]; scales[g]. Returns 0, or -1 when out of memory. */
int lora_delta(const void *x, int x_dtype, int64_t x_stride, int64_t num_tokens, const void *pool,
               int pool_dtype, void *out, int out_dtype, int64_t out_stride, int64_t in, int64_t out_f,
               const int64_t *a_off, const int64_t *b_off, int64_t num_groups, const int64_t *plan,
               const int64_t *tok_idx, const float *scales, int num_threads) {
    const int64_t G = num_groups;
    const int64_t *rank_start = plan, *rank_end = plan + G, *tok_start = plan + 2 * G;
    if (G == 0) return 0;

    int64_t max_rank = 0, work = 0, n_stream = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
        if (r > max_rank) max_rank = r;
        work += r * n * (in + out_f);
        n_stream += n <= STREAM_TOKENS;
    }
    if (work < PARALLEL_MIN_WORK) num_threads = 1;
    /* With enough few-token groups to share out, each is one work item that runs its shrink and
     * then its expand: a thread streams the group's A rows and then its B^T rows with no barrier
     * in between, and the groups, biggest first, balance the threads. With fewer, a group's rows
     * are split over the threads in the two phases below. */
    int fuse = n_stream >= 2 * num_threads;

    /* Offsets of each group's h block ([tokens, rank], fp32) and the two-phase work lists. */
    int64_t *h_start = malloc(sizeof(int64_t) * (G + 1));
    int64_t n_shrink = 0, n_expand = 0, n_fused = 0;
    if (!h_start) return -1;
    h_start[0] = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
        int stream = n <= STREAM_TOKENS;
        h_start[g + 1] = h_start[g];
        if (fuse && stream) {
            n_fused++;
            continue;
        }
        h_start[g + 1] += r * n;
        n_shrink += ((n + TOKEN_TILE - 1) / TOKEN_TILE) * ((r + CHUNK_ROWS - 1) / CHUNK_ROWS);
        n_expand += (out_f + (stream ? STREAM_COLS : COL_BLOCK) - 1) / (stream ? STREAM_COLS : COL_BLOCK);
    }
    int64_t *shrink_items = malloc(sizeof(int64_t) * 3 * (n_shrink ? n_shrink : 1));
    int64_t *expand_items = malloc(sizeof(int64_t) * 3 * (n_expand ? n_expand : 1));
    fused_item *fused_items = malloc(sizeof(fused_item) * (n_fused ? n_fused : 1));
    float *h = malloc(sizeof(float) * (h_start[G] ? h_start[G] : 1));
    /* x rows as fp32: pointers into x itself, or into a widened copy of the tokens used. */
    const float **x_rows = malloc(sizeof(float *) * (num_tokens ? num_tokens : 1));
    float *x_wide = NULL;
    int ok = shrink_items && expand_items && fused_items && h && x_rows;
    if (ok && x_dtype != DT_F32) {
        x_wide = malloc(sizeof(float) * (num_tokens ? num_tokens : 1) * in);
        ok = x_wide != NULL;
    }
    if (!ok) {
        free(h_start), free(shrink_items), free(expand_items), free(fused_items), free(h), free(x_rows),
            free(x_wide);
        return -1;
    }
    int64_t item = 0, e_item = 0, f_item = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
        if (fuse && n <= STREAM_TOKENS) {
            fused_items[f_item].work = r * n * (in + out_f);
            fused_items[f_item++].group = g;
            continue;
        }
        for (int64_t t0 = 0; t0 < n; t0 += TOKEN_TILE)
            for (int64_t j0 = 0; j0 < r; j0 += CHUNK_ROWS) {
                shrink_items[3 * item] = g;
                shrink_items[3 * item + 1] = t0;
                shrink_items[3 * item + 2] = j0;
                item++;
            }
        int64_t width = n <= STREAM_TOKENS ? STREAM_COLS : COL_BLOCK;
        for (int64_t c0 = 0; c0 < out_f; c0 += width) {
            expand_items[3 * e_item] = g;
            expand_items[3 * e_item + 1] = c0;
            expand_items[3 * e_item + 2] = out_f - c0 < width ? out_f - c0 : width;
            e_item++;
        }
    }
    qsort(fused_items, n_fused, sizeof(fused_item), by_work_desc);
    int64_t used_tokens = tok_start[G];
    int failed = 0;
    const size_t esize = x_dtype == DT_F32 ? 4 : 2;
    const size_t pool_esize = pool_dtype == DT_F32 ? 4 : 2;
    const size_t out_esize = out_dtype == DT_F32 ? 4 : 2;
    /* fp32 x needs no widening: its row pointers are set here rather than behind a barrier. */
    if (x_dtype == DT_F32)
        for (int64_t i = 0; i < used_tokens; i++)
            x_rows[tok_idx[i]] = (const float *)((const char *)x + (size_t)tok_idx[i] * x_stride * esize);

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *a_buf = malloc(sizeof(float) * SHRINK_ROWS * in);
        float *b_buf = malloc(sizeof(float) * (max_rank ? max_rank : 1) * COL_BLOCK);
        float *sums = malloc(sizeof(float) * STREAM_TOKENS * STREAM_COLS);
        float *h_fused = malloc(sizeof(float) * STREAM_TOKENS * (max_rank ? max_rank : 1));
        const float **xs = malloc(sizeof(float *) * TOKEN_TILE);
        float acc_out[COL_BLOCK];
        int mine_ok = a_buf && b_buf && sums && h_fused && xs;
        if (!mine_ok) {
#pragma omp atomic write
            failed = 1;
        }

        if (x_dtype != DT_F32) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < used_tokens; i++) {
                int64_t t = tok_idx[i];
                const void *src = (const char *)x + (size_t)t * x_stride * esize;
                x_rows[t] = row_f32(src, 0, x_dtype, in, x_wide + t * in);
            }
        }

        /* nowait: these items share nothing with the two phases below. */
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t it = 0; it < n_fused; it++) {
            if (!mine_ok) continue;
            int64_t g = fused_items[it].group;
            int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
            const int64_t *toks = tok_idx + tok_start[g];
            for (int64_t t = 0; t < n; t++) xs[t] = x_rows[toks[t]];
            /* A rows straight from the pool: each is read once for all n tokens, so widening it
             * into a buffer first would only add a pass. */
            for (int64_t j = 0; j < r; j += SHRINK_ROWS) {
                int nr = (int)(r - j < SHRINK_ROWS ? r - j : SHRINK_ROWS);
                const void *a[SHRINK_ROWS] = {0}, *next[SHRINK_ROWS] = {0};
                for (int i = 0; i < nr; i++)
                    a[i] = (const char *)pool + a_off[rank_start[g] + j + i] * pool_esize;
                /* Next: the following A rows, else the first B^T rows the expand reads. */
                int64_t nj = j + nr < r ? j + nr : 0;
                const int64_t *next_off = j + nr < r ? a_off : b_off;
                int n_next = (int)(r - nj < SHRINK_ROWS ? r - nj : SHRINK_ROWS);
                for (int i = 0; i < n_next; i++)
                    next[i] = (const char *)pool + next_off[rank_start[g] + nj + i] * pool_esize;
                shrink_rows(a, nr, xs, (int)n, in, scales[g], h_fused, (int)r, (int)j, next, n_next,
                            pool_dtype);
            }
            for (int64_t c0 = 0; c0 < out_f; c0 += STREAM_COLS)
                stream_expand(pool, pool_dtype, b_off + rank_start[g], r, h_fused, n, toks, c0,
                              (int)(out_f - c0 < STREAM_COLS ? out_f - c0 : STREAM_COLS), out_f, sums, out,
                              out_dtype, out_stride);
        }

        if (n_shrink) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_shrink; it++) {
                if (!mine_ok) continue;
                int64_t g = shrink_items[3 * it], t0 = shrink_items[3 * it + 1], j0 = shrink_items[3 * it + 2];
                int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
                int ntok = (int)(n - t0 < TOKEN_TILE ? n - t0 : TOKEN_TILE);
                int64_t j_end = j0 + CHUNK_ROWS < r ? j0 + CHUNK_ROWS : r;
                for (int t = 0; t < ntok; t++) xs[t] = x_rows[tok_idx[tok_start[g] + t0 + t]];
                for (int64_t j = j0; j < j_end; j += SHRINK_ROWS) {
                    int nr = (int)(j_end - j < SHRINK_ROWS ? j_end - j : SHRINK_ROWS);
                    float *hg = h + h_start[g] + t0 * r;
                    const void *a[SHRINK_ROWS] = {0};
                    /* Widened once into a_buf: a tile re-reads each row for up to 64 tokens. */
                    for (int i = 0; i < nr; i++)
                        a[i] = row_f32(pool, a_off[rank_start[g] + j + i], pool_dtype, in, a_buf + i * in);
                    shrink_rows(a, nr, xs, ntok, in, scales[g], hg, (int)r, (int)j, NULL, 0, DT_F32);
                }
            }
        }

        if (n_expand) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_expand; it++) {
                if (!mine_ok) continue;
                int64_t g = expand_items[3 * it], c0 = expand_items[3 * it + 1];
                int cw = (int)expand_items[3 * it + 2];
                int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
                if (n <= STREAM_TOKENS) {
                    stream_expand(pool, pool_dtype, b_off + rank_start[g], r, h + h_start[g], n,
                                  tok_idx + tok_start[g], c0, cw, out_f, sums, out, out_dtype, out_stride);
                    continue;
                }
                /* B^T block [r, COL_BLOCK] in fp32, zero-padded past the last column. */
                for (int64_t j = 0; j < r; j++) {
                    float *dst = b_buf + j * COL_BLOCK;
                    const float *row = row_f32(pool, b_off[rank_start[g] + j] + c0, pool_dtype, cw, dst);
                    if (row != dst) memcpy(dst, row, sizeof(float) * cw);
                    for (int c = cw; c < COL_BLOCK; c++) dst[c] = 0.0f;
                }
                const float *hg = h + h_start[g];
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
                    int64_t row = tok_idx[tok_start[g] + t];
                    char *dst = (char *)out + ((size_t)row * out_stride + c0) * out_esize;
                    add_into(dst, out_dtype, acc_out, cw);
                }
            }
        }
        free(a_buf), free(b_buf), free(sums), free(h_fused), free(xs);
    }
    free(h_start), free(shrink_items), free(expand_items), free(fused_items), free(h), free(x_rows), free(x_wide);
    return failed ? -1 : 0;
}
