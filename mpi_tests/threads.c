/*
 * threads: MPI_THREAD_MULTIPLE point-to-point from 4 threads at once.
 *
 * MPI_Init_thread(MPI_THREAD_MULTIPLE); if the library provides less, the program FAILs
 * (it was asked to test thread safety; it never passes silently).
 * Thread t on every rank exchanges with thread t on the ring neighbours, for --iters
 * iterations (default 200, 50 with --quick), message sizes cycling through 0, 1,
 * inject+1, 4 KiB, 64 KiB and (every 16th) 1 MiB, in three phases:
 *   A. each thread on its own duplicated communicator, receives with MPI_ANY_SOURCE and
 *      MPI_ANY_TAG (only its peer thread sends on that communicator);
 *   B. all threads on one shared communicator, distinct tags per thread, receives with
 *      MPI_ANY_SOURCE and the thread's tag;
 *   C. like B, but blocking MPI_Send/MPI_Recv with the left/right order alternating by
 *      rank parity, plus MPI_Iprobe/MPI_Improbe + MPI_Mrecv by odd threads.
 *   D. more receives than a provider queue holds: each thread posts --many (default 1500,
 *      1200 with --quick, 100 on sockets; 4 threads: more than the 3840 tcp;ofi_rxm
 *      takes for the application) receives on
 *      its own communicator, then sends to its peer thread in reverse tag order with
 *      blocking MPI_Ssend (every 97th a 64 KiB MPI_Send), so the message for the last
 *      receive comes first while the threads still post and progress concurrently.
 * Every payload carries (thread, iteration, source) in its pattern seed; every status is
 * checked. Threads report failures through the usual FAIL line (MPI_Abort).
 *
 * Options: --inject N, --iters N, --threads N (default 4), --many N.
 */
#include "common.h"
#include <pthread.h>

static int nthreads = 4, iters = 200, many = 1500;
static size_t inj;
static MPI_Comm shared, own[16];
static pthread_barrier_t posted; /* phase D: every thread has posted its receives */

static size_t tsize(int it)
{
    static const size_t base[5] = { 0, 1, 0, 4096, 65536 };
    if (it % 16 == 15)
        return 1 << 20;
    size_t s = base[it % 5];
    return it % 5 == 2 ? inj + 1 : s;
}

static uint64_t tseed(int phase, int thread, int it, int src)
{
    return t_seed((uint64_t)phase * 100 + (uint64_t)thread, (uint64_t)it, (uint64_t)src, 0xabc);
}

static void past_full_queue(int t)
{
    const size_t big = 64 * 1024;
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    MPI_Comm c = own[t];
    MPI_Request *rq = t_malloc(sizeof(*rq) * (size_t)many);
    MPI_Status *st = t_malloc(sizeof(*st) * (size_t)many);
    uint64_t *rb = t_malloc(sizeof(*rb) * (size_t)many), sv;
    int nbig = many / 97 + 1;
    uint8_t *rbig = t_malloc(big * (size_t)nbig), *sbig = t_malloc(big);
    char what[200];

    for (int i = 0; i < many; i++) {
        int src = i % 3 == 0 ? MPI_ANY_SOURCE : left;
        rb[i] = 0;
        if (i % 97 == 0)
            T_CHECK_MPI(MPI_Irecv(rbig + big * (size_t)(i / 97), (int)big, MPI_BYTE, src, i, c, &rq[i]));
        else
            T_CHECK_MPI(MPI_Irecv(&rb[i], 1, MPI_UINT64_T, src, i, c, &rq[i]));
    }
    pthread_barrier_wait(&posted);
    T_CHECK_MPI(MPI_Barrier(c));
    for (int i = many - 1; i >= 0; i--) {
        t_touch();
        if (i % 97 == 0) {
            t_fill(sbig, big, tseed(3, t, i, t_rank));
            T_CHECK_MPI(MPI_Send(sbig, (int)big, MPI_BYTE, right, i, c));
        } else {
            sv = tseed(3, t, i, t_rank);
            T_CHECK_MPI(MPI_Ssend(&sv, 1, MPI_UINT64_T, right, i, c));
        }
    }
    t_status_init_n(st, many);
    T_CHECK_MPI(MPI_Waitall(many, rq, st));
    for (int i = 0; i < many; i++) {
        snprintf(what, sizeof(what), "phase D thread %d receive %d of %d", t, i, many);
        if (i % 97 == 0) {
            t_check_status_bytes(&st[i], left, i, big, what);
            t_check(rbig + big * (size_t)(i / 97), big, tseed(3, t, i, left), what);
        } else {
            t_check_status(&st[i], left, i, MPI_UINT64_T, 1, what);
            if (rb[i] != tseed(3, t, i, left))
                t_fail("%s: wrong payload", what);
        }
    }
    free(rq); free(st); free(rb); free(rbig); free(sbig);
}

