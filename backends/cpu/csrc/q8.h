// Int8 x int8 skinny products for the CPU decode step, in the style of llama.cpp's
// Q8_0 x Q8_0: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small (the live slots), W int8
// with a float32 scale per row or per group of a row (polyengine.models.quantize).
//
// Why: a decode step is bound by streaming the weights from memory, and int8 weights
// are a quarter of float32's bytes, but the float path (linear.h) widens every int8
// weight to float32 and multiplies it by float32 activations: four times the float
// path's arithmetic per byte read, so it is compute-bound (~2 GB/s of weights on one
// Zen 4 core). Here the activations are quantized to int8 once per product
// (q8_quantize) and the products are byte dot products (AVX-512 VNNI vpdpbusd,
// AVX-VNNI, or AVX2 pmaddubsw + pmaddwd): one instruction per 64 (or 32) weights, and
// the step stays memory-bound. As in linear.h, a call streams each weight row once and
// applies every row of x to it while it sits in L1/registers.
//
// Numerics: x is quantized per block of 32 values along K, symmetric, with one float
// scale per block (scale = max|x| / 127, q = x / scale rounded to nearest even, 0 for
// an all-zero block), as llama.cpp's Q8_0 does. Inside a block the products of the
// int8 values are summed exactly in int32; each block's sum is scaled by (x block's
// scale * weight scale) and the blocks are summed in float32. So the result is the
// float product of the dequantized x and W up to float32 rounding; the quantization of
// x (half a step per value, about 0.4% of the block's largest value) is the only
// approximation. Weights must lie in [-127, 127] (the quantizer clamps to that).
//
// The ISA is chosen at compile time from the predefined macros (pe_q8_isa says which):
// 3 AVX-512 VNNI + BW, 2 AVX-VNNI (or AVX-512 VNNI + VL at 256 bits), 1 AVX2, 0 plain
// C++. -DPE_Q8_MAX_ISA=n caps it (for tests of the lower paths on a bigger host).
#pragma once
#include <stdint.h>
#include <string.h>

#include "simd.h"

#ifndef PE_Q8_MAX_ISA
#define PE_Q8_MAX_ISA 3
#endif

