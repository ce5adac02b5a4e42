/* out[M, N] = x[M, K] @ W[N, K]^T for weights kept in GGUF-style blocks of 32 along K.
 *
 * Decode is bandwidth-bound, so the weights stay in their small block form and each row is
 * expanded to float32 in L1 right before use:
 *   q4: codes uint8 [N, K/2] (byte j of a block holds element j in its low nibble and element
 *       j+16 in its high one), w = d * code + m with float32 d, m [N, K/32] (Q4_0 and Q4_1);
 *   q8: codes int8 [N, K], w = d * code with float32 d [N, K/32] (Q8_0, Q5_0);
 *   q8_16: the same with a d per 16 codes, d [N, K/16] (Q6_K);
 *   q8m: codes int8 [N, K], w = d * code + m as q4 (Q5_1, Q5_K).
 * The expanded row is fl(d * code + m), rounded once (fma), which is what gguf's numpy
 * dequantizer produces, so W here is bit-for-bit the float32 matrix a dequantized load holds.
 *
 * Every dot product runs in one fixed order (64 partial sums over k, then a fixed reduction; see
 * block_quant.h), whatever M is, however rows are split between threads and whichever SIMD path
 * the host compiled: a token's logits do not depend on what else shares its batch. Threads split
 * N through OpenMP; the library links the libgomp torch already loaded, so torch and this kernel
 * share one thread pool.
 *
 * One entry point leaves that order: block_quant_matmul_amx (amx_matmul.h), for prefill-sized
 * matmuls, which the engine calls only past a decode step's row counts.
 */
#define _GNU_SOURCE /* syscall(), which asks Linux for the AMX tile state */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "block_quant.h"
#include "block_tiles.h"
#include "q8_act.h"
#include "q8k_act.h"

#if defined(BQ_TILES)
/* bq_tiles_for with its buffers: x's packed tiles, and each thread's weight tile. Returns 0, or
 * -3 if the memory could not be had. */
static int tiled_matmul(int kind, const float *x, const void *codes, const float *d,
                        const float *m, float *out, int64_t rows, int64_t n, int64_t k) {
    const int64_t per_thread = tile_scratch_floats(k), threads = omp_get_max_threads();
    const size_t x_floats = (size_t)(rows / TILE_M * TILE_M * tile_rounds(k) * NUM_PARTIALS);
    float *xp = aligned_alloc(64, (x_floats + 16) * sizeof(float));
    float *scratch = aligned_alloc(64, (size_t)(threads * per_thread) * sizeof(float));
    if (!xp || !scratch) {
        free(xp);
        free(scratch);
        return -3;
    }
    pack_x_tiles(x, rows, k, xp);
#pragma omp parallel
    bq_tiles_for(kind, x, xp, codes, d, m, out, rows, n, k,
                 scratch + omp_get_thread_num() * per_thread);
    free(scratch);
    free(xp);
    return 0;
}
#endif

/* kind 4: q4 and 9: q8m (codes, d, m); kind 8: q8 and 16: q8_16 (codes, d; m unused). Tens
 * of rows take the tiles (block_tiles.h), with the same bits. Returns 0, -1 for a bad K or
 * kind, -3 if the tiles' scratch memory could not be had. */
int block_quant_matmul(int kind, const float *x, const void *codes, const float *d,
                       const float *m, float *out, int64_t rows, int64_t n, int64_t k) {
    if (!valid_k(kind, k) || k > MAX_K || !valid_kind(kind)) return -1;
#if defined(BQ_TILES)
    /* NOTE: the tiles read plane kinds only; K-quant rows keep bq_matmul_for at any count */
    if (rows >= TILE_MIN_ROWS && !is_kquant(kind))
        return tiled_matmul(kind, x, codes, d, m, out, rows, n, k);
#endif
#pragma omp parallel
    {
        float w[MAX_K] __attribute__((aligned(64)));
        bq_matmul_for(kind, x, codes, d, m, out, rows, n, k, n, w);
    }
    return 0;
}

