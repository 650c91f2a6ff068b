//! Matched-probe messages (`MPI_Message`): taking a handle from Open MPI's free list,
//! filling it in for `MPI_Mprobe`/`MPI_Improbe`, and giving it back at `MPI_Mrecv`.
//!
//! What it owns: every read and write of `ompi_message_t`. What it must not touch:
//! what the MTL keeps behind a message (its `req_ptr`), which is the MTL's.

use super::comm::Comm;
use super::glue;
use ompi_sys as sys;
use std::any::Any;
use std::os::raw::{c_int, c_void};
use std::ptr;

/// Publish a matched message of `comm` from rank `peer`, `len` bytes long, with
/// `claim` (the MTL's) behind it, which [`Message::take`] gives back. `None` when Open
/// MPI has no handle left (the claim is dropped).
pub fn publish<T: Any>(
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
    // The claim travels as a thin pointer to a `Box<dyn Any>`, so that taking it back
    // checks its type.
    let ours: Box<Box<dyn Any>> = Box::new(claim);
    // SAFETY: msg is a fresh message of Open MPI's, not yet shared.
    unsafe {
        (*msg).comm = comm.as_ptr();
        (*msg).req_ptr = Box::into_raw(ours) as *mut c_void;
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

    /// Take the claim [`publish`] stored, if it is a `T` and was not taken yet.
    pub fn take<T: Any>(&mut self) -> Option<Box<T>> {
        // SAFETY: the invariant: a published message, req_ptr null or our claim.
        let p = unsafe { (**self.handle).req_ptr } as *mut Box<dyn Any>;
        if p.is_null() {
            return None;
        }
        // SAFETY: p came from Box::into_raw in publish and is taken once (cleared
        // below).
        let ours = unsafe {
            (**self.handle).req_ptr = ptr::null_mut();
            Box::from_raw(p)
        };
        (*ours).downcast::<T>().ok()
    }

    /// Give the message back to Open MPI and set the caller's handle to
    /// `MPI_MESSAGE_NULL` (a claim not taken is dropped first).
    pub fn give_back(mut self) {
        drop(self.take::<()>());
        // SAFETY: the invariant: a published message, given back once (self is
        // consumed); ompi_message_null is Open MPI's static.
        unsafe {
            glue::ompi_ofi_glue_message_return(*self.handle);
            *self.handle = ptr::addr_of_mut!(sys::ompi_message_null.message);
        }
    }
}
