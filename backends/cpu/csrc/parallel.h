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
#include <chrono>
#include <omp.h>
#include <sched.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void pe_pause() { _mm_pause(); }
#else
static inline void pe_pause() {}
#endif

// Busy for about ns nanoseconds (tests: a thread held back).
static inline void pe_spin_ns(long ns) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    while (std::chrono::steady_clock::now() < until) pe_pause();
}

typedef void (*pe_task)(void *arg, int tid, int nth);

// A sense-reversing barrier for the nth threads of one parallel region. A thread that
// waits long (another process took its partner's core) yields instead of spinning.
//
// With yield_first, a thread that has to wait yields its core before it spins, at most
// once every PE_YIELD_GAP_NS (option barrier_yield). A decode step keeps every core busy,
// so a thread the OS wakes meanwhile (the driver taking a step's tokens, a server's event
// loop, its client) would otherwise wait for the scheduler's next tick, up to 4 ms at
// 250 Hz, to take a core from one of the step's threads: at a batch-1 step of ~5 ms that
// doubled a served stream's time between tokens a few times a request. The yield hands it
// the core within a phase or the gap; with nothing else to run the call returns at once.
// The gap bounds what the yields cost the step where other work does wait: each pushes the
// yielding thread's turn back (docs/cpu.md, "Barriers that yield").
#ifndef PE_YIELD_GAP_NS
#define PE_YIELD_GAP_NS 200000
#endif
static std::atomic<long> pe_barrier_yields{0};  // waits that yielded first, process-wide (pe_yield_count)

struct pe_barrier {
    std::atomic<int> arrived{0};
    std::atomic<unsigned> phase{0};
    bool yield_first = false;

    void wait(int nth) {
        if (nth <= 1) return;
        unsigned ph = phase.load(std::memory_order_acquire);
        if (arrived.fetch_add(1, std::memory_order_acq_rel) == nth - 1) {
            arrived.store(0, std::memory_order_relaxed);
            phase.fetch_add(1, std::memory_order_release);
            return;
        }
        if (yield_first) {
            static thread_local long long last = 0;
            const long long now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now().time_since_epoch()).count();
            if (now - last >= PE_YIELD_GAP_NS) {
                last = now;
                pe_barrier_yields.fetch_add(1, std::memory_order_relaxed);
                sched_yield();
            }
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

// Each thread's share of a product's items, [front, end), in one atomic word with the
// product's number, so that the share is taken by chunks from its front by its owner and
// from its back by threads done with theirs, without a lock. The threads of a region run
// the same products in the same order, each followed by a barrier; the first thread to
// reach product k sets every share for it (a thread held back before it starts still has
// its share taken), the others find them set. A product's shares are all empty when its
// barrier releases, so a share is never set again while anyone takes from it.
#define PE_MAX_RANGES 64
struct pe_ranges {
    struct alignas(64) slot {
        std::atomic<unsigned long long> r{0};  // product (16 bits), end (24), front (24)
        unsigned products = 0;                  // products its thread has started
    } s[PE_MAX_RANGES];
    int pieces = 0;  // chunks a share is taken in (0: each share whole, no taking)

    static const long LIMIT = 1L << 24;  // items a product may have here (pe_for_share)

    // Thread tid starts its next product, of `total` items shared by nth threads.
    void start(int tid, long total, int nth) {
        const unsigned long long k = ++s[tid].products & 0xffffu;
        for (int t = 0; t < nth; t++) {
            unsigned long long cur = s[t].r.load(std::memory_order_acquire);
            if (cur >> 48 == k) continue;
            const unsigned long long b = (unsigned long long)(total * t / nth), e = (unsigned long long)(total * (t + 1) / nth);
            s[t].r.compare_exchange_strong(cur, k << 48 | e << 24 | b, std::memory_order_acq_rel);
        }
    }
    // up to n items from the front of tid's share (its owner) or from its back (others)
    bool front(int tid, long n, long *lo, long *hi) { return take(tid, n, false, lo, hi); }
    bool back(int tid, long n, long *lo, long *hi) { return take(tid, n, true, lo, hi); }

  private:
    bool take(int tid, long n, bool from_back, long *lo, long *hi) {
        std::atomic<unsigned long long> &a = s[tid].r;
        unsigned long long cur = a.load(std::memory_order_acquire);
        for (;;) {
            const unsigned long long k = cur >> 48;
            long b = (long)(cur & 0xffffffu), e = (long)(cur >> 24 & 0xffffffu);
            if (b >= e) return false;
            long nb = b, ne = e;
            if (from_back) {
                ne = e - n > b ? e - n : b;
                *lo = ne, *hi = e;
            } else {
                nb = b + n < e ? b + n : e;
                *lo = b, *hi = nb;
            }
            const unsigned long long next = k << 48 | (unsigned long long)ne << 24 | (unsigned long long)nb;
            if (a.compare_exchange_weak(cur, next, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
        }
    }
};

// The [begin, end) share of `total` items for thread tid of nth.
static inline void pe_share(long total, int tid, int nth, long *begin, long *end) {
    *begin = total * tid / nth;
    *end = total * (tid + 1) / nth;
}

// fn(lo, hi) over thread tid's share of items [0, total): the share whole (r null), or
// taken from its front in r->pieces chunks, then chunks from the back of the other
// threads' shares until every share is done (r: one pe_ranges for the region's threads,
// every one of which calls this for each product, in the same order).
template <class F>
static void pe_for_share(pe_ranges *r, long total, int tid, int nth, F fn) {
    long b, e;
    pe_share(total, tid, nth, &b, &e);
    if (!r || r->pieces <= 0 || nth <= 1 || nth > PE_MAX_RANGES || total >= pe_ranges::LIMIT) {
        if (b < e) fn(b, e);
        return;
    }
    const long chunk = (e - b + r->pieces - 1) / r->pieces > 0 ? (e - b + r->pieces - 1) / r->pieces : 1;
    r->start(tid, total, nth);
    long lo, hi;
    while (r->front(tid, chunk, &lo, &hi)) fn(lo, hi);
    for (int o = 1; o < nth; o++)
        while (r->back((tid + o) % nth, chunk, &lo, &hi)) fn(lo, hi);
}
