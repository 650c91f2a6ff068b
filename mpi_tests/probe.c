/*
 * probe: MPI_Probe, MPI_Iprobe, MPI_Mprobe, MPI_Improbe, MPI_Mrecv, MPI_Imrecv.
 *
 * For each size (0, 1, inject, inject+1, 6000, 12 KiB, 64 KiB, 4 MiB; --sizes overrides) and each
 * ordered pair of ranks (one pair at a time), the sender sends with MPI_Send / MPI_Isend
 * and the receiver probes with every flavour, checks the probe status (MPI_SOURCE,
 * MPI_TAG, MPI_Get_count, MPI_ERROR), then receives and checks status and every byte:
 *   - Probe (named, then wildcards) does not consume: probing twice sees the same message
 *   - Iprobe polled until true; Iprobe on a tag nobody sends stays false
 *   - Mprobe + Mrecv, Improbe + Imrecv, Mprobe with wildcards
 *   - two queued messages Mprobe'd in order and Mrecv'd in reverse order
 *   - Mprobe/Improbe on MPI_PROC_NULL give MPI_MESSAGE_NO_PROC
 *   - probe then receive into a datatype-sized buffer picked from MPI_Get_count
 *
 * Options: --inject N, --sizes LIST.
 */
#include "common.h"

static MPI_Comm comm;
static size_t sizes[32];
static int nsizes;

enum kind {
    K_PROBE_RECV,        /* Probe(src,tag) twice, Recv(src,tag) */
    K_PROBE_ANY,         /* Probe(ANY,ANY), Recv(status.src, status.tag) */
    K_IPROBE,            /* Iprobe poll (named), Recv */
    K_IPROBE_ANY,        /* Iprobe poll (ANY, ANY), Irecv+Wait */
    K_MPROBE,            /* Mprobe(src,tag), Mrecv */
    K_MPROBE_ANY,        /* Mprobe(ANY,ANY), Mrecv */
    K_IMPROBE,           /* Improbe poll, Imrecv+Wait */
    K_IMPROBE_ANY,       /* Improbe(ANY,ANY) poll, Imrecv+Test loop */
    K_PROBE_ALLOC,       /* Probe, malloc exactly Get_count, Recv */
    NKINDS
};
static const char *kind_name[NKINDS] = {
    "Probe+Recv", "Probe(ANY,ANY)+Recv", "Iprobe+Recv", "Iprobe(ANY,ANY)+Irecv", "Mprobe+Mrecv",
    "Mprobe(ANY,ANY)+Mrecv", "Improbe+Imrecv", "Improbe(ANY,ANY)+Imrecv", "Probe+alloc+Recv",
};

static void wait_polled(MPI_Request *req, MPI_Status *st, const char *what)
{
    int flag = 0;
    double t0 = t_now();
    while (!flag) {
        T_CHECK_MPI(MPI_Test(req, &flag, st));
        if (t_now() - t0 > 120)
            t_fail("%s: MPI_Test never completed", what);
    }
}

/*
 * A probe writes the caller's status but leaves MPI_ERROR as it was (MPI 3.1, 3.2.5:
 * only the calls that return several statuses set it; MPICH's pt2pt/mprobe checks the
 * same), and the status is not of a cancelled request.
 */
static void t_check_probe_status_rest(const MPI_Status *st, const char *what)
{
    int cancelled = -1;
    if (st->MPI_ERROR != T_ERR_SENTINEL)
        t_fail("%s: a probe changed status.MPI_ERROR (set to %s)", what, t_errstr(st->MPI_ERROR));
    T_CHECK_MPI(MPI_Test_cancelled(st, &cancelled));
    if (cancelled)
        t_fail("%s: MPI_Test_cancelled on a probe's status says cancelled", what);
}

