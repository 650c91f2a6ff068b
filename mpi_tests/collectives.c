/*
 * collectives: every result of the common collectives checked element by element.
 *
 * For element counts 1, 7, 1000, 65539 and (not with --quick) 1M ints: barrier; bcast
 * from every root; reduce to every root (SUM, MAX, MIN, PROD, BXOR on int, SUM on long
 * and double, MPI_IN_PLACE at the root); allreduce (also MPI_IN_PLACE); alltoall (also
 * MPI_IN_PLACE); alltoallv with per-pair counts and gaps; alltoallw with per-pair types;
 * gather/gatherv/scatter/scatterv to/from every root (MPI_IN_PLACE at the root);
 * allgather/allgatherv (also MPI_IN_PLACE); scan/exscan (scan also MPI_IN_PLACE);
 * reduce_scatter_block and reduce_scatter (also MPI_IN_PLACE); and the non-blocking
 * forms Ibarrier, Ibcast, Ireduce, Iallreduce, Ialltoall, Igather, Iscatter, Iallgather,
 * Iscan. Guard elements behind every receive buffer must stay untouched.
 *
 * Options: --counts LIST (overrides the list), --quick.
 */
#include "common.h"

#define GUARD 16
#define GV (-0x5a5a5a5)

static MPI_Comm comm;
static int np, me;

/* value of element k contributed by rank r (distinct per rank and index) */
static int v(int r, long k)
{
    return (r + 1) * 1000003 + (int)(k % 1000000) * 7;
}

/* small values for PROD */
static int pv(int r, long k)
{
    return 1 + (int)((r + k) % 3);
}

static int *ialloc(size_t n)
{
    int *p = t_malloc(sizeof(int) * (n + GUARD));
    for (size_t i = 0; i < n + GUARD; i++)
        p[i] = GV;
    return p;
}

static void check_guard(const int *p, size_t n, const char *what)
{
    for (int g = 0; g < GUARD; g++)
        if (p[n + (size_t)g] != GV)
            t_fail("%s: guard element %d behind %zu elements overwritten (0x%x)", what, g, n, (unsigned)p[n + (size_t)g]);
}

static void check_int(const int *p, size_t i, int exp, const char *what)
{
    if (p[i] != exp)
        t_fail("%s: element %zu: expected %d got %d", what, i, exp, p[i]);
}

static void do_bcast(long n, int nonblocking)
{
    for (int root = 0; root < np; root++) {
        int *b = ialloc((size_t)n);
        t_section("%s count=%ld root=%d", nonblocking ? "Ibcast" : "Bcast", n, root);
        if (me == root)
            for (long k = 0; k < n; k++)
                b[k] = v(root, k);
        if (nonblocking) {
            MPI_Request r;
            T_CHECK_MPI(MPI_Ibcast(b, (int)n, MPI_INT, root, comm, &r));
            T_CHECK_MPI(MPI_Wait(&r, MPI_STATUS_IGNORE));
        } else {
            T_CHECK_MPI(MPI_Bcast(b, (int)n, MPI_INT, root, comm));
        }
        for (long k = 0; k < n; k++)
            check_int(b, (size_t)k, v(root, k), "bcast");
        check_guard(b, (size_t)n, "bcast");
        free(b);
    }
}

static int op_apply(MPI_Op op, int a, int b)
{
    if (op == MPI_SUM) return a + b;
    if (op == MPI_MAX) return a > b ? a : b;
    if (op == MPI_MIN) return a < b ? a : b;
    if (op == MPI_PROD) return a * b;
    return a ^ b; /* MPI_BXOR */
}

static int expect_reduce(MPI_Op op, long k, int upto /* ranks 0..upto-1 */)
{
    int acc = op == MPI_PROD ? pv(0, k) : v(0, k);
    for (int r = 1; r < upto; r++)
        acc = op_apply(op, acc, op == MPI_PROD ? pv(r, k) : v(r, k));
    return acc;
}

