/* Grouped-query attention of one decode position per row over that row's own keys, on one CPU thread (AVX2, FMA).

   For each row r and KV head g, the G = H / KVH query heads g*G .. g*G+G-1 read keys and values [0, lengths[r]) of
   head g once for all G of them: scores = q . k * scale, softmax in float32, out = sum p v. The cache may be float32
   or bfloat16 (widened as read, a shift); q and out are float32. Strides are in elements; a head's d values are
   contiguous. d must be a multiple of 8. Returns 0, or -1 when scratch cannot be allocated. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 16

/* exp(x) for float32 lanes (Cephes' expf as vectorised in avx_mathfun: range reduction by ln 2, a degree-5
   polynomial; about 1 ulp over [-87, 88]). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load8(const void *base, int64_t at, int bf16) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + at);
}

int evo_cpu_has_avx2_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* One row's KV head: its G queries qg (stride q_head) over keys and values [0, S). G is a constant in each copy
   (`evo_decode_attention` switches on it), so the G dot products stay in registers. */
static inline __attribute__((always_inline)) void group_attention(
        const int G, const float *qg, int64_t q_head, const void *k, const void *v, int bf16, int64_t kb,
        int64_t k_pos, int64_t vb, int64_t v_pos, int64_t S, int d, float scale, float *scores,
        float *out /* G rows of d */) {
    const int chunks = d / 8;
    /* scores [G, S]: each key read once for the group's G queries */
    for (int64_t s = 0; s < S; s++) {
        __m256 dot[MAX_GROUP];
        for (int j = 0; j < G; j++) dot[j] = _mm256_setzero_ps();
        for (int c = 0; c < chunks; c++) {
            __m256 kc = load8(k, kb + s * k_pos + c * 8, bf16);
            for (int j = 0; j < G; j++)
                dot[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j * q_head + c * 8), kc, dot[j]);
        }
        for (int j = 0; j < G; j++) scores[j * S + s] = hsum256(dot[j]) * scale;
    }
    /* softmax of each query's row, its exponentials left in place; 1 / their sum kept */
    float inverse[MAX_GROUP];
    for (int j = 0; j < G; j++) {
        float *row = scores + j * S;
        float top = row[0];
        for (int64_t s = 1; s < S; s++) top = row[s] > top ? row[s] : top;
        __m256 mx = _mm256_set1_ps(top), sum8 = _mm256_setzero_ps();
        int64_t s = 0;
        for (; s + 8 <= S; s += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + s), mx));
            _mm256_storeu_ps(row + s, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum256(sum8);
        if (s < S) {  /* the last S % 8 through one zero-padded vector */
            float tail[8] = {0};
            for (int64_t t = s; t < S; t++) tail[t - s] = row[t];
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(tail), mx));
            _mm256_storeu_ps(tail, e);
            for (int64_t t = s; t < S; t++) { row[t] = tail[t - s]; sum += tail[t - s]; }
        }
        inverse[j] = 1.0f / sum;
    }
    /* out = p @ V, 16 columns at a time: the group's accumulators stay in registers, each value row is read once */
    for (int c = 0; c < chunks; c += 2) {
        const int two = c + 1 < chunks;
        __m256 lo[MAX_GROUP], hi[MAX_GROUP];
        for (int j = 0; j < G; j++) lo[j] = hi[j] = _mm256_setzero_ps();
        for (int64_t s = 0; s < S; s++) {
            __m256 v0 = load8(v, vb + s * v_pos + c * 8, bf16);
            __m256 v1 = two ? load8(v, vb + s * v_pos + c * 8 + 8, bf16) : v0;
            for (int j = 0; j < G; j++) {
                __m256 p = _mm256_broadcast_ss(scores + j * S + s);
                lo[j] = _mm256_fmadd_ps(p, v0, lo[j]);
                hi[j] = _mm256_fmadd_ps(p, v1, hi[j]);
            }
        }
        for (int j = 0; j < G; j++) {
            __m256 inv = _mm256_set1_ps(inverse[j]);
            _mm256_storeu_ps(out + j * d + c * 8, _mm256_mul_ps(lo[j], inv));
            if (two) _mm256_storeu_ps(out + j * d + c * 8 + 8, _mm256_mul_ps(hi[j], inv));
        }
    }
}

int evo_decode_attention(const float *q, int64_t q_row, int64_t q_head,
                         const void *k, const void *v, int bf16,
                         int64_t k_row, int64_t k_head, int64_t k_pos,
                         int64_t v_row, int64_t v_head, int64_t v_pos,
                         const int64_t *lengths, int n, int H, int KVH, int d, float scale,
                         float *out /* [n, H, d] contiguous */) {
    const int G = H / KVH;
    if (G < 1 || G > MAX_GROUP) return -2;
    int64_t longest = 1;
    for (int r = 0; r < n; r++) longest = lengths[r] > longest ? lengths[r] : longest;
    float *scores = malloc(sizeof(float) * (size_t)(G * longest));
    if (scores == NULL) return -1;
    for (int r = 0; r < n; r++) {
        for (int g = 0; g < KVH; g++) {
            const float *qg = q + r * q_row + (int64_t)g * G * q_head;
            const int64_t kb = r * k_row + g * k_head, vb = r * v_row + g * v_head;
            float *o = out + ((int64_t)r * H + (int64_t)g * G) * d;
#define GROUP(N) group_attention(N, qg, q_head, k, v, bf16, kb, k_pos, vb, v_pos, lengths[r], d, scale, scores, o)
            switch (G) {
                case 1: GROUP(1); break;
                case 2: GROUP(2); break;
                case 3: GROUP(3); break;
                case 4: GROUP(4); break;
                case 5: GROUP(5); break;
                case 6: GROUP(6); break;
                case 7: GROUP(7); break;
                case 8: GROUP(8); break;
                default: GROUP(G); break;
            }
#undef GROUP
        }
    }
    free(scores);
    return 0;
}
