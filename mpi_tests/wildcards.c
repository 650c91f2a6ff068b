/*
 * wildcards: MPI_ANY_SOURCE, MPI_ANY_TAG, their combination, and the ordering rules
 * (non-overtaking between a pair on one communicator; a message matches the first posted
 * receive that fits; a receive matches the first queued message that fits).
 *
 * Message i from a sender has size msg_size(i), cycling through small, inject+1, zero,
 * 64 KiB and 256 KiB (eager and rendezvous mixed, so ordering must hold across protocols),
 * and a pattern seeded by (sender, receiver, test, i). A wrong message is named
 * ("got message #j instead of #i") when it can be identified.
 *
 * Options: --inject N, --msgs N (messages per sender in the fan-in tests, default 24).
 */
#include "common.h"

static MPI_Comm comm;
static size_t cycle[6];

static size_t msg_size(int i)
{
    return cycle[i % 6];
}

static uint64_t msg_seed(int src, int dst, int test, int i)
{
    return t_seed((uint64_t)src, (uint64_t)dst, (uint64_t)test, (uint64_t)i);
}

static int msg_tag(int test, int i)
{
    /* Tags vary per message so that ANY_TAG receives can check them. */
    return 10 + test * 100 + (i * 7) % 13;
}

/* Checks that buf holds message #i (of nmsg) from src; names the message it holds if not. */
static void check_msg(const uint8_t *buf, const MPI_Status *st, int src, int test, int i, int nmsg, int tag,
                      const char *what)
{
    char w[400];
    size_t len = msg_size(i);
    int cnt = -1;
    MPI_Get_count(st, MPI_BYTE, &cnt);
    if (st->MPI_SOURCE == src && (size_t)cnt == len && st->MPI_TAG == tag) {
        /* Quick path: the envelope fits; now the bytes must. */
        int ok = 1;
        for (size_t k = 0; k < len && ok; k++)
            ok = buf[k] == t_pat(msg_seed(src, t_rank, test, i), k);
        if (ok)
            return;
    }
    /* Something is wrong: try to name the message that arrived. */
    for (int j = 0; j < nmsg; j++) {
        if (j == i || msg_size(j) != (size_t)cnt || msg_size(j) == 0 || st->MPI_SOURCE < 0 ||
            st->MPI_SOURCE >= t_size)
            continue;
        int ok = 1;
        for (size_t k = 0; k < msg_size(j) && ok; k++)
            ok = buf[k] == t_pat(msg_seed(st->MPI_SOURCE, t_rank, test, j), k);
        if (ok)
            t_fail("%s: expected message #%d from rank %d (tag %d, %zu bytes) but got message #%d from rank %d "
                   "(tag %d): ordering violated",
                   what, i, src, tag, len, j, st->MPI_SOURCE, st->MPI_TAG);
    }
    snprintf(w, sizeof(w), "%s message #%d from %d", what, i, src);
    t_check_status_bytes(st, src, tag, len, w);
    t_check(buf, len, msg_seed(src, t_rank, test, i), w);
}

/*
 * Fan-in to each root in turn: every other rank Isends nmsg messages; the root receives
 * them with the given (source, tag) wildcards and checks per-sender order.
 */