static void do_reduce(long n, int all, int inplace, int nonblocking)
{
    MPI_Op ops[5] = { MPI_SUM, MPI_MAX, MPI_MIN, MPI_PROD, MPI_BXOR };
    const char *names[5] = { "SUM", "MAX", "MIN", "PROD", "BXOR" };
    for (int o = 0; o < 5; o++)
        for (int root = 0; root < (all ? 1 : np); root++) {
            int *s = ialloc((size_t)n), *r = ialloc((size_t)n);
            int at_root = all || me == root;
            t_section("%s%s%s %s count=%ld root=%d", nonblocking ? "I" : "", all ? "Allreduce" : "Reduce",
                      inplace ? " IN_PLACE" : "", names[o], n, all ? -1 : root);
            for (long k = 0; k < n; k++) {
                s[k] = ops[o] == MPI_PROD ? pv(me, k) : v(me, k);
                if (inplace && at_root)
                    r[k] = s[k];
            }
            const void *sb = (inplace && at_root) ? MPI_IN_PLACE : s;
            MPI_Request q;
            if (all) {
                if (nonblocking)
                    T_CHECK_MPI(MPI_Iallreduce(sb, r, (int)n, MPI_INT, ops[o], comm, &q));
                else
                    T_CHECK_MPI(MPI_Allreduce(sb, r, (int)n, MPI_INT, ops[o], comm));
            } else {
                if (nonblocking)
                    T_CHECK_MPI(MPI_Ireduce(sb, r, (int)n, MPI_INT, ops[o], root, comm, &q));
                else
                    T_CHECK_MPI(MPI_Reduce(sb, r, (int)n, MPI_INT, ops[o], root, comm));
            }
            if (nonblocking)
                T_CHECK_MPI(MPI_Wait(&q, MPI_STATUS_IGNORE));
            if (at_root) {
                for (long k = 0; k < n; k++)
                    check_int(r, (size_t)k, expect_reduce(ops[o], k, np), names[o]);
                check_guard(r, (size_t)n, names[o]);
            } else {
                for (long k = 0; k < n + GUARD; k++)
                    check_int(r, (size_t)k, GV, "receive buffer of a non-root (must be untouched)");
            }
            /* the send buffer is input only */
            for (long k = 0; k < n; k++)
                check_int(s, (size_t)k, ops[o] == MPI_PROD ? pv(me, k) : v(me, k), "send buffer after reduction");
            free(s);
            free(r);
        }
}

static void do_reduce_types(long n)
{
    long *ls = t_malloc(sizeof(long) * (size_t)n), *lr = t_malloc(sizeof(long) * (size_t)n);
    double *ds = t_malloc(sizeof(double) * (size_t)n), *dr = t_malloc(sizeof(double) * (size_t)n);
    t_section("Allreduce SUM long and double count=%ld", n);
    for (long k = 0; k < n; k++) {
        ls[k] = (long)v(me, k) * 1000000007L;
        ds[k] = (double)v(me, k);
    }
    T_CHECK_MPI(MPI_Allreduce(ls, lr, (int)n, MPI_LONG, MPI_SUM, comm));
    T_CHECK_MPI(MPI_Allreduce(ds, dr, (int)n, MPI_DOUBLE, MPI_SUM, comm));
    for (long k = 0; k < n; k++) {
        long el = 0;
        double ed = 0;
        for (int r = 0; r < np; r++) {
            el += (long)v(r, k) * 1000000007L;
            ed += (double)v(r, k);
        }
        if (lr[k] != el)
            t_fail("long SUM element %ld: expected %ld got %ld", k, el, lr[k]);
        if (dr[k] != ed)
            t_fail("double SUM element %ld: expected %.1f got %.1f", k, ed, dr[k]);
    }
    free(ls); free(lr); free(ds); free(dr);
}

/* element k of the block that rank `from` sends to rank `to` */
static int a2a(int from, int to, long k)
{
    return from * 100000000 + to * 1000000 + (int)(k % 1000000);
}

static void do_alltoall(long n, int inplace, int nonblocking)
{
    size_t tot = (size_t)n * (size_t)np;
    int *s = ialloc(tot), *r = ialloc(tot);
    t_section("%sAlltoall%s count=%ld", nonblocking ? "I" : "", inplace ? " IN_PLACE" : "", n);
    for (int j = 0; j < np; j++)
        for (long k = 0; k < n; k++)
            (inplace ? r : s)[(size_t)j * (size_t)n + (size_t)k] = a2a(me, j, k);
    if (nonblocking) {
        MPI_Request q;
        T_CHECK_MPI(MPI_Ialltoall(s, (int)n, MPI_INT, r, (int)n, MPI_INT, comm, &q));
        T_CHECK_MPI(MPI_Wait(&q, MPI_STATUS_IGNORE));
    } else {
        T_CHECK_MPI(MPI_Alltoall(inplace ? MPI_IN_PLACE : s, (int)n, MPI_INT, r, (int)n, MPI_INT, comm));
    }
    for (int j = 0; j < np; j++)
        for (long k = 0; k < n; k++)
            check_int(r, (size_t)j * (size_t)n + (size_t)k, a2a(j, me, k), "alltoall");
    check_guard(r, tot, "alltoall");
    free(s);
    free(r);
}

