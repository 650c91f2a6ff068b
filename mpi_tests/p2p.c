/*
 * p2p: blocking and non-blocking point-to-point between all pairs of ranks.
 *
 * For every size in the size list (see common.h: 0, 1, inject-1, inject, inject+1, 64K,
 * 4M, and 64M with --big) and every send mode, each rank r sends to (r+d)%np and receives
 * from (r-d)%np for every shift d = 1..np-1 (all ordered pairs; sizes above 4 MiB use
 * d = 1 only, i.e. a ring, unless --all-pairs-big). Every received byte, the guard bytes
 * behind the receive buffer, and every status field are checked. Odd modes post the
 * receive with 17 more elements than sent so that MPI_Get_count must report the real size.
 *
 * Options: --inject N, --sizes LIST, --big, --all-pairs-big, --reps N (default 1),
 * --modes LIST / --skip-modes LIST with keys send, isend, waitall, testloop, waitany,
 * waitsome, rsend, irsend, bsend, ibsend, ssend, issend, sendrecv, replace, persist.
 */
#include "common.h"

enum mode {
    M_SEND_IRECV,      /* MPI_Send, receiver MPI_Irecv + MPI_Wait */
    M_ISEND_RECV,      /* MPI_Isend + MPI_Wait, receiver blocking MPI_Recv */
    M_WAITALL,         /* MPI_Isend + MPI_Irecv, MPI_Waitall */
    M_TESTLOOP,        /* MPI_Isend + MPI_Irecv, completed by polling MPI_Test */
    M_WAITANY,         /* MPI_Isend + MPI_Irecv, MPI_Waitany twice */
    M_WAITSOME,        /* MPI_Isend + MPI_Irecv, MPI_Waitsome until both done */
    M_RSEND,           /* receiver preposts MPI_Irecv, barrier, MPI_Rsend */
    M_IRSEND,          /* receiver preposts MPI_Irecv, barrier, MPI_Irsend */
    M_BSEND,           /* MPI_Bsend with an attached buffer, blocking MPI_Recv */
    M_IBSEND,          /* MPI_Ibsend, blocking MPI_Recv */
    M_SSEND,           /* MPI_Ssend, receiver MPI_Irecv */
    M_ISSEND,          /* MPI_Issend, blocking MPI_Recv */
    M_SENDRECV,        /* MPI_Sendrecv */
    M_SENDRECV_REPL,   /* MPI_Sendrecv_replace */
    M_PERSIST,         /* MPI_Send_init / MPI_Recv_init, started twice */
    NMODES
};

static const char *mode_name[NMODES] = {
    "Send/Irecv", "Isend/Recv", "Isend+Irecv/Waitall", "Isend+Irecv/Test-loop",
    "Isend+Irecv/Waitany", "Isend+Irecv/Waitsome", "Rsend/preposted", "Irsend/preposted",
    "Bsend/Recv", "Ibsend/Recv", "Ssend/Irecv", "Issend/Recv", "Sendrecv", "Sendrecv_replace",
    "Send_init+Recv_init",
};

/* keys for --modes / --skip-modes */
static const char *mode_key[NMODES] = {
    "send", "isend", "waitall", "testloop", "waitany", "waitsome", "rsend", "irsend",
    "bsend", "ibsend", "ssend", "issend", "sendrecv", "replace", "persist",
};

static int in_list(const char *list, const char *key)
{
    size_t n = strlen(key);
    for (const char *p = list; p && *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && strncmp(p, key, n) == 0)
            return 1;
        if (!e)
            break;
        p = e + 1;
    }
    return 0;
}

static int mode_on(int mode)
{
    const char *only = t_opt_str("modes", NULL), *skip = t_opt_str("skip-modes", NULL);
    return (!only || in_list(only, mode_key[mode])) && !in_list(skip, mode_key[mode]);
}

#define GUARD 64
#define GUARD_BYTE 0xee

static MPI_Comm comm;
static void *bsend_buf;
static int bsend_len;

static void check_recv(const uint8_t *rbuf, size_t size, size_t extra, uint64_t seed, const MPI_Status *st,
                       int src, int tag, const char *what)
{
    char w[512];
    snprintf(w, sizeof(w), "%s status", what);
    t_check_status_bytes(st, src, tag, size, w);
    snprintf(w, sizeof(w), "%s data from rank %d", what, src);
    t_check(rbuf, size, seed, w);
    snprintf(w, sizeof(w), "%s guard bytes behind the %zu-byte message (receive count %zu)", what, size,
             size + extra);
    t_check_const(rbuf + size, extra + GUARD, GUARD_BYTE, w);
}

