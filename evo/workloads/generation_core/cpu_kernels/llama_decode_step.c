/* One decode step of a Llama-family decoder for n rows, whole, on one CPU thread (AVX2, FMA): no Python and no
   dispatch between its ops (what llama.cpp's CPU backend does per token; vLLM and SGLang capture or compile the step).

   Row r feeds one token (its embedding x[r], float32) at position pos[r] of pool row r, attends to its keys
   [0, pos[r]] and gets its logits. Per layer: h = RMSNorm(x); q, k, v = h W^T; q and k rotated at the row's
   position (pairs (i, i + d/2), or side by side with `interleaved`); k and v written into the row's cache at its
   position; grouped-query attention over the row's own keys (`decode_attention.c`); x += attn Wo^T;
   h = RMSNorm(x); x += (silu(h Wgate^T) * h Wup^T) Wdown^T. Then logits = RMSNorm(x) Whead^T.

   Weights are [out, in] rows, float32 or bfloat16 (widened as read), or int8 in groups of 32 inputs with a float32
   scale each (llama.cpp's Q8_0 block, the last group shorter where `in` is not a multiple of 32: a row is its `in`
   int8 weights, zeros up to a multiple of 16, then its groups' scales; each group's sum of weight x activation,
   against activations read as int16, scaled once); activations and sums are float32. The
   cache is float32 or bfloat16 (rounded to nearest even as written), laid out by strides. Every linear streams
   its weight from memory once for all n rows (`linear`: blocks of 8 weight rows, further row passes from cache).

   With AMX (W_AMX, where the CPU has AMX-BF16): bfloat16 weights stored as AMX tiles (`amx_tiles`), each linear's
   rows rounded to bfloat16 (nearest even) and multiplied 16 rows at a time on the tile unit (float32 sums).

   dims (int64): see the DIM_ names; ptrs: per layer the P_ names (the caches are written: one position a row), then
   final norm, head, inverse frequencies (float64 [d/2]). Returns 0, -1 when scratch cannot be allocated, -2 for a
   group size the attention cannot take, -3 for AMX tiles where this compiler cannot build them. */
#define _GNU_SOURCE /* syscall() */
#include "decode_attention.c"
#include "rms_norm.c"

#include <math.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { DIM_LAYERS, DIM_D, DIM_H, DIM_KVH, DIM_HEAD, DIM_I, DIM_V, DIM_INTERLEAVED, DIM_W_FORMAT, DIM_KV_BF16,
       DIM_K_ROW, DIM_K_HEAD, DIM_K_POS, DIM_V_ROW, DIM_V_HEAD, DIM_V_POS, DIM_COUNT };
enum { P_IN_NORM, P_POST_NORM, P_Q, P_K, P_V, P_O, P_GATE, P_UP, P_DOWN, P_K_CACHE, P_V_CACHE, P_PER_LAYER };

enum { W_F32, W_BF16, W_Q8, W_AMX };  /* DIM_W_FORMAT */
#define Q8_GROUP 32

int evo_llama_step_dims(void) { return DIM_COUNT; }
int evo_llama_step_pointers_per_layer(void) { return P_PER_LAYER; }

#ifndef PREFETCH_BYTES
/* How far ahead of each weight read to prefetch. A product's weight rows lie one after another, so this reaches into
   the rows of the blocks that come next: on this Xeon (2 cores, one thread; `linear` over SmolLM2-135M's 211
   products, interleaved, best of 10) 8 KB against 512 B took one row over int8 weights from 21-24 to 13-16 ms,
   over bfloat16 from 22-35 to 19-28 ms, two rows over int8 from 23 to 13 ms; 8-16 KB is a plateau. */
#define PREFETCH_BYTES 8192
#endif

/* A block of R rows x OB outputs of out = x w^T over K (a multiple of 8), float32 weights: each weight vector loaded
   once for the R rows, the R x OB sums in registers. */
