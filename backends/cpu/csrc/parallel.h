// Parallel loops for the CPU decode step: OpenMP threads with spinning barriers.
//
// A decode step is ~300 short phases (each projection of each layer, attention, the
// element-wise parts in between). One OpenMP parallel region per phase costs a fork
// and a join each, and libgomp makes those expensive exactly when it matters: it keeps
// one thread team per calling thread, and once two teams exist (torch's ops on the
// caller's thread, the engine's step worker thread) it counts more threads than cores
// and puts its threads to sleep between regions, so every region pays futex wake-ups
// (measured: ~40% of a batch-1 step on two cores). So a whole step is one parallel
// region, the same team torch's own ops on that thread use (no second set of threads
// competing for the cores), and its phases are separated by the barrier below, which
// spins: the next phase starts microseconds later.
#pragma once
#include <atomic>
#include <omp.h>
#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void pe_pause() { _mm_pause(); }
#else
static inline void pe_pause() {}
#endif

typedef void (*pe_task)(void *arg, int tid, int nth);

// A sense-reversing barrier for the nth threads of one parallel region. A thread that
// waits long (another process took its partner's core) yields instead of spinning.
struct pe_barrier {
    std::atomic<int> arrived{0};
    std::atomic<unsigned> phase{0};

    void wait(int nth) {
        if (nth <= 1) return;
        unsigned ph = phase.load(std::memory_order_acquire);
        if (arrived.fetch_add(1, std::memory_order_acq_rel) == nth - 1) {
            arrived.store(0, std::memory_order_relaxed);
            phase.fetch_add(1, std::memory_order_release);
            return;
        }
        for (int spins = 1; phase.load(std::memory_order_acquire) == ph; spins++) {
            pe_pause();
            if (spins % 1024 == 0) sched_yield();
        }
    }
};

// task(arg, tid, nth) on up to n threads (one parallel region); returns when all are done.
static void pe_parallel(pe_task t, void *arg, int n) {
    if (n <= 1) {
        t(arg, 0, 1);
        return;
    }
#pragma omp parallel num_threads(n)
    t(arg, omp_get_thread_num(), omp_get_num_threads());
}

// The [begin, end) share of `total` items for thread tid of nth.
static inline void pe_share(long total, int tid, int nth, long *begin, long *end) {
    *begin = total * tid / nth;
    *end = total * (tid + 1) / nth;
}
