/* One decode step of a Kimi Linear hybrid decoder for n rows, whole, on one CPU thread (AVX2, FMA), float32: no
   Python and no dispatch between its ~250 ops a step (what `llama_decode_step.c` does for a Llama decoder).

   Row r feeds one token (its embedding x[r]) at position pos[r] of pool row r and gets its logits. Per layer,
   h = RMSNorm(x), then its token mixer:
   - KDA: the q|k|v projections through the row's convolution window (shifted: the taps-1 inputs before, oldest
     first; this input joins and the oldest leaves), SiLU; q and k l2-normalised, q times K^-1/2; the forget gate
     g = a_h softplus(f_b f_a h + dt_bias) (a_h = -exp(A_log)), beta = sigmoid(b h); the delta rule on the row's
     state [H, K, V] (`kda_recurrence.c`, one token); each head's output RMSNorm'd times sigmoid(g_b g_a h); o_proj.
   - MLA (no rotary embedding), compressed cache: q = h Wq^T (or RMSNorm(h Wqa^T) Wqb^T) [H, nope + rope]; the
     latent | rope key h Wkva^T, the latent RMSNorm'd, both written at the row's position; each head's nope query times its W_UK [nope, R] (absorbed)
     beside its rope query, attending over the row's own positions [0, pos[r]] (keys: latent | rope key, values: the
     latent); the heads' latent outputs times W_UV W_O (absorbed) [D, H R].
   x += mixer; h = RMSNorm(x); then its feed-forward: dense SwiGLU, or the MoE: sigmoid router scores (+ the score
   correction bias to choose; groups scored by their top two, the best topk_groups kept), the top_k experts' SwiGLUs
   weighted by their scores (renormalised, times the routed scaling) plus the shared SwiGLU; x += it. Then
   logits = RMSNorm(x) Whead^T. Every product streams its weight once for all its rows (`product`: a weight of 16 or
   more outputs packed by the wrapper in panels of 16 outputs, `linear_panels`; fewer kept as rows, `linear`); each
   routed expert runs on the rows that chose it, gathered.

   dims (int64): the KDIM_ names, then per layer its mixer (0 KDA, 1 MLA) and feed-forward (0 dense, 1 MoE).
   ptrs: per layer the KP_ names (a mixer's and a feed-forward's pointers share slots by kind; the state, window and
   cache are written), then the final norm and the head. eps: rms, latent norm, l2 norm, routed scaling, MLA scale.
   `evo_kimi_forward` runs it over tokens in segments (a pool row's tokens from a position, packed in order; a
   segment from position 0 starts from a zeroed state and window): a decode step is n one-token segments, a prefill
   its prompts, or chunks of them. Logits of each segment's last token. Returns 0, or -1 when scratch cannot be
   allocated.

   `evo_kda_prefill`: a KDA layer's prompts between its products (torch's, which are faster than `linear` at prefill
   sizes), by the same per-token code as the step's KDA layers (`kda_tokens`). */
#include "llama_decode_step.c"
#include "kda_recurrence.c"

enum { KDIM_LAYERS, KDIM_D, KDIM_VOCAB, KDIM_KH, KDIM_KD, KDIM_TAPS, KDIM_MH, KDIM_NOPE, KDIM_ROPE, KDIM_R, KDIM_E,
       KDIM_TOPK, KDIM_GROUPS, KDIM_TOPK_GROUPS, KDIM_RENORM, KDIM_MOE_I, KDIM_SHARED_I, KDIM_DENSE_I, KDIM_STATE_ROW,
       KDIM_WINDOW_ROW, KDIM_CACHE_ROW, KDIM_CACHE_POS, KDIM_Q_LORA, KDIM_COUNT };
enum { KP_IN_NORM, KP_POST_NORM,
       /* KDA */ KP_Q, KP_K, KP_V, KP_FA, KP_FB, KP_GA, KP_GB, KP_B, KP_DT_BIAS, KP_A, KP_CONV, KP_O_NORM, KP_O, KP_STATE,
       KP_WINDOW,
       /* feed-forward, dense: gate, up, down; MoE: router, bias, experts' gate|up and down, shared gate, up, down */
       KP_FF0, KP_FF1, KP_FF2, KP_FF3, KP_FF4, KP_FF5, KP_FF6, KP_PER_LAYER };
/* MLA in the mixer's slots */
enum { KP_MQ = KP_Q, KP_MKVA = KP_K, KP_MKV_NORM = KP_V, KP_MWUK = KP_FA, KP_MO = KP_FB, KP_MCACHE = KP_GA,
       KP_MQ_NORM = KP_GB, KP_MQB = KP_B };  /* with q_lora_rank: KP_MQ is q_a, then its norm and q_b */
