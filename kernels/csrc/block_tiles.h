/* Prefill-sized block matmuls (tens of rows of x: a new question after cached documents) in
 * the block kernel's fixed order (block_quant.h), bit for bit.
 *
 * bq_matmul_for reads each weight row once for every GROUP (4) rows of x (SLOT_ROWS for float32
 * rows) and unpacks its blocks again for each such group; a load feeds about one fused
 * multiply-add. At 32 rows that ran at a third of this host's float32 peak, no faster than
 * oneDNN's GEMM over the dequantized matrix, which prefills of more than 16 rows took, and which
 * at so few rows is bound by streaming that float32 matrix (5x the block bytes).
 *
 * Here TILE_M rows of x meet TILE_N weight rows at a time: TILE_M x TILE_N accumulators of one
 * slot (lanes LANES * a .. of every 64 elements, as dot_rows_f32_slots) fill the registers, and
 * each round loads TILE_N weight vectors and TILE_M x vectors for TILE_M * TILE_N fused
 * multiply-adds. Every partial is the same chain as in dot_rows, so results equal
 * bq_matmul_for's (and a decode step's) whatever the number of rows.
 *
 * Both operands are first packed slot by slot (as BLIS packs its panels): a slot's pass then
 * reads two contiguous streams, where in the rows' own layout it read one line in four of
 * TILE_M + TILE_N rows at once, a stride the prefetchers served late (one thread, 32 rows of a
 * 3072 x 576 Q4_1 matrix: 78 GFLOP/s in place against 125 with every line in L1).
 */
#ifndef PREFIXRAG_BLOCK_TILES_H
#define PREFIXRAG_BLOCK_TILES_H
#include "block_quant.h"

#if defined(__AVX512F__)
#define BQ_TILES 1
/* 24 accumulators, 6 weight vectors and an x vector: 31 of the 32 registers. 8 x 3 (8 x vectors
 * a round, not 4) took 43.3 ms where 4 x 6 took 35.8, 8 x 2 40.1 and 4 x 4 36.5 (32 rows
 * through a SmolLM2-135M's 120 layer matrices in Q4_1, builds interleaved in one process, 2
 * threads, 2-core Xeon). The shape may be set at build time (-D) to compare builds. */
#ifndef TILE_M
#define TILE_M 4
#define TILE_N 6
#endif
/* Fewer rows than this keep bq_matmul_for: packing costs more than it saves when few rows of x
 * use each weight tile. A build may set it (-D), as bench/prefill_matmul_bench.py does to time
 * bq_matmul_for at any number of rows. */
#ifndef TILE_MIN_ROWS
#define TILE_MIN_ROWS 12
#endif

/* Packed layout of a tile of R rows of k elements: piece (a, i, r), the 16 elements of row r at
 * i * 64 + LANES * a, sits at ((a * rounds + i) * R + r) * LANES, rounds = ceil(k / 64) (an odd
 * last block leaves the pieces of slots 2 and 3 in the last round unset and unread). */
static inline int64_t tile_rounds(int64_t k) { return (k + NUM_PARTIALS - 1) / NUM_PARTIALS; }

static inline void pack_tile(const float *const *rows, int R, int64_t k, float *out) {
    const int64_t rounds = tile_rounds(k);
    for (int a = 0; a < NACC; a++)
        for (int64_t i = 0; i < rounds; i++) {
            const int64_t at = i * NUM_PARTIALS + LANES * a;
            if (at >= k) break;
            for (int r = 0; r < R; r++)
                vstore(out + ((a * rounds + i) * R + r) * LANES, vload(rows[r] + at));
        }
}

/* Weight rows j0 .. j0 + TILE_N - 1 packed as pack_tile lays them out, expanded block by block
 * straight from their planes (block_pieces: the values expand_row gives). Block 2i's pieces are
 * slots 0 and 1 of round i, block 2i + 1's slots 2 and 3. */
static ALWAYS_INLINE void pack_weight_tile_kind(int kind, const void *codes, const float *d,
                                                const float *m, int64_t j0, int64_t k,
                                                float *out) {
    const int64_t rounds = tile_rounds(k), nb = k / QBLOCK, step = TILE_N * LANES;
    for (int t = 0; t < TILE_N; t++) {
        const void *cj;
        const float *dj, *mj;
        row_planes(kind, codes, d, m, j0 + t, k, &cj, &dj, &mj);
        float *s0 = out + t * LANES, *s1 = s0 + rounds * step;
        float *s2 = s1 + rounds * step, *s3 = s2 + rounds * step;
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2, s0 += step, s1 += step, s2 += step, s3 += step) {
            vec w[2 * PIECES];
            block_pieces(kind, cj, dj, mj, b, w);
            block_pieces(kind, cj, dj, mj, b + 1, w + PIECES);
            vstore(s0, w[0]), vstore(s1, w[1]), vstore(s2, w[2]), vstore(s3, w[3]);
        }
        if (b < nb) {
            vec w[PIECES];
            block_pieces(kind, cj, dj, mj, b, w);
            vstore(s0, w[0]), vstore(s1, w[1]);
        }
    }
}

