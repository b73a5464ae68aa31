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

#include <algorithm>
#include <cmath>
#include <vector>

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
    long n;           // token ids per row: 0 .. n - 1
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

// A row's best draw so far: its score, its token, and the bound of the test against it.
struct gd_best {
    double score = -INFINITY, bound = 0.0;
    long id = 0;
    void set(double s, long j) { score = s, id = j, bound = std::exp(-s) * 1.001; }
    // Whether a token whose stream word is `bits` and whose e^(z) is about `e` can beat it.
    bool may_win(uint32_t bits, double e) const { return ((double)(0xFFFFFFu - bits) + 0.5) * 0x1p-24 < bound * e; }
    void offer(double s, long j) {
        if (s > score || (s == score && j < id)) set(s, j);
    }
};

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
    gd_best best;
    best.set(gd_noise(tf_word0(k0, k1, (uint32_t)jm, x1) >> 8), jm);  // z of the maximum is 0
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
        for (i = 0; i < len; i++)
            if (best.may_win(bits[i], e[i])) best.offer(((double)x[c + i] - (double)m) / T + gd_noise(bits[i]), c + i);
    }
    *best_out = best.score, *best_j_out = best.id;
}

static void gd_task(void *arg, int tid, int nth) {
    const gd_job *j = (const gd_job *)arg;
    long c0, c1;
    pe_share(j->n, tid, nth, &c0, &c1);
    for (int r = 0; r < j->rows; r++) gd_row(j, r, c0, c1, j->best + r * j->nth + tid, j->best_j + r * j->nth + tid);
}

// -- the filtered draw: top-k, top-p and min-p, then the Gumbel-max draw ------------------
//
// The core's steps 3-5 (core/sampling/sampler.py) for one row, in float64 as it computes
// them: log-probs of (x - max) / T; top-k (ties to the lower id) renormalised; top-p (the
// smallest highest-first prefix whose mass reaches top_p) renormalised; min-p (p >= min_p
// p_max) renormalised; the draw over what is kept (as gd_row: the exact score only where
// a token can still win). The sets are lists of ids, never the vocabulary sorted: top-k
// selects k, top-p sorts growing candidate sets (256, then 4x) until one holds the mass,
// as the core does.

