// Skinny matrix products for the CPU decode step: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// M small (the live slots), weights float32, bfloat16, or int8 with a per-row scale.
//
// Why: a decode step is bound by streaming the weights from memory, and a one-row
// product through a general GEMM library streams them well below the memory
// bandwidth. Here each thread streams a band of weight rows exactly once per step and
// applies every row of x to it while the rows sit in L1, so the bytes read per step
// are the weights' size whatever M is. int8 weights read a quarter of the bytes.
#pragma once
#include "gguf.h"
#include "packed.h"
#include "parallel.h"
#include "q8.h"
#include "simd.h"
#include "tile.h"

// MB rows of x against R rows of int8 W with one scale per GROUP weights of a row
// (blockwise quantization): partial sums per group, scaled as each group ends.
template <int MB, int R>
static inline void block_grouped(const float *x, long ldx, const int8_t *w, long K, long n0, long group,
                                 const float *scale, const float *bias, float *y, long ldy) {
    vf acc[MB][R];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = (vf){};
    const long groups = K / group;
    for (long g = 0; g < groups; g++) {
        vf part[MB][R];
        for (int m = 0; m < MB; m++)
            for (int r = 0; r < R; r++) part[m][r] = (vf){};
        for (long k = g * group; k < (g + 1) * group; k += VW) {
            vf wr[R];
            for (int r = 0; r < R; r++) wr[r] = load_w(w + (n0 + r) * K + k);
            for (int m = 0; m < MB; m++) {
                vf xv = load_f(x + m * ldx + k);
                for (int r = 0; r < R; r++) part[m][r] += xv * wr[r];
            }
        }
        for (int r = 0; r < R; r++) {
            float sc = scale[(n0 + r) * groups + g];
            for (int m = 0; m < MB; m++) acc[m][r] += part[m][r] * sc;
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[m][r]);
            if (bias) s += bias[n0 + r];
            y[m * ldy + n0 + r] = s;
        }
}

// MB rows of x against R rows of W starting at row n0.
template <int MB, int R, typename W>
static inline void block(const float *x, long ldx, const W *w, long K, long n0,
                         const float *scale, const float *bias, float *y, long ldy) {
    vf acc[MB][R];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = (vf){};
    long k = 0;
    for (; k + VW <= K; k += VW) {
        vf wr[R];
        for (int r = 0; r < R; r++) wr[r] = load_w(w + (n0 + r) * K + k);
        for (int m = 0; m < MB; m++) {
            vf xv = load_f(x + m * ldx + k);
            for (int r = 0; r < R; r++) acc[m][r] += xv * wr[r];
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[m][r]);
            for (long kk = k; kk < K; kk++) s += x[m * ldx + kk] * wv(w + (n0 + r) * K + kk);
            if (scale) s *= scale[n0 + r];
            if (bias) s += bias[n0 + r];
            y[m * ldy + n0 + r] = s;
        }
}

template <int R, typename W>
static inline void rows(const float *x, long ldx, const W *w, long K, long n0, int M,
                        const float *scale, const float *bias, float *y, long ldy) {
    // x rows in groups that keep the MB x R accumulators in registers (AVX-512 has 32;
    // 3 x 8 measured 1.5x the GFLOP/s of 4 x 4 at 32 rows, the same at one).
    const int MB = (VW == 16) ? 3 : 2;
    int m = 0;
    for (; m + MB <= M; m += MB) block<MB, R>(x + m * ldx, ldx, w, K, n0, scale, bias, y + m * ldy, ldy);
    for (; m < M; m++) block<1, R>(x + m * ldx, ldx, w, K, n0, scale, bias, y + m * ldy, ldy);
}

template <int R>
static inline void rows_grouped(const float *x, long ldx, const int8_t *w, long K, long n0, int M, long group,
                                const float *scale, const float *bias, float *y, long ldy) {
    const int MB = 2;  // 2 x MB x R accumulators (partial and total)
    int m = 0;
    for (; m + MB <= M; m += MB) block_grouped<MB, R>(x + m * ldx, ldx, w, K, n0, group, scale, bias, y + m * ldy, ldy);
    for (; m < M; m++) block_grouped<1, R>(x + m * ldx, ldx, w, K, n0, group, scale, bias, y + m * ldy, ldy);
}


