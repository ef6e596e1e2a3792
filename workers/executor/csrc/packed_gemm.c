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
#include <stdlib.h>

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

/* Weight-only int8: the same panels, one byte a weight, and one fp32 scale per output feature (symmetric, per
 * channel: w = q * scale, scale = max|w| / 127). A decode step streams a quarter of the fp32 weights' bytes; each
 * byte is widened to fp32 in registers, so the products and sums stay fp32 (no activation is quantized).
 *
 *   packed [ceil(N / NR)][K][NR] int8,  scales [ceil(N / NR) * NR] float (zero past N) */

/* Eight weights widened to fp32. GCC's generic vector conversion of int8 lanes came out as scalar conversions,
 * slower than streaming fp32; AVX2 widens eight bytes in two instructions. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline __attribute__((always_inline)) v8 widen8(const int8_t *p) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    v8 r;
    memcpy(&r, &f, sizeof r);
    return r;
}
#else
static inline __attribute__((always_inline)) v8 widen8(const int8_t *p) {
    v8 r;
    for (int j = 0; j < 8; j++) r[j] = (float)p[j];
    return r;
}
#endif

/* Quantize W [n][k] (row stride ldw) into `packed` and `scales`. */
void pack_weight_q8(const float *restrict w, int64_t ldw, int64_t n, int64_t k, int8_t *restrict packed,
                    float *restrict scales, int num_threads) {
    const int64_t num_panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        float inverse[NR];
        for (int j = 0; j < NR; j++) {
            const int64_t row = p * NR + j;
            float peak = 0.f;
            if (row < n)
                for (int64_t kk = 0; kk < k; kk++) {
                    const float a = w[row * ldw + kk] < 0 ? -w[row * ldw + kk] : w[row * ldw + kk];
                    peak = a > peak ? a : peak;
                }
            scales[p * NR + j] = peak / 127.f;
            inverse[j] = peak > 0.f ? 127.f / peak : 0.f;
        }
        int8_t *dst = packed + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                const int64_t row = p * NR + j;
                const float q = row < n ? w[row * ldw + kk] * inverse[j] : 0.f;
                dst[kk * NR + j] = (int8_t)(q < 0 ? q - 0.5f : q + 0.5f);
            }
    }
}

static inline __attribute__((always_inline)) void tile_q8(const int mr, int64_t k, const float *restrict x,
                                                          int64_t ldx, const int8_t *restrict panel,
                                                          const float *restrict scale, float *restrict y,
                                                          int64_t ldy, int ncols, int accumulate) {
    v8 acc0[MR], acc1[MR];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) acc0[i] = acc1[i] = (v8){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const v8 b0 = widen8(panel + kk * NR);
        const v8 b1 = widen8(panel + kk * NR + 8);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            const float a = x[i * ldx + kk];
            acc0[i] += a * b0;
            acc1[i] += a * b1;
        }
    }
    const v8 s0 = *(const v8 *)scale, s1 = *(const v8 *)(scale + 8);
    for (int i = 0; i < mr; i++) {
        float row[NR];
        const v8 r0 = acc0[i] * s0, r1 = acc1[i] * s1;
        memcpy(row, &r0, sizeof(v8));
        memcpy(row + 8, &r1, sizeof(v8));
        for (int j = 0; j < ncols; j++) y[i * ldy + j] = accumulate ? y[i * ldy + j] + row[j] : row[j];
    }
}

/* One row of x times a panel: tile_q8's mr = 1, with four pairs of accumulators over consecutive k. With one pair,
 * every step waits for the previous fused multiply-add (4 cycles), which bounds a decode step's speed once its
 * weights are a quarter of the bytes; four pairs keep the FMA units busy. */
static inline __attribute__((always_inline)) void row_q8(int64_t k, const float *restrict x,
                                                         const int8_t *restrict panel, const float *restrict scale,
                                                         float *restrict y, int ncols, int accumulate) {
    v8 acc[8] = {{0}};
    int64_t kk = 0;
    for (; kk + 4 <= k; kk += 4) {
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            const float a = x[kk + u];
            acc[2 * u] += a * widen8(panel + (kk + u) * NR);
            acc[2 * u + 1] += a * widen8(panel + (kk + u) * NR + 8);
        }
    }
    for (; kk < k; kk++) {
        acc[0] += x[kk] * widen8(panel + kk * NR);
        acc[1] += x[kk] * widen8(panel + kk * NR + 8);
    }
    const v8 r0 = (acc[0] + acc[2] + acc[4] + acc[6]) * *(const v8 *)scale;
    const v8 r1 = (acc[1] + acc[3] + acc[5] + acc[7]) * *(const v8 *)(scale + 8);
    float row[NR];
    memcpy(row, &r0, sizeof(v8));
    memcpy(row + 8, &r1, sizeof(v8));
    for (int j = 0; j < ncols; j++) y[j] = accumulate ? y[j] + row[j] : row[j];
}

/* y [m][n] (=, or += with `accumulate`) x [m][k] @ W.T, W as pack_weight_q8 packed it. Threads take whole panels.
 * Up to MR rows, one tile widens each weight as it streams by; more rows (a prefill chunk, a large batch) would widen
 * it again for every tile, so the panel is widened once, scaled, into the thread's fp32 buffer, and the fp32 tiles
 * run over that from cache. */
void packed_gemm_q8(const float *restrict x, int64_t ldx, int64_t m, int64_t k, const int8_t *restrict packed,
                    const float *restrict scales, int64_t n, float *restrict y, int64_t ldy, int accumulate,
                    int num_threads) {
    const int64_t num_panels = (n + NR - 1) / NR;
#pragma omp parallel num_threads(num_threads)
    {
        float *widened = m > MR ? aligned_alloc(64, (size_t)(k * NR * sizeof(float) + 63) / 64 * 64) : NULL;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++) {
            const int ncols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            const int8_t *panel = packed + p * k * NR;
            const float *s = scales + p * NR;
            if (widened != NULL) {
                const v8 s0 = *(const v8 *)s, s1 = *(const v8 *)(s + 8);
                for (int64_t kk = 0; kk < k; kk++) {
                    *(v8 *)(widened + kk * NR) = widen8(panel + kk * NR) * s0;
                    *(v8 *)(widened + kk * NR + 8) = widen8(panel + kk * NR + 8) * s1;
                }
                rows_times_panel(m, k, x, ldx, widened, NR, y + p * NR, ldy, ncols, accumulate);
            } else if (m == 1) {
                row_q8(k, x, panel, s, y + p * NR, ncols, accumulate);
            } else {
                switch (m) {
                case 6: tile_q8(6, k, x, ldx, panel, s, y + p * NR, ldy, ncols, accumulate); break;
                case 5: tile_q8(5, k, x, ldx, panel, s, y + p * NR, ldy, ncols, accumulate); break;
                case 4: tile_q8(4, k, x, ldx, panel, s, y + p * NR, ldy, ncols, accumulate); break;
                case 3: tile_q8(3, k, x, ldx, panel, s, y + p * NR, ldy, ncols, accumulate); break;
                default: tile_q8(2, k, x, ldx, panel, s, y + p * NR, ldy, ncols, accumulate); break;
                }
            }
        }
        free(widened);
    }
}