#if PE_Q8_MAX_ISA >= 3 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PE_Q8_ISA 3
#elif PE_Q8_MAX_ISA >= 2 && defined(__AVX2__) && \
    (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define PE_Q8_ISA 2
#elif PE_Q8_MAX_ISA >= 1 && defined(__AVX2__)
#define PE_Q8_ISA 1
#else
#define PE_Q8_ISA 0
#endif

#define Q8_BLOCK 32
#define Q8_R 4  // weight rows per tile
#define Q8_SPAN 8192  // bytes: the longest tile (R * K) that prefetches the next one

// ---- activations ------------------------------------------------------------------

// x (M, K) with row stride ldx -> xq (M, K) int8 and xs (M, K/32) scales; K % 32 == 0.
static void q8_quantize(const float *x, long ldx, int M, long K, int8_t *xq, float *xs) {
    typedef int32_t vi __attribute__((vector_size(VW * 4)));
    const long nb = K / Q8_BLOCK;
    const int NV = Q8_BLOCK / VW;
    const vf zero = {};
    for (int m = 0; m < M; m++)
        for (long b = 0; b < nb; b++) {
            const float *p = x + m * ldx + b * Q8_BLOCK;
            int8_t *q = xq + m * K + b * Q8_BLOCK;
            vf v[NV], mx = zero;
            for (int i = 0; i < NV; i++) {
                v[i] = load_f(p + i * VW);
                vf a = v[i] < zero ? -v[i] : v[i];
                mx = a > mx ? a : mx;
            }
            float amax = 0.f;
            for (int i = 0; i < VW; i++) amax = mx[i] > amax ? mx[i] : amax;
            const float d = amax / 127.f;
            xs[m * nb + b] = d;
            if (d == 0.f) {  // all zero (or too small to scale): q = 0
                memset(q, 0, Q8_BLOCK);
                continue;
            }
            const vf lo = zero - 127.f, hi = zero + 127.f;
            for (int i = 0; i < NV; i++) {
                vf t = v[i] / d;
                t = (t + 12582912.f) - 12582912.f;  // round to nearest even (|t| <= 2^22)
                t = t > hi ? hi : t;
                t = t < lo ? lo : t;
                // via int32: GCC 12 converts float vectors to int8 ones element by element
                vb qb = __builtin_convertvector(__builtin_convertvector(t, vi), vb);
                memcpy(q + i * VW, &qb, sizeof qb);
            }
        }
}

// ---- products ---------------------------------------------------------------------

// Streaming. A tile's R weight rows are one contiguous run of R * K bytes, read as R
// interleaved streams, and the hardware prefetchers (Zen 4 measured) do not follow that:
// at M = 1 from DRAM, R = 4 streamed ~10 GB/s where one row at a time streamed ~28. So
// a tile of up to Q8_SPAN bytes also prefetches the next tile in address order, as far
// through it as its steps have got through their own (R = 4 then streams as fast as
// one row, and beats it from cache); at M = 1 a longer tile (K > Q8_SPAN / R) is
// replaced by single rows, which stream in address order by themselves. With M > 1
// the products take longer than the loads and the tiles stay.
// (A longer tile prefetches its own lines, next to free: GCC 12 dropped the prefetches
// altogether when the walk was guarded by a null-pointer test.)
static inline const int8_t *q8_ahead(const int8_t *w, long K, long n0, int R) {
    return R * K <= Q8_SPAN ? w + (n0 + R) * K : w + n0 * K;
}

// Prefetches never fault, past the end of w either.
static inline void q8_prefetch(const int8_t *ahead, long off, long bytes) {
    for (long i = 0; i < bytes; i += 64) __builtin_prefetch(ahead + off + i, 0, 3);
}

// One tile: MB rows of x against R weight rows from n0. SM says how the weights are
// scaled: 0 one scale per row (applied at the end), 1 one per 32-block (wgroup 32),
// 2 one per group of bpg 32-blocks (wgroup = 32 * bpg). For SM 2, g/off track the
// group of block b and b's place in it (no division in the loop).

#if PE_Q8_ISA == 3

static inline __m512 q8_pair(const float *p) {  // [p[0] x 8, p[1] x 8]
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128 two = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)p));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
}

static inline __m512 q8_two(float a, float b) {  // [a x 8, b x 8]
    return _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}

// Blocks b and b+1 (HALF: only b, in the low 32 bytes; the high lanes' products are 0).
template <int MB, int R, int SM, bool HALF>
static inline void q8_step(__m512 (&acc)[MB][R], const int8_t *xq, const float *xs, long K, long nb,
                           const int8_t *w, long n0, long b, const __m512 *wsv, const int8_t *ahead) {
    const long k = b * Q8_BLOCK;
    q8_prefetch(ahead, b * R * Q8_BLOCK, R * 2 * Q8_BLOCK);
    const __m512i zero = _mm512_setzero_si512();
    __m512i wr[R];
    for (int r = 0; r < R; r++)
        wr[r] = HALF ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w + (n0 + r) * K + k)
                     : _mm512_loadu_si512(w + (n0 + r) * K + k);
    for (int m = 0; m < MB; m++) {
        const __m512i xv = HALF ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xq + m * K + k)
                                : _mm512_loadu_si512(xq + m * K + k);
        const __m512i ax = _mm512_abs_epi8(xv);          // |x| as unsigned bytes (<= 127)
        const __mmask64 neg = _mm512_movepi8_mask(xv);   // x < 0
        const __m512 xsv = HALF ? _mm512_set1_ps(xs[m * nb + b]) : q8_pair(xs + m * nb + b);
        for (int r = 0; r < R; r++) {
            // |x| * (w with x's sign) = x * w, unsigned x signed as vpdpbusd wants
            const __m512i sw = _mm512_mask_sub_epi8(wr[r], neg, zero, wr[r]);
            __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, ax, sw));
            if (SM) f = _mm512_mul_ps(f, wsv[r]);
            acc[m][r] = _mm512_fmadd_ps(f, xsv, acc[m][r]);
        }
    }
}

