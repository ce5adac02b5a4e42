/* The whole decoder stack for one decode step of a few sequences, in one call.
 *
 * At batch 1 the model's arithmetic is small and its weights are small (GGUF blocks, see
 * block_quant.h); what a step of torch ops costs on CPU is mostly dispatch: hundreds of ops a
 * few microseconds each. Here one OpenMP region runs every layer: threads split each matmul's
 * output rows and each attention's (sequence, split of positions, kv head) tasks, and meet at a
 * barrier between phases; the small ops run on one thread, their cost being a few hundred
 * floats. The KV cache may be float32, float16 or bfloat16 (kv_rows.h): at a long context its
 * reads rival the weights', and 16 bits halve them.
 *
 * Per layer, for B sequences with one new token each (x and residual [B, H]):
 *   residual += x (the first layer: residual = x); h = rmsnorm(residual) * input_norm
 *   qkv = h Wqkv^T (+ bias); RoPE on q and k by position; k, v -> their cache slots
 *   attn = softmax(q k^T * scale) v over the sequence's cached positions, grouped-query heads
 *   residual += attn Wo^T (+ bias); h = rmsnorm(residual) * post_norm
 *   x = (silu(gate) * up) Wdown^T where [gate, up] = h Wgate_up^T
 * and finally hidden = x + residual (the input of the model's final norm), written over x.
 * The arithmetic mirrors the torch model op for op in float32.
 */
#include <math.h>
#include <stdlib.h>

#include "block_quant.h"
#include "paged_attention.h"
#include "q8_act.h"
#include "q8k_act.h"
#include "row_ops.h"

#define MAX_ROWS 16 /* kernels/decode_step.py's MAX_ROWS */

#define MAX_PARTS 3 /* kernels/decode_step.py's MAX_PARTS */

/* One matrix of rows x K: 4 (q4), 8 (q8), 16 (q8_16), 9 (q8m), 44 (Q4_K) or 66 (Q6_K), see
 * block_quant.h */
typedef struct {
    int32_t kind;
    int32_t pad;
    const void *codes;
    const float *d, *m;
    int64_t rows;
} bq_part;

/* A layer's matmul weight: up to MAX_PARTS matrices stacked along N (q, k and v; gate and up),
 * each in its own kind, as a mapped GGUF file holds them */
typedef struct {
    int32_t num_parts;
    int32_t pad;
    bq_part parts[MAX_PARTS];
} bq_weight;

typedef struct {
    const float *input_norm, *post_norm; /* [H] */
    const float *qkv_bias, *o_bias;      /* NULL when absent */
    bq_weight qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_blocks, bs, hkv, d] of the shape's kv_kind */
} decode_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, bs, num_blocks, max_blocks;
    float eps, scale;
    int32_t kv_kind;   /* the caches' type (kv_rows.h) */
    int32_t split_len; /* positions per attention split (paged_attention.h) */
    int32_t act_q8;    /* 1: matmuls take int8 activations (q8_act.h) */
    int32_t pad;
} decode_shape;

/* Scratch of B rows each: h [H], qkv [(hq + 2 hkv) d], attn [hq d], gate_up [2 I], act [I]. */
typedef struct {
    float *residual, *h, *qkv, *attn, *gate_up, *act;
} decode_scratch;

/* residual += x (residual = x on the first layer), h = rmsnorm(residual) * weight, per row */
static void norm_rows(const float *x, float *residual, int first, const float *weight, float eps,
                      float *out, int64_t rows, int64_t h) {
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(x + r * h, first ? NULL : residual + r * h, weight, eps, out + r * h,
                     residual + r * h, h);
}