// exp of each lane in float64: n = round(x / ln 2), r = x - n ln 2 in two parts, e^r by
// its Taylor series to r^12 (|r| <= 0.347: the next term is below 2e-16), times 2^n
// through the exponent bits; below -708 the result is 0 (exp's underflow).
typedef double vd __attribute__((vector_size(VW * 4)));
static const int VD = VW / 2;
static inline vd vexp_d(vd x) {
    typedef int64_t vl __attribute__((vector_size(VW * 4)));
    const vd zero = {};
    const vd under = x < -708.0 ? zero + 1.0 : zero;
    x = x < -708.0 ? zero - 708.0 : x;
    x = x > 709.0 ? zero + 709.0 : x;
    const vd n = __builtin_convertvector(__builtin_convertvector(x * 1.4426950408889634 + (x < 0 ? zero - 0.5 : zero + 0.5), vl), vd);
    const vd r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    vd p = zero + 1.0 / 479001600.0;
    const double inv_fact[12] = {1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0,
                                 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
    for (int i = 0; i < 12; i++) p = p * r + inv_fact[i];
    const vl bits = (__builtin_convertvector(n, vl) + 1023) << 52;
    vd scale;
    memcpy(&scale, &bits, sizeof scale);
    const vd out = p * scale;
    return under > 0 ? zero : out;
}

// log(sum(exp(v[i] - m))) + m over n values, m their max (the core's _renormalise shift);
// -inf values add nothing.
static double fd_logsumexp(const double *v, long n) {
    double m = -INFINITY;
    for (long i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
    if (!std::isfinite(m)) return m;
    double sum = 0.0;
    long i = 0;
    vd acc = {};
    for (; i + VD <= n; i += VD) {
        vd t;
        memcpy(&t, v + i, sizeof t);
        acc += vexp_d(t - m);
    }
    for (int l = 0; l < VD; l++) sum += acc[l];
    for (; i < n; i++) sum += std::exp(v[i] - m);
    return m + std::log(sum);
}

// A row's working lists, kept across the rows a thread draws (no allocation a row once
// they have grown): the log-probs, the kept tokens and their values, an order of them,
// and fd_compact's buckets.
struct fd_scratch {
    std::vector<double> logp, vals, mass, kept_vals;
    std::vector<long> ids, order, count, kept_ids;
    std::vector<int> bucket;
};

// Keep ids[0 .. keep) (values in vals, the same order) and renormalise them in place.
static void fd_renormalise(fd_scratch *s, long keep) {
    s->ids.resize(keep), s->vals.resize(keep);
    const double lse = fd_logsumexp(s->vals.data(), keep);
    for (long i = 0; i < keep; i++) s->vals[i] -= lse;
}

// Keep the first `keep` tokens of s->order (fd_top's), renormalised.
static void fd_keep_order(fd_scratch *s, long keep) {
    s->kept_ids.resize(keep), s->kept_vals.resize(keep);
    for (long i = 0; i < keep; i++) s->kept_ids[i] = s->ids[s->order[i]], s->kept_vals[i] = s->vals[s->order[i]];
    s->ids.swap(s->kept_ids), s->vals.swap(s->kept_vals);
    fd_renormalise(s, keep);
}

// The first `m` of the kept tokens highest first (ties to the lower id), in s->order as
// indexes into s->ids/vals.
static void fd_top(fd_scratch *s, long m) {
    const long n = (long)s->ids.size();
    s->order.resize(n);
    for (long i = 0; i < n; i++) s->order[i] = i;
    const double *v = s->vals.data();
    const long *ids = s->ids.data();
    auto cmp = [v, ids](long a, long b) { return v[a] > v[b] || (v[a] == v[b] && ids[a] < ids[b]); };
    if (m < n) std::nth_element(s->order.begin(), s->order.begin() + m, s->order.end(), cmp);
    std::sort(s->order.begin(), s->order.begin() + m, cmp);
}

// Drop the tokens that cannot be among the highest-first ones a filter looks at: at
// least `count` tokens and `mass` of the probability (plus 1e-9 for the sums' order). Each
// live token goes to a bucket of its log-prob (1/8 nat wide; the last takes everything
// below -512); the buckets from the top say where the prefix ends at the latest, and the
// tokens of those buckets are exactly the global order's first ones (a bucket is a range of
// log-probs, ties share one), so the filter's selection and sums on them are the core's.
// Where the buckets never get there (rounding of the mass), nothing is dropped.
static void fd_compact(fd_scratch *s, long count, double mass) {
    static const int NB = 4097;
    const long n = (long)s->ids.size();
    if (n <= 256) return;
    std::vector<double> &m = s->mass;
    std::vector<long> &c = s->count;
    std::vector<int> &bucket = s->bucket;
    m.assign(NB, 0.0), c.assign(NB, 0), bucket.resize(n);
    for (long i = 0; i < n; i++) {
        const double v = -s->vals[i] * 8.0;  // >= 0 up to rounding: the largest log-prob is about 0
        const int b = v < 0 ? 0 : v >= NB - 1 ? NB - 1 : (int)v;
        bucket[i] = b, c[b]++;
        if (mass > 0) m[b] += std::exp(s->vals[i]);
    }
    double cum = 0.0;
    long have = 0;
    int last = -1;
    for (int b = 0; b < NB - 1 && last < 0; b++) {
        cum += m[b], have += c[b];
        if (have >= count && (mass <= 0 || cum >= mass + 1e-9)) last = b;
    }
    if (last < 0) return;
    long w = 0;
    for (long i = 0; i < n; i++)
        if (bucket[i] <= last) s->ids[w] = s->ids[i], s->vals[w] = s->vals[i], w++;
    s->ids.resize(w), s->vals.resize(w);
}

static void fd_top_k(fd_scratch *s, long k) {
    fd_compact(s, k, 0.0);
    k = k < (long)s->ids.size() ? k : (long)s->ids.size();
    fd_top(s, k);
    fd_keep_order(s, k);
}

static void fd_top_p(fd_scratch *s, double top_p) {
    fd_compact(s, 0, top_p);
    const long alive = (long)s->ids.size();
    long m = alive < 256 ? alive : 256, n_keep = 0;
    for (;;) {
        fd_top(s, m);
        double cum = 0.0;
        n_keep = -1;
        for (long i = 0; i < m; i++) {
            cum += std::exp(s->vals[s->order[i]]);
            if (n_keep < 0 && cum >= top_p) n_keep = i + 1;
        }
        if (n_keep >= 0 || m == alive) break;
        m = 4 * m < alive ? 4 * m : alive;
    }
    fd_keep_order(s, n_keep < 0 ? m : n_keep);  // under top_p after rounding: every live token
}

static void fd_min_p(fd_scratch *s, double min_p) {
    double pmax = 0.0;
    for (double v : s->vals) pmax = std::max(pmax, std::exp(v));
    long w = 0;
    for (long i = 0; i < (long)s->ids.size(); i++)
        if (std::exp(s->vals[i]) >= min_p * pmax) s->ids[w] = s->ids[i], s->vals[w] = s->vals[i], w++;
    fd_renormalise(s, w);
}

// One row: the token drawn, 0 for a greedy row or one with no finite logit.
static long fd_row(const float *x, long n, double T, long top_k, double top_p, double min_p, uint32_t k0,
                   uint32_t k1, uint32_t x1, fd_scratch *s) {
    float m = -INFINITY;
    for (long c = 0; c < n; c++) m = x[c] > m ? x[c] : m;
    if (!(T > 0) || !std::isfinite(m)) return 0;
    s->logp.resize(n);
    for (long c = 0; c < n; c++) s->logp[c] = ((double)x[c] - (double)m) / T;
    const double lse = fd_logsumexp(s->logp.data(), n);  // the maximum is 0
    s->ids.clear(), s->vals.clear();
    s->ids.reserve(n), s->vals.reserve(n);
    for (long c = 0; c < n; c++) {
        s->logp[c] -= lse;
        // the live tokens: top-k of every token less the -inf ones keeps the same set
        if (s->logp[c] > -INFINITY) s->ids.push_back(c), s->vals.push_back(s->logp[c]);
    }
    if (top_k > 0 && top_k < n) fd_top_k(s, top_k);
    if (top_p < 1.0) fd_top_p(s, top_p);
    if (min_p > 0.0) fd_min_p(s, min_p);
    // the draw over the kept tokens: the exact score only where one can still win (gd_row)
    const long kept = (long)s->ids.size();
    if (!kept) return 0;
    long at = 0;
    for (long i = 1; i < kept; i++)
        if (s->vals[i] > s->vals[at]) at = i;
    gd_best best;
    best.set(s->vals[at] + gd_noise(tf_word0(k0, k1, (uint32_t)s->ids[at], x1) >> 8), s->ids[at]);
    for (long i = 0; i < kept; i++) {
        const uint32_t bits = tf_word0(k0, k1, (uint32_t)s->ids[i], x1) >> 8;
        if (best.may_win(bits, std::exp(s->vals[i]))) best.offer(s->vals[i] + gd_noise(bits), s->ids[i]);
    }
    return best.id;
}

struct fd_job {
    const float *x;
    long ldx, n;
    int rows;
    const float *temp, *top_p, *min_p;
    const long *top_k;
    const int32_t *k0, *k1, *ctr;
    long *tokens;
};

static void fd_task(void *arg, int tid, int nth) {
    const fd_job *j = (const fd_job *)arg;
    long r0, r1;
    pe_share(j->rows, tid, nth, &r0, &r1);
    fd_scratch s;
    for (long r = r0; r < r1; r++)
        j->tokens[r] = fd_row(j->x + r * j->ldx, j->n, j->temp[r], j->top_k[r], j->top_p[r], j->min_p[r],
                              (uint32_t)j->k0[r], (uint32_t)j->k1[r], (uint32_t)j->ctr[r], &s);
}
