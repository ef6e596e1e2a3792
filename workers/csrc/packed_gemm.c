/* y = x @ W.T for few rows of x (fp32, CPU), W packed once at load; compiled at first use by workers/cpu_kernels.py.
 *
 * A decode step multiplies a handful of rows by every weight of the model. MKL re-packs W on every call and its
 * kernels are tuned for big products: on a 2-core AVX2 EPYC it took 73 ms at 8 rows for SmolLM2's weights, which
 * stream from memory in 17 ms. Here W is packed once into panels of NR output features,
 *
 *   packed [ceil(N / NR)][K][NR]:  packed[p][k][j] = W[p * NR + j][k]   (zero where p * NR + j >= N)
 *
 * so each panel is one contiguous stream, read from memory once per call and from cache for the row tiles after
 * the first. A row tile of up to MR rows keeps MR x NR accumulators in vector registers across the whole of K.
 * Written with GCC vector extensions, so it vectorises for whatever -march=native offers (AVX2 + FMA here).
 */
#include <stdint.h>
#include <string.h>

#define NR 16
#define MR 6

typedef float v8 __attribute__((vector_size(32), aligned(4)));

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

/* One tile: `mr` (a constant once inlined) rows of x times one panel, into y[.., 0:ncols]. */
static inline __attribute__((always_inline)) void tile(const int mr, int64_t k, const float *restrict x,
                                                       int64_t ldx, const float *restrict panel, float *restrict y,
                                                       int64_t ldy, int ncols, int accumulate) {
    v8 acc0[MR], acc1[MR];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) acc0[i] = acc1[i] = (v8){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const v8 b0 = *(const v8 *)(panel + kk * NR);
        const v8 b1 = *(const v8 *)(panel + kk * NR + 8);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            const float a = x[i * ldx + kk];
            acc0[i] += a * b0;
            acc1[i] += a * b1;
        }
    }
    if (ncols == NR) {
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            v8 *out = (v8 *)(y + i * ldy);
            out[0] = accumulate ? out[0] + acc0[i] : acc0[i];
            out[1] = accumulate ? out[1] + acc1[i] : acc1[i];
        }
    } else {
        for (int i = 0; i < mr; i++) {
            float row[NR];
            memcpy(row, &acc0[i], sizeof(v8));
            memcpy(row + 8, &acc1[i], sizeof(v8));
            for (int j = 0; j < ncols; j++) y[i * ldy + j] = accumulate ? y[i * ldy + j] + row[j] : row[j];
        }
    }
}

/* y [m][n] (row stride ldy) = x [m][k] (row stride ldx) @ W.T, W as packed by pack_weight_f32; with `accumulate`,
 * y += x @ W.T (a residual connection for free). Rows are split into tiles of near-equal size (32 rows: 6 6 5 5 5
 * 5, not 6 6 6 6 6 2); threads take whole panels. */
void packed_gemm_f32(const float *restrict x, int64_t ldx, int64_t m, int64_t k, const float *restrict packed,
                     int64_t n, float *restrict y, int64_t ldy, int accumulate, int num_threads) {
    const int64_t num_panels = (n + NR - 1) / NR;
    const int64_t num_tiles = (m + MR - 1) / MR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        const float *panel = packed + p * k * NR;
        const int ncols = n - p * NR < NR ? (int)(n - p * NR) : NR;
        int64_t row = 0;
        for (int64_t t = 0; t < num_tiles; t++) {
            const int mr = (int)((m - row) / (num_tiles - t)) + ((m - row) % (num_tiles - t) != 0);
            const float *xt = x + row * ldx;
            float *yt = y + row * ldy + p * NR;
            switch (mr) {
            case 6: tile(6, k, xt, ldx, panel, yt, ldy, ncols, accumulate); break;
            case 5: tile(5, k, xt, ldx, panel, yt, ldy, ncols, accumulate); break;
            case 4: tile(4, k, xt, ldx, panel, yt, ldy, ncols, accumulate); break;
            case 3: tile(3, k, xt, ldx, panel, yt, ldy, ncols, accumulate); break;
            case 2: tile(2, k, xt, ldx, panel, yt, ldy, ncols, accumulate); break;
            default: tile(1, k, xt, ldx, panel, yt, ldy, ncols, accumulate); break;
            }
            row += mr;
        }
    }
}