static inline __attribute__((always_inline)) void block_f32(const int R, const int OB, const float *x, int64_t K,
                                                            const float *w, float *out, int64_t O) {
    __m256 acc[4][8];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < OB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < K; c += 8) {
        __m256 xv[4];
        for (int i = 0; i < R; i++) xv[i] = _mm256_loadu_ps(x + i * K + c);
        for (int j = 0; j < OB; j++) {
            const __m256 wv = _mm256_loadu_ps(w + j * K + c);
            _mm_prefetch((const char *)(w + j * K + c) + PREFETCH_BYTES, _MM_HINT_T0);
            for (int i = 0; i < R; i++) acc[i][j] = _mm256_fmadd_ps(wv, xv[i], acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < OB; j++) out[i * O + j] = hsum256(acc[i][j]);
}

/* The same over bfloat16 weights, 16 a load: a 32-bit lane holds elements 2j (low half) and 2j + 1 (high half), so a
   shift widens the even ones and a mask the odd ones, against x split the same way (`split_even_odd`). */
static inline __attribute__((always_inline)) void block_bf16(const int R, const int OB, const float *xs, int64_t K,
                                                             const uint16_t *w, float *out, int64_t O) {
    __m256 acc[2][8];
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < OB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < K; c += 16) {
        __m256 xe[2], xo[2];
        for (int i = 0; i < R; i++) {
            xe[i] = _mm256_loadu_ps(xs + i * K + c);
            xo[i] = _mm256_loadu_ps(xs + i * K + c + 8);
        }
        for (int j = 0; j < OB; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + j * K + c));
            _mm_prefetch((const char *)(w + j * K + c) + PREFETCH_BYTES, _MM_HINT_T0);
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            for (int i = 0; i < R; i++) acc[i][j] = _mm256_fmadd_ps(wo, xo[i], _mm256_fmadd_ps(we, xe[i], acc[i][j]));
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < OB; j++) out[i * O + j] = hsum256(acc[i][j]);
}

/* The same over int8 weights in groups of Q8_GROUP inputs (the last one shorter where K is not a multiple), a float32
   scale each, against activations held as int16 with a float32 scale per group of theirs (`quantise_int16`): per
   group and pair (row, output), int8 x int16 products summed in int32 (vpmaddwd: 16 a pair of instructions), then
   widened once and added times the two scales. A weight row is K int8, zeros up to Kp (K rounded up to 16), then
   its groups' scales: `stride` bytes. x16 rows: Kp int16 (zeros past K); xsc rows: the groups' scales. */
static inline __attribute__((always_inline)) void block_q8(const int R, const int OB, const int16_t *x16,
                                                           const float *xsc, int64_t K, int64_t Kp, const int8_t *w,
                                                           int64_t stride, float *out, int64_t O) {
    const int64_t G = (K + Q8_GROUP - 1) / Q8_GROUP;
    __m256 acc[4][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < OB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0, group = 0; g < Kp; g += Q8_GROUP, group++) {
        const int two = g + 16 < Kp;  /* a last group of at most 16 (padded) inputs is one load */
        __m256i sums[4][4];
        for (int j = 0; j < OB; j++) {
            const int8_t *wr = w + j * stride + g;
            const __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wr));
            const __m256i wb = two ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + 16))) : wa;
            _mm_prefetch((const char *)wr + PREFETCH_BYTES, _MM_HINT_T0);
            for (int i = 0; i < R; i++) {
                const int16_t *xr = x16 + i * Kp + g;
                sums[i][j] = _mm256_madd_epi16(wa, _mm256_loadu_si256((const __m256i *)xr));
                if (two) {
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xr + 16));
                    sums[i][j] = _mm256_add_epi32(sums[i][j], _mm256_madd_epi16(wb, x1));
                }
            }
        }
        for (int j = 0; j < OB; j++) {
            const __m256 ws = _mm256_broadcast_ss((const float *)(w + j * stride + Kp) + group);
            for (int i = 0; i < R; i++) {
                const __m256 s = _mm256_mul_ps(ws, _mm256_broadcast_ss(xsc + i * G + group));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][j]), s, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < OB; j++) out[i * O + j] = hsum256(acc[i][j]);
}

