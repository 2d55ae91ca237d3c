/* The base model's matmuls over weights kept in GGUF block formats: y = x @ dequant(W)^T (+ b).
 *
 * Q4_1: blocks of 32 weights, 20 bytes: fp16 d, fp16 m, 16 bytes of 4-bit q (byte j holds weight j
 *       in its low nibble and weight j + 16 in its high one); weight = d * q + m.
 * Q8_0: blocks of 32 weights, 34 bytes: fp16 d, 32 int8 q; weight = d * q.
 * Both products are exact in fp32 (11-bit d times a 4- or 8-bit q), so one FMA gives exactly
 * gguf-py's `(d * q) + m`: the weights this kernel multiplies are bit for bit the dequantized
 * weights the reference (transformers + peft on the dequantized model) uses.
 *
 * Activations stay fp32 (bf16/fp16 x is widened first, exactly); weights are dequantized in
 * registers, a block at a time, and never written out in fp32 for calls of few rows (decode: the
 * bytes read per token are the 4.5 or 8.5 bits per weight of the file). Calls of many rows
 * (prefill) dequantize a block of W rows once into a per-thread buffer and run the same register
 * tile over it, so the dequantization is paid once per 48 rows x 128 tokens.
 *
 * Batch-invariant like cpu_invariant_matmul.c: every output is one dot product summed in one
 * order (vector lanes over k, block by block, then `half_sum` and `hsum`), whichever path, tile edge or row
 * count computes it; compiled with -ffp-contract=off, FMAs explicit. The vector width is the
 * CPU's (-march=native at first use): 16 lanes on AVX-512, 8 on AVX2; `quant_isa` says which.
 */

#include <stdlib.h>

#include "cpu_invariant.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the quantized kernels need AVX2, FMA and F16C"
#endif

enum { QF_Q4_1 = 0, QF_Q8_0 = 1 };

#define QBLOCK 32 /* weights per block, both formats */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VW 16
typedef __m512 vec;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VZERO() _mm512_setzero_ps()
#define VSET1(v) _mm512_set1_ps(v)
#define TILE_ROWS 6 /* x rows per register tile */
#define TILE_COLS 4 /* W rows per tile: 24 sums + 4 weight vectors + 1 x vector of 32 registers
                       (a quantized block's 8 weight vectors replace the prefill path's 4 when
                       its rows are few: 4 x 4 sums) */
#ifdef __AVX512BF16__
static const char ISA[] = "avx512+bf16";
#else
static const char ISA[] = "avx512";
#endif
#else
#define VW 8
typedef __m256 vec;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VZERO() _mm256_setzero_ps()
#define VSET1(v) _mm256_set1_ps(v)
#define TILE_ROWS 3
#define TILE_COLS 2 /* 6 sums + 8 weight vectors + 1 x vector of 16 registers */
static const char ISA[] = "avx2";
#endif

#define CHUNKS (QBLOCK / VW)
#define BLOCK_COLS 48  /* W rows of one work item */
#define BLOCK_ROWS 128 /* x rows of one work item */
/* From this many rows a block of W is dequantized once per work item into a buffer; below, each
 * register tile of up to TILE_ROWS rows dequantizes it again, from bytes still in L1. Measured on
 * 2 EPYC cores (the whole model's matmuls, Q4_1): the buffer costs more than a second pass over
 * the blocks up to 12 rows (8 rows 2.96x the 1-row time against 3.67x, 12 rows 3.76x against
 * 4.28x with bf16 x; 3.81x against 5.45x at 8 rows with fp32 x), and the same from 13. */
#define WIDEN_MIN_ROWS 13
/* Below this many weights x rows one thread is done before a second one would have started. */
#define PARALLEL_MIN_WORK 65536
/* How far ahead of a tile's reads the quantized paths prefetch. A tile's rows are consecutive
 * rows of W, one contiguous run of bytes read front to back (its rows side by side): prefetching
 * that run linearly covers the next tile's rows too, which a per-row distance (12 blocks in each
 * row) left to the first reads of every tile, 18 blocks long at in_features 576. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

/* Which vector path this build runs ("avx512" or "avx2"). */
const char *quant_isa(void) { return ISA; }

static inline int64_t block_bytes(int fmt) { return fmt == QF_Q4_1 ? 20 : 34; }