enum { E_RMS, E_LATENT, E_L2, E_ROUTED_SCALING, E_MLA_SCALE };
#define MAX_EXPERTS 512

/* out [R rows, 16 P outputs] = x w^T over K, w as P panels of [K][16] (`panel` floats apart): R x 2P sums in
   registers, a panel's 16 values loaded once a step for the R rows, each x value broadcast once for the P panels.
   valid: outputs of the last panel to store (16, or fewer at the weight's end). ahead: the P panels the caller
   reads next, prefetched a line a step (the same line of each), so they come from memory while these compute. */
static inline __attribute__((always_inline)) void panel_block(const int R, const int P, const float *x, int64_t K,
                                                              const float *w, int64_t panel, float *out, int64_t O,
                                                              int valid, const float *ahead) {
    __m256 acc[6][8];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * P; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 wv[8];
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            wv[2 * p] = _mm256_loadu_ps(w + p * panel + k * 16);
            wv[2 * p + 1] = _mm256_loadu_ps(w + p * panel + k * 16 + 8);
            if (ahead) _mm_prefetch((const char *)(ahead + p * panel + k * 16), _MM_HINT_T0);
        }
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * K + k);
#pragma GCC unroll 8
            for (int j = 0; j < 2 * P; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xb, acc[i][j]);
        }
    }
    if (valid == 16) {
#pragma GCC unroll 6
        for (int i = 0; i < R; i++)
#pragma GCC unroll 8
            for (int j = 0; j < 2 * P; j++) _mm256_storeu_ps(out + i * O + 8 * j, acc[i][j]);
    } else {
        float t[6][16];
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            _mm256_storeu_ps(t[i], acc[i][0]);
            _mm256_storeu_ps(t[i] + 8, acc[i][1]);
        }
        for (int i = 0; i < R; i++) memcpy(out + i * O, t[i], valid * sizeof(float));
    }
}

/* out [n, O] = x [n, K] . w^T with w packed as panels of 16 outputs ([ceil(O / 16)][K][16], zeros past O): per
   panel (or 4, or 2 at once when rows are few), the rows in blocks of up to 6 split evenly. Against `linear` over
   the same float32 weights as rows, one thread of an AMD EPYC (AVX2), weights in cache: 1.1-1.5x at 1-3 rows,
   1.2-1.6x at 4-32 (81-91 GFLOP/s against 54-62 at 16 rows; 256 -> 768, 256 -> 4096, 688 -> 256, 128 -> 256); at
   8 outputs 0.3-0.7x, hence rows there. From 3 rows to PREFETCH_ROWS, each panel's blocks prefetch the next panel
   (a step's weights come from memory: ~22 MB at 16 rows, every expert chosen): the `cpu` preset's decode step,
   paired in one process against the same step without it, 0.92x [0.91, 0.93] its time at 16 rows, 0.93x [0.91,
   0.95] at 4; level at one row, where four panels stream at once and prefetching them cost 1.14x, and in prefill. */
#define PREFETCH_ROWS 32  /* more rows reuse each panel enough to hide its fetch (a prefill's products) */
static void linear_panels(const float *x, int n, int64_t K, const float *w, int64_t O, float *out) {
    const int64_t panel = 16 * K;
    int64_t o = 0;
    if (n <= 2) {
        const int P = n == 1 ? 4 : 2;
        for (; o + 16 * P <= O; o += 16 * P) {
            if (n == 1) panel_block(1, 4, x, K, w + o * K, panel, out + o, O, 16, NULL);
            else panel_block(2, 2, x, K, w + o * K, panel, out + o, O, 16, NULL);
        }
    }
    const int blocks = (n + 5) / 6, prefetch = n <= PREFETCH_ROWS;
    for (; o < O; o += 16) {
        const float *p = w + o * K, *ahead = !prefetch ? NULL : o + 16 < O ? p + panel : p;  /* the last: itself */
        const int valid = O - o >= 16 ? 16 : (int)(O - o);
        for (int b = 0, r = 0; b < blocks; b++) {
            const int R = (n - r) / (blocks - b) + ((n - r) % (blocks - b) != 0);
            float *y = out + r * O + o;
            const float *xr = x + r * K;
            switch (R) {
                case 6: panel_block(6, 1, xr, K, p, panel, y, O, valid, ahead); break;
                case 5: panel_block(5, 1, xr, K, p, panel, y, O, valid, ahead); break;
                case 4: panel_block(4, 1, xr, K, p, panel, y, O, valid, ahead); break;
                case 3: panel_block(3, 1, xr, K, p, panel, y, O, valid, ahead); break;
                case 2: panel_block(2, 1, xr, K, p, panel, y, O, valid, ahead); break;
                default: panel_block(1, 1, xr, K, p, panel, y, O, valid, ahead); break;
            }
            r += R;
        }
    }
}

