/* Multi-adapter LoRA delta on the CPU (S-LoRA's MBGMM/MBGMV, gathering rows from the unified pool).
 *
 * out[t] += scale_g * (x[t] @ A_g^T) @ B_g^T for every token t of every group g, where a group is
 * the tokens of one batch that share one adapter and scale (cpu_native.py builds the plan from
 * LoraSegments.groups). A_g row j is pool[a_off[j] : a_off[j] + in] and B_g^T row j is
 * pool[b_off[j] : b_off[j] + out].
 *
 * Two phases in one OpenMP region:
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

/* h[t * hs + j + i] = scale * dot(a[i], x[t]) for i < nr (nr <= SHRINK_ROWS) and each token. */
static void shrink_rows(const float *const *a, int nr, const float *const *xs, int ntok, int64_t in,
                        float scale, float *h, int hs, int j) {
    const float *r0 = a[0], *r1 = a[nr > 1], *r2 = a[nr > 2 ? 2 : 0], *r3 = a[nr > 3 ? 3 : 0];
    int64_t vec_end = in - in % 8;
    for (int t = 0; t < ntok; t++) {
        const float *x = xs[t];
        /* Two sums per row over alternate vectors: eight independent FMA chains hide the FMA
         * latency that four chains (one per row) left exposed. */
        v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, u0 = {0}, u1 = {0}, u2 = {0}, u3 = {0};
        int64_t k = 0;
        for (; k + 16 <= vec_end; k += 16) {
            v8f xv = *(const v8f_u *)(x + k), xw = *(const v8f_u *)(x + k + 8);
            s0 += xv * *(const v8f_u *)(r0 + k);
            s1 += xv * *(const v8f_u *)(r1 + k);
            s2 += xv * *(const v8f_u *)(r2 + k);
            s3 += xv * *(const v8f_u *)(r3 + k);
            u0 += xw * *(const v8f_u *)(r0 + k + 8);
            u1 += xw * *(const v8f_u *)(r1 + k + 8);
            u2 += xw * *(const v8f_u *)(r2 + k + 8);
            u3 += xw * *(const v8f_u *)(r3 + k + 8);
        }
        if (k < vec_end) {
            v8f xv = *(const v8f_u *)(x + k);
            s0 += xv * *(const v8f_u *)(r0 + k);
            s1 += xv * *(const v8f_u *)(r1 + k);
            s2 += xv * *(const v8f_u *)(r2 + k);
            s3 += xv * *(const v8f_u *)(r3 + k);
        }
        float d[SHRINK_ROWS] = {hsum(s0 + u0), hsum(s1 + u1), hsum(s2 + u2), hsum(s3 + u3)};
        for (int64_t k = vec_end; k < in; k++) {
            d[0] += x[k] * r0[k];
            d[1] += x[k] * r1[k];
            d[2] += x[k] * r2[k];
            d[3] += x[k] * r3[k];
        }
        for (int i = 0; i < nr; i++) h[(int64_t)t * hs + j + i] = scale * d[i];
    }
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
    return __builtin_convertvector(*(const v8h_u *)((const _Float16 *)row + k), v8f);
}

