/* Prefill-sized block matmuls (17 to 256 rows of x: a new question after cached documents) on
 * AMX's bfloat16 tile products, to float32 accuracy.
 *
 * The block tiles (block_tiles.h) run float32 fused multiply-adds at their peak, about 100
 * GFLOP/s a core here; AMX multiplies 16 x 32 by 32 x 16 bfloat16 matrices in one instruction.
 * Its inputs have 8 significant bits, so both operands, the expanded weight fl(d * c + m) and
 * x, are split into three bfloat16 parts that add up to them exactly: each part is the top 16
 * bits of what the parts before it left, rounded, so each part is at most 2^-8 of the one
 * before and 3 x 8 bits hold float32's 24. Six of the nine products of parts are kept: the
 * other three are at most 2^-24 of the whole, float32's own rounding. Each product of parts is
 * exact in float32 and the tile unit adds them in float32, so a result is the dot product over
 * the dequantized matrix to float32 accuracy, in another summation order than the block
 * kernel's: not its bits.
 *
 * The weights are the tile products' left operand (16 weight rows by a chunk of 32 elements, as
 * a row lies), unpacked and split once per 16 rows for all rows of x (amx_matmul_for says
 * when, and q4_block_parts how q4 blocks are split cheaply); x is the right operand,
 * in AMX's pair layout, laid out once per call. C then holds 16 weight rows by 16 rows of x,
 * transposed into out. Tiles: C for two tiles of 16 rows of x (0, 1), the weights' three parts
 * (2 to 4), x's three parts for one tile (5 to 7); a chunk is 12 products.
 */
#ifndef PREFIXRAG_AMX_MATMUL_H
#define PREFIXRAG_AMX_MATMUL_H
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "block_quant.h"

#define AMX_CHUNK 32 /* bfloat16 elements in a tile row: one block */
#define AMX_PARTS 3 /* bfloat16 parts of each operand */

/* Bytes of x's packed parts for rows of x and k: [tile pair][chunk][2 tiles][part][16 pairs][16
 * rows of x][2] bfloat16 */
static inline int64_t amx_pairs(int64_t rows) { return (rows + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS); }
static inline int64_t amx_x_bytes(int64_t rows, int64_t k) {
    return amx_pairs(rows) * (k / AMX_CHUNK) * 2 * AMX_PARTS * 1024;
}

/* x's parts laid out as the right operand of the tile products, each (tile of 16 rows, chunk,
 * part) one 1 KB tile whose row i holds, for each of the 16 rows of x, elements 2i and 2i + 1
 * of the chunk; rows past `rows` are zero. Call from every thread of a parallel region; ends
 * with the loop's barrier. */
static inline void amx_pack_x(const float *x, int64_t rows, int64_t k, uint8_t *buf) {
    const int64_t chunks = k / AMX_CHUNK, tiles = amx_pairs(rows) * 2;
    __m512i *xp = (__m512i *)buf;
#pragma omp for schedule(static)
    for (int64_t e = 0; e < tiles * chunks; e++) {
        const int64_t tile = e / chunks, c = e % chunks;
        __m512i part[AMX_PARTS][AMX_ROWS];
        for (int64_t t = 0; t < AMX_ROWS; t++) {
            const int64_t r = tile * AMX_ROWS + t;
            __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
            if (r < rows) {
                lo = _mm512_loadu_ps(x + r * k + c * AMX_CHUNK);
                hi = _mm512_loadu_ps(x + r * k + c * AMX_CHUNK + 16);
            }
            __m512i parts[AMX_PARTS];
            split_bf16(lo, hi, parts, AMX_PARTS);
            for (int s = 0; s < AMX_PARTS; s++) part[s][t] = parts[s];
        }
        const int64_t at = (((tile / 2) * chunks + c) * 2 + tile % 2) * AMX_PARTS;
        for (int s = 0; s < AMX_PARTS; s++) {
            transpose16(part[s]); /* row i: pair i of every row of x */
            for (int i = 0; i < AMX_ROWS; i++) xp[(at + s) * AMX_ROWS + i] = part[s][i];
        }
    }
}

/* A panel: weight rows j0 .. j0 + 15 of the matrix, each row's planes (row_planes); rows past
 * n (live <= 16 at the matrix's end) pack as zeros. Prefetches the next panel's rows. */
typedef struct {
    const void *codes[AMX_ROWS];
    const float *d[AMX_ROWS], *m[AMX_ROWS];
    int live;
} amx_panel;

static inline void amx_panel_at(int kind, const void *codes, const float *d, const float *m,
                                int64_t j0, int64_t n, int64_t k, amx_panel *p) {
    p->live = n - j0 < AMX_ROWS ? (int)(n - j0) : AMX_ROWS;
    for (int r = 0; r < p->live; r++) {
        row_planes(kind, codes, d, m, j0 + r, k, &p->codes[r], &p->d[r], &p->m[r]);
        if (j0 + r + AMX_ROWS < n) prefetch_block_row(kind, codes, d, m, j0 + r + AMX_ROWS, n, k);
    }
}

/* A q4 block's 32 weights (byte j of codes: element j in its low nibble, j + 16 in its high
 * one) in three bfloat16 parts, part s at out[s * AMX_ROWS]. A block holds at most 16 values,
 * fl(d * c + m) for codes c = 0..15 (block_pieces' table), so the table is split into parts
 * once and each part looked up by code: split_bf16's steps on 16 values, not 32, and no
 * gathering of words, for the same parts. */