#define PANEL 16

/* A weight of O outputs over K inputs as the wrapper stores it: panels from 16 outputs up, rows below. */
static inline int64_t packed_floats(int64_t O, int64_t K) {
    return (O >= PANEL ? (O + PANEL - 1) / PANEL * PANEL : O) * K;
}

static void product(const float *x, int n, int64_t K, const void *w, int64_t O, float *out, float *xs) {
    if (O >= PANEL) linear_panels(x, n, K, (const float *)w, O, out);
    else linear(x, n, K, w, W_F32, O, out, xs);
}

int evo_kimi_step_dims(void) { return KDIM_COUNT; }
int evo_kimi_step_pointers_per_layer(void) { return KP_PER_LAYER; }

/* log(x) for positive float32 lanes (Cephes' logf as vectorised in avx_mathfun: x = m 2^e with m in [sqrt(1/2),
   sqrt(2)), a degree-8 polynomial in m - 1; about 1 ulp). */
static inline __m256 log256(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    x = _mm256_max_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x00800000)));  /* the smallest normal */
    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(x), 23);
    x = _mm256_or_ps(_mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(~0x7f800000))), _mm256_set1_ps(0.5f));
    __m256 e = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(bits, _mm256_set1_epi32(0x7f))), one);
    const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OS);
    const __m256 tmp = _mm256_and_ps(x, small);
    x = _mm256_add_ps(_mm256_sub_ps(x, one), tmp);
    e = _mm256_sub_ps(e, _mm256_and_ps(one, small));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(7.0376836292E-2f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.1514610310E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.1676998740E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.2420140846E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.4249322787E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.6668057665E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(2.0000714765E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-2.4999993993E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(3.3333331174E-1f));
    y = _mm256_mul_ps(_mm256_mul_ps(y, x), z);
    y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
    return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(x, y));
}

static inline __m256 sigmoid256(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* softplus(x) = max(x, 0) + log1p(exp(-|x|)), log1p(u) as log(1 + u) u / ((1 + u) - 1) (exact where 1 + u rounds to
   1: u); torch's softplus returns x itself above 20, where the two differ by less than exp(-20). */
static inline __m256 softplus256(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 u = exp256(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)));
    const __m256 w = _mm256_add_ps(one, u), grown = _mm256_sub_ps(w, one);
    const __m256 lp = _mm256_blendv_ps(_mm256_div_ps(_mm256_mul_ps(log256(w), u), grown), u,
                                       _mm256_cmp_ps(grown, zero, _CMP_EQ_OQ));
    return _mm256_add_ps(_mm256_max_ps(x, zero), lp);
}

static inline float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

/* out = x / sqrt(mean(x^2) + eps) * w over D values (any D: the MLA latents' norms). */
static void rms_norm_row(const float *x, const float *w, float *out, int64_t D, float eps) {
    float s = 0.0f;
    for (int64_t i = 0; i < D; i++) s += x[i] * x[i];
    const float inv = 1.0f / sqrtf(s / (float)D + eps);
    for (int64_t i = 0; i < D; i++) out[i] = x[i] * inv * w[i];
}

/* x [n, K] rows scaled in place to unit length: x / sqrt(sum x^2 + eps), each of `heads` groups of K. */
static void l2norm_heads(float *x, int64_t groups, int64_t K, float eps) {
    for (int64_t g = 0; g < groups; g++) {
        float *v = x + g * K, s = 0.0f;
        for (int64_t i = 0; i < K; i++) s += v[i] * v[i];
        const float inv = 1.0f / sqrtf(s + eps);
        for (int64_t i = 0; i < K; i++) v[i] *= inv;
    }
}

/* A KDA layer's weights and shape as its token work reads them (`kda_tokens`). */
typedef struct {
    int64_t H, K, taps;
    float rms_eps, l2_eps;
    const float *conv, *dt_bias, *a, *o_norm;  /* [taps, 3HK], [HK], [H] (-exp(A_log)), [K] */
} kda_layer;

/* One row's T tokens through a KDA layer after its products: q, k, v [T, HK] (the q, k, v products in; convolved over
   the row's window (the taps-1 inputs before, oldest first; float32 sums; the window moves on by T), SiLU'd, q and k
   l2-normalised per head, q times K^-1/2), decay [T, HK] (f f_b^T in, exp(a_h softplus(. + dt_bias)) out), gate
   [T, HK] (g_a g_b^T in, sigmoid out), beta [T, H] (b in, sigmoid out); the delta rule from the row's state
   S [H, K, K] (advanced); o [T, HK] out: each head's output RMSNorm'd times its gate. */
