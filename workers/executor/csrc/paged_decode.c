/* Decode attention straight from the paged KV cache (fp32, bf16 or int8 caches, CPU; fp32 arithmetic), compiled at
 * first use by executor/kernels.py.
 *
 * One query token per sequence. For sequence b and KV head kh, the `group` query heads that share kh are done
 * together, so each cached K/V row is read once per (b, kh) and never copied:
 *
 *   cache [num_blocks][block_size][num_kv_heads][head_dim]; position p of sequence b lives in block
 *   table[b][p / block_size] at offset p % block_size.
 *
 * Two passes over the context: scores (q.k * scale) into a per-thread buffer, then softmax weights times V. The
 * work items (b, kh) are spread over OpenMP threads; torch ships the same libgomp, so they share one thread pool.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)x << 16};
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does; no NaN in attention output */
    union { float f; uint32_t u; } v = {.f = f};
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* A cached row as floats: fp32 rows are used in place, bf16 rows are widened into `buf` (a shift per element). */
static inline const float *row_f32(float *restrict buf, const float *restrict src, int n) {
    (void)buf, (void)n;
    return src;
}

static inline const float *row_bf16(float *restrict buf, const uint16_t *restrict src, int n) {
    for (int i = 0; i < n; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

/* int8 caches: a row is head_dim int8 values, then the float scale they were quantized by (value = q * scale), as
 * attention/cpu_paged.py's write_kv_int8 stores them; widened into `buf` once per row, for every query head that
 * shares it, and its scale applied to what the row gives (a score, a softmax weight), not to each element. */
#define INT8_ROW_BYTES(hd) ((hd) + (int)sizeof(float))

static inline const float *row_i8(float *restrict buf, const int8_t *restrict src, int n) {
    for (int i = 0; i < n; i++) buf[i] = (float)src[i];
    return buf;
}

/* What a row read by ROW is still to be multiplied by: its int8 scale; 1 for fp32 and bf16 rows. */
static inline float scale_i8(const int8_t *restrict src, int n) {
    float scale;
    memcpy(&scale, src + n, sizeof scale);
    return scale;
}

#define UNSCALED(src, n) 1.f

static inline void store_f32(float *restrict dst, const float *restrict src, float scale, int n) {
    for (int i = 0; i < n; i++) dst[i] = src[i] * scale;
}

static inline void store_bf16(uint16_t *restrict dst, const float *restrict src, float scale, int n) {
    for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i] * scale);
}

/* The body for one (sequence, KV head) over caches of element type C (float, uint16_t for bf16, int8_t), rows of
 * RS(HD) elements that ROW reads as floats (times RSCALE), and output that STORE writes; q is given as floats. HD
 * is a compile-time head_dim where the caller could give one, so the inner loops unroll into whole vector
 * registers. */
