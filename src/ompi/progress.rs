//! Open MPI's progress engine, as the components need it: the registration of a
//! progress callback, one round of `opal_progress` and the `mpi_yield_when_idle`
//! setting.

use ompi_sys as sys;
use std::os::raw::c_int;
use std::ptr;

/// Have `opal_progress` call `cb` on every round, until [`unregister`].
pub fn register(cb: extern "C" fn() -> c_int) {
    // SAFETY: Open MPI keeps only the function pointer (under its own lock); the
    // component unregisters it at finalize, before the library can be unloaded.
    unsafe { sys::opal_progress_register(Some(cb)) };
}

/// Stop calling `cb` (registered with [`register`]).
pub fn unregister(cb: extern "C" fn() -> c_int) {
    // SAFETY: removes a function pointer from Open MPI's list; unknown ones are
    // ignored.
    unsafe { sys::opal_progress_unregister(Some(cb)) };
}

/// One round of Open MPI's progress engine: every registered callback (ours, the
/// other components', libnbc's for non-blocking collectives), then `sched_yield` when
/// none of them reported an event and `mpi_yield_when_idle` is set.
///
/// A call that found nothing to do ends here, as ob1's and the C MTL's do, so that a
/// program polling in a loop (HPL's broadcast test spins on `MPI_Iprobe`) gives the
/// core to a rank that computes on an oversubscribed node (`mpi_tests/turns.c
/// --iprobe`).
#[inline]
pub fn progress() {
    // SAFETY: opal_progress takes no arguments and may be called from any thread once
    // Open MPI is initialised, which it is whenever a component entry point runs.
    unsafe { sys::opal_progress() };
}

/// `mpi_yield_when_idle` (set by Open MPI itself when the node is oversubscribed).
#[inline]
pub fn yield_when_idle() -> bool {
    // SAFETY: a plain bool Open MPI sets at init; read by value without a reference,
    // as opal_progress reads it.
    unsafe { ptr::addr_of!(sys::opal_progress_yield_when_idle).read_volatile() }
}