static inline __attribute__((always_inline)) float load1(const void *row, int64_t k, int dtype) {
    if (dtype == DT_F32) return ((const float *)row)[k];
    if (dtype == DT_BF16) return bf16_to_f32(((const uint16_t *)row)[k]);
    return f16_to_f32(((const uint16_t *)row)[k]);
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
    int dtype) {
    const void *r0 = b[0], *r1 = b[nr > 1], *r2 = b[nr > 2 ? 2 : 0], *r3 = b[nr > 3 ? 3 : 0];
    int vec_end = cw - cw % 8;
    int64_t t = 0;
    for (; t + 2 <= ntok; t += 2) {
        const float *ha = hj + t * hs, *hb = ha + hs;
        BROADCAST4(ha, nr, a0, a1, a2, a3);
        BROADCAST4(hb, nr, c0, c1, c2, c3);
        float *acc_a = sums + t * cw, *acc_b = acc_a + cw;
        for (int c = 0; c < vec_end; c += 8) {
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
                        int cw, int dtype) {
    if (dtype == DT_F32) expand_rows_t(b, nr, hj, hs, ntok, sums, cw, DT_F32);
    else if (dtype == DT_BF16) expand_rows_t(b, nr, hj, hs, ntok, sums, cw, DT_BF16);
    else expand_rows_t(b, nr, hj, hs, ntok, sums, cw, DT_F16);
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

/* Per group g: rank rows plan[0*G + g] .. plan[1*G + g] (indices into a_off/b_off), tokens
 * tok_idx[plan[2*G + g] .. plan[2*G + g + 1]]; scales[g]. Returns 0, or -1 when out of memory. */
int lora_delta(const void *x, int x_dtype, int64_t x_stride, int64_t num_tokens, const void *pool,
               int pool_dtype, void *out, int out_dtype, int64_t out_stride, int64_t in, int64_t out_f,
               const int64_t *a_off, const int64_t *b_off, int64_t num_groups, const int64_t *plan,
               const int64_t *tok_idx, const float *scales, int num_threads) {
    const int64_t G = num_groups;
    const int64_t *rank_start = plan, *rank_end = plan + G, *tok_start = plan + 2 * G;
    if (G == 0) return 0;

    /* Offsets of each group's h block ([tokens, rank], fp32) and the work lists. */
    int64_t *h_start = malloc(sizeof(int64_t) * (G + 1));
    int64_t n_shrink = 0, max_rank = 0, work = 0;
    if (!h_start) return -1;
    h_start[0] = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
        h_start[g + 1] = h_start[g] + r * n;
        n_shrink += ((n + TOKEN_TILE - 1) / TOKEN_TILE) * ((r + CHUNK_ROWS - 1) / CHUNK_ROWS);
        if (r > max_rank) max_rank = r;
        work += r * n * (in + out_f);
    }
    if (work < PARALLEL_MIN_WORK) num_threads = 1;
    int64_t n_expand = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t width = tok_start[g + 1] - tok_start[g] <= STREAM_TOKENS ? STREAM_COLS : COL_BLOCK;
        n_expand += (out_f + width - 1) / width;
    }
    int64_t *shrink_items = malloc(sizeof(int64_t) * 3 * (n_shrink ? n_shrink : 1));
    int64_t *expand_items = malloc(sizeof(int64_t) * 3 * (n_expand ? n_expand : 1));
    float *h = malloc(sizeof(float) * (h_start[G] ? h_start[G] : 1));
    /* x rows as fp32: pointers into x itself, or into a widened copy of the tokens used. */
    const float **x_rows = malloc(sizeof(float *) * (num_tokens ? num_tokens : 1));
    float *x_wide = NULL;
    int ok = shrink_items && expand_items && h && x_rows;
    if (ok && x_dtype != DT_F32) {
        x_wide = malloc(sizeof(float) * (num_tokens ? num_tokens : 1) * in);
        ok = x_wide != NULL;
    }
    if (!ok) {
        free(h_start), free(shrink_items), free(expand_items), free(h), free(x_rows), free(x_wide);
        return -1;
    }
    int64_t item = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
        for (int64_t t0 = 0; t0 < n; t0 += TOKEN_TILE)
            for (int64_t j0 = 0; j0 < r; j0 += CHUNK_ROWS) {
                shrink_items[3 * item] = g;
                shrink_items[3 * item + 1] = t0;
                shrink_items[3 * item + 2] = j0;
                item++;
            }
    }
    item = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t width = tok_start[g + 1] - tok_start[g] <= STREAM_TOKENS ? STREAM_COLS : COL_BLOCK;
        for (int64_t c0 = 0; c0 < out_f; c0 += width) {
            expand_items[3 * item] = g;
            expand_items[3 * item + 1] = c0;
            expand_items[3 * item + 2] = out_f - c0 < width ? out_f - c0 : width;
            item++;
        }
    }
    int64_t used_tokens = tok_start[G];
    int failed = 0;
    const size_t esize = x_dtype == DT_F32 ? 4 : 2;
    const size_t pool_esize = pool_dtype == DT_F32 ? 4 : 2;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *a_buf = malloc(sizeof(float) * SHRINK_ROWS * in);
        float *b_buf = malloc(sizeof(float) * (max_rank ? max_rank : 1) * COL_BLOCK);
        float *sums = malloc(sizeof(float) * STREAM_TOKENS * STREAM_COLS);
        const float **xs = malloc(sizeof(float *) * TOKEN_TILE);
        float acc_out[COL_BLOCK];
        int mine_ok = a_buf && b_buf && sums && xs;
        if (!mine_ok) {
#pragma omp atomic write
            failed = 1;
        }

#pragma omp for schedule(static)
        for (int64_t i = 0; i < used_tokens; i++) {
            int64_t t = tok_idx[i];
            const void *src = (const char *)x + (size_t)t * x_stride * esize;
            x_rows[t] = row_f32(src, 0, x_dtype, in, x_wide ? x_wide + t * in : NULL);
        }

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
                const float *a[SHRINK_ROWS] = {0};
                for (int i = 0; i < nr; i++)
                    a[i] = row_f32(pool, a_off[rank_start[g] + j + i], pool_dtype, in, a_buf + i * in);
                shrink_rows(a, nr, xs, ntok, in, scales[g], hg, (int)r, (int)j);
            }
        }

#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_expand; it++) {
            if (!mine_ok) continue;
            int64_t g = expand_items[3 * it], c0 = expand_items[3 * it + 1];
            int cw = (int)expand_items[3 * it + 2];
            int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
            const size_t out_esize = out_dtype == DT_F32 ? 4 : 2;
            if (n <= STREAM_TOKENS) {
                const float *hg = h + h_start[g];
                memset(sums, 0, sizeof(float) * n * cw);
                for (int64_t j = 0; j < r; j += 4) {
                    int nr = (int)(r - j < 4 ? r - j : 4);
                    const void *b[4] = {0};
                    for (int i = 0; i < nr; i++)
                        b[i] = (const char *)pool + (b_off[rank_start[g] + j + i] + c0) * pool_esize;
                    expand_rows(b, nr, hg + j, r, n, sums, cw, pool_dtype);
                }
                for (int64_t t = 0; t < n; t++) {
                    int64_t row = tok_idx[tok_start[g] + t];
                    add_into((char *)out + ((size_t)row * out_stride + c0) * out_esize, out_dtype, sums + t * cw, cw);
                }
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
        free(a_buf), free(b_buf), free(sums), free(xs);
    }
    free(h_start), free(shrink_items), free(expand_items), free(h), free(x_rows), free(x_wide);
    return failed ? -1 : 0;
}
