/* Fused element-wise work of a Llama decoder layer on CPU, bit-compatible with the unfused PyTorch ops.
 *
 * Built and loaded like paged_attention_cpu.c (kernels/cpu_elementwise.py). Each function makes one pass over
 * its rows instead of PyTorch's 3-5 (casts, temporaries), and rounds where PyTorch rounds, so bf16 results
 * equal the unfused ops' except for the order of the fp32 sum of squares in RMSNorm and the exp of SiLU.
 * dtype: 0 = float32, 1 = bfloat16: the precision values are rounded to. Storage codes (same numbers) say how a
 * tensor is held: a bf16 model's fp32-weight GEMMs (Fp32WeightLinear) take and give fp32, so RMSNorm and SiLU*up
 * can write their bf16-rounded results as fp32 and read a GEMM's fp32 output, rounding it to bf16 on load; the
 * values are the ones the cast passes they replace would give. Rows are split over torch's OpenMP threads.
 *
 * With AVX2/FMA the passes run 8 lanes at a time with the same results bit for bit as the scalar code kept below
 * (exported as *_ref for the tests): products, sums and the bf16 rounding are the same IEEE operations element by
 * element; RMSNorm's sum of squares keeps its sequential order per row by putting 8 rows in the 8 lanes (an 8x8
 * transpose); SiLU's exp is glibc's expf (2.27 and later, the FMA variant x86-64 glibc picks on AVX2/FMA CPUs)
 * done in 4 double lanes with its own table and coefficients, so it returns what expf returns.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float ld(const void *p, int64_t i, int storage) {
    if (storage == 0) return ((const float *)p)[i];
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)((const uint16_t *)p)[i] << 16;
    return v.f;
}

/* the value after a round trip through the tensor's dtype (round to nearest even for bf16) */
static inline float rnd(float f, int dtype) {
    if (dtype == 0) return f;
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return f;
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    v.u &= 0xffff0000u;
    return v.f;
}

/* store f rounded to dtype, held as storage (fp32 storage of a bf16-rounded value keeps it exactly) */
static inline void st(void *p, int64_t i, int storage, int dtype, float f) {
    f = rnd(f, dtype);
    if (storage == 0) { ((float *)p)[i] = f; return; }
    union { uint32_t u; float f; } v;
    v.f = f;
    ((uint16_t *)p)[i] = (uint16_t)(v.u >> 16);
}

/* Fewer elements than this run on the calling thread: a decode step's rows are a few microseconds of work per
 * call, less than waking OpenMP's sleeping threads (OMP_WAIT_POLICY=PASSIVE) and joining them, 30 layers x 4 calls
 * a step. Rows are independent, so the split never changes a result. */
#define PARALLEL_MIN 32768

/* ---- the scalar code: the reference, the tails of the vector code, and the path without AVX2 ---- */

static float sumsq_row(const void *x, int64_t o, int from, int n, int storage, float ss) {
    for (int i = from; i < n; i++) { const float s = ld(x, o + i, storage); ss += s * s; }
    return ss;
}

static void add_row(void *res, const void *delta, int64_t o, int from, int n, int rs, int ds, int dtype) {
    for (int i = from; i < n; i++)
        st(res, o + i, rs, dtype, ld(res, o + i, rs) + rnd(ld(delta, o + i, ds), dtype));
}

static void norm_row(const void *res, const void *weight, void *out, int64_t o, int from, int n, float inv, int rs,
                     int os, int dtype) {
    for (int i = from; i < n; i++)
        st(out, o + i, os, dtype, ld(weight, i, dtype) * rnd(ld(res, o + i, rs) * inv, dtype));
}

static void silu_row(const void *gu, void *out, int64_t g, int64_t o, int from, int inter, int gs, int os, int dtype) {
    for (int i = from; i < inter; i++) {
        const float x = rnd(ld(gu, g + i, gs), dtype);
        const float s = rnd(x / (1.0f + expf(-x)), dtype);
        st(out, o + i, os, dtype, s * rnd(ld(gu, g + inter + i, gs), dtype));
    }
}

