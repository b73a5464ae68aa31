// Products on GGUF block weights as they lie in the file: y[M, N] = x[M, K] @ W[N, K]^T
// (+ bias) with W in one of ggml's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K), read from the memory map, never widened as a whole; and the
// dequantization of a band of rows into float32 (a prefill's GEMM takes a tile at a time).
//
// Decode (M small) works as llama.cpp's vec_dot pairs a weight block with int8
// activations: x is quantized per 32 values (q8.h's q8_quantize: one float scale per
// block, symmetric, round to nearest even), and each 32-weight sub-block of a weight row
// is unpacked in registers to signed bytes q with a float scale (two for Q6_K, whose
// scales cover 16 weights) and, for the formats with a minimum (Q4_1, Q5_1, Q4_K,
// Q5_K), an offset mn: w = sc * q + mn. The byte products sum exactly in int32, so
//   row . x = sum over blocks b of xs_b * (sc_b * sum(q * xq) + mn_b * sum(xq))
// and sum(xq) per block is computed once per product, as the sums of its two halves of 16
// (xsf: xs_b * sum(xq) per half, which Q6_K's offset needs on its own). Every term
// is exact but the float32 sums and the activations' rounding (half a step of x's block
// scale per value), which is the only approximation: the bound stated in docs/cpu.md.
//
// ISA paths (q8.h's PE_Q8_ISA): 2-3 byte dot products on vpdpbusd at 256 bits (AVX-512
// VNNI with VL, or AVX-VNNI; at 512 bits the unpacking would have to interleave two
// blocks per register for no more throughput on the Zen 4 this was written on, whose
// 512-bit units are two 256-bit halves); 1 AVX2 pmaddubsw + pmaddwd (the unsigned
// operand is |x| <= 127 and |q| <= 128, so pairs sum to at most 32512: no saturation);
// 0 plain C++. Each is tested per format against float64 products of the exactly
// dequantized blocks (tests/test_cpu_gguf_kernels.py).
#pragma once
#include <stdint.h>
#include <string.h>

#include "parallel.h"
#include "q8.h"
#include "simd.h"

// int8x2 is two int8 rows on one scale (gq_quantize_x2; block_kernel_rates.cpp tells builds apart by it).
#define GQ_X2_ONE_SCALE 1

// ggml's type ids (the GGUF file's tensor types).
enum { GQ_Q4_0 = 2, GQ_Q4_1 = 3, GQ_Q5_0 = 6, GQ_Q5_1 = 7, GQ_Q8_0 = 8, GQ_Q4_K = 12, GQ_Q5_K = 13, GQ_Q6_K = 14 };

// MIN: a minimum stored per block (w = sc * q + mn). ZERO: the zero point of a symmetric
// 32-weight format's unsigned quants (w = sc * (u - ZERO)), which the vector products take
// as a minimum mn = -ZERO * sc, so u goes into the byte products as it is stored (no
// sign moved onto x per row of x) and the offset onto x's block sums, eight blocks a step.
template <int F> struct gq_traits;
template <> struct gq_traits<GQ_Q4_0> { enum { BLOCK = 32, BYTES = 18, MIN = 0, ZERO = 8 }; };
template <> struct gq_traits<GQ_Q4_1> { enum { BLOCK = 32, BYTES = 20, MIN = 1, ZERO = 0 }; };
template <> struct gq_traits<GQ_Q5_0> { enum { BLOCK = 32, BYTES = 22, MIN = 0, ZERO = 16 }; };
template <> struct gq_traits<GQ_Q5_1> { enum { BLOCK = 32, BYTES = 24, MIN = 1, ZERO = 0 }; };
template <> struct gq_traits<GQ_Q8_0> { enum { BLOCK = 32, BYTES = 34, MIN = 0, ZERO = 0 }; };
template <> struct gq_traits<GQ_Q4_K> { enum { BLOCK = 256, BYTES = 144, MIN = 1, ZERO = 0 }; };
template <> struct gq_traits<GQ_Q5_K> { enum { BLOCK = 256, BYTES = 176, MIN = 1, ZERO = 0 }; };
template <> struct gq_traits<GQ_Q6_K> { enum { BLOCK = 256, BYTES = 210, MIN = 0, ZERO = 0 }; };

