/*
 * comms: communicator churn and communicator count.
 *
 * 1. --cycles N (default 10000, 1000 with --quick) MPI_Comm_dup / MPI_Comm_free cycles,
 *    each with a ring message on the new communicator (size varies, some above inject)
 *    checked, and every 100th cycle an MPI_ANY_SOURCE receive and a split communicator.
 * 2. As many live communicators as possible: MPI_Comm_dup in a loop on a parent with
 *    MPI_ERRORS_RETURN, up to --limit N (default 5000). A failing dup must return an
 *    error (its class is reported), not crash. The ranks agree on the count (the minimum)
 *    and report it. Then every live communicator carries a message: in batches of 512
 *    communicators, the receives are posted first, in reverse order, then the sends, so a
 *    message delivered on the wrong communicator is caught. All are freed.
 *
 * Options: --inject N, --cycles N, --limit N.
 */
#include "common.h"

static void ring_msg(MPI_Comm c, int idx, size_t n, int anysrc)
{
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    uint8_t sb[512], rb[512 + 16];
    MPI_Request rq[2];
    MPI_Status st[2];
    char what[128];
    snprintf(what, sizeof(what), "message on communicator #%d", idx);
    t_fill(sb, n, t_seed(90, (uint64_t)t_rank, (uint64_t)idx, n));
    memset(rb, 0xee, sizeof(rb));
    t_status_init_n(st, 2);
    T_CHECK_MPI(MPI_Irecv(rb, (int)n + 16, MPI_BYTE, anysrc ? MPI_ANY_SOURCE : left, idx % 1000, c, &rq[0]));
    T_CHECK_MPI(MPI_Isend(sb, (int)n, MPI_BYTE, right, idx % 1000, c, &rq[1]));
    T_CHECK_MPI(MPI_Waitall(2, rq, st));
    t_check_status_bytes(&st[0], left, idx % 1000, n, what);
    t_check(rb, n, t_seed(90, (uint64_t)left, (uint64_t)idx, n), what);
    t_check_const(rb + n, 16, 0xee, what);
}

static void churn(int cycles)
{
    size_t inj = t_inject();
    size_t sizes[4] = { 0, 8, inj + 1 > 500 ? 500 : inj + 1, 256 };
    double t0 = t_now();
    for (int i = 0; i < cycles; i++) {
        MPI_Comm c;
        t_section("dup/free cycle %d", i);
        T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &c));
        ring_msg(c, i, sizes[i % 4], i % 100 == 0);
        if (i % 100 == 50) {
            MPI_Comm s;
            int sr, ss;
            T_CHECK_MPI(MPI_Comm_split(c, t_rank % 2, t_size - t_rank, &s));
            T_CHECK_MPI(MPI_Comm_rank(s, &sr));
            T_CHECK_MPI(MPI_Comm_size(s, &ss));
            T_ASSERT(ss == (t_size + 1 - t_rank % 2) / 2, "split size %d", ss);
            T_CHECK_MPI(MPI_Barrier(s));
            T_CHECK_MPI(MPI_Comm_free(&s));
        }
        T_CHECK_MPI(MPI_Comm_free(&c));
        T_ASSERT(c == MPI_COMM_NULL, "Comm_free did not set MPI_COMM_NULL");
    }
    t_info("%d dup/free cycles with a message each: %.2f s", cycles, t_now() - t0);
}

static void many_live(int limit)
{
    MPI_Comm parent, *cs = t_malloc(sizeof(MPI_Comm) * (size_t)limit);
    int n = 0, err_class = -1, rc = MPI_SUCCESS, agreed = 0;
    double t0 = t_now();
    char errtxt[256] = "";

    t_section("create up to %d live communicators", limit);
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &parent));
    T_CHECK_MPI(MPI_Comm_set_errhandler(parent, MPI_ERRORS_RETURN));
    for (n = 0; n < limit; n++) {
        rc = MPI_Comm_dup(parent, &cs[n]);
        if (rc != MPI_SUCCESS) {
            MPI_Error_class(rc, &err_class);
            snprintf(errtxt, sizeof(errtxt), "%s", t_errstr(rc));
            break;
        }
    }
    /* A failing dup must fail on every rank alike (it is collective); agree anyway. */
    T_CHECK_MPI(MPI_Allreduce(&n, &agreed, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    if (agreed != n)
        t_fail("rank %d created %d communicators but another rank only %d", t_rank, n, agreed);
    if (n < limit)
        t_info("communicator #%d could not be created: MPI_Comm_dup returned %s (error class %d) — "
               "reported as an error, no crash; %d live communicators",
               n, errtxt, err_class, n);
    else
        t_info("created all %d live communicators in %.2f s", n, t_now() - t0);

    t_section("a message on each of %d live communicators", n);
    {
        /* In batches of 512 (receives posted first, in reverse order) so that the number of
         * posted receives stays within what any provider queues; many_posted tests that. */
        int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
        enum { B = 512 };
        MPI_Request rq[2 * B];
        MPI_Status st[2 * B];
        uint64_t sb[B], rb[B];
        for (int base = 0; base < n; base += B) {
            int m = n - base < B ? n - base : B;
            for (int k = m - 1; k >= 0; k--) {
                int i = base + k;
                rb[k] = 0;
                T_CHECK_MPI(MPI_Irecv(&rb[k], 1, MPI_UINT64_T, i % 2 ? MPI_ANY_SOURCE : left, 7, cs[i], &rq[k]));
            }
            T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
            for (int k = 0; k < m; k++) {
                sb[k] = t_seed(91, (uint64_t)t_rank, (uint64_t)(base + k), 0);
                T_CHECK_MPI(MPI_Isend(&sb[k], 1, MPI_UINT64_T, right, 7, cs[base + k], &rq[m + k]));
            }
            t_status_init_n(st, 2 * m);
            T_CHECK_MPI(MPI_Waitall(2 * m, rq, st));
            for (int k = 0; k < m; k++) {
                int i = base + k;
                char w[100];
                snprintf(w, sizeof(w), "live communicator #%d", i);
                t_check_status(&st[k], left, 7, MPI_UINT64_T, 1, w);
                if (rb[k] != t_seed(91, (uint64_t)left, (uint64_t)i, 0)) {
                    int from = -1;
                    for (int j = 0; j < n; j++)
                        if (rb[k] == t_seed(91, (uint64_t)left, (uint64_t)j, 0))
                            from = j;
                    t_fail("%s: wrong payload (it is the message sent on communicator #%d)", w, from);
                }
            }
        }
    }
    t_section("free %d live communicators", n);
    for (int i = 0; i < n; i++)
        T_CHECK_MPI(MPI_Comm_free(&cs[i]));
    T_CHECK_MPI(MPI_Comm_free(&parent));
    free(cs);
}

int main(int argc, char **argv)
{
    t_init(&argc, &argv, "comms");
    churn((int)t_opt_long("cycles", NULL, t_quick ? 1000 : 10000));
    many_live((int)t_opt_long("limit", NULL, 5000));
    /* after all that, the world still works */
    ring_msg(MPI_COMM_WORLD, 999999, 64, 1);
    return t_pass();
}
