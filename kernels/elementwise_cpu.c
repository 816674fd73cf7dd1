/* Fused element-wise work of a Llama decoder layer on CPU, bit-compatible with the unfused PyTorch ops.
 *
 * Built and loaded like paged_attention_cpu.c (kernels/cpu_kernels.py). Each function makes one pass over
 * its rows instead of PyTorch's 3-5 (casts, temporaries), and rounds where PyTorch rounds, so bf16 results
 * equal the unfused ops' except for the order of the fp32 sum of squares in RMSNorm and the exp of SiLU.
 * dtype: 0 = float32, 1 = bfloat16. Rows are split over torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float ld(const void *p, int64_t i, int dtype) {
    if (dtype == 0) return ((const float *)p)[i];
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

static inline void st(void *p, int64_t i, int dtype, float f) {
    if (dtype == 0) { ((float *)p)[i] = f; return; }
    union { uint32_t u; float f; } v;
    v.f = rnd(f, dtype);
    ((uint16_t *)p)[i] = (uint16_t)(v.u >> 16);
}

/* Fewer elements than this run on the calling thread: a decode step's rows are a few microseconds of work per
 * call, less than waking OpenMP's sleeping threads (OMP_WAIT_POLICY=PASSIVE) and joining them, 30 layers x 4 calls
 * a step. Rows are independent, so the split never changes a result. */
#define PARALLEL_MIN 32768

/* residual (in place) = residual + delta (delta may be NULL: no add); out = weight * dtype(rms_norm_f32(residual))
 * -- transformers' LlamaRMSNorm after the residual add. residual, delta, out: [rows, n] contiguous. */
void add_rms_norm(void *residual, const void *delta, const void *weight, void *out, int64_t rows, int n, float eps,
                  int dtype) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r * n;
        float ss = 0.0f;
        if (delta) {
            for (int i = 0; i < n; i++) {
                const float s = rnd(ld(residual, o + i, dtype) + ld(delta, o + i, dtype), dtype);
                st(residual, o + i, dtype, s);
                ss += s * s;
            }
        } else {
            for (int i = 0; i < n; i++) { const float s = ld(residual, o + i, dtype); ss += s * s; }
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++) {
            const float normed = rnd(ld(residual, o + i, dtype) * inv, dtype);
            st(out, o + i, dtype, ld(weight, i, dtype) * normed);
        }
    }
}

/* out[r, :] = dtype(silu(gate)) * up where gate_up[r] = [gate (inter) | up (inter)]; out [rows, inter]. */
void silu_mul(const void *gate_up, void *out, int64_t rows, int inter, int dtype) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g = r * 2 * (int64_t)inter, o = r * (int64_t)inter;
        for (int i = 0; i < inter; i++) {
            const float x = ld(gate_up, g + i, dtype);
            const float s = rnd(x / (1.0f + expf(-x)), dtype);
            st(out, o + i, dtype, s * ld(gate_up, g + inter + i, dtype));
        }
    }
}

/* In place on x [rows, heads, d] (rows row_stride elements apart, heads contiguous): x = x*cos + rotate_half(x)*sin
 * with cos_sin [2, max_pos, d] and positions [rows] int64 -- each product rounded, then the sum, as PyTorch does. */
void rope(void *x, int64_t row_stride, const void *cos_sin, int64_t max_pos, const int64_t *positions, int64_t rows,
          int heads, int d, int dtype) {
    const int half = d / 2;
#pragma omp parallel for schedule(static) if (rows * heads * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t c = positions[r] * d, s = (max_pos + positions[r]) * d;
        for (int h = 0; h < heads; h++) {
            const int64_t o = r * row_stride + (int64_t)h * d;
            float buf[512];
            for (int i = 0; i < d; i++) buf[i] = ld(x, o + i, dtype);
            for (int i = 0; i < d; i++) {
                const float rot = i < half ? -buf[i + half] : buf[i - half];
                const float a = rnd(buf[i] * ld(cos_sin, c + i, dtype), dtype);
                const float b = rnd(rot * ld(cos_sin, s + i, dtype), dtype);
                st(x, o + i, dtype, a + b);
            }
        }
    }
}