static void fan_in(int test, int any_source, int any_tag, int nmsg)
{
    size_t maxlen = 0;
    for (int i = 0; i < 6; i++)
        maxlen = cycle[i] > maxlen ? cycle[i] : maxlen;
    for (int root = 0; root < t_size; root++) {
        t_section("fan-in test=%d any_source=%d any_tag=%d root=%d", test, any_source, any_tag, root);
        if (t_rank == root) {
            int *next = calloc((size_t)t_size, sizeof(int));
            uint8_t *buf = t_malloc(maxlen + 64);
            int total = (t_size - 1) * nmsg;
            for (int k = 0; k < total; k++) {
                MPI_Status st;
                int src = any_source ? MPI_ANY_SOURCE : (root + 1 + k % (t_size - 1)) % t_size;
                int tag;
                if (any_source) {
                    /* With a specific tag we must know which tag to ask for: use a fixed one. */
                    tag = any_tag ? MPI_ANY_TAG : 5;
                } else {
                    tag = any_tag ? MPI_ANY_TAG : msg_tag(test, next[src]);
                }
                memset(buf, 0xee, maxlen + 64);
                t_status_init(&st);
                T_CHECK_MPI(MPI_Recv(buf, (int)maxlen + 64, MPI_BYTE, src, tag, comm, &st));
                int s = st.MPI_SOURCE;
                if (s < 0 || s >= t_size || s == root)
                    t_fail("fan-in: status.MPI_SOURCE %d is not a sender", s);
                if (!any_source && s != src)
                    t_fail("fan-in: asked for source %d, status.MPI_SOURCE says %d", src, s);
                if (next[s] >= nmsg)
                    t_fail("fan-in: more than %d messages from rank %d", nmsg, s);
                int exp_tag = (any_source && !any_tag) ? 5 : msg_tag(test, next[s]);
                char w[128];
                snprintf(w, sizeof(w), "fan-in root=%d", root);
                check_msg(buf, &st, s, test, next[s], nmsg, exp_tag, w);
                t_check_const(buf + msg_size(next[s]), 64, 0xee, "fan-in guard bytes");
                next[s]++;
            }
            for (int s = 0; s < t_size; s++)
                if (s != root && next[s] != nmsg)
                    t_fail("fan-in: got %d of %d messages from rank %d", next[s], nmsg, s);
            free(next);
            free(buf);
        } else {
            MPI_Request *req = t_malloc(sizeof(MPI_Request) * (size_t)nmsg);
            uint8_t **bufs = t_malloc(sizeof(uint8_t *) * (size_t)nmsg);
            for (int i = 0; i < nmsg; i++) {
                int tag = (any_source && !any_tag) ? 5 : msg_tag(test, i);
                bufs[i] = t_malloc(msg_size(i));
                t_fill(bufs[i], msg_size(i), msg_seed(t_rank, root, test, i));
                T_CHECK_MPI(MPI_Isend(bufs[i], (int)msg_size(i), MPI_BYTE, root, tag, comm, &req[i]));
            }
            T_CHECK_MPI(MPI_Waitall(nmsg, req, MPI_STATUSES_IGNORE));
            for (int i = 0; i < nmsg; i++)
                free(bufs[i]);
            free(bufs);
            free(req);
        }
        T_CHECK_MPI(MPI_Barrier(comm));
    }
}

/*
 * Posted-receive order: the receiver posts three receives that all fit the sender's
 * messages; message k must land in receive k.
 */
static void posted_order(int variant)
{
    for (int sender = 0; sender < t_size; sender++) {
        int recvr = (sender + 1) % t_size;
        int test = 20 + variant;
        t_section("posted-order variant=%d %d->%d", variant, sender, recvr);
        /* variant 0: (src,ANY) (ANY,5) (ANY,ANY); sender sends tag 5 x3
         * variant 1: (ANY,6) (src,5) (ANY,ANY); sender sends tags 5,6,5 -> recv 1,0,2 */
        int stags[3] = { 5, variant ? 6 : 5, 5 };
        int rsrc[3], rtag[3], which[3];
        if (variant == 0) {
            rsrc[0] = sender; rtag[0] = MPI_ANY_TAG;
            rsrc[1] = MPI_ANY_SOURCE; rtag[1] = 5;
            rsrc[2] = MPI_ANY_SOURCE; rtag[2] = MPI_ANY_TAG;
            which[0] = 0; which[1] = 1; which[2] = 2;
        } else {
            rsrc[0] = MPI_ANY_SOURCE; rtag[0] = 6;
            rsrc[1] = sender; rtag[1] = 5;
            rsrc[2] = MPI_ANY_SOURCE; rtag[2] = MPI_ANY_TAG;
            which[0] = 1; which[1] = 0; which[2] = 2;  /* receive r gets message which[r] */
        }
        if (t_rank == recvr) {
            MPI_Request req[3];
            MPI_Status st[3];
            uint8_t *buf[3];
            for (int r = 0; r < 3; r++) {
                buf[r] = t_malloc(msg_size(3) + 64);
                memset(buf[r], 0xee, msg_size(3) + 64);
                T_CHECK_MPI(MPI_Irecv(buf[r], (int)msg_size(3) + 64, MPI_BYTE, rsrc[r], rtag[r], comm, &req[r]));
            }
            t_status_init_n(st, 3);
            T_CHECK_MPI(MPI_Barrier(comm));
            T_CHECK_MPI(MPI_Waitall(3, req, st));
            for (int r = 0; r < 3; r++) {
                char w[128];
                snprintf(w, sizeof(w), "posted receive #%d", r);
                check_msg(buf[r], &st[r], sender, test, which[r], 3, stags[which[r]], w);
                free(buf[r]);
            }
        } else if (t_rank == sender) {
            uint8_t *buf[3];
            MPI_Request req[3];
            T_CHECK_MPI(MPI_Barrier(comm));
            for (int i = 0; i < 3; i++) {
                buf[i] = t_malloc(msg_size(i));
                t_fill(buf[i], msg_size(i), msg_seed(sender, recvr, test, i));
                T_CHECK_MPI(MPI_Isend(buf[i], (int)msg_size(i), MPI_BYTE, recvr, stags[i], comm, &req[i]));
            }
            T_CHECK_MPI(MPI_Waitall(3, req, MPI_STATUSES_IGNORE));
            for (int i = 0; i < 3; i++)
                free(buf[i]);
        } else {
            T_CHECK_MPI(MPI_Barrier(comm));
        }
        T_CHECK_MPI(MPI_Barrier(comm));
    }
}

