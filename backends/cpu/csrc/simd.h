// The vector types of the ISA path the library is compiled for, and the loads and
// conversions every kernel shares: float32, int8 and bfloat16 lanes, bfloat16 rounding,
// horizontal sums and a vector exp.
//
// Built at first use with the host's compiler and -march=native, or a lower target forced
// by the engine option isa (see kernels.py): GCC's vector extensions become AVX-512, AVX2
// or SSE code for that target; pe_isa says which, pe_vector_width how many floats a lane
// vector holds (VW).
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int8_t vb __attribute__((vector_size(VW)));

static inline vf load_f(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf load_w(const float *p) { return load_f(p); }
// int8 -> float32 lanes through the sign-extending conversions (GCC 12 turns
// __builtin_convertvector on these types into one scalar conversion per lane).
static inline vf load_w(const int8_t *p) {
#if VW == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vf);
#endif
}
static inline float wv(const float *p) { return *p; }
static inline float wv(const int8_t *p) { return (float)*p; }

// float32 -> bfloat16 with round-to-nearest-even, as torch's .to(bfloat16) (the same bits).
static inline uint16_t to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);  // NaN stays a (quiet) NaN
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

// bfloat16 weights (option weight_dtype): the upper half of each float32 weight's bits,
// rounded to nearest even when stored; widened here exactly (a zero-extend and a shift),
// so the products are float32 products of the rounded weights. Half the bytes to stream.
struct bf16w {
    uint16_t bits;
};
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));
static inline vf widen_bf16(const uint16_t *p) {
    vu16 h;
    memcpy(&h, p, sizeof h);
    vu32 b = __builtin_convertvector(h, vu32) << 16;
    vf f;
    memcpy(&f, &b, sizeof f);
    return f;
}
static inline vf load_w(const bf16w *p) { return widen_bf16(&p->bits); }
static inline float wv(const bf16w *p) {
    uint32_t b = (uint32_t)p->bits << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

// Sum of a vector's lanes as a tree of halvings (a lane-by-lane loop is a chain of
// dependent adds: it dominated the attention scores, one sum per cached position).
static inline float hsum(vf v) {
    typedef float vh __attribute__((vector_size(32)));
    typedef float vq __attribute__((vector_size(16)));
#if VW == 16
    vh h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    vh h = v;
#endif
    vq q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    q = q + __builtin_shufflevector(q, q, 2, 3, 0, 1);
    return q[0] + q[1];
}

// hsum of VW vectors at once: lane i of the result is hsum(a[i]), bit for bit (the same
// halvings in the same order), in 2(VW - 1) shuffles and VW - 1 adds instead of VW hsums'
// ~4 log2(VW) operations each: the halvings of two vectors share one pair of shuffles and
// one add. The tree leaves the sums in bit-reversed lane order; one permute puts them back.
static inline vf lane_sums(const vf *a) {
#if VW == 16
    vf c[8], d[4], e[2];
    for (int k = 0; k < 8; k++)  // lanes 0-7: a[2k]'s halves added, 8-15: a[2k+1]'s
        c[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; k++)  // quarters: a[4k], a[4k + 2], a[4k + 1], a[4k + 3]
        d[k] = __builtin_shufflevector(c[2 * k], c[2 * k + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(c[2 * k], c[2 * k + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int k = 0; k < 2; k++)  // pairs: a[8k + 0, 4, 2, 6, 1, 5, 3, 7]
        e[k] = __builtin_shufflevector(d[2 * k], d[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(d[2 * k], d[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    const vf f = __builtin_shufflevector(e[0], e[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                 __builtin_shufflevector(e[0], e[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    return __builtin_shufflevector(f, f, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
#else
    vf c[4], d[2];
    for (int k = 0; k < 4; k++)  // lanes 0-3: a[2k]'s halves added, 4-7: a[2k+1]'s
        c[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int k = 0; k < 2; k++)  // pairs: a[4k], a[4k + 2], a[4k + 1], a[4k + 3]
        d[k] = __builtin_shufflevector(c[2 * k], c[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(c[2 * k], c[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    const vf f = __builtin_shufflevector(d[0], d[1], 0, 8, 2, 10, 4, 12, 6, 14) +
                 __builtin_shufflevector(d[0], d[1], 1, 9, 3, 11, 5, 13, 7, 15);
    return __builtin_shufflevector(f, f, 0, 4, 2, 6, 1, 5, 3, 7);
#endif
}

#if defined(__AVX__)
// Sum of the 8 lanes of a 256-bit float vector (the int8 kernels' accumulators).
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// exp of each lane (softmax after subtracting the max, SiLU): n = round(x /
// ln 2), r = x - n ln 2 in two parts (Cody-Waite), e^r by the Cephes expf polynomial, then
// scaled by 2^n through the exponent bits; below -87.3 the result is 0, as expf's
// underflow. Within 2 ulp of expf; a scalar expf per cached position was most of the
// attention time at 32 rows.
static inline vf vexp(vf x) {
    typedef int32_t vi __attribute__((vector_size(VW * 4)));
    const vf zero = {};
    const vf under = x < -87.3f ? zero + 1.f : zero;  // 1 where expf underflows
    x = x < -87.3f ? zero - 87.3f : x;
    x = x > 88.3f ? zero + 88.3f : x;  // ~2e38 instead of inf above
    vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + (x < 0 ? zero - 0.5f : zero + 0.5f), vi), vf);
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    vf out = p * scale;
    return under > 0 ? zero : out;
}