// IEEE half -> float, exactly (F16C where the path has it).
static inline float gq_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        bits = sign | ((e + 112) << 23) | (m << 13);
    } else {  // zero or subnormal: m * 2^-24, exact in float
        float f = (float)m * 5.9604644775390625e-08f;
        return (h & 0x8000) ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// A 32-weight sub-block as unpacked: w[i] = sc[i / 16] * q[i] + mn.
struct gq_sub {
    float sc[2], mn;
};

// The per-super-block scales of the K formats: dsc[j] = d * scale_j, dmn[j] = -dmin * min_j
// (Q4_K/Q5_K, 6-bit packed) or d * scale_k for each 16 (Q6_K, int8).
struct gq_super {
    float dsc[16], dmn[8];
};

template <int F>
static inline void gq_prepare(const uint8_t *blk, gq_super *s) {
    if (F == GQ_Q4_K || F == GQ_Q5_K) {
        const float d = gq_f16(blk), dmin = gq_f16(blk + 2);
        const uint8_t *p = blk + 4;
        for (int j = 0; j < 4; j++) {
            s->dsc[j] = d * (float)(p[j] & 63);
            s->dmn[j] = -dmin * (float)(p[j + 4] & 63);
            s->dsc[j + 4] = d * (float)((p[j + 8] & 15) | ((p[j] >> 6) << 4));
            s->dmn[j + 4] = -dmin * (float)((p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4));
        }
    } else if (F == GQ_Q6_K) {
        const float d = gq_f16(blk + 208);
        for (int k = 0; k < 16; k++) s->dsc[k] = d * (float)(int8_t)blk[192 + k];
    }
}

// Sub-block j of block blk into q[32] (plain C++: the scalar path and the dequantization).
template <int F>
static inline void gq_unpack_s(const uint8_t *blk, int j, const gq_super *s, int8_t *q, gq_sub *o) {
    o->mn = 0.f;
    if (F == GQ_Q8_0) {
        memcpy(q, blk + 2, 32);
        o->sc[0] = o->sc[1] = gq_f16(blk);
    } else if (F == GQ_Q4_0 || F == GQ_Q4_1) {
        const uint8_t *qs = blk + (F == GQ_Q4_0 ? 2 : 4);
        const int off = F == GQ_Q4_0 ? 8 : 0;
        for (int i = 0; i < 16; i++) q[i] = (int8_t)((qs[i] & 15) - off), q[i + 16] = (int8_t)((qs[i] >> 4) - off);
        o->sc[0] = o->sc[1] = gq_f16(blk);
        if (F == GQ_Q4_1) o->mn = gq_f16(blk + 2);
    } else if (F == GQ_Q5_0 || F == GQ_Q5_1) {
        const int at = F == GQ_Q5_0 ? 2 : 4, off = F == GQ_Q5_0 ? 16 : 0;
        uint32_t qh;
        memcpy(&qh, blk + at, 4);
        const uint8_t *qs = blk + at + 4;
        for (int i = 0; i < 16; i++) {
            q[i] = (int8_t)(((qs[i] & 15) | (((qh >> i) & 1) << 4)) - off);
            q[i + 16] = (int8_t)(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off);
        }
        o->sc[0] = o->sc[1] = gq_f16(blk);
        if (F == GQ_Q5_1) o->mn = gq_f16(blk + 2);
    } else if (F == GQ_Q4_K || F == GQ_Q5_K) {
        const uint8_t *qs = blk + (F == GQ_Q4_K ? 16 : 48) + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int i = 0; i < 32; i++) {
            int v = (qs[i] >> shift) & 15;
            if (F == GQ_Q5_K) v |= ((blk[16 + i] >> j) & 1) << 4;
            q[i] = (int8_t)v;
        }
        o->sc[0] = o->sc[1] = s->dsc[j];
        o->mn = s->dmn[j];
    } else {  // Q6_K: half n of 128 weights, group g of 32 in it
        const int n = j / 4, g = j % 4;
        const uint8_t *ql = blk + 64 * n + 32 * (g & 1), *qh = blk + 128 + 32 * n;
        const int shift = 4 * (g >> 1);
        for (int i = 0; i < 32; i++) q[i] = (int8_t)((((ql[i] >> shift) & 15) | (((qh[i] >> (2 * g)) & 3) << 4)) - 32);
        o->sc[0] = s->dsc[8 * n + 2 * g];
        o->sc[1] = s->dsc[8 * n + 2 * g + 1];
    }
}

#if PE_Q8_ISA >= 1