static int vcount(int from, int to, long n)
{
    return (int)((n + from * 3 + to * 5) % (n + 7)); /* varies, sometimes 0 */
}

static void do_alltoallv(long n)
{
    int *sc = t_malloc(sizeof(int) * (size_t)np), *rc = t_malloc(sizeof(int) * (size_t)np);
    int *sd = t_malloc(sizeof(int) * (size_t)np), *rd = t_malloc(sizeof(int) * (size_t)np);
    size_t st = 0, rt = 0;
    t_section("Alltoallv count~%ld", n);
    for (int j = 0; j < np; j++) {
        sc[j] = vcount(me, j, n);
        rc[j] = vcount(j, me, n);
        sd[j] = (int)st;
        rd[j] = (int)rt + 3; /* gap of 3 before each block */
        st += (size_t)sc[j];
        rt += (size_t)rc[j] + 3;
    }
    int *s = ialloc(st), *r = ialloc(rt);
    for (int j = 0; j < np; j++)
        for (int k = 0; k < sc[j]; k++)
            s[sd[j] + k] = a2a(me, j, k);
    T_CHECK_MPI(MPI_Alltoallv(s, sc, sd, MPI_INT, r, rc, rd, MPI_INT, comm));
    for (int j = 0; j < np; j++) {
        for (int k = 0; k < rc[j]; k++)
            check_int(r, (size_t)(rd[j] + k), a2a(j, me, k), "alltoallv");
        for (int g = 1; g <= 3; g++)
            check_int(r, (size_t)(rd[j] - g), GV, "alltoallv gap");
    }
    check_guard(r, rt, "alltoallv");
    free(s); free(r); free(sc); free(rc); free(sd); free(rd);
}

/* per-pair types: even pairs plain ints, odd pairs every-other-int vectors */
static void do_alltoallw(long n)
{
    int *sc = t_malloc(sizeof(int) * (size_t)np), *rc = t_malloc(sizeof(int) * (size_t)np);
    int *sd = t_malloc(sizeof(int) * (size_t)np), *rd = t_malloc(sizeof(int) * (size_t)np);
    MPI_Datatype *sty = t_malloc(sizeof(MPI_Datatype) * (size_t)np), *rty = t_malloc(sizeof(MPI_Datatype) * (size_t)np);
    MPI_Datatype strided, tmp;
    size_t slen = (size_t)np * (size_t)n * 2, rlen = slen;
    int *s = ialloc(slen), *r = ialloc(rlen);
    t_section("Alltoallw count=%ld", n);
    T_CHECK_MPI(MPI_Type_vector(1, 1, 2, MPI_INT, &tmp));
    T_CHECK_MPI(MPI_Type_create_resized(tmp, 0, 2 * sizeof(int), &strided));
    T_CHECK_MPI(MPI_Type_commit(&strided));
    T_CHECK_MPI(MPI_Type_free(&tmp));
    for (int j = 0; j < np; j++) {
        sc[j] = rc[j] = (int)n;
        sd[j] = rd[j] = (int)((size_t)j * (size_t)n * 2 * sizeof(int));
        sty[j] = ((me + j) & 1) ? strided : MPI_INT;
        rty[j] = ((me + j + (me == j)) & 1) ? strided : MPI_INT; /* receiver may use the other shape */
        for (long k = 0; k < n; k++)
            s[(size_t)j * (size_t)n * 2 + (size_t)k * (sty[j] == strided ? 2 : 1)] = a2a(me, j, k);
    }
    T_CHECK_MPI(MPI_Alltoallw(s, sc, sd, sty, r, rc, rd, rty, comm));
    for (int j = 0; j < np; j++) {
        int step = rty[j] == strided ? 2 : 1;
        for (long k = 0; k < n; k++)
            check_int(r, (size_t)j * (size_t)n * 2 + (size_t)k * (size_t)step, a2a(j, me, k), "alltoallw");
        if (step == 2)
            for (long k = 0; k < n; k++)
                check_int(r, (size_t)j * (size_t)n * 2 + (size_t)k * 2 + 1, GV, "alltoallw hole in strided receive");
    }
    check_guard(r, rlen, "alltoallw");
    T_CHECK_MPI(MPI_Type_free(&strided));
    free(s); free(r); free(sc); free(rc); free(sd); free(rd); free(sty); free(rty);
}

