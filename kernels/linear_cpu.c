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

/* MT input rows x NT = 4 weight rows; MT is a compile-time constant at each call site */
static inline void tile(const float *x, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy, int MT) {
    __m256 acc[3][4];
    for (int m = 0; m < MT; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();
    const int64_t K8 = K - K % 8;
    for (int64_t k = 0; k < K8; k += 8) {
        const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
        const __m256 w2 = _mm256_loadu_ps(w + 2 * K + k), w3 = _mm256_loadu_ps(w + 3 * K + k);
        for (int m = 0; m < MT; m++) {
            const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
            acc[m][0] = _mm256_fmadd_ps(w0, xv, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, xv, acc[m][1]);
            acc[m][2] = _mm256_fmadd_ps(w2, xv, acc[m][2]);
            acc[m][3] = _mm256_fmadd_ps(w3, xv, acc[m][3]);
        }
    }
    for (int m = 0; m < MT; m++)
        for (int j = 0; j < 4; j++) {
            float s = hsum8(acc[m][j]);
            for (int64_t k = K8; k < K; k++) s += w[j * K + k] * x[m * ldx + k];
            y[m * ldy + j] = s;
        }
}

static void rows4(const float *x, int64_t M, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 3);
    if (M - m == 2) tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 2);
    else if (M - m == 1) tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 1);
}
#endif

/* one weight row (the last N % 4): the same summation order as the tiles */
static void row1(const float *x, int64_t M, int64_t ldx, const float *w, int64_t K, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
#if defined(__AVX2__) && defined(__FMA__)
        __m256 acc = _mm256_setzero_ps();
        const int64_t K8 = K - K % 8;
        for (int64_t k = 0; k < K8; k += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + m * ldx + k), acc);
        float s = hsum8(acc);
        for (int64_t k = K8; k < K; k++) s += w[k] * x[m * ldx + k];
#else
        float lanes[8] = {0};
        const int64_t K8 = K - K % 8;
        for (int64_t k = 0; k < K8; k += 8)
            for (int l = 0; l < 8; l++) lanes[l] += w[k + l] * x[m * ldx + k + l];
        float s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        for (int64_t k = K8; k < K; k++) s += w[k] * x[m * ldx + k];
#endif
        y[m * ldy] = s;
    }
}

/* x: [M, K] row stride ldx; w: [N, K] contiguous; bias: [N] or NULL; y: [M, N] contiguous. */
void skinny_linear(const float *x, int64_t M, int64_t ldx, const float *w, const float *bias, float *y, int64_t N,
                   int64_t K) {
    const int64_t tiles = N / 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles + N % 4; t++) {
#if defined(__AVX2__) && defined(__FMA__)
        if (t < tiles) {
            rows4(x, M, ldx, w + 4 * t * K, K, y + 4 * t, N);
            continue;
        }
#else
        if (t < tiles) {
            for (int j = 0; j < 4; j++) row1(x, M, ldx, w + (4 * t + j) * K, K, y + 4 * t + j, N);
            continue;
        }
#endif
        const int64_t n = 4 * tiles + (t - tiles);
        row1(x, M, ldx, w + n * K, K, y + n, N);
    }
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += bias[n];
}