static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* x [n, K] float32 as int16 rows x16 [n, Kp] (zeros past K) and scales xsc [n, ceil(K / Q8_GROUP)]: per group of
   Q8_GROUP, absmax / 32767, rounded to nearest (a relative error of ~1e-5 of the group's largest, far below the
   weights' int8 rounding). K a multiple of 8. */
static void quantise_int16(const float *x, int n, int64_t K, int64_t Kp, int16_t *x16, float *xsc) {
    const int64_t G = (K + Q8_GROUP - 1) / Q8_GROUP;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int r = 0; r < n; r++) {
        const float *xr = x + r * K;
        int16_t *qr = x16 + r * Kp;
        for (int64_t group = 0; group < G; group++) {
            const int64_t g = group * Q8_GROUP, end = g + Q8_GROUP < K ? g + Q8_GROUP : K;
            __m256 m = _mm256_setzero_ps();
            for (int64_t c = g; c < end; c += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + c)));
            const float largest = hmax256(m);
            xsc[r * G + group] = largest / 32767.0f;
            const __m256 inv = _mm256_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
            for (int64_t c = g; c < end; c += 8) {
                const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + c), inv));
                const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
                _mm_storeu_si128((__m128i *)(qr + c), packed);
            }
        }
        for (int64_t c = K; c < Kp; c++) qr[c] = 0;
    }
}

/* 8 outputs from int8 rows at w (`stride` bytes a row) for rows [r, r + taken): up to 4 rows, at most 8 int32 sums
   and 8 float32 ones in registers (1 row x 4 outputs twice, 2 x 4 twice, 3 or 4 x 2 four times). Returns how many
   rows it took. */
static int rows_q8(const int16_t *x16, const float *xsc, int left, int64_t K, int64_t Kp, const int8_t *w,
                   int64_t stride, float *y, int64_t O) {
    if (left >= 3) {
        for (int j = 0; j < 8; j += 2) {
            if (left >= 4) block_q8(4, 2, x16, xsc, K, Kp, w + j * stride, stride, y + j, O);
            else block_q8(3, 2, x16, xsc, K, Kp, w + j * stride, stride, y + j, O);
        }
        return left >= 4 ? 4 : 3;
    }
    if (left == 2) {
        block_q8(2, 4, x16, xsc, K, Kp, w, stride, y, O);
        block_q8(2, 4, x16, xsc, K, Kp, w + 4 * stride, stride, y + 4, O);
        return 2;
    }
    block_q8(1, 4, x16, xsc, K, Kp, w, stride, y, O);
    block_q8(1, 4, x16, xsc, K, Kp, w + 4 * stride, stride, y + 4, O);
    return 1;
}

/* ---- AMX: bfloat16 tiles (Intel AMX-BF16; built by gcc >= 11 and clang >= 12, the CPU is asked at run time) */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define EVO_AMX 1
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#include <cpuid.h>
#else
#define EVO_AMX 0
#endif
#define AMX_TILE 512      /* bfloat16 values in a weight tile: 16 pairs of inputs x 16 outputs */
#define AMX_PREFETCH 4    /* tile groups ahead (a group: the up to 4 tiles of one 32-input slice) */

/* 1 where this process may run AMX-BF16 tiles: the CPU has them, the OS keeps their state (XCR0 bits 17-18) and
   grants this process their data (Linux's arch_prctl ARCH_REQ_XCOMP_PERM, asked here; once is enough). */
int evo_amx_bf16_ready(void) {
#if EVO_AMX
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid(1, a, b, c, d);
    if (!((c >> 27) & 1)) return 0; /* OSXSAVE */
    __cpuid_count(7, 0, a, b, c, d);
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0; /* AMX-BF16, AMX-TILE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

/* x [n, K] float32 (K a multiple of 8) -> xb [n, Kp] bfloat16 rounded to nearest even (NaN kept), zeros after K. */
static void rows_to_bf16(const float *x, int n, int64_t K, int64_t Kp, uint16_t *xb) {
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x400000);
    for (int r = 0; r < n; r++) {
        const float *src = x + r * K;
        uint16_t *dst = xb + r * Kp;
        for (int64_t c = 0; c < K; c += 8) {
            const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + c));
            const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, bias),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
            const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
            const __m256i v = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, _mm256_or_si256(u, quiet), nan), 16);
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
            _mm_storeu_si128((__m128i *)(dst + c), _mm256_castsi256_si128(packed));
        }
        memset(dst + K, 0, sizeof(uint16_t) * (size_t)(Kp - K));
    }
}

#if EVO_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tiles 0-3: sums [M, 16] float32; 4: rows [M, 32] bfloat16; 5-7: weights, 16 input pairs x 16 outputs */
static AMX_TARGET void amx_configure(int M) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t < 5 ? (uint8_t)M : 16;
    }
    _tile_loadconfig(&cfg);
}

