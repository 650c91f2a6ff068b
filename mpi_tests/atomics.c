/*
 * atomics: the atomic half of onesided.c (MPI_Get_accumulate, MPI_Fetch_and_op,
 * MPI_Compare_and_swap on every window kind and synchronisation mode); see there.
 */
#define ONESIDED_ATOMICS 1
#include "onesided.c"
