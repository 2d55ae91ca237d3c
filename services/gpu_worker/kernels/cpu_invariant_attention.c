/* Batch-invariant causal attention over KV blocks, on the CPU.
 *
 * A query's attention is split at KV block boundaries (kv_block_tokens keys, the unit the pool and
 * the lending protocol move): for each block b of its context, the block's own softmax output
 * o_b and log-sum-exp lse_b (a partial, as DistAttention defines it); the partials are then
 * combined pairwise along a fixed binary tree over the block index b:
 *
 *     (o1, lse1) + (o2, lse2) = ((w1 o1 + w2 o2) / (w1 + w2), m + log(w1 + w2)),
 *     m = max(lse1, lse2), wi = exp(lsei - m),
 *
 * the tree of blocks 0..B-1 being the pairwise tree over the next power of two with empty blocks
 * (lse = -inf, the exact identity) on the right. A query's result then depends only on its own q,
 * its position and its context's keys and values: not on which other queries share the call
 * (prefill or decode, batch of 1 or 64), nor on where its blocks are. The same block partials
 * computed on a creditor for borrowed blocks (`invariant_block_partials`) and combined on the
 * debtor (`invariant_combine_partials`) give the same bits as the local kernel
 * (`invariant_attention`), which runs the very same two functions in one pass.
 *
 * Within a block: scores in the dot-product order of cpu_invariant.h, times the scale; the
 * block's max; weights exp8(s - max); their sum and the weighted sum of values in key order.
 * Up to LANES query heads go through a block together (the heads of one kv head share its key and
 * value loads), their per-head scalars (lse, merge weights) one vector lane each: every step is
 * lane-wise, so a head's bits do not depend on which heads it was grouped with.
 */

#include <stdlib.h>

#include "cpu_invariant.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 8         /* query heads per pass: one vector lane each */
#define MAX_LEVELS 40   /* tree levels: 2^39 blocks */
#define QUERY_GROUP 16  /* queries of one sequence that go over its blocks together (prefill) */
#define ITEMS_PER_THREAD 8 /* work items per thread below which query groups are shortened */
#define MAX_BLOCK_TOKENS 256
/* Below this many (query, key, dim) products one thread is done before a second one starts.
 * A decode's KV is cold (the weights streamed through the caches since the last step), and a
 * second thread halves its wait on memory: one query over 200 keys of SmolLM2's 9 heads took
 * 60 -> 32 us per layer on 2 threads (AMD EPYC, 2 vCPUs), 50 keys 6.8 -> 5.0 us cache-hot. */
#define PARALLEL_MIN_WORK 16384

/* The geometry every entry point shares. */
typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, block_tokens;
    float scale;
} shape;

static const float NEG_INF = -__builtin_inff();

/* A partial of `nh` (<= LANES) heads: o [nh][head_dim] fp32, lse one lane per head. */
typedef struct {
    float *o;
    v8f lse;
} partial;

/* The partial of heads q[0..nh) (fp32 [nh][d]) over one block's first `visible` keys: key and
 * value rows of kv_dim elements of pool_dtype, `row_bytes` apart, this kv head's slice at `keys`
 * and `values`. A head that sees no key gets o = 0, lse = -inf. */