static void exchange(int mode, size_t size, int sidx, int d, int rep)
{
    int dst = (t_rank + d) % t_size, src = (t_rank - d + t_size) % t_size;
    int tag = 100 + mode * 40 + sidx;
    size_t extra = (mode & 1) ? 17 : 0;
    int rcount = (int)(size + extra);
    uint64_t sseed = t_seed((uint64_t)t_rank, (uint64_t)dst, (uint64_t)mode * 1000 + (uint64_t)rep, size);
    uint64_t rseed = t_seed((uint64_t)src, (uint64_t)t_rank, (uint64_t)mode * 1000 + (uint64_t)rep, size);
    uint8_t *sbuf = t_malloc(size + 1);
    uint8_t *rbuf = t_malloc(size + extra + GUARD);
    MPI_Request req[2] = { MPI_REQUEST_NULL, MPI_REQUEST_NULL };
    MPI_Status st[2], rst;
    char what[256];

    snprintf(what, sizeof(what), "%s size=%zu shift=%d rep=%d %d->%d", mode_name[mode], size, d, rep, src,
             t_rank);
    t_section("%s", what);
    t_fill(sbuf, size, sseed);
    memset(rbuf, GUARD_BYTE, size + extra + GUARD);
    t_status_init_n(st, 2);
    t_status_init(&rst);

    switch (mode) {
    case M_SEND_IRECV:
        T_CHECK_MPI(MPI_Irecv(rbuf, rcount, MPI_BYTE, src, tag, comm, &req[0]));
        T_CHECK_MPI(MPI_Send(sbuf, (int)size, MPI_BYTE, dst, tag, comm));
        T_CHECK_MPI(MPI_Wait(&req[0], &rst));
        break;
    case M_ISEND_RECV:
        T_CHECK_MPI(MPI_Isend(sbuf, (int)size, MPI_BYTE, dst, tag, comm, &req[0]));
        T_CHECK_MPI(MPI_Recv(rbuf, rcount, MPI_BYTE, src, tag, comm, &rst));
        T_CHECK_MPI(MPI_Wait(&req[0], MPI_STATUS_IGNORE));
        break;
    case M_WAITALL:
        T_CHECK_MPI(MPI_Irecv(rbuf, rcount, MPI_BYTE, src, tag, comm, &req[0]));
        T_CHECK_MPI(MPI_Isend(sbuf, (int)size, MPI_BYTE, dst, tag, comm, &req[1]));
        T_CHECK_MPI(MPI_Waitall(2, req, st));
        rst = st[0];
        break;
    case M_TESTLOOP: {
        int f0 = 0, f1 = 0;
        double t0 = t_now();
        T_CHECK_MPI(MPI_Isend(sbuf, (int)size, MPI_BYTE, dst, tag, comm, &req[1]));
        T_CHECK_MPI(MPI_Irecv(rbuf, rcount, MPI_BYTE, src, tag, comm, &req[0]));
        while (!(f0 && f1)) {
            if (!f0)
                T_CHECK_MPI(MPI_Test(&req[0], &f0, &rst));
            if (!f1)
                T_CHECK_MPI(MPI_Test(&req[1], &f1, MPI_STATUS_IGNORE));
            if (t_now() - t0 > 120)
                t_fail("%s: MPI_Test never reported completion (recv %d send %d)", what, f0, f1);
        }
        T_ASSERT(req[0] == MPI_REQUEST_NULL && req[1] == MPI_REQUEST_NULL, "completed requests not freed");
        break;
    }
    case M_WAITANY: {
        int idx = -1;
        MPI_Status s;
        T_CHECK_MPI(MPI_Irecv(rbuf, rcount, MPI_BYTE, src, tag, comm, &req[0]));
        T_CHECK_MPI(MPI_Isend(sbuf, (int)size, MPI_BYTE, dst, tag, comm, &req[1]));
        for (int k = 0; k < 2; k++) {
            t_status_init(&s);
            T_CHECK_MPI(MPI_Waitany(2, req, &idx, &s));
            T_ASSERT(idx == 0 || idx == 1, "Waitany index %d", idx);
            if (idx == 0)
                rst = s;
        }
        T_ASSERT(req[0] == MPI_REQUEST_NULL && req[1] == MPI_REQUEST_NULL, "Waitany left requests");
        T_CHECK_MPI(MPI_Waitany(2, req, &idx, &s));
        T_ASSERT(idx == MPI_UNDEFINED, "Waitany on null requests returned index %d", idx);
        break;
    }
    case M_WAITSOME: {
        int done = 0, outc, idx[2];
        T_CHECK_MPI(MPI_Irecv(rbuf, rcount, MPI_BYTE, src, tag, comm, &req[0]));
        T_CHECK_MPI(MPI_Isend(sbuf, (int)size, MPI_BYTE, dst, tag, comm, &req[1]));
        while (done < 2) {
            t_status_init_n(st, 2);
            T_CHECK_MPI(MPI_Waitsome(2, req, &outc, idx, st));
            T_ASSERT(outc >= 1 && outc <= 2 - done, "Waitsome outcount %d with %d done", outc, done);
            for (int k = 0; k < outc; k++)
                if (idx[k] == 0)
                    rst = st[k];
            done += outc;
        }
        break;
    }
    case M_RSEND:
    case M_IRSEND:
        T_CHECK_MPI(MPI_Irecv(rbuf, rcount, MPI_BYTE, src, tag, comm, &req[0]));
        T_CHECK_MPI(MPI_Barrier(comm));
        if (mode == M_RSEND)
            T_CHECK_MPI(MPI_Rsend(sbuf, (int)size, MPI_BYTE, dst, tag, comm));
        else
            T_CHECK_MPI(MPI_Irsend(sbuf, (int)size, MPI_BYTE, dst, tag, comm, &req[1]));
        T_CHECK_MPI(MPI_Waitall(2, req, st));
        rst = st[0];
        break;
    case M_BSEND:
    case M_IBSEND: {
        /* Room for a message per rank and a few more: the standard lets an earlier
         * buffered send hold its space until its transmission completes, which the
         * sender learns only when it next progresses (at 8 ranks several are pending). */
        int need = (t_size + 4) * ((int)size + MPI_BSEND_OVERHEAD);
        if (bsend_len < need) {
            void *old;
            int oldlen;
            if (bsend_buf) {
                T_CHECK_MPI(MPI_Buffer_detach(&old, &oldlen));
                free(old);
            }
            bsend_len = need;
            bsend_buf = t_malloc((size_t)bsend_len);
            T_CHECK_MPI(MPI_Buffer_attach(bsend_buf, bsend_len));
        }
        if (mode == M_BSEND) {
            T_CHECK_MPI(MPI_Bsend(sbuf, (int)size, MPI_BYTE, dst, tag, comm));
            /* Bsend copied the data: scribbling on the user buffer must not matter. */
            memset(sbuf, 0x11, size);
        } else {
            T_CHECK_MPI(MPI_Ibsend(sbuf, (int)size, MPI_BYTE, dst, tag, comm, &req[1]));
        }
        T_CHECK_MPI(MPI_Recv(rbuf, rcount, MPI_BYTE, src, tag, comm, &rst));
        T_CHECK_MPI(MPI_Wait(&req[1], MPI_STATUS_IGNORE));
        break;
    }
    case M_SSEND:
        T_CHECK_MPI(MPI_Irecv(rbuf, rcount, MPI_BYTE, src, tag, comm, &req[0]));
        T_CHECK_MPI(MPI_Ssend(sbuf, (int)size, MPI_BYTE, dst, tag, comm));
        T_CHECK_MPI(MPI_Wait(&req[0], &rst));
        break;
    case M_ISSEND:
        T_CHECK_MPI(MPI_Issend(sbuf, (int)size, MPI_BYTE, dst, tag, comm, &req[1]));
        T_CHECK_MPI(MPI_Recv(rbuf, rcount, MPI_BYTE, src, tag, comm, &rst));
        T_CHECK_MPI(MPI_Wait(&req[1], MPI_STATUS_IGNORE));
        break;
    case M_SENDRECV:
        T_CHECK_MPI(MPI_Sendrecv(sbuf, (int)size, MPI_BYTE, dst, tag, rbuf, rcount, MPI_BYTE, src, tag, comm,
                                 &rst));
        break;
    case M_SENDRECV_REPL:
        /* In-place: the buffer holds our message and receives the peer's. */
        memcpy(rbuf, sbuf, size);
        T_CHECK_MPI(MPI_Sendrecv_replace(rbuf, (int)size, MPI_BYTE, dst, tag, src, tag, comm, &rst));
        break;
    case M_PERSIST: {
        MPI_Request p[2];
        T_CHECK_MPI(MPI_Recv_init(rbuf, rcount, MPI_BYTE, src, tag, comm, &p[0]));
        T_CHECK_MPI(MPI_Send_init(sbuf, (int)size, MPI_BYTE, dst, tag, comm, &p[1]));
        for (int k = 0; k < 2; k++) {
            memset(rbuf, GUARD_BYTE, size + extra + GUARD);
            t_status_init_n(st, 2);
            T_CHECK_MPI(MPI_Startall(2, p));
            T_CHECK_MPI(MPI_Waitall(2, p, st));
            T_ASSERT(p[0] != MPI_REQUEST_NULL && p[1] != MPI_REQUEST_NULL, "persistent request freed by Waitall");
            if (k == 0) {
                char w[300];
                snprintf(w, sizeof(w), "%s start #1", what);
                check_recv(rbuf, size, extra, rseed, &st[0], src, tag, w);
            }
        }
        rst = st[0];
        T_CHECK_MPI(MPI_Request_free(&p[0]));
        T_CHECK_MPI(MPI_Request_free(&p[1]));
        break;
    }
    }
    if (mode == M_SENDRECV_REPL)
        extra = 0; /* replace uses the same count both ways */
    check_recv(rbuf, size, extra, rseed, &rst, src, tag, what);
    free(sbuf);
    free(rbuf);
}

