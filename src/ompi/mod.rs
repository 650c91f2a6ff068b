//! The boundary with Open MPI.