static void one(int kind, size_t size, int si, int sender, int recvr)
{
    int tag = 300 + kind * 32 + si;
    uint64_t seed = t_seed((uint64_t)sender, (uint64_t)recvr, (uint64_t)kind, size);
    char what[256];
    snprintf(what, sizeof(what), "%s size=%zu %d->%d", kind_name[kind], size, sender, recvr);
    t_section("%s", what);

    if (t_rank == sender) {
        uint8_t *buf = t_malloc(size);
        MPI_Request r;
        t_fill(buf, size, seed);
        if (kind & 1) {
            T_CHECK_MPI(MPI_Isend(buf, (int)size, MPI_BYTE, recvr, tag, comm, &r));
            T_CHECK_MPI(MPI_Wait(&r, MPI_STATUS_IGNORE));
        } else {
            T_CHECK_MPI(MPI_Send(buf, (int)size, MPI_BYTE, recvr, tag, comm));
        }
        free(buf);
        return;
    }
    if (t_rank != recvr)
        return;

    MPI_Status pst, rst;
    MPI_Message msg = MPI_MESSAGE_NULL;
    MPI_Request req = MPI_REQUEST_NULL;
    uint8_t *buf = NULL;
    size_t blen = size + 64;
    int flag = 0;
    char w[320];
    double t0 = t_now();

    t_status_init(&pst);
    t_status_init(&rst);
    if (kind != K_PROBE_ALLOC) {
        buf = t_malloc(blen);
        memset(buf, 0xee, blen);
    }
    switch (kind) {
    case K_PROBE_RECV:
        T_CHECK_MPI(MPI_Probe(sender, tag, comm, &pst));
        snprintf(w, sizeof(w), "%s first probe", what);
        t_check_status_bytes(&pst, sender, tag, size, w);
        t_status_init(&pst);
        T_CHECK_MPI(MPI_Probe(sender, tag, comm, &pst)); /* probe does not consume */
        snprintf(w, sizeof(w), "%s second probe", what);
        t_check_status_bytes(&pst, sender, tag, size, w);
        T_CHECK_MPI(MPI_Recv(buf, (int)blen, MPI_BYTE, sender, tag, comm, &rst));
        break;
    case K_PROBE_ANY:
        T_CHECK_MPI(MPI_Probe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &pst));
        T_CHECK_MPI(MPI_Recv(buf, (int)blen, MPI_BYTE, pst.MPI_SOURCE, pst.MPI_TAG, comm, &rst));
        break;
    case K_IPROBE:
    case K_IPROBE_ANY: {
        int src = kind == K_IPROBE ? sender : MPI_ANY_SOURCE, tg = kind == K_IPROBE ? tag : MPI_ANY_TAG;
        while (!flag) {
            T_CHECK_MPI(MPI_Iprobe(src, tg, comm, &flag, &pst));
            if (t_now() - t0 > 120)
                t_fail("%s: MPI_Iprobe never found the message", what);
        }
        if (kind == K_IPROBE) {
            T_CHECK_MPI(MPI_Recv(buf, (int)blen, MPI_BYTE, sender, tag, comm, &rst));
        } else {
            T_CHECK_MPI(MPI_Irecv(buf, (int)blen, MPI_BYTE, pst.MPI_SOURCE, pst.MPI_TAG, comm, &req));
            T_CHECK_MPI(MPI_Wait(&req, &rst));
        }
        break;
    }
    case K_MPROBE:
        T_CHECK_MPI(MPI_Mprobe(sender, tag, comm, &msg, &pst));
        T_ASSERT(msg != MPI_MESSAGE_NULL && msg != MPI_MESSAGE_NO_PROC, "Mprobe returned no message handle");
        T_CHECK_MPI(MPI_Mrecv(buf, (int)blen, MPI_BYTE, &msg, &rst));
        T_ASSERT(msg == MPI_MESSAGE_NULL, "Mrecv did not reset the message handle");
        break;
    case K_MPROBE_ANY:
        T_CHECK_MPI(MPI_Mprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &msg, &pst));
        T_CHECK_MPI(MPI_Mrecv(buf, (int)blen, MPI_BYTE, &msg, &rst));
        break;
    case K_IMPROBE:
    case K_IMPROBE_ANY: {
        int src = kind == K_IMPROBE ? sender : MPI_ANY_SOURCE, tg = kind == K_IMPROBE ? tag : MPI_ANY_TAG;
        while (!flag) {
            T_CHECK_MPI(MPI_Improbe(src, tg, comm, &flag, &msg, &pst));
            if (t_now() - t0 > 120)
                t_fail("%s: MPI_Improbe never found the message", what);
        }
        T_CHECK_MPI(MPI_Imrecv(buf, (int)blen, MPI_BYTE, &msg, &req));
        T_ASSERT(msg == MPI_MESSAGE_NULL, "Imrecv did not reset the message handle");
        if (kind == K_IMPROBE)
            T_CHECK_MPI(MPI_Wait(&req, &rst));
        else
            wait_polled(&req, &rst, what);
        break;
    }
    case K_PROBE_ALLOC: {
        int cnt = -1;
        T_CHECK_MPI(MPI_Probe(sender, MPI_ANY_TAG, comm, &pst));
        T_CHECK_MPI(MPI_Get_count(&pst, MPI_BYTE, &cnt));
        T_ASSERT(cnt >= 0, "Get_count after Probe: %d", cnt);
        blen = (size_t)cnt + 64;
        buf = t_malloc(blen);
        memset(buf, 0xee, blen);
        T_CHECK_MPI(MPI_Recv(buf, cnt, MPI_BYTE, sender, pst.MPI_TAG, comm, &rst));
        break;
    }
    }
    snprintf(w, sizeof(w), "%s probe status", what);
    t_check_status_bytes(&pst, sender, tag, size, w);
    t_check_probe_status_rest(&pst, w);
    snprintf(w, sizeof(w), "%s receive status", what);
    t_check_status_bytes(&rst, sender, tag, size, w);
    snprintf(w, sizeof(w), "%s data", what);
    t_check(buf, size, seed, w);
    snprintf(w, sizeof(w), "%s guard", what);
    t_check_const(buf + size, 64, 0xee, w);
    free(buf);
}