template <int MB, int R, int SM>
static inline void q8_block(const int8_t *xq, const float *xs, long K, const int8_t *w, const float *wscale,
                            long bpg, const float *bias, float *y, long ldy, long n0) {
    const long nb = K / Q8_BLOCK, G = SM == 2 ? nb / bpg : nb;
    __m512 acc[MB][R], wsv[R];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    const int8_t *ahead = q8_ahead(w, K, n0, R);
    long b = 0, g = 0, off = 0;
    for (; b + 2 <= nb; b += 2) {
        if (SM == 1)
            for (int r = 0; r < R; r++) wsv[r] = q8_pair(wscale + (n0 + r) * G + b);
        if (SM == 2) {
            const long g1 = off + 1 == bpg ? g + 1 : g;
            for (int r = 0; r < R; r++) wsv[r] = q8_two(wscale[(n0 + r) * G + g], wscale[(n0 + r) * G + g1]);
            for (off += 2; off >= bpg; off -= bpg) g++;
        }
        q8_step<MB, R, SM, false>(acc, xq, xs, K, nb, w, n0, b, wsv, ahead);
    }
    if (b < nb) {  // an odd number of blocks: the last one alone
        if (SM)
            for (int r = 0; r < R; r++) wsv[r] = _mm512_set1_ps(wscale[(n0 + r) * G + (SM == 1 ? b : g)]);
        q8_step<MB, R, SM, true>(acc, xq, xs, K, nb, w, n0, b, wsv, ahead);
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) {
            float s = _mm512_reduce_add_ps(acc[m][r]);
            if (SM == 0) s *= wscale[n0 + r];
            if (bias) s += bias[n0 + r];
            y[m * ldy + n0 + r] = s;
        }
}

#define Q8_MB 4

#elif PE_Q8_ISA >= 1

static inline __m256i q8_dot(__m256i ax, __m256i sw) {  // 8 int32 sums of 4 products each
#if PE_Q8_ISA == 2 && defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sw);
#elif PE_Q8_ISA == 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sw);  // AVX-512 VNNI + VL
#else
    // |x| <= 127 and |w| <= 127: pairs sum to at most 32258, so maddubs cannot saturate
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
#endif
}

static inline __m256 q8_fma(__m256 a, __m256 b, __m256 c) {
#if defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}

template <int MB, int R, int SM>
static inline void q8_block(const int8_t *xq, const float *xs, long K, const int8_t *w, const float *wscale,
                            long bpg, const float *bias, float *y, long ldy, long n0) {
    const long nb = K / Q8_BLOCK, G = SM == 2 ? nb / bpg : nb;
    __m256 acc[MB][R];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();
    const int8_t *ahead = q8_ahead(w, K, n0, R);
    long g = 0, off = 0;
    for (long b = 0; b < nb; b++) {
        const long k = b * Q8_BLOCK;
        q8_prefetch(ahead, b * R * Q8_BLOCK, R * Q8_BLOCK);
        __m256i wr[R];
        __m256 wsv[R];
        for (int r = 0; r < R; r++) wr[r] = _mm256_loadu_si256((const __m256i *)(w + (n0 + r) * K + k));
        if (SM)
            for (int r = 0; r < R; r++) wsv[r] = _mm256_broadcast_ss(wscale + (n0 + r) * G + (SM == 1 ? b : g));
        if (SM == 2 && ++off == bpg) off = 0, g++;
        for (int m = 0; m < MB; m++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + k));
            const __m256i ax = _mm256_sign_epi8(xv, xv);  // |x|
            const __m256 xsv = _mm256_broadcast_ss(xs + m * nb + b);
            for (int r = 0; r < R; r++) {
                // |x| * (w with x's sign) = x * w, unsigned x signed as the byte products want
                __m256 f = _mm256_cvtepi32_ps(q8_dot(ax, _mm256_sign_epi8(wr[r], xv)));
                if (SM) f = _mm256_mul_ps(f, wsv[r]);
                acc[m][r] = q8_fma(f, xsv, acc[m][r]);
            }
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) {
            float s = hsum8(acc[m][r]);
            if (SM == 0) s *= wscale[n0 + r];
            if (bias) s += bias[n0 + r];
            y[m * ldy + n0 + r] = s;
        }
}

#define Q8_MB 2

#else  // portable