static void kda_tokens(const kda_layer *L, int64_t T, float *q, float *k, float *v, float *decay, float *gate,
                       float *beta, float *window, float *S, float *o) {
    const int64_t H = L->H, K = L->K, HK = H * K, C = 3 * HK, taps = L->taps;
    const float q_scale = 1.0f / sqrtf((float)K);
    float *xs[3] = {q, k, v};
    for (int64_t t = 0; t < T; t++) {
        for (int j = 0; j < 3; j++) {
            float *x = xs[j] + t * HK;
            const float *w = L->conv + j * HK;
            float *win = window + j * HK;
            for (int64_t c = 0; c < HK; c += 8) {  /* HK a multiple of 8 */
                const __m256 in = _mm256_loadu_ps(x + c);
                __m256 s = _mm256_mul_ps(in, _mm256_loadu_ps(w + (taps - 1) * C + c));
                for (int64_t i = 0; i < taps - 1; i++) {
                    s = _mm256_fmadd_ps(_mm256_loadu_ps(win + i * C + c), _mm256_loadu_ps(w + i * C + c), s);
                    if (i + 1 < taps - 1) _mm256_storeu_ps(win + i * C + c, _mm256_loadu_ps(win + (i + 1) * C + c));
                }
                if (taps > 1) _mm256_storeu_ps(win + (taps - 2) * C + c, in);
                _mm256_storeu_ps(x + c, _mm256_mul_ps(s, sigmoid256(s)));
            }
        }
        l2norm_heads(q + t * HK, H, K, L->l2_eps);
        l2norm_heads(k + t * HK, H, K, L->l2_eps);
        for (int64_t i = 0; i < HK; i++) q[t * HK + i] *= q_scale;
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < HK; i += 8) {  /* a head's K channels (a multiple of 8) share a_h */
            float *dr = decay + t * HK + i, *gr = gate + t * HK + i;
            const __m256 f8 = softplus256(_mm256_add_ps(_mm256_loadu_ps(dr), _mm256_loadu_ps(L->dt_bias + i)));
            _mm256_storeu_ps(dr, exp256(_mm256_mul_ps(_mm256_set1_ps(L->a[i / K]), f8)));
            _mm256_storeu_ps(gr, sigmoid256(_mm256_loadu_ps(gr)));
        }
    for (int64_t i = 0; i < T * H; i++) beta[i] = sigmoidf_(beta[i]);
    for (int64_t hd = 0; hd < H; hd++)
        head(S + hd * K * K, q + hd * K, k + hd * K, v + hd * K, decay + hd * K, beta + hd, o + hd * K, T, H, K, K);
    evo_add_rms_norm(o, NULL, o, L->o_norm, o, T * H, K, L->rms_eps);
    for (int64_t i = 0; i < T * HK; i++) o[i] *= gate[i];
}

static kda_layer kda_of(const int64_t *dims, const void *const *p, const float *eps) {
    kda_layer L = {dims[KDIM_KH], dims[KDIM_KD], dims[KDIM_TAPS], eps[E_RMS], eps[E_L2], (const float *)p[KP_CONV],
                   (const float *)p[KP_DT_BIAS], (const float *)p[KP_A], (const float *)p[KP_O_NORM]};
    return L;
}

/* The tokens in segments: segment i is seg_len[i] tokens of pool row seg_row[i] from position seg_start[i] (a
   decode step: n segments of one token; a prefill: a prompt's tokens, or a chunk of them), packed in order. */
typedef struct {
    int64_t count;
    const int64_t *row, *start, *len;  /* start NULL: every segment from position 0 */
} segments;

/* Each segment's tokens in order through `kda_tokens` on its row's window and state (rows window_row and state_row
   floats apart), from a zeroed window and state where it starts at position 0; q .. beta packed as the segments
   are (`kda_tokens`' inputs, overwritten), o [n, HK] out. */
static void kda_segments(const kda_layer *L, const segments *seg, float *windows, int64_t window_row, float *states,
                         int64_t state_row, float *q, float *k, float *v, float *decay, float *gate, float *beta,
                         float *o) {
    const int64_t H = L->H, K = L->K, HK = H * K;
    for (int64_t i = 0, t = 0; i < seg->count; t += seg->len[i], i++) {
        float *window = windows + seg->row[i] * window_row, *S = states + seg->row[i] * state_row;
        if (seg->start == NULL || seg->start[i] == 0) {
            memset(window, 0, sizeof(float) * (size_t)((L->taps - 1) * 3 * HK));
            memset(S, 0, sizeof(float) * (size_t)(H * K * K));
        }
        kda_tokens(L, seg->len[i], q + t * HK, k + t * HK, v + t * HK, decay + t * HK, gate + t * HK, beta + t * H,
                   window, S, o + t * HK);
    }
}

