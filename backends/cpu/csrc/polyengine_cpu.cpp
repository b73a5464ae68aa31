// The CPU kernels as one library: this file includes every part (one concept per header,
// each including what it uses; their functions are static or inline) and holds the C ABI
// that kernels.py calls through ctypes. build.py compiles this one file, once per host,
// ISA path and compiler (its flags and cache key are there).
//
//   simd.h          the ISA path's vector types, loads, bfloat16 rounding, hsum, vexp
//   parallel.h      OpenMP threads with spinning barriers
//   q8.h            int8 weights against int8-quantized activations (VNNI, AVX2)
//   gguf.h          GGUF block weights (Q8_0 ... Q6_K) as mapped: products, dequantization
//   linear.h        skinny products y = x @ W^T: float32, bfloat16 or int8 weights
//   decode.h        a whole fused decode step and its descriptors (pe_layer, pe_dims)
//   prefill_attn.h  a prefill's causal attention, flash-attention order
//   tile.h          GGUF block weights against many rows of x: int16 tiles (AVX-512 VNNI)
//   packed.h        GGUF block weights repacked sixteen rows interleaved: decode products
//   threefry.h      the sampler's random stream (Threefry-2x32-20) over rows of token ids
#include <stddef.h>

#include "decode.h"
#include "gguf.h"
#include "linear.h"
#include "parallel.h"
#include "prefill_attn.h"
#include "packed.h"
#include "q8.h"
#include "simd.h"
#include "threefry.h"
#include "tile.h"

// The layout of every struct Python passes in, as this compiler laid it out: one entry per
// field and one per struct (field "": its size). kernels.py compares its ctypes mirrors
// with it at load and refuses the library on any difference.
struct pe_field_layout {
    const char *record, *field;
    long offset, size;
};
#define PE_RECORD(T) {#T, "", 0, (long)sizeof(T)}
#define PE_FIELD(T, f) {#T, #f, (long)offsetof(T, f), (long)sizeof(((T *)nullptr)->f)}
static const pe_field_layout pe_layouts[] = {
    PE_RECORD(pe_layer),
    PE_FIELD(pe_layer, input_norm), PE_FIELD(pe_layer, post_norm),
    PE_FIELD(pe_layer, q), PE_FIELD(pe_layer, k), PE_FIELD(pe_layer, v), PE_FIELD(pe_layer, o),
    PE_FIELD(pe_layer, gate), PE_FIELD(pe_layer, up), PE_FIELD(pe_layer, down),
    PE_FIELD(pe_layer, q_scale), PE_FIELD(pe_layer, k_scale), PE_FIELD(pe_layer, v_scale),
    PE_FIELD(pe_layer, o_scale), PE_FIELD(pe_layer, gate_scale), PE_FIELD(pe_layer, up_scale),
    PE_FIELD(pe_layer, down_scale),
    PE_FIELD(pe_layer, q_bias), PE_FIELD(pe_layer, k_bias), PE_FIELD(pe_layer, v_bias),
    PE_FIELD(pe_layer, o_bias), PE_FIELD(pe_layer, gate_bias), PE_FIELD(pe_layer, up_bias),
    PE_FIELD(pe_layer, down_bias), PE_FIELD(pe_layer, fmt), PE_FIELD(pe_layer, rowoff), PE_FIELD(pe_layer, packed),
    PE_RECORD(pe_dims),
    PE_FIELD(pe_dims, hidden), PE_FIELD(pe_dims, intermediate), PE_FIELD(pe_dims, heads),
    PE_FIELD(pe_dims, kv_heads), PE_FIELD(pe_dims, head_dim), PE_FIELD(pe_dims, layers),
    PE_FIELD(pe_dims, cache_rows), PE_FIELD(pe_dims, cache_len), PE_FIELD(pe_dims, eps),
    PE_FIELD(pe_dims, int8), PE_FIELD(pe_dims, group), PE_FIELD(pe_dims, threads), PE_FIELD(pe_dims, q8),
    PE_FIELD(pe_dims, kv_type), PE_FIELD(pe_dims, bf16), PE_FIELD(pe_dims, gguf),
    PE_FIELD(pe_dims, page_size), PE_FIELD(pe_dims, table_len), PE_FIELD(pe_dims, tile_rows),
    PE_FIELD(pe_dims, att_runs), PE_FIELD(pe_dims, split_pieces), PE_FIELD(pe_dims, barrier_yield),
};
// A field appended to a struct and not to the table (nor to Python's mirror) would escape
// the check: the table's last field must end its struct.
static_assert(offsetof(pe_layer, packed) + sizeof(pe_layer::packed) == sizeof(pe_layer),
              "pe_layer has a field after packed: list it in pe_layouts and in kernels.py's _Layer");
