//! Communicators as the data paths see them: a copyable handle over the PML's
//! `ompi_communicator_t` with the three fields the MTL reads (context id, local rank,
//! size of the remote group) and the peer lookup.
//!
//! What it owns: every read of the communicator struct. What it must not touch: the
//! communicator's lifetime, which is Open MPI's (a handle is made from a pointer the
//! PML passed for the duration of an operation, or from the communicator table).

use super::glue;
use super::proc::Proc;
use ompi_sys as sys;
use std::os::raw::c_int;

/// A live communicator. Invariant: the pointer is a communicator Open MPI keeps alive
/// for as long as any copy of the handle is used (the PML frees a communicator only
/// after its last operation completed and `del_comm` ran).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Comm(*mut sys::ompi_communicator_t);

// SAFETY: the handle is only a pointer; the fields it reads are set when the
// communicator is created and never change while it lives, so any thread may read them.
unsafe impl Send for Comm {}
// SAFETY: as for Send: reads of immutable fields only.
unsafe impl Sync for Comm {}

impl Comm {
    /// A handle to `comm`.
    ///
    /// # Safety
    /// `comm` must be a live communicator that outlives every use of the handle (a
    /// pointer the PML passed to an MTL entry point, kept with the request it belongs
    /// to, qualifies).
    #[inline(always)]
    pub unsafe fn from_raw(comm: *mut sys::ompi_communicator_t) -> Comm {
        Comm(comm)
    }

    /// The communicator with context id `cid`, if this process has it.
    #[inline]
    pub fn lookup(cid: u32) -> Option<Comm> {
        // SAFETY: a plain lookup in Open MPI's table of communicators, which returns a
        // live communicator or null.
        let comm = unsafe { glue::ompi_ofi_glue_comm_lookup(cid) };
        (!comm.is_null()).then_some(Comm(comm))
    }

    #[inline(always)]
    pub fn as_ptr(self) -> *mut sys::ompi_communicator_t {
        self.0
    }

    /// The context id, agreed by all members.
    #[inline(always)]
    pub fn cid(self) -> u32 {
        // SAFETY: a live communicator (the type's invariant).
        unsafe { (*self.0).c_contextid }
    }

    /// This process's rank in the communicator.
    #[inline(always)]
    pub fn my_rank(self) -> c_int {
        // SAFETY: a live communicator (the type's invariant).
        unsafe { (*self.0).c_my_rank }
    }

    /// The size of the remote group (the local group for an intracommunicator): the
    /// bound of a received source rank. Not `ompi_comm_remote_size`, which is 0 for an
    /// intracommunicator.
    #[inline]
    pub fn remote_size(self) -> c_int {
        // SAFETY: a live communicator (the type's invariant); its remote group lives as
        // long as it.
        unsafe {
            let g = (*self.0).c_remote_group;
            if g.is_null() {
                0
            } else {
                (*g).grp_proc_count
            }
        }
    }

    /// The proc of `rank` in the remote group (`None` when out of range); the glue
    /// resolves the sentinel entries of Open MPI's sparse groups.
    #[inline]
    pub fn peer_proc(self, rank: c_int) -> Option<Proc> {
        // SAFETY: a live communicator; the glue checks the rank and returns a live
        // proc of the group or null; procs outlive the communicators that name them.
        unsafe { Proc::from_raw(glue::ompi_ofi_glue_comm_peer(self.0, rank)) }
    }
}
