/* Shared pieces of the batch-invariant CPU kernels (cpu_invariant_*.c).
 *
 * Every value those kernels produce is computed by one fixed sequence of operations that depends
 * only on the inputs of that value: never on how many rows the call has, where a row sits in it,
 * how many threads run, or which code path a size would pick. That is what makes a request's
 * logits independent of its batch: a library GEMM or a torch elementwise op picks its kernel,
 * blocking and vector/scalar split by shape (oneDNN/MKL by M; a torch op's scalar tail by the
 * tensor's length), so the same row can round differently in two batches.
 *
 * The rules that keep it so:
 *   - a reduction runs in one order: 8 lanes over k = 0, 8, 16, ..., then `hsum`, then the scalar
 *     tail; a tile computes its values with the same instructions whatever its edge rows are;
 *   - the files are compiled with -ffp-contract=off, so a * b + c is never fused behind our back;
 *     FMAs are explicit (`FMA8`), the same in every path;
 *   - exp and log are our own polynomials on vectors (`exp8`, `log8`), lane by lane: libm's and
 *     torch's differ between their vector loops and scalar tails; a scalar takes a lane.
 */

#ifndef LORAMESH_CPU_INVARIANT_H
#define LORAMESH_CPU_INVARIANT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__FMA__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef uint16_t v8u16_u __attribute__((vector_size(16), aligned(2)));
typedef _Float16 v8h_u __attribute__((vector_size(16), aligned(2)));

static inline v8f splat8(float v) { return (v8f){v, v, v, v, v, v, v, v}; }

/* mask ? a : b per lane (a mask lane is all ones or all zeros; C has no vector ?:). */
static inline v8f select8(v8i mask, v8f a, v8f b) { return (v8f)((mask & (v8i)a) | (~mask & (v8i)b)); }

/* c + a * b with one rounding where the CPU has FMA, two elsewhere: the same in every kernel. */
static inline __attribute__((always_inline)) v8f FMA8(v8f a, v8f b, v8f c) {
#ifdef __FMA__
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* Keep `v` in a register: GCC otherwise folds a load into each instruction that uses it, and a
 * vector used by several FMAs is loaded as many times (register tiles become load-bound). */
#if defined(__x86_64__) && defined(__AVX__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

/* The 8 lanes summed in one fixed order. */
static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* hsum of four vectors at once, in hsum's order: out[i] = hsum(v[i]) bit for bit. */
static inline __attribute__((always_inline)) void hsum4(v8f a, v8f b, v8f c, v8f d, float *out) {
#ifdef __AVX__
    __m128 ta = _mm_add_ps(_mm256_castps256_ps128((__m256)a), _mm256_extractf128_ps((__m256)a, 1));
    __m128 tb = _mm_add_ps(_mm256_castps256_ps128((__m256)b), _mm256_extractf128_ps((__m256)b, 1));
    __m128 tc = _mm_add_ps(_mm256_castps256_ps128((__m256)c), _mm256_extractf128_ps((__m256)c, 1));
    __m128 td = _mm_add_ps(_mm256_castps256_ps128((__m256)d), _mm256_extractf128_ps((__m256)d, 1));
    _mm_storeu_ps(out, _mm_hadd_ps(_mm_hadd_ps(ta, tb), _mm_hadd_ps(tc, td)));
#else
    out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
#endif
}

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

/* Eight elements of a row of `dtype` from element k, widened to fp32 (exactly). */
static inline __attribute__((always_inline)) v8f load8(const void *row, int64_t k, int dtype) {
    if (dtype == DT_F32) return *(const v8f_u *)((const float *)row + k);
    if (dtype == DT_BF16) {
#ifdef __AVX2__
        /* One vpmovzxwd from memory and a shift (GCC's generic widening takes two halves). */
        __m256i wide = _mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k))), 16);
        return (v8f)_mm256_castsi256_ps(wide);
#else
        v8u32 wide = __builtin_convertvector(*(const v8u16_u *)((const uint16_t *)row + k), v8u32) << 16;
        v8f f;
        memcpy(&f, &wide, sizeof f);
        return f;
