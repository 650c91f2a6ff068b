//! The limits in the MTL module table that pml cm reads: the largest communicator id,
//! the largest tag and the request size, written once at `mtl_init`.
//!
//! What it owns: the writes of those fields into our exported
//! `mca_mtl_base_module_t`. What it must not touch: the table's function pointers,
//! which `mtl/setup.rs` builds.

use super::component::Exported;
use ompi_sys as sys;

/// What pml cm learns from the MTL module before it uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MtlLimits {
    /// `mtl_max_contextid`: Open MPI hands out communicator ids below it.
    pub max_contextid: i32,
    /// `mtl_max_tag`: the largest MPI tag (`MPI_TAG_UB`).
    pub max_tag: i32,
    /// `mtl_request_size`: bytes pml cm reserves after its request for ours.
    pub request_size: usize,
}

impl Exported<sys::mca_mtl_base_module_t> {
    /// Store `limits` in the module and return it, for `mtl_init` to hand to pml cm.
    pub fn publish_limits(&self, limits: MtlLimits) -> *mut sys::mca_mtl_base_module_t {
        let m = self.get();
        // SAFETY: `m` points to our exported module, a static that lives as long as the
        // library. Open MPI reads it only after `mtl_init` returns it (pml cm's select),
        // and `mtl_init` runs in MCA select, which Open MPI serialises, so nothing reads
        // these fields while they are written.
        unsafe {
            (*m).mtl_max_contextid = limits.max_contextid;
            (*m).mtl_max_tag = limits.max_tag;
            (*m).mtl_request_size = limits.request_size;
        }
        m
    }
}
