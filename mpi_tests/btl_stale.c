/* The stale-registration scenario: rank 0 exposes a buffer for RDMA (MPI_Win_create,
 * which registers it through the BTL), frees the window and unmaps the buffer, maps
 * new memory at the same address with other contents and exposes it again. Rank 1
 * must read the new contents, and the BTL's registration-cache counters (read through
 * MPI_T, btl_ofi_rcache_stats) must show the invalidation and a fresh registration.
 * Then a free/reuse loop creates many windows over recycled memory, checking every
 * byte each time. Run with 2 ranks (others only take part in the collectives). */
#define _GNU_SOURCE
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define LEN (1 << 20)
static int rank, errors;

struct stats { long hits, misses, inval; };

static int read_stats(struct stats *s)
{
    int idx, count;
    MPI_T_cvar_handle h;
    char buf[512] = "";
    if (MPI_T_cvar_get_index("btl_ofi_rcache_stats", &idx) != MPI_SUCCESS) return -1;
    if (MPI_T_cvar_handle_alloc(idx, NULL, &h, &count) != MPI_SUCCESS) return -1;
    MPI_T_cvar_read(h, buf);
    MPI_T_cvar_handle_free(&h);
    if (sscanf(buf, "hits %ld misses %ld invalidations %ld", &s->hits, &s->misses, &s->inval) != 3) return -1;
    return 0;
}

static unsigned char *map_at(void *want)
{
    void *p = mmap(want, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | (want ? MAP_FIXED_NOREPLACE : 0), -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* Expose buf (rank 0) and let rank 1 read it all; returns the number of wrong bytes. */
static int expose_and_check(unsigned char *buf, unsigned char seed)
{
    MPI_Win win;
    MPI_Win_create(rank == 0 ? buf : NULL, rank == 0 ? LEN : 0, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win);
    int bad = 0;
    if (rank == 1) {
        unsigned char *dst = malloc(LEN);
        memset(dst, 0, LEN);
        MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
        MPI_Get(dst, LEN, MPI_BYTE, 0, 0, LEN, MPI_BYTE, win);
        MPI_Win_unlock(0, win);
        for (int i = 0; i < LEN; i++)
            if (dst[i] != (unsigned char) (seed + i * 13)) { bad++; }
        free(dst);
    }
    MPI_Win_free(&win);
    MPI_Bcast(&bad, 1, MPI_INT, 1, MPI_COMM_WORLD);
    return bad;
}

int main(int argc, char **argv)
{
    int provided, size;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_SINGLE, &provided);
    MPI_T_init_thread(MPI_THREAD_SINGLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int loops = argc > 1 ? atoi(argv[1]) : 1000;

    unsigned char *buf = NULL;
    struct stats s0 = {0}, s2 = {0};
    if (rank == 0) {
        buf = map_at(NULL);
        for (int i = 0; i < LEN; i++) buf[i] = (unsigned char) ('A' + i * 13);
    }
    int bad = expose_and_check(buf, 'A');
    if (bad) { errors++; if (rank == 0) fprintf(stderr, "first exposure: %d wrong bytes\n", bad); }
    if (rank == 0) {
        if (read_stats(&s0)) { errors++; fprintf(stderr, "cannot read btl_ofi_rcache_stats through MPI_T\n"); }
        void *old = buf;
        munmap(buf, LEN);
        buf = map_at(old);
        if (buf != old) { errors++; fprintf(stderr, "could not map again at %p\n", old); buf = map_at(NULL); }
        for (int i = 0; i < LEN; i++) buf[i] = (unsigned char) ('B' + i * 13);
    }
    bad = expose_and_check(buf, 'B');
    if (bad) { errors++; if (rank == 0) fprintf(stderr, "stale registration: rank 1 read %d old bytes\n", bad); }
    if (rank == 0) {
        read_stats(&s2);
        /* the counters are published at each (de)registration, so the munmap shows up
         * in the snapshot taken after the second window */
        printf("rcache: after 1st window hits %ld misses %ld invalidations %ld; after 2nd window hits %ld misses %ld invalidations %ld\n",
               s0.hits, s0.misses, s0.inval, s2.hits, s2.misses, s2.inval);
        if (s2.inval <= s0.inval) { errors++; fprintf(stderr, "munmap did not invalidate the cached registration\n"); }
        if (s2.misses <= s0.misses || s2.hits != s0.hits) { errors++; fprintf(stderr, "the second window reused the stale registration (no fresh miss)\n"); }
    }
    /* free/reuse loop over recycled memory */
    for (int k = 0; k < loops; k++) {
        if (rank == 0) {
            void *old = buf;
            munmap(buf, LEN);
            buf = map_at(k % 2 ? old : NULL);
            if (!buf) buf = map_at(NULL);
            for (int i = 0; i < LEN; i += 1) buf[i] = (unsigned char) (k + i * 13);
        }
        bad = expose_and_check(buf, (unsigned char) k);
        if (bad) { errors++; if (rank == 0) fprintf(stderr, "loop %d: %d wrong bytes\n", k, bad); break; }
    }
    if (rank == 0) {
        struct stats s3;
        read_stats(&s3);
        printf("rcache after %d windows: hits %ld misses %ld invalidations %ld\n", loops, s3.hits, s3.misses, s3.inval);
        munmap(buf, LEN);
    }
    int total;
    MPI_Allreduce(&errors, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("%s: %d errors\n", total ? "FAIL" : "PASS", total);
    MPI_T_finalize();
    MPI_Finalize();
    return total ? 1 : 0;
}
