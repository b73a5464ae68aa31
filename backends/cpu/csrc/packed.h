// GGUF block weights repacked at load with sixteen rows interleaved, for the products of
// a decode step (a few rows of x): y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// gguf.h's kernels read a weight row as the file lays it out: each 32-weight block gives
// eight int32 lanes of partial sums that belong to one output, so every block and row of
// x pays a conversion, a scale and a float multiply-add for that one output, and the
// lanes are summed at the row's end. At one row of x that overhead, not the weight bytes,
// bounds the rate (docs/cpu.md, "Batch-1 decode on interleaved rows"). Here sixteen
// weight rows are interleaved at load so that every 32-bit lane of a 512-bit register
// belongs to one row: four consecutive weights of each of the sixteen rows lie side by
// side, and a vpdpbusd against x's four values broadcast adds them to the sixteen rows'
// sums at once. A block's conversion, scale and multiply-add then serve sixteen outputs,
// and the sums need no reduction at the end.
//
// The repacked bits are the file's (same quants, same f16 scales, the K formats' 6-bit
// scales widened to bytes), so the products equal gguf.h's up to the float32 sums' order;
// only the order in memory changes. A group of sixteen rows holds, per unit of the
// format's block (32 weights, 256 for the K formats):
//   Q4_0 (288 bytes): d[16] f16 | 4 x 64 bytes of nibbles: word i, lane r holds weights
//        4i..4i+3 of row r in the low nibbles and 16+4i..16+4i+3 in the high ones (the
//        file's own bytes 4i..4i+3 of the block: a dword copy)
//   Q4_1 (320 bytes): d[16] f16 | m[16] f16 (the minimums) | the nibbles as Q4_0's
//   Q5_0 (352 bytes): d[16] f16 | 64 bytes of high bits: lane r the block's 32 (bit l:
//        weight l) | the nibbles as Q4_0's
//   Q5_1 (384 bytes): d[16] f16 | m[16] f16 | the high bits as Q5_0's | the nibbles
//   Q8_0 (544 bytes): d[16] f16 | 8 x 64 bytes: word i, lane r weights 4i..4i+3 + 128
//        (unsigned for vpdpbusd; the 128 goes onto x's block sums)
//   Q4_K (2368 bytes): d[16] | dmin[16] (f16) | scales[8][16] | mins[8][16] (bytes) |
//        per 32-weight sub-block, the nibbles as Q4_0's
//   Q5_K (2880 bytes): Q4_K's, each sub-block's nibbles followed by its 64 bytes of high
//        bits as Q5_0's
//   Q6_K (3360 bytes): d[16] f16 | scales[16][16] int8 (one per 16 weights) | per
//        sub-block the low four bits as Q4_0's nibbles | per sub-block 2 x 64 bytes of the
//        high two bits: word h, lane r, byte t, bits 2k..2k+1 for weight 4(4h + k) + t
// Rows past N are zero (scales 0). Groups follow each other: group g (rows 16g..16g+15,
// each read through the row offsets, so llama.cpp's Q/K order is undone once here) is
// K / block units.
//
// x is gguf.h's: int8 per 32 values (q8_quantize) or int8x2 on one scale
// (gq_quantize_x2), with the formats' zero points taken off in int32 against x's exact
// block sums (gp_sums): Q4_0's 8, Q5_0's 16, Q8_0's 128, Q6_K's 32; the minimums of
// Q4_1, Q5_1, Q4_K and Q5_K against x's block sums in float. The AVX-512 VNNI path
// multiplies on 512 bits (GP_WIDE); AVX2 and AVX-VNNI on 256 bits, a group as two halves
// of eight rows (pmaddubsw + pmaddwd on AVX2, where Q8_0 stays signed: GP_Q8_SIGNED); the
// repacking is plain C++ on every path. Tested per
// format against float64 products of the exactly dequantized blocks
// (tests/test_cpu_gguf_packed.py).
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "parallel.h"

// GP_PACKED: the packed products run (GP_WIDE: on 512 bits, AVX-512 VNNI; else on 256 bits,
// AVX2 or AVX-VNNI, each group as two halves of eight rows).
#if PE_Q8_ISA == 3
#define GP_PACKED 1
#define GP_WIDE 1
#elif PE_Q8_ISA >= 1 && defined(__F16C__)
#define GP_PACKED 1
#define GP_WIDE 0
#else
#define GP_PACKED 0
#define GP_WIDE 0
#endif
// AVX2 without VNNI multiplies with pmaddubsw, whose pairs of products saturate at 32767:
// Q8_0's bytes stay signed there (|w| <= 128 against |x| <= 127), no zero point of 128.
#define GP_Q8_SIGNED (PE_Q8_ISA == 1)

// Weight rows in a group: one 32-bit lane of a zmm each.
#define GP_ROWS 16
// The longest row packed.
#define GP_MAX_K 32768

template <int F> struct gp_traits;
template <> struct gp_traits<GQ_Q4_0> { enum { UNIT = 32 + 256 }; };
template <> struct gp_traits<GQ_Q4_1> { enum { UNIT = 64 + 256 }; };
template <> struct gp_traits<GQ_Q5_0> { enum { UNIT = 32 + 64 + 256, QH = 32, QS = 96 }; };
template <> struct gp_traits<GQ_Q5_1> { enum { UNIT = 64 + 64 + 256, QH = 64, QS = 128 }; };
template <> struct gp_traits<GQ_Q8_0> { enum { UNIT = 32 + 512 }; };
template <> struct gp_traits<GQ_Q4_K> { enum { UNIT = 64 + 8 * 288, SUB = 288, SC = 64, MN = 64 + 16, QS = 64 + 32 }; };
template <> struct gp_traits<GQ_Q5_K> { enum { UNIT = 64 + 8 * 352, SUB = 352, SC = 64, MN = 64 + 16, QS = 64 + 32, QH = 64 + 32 + 256 }; };
template <> struct gp_traits<GQ_Q6_K> { enum { UNIT = 32 + 8 * 416, SUB = 416, SC = 32, QL = 32 + 32, QH = 32 + 32 + 256 }; };

