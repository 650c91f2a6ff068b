//! What the monitor needs from Open MPI's memory hooks, as a trait so that tests
//! without MPI can stand in; the real implementation is `ompi::memhooks`.
//!
//! What it owns: the trait and the callback type. What it must not touch: Open MPI
//! itself.

use std::ffi::c_void;

/// The type of `opal_mem_hooks_callback_fn_t`.
pub type OpalReleaseFn = unsafe extern "C" fn(*mut c_void, usize, *mut c_void, bool);

/// What setup needs from Open MPI's memory hooks. `ompi::memhooks::OpenMpiHooks` is the real one.
/// Return values are `OPAL_*` codes.
pub trait OpalHooks: Sync {
    /// Open Open MPI's memory framework (reference counted; opening it installs the
    /// patcher once per process).
    fn open_memory_framework(&self) -> i32;
    /// `opal_mem_hooks_support_level()`.
    fn support_level(&self) -> i32;
    /// `opal_mem_hooks_register_release(cb, NULL)`.
    fn register_release(&self, cb: OpalReleaseFn) -> i32;
    /// `opal_mem_hooks_unregister_release(cb)`.
    fn unregister_release(&self, cb: OpalReleaseFn) -> i32;
}
