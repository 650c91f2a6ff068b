/*
 * hello: start-up and memory of a minimal MPI job.
 *
 * Every rank initialises MPI, takes part in one MPI_Barrier and one MPI_Allreduce (so
 * that transports which connect lazily have connected to at least their neighbours),
 * finalises, and then prints its peak resident set from /proc/self/status:
 *   rss <rank> <VmHWM kB> <VmRSS kB>
 * Rank 0 also prints `hello <nprocs> <sum of ranks>`. Read after MPI_Finalize so that
 * whatever the finalisation allocates counts too.
 */
#include <mpi.h>
#include <stdio.h>
#include <string.h>

static long status_kb(const char *key)
{
    char line[256];
    long kb = -1;
    size_t klen = strlen(key);
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) == 0 && line[klen] == ':') {
            sscanf(line + klen + 1, "%ld", &kb);
            break;
        }
    }
    fclose(f);
    return kb;
}

int main(int argc, char **argv)
{
    int rank, nprocs, sum = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nprocs);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Finalize();
    if (rank == 0)
        printf("hello %d %d\n", nprocs, sum);
    printf("rss %d %ld %ld\n", rank, status_kb("VmHWM"), status_kb("VmRSS"));
    fflush(stdout);
    return 0;
}
