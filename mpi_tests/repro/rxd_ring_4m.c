/*
 * rxd_ring_4m: 4 ranks pass 4 MiB messages around a ring (each rank sends to rank+d,
 * then receives from rank-d, one pair at a time), the pattern of truncation_large.
 * Over udp;ofi_rxd (libfabric 1.17) a run of 40 iterations stalls for good in about
 * one run out of three, with our MTL and with Open MPI's C MTL alike: every rank waits
 * in opal_progress, and rxd never completes the pending 4 MiB transfer. Larger socket
 * buffers (net.core.rmem_default) remove the UDP drops but not the stall.
 *
 *   mpicc -O2 -o rxd_ring_4m rxd_ring_4m.c
 *   scripts/mpirun --oversubscribe -np 4 --mca pml cm --mca mtl ofi \
 *       --mca opal_common_ofi_provider_include 'udp;ofi_rxd' ./rxd_ring_4m 1 40
 *   (argument 1: 1 = MPI_ANY_SOURCE receives, 0 = named source; argument 2: iterations;
 *    env RLEN: receive length, default 1 MiB, i.e. truncated)
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
  int rank, size; MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank); MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm comm; MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  size_t msg = 4<<20, rlen = getenv("RLEN") ? atol(getenv("RLEN")) : 1<<20;
  int any = argc > 1 ? atoi(argv[1]) : 1;
  int iters = argc > 2 ? atoi(argv[2]) : 20;
  char *b = malloc(msg), *b2 = malloc(100);
  for (int it = 0; it < iters; it++)
   for (int d = 1; d < size; d++) {
    for (int s = 0; s < size; s++) {
      int r = (s + d) % size, tag = 700 + d;
      if (rank == s) {
        MPI_Request q; MPI_Isend(b, msg, MPI_BYTE, r, tag, comm, &q); MPI_Wait(&q, MPI_STATUS_IGNORE);
        MPI_Send(b2, 100, MPI_BYTE, r, tag, comm);
      } else if (rank == r) {
        MPI_Status st;
        int rc = MPI_Recv(b, rlen, MPI_BYTE, any ? MPI_ANY_SOURCE : s, tag, comm, &st);
        if (rc == MPI_SUCCESS) printf("no trunc!\n");
        MPI_Recv(b2, 100, MPI_BYTE, s, tag, comm, &st);
      }
    }
    MPI_Barrier(comm);
   }
  if (rank == 0) printf("done\n");
  MPI_Finalize();
}
