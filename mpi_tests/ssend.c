/*
 * ssend: a synchronous send completes only once a matching receive has started.
 *
 * Ranks pair up (even -> odd, then odd -> even; with an odd rank count the last rank
 * sits out) and, for each receive kind and size (0, 8, inject+1, 6000, 12 KiB, 1 MiB):
 *
 *  1. Blocking MPI_Ssend. The receiver sleeps (--delay ms, default 100) after a barrier,
 *     reads CLOCK_MONOTONIC just before its receive call and sends that time to the
 *     sender on a separate communicator. The sender's MPI_Ssend must have returned at or
 *     after that time (all ranks on one host; the check is skipped otherwise).
 *
 *  2. MPI_Issend must not complete before the receive is posted. The sender polls
 *     MPI_Test on the Issend request while waiting for a "ready" handshake on another
 *     communicator; every MPI_Test must return false. The receiver keeps the message
 *     unreceived for at least --idelay ms (default 200), calling MPI_Iprobe until it sees
 *     it (a probe does not match the send), then sends "ready", waits for "go" (so the
 *     sender has certainly stopped polling), and only then receives. Deterministic: a
 *     true MPI_Test before "ready" arrived is always a bug.
 *
 * Receive kinds: named MPI_Recv, MPI_ANY_SOURCE MPI_Recv, MPI_Probe + MPI_Recv,
 * MPI_Irecv + MPI_Wait; and, in the ssend_mprobe program (which includes this file with
 * SSEND_MPROBE defined), MPI_Mprobe + MPI_Mrecv and MPI_Improbe + MPI_Imrecv.
 *
 * Then (ssend only) a flood: every rank posts --flood (1024 with --quick, else 4096)
 * MPI_Issend of 4 bytes to the next rank before that rank posts its receives; data
 * and order checked.
 *
 * Options: --inject N, --delay MS, --idelay MS, --flood N.
 */
#include "common.h"

enum kind { K_NAMED, K_ANYSRC, K_PROBE, K_IRECV, K_MPROBE, K_IMPROBE, NKINDS };
static const char *kind_name[NKINDS] = { "named Recv",   "ANY_SOURCE Recv", "Probe+Recv",
                                         "Irecv+Wait",   "Mprobe+Mrecv",    "Improbe+Imrecv" };
#ifdef SSEND_MPROBE
static const char *prog_name = "ssend_mprobe";
static const int kinds[] = { K_MPROBE, K_IMPROBE };
#else
static const char *prog_name = "ssend";
static const int kinds[] = { K_NAMED, K_ANYSRC, K_PROBE, K_IRECV };
#endif
#define NK ((int)(sizeof(kinds) / sizeof(kinds[0])))

static MPI_Comm comm, hs;
static int all_local;

/* Receive one message of `size` from `sender` in the way `kind` says; check it. */
static void do_recv(int kind, int sender, int tag, size_t size, uint64_t seed, const char *what)
{
    uint8_t *buf = t_malloc(size + 64);
    MPI_Status st, pst;
    MPI_Message msg;
    MPI_Request req;
    int flag = 0;
    char w[300];
    double t0 = t_now();

    memset(buf, 0xee, size + 64);
    t_status_init(&st);
    t_status_init(&pst);
    switch (kind) {
    case K_NAMED:
        T_CHECK_MPI(MPI_Recv(buf, (int)size + 64, MPI_BYTE, sender, tag, comm, &st));
        break;
    case K_ANYSRC:
        T_CHECK_MPI(MPI_Recv(buf, (int)size + 64, MPI_BYTE, MPI_ANY_SOURCE, tag, comm, &st));
        break;
    case K_PROBE:
        T_CHECK_MPI(MPI_Probe(MPI_ANY_SOURCE, tag, comm, &pst));
        snprintf(w, sizeof(w), "%s probe status", what);
        t_check_status_bytes(&pst, sender, tag, size, w);
        T_CHECK_MPI(MPI_Recv(buf, (int)size + 64, MPI_BYTE, pst.MPI_SOURCE, tag, comm, &st));
        break;
    case K_IRECV:
        T_CHECK_MPI(MPI_Irecv(buf, (int)size + 64, MPI_BYTE, sender, tag, comm, &req));
        T_CHECK_MPI(MPI_Wait(&req, &st));
        break;
    case K_MPROBE:
        T_CHECK_MPI(MPI_Mprobe(sender, tag, comm, &msg, &pst));
        snprintf(w, sizeof(w), "%s Mprobe status", what);
        t_check_status_bytes(&pst, sender, tag, size, w);
        T_CHECK_MPI(MPI_Mrecv(buf, (int)size + 64, MPI_BYTE, &msg, &st));
        break;
    case K_IMPROBE:
        while (!flag) {
            T_CHECK_MPI(MPI_Improbe(MPI_ANY_SOURCE, tag, comm, &flag, &msg, &pst));
            if (t_now() - t0 > 60)
                t_fail("%s: Improbe never found the message", what);
        }
        snprintf(w, sizeof(w), "%s Improbe status", what);
        t_check_status_bytes(&pst, sender, tag, size, w);
        T_CHECK_MPI(MPI_Imrecv(buf, (int)size + 64, MPI_BYTE, &msg, &req));
        T_CHECK_MPI(MPI_Wait(&req, &st));
        break;
    }
    snprintf(w, sizeof(w), "%s receive status", what);
    t_check_status_bytes(&st, sender, tag, size, w);
    snprintf(w, sizeof(w), "%s data", what);
    t_check(buf, size, seed, w);
    snprintf(w, sizeof(w), "%s guard", what);
    t_check_const(buf + size, 64, 0xee, w);
    free(buf);
}

