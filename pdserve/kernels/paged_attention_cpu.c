/* Paged attention for CPU: reads K/V blocks in place through the block table (no gather, no padding).
 *
 * Built at first use by kernels/cpu_attention.py (gcc -O3 -march=native -fopenmp -shared) and called through
 * ctypes with raw pointers. OpenMP is torch's own runtime (libgomp.so.1 is already loaded by torch), so
 * torch.set_num_threads applies here too.
 *
 * Layout (vLLM's): q, out [num_tokens, num_heads, head_dim] (q's rows q_stride elements apart, its heads
 * contiguous: a view into the fused QKV projection needs no copy); k_cache, v_cache
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks] int32;
 * seq_lens [num_seqs] int32 (context after this step); query_start_loc [num_seqs + 1] int32.
 * Query row i of sequence s sits at position seq_len - query_len + i and attends keys 0..position; with a sliding
 * window W > 0 only keys position - W + 1..position (transformers' sliding_window_overlay: q - W < k <= q). Blocks
 * wholly before a task's window are not read (their block-table entries may point anywhere).
 *
 * Algorithm: one task per (sequence, kv head, chunk of query rows); per KV block, the block's keys and
 * values are converted to fp32 once and used by every query head of the group and every row of the chunk,
 * with the online softmax of FlashAttention (Dao et al., 2022; Milakov & Gimelshein, 2018) in fp32.
 * dtype: 0 = float32, 1 = bfloat16 (round-to-nearest-even on the way out).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS_PER_TASK 32
#define MAX_BS 32 /* largest block size; K is kept transposed as [head_dim][MAX_BS] */

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);  /* NaN stays NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

static inline void load_row(const void *base, int64_t idx, int dtype, int d, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + idx, sizeof(float) * d);
    } else {
        const uint16_t *src = (const uint16_t *)base + idx;
#pragma omp simd
        for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

static inline void store_row(void *base, int64_t idx, int dtype, int d, const float *src, float mul) {
    if (dtype == 0) {
        float *dst = (float *)base + idx;
        for (int i = 0; i < d; i++) dst[i] = src[i] * mul;
    } else {
        uint16_t *dst = (uint16_t *)base + idx;
        for (int i = 0; i < d; i++) dst[i] = f32_to_bf16(src[i] * mul);
    }
}

/* A task's start: its n query rows from row `first_row` on (every head of kv head kvh's group) as fp32 times
 * `scale` into qf, and the online softmax's state cleared (acc = 0, m = -inf, l = 0). */
static void task_begin(const void *q, int64_t q_stride, int64_t first_row, int64_t n, int g, int kvh, int d,
                       int dtype, float scale, float *qf, float *acc, float *m, float *l) {
    for (int64_t r = 0; r < n; r++)
        for (int j = 0; j < g; j++) {
            float *dst = qf + (r * g + j) * d;
            load_row(q, (first_row + r) * q_stride + (int64_t)(kvh * g + j) * d, dtype, d, dst);
            for (int i = 0; i < d; i++) dst[i] *= scale;
        }
    memset(acc, 0, sizeof(float) * n * g * d);
    for (int64_t i = 0; i < n * g; i++) { m[i] = -INFINITY; l[i] = 0.0f; }
}

/* A task's end: each row's accumulator divided by its softmax sum, stored into out[row, head]. */
static void task_end(void *out, int64_t first_row, int64_t n, int g, int kvh, int num_heads, int d, int dtype,
                     const float *acc, const float *l) {
    for (int64_t r = 0; r < n; r++)
        for (int j = 0; j < g; j++) {
            const int64_t qi = r * g + j;
            store_row(out, ((first_row + r) * num_heads + kvh * g + j) * (int64_t)d, dtype, d, acc + qi * d,
                      1.0f / l[qi]);
        }
}

/* The first block a row at position `pos` (or a chunk whose first row sits there) reads: 0 without a window
 * (window <= 0), else the block holding key pos - window + 1. */
static inline int64_t first_block(int64_t pos, int64_t window, int bs) {
    const int64_t lo = window > 0 ? pos - window + 1 : 0;
    return lo > 0 ? lo / bs : 0;
}

