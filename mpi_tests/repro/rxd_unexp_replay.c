/*
 * rxd_unexp_replay: libfabric-only reproducer (no MPI) for why ofi_rxd 1.17 mixes up
 * messages longer than one packet (common::quirks::Quirks::segments_unsafe).
 *
 * rxd sends a message longer than one packet as an op packet followed by data
 * packets, and finds the receive that a data packet belongs to through one field per
 * peer, the peer's "current receive" (curr_rx_id), which the op packet sets. Posting a
 * receive that matches a message already waiting as unexpected replays that message
 * through the same code, which sets the field to the replayed receive and, unless
 * another unexpected message is being assembled, does not set it back. The data
 * packets of a long message that the same peer is sending at that moment then go to
 * the replayed receive (completed and freed by then), and the long message is never
 * completed, or completed with bytes of another message.
 *
 * Here one process sends the other, per trial: a small tagged message that arrives
 * unexpected; then a long one that the receiver has posted a receive for. The receiver
 * progresses for T microseconds (so that part of the long message has arrived) and
 * then posts the receive for the small one. It checks both messages byte by byte.
 *
 *   cc -O1 rxd_unexp_replay.c -o rxd_unexp_replay -lfabric      (beside repro.h)
 *   ./rxd_unexp_replay [PROVIDER [LONG_BYTES [TRIALS [send|expected|read|write]]]]
 *   default: "udp;ofi_rxd" 262144 10 send (T = 0, 25, 50, 100, ... by trial)
 *   expected: the small receive is posted before the small message arrives (no
 *   replay); read: the long message is an fi_read of the sender's buffer by the
 *   receiver; write: an fi_write of it into the receiver's buffer.
 *
 * Prints one line per trial ("ok", "STALL", "CORRUPT", "ERROR"), or "HANG" when the
 * receiver does not come back from fi_cq_read (what rxd 1.17 does in most runs of
 * "send", within the first trials), and exits 1 if any trial was not ok.
 */
#include "repro.h"
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <signal.h>
#include <sys/prctl.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#define SMALL 64

static struct fid_ep *ep;
static struct fid_cq *cq;
static int who;

/* Completions read: the contexts of those that completed, and any error. */
static struct fi_context sctx[2], rctx[2];
static int done_s[2], done_r[2], err_r[2];
static size_t len_r[2];

static void drain(void)
{
    struct fi_cq_tagged_entry e[16];
    ssize_t n = fi_cq_read(cq, e, 16);
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry ee = { 0 };
        fi_cq_readerr(cq, &ee, 0);
        for (int i = 0; i < 2; i++)
            if (ee.op_context == &rctx[i]) {
                err_r[i] = ee.err;
                done_r[i] = 1;
                len_r[i] = ee.len;
            }
        printf("[%d] error completion: %s (%zu bytes)\n", who, fi_strerror(ee.err), ee.len);
        return;
    }
    for (ssize_t k = 0; k < n; k++)
        for (int i = 0; i < 2; i++) {
            if (e[k].op_context == &sctx[i])
                done_s[i] = 1;
            if (e[k].op_context == &rctx[i]) {
                done_r[i] = 1;
                len_r[i] = e[k].len;
            }
        }
}

/* Wait for one byte from fd, progressing meanwhile. */
static void wait_byte(int fd)
{
    char c;
    for (;;) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        if (poll(&p, 1, 0) == 1) {
            if (read(fd, &c, 1) != 1)
                exit(1);
            return;
        }
        drain();
    }
}

static void progress_for(double secs)
{
    double t0 = now();
    while (now() - t0 < secs)
        drain();
}

static uint8_t pattern(size_t i, int trial) { return (uint8_t)(i * 7 + (size_t)trial * 13 + 1); }

static void on_alarm(int sig)
{
    (void)sig;
    static const char m[] = "HANG: the receiver is stuck inside fi_cq_read for 10 s\n";
    if (write(1, m, sizeof(m) - 1) < 0)
        _exit(1);
    _exit(1);
}