/* K-quant rows against x quantized per super-block (q8k_act.h), the rows quantized in
 * parallel */
static int kquant_matmul_q8k(int kind, const float *x, const void *codes, float *out,
                             int64_t rows, int64_t n, int64_t k) {
    const int64_t row_bytes = q8k_row_bytes(k), supers = k / QK_K;
    char *buf = aligned_alloc(64, (size_t)(rows * row_bytes));
    q8k_row *q = malloc((size_t)rows * sizeof(q8k_row));
    if (!buf || !q) {
        free(buf);
        free(q);
        return -3;
    }
    for (int64_t r = 0; r < rows; r++) q[r] = q8k_row_at(buf + r * row_bytes, k);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t e = 0; e < rows * supers; e++)
            quantize_superblock_q8k(x + (e / supers) * k + (e % supers) * QK_K, e % supers,
                                    q + e / supers);
        q8k_matmul_for(kind, q, codes, out, rows, n, k, n);
    }
    free(q);
    free(buf);
    return 0;
}

/* block_quant_matmul with x's rows quantized to int8 first: per 32 against plane kinds
 * (q8_act.h), per super-block against K-quant rows (q8k_act.h). Returns 0, -1 for a bad K or
 * kind, -3 if scratch memory could not be had. */
int block_quant_matmul_q8a(int kind, const float *x, const void *codes, const float *d,
                           const float *m, float *out, int64_t rows, int64_t n, int64_t k) {
    if (!valid_k(kind, k) || k > MAX_K || !valid_kind(kind)) return -1;
    if (is_kquant(kind)) return kquant_matmul_q8k(kind, x, codes, out, rows, n, k);
    const int64_t row_bytes = q8_row_bytes(k);
    char *buf = aligned_alloc(64, (size_t)(rows * row_bytes));
    q8_row *q = malloc((size_t)rows * sizeof(q8_row));
    if (!buf || !q) {
        free(buf);
        free(q);
        return -3;
    }
    for (int64_t r = 0; r < rows; r++) {
        q[r] = q8_row_at(buf + r * row_bytes, k);
        quantize_row_q8(x + r * k, k, q + r);
    }
#pragma omp parallel
    q8a_matmul_for(kind, q, codes, d, m, out, rows, n, k, n);
    free(q);
    free(buf);
    return 0;
}

#include "amx_tiles.h"
#if AMX_BUILD
#include "amx_matmul.h"
#endif

/* 1 when this build has the AMX path (amx_matmul.h) and the kernel lets the process use AMX */
int block_quant_amx_ready(void) {
#if AMX_BUILD
    return amx_permitted();
#else
    return 0;
#endif
}

/* out[M, N] = x[M, K] @ W[N, K]^T on AMX (amx_matmul.h): the dequantized matrix's products to
 * float32 accuracy, not the block kernel's bits. Returns 0, -1 where the build or the kernel
 * has no AMX, or for a bad K or kind, -3 if scratch memory could not be had. */
int block_quant_matmul_amx(int kind, const float *x, const void *codes, const float *d,
                           const float *m, float *out, int64_t rows, int64_t n, int64_t k) {
#if AMX_BUILD
    /* the AMX panels read plane kinds only */
    if (k % QBLOCK != 0 || k > MAX_K || !valid_kind(kind) || is_kquant(kind) || !amx_permitted())
        return -1;
    /* per thread: 16 weight rows' parts, and at least two chunks' (amx_matmul_for) */
    const int64_t chunks = k / AMX_CHUNK > 2 ? k / AMX_CHUNK : 2;
    const int64_t per_thread = chunks * AMX_PARTS * 1024;
    const int64_t threads = omp_get_max_threads();
    uint8_t *xbuf = aligned_alloc(64, (size_t)amx_x_bytes(rows, k));
    uint8_t *scratch = aligned_alloc(64, (size_t)(threads * per_thread));
    if (!xbuf || !scratch) {
        free(xbuf);
        free(scratch);
        return -3;
    }
#pragma omp parallel
    {
        uint8_t *own = scratch + omp_get_thread_num() * per_thread;
        amx_pack_x(x, rows, k, xbuf);
        amx_matmul_for(kind, xbuf, codes, d, m, out, rows, n, k, (__m512i *)own);
    }
    free(scratch);
    free(xbuf);
    return 0;
#else
    (void)kind, (void)x, (void)codes, (void)d, (void)m, (void)out, (void)rows, (void)n, (void)k;
    return -1;
#endif
}

