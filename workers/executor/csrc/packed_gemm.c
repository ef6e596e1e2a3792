/* y = x @ W.T for few rows of x (fp32, CPU), W packed once at load; compiled at first use by workers/cpu_kernels.py.
 *
 * A decode step multiplies a handful of rows by every weight of the model. MKL does such skinny products far below
 * the machine's limits: on a 2-core AVX2 EPYC it took 70-86 ms at 8 rows for SmolLM2's weights, which stream from
 * memory in 17 ms (bench/kernels.py). Here W is packed once into panels of NR output features,
 *
 *   packed [ceil(N / NR)][K][NR]:  packed[p][k][j] = W[p * NR + j][k]   (zero where p * NR + j >= N)
 *
 * so each panel is one contiguous stream, read from memory once per call and from cache for the row tiles after
 * the first (the tile itself is in gemm_tile.h).
 */
#include "gemm_tile.h"

/* Pack W [n][k] (row stride ldw) into `packed` (layout above). */
void pack_weight_f32(const float *restrict w, int64_t ldw, int64_t n, int64_t k, float *restrict packed,
                     int num_threads) {
    const int64_t num_panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        float *dst = packed + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                const int64_t row = p * NR + j;
                dst[kk * NR + j] = row < n ? w[row * ldw + kk] : 0.f;
            }
    }
}

/* y [m][n] (row stride ldy) = x [m][k] (row stride ldx) @ W.T, W as packed by pack_weight_f32; with `accumulate`,
 * y += x @ W.T (a residual connection for free). Threads take whole panels. */
void packed_gemm_f32(const float *restrict x, int64_t ldx, int64_t m, int64_t k, const float *restrict packed,
                     int64_t n, float *restrict y, int64_t ldy, int accumulate, int num_threads) {
    const int64_t num_panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        const int ncols = n - p * NR < NR ? (int)(n - p * NR) : NR;
        rows_times_panel(m, k, x, ldx, packed + p * k * NR, NR, y + p * NR, ldy, ncols, accumulate);
    }
}
