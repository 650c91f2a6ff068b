/*
 * turns: ranks take turns computing while the others wait, the pattern of a dense
 * compute-bound program such as HPL (a panel factored by one rank, then sent to the
 * rest). In turn k, rank k % np computes a fixed amount of floating-point work and sends
 * the panel it produced to every other rank; they wait for it and check its bytes. Then
 * every rank computes a smaller update, so ranks that finish early wait for the next
 * panel while others still compute.
 *
 * How the others wait is the mode (--mode, default: each in turn):
 *   recv    MPI_Recv
 *   wait    MPI_Irecv, then MPI_Wait
 *   test    MPI_Irecv, then MPI_Test in a loop
 *   iprobe  MPI_Iprobe in a loop, then MPI_Recv (HPL's broadcast test does this)
 *   bcast   the panel goes by MPI_Bcast
 *   ring    the panel goes round a ring of blocking sends from the root (HPL's 1ring),
 *           so a blocking send often waits for a peer that still computes
 *
 * On an oversubscribed node a waiting rank shares a core with a rank that computes, so
 * how much of the core it gives back decides the program's rate. The rate of each mode
 * (turns per second) is printed as INFO; nothing about time is asserted here.
 * scripts/bench --turns compares the rates of the lanes.
 *
 * Options: --mode M[,M...], --turns N (default 24, --quick 8), --work N (passes over a 64 KiB
 * array by the root per turn, default 3000, --quick 600), --update N (passes by every
 * rank after a turn, default work / 10), --panel SIZE (default 512K), --threads
 * (MPI_THREAD_MULTIPLE, with a second thread per rank that computes on its own
 * throughout and must not be starved by the one that waits; its rate is printed too).
 */
#include "common.h"

#define WORK_DOUBLES 8192 /* 64 KiB: stays in cache, so the work is CPU-bound */

static double compute(double *a, long passes)
{
    double s = 0;
    for (long p = 0; p < passes; p++)
        for (int i = 0; i < WORK_DOUBLES; i++) {
            a[i] = a[i] * 0.999999 + 1e-6 * (double)(i & 7);
            s += a[i];
        }
    return s;
}

static int side_stop;
static double side_result;
static long side_passes;

static void *side_worker(void *arg)
{
    double *a = arg;
    while (!__atomic_load_n(&side_stop, __ATOMIC_RELAXED)) {
        side_result += compute(a, 10);
        __atomic_add_fetch(&side_passes, 10, __ATOMIC_RELAXED);
    }
    return NULL;
}

static const char *const MODES[] = { "recv", "wait", "test", "iprobe", "bcast", "ring" };
#define NMODES ((int)(sizeof(MODES) / sizeof(MODES[0])))

/* Whether the comma-separated list names `mode`. */
static int selected(const char *list, const char *mode)
{
    size_t n = strlen(mode);
    for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
        if (!strncmp(p, mode, n) && (p[n] == ',' || p[n] == 0))
            return 1;
    return 0;
}

struct cfg {
    long turns, work, update;
    size_t panel;
};

static void wait_panel(const char *mode, unsigned char *buf, size_t panel, int src, int tag)
{
    MPI_Status st;
    MPI_Request rq;
    int flag = 0;
    t_status_init(&st);
    if (!strcmp(mode, "wait") || !strcmp(mode, "test")) {
        T_CHECK_MPI(MPI_Irecv(buf, (int)panel, MPI_BYTE, src, tag, MPI_COMM_WORLD, &rq));
        if (!strcmp(mode, "wait")) {
            T_CHECK_MPI(MPI_Wait(&rq, &st));
        } else {
            while (!flag)
                T_CHECK_MPI(MPI_Test(&rq, &flag, &st));
        }
    } else {
        if (!strcmp(mode, "iprobe"))
            while (!flag)
                T_CHECK_MPI(MPI_Iprobe(src, tag, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE));
        T_CHECK_MPI(MPI_Recv(buf, (int)panel, MPI_BYTE, src, tag, MPI_COMM_WORLD, &st));
    }
    t_check_status_bytes(&st, src, tag, panel, "panel");
}