/* scratch (each n rows of the step's width): qkv (the q, k and v products, [n, HK] each), gates (decay, then the
   output gate), low (f | g_a | b), o (the recurrence's outputs, normed and gated). A segment from position 0 starts
   from a zeroed window and state. */
static void kda_mixer(const int64_t *dims, const void *const *p, const float *eps, const float *h, int n,
                      const segments *seg, float *out, float *qkv, float *gates, float *low, float *o, float *xs) {
    const int64_t D = dims[KDIM_D], H = dims[KDIM_KH], K = dims[KDIM_KD], HK = H * K;
    const kda_layer L = kda_of(dims, p, eps);
    float *q = qkv, *k = qkv + n * HK, *v = qkv + 2 * n * HK;
    float *f = low, *ga = low + n * K, *b = low + 2 * n * K, *decay = gates, *gate = gates + n * HK;
    product(h, n, D, p[KP_Q], HK, q, xs);
    product(h, n, D, p[KP_K], HK, k, xs);
    product(h, n, D, p[KP_V], HK, v, xs);
    product(h, n, D, p[KP_FA], K, f, xs);
    product(h, n, D, p[KP_GA], K, ga, xs);
    product(h, n, D, p[KP_B], H, b, xs);
    product(f, n, K, p[KP_FB], HK, decay, xs);
    product(ga, n, K, p[KP_GB], HK, gate, xs);
    kda_segments(&L, seg, (float *)p[KP_WINDOW], dims[KDIM_WINDOW_ROW], (float *)p[KP_STATE], dims[KDIM_STATE_ROW],
                 q, k, v, decay, gate, b, o);
    product(o, n, HK, p[KP_O], D, out, xs);
}

/* A KDA layer's prefill after its products (torch's), prompts from position 0: prompt i's tokens lie at
   [sum of the lengths before it, + lengths[i]) of q, k, v, decay, gate [N, HK] and beta [N, H] (`kda_tokens`' inputs,
   overwritten), its window and state (pool row rows[i]: windows + rows[i] window_row, states + rows[i] state_row)
   zeroed, then advanced over them; o [N, HK] out (normed and gated: o_proj's input). */
void evo_kda_prefill(int64_t H, int64_t K, int64_t taps, float rms_eps, float l2_eps, const float *conv,
                     const float *dt_bias, const float *a, const float *o_norm, float *windows, int64_t window_row,
                     float *states, int64_t state_row, const int64_t *rows, const int64_t *lengths, int64_t n,
                     float *q, float *k, float *v, float *decay, float *gate, float *beta, float *o) {
    const kda_layer L = {H, K, taps, rms_eps, l2_eps, conv, dt_bias, a, o_norm};
    const segments prompts = {n, rows, NULL, lengths};
    kda_segments(&L, &prompts, windows, window_row, states, state_row, q, k, v, decay, gate, beta, o);
}

/* out [R] = sum over s < S of p[s] v_s, v_s the first R values of cache + s stride: 32 sums at a time in registers
   over every position (summed in order, as one at a time through memory: its stores chained each position's adds). */
static void attend_values(const float *p, int64_t S, const float *cache, int64_t stride, int64_t R, float *out) {
    int64_t c = 0;
    for (; c + 32 <= R; c += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t s = 0; s < S; s++) {
            const float *v = cache + s * stride + c;
            const __m256 pr = _mm256_set1_ps(p[s]);
            a0 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pr, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(out + c, a0);
        _mm256_storeu_ps(out + c + 8, a1);
        _mm256_storeu_ps(out + c + 16, a2);
        _mm256_storeu_ps(out + c + 24, a3);
    }
    for (; c + 8 <= R; c += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t s = 0; s < S; s++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[s]), _mm256_loadu_ps(cache + s * stride + c), a);
        _mm256_storeu_ps(out + c, a);
    }
    for (; c < R; c++) {
        float a = 0.0f;
        for (int64_t s = 0; s < S; s++) a += p[s] * cache[s * stride + c];
        out[c] = a;
    }
}

/* Token r at position pos[r] of pool row row[r]: its latent and rope key written there, then it attends over that
   row's positions [0, pos[r]] (a segment's earlier tokens come first, so their keys are there). */