static_assert(offsetof(pe_dims, barrier_yield) + sizeof(pe_dims::barrier_yield) == sizeof(pe_dims),
              "pe_dims has a field after barrier_yield: list it in pe_layouts and in kernels.py's _Dims");

extern "C" {

// Entry i of the layout table into record/field/offset/size: 0, or -1 past its end.
// Plain values out, no struct: this call itself has no layout to get wrong.
int pe_layout_field(int i, const char **record, const char **field, long *offset, long *size) {
    if (i < 0 || i >= (int)(sizeof pe_layouts / sizeof pe_layouts[0])) return -1;
    *record = pe_layouts[i].record, *field = pe_layouts[i].field;
    *offset = pe_layouts[i].offset, *size = pe_layouts[i].size;
    return 0;
}

int pe_vector_width(void) { return VW; }
// The instruction set compiled in: 2 AVX-512, 1 AVX2 with FMA, 0 neither (SSE or plain C++).
int pe_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

void pe_linear_f32(const float *x, long ldx, const float *w, const float *bias, float *y, long ldy,
                   int M, long N, long K, int threads) {
    pe_seg seg = {w, nullptr, bias, y, ldy, N};
    linear_segs(x, ldx, M, K, PE_F32, 0, &seg, 1, threads);
}

// w: bfloat16 bits (N, K).
void pe_linear_bf16(const float *x, long ldx, const uint16_t *w, const float *bias, float *y, long ldy,
                    int M, long N, long K, int threads) {
    pe_seg seg = {w, nullptr, bias, y, ldy, N};
    linear_segs(x, ldx, M, K, PE_BF16, 0, &seg, 1, threads);
}

// The same against x rounded to bfloat16 (xb: M * K uint16_t of scratch).
void pe_linear_bf16dot(const float *x, long ldx, const uint16_t *w, const float *bias, float *y, long ldy,
                       int M, long N, long K, int threads, uint16_t *xb) {
    bf16_rows(x, ldx, M, K, xb);
    pe_seg seg = {w, nullptr, bias, y, ldy, N};
    linear_segs(x, ldx, M, K, PE_BF16DOT, 0, &seg, 1, threads, (const int8_t *)xb);
}

// 1 where the bf16 products run on vdpbf16ps (AVX512-BF16), 0 where in float32.
int pe_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

void pe_linear_i8(const float *x, long ldx, const int8_t *w, const float *scale, const float *bias,
                  float *y, long ldy, int M, long N, long K, int threads) {
    pe_seg seg = {w, scale, bias, y, ldy, N};
    linear_segs(x, ldx, M, K, PE_I8, 0, &seg, 1, threads);
}

// group: weights per scale along K (a multiple of the vector width dividing K).
void pe_linear_i8_grouped(const float *x, long ldx, const int8_t *w, const float *scale, const float *bias,
                          float *y, long ldy, int M, long N, long K, long group, int threads) {
    pe_seg seg = {w, scale, bias, y, ldy, N};
    linear_segs(x, ldx, M, K, PE_I8_GROUPED, group, &seg, 1, threads);
}

// int8 weights (scales per row: group 0, or per group of a multiple of 32) against x
// quantized to int8 per 32 values (q8.h); K % 32 == 0. pairs: 2 for PE_Q8X2 (two int8
// rows per row of x), else 1. Scratch: xq pairs * M * K bytes, xs pairs * M * K / 32
// floats, res K floats.
void pe_linear_q8(const float *x, long ldx, const int8_t *w, const float *scale, const float *bias,
                  float *y, long ldy, int M, long N, long K, long group, int threads, int8_t *xq, float *xs,
                  int pairs, float *res) {
    q8_quantize_rows(x, ldx, M, K, xq, xs, pairs, res);
    pe_seg seg = {w, scale, bias, y, ldy, N};
    linear_segs(x, ldx, M, K, pairs == 2 ? PE_Q8X2 : PE_Q8, group, &seg, 1, threads, xq, xs);
}

int pe_q8_isa(void) { return PE_Q8_ISA; }

// Weights in GGUF block format fmt (ggml's type id), row n at w + rowoff[n] (or n * ldw):
// y = x @ W^T + bias against x quantized per 32 values (gguf.h); pairs 2 carries each
// row of x as two int8 rows on one scale (gguf.h's gq_quantize_x2), combined in int32.
// Scratch: xq pairs * M * K bytes, xs pairs * M * K / 32 floats and xsf 2 * M * K / 32
// (two sums a block).
// 0, or -1 where K is not a multiple of the format's block or the format is not gguf.h's.
int pe_gguf_linear(int fmt, const float *x, long ldx, const uint8_t *w, long ldw, const long *rowoff,
                   const float *bias, float *y, long ldy, int M, long N, long K, int threads, int8_t *xq, float *xs,
                   float *xsf, int pairs) {
    const int block = gq_block(fmt);
    if (!block || K % block) return -1;
    if (pairs == 2)
        gq_quantize_x2(x, ldx, M, K, xq, xs, xsf);
    else
        gq_quantize(x, ldx, M, K, xq, xs, xsf);
    gq_job job = {fmt, M, K, N, ldw, ldy, xq, xs, xsf, bias, w, rowoff, y, 0, pairs == 2};
    pe_parallel(gq_task, &job, threads);
    return 0;
}

// Rows [0, rows) of such weights as float32 into out (ldo floats a row); 0 or -1 as above.
int pe_gguf_dequant(int fmt, const uint8_t *w, long ldw, const long *rowoff, long rows, long K, float *out, long ldo,
                    int threads) {
    const int block = gq_block(fmt);
    if (!block || K % block) return -1;
    gq_job job = {fmt, 0, K, rows, ldw, ldo, nullptr, nullptr, nullptr, nullptr, w, rowoff, out, 1, 0};
    pe_parallel(gq_task, &job, threads);
    return 0;
}

// 1 where a matrix of format fmt and K columns repacks for pe_gguf_packed_linear on this
// library (packed.h: Q4_0, Q8_0, Q4_K, Q6_K on the AVX-512 VNNI path), else 0.
int pe_gguf_packs(int fmt, long K) { return gp_packs(fmt, K); }

// Bytes of N rows of K weights repacked (whole groups of sixteen rows); 0 for a format
// that does not repack.
long pe_gguf_packed_bytes(int fmt, long N, long K) {
    return gp_unit_bytes(fmt) ? (N + GP_ROWS - 1) / GP_ROWS * gp_group_bytes(fmt, K) : 0;
}

// The rows of a block matrix (row n at w + rowoff[n], or n * ldw) repacked into dst
// (pe_gguf_packed_bytes of them): 0, or -1 where pe_gguf_packs says no.
int pe_gguf_repack(int fmt, const uint8_t *w, long ldw, const long *rowoff, long N, long K, uint8_t *dst, int threads) {
    if (!gp_packs(fmt, K)) return -1;
    gp_repack_job job = {fmt, w, ldw, rowoff, N, K, dst};
    pe_parallel(gp_repack_task, &job, threads);
    return 0;
}

// pe_gguf_linear's product on a repacked matrix (pe_gguf_repack); scratch and pairs as
// there. 0; -1 where pe_gguf_packs says no.
int pe_gguf_packed_linear(int fmt, const float *x, long ldx, const uint8_t *packed, const float *bias, float *y,
                          long ldy, int M, long N, long K, int threads, int8_t *xq, float *xs, float *xsf, int pairs) {
    if (!gp_packs(fmt, K)) return -1;
#if GP_PACKED
    if (pairs == 2)
        gq_quantize_x2(x, ldx, M, K, xq, xs, xsf);
    else
        gq_quantize(x, ldx, M, K, xq, xs, xsf);
    gp_job job = {fmt, M, pairs == 2, K, N, ldy, xq, xs, xsf, bias, packed, y};
    pe_parallel(gp_task, &job, threads);
#endif
    return 0;
}

// 1 where pe_gguf_tile_linear runs (the AVX-512 VNNI path, tile.h), else 0.
int pe_gguf_tiles(void) { return GT_TILES; }

// The same product as pe_gguf_linear on tile.h's int16 tiles, for many rows of x. Scratch:
// xq M * K int16, xs and xsum M * K / 32 floats each. 0; -1 as pe_gguf_linear's; -2 where
// this library has no tiles (pe_gguf_tiles 0). packed: w repacked (pe_gguf_repack) or null,
// the tiles filled from it (-1 where it cannot be: pe_gguf_packs).
int pe_gguf_tile_linear(int fmt, const float *x, long ldx, const uint8_t *w, long ldw, const long *rowoff,
                        const uint8_t *packed, const float *bias, float *y, long ldy, int M, long N, long K,
                        int threads, int16_t *xq, float *xs, float *xsum) {
#if GT_TILES
    const int block = gq_block(fmt);
    if (!block || K % block) return -1;
    gt_quantize(x, ldx, M, K, xq, xs, xsum);
    if (packed && !gp_packs(fmt, K)) return -1;
    gt_job job = {fmt, M, K, N, ldw, ldy, xq, xs, xsum, bias, w, rowoff, packed, y};
    pe_parallel(gt_task, &job, threads);
    return 0;
#else
    (void)fmt, (void)x, (void)ldx, (void)w, (void)ldw, (void)rowoff, (void)packed, (void)bias, (void)y, (void)ldy, (void)M;
    (void)N, (void)K, (void)threads, (void)xq, (void)xs, (void)xsum;
    return -2;
#endif
}

void pe_q8_quantize(const float *x, long ldx, int M, long K, int8_t *xq, float *xs) {
    q8_quantize(x, ldx, M, K, xq, xs);
}

void pe_q8_linear(const int8_t *xq, const float *xs, int M, long K, const int8_t *w, const float *wscale,
                  long wgroup, const float *bias, float *y, long ldy, long N) {
    q8_rows(xq, xs, M, K, w, wscale, wgroup, bias, y, ldy, 0, N);
}

// One fused decode step (decode.h's decode_step: its arguments and scratch size there).
void pe_decode(const pe_dims *d, const pe_layer *layers, float *x, int M, const int *rows, const int *pos,
               void *k_cache, void *v_cache, const long *table, const float *rope_cos, const float *rope_sin,
               float *scratch) {
    decode_step(d, layers, x, M, rows, pos, k_cache, v_cache, table, rope_cos, rope_sin, scratch);
}

// How a step of these rows splits its attention (decode.h's att_units): the units that
// take a run's lanes together (attn_tile), written to tiles[i] as that unit's run length
// for i < max; returns their count (0: every row attends alone).
int pe_attention_runs(const pe_dims *d, int M, const int *rows, const int *pos, int *tiles, int max) {
    int n = 0;
    for (const pe_att_unit &u : att_units(d, M, rows, pos))
        if (u.rows) {
            if (n < max) tiles[n] = u.rows;
            n++;
        }
    return n;
}

// One layer's decode attention alone, on this thread (tests/test_cpu_decode_attention.py):
// every (row, query head) of M rows over its cache row as the fused step attends them
// (decode.h's attn_kv_head: by GQA group where the shape allows it and `grouped` is set,
// else one query head at a time). Returns 1 where the groups ran.
int pe_decode_attention(const pe_dims *d, long l, int M, const int *rows, const int *pos, const float *q,
                        const void *k_cache, const void *v_cache, const long *table, float *att, int grouped) {
    std::vector<float> scores((size_t)M * d->heads * d->cache_len);
    const pe_attn_job j = {d, l, M, rows, pos, q, k_cache, v_cache, table, att, scores.data(), nullptr, 0, nullptr};
    bool by_group = false;
    for (long m = 0; m < M; m++)
        for (long jh = 0; jh < d->kv_heads; jh++) by_group = attn_kv_head(&j, m, jh, grouped);
    return by_group;
}

// A check of parallel.h's pe_for_share (tests/test_cpu_engine.py): items [0, total) shared
// by nth threads in `pieces` chunks a share (0: whole shares), thread `slow` starting
// delay_us late, each item spinning ~item_ns. ran[i] gets the thread that ran item i, or
// -2 where two did. Returns the number of items thread `slow` ran.
long pe_split_check(long total, int nth, int pieces, int slow, long delay_us, long item_ns, int *ran) {
    for (long i = 0; i < total; i++) ran[i] = -1;
    pe_ranges r;
    r.pieces = pieces;
    long slow_ran = 0;
#pragma omp parallel num_threads(nth) reduction(+ : slow_ran)
    {
        const int tid = omp_get_thread_num(), n = omp_get_num_threads();
        if (tid == slow) pe_spin_ns(delay_us * 1000);
        pe_for_share(pieces > 0 ? &r : nullptr, total, tid, n, [&](long lo, long hi) {
            for (long i = lo; i < hi; i++) {
                int none = -1;
                if (!__atomic_compare_exchange_n(ran + i, &none, tid, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                    __atomic_store_n(ran + i, -2, __ATOMIC_RELEASE);
                pe_spin_ns(item_ns);
                if (tid == slow) slow_ran++;
            }
        });
    }
    return slow_ran;
}

// The phase barriers' waits so far that yielded their core first (option barrier_yield;
// tests/test_cpu_engine.py reads it around a step).
long pe_yield_count() { return pe_barrier_yields.load(std::memory_order_relaxed); }

#ifdef PE_PROFILE
void pe_profile(double *out) {
    for (int i = 0; i < 8; i++) out[i] = pe_phase_ns[i], pe_phase_ns[i] = 0;
}
#endif

// A prefill's causal attention, its queries at positions start.. (prefill_attn.h's
// prefill_attention: 0, or -1 refused).
int pe_prefill_attention(const float *q, long ldq, const float *k, const float *v, long khs, long kps, float *out,
                         int T, long start, int nh, int nkv, int hd, float scale, int bf16, int threads) {
    return prefill_attention(q, ldq, k, v, khs, kps, out, T, start, nh, nkv, hd, scale, bf16, threads);
}

// The sampler's stream bits (threefry.h): out[r * n + c] = Threefry-2x32-20(key (k0[r], k1[r]),
// counter (c, ctr[r]))'s first word >> 8 for token ids c < n, on up to `threads` threads.
void pe_threefry_bits(const int32_t *k0, const int32_t *k1, const int32_t *ctr, int rows, long n, int32_t *out,
                      int threads) {
    tf_job job = {k0, k1, ctr, rows, n, out};
    pe_parallel(tf_task, &job, threads);
}

// y = x / sqrt(mean(x^2) + eps) * w for M rows of H floats (decode.h's rms_norm): the
// final norm after a fused step, one call where torch takes five ops.
void pe_rms_norm(const float *x, const float *w, float *y, int M, long H, float eps) {
    for (int m = 0; m < M; m++) rms_norm(x + m * H, w, y + m * H, H, eps);
}

// The greedy token of each of `rows` rows of x (float32, row stride ldx, n columns), as
// torch_common/sampling.py's argmax_lowest gives it: the first index of the row's
// maximum, n - 1 for a row holding NaN; broken[r] = 1 where the row holds NaN or +inf
// (the sampler's non-finite rows). One thread: a pass over the row, then a search for
// its first maximum.
void pe_greedy(const float *x, long ldx, int rows, long n, long *tokens, uint8_t *broken) {
    for (int r = 0; r < rows; r++) {
        const float *row = x + r * ldx;
        float m = -INFINITY;
        int nan = 0, inf = 0;
        for (long j = 0; j < n; j++) {
            const float v = row[j];
            m = v > m ? v : m;
            nan |= v != v;
            inf |= v == INFINITY;
        }
        long t = n - 1;
        if (!nan)
            for (long j = 0; j < n; j++)
                if (row[j] == m) {
                    t = j;
                    break;
                }
        tokens[r] = t;
        broken[r] = (uint8_t)(nan | inf);
    }
}

// The Gumbel-max draw of plain temperature sampling (threefry.h's gd_row) for `rows` rows
// of x (float32, row stride ldx, n columns): tokens[r], or 0 for a row whose temperature
// is not positive or whose x has no finite maximum. scratch: rows * threads doubles and
// longs (best, best_j: each thread's; those of threads the region did not start stay empty).
void pe_gumbel_draw(const float *x, long ldx, int rows, long n, const float *temp, const int32_t *k0,
                    const int32_t *k1, const int32_t *ctr, long *tokens, double *best, long *best_j, int threads) {
    for (long i = 0; i < (long)rows * threads; i++) best[i] = -INFINITY, best_j[i] = 0;
    gd_job job = {x, ldx, n, rows, threads, temp, k0, k1, ctr, best, best_j};
    pe_parallel(gd_task, &job, threads);
    for (int r = 0; r < rows; r++) {
        double b = -INFINITY;
        long t = 0;
        for (int i = 0; i < threads; i++) {
            const double s = best[r * threads + i];
            const long c = best_j[r * threads + i];
            if (s > b || (s == b && s > -INFINITY && c < t)) b = s, t = c;
        }
        tokens[r] = t;
    }
}

// Sampling with top-k, top-p and min-p (threefry.h's fd_row) for `rows` rows of x (float32,
// row stride ldx, n columns), rows across the threads: tokens[r], 0 for a greedy row.
void pe_filtered_draw(const float *x, long ldx, int rows, long n, const float *temp, const long *top_k,
                      const float *top_p, const float *min_p, const int32_t *k0, const int32_t *k1, const int32_t *ctr,
                      long *tokens, int threads) {
    fd_job job = {x, ldx, n, rows, temp, top_p, min_p, top_k, k0, k1, ctr, tokens};
    pe_parallel(fd_task, &job, threads < rows ? threads : rows);
}

// 1 where pe_prefill_attention has its bfloat16 path (AVX512-BF16), else 0.
int pe_pa_bf16(void) { return PA_BF16; }

}