/* One run of the turns in `mode`; returns the slowest rank's elapsed seconds. */
static double run_mode(const char *mode, const struct cfg *c, double *a, unsigned char *buf, double *sum)
{
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    double t0 = MPI_Wtime();
    for (long k = 0; k < c->turns; k++) {
        int root = (int)(k % t_size), tag = (int)k;
        int prev = (t_rank - 1 + t_size) % t_size, next = (t_rank + 1) % t_size;
        uint64_t seed = t_seed(0x7475726e, (uint64_t)k, (uint64_t)root, (uint64_t)c->panel);
        t_section("%s: turn %ld root %d", mode, k, root);
        if (t_rank == root) {
            *sum += compute(a, c->work);
            t_fill(buf, c->panel, seed);
        } else {
            memset(buf, 0, c->panel);
        }
        if (!strcmp(mode, "bcast")) {
            T_CHECK_MPI(MPI_Bcast(buf, (int)c->panel, MPI_BYTE, root, MPI_COMM_WORLD));
        } else if (!strcmp(mode, "ring")) {
            if (t_rank != root)
                wait_panel("recv", buf, c->panel, prev, tag);
            if (next != root)
                T_CHECK_MPI(MPI_Send(buf, (int)c->panel, MPI_BYTE, next, tag, MPI_COMM_WORLD));
        } else if (t_rank == root) {
            for (int r = 0; r < t_size; r++)
                if (r != root)
                    T_CHECK_MPI(MPI_Send(buf, (int)c->panel, MPI_BYTE, r, tag, MPI_COMM_WORLD));
        } else {
            wait_panel(mode, buf, c->panel, root, tag);
        }
        if (t_rank != root)
            t_check(buf, c->panel, seed, "panel");
        *sum += compute(a, c->update);
    }
    double el = MPI_Wtime() - t0, maxel = 0;
    T_CHECK_MPI(MPI_Allreduce(&el, &maxel, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
    return maxel;
}

int main(int argc, char **argv)
{
    t_argc = argc;
    t_argv = argv;
    int threads = t_opt_flag("threads");
    if (threads) {
        int provided = t_init_thread(&argc, &argv, "turns", MPI_THREAD_MULTIPLE);
        T_ASSERT(provided == MPI_THREAD_MULTIPLE, "MPI_THREAD_MULTIPLE not provided (%d)", provided);
    } else {
        t_init(&argc, &argv, "turns");
    }
    struct cfg c;
    c.turns = t_opt_long("turns", NULL, t_quick ? 8 : 24);
    c.work = t_opt_long("work", NULL, t_quick ? 600 : 3000);
    c.update = t_opt_long("update", NULL, c.work / 10);
    long long panel = t_parse_size(t_opt_str("panel", "512K"));
    const char *only = t_opt_str("mode", NULL);
    T_ASSERT(c.turns > 0 && c.work > 0 && c.update >= 0 && panel > 0, "bad --turns/--work/--update/--panel");
    c.panel = (size_t)panel;
    if (only) {
        char list[256];
        snprintf(list, sizeof(list), "%s", only);
        for (char *save = NULL, *w = strtok_r(list, ",", &save); w; w = strtok_r(NULL, ",", &save)) {
            int known = 0;
            for (int i = 0; i < NMODES; i++)
                known |= !strcmp(w, MODES[i]);
            T_ASSERT(known, "unknown --mode %s (recv, wait, test, iprobe, bcast, ring)", w);
        }
    }

    double *a = t_malloc(WORK_DOUBLES * sizeof(double));
    double *side = t_malloc(WORK_DOUBLES * sizeof(double));
    for (int i = 0; i < WORK_DOUBLES; i++)
        a[i] = side[i] = 1.0 + i;
    unsigned char *buf = t_malloc(c.panel);
    double sum = 0;
    for (int i = 0; i < NMODES; i++) {
        if (only && !selected(only, MODES[i]))
            continue;
        pthread_t th;
        long side_before = 0, side_total = 0;
        if (threads) {
            __atomic_store_n(&side_stop, 0, __ATOMIC_RELAXED);
            side_before = __atomic_load_n(&side_passes, __ATOMIC_RELAXED);
            T_ASSERT(pthread_create(&th, NULL, side_worker, side) == 0, "pthread_create");
        }
        double el = run_mode(MODES[i], &c, a, buf, &sum);
        if (threads) {
            __atomic_store_n(&side_stop, 1, __ATOMIC_RELAXED);
            T_ASSERT(pthread_join(th, NULL) == 0, "pthread_join");
            long mine = __atomic_load_n(&side_passes, __ATOMIC_RELAXED) - side_before;
            T_CHECK_MPI(MPI_Allreduce(&mine, &side_total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD));
        }
        t_info("mode=%s turns=%ld work=%ld update=%ld panel=%zu%s elapsed=%.3f s rate=%.2f turns/s"
               " side_rate=%.0f passes/s",
               MODES[i], c.turns, c.work, c.update, c.panel, threads ? " threads" : "", el,
               (double)c.turns / el, threads ? (double)side_total / el : 0.0);
    }
    /* Keep the work observable so the compiler cannot drop it. */
    T_ASSERT(sum == sum && side_result == side_result, "work produced NaN");
    free(a);
    free(side);
    free(buf);
    return t_pass();
}