/* The first key, relative to a block starting at position `first`, that the row at `pos` sees: 0 without a
 * window; may be past the block's last key (the row sees none of it). */
static inline int window_start(int64_t pos, int64_t window, int64_t first) {
    const int64_t lo = window > 0 ? pos - window + 1 - first : 0;
    return lo > 0 ? (lo < MAX_BS + 1 ? (int)lo : MAX_BS + 1) : 0;
}

/* One task: rows [r0, r1) of sequence s (row indices relative to the sequence's first query row), kv head
 * kvh, every query head of its group. Scratch: q [n*G*D], acc [n*G*D], m/l [n*G], kb/vb [MAX_BS*D]. */
static void attend_task(const void *q, int64_t q_stride, const void *kc, const void *vc, void *out,
                        const int32_t *table, int64_t ctx, int64_t qlen, int64_t row0, int64_t r0, int64_t r1, int kvh, int num_heads,
                        int num_kv_heads, int d, int bs, float scale, int dtype, int64_t window, float *scratch) {
    const int g = num_heads / num_kv_heads;
    const int64_t n = r1 - r0, nq = n * g;
    float *qf = scratch, *acc = qf + nq * d, *m = acc + nq * d, *l = m + nq, *kb = l + nq, *vb = kb + (int64_t)MAX_BS * d;
    task_begin(q, q_stride, row0 + r0, n, g, kvh, d, dtype, scale, qf, acc, m, l);
    const int64_t last_pos = ctx - qlen + r1 - 1;  /* the chunk's last row sees keys 0..last_pos */
    const int64_t nblocks = last_pos / bs + 1;
    const int64_t stride_tok = (int64_t)num_kv_heads * d;
    for (int64_t b = first_block(ctx - qlen + r0, window, bs); b < nblocks; b++) {
        const int64_t base = (int64_t)table[b] * bs * stride_tok + (int64_t)kvh * d;
        const int64_t first = b * bs;
        const int nk = (int)((last_pos - first + 1) < bs ? (last_pos - first + 1) : bs);
        for (int t = 0; t < nk; t++) {
            load_row(kc, base + t * stride_tok, dtype, d, vb);  /* vb as scratch: K row t, transposed below */
            for (int i = 0; i < d; i++) kb[i * MAX_BS + t] = vb[i];
        }
        for (int t = 0; t < nk; t++) load_row(vc, base + t * stride_tok, dtype, d, vb + (int64_t)t * d);
        for (int64_t r = 0; r < n; r++) {
            const int64_t pos = ctx - qlen + r0 + r;
            if (pos < first) continue;
            const int valid = (int)((pos - first + 1) < nk ? (pos - first + 1) : nk);
            const int lo = window_start(pos, window, first);  /* keys before lo are outside the row's window */
            if (lo >= valid) continue;
            for (int j = 0; j < g; j++) {
                const int64_t qi = r * g + j;
                const float *qv = qf + qi * d;
                /* scores of the block's keys, vectorised over keys: p[t] = sum_i q[i] * K^T[i][t] */
                float p[MAX_BS];
                for (int t = 0; t < nk; t++) p[t] = 0.0f;
                for (int i = 0; i < d; i++) {
                    const float qs = qv[i];
                    const float *krow = kb + i * MAX_BS;
#pragma omp simd
                    for (int t = 0; t < nk; t++) p[t] += qs * krow[t];
                }
                float mx = m[qi];
                for (int t = lo; t < valid; t++) mx = p[t] > mx ? p[t] : mx;
                const float corr = expf(m[qi] - mx);  /* exp(-inf) = 0 on the first block */
                float sum = 0.0f;
                for (int t = lo; t < valid; t++) { p[t] = expf(p[t] - mx); sum += p[t]; }
                l[qi] = l[qi] * corr + sum;
                m[qi] = mx;
                float *a = acc + qi * d;
#pragma omp simd
                for (int i = 0; i < d; i++) a[i] *= corr;
                for (int t = lo; t < valid; t++) {
                    const float *vv = vb + (int64_t)t * d;
                    const float w = p[t];
#pragma omp simd
                    for (int i = 0; i < d; i++) a[i] += w * vv[i];
                }
            }
        }
    }
    task_end(out, row0 + r0, n, g, kvh, num_heads, d, dtype, acc, l);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 elements of a float32 (dtype 0) or bfloat16 (1) array from base[idx] as fp32 (bf16 -> fp32 is exact) */
static inline __m256 load8(const void *base, int64_t idx, int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)base + idx);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* [sum of a[0]'s lanes, ..., sum of a[7]'s lanes] */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

