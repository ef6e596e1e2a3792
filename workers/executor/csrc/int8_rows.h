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

/* What a kernel does to each row of x before quantizing it, so that the step feeding a projection costs neither a
 * call from Python nor a pass of its own (workers/executor/linear.py, Linear.after_rms_norm and after_silu_mul). */
#define PROLOGUE_NONE 0
#define PROLOGUE_RMS_NORM 1 /* x / sqrt(mean(x^2) + eps) * weight: the norm before the attention and the MLP */
#define PROLOGUE_SILU_MUL 2 /* silu(x[0..k)) * x[k..2k): SwiGLU, the row being the stacked gate/up projection's */

/* Row x [k] after `prologue`, in `scratch` [k] (x itself for none): the arithmetic of csrc/cpu_ops.c's
 * rms_norm_f32 and silu_mul_f32, so a fused layer computes what the unfused one does. */
static inline const float *prologue_row(const float *restrict x, int64_t k, int prologue,
                                        const float *restrict norm_weight, float eps, float *restrict scratch) {
    if (prologue == PROLOGUE_RMS_NORM) {
        float sum = 0.f;
        for (int64_t i = 0; i < k; i++) sum += x[i] * x[i];
        const float inv = 1.f / sqrtf(sum / (float)k + eps);
        for (int64_t i = 0; i < k; i++) scratch[i] = x[i] * inv * norm_weight[i];
        return scratch;
    }
    if (prologue == PROLOGUE_SILU_MUL) {
        const float *up = x + k;
        for (int64_t i = 0; i < k; i++) scratch[i] = x[i] / (1.f + expf(-x[i])) * up[i];
        return scratch;
    }
    return x;
}

/* Up to this many inputs (rows times k) are quantized by the calling thread before the threads start on the
 * panels: for a decode step's few rows a parallel loop's barrier costs more than their work (a row of 576 inputs is
 * a fraction of a microsecond), and a call at one row is what a single stream's step makes 120 of. */
#define SERIAL_QUANTIZE_INPUTS 4096

/* Row i of x (row stride ldx), after `prologue`, quantized as quantize_row does into row i of q, scale and sums;
 * `scratch` [m][k] holds the rows after the prologue (NULL for none). */
static inline void prepare_row(const float *restrict x, int64_t ldx, int64_t i, int64_t k, int64_t kg, int bias,
                               int prologue, const float *restrict norm_weight, float eps, float *restrict scratch,
                               uint8_t *restrict q, float *restrict scale, float *restrict sums) {
    const int64_t groups = kg / GROUP;
    float *row_scratch = scratch == NULL ? NULL : scratch + i * k;
    quantize_row(prologue_row(x + i * ldx, k, prologue, norm_weight, eps, row_scratch), k, kg, bias, q + i * kg,
                 scale + i * groups, sums == NULL ? NULL : sums + i * groups);
}

#endif
