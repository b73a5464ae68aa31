// Causal attention of a prefill on the CPU (option prefill_attention), from position 0 or
// continuing a prefix of `start` positions (a chunked prefill's later pieces, a prefix-cache
// hit): query t sits at position start + t and
// out[t, h] = softmax_s<=start+t(q[t, h] . k[s, h / group] * scale) @ v[s, h / group].
//
// Why: torch's CPU flash attention for a 1024-token prompt of the default model ran at
// ~100 GFLOP/s in float32 and took ~45% of a prefill on bfloat16 operands (its causal
// blocks of 256 x 512 also compute a quarter of the masked half), and its bfloat16 mode
// was no faster; torch's bfloat16 GEMM has no float32 output, so the scores cannot go
// through it without being rounded. Here the scores are products of bfloat16 operands
// summed in float32 by vdpbf16ps (AVX512-BF16), or float32 FMAs on every other path.
//
// Flash-attention order: each task is one KV head and a block of query tokens; its rows
// (token, head of the group) walk the keys in blocks, keeping a running max, sum and
// output per row (an online softmax), so no T x T matrix is ever formed, and a block
// past a row's own position is never computed. K (and V on the bfloat16 path) are first
// repacked so that each vector instruction reads one contiguous line:
//   float32:  kf[g][key block of VW][d][VW]            (lanes: VW keys)
//   bfloat16: kb[g][key block of 16][d pair][16][2]     (lanes: 16 keys, a pair of d each)
//             vb[g][key pair][d][2]                     (lanes: 16 d, a pair of keys each)
// The bfloat16 path rounds q, k, v and the softmax weights p to bfloat16 (round to
// nearest even) and keeps the scores, the softmax and the output in float32: the
// accuracy class of bf16_compute / prefill_compute "bf16", which is where the engine
// uses it. Masked positions get weight exactly 0.
//
// Layouts: q (T, nh, hd) with token stride ldq; k, v (nkv, S, hd) with head stride khs
// and position stride kps (S = start + T: the prefix's keys, then the new tokens' own);
// out (T, nh, hd) contiguous. All S keys are packed; a row's key blocks past its own
// position are skipped, so a continued prefill computes T x (start + T/2) scores, not T x S.
#pragma once
#include <atomic>
#include <math.h>
#include <stdlib.h>

#include "parallel.h"
#include "simd.h"

enum { PA_TOKENS = 16, PA_ROWS = 4, PA_KEY_VECS = 4 };

struct pe_pa_job {
    const float *q, *k, *v;
    long ldq, khs, kps;
    float *out;
    int T, nh, nkv, hd, bf16;
    long start;        // the queries' first position (keys: start + T)
    float scale;
    long blocks;       // key blocks of VW (float32) or 16 (bfloat16) per KV head
    float *kf;         // float32 packed K
    uint16_t *kb, *vb; // bfloat16 packed K, V
    float *scratch;    // per thread: PA_ROWS x hd outputs, PA_ROWS x (PA_KEY_VECS * VW) weights, the
                       // PA_ROWS maxima and sums, then a task's rows of q as bfloat16 pairs
    long scratch_per_thread;
    std::atomic<long> next;
    pe_barrier bar;
};

#if defined(__AVX512BF16__)
#define PA_BF16 1
#else
#define PA_BF16 0
#endif

static void pa_pack(pe_pa_job *j, int tid, int nth) {
    const long hd = j->hd, S = j->start + j->T;
    long b, e;
    pe_share(j->nkv * j->blocks, tid, nth, &b, &e);
    for (long gb = b; gb < e; gb++) {
        const long g = gb / j->blocks, blk = gb % j->blocks;
        const float *kg = j->k + g * j->khs, *vg = j->v + g * j->khs;
        if (!j->bf16) {
            float *dst = j->kf + gb * hd * VW;
            for (long d = 0; d < hd; d++)
                for (long l = 0; l < VW; l++) {
                    const long s = blk * VW + l;
                    dst[d * VW + l] = s < S ? kg[s * j->kps + d] : 0.f;
                }
            continue;
        }
        uint16_t *dk = j->kb + gb * hd * 16;
        for (long p = 0; p < hd / 2; p++)
            for (long l = 0; l < 16; l++) {
                const long s = blk * 16 + l;
                dk[(p * 16 + l) * 2] = s < S ? to_bf16(kg[s * j->kps + 2 * p]) : 0;
                dk[(p * 16 + l) * 2 + 1] = s < S ? to_bf16(kg[s * j->kps + 2 * p + 1]) : 0;
            }
        uint16_t *dv = j->vb + gb * 8 * hd * 2;  // this block's 8 key pairs
        for (long t = 0; t < 8; t++)
            for (long d = 0; d < hd; d++)
                for (long e2 = 0; e2 < 2; e2++) {
                    const long s = blk * 16 + 2 * t + e2;
                    dv[(t * hd + d) * 2 + e2] = s < S ? to_bf16(vg[s * j->kps + d]) : 0;
                }
    }
}