int main(int argc, char **argv)
{
    const char *prov = argc > 1 ? argv[1] : "udp;ofi_rxd";
    size_t len = argc > 2 ? strtoull(argv[2], NULL, 10) : 262144;
    int trials = argc > 3 ? atoi(argv[3]) : 10;
    const char *mode = argc > 4 ? argv[4] : "send";
    int by_read = !strcmp(mode, "read"), by_write = !strcmp(mode, "write");
    int expected = !strcmp(mode, "expected");
    if (!by_read && !by_write && !expected && strcmp(mode, "send"))
        return 2;
    setvbuf(stdout, NULL, _IONBF, 0);
    int a2b[2], b2a[2];
    if (pipe(a2b) || pipe(b2a))
        return 1;
    pid_t pid = fork();
    who = pid == 0; /* 1: the sender */
    if (who)
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* the receiver may give up on a hang */
    int in = who ? a2b[0] : b2a[0], out = who ? b2a[1] : a2b[1];
    struct fid_av *av;
    struct fi_info *fi = repro_open(prov, FI_TAGGED | (by_read || by_write ? FI_RMA : 0), FI_ORDER_SAS,
                                    FI_CQ_FORMAT_TAGGED, &ep, &cq, &av);
    CK(fi_enable(ep));
    char name[256] = { 0 }, pname[256];
    size_t nlen = sizeof(name);
    CK(fi_getname(&ep->fid, name, &nlen));
    if (write(out, name, 256) != 256 || read(in, pname, 256) != 256)
        return 1;
    fi_addr_t peer;
    CK(fi_av_insert(av, pname, 1, &peer, 0, NULL) != 1);
    (void)fi;

    uint8_t *big = malloc(len), small[SMALL];
    int bad = 0;
    char c = 1;
    if (!who)
        signal(SIGALRM, on_alarm);
    for (int t = 0; t < trials; t++) {
        int us = t ? 25 << (t - 1) : 0;
        memset(done_s, 0, sizeof(done_s));
        memset(done_r, 0, sizeof(done_r));
        memset(err_r, 0, sizeof(err_r));
        if (who) {
            /* the small message first: the receiver has no receive for it (unless
             * "expected") */
            for (int i = 0; i < SMALL; i++)
                small[i] = pattern((size_t)i, t + 100);
            for (size_t i = 0; i < len; i++)
                big[i] = pattern(i, t);
            struct fid_mr *mr = NULL;
            if (by_read)
                CK(fi_mr_reg(repro_domain, big, len, FI_REMOTE_READ, 0, 42 + (uint64_t)t, 0, &mr, NULL));
            if (!expected)
                CK(fi_tsend(ep, small, SMALL, NULL, peer, 1000 + t, &sctx[0]));
            wait_byte(in); /* the receiver has the small one and wants the long one */
            if (expected)
                CK(fi_tsend(ep, small, SMALL, NULL, peer, 1000 + t, &sctx[0]));
            if (by_write) {
                /* into the receiver's buffer; it learns of the end from us */
                CK(fi_write(ep, big, len, NULL, peer, 0, 42 + (uint64_t)t, &sctx[1]));
                while (!done_s[1])
                    drain();
                if (write(out, &c, 1) != 1)
                    return 1;
            } else if (!by_read) {
                CK(fi_tsend(ep, big, len, NULL, peer, 2000 + t, &sctx[1]));
            } else {
                done_s[1] = 1;
            }
            wait_byte(in); /* the receiver is done with the trial */
            while (!done_s[0] || !done_s[1])
                drain();
            if (mr)
                fi_close(&mr->fid);
            if (write(out, &c, 1) != 1)
                return 1;
            continue;
        }
        memset(big, 0xee, len);
        memset(small, 0xee, SMALL);
        alarm(10);
        if (expected)
            CK(fi_trecv(ep, small, SMALL, NULL, peer, 1000 + t, 0, &rctx[0]));
        progress_for(0.2); /* the small message arrives, unexpected */
        struct fid_mr *rmr = NULL;
        if (by_write)
            CK(fi_mr_reg(repro_domain, big, len, FI_REMOTE_WRITE, 0, 42 + (uint64_t)t, 0, &rmr, NULL));
        else if (!by_read)
            CK(fi_trecv(ep, big, len, NULL, peer, 2000 + t, 0, &rctx[1]));
        if (write(out, &c, 1) != 1)
            return 1;
        if (by_read) {
            progress_for(0.01); /* the sender has registered its buffer */
            CK(fi_read(ep, big, len, NULL, peer, 0, 42 + (uint64_t)t, &rctx[1]));
        }
        /* part of the long message arrives (its op packet, some data packets) */
        progress_for(us * 1e-6);
        int long_first = done_r[1];
        if (!expected)
            CK(fi_trecv(ep, small, SMALL, NULL, peer, 1000 + t, 0, &rctx[0]));
        double t0 = now();
        if (by_write) {
            while (!done_r[0])
                drain();
            wait_byte(in); /* the writer saw its write complete */
            done_r[1] = 1;
        }
        while ((!done_r[0] || !done_r[1]) && now() - t0 < 5)
            drain();
        alarm(0);
        if (rmr)
            fi_close(&rmr->fid);
        const char *what = "ok";
        size_t first = 0;
        if (!done_r[0] || !done_r[1])
            what = "STALL";
        else if (err_r[0] || err_r[1])
            what = "ERROR";
        else {
            for (int i = 0; i < SMALL && !first; i++)
                if (small[i] != pattern((size_t)i, t + 100))
                    first = (size_t)i + 1, what = "CORRUPT (short message)";
            for (size_t i = 0; i < len && !first; i++)
                if (big[i] != pattern(i, t))
                    first = i + 1, what = "CORRUPT (long message)";
        }
        printf("trial %2d, %5d us before the small receive%s: %s", t, us,
               long_first ? " (long one already done)" : "", what);
        if (first)
            printf(", first wrong byte %zu", first - 1);
        if (!done_r[0] || !done_r[1])
            printf(" (small %s, long %s)", done_r[0] ? "done" : "pending", done_r[1] ? "done" : "pending");
        printf("\n");
        bad |= strcmp(what, "ok") != 0;
        if (write(out, &c, 1) != 1)
            return 1;
        if (!strcmp(what, "STALL") || !strcmp(what, "ERROR"))
            break; /* rxd is in an unknown state: stop here */
        wait_byte(in);
    }
    if (pid) {
        kill(pid, 9);
        waitpid(pid, NULL, 0);
    }
    return bad;
}