// Bytes of one unit of a group (0: a format that is not packed).
static long gp_unit_bytes(int fmt) {
    switch (fmt) {
        case GQ_Q4_0: return gp_traits<GQ_Q4_0>::UNIT;
        case GQ_Q4_1: return gp_traits<GQ_Q4_1>::UNIT;
        case GQ_Q5_0: return gp_traits<GQ_Q5_0>::UNIT;
        case GQ_Q5_1: return gp_traits<GQ_Q5_1>::UNIT;
        case GQ_Q5_K: return gp_traits<GQ_Q5_K>::UNIT;
        case GQ_Q8_0: return gp_traits<GQ_Q8_0>::UNIT;
        case GQ_Q4_K: return gp_traits<GQ_Q4_K>::UNIT;
        case GQ_Q6_K: return gp_traits<GQ_Q6_K>::UNIT;
    }
    return 0;
}

// Bytes of a group of sixteen rows of K weights.
static long gp_group_bytes(int fmt, long K) { return K / gq_block(fmt) * gp_unit_bytes(fmt); }

// Sixteen bytes from four words of four: lane r of word i gets src's bytes 4i..4i+3
// (lanes of 4 bytes, words of 64).
static inline void gp_put4(uint8_t *word, int r, const uint8_t *four) { memcpy(word + 4 * r, four, 4); }