/* Many messages in flight at once between each pair, receives posted in reverse tag order. */
static void many_in_flight(size_t size, int nmsg)
{
    int dst = (t_rank + 1) % t_size, src = (t_rank - 1 + t_size) % t_size;
    MPI_Request *req = t_malloc(sizeof(*req) * 2 * (size_t)nmsg);
    MPI_Status *st = t_malloc(sizeof(*st) * 2 * (size_t)nmsg);
    uint8_t *sbuf = t_malloc(size * (size_t)nmsg), *rbuf = t_malloc(size * (size_t)nmsg);
    char what[200];

    t_section("many-in-flight size=%zu n=%d", size, nmsg);
    for (int i = 0; i < nmsg; i++)
        t_fill(sbuf + (size_t)i * size, size, t_seed(7, (uint64_t)t_rank, (uint64_t)i, size));
    memset(rbuf, GUARD_BYTE, size * (size_t)nmsg);
    t_status_init_n(st, 2 * nmsg);
    for (int i = nmsg - 1; i >= 0; i--)
        T_CHECK_MPI(MPI_Irecv(rbuf + (size_t)i * size, (int)size, MPI_BYTE, src, 2000 + i, comm, &req[i]));
    for (int i = 0; i < nmsg; i++)
        T_CHECK_MPI(MPI_Isend(sbuf + (size_t)i * size, (int)size, MPI_BYTE, dst, 2000 + i, comm, &req[nmsg + i]));
    T_CHECK_MPI(MPI_Waitall(2 * nmsg, req, st));
    for (int i = 0; i < nmsg; i++) {
        snprintf(what, sizeof(what), "many-in-flight size=%zu msg %d from %d", size, i, src);
        t_check_status_bytes(&st[i], src, 2000 + i, size, what);
        t_check(rbuf + (size_t)i * size, size, t_seed(7, (uint64_t)src, (uint64_t)i, size), what);
    }
    free(req);
    free(st);
    free(sbuf);
    free(rbuf);
}

