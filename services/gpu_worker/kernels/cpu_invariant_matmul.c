/* The base model's matmuls, batch-invariant: y = x @ W^T (+ b), every output computed as one dot
 * product in one fixed order (8 lanes over k, `hsum`, scalar tail), whatever the number of rows.
 *
 * A library GEMM picks its kernel by shape (MKL runs one row as a GEMV and rounds it differently
 * from the same row among others; oneDNN picks AMX, AVX-512 or brgemm blockings by M), so a
 * request's logits changed with its batch. Here a register tile of TILE_ROWS rows of x by
 * TILE_COLS rows of W computes each of its dot products with the same instructions, and a tile
 * at an edge repeats its last valid row or column instead of switching code. Work items are
 * blocks of rows x columns, spread over the threads; each value is computed by one thread.
 *
 * Weights are read in their storage dtype and widened in registers (bf16 on a CPU without bf16
 * units: no fp32 copy of the weights, no scratch pass; many-row calls widen each block once),
 * math is fp32, y is rounded once. Cost: the rows that really exist, no padding; decode (few
 * rows) is bound by reading the weights, prefill reaches about 80% of MKL's rate here.
 */

#include <stdlib.h>

#include "cpu_invariant.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define TILE_ROWS 4   /* x rows per register tile */
#define TILE_COLS 3   /* W rows per tile: 12 sums + 3 W vectors + 1 x vector = 16 AVX registers */
#define BLOCK_COLS 48  /* W rows one work item keeps in cache while its row tiles pass over them */
#define BLOCK_ROWS 128 /* x rows of one work item: they stay in L2 while W streams past (prefill) */
/* From this many rows on, a block of 16-bit W is widened to fp32 once (exactly: the same values)
 * rather than in registers by every row tile: prefill-sized calls run at the fp32 rate. */
#define WIDEN_MIN_ROWS 16
/* Below this many multiply-adds one thread is done before a second one would have started. */
#define PARALLEL_MIN_WORK 1000000

/* s[i][j] = dot(x[i], w[j]) over k < n for i < MR rows of fp32 x and TILE_COLS rows of w. */
static inline __attribute__((always_inline)) void dot_tile(const float *const *x, const void *const *w,
                                                           int64_t n, int wdt, float s[TILE_ROWS][TILE_COLS],
                                                           const int MR) {
    v8f acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < TILE_COLS; j++) acc[i][j] = splat8(0.0f);
    const int64_t n8 = n - n % 8;
    for (int64_t k = 0; k < n8; k += 8) {
        v8f w0 = load8(w[0], k, wdt), w1 = load8(w[1], k, wdt), w2 = load8(w[2], k, wdt);
        IN_REGISTER(w0);
        IN_REGISTER(w1);
        IN_REGISTER(w2);
        for (int i = 0; i < MR; i++) {
            v8f xv = *(const v8f_u *)(x[i] + k);
            IN_REGISTER(xv);
            acc[i][0] = FMA8(xv, w0, acc[i][0]);
            acc[i][1] = FMA8(xv, w1, acc[i][1]);
            acc[i][2] = FMA8(xv, w2, acc[i][2]);
        }
    }
    /* The sums in groups of four (hsum4 gives each exactly hsum's value). */
    float sums[TILE_ROWS * TILE_COLS];
    v8f *flat = &acc[0][0];
    int count = MR * TILE_COLS;
    for (int g = 0; g < count; g += 4)
        hsum4(flat[g], flat[g + 1 < count ? g + 1 : g], flat[g + 2 < count ? g + 2 : g],
              flat[g + 3 < count ? g + 3 : g], sums + g);
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < TILE_COLS; j++) {
            float v = sums[i * TILE_COLS + j];
            for (int64_t k = n8; k < n; k++) v += x[i][k] * load1(w[j], k, wdt);
            s[i][j] = v;
        }
}

static void dot_tile_rows(const float *const *x, int mr, const void *const *w, int64_t n, int wdt,
                          float s[TILE_ROWS][TILE_COLS]) {
    /* Each row count is its own instance, so a tile never computes rows it does not have; the
     * instances differ only in how many rows they loop over, never in a dot product's steps. */
    if (wdt == DT_BF16) {
        if (mr == 4) dot_tile(x, w, n, DT_BF16, s, 4);
        else if (mr == 3) dot_tile(x, w, n, DT_BF16, s, 3);
        else if (mr == 2) dot_tile(x, w, n, DT_BF16, s, 2);
        else dot_tile(x, w, n, DT_BF16, s, 1);
    } else if (wdt == DT_F32) {
        if (mr == 4) dot_tile(x, w, n, DT_F32, s, 4);
        else if (mr == 3) dot_tile(x, w, n, DT_F32, s, 3);
        else if (mr == 2) dot_tile(x, w, n, DT_F32, s, 2);
        else dot_tile(x, w, n, DT_F32, s, 1);
    } else {
        if (mr == 4) dot_tile(x, w, n, DT_F16, s, 4);
        else if (mr == 3) dot_tile(x, w, n, DT_F16, s, 3);
        else if (mr == 2) dot_tile(x, w, n, DT_F16, s, 2);
        else dot_tile(x, w, n, DT_F16, s, 1);
    }
}