static inline __attribute__((always_inline)) void block_partial_t(const float *q, int nh, const char *keys,
                                                                  const char *values, int64_t visible,
                                                                  int64_t row_bytes, const int pool_dtype,
                                                                  const shape *sh, partial *out) {
    const int64_t d = sh->head_dim;
    if (visible <= 0) {
        memset(out->o, 0, sizeof(float) * nh * d);
        out->lse = splat8(NEG_INF);
        return;
    }
    float s[LANES][MAX_BLOCK_TOKENS];
    for (int64_t t = 0; t < visible; t += 2) {
        /* Two keys (the second past `visible`: the first again, discarded) by four heads (past
         * nh: head h0 again, discarded): eight independent sums. hsum4 = hsum for each. */
        const int64_t t1 = t + 1 < visible ? t + 1 : t;
        const char *k0 = keys + t * row_bytes, *k1 = keys + t1 * row_bytes;
        for (int h0 = 0; h0 < nh; h0 += 4) {
            const float *qh[4];
            for (int i = 0; i < 4; i++) qh[i] = q + (h0 + i < nh ? h0 + i : h0) * d;
            v8f a[4][2];
            for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = splat8(0.0f);
            for (int64_t j = 0; j < d; j += 8) {
                v8f kv0 = load8(k0, j, pool_dtype), kv1 = load8(k1, j, pool_dtype);
                IN_REGISTER(kv0);
                IN_REGISTER(kv1);
                for (int i = 0; i < 4; i++) {
                    v8f qv = *(const v8f_u *)(qh[i] + j);
                    a[i][0] = FMA8(qv, kv0, a[i][0]);
                    a[i][1] = FMA8(qv, kv1, a[i][1]);
                }
            }
            float dots[2][4];
            hsum4(a[0][0], a[1][0], a[2][0], a[3][0], dots[0]);
            hsum4(a[0][1], a[1][1], a[2][1], a[3][1], dots[1]);
            for (int i = 0; i < 4 && h0 + i < nh; i++) {
                s[h0 + i][t] = dots[0][i] * sh->scale;
                s[h0 + i][t1] = dots[1][i] * sh->scale;
            }
        }
    }
    /* Per head: the block's max, weights exp(s - max) 8 keys at a time, their sum in key order. */
    float w[LANES][MAX_BLOCK_TOKENS + 8];
    v8f top = splat8(NEG_INF), total = splat8(0.0f);
    for (int h = 0; h < nh; h++) {
        float m = NEG_INF;
        for (int64_t t = 0; t < visible; t++) m = s[h][t] > m ? s[h][t] : m;
        for (int64_t t = 0; t < visible; t += 8) {
            v8f x;
            for (int l = 0; l < 8; l++) x[l] = t + l < visible ? s[h][t + l] - m : 0.0f;
            *(v8f_u *)(w[h] + t) = exp8(x);
        }
        float sum = 0.0f;
        for (int64_t t = 0; t < visible; t++) sum += w[h][t];
        top[h] = m;
        total[h] = sum;
    }
    /* o = sum_t w_t v_t / total, in key order: 32 columns (or 8 where fewer are left) of two
     * heads at a time, each value vector loaded once per pair of heads. */
    for (int64_t j = 0; j < d;) {
        const int wide = d - j >= 32;
        for (int h0 = 0; h0 < nh; h0 += 2) {
            const int h1 = h0 + 1 < nh ? h0 + 1 : h0;
            v8f a0 = splat8(0.0f), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t t = 0; t < visible; t++) {
                const char *vrow = values + t * row_bytes;
                const v8f w0 = splat8(w[h0][t]), w1 = splat8(w[h1][t]);
                v8f v = load8(vrow, j, pool_dtype);
                a0 = FMA8(w0, v, a0);
                b0 = FMA8(w1, v, b0);
                if (wide) {
                    v = load8(vrow, j + 8, pool_dtype);
                    a1 = FMA8(w0, v, a1);
                    b1 = FMA8(w1, v, b1);
                    v = load8(vrow, j + 16, pool_dtype);
                    a2 = FMA8(w0, v, a2);
                    b2 = FMA8(w1, v, b2);
                    v = load8(vrow, j + 24, pool_dtype);
                    a3 = FMA8(w0, v, a3);
                    b3 = FMA8(w1, v, b3);
                }
            }
            const v8f t0 = splat8(total[h0]), t1 = splat8(total[h1]);
            float *o0 = out->o + h0 * d + j, *o1 = out->o + h1 * d + j;
            *(v8f_u *)o0 = a0 / t0;
            *(v8f_u *)o1 = b0 / t1;
            if (wide) {
                *(v8f_u *)(o0 + 8) = a1 / t0, *(v8f_u *)(o0 + 16) = a2 / t0, *(v8f_u *)(o0 + 24) = a3 / t0;
                *(v8f_u *)(o1 + 8) = b1 / t1, *(v8f_u *)(o1 + 16) = b2 / t1, *(v8f_u *)(o1 + 24) = b3 / t1;
            }
        }
        j += wide ? 32 : 8;
    }
    for (int h = nh; h < LANES; h++) total[h] = 1.0f; /* unused lanes: keep log8 finite */
    out->lse = top + log8(total);
}