static void mla_mixer(const int64_t *dims, const void *const *p, const float *eps, const float *h, const int64_t *row,
                      const int64_t *pos, int n, float *out, float *q, float *kv, float *lat, float *scores, float *xs) {
    const int64_t D = dims[KDIM_D], H = dims[KDIM_MH], nope = dims[KDIM_NOPE], rope = dims[KDIM_ROPE], R = dims[KDIM_R];
    const int64_t QD = nope + rope, KD = R + rope, QL = dims[KDIM_Q_LORA];
    if (QL) {  /* q = RMSNorm(h q_a^T) q_b^T, the low-rank rows first in kv's room */
        product(h, n, D, p[KP_MQ], QL, kv, xs);
        for (int r = 0; r < n; r++)
            rms_norm_row(kv + r * QL, (const float *)p[KP_MQ_NORM], kv + r * QL, QL, eps[E_LATENT]);
        product(kv, n, QL, p[KP_MQB], H * QD, q, xs);
    } else {
        product(h, n, D, p[KP_MQ], H * QD, q, xs);
    }
    product(h, n, D, p[KP_MKVA], KD, kv, xs);
    const float *wuk = (const float *)p[KP_MWUK];  /* [H, nope, R] */
    for (int r = 0; r < n; r++) {
        float *key = (float *)p[KP_MCACHE] + row[r] * dims[KDIM_CACHE_ROW] + pos[r] * dims[KDIM_CACHE_POS];
        rms_norm_row(kv + r * KD, (const float *)p[KP_MKV_NORM], key, R, eps[E_LATENT]);
        memcpy(key + R, kv + r * KD + R, sizeof(float) * (size_t)rope);
        /* each head's query in the latent: [q_nope W_UK | q_rope] [KD] */
        float *ql = lat;  /* [H, KD] */
        for (int64_t hd = 0; hd < H; hd++) {
            const float *qn = q + r * H * QD + hd * QD;
            float *t = ql + hd * KD;
            for (int64_t c = 0; c < R; c++) t[c] = 0.0f;
            for (int64_t d = 0; d < nope; d++) {
                const float s = qn[d];
                const float *row = wuk + (hd * nope + d) * R;
                for (int64_t c = 0; c < R; c++) t[c] += s * row[c];
            }
            memcpy(t + R, qn + nope, sizeof(float) * (size_t)rope);
        }
        /* attention over positions [0, pos[r]]: every head reads each key once */
        const int64_t S = pos[r] + 1;
        const float *cache = (const float *)p[KP_MCACHE] + row[r] * dims[KDIM_CACHE_ROW];
        for (int64_t s = 0; s < S; s++) {
            const float *kk = cache + s * dims[KDIM_CACHE_POS];
            for (int64_t hd = 0; hd < H; hd++) {
                const float *t = ql + hd * KD;
                __m256 acc = _mm256_setzero_ps();
                int64_t c = 0;
                for (; c + 8 <= KD; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(t + c), _mm256_loadu_ps(kk + c), acc);
                float dot = hsum256(acc);
                for (; c < KD; c++) dot += t[c] * kk[c];
                scores[hd * S + s] = dot * eps[E_MLA_SCALE];
            }
        }
        float *o = lat + H * KD + r * H * R;  /* this row's [H, R] outputs, after the latent queries */
        for (int64_t hd = 0; hd < H; hd++) {
            float *sc = scores + hd * S, top = sc[0], total = 0.0f;
            for (int64_t s = 1; s < S; s++) top = sc[s] > top ? sc[s] : top;
            for (int64_t s = 0; s < S; s++) total += (sc[s] = expf(sc[s] - top));
            for (int64_t s = 0; s < S; s++) sc[s] /= total;
            attend_values(sc, S, cache, dims[KDIM_CACHE_POS], R, o + hd * R);
        }
    }
    product(lat + H * KD, n, H * R, p[KP_MO], D, out, xs);
}

/* SwiGLU of n rows: (silu(h Wg^T) * h Wu^T) Wd^T into out [n, D]; gate and up: scratch [n, I]. */
static void swiglu(const float *h, int n, int64_t D, int64_t I, const void *wg, const void *wu, const void *wd,
                   float *out, float *gate, float *up, float *xs) {
    product(h, n, D, wg, I, gate, xs);
    product(h, n, D, wu, I, up, xs);
    silu_mul(gate, up, n * I);
    product(gate, n, I, wd, D, out, xs);
}

