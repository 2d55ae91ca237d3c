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
 *   expand: work items (group, block of output columns). The block of every B^T row is widened to
 *           fp32 once into a small buffer, then each token's fp32 sum over the rank stays in
 *           registers and is added to out once (one rounding, as the torch reference does).
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
#define COL_BLOCK 64    /* output columns per expand work item: 8 vectors of accumulators */
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
        v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (int64_t k = 0; k < vec_end; k += 8) {
            v8f xv = *(const v8f_u *)(x + k);
            s0 += xv * *(const v8f_u *)(r0 + k);
            s1 += xv * *(const v8f_u *)(r1 + k);
            s2 += xv * *(const v8f_u *)(r2 + k);
            s3 += xv * *(const v8f_u *)(r3 + k);
        }
        float d[SHRINK_ROWS] = {hsum(s0), hsum(s1), hsum(s2), hsum(s3)};
        for (int64_t k = vec_end; k < in; k++) {
            d[0] += x[k] * r0[k];
            d[1] += x[k] * r1[k];
            d[2] += x[k] * r2[k];
            d[3] += x[k] * r3[k];
        }
        for (int i = 0; i < nr; i++) h[(int64_t)t * hs + j + i] = scale * d[i];
    }
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
    int64_t col_blocks = (out_f + COL_BLOCK - 1) / COL_BLOCK;
    int64_t n_expand = G * col_blocks;
    int64_t *shrink_items = malloc(sizeof(int64_t) * 3 * (n_shrink ? n_shrink : 1));
    float *h = malloc(sizeof(float) * (h_start[G] ? h_start[G] : 1));
    /* x rows as fp32: pointers into x itself, or into a widened copy of the tokens used. */
    const float **x_rows = malloc(sizeof(float *) * (num_tokens ? num_tokens : 1));
    float *x_wide = NULL;
    int ok = shrink_items && h && x_rows;
    if (ok && x_dtype != DT_F32) {
        x_wide = malloc(sizeof(float) * (num_tokens ? num_tokens : 1) * in);
        ok = x_wide != NULL;
    }
    if (!ok) {
        free(h_start), free(shrink_items), free(h), free(x_rows), free(x_wide);
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
    int64_t used_tokens = tok_start[G];
    int failed = 0;
    const size_t esize = x_dtype == DT_F32 ? 4 : 2;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *a_buf = malloc(sizeof(float) * SHRINK_ROWS * in);
        float *b_buf = malloc(sizeof(float) * max_rank * COL_BLOCK);
        const float **xs = malloc(sizeof(float *) * TOKEN_TILE);
        float acc_out[COL_BLOCK];
        int mine_ok = a_buf && b_buf && xs;
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
                const float *a[SHRINK_ROWS] = {0};
                for (int i = 0; i < nr; i++)
                    a[i] = row_f32(pool, a_off[rank_start[g] + j + i], pool_dtype, in, a_buf + i * in);
                shrink_rows(a, nr, xs, ntok, in, scales[g], h + h_start[g] + t0 * r, (int)r, (int)j);
            }
        }

#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_expand; it++) {
            if (!mine_ok) continue;
            int64_t g = it / col_blocks, c0 = (it % col_blocks) * COL_BLOCK;
            int64_t r = rank_end[g] - rank_start[g], n = tok_start[g + 1] - tok_start[g];
            int cw = (int)(out_f - c0 < COL_BLOCK ? out_f - c0 : COL_BLOCK);
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
                char *dst = (char *)out + ((size_t)row * out_stride + c0) * (out_dtype == DT_F32 ? 4 : 2);
                add_into(dst, out_dtype, acc_out, cw);
            }
        }
        free(a_buf), free(b_buf), free(xs);
    }
    free(h_start), free(shrink_items), free(h), free(x_rows), free(x_wide);
    return failed ? -1 : 0;
}