/*
 * Unexpected-queue order: the sender Isends tags 1,2,3,1,2,3 before the receiver posts
 * anything; the receiver then picks them out selectively and must always get the first
 * queued message that fits.
 */
static void unexpected_order(void)
{
    const int tags[6] = { 1, 2, 3, 1, 2, 3 };
    for (int sender = 0; sender < t_size; sender++) {
        int recvr = (sender + t_size - 1) % t_size;
        int test = 30;
        t_section("unexpected-order %d->%d", sender, recvr);
        if (t_rank == sender) {
            MPI_Request req[6];
            uint8_t *buf[6];
            for (int i = 0; i < 6; i++) {
                buf[i] = t_malloc(msg_size(i));
                t_fill(buf[i], msg_size(i), msg_seed(sender, recvr, test, i));
                T_CHECK_MPI(MPI_Isend(buf[i], (int)msg_size(i), MPI_BYTE, recvr, tags[i], comm, &req[i]));
            }
            T_CHECK_MPI(MPI_Barrier(comm));
            T_CHECK_MPI(MPI_Waitall(6, req, MPI_STATUSES_IGNORE));
            for (int i = 0; i < 6; i++)
                free(buf[i]);
        } else if (t_rank == recvr) {
            /* (source, tag) asked for -> message index expected */
            const int rs[6] = { MPI_ANY_SOURCE, MPI_ANY_SOURCE, sender, MPI_ANY_SOURCE, MPI_ANY_SOURCE, sender };
            const int rt[6] = { 2, MPI_ANY_TAG, 3, MPI_ANY_TAG, 3, MPI_ANY_TAG };
            const int exp[6] = { 1, 0, 2, 3, 5, 4 };
            size_t maxlen = 262144 + 64;
            uint8_t *buf = t_malloc(maxlen);
            T_CHECK_MPI(MPI_Barrier(comm));
            t_sleep_ms(20); /* let eager messages land in the unexpected queue */
            for (int k = 0; k < 6; k++) {
                MPI_Status st;
                char w[128];
                t_status_init(&st);
                memset(buf, 0xee, maxlen);
                T_CHECK_MPI(MPI_Recv(buf, (int)maxlen, MPI_BYTE, rs[k], rt[k], comm, &st));
                snprintf(w, sizeof(w), "selective receive #%d (source %d, tag %d)", k, rs[k], rt[k]);
                check_msg(buf, &st, sender, test, exp[k], 6, tags[exp[k]], w);
            }
            free(buf);
        } else {
            T_CHECK_MPI(MPI_Barrier(comm));
        }
        T_CHECK_MPI(MPI_Barrier(comm));
    }
}

