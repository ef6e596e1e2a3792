/* y = x @ W.T with 4-bit weights in groups of GROUP inputs, each group with its own scale and offset (the layout of
 * GGUF's Q4_1: W = d * q + m, q in 0..15), multiplied on int8 activations in int32 as llama.cpp multiplies Q4_1 by
 * Q8_1. Compiled at first use by workers/executor/kernels.py.
 *
 * A decode step of a few rows is bound by the bytes of weights it streams: 0.625 a weight here (a nibble, and two
 * float16s per 32 weights) against int8's 1 and float32's 4. Each row of x is quantized per group (int8_rows.h);
 * a group's product is then  sx * (d * sum(qx * q) + m * sum(qx)),  the first sum in int32:
 *
 *   AVX-512 VNNI  vpdpbusd, the nibbles as its unsigned operand, the activations as its signed one: 64 products
 *                 per instruction, no bias needed.
 *   AVX2          vpmaddubsw + vpmaddwd, the same operands (|15 * 127 * 2| < 32767: no pair saturates).
 *   otherwise     plain C.
 *
 * Layout: W [n][k] in panels of NR output features, a block per panel and group of 32 inputs, kg = k rounded up
 * to GROUP (zeros past k and past n):
 *
 *   packed [ceil(n / NR)][kg / GROUP][BLOCK_BYTES] bytes, a block being
 *     [4 chunks of 8 inputs][NR features][4] bytes: byte t of a feature's lane in chunk c holds input c*8+t in its
 *                                                  low nibble and input c*8+4+t in its high one
 *     [NR] float16 d, then [NR] float16 m
 *
 * workers/executor/linear.py quantizes and packs (torch), this file only multiplies.
 */
#include <stdlib.h>
#include <string.h>

#include "gemm_tile.h"
#include "int8_rows.h"

#define NIBBLE_BYTES (GROUP / 2 * NR)
#define BLOCK_BYTES (NIBBLE_BYTES + 4 * NR)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W4A8_VNNI 1
#define TILE_ROWS 8
#elif defined(__AVX2__) && defined(__F16C__)
#define W4A8_AVX2 1
#define TILE_ROWS 3
#else
#define TILE_ROWS 4
#endif
#if defined(W4A8_VNNI) || defined(W4A8_AVX2)
#include <immintrin.h>
#endif

/* Which instructions this build multiplies with: 2 VNNI, 1 AVX2, 0 plain C (the worker's log names it). */
int w4a8_instructions(void) {
#if defined(W4A8_VNNI)
    return 2;
#elif defined(W4A8_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Bytes of one block (a panel's group): the caller sizes the packed weight by it. */
int w4a8_block_bytes(void) { return BLOCK_BYTES; }

#if !defined(W4A8_VNNI) && !defined(W4A8_AVX2)
/* IEEE half to float, normals, subnormals and zero (a scale is never infinite or NaN). */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
    if (exponent == 0) {
        const float v = (float)mantissa * (1.f / 16777216.f);  /* mantissa * 2^-24 */
        return sign ? -v : v;
    }
    const uint32_t bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float out;
    memcpy(&out, &bits, 4);
    return out;
}
#endif

/* Rows [0, mr) of the quantized x (kg bytes, kg / GROUP scales and scaled sums a row) times one panel, into
 * out[mr][NR]. */
static inline __attribute__((always_inline)) void int4_tile(const int mr, int64_t kg, const uint8_t *restrict xq,
                                                       const float *restrict x_scale, const float *restrict x_sum,
                                                       const uint8_t *restrict panel, float out[][NR]) {
    const int64_t groups = kg / GROUP;
#if defined(W4A8_VNNI)
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 total[TILE_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++) total[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = panel + g * BLOCK_BYTES;
        __m512i sum[TILE_ROWS];
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) sum[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(block + c * 4 * NR));
            const __m512i first = _mm512_and_si512(v, low), second = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++) {
                int32_t a0, a1;
                memcpy(&a0, xq + i * kg + g * GROUP + c * 8, 4);
                memcpy(&a1, xq + i * kg + g * GROUP + c * 8 + 4, 4);
                sum[i] = _mm512_dpbusd_epi32(sum[i], first, _mm512_set1_epi32(a0));
                sum[i] = _mm512_dpbusd_epi32(sum[i], second, _mm512_set1_epi32(a1));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + NIBBLE_BYTES)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + NIBBLE_BYTES + 2 * NR)));
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            total[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]),
                                       _mm512_mul_ps(d, _mm512_set1_ps(x_scale[i * groups + g])), total[i]);
            total[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(x_sum[i * groups + g]), total[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(out[i], total[i]);
#elif defined(W4A8_AVX2)
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 total0[TILE_ROWS], total1[TILE_ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) total0[i] = total1[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *block = panel + g * BLOCK_BYTES;
        __m256i sum0[TILE_ROWS], sum1[TILE_ROWS];
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) sum0[i] = sum1[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(block + c * 4 * NR));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(block + c * 4 * NR + 32));
            const __m256i first0 = _mm256_and_si256(v0, low), second0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
            const __m256i first1 = _mm256_and_si256(v1, low), second1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++) {
                int32_t a0, a1;
                memcpy(&a0, xq + i * kg + g * GROUP + c * 8, 4);
                memcpy(&a1, xq + i * kg + g * GROUP + c * 8 + 4, 4);
                const __m256i x0 = _mm256_set1_epi32(a0), x1 = _mm256_set1_epi32(a1);
                sum0[i] = _mm256_add_epi32(sum0[i], _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(first0, x0), _mm256_maddubs_epi16(second0, x1)), ones));
                sum1[i] = _mm256_add_epi32(sum1[i], _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(first1, x0), _mm256_maddubs_epi16(second1, x1)), ones));
            }
        }
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + NIBBLE_BYTES)));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + NIBBLE_BYTES + 16)));
        const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + NIBBLE_BYTES + 2 * NR)));
        const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + NIBBLE_BYTES + 2 * NR + 16)));
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            const __m256 s = _mm256_set1_ps(x_scale[i * groups + g]), t = _mm256_set1_ps(x_sum[i * groups + g]);
            total0[i] = _mm256_fmadd_ps(m0, t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum0[i]), _mm256_mul_ps(d0, s),
                                                               total0[i]));
            total1[i] = _mm256_fmadd_ps(m1, t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum1[i]), _mm256_mul_ps(d1, s),
                                                               total1[i]));
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
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *block = panel + g * BLOCK_BYTES;
            for (int j = 0; j < NR; j++) {
                int32_t sum = 0;
                for (int kk = 0; kk < GROUP; kk++) {
                    const uint8_t byte = block[(kk / 8) * 4 * NR + j * 4 + kk % 4];
                    const int q = kk % 8 < 4 ? byte & 15 : byte >> 4;
                    sum += q * (int32_t)(int8_t)xq[i * kg + g * GROUP + kk];
                }
                uint16_t d, m;
                memcpy(&d, block + NIBBLE_BYTES + 2 * j, 2);
                memcpy(&m, block + NIBBLE_BYTES + 2 * NR + 2 * j, 2);
                out[i][j] += half_to_float(d) * x_scale[i * groups + g] * (float)sum
                             + half_to_float(m) * x_sum[i * groups + g];
            }
        }
    }