/* Every fp16 value in fp32 (what vcvtph2ps gives), filled when the library loads. A block's fp16
 * scales looked up here are broadcast straight from memory (a load, no vector instruction), where
 * converting and broadcasting them took 7 of the 14 vector instructions per block and row of the
 * batch-1 loop; the scales a model uses are a few thousand values, so the lookups stay in L2.
 * The widening path converts instead: its lookups' lines only crowded its buffers out of L2
 * (3-5% slower at 8 rows), for no gain. */
static float half_table[1 << 16];

__attribute__((constructor)) static void fill_half_table(void) {
    for (int h = 0; h < 1 << 16; h++) half_table[h] = _cvtsh_ss((unsigned short)h);
}

/* The fp16 at p in fp32: looked up (`lookup`, a constant of each inlined caller) or converted. */
static inline __attribute__((always_inline)) float half_at(const uint8_t *p, const int lookup) {
    uint16_t h;
    memcpy(&h, p, 2);
    return lookup ? half_table[h] : _cvtsh_ss(h);
}

/* The 32 weights of one block, as CHUNKS vectors (`lookup`: how to read the scales, see half_table). */
static inline __attribute__((always_inline)) void dequant_block(const uint8_t *blk, int fmt, vec w[CHUNKS],
                                                                const int lookup) {
    if (fmt == QF_Q4_1) {
        const vec d = VSET1(half_at(blk, lookup)), m = VSET1(half_at(blk + 2, lookup));
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
#if VW == 16
        /* The block's 16 possible weights d * q + m in one register, looked up by each lane's
         * nibble (vpermps reads the low 4 bits of its index): two instructions per 16 weights
         * fewer than converting and scaling every q, and the same values. */
        const vec table = VFMA(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d, m);
        const __m512i bytes = _mm512_cvtepu8_epi32(raw);
        w[0] = _mm512_permutexvar_ps(bytes, table);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#else
        const __m128i nibble = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, nibble), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
        w[0] = VFMA(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
        w[1] = VFMA(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
        w[2] = VFMA(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
        w[3] = VFMA(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
#endif
    } else {
        const vec d = VSET1(half_at(blk, lookup));
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
#if VW == 16
        w[0] = VMUL(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
        w[1] = VMUL(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
#else
        w[0] = VMUL(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), d);
        w[1] = VMUL(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), d);
        w[2] = VMUL(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), d);
        w[3] = VMUL(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), d);
#endif
    }
}

/* The lanes folded to 8 (lane i + lane i + 8), the first step of the one summation order. */
static inline v8f half_sum(vec v) {
#if VW == 16
    return (v8f)_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
#else
    return (v8f)v;
#endif
}

/* s[i][j] = the lanes of acc[i][j] summed, for MR rows: half_sum, then hsum's order, four sums at
 * a time (hsum4 gives hsum's bits). Every tile of every path reduces this way. */
static inline __attribute__((always_inline)) void reduce_tile(vec acc[TILE_ROWS][TILE_COLS],
                                                              float s[TILE_ROWS][TILE_COLS], const int MR) {
    v8f halves[TILE_ROWS * TILE_COLS];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < TILE_COLS; j++) halves[i * TILE_COLS + j] = half_sum(acc[i][j]);
    float sums[TILE_ROWS * TILE_COLS + 2]; /* + 2: the odd pair's hsum4 below stores four */
    const int count = MR * TILE_COLS; /* even: TILE_COLS is 2 or 4 */
    for (int g = 0; g + 3 < count; g += 4) hsum4(halves[g], halves[g + 1], halves[g + 2], halves[g + 3], sums + g);
    if (count % 4) /* TILE_COLS 2, an odd row count */
        hsum4(halves[count - 2], halves[count - 1], halves[count - 1], halves[count - 1], sums + count - 2);
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < TILE_COLS; j++) s[i][j] = sums[i * TILE_COLS + j];
}

/* Prefetch the bytes a tile reads PREFETCH_BYTES after those of its block b (its TILE_COLS rows
 * are consecutive from `tile`, each bb bytes a block): what block b's step reads, one step on. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *tile, int64_t b, int64_t bb) {
    const uint8_t *ahead = tile + b * TILE_COLS * bb + PREFETCH_BYTES;
    for (int64_t o = 0; o < TILE_COLS * bb; o += 64) _mm_prefetch((const char *)(ahead + o), _MM_HINT_T0);
}

/* s[i][j] = dot(x[i], w[j]) for MR rows of fp32 x and TILE_COLS rows of W, either quantized (wq,
 * row after row of blocks) or already dequantized (wf): the same sums in the same order. */