/* e^x in 8 lanes: Cephes' expf (S. L. Moshier; the AVX form of avx_mathfun.h, J. Pommier): x = n ln2 + r with
 * |r| <= ln2/2, e^r by a degree-7 polynomial, times 2^n; about 1 ulp from expf on the arguments used here (scores
 * minus their running maximum, <= 0). Below -87.3 it returns e^-87.3 (~1e-38) where expf gives 0 or a subnormal:
 * such a weight is below fp32's resolution beside the maximum's 1. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* attend_task for head_dim % 8 == 0 with AVX2/FMA: the same online softmax, the same scratch. Per KV block the
 * keys and values are converted to fp32 row by row once (8 lanes at a time, no transpose), each score is a dot
 * product over head_dim in 8 lanes (8 keys at a time, reduced with one horizontal-add tree), and the values are
 * accumulated 8 dimensions at a time in registers, only over the keys a row may see; the softmax's exponentials
 * are taken 8 at a time (exp8). The scalar version
 * transposed every key element with a strided store and spent most of a decode step there (177 of about 400
 * CPU-ms at batch 32 on this project's AVX2 machine). */
static void attend_task_avx2(const void *q, int64_t q_stride, const void *kc, const void *vc, void *out,
                             const int32_t *table, int64_t ctx, int64_t qlen, int64_t row0, int64_t r0, int64_t r1,
                             int kvh, int num_heads, int num_kv_heads, int d, int bs, float scale, int dtype,
                             int64_t window, float *scratch) {
    const int g = num_heads / num_kv_heads;
    const int64_t n = r1 - r0, nq = n * g;
    float *qf = scratch, *acc = qf + nq * d, *m = acc + nq * d, *l = m + nq, *kb = l + nq, *vb = kb + (int64_t)MAX_BS * d;
    task_begin(q, q_stride, row0 + r0, n, g, kvh, d, dtype, scale, qf, acc, m, l);
    const int64_t last_pos = ctx - qlen + r1 - 1;
    const int64_t nblocks = last_pos / bs + 1;
    const int64_t stride_tok = (int64_t)num_kv_heads * d;
    for (int64_t b = first_block(ctx - qlen + r0, window, bs); b < nblocks; b++) {
        const int64_t base = (int64_t)table[b] * bs * stride_tok + (int64_t)kvh * d;
        const int64_t first = b * bs;
        const int nk = (int)((last_pos - first + 1) < bs ? (last_pos - first + 1) : bs);
        for (int t = 0; t < nk; t++)
            for (int c = 0; c < d; c += 8) {
                _mm256_storeu_ps(kb + (int64_t)t * d + c, load8(kc, base + t * stride_tok + c, dtype));
                _mm256_storeu_ps(vb + (int64_t)t * d + c, load8(vc, base + t * stride_tok + c, dtype));
            }
        const int nk8 = (nk + 7) & ~7;  /* the score loop reads keys in groups of 8: zeros past the block's end */
        if (nk8 > nk) memset(kb + (int64_t)nk * d, 0, sizeof(float) * (size_t)(nk8 - nk) * d);
        for (int64_t r = 0; r < n; r++) {
            const int64_t pos = ctx - qlen + r0 + r;
            if (pos < first) continue;
            const int valid = (int)((pos - first + 1) < nk ? (pos - first + 1) : nk);
            const int lo = window_start(pos, window, first);  /* keys before lo are outside the row's window */
            if (lo >= valid) continue;
            for (int j = 0; j < g; j++) {
                const int64_t qi = r * g + j;
                const float *qv = qf + qi * d;
                float p[MAX_BS];
                for (int t0 = 0; t0 < valid; t0 += 8) {
                    __m256 a[8];
                    for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
                    for (int c = 0; c < d; c += 8) {
                        const __m256 qc = _mm256_loadu_ps(qv + c);
                        for (int u = 0; u < 8; u++)
                            a[u] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kb + (int64_t)(t0 + u) * d + c), a[u]);
                    }
                    _mm256_storeu_ps(p + t0, hsum8x8(a));
                }
                float mx = m[qi];
                for (int t = lo; t < valid; t++) mx = p[t] > mx ? p[t] : mx;
                const float corr = expf(m[qi] - mx);  /* exp(-inf) = 0 on the first block */
                const __m256 mxv = _mm256_set1_ps(mx);
                for (int t0 = 0; t0 < valid; t0 += 8)  /* lanes past valid (or before lo) are computed, never read */
                    _mm256_storeu_ps(p + t0, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t0), mxv)));
                float sum = 0.0f;
                for (int t = lo; t < valid; t++) sum += p[t];
                l[qi] = l[qi] * corr + sum;
                m[qi] = mx;
                float *av = acc + qi * d;
                const __m256 cv = _mm256_set1_ps(corr);
                for (int c = 0; c < d; c += 8) {
                    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(av + c), cv);
                    for (int t = lo; t < valid; t++)
                        x = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vb + (int64_t)t * d + c), x);
                    _mm256_storeu_ps(av + c, x);
                }
            }
        }
    }
    task_end(out, row0 + r0, n, g, kvh, num_heads, d, dtype, acc, l);
}