static inline void q4_block_parts(const uint8_t *codes, float d, float m, __m512i *out) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(m));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes));
    const __m256i low4 = _mm256_set1_epi16(15);
    const __m512i code = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(bytes, low4)), _mm256_srli_epi16(bytes, 4), 1);
    /* the 16-bit word 2c + 1 of the table: code c's float, its top half */
    const __m512i word = _mm512_or_si512(_mm512_slli_epi16(code, 1), _mm512_set1_epi16(1));
    for (int s = 0; s < AMX_PARTS; s++) { /* split_bf16's steps, on the table */
        const __m512i part = bf16_top(table);
        out[s * AMX_ROWS] = _mm512_permutexvar_epi16(word, part);
        table = _mm512_sub_ps(table, _mm512_castsi512_ps(part));
    }
}

/* chunk c of the panel's rows, expanded as the block kernel expands them (block_pieces:
 * fl(d * c + m)), in three bfloat16 parts: [part][16 rows][32] */
static inline void amx_pack_chunk(int kind, const amx_panel *p, int64_t c, __m512i *wp) {
    for (int r = 0; r < AMX_ROWS; r++) {
        if (kind == 4 && r < p->live) {
            q4_block_parts((const uint8_t *)p->codes[r] + c * (AMX_CHUNK / 2), p->d[r][c],
                           p->m[r][c], wp + r);
            continue;
        }
        vec w[PIECES] = {vzero(), vzero()};
        if (r < p->live) block_pieces(kind, p->codes[r], p->d[r], p->m[r], c, w);
        __m512i parts[AMX_PARTS];
        split_bf16(w[0], w[1], parts, AMX_PARTS);
        for (int s = 0; s < AMX_PARTS; s++) wp[s * AMX_ROWS + r] = parts[s];
    }
}

/* out[r, j] = x[r] . W[j] for r < rows, j < n, x packed by amx_pack_x into xbuf; call from
 * every thread of a parallel region, each with wp (k / 32 * 3 KB, at least 6 KB, 64-byte
 * aligned). Ends with the loop's barrier.
 *
 * Up to 32 rows of x (one tile pair: a new question after cached documents) a panel's chunks
 * are packed as the products reach them, into two 3 KB buffers in turn, so the parts the tile
 * loads read are in L1 rather than in a whole panel's 54 to 144 KB. Interleaved in one process,
 * SmolLM2-135M Q4_1's layer matrices at 32 rows took 0.77 to 0.82 of the time of a panel packed
 * first, with the code lookup of q4_block_parts; either change alone took 1.00 and 1.05, and
 * why they need each other is not pinned down (the packing and the products, each timed with
 * the other left out, add up to the whole: they barely overlap). Past 32 rows the panel is
 * packed once for every pair. */
static inline void amx_matmul_for(int kind, const uint8_t *xbuf, const void *codes,
                                  const float *d, const float *m, float *out, int64_t rows,
                                  int64_t n, int64_t k, __m512i *wp) {
    const int64_t pairs = amx_pairs(rows), chunks = k / AMX_CHUNK;
    _Alignas(64) __m512i c[AMX_ROWS];
    amx_configure();
#pragma omp for schedule(static)
    for (int64_t j0 = 0; j0 < n; j0 += AMX_ROWS) {
        amx_panel panel;
        amx_panel_at(kind, codes, d, m, j0, n, k, &panel);
        const int one_pair = pairs == 1;
        if (!one_pair)
            for (int64_t ch = 0; ch < chunks; ch++)
                amx_pack_chunk(kind, &panel, ch, wp + ch * AMX_PARTS * AMX_ROWS);
        for (int64_t p = 0; p < pairs; p++) {
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t ch = 0; ch < chunks; ch++) {
                __m512i *w = wp + (one_pair ? ch % 2 : ch) * AMX_PARTS * AMX_ROWS;
                if (one_pair) amx_pack_chunk(kind, &panel, ch, w);
                const uint8_t *x = xbuf + (p * chunks + ch) * 2 * AMX_PARTS * 1024;
                _tile_loadd(2, w, 64);
                _tile_loadd(3, w + AMX_ROWS, 64);
                _tile_loadd(4, w + 2 * AMX_ROWS, 64);
                _tile_loadd(5, x, 64); /* x's first part: times every part of w */
                _tile_loadd(6, x + 1024, 64);
                _tile_loadd(7, x + 2048, 64);
                _tile_dpbf16ps(0, 2, 5);
                _tile_dpbf16ps(0, 3, 5);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(0, 2, 6); /* x's second: w's first two */
                _tile_dpbf16ps(0, 3, 6);
                _tile_dpbf16ps(0, 2, 7); /* x's third: w's first */
                _tile_loadd(5, x + 3072, 64); /* the pair's second tile of x */
                _tile_loadd(6, x + 4096, 64);
                _tile_loadd(7, x + 5120, 64);
                _tile_dpbf16ps(1, 2, 5);
                _tile_dpbf16ps(1, 3, 5);
                _tile_dpbf16ps(1, 4, 5);
                _tile_dpbf16ps(1, 2, 6);
                _tile_dpbf16ps(1, 3, 6);
                _tile_dpbf16ps(1, 2, 7);
            }
            /* C[w][t]: weight row j0 + w, row of x 32p + 16h + t; transposed into out */
            for (int h = 0; h < 2; h++) {
                const int64_t r0 = 32 * p + 16 * h;
                if (r0 >= rows) break;
                if (h == 0)
                    _tile_stored(0, c, 64);
                else
                    _tile_stored(1, c, 64);
                transpose16(c);
                const __mmask16 cols = j0 + AMX_ROWS <= n ? 0xffff : (1u << (n - j0)) - 1;
                for (int64_t t = 0; t < AMX_ROWS && r0 + t < rows; t++)
                    _mm512_mask_storeu_ps(out + (r0 + t) * n + j0, cols, _mm512_castsi512_ps(c[t]));
            }
        }
    }
    _tile_release();
}

#endif
