/* One-sided correctness under osc rdma: put, get, accumulate, get_accumulate,
 * fetch_and_op, compare_and_swap; fence, post/start/complete/wait, lock/unlock and
 * lock_all with flush; windows from MPI_Win_allocate, MPI_Win_create and dynamic
 * windows. Checks every byte. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

#define N 4096
static int errors = 0, rank, size;
#define CHECK(c, ...) do { if (!(c)) { errors++; fprintf(stderr, "rank %d: ", rank); fprintf(stderr, __VA_ARGS__); } } while (0)

static int64_t val(int r, int i, int round) { return (int64_t) r * 1000003 + i * 7 + round * 100000007LL; }

enum { FENCE, PSCW, LOCK, LOCKALL };
static const char *sync_names[] = {"fence", "pscw", "lock", "lock_all"};

static void open_epoch(MPI_Win win, int sync, int target, MPI_Group wg)
{
    switch (sync) {
    case FENCE: MPI_Win_fence(0, win); break;
    case PSCW: {
        int right = (rank + 1) % size, left = (rank + size - 1) % size;
        MPI_Group g_post, g_start;
        MPI_Group_incl(wg, 1, &left, &g_post);   /* left accesses me */
        MPI_Group_incl(wg, 1, &right, &g_start);  /* I access right */
        MPI_Win_post(g_post, 0, win);
        MPI_Win_start(g_start, 0, win);
        MPI_Group_free(&g_post); MPI_Group_free(&g_start);
        break;
    }
    case LOCK: MPI_Win_lock(MPI_LOCK_SHARED, target, 0, win); break;
    case LOCKALL: MPI_Win_lock_all(0, win); break;
    }
}

static void close_epoch(MPI_Win win, int sync, int target)
{
    switch (sync) {
    case FENCE: MPI_Win_fence(0, win); break;
    case PSCW: MPI_Win_complete(win); MPI_Win_wait(win); break;
    case LOCK: MPI_Win_unlock(target, win); MPI_Barrier(MPI_COMM_WORLD); break;
    case LOCKALL: MPI_Win_flush_all(win); MPI_Win_unlock_all(win); MPI_Barrier(MPI_COMM_WORLD); break;
    }
}

/* base: my window memory (N int64 + 8 counters); disp0: displacement of the data on
 * the target (0, or an absolute address for dynamic windows). */