static void rope_head(void *x, int64_t o, const void *cos_sin, int64_t c, int64_t s, int from, int d, int dtype) {
    const int half = d / 2;
    float buf[512];
    for (int i = 0; i < d; i++) buf[i] = ld(x, o + i, dtype);
    for (int i = from; i < d; i++) {
        const float rot = i < half ? -buf[i + half] : buf[i - half];
        const float a = rnd(buf[i] * ld(cos_sin, c + i, dtype), dtype);
        const float b = rnd(rot * ld(cos_sin, s + i, dtype), dtype);
        st(x, o + i, dtype, dtype, a + b);
    }
}

static inline float inv_rms(float ss, int n, float eps) { return 1.0f / sqrtf(ss / (float)n + eps); }

void add_rms_norm_ref(void *residual, const void *delta, const void *weight, void *out, int64_t rows, int n, float eps,
                      int dtype, int delta_storage, int out_storage) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r * n;
        if (delta) add_row(residual, delta, o, 0, n, dtype, delta_storage, dtype);
        const float inv = inv_rms(sumsq_row(residual, o, 0, n, dtype, 0.0f), n, eps);
        norm_row(residual, weight, out, o, 0, n, inv, dtype, out_storage, dtype);
    }
}

void silu_mul_ref(const void *gate_up, void *out, int64_t rows, int inter, int dtype, int in_storage, int out_storage) {
    for (int64_t r = 0; r < rows; r++)
        silu_row(gate_up, out, r * 2 * (int64_t)inter, r * (int64_t)inter, 0, inter, in_storage, out_storage, dtype);
}

void rope_ref(void *x, int64_t row_stride, const void *cos_sin, int64_t max_pos, const int64_t *positions, int64_t rows,
              int heads, int d, int dtype) {
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            rope_head(x, r * row_stride + (int64_t)h * d, cos_sin, positions[r] * d, (max_pos + positions[r]) * d, 0, d,
                      dtype);
}