// bfloat16 weights against activations rounded to bfloat16 (option bf16_compute "bf16"):
// each product's input rows are rounded once (bf16_rows), then every pair of k values
// is one step of AVX512-BF16's vdpbf16ps (32 products per instruction, twice the
// float32 FMA's) where the ISA path has it; elsewhere the same products in float32 (a
// bfloat16 times a bfloat16 is exact in float32), summed in another order.
static void bf16_rows(const float *x, long ldx, int M, long K, uint16_t *xb) {
    for (int m = 0; m < M; m++)
        for (long k = 0; k < K; k++) xb[m * K + k] = to_bf16(x[m * ldx + k]);
}

template <int MB, int R>
static inline void block_bf16dot(const uint16_t *xb, long K, const uint16_t *w, long n0, const float *bias, float *y,
                                 long ldy) {
    long k = 0;
    float sums[MB][R];
#if defined(__AVX512BF16__)
    __m512 acc[MB][R];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        __m512bh wr[R];
        for (int r = 0; r < R; r++) wr[r] = (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k);
        for (int m = 0; m < MB; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * K + k);
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wr[r]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) sums[m][r] = _mm512_reduce_add_ps(acc[m][r]);
#else
    vf acc[MB][R];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = (vf){};
    for (; k + VW <= K; k += VW) {
        vf wr[R];
        for (int r = 0; r < R; r++) wr[r] = widen_bf16(w + (n0 + r) * K + k);
        for (int m = 0; m < MB; m++) {
            vf xv = widen_bf16(xb + m * K + k);
            for (int r = 0; r < R; r++) acc[m][r] += xv * wr[r];
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) sums[m][r] = hsum(acc[m][r]);
#endif
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) {
            float s = sums[m][r];
            for (long kk = k; kk < K; kk++) s += from_bf16(xb[m * K + kk]) * from_bf16(w[(n0 + r) * K + kk]);
            if (bias) s += bias[n0 + r];
            y[m * ldy + n0 + r] = s;
        }
}

template <int R>
static inline void rows_bf16dot(const uint16_t *xb, int M, long K, const uint16_t *w, long n0, const float *bias,
                                float *y, long ldy) {
    const int MB = (VW == 16) ? 3 : 2;
    int m = 0;
    for (; m + MB <= M; m += MB) block_bf16dot<MB, R>(xb + m * K, K, w, n0, bias, y + m * ldy, ldy);
    for (; m < M; m++) block_bf16dot<1, R>(xb + m * K, K, w, n0, bias, y + m * ldy, ldy);
}

// One projection's output rows in a parallel loop over several projections of one input
// (q, k and v read the same normed activations; so do gate and up).
struct pe_seg {
    const void *w;
    const float *scale;  // int8: (N,) or (N, K / group)
    const float *bias;
    float *y;
    long ldy, N;
    int fmt;              // PE_GGUF: the GGUF block format (gguf.h's ggml type id)
    const long *rowoff;   // PE_GGUF: row n's byte offset from w (null: rows evenly spaced)
    const uint8_t *packed;  // PE_GGUF(X2): w repacked sixteen rows interleaved (packed.h), read instead
};

// PE_Q8: int8 weights against int8-quantized activations (q8.h; xq/xs set, x unused).
// PE_Q8X2: the same with each activation row carried as two int8 rows, its quantization
// and the quantization of what that left over (q8x2_quantize): twice the integer
// arithmetic, the same weight bytes, ~1/250 of the activation rounding error.
// PE_BF16: bfloat16 weights against float32 activations (bf16w); PE_BF16DOT: against
// activations rounded to bfloat16 (bf16_rows into xq, read as uint16_t; block_bf16dot).
// PE_GGUF/PE_GGUFX2: GGUF block weights (gguf.h) against one (two) int8 rows per row.
// PE_GGUFT: GGUF block weights on tile.h's int16 tiles (xq read as int16_t, xsf as the blocks' sums).
enum { PE_F32 = 0, PE_I8 = 1, PE_I8_GROUPED = 2, PE_Q8 = 3, PE_Q8X2 = 4, PE_BF16 = 5, PE_BF16DOT = 6, PE_GGUF = 7,
       PE_GGUFX2 = 8, PE_GGUFT = 9 };