// Four bytes at p as one word (any alignment), and back.
static inline uint32_t gp_ld4(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline void gp_st4(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

// The 8 x 8 bit matrix of eight bytes transposed: bit i of byte j <- bit j of byte i.
static inline uint64_t gp_transpose8(uint64_t x) {
    uint64_t t;
    t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAULL, x = x ^ t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCULL, x = x ^ t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ULL, x = x ^ t ^ (t << 28);
    return x;
}

// Q4_K's (and Q5_K's) widened scales and mins and sub-block nibbles of block blk (its
// nibbles at qs) for row r of the unit at o.
template <int F>
static inline void gp_put_k(const uint8_t *blk, const uint8_t *qs, int r, uint8_t *o) {
    typedef gp_traits<F> P;
    const uint32_t m4 = 0x0F0F0F0Fu;
    memcpy(o + 2 * r, blk, 2);
    memcpy(o + 32 + 2 * r, blk + 2, 2);
    const uint8_t *p = blk + 4;  // the 6-bit scales and mins, as gq_prepare reads them
    for (int j = 0; j < 4; j++) {
        o[P::SC + P::SUB * j + r] = p[j] & 63;
        o[P::MN + P::SUB * j + r] = p[j + 4] & 63;
        o[P::SC + P::SUB * (j + 4) + r] = (p[j + 8] & 15) | ((p[j] >> 6) << 4);
        o[P::MN + P::SUB * (j + 4) + r] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
    // sub-block j's weights i are the low (even j) or high (odd j) nibbles of
    // bytes 32 (j / 2) + i; lane byte t of word i: weight 4i + t low, 16 + 4i + t high
    for (int j = 0; j < 8; j++) {
        const uint8_t *q = qs + 32 * (j / 2);
        uint8_t *oq = o + P::QS + P::SUB * j + 4 * r;
        for (int i = 0; i < 4; i++) {
            const uint32_t lo = gp_ld4(q + 4 * i), hi = gp_ld4(q + 16 + 4 * i);
            gp_st4(oq + 64 * i, j & 1 ? ((lo >> 4) & m4) | (hi & ~m4) : (lo & m4) | ((hi & m4) << 4));
        }
    }
}

// Rows 16g..16g+15 of W (row n at w + rowoff[n], or n * ldw) into one group at dst. Every
// byte of a group is written from its sixteen rows, so only a group with rows past N (its
// absent rows: scales 0, Q8_0's quants 0 stored + 128) is cleared first. The bytes move
// four at a time (a lane's four weights are four consecutive ones of a sub-block).
template <int F>
static void gp_repack_group(const uint8_t *w, long ldw, const long *rowoff, long N, long K, long g, uint8_t *dst) {
    typedef gq_traits<F> T;
    const long units = K / T::BLOCK, UNIT = gp_traits<F>::UNIT;
    if ((g + 1) * GP_ROWS > N) {
        memset(dst, 0, units * UNIT);
        if (F == GQ_Q8_0)
            for (long u = 0; u < units; u++) memset(dst + u * UNIT + 32, 0x80, 512);
    }
    const uint32_t m4 = 0x0F0F0F0Fu;
    for (int r = 0; r < GP_ROWS && g * GP_ROWS + r < N; r++) {
        const long n = g * GP_ROWS + r;
        const uint8_t *row = w + (rowoff ? rowoff[n] : n * ldw);
        for (long u = 0; u < units; u++) {
            const uint8_t *blk = row + u * T::BYTES;
            uint8_t *o = dst + u * UNIT;
            if (F == GQ_Q4_0) {
                memcpy(o + 2 * r, blk, 2);
                for (int i = 0; i < 4; i++) gp_put4(o + 32 + 64 * i, r, blk + 2 + 4 * i);
            } else if (F == GQ_Q4_1) {
                memcpy(o + 2 * r, blk, 2);
                memcpy(o + 32 + 2 * r, blk + 2, 2);
                for (int i = 0; i < 4; i++) gp_put4(o + 64 + 64 * i, r, blk + 4 + 4 * i);
            } else if (F == GQ_Q8_0) {
                memcpy(o + 2 * r, blk, 2);
                for (int i = 0; i < 8; i++) gp_st4(o + 32 + 64 * i + 4 * r, gp_ld4(blk + 2 + 4 * i) ^ 0x80808080u);
            } else if constexpr (F == GQ_Q5_0 || F == GQ_Q5_1) {
                typedef gp_traits<F> P;
                const int at = F == GQ_Q5_0 ? 2 : 4;  // qh, then the nibbles
                memcpy(o + 2 * r, blk, 2);
                if (F == GQ_Q5_1) memcpy(o + 32 + 2 * r, blk + 2, 2);
                memcpy(o + P::QH + 4 * r, blk + at, 4);
                for (int i = 0; i < 4; i++) gp_put4(o + P::QS + 64 * i, r, blk + at + 4 + 4 * i);
            } else if (F == GQ_Q4_K) {
                gp_put_k<GQ_Q4_K>(blk, blk + 16, r, o);
            } else if (F == GQ_Q5_K) {
                typedef gp_traits<GQ_Q5_K> P;
                gp_put_k<GQ_Q5_K>(blk, blk + 48, r, o);
                // the high bit of sub-block j's weight l is bit j of qh[l] (qh = blk + 16):
                // eight bytes at a time transposed, byte j then holds weights 8k..8k+7's
                for (int k = 0; k < 4; k++) {
                    uint64_t x;
                    memcpy(&x, blk + 16 + 8 * k, 8);
                    x = gp_transpose8(x);
                    for (int j = 0; j < 8; j++) o[P::QH + P::SUB * j + 4 * r + k] = (uint8_t)(x >> (8 * j));
                }
            } else {  // Q6_K: gq_unpack_s's sub-block j, unsigned (q + 32)
                typedef gp_traits<GQ_Q6_K> P;
                memcpy(o + 2 * r, blk + 208, 2);
                for (int k = 0; k < 16; k++) o[P::SC + P::SUB * (k / 2) + 16 * (k % 2) + r] = blk[192 + k];
                for (int j = 0; j < 8; j++) {
                    // weight i: low four bits (ql[i] >> 4 (grp / 2)) & 15, high two (qh[i] >> 2 grp) & 3
                    const int half = j / 4, grp = j % 4, sl = 4 * (grp >> 1), sh = 2 * grp;
                    const uint8_t *ql = blk + 64 * half + 32 * (grp & 1), *qh = blk + 128 + 32 * half;
                    uint8_t *ol = o + P::QL + P::SUB * j + 4 * r, *oh = o + P::QH + P::SUB * j + 4 * r;
                    for (int i = 0; i < 4; i++) {
                        const uint32_t lo = (gp_ld4(ql + 4 * i) >> sl) & m4, hi = (gp_ld4(ql + 16 + 4 * i) >> sl) & m4;
                        gp_st4(ol + 64 * i, lo | (hi << 4));
                    }
                    // byte t of word h: bits 2k..2k+1 hold weight 4 (4h + k) + t's high two bits
                    for (int h = 0; h < 2; h++) {
                        uint32_t b = 0;
                        for (int k = 0; k < 4; k++) b |= ((gp_ld4(qh + 16 * h + 4 * k) >> sh) & 0x03030303u) << (2 * k);
                        gp_st4(oh + 64 * h, b);
                    }
                }
            }
        }
    }
}

struct gp_repack_job {
    int fmt;
    const uint8_t *w;
    long ldw;
    const long *rowoff;
    long N, K;
    uint8_t *dst;
};

#define GP_DISPATCH(fmt, CALL)              \
    switch (fmt) {                          \
        case GQ_Q4_0: CALL(GQ_Q4_0); break; \
        case GQ_Q4_1: CALL(GQ_Q4_1); break; \
        case GQ_Q5_0: CALL(GQ_Q5_0); break; \
        case GQ_Q5_1: CALL(GQ_Q5_1); break; \
        case GQ_Q5_K: CALL(GQ_Q5_K); break; \
        case GQ_Q8_0: CALL(GQ_Q8_0); break; \
        case GQ_Q4_K: CALL(GQ_Q4_K); break; \
        case GQ_Q6_K: CALL(GQ_Q6_K); break; \
    }

static void gp_repack_task(void *arg, int tid, int nth) {
    const gp_repack_job *j = (const gp_repack_job *)arg;
    long g0, g1;
    pe_share((j->N + GP_ROWS - 1) / GP_ROWS, tid, nth, &g0, &g1);
    const long gb = gp_group_bytes(j->fmt, j->K);
#define GP_REPACK(F) \
    for (long g = g0; g < g1; g++) gp_repack_group<F>(j->w, j->ldw, j->rowoff, j->N, j->K, g, j->dst + g * gb);
    GP_DISPATCH(j->fmt, GP_REPACK)
#undef GP_REPACK
}

#if GP_PACKED

// The zero point gp_unpack's bytes carry.
template <int F> struct gp_zero {
    enum { Z = F == GQ_Q4_0 ? 8 : F == GQ_Q5_0 ? 16 : F == GQ_Q8_0 ? (GP_Q8_SIGNED ? 0 : 128) : F == GQ_Q6_K ? 32 : 0 };
};

#if GP_WIDE

// S[2b + h] = the exact int32 sum of half h of x's block b (int8x2: 254 * q1's + q2's),
// for one row of x as gguf.h lays it out (K values, the second int8 row K bytes on).
template <int X2>
static void gp_sums(const int8_t *xq, long K, int32_t *S) {
    for (long h = 0; h < K / 16; h++) {
        int32_t s = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(xq + 16 * h))));
        if (X2) s = 254 * s + _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(xq + K + 16 * h))));
        S[h] = s;
    }
}

// vpdpbusd of sixteen rows' four weights (u, unsigned) against x's four int8 values at p, broadcast.
static inline __m512i gp_dot(__m512i acc, __m512i u, const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(four));
}

