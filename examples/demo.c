/* The demo job: two ranks exchange messages over our OFI components and rank 0
 * reports what the components chose (read back through MPI_T from the read-only
 * variable opal_common_ofi_memory_monitor_status). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void report_status(void)
{
    int provided, idx, count = 1;
    char value[512] = "";
    MPI_T_cvar_handle h;
    if (MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) return;
    if (MPI_T_cvar_get_index("opal_common_ofi_memory_monitor_status", &idx) == MPI_SUCCESS &&
        MPI_T_cvar_handle_alloc(idx, NULL, &h, &count) == MPI_SUCCESS) {
        MPI_T_cvar_read(h, value);
        MPI_T_cvar_handle_free(&h);
        printf("demo: memory monitor: %s\n", value[0] ? value : "(not set)");
    } else {
        printf("demo: memory monitor: variable not found (are our components loaded?)\n");
    }
    MPI_T_finalize();
}

int main(int argc, char **argv)
{
    int rank, size, n = 1 << 20, iters = 100;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != 2) {
        if (rank == 0) fprintf(stderr, "demo: run with 2 ranks\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    unsigned char *buf = malloc(n);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++) {
        if (rank == 0) {
            memset(buf, i & 0xff, n);
            MPI_Send(buf, n, MPI_BYTE, 1, i, MPI_COMM_WORLD);
            MPI_Recv(buf, n, MPI_BYTE, 1, i, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            for (int j = 0; j < n; j++)
                if (buf[j] != (unsigned char) (i + 1)) {
                    fprintf(stderr, "demo: byte %d of round %d is %d, expected %d\n", j, i, buf[j], (i + 1) & 0xff);
                    MPI_Abort(MPI_COMM_WORLD, 1);
                }
        } else {
            MPI_Recv(buf, n, MPI_BYTE, 0, i, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            for (int j = 0; j < n; j++) buf[j]++;
            MPI_Send(buf, n, MPI_BYTE, 0, i, MPI_COMM_WORLD);
        }
    }
    double t = MPI_Wtime() - t0;
    if (rank == 0) {
        printf("demo: %d round trips of 1 MiB checked, %.1f MB/s\n", iters, 2.0 * iters * n / t / 1e6);
        report_status();
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
