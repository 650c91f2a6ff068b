/*
 * ssend_mprobe: the ssend tests with matched-probe receives (MPI_Mprobe + MPI_Mrecv,
 * MPI_Improbe + MPI_Imrecv). Kept apart from ssend because Open MPI 4.1.4's C MTL
 * deadlocks on MPI_Mrecv of a synchronous-send message (see README.md).
 */
#define SSEND_MPROBE 1
#include "ssend.c"
