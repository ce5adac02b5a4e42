/* Per-row float32 ops shared by cpu_ops.c and decode_step.c, so the torch model's C ops and the
 * one-call decode step compute norms and rotations identically.
 */
#ifndef PREFIXRAG_ROW_OPS_H
#define PREFIXRAG_ROW_OPS_H
#include <math.h>
#include <stdint.h>

/* sum = x + residual (x alone when residual is NULL; sum may be residual itself), then
 * out = sum * rsqrt(mean(sum^2) + eps) * weight, over one row of h floats. */
static inline void rms_norm_row(const float *x, const float *residual, const float *weight,
                                float eps, float *out, float *sum, int64_t h) {
    float ss = 0.0f;
    if (residual) {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < h; i++) {
            sum[i] = x[i] + residual[i];
            ss += sum[i] * sum[i];
        }
    } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < h; i++) {
            sum[i] = x[i];
            ss += x[i] * x[i];
        }
    }
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; i++) out[i] = weight[i] * (sum[i] * inv);
}

/* Rotate-half RoPE of one head of d = 2 * half floats, in place; cs = cat(cos, sin) [d]. */
static inline void rotate_half(float *x, const float *cs, int64_t half) {
    const float *c = cs, *s = cs + half;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

#endif
