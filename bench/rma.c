/*
 * rma: MPI one-sided latency and bandwidth, rank 0 origin, rank 1 target, passive target.
 *
 * Rank 0 holds MPI_Win_lock(MPI_LOCK_SHARED, 1) for the whole run and completes every
 * operation with MPI_Win_flush(1), so a latency is one operation plus its remote
 * completion. The window is MPI_Win_create over MPI_Alloc_mem memory: with
 * MPI_Win_allocate on one node osc/rdma (and osc/sm) put the window in a shared segment
 * and copy with the CPU, so the BTL would never be measured (-a asks for that anyway).
 * The target sits in MPI_Barrier meanwhile, which is what drives progress for
 * osc/pt2pt.
 *
 * Output (rank 0, stdout), one parsable line per measurement:
 *   put <bytes> <usec>      one MPI_Put + MPI_Win_flush, mean over the timed iterations
 *   get <bytes> <usec>      one MPI_Get + MPI_Win_flush
 *   putbw <bytes> <MB/s>    <window> MPI_Put then one MPI_Win_flush, repeated; MB = 1e6 bytes
 *   getbw <bytes> <MB/s>    the same with MPI_Get
 * Lines starting with '#' are comments (iteration counts actually used).
 *
 * Options (as pingpong):
 *   -s LIST   sizes, comma separated (default 8,4096,65536,1048576)
 *   -i N      iterations at <= 4 KiB; /5 up to 64 KiB, /40 above (default 10000)
 *   -w N      warm-up iterations per size (default iterations/10, between 2 and 200)
 *   -t SECS   time budget per measurement (default 1.0); at least 5 iterations
 *   -b BYTES  bandwidth message size (default 1048576); 0 disables the bandwidth tests
 *   -W N      operations per flush in the bandwidth tests (default 64)
 *   -n N      bandwidth bursts timed, at most (default 20; one warm-up burst before)
 *   -q        quick: iterations, budget, window and bursts divided by 4 unless given
 *   -a        MPI_Win_allocate instead of MPI_Win_create
 *   -h        usage
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_SIZES 32

static const char usage[] =
    "usage: rma [-s sizes] [-i iters] [-w warmup] [-t secs] [-b bwbytes] [-W window]\n"
    "           [-n bursts] [-q] [-a] [-h]  (see the comment at the top of bench/rma.c)\n";

enum op { PUT, GET };

static int iters_for(long size, int base)
{
    int n = base;
    if (size > 65536)
        n = base / 40;
    else if (size > 4096)
        n = base / 5;
    return n < 5 ? 5 : n;
}

/* Only the origin runs the loops, so it decides alone. */
static int fit_budget(double per_iter, int min_iters, int max_iters, double budget)
{
    int n = max_iters;
    if (per_iter > 0.0 && per_iter * max_iters > budget)
        n = (int)(budget / per_iter);
    if (n < min_iters)
        n = min_iters;
    return n > max_iters ? max_iters : n;
}

static void burst(enum op op, char *buf, long size, int count, MPI_Win win)
{
    for (int k = 0; k < count; k++) {
        if (op == PUT)
            MPI_Put(buf, (int)size, MPI_BYTE, 1, 0, (int)size, MPI_BYTE, win);
        else
            MPI_Get(buf, (int)size, MPI_BYTE, 1, 0, (int)size, MPI_BYTE, win);
    }
    MPI_Win_flush(1, win);
}

/* Mean seconds per burst of `count` operations; the first warm-up burst pays for setup
 * and is left out of the estimate that sizes the timed loop. */
static double timed(enum op op, char *buf, long size, int count, int iters, int warmup,
                    double budget, int min_iters, MPI_Win win, int *used)
{
    burst(op, buf, size, count, win);
    double t0 = MPI_Wtime();
    for (int i = 1; i < warmup; i++)
        burst(op, buf, size, count, win);
    double per = warmup > 1 ? (MPI_Wtime() - t0) / (warmup - 1) : 0.0;
    int n = fit_budget(per, min_iters, iters, budget);
    t0 = MPI_Wtime();
    for (int i = 0; i < n; i++)
        burst(op, buf, size, count, win);
    *used = n;
    return (MPI_Wtime() - t0) / n;
}