// The sixteen rows' sums of words [C0, C1) of a sub-block against one x row at x, in two
// independent chains (each vpdpbusd waits for its accumulator), added at the end.
template <int C0, int C1>
static inline __m512i gp_row_chains(const __m512i *U, const int8_t *x) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = C0; c < C1; c += 2) {
        a = gp_dot(a, U[c], x + 4 * c);
        if (c + 1 < C1) b = gp_dot(b, U[c + 1], x + 4 * c + 4);
    }
    return _mm512_add_epi32(a, b);
}

// The same against the x row(s) at x1 (X2: 254 * x1's + x2's, the int8x2 row on one scale).
template <int X2, int C0, int C1>
static inline __m512i gp_block_dot(const __m512i *U, const int8_t *x1, const int8_t *x2) {
    const __m512i d = gp_row_chains<C0, C1>(U, x1);
    if (!X2) return d;
    return _mm512_add_epi32(_mm512_mullo_epi32(d, _mm512_set1_epi32(254)), gp_row_chains<C0, C1>(U, x2));
}

// Four words of nibbles -> U[0..3] the low ones (weights 4c..4c+3), U[4..7] the high ones.
static inline void gp_nibbles(const uint8_t *p, __m512i *U) {
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int i = 0; i < 4; i++) {
        const __m512i v = _mm512_loadu_si512(p + 64 * i);
        U[i] = _mm512_and_si512(v, m4);
        U[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
}

// The high bits (64 bytes at p: lane r's 32, bit l for weight l) onto the nibbles: U[c]'s
// byte t of each lane (weight 4c + t) gets 16 where bit 4c + t is set.
static inline void gp_high_bits(const uint8_t *p, __m512i *U) {
    const __m512i h = _mm512_loadu_si512(p), sixteen = _mm512_set1_epi8(16);
    for (int c = 0; c < 8; c++) {
        // every byte of a lane gets its byte c / 2, then byte t is tested for bit 4 (c % 2) + t
        const char b = (char)(c / 2);
        const __m512i idx = _mm512_broadcast_i32x4(_mm_setr_epi8(b, b, b, b, b + 4, b + 4, b + 4, b + 4, b + 8, b + 8,
                                                                 b + 8, b + 8, b + 12, b + 12, b + 12, b + 12));
        const int s = 4 * (c % 2);
        const __m512i bit = _mm512_set1_epi32((int)((1u << s) | (2u << (s + 8)) | (4u << (s + 16)) | (8u << (s + 24))));
        const __mmask64 k = _mm512_test_epi8_mask(_mm512_shuffle_epi8(h, idx), bit);
        U[c] = _mm512_mask_add_epi8(U[c], k, U[c], sixteen);
    }
}

// Sixteen f16 -> float.
static inline __m512 gp_f16x16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }


// Sub-block j (32 weights) of the unit at o as eight words of unsigned bytes: U[c], lane
// r = weights 4c..4c+3 of row r (u = q + the format's zero point: 8, 128, 0 or 32).
template <int F>
static inline void gp_unpack(const uint8_t *o, int j, __m512i *U) {
    if (F == GQ_Q4_0) {
        gp_nibbles(o + 32, U);
    } else if (F == GQ_Q4_1) {
        gp_nibbles(o + 64, U);
    } else if constexpr (F == GQ_Q5_0 || F == GQ_Q5_1) {
        gp_nibbles(o + gp_traits<F>::QS, U);
        gp_high_bits(o + gp_traits<F>::QH, U);
    } else if (F == GQ_Q5_K) {
        typedef gp_traits<GQ_Q5_K> P;
        gp_nibbles(o + P::QS + P::SUB * j, U);
        gp_high_bits(o + P::QH + P::SUB * j, U);
    } else if (F == GQ_Q8_0) {
        for (int c = 0; c < 8; c++) U[c] = _mm512_loadu_si512(o + 32 + 64 * c);
    } else if (F == GQ_Q4_K) {
        gp_nibbles(o + gp_traits<GQ_Q4_K>::QS + gp_traits<GQ_Q4_K>::SUB * j, U);
    } else {  // Q6_K: the two high bits of word c = 4h + k are bits 2k..2k+1 of h's bytes, moved to 4..5
        typedef gp_traits<GQ_Q6_K> P;
        gp_nibbles(o + P::QL + P::SUB * j, U);
        const __m512i m2 = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_loadu_si512(o + P::QH + P::SUB * j + 64 * h);
            U[4 * h] = _mm512_or_si512(U[4 * h], _mm512_and_si512(_mm512_slli_epi16(v, 4), m2));
            U[4 * h + 1] = _mm512_or_si512(U[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(v, 2), m2));
            U[4 * h + 2] = _mm512_or_si512(U[4 * h + 2], _mm512_and_si512(v, m2));
            U[4 * h + 3] = _mm512_or_si512(U[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(v, 2), m2));
        }
    }
}


// Sixteen bytes at p (unsigned, or signed with SIGNED) times d, as floats.
template <bool SIGNED>
static inline __m512 gp_scale16(const uint8_t *p, __m512 d) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v)), d);
}

// The rows' scales of sub-block j of the unit at o (d its f16 scales as floats): s[0] for
// weights 0-15, s[1] for 16-31 (the same but for Q6_K), and the minimums mn (Q4_K: w = sc
// u + mn, mn = -dmin m; Q4_1: its m; 0 for the others, whose zero points gp_zero carries).
template <int F>
static inline void gp_scales(const uint8_t *o, int j, __m512 d, __m512 *s, __m512 *mn) {
    if constexpr (F == GQ_Q4_K || F == GQ_Q5_K) {
        typedef gp_traits<F> P;
        s[0] = s[1] = gp_scale16<false>(o + P::SC + P::SUB * j, d);
        *mn = gp_scale16<false>(o + P::MN + P::SUB * j, _mm512_sub_ps(_mm512_setzero_ps(), gp_f16x16(o + 32)));
    } else if (F == GQ_Q4_1 || F == GQ_Q5_1) {
        s[0] = s[1] = d;
        *mn = gp_f16x16(o + 32);
    } else if (F == GQ_Q6_K) {
        typedef gp_traits<GQ_Q6_K> P;
        s[0] = gp_scale16<true>(o + P::SC + P::SUB * j, d);
        s[1] = gp_scale16<true>(o + P::SC + P::SUB * j + 16, d);
        *mn = _mm512_setzero_ps();
    } else {
        s[0] = s[1] = d;
        *mn = _mm512_setzero_ps();
    }
}