#endif
}

/* y [m][n] (=, or += with `accumulate`) x [m][k] @ W.T, W packed as above. The rows are quantized once, then
 * threads take whole panels, each in tiles of up to TILE_ROWS rows (the panel stays in cache). */
void gemm_w4a8(const float *restrict x, int64_t ldx, int64_t m, int64_t k, const uint8_t *restrict packed, int64_t n,
               float *restrict y, int64_t ldy, int accumulate, int num_threads, int prologue,
               const float *restrict norm_weight, float eps) {
    const int64_t num_panels = (n + NR - 1) / NR, kg = padded_k(k), groups = kg / GROUP;
    uint8_t *xq = malloc((size_t)(m * kg));
    float *x_scale = malloc((size_t)(m * groups) * sizeof(float));
    float *x_sum = malloc((size_t)(m * groups) * sizeof(float));
    float *scratch = prologue != PROLOGUE_NONE ? malloc((size_t)(m * k) * sizeof(float)) : NULL;
    if (xq == NULL || x_scale == NULL || x_sum == NULL || (prologue != PROLOGUE_NONE && scratch == NULL)) abort();
    const int serial = m * k <= SERIAL_QUANTIZE_INPUTS;
    if (serial)
        for (int64_t i = 0; i < m; i++)
            prepare_row(x, ldx, i, k, kg, 0, prologue, norm_weight, eps, scratch, xq, x_scale,
                        x_sum);
#pragma omp parallel num_threads(num_threads)
    {
        if (!serial) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++)
                prepare_row(x, ldx, i, k, kg, 0, prologue, norm_weight, eps, scratch, xq,
                            x_scale, x_sum);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++) {
            const int ncols = n - p * NR < NR ? (int)(n - p * NR) : NR;
            const uint8_t *panel = packed + p * groups * BLOCK_BYTES;
            for (int64_t row = 0; row < m; row += TILE_ROWS) {
                const int mr = m - row < TILE_ROWS ? (int)(m - row) : TILE_ROWS;
                const uint8_t *rows = xq + row * kg;
                const float *rows_scale = x_scale + row * groups, *rows_sum = x_sum + row * groups;
                float out[TILE_ROWS][NR];
                switch (mr) {
                case TILE_ROWS: int4_tile(TILE_ROWS, kg, rows, rows_scale, rows_sum, panel, out); break;
#if TILE_ROWS == 8
                case 7: int4_tile(7, kg, rows, rows_scale, rows_sum, panel, out); break;
                case 6: int4_tile(6, kg, rows, rows_scale, rows_sum, panel, out); break;
                case 5: int4_tile(5, kg, rows, rows_scale, rows_sum, panel, out); break;
                case 4: int4_tile(4, kg, rows, rows_scale, rows_sum, panel, out); break;
#endif
#if TILE_ROWS >= 4
                case 3: int4_tile(3, kg, rows, rows_scale, rows_sum, panel, out); break;
#endif
                case 2: int4_tile(2, kg, rows, rows_scale, rows_sum, panel, out); break;
                default: int4_tile(1, kg, rows, rows_scale, rows_sum, panel, out); break;
                }
                for (int i = 0; i < mr; i++) {
                    float *dst = y + (row + i) * ldy + p * NR;
                    for (int j = 0; j < ncols; j++) dst[j] = accumulate ? dst[j] + out[i][j] : out[i][j];
                }
            }
        }
    }
    free(xq);
    free(x_scale);
    free(x_sum);
    free(scratch);
}
