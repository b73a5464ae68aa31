// One decode step of the Llama-family model on the CPU, fused: every layer for M rows
// (the live slots) in one call, float32 activations, float32, bfloat16 or int8 weights.
//
// Why: the shared torch forward issues ~50 small tensor ops per layer; at one token per
// slot their dispatch costs more than the arithmetic. Here the whole step is plain
// loops over the same data the torch forward uses (the weights as the model's arrays,
// the engine's KV cache tensor, the RoPE tables), so it computes the same function in
// the same order up to float rounding; tests compare it with the shared forward.
//
// Layouts: x (M, H) row-major; KV cache [layers, rows, kv_heads, S, head_dim] of float32,
// bfloat16 or float16 (pe_dims.kv_type);
// RoPE tables (positions, head_dim/2); weights [out, in]. Attention for a row reads
// its own cache row at positions 0..pos (the token just written included).
#pragma once
#include <math.h>
#include <stdlib.h>

#include <vector>

#include "linear.h"
#include "parallel.h"
#include "q8.h"
#include "simd.h"

// The two descriptors of a step, filled by Python (kernels.py's ctypes mirrors _Layer and
// _Dims): a field added, moved or retyped here must change there too. The library reports
// their layout (pe_layout_field, polyengine_cpu.cpp) and kernels.py refuses a library whose
// layout differs from its mirrors', instead of letting a step read the wrong bytes.
struct pe_layer {
    const float *input_norm, *post_norm;
    // float32 weights, or int8 ones with scales (per row, or per group of a row)
    const void *q, *k, *v, *o, *gate, *up, *down;
    const float *q_scale, *k_scale, *v_scale, *o_scale, *gate_scale, *up_scale, *down_scale;
    const float *q_bias, *k_bias, *v_bias, *o_bias, *gate_bias, *up_bias, *down_bias;
    // GGUF block weights (pe_dims.gguf): each projection's format (gguf.h's ggml type id)
    // and row offsets (null: rows evenly spaced), in the order q, k, v, o, gate, up, down
    int fmt[7];
    const long *rowoff[7];
    // the same matrices repacked sixteen rows interleaved (packed.h; null: not repacked),
    // which a step's products read below tile_rows rows
    const uint8_t *packed[7];
};

struct pe_dims {
    long hidden, intermediate, heads, kv_heads, head_dim, layers, cache_rows, cache_len;
    float eps;
    int int8;   // weights are int8 (with scales)
    long group; // int8: weights per scale along a row (0: one scale per row)
    int threads;
    int q8;     // int8 weights: activations to int8 too (q8.h; all K % 32 == 0), as one int8
                // row per row (1) or two, the second carrying the first's rounding error (2)
    int kv_type;  // the KV cache's elements: PE_KV_F32, PE_KV_BF16 or PE_KV_F16 (option kv_dtype)
    int bf16;     // float weights stored as bfloat16 (option weight_dtype; int8 is 0), against float32
                  // activations (1) or activations rounded to bfloat16 (2, option bf16_compute "bf16")
    long gguf;    // weights are a GGUF file's blocks as mapped (pe_layer.fmt; int8 and bf16 are 0),
                  // against q8 int8 rows per row of x (1 or 2)
    long page_size;  // paged K/V (option page_size; 0: contiguous): the caches are page pools of
                     // cache_rows pages and a row's position p lives in page table[row][p / page_size]
    long table_len;  // paged: page ids per row of the page table
    long tile_rows;  // gguf: steps of at least this many rows multiply on tile.h's int16 tiles
                     // (int16 activations; 0: never, or where the library has no tiles)
    long att_runs;   // a prefill's consecutive rows of one cache row attend as one run (attn_tile; 0: row by row)
    long split_pieces;  // each thread takes its share of a product in this many chunks and then
                        // chunks of the others' (parallel.h's pe_for_share; 0: its share whole)
    long barrier_yield;  // in steps of at most this many rows a thread waiting at a phase's barrier
                         // yields its core first (pe_barrier; 0: never)
};

// Element offset of K/V at (layer l, row, kv head j, position p): in the contiguous cache
// [layers, cache_rows, kv_heads, cache_len, head_dim], or, paged, in the pool [layers,
// cache_rows pages, kv_heads, page_size, head_dim] at offset p % page_size of the row's page
// table[row * table_len + p / page_size].
// The attention loops call this once a page (kv_walk), the K/V stores once a position.
static inline long kv_offset(const pe_dims *d, const long *table, long l, long row, long j, long p) {
    if (!d->page_size) return (((l * d->cache_rows + row) * d->kv_heads + j) * d->cache_len + p) * d->head_dim;
    const long ps = d->page_size, page = table[row * d->table_len + p / ps];
    return (((l * d->cache_rows + page) * d->kv_heads + j) * ps + p % ps) * d->head_dim;
}

// The KV cache's element types. Written from float32 with round-to-nearest-even, as
// torch's .to(bfloat16/float16) does (so this step and the torch forward store the same
// bits), and widened back to float32 where attention reads them.
enum { PE_KV_F32 = 0, PE_KV_BF16 = 1, PE_KV_F16 = 2 };
typedef _Float16 vh __attribute__((vector_size(VW * 2)));