// Byte i of the result is 0xFF where bit i of bits is set.
static inline __m256i gq_bits(uint32_t bits) {
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// 16 bytes -> their 32 nibbles: low ones first (weights 0-15), then the high ones.
static inline __m256i gq_nibbles(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
}

// Sub-block j of block blk as 32 signed bytes in a register (sc/mn as gq_unpack_s).
// RAW: Q6_K's bytes as stored, 0..63 (q + 32), and Q4_0/Q5_0's, 0..15/0..31 with their
// zero point as a minimum (mn = -ZERO * sc), for the products (gq_row moves the offsets
// onto the sums of x); every other format is the same either way.
template <int F, bool RAW = false>
static inline __m256i gq_unpack_v(const uint8_t *blk, int j, const gq_super *s, gq_sub *o) {
    o->mn = 0.f;
    if (F == GQ_Q8_0) {
        o->sc[0] = o->sc[1] = gq_f16(blk);
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
    if (F == GQ_Q4_0 || F == GQ_Q4_1) {
        o->sc[0] = o->sc[1] = gq_f16(blk);
        if (F == GQ_Q4_1) {
            o->mn = gq_f16(blk + 2);
            return gq_nibbles(blk + 4);
        }
        if (RAW) {
            o->mn = -8.f * o->sc[0];
            return gq_nibbles(blk + 2);
        }
        return _mm256_sub_epi8(gq_nibbles(blk + 2), _mm256_set1_epi8(8));
    }
    if (F == GQ_Q5_0 || F == GQ_Q5_1) {
        const int at = F == GQ_Q5_0 ? 2 : 4;
        uint32_t qh;
        memcpy(&qh, blk + at, 4);
        __m256i v = _mm256_or_si256(gq_nibbles(blk + at + 4), _mm256_and_si256(gq_bits(qh), _mm256_set1_epi8(16)));
        o->sc[0] = o->sc[1] = gq_f16(blk);
        if (F == GQ_Q5_1) {
            o->mn = gq_f16(blk + 2);
            return v;
        }
        if (RAW) {
            o->mn = -16.f * o->sc[0];
            return v;
        }
        return _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    }
    if (F == GQ_Q4_K || F == GQ_Q5_K) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + (F == GQ_Q4_K ? 16 : 48) + 32 * (j / 2)));
        __m256i v = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
        if (F == GQ_Q5_K) {
            const __m256i hb = _mm256_set1_epi8((char)(1 << j));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, hb), hb),
                                                    _mm256_set1_epi8(16)));
        }
        o->sc[0] = o->sc[1] = s->dsc[j];
        o->mn = s->dmn[j];
        return v;
    }
    // Q6_K
    const int n = j / 4, g = j % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32 * (g & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
    const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(15));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), _mm256_set1_epi8(3));
    o->sc[0] = s->dsc[8 * n + 2 * g];
    o->sc[1] = s->dsc[8 * n + 2 * g + 1];
    const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    return RAW ? u : _mm256_sub_epi8(u, _mm256_set1_epi8(32));
}

// gq_prepare in vector registers: the 6-bit scales and mins unpacked as four bytes per
// 32-bit word (ggml's layout read as three words), widened and scaled eight at a time
// (scalar int-to-float conversions, each with a false dependency, were half the time).
template <int F>
static inline void gq_prepare_v(const uint8_t *blk, gq_super *s) {
    if (F == GQ_Q4_K || F == GQ_Q5_K) {
        uint32_t u[3];
        memcpy(u, blk + 4, 12);
        const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
        const uint32_t sc_lo = u[0] & low6, mn_lo = u[1] & low6;
        const uint32_t sc_hi = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
        const uint32_t mn_hi = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo)));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo)));
        _mm256_storeu_ps(s->dsc, _mm256_mul_ps(sc, _mm256_set1_ps(gq_f16(blk))));
        _mm256_storeu_ps(s->dmn, _mm256_mul_ps(mn, _mm256_set1_ps(-gq_f16(blk + 2))));
    } else if (F == GQ_Q6_K) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 d = _mm256_set1_ps(gq_f16(blk + 208));
        _mm256_storeu_ps(s->dsc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d));
        _mm256_storeu_ps(s->dsc + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))), d));
    }
}

// 8 int32 sums of 4 byte products each (lanes 0-3: bytes 0-15): unsigned aq, signed sx.
static inline __m256i gq_dot(__m256i aq, __m256i sx) {
#if PE_Q8_ISA == 2 && defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aq, sx);
#elif PE_Q8_ISA >= 2
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aq, sx);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), _mm256_set1_epi16(1));
#endif
}

// gq_dot added to acc.
static inline __m256i gq_dot_acc(__m256i acc, __m256i aq, __m256i sx) {
#if PE_Q8_ISA == 2 && defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, aq, sx);
#elif PE_Q8_ISA >= 2
    return _mm256_dpbusd_epi32(acc, aq, sx);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), _mm256_set1_epi16(1)));
#endif
}

// Q4_1/Q5_1 rows of up to this many blocks (K up to 32768) add their minimums' terms eight
// blocks at a time after the row (gq_row's mnrow, 4 KiB of stack); longer rows a block at a time.
static const long GQ_MIN_BLOCKS = 1024;

// Bytes ahead of a row's current block that gq_row prefetches (1152 to 4096 measured the same).
static const long GQ_AHEAD = 2048;

