/*
 * cancel: cancelling receives.
 *  - an unmatched receive (named source, MPI_ANY_SOURCE/MPI_ANY_TAG, persistent) is
 *    cancelled: MPI_Test_cancelled is true, the buffer is untouched, and a message sent
 *    later with the same envelope goes to the next receive instead;
 *  - a completed receive (seen complete through MPI_Request_get_status) is not
 *    cancelled: MPI_Test_cancelled false, data and status intact;
 *  - racing cancel: cancel right after the peer starts sending; either outcome is
 *    accepted, but it must be consistent (cancelled -> the message is still there for a
 *    new receive; not cancelled -> the data arrived in the first buffer).
 *
 * Options: --inject N, --iters N (race iterations per size, default 20, 5 with --quick).
 */
#include "common.h"

static MPI_Comm comm;

static void check_cancelled(const MPI_Status *st, int expect, const char *what)
{
    int c = -1;
    T_CHECK_MPI(MPI_Test_cancelled(st, &c));
    if (c != expect)
        t_fail("%s: MPI_Test_cancelled says %d, expected %d", what, c, expect);
}

static void unmatched(void)
{
    int peer = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    uint8_t buf[256], buf2[256], sbuf[100];
    MPI_Request r;
    MPI_Status st;
    int flag = 0;

    t_section("cancel unmatched named receive");
    memset(buf, 0xee, sizeof(buf));
    T_CHECK_MPI(MPI_Irecv(buf, 100, MPI_BYTE, from, 11, comm, &r));
    T_CHECK_MPI(MPI_Cancel(&r));
    t_status_init(&st);
    T_CHECK_MPI(MPI_Wait(&r, &st));
    T_ASSERT(r == MPI_REQUEST_NULL, "Wait did not free the cancelled request");
    check_cancelled(&st, 1, "unmatched named receive");

    t_section("cancel unmatched ANY_SOURCE/ANY_TAG receive, completed by MPI_Test");
    T_CHECK_MPI(MPI_Irecv(buf, 100, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &r));
    T_CHECK_MPI(MPI_Cancel(&r));
    double t0 = t_now();
    while (!flag) {
        t_status_init(&st);
        T_CHECK_MPI(MPI_Test(&r, &flag, &st));
        if (t_now() - t0 > 60)
            t_fail("cancelled receive never completed");
    }
    check_cancelled(&st, 1, "unmatched wildcard receive");

    t_section("cancel unmatched persistent receive");
    T_CHECK_MPI(MPI_Recv_init(buf, 100, MPI_BYTE, from, 12, comm, &r));
    T_CHECK_MPI(MPI_Start(&r));
    T_CHECK_MPI(MPI_Cancel(&r));
    t_status_init(&st);
    T_CHECK_MPI(MPI_Wait(&r, &st));
    check_cancelled(&st, 1, "unmatched persistent receive");
    T_CHECK_MPI(MPI_Request_free(&r));
    t_check_const(buf, sizeof(buf), 0xee, "buffer of cancelled receives");

    /* A message sent after the cancel must go to the next receive, not the cancelled one. */
    t_section("message after a cancelled receive goes to the next receive");
    T_CHECK_MPI(MPI_Irecv(buf, 100, MPI_BYTE, from, 13, comm, &r));
    T_CHECK_MPI(MPI_Cancel(&r));
    T_CHECK_MPI(MPI_Wait(&r, &st));
    check_cancelled(&st, 1, "unmatched receive before the real one");
    T_CHECK_MPI(MPI_Barrier(comm));
    t_fill(sbuf, 100, t_seed(13, (uint64_t)t_rank, 0, 0));
    memset(buf2, 0xee, sizeof(buf2));
    T_CHECK_MPI(MPI_Irecv(buf2, 100, MPI_BYTE, from, 13, comm, &r));
    T_CHECK_MPI(MPI_Send(sbuf, 100, MPI_BYTE, peer, 13, comm));
    t_status_init(&st);
    T_CHECK_MPI(MPI_Wait(&r, &st));
    check_cancelled(&st, 0, "the real receive");
    t_check_status_bytes(&st, from, 13, 100, "the real receive");
    t_check(buf2, 100, t_seed(13, (uint64_t)from, 0, 0), "the real receive");
    t_check_const(buf, sizeof(buf), 0xee, "buffer of the cancelled receive");
    T_CHECK_MPI(MPI_Barrier(comm));
}

