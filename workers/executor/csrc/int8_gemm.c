/* y = x @ W.T with int8 weights AND int8 activations (w8a8): products in int32, on the CPU's integer dot-product
 * instructions. Compiled at first use by workers/executor/kernels.py.
 *
 * Weight-only int8 (packed_gemm.c) streams a quarter of fp32's bytes but still multiplies in fp32; from a few rows
 * up a step is bound by those fp32 multiply-adds, not by memory (SmolLM2 at 32 rows: 127 GFLOP/s on two cores,
 * near the FMA units' limit). Here each row of x is quantized on the fly, one scale per GROUP consecutive inputs
 * (int8_rows.h), and 4 weights x 4 activations are summed per 32-bit lane in one instruction:
 *
 *   AVX-512 VNNI  vpdpbusd: 64 products per instruction, unsigned x signed bytes; the activations carry +128 so
 *                 they are unsigned, and `comp[j][g] = 128 * sum over group g of W[j]` takes it back out.
 *   AVX2          vpmaddubsw + vpmaddwd: |x| times W with x's sign moved onto W, so no pair saturates 16 bits
 *                 (127 * 127 * 2 < 32767); no +128.
 *   otherwise     plain C.
 *
 * Each group's int32 sums are scaled by the row's group scale into fp32 sums, and those by the feature's scale.
 * Layout: W [n][k] in panels of NR output features, 4 consecutive k of one feature in one 32-bit lane:
 *
 *   packed [ceil(n / NR)][kg / 4][NR][4] int8, kg = k rounded up to GROUP (zeros past k and past n)
 *   scales [ceil(n / NR) * NR] float  (W[j] = packed[j] * scales[j], scale = max|W[j]| / 127)
 *   comp   [ceil(n / NR)][kg / GROUP][NR] int32
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_tile.h"
#include "int8_rows.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W8A8_VNNI 1
#define ACTIVATION_BIAS 128
#define TILE_ROWS 8
#elif defined(__AVX2__)
#define W8A8_AVX2 1
#define ACTIVATION_BIAS 0
#define TILE_ROWS 3
#else
#define ACTIVATION_BIAS 0
#define TILE_ROWS 4
#endif
#if defined(W8A8_VNNI) || defined(W8A8_AVX2)
#include <immintrin.h>
#endif

/* Which instructions this build multiplies with: 2 VNNI, 1 AVX2, 0 plain C (the worker's log names it). */
int w8a8_instructions(void) {
#if defined(W8A8_VNNI)
    return 2;
#elif defined(W8A8_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* The group size the activations are quantized in (the caller sizes comp by it). */
int w8a8_group(void) { return GROUP; }

/* Quantize W [n][k] (row stride ldw) into packed, scales and comp (layout above). */
void pack_weight_w8a8(const float *restrict w, int64_t ldw, int64_t n, int64_t k, int8_t *restrict packed,
                      float *restrict scales, int32_t *restrict comp, int num_threads) {
    const int64_t num_panels = (n + NR - 1) / NR, kg = padded_k(k), groups = kg / GROUP;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < num_panels; p++) {
        int8_t *dst = packed + p * kg * NR;
        for (int j = 0; j < NR; j++) {
            const int64_t row = p * NR + j;
            float peak = 0.f;
            for (int64_t kk = 0; row < n && kk < k; kk++) peak = fmaxf(peak, fabsf(w[row * ldw + kk]));
            const float inverse = peak > 0.f ? 127.f / peak : 0.f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t sum = 0;
                for (int64_t kk = g * GROUP; kk < (g + 1) * GROUP; kk++) {
                    const float q = row < n && kk < k ? w[row * ldw + kk] * inverse : 0.f;
                    const int8_t b = (int8_t)(q < 0 ? q - 0.5f : q + 0.5f);
                    dst[(kk / 4) * NR * 4 + j * 4 + kk % 4] = b;
                    sum += b;
                }
                comp[(p * groups + g) * NR + j] = ACTIVATION_BIAS * sum;
            }
            scales[p * NR + j] = peak / 127.f;
        }
    }
}

/* Rows [0, mr) of the quantized x (kg bytes and kg / GROUP scales a row) times one panel, into out[mr][NR]:
 * sum over groups of the row's group scale times the group's int32 sum. */