// Row m of x (K values) -> rows 2m and 2m + 1 of xq/xs: x ~ xs[2m] * xq[2m] +
// xs[2m + 1] * xq[2m + 1] blockwise. res: K floats of scratch.
static void q8x2_quantize(const float *x, long ldx, int M, long K, int8_t *xq, float *xs, float *res) {
    const long nb = K / Q8_BLOCK;
    for (int m = 0; m < M; m++) {
        int8_t *q = xq + 2L * m * K;
        float *sc = xs + 2L * m * nb;
        q8_quantize(x + m * ldx, ldx, 1, K, q, sc);
        for (long k = 0; k < K; k++) res[k] = x[m * ldx + k] - sc[k / Q8_BLOCK] * (float)q[k];
        q8_quantize(res, K, 1, K, q + K, sc + nb);
    }
}

// x (M, K) -> pairs int8 rows per row in xq/xs: q8_quantize (pairs 1) or q8x2_quantize
// (pairs 2; res: K floats of scratch).
static void q8_quantize_rows(const float *x, long ldx, int M, long K, int8_t *xq, float *xs, int pairs, float *res) {
    if (pairs == 2)
        q8x2_quantize(x, ldx, M, K, xq, xs, res);
    else
        q8_quantize(x, ldx, M, K, xq, xs);
}

// Rows [n0, n1) of one projection against 2M int8 rows (PE_Q8X2): the pairs' products
// land in a stack buffer, chunk by chunk, and are summed (with the bias) into y.
static void q8x2_rows(const int8_t *xq, const float *xs, int M, long K, const int8_t *w, const float *scale,
                      long group, const float *bias, float *y, long ldy, long n0, long n1) {
    float buf[8192];
    const int M2 = 2 * M;
    long chunk = 8192 / M2;
    if (chunk > Q8_R) chunk -= chunk % Q8_R;
    const long spr = group ? K / group : 1;  // scales per weight row
    for (long a = n0; a < n1; a += chunk) {
        const long b = a + chunk < n1 ? a + chunk : n1, width = b - a;
        q8_rows(xq, xs, M2, K, w + a * K, scale + a * spr, group, nullptr, buf, width, 0, width);
        for (int m = 0; m < M; m++)
            for (long n = 0; n < width; n++)
                y[m * ldy + a + n] = buf[2 * m * width + n] + buf[(2 * m + 1) * width + n] + (bias ? bias[a + n] : 0.f);
    }
}

struct pe_linear_job {
    const float *x;
    long ldx;
    int M;
    long K;
    int kind;
    long group;  // int8 weights per scale along a row (0: one scale per row)
    const pe_seg *segs;
    int nseg;
    const int8_t *xq;  // PE_Q8: q8_quantize(x)
    const float *xs;
    const float *xsf;  // PE_GGUF(X2): xs times the sums of each block's halves (gq_sums, gq_quantize_x2)
    pe_ranges *steal;  // null: each thread its fixed share; else shares taken by chunks (linear_task)
};

static const long PE_TILE = (VW == 16) ? 8 : 4;  // weight rows a thread streams together (MB x R accumulators in registers)

// Rows [n0, n1) of float weights (float32 or bf16w) without scales.
template <typename W>
static void float_rows(const pe_linear_job *j, const pe_seg *s, const W *w, long n0, long n1) {
    const int R = PE_TILE;
    long n = n0;
    if (j->M <= 2) {
        // memory-bound: one weight row at a time, a single sequential stream, which the
        // hardware prefetchers follow best (R rows side by side are R short streams;
        // measured on Zen 4 at batch 1: 13.0 vs 15.0 ms a step's layers, R = 8)
        for (; n < n1; n++) rows<1>(j->x, j->ldx, w, j->K, n, j->M, nullptr, s->bias, s->y, s->ldy);
        return;
    }
    for (; n + R <= n1; n += R) rows<R>(j->x, j->ldx, w, j->K, n, j->M, nullptr, s->bias, s->y, s->ldy);
    for (; n < n1; n++) rows<1>(j->x, j->ldx, w, j->K, n, j->M, nullptr, s->bias, s->y, s->ldy);
}