// MB rows of x against weight row `row` (K weights): y[m * ldy] for each m.
// X2: each row of x is two int8 rows on one scale (gq_quantize_x2: row m's first at
// xq + 2mK, its second K bytes on, xs/xsf at 2m * nb), combined in int32 before the
// float work: 254 * (first's sum) + (second's sum), the int8x2 activations for one
// conversion, one scale and one FMA a block (|254 * s1 + s2| <= 4 * 128 * 127 * 255 < 2^24
// a lane: the conversion to float is exact).
template <int F, int MB, int X2 = 0>
static inline void gq_row(const int8_t *xq, const float *xs, const float *xsf, long K, const uint8_t *row,
                          float bias, float *y, long ldy) {
    typedef gq_traits<F> T;
    const bool KMIN = T::BLOCK == 256 && T::MIN;
    const long nb = K / 32;
    // a row of x's stride in xq, xs and xsf (two sums a block: its halves of 16)
    const long XK = X2 ? 2 * K : K, XB = X2 ? 2 * nb : nb, XF = 2 * nb;
    // unsigned weight bytes: the formats with a minimum or a zero point (0..31) and Q6_K
    // (0..63, its -32 moved onto x's half-block sums, one step a super-block): no sign
    // moved onto x a block and row (Q4_0 int8x2 in cache, one core, a row of x: 18.0 -> 21.1
    // Gweights/s, 8 rows 25.7 -> 31.5; backends/cpu/bench/block_kernel_rates.py)
    const bool UNS = T::MIN || T::ZERO || F == GQ_Q6_K;
    // two accumulators a row, alternating by block: one FMA chain's latency (4 cycles a
    // block) bounded a row's throughput, not the unpacking or the dot products
    __m256 acc[MB][2], kmins[MB];
    float mins[MB];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = kmins[m] = _mm256_setzero_ps(), mins[m] = 0.f;
    gq_super sup;
    // Q4_1/Q5_1: a row's block minimums kept (mnrow), and their terms added after its blocks
    // as one vector FMA a row of x for every eight blocks (against x's eight block sums)
    // instead of two loads, an add and an FMA a block and row; after the row, so the vector
    // loads find the minimums in cache, not in stores still in flight
    // (backends/cpu/bench/block_kernel_rates.py); the last nblk mod 8 one at a time from mnrow.
    // Rows of more than GQ_MIN_BLOCKS blocks: a block at a time.
    const bool MIN32 = (T::MIN || T::ZERO) && T::BLOCK == 32;
    float mnrow[MIN32 ? GQ_MIN_BLOCKS : 1];
    const bool vmin = MIN32 && K / 32 <= GQ_MIN_BLOCKS;
    // One block; its products go to accumulator `par` (32-weight formats: the block's
    // parity) or, in a super-block, the sub-block's parity. Inlined where par is a literal
    // and the sub-block loop unrolled, the accumulator is known when compiling and stays
    // in a register: rolled loops kept acc[][] in memory, every FMA a store and a reload
    // (backends/cpu/bench/block_kernel_rates.py: in cache, one row of x, one core, with the other
    // changes of 2026-12-04, Q4_K int8x2 20.6 -> 25.2, Q8_0 int8 18.2 -> 30.8 Gweights/s).
    auto one = [&](long blk, int par) __attribute__((always_inline)) {
        const uint8_t *p = row + blk * T::BYTES;
        // every cache line of the block GQ_AHEAD bytes on (one prefetch a block reached only
        // one line in 2.25 of Q4_K's 144-byte blocks: the loads waited on memory; all lines
        // measured 1.36x a 1B Q4_K_M file's fused step on one Zen 4 core, CPU time)
        for (int o = 0; o < T::BYTES; o += 64) __builtin_prefetch(p + GQ_AHEAD + o, 0, 3);
        if (T::BLOCK == 256) gq_prepare_v<F>(p, &sup);
        if (T::BLOCK == 256 && T::MIN)  // the eight sub-blocks' minimum terms in one step
            for (int m = 0; m < MB; m++) {
                // x's sixteen half-block sums -> its eight block sums, in order
                const float *h = xsf + m * XF + blk * 16;
                const __m256 pairs = _mm256_hadd_ps(_mm256_loadu_ps(h), _mm256_loadu_ps(h + 8));
                const __m256 sums = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(pairs), 0xD8));
                kmins[m] = _mm256_fmadd_ps(_mm256_loadu_ps(sup.dmn), sums, kmins[m]);
            }
        if (F == GQ_Q6_K) {  // -32 times each 16 weights' scale times x's sum over them
            const __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(sup.dsc), _mm256_set1_ps(-32.f));
            const __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(sup.dsc + 8), _mm256_set1_ps(-32.f));
            for (int m = 0; m < MB; m++) {
                const float *h = xsf + m * XF + blk * 16;
                kmins[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(h), kmins[m]);
                kmins[m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(h + 8), kmins[m]);
            }
        }
        // Q4_K/Q5_K: each sub-block's scale times x's block scale, the eight of a super-block
        // in one product a row of x (one broadcast a sub-block instead of two and a product)
        float dd[MB][8];
        if (KMIN)
            for (int m = 0; m < MB; m++)
                _mm256_storeu_ps(dd[m], _mm256_mul_ps(_mm256_loadu_ps(sup.dsc), _mm256_loadu_ps(xs + m * XB + blk * 8)));
