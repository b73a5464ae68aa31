// Products on GGUF block weights for many rows of x (a prefill, a long piece): y[M, N] =
// x[M, K] @ W[N, K]^T (+ bias), sixteen weight rows at a time against int16 activations.
//
// gguf.h's kernels unpack a weight row and take its dot product with a few rows of x,
// one 32-weight block at a time: every block and row of x pays a conversion and a float
// multiply-add of its own, which is most of the work, so the rate per row of x hardly
// grows with the rows. Here a band of sixteen weight rows is unpacked once into a tile
// laid out for vpdpwssd: per 32-weight block, sixteen 64-byte words, word p holding
// weights 2p and 2p + 1 of each of the sixteen rows as int16 pairs (one int32 lane per
// weight row), with the rows' scales (two per block for Q6_K, one per 16 weights) and
// minimums beside it. Every row of x then runs over the tile: one vpdpwssd per two
// weights of sixteen rows against a broadcast pair of x's int16 values, and one
// conversion and multiply-add per block for sixteen outputs, not one per output.
//
// x is quantized per 32 values to int16 on one scale (gt_quantize: d = max|x| / 32767,
// round to nearest even): x = d * q to within d / 2 a value, finer than int8x2's d8 / 508
// (d8 = max|x| / 127, gguf.h), so the bound docs/cpu.md states for int8x2 covers it. The
// int32 sums are exact (a block's 32 products of |w| <= 128 and |q| <= 32767 stay under
// 2^31); the float work is the scales and the sums over blocks.
//
// Only the AVX-512 VNNI path has it (PE_Q8_ISA 3; gt_available): elsewhere the engine
// keeps its fallback, bands dequantized into torch's GEMM (blocks.py). Tested per format
// against float64 products of the exactly dequantized blocks (tests/test_cpu_gguf_tiles.py).
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "packed.h"
#include "parallel.h"

#if PE_Q8_ISA == 3
#define GT_TILES 1
#else
#define GT_TILES 0
#endif

// Rows of x that one pass over a tile takes at once (accumulators: 2 * GT_MR of 32 zmm).
#define GT_MR 8

#if GT_TILES

// x (M, K) -> xq (M, K) int16, xs (M, K / 32) their scales, xsum (M, K / 32): xs times the
// sum of a block's int16 values (the minimums' terms).
static void gt_quantize(const float *x, long ldx, int M, long K, int16_t *xq, float *xs, float *xsum) {
    const long nb = K / 32;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int m = 0; m < M; m++)
        for (long b = 0; b < nb; b++) {
            const float *p = x + m * ldx + b * 32;
            const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, absmask), _mm512_and_ps(hi, absmask)));
            const float d = amax / 32767.f, inv = amax > 0.f ? 32767.f / amax : 0.f;
            // cvtps rounds to nearest even (MXCSR's default); |x * inv| <= 32767 up to a rounding
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
            int16_t *q = xq + m * K + b * 32;
            _mm256_storeu_si256((__m256i *)q, _mm512_cvtsepi32_epi16(qlo));
            _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtsepi32_epi16(qhi));
            xs[m * nb + b] = d;
            xsum[m * nb + b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
}

// Scales per 32-weight block in a tile: Q6_K has one per 16 weights.
template <int F> struct gt_ns { enum { N = F == GQ_Q6_K ? 2 : 1 }; };