int main(int argc, char **argv)
{
    long sizes[MAX_SIZES] = {8, 4096, 65536, 1048576};
    int nsizes = 4, iters = 10000, warmup = -1, window = 64, windows = 20, quick = 0, alloc = 0;
    long bwsize = 1048576;
    double budget = 1.0;
    int rank, nprocs, opt, set = 0;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nprocs);

    while ((opt = getopt(argc, argv, "s:i:w:t:b:W:n:qah")) != -1) {
        switch (opt) {
        case 's': {
            char *list = strdup(optarg), *save = NULL;
            nsizes = 0;
            for (char *t = strtok_r(list, ",", &save); t && nsizes < MAX_SIZES;
                 t = strtok_r(NULL, ",", &save))
                sizes[nsizes++] = atol(t);
            free(list);
            break;
        }
        case 'i': iters = atoi(optarg); set |= 1; break;
        case 'w': warmup = atoi(optarg); break;
        case 't': budget = atof(optarg); set |= 2; break;
        case 'b': bwsize = atol(optarg); break;
        case 'W': window = atoi(optarg); set |= 4; break;
        case 'n': windows = atoi(optarg); set |= 8; break;
        case 'q': quick = 1; break;
        case 'a': alloc = 1; break;
        case 'h':
            if (rank == 0)
                printf("%s", usage);
            MPI_Finalize();
            return 0;
        default:
            if (rank == 0)
                fprintf(stderr, "%s", usage);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
    if (quick) {
        if (!(set & 1))
            iters /= 4;
        if (!(set & 2))
            budget /= 4;
        if (!(set & 4))
            window /= 4;
        if (!(set & 8))
            windows /= 4;
    }
    if (iters < 1 || window < 1 || windows < 1 || budget <= 0.0) {
        if (rank == 0)
            fprintf(stderr, "rma: iterations, window, bursts and budget must be > 0\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (nprocs < 2) {
        if (rank == 0)
            fprintf(stderr, "rma: needs 2 ranks\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    long maxsize = bwsize > 1 ? bwsize : 1;
    for (int i = 0; i < nsizes; i++)
        if (sizes[i] > maxsize)
            maxsize = sizes[i];
    char *buf = NULL, *base = NULL;
    MPI_Win win;
    if (posix_memalign((void **)&buf, 4096, (size_t)maxsize))
        MPI_Abort(MPI_COMM_WORLD, 2);
    memset(buf, 'a', (size_t)maxsize);
    if (alloc) {
        MPI_Win_allocate((MPI_Aint)maxsize, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
    } else {
        MPI_Alloc_mem((MPI_Aint)maxsize, MPI_INFO_NULL, &base);
        MPI_Win_create(base, (MPI_Aint)maxsize, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win);
    }
    memset(base, 'b', (size_t)maxsize);
    MPI_Barrier(MPI_COMM_WORLD);

    if (rank == 0) {
        static const char *names[2] = {"put", "get"};
        printf("# window %s\n", alloc ? "MPI_Win_allocate" : "MPI_Win_create");
        MPI_Win_lock(MPI_LOCK_SHARED, 1, 0, win);
        for (int op = PUT; op <= GET; op++) {
            for (int i = 0; i < nsizes; i++) {
                int n = iters_for(sizes[i], iters), used = 0;
                int w = warmup >= 0 ? warmup : n / 10;
                if (w < 2)
                    w = 2;
                if (warmup < 0 && w > 200)
                    w = 200;
                double s = timed((enum op)op, buf, sizes[i], 1, n, w, budget, 5, win, &used);
                printf("# %s %ld iters=%d warmup=%d\n", names[op], sizes[i], used, w);
                printf("%s %ld %.3f\n", names[op], sizes[i], s * 1e6);
                fflush(stdout);
            }
            if (bwsize > 0) {
                int used = 0;
                double s = timed((enum op)op, buf, bwsize, window, windows, 1, budget, 1, win,
                                 &used);
                printf("# %sbw %ld window=%d bursts=%d\n", names[op], bwsize, window, used);
                printf("%sbw %ld %.1f\n", names[op], bwsize, (double)bwsize * window / s / 1e6);
                fflush(stdout);
            }
        }
        MPI_Win_unlock(1, win);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Win_free(&win);
    if (!alloc)
        MPI_Free_mem(base);
    free(buf);
    MPI_Finalize();
    return 0;
}