// f(s, offset) for positions s = 0..n-1 of (layer l, row, kv head j) in order, offset as
// kv_offset's: contiguous from ``base``, paged a page at a time (one table lookup a page,
// then its positions one head_dim apart, as contiguous ones are). Given the cache it
// reads, each position also prefetches the same position of the next page: a page's run
// (4 KB of float32 K a head at 16 x 64) is too short for the hardware's streams to carry
// over. Together 5-7% of the fused step at batch 32 (a paged step against a contiguous
// one: docs/cpu.md, "Paged K/V"). Into L2, not L1 (locality 1: prefetcht1): a core has
// few L1 miss buffers and the walk's demand loads need them; fetched into L1 the next
// page's lines waited behind them (float32 K/V out of cache read at ~10 GB/s a core
// instead of ~16: docs/cpu.md, "Decode attention").
template <class F>
static inline void kv_walk(const pe_dims *d, const long *table, long l, long row, long j, long n, long base, F f,
                           const void *cache = nullptr) {
    const long hd = d->head_dim;
    if (!table) {
        for (long s = 0; s < n; s++) f(s, base + s * hd);
        return;
    }
    const long ps = d->page_size, esz = d->kv_type == PE_KV_F32 ? 4 : 2, line = 64 / esz;
    for (long s0 = 0; s0 < n; s0 += ps) {
        const long at = kv_offset(d, table, l, row, j, s0), end = s0 + ps < n ? s0 + ps : n;
        const long next = cache && end < n ? kv_offset(d, table, l, row, j, end) : -1;
        for (long s = s0; s < end; s++) {
            if (next >= 0)  // the next page one page ahead: a page's run is too short for the streamer
                for (long e = 0; e < hd; e += line)
                    __builtin_prefetch((const char *)cache + (next + (s - s0) * hd + e) * esz, 0, 1);
            f(s, at + (s - s0) * hd);
        }
    }
}