// MB rows of x (with their half sums S, 2 * K / 32 a row) against one group at pk: the
// sixteen rows' products into out[m * 16 + r]. Per sub-block and row of x: the zero point
// off the int32 sums against x's exact half sums, one conversion, and one multiply-add a
// scale (two for Q6_K); Q4_K's minimum against x's block sum in float.
template <int F, int MB, int X2>
static inline void gp_group(const uint8_t *pk, long K, const int8_t *xq, const float *xs, const float *xsf,
                            const int32_t *S, float *out) {
    typedef gq_traits<F> T;
    const long nb = K / 32, XK = X2 ? 2 * K : K, XB = X2 ? 2 * nb : nb, XF = 2 * nb;
    const long UNIT = gp_traits<F>::UNIT;
    const int32_t Z = gp_zero<F>::Z;
    __m512 acc[MB];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    for (long unit = 0; unit < K / T::BLOCK; unit++) {
        const uint8_t *o = pk + unit * UNIT;
        // no software prefetch: a group is one sequential stream, which the hardware
        // prefetchers follow (1 to 16 KiB ahead measured slower on a 1B Q4_K_M file's pass)
        const __m512 d = gp_f16x16(o);
#pragma GCC unroll 8
        for (int j = 0; j < T::BLOCK / 32; j++) {
            const long b = unit * (T::BLOCK / 32) + j;
            __m512i U[8];
            gp_unpack<F>(o, j, U);
            __m512 s[2], mn;
            gp_scales<F>(o, j, d, s, &mn);
            for (int m = 0; m < MB; m++) {
                const int8_t *x1 = xq + m * XK + b * 32;
                const int32_t *Sb = S + m * XF + 2 * b;
                const __m512 xb = _mm512_set1_ps(xs[m * XB + b]);
                if (F == GQ_Q6_K) {  // a scale per 16 weights: the halves apart
                    __m512i da = gp_block_dot<X2, 0, 4>(U, x1, x1 + K), db = gp_block_dot<X2, 4, 8>(U, x1, x1 + K);
                    da = _mm512_sub_epi32(da, _mm512_set1_epi32(Z * Sb[0]));
                    db = _mm512_sub_epi32(db, _mm512_set1_epi32(Z * Sb[1]));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(da), _mm512_mul_ps(s[0], xb), acc[m]);
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(db), _mm512_mul_ps(s[1], xb), acc[m]);
                } else {
                    __m512i dot = gp_block_dot<X2, 0, 8>(U, x1, x1 + K);
                    if (Z) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(Z * (Sb[0] + Sb[1])));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[0], xb), acc[m]);
                    if (gq_traits<F>::MIN)  // the minimum's term against x's block sum
                        acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsf[m * XF + 2 * b] + xsf[m * XF + 2 * b + 1]), acc[m]);
                }
            }
        }
    }
    for (int m = 0; m < MB; m++) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

// One group at pk into tile.h's int16 tile (gt_pack's layout: per 32-weight block, word p
// lane r = the int16 pair of weights 2p, 2p + 1 of row r; sc NS vectors of 16 scales a
// block, mn 16 minimums a block where the format has them), from registers: no transpose,
// the interleaving is already the packed layout's.
template <int F>
static inline void gp_tile(const uint8_t *pk, long K, int32_t *wt, float *sc, float *mn) {
    typedef gq_traits<F> T;
    const int NS = F == GQ_Q6_K ? 2 : 1;
    const long UNIT = gp_traits<F>::UNIT;
    // bytes 0, 1 (then 2, 3) of each lane, zero-extended to 16 bits
    const __m512i lo2 = _mm512_broadcast_i32x4(_mm_set_epi32((int)0x800D800C, (int)0x80098008, (int)0x80058004, (int)0x80018000));
    const __m512i hi2 = _mm512_broadcast_i32x4(_mm_set_epi32((int)0x800F800E, (int)0x800B800A, (int)0x80078006, (int)0x80038002));
    const __m512i zero = _mm512_set1_epi16((short)gp_zero<F>::Z);
    for (long unit = 0; unit < K / T::BLOCK; unit++) {
        const uint8_t *o = pk + unit * UNIT;
        const __m512 d = gp_f16x16(o);
        for (int j = 0; j < T::BLOCK / 32; j++) {
            const long b = unit * (T::BLOCK / 32) + j;
            __m512i U[8];
            gp_unpack<F>(o, j, U);
            int32_t *wb = wt + b * 256;
            for (int c = 0; c < 8; c++) {
                _mm512_store_si512((__m512i *)(wb + 32 * c), _mm512_sub_epi16(_mm512_shuffle_epi8(U[c], lo2), zero));
                _mm512_store_si512((__m512i *)(wb + 32 * c + 16), _mm512_sub_epi16(_mm512_shuffle_epi8(U[c], hi2), zero));
            }
            __m512 s[2], m;
            gp_scales<F>(o, j, d, s, &m);
            _mm512_store_ps(sc + b * NS * 16, s[0]);
            if (NS == 2) _mm512_store_ps(sc + b * NS * 16 + 16, s[1]);
            if (T::MIN) _mm512_store_ps(mn + b * 16, m);
        }
    }
}

// gp_tile for the formats that pack; nothing for the others (never packed: gp_packs).
template <int F>
static inline void gp_tile_of(const uint8_t *pk, long K, int32_t *wt, float *sc, float *mn) {
    if constexpr (F == GQ_Q4_0 || F == GQ_Q4_1 || F == GQ_Q5_0 || F == GQ_Q5_1 || F == GQ_Q8_0 || F == GQ_Q4_K ||
                  F == GQ_Q5_K || F == GQ_Q6_K)
        gp_tile<F>(pk, K, wt, sc, mn);
}