static void do_gather_scatter(long n, int inplace, int nonblocking)
{
    size_t tot = (size_t)n * (size_t)np;
    for (int root = 0; root < np; root++) {
        int *s = ialloc((size_t)n), *r = ialloc(tot);
        int ip = inplace && me == root;
        MPI_Request q;
        t_section("%sGather%s count=%ld root=%d", nonblocking ? "I" : "", inplace ? " IN_PLACE" : "", n, root);
        for (long k = 0; k < n; k++) {
            s[k] = v(me, k);
            if (ip)
                r[(size_t)me * (size_t)n + (size_t)k] = v(me, k);
        }
        if (nonblocking) {
            T_CHECK_MPI(MPI_Igather(s, (int)n, MPI_INT, r, (int)n, MPI_INT, root, comm, &q));
            T_CHECK_MPI(MPI_Wait(&q, MPI_STATUS_IGNORE));
        } else {
            T_CHECK_MPI(MPI_Gather(ip ? MPI_IN_PLACE : s, (int)n, MPI_INT, r, (int)n, MPI_INT, root, comm));
        }
        if (me == root) {
            for (int j = 0; j < np; j++)
                for (long k = 0; k < n; k++)
                    check_int(r, (size_t)j * (size_t)n + (size_t)k, v(j, k), "gather");
            check_guard(r, tot, "gather");
        }
        /* scatter back a different pattern */
        t_section("%sScatter%s count=%ld root=%d", nonblocking ? "I" : "", inplace ? " IN_PLACE" : "", n, root);
        if (me == root)
            for (int j = 0; j < np; j++)
                for (long k = 0; k < n; k++)
                    r[(size_t)j * (size_t)n + (size_t)k] = a2a(root, j, k);
        for (long k = 0; k < n + GUARD; k++)
            s[k] = GV;
        if (nonblocking) {
            T_CHECK_MPI(MPI_Iscatter(r, (int)n, MPI_INT, s, (int)n, MPI_INT, root, comm, &q));
            T_CHECK_MPI(MPI_Wait(&q, MPI_STATUS_IGNORE));
        } else {
            T_CHECK_MPI(MPI_Scatter(r, (int)n, MPI_INT, ip ? MPI_IN_PLACE : s, (int)n, MPI_INT, root, comm));
        }
        if (!ip) {
            for (long k = 0; k < n; k++)
                check_int(s, (size_t)k, a2a(root, me, k), "scatter");
            check_guard(s, (size_t)n, "scatter");
        } else {
            for (long k = 0; k < n; k++) /* IN_PLACE at root: its block stays in place */
                check_int(r, (size_t)me * (size_t)n + (size_t)k, a2a(root, me, k), "scatter IN_PLACE root block");
        }
        free(s);
        free(r);
    }
}

static void do_gatherv_scatterv(long n)
{
    for (int root = 0; root < np; root++) {
        int *rc = t_malloc(sizeof(int) * (size_t)np), *dp = t_malloc(sizeof(int) * (size_t)np);
        size_t tot = 0;
        for (int j = 0; j < np; j++) {
            rc[j] = vcount(j, root, n);
            dp[j] = (int)tot + 2;
            tot += (size_t)rc[j] + 2;
        }
        int *s = ialloc((size_t)rc[me]), *r = ialloc(tot);
        t_section("Gatherv count~%ld root=%d", n, root);
        for (int k = 0; k < rc[me]; k++)
            s[k] = a2a(me, root, k);
        T_CHECK_MPI(MPI_Gatherv(s, rc[me], MPI_INT, r, rc, dp, MPI_INT, root, comm));
        if (me == root) {
            for (int j = 0; j < np; j++) {
                for (int k = 0; k < rc[j]; k++)
                    check_int(r, (size_t)(dp[j] + k), a2a(j, root, k), "gatherv");
                check_int(r, (size_t)(dp[j] - 1), GV, "gatherv gap");
            }
            check_guard(r, tot, "gatherv");
        }
        t_section("Scatterv count~%ld root=%d", n, root);
        for (int k = 0; k < rc[me] + GUARD; k++)
            s[k] = GV;
        if (me == root)
            for (int j = 0; j < np; j++)
                for (int k = 0; k < rc[j]; k++)
                    r[dp[j] + k] = a2a(root, j, k) + 1;
        T_CHECK_MPI(MPI_Scatterv(r, rc, dp, MPI_INT, s, rc[me], MPI_INT, root, comm));
        for (int k = 0; k < rc[me]; k++)
            check_int(s, (size_t)k, a2a(root, me, k) + 1, "scatterv");
        check_guard(s, (size_t)rc[me], "scatterv");
        free(s); free(r); free(rc); free(dp);
    }
}