/* bias, RoPE and the cache write for every row's fresh q, k, v */
static void place_qkv(const decode_shape *sh, const decode_layer *ly, float *qkv, int64_t rows,
                      const int64_t *positions, const int64_t *slots, const float *cos_sin) {
    const int64_t d = sh->head_dim, q_size = sh->heads * d, kv_size = sh->kv_heads * d;
    const int64_t width = q_size + 2 * kv_size;
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * width;
        if (ly->qkv_bias)
            for (int64_t i = 0; i < width; i++) row[i] += ly->qkv_bias[i];
        const float *cs = cos_sin + positions[r] * d;
        for (int64_t h = 0; h < sh->heads + sh->kv_heads; h++) rotate_half(row + h * d, cs, d / 2);
        kv_store(ly->k_cache, sh->kv_kind, slots[r] * kv_size, row + q_size, kv_size);
        kv_store(ly->v_cache, sh->kv_kind, slots[r] * kv_size, row + q_size + kv_size, kv_size);
    }
}

/* Task u of a layer's attention: split u of every row's splits (off, see paged_attention.h),
 * every kv head; each head's partial goes beside that head's other splits. */
static void attend_task(const decode_shape *sh, const decode_layer *ly, const float *qkv,
                        const int64_t *off, int64_t rows, const int32_t *block_tables,
                        const int32_t *seq_lens, float *parts, float *run, int64_t u) {
    const int64_t d = sh->head_dim, hkv = sh->kv_heads, group = sh->heads / hkv;
    const int64_t width = (sh->heads + 2 * hkv) * d, part_size = group * partial_width(d);
    const int64_t b = split_row(off, rows, u), s = u - off[b], splits = off[b + 1] - off[b];
    const int64_t begin = s * sh->split_len;
    const int64_t end = begin + sh->split_len < seq_lens[b] ? begin + sh->split_len : seq_lens[b];
    attend_range(qkv + b * width, sh->heads, ly->k_cache, ly->v_cache, sh->kv_kind, hkv, d,
                 sh->bs, block_tables + b * sh->max_blocks, begin, end, sh->scale, run,
                 parts + (off[b] * hkv + s) * part_size, splits * part_size);
}

/* Merge task t: row t / hkv, kv head t % hkv, its splits into the attention output. */
static void merge_task(const decode_shape *sh, const int64_t *off, const float *parts,
                       float *attn, int64_t t) {
    const int64_t d = sh->head_dim, hkv = sh->kv_heads, group = sh->heads / hkv;
    const int64_t b = t / hkv, g = t % hkv, splits = off[b + 1] - off[b];
    merge_splits(parts + (off[b] * hkv + g * splits) * group * partial_width(d), splits, group,
                 d, attn + b * sh->heads * d + g * group * d);
}

/* Int8 activation rows, each quantized twice where K allows: per 32 for plane kinds (q8_act.h)
 * and per super-block for K-quant rows (q8k_act.h), row r's buffers at buf + r * stride */
typedef struct {
    q8_row q[MAX_ROWS];
    q8k_row qk[MAX_ROWS];
} act_rows;

/* where row r's two buffers lie, for k */
static void lay_rows(char *buf, int64_t stride, int64_t kstride, int64_t rows, int64_t k,
                     act_rows *a) {
    for (int64_t r = 0; r < rows; r++) {
        a->q[r] = q8_row_at(buf + r * stride, k);
        a->qk[r] = q8k_row_at(buf + r * stride + kstride, k);
    }
}

static void quantize_rows(const float *x, int64_t rows, int64_t k, char *buf, int64_t stride,
                          int64_t kstride, act_rows *a) {
    lay_rows(buf, stride, kstride, rows, k, a);
    for (int64_t r = 0; r < rows; r++) {
        quantize_row_q8(x + r * k, k, a->q + r);
        if (k % QK_K == 0) quantize_row_q8k(x + r * k, k, a->qk + r);
    }
}

/* out = x W^T through whichever activations the shape asks for; every thread calls it. With
 * int8 activations, a holds x already quantized. */