#else  // 256 bits: AVX2 (pmaddubsw + pmaddwd) or AVX-VNNI (vpdpbusd)

// S[2b + h] as gp_sums above (plain C++: a row of x's sums are a small part of a product).
template <int X2>
static void gp_sums(const int8_t *xq, long K, int32_t *S) {
    for (long h = 0; h < K / 16; h++) {
        int32_t s = 0, s2 = 0;
        for (int i = 0; i < 16; i++) s += xq[16 * h + i];
        if (X2)
            for (int i = 0; i < 16; i++) s2 += xq[K + 16 * h + i];
        S[h] = X2 ? 254 * s + s2 : s;
    }
}

#if PE_Q8_ISA == 2
// Words [C0, C1) of eight rows' four unsigned weights each against x's four int8 values
// at 4c, broadcast: vpdpbusd (AVX-VNNI, or AVX-512 VNNI with VL).
template <int F, int C0, int C1>
static inline __m256i gp_row_dot(const __m256i *U, const int8_t *x) {
    __m256i d = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = C0; c < C1; c++) {
        int32_t four;
        memcpy(&four, x + 4 * c, 4);
#if defined(__AVXVNNI__)
        d = _mm256_dpbusd_avx_epi32(d, U[c], _mm256_set1_epi32(four));
#else
        d = _mm256_dpbusd_epi32(d, U[c], _mm256_set1_epi32(four));
#endif
    }
    return d;
}
#else
// The same on AVX2: pmaddubsw's pairs of words c..c+G-1 summed in 16 bits before one
// pmaddwd: a pair is at most 2 * 127 * (15, 31, 63) for 4-, 5- and 6-bit quants, so G of
// them stay within 32767 (8 * 3810, 4 * 7874, 2 * 16002); Q8_0's signed bytes (|w| <= 128
// against x with w's sign: 32512) one at a time.
template <int F> struct gp_words16 {
    enum { G = F == GQ_Q4_0 || F == GQ_Q4_1 || F == GQ_Q4_K ? 8 : F == GQ_Q5_0 || F == GQ_Q5_1 || F == GQ_Q5_K ? 4
               : F == GQ_Q6_K ? 2 : 1 };
};

template <int F, int C0, int C1>
static inline __m256i gp_row_dot(const __m256i *U, const int8_t *x) {
    constexpr bool SIGNED = F == GQ_Q8_0 && GP_Q8_SIGNED;
    constexpr int G = gp_words16<F>::G;
    __m256i d = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = C0; c < C1; c += G) {
        __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < G && c + g < C1; g++) {
            int32_t four;
            memcpy(&four, x + 4 * (c + g), 4);
            const __m256i xv = _mm256_set1_epi32(four);
            const __m256i u = U[c + g];
            s16 = _mm256_add_epi16(s16, SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(xv, u))
                                               : _mm256_maddubs_epi16(u, xv));
        }
        d = _mm256_add_epi32(d, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
    }
    return d;
}
#endif

// Words [C0, C1) against a row of x (X2: 254 * x1's + x2's, the int8x2 row on one scale).
template <int F, int X2, int C0, int C1>
static inline __m256i gp_block_dot(const __m256i *U, const int8_t *x1, const int8_t *x2) {
    __m256i d = gp_row_dot<F, C0, C1>(U, x1);
    if (X2) d = _mm256_add_epi32(_mm256_mullo_epi32(d, _mm256_set1_epi32(254)), gp_row_dot<F, C0, C1>(U, x2));
    return d;
}

// Half h (rows 8h..8h+7) of four words of nibbles: U[0..3] the low ones, U[4..7] the high.
static inline void gp_nibbles(const uint8_t *p, int h, __m256i *U) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int i = 0; i < 4; i++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * i + 32 * h));
        U[i] = _mm256_and_si256(v, m4);
        U[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
}

// Half h of the fifth bits (as the 512-bit gp_high_bits), onto the nibbles as 16.
static inline void gp_high_bits(const uint8_t *p, int h, __m256i *U) {
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 32 * h)), sixteen = _mm256_set1_epi8(16);
    for (int c = 0; c < 8; c++) {
        const char b = (char)(c / 2);
        const __m256i idx = _mm256_broadcastsi128_si256(_mm_setr_epi8(b, b, b, b, b + 4, b + 4, b + 4, b + 4, b + 8, b + 8,
                                                                      b + 8, b + 8, b + 12, b + 12, b + 12, b + 12));
        const int s = 4 * (c % 2);
        const __m256i bit = _mm256_set1_epi32((int)((1u << s) | (2u << (s + 8)) | (4u << (s + 16)) | (8u << (s + 24))));
        const __m256i t = _mm256_and_si256(_mm256_shuffle_epi8(hb, idx), bit);
        U[c] = _mm256_or_si256(U[c], _mm256_and_si256(_mm256_cmpeq_epi8(t, bit), sixteen));
    }
}

// Eight f16 -> float.
static inline __m256 gp_f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

