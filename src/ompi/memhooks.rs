//! Open MPI's memory hooks in `libopen-pal`: opening the memory framework (which
//! installs Open MPI's patcher), its support level, and the release callbacks the
//! monitor registers.
//!
//! What it owns: every call into Open MPI's memory framework. What it must not touch:
//! the choice of monitor (`common::monitor`), which reaches this through the
//! `OpalHooks` trait.

use crate::common::monitor::{OpalHooks, OpalReleaseFn};
use ompi_sys as ompi;
use std::ptr::null_mut;

extern "C" {
    // In libopen-pal; not in ompi-sys's bindings (its wrapper.h does not include
    // opal/mca/memory/base/base.h).
    static mut opal_memory_base_framework: ompi::mca_base_framework_t;
}

/// Open MPI's memory hooks in `libopen-pal`. Needs `opal_init` (or `opal_init_util`
/// plus `opal_mem_hooks_init`) to have run, as it has inside any MPI process.
pub struct OpenMpiHooks;

impl OpalHooks for OpenMpiHooks {
    fn open_memory_framework(&self) -> i32 {
        // SAFETY: the framework is a static of libopen-pal, which is loaded (we link
        // it); mca_base_framework_open is reference counted and thread safe enough for
        // our single call under the monitor lock.
        unsafe { ompi::mca_base_framework_open(&raw mut opal_memory_base_framework, 0) }
    }
    fn support_level(&self) -> i32 {
        // SAFETY: reads a static int of libopen-pal.
        unsafe { ompi::opal_mem_hooks_support_level() }
    }
    fn register_release(&self, cb: OpalReleaseFn) -> i32 {
        // SAFETY: `cb` stays valid until unregistered (teardown unregisters it before
        // this library can be unloaded); cbdata is unused.
        unsafe { ompi::opal_mem_hooks_register_release(Some(cb), null_mut()) }
    }
    fn unregister_release(&self, cb: OpalReleaseFn) -> i32 {
        // SAFETY: removes a callback registered above; takes Open MPI's list lock.
        unsafe { ompi::opal_mem_hooks_unregister_release(Some(cb)) }
    }
}
