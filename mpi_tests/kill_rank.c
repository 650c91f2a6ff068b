/*
 * kill_rank: one rank dies with SIGKILL in the middle of traffic; the job must end.
 *
 * All ranks exchange messages in a ring (Irecv from the left, Isend to the right, sizes
 * alternating 4 KiB and 1 MiB, every byte checked). At iteration --kill-at N (default
 * 30) the last rank posts its receive and send and then kills itself with SIGKILL (as
 * `kill -9` would), with operations in flight on both sides.
 * The survivors keep completing their requests with MPI_Test (MPI_ERRORS_RETURN), so
 * they can report what they see:
 *   - an error from MPI: "NOTE kill_rank rank=R: error after the kill: ..." and exit 2
 *     (the job ended with an error, not a hang);
 *   - nothing for --survivor-timeout S seconds (default 60): "NOTE ... no error" and
 *     MPI_Abort (the caller's time bound catches the case where even that hangs).
 * Normally mpirun notices the killed rank first and tears the job down.
 * The program never prints PASS; scripts/test-hostile asserts that mpirun returns
 * non-zero within its bound and that no rank is left running.
 */
#include "common.h"
#include <signal.h>

int main(int argc, char **argv)
{
    t_init(&argc, &argv, "kill_rank");
    int kill_at = (int)t_opt_long("kill-at", NULL, 30);
    double surv_to = (double)t_opt_long("survivor-timeout", NULL, 60);
    int victim = t_size - 1;
    int right = (t_rank + 1) % t_size, left = (t_rank + t_size - 1) % t_size;
    size_t maxn = 1 << 20;
    uint8_t *sb = t_malloc(maxn), *rb = t_malloc(maxn);
    if (t_size < 2)
        t_fail("needs at least 2 ranks");
    double t_kill = 0;
    for (int it = 0;; it++) {
        size_t n = it % 2 ? maxn : 4096;
        MPI_Request rq[2];
        t_section("iteration %d size %zu", it, n);
        t_fill(sb, n, t_seed(t_rank, it, 7, 0));
        T_CHECK_MPI(MPI_Irecv(rb, (int)n, MPI_BYTE, left, it, MPI_COMM_WORLD, &rq[0]));
        T_CHECK_MPI(MPI_Isend(sb, (int)n, MPI_BYTE, right, it, MPI_COMM_WORLD, &rq[1]));
        if (it == kill_at && t_rank == victim) {
            printf("NOTE kill_rank rank=%d pid=%d: SIGKILL now, iteration %d, 2 requests in flight\n", t_rank,
                   (int)getpid(), it);
            fflush(stdout);
            kill(getpid(), SIGKILL);
        }
        if (it == kill_at)
            t_kill = t_now();
        int done = 0;
        while (!done) {
            int rc = MPI_Testall(2, rq, &done, MPI_STATUSES_IGNORE);
            if (rc != MPI_SUCCESS) {
                printf("NOTE kill_rank rank=%d: error after the kill (iteration %d, %.1f s): %s\n", t_rank, it,
                       t_kill ? t_now() - t_kill : 0.0, t_errstr(rc));
                fflush(stdout);
                _exit(2);
            }
            if (t_kill && t_now() - t_kill > surv_to) {
                printf("NOTE kill_rank rank=%d: no error %.0f s after the kill (iteration %d); aborting\n", t_rank,
                       surv_to, it);
                fflush(stdout);
                MPI_Abort(MPI_COMM_WORLD, 3);
            }
            t_touch();
        }
        t_check(rb, n, t_seed(left, it, 7, 0), "ring message");
    }
}
