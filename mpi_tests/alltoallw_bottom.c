/*
 * alltoallw_bottom: MPI_Alltoallw / MPI_Ialltoallw with MPI_BOTTOM buffers and struct
 * types built from absolute addresses (MPI_Get_address) of separate allocations, one
 * send and one receive type per peer (including self), with differently shaped send and
 * receive layouts of equal signature and per-pair sizes (some pairs empty). Also the
 * same with ordinary buffers and byte displacements. Every byte and gap is checked with
 * the oracle of dt_common.h.
 *
 * Kept apart from datatypes because Open MPI 4.1.4's C MTL segfaults on MPI_Alltoallw
 * with MPI_BOTTOM (see README.md).
 *
 * Options: --reps N (default 3).
 */
#include "dt_common.h"

static int n_doubles(int from, int to)
{
    return (from + 2 * to) % 5 == 4 ? 0 : 10 + (from * 7 + to * 3) % 50;
}

static int n_ints(int from, int to)
{
    return (from + 2 * to) % 5 == 4 ? 0 : 5 + (from + 2 * to) % 20;
}

/* shape 0: doubles in one allocation, ints strided (every other int) in another.
 * shape 1: doubles split over two allocations, ints contiguous in a third.
 * shape 2: one allocation, doubles immediately followed by the ints: a contiguous
 *          layout whose lower bound is an absolute address (the data does not start at
 *          the buffer pointer, which is MPI_BOTTOM). */
static dt_side make_side(int nd, int ni, int shape)
{
    dt_side s;
    MPI_Datatype ty[3], ivec = MPI_DATATYPE_NULL;
    MPI_Aint disp[3];
    int bl[3], n = 0;
    memset(&s, 0, sizeof(s));
    s.owns = 1;
    s.buf = MPI_BOTTOM;
    s.count = 1;
    if (shape == 0) {
        s.seglen[0] = sizeof(double) * (size_t)nd;
        s.seglen[1] = sizeof(int) * (size_t)ni * 2;
        s.nseg = 2;
    } else if (shape == 2) {
        s.seglen[0] = sizeof(double) * (size_t)nd + sizeof(int) * (size_t)ni;
        s.nseg = 1;
    } else {
        s.seglen[0] = sizeof(double) * (size_t)(nd / 2);
        s.seglen[1] = sizeof(double) * (size_t)(nd - nd / 2);
        s.seglen[2] = sizeof(int) * (size_t)ni;
        s.nseg = 3;
    }
    for (int k = 0; k < s.nseg; k++) {
        s.seg[k] = t_malloc(s.seglen[k] + 8);
        memset(s.seg[k], 0, s.seglen[k] + 8);
    }
    if (shape == 0) {
        T_CHECK_MPI(MPI_Type_vector(ni, 1, 2, MPI_INT, &ivec));
        bl[n] = nd; ty[n] = MPI_DOUBLE; T_CHECK_MPI(MPI_Get_address(s.seg[0], &disp[n])); n++;
        bl[n] = 1; ty[n] = ivec; T_CHECK_MPI(MPI_Get_address(s.seg[1], &disp[n])); n++;
    } else if (shape == 2) {
        bl[n] = nd; ty[n] = MPI_DOUBLE; T_CHECK_MPI(MPI_Get_address(s.seg[0], &disp[n])); n++;
        bl[n] = ni; ty[n] = MPI_INT; T_CHECK_MPI(MPI_Get_address(s.seg[0] + sizeof(double) * (size_t)nd, &disp[n])); n++;
    } else {
        bl[n] = nd / 2; ty[n] = MPI_DOUBLE; T_CHECK_MPI(MPI_Get_address(s.seg[0], &disp[n])); n++;
        bl[n] = nd - nd / 2; ty[n] = MPI_DOUBLE; T_CHECK_MPI(MPI_Get_address(s.seg[1], &disp[n])); n++;
        bl[n] = ni; ty[n] = MPI_INT; T_CHECK_MPI(MPI_Get_address(s.seg[2], &disp[n])); n++;
    }
    T_CHECK_MPI(MPI_Type_create_struct(n, bl, disp, ty, &s.type));
    T_CHECK_MPI(MPI_Type_commit(&s.type));
    if (ivec != MPI_DATATYPE_NULL)
        T_CHECK_MPI(MPI_Type_free(&ivec));
    return s;
}