// The 16 x 16 int32 matrix r (row i in r[i]) transposed in place: r[p] lane i = old r[i] lane p.
static inline void gt_transpose(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {  // pairs of rows, interleaved by 32 bits within each 128-bit lane
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // u[4i + c], lane L: rows 4i..4i+3 of column 4L + c
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {  // column 4L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
        const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

// Weight rows n0 .. n0 + rows (rows <= 16; the tile's other rows zero) into the tile: wt
// (K / 32 blocks of 16 words of 16 int32 lanes), sc (per block NS vectors of 16 scales)
// and mn (per block 16 minimums, the formats with one). Each row's block is unpacked to
// 32 int16 (16 pairs) in a register, and the sixteen registers transposed.
template <int F>
static void gt_pack(const uint8_t *w, long ldw, const long *rowoff, long K, long n0, int rows, int32_t *wt, float *sc,
                    float *mn) {
    typedef gq_traits<F> T;
    const int NS = gt_ns<F>::N;
    const uint8_t *rp[16];
    for (int r = 0; r < rows; r++) rp[r] = w + (rowoff ? rowoff[n0 + r] : (n0 + r) * ldw);
    gq_super sup[16];
    for (long blk = 0; blk < K / T::BLOCK; blk++) {
        if (T::BLOCK == 256)
            for (int r = 0; r < rows; r++) gq_prepare_v<F>(rp[r] + blk * T::BYTES, &sup[r]);
        for (int j = 0; j < T::BLOCK / 32; j++) {
            const long b = blk * (T::BLOCK / 32) + j;
            float *scb = sc + b * NS * 16, *mnb = mn + b * 16;
            __m512i v[16];
            for (int r = 0; r < 16; r++) {
                if (r < rows) {
                    gq_sub o;
                    v[r] = _mm512_cvtepi8_epi16(gq_unpack_v<F, false>(rp[r] + blk * T::BYTES, j, &sup[r], &o));
                    scb[r] = o.sc[0];
                    if (NS == 2) scb[16 + r] = o.sc[1];
                    if (T::MIN) mnb[r] = o.mn;
                } else {
                    v[r] = _mm512_setzero_si512();
                    scb[r] = 0.f;
                    if (NS == 2) scb[16 + r] = 0.f;
                    if (T::MIN) mnb[r] = 0.f;
                }
            }
            gt_transpose(v);
            int32_t *wb = wt + b * 256;
            for (int p = 0; p < 16; p++) _mm512_store_si512((__m512i *)(wb + p * 16), v[p]);
        }
    }
}

// MR rows of x (xq at row stride K, xs/xsum at nb) against one tile: y[m * ldy + i] for
// the tile's rows i where mask has bit i.
template <int F, int MR>
static inline void gt_micro(const int32_t *wt, const float *sc, const float *mn, long K, const int16_t *xq,
                            const float *xs, const float *xsum, const float *bias, float *y, long ldy, __mmask16 mask) {
    const int NS = gt_ns<F>::N;
    const long nb = K / 32;
    __m512 acc[MR];
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const int32_t *wb = wt + b * 256;
#pragma GCC unroll 2
        for (int s = 0; s < NS; s++) {
            __m512i dot[MR];
            for (int m = 0; m < MR; m++) dot[m] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int p = s * (16 / NS); p < (s + 1) * (16 / NS); p++) {
                const __m512i wv = _mm512_load_si512((const __m512i *)(wb + p * 16));
                for (int m = 0; m < MR; m++) {
                    int32_t pair;
                    memcpy(&pair, xq + m * K + b * 32 + 2 * p, 4);
                    dot[m] = _mm512_dpwssd_epi32(dot[m], wv, _mm512_set1_epi32(pair));
                }
            }
            const __m512 scv = _mm512_load_ps(sc + (b * NS + s) * 16);
            for (int m = 0; m < MR; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(scv, _mm512_set1_ps(xs[m * nb + b])),
                                         acc[m]);
        }
        if (gq_traits<F>::MIN) {
            const __m512 mnv = _mm512_load_ps(mn + b * 16);
            for (int m = 0; m < MR; m++) acc[m] = _mm512_fmadd_ps(mnv, _mm512_set1_ps(xsum[m * nb + b]), acc[m]);
        }
    }
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int m = 0; m < MR; m++) _mm512_mask_storeu_ps(y + m * ldy, mask, _mm512_add_ps(acc[m], bv));
}

// This thread's tile, grown to the longest row it has met (kept: a fused step calls
// this once per projection and layer, and a fresh 300 KB tile each time would fault in).
static inline int32_t *gt_scratch(long bytes) {
    static thread_local int32_t *buf = nullptr;
    static thread_local long have = 0;
    if (bytes > have) {
        free(buf);
        buf = (int32_t *)aligned_alloc(64, (bytes + 63) / 64 * 64);
        have = buf ? bytes : 0;
    }
    return buf;
}

