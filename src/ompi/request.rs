//! The PML's side of an MTL request: the `mca_mtl_request_t` that heads our request,
//! the status we publish into its `ompi_request_t`, and the completion callback.
//!
//! What it owns: every write into the PML's request. What it must not touch: the
//! rest of our request (`mtl::request`).

use ompi_sys as sys;
use std::os::raw::c_int;
use std::ptr;

/// What a completed operation tells MPI.
#[derive(Clone, Copy, Default, Debug)]
pub struct Status {
    pub source: c_int,
    pub tag: c_int,
    pub error: c_int,
    pub cancelled: bool,
    pub count: usize,
}

/// A head for an internal request: no PML request behind it, no callback.
pub const NO_PML: sys::mca_mtl_request_t = sys::mca_mtl_request_t {
    ompi_req: ptr::null_mut(),
    completion_callback: None,
};

/// Does a PML request stand behind `head`?
#[inline(always)]
pub fn has_pml(head: &sys::mca_mtl_request_t) -> bool {
    !head.ompi_req.is_null()
}

/// Publish `status` to the PML's request behind `head` (if any), then call the PML's
/// completion callback (if any).
///
/// # Safety
/// `head` is the head of a live request: the PML's `ompi_request_t` it names, when
/// set, outlives the call, and the callback may free the memory `head` lives in (so
/// nothing may use `head` after this returns).
#[inline]
pub unsafe fn complete(head: *mut sys::mca_mtl_request_t, status: Status) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let oreq = (*head).ompi_req;
        if !oreq.is_null() {
            let s = &mut (*oreq).req_status;
            s.MPI_SOURCE = status.source;
            s.MPI_TAG = status.tag;
            s.MPI_ERROR = status.error;
            s._ucount = status.count;
            s._cancelled = status.cancelled as c_int;
        }
        if let Some(cb) = (*head).completion_callback {
            cb(head);
        }
    }
}

/// Tell the PML that a cancel did not take: the request completes as usual.
///
/// # Safety
/// As [`complete`]: `head` heads a live request.
#[inline]
pub unsafe fn mark_not_cancelled(head: *mut sys::mca_mtl_request_t) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let oreq = (*head).ompi_req;
        if !oreq.is_null() {
            (*oreq).req_status._cancelled = 0;
        }
    }
}
