/* The KDA (gated delta rule) recurrence on one CPU thread (AVX2, FMA), float32, for B sequences of up to T tokens,
   each head's state S [K, V] (row-major, V a multiple of 8) updated in place. Per token t of a sequence and head:
       S' = diag(decay_t) S;  r_t = v_t - S'^T k_t;  S = S' + beta_t k_t r_t^T;
       o_t = S^T q_t = S'^T q_t + (beta_t k_t . q_t) r_t
   One pass over S a token: the rank-one update of token t is applied in the pass that decays S for token t + 1 and
   forms its two products (S'^T k, S'^T q), so S is read and written once a token (a head's 64 x 64 state is 16 KB,
   in L1); the last token's update gets a pass of its own.
   Layouts (contiguous): q, k, decay [B, T, H, K]; v, o [B, T, H, V]; beta [B, T, H]; S [B, H, K, V].
   lengths: NULL (every sequence T tokens) or B counts; a sequence's tokens from its length on are not read and
   their o rows are not written. */
#include <immintrin.h>
#include <stdint.h>

#define MAX_V 512

/* Columns [c, c + 8 B) of `pass`: B blocks of 8 at once, so that B chains of fused multiply-adds into u and w are
   in flight (one block alone waits on the latency of its chain, row after row). */
#define PASS_BLOCKS(B)                                                                                             \
    static inline void pass_##B(float *S, const float *bk, const float *r, const float *decay, const float *k,    \
                                const float *q, float *u, float *w, int64_t K, int64_t V, int64_t c) {            \
        __m256 rc[B], uc[B], wc[B];                                                                                \
        for (int j = 0; j < B; j++) {                                                                              \
            rc[j] = bk ? _mm256_loadu_ps(r + c + 8 * j) : _mm256_setzero_ps();                                     \
            uc[j] = wc[j] = _mm256_setzero_ps();                                                                   \
        }                                                                                                          \
        for (int64_t i = 0; i < K; i++) {                                                                          \
            float *row = S + i * V + c;                                                                            \
            const __m256 b = bk ? _mm256_broadcast_ss(bk + i) : _mm256_setzero_ps();                               \
            const __m256 d = decay ? _mm256_broadcast_ss(decay + i) : _mm256_setzero_ps();                         \
            const __m256 ki = decay ? _mm256_broadcast_ss(k + i) : _mm256_setzero_ps();                            \
            const __m256 qi = decay ? _mm256_broadcast_ss(q + i) : _mm256_setzero_ps();                            \
            for (int j = 0; j < B; j++) {                                                                          \
                __m256 s = _mm256_loadu_ps(row + 8 * j);                                                           \
                if (bk) s = _mm256_fmadd_ps(b, rc[j], s);                                                          \
                if (decay) {                                                                                       \
                    s = _mm256_mul_ps(s, d);                                                                       \
                    uc[j] = _mm256_fmadd_ps(ki, s, uc[j]);                                                         \
                    wc[j] = _mm256_fmadd_ps(qi, s, wc[j]);                                                         \
                }                                                                                                  \
                _mm256_storeu_ps(row + 8 * j, s);                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        if (decay)                                                                                                 \
            for (int j = 0; j < B; j++) {                                                                          \
                _mm256_storeu_ps(u + c + 8 * j, uc[j]);                                                            \
                _mm256_storeu_ps(w + c + 8 * j, wc[j]);                                                            \
            }                                                                                                      \
    }
PASS_BLOCKS(4)
PASS_BLOCKS(1)

/* S [K, V] += bk r^T (bk NULL: no update), then (decay non-NULL) S = diag(decay) S with u = S^T k and w = S^T q
   formed from the new S. Columns in groups of 32 (then 8), rows inner: a group's u, w and r stay in registers. */
static void pass(float *S, const float *bk, const float *r, const float *decay, const float *k, const float *q,
                 float *u, float *w, int64_t K, int64_t V) {
    int64_t c = 0;
    for (; c + 32 <= V; c += 32) pass_4(S, bk, r, decay, k, q, u, w, K, V, c);
    for (; c < V; c += 8) pass_1(S, bk, r, decay, k, q, u, w, K, V, c);
}

static void head(float *S, const float *q, const float *k, const float *v, const float *decay, const float *beta,
                 float *o, int64_t T, int64_t H, int64_t K, int64_t V) {
    float u[MAX_V], w[MAX_V], r[MAX_V], bk[MAX_V];  /* K <= MAX_V too (checked by the caller) */
    for (int64_t t = 0; t < T; t++) {
        const float *qt = q + t * H * K, *kt = k + t * H * K, *vt = v + t * H * V;
        pass(S, t ? bk : 0, r, decay + t * H * K, kt, qt, u, w, K, V);
        const float b = beta[t * H];
        float kq = 0.0f;
        for (int64_t i = 0; i < K; i++) {
            bk[i] = b * kt[i];
            kq += bk[i] * qt[i];
        }
        float *ot = o + t * H * V;
        for (int64_t c = 0; c < V; c++) {
            r[c] = vt[c] - u[c];
            ot[c] = w[c] + kq * r[c];
        }
    }
    if (T) pass(S, bk, r, 0, 0, 0, 0, 0, K, V);
}

void evo_kda_recurrence(float *S, const float *q, const float *k, const float *v, const float *decay,
                        const float *beta, float *o, const int64_t *lengths, int64_t B, int64_t T, int64_t H,
                        int64_t K, int64_t V) {
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lengths ? lengths[b] : T;
        for (int64_t h = 0; h < H; h++) {
            const int64_t x = (b * T * H + h) * K, y = (b * T * H + h) * V;
            head(S + (b * H + h) * K * V, q + x, k + x, v + y, decay + x, beta + b * T * H + h, o + y, n, H, K, V);
        }
    }
}
