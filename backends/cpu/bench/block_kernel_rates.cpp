// The block kernels' compute rate (backends/cpu/csrc/gguf.h) in cache on one core: each
// format against M rows of x (int8 and int8x2 activations), weights small enough for L2,
// the best of 200 calls. Built and run by block_kernel_rates.py; prints one line a case:
//   FORMAT M X Gweights/s   (weights a second per row of x)
// and, where the sources have them (packed.h, GP_PACKED), the same matrix repacked with
// sixteen rows interleaved (option repack_weights) as FORMAT/groups.
// Random bytes with f16 scales of 1.0 (a kernel's time does not depend on the values).
#include "linear.h"  // gguf.h, and the earlier int8x2 (q8x2_quantize) for --against
#if __has_include("packed.h")
#include "packed.h"
#endif

#include <chrono>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <int F>
static void run(const char *name, long N, long K) {
    typedef gq_traits<F> T;
    const long ldw = K / T::BLOCK * T::BYTES;
    std::vector<uint8_t> w(N * ldw);
    srand(1);
    for (auto &b : w) b = (uint8_t)(rand() & 255);
    const uint16_t one = 0x3C00;  // f16 1.0
    for (long n = 0; n < N; n++)
        for (long blk = 0; blk < K / T::BLOCK; blk++) {
            uint8_t *p = w.data() + n * ldw + blk * T::BYTES;
            if (F == GQ_Q6_K) {
                memcpy(p + 208, &one, 2);
            } else {
                memcpy(p, &one, 2);
                if (T::MIN) memcpy(p + 2, &one, 2);
            }
        }
    const int MM = 16;
    std::vector<float> x(MM * K), y(2 * MM * N);
    for (auto &v : x) v = (float)(rand() % 2000 - 1000) / 1000.f;
    std::vector<int8_t> xq(2 * MM * K);
    std::vector<float> xs(2 * MM * K / 32), xsf(4 * MM * K / 32);
#if defined(GP_PACKED) && GP_PACKED && defined(GQ_X2_ONE_SCALE)
    std::vector<uint8_t> packed;  // the same matrix repacked (the library's own repack, one thread)
    if (gp_packs(F, K)) {
        packed.resize((N + GP_ROWS - 1) / GP_ROWS * gp_group_bytes(F, K));
        gp_repack_job job = {F, w.data(), ldw, nullptr, N, K, packed.data()};
        gp_repack_task(&job, 0, 1);
    }
#endif
    for (int M : {1, 2, 4, 8, 16})
        for (int x2 : {0, 1}) {
#ifdef GQ_X2_ONE_SCALE
            if (x2)
                gq_quantize_x2(x.data(), K, M, K, xq.data(), xs.data(), xsf.data());
            else
                gq_quantize(x.data(), K, M, K, xq.data(), xs.data(), xsf.data());
#else  // kernels before int8x2 on one scale: two rows of x per row, each with its scales
            std::vector<float> res(K);
            if (x2) {
                q8x2_quantize(x.data(), K, M, K, xq.data(), xs.data(), res.data());
                gq_sums(xq.data(), xs.data(), 2 * M, K, xsf.data());
            } else {
                gq_quantize(x.data(), K, M, K, xq.data(), xs.data(), xsf.data());
            }
#endif
            double best = 1e9;
            for (int rep = 0; rep < 200; rep++) {
                const double t = now();
#ifdef GQ_X2_ONE_SCALE
                if (x2)
                    gq_rows<F, 1>(xq.data(), xs.data(), xsf.data(), M, K, w.data(), ldw, nullptr, nullptr, y.data(),
                                  N, 0, N);
                else
#else
                if (x2)
                    gq_rows<F>(xq.data(), xs.data(), xsf.data(), 2 * M, K, w.data(), ldw, nullptr, nullptr, y.data(),
                               N, 0, N);
                else
#endif
                    gq_rows<F>(xq.data(), xs.data(), xsf.data(), M, K, w.data(), ldw, nullptr, nullptr, y.data(),
                                  N, 0, N);
                const double dt = now() - t;
                best = dt < best ? dt : best;
            }
            printf("%s %d %s %.1f\n", name, M, x2 ? "int8x2" : "int8", (double)N * K * M / best / 1e9);
#if defined(GP_PACKED) && GP_PACKED && defined(GQ_X2_ONE_SCALE)
            if (!packed.empty()) {
                double pbest = 1e9;
                for (int rep = 0; rep < 200; rep++) {
                    const double t = now();
                    if (x2)
                        gp_rows<F, 1>(xq.data(), xs.data(), xsf.data(), M, K, packed.data(), nullptr, y.data(), N, 0, N);
                    else
                        gp_rows<F, 0>(xq.data(), xs.data(), xsf.data(), M, K, packed.data(), nullptr, y.data(), N, 0, N);
                    const double dt = now() - t;
                    pbest = dt < pbest ? dt : pbest;
                }
                printf("%s/groups %d %s %.1f\n", name, M, x2 ? "int8x2" : "int8", (double)N * K * M / pbest / 1e9);
            }
#endif
        }
}

int main() {
    run<GQ_Q4_0>("Q4_0", 128, 2048);
    run<GQ_Q4_1>("Q4_1", 128, 2048);
    run<GQ_Q5_0>("Q5_0", 128, 2048);
    run<GQ_Q5_1>("Q5_1", 128, 2048);
    run<GQ_Q8_0>("Q8_0", 128, 2048);
    run<GQ_Q4_K>("Q4_K", 128, 2048);
    run<GQ_Q5_K>("Q5_K", 128, 2048);
    run<GQ_Q6_K>("Q6_K", 128, 2048);
    return 0;
}
