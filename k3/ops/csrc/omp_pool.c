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
