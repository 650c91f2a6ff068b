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

/// What a component keeps behind a published message.
///
/// # Safety
/// The implementing type is the only one ever published in this process, so that
/// [`Message::take`] reads back the type [`publish`] stored (the message carries no
/// type of its own, and a second allocation to carry one would cost every mprobe).
pub unsafe trait Claim: Sized {}

/// Publish a matched message of `comm` from rank `peer`, `len` bytes long, with
/// `claim` (the component's) behind it, which [`Message::take`] gives back. `None` when
/// Open MPI has no handle left (the claim is dropped).
pub fn publish<T: Claim>(
    comm: Comm,
    peer: c_int,
    len: usize,
    claim: Box<T>,
) -> Option<*mut sys::ompi_message_t> {
    // SAFETY: an allocation from Open MPI's free list of messages; null when empty.
    let msg = unsafe { glue::ompi_ofi_glue_message_alloc() };
    if msg.is_null() {
        return None;
    }
    // SAFETY: msg is a fresh message of Open MPI's, not yet shared.
    unsafe {
        (*msg).comm = comm.as_ptr();
        (*msg).req_ptr = Box::into_raw(claim) as *mut c_void;
        (*msg).peer = peer;
        (*msg).count = len;
    }
    Some(msg)
}

/// A message [`publish`] returned, as `MPI_Imrecv` hands it back: the caller's
/// `MPI_Message` handle. Invariant: `*handle` is a published message not given back
/// yet, whose `req_ptr` is null (taken) or the claim `publish` stored.
pub struct Message<'a> {
    handle: &'a mut *mut sys::ompi_message_t,
}

impl<'a> Message<'a> {
    /// # Safety
    /// `*handle` is a message [`publish`] returned and not yet given back; nothing else
    /// uses it while the value lives.
    pub unsafe fn from_raw(handle: &'a mut *mut sys::ompi_message_t) -> Self {
        Message { handle }
    }

    /// The message's communicator.
    pub fn comm(&self) -> Comm {
        // SAFETY: the invariant: a published message; its communicator was live when it
        // was published and lives until its messages are received (MPI forbids freeing
        // it before).
        unsafe { Comm::from_raw((**self.handle).comm) }
    }

    /// Take the claim [`publish`] stored, if it was not taken yet.
    pub fn take<T: Claim>(&mut self) -> Option<Box<T>> {
        // SAFETY: the invariant: a published message, whose req_ptr is null or the Box
        // publish leaked, of T (the one claim type, `Claim`'s promise); taken once
        // (cleared here).
        unsafe {
            let p = (**self.handle).req_ptr as *mut T;
            (**self.handle).req_ptr = ptr::null_mut();
            (!p.is_null()).then(|| Box::from_raw(p))
        }
    }

    /// Give the message back to Open MPI and set the caller's handle to
    /// `MPI_MESSAGE_NULL` (the caller took its claim first).
    pub fn give_back(self) {
        // SAFETY: the invariant: a published message, given back once (self is
        // consumed); ompi_message_null is Open MPI's static.
        unsafe {
            glue::ompi_ofi_glue_message_return(*self.handle);
            *self.handle = ptr::addr_of_mut!(sys::ompi_message_null.message);
        }
    }
}