static void completed(size_t size)
{
    int peer = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    uint8_t *buf = t_malloc(size + 64), *sbuf = t_malloc(size);
    MPI_Request r;
    MPI_Status st;
    int flag = 0;
    double t0 = t_now();

    t_section("cancel a completed receive, size %zu", size);
    memset(buf, 0xee, size + 64);
    t_fill(sbuf, size, t_seed(20, (uint64_t)t_rank, size, 0));
    T_CHECK_MPI(MPI_Irecv(buf, (int)size + 64, MPI_BYTE, from, 20, comm, &r));
    T_CHECK_MPI(MPI_Barrier(comm));
    T_CHECK_MPI(MPI_Send(sbuf, (int)size, MPI_BYTE, peer, 20, comm));
    while (!flag) {
        T_CHECK_MPI(MPI_Request_get_status(r, &flag, MPI_STATUS_IGNORE));
        if (t_now() - t0 > 60)
            t_fail("receive never completed");
    }
    T_CHECK_MPI(MPI_Cancel(&r));
    t_status_init(&st);
    T_CHECK_MPI(MPI_Wait(&r, &st));
    check_cancelled(&st, 0, "completed receive");
    t_check_status_bytes(&st, from, 20, size, "completed receive");
    t_check(buf, size, t_seed(20, (uint64_t)from, size, 0), "completed receive");
    t_check_const(buf + size, 64, 0xee, "completed receive guard");
    free(buf);
    free(sbuf);
    T_CHECK_MPI(MPI_Barrier(comm));
}

static void race(size_t size, int iters, int *n_cancelled)
{
    int peer = (t_rank + 1) % t_size, from = (t_rank + t_size - 1) % t_size;
    uint8_t *buf = t_malloc(size + 64), *sbuf = t_malloc(size);
    for (int it = 0; it < iters; it++) {
        MPI_Request r, sr;
        MPI_Status st;
        int c = -1;
        uint64_t seed_in = t_seed(30, (uint64_t)from, size, (uint64_t)it);
        t_section("racing cancel, size %zu iteration %d", size, it);
        memset(buf, 0xee, size + 64);
        t_fill(sbuf, size, t_seed(30, (uint64_t)t_rank, size, (uint64_t)it));
        T_CHECK_MPI(MPI_Irecv(buf, (int)size + 64, MPI_BYTE, from, 30, comm, &r));
        T_CHECK_MPI(MPI_Barrier(comm));
        T_CHECK_MPI(MPI_Isend(sbuf, (int)size, MPI_BYTE, peer, 30, comm, &sr));
        if (it & 1)
            t_sleep_ms(1);
        T_CHECK_MPI(MPI_Cancel(&r));
        t_status_init(&st);
        T_CHECK_MPI(MPI_Wait(&r, &st));
        T_CHECK_MPI(MPI_Test_cancelled(&st, &c));
        if (c) {
            (*n_cancelled)++;
            t_check_const(buf, size + 64, 0xee, "buffer of a receive reported cancelled");
            t_status_init(&st);
            T_CHECK_MPI(MPI_Recv(buf, (int)size + 64, MPI_BYTE, from, 30, comm, &st));
        }
        t_check_status_bytes(&st, from, 30, size, c ? "receive after a cancelled one" : "receive not cancelled");
        t_check(buf, size, seed_in, c ? "receive after a cancelled one" : "receive not cancelled");
        t_check_const(buf + size, 64, 0xee, "guard");
        T_CHECK_MPI(MPI_Wait(&sr, MPI_STATUS_IGNORE));
    }
    free(buf);
    free(sbuf);
    T_CHECK_MPI(MPI_Barrier(comm));
}

int main(int argc, char **argv)
{
    int iters, nc;
    size_t sizes[] = { 1, 0, 65536, 1 << 20 };
    t_init(&argc, &argv, "cancel");
    sizes[1] = t_inject() + 1;
    iters = (int)t_opt_long("iters", NULL, t_quick ? 5 : 20);
    T_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
    unmatched();
    for (int i = 0; i < 4; i++)
        completed(sizes[i]);
    for (int i = 0; i < 4; i++) {
        nc = 0;
        race(sizes[i], iters, &nc);
        if (t_verbose)
            t_info("racing cancel size %zu: %d of %d cancelled on rank 0", sizes[i], nc, iters);
    }
    T_CHECK_MPI(MPI_Comm_free(&comm));
    return t_pass();
}