static void do_allgather(long n, int inplace, int nonblocking)
{
    size_t tot = (size_t)n * (size_t)np;
    int *s = ialloc((size_t)n), *r = ialloc(tot);
    t_section("%sAllgather%s count=%ld", nonblocking ? "I" : "", inplace ? " IN_PLACE" : "", n);
    for (long k = 0; k < n; k++) {
        s[k] = v(me, k);
        if (inplace)
            r[(size_t)me * (size_t)n + (size_t)k] = v(me, k);
    }
    if (nonblocking) {
        MPI_Request q;
        T_CHECK_MPI(MPI_Iallgather(s, (int)n, MPI_INT, r, (int)n, MPI_INT, comm, &q));
        T_CHECK_MPI(MPI_Wait(&q, MPI_STATUS_IGNORE));
    } else {
        T_CHECK_MPI(MPI_Allgather(inplace ? MPI_IN_PLACE : s, (int)n, MPI_INT, r, (int)n, MPI_INT, comm));
    }
    for (int j = 0; j < np; j++)
        for (long k = 0; k < n; k++)
            check_int(r, (size_t)j * (size_t)n + (size_t)k, v(j, k), "allgather");
    check_guard(r, tot, "allgather");
    free(s);
    free(r);

    /* allgatherv with per-rank counts */
    int *rc = t_malloc(sizeof(int) * (size_t)np), *dp = t_malloc(sizeof(int) * (size_t)np);
    tot = 0;
    for (int j = 0; j < np; j++) {
        rc[j] = vcount(j, 0, n);
        dp[j] = (int)tot;
        tot += (size_t)rc[j];
    }
    s = ialloc((size_t)rc[me]);
    r = ialloc(tot);
    t_section("Allgatherv%s count~%ld", inplace ? " IN_PLACE" : "", n);
    for (int k = 0; k < rc[me]; k++) {
        s[k] = a2a(me, 0, k);
        if (inplace)
            r[dp[me] + k] = s[k];
    }
    T_CHECK_MPI(MPI_Allgatherv(inplace ? MPI_IN_PLACE : s, rc[me], MPI_INT, r, rc, dp, MPI_INT, comm));
    for (int j = 0; j < np; j++)
        for (int k = 0; k < rc[j]; k++)
            check_int(r, (size_t)(dp[j] + k), a2a(j, 0, k), "allgatherv");
    check_guard(r, tot, "allgatherv");
    free(s); free(r); free(rc); free(dp);
}

static void do_scan(long n, int inplace, int nonblocking)
{
    int *s = ialloc((size_t)n), *r = ialloc((size_t)n);
    t_section("%sScan%s count=%ld", nonblocking ? "I" : "", inplace ? " IN_PLACE" : "", n);
    for (long k = 0; k < n; k++) {
        s[k] = v(me, k);
        if (inplace)
            r[k] = s[k];
    }
    if (nonblocking) {
        MPI_Request q;
        T_CHECK_MPI(MPI_Iscan(s, r, (int)n, MPI_INT, MPI_SUM, comm, &q));
        T_CHECK_MPI(MPI_Wait(&q, MPI_STATUS_IGNORE));
    } else {
        T_CHECK_MPI(MPI_Scan(inplace ? MPI_IN_PLACE : s, r, (int)n, MPI_INT, MPI_SUM, comm));
    }
    for (long k = 0; k < n; k++)
        check_int(r, (size_t)k, expect_reduce(MPI_SUM, k, me + 1), "scan");
    check_guard(r, (size_t)n, "scan");
    if (!inplace && !nonblocking) {
        t_section("Exscan count=%ld", n);
        for (long k = 0; k < n + GUARD; k++)
            r[k] = GV;
        T_CHECK_MPI(MPI_Exscan(s, r, (int)n, MPI_INT, MPI_SUM, comm));
        if (me > 0) /* rank 0's result is undefined */
            for (long k = 0; k < n; k++)
                check_int(r, (size_t)k, expect_reduce(MPI_SUM, k, me), "exscan");
        check_guard(r, (size_t)n, "exscan");
    }
    free(s);
    free(r);
}

