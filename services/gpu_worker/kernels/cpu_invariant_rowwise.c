/* The model's row-wise ops, batch-invariant: RMSNorm and the SwiGLU activation silu(gate) * up.
 *
 * torch computes these with vector loops whose scalar tails round differently (F.silu on an
 * element in a thread's tail calls std::exp, in the vector body Sleef's exp), and where the tails
 * fall depends on the tensor's length and the thread count, i.e. on the batch. Here every element
 * goes through the same vector code: a row's sum of squares in the fixed order of
 * cpu_invariant.h, exp as `exp8`. The roundings follow the torch path (HF's): the normalised row is
 * rounded to the compute dtype before the weight multiplies it; silu(gate) before up does.
 */

#include "cpu_invariant.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Rows per work item: one row is too little work to hand to a thread. */
#define ROWS_PER_ITEM 4
/* Below this many elements one thread is done before a second one starts. */
#define PARALLEL_MIN_ELEMS 65536
/* The same for SwiGLU, whose exp costs ~10x a norm's work per element (a batch of 8 rows of 1536
 * took 44 us in bf16 on one EPYC core). */
#define PARALLEL_MIN_SILU_ELEMS 8192

/* Every lane rounded to `dtype` (to nearest even) and widened back; fp32: unchanged. */
static inline __attribute__((always_inline)) v8f round8(v8f v, int dtype) {
    if (dtype == DT_F32) return v;
    if (dtype == DT_BF16) {
        v8u32 u;
        memcpy(&u, &v, sizeof u);
        v8i nan = (v8i)((u & 0x7fffffffu) > 0x7f800000u);
        v8u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        v8u32 quiet = (u & 0xffff0000u) | 0x00400000u;
        rounded = (v8u32)(((v8i)quiet & nan) | ((v8i)rounded & ~nan));
        memcpy(&v, &rounded, sizeof v);
        return v;
    }
#ifdef __F16C__
    return (v8f)_mm256_cvtph_ps(_mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
    for (int l = 0; l < 8; l++) v[l] = f16_to_f32(f32_to_f16(v[l]));
    return v;
#endif
}

/* n elements of a row of `dtype` from element k (n < 8): the rest of the lanes 0. */
static inline __attribute__((always_inline)) v8f load_tail(const void *row, int64_t k, int n, int dtype) {
    v8f v = splat8(0.0f);
    for (int l = 0; l < n; l++) v[l] = load1(row, k + l, dtype);
    return v;
}

/* Store the first n lanes (all 8 when n is 8) of fp32 `v` as elements k.. of a row of `dtype`. */
static inline __attribute__((always_inline)) void store8(void *row, int64_t k, int n, int dtype, v8f v) {
    if (dtype == DT_F32 && n == 8) {
        *(v8f_u *)((float *)row + k) = v;
        return;
    }
    v = round8(v, dtype);
    if (dtype == DT_BF16 && n == 8) { /* the rounded lanes are bf16 values: keep their top halves */
        v8u32 u;
        memcpy(&u, &v, sizeof u);
        *(v8u16_u *)((uint16_t *)row + k) = __builtin_convertvector(u >> 16, v8u16_u);
        return;
    }
    for (int l = 0; l < n; l++) store1(row, k + l, dtype, v[l]);
}

typedef struct {
    const void *x;       /* rows of `width` elements of x_dtype, x_stride apart */
    int64_t x_dtype;
    int64_t x_stride;
    const void *weight;  /* [width] of weight_dtype */
    int64_t weight_dtype;
    void *y;             /* rows of `width` elements of y_dtype (the compute dtype), y_stride apart */
    int64_t y_dtype;
    int64_t y_stride;
    int64_t rows;
    int64_t width;
    double eps;
    int64_t num_threads;
} rms_norm_call;

/* One row: y = round(x / sqrt(mean(x^2) + eps)) * round(weight), rounded to ydt. Inlined with
 * constant dtypes (one instance per combination the model uses). */
static inline __attribute__((always_inline)) void rms_norm_row(const void *x, int xdt, const void *weight, int wdt,
                                                               void *y, int ydt, int64_t n, float eps) {
    const int64_t n8 = n - n % 8;
    v8f acc = splat8(0.0f);
    for (int64_t k = 0; k < n8; k += 8) {
        v8f v = load8(x, k, xdt);
        acc = FMA8(v, v, acc);
    }
    float sum = hsum(acc);
    for (int64_t k = n8; k < n; k++) sum += load1(x, k, xdt) * load1(x, k, xdt);
    const v8f inv = splat8(1.0f / __builtin_sqrtf(sum / (float)n + eps));
    for (int64_t k = 0; k < n; k += 8) {
        const int lanes = n - k < 8 ? (int)(n - k) : 8;
        v8f xv = lanes == 8 ? load8(x, k, xdt) : load_tail(x, k, lanes, xdt);
        v8f wv = lanes == 8 ? load8(weight, k, wdt) : load_tail(weight, k, lanes, wdt);
        store8(y, k, lanes, ydt, round8(xv * inv, ydt) * round8(wv, ydt));
    }
}

/* y = round(x / sqrt(mean(x^2) + eps)) * round(weight), rounded to y_dtype. */
int invariant_rms_norm(const rms_norm_call *c) {
    const int64_t n = c->width, items = (c->rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    const int xdt = (int)c->x_dtype, wdt = (int)c->weight_dtype, ydt = (int)c->y_dtype;
    const float eps = (float)c->eps;
    int threads = c->rows * n < PARALLEL_MIN_ELEMS || c->num_threads < 1 ? 1 : (int)c->num_threads;

#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < items; item++) {
        for (int64_t r = item * ROWS_PER_ITEM; r < c->rows && r < (item + 1) * ROWS_PER_ITEM; r++) {
            const char *x = (const char *)c->x + (size_t)r * c->x_stride * dtype_size(xdt);
            char *y = (char *)c->y + (size_t)r * c->y_stride * dtype_size(ydt);
            /* The model's combinations get their own instance; others the generic one. */
            if (xdt == DT_F32 && wdt == DT_F32 && ydt == DT_F32)
                rms_norm_row(x, DT_F32, c->weight, DT_F32, y, DT_F32, n, eps);
            else if (xdt == DT_F32 && wdt == DT_BF16 && ydt == DT_F32)
                rms_norm_row(x, DT_F32, c->weight, DT_BF16, y, DT_F32, n, eps);
            else if (xdt == DT_BF16 && wdt == DT_BF16 && ydt == DT_BF16)
                rms_norm_row(x, DT_BF16, c->weight, DT_BF16, y, DT_BF16, n, eps);
            else
                rms_norm_row(x, xdt, c->weight, wdt, y, ydt, n, eps);
        }
    }
    return 0;
}

typedef struct {
    const void *gate;    /* rows of `width` elements of dtype, stride apart */
    const void *up;      /* the same layout */
    int64_t stride;
    void *y;             /* rows of `width` elements of dtype, y_stride apart */
    int64_t y_stride;
    int64_t dtype;
    int64_t rows;
    int64_t width;
    int64_t num_threads;
} silu_mul_call;

/* One row: y = round(round(gate / (1 + exp(-gate))) * up), silu and product in fp32. */
static inline __attribute__((always_inline)) void silu_mul_row(const void *g, const void *u, void *y, int dt, int64_t n) {
    for (int64_t k = 0; k < n; k += 8) {
        const int lanes = n - k < 8 ? (int)(n - k) : 8;
        v8f gv = lanes == 8 ? load8(g, k, dt) : load_tail(g, k, lanes, dt);
        v8f uv = lanes == 8 ? load8(u, k, dt) : load_tail(u, k, lanes, dt);
        store8(y, k, lanes, dt, round8(gv / (splat8(1.0f) + exp8(-gv)), dt) * uv);
    }
}

/* y = round(round(silu(gate)) * up) for every row. */
int invariant_silu_mul(const silu_mul_call *c) {
    const int dt = (int)c->dtype;
    const int64_t n = c->width, items = (c->rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    const size_t es = dtype_size(dt);
    int threads = c->rows * n < PARALLEL_MIN_SILU_ELEMS || c->num_threads < 1 ? 1 : (int)c->num_threads;

#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < items; item++) {
        for (int64_t r = item * ROWS_PER_ITEM; r < c->rows && r < (item + 1) * ROWS_PER_ITEM; r++) {
            const char *g = (const char *)c->gate + (size_t)r * c->stride * es;
            const char *u = (const char *)c->up + (size_t)r * c->stride * es;
            char *y = (char *)c->y + (size_t)r * c->y_stride * es;
            if (dt == DT_F32) silu_mul_row(g, u, y, DT_F32, n);
            else if (dt == DT_BF16) silu_mul_row(g, u, y, DT_BF16, n);
            else silu_mul_row(g, u, y, DT_F16, n);
        }
    }
    return 0;
}

typedef struct {
    void *x;             /* the residual stream: rows of `width` elements of dtype, x_stride apart */
    int64_t x_stride;
    const void *delta;   /* what a sublayer adds to it: the same layout, delta_stride apart */
    int64_t delta_stride;
    int64_t dtype;       /* the compute dtype, of x, delta and y */
    const void *weight;  /* [width] of weight_dtype */
    int64_t weight_dtype;
    void *y;             /* rows of `width` elements of dtype, y_stride apart */
    int64_t y_stride;
    int64_t rows;
    int64_t width;
    double eps;
    int64_t num_threads;
} add_rms_norm_call;

/* x = round(x + delta) in place (torch's `x + o`), then y = RMSNorm(x) as invariant_rms_norm
 * computes it: the residual add and the next norm in one pass over the row. */
int invariant_add_rms_norm(const add_rms_norm_call *c) {
    const int dt = (int)c->dtype, wdt = (int)c->weight_dtype;
    const int64_t n = c->width, items = (c->rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    const size_t es = dtype_size(dt);
    const float eps = (float)c->eps;
    int threads = c->rows * n < PARALLEL_MIN_ELEMS || c->num_threads < 1 ? 1 : (int)c->num_threads;

#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < items; item++) {
        for (int64_t r = item * ROWS_PER_ITEM; r < c->rows && r < (item + 1) * ROWS_PER_ITEM; r++) {
            char *x = (char *)c->x + (size_t)r * c->x_stride * es;
            const char *d = (const char *)c->delta + (size_t)r * c->delta_stride * es;
            char *y = (char *)c->y + (size_t)r * c->y_stride * es;
            for (int64_t k = 0; k < n; k += 8) {
                const int lanes = n - k < 8 ? (int)(n - k) : 8;
                v8f xv = lanes == 8 ? load8(x, k, dt) : load_tail(x, k, lanes, dt);
                v8f dv = lanes == 8 ? load8(d, k, dt) : load_tail(d, k, lanes, dt);
                store8(x, k, lanes, dt, xv + dv);
            }
            if (dt == DT_F32 && wdt == DT_F32) rms_norm_row(x, DT_F32, c->weight, DT_F32, y, DT_F32, n, eps);
            else if (dt == DT_F32 && wdt == DT_BF16) rms_norm_row(x, DT_F32, c->weight, DT_BF16, y, DT_F32, n, eps);
            else if (dt == DT_BF16 && wdt == DT_BF16) rms_norm_row(x, DT_BF16, c->weight, DT_BF16, y, DT_BF16, n, eps);
            else rms_norm_row(x, dt, c->weight, wdt, y, dt, n, eps);
        }
    }
    return 0;
}

typedef struct {
    const void *qkv;     /* rows of q | k | v ((heads + 2 kv_heads) * head_dim elements of dtype), qkv_stride apart */
    int64_t qkv_stride;
    int64_t dtype;       /* the compute dtype, of qkv, cos, sin and q_out */
    int64_t rows;
    const int64_t *positions; /* [rows] */
    const void *cos;     /* [positions, head_dim] of dtype: the rotary table */
    const void *sin;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;    /* a multiple of 16 */
    void *q_out;         /* [rows, heads * head_dim] of dtype, contiguous */
    void *kv;            /* the KV cache as rows of kv_heads * head_dim elements of kv_dtype */
    int64_t kv_dtype;
    const int64_t *key_rows;   /* [rows]: the kv row each token's key goes to */
    const int64_t *value_rows; /* [rows]: and its value */
    int64_t num_threads;
} rope_kv_call;

/* One head of `count` heads: dst = round(round(x * cos) + round(rotate_half(x) * sin)) rounded to
 * dst_dtype, HF's `x * cos + rotate_half(x) * sin` in the compute dtype `dt`. */
static inline __attribute__((always_inline)) void rope_heads(const char *x, int dt, const char *cos, const char *sin,
                                                             int64_t count, int64_t head_dim, char *dst, int ddt) {
    const int64_t half = head_dim / 2;
    const size_t es = dtype_size(dt), des = dtype_size(ddt);
    for (int64_t h = 0; h < count; h++) {
        const char *xh = x + (size_t)(h * head_dim) * es;
        char *out = dst + (size_t)(h * head_dim) * des;
        for (int64_t k = 0; k < head_dim; k += 8) {
            const v8f xv = load8(xh, k, dt);
            const v8f rotated = k < half ? -load8(xh, k + half, dt) : load8(xh, k - half, dt);
            const v8f sum = round8(xv * load8(cos, k, dt), dt) + round8(rotated * load8(sin, k, dt), dt);
            store8(out, k, 8, ddt, round8(sum, dt));
        }
    }
}

/* For each token: q rotated into q_out; k rotated and v as it is written to the token's KV rows
 * (rounded to the cache's dtype). The rotation is HF's, rounding where torch's ops round. */
int invariant_rope_kv(const rope_kv_call *c) {
    const int dt = (int)c->dtype, kvdt = (int)c->kv_dtype;
    const int64_t hd = c->head_dim, q_dim = c->num_heads * hd, kv_dim = c->num_kv_heads * hd;
    if (hd % 16) return -2;
    const size_t es = dtype_size(dt), kves = dtype_size(kvdt);
    int threads = c->rows * (q_dim + 2 * kv_dim) < PARALLEL_MIN_ELEMS || c->num_threads < 1 ? 1 : (int)c->num_threads;

#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < c->rows; r++) {
        const char *row = (const char *)c->qkv + (size_t)r * c->qkv_stride * es;
        const char *cos = (const char *)c->cos + (size_t)(c->positions[r] * hd) * es;
        const char *sin = (const char *)c->sin + (size_t)(c->positions[r] * hd) * es;
        char *key = (char *)c->kv + (size_t)(c->key_rows[r] * kv_dim) * kves;
        char *value = (char *)c->kv + (size_t)(c->value_rows[r] * kv_dim) * kves;
        char *q = (char *)c->q_out + (size_t)(r * q_dim) * es;
        const char *k_in = row + (size_t)q_dim * es, *v_in = row + (size_t)(q_dim + kv_dim) * es;
        if (dt == DT_F32) {
            rope_heads(row, DT_F32, cos, sin, c->num_heads, hd, q, DT_F32);
            if (kvdt == DT_F32) rope_heads(k_in, DT_F32, cos, sin, c->num_kv_heads, hd, key, DT_F32);
            else rope_heads(k_in, DT_F32, cos, sin, c->num_kv_heads, hd, key, kvdt);
        } else {
            rope_heads(row, dt, cos, sin, c->num_heads, hd, q, dt);
            rope_heads(k_in, dt, cos, sin, c->num_kv_heads, hd, key, kvdt);
        }
        for (int64_t k = 0; k < kv_dim; k += 8) store8(value, k, 8, kvdt, load8(v_in, k, dt));
    }
    return 0;
}
