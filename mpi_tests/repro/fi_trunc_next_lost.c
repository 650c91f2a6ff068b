/*
 * fi_trunc_next_lost: libfabric-only reproducer (no MPI) for the provider behaviour that
 * makes the truncation program hang over tcp: after a truncated tagged receive, the next
 * message from the same peer is never delivered (libfabric 1.17, tcp;ofi_rxm). It also
 * shows how providers report truncation (udp;ofi_rxd 1.17 reports none: a successful
 * completion with len 0).
 *
 *   cc -O1 fi_trunc_next_lost.c -o fi_trunc_next_lost -lfabric      (beside repro.h)
 *   ./fi_trunc_next_lost PROVIDER MSG_LEN RECV_LEN [send]   e.g.  ./fi_trunc_next_lost tcp 1 0
 *
 * A child process (receiver) preposts a tagged receive of RECV_LEN bytes (tag 5) and one
 * of 100 bytes (tag 6); the parent sends MSG_LEN bytes with tag 5 (fi_tinject when it
 * fits and "send" is not given, else fi_tsend) and then 100 bytes with tag 6. The child
 * prints both completions, or "LOST" after 5 s.
 */
#include "repro.h"
#include <rdma/fi_tagged.h>
#include <fcntl.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s PROVIDER MSG_LEN RECV_LEN [send]\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    size_t msg = (size_t)atoi(argv[2]), rl = (size_t)atoi(argv[3]);
    int p2c[2], c2p[2];
    if (pipe(p2c) || pipe(c2p))
        return 1;
    int child = fork() == 0; /* child receives, parent sends */
    struct fid_ep *ep;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fi_info *fi = repro_open(argv[1], FI_TAGGED, 0, FI_CQ_FORMAT_TAGGED, &ep, &cq, &av);
    CK(fi_enable(ep));
    char name[256] = { 0 }, pname[256];
    size_t nlen = sizeof(name);
    CK(fi_getname(&ep->fid, name, &nlen));
    if (write(child ? c2p[1] : p2c[1], name, 256) != 256 || read(child ? p2c[0] : c2p[0], pname, 256) != 256)
        return 1;
    fi_addr_t peer;
    CK(fi_av_insert(av, pname, 1, &peer, 0, NULL) != 1);
    static char sbuf[1 << 20], r1[1 << 20], r2[4096];
    struct fi_context c1, c2, c3, c4;
    ssize_t r;
    char go = 1;
    if (child) {
        CK(fi_trecv(ep, r1, rl, NULL, peer, 5, 0, &c1));
        CK(fi_trecv(ep, r2, 100, NULL, peer, 6, 0, &c2));
        if (write(c2p[1], &go, 1) != 1)
            return 1;
        int got = 0;
        double t0 = now();
        while (got < 2 && now() - t0 < 5) {
            struct fi_cq_tagged_entry e;
            r = fi_cq_read(cq, &e, 1);
            if (r == 1) {
                printf("completion: %s receive, len=%zu tag=%lu\n", e.op_context == &c1 ? "short" : "follow-up",
                       e.len, (unsigned long)e.tag);
                got++;
            } else if (r == -FI_EAVAIL) {
                struct fi_cq_err_entry ee = { 0 };
                fi_cq_readerr(cq, &ee, 0);
                printf("error completion: %s receive, err=%s len=%zu olen=%zu\n",
                       ee.op_context == &c1 ? "short" : "follow-up", fi_strerror(ee.err), ee.len, ee.olen);
                got++;
            }
        }
        printf("%s\n", got == 2 ? "both receives completed" : "LOST: a receive never completed");
        if (write(c2p[1], &go, 1) != 1)
            return 1;
    } else {
        if (read(c2p[0], &go, 1) != 1)
            return 1;
        if (msg <= fi->tx_attr->inject_size && argc < 5) {
            while ((r = fi_tinject(ep, sbuf, msg, peer, 5)) == -FI_EAGAIN)
                fi_cq_read(cq, NULL, 0);
        } else {
            while ((r = fi_tsend(ep, sbuf, msg, NULL, peer, 5, &c3)) == -FI_EAGAIN)
                fi_cq_read(cq, NULL, 0);
        }
        CK(r);
        while ((r = fi_tsend(ep, sbuf, 100, NULL, peer, 6, &c4)) == -FI_EAGAIN)
            fi_cq_read(cq, NULL, 0);
        CK(r);
        fcntl(c2p[0], F_SETFL, O_NONBLOCK);
        double t0 = now();
        while (now() - t0 < 7) { /* progress until the child is done */
            struct fi_cq_tagged_entry e;
            fi_cq_read(cq, &e, 1);
            if (read(c2p[0], &go, 1) == 1)
                break;
        }
    }
    return 0;
}
