/* Decode attention straight from the paged KV cache (fp32 or bf16 caches, CPU; fp32 arithmetic), compiled at first use
 * by executor/kernels.py.
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

static inline void store_f32(float *restrict dst, const float *restrict src, float scale, int n) {
    for (int i = 0; i < n; i++) dst[i] = src[i] * scale;
}

static inline void store_bf16(uint16_t *restrict dst, const float *restrict src, float scale, int n) {
    for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i] * scale);
}

/* The body for one (sequence, KV head) over caches of element type T (float or uint16_t for bf16), whose rows ROW
 * reads as floats and whose output STORE writes; q is given as floats. HD is a compile-time head_dim where the
 * caller could give one, so the inner loops unroll into whole vector registers. */
#define DECODE_ONE(HD, T, ROW, STORE)                                                                               \
    do {                                                                                                            \
        float mx[MAX_GROUP], sum[MAX_GROUP], row[MAX_HEAD_DIM];                                                     \
        for (int g = 0; g < group; g++) mx[g] = -FLT_MAX, sum[g] = 0.f;                                              \
        for (int64_t j0 = 0; j0 < ctx; j0 += block_size) {                                                          \
            const int64_t base = table[j0 / block_size] * block_size;                                               \
            const int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;                                        \
            for (int64_t j = 0; j < n; j++) {                                                                       \
                const float *kj = ROW(row, (const T *)k_cache + ((base + j) * num_kv_heads + kh) * (HD), (HD));     \
                for (int g = 0; g < group; g++) {                                                                   \
                    float s = dot(qb + g * (HD), kj, (HD)) * scale;                                                 \
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
                const float *vj = ROW(row, (const T *)v_cache + ((base + j) * num_kv_heads + kh) * (HD), (HD));     \
                for (int g = 0; g < group; g++) axpy(acc + g * (HD), scores[g * ctx + j0 + j], vj, (HD));           \
            }                                                                                                       \
        }                                                                                                           \
        for (int g = 0; g < group; g++) STORE(ob + g * (HD), acc + g * (HD), 1.f / sum[g], (HD));                   \
    } while (0)

/* The whole kernel for element type T: q [batch][q_row_stride] (heads * head_dim used), out [batch][num_heads *
 * head_dim], block_tables [batch][table_stride], context_lens [batch]. Returns 0; -1 for shapes this kernel does not
 * take, -2 when a score buffer could not be allocated. */
#define PAGED_DECODE(NAME, T, ROW, STORE)                                                                           \
    int NAME(const T *q, int64_t q_row_stride, const T *k_cache, const T *v_cache, const int64_t *block_tables,     \
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
                const float *qb = ROW(qbuf, q + b * q_row_stride + (int64_t)kh * group * head_dim,                  \
                                      group * head_dim);                                                            \
                T *ob = out + ((int64_t)b * num_heads + (int64_t)kh * group) * head_dim;                            \
                if (head_dim == 64)                                                                                 \
                    DECODE_ONE(64, T, ROW, STORE);                                                                  \
                else if (head_dim == 128)                                                                           \
                    DECODE_ONE(128, T, ROW, STORE);                                                                 \
                else                                                                                                \
                    DECODE_ONE(head_dim, T, ROW, STORE);                                                            \
            }                                                                                                       \
            free(scores);                                                                                           \
        }                                                                                                           \
        return failed ? -2 : 0;                                                                                     \
    }

PAGED_DECODE(paged_decode_f32, float, row_f32, store_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, row_bf16, store_bf16)