/* block_partial_t compiled once per pool dtype (a runtime dtype in its loops costs 2x). */
static void block_partial(const float *q, int nh, const char *keys, const char *values, int64_t visible,
                          int64_t row_bytes, int pool_dtype, const shape *sh, partial *out) {
    if (pool_dtype == DT_BF16) block_partial_t(q, nh, keys, values, visible, row_bytes, DT_BF16, sh, out);
    else if (pool_dtype == DT_F32) block_partial_t(q, nh, keys, values, visible, row_bytes, DT_F32, sh, out);
    else block_partial_t(q, nh, keys, values, visible, row_bytes, DT_F16, sh, out);
}

/* a <- a + b for nh heads; a head whose side is empty (lse -inf) takes the other as it is. */
static void merge(partial *a, const partial *b, int nh, int64_t d) {
    const v8f m = select8(a->lse > b->lse, a->lse, b->lse);
    const v8i a_empty = a->lse == splat8(NEG_INF), b_empty = b->lse == splat8(NEG_INF);
    /* Empty lanes get finite stand-ins, so no lane computes -inf - -inf. */
    const v8f safe_m = select8(a_empty & b_empty, splat8(0.0f), m);
    const v8f w1 = exp8(a->lse - safe_m), w2 = exp8(b->lse - safe_m), total = w1 + w2;
    const v8f lse = m + log8(select8(a_empty & b_empty, splat8(1.0f), total));
    for (int h = 0; h < nh; h++) {
        float *o1 = a->o + h * d;
        const float *o2 = b->o + h * d;
        if (b_empty[h]) continue;
        if (a_empty[h]) {
            memcpy(o1, o2, sizeof(float) * d);
            continue;
        }
        for (int64_t j = 0; j < d; j += 8) {
            v8f x = *(v8f_u *)(o1 + j) * splat8(w1[h]), y = *(const v8f_u *)(o2 + j) * splat8(w2[h]);
            *(v8f_u *)(o1 + j) = (x + y) / splat8(total[h]);
        }
    }
    a->lse = select8(b_empty, a->lse, select8(a_empty, b->lse, lse));
}

/* The pairwise tree over block indices, fed one block at a time, left to right. */
typedef struct {
    partial node[MAX_LEVELS];
    int64_t size[MAX_LEVELS]; /* blocks under each node: powers of two, decreasing */
    int depth, nh;
    int64_t d;
} tree;

/* A tree of `levels` levels (enough for 2^(levels-1) blocks) over `mem` (levels * LANES * d floats). */
static void tree_init(tree *t, float *mem, int levels, int nh, int64_t d) {
    for (int i = 0; i < levels; i++) t->node[i].o = mem + (int64_t)i * LANES * d;
    t->depth = 0;
    t->nh = nh;
    t->d = d;
}

/* Where the next block's partial goes before tree_push. */
static partial *tree_slot(tree *t) { return &t->node[t->depth]; }

/* Take the block in tree_slot: merge equal-sized subtrees. */
static void tree_push(tree *t) {
    t->size[t->depth++] = 1;
    while (t->depth >= 2 && t->size[t->depth - 1] == t->size[t->depth - 2]) {
        merge(&t->node[t->depth - 2], &t->node[t->depth - 1], t->nh, t->d);
        t->size[t->depth - 2] *= 2;
        t->depth--;
    }
}

/* The root: the remaining subtrees merged right to left (the empty right of the padded tree). */
static partial *tree_finish(tree *t) {
    if (t->depth == 0) {
        memset(t->node[0].o, 0, sizeof(float) * t->nh * t->d);
        t->node[0].lse = splat8(NEG_INF);
        return &t->node[0];
    }
    for (int i = t->depth - 2; i >= 0; i--) merge(&t->node[i], &t->node[i + 1], t->nh, t->d);
    return &t->node[0];
}

/* Per-thread scratch: a tree's nodes and the queries in fp32. */
static __thread float *scratch;
static __thread size_t scratch_elems;

