/* The process-wide count of decode-priority (0) reads in flight, over every Pool and Aio of
 * engram.store._pread_pool (declared in read_call.h): a prompt-priority job of a pool claims no new block while
 * it is above 0 (csrc/pread_pool.c), so prompt reads never hold a disk queue a decode read waits in. */
#include <pthread.h>
#include <time.h>

int engram_decode_reads = 0;
static pthread_mutex_t decode_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t decode_idle = PTHREAD_COND_INITIALIZER; /* broadcast when engram_decode_reads drops to 0 */

void engram_decode_begin(void) { __atomic_add_fetch(&engram_decode_reads, 1, __ATOMIC_SEQ_CST); }

void engram_decode_end(void) {
    if (__atomic_sub_fetch(&engram_decode_reads, 1, __ATOMIC_SEQ_CST) == 0) {
        pthread_mutex_lock(&decode_mu);
        pthread_cond_broadcast(&decode_idle);
        pthread_mutex_unlock(&decode_mu);
    }
}

/* Sleeps until no decode read runs (or 1 ms passed: a decode job queued here is not counted while it waits). */
void engram_wait_decode_idle(void) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 1000000;
    if (until.tv_nsec >= 1000000000) { until.tv_sec++; until.tv_nsec -= 1000000000; }
    pthread_mutex_lock(&decode_mu);
    while (__atomic_load_n(&engram_decode_reads, __ATOMIC_SEQ_CST) > 0)
        if (pthread_cond_timedwait(&decode_idle, &decode_mu, &until) != 0) break;
    pthread_mutex_unlock(&decode_mu);
}
