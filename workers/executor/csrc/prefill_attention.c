/* Causal attention of one prefill chunk over its sequence's paged KV cache (fp32 or int8 caches, CPU); compiled at first use by
 * workers/cpu_kernels.py.
 *
 * torch's CPU SDPA ran a 512-token causal prefill of SmolLM2 (9 query / 3 KV heads of 64) at about 45 GFLOP/s on a
 * 2-core AVX2 EPYC, where the projections run at 120-160. Here both products go through the register tile of
 * gemm_tile.h:
 *
 *   1. gather: per KV head, K packed into panels of NR keys ([ctx/NR][head_dim][NR], the "weights" of S = Q.K^T)
 *      and V copied to one contiguous [ctx][head_dim] (NR of its columns are a panel of O = P.V, used in place);
 *   2. per (KV head, tile of QT queries): the tile's QT x group query rows (every query head that shares the KV
 *      head) against the keys its last query may see, the causal mask and an exact softmax over whole score rows,
 *      then P.V.
 *
 * The chunk's own K/V are already in the cache (the caller writes them first), so a fresh prompt and a later chunk
 * of a long one are the same case: queries i = 0..n-1 sit at positions start + i and see positions <= start + i.
 */
#include <float.h>
#include <math.h>
#include <omp.h>

#include "gemm_tile.h"

#define QT 16 /* queries per work item */

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Floats of workspace prefill_attention needs for a context of ctx positions. */
int64_t prefill_workspace_floats(int64_t ctx, int num_heads, int num_kv_heads, int head_dim, int num_threads) {
    const int64_t ctx_pad = round_up(ctx, NR), rows = (int64_t)QT * (num_heads / num_kv_heads);
    return 2 * (int64_t)num_kv_heads * ctx_pad * head_dim +
           (int64_t)num_threads * (rows * ctx_pad + 2 * rows * head_dim);
}

/* The cached row of (slot, KV head) as head_dim floats into dst (dst_stride apart): an fp32 cache's row, or an int8
 * cache's row (head_dim int8 values, then the float scale they were quantized by; see paged_decode.c) widened. */
static inline void gather_row(const void *cache, int int8_rows, int64_t slot, int num_kv_heads, int kh, int hd,
                              float *restrict dst, int64_t dst_stride) {
    if (int8_rows) {
        const int8_t *row = (const int8_t *)cache + (slot * num_kv_heads + kh) * (hd + (int64_t)sizeof(float));
        float s;
        memcpy(&s, row + hd, sizeof s);
        for (int d = 0; d < hd; d++) dst[d * dst_stride] = (float)row[d] * s;
    } else {
        const float *row = (const float *)cache + (slot * num_kv_heads + kh) * hd;
        for (int d = 0; d < hd; d++) dst[d * dst_stride] = row[d];
    }
}

/* q: row i of the chunk at q + i * q_row_stride, heads of head_dim back to back; out likewise (out_row_stride).
 * k_cache, v_cache: fp32, or with int8_rows int8 rows (gather_row). table: the sequence's block ids covering
 * positions [0, start + n). Returns 0, or -1 for shapes it does not take (head_dim not a multiple of NR, or heads
 * not a multiple of KV heads). */
int prefill_attention(
    const float *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, int int8_rows,
    const int64_t *table, int64_t start, int64_t n, float *out, int64_t out_row_stride, int num_heads,
    int num_kv_heads, int head_dim, int block_size, float scale, float *workspace, int num_threads) {
    if (head_dim % NR || num_heads % num_kv_heads) return -1;
    const int group = num_heads / num_kv_heads, hd = head_dim;
    const int64_t ctx = start + n, ctx_pad = round_up(ctx, NR), num_key_panels = ctx_pad / NR;
    const int64_t rows_max = (int64_t)QT * group, num_tiles = (n + QT - 1) / QT;
    float *k_packed = workspace;                                      /* [kv_heads][ctx_pad / NR][hd][NR] */
    float *v_all = k_packed + (int64_t)num_kv_heads * ctx_pad * hd;   /* [kv_heads][ctx_pad][hd] */
    float *per_thread = v_all + (int64_t)num_kv_heads * ctx_pad * hd; /* scores, q tile, out tile */
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_kv_heads * num_key_panels; item++) {
            const int kh = (int)(item / num_key_panels);
            const int64_t p = item % num_key_panels;
            float *kp = k_packed + (kh * num_key_panels + p) * hd * NR;
            for (int j = 0; j < NR; j++) {
                const int64_t pos = p * NR + j;
                float *vrow = v_all + (kh * ctx_pad + pos) * hd;
                if (pos < ctx) {
                    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                    gather_row(k_cache, int8_rows, slot, num_kv_heads, kh, hd, kp + j, NR);
                    gather_row(v_cache, int8_rows, slot, num_kv_heads, kh, hd, vrow, 1);
                } else { /* padding: zero keys get zero weight below, zero values keep 0 * garbage out */
                    for (int d = 0; d < hd; d++) kp[d * NR + j] = 0.f;
                    memset(vrow, 0, sizeof(float) * hd);
                }
            }
        }
        /* the implicit barrier above: every K/V panel is ready */
        float *scores = per_thread + (int64_t)omp_get_thread_num() * (rows_max * ctx_pad + 2 * rows_max * hd);
        float *q_tile = scores + rows_max * ctx_pad, *o_tile = q_tile + rows_max * hd;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_kv_heads * num_tiles; item++) {
            const int64_t t = num_tiles - 1 - item / num_kv_heads; /* the longest (last) tiles first */
            const int kh = (int)(item % num_kv_heads);
            const int64_t i0 = t * QT, nq = n - i0 < QT ? n - i0 : QT, rows = nq * group;
            const int64_t keys = round_up(start + i0 + nq, NR); /* what the tile's last query may see, padded */
            for (int64_t r = 0; r < rows; r++) {
                const float *src = q + (i0 + r / group) * q_row_stride + ((int64_t)kh * group + r % group) * hd;
                for (int d = 0; d < hd; d++) q_tile[r * hd + d] = src[d] * scale;
            }
            for (int64_t p = 0; p < keys / NR; p++)
                rows_times_panel(rows, hd, q_tile, hd, k_packed + (kh * num_key_panels + p) * hd * NR, NR,
                                 scores + p * NR, ctx_pad, NR, 0);
            for (int64_t r = 0; r < rows; r++) {
                float *s = scores + r * ctx_pad, mx = -FLT_MAX, sum = 0.f;
                const int64_t seen = start + i0 + r / group + 1; /* causal: positions <= start + i */
                for (int64_t j = 0; j < seen; j++) mx = s[j] > mx ? s[j] : mx;
                for (int64_t j = 0; j < seen; j++) {
                    s[j] = expf(s[j] - mx);
                    sum += s[j];
                }
                const float inv = 1.f / sum;
                for (int64_t j = 0; j < seen; j++) s[j] *= inv;
                for (int64_t j = seen; j < keys; j++) s[j] = 0.f;
            }
            for (int p = 0; p < hd / NR; p++)
                rows_times_panel(rows, keys, scores, ctx_pad, v_all + kh * ctx_pad * hd + p * NR, hd,
                                 o_tile + p * NR, hd, NR, 0);
            for (int64_t r = 0; r < rows; r++)
                memcpy(out + (i0 + r / group) * out_row_stride + ((int64_t)kh * group + r % group) * hd,
                       o_tile + r * hd, sizeof(float) * hd);
        }
    }
    return 0;
}