static void seg_rows(const pe_linear_job *j, const pe_seg *s, long n0, long n1) {
    const int R = PE_TILE;
    long n = n0;
    if (j->kind == PE_F32) {
        float_rows(j, s, (const float *)s->w, n0, n1);
    } else if (j->kind == PE_BF16) {
        float_rows(j, s, (const bf16w *)s->w, n0, n1);
    } else if (j->kind == PE_BF16DOT) {
        const uint16_t *xb = (const uint16_t *)j->xq, *w = (const uint16_t *)s->w;
        if (j->M > 2)
            for (; n + R <= n1; n += R) rows_bf16dot<R>(xb, j->M, j->K, w, n, s->bias, s->y, s->ldy);
        for (; n < n1; n++) rows_bf16dot<1>(xb, j->M, j->K, w, n, s->bias, s->y, s->ldy);
    } else if (j->kind == PE_I8) {
        const int8_t *w = (const int8_t *)s->w;
        for (; n + R <= n1; n += R) rows<R>(j->x, j->ldx, w, j->K, n, j->M, s->scale, s->bias, s->y, s->ldy);
        for (; n < n1; n++) rows<1>(j->x, j->ldx, w, j->K, n, j->M, s->scale, s->bias, s->y, s->ldy);
    } else if (j->kind == PE_Q8) {
        q8_rows(j->xq, j->xs, j->M, j->K, (const int8_t *)s->w, s->scale, j->group, s->bias, s->y, s->ldy, n0, n1);
    } else if (j->kind == PE_GGUF || j->kind == PE_GGUFX2) {
#if GP_PACKED
        if (s->packed) {
            gp_seg_rows(s->fmt, j->kind == PE_GGUFX2, j->xq, j->xs, j->xsf, j->M, j->K, s->packed, s->bias, s->y,
                        s->ldy, n0, n1);
            return;
        }
#endif
        gq_seg_rows(s->fmt, j->kind == PE_GGUFX2, j->xq, j->xs, j->xsf, j->M, j->K, (const uint8_t *)s->w, s->rowoff,
                    s->bias, s->y, s->ldy, n0, n1);
#if GT_TILES
    } else if (j->kind == PE_GGUFT) {
        gt_seg_rows(s->fmt, (const int16_t *)j->xq, j->xs, j->xsf, j->M, j->K, (const uint8_t *)s->w, 0, s->rowoff,
                    s->packed, s->bias, s->y, s->ldy, n0, n1);
#endif
    } else if (j->kind == PE_Q8X2) {
        q8x2_rows(j->xq, j->xs, j->M, j->K, (const int8_t *)s->w, s->scale, j->group, s->bias, s->y, s->ldy, n0, n1);
    } else {
        const int8_t *w = (const int8_t *)s->w;
        for (; n + R <= n1; n += R)
            rows_grouped<R>(j->x, j->ldx, w, j->K, n, j->M, j->group, s->scale, s->bias, s->y, s->ldy);
        for (; n < n1; n++) rows_grouped<1>(j->x, j->ldx, w, j->K, n, j->M, j->group, s->scale, s->bias, s->y, s->ldy);
    }
}

// Units [lo, hi) of the union of every segment's row tiles.
static void run_units(const pe_linear_job *j, long unit, long lo, long hi) {
    long base = 0;
    for (int i = 0; i < j->nseg && base < hi; i++) {
        const pe_seg *s = j->segs + i;
        long tiles = (s->N + unit - 1) / unit;
        long a = lo > base ? lo : base, b = hi < base + tiles ? hi : base + tiles;
        if (a < b) {
            long n1 = (b - base) * unit;
            seg_rows(j, s, (a - base) * unit, n1 < s->N ? n1 : s->N);
        }
        base += tiles;
    }
}

// Thread tid's share of every segment's row tiles, in one static split of their union
// (block weights: of sixteen rows, whatever a thread's share, no int16 tile or group of
// packed rows is cut in two); with j->steal, that share is taken a chunk at a time from
// its front and a thread done with its own takes chunks from the back of another's
// (parallel.h's pe_ranges), so a thread slowed down (another process on its core, a
// page fault) hands the rest of its share to the other.
static void linear_task(void *arg, int tid, int nth) {
    const pe_linear_job *j = (const pe_linear_job *)arg;
    const long unit = j->kind == PE_GGUFT || j->kind == PE_GGUF || j->kind == PE_GGUFX2 ? 16 : PE_TILE;
    long total = 0;
    for (int i = 0; i < j->nseg; i++) total += (j->segs[i].N + unit - 1) / unit;
    pe_for_share(j->steal, total, tid, nth, [&](long lo, long hi) { run_units(j, unit, lo, hi); });
}

static void linear_segs(const float *x, long ldx, int M, long K, int kind, long group, const pe_seg *segs, int nseg,
                        int threads, const int8_t *xq = nullptr, const float *xs = nullptr) {
    pe_linear_job job = {x, ldx, M, K, kind, group, segs, nseg, xq, xs, nullptr, nullptr};
    pe_parallel(linear_task, &job, threads);
}