void expf_ref(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = expf(x[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 ld8(const void *p, int64_t i, int storage) {
    if (storage == 0) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 rnd8(__m256 f, int dtype) {
    if (dtype == 0) return f;
    const __m256i u = _mm256_castps_si256(f);
    /* both sides below 2^31, so the signed compare is the scalar code's unsigned one */
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, u, nan));
}

static inline void st8(void *p, int64_t i, int storage, int dtype, __m256 f) {
    f = rnd8(f, dtype);
    if (storage == 0) { _mm256_storeu_ps((float *)p + i, f); return; }
    const __m256i v = _mm256_srli_epi32(_mm256_castps_si256(f), 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

/* glibc's __expf_fma (sysdeps/ieee754/flt-32/e_expf.c, EXP2F_TABLE_BITS 5): exp(x) = 2^(k/32) * 2^(r/32) with a
 * cubic in r, all in double, one rounding to float at the end; the same FMAs in the same order as its machine code,
 * so each lane equals expf(x) for |x| < 88 (the caller sends other x to expf itself). */
static const uint64_t EXP2F_TAB[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};

static inline __m256d bits_pd(uint64_t u) { return _mm256_castsi256_pd(_mm256_set1_epi64x((long long)u)); }

static inline __m128 exp4(__m128 x) {
    const __m256d inv_ln2_n = bits_pd(0x40471547652b82feull), shift = bits_pd(0x4338000000000000ull);
    const __m256d c0 = bits_pd(0x3ebc6af84b912394ull), c1 = bits_pd(0x3f2ebfce50fac4f3ull);
    const __m256d c2 = bits_pd(0x3f962e42ff0c52d6ull);
    const __m256d xd = _mm256_cvtps_pd(x);
    const __m256d kds = _mm256_fmadd_pd(inv_ln2_n, xd, shift);
    const __m256i ki = _mm256_castpd_si256(kds);
    const __m256d kd = _mm256_sub_pd(kds, shift);
    const __m256d r = _mm256_fmsub_pd(inv_ln2_n, xd, kd);
    __m256i t = _mm256_i64gather_epi64((const long long *)EXP2F_TAB, _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
    t = _mm256_add_epi64(t, _mm256_slli_epi64(ki, 47));
    const __m256d z = _mm256_fmadd_pd(r, c0, c1);
    const __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(r, c2, _mm256_set1_pd(1.0));
    y = _mm256_fmadd_pd(z, r2, y);
    return _mm256_cvtpd_ps(_mm256_mul_pd(y, _mm256_castsi256_pd(t)));
}

static inline __m256 exp8(__m256 x) {
    /* |x| >= 88 (glibc's special-case branch) or NaN: expf itself, lane by lane */
    const __m256 big = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), _mm256_set1_ps(88.0f), _CMP_NLT_UQ);
    if (_mm256_movemask_ps(big)) {
        float v[8];
        _mm256_storeu_ps(v, x);
        for (int l = 0; l < 8; l++) v[l] = expf(v[l]);
        return _mm256_loadu_ps(v);
    }
    return _mm256_set_m128(exp4(_mm256_extractf128_ps(x, 1)), exp4(_mm256_castps256_ps128(x)));
}

void expf_vec(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = expf(x[i]);
}

/* how many float bit patterns in [lo, hi) give exp8 != expf (NaNs equal): the tests' exhaustive check */
int64_t expf_mismatches(uint32_t lo, uint32_t hi) {
    int64_t bad = 0;
    for (uint64_t b = lo; b < hi; b += 8) {
        uint32_t u[8];
        float x[8], y[8];
        for (int l = 0; l < 8; l++) u[l] = (uint32_t)(b + l < hi ? b + l : lo);
        memcpy(x, u, sizeof x);
        _mm256_storeu_ps(y, exp8(_mm256_loadu_ps(x)));
        for (int l = 0; l < 8; l++) {
            const float e = expf(x[l]);
            uint32_t ye, yg;
            memcpy(&ye, &e, 4);
            memcpy(&yg, &y[l], 4);
            bad += ye != yg && !(isnan(e) && isnan(y[l]));
        }
    }
    return bad;
}

/* r[c] lane j <- r[j] lane c */
static inline void transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* sums of squares of 8 rows (rows past the last repeat it), each summed in element order as sumsq_row does */
static void sumsq8(const void *x, int64_t r0, int64_t rows, int n, int storage, float *ss) {
    int64_t o[8];
    for (int j = 0; j < 8; j++) o[j] = (r0 + j < rows ? r0 + j : rows - 1) * n;
    __m256 acc = _mm256_setzero_ps();
    const int n8 = n - n % 8;
    for (int i = 0; i < n8; i += 8) {
        __m256 v[8];
        for (int j = 0; j < 8; j++) { v[j] = ld8(x, o[j] + i, storage); v[j] = _mm256_mul_ps(v[j], v[j]); }
        transpose8(v);
        for (int c = 0; c < 8; c++) acc = _mm256_add_ps(acc, v[c]);
    }
    _mm256_storeu_ps(ss, acc);
    for (int j = 0; j < 8; j++) ss[j] = sumsq_row(x, o[j], n8, n, storage, ss[j]);
}

static void add_rms_norm_rows(void *residual, const void *delta, const void *weight, void *out, int64_t r0, int64_t rows,
                              int n, float eps, int dtype, int ds, int os) {
    const int n8 = n - n % 8;
    const int64_t end = r0 + 8 < rows ? r0 + 8 : rows;
    if (delta)
        for (int64_t r = r0; r < end; r++) {
            const int64_t o = r * n;
            for (int i = 0; i < n8; i += 8)
                st8(residual, o + i, dtype, dtype,
                    _mm256_add_ps(ld8(residual, o + i, dtype), rnd8(ld8(delta, o + i, ds), dtype)));
            add_row(residual, delta, o, n8, n, dtype, ds, dtype);
        }
    float ss[8];
    sumsq8(residual, r0, rows, n, dtype, ss);
    for (int64_t r = r0; r < end; r++) {
        const int64_t o = r * n;
        const float inv = inv_rms(ss[r - r0], n, eps);
        const __m256 iv = _mm256_set1_ps(inv);
        for (int i = 0; i < n8; i += 8)
            st8(out, o + i, os, dtype,
                _mm256_mul_ps(ld8(weight, i, dtype), rnd8(_mm256_mul_ps(ld8(residual, o + i, dtype), iv), dtype)));
        norm_row(residual, weight, out, o, n8, n, inv, dtype, os, dtype);
    }
}
#endif

/* residual (in place) = residual + dtype(delta) (delta may be NULL: no add); out = weight * dtype(rms_norm_f32(residual))
 * -- transformers' LlamaRMSNorm after the residual add. residual, delta, out: [rows, n] contiguous; residual and weight
 * held in dtype, delta as delta_storage, out as out_storage. */
void add_rms_norm(void *residual, const void *delta, const void *weight, void *out, int64_t rows, int n, float eps,
                  int dtype, int delta_storage, int out_storage) {
#if defined(__AVX2__) && defined(__FMA__)
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t g = 0; g < (rows + 7) / 8; g++)
        add_rms_norm_rows(residual, delta, weight, out, 8 * g, rows, n, eps, dtype, delta_storage, out_storage);
#else
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_ref((char *)residual + r * n * (dtype ? 2 : 4),
                         delta ? (const char *)delta + r * n * (delta_storage ? 2 : 4) : NULL, weight,
                         (char *)out + r * n * (out_storage ? 2 : 4), 1, n, eps, dtype, delta_storage, out_storage);
#endif
}

/* out[r, :] = dtype(silu(gate)) * up where gate_up[r] = [gate (inter) | up (inter)], both rounded to dtype on load;
 * gate_up [rows, 2 * inter] held as in_storage, out [rows, inter] as out_storage. */
void silu_mul(const void *gate_up, void *out, int64_t rows, int inter, int dtype, int in_storage, int out_storage) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g = r * 2 * (int64_t)inter, o = r * (int64_t)inter;
        int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = rnd8(ld8(gate_up, g + i, in_storage), dtype);
            const __m256 s = rnd8(_mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, neg)))), dtype);
            st8(out, o + i, out_storage, dtype, _mm256_mul_ps(s, rnd8(ld8(gate_up, g + inter + i, in_storage), dtype)));
        }