static void moe(const int64_t *dims, const void *const *p, const float *eps, const float *h, int n, float *out,
                float *gathered, float *gu, float *act, float *y, float *xs, int *chosen, float *weight, int *members) {
    const int64_t D = dims[KDIM_D], E = dims[KDIM_E], top_k = dims[KDIM_TOPK], G = dims[KDIM_GROUPS];
    const int64_t I = dims[KDIM_MOE_I], S = dims[KDIM_SHARED_I], per = E / G;
    /* the shared experts on every row */
    swiglu(h, n, D, S, p[KP_FF4], p[KP_FF5], p[KP_FF6], out, gu, act, xs);
    /* routing: scores = sigmoid(h router^T) (float32), chosen by score + bias within the best groups */
    float *scores = y;  /* [n, E] before y is needed */
    product(h, n, D, p[KP_FF0], E, scores, xs);
    const float *bias = (const float *)p[KP_FF1];
    for (int r = 0; r < n; r++) {
        float choice[MAX_EXPERTS];
        float *sr = scores + r * E;
        for (int64_t e = 0; e < E; e++) {
            sr[e] = sigmoidf_(sr[e]);
            choice[e] = sr[e] + bias[e];
        }
        if (G > 1) {
            float group_score[MAX_EXPERTS];
            for (int64_t grp = 0; grp < G; grp++) {
                float a = -INFINITY, b2 = -INFINITY;
                for (int64_t e = grp * per; e < (grp + 1) * per; e++) {
                    if (choice[e] > a) { b2 = a; a = choice[e]; }
                    else if (choice[e] > b2) b2 = choice[e];
                }
                group_score[grp] = a + b2;
            }
            int kept[MAX_EXPERTS] = {0};
            for (int64_t t = 0; t < dims[KDIM_TOPK_GROUPS]; t++) {
                int64_t best = -1;
                for (int64_t grp = 0; grp < G; grp++)
                    if (!kept[grp] && (best < 0 || group_score[grp] > group_score[best])) best = grp;
                kept[best] = 1;
            }
            for (int64_t e = 0; e < E; e++)
                if (!kept[e / per]) choice[e] = -INFINITY;
        }
        float total = 0.0f;
        for (int64_t t = 0; t < top_k; t++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t u = 0; u < t; u++) taken |= chosen[r * top_k + u] == e;
                if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
            }
            chosen[r * top_k + t] = (int)best;
            weight[r * top_k + t] = sr[best];
            total += sr[best];
        }
        for (int64_t t = 0; t < top_k; t++) {
            if (dims[KDIM_RENORM]) weight[r * top_k + t] /= total + 1e-20f;
            weight[r * top_k + t] *= eps[E_ROUTED_SCALING];
        }
    }
    /* each expert on the rows that chose it, gathered; its output added times the row's weight */
    for (int64_t e = 0; e < E; e++) {
        int m = 0;
        for (int r = 0; r < n; r++)
            for (int64_t t = 0; t < top_k; t++)
                if (chosen[r * top_k + t] == e) {
                    members[m] = r * (int)top_k + (int)t;
                    memcpy(gathered + m * D, h + r * D, sizeof(float) * (size_t)D);
                    m++;
                }
        if (!m) continue;
        product(gathered, m, D, (const float *)p[KP_FF2] + e * packed_floats(2 * I, D), 2 * I, gu, xs);
        for (int i = 0; i < m; i++) {  /* silu(gate) * up, each row's gate | up halves */
            silu_mul(gu + i * 2 * I, gu + i * 2 * I + I, I);
            memcpy(act + i * I, gu + i * 2 * I, sizeof(float) * (size_t)I);
        }
        product(act, m, I, (const float *)p[KP_FF3] + e * packed_floats(D, I), D, y, xs);
        for (int i = 0; i < m; i++) {
            const int r = members[i] / (int)top_k;
            const float wgt = weight[members[i]];
            for (int64_t c = 0; c < D; c++) out[r * D + c] += wgt * y[i * D + c];
        }
    }
}

/* The forward of the tokens of `count` segments (`segments`; a pool row in one segment at most), embedded [n, D]
   packed in order: each layer advances each segment's row over its tokens; logits [count, V] of each segment's last
   token. Returns 0, or -1 when scratch cannot be allocated. */