/* Part 1: blocking Ssend returns no earlier than the receive call started. */
static void blocking(int kind, size_t size, int sender, int recvr, int delay_ms)
{
    int tag = 10 + kind;
    uint64_t seed = t_seed((uint64_t)sender, (uint64_t)recvr, 1000 + (uint64_t)kind, size);
    char what[200];
    snprintf(what, sizeof(what), "blocking Ssend, %s, size=%zu %d->%d", kind_name[kind], size, sender, recvr);
    t_section("%s", what);
    T_CHECK_MPI(MPI_Barrier(comm));
    if (t_rank == sender) {
        uint8_t *buf = t_malloc(size);
        double t_post = 0, t_done;
        t_fill(buf, size, seed);
        T_CHECK_MPI(MPI_Ssend(buf, (int)size, MPI_BYTE, recvr, tag, comm));
        t_done = t_now();
        T_CHECK_MPI(MPI_Recv(&t_post, 1, MPI_DOUBLE, recvr, 1, hs, MPI_STATUS_IGNORE));
        if (all_local && t_done < t_post)
            t_fail("%s: MPI_Ssend returned %.3f ms before the receiver started its receive", what,
                   (t_post - t_done) * 1e3);
        free(buf);
    } else if (t_rank == recvr) {
        double t_post;
        t_sleep_ms(delay_ms);
        t_post = t_now();
        do_recv(kind, sender, tag, size, seed, what);
        T_CHECK_MPI(MPI_Send(&t_post, 1, MPI_DOUBLE, sender, 1, hs));
    }
}

/* Part 2: Issend stays incomplete (MPI_Test false) until the receiver posts. */
static void nonblocking(int kind, size_t size, int sender, int recvr, int idelay_ms)
{
    int tag = 40 + kind;
    uint64_t seed = t_seed((uint64_t)sender, (uint64_t)recvr, 2000 + (uint64_t)kind, size);
    char what[200];
    snprintf(what, sizeof(what), "Issend not complete before receive, %s, size=%zu %d->%d", kind_name[kind], size,
             sender, recvr);
    t_section("%s", what);
    T_CHECK_MPI(MPI_Barrier(comm));
    if (t_rank == sender) {
        uint8_t *buf = t_malloc(size);
        MPI_Request sreq, hreq;
        int ready = 0, done = 0, go = 1, ready_msg = 0;
        long polls = 0;
        double t0 = t_now();
        t_fill(buf, size, seed);
        T_CHECK_MPI(MPI_Irecv(&ready_msg, 1, MPI_INT, recvr, 2, hs, &hreq));
        T_CHECK_MPI(MPI_Issend(buf, (int)size, MPI_BYTE, recvr, tag, comm, &sreq));
        for (;;) {
            /* Handshake first: once "ready" is in, the receiver may post at any moment
             * after our "go", but not before. */
            T_CHECK_MPI(MPI_Test(&hreq, &ready, MPI_STATUS_IGNORE));
            if (ready)
                break;
            T_CHECK_MPI(MPI_Test(&sreq, &done, MPI_STATUS_IGNORE));
            polls++;
            if (done)
                t_fail("%s: MPI_Test reported the Issend complete after %.1f ms and %ld polls, before the "
                       "receiver posted any receive",
                       what, (t_now() - t0) * 1e3, polls);
            if (t_now() - t0 > 60)
                t_fail("%s: no handshake from the receiver in 60 s", what);
        }
        T_ASSERT(polls > 0, "sender never polled");
        T_CHECK_MPI(MPI_Send(&go, 1, MPI_INT, recvr, 3, hs));
        T_CHECK_MPI(MPI_Wait(&sreq, MPI_STATUS_IGNORE));
        free(buf);
    } else if (t_rank == recvr) {
        double t0 = t_now();
        int seen = 0, flag, one = 1, go = 0;
        MPI_Status pst;
        /* Keep progressing and probing for at least idelay ms; the probe must find it. */
        while (t_now() - t0 < idelay_ms * 1e-3 || !seen) {
            t_status_init(&pst);
            T_CHECK_MPI(MPI_Iprobe(sender, tag, comm, &flag, &pst));
            if (flag && !seen) {
                seen = 1;
                t_check_status_bytes(&pst, sender, tag, size, "Iprobe status of the pending Issend");
            }
            if (t_now() - t0 > 30)
                t_fail("%s: MPI_Iprobe did not see the Issend message within 30 s", what);
            t_sleep_ms(1);
        }
        T_CHECK_MPI(MPI_Send(&one, 1, MPI_INT, sender, 2, hs));
        T_CHECK_MPI(MPI_Recv(&go, 1, MPI_INT, sender, 3, hs, MPI_STATUS_IGNORE));
        do_recv(kind, sender, tag, size, seed, what);
    }
}