/* [4 keys' scores] from their lane vectors, summed in hsum8x8's tree: ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* One decode row (a task of one query row) for query heads [j0, j0 + G) of its group, G <= 3: attend_task_avx2's
 * arithmetic in its order, bit for bit. Each block's K/V rows are copied to fp32 first, as that task does (reading
 * them in place in the loops below instead was 1.6x faster while the K/V sat in cache but 15% slower once a step's
 * ~110 MB streamed from memory: the bulk copy keeps more loads in flight), then every load from the copy serves all
 * G heads: 4 keys x G heads of scores at a time, then G accumulators over the values. Scores are computed for keys
 * t0..t0+3 of a block (bs % 4 == 0); lanes past `valid` hold stale copy rows and are never used. */
static inline void decode_heads(const void *kc, const void *vc, const int32_t *table, int64_t ctx, int kvh,
                                int num_kv_heads, int d, int bs, int dtype, int64_t window, int j0, const int G,
                                const float *qf, float *acc, float *m, float *l, float *kbuf, float *vbuf) {
    const int64_t stride_tok = (int64_t)num_kv_heads * d, nblocks = (ctx - 1) / bs + 1;
    for (int64_t b = first_block(ctx - 1, window, bs); b < nblocks; b++) {
        const int64_t src = (int64_t)table[b] * bs * stride_tok + (int64_t)kvh * d, first = b * bs;
        const int valid = (int)((ctx - first) < bs ? (ctx - first) : bs);
        const int lo = window_start(ctx - 1, window, first);  /* < valid: the first block holds the window's start */
        for (int t = 0; t < valid; t++)
            for (int c = 0; c < d; c += 8) {
                _mm256_storeu_ps(kbuf + (int64_t)t * d + c, load8(kc, src + t * stride_tok + c, dtype));
                _mm256_storeu_ps(vbuf + (int64_t)t * d + c, load8(vc, src + t * stride_tok + c, dtype));
            }
        float p[3][MAX_BS];
        for (int t0 = 0; t0 < valid; t0 += 4) {
            __m256 a[3][4];
            for (int j = 0; j < G; j++)
                for (int u = 0; u < 4; u++) a[j][u] = _mm256_setzero_ps();
            for (int c = 0; c < d; c += 8) {
                __m256 k[4];
                for (int u = 0; u < 4; u++) k[u] = _mm256_loadu_ps(kbuf + (int64_t)(t0 + u) * d + c);
                for (int j = 0; j < G; j++) {
                    const __m256 qc = _mm256_loadu_ps(qf + (int64_t)(j0 + j) * d + c);
                    for (int u = 0; u < 4; u++) a[j][u] = _mm256_fmadd_ps(qc, k[u], a[j][u]);
                }
            }
            for (int j = 0; j < G; j++) _mm_storeu_ps(p[j] + t0, hsum4x8(a[j][0], a[j][1], a[j][2], a[j][3]));
        }
        __m256 cv[3];
        for (int j = 0; j < G; j++) {
            const int qi = j0 + j;
            float mx = m[qi];
            for (int t = lo; t < valid; t++) mx = p[j][t] > mx ? p[j][t] : mx;
            const float corr = expf(m[qi] - mx);
            const __m256 mxv = _mm256_set1_ps(mx);
            for (int t0 = 0; t0 < valid; t0 += 8)  /* p has MAX_BS lanes: a last group past valid is never read */
                _mm256_storeu_ps(p[j] + t0, exp8(_mm256_sub_ps(_mm256_loadu_ps(p[j] + t0), mxv)));
            float sum = 0.0f;
            for (int t = lo; t < valid; t++) sum += p[j][t];
            l[qi] = l[qi] * corr + sum;
            m[qi] = mx;
            cv[j] = _mm256_set1_ps(corr);
        }
        for (int c = 0; c < d; c += 8) {
            __m256 x[3];
            for (int j = 0; j < G; j++) x[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)(j0 + j) * d + c), cv[j]);
            for (int t = lo; t < valid; t++) {
                const __m256 v = _mm256_loadu_ps(vbuf + (int64_t)t * d + c);
                for (int j = 0; j < G; j++) x[j] = _mm256_fmadd_ps(_mm256_set1_ps(p[j][t]), v, x[j]);
            }
            for (int j = 0; j < G; j++) _mm256_storeu_ps(acc + (int64_t)(j0 + j) * d + c, x[j]);
        }
    }
}

