/* The loops of linear_cpu.c's skinny product, included there once per weight type. Before each inclusion define WT
 * (the weight element type), SFX (the suffix of this copy's functions and of the loads load8_SFX, load1_SFX: 8
 * weights -> __m256 of fp32, one weight -> float) and ENTRY (the exported function's name); all three are undefined
 * at the end. */
#define NAME_(f, s) f##_##s
#define NAME__(f, s) NAME_(f, s)
#define NAME(f) NAME__(f, SFX)

#if defined(__AVX2__) && defined(__FMA__)
/* MT input rows x NT = 4 weight rows; MT is a compile-time constant at each call site */
static inline void NAME(tile)(const float *x, int64_t ldx, const WT *w, int64_t K, float *y, int64_t ldy, int MT) {
    __m256 acc[3][4];
    for (int m = 0; m < MT; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();
    const int64_t K8 = K - K % 8;
    for (int64_t k = 0; k < K8; k += 8) {
        const __m256 w0 = NAME(load8)(w + k), w1 = NAME(load8)(w + K + k);
        const __m256 w2 = NAME(load8)(w + 2 * K + k), w3 = NAME(load8)(w + 3 * K + k);
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
            for (int64_t k = K8; k < K; k++) s += NAME(load1)(w + j * K + k) * x[m * ldx + k];
            y[m * ldy + j] = s;
        }
}

static void NAME(rows4)(const float *x, int64_t M, int64_t ldx, const WT *w, int64_t K, float *y, int64_t ldy) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) NAME(tile)(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 3);
    if (M - m == 2) NAME(tile)(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 2);
    else if (M - m == 1) NAME(tile)(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 1);
}
#endif

/* one weight row (the last N % 4): the same summation order as the tiles */
static void NAME(row1)(const float *x, int64_t M, int64_t ldx, const WT *w, int64_t K, float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
#if defined(__AVX2__) && defined(__FMA__)
        __m256 acc = _mm256_setzero_ps();
        const int64_t K8 = K - K % 8;
        for (int64_t k = 0; k < K8; k += 8)
            acc = _mm256_fmadd_ps(NAME(load8)(w + k), _mm256_loadu_ps(x + m * ldx + k), acc);
        float s = hsum8(acc);
        for (int64_t k = K8; k < K; k++) s += NAME(load1)(w + k) * x[m * ldx + k];
#else
        float lanes[8] = {0};
        const int64_t K8 = K - K % 8;
        for (int64_t k = 0; k < K8; k += 8)
            for (int l = 0; l < 8; l++) lanes[l] += NAME(load1)(w + k + l) * x[m * ldx + k + l];
        float s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        for (int64_t k = K8; k < K; k++) s += NAME(load1)(w + k) * x[m * ldx + k];
#endif
        y[m * ldy] = s;
    }
}

void ENTRY(const float *x, int64_t M, int64_t ldx, const WT *w, const float *bias, float *y, int64_t N, int64_t K) {
    const int64_t tiles = N / 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles + N % 4; t++) {
#if defined(__AVX2__) && defined(__FMA__)
        if (t < tiles) {
            NAME(rows4)(x, M, ldx, w + 4 * t * K, K, y + 4 * t, N);
            continue;
        }
#else
        if (t < tiles) {
            for (int j = 0; j < 4; j++) NAME(row1)(x, M, ldx, w + (4 * t + j) * K, K, y + 4 * t + j, N);
            continue;
        }
#endif
        const int64_t n = 4 * tiles + (t - tiles);
        NAME(row1)(x, M, ldx, w + n * K, K, y + n, N);
    }
    add_bias(bias, y, M, N);
}

#undef NAME
#undef NAME__
#undef NAME_
#undef WT
#undef SFX
#undef ENTRY