// Sub-block j of the unit at o, half h, as gp_unpack above.
template <int F>
static inline void gp_unpack(const uint8_t *o, int j, int h, __m256i *U) {
    if constexpr (F == GQ_Q4_0) {
        gp_nibbles(o + 32, h, U);
    } else if constexpr (F == GQ_Q4_1) {
        gp_nibbles(o + 64, h, U);
    } else if constexpr (F == GQ_Q5_0 || F == GQ_Q5_1) {
        gp_nibbles(o + gp_traits<F>::QS, h, U);
        gp_high_bits(o + gp_traits<F>::QH, h, U);
    } else if constexpr (F == GQ_Q5_K) {
        typedef gp_traits<GQ_Q5_K> P;
        gp_nibbles(o + P::QS + P::SUB * j, h, U);
        gp_high_bits(o + P::QH + P::SUB * j, h, U);
    } else if constexpr (F == GQ_Q8_0) {
        for (int c = 0; c < 8; c++) {
            U[c] = _mm256_loadu_si256((const __m256i *)(o + 32 + 64 * c + 32 * h));
            if (GP_Q8_SIGNED) U[c] = _mm256_xor_si256(U[c], _mm256_set1_epi8((char)0x80));
        }
    } else if constexpr (F == GQ_Q4_K) {
        gp_nibbles(o + gp_traits<GQ_Q4_K>::QS + gp_traits<GQ_Q4_K>::SUB * j, h, U);
    } else {  // Q6_K
        typedef gp_traits<GQ_Q6_K> P;
        gp_nibbles(o + P::QL + P::SUB * j, h, U);
        const __m256i m2 = _mm256_set1_epi8(0x30);
        for (int k = 0; k < 2; k++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(o + P::QH + P::SUB * j + 64 * k + 32 * h));
            U[4 * k] = _mm256_or_si256(U[4 * k], _mm256_and_si256(_mm256_slli_epi16(v, 4), m2));
            U[4 * k + 1] = _mm256_or_si256(U[4 * k + 1], _mm256_and_si256(_mm256_slli_epi16(v, 2), m2));
            U[4 * k + 2] = _mm256_or_si256(U[4 * k + 2], _mm256_and_si256(v, m2));
            U[4 * k + 3] = _mm256_or_si256(U[4 * k + 3], _mm256_and_si256(_mm256_srli_epi16(v, 2), m2));
        }
    }
}

// Eight bytes at p (unsigned, or signed) times d, as floats.
template <bool SIGNED>
static inline __m256 gp_scale8(const uint8_t *p, __m256 d) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v)), d);
}

// Half h of gp_scales above (d: that half's f16 scales as floats).
template <int F>
static inline void gp_scales(const uint8_t *o, int j, int h, __m256 d, __m256 *s, __m256 *mn) {
    if constexpr (F == GQ_Q4_K || F == GQ_Q5_K) {
        typedef gp_traits<F> P;
        s[0] = s[1] = gp_scale8<false>(o + P::SC + P::SUB * j + 8 * h, d);
        *mn = gp_scale8<false>(o + P::MN + P::SUB * j + 8 * h, _mm256_sub_ps(_mm256_setzero_ps(), gp_f16x8(o + 32 + 16 * h)));
    } else if constexpr (F == GQ_Q4_1 || F == GQ_Q5_1) {
        s[0] = s[1] = d;
        *mn = gp_f16x8(o + 32 + 16 * h);
    } else if constexpr (F == GQ_Q6_K) {
        typedef gp_traits<GQ_Q6_K> P;
        s[0] = gp_scale8<true>(o + P::SC + P::SUB * j + 8 * h, d);
        s[1] = gp_scale8<true>(o + P::SC + P::SUB * j + 16 + 8 * h, d);
        *mn = _mm256_setzero_ps();
    } else {
        s[0] = s[1] = d;
        *mn = _mm256_setzero_ps();
    }
}

// Half h (rows 8h..8h+7) of sub-block j (block b of x) of the unit at o (d: that half's
// f16 scales as floats) against MB rows of x, into acc[0..MB).
template <int F, int MB, int X2>
static inline void gp_half(const uint8_t *o, int j, int h, __m256 d, long b, long K, const int8_t *xq, const float *xs,
                           const float *xsf, const int32_t *S, __m256 *acc) {
    const long nb = K / 32, XK = X2 ? 2 * K : K, XB = X2 ? 2 * nb : nb, XF = 2 * nb;
    const int32_t Z = gp_zero<F>::Z;
    __m256i U[8];
    gp_unpack<F>(o, j, h, U);
    __m256 s[2], mn;
    gp_scales<F>(o, j, h, d, s, &mn);
    for (int m = 0; m < MB; m++) {
        const int8_t *x1 = xq + m * XK + b * 32;
        const int32_t *Sb = S + m * XF + 2 * b;
        const __m256 xb = _mm256_set1_ps(xs[m * XB + b]);
        if (F == GQ_Q6_K) {
            __m256i da = gp_block_dot<F, X2, 0, 4>(U, x1, x1 + K), db = gp_block_dot<F, X2, 4, 8>(U, x1, x1 + K);
            da = _mm256_sub_epi32(da, _mm256_set1_epi32(Z * Sb[0]));
            db = _mm256_sub_epi32(db, _mm256_set1_epi32(Z * Sb[1]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(da), _mm256_mul_ps(s[0], xb), acc[m]);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(db), _mm256_mul_ps(s[1], xb), acc[m]);
        } else {
            __m256i dot = gp_block_dot<F, X2, 0, 8>(U, x1, x1 + K);
            if (Z) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(Z * (Sb[0] + Sb[1])));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s[0], xb), acc[m]);
            if (gq_traits<F>::MIN)
                acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsf[m * XF + 2 * b] + xsf[m * XF + 2 * b + 1]), acc[m]);
        }
    }
}