#endif
    }
#ifdef __F16C__
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

/* Store fp32 `v` as element k of a row of `dtype` (one rounding). */
static inline void store1(void *row, int64_t k, int dtype, float v) {
    if (dtype == DT_F32) ((float *)row)[k] = v;
    else if (dtype == DT_BF16) ((uint16_t *)row)[k] = f32_to_bf16(v);
    else ((uint16_t *)row)[k] = f32_to_f16(v);
}

static inline size_t dtype_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

/* n elements of a row of `dtype` widened into fp32 `dst`. */
static inline void widen_row(const void *row, int dtype, int64_t n, float *dst) {
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) *(v8f_u *)(dst + k) = load8(row, k, dtype);
    for (; k < n; k++) dst[k] = load1(row, k, dtype);
}

/* `buf` grown to hold `need` floats (a thread's scratch, kept for the next call); NULL when out of
 * memory. */
static inline float *grown(float **buf, size_t *elems, size_t need) {
    if (*elems < need) {
        free(*buf);
        *buf = malloc(need * sizeof(float));
        *elems = *buf ? need : 0;
    }
    return *buf;
}

/* exp(x) for every lane (Cephes expf: 2^n * p(r), |r| <= ln2 / 2, about 1 ulp); 0 below -87.3
 * (and for -inf), +inf above 88.7; exp(0) is exactly 1. */
static inline __attribute__((always_inline)) v8f exp8(v8f x) {
    const v8f hi = splat8(88.3762626647949f), lo = splat8(-87.3365447505531f);
    v8i under = x < lo, over = x > hi;
    x = select8(over, hi, x);
    x = select8(under, lo, x);
    v8f t = x * splat8(1.44269504088896341f) + splat8(0.5f);
    v8i n = __builtin_convertvector(t, v8i);
    v8f nf = __builtin_convertvector(n, v8f);
    n += (v8i)(nf > t); /* trunc -> floor: a true lane is -1 */
    nf = __builtin_convertvector(n, v8f);
    v8f r = x - nf * splat8(0.693359375f);
    r = r - nf * splat8(-2.12194440e-4f);
    v8f p = splat8(1.9875691500e-4f);
    p = p * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    v8f y = p * (r * r) + r + splat8(1.0f);
    v8u32 bits = (v8u32)((n + 127) << 23);
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    y = y * scale;
    y = select8(under, splat8(0.0f), y);
    return select8(over, splat8(__builtin_inff()), y);
}

/* log(x) for every lane, x > 0 and normal (Cephes logf); log(1) is exactly 0. */
static inline __attribute__((always_inline)) v8f log8(v8f x) {
    v8u32 bits;
    memcpy(&bits, &x, sizeof bits);
    v8i e = (v8i)(bits >> 23) - 126;
    bits = (bits & 0x007fffffu) | 0x3f000000u; /* mantissa in [0.5, 1) */
    v8f m;
    memcpy(&m, &bits, sizeof m);
    v8i small = m < splat8(0.707106781186547524f);
    e += small; /* a true lane is -1 */
    m = select8(small, m + m, m);
    m = m - splat8(1.0f);
    v8f ef = __builtin_convertvector(e, v8f);
    v8f z = m * m;
    v8f p = splat8(7.0376836292e-2f);
    p = p * m + splat8(-1.1514610310e-1f);
    p = p * m + splat8(1.1676998740e-1f);
    p = p * m + splat8(-1.2420140846e-1f);
    p = p * m + splat8(1.4249322787e-1f);
    p = p * m + splat8(-1.6668057665e-1f);
    p = p * m + splat8(2.0000714765e-1f);
    p = p * m + splat8(-2.4999993993e-1f);
    p = p * m + splat8(3.3333331174e-1f);
    v8f y = p * m * z;
    y = y + ef * splat8(-2.12194440e-4f);
    y = y - splat8(0.5f) * z;
    v8f r = m + y;
    return r + ef * splat8(0.693359375f);
}

#endif