static inline __attribute__((always_inline)) void int8_tile(const int mr, int64_t kg, const uint8_t *restrict xq,
                                                       const float *restrict x_scale, const int8_t *restrict panel,
                                                       const int32_t *restrict comp, float out[][NR]) {
    const int64_t groups = kg / GROUP;
#if defined(W8A8_VNNI)
    __m512 total[TILE_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++) total[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i sum[TILE_ROWS];
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) sum[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int64_t kk = g * GROUP; kk < (g + 1) * GROUP; kk += 4) {
            const __m512i b = _mm512_loadu_si512((const void *)(panel + kk * NR));
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++) {
                int32_t a;
                memcpy(&a, xq + i * kg + kk, 4);
                sum[i] = _mm512_dpbusd_epi32(sum[i], _mm512_set1_epi32(a), b);
            }
        }
        const __m512i c = _mm512_loadu_si512((const void *)(comp + g * NR));
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++)
            total[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[i], c)),
                                       _mm512_set1_ps(x_scale[i * groups + g]), total[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(out[i], total[i]);
#elif defined(W8A8_AVX2)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 total0[TILE_ROWS], total1[TILE_ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) total0[i] = total1[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i sum0[TILE_ROWS], sum1[TILE_ROWS];
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) sum0[i] = sum1[i] = _mm256_setzero_si256();
        for (int64_t kk = g * GROUP; kk < (g + 1) * GROUP; kk += 4) {
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)(panel + kk * NR));
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(panel + kk * NR + 32));
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++) {
                int32_t a;
                memcpy(&a, xq + i * kg + kk, 4);
                const __m256i av = _mm256_set1_epi32(a), magnitude = _mm256_abs_epi8(av);
                sum0[i] = _mm256_add_epi32(sum0[i], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(b0, av)), ones));
                sum1[i] = _mm256_add_epi32(sum1[i], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(b1, av)), ones));
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            const __m256 s = _mm256_set1_ps(x_scale[i * groups + g]);
            total0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum0[i]), s, total0[i]);
            total1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum1[i]), s, total1[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(out[i], total0[i]);
        _mm256_storeu_ps(out[i] + 8, total1[i]);
    }
#else
    for (int i = 0; i < mr; i++) {
        for (int j = 0; j < NR; j++) out[i][j] = 0.f;
        for (int64_t g = 0; g < groups; g++)
            for (int j = 0; j < NR; j++) {
                int32_t sum = 0;
                for (int64_t kk = g * GROUP; kk < (g + 1) * GROUP; kk++)
                    sum += (int32_t)(int8_t)xq[i * kg + kk] * panel[(kk / 4) * NR * 4 + j * 4 + kk % 4];
                out[i][j] += (float)(sum - comp[g * NR + j]) * x_scale[i * groups + g];
            }
    }
#endif
}

/* y [m][n] (=, or += with `accumulate`) x [m][k] @ W.T, W as pack_weight_w8a8 packed it. The rows are quantized
 * once, then threads take whole panels, each in tiles of up to TILE_ROWS rows (the panel stays in cache). */
void gemm_w8a8(const float *restrict x, int64_t ldx, int64_t m, int64_t k, const int8_t *restrict packed,
               const float *restrict scales, const int32_t *restrict comp, int64_t n, float *restrict y, int64_t ldy,
               int accumulate, int num_threads, int prologue, const float *restrict norm_weight, float eps) {
    const int64_t num_panels = (n + NR - 1) / NR, kg = padded_k(k), groups = kg / GROUP;
    uint8_t *xq = malloc((size_t)(m * kg));
    float *x_scale = malloc((size_t)(m * groups) * sizeof(float));
    float *scratch = prologue != PROLOGUE_NONE ? malloc((size_t)(m * k) * sizeof(float)) : NULL;
    if (xq == NULL || x_scale == NULL || (prologue != PROLOGUE_NONE && scratch == NULL)) abort();
    const int serial = m * k <= SERIAL_QUANTIZE_INPUTS;
    if (serial)
        for (int64_t i = 0; i < m; i++)
            prepare_row(x, ldx, i, k, kg, ACTIVATION_BIAS, prologue, norm_weight, eps, scratch,
                        xq, x_scale, NULL);
#pragma omp parallel num_threads(num_threads)
    {
        if (!serial) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++)
                prepare_row(x, ldx, i, k, kg, ACTIVATION_BIAS, prologue, norm_weight, eps,
                            scratch, xq, x_scale, NULL);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++) {
            const int ncols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            const int8_t *panel = packed + p * kg * NR;
            const int32_t *panel_comp = comp + p * groups * NR;
            for (int64_t row = 0; row < m; row += TILE_ROWS) {
                const int mr = m - row < TILE_ROWS ? (int)(m - row) : TILE_ROWS;
                const uint8_t *rows = xq + row * kg;
                const float *rows_scale = x_scale + row * groups;
                float out[TILE_ROWS][NR];
                switch (mr) {
                case TILE_ROWS: int8_tile(TILE_ROWS, kg, rows, rows_scale, panel, panel_comp, out); break;
#if TILE_ROWS == 8
                case 7: int8_tile(7, kg, rows, rows_scale, panel, panel_comp, out); break;
                case 6: int8_tile(6, kg, rows, rows_scale, panel, panel_comp, out); break;
                case 5: int8_tile(5, kg, rows, rows_scale, panel, panel_comp, out); break;
                case 4: int8_tile(4, kg, rows, rows_scale, panel, panel_comp, out); break;
#endif
#if TILE_ROWS >= 4
                case 3: int8_tile(3, kg, rows, rows_scale, panel, panel_comp, out); break;
#endif
                case 2: int8_tile(2, kg, rows, rows_scale, panel, panel_comp, out); break;
                default: int8_tile(1, kg, rows, rows_scale, panel, panel_comp, out); break;
                }
                for (int i = 0; i < mr; i++) {
                    float *dst = y + (row + i) * ldy + p * NR;
                    for (int j = 0; j < ncols; j++) {
                        const float v = out[i][j] * scales[p * NR + j];
                        dst[j] = accumulate ? dst[j] + v : v;
                    }
                }
            }
        }
    }
    free(xq);
    free(x_scale);
    free(scratch);
}
