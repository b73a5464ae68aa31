// One decode step of the Llama-family model on the CPU, fused: every layer for M rows
// (the live slots) in one call, float32 activations, float32 or int8 weights.
//
// Why: the shared torch forward issues ~50 small tensor ops per layer; at one token per
// slot their dispatch costs more than the arithmetic. Here the whole step is plain
// loops over the same data the torch forward uses (the weights as the model's arrays,
// the engine's KV cache tensor, the RoPE tables), so it computes the same function in
// the same order up to float rounding; tests compare it with the shared forward.
//
// Layouts: x (M, H) row-major; KV cache [layers, rows, kv_heads, S, head_dim];
// RoPE tables (positions, head_dim/2); weights [out, in]. Attention for a row reads
// its own cache row at positions 0..pos (the token just written included).
#include <math.h>
#include <stdlib.h>

#include "linear.cpp"

struct pe_layer {
    const float *input_norm, *post_norm;
    // float32 weights, or int8 ones with scales (per row, or per group of a row)
    const void *q, *k, *v, *o, *gate, *up, *down;
    const float *q_scale, *k_scale, *v_scale, *o_scale, *gate_scale, *up_scale, *down_scale;
    const float *q_bias, *k_bias, *v_bias, *o_bias, *gate_bias, *up_bias, *down_bias;
};

struct pe_dims {
    long hidden, intermediate, heads, kv_heads, head_dim, layers, cache_rows, cache_len;
    float eps;
    int int8;   // weights are int8 (with scales)
    long group; // int8: weights per scale along a row (0: one scale per row)
    int threads;
};

static void proj(const pe_dims *d, const float *x, int M, const void *w, const float *scale,
                 const float *bias, float *y, long N, long K) {
    if (!d->int8)
        linear<float>(x, K, (const float *)w, nullptr, bias, y, N, M, N, K, d->threads);
    else if (d->group && scale)
        pe_linear_i8_grouped(x, K, (const int8_t *)w, scale, bias, y, N, M, N, K, d->group, d->threads);
    else
        linear<int8_t>(x, K, (const int8_t *)w, scale, bias, y, N, M, N, K, d->threads);
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

extern "C" {

// x: (M, H) in/out (the residual stream: embeddings in, final hidden states out, before
// the final norm). rows/pos: each row's cache row and position. scratch: at least
// M * (q_size + 2 * kv_size + q_size + 2 * intermediate + hidden) floats, plus
// M * heads * cache_len for the attention scores.
void pe_decode(const pe_dims *d, const pe_layer *layers, float *x, int M, const int *rows, const int *pos,
               float *k_cache, float *v_cache, const float *rope_cos, const float *rope_sin, float *scratch) {
    const long H = d->hidden, I = d->intermediate, nh = d->heads, nkv = d->kv_heads, hd = d->head_dim;
    const long qs = nh * hd, kvs = nkv * hd, group = nh / nkv, S = d->cache_len;
    float *h = scratch;               // (M, H)
    float *q = h + M * H;             // (M, qs)
    float *k = q + M * qs;            // (M, kvs)
    float *v = k + M * kvs;           // (M, kvs)
    float *att = v + M * kvs;         // (M, qs)
    float *g = att + M * qs;          // (M, I)
    float *u = g + M * I;             // (M, I)
    float *tmp = u + M * I;           // (M, H)
    float *scores = tmp + M * H;      // (M * nh, S)
    const float scale = 1.f / sqrtf((float)hd);
    for (long l = 0; l < d->layers; l++) {
        const pe_layer *w = layers + l;
        for (int m = 0; m < M; m++) rms_norm(x + m * H, w->input_norm, h + m * H, H, d->eps);
        proj(d, h, M, w->q, w->q_scale, w->q_bias, q, qs, H);
        proj(d, h, M, w->k, w->k_scale, w->k_bias, k, kvs, H);
        proj(d, h, M, w->v, w->v_scale, w->v_bias, v, kvs, H);
        for (int m = 0; m < M; m++) {
            const float *cs = rope_cos + (long)pos[m] * (hd / 2), *sn = rope_sin + (long)pos[m] * (hd / 2);
            rope(q + m * qs, nh, hd, cs, sn);
            rope(k + m * kvs, nkv, hd, cs, sn);
            for (long j = 0; j < nkv; j++) {  // write K (after RoPE) and V at (layer, row, head, pos)
                long off = (((l * d->cache_rows + rows[m]) * nkv + j) * S + pos[m]) * hd;
                memcpy(k_cache + off, k + m * kvs + j * hd, hd * sizeof(float));
                memcpy(v_cache + off, v + m * kvs + j * hd, hd * sizeof(float));
            }
        }
#pragma omp parallel for num_threads(d->threads) schedule(static) collapse(2)
        for (int m = 0; m < M; m++)
            for (long a = 0; a < nh; a++) {
                const long j = a / group, n = pos[m] + 1;
                const float *qa = q + m * qs + a * hd;
                const float *kb = k_cache + ((l * d->cache_rows + rows[m]) * nkv + j) * S * hd;
                const float *vb = v_cache + ((l * d->cache_rows + rows[m]) * nkv + j) * S * hd;
                float *sc = scores + (m * nh + a) * S;
                float mx = -INFINITY;
                for (long s = 0; s < n; s++) {
                    float dot = 0.f;
                    for (long i = 0; i < hd; i++) dot += qa[i] * kb[s * hd + i];
                    sc[s] = dot * scale;
                    mx = sc[s] > mx ? sc[s] : mx;
                }
                float sum = 0.f;
                for (long s = 0; s < n; s++) { sc[s] = expf(sc[s] - mx); sum += sc[s]; }
                float *out = att + m * qs + a * hd;
                for (long i = 0; i < hd; i++) out[i] = 0.f;
                for (long s = 0; s < n; s++) {
                    const float p = sc[s] / sum;
                    for (long i = 0; i < hd; i++) out[i] += p * vb[s * hd + i];
                }
            }
        proj(d, att, M, w->o, w->o_scale, w->o_bias, tmp, H, qs);
        for (long i = 0; i < M * H; i++) x[i] += tmp[i];
        for (int m = 0; m < M; m++) rms_norm(x + m * H, w->post_norm, h + m * H, H, d->eps);
        proj(d, h, M, w->gate, w->gate_scale, w->gate_bias, g, I, H);
        proj(d, h, M, w->up, w->up_scale, w->up_bias, u, I, H);
        for (long i = 0; i < M * I; i++) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        proj(d, g, M, w->down, w->down_scale, w->down_bias, tmp, H, I);
        for (long i = 0; i < M * H; i++) x[i] += tmp[i];
    }
}

}