/* out[r, o] = xb[r] . w[o] for rows [0, M) (M <= 16), outputs [o0, o0 + 16 tiles) of one group: w its tiles, per
   32-input slice `tiles` consecutive tiles (the group's outputs in 16s). */
static AMX_TARGET void amx_group(const uint16_t *xb, int64_t Kp, const uint16_t *w, int tiles, float *out, int64_t O) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t slice = (int64_t)tiles * AMX_TILE, lines = (int64_t)tiles * AMX_TILE * 2 / 64;
    for (int64_t kb = 0; kb < Kp / 32; kb++) {
        const uint16_t *t = w + kb * slice;
        const char *ahead = (const char *)(t + AMX_PREFETCH * slice);
        for (int64_t l = 0; l < lines; l++) _mm_prefetch(ahead + l * 64, _MM_HINT_T0);
        _tile_loadd(4, xb + kb * 32, Kp * 2);
        _tile_loadd(5, t, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (tiles > 1) {
            _tile_loadd(6, t + AMX_TILE, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (tiles > 2) {
            _tile_loadd(7, t + 2 * AMX_TILE, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (tiles > 3) {
            _tile_loadd(5, t + 3 * AMX_TILE, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, out, O * 4);
    if (tiles > 1) _tile_stored(1, out + 16, O * 4);
    if (tiles > 2) _tile_stored(2, out + 32, O * 4);
    if (tiles > 3) _tile_stored(3, out + 48, O * 4);
}

/* out [n, O] = xb [n, Kp] . w^T, w as `amx_tiles` stores it (O a multiple of 16): 16 rows a pass, each pass
   streaming the weight once. */
static AMX_TARGET void linear_amx(const uint16_t *xb, int n, int64_t Kp, const uint16_t *w, int64_t O, float *out) {
    for (int r = 0; r < n; r += 16) {
        amx_configure(n - r < 16 ? n - r : 16);
        for (int64_t o = 0; o < O; o += 64)
            amx_group(xb + r * Kp, Kp, w + o * Kp, O - o >= 64 ? 4 : (int)((O - o) / 16), out + r * O + o, O);
        _tile_release();
    }
}
#endif

/* x [n, K] into xs: each 16 values as their 8 even ones, then their 8 odd ones (K a multiple of 16). */
static void split_even_odd(const float *x, int n, int64_t K, float *xs) {
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t at = 0; at < n * K; at += 16) {
        const __m256 a = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + at), even);     /* a0 a2 a4 a6 a1 a3 a5 a7 */
        const __m256 b = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + at + 8), even); /* b0 b2 b4 b6 b1 b3 b5 b7 */
        _mm256_storeu_ps(xs + at, _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(xs + at + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
}

/* out[r, o] = x[r] . w[o] for rows [0, n), outputs [0, O); x rows of K contiguous floats, K a multiple of 8 (16 for
   bfloat16 weights); xs: scratch of n * (K + 16) floats (AMX tiles: the rows as bfloat16 there, then `linear_amx`).
   Outputs go in blocks of 8 weight rows, read from
   memory once (the first row pass, which also prefetches ahead) and from cache by the others: up to 4 rows a pass
   over float32 or int8 weights (2 over bfloat16 ones), each pass at most 8 sums of a kind in registers. */
static void linear(const float *x, int n, int64_t K, const void *w, int format, int64_t O, float *out, float *xs) {
    if (format == W_AMX) {
#if EVO_AMX
        const int64_t Kp = (K + 31) / 32 * 32;
        rows_to_bf16(x, n, K, Kp, (uint16_t *)xs);
        linear_amx((const uint16_t *)xs, n, Kp, (const uint16_t *)w, O, out);
#endif
        return;
    }
    const int bf16 = format == W_BF16;
    const int64_t Kp = (K + 15) / 16 * 16, G = (K + Q8_GROUP - 1) / Q8_GROUP;
    const int64_t q8_stride = Kp + G * (int64_t)sizeof(float);
    int16_t *x16 = (int16_t *)xs;
    float *xsc = (float *)(x16 + n * Kp);
    if (bf16) split_even_odd(x, n, K, xs);
    if (format == W_Q8) quantise_int16(x, n, K, Kp, x16, xsc);
    int64_t o = 0;
    for (; o + 8 <= O; o += 8)
        for (int r = 0; r < n;) {
            float *y = out + r * O + o;
            if (format == W_Q8) {
                r += rows_q8(x16 + r * Kp, xsc + r * G, n - r, K, Kp, (const int8_t *)w + o * q8_stride, q8_stride, y,
                             O);
            } else if (bf16) {
                const uint16_t *wb = (const uint16_t *)w + o * K;
                const float *xr = xs + r * K;
                if (n - r >= 2) {
                    block_bf16(2, 4, xr, K, wb, y, O);
                    block_bf16(2, 4, xr, K, wb + 4 * K, y + 4, O);
                    r += 2;
                } else {
                    block_bf16(1, 8, xr, K, wb, y, O);
                    r += 1;
                }
            } else {
                const float *wf = (const float *)w + o * K, *xr = x + r * K;
                const int R = n - r >= 4 ? 4 : n - r;
                if (R >= 3) {
                    for (int j = 0; j < 8; j += 2) {
                        if (R == 4) block_f32(4, 2, xr, K, wf + j * K, y + j, O);
                        else block_f32(3, 2, xr, K, wf + j * K, y + j, O);
                    }
                } else if (R == 2) {
                    block_f32(2, 4, xr, K, wf, y, O);
                    block_f32(2, 4, xr, K, wf + 4 * K, y + 4, O);
                } else {
                    block_f32(1, 8, xr, K, wf, y, O);
                }
                r += R;
            }
        }
    for (; o < O; o++)
        for (int r = 0; r < n; r++) {
            if (format == W_Q8)
                block_q8(1, 1, x16 + r * Kp, xsc + r * G, K, Kp, (const int8_t *)w + o * q8_stride, q8_stride,
                         out + r * O + o, O);
            else if (bf16) block_bf16(1, 1, xs + r * K, K, (const uint16_t *)w + o * K, out + r * O + o, O);
            else block_f32(1, 1, x + r * K, K, (const float *)w + o * K, out + r * O + o, O);
        }
}

/* heads rows of d values rotated by cos / sin [d/2]: pairs (i, i + d/2), or (2i, 2i + 1) when interleaved. */
static void rotate(float *x, int heads, int d, const float *cos_, const float *sin_, int interleaved) {
    const int half = d / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (int64_t)h * d;
        for (int i = 0; i < half; i++) {
            float *a = interleaved ? v + 2 * i : v + i, *b = interleaved ? v + 2 * i + 1 : v + i + half;
            const float p = *a, q = *b;
            *a = p * cos_[i] - q * sin_[i];
            *b = q * cos_[i] + p * sin_[i];
        }
    }
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* heads rows of d values of one row into its cache at one position (head stride `head`). */
static void store_kv(const float *src, void *cache, int bf16, int64_t at, int64_t head, int heads, int d) {
    for (int g = 0; g < heads; g++) {
        const float *s = src + (int64_t)g * d;
        if (bf16) {
            uint16_t *t = (uint16_t *)cache + at + g * head;
            for (int i = 0; i < d; i++) t[i] = to_bf16(s[i]);
        } else {
            memcpy((float *)cache + at + g * head, s, sizeof(float) * (size_t)d);
        }
    }
}

/* gate = silu(gate) * up, count a multiple of 8 (silu(g) = g / (1 + exp(-g))). */
static void silu_mul(float *gate, const float *up, int64_t count) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t c = 0; c < count; c += 8) {
        __m256 g = _mm256_loadu_ps(gate + c);
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(gate + c, _mm256_mul_ps(s, _mm256_loadu_ps(up + c)));
    }
}

int evo_llama_decode_step(const int64_t *dims, const void *const *ptrs, float eps, const float *embedded,
                          const int64_t *pos, int n, float *logits) {
    const int layers = (int)dims[DIM_LAYERS], H = (int)dims[DIM_H], KVH = (int)dims[DIM_KVH], d = (int)dims[DIM_HEAD];
    const int64_t D = dims[DIM_D], I = dims[DIM_I], V = dims[DIM_V];
    const int wf = (int)dims[DIM_W_FORMAT], kvb = (int)dims[DIM_KV_BF16], interleaved = (int)dims[DIM_INTERLEAVED];
    const int64_t QD = (int64_t)H * d, KD = (int64_t)KVH * d;
    const int half = d / 2;
    if (wf == W_AMX && !EVO_AMX) return -3;
    /* scratch: x, h, o [n, D]; q, att [n, QD]; k, v [n, KD]; gate, up [n, I]; cos, sin [n, d/2]; lengths [n];
       then a linear's inputs split even / odd, or as int16 and their scales [n, max(D, QD, I) + 16] */
    const int64_t widest = D > QD ? (D > I ? D : I) : (QD > I ? QD : I);
    const size_t floats = (size_t)n * (size_t)(3 * D + 2 * QD + 2 * KD + 2 * I + 2 * half + widest + 16 + 2);
    float *x = malloc(sizeof(float) * floats + sizeof(int64_t) * (size_t)n);
    if (x == NULL) return -1;
    float *h = x + n * D, *o = h + n * D, *q = o + n * D, *att = q + n * QD, *k = att + n * QD, *v = k + n * KD;
    float *gate = v + n * KD, *up = gate + n * I, *cos_ = up + n * I, *sin_ = cos_ + (int64_t)n * half;
    int64_t *lengths = (int64_t *)(sin_ + (int64_t)n * half);
    float *xs = (float *)(lengths + n);
    const double *inv_freq = (const double *)ptrs[layers * P_PER_LAYER + 2];
    for (int r = 0; r < n; r++) {
        lengths[r] = pos[r] + 1;
        for (int i = 0; i < half; i++) {
            const double angle = (double)pos[r] * inv_freq[i];
            cos_[r * half + i] = (float)cos(angle);
            sin_[r * half + i] = (float)sin(angle);
        }
    }
    memcpy(x, embedded, sizeof(float) * (size_t)(n * D));
    const float scale = 1.0f / sqrtf((float)d);
    int rc = 0;
    for (int l = 0; l < layers && rc == 0; l++) {
        const void *const *p = ptrs + l * P_PER_LAYER;
        evo_add_rms_norm(x, l ? o : NULL, x, (const float *)p[P_IN_NORM], h, n, D, eps);  /* o: the last MLP's */
        linear(h, n, D, p[P_Q], wf, QD, q, xs);
        linear(h, n, D, p[P_K], wf, KD, k, xs);
        linear(h, n, D, p[P_V], wf, KD, v, xs);
        for (int r = 0; r < n; r++) {
            rotate(q + r * QD, H, d, cos_ + r * half, sin_ + r * half, interleaved);
            rotate(k + r * KD, KVH, d, cos_ + r * half, sin_ + r * half, interleaved);
            store_kv(k + r * KD, (void *)p[P_K_CACHE], kvb, r * dims[DIM_K_ROW] + pos[r] * dims[DIM_K_POS], dims[DIM_K_HEAD],
                     KVH, d);
            store_kv(v + r * KD, (void *)p[P_V_CACHE], kvb, r * dims[DIM_V_ROW] + pos[r] * dims[DIM_V_POS], dims[DIM_V_HEAD],
                     KVH, d);
        }
        rc = evo_decode_attention(q, QD, d, p[P_K_CACHE], p[P_V_CACHE], kvb, dims[DIM_K_ROW], dims[DIM_K_HEAD],
                                  dims[DIM_K_POS], dims[DIM_V_ROW], dims[DIM_V_HEAD], dims[DIM_V_POS], lengths, n, H,
                                  KVH, d, scale, att);
        linear(att, n, QD, p[P_O], wf, D, o, xs);
        evo_add_rms_norm(x, o, x, (const float *)p[P_POST_NORM], h, n, D, eps);
        linear(h, n, D, p[P_GATE], wf, I, gate, xs);
        linear(h, n, D, p[P_UP], wf, I, up, xs);
        silu_mul(gate, up, n * I);
        linear(gate, n, I, p[P_DOWN], wf, D, o, xs);
    }
    if (rc == 0) {
        evo_add_rms_norm(x, o, x, (const float *)ptrs[layers * P_PER_LAYER], h, n, D, eps);
        linear(h, n, D, ptrs[layers * P_PER_LAYER + 1], wf, V, logits, xs);
    }
    free(x);
    return rc;
}
