/* Release the calling thread's OpenMP worker threads (its pool); the next parallel region it starts
 * builds a new one.
 *
 * Why: libgomp counts the workers of every thread's pool, and once they outnumber the CPUs it cuts the
 * spin at a barrier to about a hundred iterations before the thread sleeps on a futex. A team whose
 * partner arrives a moment late then sleeps and pays a wake-up at every barrier. That is the state of
 * a process that loads a model on one thread (torch's parallel ops give that thread a pool) and runs it
 * on another: the native decode step has about ten barriers a layer, and on 2 CPUs a served k3-tiny
 * round took ~11,000 sleeps and a third longer. Releasing the loading thread's pool leaves the running
 * thread's team the only one.
 *
 * omp_pause_resource_all (OpenMP 5.0) with a soft pause: libgomp frees the calling thread's pool.
 * Returns its status, 0 on success. */
#include <omp.h>

int k3_release_thread_pool(void) { return omp_pause_resource_all(omp_pause_soft); }

/* Flush denormals to zero (on != 0) or stop flushing (on == 0) on every thread of the calling thread's
 * OpenMP pool, `threads` of them, the calling thread included; returns how many threads changed mode.
 * torch.set_flush_denormal sets the calling thread's MXCSR alone, while torch's parallel ops and MKL's
 * batched products run on this pool too: their workers kept computing denormal operands at ~150 cycles
 * a microcode assist each (k3.ops.kda.scratch.denormals_flushed). */
int k3_flush_denormals_team(int on, int threads) {
    int changed = 0;
#if defined(__x86_64__) || defined(__i386__)
#pragma omp parallel num_threads(threads) reduction(+ : changed)
    {
        const unsigned mode = __builtin_ia32_stmxcsr();
        const unsigned want = on ? (mode | 0x8040u) : (mode & ~0x8040u);
        if (want != mode) {
            __builtin_ia32_ldmxcsr(want);
            changed = 1;
        }
    }
#else
    (void)on;
    (void)threads;
#endif
    return changed;
}
