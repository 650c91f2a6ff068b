/*
 * ob1_recv_threads: MPI-only reproducer (no ompi-ofi needed) for Open MPI 4.1.4's
 * MPI_T_init_thread lowering the MPI library's own thread level: the first
 * MPI_T_init_thread calls ompi_mpi_thread_level() with the level it is asked for, even
 * after MPI_Init_thread, so MPI_T_init_thread(MPI_THREAD_SINGLE) in a program running
 * MPI_THREAD_MULTIPLE sets ompi_mpi_thread_multiple to false (and MPI_Query_thread then
 * says SINGLE). ob1's blocking MPI_Recv (mca_pml_ob1_recv) then takes its one cached
 * request, meant for single-threaded programs, in every thread at once, and receives
 * complete with no message or another thread's. Found with mpi_tests/fbox --threads
 * (docs/testing.md, "Open MPI 4.1.4's own layers").
 *
 *   mpicc -O2 -pthread ob1_recv_threads.c -o ob1_recv_threads
 *   mpirun --oversubscribe -np 4 --mca pml ob1 --mca btl vader,self \
 *       ./ob1_recv_threads [N [b|nb [mpit]]]
 *
 * Every rank runs 4 threads. Thread t sends N messages (default 3000) to the right
 * neighbour with tag t (MPI_Isend), and receives N with tag t from the left neighbour
 * (MPI_Recv, or MPI_Irecv + MPI_Wait with "nb"), then waits for its send. A message
 * holds its number in its first 4 bytes and is 16 to 20,000 bytes long. MPI's
 * non-overtaking rule means thread t's k-th receive gets message k of the left
 * neighbour's thread t, with tag t and its length. "mpit" calls
 * MPI_T_init_thread(MPI_THREAD_SINGLE) after MPI_Init_thread.
 *
 * On this project's 2-core virtual machine (Debian 12, Open MPI 4.1.4, stock mpirun): "3000 b mpit" printed "BAD" in 1 run of 3 ("receive #1834 got message
 * #1833, count 0 (sent 18034), source -1 (expected 1), tag -1 (expected 3)"); without
 * "mpit", 6 of 6 and with "nb mpit" 3 of 3 printed "ok".
 */
#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NT 4
#define MAXLEN 20000

static int rank, size, n = 3000, nb;
static volatile int bad;

static int len_of(int k)
{
    return 16 + (int)(((unsigned)k * 97u) % (MAXLEN - 15));
}

static void *run(void *p)
{
    int tag = (int)(long)p, right = (rank + 1) % size, left = (rank + size - 1) % size;
    char *sb = malloc(MAXLEN), *rb = malloc(MAXLEN);
    for (int k = 0; k < n && !bad; k++) {
        MPI_Request sr;
        MPI_Status st;
        int got, count;
        memset(sb, k & 0xff, MAXLEN);
        memcpy(sb, &k, sizeof(k));
        MPI_Isend(sb, len_of(k), MPI_BYTE, right, tag, MPI_COMM_WORLD, &sr);
        st.MPI_SOURCE = st.MPI_TAG = -7;
        if (nb) {
            MPI_Request rr;
            MPI_Irecv(rb, MAXLEN, MPI_BYTE, left, tag, MPI_COMM_WORLD, &rr);
            MPI_Wait(&rr, &st);
        } else {
            MPI_Recv(rb, MAXLEN, MPI_BYTE, left, tag, MPI_COMM_WORLD, &st);
        }
        MPI_Get_count(&st, MPI_BYTE, &count);
        memcpy(&got, rb, sizeof(got));
        if (got != k || count != len_of(k) || st.MPI_SOURCE != left || st.MPI_TAG != tag) {
            printf("BAD rank %d thread %d: receive #%d got message #%d, count %d (sent %d), "
                   "source %d (expected %d), tag %d (expected %d)\n",
                   rank, tag, k, got, count, len_of(k), st.MPI_SOURCE, left, st.MPI_TAG, tag);
            fflush(stdout);
            bad = 1;
        }
        MPI_Wait(&sr, MPI_STATUS_IGNORE);
    }
    free(sb);
    free(rb);
    return NULL;
}

int main(int argc, char **argv)
{
    int provided, any;
    pthread_t th[NT];
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc > 1)
        n = atoi(argv[1]);
    nb = argc > 2 && strcmp(argv[2], "nb") == 0;
    if (argc > 3 && strcmp(argv[3], "mpit") == 0) {
        int tprov;
        MPI_T_init_thread(MPI_THREAD_SINGLE, &tprov);
    }
    if (provided != MPI_THREAD_MULTIPLE || size < 2) {
        if (rank == 0)
            printf("needs MPI_THREAD_MULTIPLE (got %d) and 2 ranks or more\n", provided);
        MPI_Finalize();
        return 2;
    }
    for (long t = 0; t < NT; t++)
        pthread_create(&th[t], NULL, run, (void *)t);
    for (int t = 0; t < NT; t++)
        pthread_join(th[t], NULL);
    if (bad) {
        /* the neighbours may wait for messages this rank no longer sends */
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    any = bad;
    MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0)
        printf("%s: %d ranks, %d threads, %d messages each, %s\n", any ? "BAD" : "ok", size, NT, n,
               nb ? "MPI_Irecv + MPI_Wait" : "MPI_Recv");
    MPI_Finalize();
    return any;
}