static inline void pack_weight_tile(int kind, const void *codes, const float *d, const float *m,
                                    int64_t j0, int64_t k, float *out) {
    switch (kind) { /* a constant kind: block_pieces inlined for it */
    case 4: pack_weight_tile_kind(4, codes, d, m, j0, k, out); break;
    case 8: pack_weight_tile_kind(8, codes, d, m, j0, k, out); break;
    case 16: pack_weight_tile_kind(16, codes, d, m, j0, k, out); break;
    default: pack_weight_tile_kind(9, codes, d, m, j0, k, out); break;
    }
}

/* res[o] = reduce_partials' horizontal sum of s[o] for o < 16, bit for bit: its pairs (lane l
 * with l + 8, then l + 4, l + 2, l + 1) summed for 16 vectors at once, two vectors' halves
 * meeting in one add, so the 16 sums cost 46 shuffles and adds, not about 16 x 8. At K = 576 a
 * result is only 36 multiply-adds, so this is worth 4% of the whole matmul (36.4 -> 34.8 ms). */
static ALWAYS_INLINE void hsum16(const vec *s, float *res) {
    __m512 t[8], u[4], v[2];
    for (int q = 0; q < 8; q++) /* [s lanes 0-7 + 8-15 | the same for s + 1] */
        t[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0x44),
                             _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0xEE));
    for (int p = 0; p < 4; p++) /* 128-bit lane q: vector 4p + q's lanes 0-3 + 4-7 */
        u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * p], t[2 * p + 1], 0xDD));
    for (int h = 0; h < 2; h++) /* lane q: vectors 8h + q and 8h + 4 + q, lanes 0 + 2, 1 + 3 */
        v[h] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * h], u[2 * h + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * h], u[2 * h + 1], 0xEE));
    /* lane 4q + j: vector q + 4j's sum */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88),
                                   _mm512_shuffle_ps(v[0], v[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(res, _mm512_permutexvar_ps(order, r));
}

/* res[r][t] = x[r] . w[t] for r < TILE_M, t < TILE_N, each in dot()'s fixed order, over the
 * packed tiles xp (TILE_M rows) and wp (TILE_N rows) */
static ALWAYS_INLINE void dot_tile(const float *xp, const float *wp, int64_t k,
                                   float res[TILE_M][TILE_N]) {
    vec part[TILE_M][TILE_N][NACC];
    const int64_t rounds = tile_rounds(k), full = k / NUM_PARTIALS;
    for (int a = 0; a < NACC; a++) {
        vec acc[TILE_M][TILE_N];
        for (int r = 0; r < TILE_M; r++)
            for (int t = 0; t < TILE_N; t++) acc[r][t] = vzero();
        /* an odd last block feeds the slots of the first half only, as in dot_rows */
        const int64_t end = full + (rounds > full && a < NACC / 2);
        const float *xa = xp + a * rounds * TILE_M * LANES, *wa = wp + a * rounds * TILE_N * LANES;
        for (int64_t i = 0; i < end; i++) {
            vec wv[TILE_N];
            for (int t = 0; t < TILE_N; t++) wv[t] = vload(wa + (i * TILE_N + t) * LANES);
            for (int r = 0; r < TILE_M; r++) {
                vec xv = vload(xa + (i * TILE_M + r) * LANES);
                /* a register, not a memory operand: GCC would otherwise fold this load into
                 * each of the TILE_N multiply-adds, and loads, not FMAs, would bound the loop */
                __asm__("" : "+v"(xv));
                for (int t = 0; t < TILE_N; t++) acc[r][t] = vfma(xv, wv[t], acc[r][t]);
            }
        }
        for (int r = 0; r < TILE_M; r++)
            for (int t = 0; t < TILE_N; t++) part[r][t][a] = acc[r][t];
    }
    /* reduce_partials' sums: its vertical adds, then its horizontal pairs 16 vectors at once */
    vec sums[(TILE_M * TILE_N + 15) / 16 * 16];
    float flat[(TILE_M * TILE_N + 15) / 16 * 16];
    int o = 0;
    for (int r = 0; r < TILE_M; r++)
        for (int t = 0; t < TILE_N; t++, o++)
            sums[o] = _mm512_add_ps(_mm512_add_ps(part[r][t][0], part[r][t][1]),
                                    _mm512_add_ps(part[r][t][2], part[r][t][3]));
    for (; o % 16; o++) sums[o] = sums[0];
    for (int g = 0; g < o; g += 16) hsum16(sums + g, flat + g);
    for (int r = 0; r < TILE_M; r++)
        for (int t = 0; t < TILE_N; t++) res[r][t] = flat[r * TILE_N + t];
}

/* the rows of x from r on against weight row w (natural layout), through the slot and row
 * kernels: the same sums */
static inline void dot_rest(const float *x, int64_t k, const float *w, int64_t r, int64_t rows,
                            float *out, int64_t n, int64_t j) {
    while (r < rows) {
        float res[SLOT_ROWS];
        const int64_t left = rows - r;
        const int g = left >= SLOT_MIN_ROWS ? (left < SLOT_ROWS ? (int)left : SLOT_ROWS)
                                            : (left < GROUP ? (int)left : GROUP);
        if (g >= SLOT_MIN_ROWS)
            dot_rows_f32_kind(x + r * k, k, w, g, res, NULL);
        else
            dot_rows_kind(KIND_F32, x + r * k, k, w, NULL, NULL, g, res);
        for (int i = 0; i < g; i++) out[(r + i) * n + j] = res[i];
        r += g;
    }
}

/* A thread packs PANEL_TILES weight tiles at a time (110 KB at K = 576, in L2) and runs each
 * tile of x against all of them while it sits in L1: x from L2 for every weight tile was bound
 * by L2's bandwidth. 4, 8 and 16 tiles measured the same. */
#ifndef PANEL_TILES
#define PANEL_TILES 8
#endif

/* Scratch floats a thread needs: its panel packed, and one weight row expanded (for the rows
 * past the whole tiles) */
static inline int64_t tile_scratch_floats(int64_t k) {
    return PANEL_TILES * TILE_N * tile_rounds(k) * NUM_PARTIALS + k;
}

/* Packs x's whole tiles of TILE_M rows into xp (rows / TILE_M * TILE_M * ceil(k / 64) * 64
 * floats); call once, before bq_tiles_for. */
static inline void pack_x_tiles(const float *x, int64_t rows, int64_t k, float *xp) {
    const int64_t per_tile = TILE_M * tile_rounds(k) * NUM_PARTIALS;
    for (int64_t r0 = 0; r0 + TILE_M <= rows; r0 += TILE_M) {
        const float *tile[TILE_M];
        for (int r = 0; r < TILE_M; r++) tile[r] = x + (r0 + r) * k;
        pack_tile(tile, TILE_M, k, xp + r0 / TILE_M * per_tile);
    }
}

/* out[r, j] = x[r] . W[j] for r < rows, j < n, as bq_matmul_for, with x's whole tiles packed
 * in xp (pack_x_tiles); call from every thread of a parallel region, each with its own scratch
 * of tile_scratch_floats(k) floats. Ends with the loop's barrier. */
static inline void bq_tiles_for(int kind, const float *x, const float *xp, const void *codes,
                                const float *d, const float *m, float *out, int64_t rows,
                                int64_t n, int64_t k, float *scratch) {
    const int64_t per_panel = PANEL_TILES * TILE_N, whole_rows = rows / TILE_M * TILE_M;
    const int64_t panels = (n + per_panel - 1) / per_panel, w_tile = TILE_N * tile_rounds(k) * NUM_PARTIALS;
    const int64_t x_tile = TILE_M * tile_rounds(k) * NUM_PARTIALS;
    float *row = scratch + PANEL_TILES * w_tile; /* one weight row, expanded */
#pragma omp for schedule(static)
    for (int64_t panel = 0; panel < panels; panel++) {
        const int64_t j0 = panel * per_panel, nj = n - j0 < per_panel ? n - j0 : per_panel;
        const int64_t whole = nj / TILE_N; /* whole weight tiles */
        for (int64_t t = 0; t < whole; t++) {
            for (int u = 0; u < TILE_N; u++)
                prefetch_block_row(kind, codes, d, m, j0 + t * TILE_N + u, n, k);
            pack_weight_tile(kind, codes, d, m, j0 + t * TILE_N, k, scratch + t * w_tile);
        }
        for (int64_t r0 = 0; r0 < whole_rows; r0 += TILE_M)
            for (int64_t t = 0; t < whole; t++) {
                float res[TILE_M][TILE_N];
                dot_tile(xp + r0 / TILE_M * x_tile, scratch + t * w_tile, k, res);
                for (int r = 0; r < TILE_M; r++)
                    for (int u = 0; u < TILE_N; u++)
                        out[(r0 + r) * n + j0 + t * TILE_N + u] = res[r][u];
            }
        /* the rows of x past the last whole tile of x, and every row of x against the weight
         * rows past the last whole tile, weight row by weight row */
        for (int64_t t = 0; t < nj; t++) {
            const int64_t from = t < whole * TILE_N ? whole_rows : 0;
            if (from == rows) continue;
            const int64_t j = j0 + t;
            expand_row(kind, codes, d, m, j, k, row);
            dot_rest(x, k, row, from, rows, out, n, j);
        }
    }
}
#endif

#endif
