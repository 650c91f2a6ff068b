/*
 * ring: every rank exchanges messages with both neighbours of a ring at once, as the
 * ring latency and bandwidth tests of HPC Challenge do (hpcc's "naturally and randomly
 * ordered ring"). Each message size from 8 B to 2 MiB (and hpcc's 2,000,000 bytes) is
 * sent round a ring in rank order and round rings in a random order (the same on every
 * rank), in both directions at once:
 *   sendrecv  MPI_Sendrecv to the right from the left, then to the left from the right
 *   isend     MPI_Irecv from both, MPI_Isend to both, MPI_Waitall of the four
 * Every received message is checked byte for byte and by its status.
 *
 * Options: --iters N (exchanges per size, order and style; default 6, --quick 3),
 * --rings N (random orders, default 10 as hpcc's bandwidth test, --quick 2), --sizes LIST (t_sizes).
 */
#include "common.h"

static void shuffle(int *perm, int n, uint64_t seed)
{
    for (int i = 0; i < n; i++)
        perm[i] = i;
    for (int i = n - 1; i > 0; i--) {
        seed = t_mix(seed + (uint64_t)i);
        int j = (int)(seed % (uint64_t)(i + 1));
        int t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
}

static uint64_t msg_seed(int order, int style, int it, size_t size, int src, int dst, int dir)
{
    return t_seed(((uint64_t)order << 8) | ((uint64_t)style << 1) | (uint64_t)dir, (uint64_t)it,
                  (uint64_t)size, ((uint64_t)src << 32) | (uint64_t)dst);
}

static void exchange(int order, int style, int it, size_t size, int left, int right,
                     unsigned char *sl, unsigned char *sr, unsigned char *rl, unsigned char *rr)
{
    /* hpcc's tags: a message to the right neighbour is TO_RIGHT, to the left TO_LEFT. */
    const int to_right = 200, to_left = 201;
    MPI_Status st[4];
    t_fill(sr, size, msg_seed(order, style, it, size, t_rank, right, 0));
    t_fill(sl, size, msg_seed(order, style, it, size, t_rank, left, 1));
    memset(rl, 0, size);
    memset(rr, 0, size);
    t_status_init_n(st, 4);
    if (style == 0) {
        T_CHECK_MPI(MPI_Sendrecv(sr, (int)size, MPI_BYTE, right, to_right, rl, (int)size, MPI_BYTE, left,
                                 to_right, MPI_COMM_WORLD, &st[0]));
        T_CHECK_MPI(MPI_Sendrecv(sl, (int)size, MPI_BYTE, left, to_left, rr, (int)size, MPI_BYTE, right,
                                 to_left, MPI_COMM_WORLD, &st[1]));
    } else {
        MPI_Request rq[4];
        T_CHECK_MPI(MPI_Irecv(rl, (int)size, MPI_BYTE, left, to_right, MPI_COMM_WORLD, &rq[0]));
        T_CHECK_MPI(MPI_Irecv(rr, (int)size, MPI_BYTE, right, to_left, MPI_COMM_WORLD, &rq[1]));
        T_CHECK_MPI(MPI_Isend(sr, (int)size, MPI_BYTE, right, to_right, MPI_COMM_WORLD, &rq[2]));
        T_CHECK_MPI(MPI_Isend(sl, (int)size, MPI_BYTE, left, to_left, MPI_COMM_WORLD, &rq[3]));
        T_CHECK_MPI(MPI_Waitall(4, rq, st));
    }
    /* With two ranks both neighbours are one rank: the tags tell its two messages
     * apart. */
    t_check_status_bytes(&st[0], left, to_right, size, "from the left");
    t_check_status_bytes(&st[1], right, to_left, size, "from the right");
    t_check(rl, size, msg_seed(order, style, it, size, left, t_rank, 0), "from the left");
    t_check(rr, size, msg_seed(order, style, it, size, right, t_rank, 1), "from the right");
}

int main(int argc, char **argv)
{
    t_init(&argc, &argv, "ring");
    int iters = (int)t_opt_long("iters", NULL, t_quick ? 3 : 6);
    int rings = (int)t_opt_long("rings", NULL, t_quick ? 2 : 10);
    size_t sizes[64];
    int nsizes = t_sizes_def(sizes, 64, "8,1K,16K,64K,256K,1M,2000000,2M");
    T_ASSERT(iters > 0 && rings >= 0 && nsizes > 0, "bad --iters/--rings/--sizes");
    size_t max = 0;
    for (int i = 0; i < nsizes; i++)
        max = sizes[i] > max ? sizes[i] : max;
    unsigned char *sl = t_malloc(max), *sr = t_malloc(max), *rl = t_malloc(max), *rr = t_malloc(max);
    int *perm = t_malloc(sizeof(int) * (size_t)t_size);
    static const char *const STYLE[] = { "sendrecv", "isend" };

    for (int order = 0; order <= rings; order++) {
        /* order 0: rank order; then random orders drawn from the same seed everywhere. */
        shuffle(perm, t_size, order ? t_seed(0x72696e67, (uint64_t)order, 0, 0) : 0);
        if (!order)
            for (int i = 0; i < t_size; i++)
                perm[i] = i;
        int pos = 0;
        for (int i = 0; i < t_size; i++)
            if (perm[i] == t_rank)
                pos = i;
        int left = perm[(pos - 1 + t_size) % t_size], right = perm[(pos + 1) % t_size];
        for (int style = 0; style < 2; style++) {
            for (int s = 0; s < nsizes; s++) {
                double t0 = MPI_Wtime();
                for (int it = 0; it < iters; it++) {
                    t_section("%s ring %d, %s, %zu bytes, exchange %d (left %d, right %d)",
                              order ? "random" : "natural", order, STYLE[style], sizes[s], it, left, right);
                    exchange(order, style, it, sizes[s], left, right, sl, sr, rl, rr);
                }
                double el = MPI_Wtime() - t0, maxel = 0;
                T_CHECK_MPI(MPI_Reduce(&el, &maxel, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD));
                if (t_verbose || sizes[s] == 2000000)
                    t_info("%s ring %d %s %zu B: %.1f us per exchange, %.1f MB/s per rank",
                           order ? "random" : "natural", order, STYLE[style], sizes[s], maxel / iters * 1e6,
                           2.0 * (double)sizes[s] * iters / maxel / 1e6);
            }
        }
    }
    free(sl);
    free(sr);
    free(rl);
    free(rr);
    free(perm);
    return t_pass();
}