// Weight rows [n0, n1) of W (row n at w + rowoff[n], or n * ldw) against M rows of x as
// gt_quantize laid them out, sixteen rows a tile (the last may have fewer): y[m * ldy + n].
// packed: W repacked (packed.h; n0 a multiple of 16), each tile filled from its group.
template <int F>
static void gt_rows(const int16_t *xq, const float *xs, const float *xsum, int M, long K, const uint8_t *w, long ldw,
                    const long *rowoff, const uint8_t *packed, const float *bias, float *y, long ldy, long n0,
                    long n1) {
    const int NS = gt_ns<F>::N;
    const long nb = K / 32;
    // 1 KiB of weights a block, then the scales and minimums
    int32_t *wt = gt_scratch(nb * (1024 + 64 * NS + 64));
    if (!wt) abort();
    float *sc = (float *)(wt + nb * 256), *mn = sc + nb * 16 * NS;
    for (long t0 = n0; t0 < n1; t0 += 16) {
        const int rows = (int)(n1 - t0 < 16 ? n1 - t0 : 16);
        const __mmask16 mask = (__mmask16)((1u << rows) - 1u);
        if (packed)
            gp_tile_of<F>(packed + t0 / GP_ROWS * gp_group_bytes(F, K), K, wt, sc, mn);
        else
            gt_pack<F>(w, ldw, rowoff, K, t0, rows, wt, sc, mn);
        const float *b = bias ? bias + t0 : nullptr;
        int m = 0;
        for (; m + GT_MR <= M; m += GT_MR)
            gt_micro<F, GT_MR>(wt, sc, mn, K, xq + m * K, xs + m * nb, xsum + m * nb, b, y + m * ldy + t0, ldy, mask);
#define GT_REST(R)                                                                                                 \
    case R:                                                                                                        \
        gt_micro<F, R>(wt, sc, mn, K, xq + m * K, xs + m * nb, xsum + m * nb, b, y + m * ldy + t0, ldy, mask);     \
        break;
        switch (M - m) {
            GT_REST(1) GT_REST(2) GT_REST(3) GT_REST(4) GT_REST(5) GT_REST(6) GT_REST(7)
        }
#undef GT_REST
    }
}

// gt_rows for format fmt (gguf.h's ggml type id): a fused step's share of one projection
// (linear.h's PE_GGUFT, ldw 0: packed rows) or a whole product's (pe_gguf_tile_linear).
static void gt_seg_rows(int fmt, const int16_t *xq, const float *xs, const float *xsum, int M, long K,
                        const uint8_t *w, long ldw, const long *rowoff, const uint8_t *packed, const float *bias,
                        float *y, long ldy, long n0, long n1) {
    if (!ldw) ldw = gq_row_bytes(fmt, K);
#define GT_SEG(F) gt_rows<F>(xq, xs, xsum, M, K, w, ldw, rowoff, packed, bias, y, ldy, n0, n1)
    GQ_DISPATCH(fmt, GT_SEG)
#undef GT_SEG
}

struct gt_job {
    int fmt, M;
    long K, N, ldw, ldy;
    const int16_t *xq;
    const float *xs, *xsum, *bias;
    const uint8_t *w;
    const long *rowoff;
    const uint8_t *packed;  // null, or w repacked (packed.h)
    float *y;
};

// Thread tid's share of whole tiles.
static void gt_task(void *arg, int tid, int nth) {
    const gt_job *j = (const gt_job *)arg;
    long b0, b1;
    pe_share((j->N + 15) / 16, tid, nth, &b0, &b1);
    const long n1 = b1 * 16 < j->N ? b1 * 16 : j->N;
    if (b0 * 16 < n1)
        gt_seg_rows(j->fmt, j->xq, j->xs, j->xsum, j->M, j->K, j->w, j->ldw, j->rowoff, j->packed, j->bias, j->y,
                    j->ldy, b0 * 16, n1);
}

#endif  // GT_TILES