static inline __attribute__((always_inline)) void dot_tile(const float *const *x, const uint8_t *const *wq,
                                                           const float *const *wf, int64_t blocks, int fmt,
                                                           float s[TILE_ROWS][TILE_COLS], const int MR) {
    vec acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < TILE_COLS; j++) acc[i][j] = VZERO();
    const int64_t bb = block_bytes(fmt);
    /* Either way each sum takes its block's chunks in order, block after block; only how the
     * sums' updates interleave differs (what keeps the registers in use under 32 or 16). */
    for (int64_t b = 0; b < blocks; b++) {
        if (wf) {
            for (int c = 0; c < CHUNKS; c++) {
                vec w[TILE_COLS];
                for (int j = 0; j < TILE_COLS; j++) w[j] = VLOAD(wf[j] + b * QBLOCK + c * VW);
                for (int i = 0; i < MR; i++) {
                    const vec xv = VLOAD(x[i] + b * QBLOCK + c * VW);
                    for (int j = 0; j < TILE_COLS; j++) acc[i][j] = VFMA(w[j], xv, acc[i][j]);
                }
            }
        } else {
            prefetch_ahead(wq[0], b, bb);
            for (int j = 0; j < TILE_COLS; j++) {
                vec w[CHUNKS];
                dequant_block(wq[j] + b * bb, fmt, w, 1);
                for (int c = 0; c < CHUNKS; c++)
                    for (int i = 0; i < MR; i++) acc[i][j] = VFMA(w[c], VLOAD(x[i] + b * QBLOCK + c * VW), acc[i][j]);
            }
        }
    }
    reduce_tile(acc, s, MR);
}

/* One instance per (row count, format, source), so no tile computes rows it does not have and
 * the format test is out of the inner loop; the instances differ only in what they loop over. */
#define TILE_CASE(MR)                                                  \
    if (mr == MR) {                                                    \
        if (wf) dot_tile(x, wq, wf, blocks, QF_Q8_0, s, MR);           \
        else if (fmt == QF_Q4_1) dot_tile(x, wq, NULL, blocks, QF_Q4_1, s, MR); \
        else dot_tile(x, wq, NULL, blocks, QF_Q8_0, s, MR);           \
        return;                                                        \
    }

static void dot_tile_rows(const float *const *x, int mr, const uint8_t *const *wq, const float *const *wf,
                          int64_t blocks, int fmt, float s[TILE_ROWS][TILE_COLS]) {
#if TILE_ROWS >= 6
    TILE_CASE(6)
    TILE_CASE(5)
    TILE_CASE(4)
#endif
    TILE_CASE(3)
    TILE_CASE(2)
    TILE_CASE(1)
}

/* The weights of `blocks` consecutive blocks from `row`, into fp32 `dst`. */
static void dequant_row(const uint8_t *row, int fmt, int64_t blocks, float *dst) {
    const int64_t bb = block_bytes(fmt);
    for (int64_t b = 0; b < blocks; b++) {
        vec w[CHUNKS];
        if (fmt == QF_Q4_1) dequant_block(row + b * bb, QF_Q4_1, w, 0);
        else dequant_block(row + b * bb, QF_Q8_0, w, 0);
        for (int c = 0; c < CHUNKS; c++) VSTORE(dst + b * QBLOCK + c * VW, w[c]);
    }
}

#ifdef __AVX512BF16__
/* bf16 activations on a CPU with AVX512_BF16: vdpbf16ps multiplies 32 bf16 pairs into 16 fp32
 * sums per instruction, twice the fp32 FMA rate. The weights are the exact fp32 dequantization
 * rounded to bf16 (round to nearest even), which is what `--dtype bfloat16` stores for a
 * dequantized model; the sums are fp32, reduced as the fp32 path reduces them. Every row count
 * takes this path for bf16 x, so it is batch-invariant too. */
#define BF16_PATH 1

/* A block's 32 weights as bf16, in order. For Q4_1 the block's 16 possible weights are rounded to
 * bf16 once and looked up by nibble (vpermw reads the low 5 bits of each 16-bit index: the
 * table, twice over, answers a whole byte by its low nibble): rounding a looked-up weight is
 * looking up the rounded one, so these are the same bits as converting the 32 fp32 weights, in
 * fewer instructions. */
