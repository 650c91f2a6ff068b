/*
 * rxm_multi_recv: libfabric-only reproducer (no MPI) for what hung ob1 over our BTL on
 * tcp;ofi_rxm (mpi_tests `collectives` at 4 ranks, Gather of 64 KiB fragments from
 * three peers at once) while the BTL received into multi-receive buffers.
 *
 *   cc -O1 rxm_multi_recv.c -o rxm_multi_recv -lfabric      (beside repro.h)
 *   ./rxm_multi_recv [PROVIDER [SIZE [COUNT [SENDERS]]]]   default: "tcp;ofi_rxm" 65544 200 3
 *
 * One receiver posts two multi-receive buffers of four messages each, with
 * FI_OPT_MIN_MULTI_RECV at one message, and reposts a buffer when its completion
 * carries FI_MULTI_RECV (what the BTL does). SENDERS processes each send it COUNT
 * messages (fi_send, four in flight; every third is 64 bytes, the others SIZE bytes),
 * each message a sender id, a sequence number, its length and bytes derived from them.
 * The receiver checks that every message arrives whole, inside its buffer and intact. It prints the first wrong one
 * ("SHORT", "OUTSIDE", "CORRUPT") or "STALL" when nothing arrives for 10 s, else "ok".
 * Exit status 1 on any of those.
 *
 * Seen with libfabric 1.17 (Debian 12): tcp;ofi_rxm at 65544 bytes (above
 * rxm's 16 KiB eager buffers) failed 4 runs of 4 ("SHORT: message 7 has 65544 bytes,
 * its header says 64", "CORRUPT: message #1 of sender 3 (at offset 131088 of its
 * buffer), byte 64": a small message written over a large one); at 8000 bytes it
 * passed 2 of 2. (Written for tcp;ofi_rxm only: on shm its fi_setopt before fi_enable
 * crashes inside libfabric 1.17; shm's own multi-receive problem is
 * shm_multi_recv_unexp.c.)
 */
#include "repro.h"
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXSEND 16
#define PER_BUF 4
#define INFLIGHT 4
#define SMALL 64

static uint8_t byte_at(uint64_t word, size_t i)
{
    return (uint8_t)(word * 31 + (uint64_t)i * 7);
}

/* A message: its word (sender id << 32 | sequence number), its length, then bytes
 * derived from the word. */
static void fill(uint8_t *m, size_t size, uint64_t word)
{
    uint64_t len = size;
    memcpy(m, &word, 8);
    memcpy(m + 8, &len, 8);
    for (size_t i = 16; i < size; i++)
        m[i] = byte_at(word, i);
}

static struct fid_ep *ep;
static struct fid_cq *cq;
static struct fid_av *av;

static void open_ep(const char *prov)
{
    repro_open(prov, FI_MSG | FI_MULTI_RECV, 0, FI_CQ_FORMAT_DATA, &ep, &cq, &av);
}

static int sender(const char *prov, uint32_t id, size_t size, unsigned count, int rfd)
{
    open_ep(prov);
    CK(fi_enable(ep));
    char pname[256];
    if (read(rfd, pname, 256) != 256)
        return 1;
    fi_addr_t peer;
    CK(fi_av_insert(av, pname, 1, &peer, 0, NULL) != 1);
    /* INFLIGHT sends at a time; every third message is small */
    uint8_t *m[INFLIGHT];
    struct fi_context ctx[INFLIGHT];
    for (int k = 0; k < INFLIGHT; k++)
        m[k] = malloc(size);
    unsigned done = 0;
    for (unsigned seq = 0; seq < count + INFLIGHT; seq++) {
        if (seq >= INFLIGHT) {
            /* wait for the send that used this slot */
            struct fi_cq_data_entry e;
            double t0 = now();
            for (;;) {
                ssize_t n = fi_cq_read(cq, &e, 1);
                if (n == 1) {
                    done++;
                    break;
                }
                if (n == -FI_EAVAIL) {
                    struct fi_cq_err_entry ee = { 0 };
                    fi_cq_readerr(cq, &ee, 0);
                    printf("[sender %u] error completion: %s\n", id, fi_strerror(ee.err));
                    return 1;
                }
                if (now() - t0 > 10) {
                    printf("[sender %u] STALL: %u of %u sends completed\n", id, done, count);
                    return 1;
                }
            }
        }
        if (seq >= count)
            continue;
        int k = (int)(seq % INFLIGHT);
        size_t len = seq % 3 == 2 ? SMALL : size;
        fill(m[k], len, (uint64_t)id << 32 | seq);
        ssize_t r;
        while ((r = fi_send(ep, m[k], len, NULL, peer, &ctx[k])) == -FI_EAGAIN)
            fi_cq_read(cq, NULL, 0);
        CK(r);
    }
    /* progress a little longer so that the receiver gets what it needs */
    double t0 = now();
    while (now() - t0 < 1)
        fi_cq_read(cq, NULL, 0);
    return 0;
}