#pragma GCC unroll 8
        for (int j = 0; j < T::BLOCK / 32; j++) {
            const long b = blk * (T::BLOCK / 32) + j;
            gq_sub o;
            const __m256i q = gq_unpack_v<F, true>(p, j, &sup, &o);
            const __m256 sc = F == GQ_Q6_K ? _mm256_set_m128(_mm_set1_ps(o.sc[1]), _mm_set1_ps(o.sc[0]))
                                           : _mm256_set1_ps(o.sc[0]);
            // the formats with a minimum (and Q6_K, RAW) unpack to unsigned bytes, which the
            // byte products take as they are; the others' signs move onto x (|q| * (x with q's sign))
            const __m256i aq = UNS ? q : _mm256_sign_epi8(q, q);  // |q|, -128 read as 128 unsigned
            if (vmin) mnrow[b & (GQ_MIN_BLOCKS - 1)] = o.mn;  // b < GQ_MIN_BLOCKS (vmin): the mask only says so
            for (int m = 0; m < MB; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * XK + b * 32));
                const __m256 d = KMIN ? _mm256_broadcast_ss(dd[m] + j)
                                      : _mm256_mul_ps(sc, _mm256_broadcast_ss(xs + m * XB + b));
                __m256i dot = gq_dot(aq, UNS ? xv : _mm256_sign_epi8(xv, q));
                if (X2) {
                    const __m256i xv2 = _mm256_loadu_si256((const __m256i *)(xq + m * XK + K + b * 32));
                    dot = gq_dot_acc(_mm256_mullo_epi32(dot, _mm256_set1_epi32(254)), aq,
                                     UNS ? xv2 : _mm256_sign_epi8(xv2, q));
                }
                const int a = T::BLOCK == 32 ? par : (j & 1);
                acc[m][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[m][a]);
                if (MIN32 && !vmin) mins[m] += o.mn * (xsf[m * XF + 2 * b] + xsf[m * XF + 2 * b + 1]);
            }
        }
    };
    const long nblk = K / T::BLOCK;
    long blk = 0;
    if (T::BLOCK == 32) {
        for (; blk + 2 <= nblk; blk += 2) one(blk, 0), one(blk + 1, 1);
        if (blk < nblk) one(blk, 0);  // an odd count's last block
    } else {
        for (; blk < nblk; blk++) one(blk, 0);
    }
    if (vmin) {
        long b = 0;
        for (; b + 8 <= nblk; b += 8) {
            const __m256 mn = _mm256_loadu_ps(mnrow + (b & (GQ_MIN_BLOCKS - 8)));
            for (int m = 0; m < MB; m++) {  // x's sixteen half-block sums -> its eight block sums, in order
                const float *h = xsf + m * XF + 2 * b;
                const __m256 pairs = _mm256_hadd_ps(_mm256_loadu_ps(h), _mm256_loadu_ps(h + 8));
                const __m256 sums = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(pairs), 0xD8));
                kmins[m] = _mm256_fmadd_ps(mn, sums, kmins[m]);
            }
        }
        for (int r = 0; r < 7 && b < nblk; r++, b++)  // the last nblk mod 8 (at most 7)
            for (int m = 0; m < MB; m++)
                mins[m] += mnrow[b & (GQ_MIN_BLOCKS - 1)] * (xsf[m * XF + 2 * b] + xsf[m * XF + 2 * b + 1]);
    }
    for (int m = 0; m < MB; m++)
        y[m * ldy] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), kmins[m])) + mins[m] + bias;
}

#else  // plain C++

template <int F, int MB, int X2 = 0>
static inline void gq_row(const int8_t *xq, const float *xs, const float *xsf, long K, const uint8_t *row,
                          float bias, float *y, long ldy) {
    typedef gq_traits<F> T;
    const long nb = K / 32;
    const long XK = X2 ? 2 * K : K, XB = X2 ? 2 * nb : nb, XF = 2 * nb;
    float acc[MB] = {};
    gq_super sup;
    for (long blk = 0; blk < K / T::BLOCK; blk++) {
        const uint8_t *p = row + blk * T::BYTES;
        if (T::BLOCK == 256) gq_prepare<F>(p, &sup);
        for (int j = 0; j < T::BLOCK / 32; j++) {
            const long b = blk * (T::BLOCK / 32) + j;
            gq_sub o;
            int8_t q[32];
            gq_unpack_s<F>(p, j, &sup, q, &o);
            for (int m = 0; m < MB; m++) {
                const int8_t *xa = xq + m * XK + b * 32;
                int32_t s0 = 0, s1 = 0;
                for (int i = 0; i < 16; i++) s0 += (int32_t)q[i] * xa[i], s1 += (int32_t)q[i + 16] * xa[i + 16];
                if (X2) {  // 254 * the first row's sums + the second's, as the vector paths
                    const int8_t *xb = xa + K;
                    int32_t t0 = 0, t1 = 0;
                    for (int i = 0; i < 16; i++) t0 += (int32_t)q[i] * xb[i], t1 += (int32_t)q[i + 16] * xb[i + 16];
                    s0 = 254 * s0 + t0, s1 = 254 * s1 + t1;
                }
                acc[m] += xs[m * XB + b] * (o.sc[0] * (float)s0 + o.sc[1] * (float)s1);
                if (T::MIN) acc[m] += o.mn * (xsf[m * XF + 2 * b] + xsf[m * XF + 2 * b + 1]);
            }
        }
    }
    for (int m = 0; m < MB; m++) y[m * ldy] = acc[m] + bias;
}