static void matmul_for(const decode_shape *sh, const bq_weight *wt, const float *x,
                       const act_rows *a, float *out, int64_t rows, int64_t n, int64_t k,
                       float *w) {
    int64_t at = 0; /* each part fills its columns of out's rows */
    for (int32_t i = 0; i < wt->num_parts; i++) {
        const bq_part *p = wt->parts + i;
        if (sh->act_q8 && is_kquant(p->kind))
            q8k_matmul_for(p->kind, a->qk, p->codes, out + at, rows, p->rows, k, n);
        else if (sh->act_q8)
            q8a_matmul_for(p->kind, a->q, p->codes, p->d, p->m, out + at, rows, p->rows, k, n);
        else
            bq_matmul_for(p->kind, x, p->codes, p->d, p->m, out + at, rows, p->rows, k, n, w);
        at += p->rows;
    }
}

/* block weights, or plain float32 rows (KIND_F32: the fixed-order matmul of a float32 model;
 * int8 activations quantize against blocks only), whose parts' rows add up to n */
static int valid_weight(const decode_shape *sh, const bq_weight *w, int64_t n, int64_t k) {
    if (w->num_parts < 1 || w->num_parts > MAX_PARTS || k > MAX_K) return 0;
    int64_t rows = 0;
    for (int32_t i = 0; i < w->num_parts; i++) {
        const bq_part *p = w->parts + i;
        const int kind_ok = valid_kind(p->kind) || (p->kind == KIND_F32 && !sh->act_q8);
        if (!kind_ok || !valid_k(p->kind, k) || p->rows < 1) return 0;
        rows += p->rows;
    }
    return rows == n;
}

/* x [B, H]: the token embeddings in, the hidden states out. positions, slots int64 [B];
 * block_tables int32 [B, max_blocks]; seq_lens int32 [B] (the new token included).
 * Returns 0; -1 for a shape or KV kind it does not support; -2, touching nothing, if a position,
 * slot, sequence length or block id is out of range; -3 if scratch memory could not be had. */
