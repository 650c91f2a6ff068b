/*
 * many_posted: MPI_Irecv and MPI_Isend are local operations however many are pending.
 *
 * 1. Each rank posts --n (default 10000) receives from its left neighbour (distinct tags,
 *    every third one MPI_ANY_SOURCE, every fifth MPI_ANY_TAG-free named tag ordering),
 *    then a barrier, then the neighbour sends all messages in reverse tag order. A
 *    provider receive queue is finite (tcp: 2048 entries in libfabric 1.17); MPI_Irecv
 *    must not block when it is full, since nothing can drain it before the barrier.
 * 2. Each rank Isends --n small messages to its right neighbour before the neighbour has
 *    posted anything (a barrier follows the Isends), then receives them all in order.
 * 3. Each rank posts --n receives again (every 97th for 64 KiB), then sends to its right
 *    neighbour in reverse tag order with blocking sends the receiver must match before
 *    they return: MPI_Ssend of 8 bytes, and MPI_Send of 64 KiB (rendezvous on every
 *    provider here). The message for the last receive comes first, and that receive
 *    cannot be in a full provider queue: the MTL must match it anyway (the C MTL's job
 *    hangs here).
 * 4. With --n receives waiting again, each rank sends its right neighbour a message no
 *    receive matches yet: MPI_Issend of 8 bytes and MPI_Isend of 64 KiB. The Issend must
 *    not complete while the receiver only progresses (the MTL may take the message off
 *    the provider, but that is no match); MPI_Iprobe, then MPI_Mprobe/MPI_Mrecv and
 *    MPI_Recv must find both.
 * Every payload and status is checked.
 *
 * Kept apart from comms because Open MPI 4.1.4's C MTL spins forever inside MPI_Irecv when
 * the provider's receive queue is full (see README.md).
 *
 * Options: --n N.
 */
#include "common.h"