static void run(int rep, int nonblocking)
{
    int np = t_size;
    dt_side *ss = t_malloc(sizeof(dt_side) * (size_t)np), *rs = t_malloc(sizeof(dt_side) * (size_t)np);
    int *sc = t_malloc(sizeof(int) * (size_t)np), *rc = t_malloc(sizeof(int) * (size_t)np);
    int *sd = t_malloc(sizeof(int) * (size_t)np), *rd = t_malloc(sizeof(int) * (size_t)np);
    MPI_Datatype *st = t_malloc(sizeof(MPI_Datatype) * (size_t)np), *rt = t_malloc(sizeof(MPI_Datatype) * (size_t)np);
    char w[200];

    t_section("%s with MPI_BOTTOM and absolute struct types, rep %d", nonblocking ? "MPI_Ialltoallw" : "MPI_Alltoallw",
              rep);
    for (int j = 0; j < np; j++) {
        ss[j] = make_side(n_doubles(t_rank, j), n_ints(t_rank, j), (rep + j) % 3);
        rs[j] = make_side(n_doubles(j, t_rank), n_ints(j, t_rank), (rep + j + 1) % 3);
        dt_side_fill(&ss[j], t_seed(70, (uint64_t)t_rank, (uint64_t)j, (uint64_t)(rep * 2 + nonblocking)));
        dt_side_set(&rs[j], DT_GUARD);
        sc[j] = rc[j] = 1;
        sd[j] = rd[j] = 0;
        st[j] = ss[j].type;
        rt[j] = rs[j].type;
    }
    if (nonblocking) {
        MPI_Request req;
        T_CHECK_MPI(MPI_Ialltoallw(MPI_BOTTOM, sc, sd, st, MPI_BOTTOM, rc, rd, rt, MPI_COMM_WORLD, &req));
        T_CHECK_MPI(MPI_Wait(&req, MPI_STATUS_IGNORE));
    } else {
        T_CHECK_MPI(MPI_Alltoallw(MPI_BOTTOM, sc, sd, st, MPI_BOTTOM, rc, rd, rt, MPI_COMM_WORLD));
    }
    for (int j = 0; j < np; j++) {
        snprintf(w, sizeof(w), "block from rank %d (%d doubles, %d ints)", j, n_doubles(j, t_rank),
                 n_ints(j, t_rank));
        dt_side_check(&rs[j], t_seed(70, (uint64_t)j, (uint64_t)t_rank, (uint64_t)(rep * 2 + nonblocking)), w);
        T_CHECK_MPI(MPI_Type_free(&ss[j].type));
        T_CHECK_MPI(MPI_Type_free(&rs[j].type));
        dt_side_free(&ss[j]);
        dt_side_free(&rs[j]);
    }
    free(ss); free(rs); free(sc); free(rc); free(sd); free(rd); free(st); free(rt);
}

/* Ordinary buffers: per-peer struct type (double + ints, relative), byte displacements. */
static void run_plain(void)
{
    int np = t_size;
    int *sc = t_malloc(sizeof(int) * (size_t)np), *rc = t_malloc(sizeof(int) * (size_t)np);
    int *sd = t_malloc(sizeof(int) * (size_t)np), *rd = t_malloc(sizeof(int) * (size_t)np);
    MPI_Datatype *st = t_malloc(sizeof(MPI_Datatype) * (size_t)np), *rt = t_malloc(sizeof(MPI_Datatype) * (size_t)np);
    MPI_Datatype pair;
    size_t sbytes = 0, rbytes = 0;
    uint8_t *sbuf, *rbuf;
    t_section("MPI_Alltoallw with ordinary buffers and struct types");
    {
        /* element: one double at 0, two ints at 12 and 20, extent 32 */
        int bl[2] = { 1, 1 };
        MPI_Aint dp[2] = { 0, 12 };
        MPI_Datatype iv, ty[2], t0;
        T_CHECK_MPI(MPI_Type_vector(2, 1, 2, MPI_INT, &iv));
        ty[0] = MPI_DOUBLE;
        ty[1] = iv;
        T_CHECK_MPI(MPI_Type_create_struct(2, bl, dp, ty, &t0));
        T_CHECK_MPI(MPI_Type_create_resized(t0, 0, 32, &pair));
        T_CHECK_MPI(MPI_Type_commit(&pair));
        T_CHECK_MPI(MPI_Type_free(&t0));
        T_CHECK_MPI(MPI_Type_free(&iv));
    }
    for (int j = 0; j < np; j++) {
        sc[j] = n_ints(t_rank, j);
        rc[j] = n_ints(j, t_rank);
        sd[j] = (int)sbytes;
        rd[j] = (int)rbytes + 8; /* unaligned-to-block gaps between peers */
        sbytes += (size_t)sc[j] * 32;
        rbytes += (size_t)rc[j] * 32 + 8;
        st[j] = rt[j] = pair;
    }
    sbuf = t_malloc(sbytes + 1);
    rbuf = t_malloc(rbytes + 1);
    for (int j = 0; j < np; j++) {
        dt_side s;
        memset(&s, 0, sizeof(s));
        s.type = pair; s.count = sc[j]; s.buf = sbuf + sd[j]; s.nseg = 1;
        s.seg[0] = sbuf + sd[j]; s.seglen[0] = (size_t)sc[j] * 32;
        dt_side_fill(&s, t_seed(71, (uint64_t)t_rank, (uint64_t)j, 0));
    }
    memset(rbuf, DT_GUARD, rbytes + 1);
    T_CHECK_MPI(MPI_Alltoallw(sbuf, sc, sd, st, rbuf, rc, rd, rt, MPI_COMM_WORLD));
    for (int j = 0; j < np; j++) {
        dt_side r;
        char w[100];
        memset(&r, 0, sizeof(r));
        r.type = pair; r.count = rc[j]; r.buf = rbuf + rd[j]; r.nseg = 1;
        r.seg[0] = rbuf + rd[j] - 8; r.seglen[0] = (size_t)rc[j] * 32 + 8;
        snprintf(w, sizeof(w), "block from rank %d", j);
        dt_side_check(&r, t_seed(71, (uint64_t)j, (uint64_t)t_rank, 0), w);
    }
    T_CHECK_MPI(MPI_Type_free(&pair));
    free(sbuf); free(rbuf); free(sc); free(rc); free(sd); free(rd); free(st); free(rt);
}

int main(int argc, char **argv)
{
    int reps;
    t_init(&argc, &argv, "alltoallw_bottom");
    reps = (int)t_opt_long("reps", NULL, 3);
    run_plain();
    for (int rep = 0; rep < reps; rep++) {
        run(rep, 0);
        run(rep, 1);
    }
    return t_pass();
}
