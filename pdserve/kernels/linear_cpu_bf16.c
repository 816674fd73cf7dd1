/* Skinny bf16 matrix product on AVX512-BF16: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), x and w bf16, y fp32.
 *
 * linear_cpu.c's product for CPUs with vdpbf16ps (built only where /proc/cpuinfo lists avx512_bf16; see
 * kernels/cpu_linear.py). One vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32 lanes, twice the
 * work of an fp32 FMA of the same width, and reads the weights at half the bytes of fp32 copies. The products of
 * two bf16 values are exact in fp32; each lane adds its two products in the instruction's fixed order.
 *
 * Every weight row is read once per call and multiplied with all M input rows while in registers (tiles of
 * 4 weight rows x up to 4 input rows: 16 accumulators). Each output element is summed in one order whatever M
 * or the row's place in the batch: 16 lanes over k = 0, 32, 64, ... (the last chunk zero-padded by a masked
 * load), then one horizontal sum; so a row gives the same bits in a 1-row decode step and in a verify step.
 */
#include <stdint.h>
#include <immintrin.h>

static inline __m512bh load32(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* MT input rows (1..4) x NT weight rows (1 or 4); both compile-time constants at each call site */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K, float *y, int64_t ldy,
                        const int MT, const int NT) {
    __m512 acc[4][4];
    for (int m = 0; m < MT; m++)
        for (int j = 0; j < NT; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        __m512bh wv[4];
        for (int j = 0; j < NT; j++) wv[j] = load32(w + j * K + k, mask);
        for (int m = 0; m < MT; m++) {
            const __m512bh xv = load32(x + m * ldx + k, mask);
            for (int j = 0; j < NT; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xv);
        }
    }
    for (int m = 0; m < MT; m++)
        for (int j = 0; j < NT; j++) y[m * ldy + j] = _mm512_reduce_add_ps(acc[m][j]);
}

static inline __attribute__((always_inline)) void rows(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K, float *y,
                        int64_t ldy, const int NT) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 4, NT);
    switch (M - m) {
    case 3: tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 3, NT); break;
    case 2: tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 2, NT); break;
    case 1: tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 1, NT); break;
    default: break;
    }
}

/* x: [M, K] bf16 row stride ldx; w: [N, K] contiguous bf16; bias: [N] fp32 or NULL; y: [M, N] contiguous fp32 */
void skinny_linear_dpbf16(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, const float *bias, float *y,
                          int64_t N, int64_t K) {
    const int64_t tiles = N / 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles + N % 4; t++) {
        if (t < tiles)
            rows(x, M, ldx, w + 4 * t * K, K, y + 4 * t, N, 4);
        else {
            const int64_t n = 4 * tiles + (t - tiles);
            rows(x, M, ldx, w + n * K, K, y + n, N, 1);
        }
    }
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += bias[n];
}
