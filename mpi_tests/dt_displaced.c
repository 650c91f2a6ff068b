/*
 * dt_displaced: point-to-point with datatypes whose memory layout is contiguous but does
 * not start at the buffer pointer (non-zero true lower bound). A transport that takes the
 * "contiguous" fast path must add the displacement; one that uses the buffer pointer as
 * is sends the wrong bytes (or dereferences MPI_BOTTOM, i.e. NULL).
 *
 * Types: hindexed with one block at +16 bytes; subarray selecting whole middle rows of a
 * 2-D array (contiguous slab at an offset); struct of two adjacent blocks at absolute
 * addresses used with MPI_BOTTOM; contiguous of a resized type with lb > 0. Each is sent
 * to the ring neighbour and received into the same kind of type and into a plain buffer,
 * with Send/Irecv, Isend/Recv, Sendrecv and persistent Send_init/Recv_init, at several sizes (up to 4 MiB, rendezvous).
 * Every byte, including the bytes around the data, is checked (dt_common.h oracle).
 *
 * Kept apart from datatypes because Open MPI 4.1.4's C MTL sends from the buffer pointer
 * for such types (see README.md).
 */
#include "dt_common.h"

static MPI_Comm comm;

typedef struct {
    char name[96];
    MPI_Datatype type; /* committed; freed by caller */
    int count;
    int bottom;        /* memory is a separate allocation addressed absolutely */
    uint8_t *mem;      /* for bottom types */
    size_t memlen;
} dtype;

/* n: payload elements of MPI_INT */
static void make(int which, int n, dtype *d)
{
    memset(d, 0, sizeof(*d));
    d->count = 1;
    switch (which) {
    case 0: {
        int bl = n;
        MPI_Aint disp = 16;
        snprintf(d->name, sizeof(d->name), "hindexed 1 block at +16 (%d ints)", n);
        T_CHECK_MPI(MPI_Type_create_hindexed(1, &bl, &disp, MPI_INT, &d->type));
        break;
    }
    case 1: {
        /* rows x cols array of ints; select rows [2, 2+n/cols) fully */
        int cols = 16, rows = n / 16 + 4;
        int sizes[2] = { rows, cols }, sub[2] = { n / 16, cols }, start[2] = { 2, 0 };
        snprintf(d->name, sizeof(d->name), "subarray of %d full rows at row 2", n / 16);
        T_CHECK_MPI(MPI_Type_create_subarray(2, sizes, sub, start, MPI_ORDER_C, MPI_INT, &d->type));
        break;
    }
    case 2: {
        int bl[2] = { n / 2, n - n / 2 };
        MPI_Aint disp[2];
        MPI_Datatype ty[2] = { MPI_INT, MPI_INT };
        snprintf(d->name, sizeof(d->name), "MPI_BOTTOM struct of 2 adjacent blocks (%d ints)", n);
        d->bottom = 1;
        d->memlen = sizeof(int) * (size_t)n;
        d->mem = t_malloc(d->memlen);
        memset(d->mem, 0, d->memlen);
        T_CHECK_MPI(MPI_Get_address(d->mem, &disp[0]));
        T_CHECK_MPI(MPI_Get_address(d->mem + sizeof(int) * (size_t)(n / 2), &disp[1]));
        T_CHECK_MPI(MPI_Type_create_struct(2, bl, disp, ty, &d->type));
        break;
    }
    case 3: {
        /* int at +8 in an extent of 4 -> consecutive ints starting 8 bytes in */
        MPI_Datatype t1, t2;
        int bl = 1;
        MPI_Aint disp = 8;
        snprintf(d->name, sizeof(d->name), "%d x (int at +8 resized to extent 4)", n);
        T_CHECK_MPI(MPI_Type_create_hindexed(1, &bl, &disp, MPI_INT, &t1));
        T_CHECK_MPI(MPI_Type_create_resized(t1, 8, 4, &t2));
        T_CHECK_MPI(MPI_Type_contiguous(n, t2, &d->type));
        T_CHECK_MPI(MPI_Type_free(&t1));
        T_CHECK_MPI(MPI_Type_free(&t2));
        break;
    }
    }
    T_CHECK_MPI(MPI_Type_commit(&d->type));
}

