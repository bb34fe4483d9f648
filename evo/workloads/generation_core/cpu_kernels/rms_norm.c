/* RMSNorm after a residual add, one row at a time on one CPU thread (AVX2, FMA), float32:
   new_x = x + residual (residual may be NULL: new_x = x), out = new_x * (1 / sqrt(mean(new_x^2) + eps)) * weight.
   new_x may be x itself (the add in place). Rows are contiguous, D a multiple of 8. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

void evo_add_rms_norm(const float *x, const float *residual, float *new_x, const float *weight, float *out,
                      int64_t rows, int64_t D, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        const float *rr = residual ? residual + r * D : 0;
        float *nr = new_x + r * D, *o = out + r * D;
        __m256 sq = _mm256_setzero_ps();
        for (int64_t c = 0; c < D; c += 8) {
            __m256 s = _mm256_loadu_ps(xr + c);
            if (rr) s = _mm256_add_ps(s, _mm256_loadu_ps(rr + c));
            _mm256_storeu_ps(nr + c, s);
            sq = _mm256_fmadd_ps(s, s, sq);
        }
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(sq), _mm256_extractf128_ps(sq, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(_mm_cvtss_f32(h) / (float)D + eps));
        for (int64_t c = 0; c < D; c += 8)
            _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(nr + c), inv),
                                                  _mm256_loadu_ps(weight + c)));
    }
}