#ifndef SSEND_MPROBE
/* Many synchronous sends in flight at once (MPICH's threads/pt2pt/mt_issendirecv did
 * 4 x 1024 and hung our MTL over udp;ofi_rxd: the acknowledgements, injected, flooded
 * rxd): every rank posts n MPI_Issend of 4 bytes to the next rank before that rank
 * posts its receives (after a barrier), then takes n from the rank before. */
static void flood(int n)
{
    int peer = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    int *sbuf = t_malloc(sizeof(int) * (size_t)n), *rbuf = t_malloc(sizeof(int) * (size_t)n);
    MPI_Request *sr = t_malloc(sizeof(MPI_Request) * (size_t)n);
    MPI_Request *rr = t_malloc(sizeof(MPI_Request) * (size_t)n);
    t_section("%d MPI_Issend of 4 bytes to the next rank before it posts", n);
    for (int i = 0; i < n; i++) {
        sbuf[i] = t_rank * 1000003 + i;
        T_CHECK_MPI(MPI_Issend(&sbuf[i], 1, MPI_INT, peer, 5, comm, &sr[i]));
    }
    T_CHECK_MPI(MPI_Barrier(hs));
    for (int i = 0; i < n; i++) {
        rbuf[i] = -1;
        T_CHECK_MPI(MPI_Irecv(&rbuf[i], 1, MPI_INT, from, 5, comm, &rr[i]));
    }
    T_CHECK_MPI(MPI_Waitall(n, rr, MPI_STATUSES_IGNORE));
    T_CHECK_MPI(MPI_Waitall(n, sr, MPI_STATUSES_IGNORE));
    for (int i = 0; i < n; i++)
        if (rbuf[i] != from * 1000003 + i)
            t_fail("Issend flood: message %d of %d from rank %d: expected %d got %d (order or data)",
                   i, n, from, from * 1000003 + i, rbuf[i]);
    T_CHECK_MPI(MPI_Barrier(hs));
    free(sbuf);
    free(rbuf);
    free(sr);
    free(rr);
}
#endif

int main(int argc, char **argv)
{
    size_t sizes[8];
    int nsizes, delay, idelay;
    t_init(&argc, &argv, prog_name);
    if (t_size < 2)
        t_fail("needs at least 2 ranks");
    nsizes = t_sizes_def(sizes, 8, "0,8,inject+1,6000,12K,1M");
    delay = (int)t_opt_long("delay", NULL, t_quick ? 20 : 100);
    idelay = (int)t_opt_long("idelay", NULL, t_quick ? 50 : 200);
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &hs));
    all_local = t_all_local();
    if (!all_local)
        t_info("ranks on several hosts: the Ssend timing check is skipped");

    for (int phase = 0; phase < 2; phase++) {
        /* phase 0: 0->1, 2->3, ...; phase 1: 1->0, 3->2, ... */
        int pair = t_rank / 2, sender = 2 * pair + phase, recvr = 2 * pair + 1 - phase;
        if (2 * pair + 1 >= t_size)
            sender = recvr = -1; /* odd one out */
        for (int k = 0; k < NK; k++)
            for (int s = 0; s < nsizes; s++) {
                blocking(kinds[k], sizes[s], sender, recvr, delay);
                nonblocking(kinds[k], sizes[s], sender, recvr, idelay);
            }
    }
#ifndef SSEND_MPROBE
    flood((int)t_opt_long("flood", NULL, t_quick ? 1024 : 4096));
#endif
    T_CHECK_MPI(MPI_Comm_free(&hs));
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