/* Two queued messages on one (source, tag): Mprobe both, Mrecv in reverse order. */
static void mprobe_two(size_t size)
{
    int sender = 0, recvr = t_size - 1;
    t_section("two Mprobes then Mrecv in reverse order, size %zu", size);
    if (t_rank == sender) {
        uint8_t *b0 = t_malloc(size), *b1 = t_malloc(size + 5);
        MPI_Request r[2];
        t_fill(b0, size, t_seed(60, 0, size, 0));
        t_fill(b1, size + 5, t_seed(60, 1, size, 0));
        T_CHECK_MPI(MPI_Isend(b0, (int)size, MPI_BYTE, recvr, 61, comm, &r[0]));
        T_CHECK_MPI(MPI_Isend(b1, (int)size + 5, MPI_BYTE, recvr, 61, comm, &r[1]));
        T_CHECK_MPI(MPI_Waitall(2, r, MPI_STATUSES_IGNORE));
        free(b0);
        free(b1);
    } else if (t_rank == recvr) {
        MPI_Message m[2];
        MPI_Status ps[2], rs[2];
        uint8_t *b[2];
        t_status_init_n(ps, 2);
        t_status_init_n(rs, 2);
        T_CHECK_MPI(MPI_Mprobe(sender, 61, comm, &m[0], &ps[0]));
        T_CHECK_MPI(MPI_Mprobe(MPI_ANY_SOURCE, 61, comm, &m[1], &ps[1]));
        t_check_status_bytes(&ps[0], sender, 61, size, "first Mprobe (must be the first message)");
        t_check_status_bytes(&ps[1], sender, 61, size + 5, "second Mprobe (must be the second message)");
        for (int k = 1; k >= 0; k--) {
            size_t len = size + (size_t)k * 5;
            b[k] = t_malloc(len + 64);
            memset(b[k], 0xee, len + 64);
            T_CHECK_MPI(MPI_Mrecv(b[k], (int)len + 64, MPI_BYTE, &m[k], &rs[k]));
            t_check_status_bytes(&rs[k], sender, 61, len, k ? "Mrecv of second message" : "Mrecv of first message");
            t_check(b[k], len, t_seed(60, (uint64_t)k, size, 0), k ? "second message data" : "first message data");
            t_check_const(b[k] + len, 64, 0xee, "Mrecv guard");
            free(b[k]);
        }
    }
    T_CHECK_MPI(MPI_Barrier(comm));
}