#endif

// One weight row against every row of x, in groups of 4 x rows (the row is read from
// memory once, from L1 for the next groups).
template <int F, int X2 = 0>
static inline void gq_row_all(const int8_t *xq, const float *xs, const float *xsf, int M, long K, const uint8_t *row,
                              float b, float *yn, long ldy) {
    const long XK = X2 ? 2 * K : K, XB = X2 ? 2 * (K / 32) : K / 32, XF = 2 * (K / 32);
    int m = 0;
    for (; m + 4 <= M; m += 4)
        gq_row<F, 4, X2>(xq + m * XK, xs + m * XB, xsf + m * XF, K, row, b, yn + m * ldy, ldy);
    for (; m + 2 <= M; m += 2)
        gq_row<F, 2, X2>(xq + m * XK, xs + m * XB, xsf + m * XF, K, row, b, yn + m * ldy, ldy);
    for (; m < M; m++) gq_row<F, 1, X2>(xq + m * XK, xs + m * XB, xsf + m * XF, K, row, b, yn + m * ldy, ldy);
}

// Rows [n0, n1) through a table of offsets that are whole packed rows within GQ_ORDER rows
// of each other, each row once, computed in the order they lie in memory (each written to
// its own column): true of llama.cpp's Q/K order undone per head, which read in output
// order jumps between every other row and half a head on (measured: the 1B Q4_K_M fused
// step 1.046x on one core, its q and k 8% of the weights). Returns false, with nothing
// computed, for other tables (they are read in output order).
static const long GQ_ORDER = 4096;
template <int F, int X2>
static bool gq_rows_in_memory_order(const int8_t *xq, const float *xs, const float *xsf, int M, long K,
                                    const uint8_t *w, const long *rowoff, const float *bias, float *y, long ldy,
                                    long n0, long n1) {
    typedef gq_traits<F> T;
    const long ldw = K / T::BLOCK * T::BYTES;  // a packed row: the unit of the offsets
    if (n1 - n0 < 2) return false;
    long lo = rowoff[n0], hi = rowoff[n0];
    for (long n = n0; n < n1; n++) {
        if (rowoff[n] < 0 || rowoff[n] % ldw) return false;
        lo = rowoff[n] < lo ? rowoff[n] : lo;
        hi = rowoff[n] > hi ? rowoff[n] : hi;
    }
    const long first = lo / ldw, span = hi / ldw - first + 1;
    if (span > GQ_ORDER) return false;
    int32_t col[GQ_ORDER];  // memory row first + i -> its output row (-1: not in [n0, n1))
    for (long i = 0; i < span; i++) col[i] = -1;
    for (long n = n0; n < n1; n++) {
        int32_t *c = col + rowoff[n] / ldw - first;
        if (*c >= 0) return false;  // a row read twice: not a permutation
        *c = (int32_t)n;
    }
    for (long i = 0; i < span; i++) {
        const long n = col[i];
        if (n >= 0)
            gq_row_all<F, X2>(xq, xs, xsf, M, K, w + (first + i) * ldw, bias ? bias[n] : 0.f, y + n, ldy);
    }
    return true;
}

// Rows [n0, n1) of W against every row of x (gq_row_all each).
// X2: x as gq_quantize_x2 lays it out (two int8 rows on one scale per row of x).
template <int F, int X2 = 0>
static void gq_rows(const int8_t *xq, const float *xs, const float *xsf, int M, long K, const uint8_t *w, long ldw,
                    const long *rowoff, const float *bias, float *y, long ldy, long n0, long n1) {
    if (rowoff && gq_rows_in_memory_order<F, X2>(xq, xs, xsf, M, K, w, rowoff, bias, y, ldy, n0, n1)) return;
    for (long n = n0; n < n1; n++) {
        const uint8_t *row = w + (rowoff ? rowoff[n] : n * ldw);
        gq_row_all<F, X2>(xq, xs, xsf, M, K, row, bias ? bias[n] : 0.f, y + n, ldy);
    }
}

// gq_rows for x as gq_quantize (x2 0) or gq_quantize_x2 (x2 1) laid it out.
template <int F>
static void gq_rows_x(int x2, const int8_t *xq, const float *xs, const float *xsf, int M, long K, const uint8_t *w,
                      long ldw, const long *rowoff, const float *bias, float *y, long ldy, long n0, long n1) {
    if (x2)
        gq_rows<F, 1>(xq, xs, xsf, M, K, w, ldw, rowoff, bias, y, ldy, n0, n1);
    else
        gq_rows<F, 0>(xq, xs, xsf, M, K, w, ldw, rowoff, bias, y, ldy, n0, n1);
}

