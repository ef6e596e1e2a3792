/* Rows of activations as int8, one scale per GROUP consecutive inputs: what the kernels that multiply on int8
 * activations (int8_gemm.c, int4_gemm.c) quantize each call's rows into, as GGUF's Q8 activations are (one scale
 * per row cost SmolLM2 5% perplexity, one per 32 inputs 0.1%).
 */
#ifndef SWITCHYARD_INT8_ROWS_H
#define SWITCHYARD_INT8_ROWS_H

#include <math.h>
#include <stdint.h>

#define GROUP 32

static inline int64_t padded_k(int64_t k) { return (k + GROUP - 1) / GROUP * GROUP; }

/* Row x [k] as kg bytes (zeros past k) and a scale per group: q = round(x / scale) + bias, rounded half away from
 * zero, scale = max |x| / 127 over the group (a bias of 128 makes them unsigned). `sums`, where not NULL, gets each
 * group's scale times the sum of its q before the bias: what a group's weight offset is multiplied by. */
static inline void quantize_row(const float *restrict x, int64_t k, int64_t kg, int bias, uint8_t *restrict q,
                                float *restrict scale, float *restrict sums) {
    for (int64_t g = 0; g * GROUP < kg; g++) {
        float peak = 0.f;
        for (int64_t kk = g * GROUP; kk < (g + 1) * GROUP && kk < k; kk++) peak = fmaxf(peak, fabsf(x[kk]));
        const float inverse = peak > 0.f ? 127.f / peak : 0.f;
        int32_t sum = 0;
        for (int64_t kk = g * GROUP; kk < (g + 1) * GROUP; kk++) {
            const float v = kk < k ? x[kk] * inverse : 0.f;
            const int r = (int)(v < 0 ? v - 0.5f : v + 0.5f);
            q[kk] = (uint8_t)(r + bias);
            sum += r;
        }
        scale[g] = peak / 127.f;
        if (sums != NULL) sums[g] = scale[g] * (float)sum;
    }
}

#endif
