/* The register tile shared by the CPU kernels: rows of x times one panel of NR columns, fp32.
 *
 * A panel is K rows of NR floats, `ldp` floats apart: NR for weights packed by packed_gemm.c (one contiguous
 * stream), or a row stride for a matrix used in place (V in prefill_attention.c, NR of its columns). A tile of up
 * to MR rows keeps MR x NR accumulators in vector registers across the whole of K. Written with GCC vector
 * extensions, so it vectorises for whatever -march=native offers (AVX2 + FMA here).
 */
#ifndef SWITCHYARD_GEMM_TILE_H
#define SWITCHYARD_GEMM_TILE_H

#include <stdint.h>
#include <string.h>

#define NR 16
#define MR 6

typedef float v8 __attribute__((vector_size(32), aligned(4)));

/* y[0:mr][0:ncols] (=, or += with `accumulate`) x[0:mr][0:k] . panel; `mr` is a constant once inlined. */
static inline __attribute__((always_inline)) void tile(const int mr, int64_t k, const float *restrict x,
                                                       int64_t ldx, const float *restrict panel, int64_t ldp,
                                                       float *restrict y, int64_t ldy, int ncols, int accumulate) {
    v8 acc0[MR], acc1[MR];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) acc0[i] = acc1[i] = (v8){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const v8 b0 = *(const v8 *)(panel + kk * ldp);
        const v8 b1 = *(const v8 *)(panel + kk * ldp + 8);
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

/* All m rows of x times one panel, in tiles of near-equal size (32 rows: 6 6 5 5 5 5, not 6 6 6 6 6 2). */
static inline __attribute__((always_inline)) void rows_times_panel(int64_t m, int64_t k, const float *restrict x,
                                                                   int64_t ldx, const float *restrict panel,
                                                                   int64_t ldp, float *restrict y, int64_t ldy,
                                                                   int ncols, int accumulate) {
    const int64_t num_tiles = (m + MR - 1) / MR;
    int64_t row = 0;
    for (int64_t t = 0; t < num_tiles; t++) {
        const int mr = (int)((m - row) / (num_tiles - t)) + ((m - row) % (num_tiles - t) != 0);
        const float *xt = x + row * ldx;
        float *yt = y + row * ldy;
        switch (mr) {
        case 6: tile(6, k, xt, ldx, panel, ldp, yt, ldy, ncols, accumulate); break;
        case 5: tile(5, k, xt, ldx, panel, ldp, yt, ldy, ncols, accumulate); break;
        case 4: tile(4, k, xt, ldx, panel, ldp, yt, ldy, ncols, accumulate); break;
        case 3: tile(3, k, xt, ldx, panel, ldp, yt, ldy, ncols, accumulate); break;
        case 2: tile(2, k, xt, ldx, panel, ldp, yt, ldy, ncols, accumulate); break;
        default: tile(1, k, xt, ldx, panel, ldp, yt, ldy, ncols, accumulate); break;
        }
        row += mr;
    }
}

#endif