/* attend_task_avx2 for a task of one query row (decode steps), same results bit for bit, every load from the
 * block's fp32 copy shared by up to 3 query heads: SmolLM2-135M's 9/3 heads, batch 32, contexts 36-276, bf16,
 * 1 thread, 30 layers: 41-42 -> 37-39 CPU-ms with 30 distinct layers' K/V (135 MB, from memory), 23.5 -> 19.2 with
 * one layer's K/V in cache 30 times. A task of one row is always its sequence's last row (row chunks start at
 * multiples of ROWS_PER_TASK), so it sees ctx keys. */
static void attend_decode_avx2(const void *q, int64_t q_stride, const void *kc, const void *vc, void *out,
                               const int32_t *table, int64_t ctx /* keys the row sees */, int64_t row, int kvh, int num_heads,
                               int num_kv_heads, int d, int bs, float scale, int dtype, int64_t window, float *scratch) {
    const int g = num_heads / num_kv_heads;
    float *qf = scratch, *acc = qf + (int64_t)g * d, *m = acc + (int64_t)g * d, *l = m + g, *kbuf = l + g;
    float *vbuf = kbuf + (int64_t)MAX_BS * d;
    task_begin(q, q_stride, row, 1, g, kvh, d, dtype, scale, qf, acc, m, l);
    for (int j0 = 0; j0 < g; j0 += 3) {
        const int G = g - j0 < 3 ? g - j0 : 3;
        if (G == 3) decode_heads(kc, vc, table, ctx, kvh, num_kv_heads, d, bs, dtype, window, j0, 3, qf, acc, m, l, kbuf, vbuf);
        else if (G == 2) decode_heads(kc, vc, table, ctx, kvh, num_kv_heads, d, bs, dtype, window, j0, 2, qf, acc, m, l, kbuf, vbuf);
        else decode_heads(kc, vc, table, ctx, kvh, num_kv_heads, d, bs, dtype, window, j0, 1, qf, acc, m, l, kbuf, vbuf);
    }
    task_end(out, row, 1, g, kvh, num_heads, d, dtype, acc, l);
}
#endif

/* 0: decode rows take attend_task_avx2 like any other (the tests' bit-for-bit reference for attend_decode_avx2) */
static int decode_path = 1;
void set_decode_path(int on) { decode_path = on; }