static void do_reduce_scatter(long n, int inplace)
{
    size_t tot = (size_t)n * (size_t)np;
    int *s = ialloc(tot), *r = ialloc(tot);
    t_section("Reduce_scatter_block%s count=%ld", inplace ? " IN_PLACE" : "", n);
    for (size_t k = 0; k < tot; k++)
        (inplace ? r : s)[k] = v(me, (long)k);
    T_CHECK_MPI(MPI_Reduce_scatter_block(inplace ? MPI_IN_PLACE : s, r, (int)n, MPI_INT, MPI_SUM, comm));
    for (long k = 0; k < n; k++)
        check_int(r, (size_t)k, expect_reduce(MPI_SUM, (long)me * n + k, np), "reduce_scatter_block");
    if (!inplace)
        check_guard(r, (size_t)n, "reduce_scatter_block");
    free(s);
    free(r);

    int *rc = t_malloc(sizeof(int) * (size_t)np);
    tot = 0;
    for (int j = 0; j < np; j++) {
        rc[j] = vcount(j, 1, n);
        tot += (size_t)rc[j];
    }
    long off = 0;
    for (int j = 0; j < me; j++)
        off += rc[j];
    s = ialloc(tot);
    r = ialloc(tot);
    t_section("Reduce_scatter%s count~%ld", inplace ? " IN_PLACE" : "", n);
    for (size_t k = 0; k < tot; k++)
        (inplace ? r : s)[k] = v(me, (long)k);
    T_CHECK_MPI(MPI_Reduce_scatter(inplace ? MPI_IN_PLACE : s, r, rc, MPI_INT, MPI_SUM, comm));
    for (int k = 0; k < rc[me]; k++)
        check_int(r, (size_t)k, expect_reduce(MPI_SUM, off + k, np), "reduce_scatter");
    free(s); free(r); free(rc);
}

int main(int argc, char **argv)
{
    size_t counts[16];
    int nc;
    t_init(&argc, &argv, "collectives");
    np = t_size;
    me = t_rank;
    {
        const char *c = t_opt_str("counts", NULL);
        static char spec[256];
        snprintf(spec, sizeof(spec), "%s", c ? c : (t_quick ? "1,7,1000,65539" : "1,7,1000,65539,1M"));
        /* reuse the size-list parser: "--sizes" semantics, but from our own spec */
        nc = 0;
        for (char *save = NULL, *tok = strtok_r(spec, ",", &save); tok && nc < 16; tok = strtok_r(NULL, ",", &save)) {
            long long x = t_parse_size(tok);
            if (x < 1)
                t_fail("bad count '%s'", tok);
            counts[nc++] = (size_t)x;
        }
    }
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    for (int i = 0; i < nc; i++) {
        long n = (long)counts[i];
        int big = n > 100000;
        t_section("Barrier");
        T_CHECK_MPI(MPI_Barrier(comm));
        {
            MPI_Request q;
            t_section("Ibarrier");
            T_CHECK_MPI(MPI_Ibarrier(comm, &q));
            T_CHECK_MPI(MPI_Wait(&q, MPI_STATUS_IGNORE));
        }
        do_bcast(n, 0);
        do_bcast(n, 1);
        do_reduce(n, 0, 0, 0);
        do_reduce(n, 0, 1, 0);
        do_reduce(n, 1, 0, 0);
        do_reduce(n, 1, 1, 0);
        if (!big) {
            do_reduce(n, 0, 0, 1);
            do_reduce(n, 1, 0, 1);
        }
        do_reduce_types(n);
        do_alltoall(n, 0, 0);
        do_alltoall(n, 1, 0);
        do_alltoall(n, 0, 1);
        do_alltoallv(n);
        do_alltoallw(n);
        do_gather_scatter(n, 0, 0);
        do_gather_scatter(n, 1, 0);
        do_gather_scatter(n, 0, 1);
        do_gatherv_scatterv(n);
        do_allgather(n, 0, 0);
        do_allgather(n, 1, 0);
        do_allgather(n, 0, 1);
        do_scan(n, 0, 0);
        do_scan(n, 1, 0);
        do_scan(n, 0, 1);
        do_reduce_scatter(n, 0);
        do_reduce_scatter(n, 1);
        if (t_verbose)
            t_info("count %ld done", n);
    }
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
