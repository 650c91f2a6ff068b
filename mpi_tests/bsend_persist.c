/*
 * bsend_persist: bsend's cases with MPI_Bsend_init + MPI_Start. Kept apart because
 * pml cm (Open MPI 4.1.4) gets persistent buffered sends wrong whatever the MTL (see
 * bsend.c and README.md).
 */
#define BSEND_PERSIST 1
#include "bsend.c"
