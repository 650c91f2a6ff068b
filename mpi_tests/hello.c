/*
 * hello: MPI_Init, print rank/size/host, MPI_Finalize. The runner's elapsed time for it
 * is the start-up (and shut-down) cost of a lane. Output is the one line per rank plus
 * the usual PASS line; nothing is checked beyond MPI_Init/MPI_Finalize succeeding and
 * the ranks agreeing on the size.
 */
#include "common.h"

int main(int argc, char **argv)
{
    char host[MPI_MAX_PROCESSOR_NAME];
    int len = 0, sum = 0;
    t_init(&argc, &argv, "hello");
    MPI_Get_processor_name(host, &len);
    printf("hello from rank %d of %d on %s\n", t_rank, t_size, host);
    T_CHECK_MPI(MPI_Allreduce(&t_size, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
    T_ASSERT(sum == t_size * t_size, "ranks disagree on the size");
    return t_pass();
}