int main(int argc, char **argv)
{
    const char *prov = argc > 1 ? argv[1] : "tcp;ofi_rxm";
    size_t size = argc > 2 ? strtoull(argv[2], NULL, 10) : 65544;
    unsigned count = argc > 3 ? (unsigned)atoi(argv[3]) : 200;
    int senders = argc > 4 ? atoi(argv[4]) : 3;
    if (size < 16 || senders < 1 || senders > MAXSEND)
        return 2;
    setvbuf(stdout, NULL, _IONBF, 0);
    int fds[MAXSEND][2];
    pid_t pids[MAXSEND];
    for (int s = 0; s < senders; s++) {
        if (pipe(fds[s]))
            return 1;
        pids[s] = fork();
        if (pids[s] == 0)
            return sender(prov, (uint32_t)s + 1, size, count, fds[s][0]);
    }
    open_ep(prov);
    CK(fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_MIN_MULTI_RECV, &size, sizeof(size)));
    CK(fi_enable(ep));
    size_t cap = PER_BUF * size;
    uint8_t *bufs[2];
    struct fi_context ctx[2];
    for (int b = 0; b < 2; b++) {
        bufs[b] = malloc(cap);
        struct iovec iov = { bufs[b], cap };
        struct fi_msg msg = { .msg_iov = &iov, .iov_count = 1, .addr = FI_ADDR_UNSPEC, .context = &ctx[b] };
        CK(fi_recvmsg(ep, &msg, FI_MULTI_RECV));
    }
    char name[256] = { 0 };
    size_t nlen = sizeof(name);
    CK(fi_getname(&ep->fid, name, &nlen));
    for (int s = 0; s < senders; s++)
        if (write(fds[s][1], name, 256) != 256)
            return 1;
    unsigned long want = (unsigned long)count * (unsigned)senders, got = 0;
    int bad = 0;
    double last = now();
    while (got < want && !bad) {
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
                printf("[receiver] STALL: %lu of %lu messages, nothing for 10 s\n", got, want);
                bad = 1;
            }
            continue;
        }
        last = now();
        int b = (int)((struct fi_context *)e.op_context - ctx);
        if (e.len > 0) {
            uint8_t *at = e.buf;
            uint64_t word = 0, len = 0;
            if (at >= bufs[b] && at + 16 <= bufs[b] + cap)
                memcpy(&len, at + 8, 8);
            if (e.len != len || (len != size && len != SMALL)) {
                printf("[receiver] SHORT: message %lu has %zu bytes, its header says %llu\n", got, e.len,
                       (unsigned long long)len);
                bad = 1;
            } else if (at < bufs[b] || at + e.len > bufs[b] + cap) {
                printf("[receiver] OUTSIDE: a %zu-byte message at offset %td of a %zu-byte buffer\n", e.len,
                       at - bufs[b], cap);
                bad = 1;
            } else {
                memcpy(&word, at, 8);
                for (size_t i = 16; i < len && !bad; i++)
                    if (at[i] != byte_at(word, i)) {
                        printf("[receiver] CORRUPT: message #%u of sender %u (at offset %td of its "
                               "buffer), byte %zu\n",
                               (unsigned)word, (unsigned)(word >> 32), at - bufs[b], i);
                        bad = 1;
                    }
            }
            got++;
        }
        if (e.flags & FI_MULTI_RECV) {
            struct iovec iov = { bufs[b], cap };
            struct fi_msg msg = { .msg_iov = &iov, .iov_count = 1, .addr = FI_ADDR_UNSPEC, .context = &ctx[b] };
            CK(fi_recvmsg(ep, &msg, FI_MULTI_RECV));
        }
    }
    if (!bad)
        printf("[receiver] ok: %lu messages of %zu bytes from %d senders, whole and intact\n", got, size,
               senders);
    for (int s = 0; s < senders; s++) {
        int st = 0;
        if (bad)
            kill(pids[s], SIGKILL);
        waitpid(pids[s], &st, 0);
        bad |= !bad && (!WIFEXITED(st) || WEXITSTATUS(st));
    }
    return bad;
}