static dt_side side_of(const dtype *d)
{
    if (!d->bottom) {
        /* dt_side_plain covers [true_lb, ...); add room before it so that bytes between the
         * buffer pointer and the data are checked too. */
        MPI_Aint tlb, text, lb, ext;
        dt_side s;
        T_CHECK_MPI(MPI_Type_get_true_extent(d->type, &tlb, &text));
        T_CHECK_MPI(MPI_Type_get_extent(d->type, &lb, &ext));
        memset(&s, 0, sizeof(s));
        s.type = d->type;
        s.count = d->count;
        s.nseg = 1;
        s.seglen[0] = (size_t)(tlb + (MPI_Aint)(d->count - 1) * ext + text) + 32;
        s.seg[0] = t_malloc(s.seglen[0]);
        s.buf = s.seg[0];
        s.owns = 1;
        return s;
    }
    dt_side s;
    memset(&s, 0, sizeof(s));
    s.type = d->type;
    s.count = 1;
    s.buf = MPI_BOTTOM;
    s.nseg = 1;
    s.seg[0] = d->mem;
    s.seglen[0] = d->memlen;
    s.owns = 0;
    return s;
}

static void one(int ci, dtype *sd, dtype *rd, int how)
{
    int to = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size, tag = 100 + ci * 4 + how;
    static const char *hows[4] = { "Send/Irecv", "Isend/Recv", "Sendrecv", "Send_init/Recv_init" };
    dt_side s = side_of(sd), r = side_of(rd);
    MPI_Request req;
    MPI_Status st;
    char what[300];
    snprintf(what, sizeof(what), "%s -> %s via %s", sd->name, rd->name, hows[how]);
    t_section("%s", what);
    dt_side_fill(&s, t_seed(80, (uint64_t)t_rank, (uint64_t)ci, (uint64_t)how));
    dt_side_set(&r, DT_GUARD);
    t_status_init(&st);
    if (how == 0) {
        T_CHECK_MPI(MPI_Irecv(r.buf, r.count, r.type, from, tag, comm, &req));
        T_CHECK_MPI(MPI_Send(s.buf, s.count, s.type, to, tag, comm));
        T_CHECK_MPI(MPI_Wait(&req, &st));
    } else if (how == 1) {
        T_CHECK_MPI(MPI_Isend(s.buf, s.count, s.type, to, tag, comm, &req));
        T_CHECK_MPI(MPI_Recv(r.buf, r.count, r.type, from, tag, comm, &st));
        T_CHECK_MPI(MPI_Wait(&req, MPI_STATUS_IGNORE));
    } else if (how == 2) {
        T_CHECK_MPI(MPI_Sendrecv(s.buf, s.count, s.type, to, tag, r.buf, r.count, r.type, from, tag, comm, &st));
    } else {
        /* persistent requests (coll/basic's alltoallw uses them) */
        MPI_Request p[2];
        MPI_Status sts[2];
        T_CHECK_MPI(MPI_Recv_init(r.buf, r.count, r.type, from, tag, comm, &p[0]));
        T_CHECK_MPI(MPI_Send_init(s.buf, s.count, s.type, to, tag, comm, &p[1]));
        t_status_init_n(sts, 2);
        T_CHECK_MPI(MPI_Startall(2, p));
        T_CHECK_MPI(MPI_Waitall(2, p, sts));
        st = sts[0];
        T_CHECK_MPI(MPI_Request_free(&p[0]));
        T_CHECK_MPI(MPI_Request_free(&p[1]));
    }
    t_check_status(&st, from, tag, r.type, r.count, what);
    dt_side_check(&r, t_seed(80, (uint64_t)from, (uint64_t)ci, (uint64_t)how), what);
    dt_side_free(&s);
    dt_side_free(&r);
}

int main(int argc, char **argv)
{
    int ns[] = { 16, 1024, 16384, 1 << 20 }, nn = t_quick ? 3 : 4, ci = 0;
    t_init(&argc, &argv, "dt_displaced");
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    for (int k = 0; k < nn; k++) {
        dtype d[4], plain;
        memset(&plain, 0, sizeof(plain));
        plain.type = MPI_INT;
        plain.count = ns[k];
        snprintf(plain.name, sizeof(plain.name), "%d contiguous ints", ns[k]);
        for (int w = 0; w < 4; w++)
            make(w, ns[k], &d[w]);
        for (int w = 0; w < 4; w++)
            for (int how = 0; how < 4; how++) {
                one(ci++, &d[w], &plain, how);  /* displaced send, plain receive */
                one(ci++, &plain, &d[w], how);  /* plain send, displaced receive */
                one(ci++, &d[w], &d[(w + 1) % 4], how);
            }
        for (int w = 0; w < 4; w++) {
            T_CHECK_MPI(MPI_Type_free(&d[w].type));
            free(d[w].mem);
        }
    }
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