template <int MB, int R, int SM>
static inline void q8_block(const int8_t *xq, const float *xs, long K, const int8_t *w, const float *wscale,
                            long bpg, const float *bias, float *y, long ldy, long n0) {
    const long nb = K / Q8_BLOCK, G = SM == 2 ? nb / bpg : nb;
    float acc[MB][R] = {};
    const int8_t *ahead = q8_ahead(w, K, n0, R);
    long g = 0, off = 0;
    for (long b = 0; b < nb; b++) {
        const long k = b * Q8_BLOCK;
        q8_prefetch(ahead, b * R * Q8_BLOCK, R * Q8_BLOCK);
        for (int m = 0; m < MB; m++)
            for (int r = 0; r < R; r++) {
                const int8_t *xa = xq + m * K + k, *wa = w + (n0 + r) * K + k;
                int32_t s = 0;
                for (int i = 0; i < Q8_BLOCK; i++) s += (int32_t)xa[i] * (int32_t)wa[i];
                float f = (float)s;
                if (SM) f *= wscale[(n0 + r) * G + (SM == 1 ? b : g)];
                acc[m][r] += f * xs[m * nb + b];
            }
        if (SM == 2 && ++off == bpg) off = 0, g++;
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) {
            float s = acc[m][r];
            if (SM == 0) s *= wscale[n0 + r];
            if (bias) s += bias[n0 + r];
            y[m * ldy + n0 + r] = s;
        }
}

#define Q8_MB 2

#endif

// R weight rows from n0 against every row of x: groups of MB, then 2, then 1 x rows
// (the weight rows are read from memory once, then from L1, or L2 for a long tile).
template <int R, int SM>
static inline void q8_tile(const int8_t *xq, const float *xs, int M, long K, const int8_t *w, const float *wscale,
                           long bpg, const float *bias, float *y, long ldy, long n0) {
    const long nb = K / Q8_BLOCK;
    int m = 0;
    for (; m + Q8_MB <= M; m += Q8_MB)
        q8_block<Q8_MB, R, SM>(xq + m * K, xs + m * nb, K, w, wscale, bpg, bias, y + m * ldy, ldy, n0);
    if (Q8_MB > 2 && m + 2 <= M) {
        q8_block<2, R, SM>(xq + m * K, xs + m * nb, K, w, wscale, bpg, bias, y + m * ldy, ldy, n0);
        m += 2;
    }
    for (; m < M; m++) q8_block<1, R, SM>(xq + m * K, xs + m * nb, K, w, wscale, bpg, bias, y + m * ldy, ldy, n0);
}

template <int SM>
static void q8_rows_scaled(const int8_t *xq, const float *xs, int M, long K, const int8_t *w, const float *wscale,
                           long bpg, const float *bias, float *y, long ldy, long n0, long n1) {
    long n = n0;
    if (!(M == 1 && Q8_R * K > Q8_SPAN))
        for (; n + Q8_R <= n1; n += Q8_R) q8_tile<Q8_R, SM>(xq, xs, M, K, w, wscale, bpg, bias, y, ldy, n);
    for (; n < n1; n++) q8_tile<1, SM>(xq, xs, M, K, w, wscale, bpg, bias, y, ldy, n);
}

// y[m * ldy + n] for n in [n0, n1), all m < M, from xq/xs (q8_quantize of x) and int8
// w (N, K) with wscale (N,) (wgroup 0) or (N, K / wgroup) (wgroup a multiple of 32
// dividing K). One thread's share of a product: callers split [0, N) among threads.
static void q8_rows(const int8_t *xq, const float *xs, int M, long K, const int8_t *w, const float *wscale,
                    long wgroup, const float *bias, float *y, long ldy, long n0, long n1) {
    if (wgroup == 0)
        q8_rows_scaled<0>(xq, xs, M, K, w, wscale, 0, bias, y, ldy, n0, n1);
    else if (wgroup == Q8_BLOCK)
        q8_rows_scaled<1>(xq, xs, M, K, w, wscale, 1, bias, y, ldy, n0, n1);
    else
        q8_rows_scaled<2>(xq, xs, M, K, w, wscale, wgroup / Q8_BLOCK, bias, y, ldy, n0, n1);
}
