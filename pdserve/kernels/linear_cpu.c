/* Skinny fp32 matrix product for a few rows: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), M small (decode steps,
 * speculative verify steps).
 *
 * Built and loaded like paged_attention_cpu.c (kernels/cpu_linear.py). MKL's sgemm packs the weight matrix for
 * every call when M >= 2, so on this project's AVX2 machine a 5-row product cost 2-3x the 1-row gemv although
 * both are bound by reading the weights once. Here every weight row is read once and multiplied with all M
 * input rows while it is in registers.
 *
 * Each output element is summed in one fixed order whatever M, the row's place in the batch or the thread
 * split: 8 fp32 lanes accumulated with FMA over k = 0, 8, 16, ..., then the lanes added in a fixed tree, then
 * the scalar tail k >= K - K % 8, then the bias. So a row's result is bit-identical in a 1-row decode step and
 * in a (k+1)-row verify step (speculative decoding's greedy output stays token-for-token the plain one).
 * Output columns are split over torch's OpenMP threads in tiles of 4 weight rows.
 *
 * The weights come as fp32 (skinny_linear) or as bf16 (skinny_linear_bf16w: the model's own weights; at a few rows
 * a decode step is bound by reading the weights, and bf16 halves the bytes). A bf16 value widened to fp32 is exact,
 * so both read the same numbers and sum them in the same order: the two give bit-identical results. The loops are
 * written once, in linear_cpu_tiles.h, and included once per weight type (a flag argument instead was not
 * specialised inside OpenMP's outlined loop, and the fp32 kernel lost up to 20% at 16 rows).
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    const __m128 s4 = _mm_add_ps(lo, hi);                       /* lanes i + (i + 4) */
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));    /* (0 + 2), (1 + 3) */
    const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));      /* 0 + 1 */
    return _mm_cvtss_f32(s1);
}

static inline __m256 load8_f32(const float *w) { return _mm256_loadu_ps(w); }

static inline __m256 load8_bf16(const uint16_t *w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}
#endif

static inline float load1_f32(const float *w) { return *w; }

static inline float load1_bf16(const uint16_t *w) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)*w << 16};
    return v.f;
}

static void add_bias(const float *bias, float *y, int64_t M, int64_t N) {
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += bias[n];
}

/* x: [M, K] row stride ldx; w: [N, K] contiguous fp32; bias: [N] or NULL; y: [M, N] contiguous. */
#define WT float
#define SFX f32
#define ENTRY skinny_linear
#include "linear_cpu_tiles.h"

/* the same with w [N, K] contiguous bf16 (its raw bits) */
#define WT uint16_t
#define SFX bf16
#define ENTRY skinny_linear_bf16w
#include "linear_cpu_tiles.h"