/* 64-byte aligned (trees hold vectors); grown, never freed. */
static float *thread_scratch(size_t elems) {
    elems = (elems + 15) / 16 * 16;
    if (scratch_elems < elems) {
        free(scratch);
        scratch = aligned_alloc(64, elems * sizeof(float));
        scratch_elems = scratch ? elems : 0;
    }
    return scratch;
}

/* Tree levels for contexts of up to `blocks` blocks. */
static int levels_for(int64_t blocks) {
    int levels = 1;
    while (levels < MAX_LEVELS && ((int64_t)1 << (levels - 1)) < blocks) levels++;
    return levels;
}

static int check_shape(const shape *sh) {
    return sh->head_dim % 8 == 0 && sh->block_tokens <= MAX_BLOCK_TOKENS && sh->num_kv_heads > 0 &&
           sh->num_heads % sh->num_kv_heads == 0;
}

/* ---- the local kernel ------------------------------------------------------------------------ */

typedef struct {
    const void *q;          /* rows of num_heads * head_dim elements of q_dtype, q_stride apart */
    int64_t q_dtype;
    int64_t q_stride;
    void *out;              /* same layout, out_dtype */
    int64_t out_dtype;
    int64_t out_stride;
    const void *pool;       /* KV blocks of block_tokens rows of kv_dim elements: key block kb, value kb + 1 */
    int64_t pool_dtype;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_tokens;
    int64_t num_rows;
    const int64_t *rows;         /* [num_rows]: the q/out row of each query */
    const int64_t *positions;    /* indexed by row: the query's token position */
    const int64_t *tables;       /* key block of each context block, table_stride per sequence */
    int64_t table_stride;
    const int64_t *table_of_row; /* [num_rows]: which table each query reads */
    double scale;
    int64_t num_threads;
} attention_call;

/* Attention of each query over its context (blocks 0 .. position / block_tokens of its table).
 * Consecutive queries with one table (a prefill) go over its blocks up to QUERY_GROUP at a time,
 * each block loaded once for all of them; each query keeps its own tree, so grouping changes no bit.
 * Returns 0, -1 when out of memory, -2 on a shape the kernel does not handle. */