#endif
        silu_row(gate_up, out, g, o, i, inter, in_storage, out_storage, dtype);
    }
}

/* In place on x [rows, heads, d] (rows row_stride elements apart, heads contiguous): x = x*cos + rotate_half(x)*sin
 * with cos_sin [2, max_pos, d] and positions [rows] int64 -- each product rounded, then the sum, as PyTorch does. */
void rope(void *x, int64_t row_stride, const void *cos_sin, int64_t max_pos, const int64_t *positions, int64_t rows,
          int heads, int d, int dtype) {
#pragma omp parallel for schedule(static) if (rows * heads * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t c = positions[r] * d, s = (max_pos + positions[r]) * d;
        for (int h = 0; h < heads; h++) {
            const int64_t o = r * row_stride + (int64_t)h * d;
#if defined(__AVX2__) && defined(__FMA__)
            const int half = d / 2;
            if (half % 8 == 0) {
                __m256 buf[64];  /* d <= 512: the head, read before any lane is written */
                for (int i = 0; i < d; i += 8) buf[i / 8] = ld8(x, o + i, dtype);
                const __m256 neg = _mm256_set1_ps(-0.0f);
                for (int i = 0; i < d; i += 8) {
                    const __m256 rot = i < half ? _mm256_xor_ps(buf[(i + half) / 8], neg) : buf[(i - half) / 8];
                    const __m256 a = rnd8(_mm256_mul_ps(buf[i / 8], ld8(cos_sin, c + i, dtype)), dtype);
                    const __m256 b = rnd8(_mm256_mul_ps(rot, ld8(cos_sin, s + i, dtype)), dtype);
                    st8(x, o + i, dtype, dtype, _mm256_add_ps(a, b));
                }
                continue;
            }
#endif
            rope_head(x, o, cos_sin, c, s, 0, d, dtype);
        }
    }
}

#if !(defined(__AVX2__) && defined(__FMA__))
void expf_vec(const float *x, float *y, int64_t n) { expf_ref(x, y, n); }
int64_t expf_mismatches(uint32_t lo, uint32_t hi) { (void)lo; (void)hi; return 0; }
#endif