/* Each thread's x in fp32 when x is not fp32, and its block of W widened: grown, never freed
 * (OpenMP threads and the engine thread live as long as the process). */
static __thread float *wide_x, *wide_w;
static __thread size_t wide_x_elems, wide_w_elems;


/* The arguments of one call (every field 8 bytes: the ctypes mirror needs no padding rules). */
typedef struct {
    const void *x;        /* rows of in_features elements of x_dtype, x_stride apart */
    int64_t x_dtype;
    int64_t x_stride;
    int64_t rows;
    int64_t in_features;
    const void *w;        /* [out_features, in_features] of w_dtype, contiguous */
    int64_t w_dtype;
    int64_t out_features;
    const void *bias;     /* [out_features] of bias_dtype, or NULL */
    int64_t bias_dtype;
    void *y;              /* rows of out_features elements of y_dtype, y_stride apart */
    int64_t y_dtype;
    int64_t y_stride;
    int64_t num_threads;
} linear_call;

/* y = x @ W^T (+ bias). Returns 0, or -1 when out of memory. */
int invariant_linear(const linear_call *c) {
    const int64_t M = c->rows, K = c->in_features, N = c->out_features;
    if (M == 0 || N == 0) return 0;
    const int xdt = (int)c->x_dtype, wdt = (int)c->w_dtype, ydt = (int)c->y_dtype;
    const float *x32 = (const float *)c->x;
    int64_t x32_stride = c->x_stride;
    if (xdt != DT_F32) {
        if (!grown(&wide_x, &wide_x_elems, (size_t)(M * K))) return -1;
        for (int64_t m = 0; m < M; m++)
            widen_row((const char *)c->x + (size_t)m * c->x_stride * dtype_size(xdt), xdt, K, wide_x + m * K);
        x32 = wide_x;
        x32_stride = K;
    }
    const size_t wsize = dtype_size(wdt), ysize = dtype_size(ydt);
    const int64_t col_blocks = (N + BLOCK_COLS - 1) / BLOCK_COLS, row_blocks = (M + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int threads = (int)c->num_threads;
    if (M * N * K < PARALLEL_MIN_WORK || threads < 1) threads = 1;
    const int widen = wdt != DT_F32 && M >= WIDEN_MIN_ROWS;
    int failed = 0;

#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < row_blocks * col_blocks; item++) {
        const int64_t b = item % col_blocks, m_start = item / col_blocks * BLOCK_ROWS;
        const int64_t m_end = m_start + BLOCK_ROWS < M ? m_start + BLOCK_ROWS : M;
        const int64_t n0 = b * BLOCK_COLS, n1 = n0 + BLOCK_COLS < N ? n0 + BLOCK_COLS : N;
        const char *w_block = (const char *)c->w + (size_t)n0 * K * wsize;
        int w_dtype = wdt;
        size_t w_size = wsize;
        if (widen) {
            float *buf = grown(&wide_w, &wide_w_elems, (size_t)(BLOCK_COLS * K));
            if (!buf) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            for (int64_t n = n0; n < n1; n++) widen_row(w_block + (size_t)(n - n0) * K * wsize, wdt, K, buf + (n - n0) * K);
            w_block = (const char *)buf;
            w_dtype = DT_F32;
            w_size = sizeof(float);
        }
        for (int64_t m0 = m_start; m0 < m_end; m0 += TILE_ROWS) {
            const int mr = (int)(m_end - m0 < TILE_ROWS ? m_end - m0 : TILE_ROWS);
            const float *xs[TILE_ROWS];
            for (int i = 0; i < TILE_ROWS; i++) xs[i] = x32 + (m0 + (i < mr ? i : 0)) * x32_stride;
            for (int64_t n = n0; n < n1; n += TILE_COLS) {
                const int nc = (int)(n1 - n < TILE_COLS ? n1 - n : TILE_COLS);
                const void *ws[TILE_COLS];
                for (int j = 0; j < TILE_COLS; j++) ws[j] = w_block + (size_t)(n - n0 + (j < nc ? j : 0)) * K * w_size;
                float s[TILE_ROWS][TILE_COLS];
                dot_tile_rows(xs, mr, ws, K, w_dtype, s);
                for (int i = 0; i < mr; i++) {
                    char *yrow = (char *)c->y + (size_t)(m0 + i) * c->y_stride * ysize;
                    for (int j = 0; j < nc; j++) {
                        float v = s[i][j];
                        if (c->bias) v += load1(c->bias, n + j, (int)c->bias_dtype);
                        store1(yrow, n + j, ydt, v);
                    }
                }
            }
        }
    }
    return failed ? -1 : 0;
}
