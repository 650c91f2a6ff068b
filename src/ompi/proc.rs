//! Procs as the components see them: the endpoint slot each component keeps in an
//! `ompi_proc_t`, the process name the modex is keyed by, whether the proc is on this
//! node, and the local process's own name and the job's size.
//!
//! What it owns: every read and write of `ompi_proc_t` and `opal_proc_t`. What it
//! must not touch: the procs' lifetime, which is Open MPI's.

use super::glue;
use ompi_sys as sys;
use std::os::raw::c_void;

/// A live proc. Invariant: Open MPI keeps it alive while any copy of the handle is
/// used (procs live until `ompi_mpi_finalize`, after the components' `del_procs`).
///
/// `repr(transparent)`, so that the PML's array of proc pointers reads as handles
/// ([`procs`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(transparent)]
pub struct Proc(*mut sys::ompi_proc_t);

/// The procs an MTL `add_procs` or `del_procs` received, as handles (empty for none).
///
/// # Safety
/// `procs` must be null or point to `n` pointers to live procs that outlive every use
/// of the handles (the PML passes such an array for the duration of the call).
#[inline]
pub unsafe fn procs<'a>(procs: *mut *mut sys::ompi_proc_t, n: usize) -> &'a [Proc] {
    if procs.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller passes n pointers to live procs; Proc is a transparent
    // wrapper of one, so the array is an array of handles whose invariant holds.
    unsafe { std::slice::from_raw_parts(procs as *const Proc, n) }
}

/// The components' slots in `proc_endpoints`.
#[derive(Clone, Copy)]
pub enum Slot {
    Mtl = sys::OMPI_PROC_ENDPOINT_TAG_MTL as isize,
}

impl Proc {
    /// A handle to `p`; `None` for null.
    ///
    /// # Safety
    /// `p` must be null or a live proc that outlives every use of the handle (the procs
    /// the PML passes to add_procs and the ones communicators look up qualify).
    #[inline(always)]
    pub unsafe fn from_raw(p: *mut sys::ompi_proc_t) -> Option<Proc> {
        (!p.is_null()).then_some(Proc(p))
    }

    #[inline(always)]
    pub fn as_ptr(self) -> *mut sys::ompi_proc_t {
        self.0
    }

    /// What the component stored in its slot (null when nothing).
    #[inline(always)]
    pub fn endpoint(self, slot: Slot) -> *mut c_void {
        // SAFETY: a live proc (the type's invariant); the slot index is in range.
        unsafe { (*self.0).proc_endpoints[slot as usize] as *mut c_void }
    }

    /// Store `ep` in the component's slot. The component owns what it stores there
    /// until it clears it.
    #[inline]
    pub fn set_endpoint(self, slot: Slot, ep: *mut c_void) {
        // SAFETY: a live proc; each component writes only its own slot, under its own
        // add/del procs serialisation.
        unsafe { (*self.0).proc_endpoints[slot as usize] = ep as _ };
    }

    /// The process name the modex is keyed by.
    #[inline]
    pub fn name(self) -> &'static sys::opal_process_name_t {
        // SAFETY: a live proc; the glue returns its embedded name, which lives as long
        // as the proc (the handle's invariant bounds every use).
        unsafe { &*glue::ompi_ofi_glue_proc_name(self.0) }
    }

    /// Is the proc on this node?
    #[inline]
    pub fn on_node(self) -> bool {
        // SAFETY: a live proc; its flags are set before add_procs.
        let flags = unsafe { (*self.0).super_.proc_flags };
        u32::from(flags) & sys::OPAL_PROC_ON_NODE != 0
    }
}

/// This process's name (jobid, vpid), or `None` before Open MPI has set the local
/// process up.
pub fn local_name() -> Option<(u32, u32)> {
    // SAFETY: returns the local proc or null.
    let p = unsafe { sys::opal_proc_local_get() };
    if p.is_null() {
        return None;
    }
    // SAFETY: opal_proc_local_get returned the live local proc (not null).
    let n = unsafe { (*p).proc_name };
    Some((n.jobid, n.vpid))
}

/// The ranks of MPI_COMM_WORLD, and how many other processes of the job share this
/// node.
pub fn job_shape() -> (usize, usize) {
    // SAFETY: both are set up by Open MPI before any component's init runs.
    unsafe {
        (
            sys::ompi_proc_world_size() as usize,
            sys::opal_process_info.num_local_peers as usize,
        )
    }
}

/// This process's rank among the processes of its node (0 before Open MPI knows it).
pub fn local_rank() -> usize {
    // SAFETY: a plain int of opal_process_info, set up before any component's init.
    unsafe { sys::opal_process_info.my_local_rank }.max(0) as usize
}

/// An OPAL-level proc as the BTL interface passes it. Invariant: live while the
/// handle is used (procs live until finalize, after the BTL's del_procs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(transparent)]
pub struct OpalProc(*mut sys::opal_proc_t);

impl OpalProc {
    /// # Safety
    /// `p` must be a live proc (the BTL's add_procs receives only such).
    #[inline(always)]
    pub unsafe fn from_raw(p: *mut sys::opal_proc_t) -> OpalProc {
        OpalProc(p)
    }

    #[inline(always)]
    pub fn as_ptr(self) -> *mut sys::opal_proc_t {
        self.0
    }

    /// The process name the modex is keyed by.
    #[inline]
    pub fn name(&self) -> &sys::opal_process_name_t {
        // SAFETY: a live proc (the type's invariant); the name is embedded in it.
        unsafe { &(*self.0).proc_name }
    }

    /// Is the proc on this node?
    #[inline]
    pub fn on_node(self) -> bool {
        // SAFETY: a live proc; its flags are set before add_procs.
        u32::from(unsafe { (*self.0).proc_flags }) & sys::OPAL_PROC_ON_NODE != 0
    }

    /// Is the proc this process?
    #[inline]
    pub fn is_self(self) -> bool {
        // SAFETY: returns the local proc (or null before opal_init).
        self.0 == unsafe { sys::opal_proc_local_get() }
    }
}

/// Mark peer `i` reachable in the BTL's add_procs bitmap (if the caller passed one).
///
/// # Safety
/// `bitmap` is null or the bitmap of at least `i + 1` bits that add_procs received.
pub unsafe fn mark_reachable(bitmap: *mut sys::opal_bitmap_t, i: usize) {
    if !bitmap.is_null() {
        // SAFETY: bitmap is not null, and has room for bit i (the caller's contract).
        unsafe { sys::opal_bitmap_set_bit(bitmap, i as std::os::raw::c_int) };
    }
}