static void negative_and_procnull(void)
{
    int flag = 1;
    MPI_Status st;
    MPI_Message msg;
    char b[4];
    t_section("Iprobe/Improbe with nothing to find, MPI_PROC_NULL");
    T_CHECK_MPI(MPI_Barrier(comm));
    T_CHECK_MPI(MPI_Iprobe(MPI_ANY_SOURCE, 4242, comm, &flag, &st));
    T_ASSERT(!flag, "Iprobe found a message that was never sent");
    flag = 1;
    T_CHECK_MPI(MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &flag, &msg, &st));
    T_ASSERT(!flag, "Improbe(ANY,ANY) found a message that was never sent");

    t_status_init(&st);
    T_CHECK_MPI(MPI_Probe(MPI_PROC_NULL, 1, comm, &st));
    t_check_status_procnull(&st, "Probe(MPI_PROC_NULL)");
    t_status_init(&st);
    flag = 0;
    T_CHECK_MPI(MPI_Iprobe(MPI_PROC_NULL, 1, comm, &flag, &st));
    T_ASSERT(flag, "Iprobe(MPI_PROC_NULL) flag false");
    t_check_status_procnull(&st, "Iprobe(MPI_PROC_NULL)");
    t_status_init(&st);
    T_CHECK_MPI(MPI_Mprobe(MPI_PROC_NULL, 1, comm, &msg, &st));
    T_ASSERT(msg == MPI_MESSAGE_NO_PROC, "Mprobe(MPI_PROC_NULL) did not return MPI_MESSAGE_NO_PROC");
    t_check_status_procnull(&st, "Mprobe(MPI_PROC_NULL)");
    t_status_init(&st);
    T_CHECK_MPI(MPI_Mrecv(b, 4, MPI_BYTE, &msg, &st));
    t_check_status_procnull(&st, "Mrecv(MPI_MESSAGE_NO_PROC)");
    flag = 0;
    T_CHECK_MPI(MPI_Improbe(MPI_PROC_NULL, 1, comm, &flag, &msg, &st));
    T_ASSERT(flag && msg == MPI_MESSAGE_NO_PROC, "Improbe(MPI_PROC_NULL): flag %d", flag);
    T_CHECK_MPI(MPI_Barrier(comm));
}

int main(int argc, char **argv)
{
    t_init(&argc, &argv, "probe");
    if (t_size < 2)
        t_fail("needs at least 2 ranks");
    /* Probe sizes default to a shorter list than p2p's. */
    nsizes = t_sizes_def(sizes, 32, "0,1,inject,inject+1,6000,12K,64K,4M");
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    negative_and_procnull();
    for (int si = 0; si < nsizes; si++)
        for (int kind = 0; kind < NKINDS; kind++)
            for (int d = 1; d < t_size; d++)
                for (int sender = 0; sender < t_size; sender++) {
                    /* one pair at a time so that wildcard probes see only this message */
                    one(kind, sizes[si], si, sender, (sender + d) % t_size);
                    T_CHECK_MPI(MPI_Barrier(comm));
                }
    mprobe_two(1);
    mprobe_two(t_inject() + 1);
    mprobe_two(1 << 20);
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
