//! Matched-probe messages (`MPI_Message`): taking a handle from Open MPI's free list,
//! filling it in for `MPI_Mprobe`/`MPI_Improbe`, and giving it back at `MPI_Mrecv`.
//!
//! What it owns: every read and write of `ompi_message_t`. What it must not touch:
//! what the MTL keeps behind a message (its `req_ptr`), which is the MTL's.

use super::comm::Comm;
use super::glue;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;

/// Publish a matched message of `comm` from rank `peer`, `len` bytes long, with
/// `ours` (the MTL's claim) behind it. `None` when Open MPI has no handle left.
pub fn publish(
    comm: Comm,
    peer: c_int,
    len: usize,
    ours: *mut c_void,
) -> Option<*mut sys::ompi_message_t> {
    // SAFETY: an allocation from Open MPI's free list of messages; null when empty.
    let msg = unsafe { glue::ompi_ofi_glue_message_alloc() };
    if msg.is_null() {
        return None;
    }
    // SAFETY: msg is a fresh message of Open MPI's, not yet shared.
    unsafe {
        (*msg).comm = comm.as_ptr();
        (*msg).req_ptr = ours;
        (*msg).peer = peer;
        (*msg).count = len;
    }
    Some(msg)
}

/// What a published message holds: its communicator and the MTL's claim.
///
/// # Safety
/// `msg` is a message [`publish`] returned and not yet given back.
pub unsafe fn parts(msg: *mut sys::ompi_message_t) -> (Comm, *mut c_void) {
    // SAFETY: forwarded; the communicator was live when the message was published and
    // lives until its messages are received (MPI forbids freeing it before).
    unsafe { (Comm::from_raw((*msg).comm), (*msg).req_ptr) }
}

/// Give `*message` back to Open MPI and set the caller's handle to `MPI_MESSAGE_NULL`.
///
/// # Safety
/// `*message` is a message [`publish`] returned, received now; nothing uses it after.
pub unsafe fn give_back(message: &mut *mut sys::ompi_message_t) {
    // SAFETY: forwarded from the caller; ompi_message_null is Open MPI's static.
    unsafe {
        glue::ompi_ofi_glue_message_return(*message);
        *message = ptr::addr_of_mut!(sys::ompi_message_null.message);
    }
}