/* Returns 0, or -1 when block_size > MAX_BS or a scratch allocation failed. window: 0 for full attention. */
int paged_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, void *out, const int32_t *block_tables,
                    const int32_t *seq_lens, const int32_t *query_start_loc, int num_seqs, int max_blocks,
                    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int dtype,
                    int64_t window) {
    if (block_size > MAX_BS) return -1;
    /* tasks: (sequence, row chunk) x kv heads, listed up front so OpenMP can balance them */
    int64_t ntasks = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int64_t qlen = query_start_loc[s + 1] - query_start_loc[s];
        ntasks += (qlen + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    }
    int32_t *task_seq = malloc(sizeof(int32_t) * (ntasks + 1)), *task_r0 = malloc(sizeof(int32_t) * (ntasks + 1));
    if (!task_seq || !task_r0) { free(task_seq); free(task_r0); return -1; }
    int64_t k = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int64_t qlen = query_start_loc[s + 1] - query_start_loc[s];
        for (int64_t r = 0; r < qlen; r += ROWS_PER_TASK) { task_seq[k] = s; task_r0[k] = (int32_t)r; k++; }
    }
    const int g = num_heads / num_kv_heads;
    const int64_t scratch_floats = 2 * (int64_t)ROWS_PER_TASK * g * head_dim + 2 * ROWS_PER_TASK * g
                                   + 2 * (int64_t)MAX_BS * head_dim;
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t t = 0; t < ntasks; t++)
            for (int h = 0; h < num_kv_heads; h++) {
                if (!scratch) continue;
                const int s = task_seq[t];
                const int64_t qlen = query_start_loc[s + 1] - query_start_loc[s];
                const int64_t r0 = task_r0[t];
                const int64_t r1 = r0 + ROWS_PER_TASK < qlen ? r0 + ROWS_PER_TASK : qlen;
#if defined(__AVX2__) && defined(__FMA__)
                if (head_dim % 8 == 0 && r1 - r0 == 1 && block_size % 4 == 0 && decode_path) {
                    attend_decode_avx2(q, q_stride, k_cache, v_cache, out, block_tables + (int64_t)s * max_blocks,
                                       seq_lens[s] - qlen + r0 + 1, query_start_loc[s] + r0, h, num_heads, num_kv_heads, head_dim,
                                       block_size, scale, dtype, window, scratch);
                    continue;
                }
                if (head_dim % 8 == 0) {
                    attend_task_avx2(q, q_stride, k_cache, v_cache, out, block_tables + (int64_t)s * max_blocks,
                                     seq_lens[s], qlen, query_start_loc[s], r0, r1, h, num_heads, num_kv_heads,
                                     head_dim, block_size, scale, dtype, window, scratch);
                    continue;
                }
#endif
                attend_task(q, q_stride, k_cache, v_cache, out, block_tables + (int64_t)s * max_blocks, seq_lens[s], qlen,
                            query_start_loc[s], r0, r1, h, num_heads, num_kv_heads, head_dim, block_size, scale,
                            dtype, window, scratch);
            }
        free(scratch);
    }
    free(task_seq);
    free(task_r0);
    return failed ? -1 : 0;
}

/* Writes each token's K and V rows into its slot of the paged caches (what reshape_and_cache_ref does with two
 * index_copy_): key/value [num_tokens, row] with rows k_stride/v_stride elements apart (views into the fused QKV
 * projection), row = num_kv_heads * head_dim contiguous elements of elsize bytes; slot -1 (padding) is skipped.
 * Returns -1, writing nothing, when a slot is past the cache. One pass on the calling thread: a decode step writes
 * a few KiB per layer, less than an OpenMP fork costs. */
int reshape_and_cache(const void *key, int64_t k_stride, const void *value, int64_t v_stride, void *k_cache,
                      void *v_cache, const int64_t *slots, int64_t num_tokens, int64_t num_slots, int64_t row, int elsize) {
    const size_t bytes = (size_t)row * elsize;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= num_slots) return -1;  /* nothing written, as index_copy_ raises first */
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        memcpy((char *)k_cache + s * bytes, (const char *)key + t * k_stride * elsize, bytes);
        memcpy((char *)v_cache + s * bytes, (const char *)value + t * v_stride * elsize, bytes);
    }
    return 0;
}