/* ANY_SOURCE receives posted before the messages, mixed with named receives. */
static void mixed_preposted(void)
{
    int test = 40;
    int n = t_size - 1;
    size_t len = msg_size(1);
    t_section("mixed preposted any-source/named");
    /* Each rank receives one message from each other rank: half through named receives
     * posted first, the rest through ANY_SOURCE receives. */
    MPI_Request *req = t_malloc(sizeof(MPI_Request) * (size_t)(2 * n));
    MPI_Status *st = t_malloc(sizeof(MPI_Status) * (size_t)(2 * n));
    uint8_t *rbuf = t_malloc((len + 8) * (size_t)n), *sbuf = t_malloc((len + 8) * (size_t)n);
    int named = n / 2;
    for (int k = 0; k < named; k++) {
        int src = (t_rank + 1 + k) % t_size;
        T_CHECK_MPI(MPI_Irecv(rbuf + (size_t)k * (len + 8), (int)len + 8, MPI_BYTE, src, 77, comm, &req[k]));
    }
    for (int k = named; k < n; k++)
        T_CHECK_MPI(MPI_Irecv(rbuf + (size_t)k * (len + 8), (int)len + 8, MPI_BYTE, MPI_ANY_SOURCE, 77, comm, &req[k]));
    T_CHECK_MPI(MPI_Barrier(comm));
    for (int k = 0; k < n; k++) {
        int dst = (t_rank + t_size - 1 - k) % t_size;
        t_fill(sbuf + (size_t)k * (len + 8), len, msg_seed(t_rank, dst, test, 1));
        T_CHECK_MPI(MPI_Isend(sbuf + (size_t)k * (len + 8), (int)len, MPI_BYTE, dst, 77, comm, &req[n + k]));
    }
    t_status_init_n(st, 2 * n);
    T_CHECK_MPI(MPI_Waitall(2 * n, req, st));
    int *seen = calloc((size_t)t_size, sizeof(int));
    for (int k = 0; k < n; k++) {
        int s = st[k].MPI_SOURCE;
        if (k < named && s != (t_rank + 1 + k) % t_size)
            t_fail("named receive from %d completed with MPI_SOURCE %d", (t_rank + 1 + k) % t_size, s);
        if (s < 0 || s >= t_size || s == t_rank || seen[s]++)
            t_fail("receive #%d: bad or duplicate MPI_SOURCE %d", k, s);
        check_msg(rbuf + (size_t)k * (len + 8), &st[k], s, test, 1, 2, 77, "mixed preposted");
    }
    free(seen);
    free(req);
    free(st);
    free(rbuf);
    free(sbuf);
    T_CHECK_MPI(MPI_Barrier(comm));
}

/* The same tag on two communicators never cross-matches, even with wildcards. */
static void comm_isolation(void)
{
    MPI_Comm c2;
    int peer = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    uint8_t a[16], b[16], ra[16], rb[16];
    MPI_Request req[4];
    MPI_Status st[4];
    t_section("communicator isolation with wildcards");
    T_CHECK_MPI(MPI_Comm_dup(comm, &c2));
    t_fill(a, 16, t_seed(50, (uint64_t)t_rank, 0, 0));
    t_fill(b, 16, t_seed(50, (uint64_t)t_rank, 1, 0));
    /* Receive on c2 first (wildcards), then on comm; send on comm first. */
    T_CHECK_MPI(MPI_Irecv(rb, 16, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, c2, &req[0]));
    T_CHECK_MPI(MPI_Irecv(ra, 16, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &req[1]));
    T_CHECK_MPI(MPI_Isend(a, 16, MPI_BYTE, peer, 9, comm, &req[2]));
    T_CHECK_MPI(MPI_Barrier(comm));
    T_CHECK_MPI(MPI_Isend(b, 16, MPI_BYTE, peer, 9, c2, &req[3]));
    t_status_init_n(st, 4);
    T_CHECK_MPI(MPI_Waitall(4, req, st));
    t_check_status_bytes(&st[0], from, 9, 16, "c2 receive");
    t_check_status_bytes(&st[1], from, 9, 16, "comm receive");
    t_check(rb, 16, t_seed(50, (uint64_t)from, 1, 0), "message on the second communicator");
    t_check(ra, 16, t_seed(50, (uint64_t)from, 0, 0), "message on the first communicator");
    T_CHECK_MPI(MPI_Comm_free(&c2));
}

int main(int argc, char **argv)
{
    int nmsg;
    t_init(&argc, &argv, "wildcards");
    if (t_size < 2)
        t_fail("needs at least 2 ranks");
    cycle[0] = 8;
    cycle[1] = t_inject() + 1;
    cycle[2] = 0;
    cycle[3] = 65536;
    cycle[4] = 1;
    cycle[5] = 262144;
    nmsg = (int)t_opt_long("msgs", NULL, t_quick ? 12 : 24);
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));

    fan_in(1, 1, 0, nmsg); /* ANY_SOURCE, fixed tag */
    fan_in(2, 0, 1, nmsg); /* named source, ANY_TAG */
    fan_in(3, 1, 1, nmsg); /* ANY_SOURCE + ANY_TAG */
    fan_in(4, 0, 0, nmsg); /* named source, named tag (reference) */
    posted_order(0);
    posted_order(1);
    unexpected_order();
    mixed_preposted();
    comm_isolation();
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
