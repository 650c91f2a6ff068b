/*
 * truncation_large: the truncation tests at rendezvous sizes (see truncation.c).
 * Kept apart because Open MPI 4.1.4's ob1 RGET protocol copies the sender's full length
 * into a smaller receive buffer (heap overflow) with any BTL that offers RDMA get
 * (vader's CMA here); see README.md.
 */
#define TRUNC_LARGE 1
#include "truncation.c"