int evo_kimi_forward(const int64_t *dims, const void *const *ptrs, const float *eps, const float *embedded,
                     const int64_t *seg_row, const int64_t *seg_start, const int64_t *seg_len, int64_t count,
                     float *logits) {
    const segments seg = {count, seg_row, seg_start, seg_len};
    const int layers = (int)dims[KDIM_LAYERS];
    const int64_t D = dims[KDIM_D], V = dims[KDIM_VOCAB], HK = dims[KDIM_KH] * dims[KDIM_KD], K = dims[KDIM_KD];
    const int64_t MH = dims[KDIM_MH], QD = dims[KDIM_NOPE] + dims[KDIM_ROPE], KD = dims[KDIM_R] + dims[KDIM_ROPE];
    const int64_t topk = dims[KDIM_TOPK] > 0 ? dims[KDIM_TOPK] : 1;
    int n = 0;
    int64_t longest = 1;
    for (int64_t i = 0; i < count; i++) {
        n += (int)seg_len[i];
        longest = seg_start[i] + seg_len[i] > longest ? seg_start[i] + seg_len[i] : longest;
    }
    /* one width W fits every per-row scratch: 3HK, 2I, the dense and shared widths, the MLA query, latent and
       outputs, the experts' count */
    int64_t W = D;
    const int64_t widths[] = {dims[KDIM_Q_LORA], 3 * HK, 2 * dims[KDIM_MOE_I], dims[KDIM_DENSE_I], dims[KDIM_SHARED_I],
                              MH * QD, KD,
                              MH * dims[KDIM_R], dims[KDIM_E], 2 * K + dims[KDIM_KH]};
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++) W = widths[i] > W ? widths[i] : W;
    const int64_t LAT = MH * KD + (int64_t)n * MH * dims[KDIM_R];  /* MLA: latent queries then every row's outputs */
    /* x, h, o [n, D]; four scratch blocks s0..s3 [n, W]; a linear's xs [n, W + 16]; MLA's latents and scores */
    const size_t floats = (size_t)n * (size_t)(3 * D + 4 * W + W + 16) + (size_t)(LAT + MH * longest);
    /* the scratch is kept between calls (per thread): a fresh one a step cost its pages' first-touch faults */
    static __thread float *kept = NULL;
    static __thread size_t kept_bytes = 0;
    const size_t bytes = sizeof(float) * (floats + (size_t)(n * topk)) + sizeof(int) * (size_t)(n * topk * 2) +
                         sizeof(int64_t) * (size_t)(2 * n);
    if (bytes > kept_bytes) {
        free(kept);
        kept = malloc(bytes);
        kept_bytes = kept ? bytes : 0;
    }
    float *x = kept;
    if (x == NULL) return -1;
    float *h = x + n * D, *o = h + n * D;
    float *s0 = o + n * D, *s1 = s0 + n * W, *s2 = s1 + n * W, *s3 = s2 + n * W;
    float *xs = s3 + n * W, *lat = xs + n * (W + 16), *scores = lat + LAT;
    float *weight = scores + MH * longest;
    int *chosen = (int *)(weight + n * topk), *members = chosen + n * topk;
    int64_t *row = (int64_t *)(members + n * topk), *pos = row + n;  /* each token's pool row and position */
    for (int64_t i = 0, t = 0; i < count; i++)
        for (int64_t j = 0; j < seg_len[i]; j++, t++) {
            row[t] = seg_row[i];
            pos[t] = seg_start[i] + j;
        }
    memcpy(x, embedded, sizeof(float) * (size_t)(n * D));
    for (int l = 0; l < layers; l++) {
        const void *const *p = ptrs + l * KP_PER_LAYER;
        const int64_t mixer = dims[KDIM_COUNT + 2 * l], ff = dims[KDIM_COUNT + 2 * l + 1];
        /* o: the last feed-forward's output */
        evo_add_rms_norm(x, l ? o : NULL, x, (const float *)p[KP_IN_NORM], h, n, D, eps[E_RMS]);
        if (mixer == 0) kda_mixer(dims, p, eps, h, n, &seg, o, s0, s1, s2, s3, xs);  /* s0: 3 n HK, s1: 2 n HK */
        else mla_mixer(dims, p, eps, h, row, pos, n, o, s0, s1, lat, scores, xs);
        evo_add_rms_norm(x, o, x, (const float *)p[KP_POST_NORM], h, n, D, eps[E_RMS]);
        if (ff == 0) swiglu(h, n, D, dims[KDIM_DENSE_I], p[KP_FF0], p[KP_FF1], p[KP_FF2], o, s0, s1, xs);
        else moe(dims, p, eps, h, n, o, s0, s1, s2, s3, xs, chosen, weight, members);
    }
    /* each segment's last token: x + o, normed, through the head */
    for (int64_t i = 0, t = 0; i < count; i++) {
        t += seg_len[i];
        for (int64_t c = 0; c < D; c++) s0[i * D + c] = x[(t - 1) * D + c] + o[(t - 1) * D + c];
    }
    evo_add_rms_norm(s0, NULL, s0, (const float *)ptrs[layers * KP_PER_LAYER], h, (int)count, D, eps[E_RMS]);
    product(h, (int)count, D, ptrs[layers * KP_PER_LAYER + 1], V, logits, xs);
    return 0;
}