// The largest lane (a shuffle tree, not VW dependent scalar compares).
static inline float pa_hmax(vf v) {
    typedef float vh __attribute__((vector_size(32)));
    typedef float vq __attribute__((vector_size(16)));
#if VW == 16
    const vh a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const vh h = a > b ? a : b;
#else
    const vh h = v;
#endif
    const vq x = __builtin_shufflevector(h, h, 0, 1, 2, 3), y = __builtin_shufflevector(h, h, 4, 5, 6, 7);
    vq q = x > y ? x : y;
    const vq z = __builtin_shufflevector(q, q, 2, 3, 0, 1);
    q = q > z ? q : z;
    return q[0] > q[1] ? q[0] : q[1];
}

// Scores of rows [r, r + R) (query tokens tok[], heads qh[]) against one key block of
// nvec <= PA_KEY_VECS vectors starting at key block index kblk (in units of VW or 16 keys).
// NV: nvec known at compile time (a full block), 0 where it is not (a row's last block):
// with a run-time count the loops over c stay rolled and acc is indexed at run time (so
// not held in registers), which cost a fifth of the rate (float32, one core of this AMD
// EPYC, T 64 after 1500 keys: 54 -> 69 GFLOP/s; the same bits).
template <int R, int NV>
static inline void pa_scores(const pe_pa_job *j, long g, const float *const *qrow, const uint32_t *const *qpair,
                             long kblk, long nvec_, float *sc) {
    const long hd = j->hd, nvec = NV ? NV : nvec_;
    if (!j->bf16) {
        vf acc[R][PA_KEY_VECS] = {};
        const float *kp = j->kf + (g * j->blocks + kblk) * hd * VW;
        for (long d = 0; d < hd; d++) {
            vf kv[PA_KEY_VECS];
            for (long c = 0; c < nvec; c++) kv[c] = load_f(kp + (c * hd + d) * VW);
            for (int r = 0; r < R; r++) {
                const vf qv = (vf){} + qrow[r][d];
                for (long c = 0; c < nvec; c++) acc[r][c] += qv * kv[c];
            }
        }
        for (int r = 0; r < R; r++)
            for (long c = 0; c < nvec; c++) memcpy(sc + (r * PA_KEY_VECS + c) * VW, &acc[r][c], sizeof(vf));
        return;
    }
#if PA_BF16
    __m512 acc[R][PA_KEY_VECS];
    for (int r = 0; r < R; r++)
        for (long c = 0; c < PA_KEY_VECS; c++) acc[r][c] = _mm512_setzero_ps();
    const uint16_t *kp = j->kb + (g * j->blocks + kblk) * hd * 16;
    for (long p = 0; p < hd / 2; p++) {
        __m512bh kv[PA_KEY_VECS];
        for (long c = 0; c < nvec; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kp + (c * hd / 2 + p) * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qpair[r][p]);
            for (long c = 0; c < nvec; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, kv[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (long c = 0; c < nvec; c++) _mm512_storeu_ps(sc + (r * PA_KEY_VECS + c) * 16, acc[r][c]);
#endif
}

// o (R rows x hd) += p (R rows x n keys, starting at key s0) @ v. NV: 4 where every
// chunk of hd is 4 vectors (compile-time, so acc stays in registers), else 0.
template <int R, int NV>
static inline void pa_values(const pe_pa_job *j, long g, const float *p, long s0, long n, float *o) {
    const long hd = j->hd, KB = PA_KEY_VECS * VW;
    if (!j->bf16) {
        const float *vg = j->v + g * j->khs;
        for (long d0 = 0; d0 < hd; d0 += 4 * VW) {
            const long nv = NV ? NV : (hd - d0) / VW < 4 ? (hd - d0) / VW : 4;
            vf acc[R][4];
            for (int r = 0; r < R; r++)
                for (long c = 0; c < nv; c++) acc[r][c] = load_f(o + r * hd + d0 + c * VW);
            for (long s = 0; s < n; s++) {
                vf vv[4];
                for (long c = 0; c < nv; c++) vv[c] = load_f(vg + (s0 + s) * j->kps + d0 + c * VW);
                for (int r = 0; r < R; r++) {
                    const vf pv = (vf){} + p[r * KB + s];
                    for (long c = 0; c < nv; c++) acc[r][c] += pv * vv[c];
                }
            }
            for (int r = 0; r < R; r++)
                for (long c = 0; c < nv; c++) memcpy(o + r * hd + d0 + c * VW, &acc[r][c], sizeof(vf));
        }
        return;
    }
#if PA_BF16
    // key pairs (s0 and n are multiples of 16): p's bfloat16 values in order are the pairs
    const long pairs = n / 2;
    uint32_t pp[R][PA_KEY_VECS * 8];
    for (int r = 0; r < R; r++) {
        long c = 0;
        for (; c + 32 <= n; c += 32) {
            const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + r * KB + c + 16), _mm512_loadu_ps(p + r * KB + c));
            _mm512_storeu_si512(&pp[r][c / 2], (__m512i)b);
        }
        if (c < n) _mm256_storeu_si256((__m256i *)&pp[r][c / 2], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * KB + c)));
    }
    const uint16_t *vp = j->vb + (g * j->blocks * 8 + s0 / 2) * hd * 2;
    for (long d0 = 0; d0 < hd; d0 += 64) {
        const long nv = NV ? NV : (hd - d0) / 16 < 4 ? (hd - d0) / 16 : 4;
        __m512 acc[R][4];
        for (int r = 0; r < R; r++)
            for (long c = 0; c < nv; c++) acc[r][c] = _mm512_loadu_ps(o + r * hd + d0 + c * 16);
        for (long t = 0; t < pairs; t++) {
            __m512bh vv[4];
            for (long c = 0; c < nv; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vp + (t * hd + d0 + c * 16) * 2);
            for (int r = 0; r < R; r++) {
                const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp[r][t]);
                for (long c = 0; c < nv; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, vv[c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (long c = 0; c < nv; c++) _mm512_storeu_ps(o + r * hd + d0 + c * 16, acc[r][c]);
    }
#endif
}

// Rows [r0, r0 + R) of a task: row i is token t0 + i / group, head g * group + i % group.
template <int R>
static void pa_rows(pe_pa_job *j, long g, long t0, long r0, float *o, float *p, float *m, float *l,
                    const uint32_t *qb) {
    const long hd = j->hd, group = j->nh / j->nkv, KB = PA_KEY_VECS * VW;
    const long unit = j->bf16 ? 16 : VW;  // keys per packed block
    const float *qrow[R];
    const uint32_t *qpair[R];
    long pos[R];
    for (int r = 0; r < R; r++) {
        const long i = r0 + r, t = t0 + i / group, h = g * group + i % group;
        qrow[r] = j->q + t * j->ldq + h * hd;
        qpair[r] = qb + i * (hd / 2);
        pos[r] = j->start + t;
        m[r] = -INFINITY;
        l[r] = 0.f;
        for (long d = 0; d < hd; d++) o[r * hd + d] = 0.f;
    }
    const long last = pos[R - 1];  // rows are in token order: the last row sees the most keys
    float sc[R * PA_KEY_VECS * VW];
    vf iota;
    for (long c = 0; c < VW; c++) iota[c] = (float)c;
    const vf ninf = (vf){} - INFINITY;
    for (long s0 = 0; s0 <= last; s0 += KB) {
        const long n = last + 1 - s0 < KB ? last + 1 - s0 : KB;
        const long nvec = (n + unit - 1) / unit, lanes = nvec * unit;  // lanes past n: padding, masked
        if (nvec == PA_KEY_VECS)
            pa_scores<R, PA_KEY_VECS>(j, g, qrow, qpair, s0 / unit, nvec, sc);
        else
            pa_scores<R, 0>(j, g, qrow, qpair, s0 / unit, nvec, sc);
        for (int r = 0; r < R; r++) {
            const float seen = (float)(pos[r] + 1 - s0);  // keys of this block row r sees
            float *s = sc + r * KB, *pr = p + r * KB;
            vf vmx = ninf;
            const bool masked = seen < (float)lanes;  // most blocks of a long row mask nothing
            for (long c = 0; c < lanes; c += VW) {
                vf v = load_f(s + c) * j->scale;
                if (masked) v = iota + (float)c < seen ? v : ninf;
                memcpy(s + c, &v, sizeof v);
                vmx = v > vmx ? v : vmx;
            }
            const float bmx = pa_hmax(vmx);  // max is exact: any order gives the same value
            const float mx = bmx > m[r] ? bmx : m[r];
            const float corr = expf(m[r] - mx);  // 0 on the first block (m = -inf)
            vf vsum = (vf){};
            for (long c = 0; c < lanes; c += VW) {
                vf ev = vexp(load_f(s + c) - mx);  // exactly 0 where masked (-inf)
                memcpy(pr + c, &ev, sizeof ev);
                vsum += ev;
            }
            if (corr != 1.f) {
                const vf cv = (vf){} + corr;
                for (long d = 0; d < hd; d += VW) {
                    vf ov = load_f(o + r * hd + d) * cv;
                    memcpy(o + r * hd + d, &ov, sizeof ov);
                }
            }
            l[r] = l[r] * corr + hsum(vsum);
            m[r] = mx;
        }
        if (hd % (4 * unit) == 0)
            pa_values<R, 4>(j, g, p, s0, j->bf16 ? lanes : n, o);
        else
            pa_values<R, 0>(j, g, p, s0, j->bf16 ? lanes : n, o);
    }
    for (int r = 0; r < R; r++) {
        const long i = r0 + r, t = t0 + i / group, h = g * group + i % group;
        float *dst = j->out + (t * j->nh + h) * hd;
        const float inv = 1.f / l[r];
        for (long d = 0; d < hd; d++) dst[d] = o[r * hd + d] * inv;
    }
}

static void pa_task(void *arg, int tid, int nth) {
    pe_pa_job *j = (pe_pa_job *)arg;
    pa_pack(j, tid, nth);
    j->bar.wait(nth);
    const long hd = j->hd, group = j->nh / j->nkv, KB = PA_KEY_VECS * VW;
    const long qblocks = (j->T + PA_TOKENS - 1) / PA_TOKENS, tasks = qblocks * j->nkv;
    float *o = j->scratch + tid * j->scratch_per_thread;
    float *p = o + PA_ROWS * hd, *m = p + PA_ROWS * KB, *l = m + PA_ROWS;
    uint32_t *qb = (uint32_t *)(l + PA_ROWS);  // this task's rows' q as bfloat16 pairs
    for (long task = j->next.fetch_add(1); task < tasks; task = j->next.fetch_add(1)) {
        const long qblk = qblocks - 1 - task / j->nkv, g = task % j->nkv;  // the longest rows first
        const long t0 = qblk * PA_TOKENS, t1 = t0 + PA_TOKENS < j->T ? t0 + PA_TOKENS : j->T;
        const long rows = (t1 - t0) * group;
        if (j->bf16)
            for (long i = 0; i < rows; i++) {
                const float *q = j->q + (t0 + i / group) * j->ldq + (g * group + i % group) * hd;
                for (long pi = 0; pi < hd / 2; pi++)
                    qb[i * (hd / 2) + pi] = (uint32_t)to_bf16(q[2 * pi]) | ((uint32_t)to_bf16(q[2 * pi + 1]) << 16);
            }
        long r = 0;
        for (; r + PA_ROWS <= rows; r += PA_ROWS) pa_rows<PA_ROWS>(j, g, t0, r, o, p, m, l, qb);
        for (; r < rows; r++) pa_rows<1>(j, g, t0, r, o, p, m, l, qb);
    }
}

// The prefill attention above; start: the queries' first position (k, v hold start + T
// positions); bf16: 1 for the bfloat16 path (needs PA_BF16), 0 for float32. hd must be a
// multiple of VW (pe_vector_width) and, on the bfloat16 path, of 16. Returns 0, or -1
// where the arguments do not fit those conditions (nothing written).
static int prefill_attention(const float *q, long ldq, const float *k, const float *v, long khs, long kps, float *out,
                             int T, long start, int nh, int nkv, int hd, float scale, int bf16, int threads) {
    if (T <= 0 || start < 0 || nkv <= 0 || nh % nkv || hd % VW || (bf16 && (!PA_BF16 || hd % 16))) return -1;
    pe_pa_job j;
    j.q = q, j.k = k, j.v = v, j.ldq = ldq, j.khs = khs, j.kps = kps, j.out = out;
    j.T = T, j.start = start, j.nh = nh, j.nkv = nkv, j.hd = hd, j.bf16 = bf16, j.scale = scale;
    const long unit = bf16 ? 16 : VW;
    j.blocks = (start + T + unit - 1) / unit + PA_KEY_VECS;  // room for a key block's last vectors past S
    const long packed = (long)nkv * j.blocks * hd * unit;
    void *buf = aligned_alloc(64, ((packed * (bf16 ? 2 * 2 : 4) + 63) / 64) * 64);
    if (bf16) {
        j.kb = (uint16_t *)buf, j.vb = j.kb + packed, j.kf = nullptr;
    } else {
        j.kf = (float *)buf, j.kb = j.vb = nullptr;
    }
    const long group = nh / nkv, rows = PA_TOKENS * group;
    j.scratch_per_thread = PA_ROWS * hd + PA_ROWS * PA_KEY_VECS * VW + 2 * PA_ROWS + rows * hd / 2 + 16;
    const int nth = threads > 0 ? threads : 1;
    j.scratch = (float *)aligned_alloc(64, ((nth * j.scratch_per_thread * 4 + 63) / 64) * 64);
    j.next.store(0);
    pe_parallel(pa_task, &j, nth);
    free(j.scratch);
    free(buf);
    return 0;
}