// Rows [n0, n1) dequantized into out (ldo floats per row): float32 of sc * q + mn.
template <int F>
static void gq_dequant_rows(const uint8_t *w, long ldw, const long *rowoff, long K, float *out, long ldo, long n0,
                            long n1) {
    typedef gq_traits<F> T;
    for (long n = n0; n < n1; n++) {
        const uint8_t *row = w + (rowoff ? rowoff[n] : n * ldw);
        float *o = out + (n - n0) * ldo;
        gq_super sup;
        for (long blk = 0; blk < K / T::BLOCK; blk++) {
            const uint8_t *p = row + blk * T::BYTES;
#if PE_Q8_ISA >= 1
            if (T::BLOCK == 256) gq_prepare_v<F>(p, &sup);
#else
            if (T::BLOCK == 256) gq_prepare<F>(p, &sup);
#endif
            for (int j = 0; j < T::BLOCK / 32; j++) {
                gq_sub s;
                float *d = o + blk * T::BLOCK + j * 32;
#if PE_Q8_ISA >= 1
                const __m256i q = gq_unpack_v<F>(p, j, &sup, &s);
                const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
                const __m256 mn = _mm256_set1_ps(s.mn);
                for (int h = 0; h < 4; h++) {  // eight weights at a time: sc * q + mn, one rounding
                    const __m128i part = h & 1 ? _mm_srli_si128(half[h >> 1], 8) : half[h >> 1];
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part));
                    _mm256_storeu_ps(d + 8 * h, _mm256_fmadd_ps(f, _mm256_set1_ps(s.sc[h >> 1]), mn));
                }
#else
                int8_t q[32];
                gq_unpack_s<F>(p, j, &sup, q, &s);
                for (int i = 0; i < 32; i++) d[i] = s.sc[i >> 4] * (float)q[i] + s.mn;
#endif
            }
        }
    }
}

// xsf[m, 2b + h] = xs[m, b] * the sum of half h (16 values) of block b's int8 values: the
// minimums' terms (the two halves summed) and Q6_K's offset (a scale per half).
static void gq_sums(const int8_t *xq, const float *xs, int M, long K, float *xsf) {
    const long nb = K / 32;
    for (int m = 0; m < M; m++)
        for (long b = 0; b < nb; b++) {
            const int8_t *q = xq + m * K + b * 32;
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < 16; i++) s0 += q[i], s1 += q[i + 16];
            xsf[m * 2 * nb + 2 * b] = xs[m * nb + b] * (float)s0;
            xsf[m * 2 * nb + 2 * b + 1] = xs[m * nb + b] * (float)s1;
        }
}

// x (M, K) -> xq/xs (q8_quantize) and their half-block sums xsf (2 * M * K / 32 floats).
static void gq_quantize(const float *x, long ldx, int M, long K, int8_t *xq, float *xs, float *xsf) {
    q8_quantize(x, ldx, M, K, xq, xs);
    gq_sums(xq, xs, M, K, xsf);
}

// int8x2 on one scale: x (M, K) -> for row m, two int8 rows at xq + 2mK (q1, then q2 K
// bytes on) and per block b of 32 xs[2m * nb + b] = d / 254, xsf[2m * nb + 2b + h] = xs *
// (254 * sum(q1) + sum(q2)) over half h of the block, where q1 is q8_quantize's (d = max|x| / 127) and q2 its rounding
// error r = x - d * q1 (|r| <= d / 2) in steps of d / 254, rounded half to even: |q2| <=
// 127, and x = xs * (254 * q1 + q2) to within d / 508 a value, the error of an int8 row of
// r on its own scale (max|r| / 127 <= d / 254), so a product on it is as close as on two
// rows with two scales (the earlier int8x2), for one conversion, scale and FMA a block.
static void gq_quantize_x2(const float *x, long ldx, int M, long K, int8_t *xq, float *xs, float *xsf) {
    const long nb = K / 32;
    for (int m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        int8_t *q1 = xq + 2 * m * K, *q2 = q1 + K;
        float *s = xs + 2 * m * nb, *sf = xsf + 2 * m * nb;
        q8_quantize(xm, ldx, 1, K, q1, s);
        for (long b = 0; b < nb; b++) {
            const float d = s[b];
            int32_t sum[2] = {0, 0};
            if (d == 0.f) {
                memset(q2 + b * 32, 0, 32);
            } else {
#if PE_Q8_ISA == 3  // the plain loop below sixteen values a step (a 2048-value row 5.8 -> 1.5 us)
                const __m512 vd = _mm512_set1_ps(d), inv = _mm512_set1_ps(254.f / d);
                for (int h = 0; h < 2; h++) {
                    const long k = b * 32 + 16 * h;
                    const __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q1 + k)));
                    __m512 t = _mm512_mul_ps(_mm512_fnmadd_ps(vd, _mm512_cvtepi32_ps(a), _mm512_loadu_ps(xm + k)), inv);
                    t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // half to even
                    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
                    const __m512i r = _mm512_cvtps_epi32(t);
                    _mm_storeu_si128((__m128i *)(q2 + k), _mm512_cvtepi32_epi8(r));
                    sum[h] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_mullo_epi32(a, _mm512_set1_epi32(254)), r));
                }