int main(int argc, char **argv)
{
    int n, right, left;
    MPI_Comm comm;
    MPI_Request *rq;
    MPI_Status *st;
    uint64_t *sb, *rb;
    double t0;

    t_init(&argc, &argv, "many_posted");
    n = (int)t_opt_long("n", NULL, 10000);
    right = (t_rank + 1) % t_size;
    left = (t_rank + t_size - 1) % t_size;
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    rq = t_malloc(sizeof(*rq) * 2 * (size_t)n);
    st = t_malloc(sizeof(*st) * 2 * (size_t)n);
    sb = t_malloc(sizeof(*sb) * (size_t)n);
    rb = t_malloc(sizeof(*rb) * (size_t)n);

    t_section("posting %d receives before any send", n);
    t0 = t_now();
    for (int i = 0; i < n; i++) {
        rb[i] = 0;
        T_CHECK_MPI(MPI_Irecv(&rb[i], 1, MPI_UINT64_T, i % 3 == 0 ? MPI_ANY_SOURCE : left, i, comm, &rq[i]));
        if (t_now() - t0 > 60)
            t_fail("posting receive #%d: MPI_Irecv is not returning (60 s for %d receives)", i, i);
    }
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    t_section("sending %d messages in reverse tag order", n);
    for (int i = n - 1; i >= 0; i--) {
        sb[i] = t_seed(95, (uint64_t)t_rank, (uint64_t)i, 0);
        T_CHECK_MPI(MPI_Isend(&sb[i], 1, MPI_UINT64_T, right, i, comm, &rq[n + i]));
    }
    t_status_init_n(st, 2 * n);
    T_CHECK_MPI(MPI_Waitall(2 * n, rq, st));
    for (int i = 0; i < n; i++) {
        char w[80];
        snprintf(w, sizeof(w), "preposted receive #%d", i);
        t_check_status(&st[i], left, i, MPI_UINT64_T, 1, w);
        if (rb[i] != t_seed(95, (uint64_t)left, (uint64_t)i, 0))
            t_fail("%s: wrong payload", w);
    }
    t_info("%d preposted receives matched in %.2f s", n, t_now() - t0);

    t_section("%d Isends before the receiver posts", n);
    t0 = t_now();
    for (int i = 0; i < n; i++) {
        sb[i] = t_seed(96, (uint64_t)t_rank, (uint64_t)i, 0);
        T_CHECK_MPI(MPI_Isend(&sb[i], 1, MPI_UINT64_T, right, 5, comm, &rq[i]));
        if (t_now() - t0 > 60)
            t_fail("Isend #%d: MPI_Isend is not returning", i);
    }
    T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    for (int i = 0; i < n; i++) {
        MPI_Status s;
        uint64_t v = 0;
        t_status_init(&s);
        T_CHECK_MPI(MPI_Recv(&v, 1, MPI_UINT64_T, i % 2 ? MPI_ANY_SOURCE : left, 5, comm, &s));
        t_check_status(&s, left, 5, MPI_UINT64_T, 1, "unexpected message");
        if (v != t_seed(96, (uint64_t)left, (uint64_t)i, 0)) {
            int j = -1;
            for (int k = 0; k < n; k++)
                if (v == t_seed(96, (uint64_t)left, (uint64_t)k, 0))
                    j = k;
            t_fail("receive #%d got message #%d: order between a pair violated", i, j);
        }
    }
    T_CHECK_MPI(MPI_Waitall(n, rq, MPI_STATUSES_IGNORE));
    t_info("%d unexpected messages received in order in %.2f s", n, t_now() - t0);

    t_section("%d receives, then blocking sends matching the last receive first", n);
    t0 = t_now();
    {
        const size_t big = 64 * 1024;
        int nbig = n / 97 + 1;
        char *rbig = t_malloc(big * (size_t)nbig), *sbig = t_malloc(big);
        for (int i = 0; i < n; i++) {
            int src = i % 3 == 0 ? MPI_ANY_SOURCE : left;
            rb[i] = 0;
            if (i % 97 == 0) {
                memset(rbig + big * (size_t)(i / 97), 0, big);
                T_CHECK_MPI(MPI_Irecv(rbig + big * (size_t)(i / 97), (int)big, MPI_BYTE, src, i, comm, &rq[i]));
            } else {
                T_CHECK_MPI(MPI_Irecv(&rb[i], 1, MPI_UINT64_T, src, i, comm, &rq[i]));
            }
        }
        T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        for (int i = n - 1; i >= 0; i--) {
            if (i % 97 == 0) {
                t_fill(sbig, big, t_seed(97, (uint64_t)t_rank, (uint64_t)i, 0));
                T_CHECK_MPI(MPI_Send(sbig, (int)big, MPI_BYTE, right, i, comm));
            } else {
                sb[0] = t_seed(98, (uint64_t)t_rank, (uint64_t)i, 0);
                T_CHECK_MPI(MPI_Ssend(&sb[0], 1, MPI_UINT64_T, right, i, comm));
            }
            if (i % 256 == 0)
                t_touch();
            if (t_now() - t0 > 60)
                t_fail("blocking send #%d (of %d, in reverse order) is not returning", n - 1 - i, n);
        }
        t_status_init_n(st, n);
        T_CHECK_MPI(MPI_Waitall(n, rq, st));
        for (int i = 0; i < n; i++) {
            char w[80];
            snprintf(w, sizeof(w), "receive #%d matched out of order", i);
            if (i % 97 == 0) {
                t_check_status(&st[i], left, i, MPI_BYTE, (int)big, w);
                t_check(rbig + big * (size_t)(i / 97), big, t_seed(97, (uint64_t)left, (uint64_t)i, 0), w);
            } else {
                t_check_status(&st[i], left, i, MPI_UINT64_T, 1, w);
                if (rb[i] != t_seed(98, (uint64_t)left, (uint64_t)i, 0))
                    t_fail("%s: wrong payload", w);
            }
        }
        free(rbig); free(sbig);
    }
    t_info("%d receives matched last to first by blocking sends in %.2f s", n, t_now() - t0);

    t_section("messages no waiting receive matches, with %d receives waiting", n);
    {
        const size_t big = 64 * 1024;
        char *bigs = t_malloc(big), *bigr = t_malloc(big);
        uint64_t small = t_seed(99, (uint64_t)t_rank, 0, 0), got = 0;
        MPI_Request sreq[2];
        MPI_Message msg;
        MPI_Status s;
        int flag = 0;
        for (int i = 0; i < n; i++) {
            rb[i] = 0;
            T_CHECK_MPI(MPI_Irecv(&rb[i], 1, MPI_UINT64_T, i % 3 == 0 ? MPI_ANY_SOURCE : left, i, comm, &rq[i]));
        }
        T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        t_fill(bigs, big, t_seed(100, (uint64_t)t_rank, 0, 0));
        T_CHECK_MPI(MPI_Issend(&small, 1, MPI_UINT64_T, right, n + 1, comm, &sreq[0]));
        T_CHECK_MPI(MPI_Isend(bigs, (int)big, MPI_BYTE, right, n + 2, comm, &sreq[1]));
        t0 = t_now();
        while (t_now() - t0 < 0.5) {
            T_CHECK_MPI(MPI_Test(&sreq[0], &flag, MPI_STATUS_IGNORE));
            if (flag)
                t_fail("MPI_Issend completed before any receive matched it");
        }
        T_CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        /* MPI_Iprobe need not set MPI_ERROR (ob1 leaves it): start from the sentinel. */
        t_status_init(&s);
        t0 = t_now();
        do {
            T_CHECK_MPI(MPI_Iprobe(left, n + 2, comm, &flag, &s));
            if (t_now() - t0 > 20)
                t_fail("MPI_Iprobe does not find the 64 KiB message");
        } while (!flag);
        t_check_status(&s, left, n + 2, MPI_BYTE, (int)big, "MPI_Iprobe of the 64 KiB message");
        t_status_init(&s);
        T_CHECK_MPI(MPI_Mprobe(MPI_ANY_SOURCE, n + 1, comm, &msg, &s));
        t_check_status(&s, left, n + 1, MPI_UINT64_T, 1, "MPI_Mprobe of the synchronous message");
        T_CHECK_MPI(MPI_Mrecv(&got, 1, MPI_UINT64_T, &msg, &s));
        if (got != t_seed(99, (uint64_t)left, 0, 0))
            t_fail("MPI_Mrecv of the synchronous message: wrong payload");
        t_status_init(&s);
        T_CHECK_MPI(MPI_Recv(bigr, (int)big, MPI_BYTE, left, n + 2, comm, &s));
        t_check_status(&s, left, n + 2, MPI_BYTE, (int)big, "MPI_Recv of the 64 KiB message");
        t_check(bigr, big, t_seed(100, (uint64_t)left, 0, 0), "MPI_Recv of the 64 KiB message");
        T_CHECK_MPI(MPI_Waitall(2, sreq, MPI_STATUSES_IGNORE));
        for (int i = 0; i < n; i++) {
            sb[i] = t_seed(101, (uint64_t)t_rank, (uint64_t)i, 0);
            T_CHECK_MPI(MPI_Isend(&sb[i], 1, MPI_UINT64_T, right, i, comm, &rq[n + i]));
        }
        t_status_init_n(st, 2 * n);
        T_CHECK_MPI(MPI_Waitall(2 * n, rq, st));
        for (int i = 0; i < n; i++) {
            char w[80];
            snprintf(w, sizeof(w), "receive #%d after the unmatched messages", i);
            t_check_status(&st[i], left, i, MPI_UINT64_T, 1, w);
            if (rb[i] != t_seed(101, (uint64_t)left, (uint64_t)i, 0))
                t_fail("%s: wrong payload", w);
        }
        free(bigs); free(bigr);
    }

    free(rq); free(st); free(sb); free(rb);
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