static void *worker(void *arg)
{
    int t = (int)(intptr_t)arg;
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    size_t maxs = 1 << 20;
    uint8_t *sb = t_malloc(maxs), *rb = t_malloc(maxs + 64);
    char what[200];

    for (int phase = 0; phase < 3; phase++) {
        MPI_Comm c = phase == 0 ? own[t] : shared;
        int tag = phase == 0 ? 5 : 100 + t;
        for (int it = 0; it < iters; it++) {
            size_t n = tsize(it);
            MPI_Request rq[2];
            MPI_Status st[2];
            int expect_tag = tag;
            snprintf(what, sizeof(what), "phase %c thread %d iteration %d size %zu", 'A' + phase, t, it, n);
            t_touch();
            t_fill(sb, n, tseed(phase, t, it, t_rank));
            memset(rb, 0xee, n + 64);
            t_status_init_n(st, 2);
            if (phase < 2) {
                int rtag = phase == 0 ? MPI_ANY_TAG : tag;
                T_CHECK_MPI(MPI_Irecv(rb, (int)n + 64, MPI_BYTE, MPI_ANY_SOURCE, rtag, c, &rq[0]));
                T_CHECK_MPI(MPI_Isend(sb, (int)n, MPI_BYTE, right, tag, c, &rq[1]));
                T_CHECK_MPI(MPI_Waitall(2, rq, st));
            } else if ((t & 1) == 0) {
                if (t_rank & 1) {
                    T_CHECK_MPI(MPI_Recv(rb, (int)n + 64, MPI_BYTE, MPI_ANY_SOURCE, tag, c, &st[0]));
                    T_CHECK_MPI(MPI_Send(sb, (int)n, MPI_BYTE, right, tag, c));
                } else {
                    /* Isend: with an odd rank count two even ranks are neighbours */
                    T_CHECK_MPI(MPI_Isend(sb, (int)n, MPI_BYTE, right, tag, c, &rq[1]));
                    T_CHECK_MPI(MPI_Recv(rb, (int)n + 64, MPI_BYTE, left, tag, c, &st[0]));
                    T_CHECK_MPI(MPI_Wait(&rq[1], MPI_STATUS_IGNORE));
                }
            } else {
                MPI_Message m;
                MPI_Status pst;
                int flag = 0;
                double t0 = t_now();
                T_CHECK_MPI(MPI_Isend(sb, (int)n, MPI_BYTE, right, tag, c, &rq[1]));
                t_status_init(&pst);
                if (it & 1) {
                    while (!flag) {
                        T_CHECK_MPI(MPI_Improbe(MPI_ANY_SOURCE, tag, c, &flag, &m, &pst));
                        if (t_now() - t0 > 60)
                            t_fail("%s: Improbe found nothing in 60 s", what);
                    }
                } else {
                    while (!flag) {
                        T_CHECK_MPI(MPI_Iprobe(left, tag, c, &flag, &pst));
                        if (t_now() - t0 > 60)
                            t_fail("%s: Iprobe found nothing in 60 s", what);
                    }
                    T_CHECK_MPI(MPI_Mprobe(left, tag, c, &m, &pst));
                }
                t_check_status_bytes(&pst, left, tag, n, what);
                T_CHECK_MPI(MPI_Mrecv(rb, (int)n + 64, MPI_BYTE, &m, &st[0]));
                T_CHECK_MPI(MPI_Wait(&rq[1], MPI_STATUS_IGNORE));
            }
            t_check_status_bytes(&st[0], left, expect_tag, n, what);
            t_check(rb, n, tseed(phase, t, it, left), what);
            t_check_const(rb + n, 64, 0xee, what);
        }
    }
    if (many > 0)
        past_full_queue(t);
    free(sb);
    free(rb);
    return NULL;
}

static const char *level_name(int l)
{
    switch (l) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "?";
    }
}

int main(int argc, char **argv)
{
    pthread_t th[16];
    int provided = t_init_thread(&argc, &argv, "threads", MPI_THREAD_MULTIPLE);
    t_section("MPI_Init_thread");
    if (provided < MPI_THREAD_MULTIPLE)
        t_fail("MPI_THREAD_MULTIPLE requested, %s provided: cannot test threads", level_name(provided));
    nthreads = (int)t_opt_long("threads", NULL, 4);
    if (nthreads < 1 || nthreads > 16)
        t_fail("--threads must be 1..16");
    iters = (int)t_opt_long("iters", NULL, t_quick ? 50 : 200);
    /* sockets (correctness only, slow): 100 per thread, which 4 threads make more than
     * the 224 queue entries that are the application's there. */
    many = (int)t_opt_long("many", NULL, !strcmp(t_provider(), "sockets") ? 100 : t_quick ? 1200 : 1500);
    inj = t_inject();
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &shared));
    for (int t = 0; t < nthreads; t++)
        T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &own[t]));
    if (pthread_barrier_init(&posted, NULL, (unsigned)nthreads) != 0)
        t_fail("pthread_barrier_init failed");
    t_section("threads running");
    for (int t = 0; t < nthreads; t++)
        if (pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t) != 0)
            t_fail("pthread_create failed");
    for (int t = 0; t < nthreads; t++)
        pthread_join(th[t], NULL);
    for (int t = 0; t < nthreads; t++)
        T_CHECK_MPI(MPI_Comm_free(&own[t]));
    T_CHECK_MPI(MPI_Comm_free(&shared));
    return t_pass();
}