int invariant_attention(const attention_call *c) {
    const shape sh = {c->num_heads, c->num_kv_heads, c->head_dim, c->block_tokens, (float)c->scale};
    if (!check_shape(&sh) || c->num_rows == 0) return check_shape(&sh) ? 0 : -2;
    const int64_t d = sh.head_dim, group = sh.num_heads / sh.num_kv_heads, kv_dim = sh.num_kv_heads * d;
    const int64_t chunks = (group + LANES - 1) / LANES; /* passes over one kv head's query heads */
    const int pdt = (int)c->pool_dtype, qdt = (int)c->q_dtype, odt = (int)c->out_dtype;
    const int64_t row_bytes = kv_dim * (int64_t)dtype_size(pdt), block_bytes = sh.block_tokens * row_bytes;
    int64_t work = 0, max_position = 0;
    for (int64_t i = 0; i < c->num_rows; i++) {
        const int64_t position = c->positions[c->rows[i]];
        work += (position + 1) * sh.num_heads * d;
        max_position = position > max_position ? position : max_position;
    }
    int threads = work < PARALLEL_MIN_WORK || c->num_threads < 1 ? 1 : (int)c->num_threads;
    /* Query groups: runs of at most `run` consecutive rows reading one table. Grouping saves
     * block loads but makes few items: a step verifying one request's 1 + k drafts is one run,
     * as many items as kv heads (3 on 2 threads: 2 against 1). Runs are shortened until the
     * items are ITEMS_PER_THREAD per thread where the rows allow (the same bits either way). */
    const int64_t per_row = sh.num_kv_heads * chunks;
    int64_t run = c->num_rows * per_row / (ITEMS_PER_THREAD * threads);
    run = run < 1 ? 1 : run > QUERY_GROUP ? QUERY_GROUP : run;
    int64_t *starts = malloc(sizeof(int64_t) * (c->num_rows + 1));
    if (!starts) return -1;
    int64_t groups = 0;
    for (int64_t i = 0; i < c->num_rows; i++)
        if (i == 0 || c->table_of_row[i] != c->table_of_row[i - 1] || i - starts[groups - 1] == run)
            starts[groups++] = i;
    starts[groups] = c->num_rows;
    const int levels = levels_for(max_position / sh.block_tokens + 1);
    const int64_t items = groups * per_row;
    int failed = 0;

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* Per query of a group: its tree's nodes and its query heads in fp32; then the trees. */
        const size_t per_query = (size_t)(levels + 1) * LANES * d;
        float *mem = thread_scratch(QUERY_GROUP * per_query + QUERY_GROUP * sizeof(tree) / sizeof(float));
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!mem) continue;
            const int64_t g = item / (sh.num_kv_heads * chunks), kvh = item / chunks % sh.num_kv_heads;
            const int64_t first = kvh * group + item % chunks * LANES; /* first query head of the pass */
            const int nh = (int)(group - item % chunks * LANES < LANES ? group - item % chunks * LANES : LANES);
            const int64_t i0 = starts[g], count = starts[g + 1] - starts[g];
            const int64_t *table = c->tables + c->table_of_row[i0] * c->table_stride;
            tree *trees = (tree *)(mem + QUERY_GROUP * per_query);
            int64_t last_block = 0;
            for (int64_t i = 0; i < count; i++) {
                const int64_t row = c->rows[i0 + i];
                const char *qrow = (const char *)c->q + (size_t)row * c->q_stride * dtype_size(qdt);
                float *own = mem + i * per_query;
                widen_row(qrow + (size_t)first * d * dtype_size(qdt), qdt, nh * d, own + levels * LANES * d);
                tree_init(&trees[i], own, levels, nh, d);
                const int64_t blocks = c->positions[row] / sh.block_tokens;
                last_block = blocks > last_block ? blocks : last_block;
            }
            for (int64_t b = 0; b <= last_block; b++) {
                const char *keys = (const char *)c->pool + table[b] * block_bytes + kvh * d * dtype_size(pdt);
                for (int64_t i = 0; i < count; i++) {
                    const int64_t position = c->positions[c->rows[i0 + i]];
                    if (b * sh.block_tokens > position) continue;
                    const int64_t visible = position - b * sh.block_tokens + 1;
                    block_partial(mem + i * per_query + levels * LANES * d, nh, keys, keys + block_bytes,
                                  visible < sh.block_tokens ? visible : sh.block_tokens, row_bytes, pdt, &sh,
                                  tree_slot(&trees[i]));
                    tree_push(&trees[i]);
                }
            }
            for (int64_t i = 0; i < count; i++) {
                const partial *root = tree_finish(&trees[i]);
                const int64_t row = c->rows[i0 + i];
                char *orow = (char *)c->out + (size_t)row * c->out_stride * dtype_size(odt);
                for (int64_t j = 0; j < nh * d; j++) store1(orow, first * d + j, odt, root->o[j]);
            }
        }
    }
    free(starts);
    return failed ? -1 : 0;
}

/* ---- the split kernel: block partials where the blocks are, combined where the query is ---- */

typedef struct {
    const void *q;          /* [n, num_heads, head_dim] of q_dtype, contiguous */
    int64_t q_dtype;
    int64_t num_queries;
    const int64_t *positions;        /* [n] */
    const void *pool;
    int64_t pool_dtype;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_tokens;
    int64_t num_blocks;
    const int64_t *key_blocks;       /* [B]: key block id of each block (value block: + 1) */
    const int64_t *first_positions;  /* [B]: token position of each block's first slot */
    float *out;                      /* fp32 [n, B, num_heads, head_dim] */
    float *lse;                      /* fp32 [n, B, num_heads] */
    double scale;
    int64_t num_threads;
} partials_call;