/* 1 when int8 activations run on AVX-512 VNNI or AVX2 here, 0 when on the portable loops (which
 * are slower than the float32 path: the engine only turns int8 activations on where this is 1) */
int block_quant_q8a_fast(void) {
#if defined(Q8A_SIMD)
    return 1;
#else
    return 0;
#endif
}

/* The float32 matrix itself, [N, K] (prefill hands it to a GEMM). */
int block_quant_dequantize(int kind, const void *codes, const float *d, const float *m,
                           float *out, int64_t n, int64_t k) {
    if (!valid_k(kind, k) || k > MAX_K || !valid_kind(kind)) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) expand_row(kind, codes, d, m, j, k, out + j * k);
    return 0;
}

/* float32 to bfloat16, rounded to nearest even as torch rounds (no NaN in a weight matrix) */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The matrix in bfloat16, [N, K]: each row widened to float32 as above, then rounded, so it is
 * the float32 matrix's .to(torch.bfloat16) bit for bit, at half the bytes written (prefill's
 * bfloat16 GEMM, engine/quant.py's bf16_prefill). */
int block_quant_dequantize_bf16(int kind, const void *codes, const float *d, const float *m,
                                uint16_t *out, int64_t n, int64_t k) {
    if (!valid_k(kind, k) || k > MAX_K || !valid_kind(kind)) return -1;
#pragma omp parallel
    {
        float row[MAX_K];
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            expand_row(kind, codes, d, m, j, k, row);
            uint16_t *o = out + j * k;
            for (int64_t i = 0; i < k; i++) o[i] = bf16_of(row[i]);
        }
    }
    return 0;
}

/* Rows ids[0 .. count) of the float32 matrix, [count, K] (an embedding lookup); -2, writing
 * nothing, when an id is outside [0, n). */
int block_quant_dequantize_rows(int kind, const void *codes, const float *d, const float *m,
                                const int64_t *ids, int64_t count, float *out, int64_t n,
                                int64_t k) {
    if (!valid_k(kind, k) || k > MAX_K || !valid_kind(kind)) return -1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -2;
#pragma omp parallel for schedule(static) if (count > 8)
    for (int64_t i = 0; i < count; i++) expand_row(kind, codes, d, m, ids[i], k, out + i * k);
    return 0;
}

/* out[M, N] = x[M, K] @ W[N, K]^T for a float32 W, each dot product in the block kernel's fixed
 * order: over the dequantized matrix this is the block matmul, bit for bit (the tests' yardstick).
 * It is also the engine's decode matmul over float32 weights: each weight row is read once for
 * up to four rows of x, where a BLAS GEMV/GEMM this small runs at a fraction of the memory
 * bandwidth. */
int fixed_order_matmul(const float *x, const float *w, float *out, int64_t rows, int64_t n,
                       int64_t k) {
    if (k % QBLOCK != 0 || k > MAX_K) return -1;
#pragma omp parallel
    {
        float buf[MAX_K] __attribute__((aligned(64)));
        bq_matmul_for(KIND_F32, x, w, NULL, NULL, out, rows, n, k, n, buf);
    }
    return 0;
}

/* The fewest rows of x that take the tiles (block_tiles.h) in this build, 0 where it has none */
int block_quant_tile_min_rows(void) {
#if defined(BQ_TILES)
    return TILE_MIN_ROWS;
#else
    return 0;
#endif
}

/* 16 (AVX-512), 8 (AVX2+FMA) or 1 (portable): which path this build took */
int block_quant_lanes(void) {
#if defined(BQ_SIMD)
    return LANES;
#else
    return 1;
#endif
}
