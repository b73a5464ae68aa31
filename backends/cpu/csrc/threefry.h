// The sampler's random stream on the host: Threefry-2x32 (20 rounds), the core's
// definition (core/sampling/threefry.py), for a batch of rows over a run of token ids.
//
// A sampled step draws one uniform per (row, token): the counter is (token id, the row's
// step + 2^20 * sample index) under the row's 64-bit seed. torch computes it as ~140
// element-wise passes over (rows, vocab) int32 (backends/torch_common/threefry.py); here
// each element's 20 rounds run in registers, one pass, the loop over token ids vectorized
// by the compiler on whatever the ISA path has (rotations are vprold on AVX-512). Only the
// first output word's top 24 bits are kept (m = y0 >> 8: u = (m + 0.5) * 2^-24), which is
// all the sampler's Gumbel noise reads (torch_common/threefry.py's gumbel_from_bits).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cmath>

#include "parallel.h"
#include "simd.h"

static inline uint32_t tf_rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// The first word of Threefry-2x32-20 of counter (x0, x1) under key (k0, k1).
static inline uint32_t tf_word0(uint32_t k0, uint32_t k1, uint32_t x0, uint32_t x1) {
    const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
    uint32_t y0 = x0 + k0, y1 = x1 + k1;
#define TF_ROUND(r) y0 += y1, y1 = tf_rotl(y1, r), y1 ^= y0
#define TF_GROUP(g, a, b, c, d)                                      \
    TF_ROUND(a), TF_ROUND(b), TF_ROUND(c), TF_ROUND(d);              \
    y0 += ks[((g) + 1) % 3], y1 += ks[((g) + 2) % 3] + (uint32_t)((g) + 1)
    TF_GROUP(0, 13, 15, 26, 6);
    TF_GROUP(1, 17, 29, 16, 24);
    TF_GROUP(2, 13, 15, 26, 6);
    TF_GROUP(3, 17, 29, 16, 24);
    TF_GROUP(4, 13, 15, 26, 6);
#undef TF_GROUP
#undef TF_ROUND
    return y0;
}

struct tf_job {
    const int32_t *k0, *k1, *ctr;  // per row: the seed's words, the counter's second word
    int rows;
    long n;           // token ids per row
    const int32_t *ids;  // the ids (n of them), or null: 0 .. n - 1
    int32_t *out;     // rows x n: y0 >> 8
};

static void tf_task(void *arg, int tid, int nth) {
    const tf_job *j = (const tf_job *)arg;
    long begin, end;
    pe_share((long)j->rows * j->n, tid, nth, &begin, &end);
    for (long at = begin; at < end;) {
        const long r = at / j->n, c0 = at % j->n;
        const long c1 = (end - r * j->n) < j->n ? end - r * j->n : j->n;
        const uint32_t k0 = (uint32_t)j->k0[r], k1 = (uint32_t)j->k1[r], x1 = (uint32_t)j->ctr[r];
        int32_t *o = j->out + r * j->n;
        if (j->ids)
            for (long c = c0; c < c1; c++) o[c] = (int32_t)(tf_word0(k0, k1, (uint32_t)j->ids[c], x1) >> 8);
        else
            for (long c = c0; c < c1; c++) o[c] = (int32_t)(tf_word0(k0, k1, (uint32_t)c, x1) >> 8);
        at = r * j->n + c1;
    }
}

// The Gumbel-max draw of plain temperature sampling (no top-k, top-p or min-p), whole:
// token = argmax_j (z_j + g_j), z_j = (x_j - max x) / T, g_j = -log(-log(u_j)) with u_j the
// stream's uniform ((m + 0.5) 2^-24, m = word0 >> 8), ties to the lowest id. That is the
// core's draw (log_softmax((x - max) / T) + g: the log-sum-exp is one constant a row, so
// it leaves the argmax where it is), in float64 as the core computes it.
//
// Most tokens cannot win, and telling which needs no logarithm: with `best` the highest
// score so far, token j beats it only if g_j > best - z_j, i.e. -log u_j < e^(z_j - best),
// and since -log u >= 1 - u that needs 1 - u_j < e^(z_j) e^(-best). So each token costs its
// stream word and a vector exp (float, with a 1.001 margin, far above its 2-ulp error), and
// the exact score in float64 is computed only where that test passes: about e^(-best) of
// them a row in expectation, a handful. The first bound is the most likely token's own
// exact score. A row's columns are shared among the threads; each reports its best,
// combined after (pe_gumbel_draw).
static inline double gd_noise(uint32_t m) {
    const double u = ((double)m + 0.5) * 0x1p-24;
    return -std::log(-std::log(u));
}

struct gd_job {
    const float *x;
    long ldx, n;
    int rows, nth;
    const float *temp;
    const int32_t *k0, *k1, *ctr;
    double *best;   // rows x nth: each thread's best score
    long *best_j;   // rows x nth: and its token
};

static const long GD_CHUNK = 256;

static void gd_row(const gd_job *j, int r, long c0, long c1, double *best_out, long *best_j_out) {
    const float *x = j->x + r * j->ldx;
    const double T = j->temp[r];
    *best_out = -INFINITY, *best_j_out = 0;
    float m = -INFINITY;
    long jm = 0;
    for (long c = 0; c < j->n; c++)
        if (x[c] > m) m = x[c], jm = c;  // the first maximum; NaN never compares greater
    if (!(T > 0) || !std::isfinite(m)) return;  // a greedy row, or nothing finite to draw from
    const uint32_t k0 = (uint32_t)j->k0[r], k1 = (uint32_t)j->k1[r], x1 = (uint32_t)j->ctr[r];
    double best = gd_noise(tf_word0(k0, k1, (uint32_t)jm, x1) >> 8);  // z of the maximum is 0
    long best_j = jm;
    double bound = std::exp(-best) * 1.001;
    const float finv = (float)(1.0 / T);
    uint32_t bits[GD_CHUNK];
    float e[GD_CHUNK];
    for (long c = c0; c < c1; c += GD_CHUNK) {
        const long len = c1 - c < GD_CHUNK ? c1 - c : GD_CHUNK;
        for (long i = 0; i < len; i++) bits[i] = tf_word0(k0, k1, (uint32_t)(c + i), x1) >> 8;
        long i = 0;
        for (; i + VW <= len; i += VW) {
            const vf v = vexp((load_f(x + c + i) - m) * finv);
            memcpy(e + i, &v, sizeof v);
        }
        for (; i < len; i++) e[i] = std::exp((x[c + i] - m) * finv);
        for (i = 0; i < len; i++) {
            const double one_minus_u = ((double)(0xFFFFFFu - bits[i]) + 0.5) * 0x1p-24;
            if (!(one_minus_u < bound * (double)e[i])) continue;
            const double s = ((double)x[c + i] - (double)m) / T + gd_noise(bits[i]);
            if (s > best || (s == best && c + i < best_j)) best = s, best_j = c + i, bound = std::exp(-best) * 1.001;
        }
    }
    *best_out = best, *best_j_out = best_j;
}

static void gd_task(void *arg, int tid, int nth) {
    const gd_job *j = (const gd_job *)arg;
    long c0, c1;
    pe_share(j->n, tid, nth, &c0, &c1);
    for (int r = 0; r < j->rows; r++) gd_row(j, r, c0, c1, j->best + r * j->nth + tid, j->best_j + r * j->nth + tid);
    for (int t = nth; t < j->nth; t++)  // threads the region did not start
        for (int r = 0; r < j->rows; r++)
            if (tid == 0) j->best[r * j->nth + t] = -INFINITY, j->best_j[r * j->nth + t] = 0;
}
