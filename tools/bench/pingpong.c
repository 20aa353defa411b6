/* pingpong: the machine's phase, as the round trip of one cache line between two CPUs.
 *
 *   cc -O2 -pthread -o target/pingpong tools/bench/pingpong.c && target/pingpong [CPU_A CPU_B]
 *
 * Two threads, pinned to CPU_A and CPU_B (default 0 and 1), hand a counter back and forth
 * through two cache lines, 200,000 times; prints the mean round trip in nanoseconds. On the
 * 2-core reference VM it reads about 100 ns in its usual phase and 300-600 ns in its slow one,
 * and small calls between ranks move with it: benchmarks say the phase they ran in by running
 * this before and after (tools/bench/ab.py).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ROUNDS 200000L

static _Alignas(64) _Atomic long ping;
static _Alignas(64) _Atomic long pong;
static int cpu_b = 1;

static int pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    return pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void *responder(void *arg) {
    (void)arg;
    if (pin(cpu_b) != 0) {
        fprintf(stderr, "pingpong: cannot pin to CPU %d\n", cpu_b);
        exit(2);
    }
    for (long i = 1; i <= ROUNDS; i++) {
        while (atomic_load_explicit(&ping, memory_order_acquire) != i)
            ;
        atomic_store_explicit(&pong, i, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int cpu_a = argc > 2 ? atoi(argv[1]) : 0;
    cpu_b = argc > 2 ? atoi(argv[2]) : 1;
    if (pin(cpu_a) != 0) {
        fprintf(stderr, "pingpong: cannot pin to CPU %d\n", cpu_a);
        return 2;
    }
    pthread_t t;
    if (pthread_create(&t, NULL, responder, NULL) != 0) {
        fprintf(stderr, "pingpong: cannot start a thread\n");
        return 2;
    }
    struct timespec s, e;
    clock_gettime(CLOCK_MONOTONIC, &s);
    for (long i = 1; i <= ROUNDS; i++) {
        atomic_store_explicit(&ping, i, memory_order_release);
        while (atomic_load_explicit(&pong, memory_order_acquire) != i)
            ;
    }
    clock_gettime(CLOCK_MONOTONIC, &e);
    pthread_join(t, NULL);
    double ns = (double)(e.tv_sec - s.tv_sec) * 1e9 + (double)(e.tv_nsec - s.tv_nsec);
    printf("%.0f\n", ns / ROUNDS);
    return 0;
}
