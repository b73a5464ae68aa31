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
#include <stdint.h>

#include "parallel.h"

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
