/*
 * shm_multi_recv_unexp: libfabric-only reproducer (no MPI) for what hung mpi_tests
 * `many_posted` (10,000 small messages sent before the receiver posts) under both of
 * our components on shm while they received into multi-receive buffers.
 *
 *   cc -O1 shm_multi_recv_unexp.c -o shm_multi_recv_unexp -lfabric      (beside repro.h)
 *   ./shm_multi_recv_unexp [PROVIDER [COUNT [DELAY_MS [SINGLE]]]]   default: shm 10000 500 0
 *
 * A sender process sends COUNT messages of 24 bytes (a sequence number, the length,
 * then bytes derived from them), posting each again on -FI_EAGAIN after reading its
 * completion queue. The receiver posts nothing for DELAY_MS, so the messages arrive
 * with no buffer posted, then posts two multi-receive buffers of 262,176 bytes with
 * FI_OPT_MIN_MULTI_RECV at 65,544 (the BTL's layout) and reposts a buffer when its
 * completion carries FI_MULTI_RECV. With SINGLE=1 it posts 8 plain receive buffers
 * instead (what the components do on shm). It checks that every
 * message arrives once, in order and intact, and prints "ok", the first wrong one, or
 * "STALL" when nothing arrives for 10 s. Exit status 1 on any of those.
 *
 * Seen with libfabric 1.17 (Debian 12): with 2,000 or 10,000 messages and
 * the 500 ms delay, posting the first multi-receive buffer fails with -FI_ENOMEM
 * ("r = -12 (Cannot allocate memory)") while the sender stalls at message 1024 (shm
 * holds 1,024 unexpected messages); 1,000 messages, or no delay, or SINGLE=1 with
 * 10,000: "ok". The components lost such a buffer (a receive that cannot be posted
 * again), so nothing more arrived.
 */
#include "repro.h"
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define MSG 24
#define CAP 262176
#define MIN_FREE 65544
#define NSINGLE 8

static struct fid_ep *ep;
static struct fid_cq *cq;
static struct fid_av *av;

static void open_ep(const char *prov)
{
    repro_open(prov, FI_MSG | FI_MULTI_RECV, 0, FI_CQ_FORMAT_DATA, &ep, &cq, &av);
}

static void fill(uint8_t *m, uint64_t seq)
{
    uint64_t len = MSG;
    memcpy(m, &seq, 8);
    memcpy(m + 8, &len, 8);
    for (size_t i = 16; i < MSG; i++)
        m[i] = (uint8_t)(seq * 31 + i * 7);
}

static int sender(const char *prov, unsigned count, int rfd)
{
    open_ep(prov);
    CK(fi_enable(ep));
    char pname[256];
    if (read(rfd, pname, 256) != 256)
        return 1;
    fi_addr_t peer;
    CK(fi_av_insert(av, pname, 1, &peer, 0, NULL) != 1);
    uint8_t m[MSG];
    double t0 = now();
    for (unsigned seq = 0; seq < count; seq++) {
        fill(m, seq);
        ssize_t r;
        while ((r = fi_inject(ep, m, MSG, peer)) == -FI_EAGAIN) {
            fi_cq_read(cq, NULL, 0);
            if (now() - t0 > 30) {
                printf("[sender] STALL: message %u of %u not accepted for 30 s\n", seq, count);
                return 1;
            }
        }
        CK(r);
    }
    /* progress a little longer so that the receiver gets what it needs */
    t0 = now();
    while (now() - t0 < 2)
        fi_cq_read(cq, NULL, 0);
    return 0;
}

static void post(uint8_t *buf, size_t cap, struct fi_context *ctx, int multi)
{
    struct iovec iov = { buf, cap };
    struct fi_msg msg = { .msg_iov = &iov, .iov_count = 1, .addr = FI_ADDR_UNSPEC, .context = ctx };
    ssize_t r;
    while ((r = fi_recvmsg(ep, &msg, multi ? FI_MULTI_RECV : 0)) == -FI_EAGAIN)
        fi_cq_read(cq, NULL, 0);
    CK(r);
}

int main(int argc, char **argv)
{
    const char *prov = argc > 1 ? argv[1] : "shm";
    unsigned count = argc > 2 ? (unsigned)atoi(argv[2]) : 10000;
    int delay_ms = argc > 3 ? atoi(argv[3]) : 500;
    int single = argc > 4 ? atoi(argv[4]) : 0;
    setvbuf(stdout, NULL, _IONBF, 0);
    int fds[2];
    if (pipe(fds))
        return 1;
    pid_t pid = fork();
    if (pid == 0)
        return sender(prov, count, fds[0]);
    open_ep(prov);
    size_t min_free = MIN_FREE;
    CK(fi_enable(ep));
    /* after fi_enable, as the components do (before it shm 1.17 crashes) */
    if (!single)
        CK(fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &min_free, sizeof(min_free)));
    char name[256] = { 0 };
    size_t nlen = sizeof(name);
    CK(fi_getname(&ep->fid, name, &nlen));
    if (write(fds[1], name, 256) != 256)
        return 1;
    /* let the messages arrive with nothing posted (progressing, as MPI would) */
    double t0 = now();
    while (now() - t0 < delay_ms / 1000.0)
        fi_cq_read(cq, NULL, 0);
    int nbuf = single ? NSINGLE : 2;
    size_t cap = single ? MSG : CAP;
    uint8_t *bufs[NSINGLE];
    struct fi_context ctx[NSINGLE];
    for (int b = 0; b < nbuf; b++) {
        bufs[b] = malloc(cap);
        post(bufs[b], cap, &ctx[b], !single);
    }
    unsigned long got = 0;
    int bad = 0;
    double last = now();
    while (got < count && !bad) {
        struct fi_cq_data_entry e;
        ssize_t n = fi_cq_read(cq, &e, 1);
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry ee = { 0 };
            fi_cq_readerr(cq, &ee, 0);
            printf("[receiver] error completion: %s\n", fi_strerror(ee.err));
            bad = 1;
            break;
        }
        if (n != 1) {
            if (now() - last > 10) {
                printf("[receiver] STALL: %lu of %u messages, nothing for 10 s\n", got, count);
                bad = 1;
            }
            continue;
        }
        last = now();
        int b = (int)((struct fi_context *)e.op_context - ctx);
        if (e.len > 0) {
            uint8_t *at = single ? bufs[b] : e.buf, want[MSG];
            fill(want, got);
            if (e.len != MSG || at < bufs[b] || at + MSG > bufs[b] + cap || memcmp(at, want, MSG)) {
                uint64_t seq = 0;
                if (at >= bufs[b] && at + 8 <= bufs[b] + cap)
                    memcpy(&seq, at, 8);
                printf("[receiver] WRONG: message %lu: %zu bytes at offset %td, sequence number %llu\n", got,
                       e.len, at - bufs[b], (unsigned long long)seq);
                bad = 1;
            }
            got++;
        }
        if (single || (e.flags & FI_MULTI_RECV))
            post(bufs[b], cap, &ctx[b], !single);
    }
    if (!bad)
        printf("[receiver] ok: %lu messages in order and intact (%s)\n", got,
               single ? "one buffer per message" : "multi-receive buffers");
    int st = 0;
    if (bad)
        kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    bad |= !bad && (!WIFEXITED(st) || WEXITSTATUS(st));
    return bad;
}