static inline __attribute__((always_inline)) __m512bh dequant_block_bf16(const uint8_t *blk, int fmt,
                                                                         const int lookup) {
    if (fmt == QF_Q4_1) {
        const vec d = VSET1(half_at(blk, lookup)), m = VSET1(half_at(blk + 2, lookup));
        const vec table = VFMA(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d, m);
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 4)));
        const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
        return (__m512bh)_mm512_permutexvar_epi16(nibbles, (__m512i)_mm512_cvtne2ps_pbh(table, table));
    }
    vec w[CHUNKS];
    dequant_block(blk, fmt, w, lookup);
    return _mm512_cvtne2ps_pbh(w[1], w[0]);
}

static inline __attribute__((always_inline)) void dot_tile_bf16(const uint16_t *const *x, const uint8_t *const *wq,
                                                                const uint16_t *const *wb, int64_t blocks, int fmt,
                                                                float s[TILE_ROWS][TILE_COLS], const int MR) {
    vec acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < TILE_COLS; j++) acc[i][j] = VZERO();
    const int64_t bb = block_bytes(fmt);
    for (int64_t b = 0; b < blocks; b++) {
        __m512bh w[TILE_COLS];
        if (!wb) prefetch_ahead(wq[0], b, bb);
        for (int j = 0; j < TILE_COLS; j++) {
            w[j] = wb ? (__m512bh)_mm512_loadu_si512(wb[j] + b * QBLOCK) : dequant_block_bf16(wq[j] + b * bb, fmt, 1);
        }
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[i] + b * QBLOCK);
            for (int j = 0; j < TILE_COLS; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
        }
    }
    reduce_tile(acc, s, MR);
}

#define TILE_CASE_BF16(MR)                                                      \
    if (mr == MR) {                                                             \
        if (wb) dot_tile_bf16(x, wq, wb, blocks, QF_Q8_0, s, MR);               \
        else if (fmt == QF_Q4_1) dot_tile_bf16(x, wq, NULL, blocks, QF_Q4_1, s, MR); \
        else dot_tile_bf16(x, wq, NULL, blocks, QF_Q8_0, s, MR);               \
        return;                                                                 \
    }

static void dot_tile_rows_bf16(const uint16_t *const *x, int mr, const uint8_t *const *wq,
                               const uint16_t *const *wb, int64_t blocks, int fmt, float s[TILE_ROWS][TILE_COLS]) {
    TILE_CASE_BF16(6)
    TILE_CASE_BF16(5)
    TILE_CASE_BF16(4)
    TILE_CASE_BF16(3)
    TILE_CASE_BF16(2)
    TILE_CASE_BF16(1)
}

static void dequant_row_bf16(const uint8_t *row, int fmt, int64_t blocks, uint16_t *dst) {
    const int64_t bb = block_bytes(fmt);
    for (int64_t b = 0; b < blocks; b++) {
        const __m512bh w = fmt == QF_Q4_1 ? dequant_block_bf16(row + b * bb, QF_Q4_1, 0)
                                          : dequant_block_bf16(row + b * bb, QF_Q8_0, 0);
        _mm512_storeu_si512(dst + b * QBLOCK, (__m512i)w);
    }
}
#else
#define BF16_PATH 0
#endif

static __thread float *wide_x, *wide_w;
static __thread size_t wide_x_elems, wide_w_elems;


/* The arguments of one call (every field 8 bytes: the ctypes mirror needs no padding rules). */
typedef struct {
    const void *x;       /* rows of in_features elements of x_dtype, x_stride apart */
    int64_t x_dtype;
    int64_t x_stride;
    int64_t rows;
    int64_t in_features; /* a multiple of 32 */
    const uint8_t *w;    /* out_features rows of in_features / 32 blocks of format */
    int64_t format;
    int64_t out_features;
    const void *bias;    /* [out_features] of bias_dtype, or NULL */
    int64_t bias_dtype;
    void *y;             /* rows of out_features elements of y_dtype, y_stride apart */
    int64_t y_dtype;
    int64_t y_stride;
    int64_t num_threads;
} quant_linear_call;