int decode_step(const decode_shape *sh, const decode_layer *layers, int64_t num_layers, float *x,
                int64_t rows, const int64_t *positions, const int64_t *slots,
                const int32_t *block_tables, const int32_t *seq_lens, const float *cos_sin,
                int64_t num_positions, const decode_scratch *sc) {
    const int64_t d = sh->head_dim, hq = sh->heads, hkv = sh->kv_heads, hidden = sh->hidden;
    if (hkv < 1 || hq % hkv || hq / hkv > MAX_GROUP || d > MAX_HEAD_DIM || hkv * d > TILE ||
        d % 2 || !kv_kind_ok(sh->kv_kind) || sh->split_len < CHUNK || sh->split_len % CHUNK ||
        rows < 1 || rows > MAX_ROWS)
        return -1;
    for (int64_t i = 0; i < num_layers; i++) {
        const decode_layer *ly = layers + i;
        if (!valid_weight(sh, &ly->qkv, (hq + 2 * hkv) * d, hidden) ||
            !valid_weight(sh, &ly->o, hidden, hq * d) ||
            !valid_weight(sh, &ly->gate_up, 2 * sh->inter, hidden) ||
            !valid_weight(sh, &ly->down, hidden, sh->inter))
            return -1;
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = seq_lens[r], used = (len + sh->bs - 1) / sh->bs;
        if (positions[r] < 0 || positions[r] >= num_positions || len < 1 || used > sh->max_blocks ||
            slots[r] < 0 || slots[r] >= sh->num_blocks * sh->bs)
            return -2;
        for (int64_t j = 0; j < used; j++) {
            const int32_t blk = block_tables[r * sh->max_blocks + j];
            if (blk < 0 || blk >= sh->num_blocks) return -2;
        }
    }
    const int64_t qkv_width = (hq + 2 * hkv) * d;
    int64_t off[MAX_ROWS + 1];
    const int64_t num_tasks = split_offsets(seq_lens, rows, sh->split_len, off);
    /* the partials, then each thread's running sums (attend_range) */
    const int64_t part_floats = num_tasks * hq * partial_width(d), run = run_floats(hq, d);
    float *parts = alloc_parts(part_floats, run);
    /* int8 activation rows, each laid out for the K of the matmul at hand */
    const int64_t kmax = hidden > hq * d ? (hidden > sh->inter ? hidden : sh->inter)
                                         : (hq * d > sh->inter ? hq * d : sh->inter);
    const int64_t k_stride = q8_row_bytes(kmax);
    const int64_t q_stride = k_stride + q8k_row_bytes(kmax / QK_K * QK_K);
    char *q_buf = sh->act_q8 ? aligned_alloc(64, (size_t)(rows * q_stride)) : NULL;
    act_rows q;
    if (!parts || (sh->act_q8 && !q_buf)) {
        free(parts);
        free(q_buf);
        return -3;
    }
#pragma omp parallel
    {
        float w[MAX_K] __attribute__((aligned(64)));
        float *own = thread_run(parts, part_floats, run);
        for (int64_t i = 0; i < num_layers; i++) {
            const decode_layer *ly = layers + i;
#pragma omp single
            {
                norm_rows(x, sc->residual, i == 0, ly->input_norm, sh->eps, sc->h, rows, hidden);
                if (sh->act_q8) quantize_rows(sc->h, rows, hidden, q_buf, q_stride, k_stride, &q);
            }
            matmul_for(sh, &ly->qkv, sc->h, &q, sc->qkv, rows, qkv_width, hidden, w);
#pragma omp single
            place_qkv(sh, ly, sc->qkv, rows, positions, slots, cos_sin);
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < num_tasks; t++)
                attend_task(sh, ly, sc->qkv, off, rows, block_tables, seq_lens, parts, own, t);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < rows * hkv; t++) merge_task(sh, off, parts, sc->attn, t);
            if (sh->act_q8) {
#pragma omp single
                quantize_rows(sc->attn, rows, hq * d, q_buf, q_stride, k_stride, &q);
            }
            matmul_for(sh, &ly->o, sc->attn, &q, x, rows, hidden, hq * d, w);
#pragma omp single
            {
                if (ly->o_bias)
                    for (int64_t r = 0; r < rows; r++)
                        for (int64_t j = 0; j < hidden; j++) x[r * hidden + j] += ly->o_bias[j];
                norm_rows(x, sc->residual, 0, ly->post_norm, sh->eps, sc->h, rows, hidden);
                if (sh->act_q8) quantize_rows(sc->h, rows, hidden, q_buf, q_stride, k_stride, &q);
            }
            matmul_for(sh, &ly->gate_up, sc->h, &q, sc->gate_up, rows, 2 * sh->inter, hidden, w);
            const int64_t inter = sh->inter;
            /* span by span, not row by row: at batch 1 one thread ran the whole row while the
             * others waited at the barrier */
            const int64_t spans = (inter + SILU_SPAN - 1) / SILU_SPAN;
#pragma omp for schedule(static)
            for (int64_t e = 0; e < rows * spans; e++) {
                const int64_t r = e / spans, at = (e % spans) * SILU_SPAN;
                const float *g = sc->gate_up + r * 2 * inter + at;
                silu_mul_span(g, g + inter, sc->act + r * inter + at,
                              inter - at < SILU_SPAN ? inter - at : SILU_SPAN);
            }
            if (sh->act_q8) {
                /* block by block: at batch 1 a row per thread left the others waiting */
                const int64_t nb = inter / QBLOCK, supers = inter % QK_K ? 0 : inter / QK_K;
#pragma omp single
                lay_rows(q_buf, q_stride, k_stride, rows, inter, &q);
#pragma omp for schedule(static)
                for (int64_t e = 0; e < rows * (nb + supers); e++) {
                    const int64_t r = e / (nb + supers), blk = e % (nb + supers);
                    const float *xr = sc->act + r * inter;
                    if (blk >= nb) {
                        quantize_superblock_q8k(xr + (blk - nb) * QK_K, blk - nb, q.qk + r);
                        continue;
                    }
                    quantize_block_q8(xr + blk * QBLOCK, blk, q.q + r);
                    if (blk == nb - 1) pad_q8_row(q.q + r, nb);
                }
            }
            matmul_for(sh, &ly->down, sc->act, &q, x, rows, hidden, inter, w);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < rows * hidden; j++) x[j] += sc->residual[j];
    }
    free(parts);
    free(q_buf);
    return 0;
}