#else
                const float inv = 254.f / d;
                for (int i = 0; i < 32; i++) {
                    const long k = b * 32 + i;
                    float t = (xm[k] - d * (float)q1[k]) * inv;
                    t = (t + 12582912.f) - 12582912.f;  // round to nearest even (|t| <= 2^22)
                    t = t > 127.f ? 127.f : t < -127.f ? -127.f : t;
                    q2[k] = (int8_t)t;
                    sum[i >> 4] += 254 * q1[k] + q2[k];
                }
#endif
            }
            s[b] = d / 254.f;
            sf[2 * b] = s[b] * (float)sum[0];
            sf[2 * b + 1] = s[b] * (float)sum[1];
        }
    }
}

struct gq_job {
    int fmt, M;
    long K, N, ldw, ldy;
    const int8_t *xq;
    const float *xs, *xsf, *bias;
    const uint8_t *w;
    const long *rowoff;
    float *y;  // linear: (M, ldy); dequant: (rows, ldy)
    int dequant;
    int x2;  // linear: x as gq_quantize_x2 lays it out
};

#define GQ_DISPATCH(fmt, CALL)                 \
    switch (fmt) {                             \
        case GQ_Q4_0: CALL(GQ_Q4_0); break;    \
        case GQ_Q4_1: CALL(GQ_Q4_1); break;    \
        case GQ_Q5_0: CALL(GQ_Q5_0); break;    \
        case GQ_Q5_1: CALL(GQ_Q5_1); break;    \
        case GQ_Q8_0: CALL(GQ_Q8_0); break;    \
        case GQ_Q4_K: CALL(GQ_Q4_K); break;    \
        case GQ_Q5_K: CALL(GQ_Q5_K); break;    \
        case GQ_Q6_K: CALL(GQ_Q6_K); break;    \
    }

static void gq_task(void *arg, int tid, int nth) {
    const gq_job *j = (const gq_job *)arg;
    long n0, n1;
    pe_share(j->N, tid, nth, &n0, &n1);
#define GQ_LINEAR(F) \
    gq_rows_x<F>(j->x2, j->xq, j->xs, j->xsf, j->M, j->K, j->w, j->ldw, j->rowoff, j->bias, j->y, j->ldy, n0, n1)
#define GQ_DEQUANT(F) gq_dequant_rows<F>(j->w, j->ldw, j->rowoff, j->K, j->y + n0 * j->ldy, j->ldy, n0, n1)
    if (j->dequant) {
        GQ_DISPATCH(j->fmt, GQ_DEQUANT)
    } else {
        GQ_DISPATCH(j->fmt, GQ_LINEAR)
    }
#undef GQ_LINEAR
#undef GQ_DEQUANT
}

// Bytes of one row of K weights in format fmt (0 for a format gguf.h does not know).
static long gq_row_bytes(int fmt, long K) {
    switch (fmt) {
        case GQ_Q4_0: return K / 32 * gq_traits<GQ_Q4_0>::BYTES;
        case GQ_Q4_1: return K / 32 * gq_traits<GQ_Q4_1>::BYTES;
        case GQ_Q5_0: return K / 32 * gq_traits<GQ_Q5_0>::BYTES;
        case GQ_Q5_1: return K / 32 * gq_traits<GQ_Q5_1>::BYTES;
        case GQ_Q8_0: return K / 32 * gq_traits<GQ_Q8_0>::BYTES;
        case GQ_Q4_K: return K / 256 * gq_traits<GQ_Q4_K>::BYTES;
        case GQ_Q5_K: return K / 256 * gq_traits<GQ_Q5_K>::BYTES;
        case GQ_Q6_K: return K / 256 * gq_traits<GQ_Q6_K>::BYTES;
    }
    return 0;
}

// Rows [n0, n1) of a block matrix (rows evenly spaced unless rowoff) against M rows of x
// as gq_quantize (x2 0) or gq_quantize_x2 (x2 1) laid them out: a fused step's share of
// one projection (linear.h's PE_GGUF, PE_GGUFX2).
static void gq_seg_rows(int fmt, int x2, const int8_t *xq, const float *xs, const float *xsf, int M, long K,
                        const uint8_t *w, const long *rowoff, const float *bias, float *y, long ldy, long n0,
                        long n1) {
    const long ldw = gq_row_bytes(fmt, K);
#define GQ_SEG(F) gq_rows_x<F>(x2, xq, xs, xsf, M, K, w, ldw, rowoff, bias, y, ldy, n0, n1)
    GQ_DISPATCH(fmt, GQ_SEG)
#undef GQ_SEG
}

static int gq_block(int fmt) {
    switch (fmt) {
        case GQ_Q4_0: case GQ_Q4_1: case GQ_Q5_0: case GQ_Q5_1: case GQ_Q8_0: return 32;
        case GQ_Q4_K: case GQ_Q5_K: case GQ_Q6_K: return 256;
    }
    return 0;
}