static void proc_null(void)
{
    MPI_Status st;
    MPI_Request r;
    char b[4] = { 1, 2, 3, 4 };
    t_section("MPI_PROC_NULL");
    T_CHECK_MPI(MPI_Send(b, 4, MPI_BYTE, MPI_PROC_NULL, 1, comm));
    t_status_init(&st);
    T_CHECK_MPI(MPI_Recv(b, 4, MPI_BYTE, MPI_PROC_NULL, 1, comm, &st));
    t_check_status_procnull(&st, "MPI_Recv from MPI_PROC_NULL");
    T_CHECK_MPI(MPI_Irecv(b, 4, MPI_BYTE, MPI_PROC_NULL, 1, comm, &r));
    t_status_init(&st);
    T_CHECK_MPI(MPI_Wait(&r, &st));
    t_check_status_procnull(&st, "MPI_Irecv from MPI_PROC_NULL");
    T_ASSERT(b[0] == 1 && b[3] == 4, "receive from MPI_PROC_NULL wrote the buffer");
}

int main(int argc, char **argv)
{
    size_t sizes[32];
    int nsizes, reps, all_pairs_big;
    double t0;

    t_init(&argc, &argv, "p2p");
    nsizes = t_sizes(sizes, 32);
    reps = (int)t_opt_long("reps", NULL, 1);
    all_pairs_big = t_opt_flag("all-pairs-big");
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));

    proc_null();
    for (int si = 0; si < nsizes; si++) {
        size_t size = sizes[si];
        int maxd = (size > (4u << 20) && !all_pairs_big) ? 1 : t_size - 1;
        t0 = t_now();
        for (int rep = 0; rep < reps; rep++)
            for (int mode = 0; mode < NMODES; mode++)
                for (int d = 1; d <= maxd && mode_on(mode); d++)
                    exchange(mode, size, si, d, rep);
        if (t_verbose)
            t_info("size %zu done in %.2fs", size, t_now() - t0);
    }
    many_in_flight(1, 64);
    many_in_flight(t_inject() + 1, 64);
    many_in_flight(65536, 16);
    if (bsend_buf) {
        void *old;
        int oldlen;
        T_CHECK_MPI(MPI_Buffer_detach(&old, &oldlen));
        free(old);
    }
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