// n floats of src into the cache at element offset off.
static inline void kv_store(const pe_dims *d, void *cache, long off, const float *src, long n) {
    if (d->kv_type == PE_KV_F32) {
        memcpy((float *)cache + off, src, n * sizeof(float));
    } else if (d->kv_type == PE_KV_BF16) {
        uint16_t *dst = (uint16_t *)cache + off;
        for (long i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
    } else {
        _Float16 *dst = (_Float16 *)cache + off;
        for (long i = 0; i < n; i++) dst[i] = (_Float16)src[i];
    }
}

// VW cache elements at element offset off, widened to float32.
static inline vf kv_load(int kv_type, const void *cache, long off) {
    if (kv_type == PE_KV_F32) return load_f((const float *)cache + off);
    if (kv_type == PE_KV_BF16) return widen_bf16((const uint16_t *)cache + off);
    vh h;
    memcpy(&h, (const _Float16 *)cache + off, sizeof h);
    return __builtin_convertvector(h, vf);
}

static inline float kv_at(int kv_type, const void *cache, long off) {
    if (kv_type == PE_KV_F32) return ((const float *)cache)[off];
    if (kv_type == PE_KV_BF16) return from_bf16(((const uint16_t *)cache)[off]);
    return (float)((const _Float16 *)cache)[off];
}

// Whether a step of M rows multiplies block weights on int16 tiles.
static inline bool tiles_for(const pe_dims *d, int M) { return GT_TILES && d->gguf && d->tile_rows && M >= d->tile_rows; }

static int kind_of(const pe_dims *d, int M) {
    if (tiles_for(d, M)) return PE_GGUFT;
    if (d->gguf) return d->q8 == 2 ? PE_GGUFX2 : PE_GGUF;
    return !d->int8 ? (d->bf16 == 2 ? PE_BF16DOT : d->bf16 ? PE_BF16 : PE_F32) : d->q8 == 2 ? PE_Q8X2 : d->q8 ? PE_Q8 : d->group ? PE_I8_GROUPED : PE_I8;
}

// Thread tid's share of the projections that read the same input x (M, K) (for PE_Q8,
// its int8 form xq/xs, quantized by rows before the barrier that precedes this).
static void proj(const pe_dims *d, const float *x, const int8_t *xq, const float *xs, const float *xsf, int M,
                 long K, const pe_seg *segs, int nseg, int tid, int nth, pe_ranges *steal) {
    pe_linear_job job = {x, K, M, K, kind_of(d, M), d->group, segs, nseg, xq, xs, xsf, steal};
    linear_task(&job, tid, nth);
}

// Whether a product's input rows are converted first (int8, or bfloat16 into xq).
static inline bool converts_rows(const pe_dims *d) { return d->q8 || d->bf16 == 2; }

// Rows [r0, r1) of x (M, K) to int8 (or bfloat16) for the next product, when it runs on
// int8 (bfloat16) activations (res: K floats of this thread's scratch, for q8 == 2); on
// int16 tiles (tiles_for), to int16 (xq read as int16_t, xsf holding the blocks' sums).
static void quantize_rows(const pe_dims *d, int M, const float *x, long K, long r0, long r1, int8_t *xq, float *xs,
                          float *xsf, float *res) {
#if GT_TILES
    if (tiles_for(d, M)) {
        const long nb = K / Q8_BLOCK;
        if (r1 > r0) gt_quantize(x + r0 * K, K, (int)(r1 - r0), K, (int16_t *)xq + r0 * K, xs + r0 * nb, xsf + r0 * nb);
        return;
    }
#endif
    if (d->bf16 == 2 && r1 > r0) {
        bf16_rows(x + r0 * K, K, (int)(r1 - r0), K, (uint16_t *)xq + r0 * K);
        return;
    }
    if (!d->q8 || r1 <= r0) return;
    const long p = d->q8, nb = K / Q8_BLOCK;  // int8 rows per row
    if (d->gguf) {  // gguf.h's layouts: with the half-block sums, and int8x2 on one scale
        if (p == 2)
            gq_quantize_x2(x + r0 * K, K, (int)(r1 - r0), K, xq + 2 * r0 * K, xs + 2 * r0 * nb, xsf + 2 * r0 * nb);
        else
            gq_quantize(x + r0 * K, K, (int)(r1 - r0), K, xq + r0 * K, xs + r0 * nb, xsf + 2 * r0 * nb);
        return;
    }
    q8_quantize_rows(x + r0 * K, K, (int)(r1 - r0), K, xq + p * r0 * K, xs + p * r0 * nb, d->q8, res);
}

static void rms_norm(const float *x, const float *w, float *y, long n, float eps) {
    float ss = 0.f;
    for (long i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (long i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

static void rope(float *v, long heads, long hd, const float *cs, const float *sn) {
    long half = hd / 2;
    for (long h = 0; h < heads; h++) {
        float *p = v + h * hd;
        for (long i = 0; i < half; i++) {
            float a = p[i], b = p[i + half];
            p[i] = a * cs[i] - b * sn[i];
            p[i + half] = b * cs[i] + a * sn[i];
        }
    }
}

// Attention of every (row, head) pair over its cache row, split between the threads.
struct pe_attn_job {
    const pe_dims *d;
    long l;
    int M;
    const int *rows, *pos;
    const float *q;
    const void *k_cache, *v_cache;
    const long *table;  // paged: the page table (null: contiguous)
    float *att, *scores;
    const struct pe_att_unit *units;  // null: every (row, head) split evenly (no runs in this step)
    long nunits;
    float *tile_scratch;  // runs: per thread, att_tile_floats(d) floats
};

// Runs (option-free; pe_dims.att_runs): rows m..m+R-1 of one step that are one cache row's
// consecutive positions (a prefill's tokens, a chunked prompt's piece) share every key they
// attend. attn_group walks the keys once per row and pays, per query head and key, a
// horizontal sum of head_dim / VW vectors; for a run the query heads of all its rows are
// taken VW at a time instead, one lane each (lane = row * group + head of the group), and
// each key's value is broadcast against the lanes' queries (head_dim FMAs for VW scores, no
// horizontal sum), the softmax runs along the keys per lane, and the values are summed the
// same way (out, transposed: VW dims of VW lanes a pass). A lane attends keys 0..its own
// position; keys past a lane's position are masked out (weight exactly 0).
// The work is split between the threads by its cost, whole units to a thread: a unit is one
// single row's KV head (attn_group / attn_head) or VW lanes of a run's KV head (attn_tile).
struct pe_att_unit {
    int m, rows, jh, lane;  // rows 0: row m alone; else the run m..m+rows-1, lanes lane..lane+VW-1
    double start, cost;     // the work before this unit and its own, in score-sized steps
};
enum { ATT_RUN_MIN = 4 };  // rows; a shorter run attends row by row
static inline long att_tile_floats(const pe_dims *d) {
    // scores, q transposed, 8 keys widened (VW floats each of S, hd, 8 hd), the keys' offsets (S longs)
    return (d->cache_len + 9 * d->head_dim + 2) * VW + 2 * d->cache_len;
}

// The GQA group of query heads that share KV head jh, of row m, together: each cached
// position's K and V are loaded once for all of them (attn_task's loop loads them once
// per query head: the group's K/V read `group` times over, from L2 or L3 past a few
// hundred positions). For head sizes that are whole vectors, up to ATT_VECS of them, and
// groups up to ATT_GROUP: the same sums as attn_task's in the same order (with the shape
// a compile-time one the compiler fuses some multiplies into their adds: within float32
// rounding). The scores are taken VW keys at a time, each head's VW dot products summed
// across their lanes together (lane_sums: one shuffle tree instead of VW horizontal
// sums, which were most of the scores' time) and stored as one vector; the weights are
// divided by their sum in vector passes, so the values' pass is loads and FMAs only.
enum { ATT_GROUP = 8, ATT_VECS = 16 };
template <int NV, int G>  // the head's vectors and the group's heads when known at compile time (0: at run time)
static void attn_group_of(const pe_attn_job *j, long m, long jh) {
    const pe_dims *d = j->d;
    const long nh = d->heads, nkv = d->kv_heads, hd = d->head_dim, S = d->cache_len;
    const long qs = nh * hd, group = G ? G : nh / nkv, nv = NV ? NV : hd / VW, n = j->pos[m] + 1;
    const float scale = 1.f / sqrtf((float)hd);
    const long base = ((j->l * d->cache_rows + j->rows[m]) * nkv + jh) * S * hd;
    const long *table = j->table;
    const int kt = d->kv_type;
    vf q[ATT_GROUP][ATT_VECS];
    vf mx[ATT_GROUP];
    float sum[ATT_GROUP];
    float *sc[ATT_GROUP];
    for (long t = 0; t < group; t++) {
        const float *qa = j->q + m * qs + (jh * group + t) * hd;
        for (long v = 0; v < nv; v++) q[t][v] = load_f(qa + v * VW);
        sc[t] = j->scores + (m * nh + jh * group + t) * S;
        mx[t] = (vf){} - INFINITY;
    }
    long offs[VW];
    vf dots[ATT_GROUP][VW];  // each head's VW products of a block of keys, before their lanes are summed
    auto scores = [&](long s0, long cnt) {  // keys s0..s0+cnt-1, at offs[0..cnt-1]
        for (long i = 0; i < cnt; i++) {
            vf k[ATT_VECS];
            for (long v = 0; v < nv; v++) k[v] = kv_load(kt, j->k_cache, offs[i] + v * VW);
            for (long t = 0; t < group; t++) {
                vf acc = q[t][0] * k[0];
                for (long v = 1; v < nv; v++) acc += q[t][v] * k[v];
                dots[t][i] = acc;
            }
        }
        for (long t = 0; t < group; t++) {
            for (long i = cnt; i < VW; i++) dots[t][i] = (vf){};
            vf x = lane_sums(dots[t]) * scale;
            memcpy(sc[t] + s0, &x, cnt * sizeof(float));
            for (long i = cnt; i < VW; i++) x[i] = -INFINITY;
            mx[t] = x > mx[t] ? x : mx[t];
        }
    };
    kv_walk(d, table, j->l, j->rows[m], jh, n, base, [&](long s, long kr) {
        offs[s % VW] = kr;
        if (s % VW == VW - 1) scores(s - (VW - 1), VW);
    }, j->k_cache);
    if (n % VW) scores(n - n % VW, n % VW);
    for (long t = 0; t < group; t++) {
        float top = -INFINITY;  // max is exact: any order gives the same value
        for (long i = 0; i < VW; i++) top = mx[t][i] > top ? mx[t][i] : top;
        long s = 0;
        vf vsum = (vf){};
        for (; s + VW <= n; s += VW) {
            vf e = vexp(load_f(sc[t] + s) - top);
            memcpy(sc[t] + s, &e, sizeof e);
            vsum += e;
        }
        sum[t] = hsum(vsum);
        for (; s < n; s++) {
            sc[t][s] = expf(sc[t][s] - top);
            sum[t] += sc[t][s];
        }
        for (s = 0; s + VW <= n; s += VW) {  // the weights: IEEE division, as one key at a time
            vf w = load_f(sc[t] + s) / sum[t];
            memcpy(sc[t] + s, &w, sizeof w);
        }
        for (; s < n; s++) sc[t][s] /= sum[t];
    }
    vf out[ATT_GROUP][ATT_VECS];
    for (long t = 0; t < group; t++)
        for (long v = 0; v < nv; v++) out[t][v] = (vf){};
    kv_walk(d, table, j->l, j->rows[m], jh, n, base, [&](long s, long vr) {
        vf val[ATT_VECS];
        for (long v = 0; v < nv; v++) val[v] = kv_load(kt, j->v_cache, vr + v * VW);
        for (long t = 0; t < group; t++) {
            const float p = sc[t][s];
            for (long v = 0; v < nv; v++) out[t][v] += p * val[v];
        }
    }, j->v_cache);
    for (long t = 0; t < group; t++)
        memcpy(j->att + m * qs + (jh * group + t) * hd, out[t], nv * sizeof(vf));
}

// attn_group_of for the shapes of the models people run, its registers known to the
// compiler (each head's partial outputs held in registers instead of reloaded from memory
// a key at a time; at 16 vectors a head, 128 on the 8-lane paths or 256 on AVX-512, they
// spill, and the compiled loops still ran ~10% faster in a throwaway harness); any other
// shape at run time.
static void attn_group(const pe_attn_job *j, long m, long jh) {
    const long nv = j->d->head_dim / VW, group = j->d->heads / j->d->kv_heads;
#define PE_ATT_SHAPE(V, G) \
    if (nv == V && group == G) return attn_group_of<V, G>(j, m, jh);
    PE_ATT_SHAPE(4, 2) PE_ATT_SHAPE(4, 3) PE_ATT_SHAPE(4, 4) PE_ATT_SHAPE(4, 8)
    PE_ATT_SHAPE(8, 2) PE_ATT_SHAPE(8, 3) PE_ATT_SHAPE(8, 4)
    PE_ATT_SHAPE(16, 2) PE_ATT_SHAPE(16, 3) PE_ATT_SHAPE(16, 4)
#undef PE_ATT_SHAPE
    attn_group_of<0, 0>(j, m, jh);
}

// Query head a of row m over its cache row (any head size, any grouping), its walks
// prefetching the next page as attn_group's do.
static void attn_head(const pe_attn_job *j, long m, long a) {
    const pe_dims *d = j->d;
    const long nh = d->heads, nkv = d->kv_heads, hd = d->head_dim, S = d->cache_len;
    const long qs = nh * hd, group = nh / nkv;
    const float scale = 1.f / sqrtf((float)hd);
    const long jh = a / group, n = j->pos[m] + 1;
    const float *qa = j->q + m * qs + a * hd;
    const long base = ((j->l * d->cache_rows + j->rows[m]) * nkv + jh) * S * hd;  // element offset
    const long *table = j->table;  // paged: each position's offset through the row's page table
    const int kt = d->kv_type;
    float *sc = j->scores + (m * nh + a) * S;
    float mx = -INFINITY;
    const long hv = hd - hd % VW;  // q . k in vector lanes (a scalar loop would be latency-bound)
    kv_walk(d, table, j->l, j->rows[m], jh, n, base, [&](long s, long kr) {
        vf acc = (vf){};
        for (long i = 0; i < hv; i += VW) acc += load_f(qa + i) * kv_load(kt, j->k_cache, kr + i);
        float dot = hsum(acc);
        for (long i = hv; i < hd; i++) dot += qa[i] * kv_at(kt, j->k_cache, kr + i);
        sc[s] = dot * scale;
        mx = sc[s] > mx ? sc[s] : mx;
    }, j->k_cache);
    float sum = 0.f;
    long s = 0;
    vf vsum = (vf){};
    for (; s + VW <= n; s += VW) {
        vf e = vexp(load_f(sc + s) - mx);
        memcpy(sc + s, &e, sizeof e);
        vsum += e;
    }
    sum = hsum(vsum);
    for (; s < n; s++) {
        sc[s] = expf(sc[s] - mx);
        sum += sc[s];
    }
    float *out = j->att + m * qs + a * hd;
    for (long i = 0; i < hd; i++) out[i] = 0.f;
    if (kt == PE_KV_F32) {
        kv_walk(d, table, j->l, j->rows[m], jh, n, base, [&](long s, long vr) {
            const float p = sc[s] / sum;
            const float *vs = (const float *)j->v_cache + vr;
            for (long i = 0; i < hd; i++) out[i] += p * vs[i];
        }, j->v_cache);
    } else {
        kv_walk(d, table, j->l, j->rows[m], jh, n, base, [&](long s, long vr) {
            const float p = sc[s] / sum;
            long i = 0;
            for (; i < hv; i += VW) {
                vf o = load_f(out + i) + p * kv_load(kt, j->v_cache, vr + i);
                memcpy(out + i, &o, sizeof o);
            }
            for (; i < hd; i++) out[i] += p * kv_at(kt, j->v_cache, vr + i);
        }, j->v_cache);
    }
}

static inline bool att_grouped(const pe_dims *d) {
    const long hd = d->head_dim, group = d->heads / d->kv_heads;
    return hd % VW == 0 && hd / VW <= ATT_VECS && group <= ATT_GROUP && group > 1;
}

// VW lanes (from `lane`) of the run m0..m0+R-1's query heads of KV head jh; ws: this
// thread's att_tile_floats(d) floats.
static void attn_tile(const pe_attn_job *j, long m0, long R, long jh, long lane, float *ws) {
    const pe_dims *d = j->d;
    const long nh = d->heads, nkv = d->kv_heads, hd = d->head_dim, S = d->cache_len;
    const long qs = nh * hd, group = nh / nkv, lanes = R * group, nl = lanes - lane < VW ? lanes - lane : VW;
    const float scale = 1.f / sqrtf((float)hd);
    const long *table = j->table;
    const int kt = d->kv_type, row = j->rows[m0];
    const long base = ((j->l * d->cache_rows + row) * nkv + jh) * S * hd;
    float *sc = ws;                 // (n, VW): the scores, then the weights
    float *qt = sc + S * VW;        // (hd, VW): the lanes' queries, scaled, transposed
    float *kb = qt + hd * VW;       // (8, hd): keys widened to float32 (bfloat16/float16 caches)
    long *offs = (long *)(kb + 8 * hd);  // (S): each key's element offset, for K and V alike
    float lp[VW];
    long lo = S, n = 0;             // the lanes' lowest and highest position + 1
    for (long l = 0; l < VW; l++) {
        const long t = lane + (l < nl ? l : 0), m = m0 + t / group, a = jh * group + t % group;
        const float *qa = j->q + m * qs + a * hd;
        for (long e = 0; e < hd; e++) qt[e * VW + l] = l < nl ? qa[e] * scale : 0.f;
        const long p = j->pos[m];
        lp[l] = (float)p;  // exact: positions are far below 2^24
        lo = p < lo ? p : lo;
        n = p + 1 > n ? p + 1 : n;
    }
    kv_walk(d, table, j->l, row, jh, n, base, [&](long s, long off) { offs[s] = off; });
    vf vpos;
    memcpy(&vpos, lp, sizeof vpos);
    const vf ninf = (vf){} - INFINITY;
    auto key = [&](long s, long i) -> const float * {  // key s as float32 (slot i of kb when widened)
        const long off = offs[s];
        if (kt == PE_KV_F32) return (const float *)j->k_cache + off;
        float *dst = kb + i * hd;
        for (long e = 0; e < hd; e += VW) {
            vf w = kv_load(kt, j->k_cache, off + e);
            memcpy(dst + e, &w, sizeof w);
        }
        return dst;
    };
    vf mx = ninf;
    long s = 0;
    for (; s + 8 <= n; s += 8) {  // eight keys at a time: eight independent FMA chains
        const float *k0 = key(s, 0), *k1 = key(s + 1, 1), *k2 = key(s + 2, 2), *k3 = key(s + 3, 3);
        const float *k4 = key(s + 4, 4), *k5 = key(s + 5, 5), *k6 = key(s + 6, 6), *k7 = key(s + 7, 7);
        vf a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
        for (long e = 0; e < hd; e++) {
            const vf qv = load_f(qt + e * VW);
            a0 += qv * k0[e], a1 += qv * k1[e], a2 += qv * k2[e], a3 += qv * k3[e];
            a4 += qv * k4[e], a5 += qv * k5[e], a6 += qv * k6[e], a7 += qv * k7[e];
        }
        vf acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
        for (long i = 0; i < 8; i++) {
            if (s + i > lo) acc[i] = vpos >= (float)(s + i) ? acc[i] : ninf;
            mx = acc[i] > mx ? acc[i] : mx;
            memcpy(sc + (s + i) * VW, &acc[i], sizeof(vf));
        }
    }
    for (; s < n; s++) {
        const float *k0 = key(s, 0);
        vf a0 = {};
        for (long e = 0; e < hd; e++) a0 += load_f(qt + e * VW) * k0[e];
        if (s > lo) a0 = vpos >= (float)s ? a0 : ninf;
        mx = a0 > mx ? a0 : mx;
        memcpy(sc + s * VW, &a0, sizeof a0);
    }
    vf sum = {};
    for (s = 0; s < n; s++) {
        vf e = vexp(load_f(sc + s * VW) - mx);
        memcpy(sc + s * VW, &e, sizeof e);
        sum += e;
    }
    const vf inv = 1.f / sum;
    float o[VW][VW];  // o[i][l]: dim c + i of lane l
    for (long c = 0; c < hd; c += VW) {
        vf acc[VW];
        for (long i = 0; i < VW; i++) acc[i] = (vf){};
        for (s = 0; s < n; s++) {
            const long off = offs[s] + c;
            const vf p = load_f(sc + s * VW);
            float vv[VW];
            if (kt == PE_KV_F32) {
                memcpy(vv, (const float *)j->v_cache + off, sizeof vv);
            } else {
                vf w = kv_load(kt, j->v_cache, off);
                memcpy(vv, &w, sizeof w);
            }
            for (long i = 0; i < VW; i++) acc[i] += p * vv[i];
        }
        for (long i = 0; i < VW; i++) {
            vf r = acc[i] * inv;
            memcpy(o[i], &r, sizeof r);
        }
        for (long l = 0; l < nl; l++) {
            const long t = lane + l, m = m0 + t / group, a = jh * group + t % group;
            float *out = j->att + m * qs + a * hd + c;
            for (long i = 0; i < VW; i++) out[i] = o[i][l];
        }
    }
}

// Row m's query heads of KV head jh: as one group where the shape allows it and `grouped`
// is set (attn_group), else one query head at a time (attn_head). Returns whether the group
// ran.
static bool attn_kv_head(const pe_attn_job *j, long m, long jh, bool grouped) {
    if (grouped && att_grouped(j->d)) {
        attn_group(j, m, jh);
        return true;
    }
    const long group = j->d->heads / j->d->kv_heads;
    for (long t = 0; t < group; t++) attn_head(j, m, jh * group + t);
    return false;
}

static void attn_task(void *arg, int tid, int nth) {
    const pe_attn_job *j = (const pe_attn_job *)arg;
    const pe_dims *d = j->d;
    const long nh = d->heads, nkv = d->kv_heads;
    long b, e;
    if (j->units) {  // runs in this step: whole units by cost
        const double total = j->units[j->nunits - 1].start + j->units[j->nunits - 1].cost;
        const double lo = total * tid / nth, hi = total * (tid + 1) / nth;
        float *ws = j->tile_scratch + tid * att_tile_floats(d);
        for (long u = 0; u < j->nunits; u++) {
            const pe_att_unit *x = j->units + u;
            const double mid = x->start + x->cost / 2;
            if (mid < lo || mid >= hi) continue;
            if (x->rows)
                attn_tile(j, x->m, x->rows, x->jh, x->lane, ws);
            else
                attn_kv_head(j, x->m, x->jh, true);
        }
        return;
    }
    if (att_grouped(d)) {
        pe_share((long)j->M * nkv, tid, nth, &b, &e);
        for (long mj = b; mj < e; mj++) attn_group(j, mj / nkv, mj % nkv);
        return;
    }
    pe_share((long)j->M * nh, tid, nth, &b, &e);
    for (long ma = b; ma < e; ma++) attn_head(j, ma / nh, ma % nh);
}

// The attention units of a step whose rows hold a run of at least ATT_RUN_MIN rows (else
// none: every row attends alone, split evenly as before runs existed).
static std::vector<pe_att_unit> att_units(const pe_dims *d, int M, const int *rows, const int *pos) {
    std::vector<pe_att_unit> units;
    if (!d->att_runs || d->head_dim % VW) return units;
    const long nkv = d->kv_heads, group = d->heads / nkv;
    bool any = false;
    double at = 0;
    for (int m = 0; m < M;) {
        int r = 1;
        while (m + r < M && rows[m + r] == rows[m] && pos[m + r] == pos[m] + r) r++;
        for (long jh = 0; jh < nkv; jh++) {
            if (r >= ATT_RUN_MIN) {
                any = true;
                for (long lane = 0; lane < r * group; lane += VW) {
                    const long last = m + (lane + VW < r * group ? lane + VW : r * group) / group;
                    const double c = (double)(pos[last - 1] + 1) * VW;
                    units.push_back({m, r, (int)jh, (int)lane, at, c});
                    at += c;
                }
            } else {
                for (int i = 0; i < r; i++) {  // a row alone: ~2 steps a score (the horizontal sums)
                    const double c = 2.0 * (pos[m + i] + 1) * group;
                    units.push_back({m + i, 0, (int)jh, 0, at, c});
                    at += c;
                }
            }
        }
        m += r;
    }
    if (!any) units.clear();
    return units;
}

// -DPE_PROFILE: thread 0 adds each phase's time to pe_phase_ns (read with pe_profile);
// for finding where a step's time goes, never in a normal build.
#ifdef PE_PROFILE
#include <chrono>
static double pe_phase_ns[8];
static inline double pe_now() {
    return (double)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}
#define PE_MARK(i)                                   \
    if (tid == 0) {                                  \
        double t_ = pe_now();                        \
        pe_phase_ns[i] += t_ - pe_t0;                \
        pe_t0 = t_;                                  \
    }
#else
#define PE_MARK(i)
#endif

// x: (M, H) in/out (the residual stream: embeddings in, final hidden states out, before
// the final norm). rows/pos: each row's cache row (paged: its page-table row) and position;
// table: the page table when d->page_size (null otherwise). scratch: at least
// M * (q_size + 2 * kv_size + q_size + 2 * intermediate + hidden) floats, plus
// M * heads * cache_len for the attention scores, plus threads * kmax + 2M * kmax / 32
// floats and 2M * kmax bytes for the int8 activations, kmax the longest K of a projection,
// plus 16 + threads * att_tile_floats(d) floats for the runs' attention.
static void decode_step(const pe_dims *d, const pe_layer *layers, float *x, int M, const int *rows, const int *pos,
                        void *k_cache, void *v_cache, const long *table, const float *rope_cos, const float *rope_sin,
                        float *scratch) {
    const long H = d->hidden, I = d->intermediate, nh = d->heads, nkv = d->kv_heads, hd = d->head_dim;
    const long qs = nh * hd, kvs = nkv * hd, S = d->cache_len;
    float *h = scratch;               // (M, H)
    float *q = h + M * H;             // (M, qs)
    float *k = q + M * qs;            // (M, kvs)
    float *v = k + M * kvs;           // (M, kvs)
    float *att = v + M * kvs;         // (M, qs)
    float *g = att + M * qs;          // (M, I)
    float *u = g + M * I;             // (M, I)
    float *tmp = u + M * I;           // (M, H)
    float *scores = tmp + M * H;      // (M * nh, S)
    const long kmax = I > H ? (I > qs ? I : qs) : (H > qs ? H : qs);
    float *res = scores + M * nh * S;  // (threads, kmax): q8 == 2 residuals
    float *xs = res + d->threads * kmax;  // (2M, kmax / 32): int8 activations' scales (q8)
    float *xsf = xs + 2 * M * (kmax / 32);  // (2M, kmax / 32): with gguf, xs times the blocks' sums
    int8_t *xq = (int8_t *)(xsf + 2 * M * (kmax / 32));  // (2M, kmax)
    // runs: threads * att_tile_floats(d) floats, 64-byte aligned, after xq
    float *tiles = (float *)(((uintptr_t)(xq + 2 * M * kmax) + 63) & ~(uintptr_t)63);
    const std::vector<pe_att_unit> units = att_units(d, M, rows, pos);
    pe_barrier bar;
    bar.yield_first = M <= d->barrier_yield;  // steps of at most barrier_yield rows (0: none)
    pe_ranges ranges;  // the products' shares (split_pieces), set by the first thread to reach each product
    ranges.pieces = (int)d->split_pieces;
    pe_ranges *steal = d->split_pieces > 0 ? &ranges : nullptr;
    // One parallel region for the whole step; its phases are separated by bar.wait().
    // Row-wise work (norms, RoPE and cache writes) is split by row, element-wise work by
    // element: each thread's share is fixed by (tid, nth), so writes never overlap.
#pragma omp parallel num_threads(d->threads > 1 ? d->threads : 1)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#ifdef PE_PROFILE
        double pe_t0 = pe_now();
#endif
        long r0, r1, e0, e1;
        pe_share(M, tid, nth, &r0, &r1);
        // tmp (M, H) = in (M, K) @ W^T for the o and down projections, whose input the
        // threads wrote by element or by head: quantized by rows (q8) after a barrier.
        auto into_tmp = [&](const float *in, long K, const void *wt, const float *scale, const float *bias, int fmt,
                            const long *rowoff, const uint8_t *packed) {
            if (converts_rows(d)) {
                quantize_rows(d, M, in, K, r0, r1, xq, xs, xsf, res + tid * kmax);
                bar.wait(nth);
            }
            const pe_seg seg[1] = {{wt, scale, bias, tmp, H, H, fmt, rowoff, packed}};
            proj(d, in, xq, xs, xsf, M, K, seg, 1, tid, nth, steal);
            bar.wait(nth);
        };
        for (long l = 0; l < d->layers; l++) {
            const pe_layer *w = layers + l;
            for (long m = r0; m < r1; m++) rms_norm(x + m * H, w->input_norm, h + m * H, H, d->eps);
            quantize_rows(d, M, h, H, r0, r1, xq, xs, xsf, res + tid * kmax);
            bar.wait(nth);
            const pe_seg qkv[3] = {{w->q, w->q_scale, w->q_bias, q, qs, qs, w->fmt[0], w->rowoff[0], w->packed[0]},
                                   {w->k, w->k_scale, w->k_bias, k, kvs, kvs, w->fmt[1], w->rowoff[1], w->packed[1]},
                                   {w->v, w->v_scale, w->v_bias, v, kvs, kvs, w->fmt[2], w->rowoff[2], w->packed[2]}};
            proj(d, h, xq, xs, xsf, M, H, qkv, 3, tid, nth, steal);
            bar.wait(nth);
            PE_MARK(1)
            for (long m = r0; m < r1; m++) {
                const float *cs = rope_cos + (long)pos[m] * (hd / 2), *sn = rope_sin + (long)pos[m] * (hd / 2);
                rope(q + m * qs, nh, hd, cs, sn);
                rope(k + m * kvs, nkv, hd, cs, sn);
                for (long j = 0; j < nkv; j++) {  // write K (after RoPE) and V at (layer, row, head, pos)
                    const long off = kv_offset(d, table, l, rows[m], j, pos[m]);
                    kv_store(d, k_cache, off, k + m * kvs + j * hd, hd);
                    kv_store(d, v_cache, off, v + m * kvs + j * hd, hd);
                }
            }
            bar.wait(nth);
            PE_MARK(2)
            pe_attn_job aj = {d, l, M, rows, pos, q, k_cache, v_cache, table, att, scores,
                              units.empty() ? nullptr : units.data(), (long)units.size(), tiles};
            attn_task(&aj, tid, nth);
            bar.wait(nth);
            PE_MARK(3)
            into_tmp(att, qs, w->o, w->o_scale, w->o_bias, w->fmt[3], w->rowoff[3], w->packed[3]);
            PE_MARK(4)
            for (long m = r0; m < r1; m++) {
                for (long i = 0; i < H; i++) x[m * H + i] += tmp[m * H + i];
                rms_norm(x + m * H, w->post_norm, h + m * H, H, d->eps);
            }
            quantize_rows(d, M, h, H, r0, r1, xq, xs, xsf, res + tid * kmax);
            bar.wait(nth);
            const pe_seg gate_up[2] = {{w->gate, w->gate_scale, w->gate_bias, g, I, I, w->fmt[4], w->rowoff[4], w->packed[4]},
                                       {w->up, w->up_scale, w->up_bias, u, I, I, w->fmt[5], w->rowoff[5], w->packed[5]}};
            proj(d, h, xq, xs, xsf, M, H, gate_up, 2, tid, nth, steal);
            bar.wait(nth);
            PE_MARK(5)
            pe_share(M * I, tid, nth, &e0, &e1);
            long i = e0;
            for (; i + VW <= e1; i += VW) {  // SiLU(gate) * up
                vf gv = load_f(g + i), out = gv / (1.f + vexp(-gv)) * load_f(u + i);
                memcpy(g + i, &out, sizeof out);
            }
            for (; i < e1; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
            bar.wait(nth);
            into_tmp(g, I, w->down, w->down_scale, w->down_bias, w->fmt[6], w->rowoff[6], w->packed[6]);
            PE_MARK(6)
            for (long m = r0; m < r1; m++)
                for (long i = 0; i < H; i++) x[m * H + i] += tmp[m * H + i];
            // the next layer's first phase reads only this thread's rows of x: no barrier
        }
    }
}
