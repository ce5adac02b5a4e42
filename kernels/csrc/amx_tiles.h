/* What both AMX kernels need: the tile state asked of Linux, one tile shape (16 rows of 64
 * bytes), float32 split into bfloat16 parts, and a 16 x 16 transpose of 32-bit words.
 * Used by amx_matmul.h (block matmuls) and extend_amx.h (extend attention). */
#ifndef PREFIXRAG_AMX_TILES_H
#define PREFIXRAG_AMX_TILES_H

/* 1 when this build may use AMX-BF16 (the compiler targets it, and Linux, which hands out the
 * tile state); the rest of this header, and the kernels built on it, exist only then. Any
 * source may include this header to ask. */
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define AMX_BUILD 1
#else
#define AMX_BUILD 0
#endif

#if AMX_BUILD
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16 /* rows of a tile */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands a process the tile registers' state only when it asks; 1 if it may use them */
static inline int amx_permitted(void) {
    static int state = -1; /* -1 not asked yet; asking twice is harmless */
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;

/* every tile 16 rows of 64 bytes */
static inline void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = AMX_ROWS;
    _tile_loadconfig(&cfg);
}

/* each float of v rounded to its top 16 bits (half up), low 16 bits zero: a bfloat16 in the
 * top half of each word, and exact to subtract from v */
static inline __m512i bf16_top(__m512 v) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u), half = _mm512_set1_epi32(0x8000);
    return _mm512_and_si512(_mm512_add_epi32(_mm512_castps_si512(v), half), top);
}

/* 32 floats (lo: elements 0-15, hi: 16-31) into `parts` bfloat16 vectors of 32, each what the
 * ones before it left, rounded to its top 16 bits (half up; what is left is exact in float32,
 * at most 2^-8 of what was there). Three parts add up to a float32 exactly (3 x 8 bits hold its
 * 24); two leave at most 2^-16 of it. */
static inline void split_bf16(__m512 lo, __m512 hi, __m512i *out, int parts) {
    /* the odd 16-bit words (each float's top half) of lo, then of hi */
    static const uint16_t odd_words[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                           23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                           45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    const __m512i odd = _mm512_loadu_si512(odd_words);
    for (int p = 0; p < parts; p++) {
        const __m512i lo_top = bf16_top(lo), hi_top = bf16_top(hi);
        out[p] = _mm512_permutex2var_epi16(lo_top, odd, hi_top);
        lo = _mm512_sub_ps(lo, _mm512_castsi512_ps(lo_top));
        hi = _mm512_sub_ps(hi, _mm512_castsi512_ps(hi_top));
    }
}

/* a 16 x 16 matrix of 32-bit words, row i in v[i], transposed in place */
static inline void transpose16(__m512i *v) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; j++) { /* per 128-bit lane: columns 2j and 2j + 1 */
            v[i + 2 * j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
            v[i + 2 * j + 1] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
        }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        v[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        v[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
    }
}

#endif /* AMX_BUILD */
#endif