static void run(MPI_Win win, int64_t *base, MPI_Aint *disps, int step, const char *kind)
{
#define D(t, e) (disps[t] + (MPI_Aint) (e) * step)
    MPI_Group wg;
    MPI_Win_get_group(win, &wg);
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    int64_t *src = malloc(N * sizeof(int64_t)), *dst = malloc(N * sizeof(int64_t));
    for (int sync = FENCE; sync <= LOCKALL; sync++) {
        int round = sync;
        /* put to the right */
        for (int i = 0; i < N + 8; i++) base[i] = -1;
        for (int i = 0; i < N; i++) src[i] = val(rank, i, round);
        MPI_Barrier(MPI_COMM_WORLD);
        open_epoch(win, sync, right, wg);
        MPI_Put(src, N, MPI_INT64_T, right, D(right, 0), N, MPI_INT64_T, win);
        if (sync == LOCKALL) MPI_Win_flush(right, win);
        close_epoch(win, sync, right);
        for (int i = 0; i < N; i++)
            if (base[i] != val(left, i, round)) { CHECK(0, "%s %s put: elem %d = %ld\n", kind, sync_names[sync], i, (long) base[i]); break; }
        /* get from the right */
        memset(dst, 0, N * sizeof(int64_t));
        MPI_Barrier(MPI_COMM_WORLD);
        open_epoch(win, sync, right, wg);
        MPI_Get(dst, N, MPI_INT64_T, right, D(right, 0), N, MPI_INT64_T, win);
        close_epoch(win, sync, right);
        for (int i = 0; i < N; i++)
            if (dst[i] != val(rank, i, round)) { CHECK(0, "%s %s get: elem %d\n", kind, sync_names[sync], i); break; }
        /* accumulate (sum) from everyone into counter 0 of rank 0, and into the data of the right */
        MPI_Barrier(MPI_COMM_WORLD);
        base[N] = 0; base[N + 1] = 0; base[N + 2] = 0; base[N + 3] = 0;
        MPI_Barrier(MPI_COMM_WORLD);
        open_epoch(win, sync, 0, wg);
        if (sync != PSCW) {
            int64_t one = rank + 1;
            MPI_Accumulate(&one, 1, MPI_INT64_T, 0, D(0, N), 1, MPI_INT64_T, MPI_SUM, win);
            int64_t fetched = -5, add = 1;
            MPI_Fetch_and_op(&add, &fetched, MPI_INT64_T, 0, D(0, N + 1), MPI_SUM, win);
            if (sync == LOCK || sync == LOCKALL) MPI_Win_flush(0, win);
            CHECK(fetched >= 0 && fetched < size, "%s %s fetch_and_op fetched %ld\n", kind, sync_names[sync], (long) fetched);
            int64_t cmp = 0, newv = rank + 100, old = -5;
            MPI_Compare_and_swap(&newv, &cmp, &old, MPI_INT64_T, 0, D(0, N + 2), win);
            int64_t ga_in = 2, ga_out = -5;
            MPI_Get_accumulate(&ga_in, 1, MPI_INT64_T, &ga_out, 1, MPI_INT64_T, 0, D(0, N + 3), 1, MPI_INT64_T, MPI_SUM, win);
        }
        close_epoch(win, sync, 0);
        if (sync == PSCW) {
            /* PSCW only pairs neighbours: accumulate into the right */
            MPI_Barrier(MPI_COMM_WORLD);
            open_epoch(win, sync, right, wg);
            int64_t add = 5;
            MPI_Accumulate(&add, 1, MPI_INT64_T, right, D(right, N), 1, MPI_INT64_T, MPI_SUM, win);
            close_epoch(win, sync, right);
            CHECK(base[N] == 5, "%s pscw accumulate %ld\n", kind, (long) base[N]);
        } else if (rank == 0) {
            CHECK(base[N] == (int64_t) size * (size + 1) / 2, "%s %s accumulate %ld\n", kind, sync_names[sync], (long) base[N]);
            CHECK(base[N + 1] == size, "%s %s fetch_and_op total %ld\n", kind, sync_names[sync], (long) base[N + 1]);
            CHECK(base[N + 2] >= 100 && base[N + 2] < 100 + size, "%s %s cas %ld\n", kind, sync_names[sync], (long) base[N + 2]);
            CHECK(base[N + 3] == 2 * size, "%s %s get_accumulate %ld\n", kind, sync_names[sync], (long) base[N + 3]);
        }
        MPI_Barrier(MPI_COMM_WORLD);
    }
    /* 32-bit atomics */
    {
        int32_t *b32 = (int32_t *) &base[N + 4];
        b32[0] = 0;
        MPI_Barrier(MPI_COMM_WORLD);
        MPI_Win_lock_all(0, win);
        int32_t add = 3, old;
        MPI_Fetch_and_op(&add, &old, MPI_INT32_T, 0, D(0, N + 4), MPI_SUM, win);
        MPI_Win_flush_all(win);
        MPI_Win_unlock_all(win);
        MPI_Barrier(MPI_COMM_WORLD);
        if (rank == 0) CHECK(b32[0] == 3 * size, "%s 32-bit fetch_and_op %d\n", kind, b32[0]);
    }
    MPI_Group_free(&wg);
    free(src); free(dst);
#undef D
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    size_t bytes = (N + 8) * sizeof(int64_t);
    MPI_Aint *zeros = calloc(size, sizeof(MPI_Aint));
    {
        int64_t *base; MPI_Win win;
        MPI_Win_allocate(bytes, 8, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
        run(win, base, zeros, 1, "allocate");
        MPI_Win_free(&win);
    }
    {
        int64_t *base = malloc(bytes); MPI_Win win;
        MPI_Win_create(base, bytes, 8, MPI_INFO_NULL, MPI_COMM_WORLD, &win);
        run(win, base, zeros, 1, "create");
        MPI_Win_free(&win);
        free(base);
    }
    {
        int64_t *base = malloc(bytes); MPI_Win win;
        MPI_Win_create_dynamic(MPI_INFO_NULL, MPI_COMM_WORLD, &win);
        MPI_Win_attach(win, base, bytes);
        MPI_Aint mine, *disps = malloc(size * sizeof(MPI_Aint));
        MPI_Get_address(base, &mine);
        MPI_Allgather(&mine, 1, MPI_AINT, disps, 1, MPI_AINT, MPI_COMM_WORLD);
        run(win, base, disps, 8, "dynamic");
        free(disps);
        MPI_Win_detach(win, base);
        MPI_Win_free(&win);
        free(base);
    }
    int total;
    MPI_Allreduce(&errors, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("%s: %d errors\n", total ? "FAIL" : "PASS", total);
    MPI_Finalize();
    return total ? 1 : 0;
}
