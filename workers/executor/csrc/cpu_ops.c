/* The model runner's elementwise steps fused into single passes (fp32, CPU); compiled at first use by
 * workers/cpu_kernels.py.
 *
 * In torch each of these is three to seven ops, each a pass over the activations plus a dispatch from Python: per
 * layer an RMSNorm is pow, mean, add, rsqrt, mul, mul; rotary embeddings are chunk, four muls, add, sub, cat. For
 * a decode step of 32 sequences that was about 10 ms of 120 on a 2-core AVX2 EPYC, for a 512-token prefill step 75.
 * Work is split over rows with OpenMP only when there is enough of it to pay for waking the threads.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_ELEMENTS (1 << 16)

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, rows of `dim` (x row stride ldx, out contiguous). */
void rms_norm_f32(const float *restrict x, int64_t ldx, const float *restrict weight, float eps,
                  float *restrict out, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * dim;
        float sum = 0.f;
        for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * weight[i];
    }
}

/* out[r][i] = silu(gate_up[r][i]) * gate_up[r][inter + i]: the SwiGLU between the stacked gate/up projection and
 * the down projection. */
void silu_mul_f32(const float *restrict gate_up, int64_t rows, int64_t inter, float *restrict out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Rotary embeddings in place on the first `num_heads` heads of each row of x (row stride ldx, heads of head_dim
 * back to back), HF's "rotate half" layout: for i < d/2, (x[i], x[i + d/2]) turns by the angle whose cos/sin are
 * cos[r][i], sin[r][i] ([rows][d/2], contiguous). */
void rotary_f32(float *restrict x, int64_t ldx, int64_t rows, int num_heads, int head_dim,
                const float *restrict cos, const float *restrict sin, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (rows * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int h = 0; h < num_heads; h++) {
            float *x1 = x + r * ldx + (int64_t)h * head_dim, *x2 = x1 + half;
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}