#define DECODE_ONE(HD, C, RS, ROW, RSCALE, STORE)                                                                   \
    do {                                                                                                            \
        float mx[MAX_GROUP], sum[MAX_GROUP], row[MAX_HEAD_DIM];                                                     \
        for (int g = 0; g < group; g++) mx[g] = -FLT_MAX, sum[g] = 0.f;                                              \
        for (int64_t j0 = 0; j0 < ctx; j0 += block_size) {                                                          \
            const int64_t base = table[j0 / block_size] * block_size;                                               \
            const int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;                                        \
            for (int64_t j = 0; j < n; j++) {                                                                       \
                const C *src = (const C *)k_cache + ((base + j) * num_kv_heads + kh) * RS(HD);                      \
                const float *kj = ROW(row, src, (HD));                                                              \
                const float row_scale = scale * RSCALE(src, (HD));                                                  \
                for (int g = 0; g < group; g++) {                                                                   \
                    float s = dot(qb + g * (HD), kj, (HD)) * row_scale;                                             \
                    scores[g * ctx + j0 + j] = s;                                                                   \
                    if (s > mx[g]) mx[g] = s;                                                                       \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
        for (int g = 0; g < group; g++) {                                                                           \
            float *sg = scores + g * ctx;                                                                           \
            for (int64_t j = 0; j < ctx; j++) {                                                                     \
                sg[j] = expf(sg[j] - mx[g]);                                                                        \
                sum[g] += sg[j];                                                                                    \
            }                                                                                                       \
        }                                                                                                           \
        float acc[MAX_GROUP * MAX_HEAD_DIM];                                                                        \
        for (int i = 0; i < group * (HD); i++) acc[i] = 0.f;                                                        \
        for (int64_t j0 = 0; j0 < ctx; j0 += block_size) {                                                          \
            const int64_t base = table[j0 / block_size] * block_size;                                               \
            const int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;                                        \
            for (int64_t j = 0; j < n; j++) {                                                                       \
                const C *src = (const C *)v_cache + ((base + j) * num_kv_heads + kh) * RS(HD);                      \
                const float *vj = ROW(row, src, (HD));                                                              \
                const float row_scale = RSCALE(src, (HD));                                                          \
                for (int g = 0; g < group; g++)                                                                     \
                    axpy(acc + g * (HD), scores[g * ctx + j0 + j] * row_scale, vj, (HD));                           \
            }                                                                                                       \
        }                                                                                                           \
        for (int g = 0; g < group; g++) STORE(ob + g * (HD), acc + g * (HD), 1.f / sum[g], (HD));                   \
    } while (0)

/* The whole kernel for q and out of element type T (read by QROW, written by STORE) and caches of C (rows of RS
 * elements, read by ROW): q [batch][q_row_stride] (heads * head_dim used), out [batch][num_heads * head_dim],
 * block_tables [batch][table_stride], context_lens [batch]. Returns 0; -1 for shapes this kernel does not take, -2
 * when a score buffer could not be allocated. */
#define SAME_ELEMS(hd) (hd)
#define PAGED_DECODE(NAME, T, QROW, STORE, C, RS, ROW, RSCALE)                                                      \
    int NAME(const T *q, int64_t q_row_stride, const C *k_cache, const C *v_cache, const int64_t *block_tables,     \
             int64_t table_stride, const int64_t *context_lens, T *out, int batch, int num_heads, int num_kv_heads,  \
             int head_dim, int block_size, float scale, int num_threads) {                                          \
        const int group = num_heads / num_kv_heads;                                                                 \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads) return -1;           \
        int failed = 0;                                                                                             \
        _Pragma("omp parallel num_threads(num_threads)") {                                                          \
            float *scores = NULL;                                                                                   \
            int64_t capacity = 0;                                                                                   \
            float qbuf[MAX_GROUP * MAX_HEAD_DIM];                                                                   \
            _Pragma("omp for schedule(dynamic, 1)") for (int item = 0; item < batch * num_kv_heads; item++) {       \
                const int b = item / num_kv_heads, kh = item % num_kv_heads;                                        \
                const int64_t ctx = context_lens[b];                                                                \
                if (ctx * group > capacity) {                                                                       \
                    free(scores);                                                                                   \
                    capacity = ctx * group;                                                                         \
                    scores = malloc(sizeof(float) * capacity);                                                      \
                    if (scores == NULL) {                                                                           \
                        capacity = 0;                                                                               \
                        _Pragma("omp atomic write") failed = 1;                                                     \
                        continue;                                                                                   \
                    }                                                                                               \
                }                                                                                                   \
                const int64_t *table = block_tables + b * table_stride;                                             \
                const float *qb = QROW(qbuf, q + b * q_row_stride + (int64_t)kh * group * head_dim,                 \
                                       group * head_dim);                                                           \
                T *ob = out + ((int64_t)b * num_heads + (int64_t)kh * group) * head_dim;                            \
                if (head_dim == 64)                                                                                 \
                    DECODE_ONE(64, C, RS, ROW, RSCALE, STORE);                                                      \
                else if (head_dim == 128)                                                                           \
                    DECODE_ONE(128, C, RS, ROW, RSCALE, STORE);                                                     \
                else                                                                                                \
                    DECODE_ONE(head_dim, C, RS, ROW, RSCALE, STORE);                                                \
            }                                                                                                       \
            free(scores);                                                                                           \
        }                                                                                                           \
        return failed ? -2 : 0;                                                                                     \
    }

PAGED_DECODE(paged_decode_f32, float, row_f32, store_f32, float, SAME_ELEMS, row_f32, UNSCALED)
PAGED_DECODE(paged_decode_bf16, uint16_t, row_bf16, store_bf16, uint16_t, SAME_ELEMS, row_bf16, UNSCALED)
PAGED_DECODE(paged_decode_i8, float, row_f32, store_f32, int8_t, INT8_ROW_BYTES, row_i8, scale_i8)

/* Store a step's new K and V [t][num_kv_heads][head_dim] (fp32, rows k_stride and v_stride floats apart) into int8
 * caches at
 * their flat slots: each row's values rounded to x / scale (half away from zero), scale = max|row| / 127, then the
 * scale's four bytes (INT8_ROW_BYTES). One pass, where torch took a dozen operations a layer. */
void write_kv_i8(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots, int64_t t,
                 int num_kv_heads, int head_dim, int8_t *k_cache, int8_t *v_cache) {
    for (int64_t i = 0; i < t; i++)
        for (int kv = 0; kv < 2; kv++)
            for (int h = 0; h < num_kv_heads; h++) {
                const float *x = kv ? v + i * v_stride + (int64_t)h * head_dim : k + i * k_stride + (int64_t)h * head_dim;
                int8_t *dst = (kv ? v_cache : k_cache) + (slots[i] * num_kv_heads + h) * INT8_ROW_BYTES(head_dim);
                float peak = 0.f;
                for (int d = 0; d < head_dim; d++) peak = fmaxf(peak, fabsf(x[d]));
                /* peak * (1 / 127), as -ffast-math would make peak / 127 anyway: int8_rows computes the same */
                const float inverse = peak > 0.f ? 127.f / peak : 0.f, scale = peak * (1.f / 127.f);
                for (int d = 0; d < head_dim; d++) {
                    const float q = x[d] * inverse;
                    dst[d] = (int8_t)(q < 0 ? q - 0.5f : q + 0.5f);
                }
                memcpy(dst + head_dim, &scale, sizeof scale);
            }
}
