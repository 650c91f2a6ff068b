/*
 * pingpong: MPI point-to-point latency and streaming bandwidth between ranks 0 and 1.
 *
 * Output (rank 0, stdout), one parsable line per measurement:
 *   lat <bytes> <usec one-way>   half the mean round trip of the timed ping-pongs
 *   bw  <bytes> <MB/s>           streaming: windows of <window> MPI_Isend / MPI_Irecv on
 *                                one buffer, one zero-byte ack per window; MB = 1e6 bytes
 * Lines starting with '#' are comments (iteration counts actually used).
 *
 * Options:
 *   -s LIST   latency sizes, comma separated (default 8,4096,65536,1048576)
 *   -i N      iterations at <= 4 KiB; /5 up to 64 KiB, /40 above (default 10000)
 *   -w N      warm-up iterations per size (default iterations/10, between 2 and 200)
 *   -t SECS   time budget per measurement: fewer iterations when the warm-up says the
 *             full count would take longer (default 1.0); at least 5 iterations
 *   -b LIST   bandwidth message sizes, comma separated (default 1048576); 0 disables the
 *             bandwidth test
 *   -W N      bandwidth window (default 64)
 *   -n N      bandwidth windows timed, at most (default 20; two warm-up windows before,
 *             the second of which sizes the run to the budget)
 *   -s none   no latency measurement: the stream only
 *   -q        quick: iterations and budget divided by 4 unless given. The stream keeps
 *             its window and windows: the budget bounds them (a quarter of the default
 *             window and windows, 80 MiB, took 15 ms over tcp, too short to compare)
 *   -1        one buffer for sends and receives; by default each rank sends from one
 *             buffer and receives into another, as osu_latency and fi_pingpong do. With
 *             one buffer every single-copy transfer (CMA on shm, vader's get) reads
 *             lines the other core has just written: 64 KiB one-way goes from about 5.5
 *             to 12 us on shm, for every component alike
 *   -T        initialise with MPI_THREAD_MULTIPLE (one thread still does the traffic):
 *             what the components cost when threads may call them
 *   -S        the latency ping-pong sends with MPI_Ssend: what a synchronous send's
 *             acknowledgement costs (the stream is unchanged)
 *   -h        usage
 *
 * Only ranks 0 and 1 take part; any further ranks wait in the final barrier.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_SIZES 32

static const char usage[] =
    "usage: pingpong [-s sizes] [-i iters] [-w warmup] [-t secs] [-b bwbytes] [-W window]\n"
    "                [-n windows] [-q] [-1] [-T] [-S] [-h]  (see the comment at the top of bench/pingpong.c)\n";

static int iters_for(long size, int base)
{
    int n = base;
    if (size > 65536)
        n = base / 40;
    else if (size > 4096)
        n = base / 5;
    return n < 5 ? 5 : n;
}

/* Rank 0 decides how many timed iterations fit the budget and tells rank 1. */
static int fit_budget(int rank, double per_iter, int min_iters, int max_iters, double budget)
{
    int n = max_iters;
    if (rank == 0) {
        if (per_iter > 0.0 && per_iter * max_iters > budget)
            n = (int)(budget / per_iter);
        if (n < min_iters)
            n = min_iters;
        if (n > max_iters)
            n = max_iters;
        MPI_Send(&n, 1, MPI_INT, 1, 9, MPI_COMM_WORLD);
    } else {
        MPI_Recv(&n, 1, MPI_INT, 0, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    return n;
}

/* MPI_Send, or MPI_Ssend with -S. */
static int (*send_fn)(const void *, int, MPI_Datatype, int, int, MPI_Comm) = MPI_Send;

static void round_trip(int rank, char *sbuf, char *rbuf, long size)
{
    if (rank == 0) {
        send_fn(sbuf, (int)size, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
        MPI_Recv(rbuf, (int)size, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
        MPI_Recv(rbuf, (int)size, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        send_fn(sbuf, (int)size, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
    }
}

static double pingpong(int rank, char *sbuf, char *rbuf, long size, int iters, int warmup,
                       double budget, int *used)
{
    /* The first warm-up round trip pays for connection setup: leave it out of the estimate. */
    round_trip(rank, sbuf, rbuf, size);
    double t0 = MPI_Wtime();
    for (int i = 1; i < warmup; i++)
        round_trip(rank, sbuf, rbuf, size);
    double per_iter = warmup > 1 ? (MPI_Wtime() - t0) / (warmup - 1) : 0.0;
    int n = fit_budget(rank, per_iter, 5, iters, budget);

    t0 = MPI_Wtime();
    for (int i = 0; i < n; i++)
        round_trip(rank, sbuf, rbuf, size);
    *used = n;
    return (MPI_Wtime() - t0) * 1e6 / (2.0 * n);
}

static void one_window(int rank, char *buf, long size, int window, MPI_Request *req)
{
    char ack = 0;
    for (int k = 0; k < window; k++) {
        if (rank == 0)
            MPI_Isend(buf, (int)size, MPI_BYTE, 1, 2, MPI_COMM_WORLD, &req[k]);
        else
            MPI_Irecv(buf, (int)size, MPI_BYTE, 0, 2, MPI_COMM_WORLD, &req[k]);
    }
    MPI_Waitall(window, req, MPI_STATUSES_IGNORE);
    if (rank == 0)
        MPI_Recv(&ack, 0, MPI_BYTE, 1, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    else
        MPI_Send(&ack, 0, MPI_BYTE, 0, 3, MPI_COMM_WORLD);
}

static double stream(int rank, char *buf, long size, int window, int windows, double budget,
                     int *used)
{
    MPI_Request *req = malloc(sizeof(*req) * (size_t)window);
    if (!req)
        MPI_Abort(MPI_COMM_WORLD, 2);
    /* The first window pays for connections and first touches: the second sizes the run. */
    one_window(rank, buf, size, window, req);
    double t0 = MPI_Wtime();
    one_window(rank, buf, size, window, req);
    int n = fit_budget(rank, MPI_Wtime() - t0, 1, windows, budget);
    t0 = MPI_Wtime();
    for (int w = 0; w < n; w++)
        one_window(rank, buf, size, window, req);
    double secs = MPI_Wtime() - t0;
    free(req);
    *used = n;
    return (double)size * window * n / secs / 1e6;
}

/* "8,4096,..." (or "none": no sizes) into out; returns the count. */
static int parse_list(const char *arg, long *out)
{
    char *list = strdup(arg), *save = NULL;
    int n = 0;
    if (strcmp(list, "none") == 0)
        *list = '\0';
    for (char *t = strtok_r(list, ",", &save); t && n < MAX_SIZES; t = strtok_r(NULL, ",", &save))
        out[n++] = atol(t);
    free(list);
    return n;
}

int main(int argc, char **argv)
{
    long sizes[MAX_SIZES] = {8, 4096, 65536, 1048576};
    int nsizes = 4, iters = 10000, warmup = -1, window = 64, windows = 20, quick = 0;
    long bwsizes[MAX_SIZES] = {1048576};
    int nbw = 1;
    double budget = 1.0;
    int rank, nprocs, opt, set = 0, one_buffer = 0;

    int threaded = 0, provided = 0;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "-T") == 0)
            threaded = 1;
    if (threaded) {
        MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    } else {
        MPI_Init(&argc, &argv);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nprocs);
    if (threaded && provided != MPI_THREAD_MULTIPLE && rank == 0)
        fprintf(stderr, "pingpong: -T: MPI_THREAD_MULTIPLE not provided (%d)\n", provided);

    while ((opt = getopt(argc, argv, "s:i:w:t:b:W:n:q1TSh")) != -1) {
        switch (opt) {
        case 's':
            nsizes = parse_list(optarg, sizes);
            break;
        case 'i': iters = atoi(optarg); set |= 1; break;
        case 'w': warmup = atoi(optarg); break;
        case 't': budget = atof(optarg); set |= 2; break;
        case 'b':
            nbw = parse_list(optarg, bwsizes);
            break;
        case 'W': window = atoi(optarg); break;
        case 'n': windows = atoi(optarg); break;
        case 'q': quick = 1; break;
        case '1': one_buffer = 1; break;
        case 'T': break;
        case 'S': send_fn = MPI_Ssend; break;
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
    }
    if (iters < 1 || window < 1 || windows < 1 || budget <= 0.0) {
        if (rank == 0)
            fprintf(stderr, "pingpong: iterations, window, windows and budget must be > 0\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (nprocs < 2) {
        if (rank == 0)
            fprintf(stderr, "pingpong: needs 2 ranks\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    long maxsize = 1;
    for (int i = 0; i < nbw; i++)
        if (bwsizes[i] > maxsize)
            maxsize = bwsizes[i];
    for (int i = 0; i < nsizes; i++)
        if (sizes[i] > maxsize)
            maxsize = sizes[i];
    char *buf = NULL, *rbuf = NULL;
    if (posix_memalign((void **)&buf, 4096, (size_t)maxsize))
        MPI_Abort(MPI_COMM_WORLD, 2);
    memset(buf, 'a', (size_t)maxsize);
    if (one_buffer) {
        rbuf = buf;
    } else {
        if (posix_memalign((void **)&rbuf, 4096, (size_t)maxsize))
            MPI_Abort(MPI_COMM_WORLD, 2);
        memset(rbuf, 'b', (size_t)maxsize);
    }

    if (rank < 2) {
        MPI_Barrier(MPI_COMM_WORLD);
        for (int i = 0; i < nsizes; i++) {
            int n = iters_for(sizes[i], iters), used = 0;
            int w = warmup >= 0 ? warmup : n / 10;
            if (w < 2)
                w = 2;
            if (warmup < 0 && w > 200)
                w = 200;
            double us = pingpong(rank, buf, rbuf, sizes[i], n, w, budget, &used);
            if (rank == 0) {
                printf("# lat %ld iters=%d warmup=%d\n", sizes[i], used, w);
                printf("lat %ld %.3f\n", sizes[i], us);
                fflush(stdout);
            }
        }
        for (int i = 0; i < nbw; i++) {
            int used = 0;
            if (bwsizes[i] <= 0)
                continue;
            double mbs = stream(rank, rank == 0 ? buf : rbuf, bwsizes[i], window, windows, budget, &used);
            if (rank == 0) {
                printf("# bw %ld window=%d windows=%d\n", bwsizes[i], window, used);
                printf("bw %ld %.1f\n", bwsizes[i], mbs);
                fflush(stdout);
            }
        }
    } else {
        MPI_Barrier(MPI_COMM_WORLD);
    }
    if (rbuf != buf)
        free(rbuf);
    free(buf);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    return 0;
}