/* y = x @ dequant(W)^T (+ bias). Returns 0, -1 when out of memory, -2 on a bad shape. */
int quant_linear(const quant_linear_call *c) {
    const int64_t M = c->rows, K = c->in_features, N = c->out_features;
    if (K % QBLOCK) return -2;
    if (M == 0 || N == 0) return 0;
    const int xdt = (int)c->x_dtype, ydt = (int)c->y_dtype, fmt = (int)c->format;
    const int64_t blocks = K / QBLOCK, row_bytes = blocks * block_bytes(fmt);
    const int bf16 = BF16_PATH && xdt == DT_BF16;
    const float *x32 = (const float *)c->x;
    int64_t x32_stride = c->x_stride;
    if (xdt != DT_F32 && !bf16) {
        if (!grown(&wide_x, &wide_x_elems, (size_t)(M * K))) return -1;
        for (int64_t m = 0; m < M; m++)
            widen_row((const char *)c->x + (size_t)m * c->x_stride * dtype_size(xdt), xdt, K, wide_x + m * K);
        x32 = wide_x;
        x32_stride = K;
    }
    const size_t ysize = dtype_size(ydt);
    const int64_t col_blocks = (N + BLOCK_COLS - 1) / BLOCK_COLS, row_blocks = (M + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int threads = (int)c->num_threads;
    if (M * N * K < PARALLEL_MIN_WORK || threads < 1) threads = 1;
    const int widen = M >= WIDEN_MIN_ROWS;
    int failed = 0;

#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < row_blocks * col_blocks; item++) {
        const int64_t b = item % col_blocks, m_start = item / col_blocks * BLOCK_ROWS;
        const int64_t m_end = m_start + BLOCK_ROWS < M ? m_start + BLOCK_ROWS : M;
        const int64_t n0 = b * BLOCK_COLS, n1 = n0 + BLOCK_COLS < N ? n0 + BLOCK_COLS : N;
        float *wide = NULL;
        if (widen) {
            wide = grown(&wide_w, &wide_w_elems, (size_t)(BLOCK_COLS * K));
            if (!wide) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
#if BF16_PATH
            if (bf16) {
                for (int64_t n = n0; n < n1; n++)
                    dequant_row_bf16(c->w + (size_t)n * row_bytes, fmt, blocks, (uint16_t *)wide + (n - n0) * K);
            } else
#endif
                for (int64_t n = n0; n < n1; n++) dequant_row(c->w + (size_t)n * row_bytes, fmt, blocks, wide + (n - n0) * K);
        }
        for (int64_t m0 = m_start; m0 < m_end; m0 += TILE_ROWS) {
            const int mr = (int)(m_end - m0 < TILE_ROWS ? m_end - m0 : TILE_ROWS);
            const float *xs[TILE_ROWS];
            for (int i = 0; i < TILE_ROWS; i++) xs[i] = x32 + (m0 + (i < mr ? i : 0)) * x32_stride;
            for (int64_t n = n0; n < n1; n += TILE_COLS) {
                const int nc = (int)(n1 - n < TILE_COLS ? n1 - n : TILE_COLS);
                const uint8_t *wq[TILE_COLS];
                const float *wf[TILE_COLS];
                for (int j = 0; j < TILE_COLS; j++) {
                    const int64_t col = n + (j < nc ? j : 0);
                    wq[j] = c->w + (size_t)col * row_bytes;
                    wf[j] = wide ? wide + (col - n0) * K : NULL;
                }
                float s[TILE_ROWS][TILE_COLS];
#if BF16_PATH
                if (bf16) {
                    const uint16_t *xb[TILE_ROWS], *wb[TILE_COLS];
                    for (int i = 0; i < TILE_ROWS; i++)
                        xb[i] = (const uint16_t *)c->x + (m0 + (i < mr ? i : 0)) * c->x_stride;
                    for (int j = 0; j < TILE_COLS; j++)
                        wb[j] = wide ? (const uint16_t *)wide + (n + (j < nc ? j : 0) - n0) * K : NULL;
                    dot_tile_rows_bf16(xb, mr, wq, wide ? wb : NULL, blocks, fmt, s);
                } else
#endif
                    dot_tile_rows(xs, mr, wq, wide ? wf : NULL, blocks, fmt, s);
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

typedef struct {
    const uint8_t *w;  /* rows of in_features / 32 blocks of format */
    int64_t format;
    int64_t in_features;
    const int64_t *indices; /* the rows wanted */
    int64_t count;
    float *out;        /* [count, in_features] */
} quant_rows_call;

/* out[i] = dequant(W[indices[i]]): the embedding lookup of quantized token embeddings. */
int quant_rows(const quant_rows_call *c) {
    if (c->in_features % QBLOCK) return -2;
    const int64_t blocks = c->in_features / QBLOCK, row_bytes = blocks * block_bytes((int)c->format);
    for (int64_t i = 0; i < c->count; i++)
        dequant_row(c->w + (size_t)c->indices[i] * row_bytes, (int)c->format, blocks, c->out + i * c->in_features);
    return 0;
}
