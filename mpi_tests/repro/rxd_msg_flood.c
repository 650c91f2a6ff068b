/*
 * rxd_msg_flood: libfabric-only reproducer (no MPI) for what fails `many_posted` over
 * udp;ofi_rxd under our MTL's software matching: two processes flood each other with
 * small untagged messages while each keeps a few receive buffers posted, reposting
 * each buffer as soon as its completion is read (what the MTL's bounce buffers do).
 *
 *   cc -O1 rxd_msg_flood.c -o rxd_msg_flood -lfabric      (beside repro.h)
 *   ./rxd_msg_flood [PROVIDER [COUNT [BUFFERS [send [WINDOW]]]]]
 *   default: "udp;ofi_rxd" 5000 64 (injects); "send": fi_send, WINDOW (default 1) in flight
 *
 * Every message is 64 bytes: a sequence number and 56 bytes derived from it. Each
 * process sends COUNT of them (fi_inject, or fi_send with a completion each and at most
 * WINDOW in flight when "send" is given) and checks that it receives COUNT, in order,
 * intact. It prints the first wrong message ("OUT OF ORDER", "CORRUPT", "SHORT") or
 * "STALL" when nothing arrives for 10 s, else "ok". Exit status 1 on any of those.
 */
#include "repro.h"
#include <sys/wait.h>
#include <unistd.h>

#define MSG 64
#define MAXBUF 1024

static void fill(uint8_t *m, uint64_t seq)
{
    memcpy(m, &seq, 8);
    for (int i = 8; i < MSG; i++)
        m[i] = (uint8_t)(seq * 31 + (uint64_t)i * 7);
}

static struct fid_ep *ep;
static struct fid_cq *cq;
static uint8_t bufs[MAXBUF][MSG * 2];
#define MAXWIN 1024
static struct fi_context rctx[MAXBUF], sctx[MAXWIN];
/* Send slots: a buffer and a context each; the free ones are stacked in sfree. */
static uint8_t sbuf[MAXWIN][MSG];
static int sfree[MAXWIN], nfree;
static uint64_t send_done;
static uint64_t expect, received, count;
static int bad, who;

static void post(int i)
{
    ssize_t r;
    while ((r = fi_recv(ep, bufs[i], sizeof(bufs[i]), NULL, FI_ADDR_UNSPEC, &rctx[i])) == -FI_EAGAIN)
        ;
    CK(r);
}

/* Read completions; returns how many receives completed. */
static int drain(void)
{
    struct fi_cq_msg_entry e[16];
    ssize_t n = fi_cq_read(cq, e, 16);
    int got = 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry ee = { 0 };
        fi_cq_readerr(cq, &ee, 0);
        printf("[%d] error completion: %s\n", who, fi_strerror(ee.err));
        bad = 1;
        return 0;
    }
    for (ssize_t k = 0; k < n; k++) {
        if (e[k].flags & FI_SEND) {
            sfree[nfree++] = (int)((struct fi_context *)e[k].op_context - sctx);
            send_done++;
            continue;
        }
        if (!(e[k].flags & FI_RECV))
            continue;
        int i = (int)((struct fi_context *)e[k].op_context - rctx);
        uint8_t want[MSG];
        uint64_t seq;
        memcpy(&seq, bufs[i], 8);
        fill(want, expect);
        if (!bad && e[k].len != MSG) {
            printf("[%d] SHORT: message #%llu has %zu bytes, not %d\n", who, (unsigned long long)expect,
                   e[k].len, MSG);
            bad = 1;
        } else if (!bad && seq != expect) {
            printf("[%d] OUT OF ORDER: expected message #%llu, got #%llu\n", who, (unsigned long long)expect,
                   (unsigned long long)seq);
            bad = 1;
        } else if (!bad && memcmp(want, bufs[i], MSG)) {
            printf("[%d] CORRUPT: message #%llu has wrong bytes\n", who, (unsigned long long)expect);
            bad = 1;
        }
        expect++;
        received++;
        got++;
        post(i);
    }
    return got;
}

int main(int argc, char **argv)
{
    const char *prov = argc > 1 ? argv[1] : "udp;ofi_rxd";
    count = argc > 2 ? strtoull(argv[2], NULL, 10) : 5000;
    int nbuf = argc > 3 ? atoi(argv[3]) : 64;
    int use_send = argc > 4 && !strcmp(argv[4], "send");
    int window = argc > 5 ? atoi(argv[5]) : 1;
    if (nbuf < 1 || nbuf > MAXBUF || window < 1 || window > MAXWIN)
        return 2;
    for (int s = 0; s < window; s++)
        sfree[nfree++] = s;
    setvbuf(stdout, NULL, _IONBF, 0);
    int a2b[2], b2a[2];
    if (pipe(a2b) || pipe(b2a))
        return 1;
    pid_t pid = fork();
    who = pid == 0;
    struct fid_av *av;
    repro_open(prov, FI_MSG, FI_ORDER_SAS, FI_CQ_FORMAT_MSG, &ep, &cq, &av);
    CK(fi_enable(ep));
    char name[256] = { 0 }, pname[256];
    size_t nlen = sizeof(name);
    CK(fi_getname(&ep->fid, name, &nlen));
    if (write(who ? b2a[1] : a2b[1], name, 256) != 256 || read(who ? a2b[0] : b2a[0], pname, 256) != 256)
        return 1;
    fi_addr_t peer;
    CK(fi_av_insert(av, pname, 1, &peer, 0, NULL) != 1);
    for (int i = 0; i < nbuf; i++)
        post(i);
    char go = 1;
    if (write(who ? b2a[1] : a2b[1], &go, 1) != 1 || read(who ? a2b[0] : b2a[0], &go, 1) != 1)
        return 1;

    uint8_t m[MSG];
    uint64_t sent = 0;
    double last = now();
    while ((sent < count || received < count || (use_send && send_done < count)) && !bad) {
        if (sent < count && (!use_send || nfree > 0)) {
            ssize_t r;
            if (use_send) {
                int slot = sfree[nfree - 1];
                fill(sbuf[slot], sent);
                r = fi_send(ep, sbuf[slot], MSG, NULL, peer, &sctx[slot]);
                if (r == 0)
                    nfree--;
            } else {
                fill(m, sent);
                r = fi_inject(ep, m, MSG, peer);
            }
            if (r == 0) {
                sent++;
                last = now();
                continue;
            }
            if (r != -FI_EAGAIN)
                CK(r);
        }
        if (drain() > 0)
            last = now();
        else if (now() - last > 10) {
            printf("[%d] STALL: sent %llu of %llu, received %llu of %llu, nothing for 10 s\n", who,
                   (unsigned long long)sent, (unsigned long long)count, (unsigned long long)received,
                   (unsigned long long)count);
            bad = 1;
        }
    }
    /* keep progressing a little so that the peer gets its acknowledgements */
    double t0 = now();
    while (now() - t0 < 1)
        drain();
    if (!bad)
        printf("[%d] ok: %llu messages sent and %llu received in order\n", who, (unsigned long long)count,
               (unsigned long long)received);
    if (pid) {
        int st = 0;
        waitpid(pid, &st, 0);
        bad |= !WIFEXITED(st) || WEXITSTATUS(st);
    }
    return bad;
}