// gp_group above on 256 bits. Up to two rows of x: both halves of each sub-block in turn,
// the group read once in order; more rows (whose accumulators would not fit the sixteen
// registers beside a half's eight words): the two halves one after the other, the second
// reading the group again from cache.
template <int F, int MB, int X2>
static inline void gp_group(const uint8_t *pk, long K, const int8_t *xq, const float *xs, const float *xsf,
                            const int32_t *S, float *out) {
    typedef gq_traits<F> T;
    const long UNIT = gp_traits<F>::UNIT;
    if constexpr (MB <= 2) {
        __m256 acc[2][MB];
        for (int h = 0; h < 2; h++)
            for (int m = 0; m < MB; m++) acc[h][m] = _mm256_setzero_ps();
        for (long unit = 0; unit < K / T::BLOCK; unit++) {
            const uint8_t *o = pk + unit * UNIT;
            const __m256 d0 = gp_f16x8(o), d1 = gp_f16x8(o + 16);
            for (int j = 0; j < T::BLOCK / 32; j++) {
                const long b = unit * (T::BLOCK / 32) + j;
                gp_half<F, MB, X2>(o, j, 0, d0, b, K, xq, xs, xsf, S, acc[0]);
                gp_half<F, MB, X2>(o, j, 1, d1, b, K, xq, xs, xsf, S, acc[1]);
            }
        }
        for (int h = 0; h < 2; h++)
            for (int m = 0; m < MB; m++) _mm256_storeu_ps(out + 16 * m + 8 * h, acc[h][m]);
    } else {
        for (int h = 0; h < 2; h++) {
            __m256 acc[MB];
            for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
            for (long unit = 0; unit < K / T::BLOCK; unit++) {
                const uint8_t *o = pk + unit * UNIT;
                const __m256 d = gp_f16x8(o + 16 * h);
                for (int j = 0; j < T::BLOCK / 32; j++)
                    gp_half<F, MB, X2>(o, j, h, d, unit * (T::BLOCK / 32) + j, K, xq, xs, xsf, S, acc);
            }
            for (int m = 0; m < MB; m++) _mm256_storeu_ps(out + 16 * m + 8 * h, acc[m]);
        }
    }
}

#endif  // GP_WIDE

// This thread's int32 half sums of x, grown to the most rows and columns it has met.
static inline int32_t *gp_scratch(long n) {
    static thread_local int32_t *buf = nullptr;
    static thread_local long have = 0;
    if (n > have) {
        free(buf);
        buf = (int32_t *)malloc(n * sizeof(int32_t));
        have = buf ? n : 0;
    }
    return buf;
}

// Rows [n0, n1) of a packed matrix against every row of x (gguf.h's layout: int8, or
// int8x2 with X2): each group of sixteen rows read once from memory, every four rows of
// x taking it in turn from cache (groups n0 / 16 .. (n1 - 1) / 16).
template <int F, int X2>
static void gp_rows(const int8_t *xq, const float *xs, const float *xsf, int M, long K, const uint8_t *packed,
                    const float *bias, float *y, long ldy, long n0, long n1) {
    const long nb = K / 32, XK = X2 ? 2 * K : K, XB = X2 ? 2 * nb : nb, XF = 2 * nb;
    const long gb = gp_group_bytes(F, K);
    int32_t *S = gp_scratch(M * XF);
    if (!S) abort();
    for (int m = 0; m < M; m++) gp_sums<X2>(xq + m * XK, K, S + m * XF);
    float out[4 * GP_ROWS];
    for (long g = n0 / GP_ROWS; g * GP_ROWS < n1; g++) {
        const uint8_t *pk = packed + g * gb;
        const long lo = g * GP_ROWS > n0 ? g * GP_ROWS : n0, hi = (g + 1) * GP_ROWS < n1 ? (g + 1) * GP_ROWS : n1;
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int mb = M - m0 < 4 ? M - m0 : 4;
            const int8_t *xm = xq + m0 * XK;
            const float *xsm = xs + m0 * XB, *xfm = xsf + m0 * XF;
            const int32_t *Sm = S + m0 * XF;
            if (mb == 4) gp_group<F, 4, X2>(pk, K, xm, xsm, xfm, Sm, out);
            else if (mb == 3) gp_group<F, 3, X2>(pk, K, xm, xsm, xfm, Sm, out);
            else if (mb == 2) gp_group<F, 2, X2>(pk, K, xm, xsm, xfm, Sm, out);
            else gp_group<F, 1, X2>(pk, K, xm, xsm, xfm, Sm, out);
            for (int m = 0; m < mb; m++)
                for (long n = lo; n < hi; n++)
                    y[(m0 + m) * ldy + n] = out[16 * m + (n - g * GP_ROWS)] + (bias ? bias[n] : 0.f);
        }
    }
}

// gp_rows for format fmt and x as gq_quantize (x2 0) or gq_quantize_x2 (x2 1) laid it out.
static void gp_seg_rows(int fmt, int x2, const int8_t *xq, const float *xs, const float *xsf, int M, long K,
                        const uint8_t *packed, const float *bias, float *y, long ldy, long n0, long n1) {
#define GP_SEG(F)                                                                  \
    if (x2)                                                                        \
        gp_rows<F, 1>(xq, xs, xsf, M, K, packed, bias, y, ldy, n0, n1);            \
    else                                                                           \
        gp_rows<F, 0>(xq, xs, xsf, M, K, packed, bias, y, ldy, n0, n1);
    GP_DISPATCH(fmt, GP_SEG)
#undef GP_SEG
}

struct gp_job {
    int fmt, M, x2;
    long K, N, ldy;
    const int8_t *xq;
    const float *xs, *xsf, *bias;
    const uint8_t *packed;
    float *y;
};

static void gp_task(void *arg, int tid, int nth) {
    const gp_job *j = (const gp_job *)arg;
    long g0, g1;
    pe_share((j->N + GP_ROWS - 1) / GP_ROWS, tid, nth, &g0, &g1);
    const long n1 = g1 * GP_ROWS < j->N ? g1 * GP_ROWS : j->N;
    if (g0 < g1) gp_seg_rows(j->fmt, j->x2, j->xq, j->xs, j->xsf, j->M, j->K, j->packed, j->bias, j->y, j->ldy, g0 * GP_ROWS, n1);
}

#endif  // GP_PACKED

// Whether matrices of format fmt and K columns are packed (on a path with the kernels).
static inline int gp_packs(int fmt, long K) {
    return GP_PACKED && gp_unit_bytes(fmt) && K % gq_block(fmt) == 0 && K <= GP_MAX_K;
}