/* Each query's partial over each block. Returns 0, -1 or -2 (see invariant_attention). */
int invariant_block_partials(const partials_call *c) {
    const shape sh = {c->num_heads, c->num_kv_heads, c->head_dim, c->block_tokens, (float)c->scale};
    if (!check_shape(&sh)) return -2;
    const int64_t d = sh.head_dim, H = sh.num_heads, group = H / sh.num_kv_heads, B = c->num_blocks;
    const int pdt = (int)c->pool_dtype, qdt = (int)c->q_dtype;
    const int64_t row_bytes = sh.num_kv_heads * d * (int64_t)dtype_size(pdt), block_bytes = sh.block_tokens * row_bytes;
    const int64_t items = c->num_queries * B;
    int threads = items * sh.block_tokens * H * d < PARALLEL_MIN_WORK || c->num_threads < 1 ? 1 : (int)c->num_threads;
    int failed = 0;

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *mem = thread_scratch(2 * LANES * d);
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < items; item++) {
            if (!mem) continue;
            const int64_t n = item / B, b = item % B;
            const int64_t visible = c->positions[n] - c->first_positions[b] + 1;
            const char *block = (const char *)c->pool + c->key_blocks[b] * block_bytes;
            for (int64_t kvh = 0; kvh < sh.num_kv_heads; kvh++)
                for (int64_t first = kvh * group; first < (kvh + 1) * group; first += LANES) {
                    const int nh = (int)((kvh + 1) * group - first < LANES ? (kvh + 1) * group - first : LANES);
                    const char *keys = block + kvh * d * dtype_size(pdt);
                    widen_row((const char *)c->q + (size_t)(n * H + first) * d * dtype_size(qdt), qdt, nh * d, mem);
                    partial p = {mem + LANES * d, splat8(0.0f)};
                    block_partial(mem, nh, keys, keys + block_bytes,
                                  visible < sh.block_tokens ? visible : sh.block_tokens, row_bytes, pdt, &sh, &p);
                    memcpy(c->out + ((n * B + b) * H + first) * d, p.o, sizeof(float) * nh * d);
                    for (int h = 0; h < nh; h++) c->lse[(n * B + b) * H + first + h] = p.lse[h];
                }
        }
    }
    return failed ? -1 : 0;
}

typedef struct {
    const float *partials;  /* fp32 [n, B, num_heads, head_dim]: the partial of logical block b */
    const float *lse;       /* fp32 [n, B, num_heads]; -inf for a block the query does not see */
    int64_t num_queries;
    int64_t num_blocks;
    int64_t num_heads;
    int64_t head_dim;
    float *out;             /* fp32 [n, num_heads, head_dim] */
    float *out_lse;         /* fp32 [n, num_heads]: the log-sum-exp over every block */
    int64_t num_threads;
} combine_call;

/* Each query's attention from its block partials, in logical block order. Returns 0, -1 or -2. */
int invariant_combine_partials(const combine_call *c) {
    const int64_t d = c->head_dim, H = c->num_heads, B = c->num_blocks;
    const int64_t chunks = (H + LANES - 1) / LANES, items = c->num_queries * chunks;
    if (d % 8) return -2;
    const int levels = levels_for(B);
    int threads = items * B * d < PARALLEL_MIN_WORK || c->num_threads < 1 ? 1 : (int)c->num_threads;
    int failed = 0;

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *mem = thread_scratch((size_t)levels * LANES * d);
        if (!mem) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (!mem) continue;
            const int64_t n = item / chunks, first = item % chunks * LANES;
            const int nh = (int)(H - first < LANES ? H - first : LANES);
            tree t;
            tree_init(&t, mem, levels, nh, d);
            for (int64_t b = 0; b < B; b++) {
                partial *slot = tree_slot(&t);
                memcpy(slot->o, c->partials + ((n * B + b) * H + first) * d, sizeof(float) * nh * d);
                slot->lse = splat8(NEG_INF);
                for (int h = 0; h < nh; h++) slot->lse[h] = c->lse[(n * B + b) * H + first + h];
                tree_push(&t);
            }
            const partial *root = tree_finish(&t);
            memcpy(c->out + (n * H + first) * d, root->o, sizeof(float) * nh * d);
            for (int h = 0; h < nh; h++) c->out_lse[n * H + first + h] = root->lse[h];
        }
    }
    return failed ? -1 : 0;
}
