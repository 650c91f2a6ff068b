//! The layout of an MTL request, and the handle that reaches one by address: the PML's
//! `mca_mtl_request_t` head (the PML allocates `mtl_request_size` bytes behind it),
//! the libfabric context of the request's operations, then the component's body `B`.
//! A completion finds its request from the context; the PML's head is how the request
//! is handed back ([`ReqRef::complete_with`]).
//!
//! What it owns: the layout, the handle's raw accesses, the hand-over to the PML.
//! What it must not touch: what the body holds or means (the component's).

use super::request::{self, Status};
use crate::fabric::OpContext;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::cell::Cell;
use std::fmt;
use std::mem::{offset_of, size_of};
use std::ops::{Deref, DerefMut};
use std::os::raw::c_void;
use std::ptr::{self, NonNull};

/// A request: the PML's head, the context of its operations, the component's body.
/// The head and the context are `Cell`s, as the body's fields must be (see
/// [`ReqRef`]); a `Cell` has its value's layout, so the C layout is the fields' own.
#[repr(C)]
pub struct MtlRequest<B> {
    head: Cell<sys::mca_mtl_request_t>,
    /// FI_CONTEXT/FI_CONTEXT2 room: the provider's while an operation is in flight;
    /// Rust code only takes its address (and fills it under the scribble test hook
    /// before a post).
    ctx: Cell<fi::fi_context2>,
    pub body: B,
}

impl<B> Deref for MtlRequest<B> {
    type Target = B;
    #[inline(always)]
    fn deref(&self) -> &B {
        &self.body
    }
}

impl<B> DerefMut for MtlRequest<B> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut B {
        &mut self.body
    }
}

impl<B> MtlRequest<B> {
    /// Bytes the PML must reserve after its request for the rest of the layout.
    pub const EXTRA: usize = size_of::<Self>() - size_of::<sys::mca_mtl_request_t>();

    /// An internal request: no PML request behind it.
    #[inline]
    pub fn internal(body: B) -> Self {
        MtlRequest {
            head: Cell::new(request::NO_PML),
            ctx: Cell::new(fi::fi_context2::default()),
            body,
        }
    }

    /// A PML request stands behind this one.
    #[inline(always)]
    pub fn has_pml(&self) -> bool {
        request::has_pml(&self.head.get())
    }
}

/// A live request, reached by address: the PML's (from an entry point), or an internal
/// one of the component's (on its heap or its stack).
///
/// Invariant (the contract of every constructor): the handle points to an initialised
/// [`MtlRequest`] that stays alive, and does not move, until its last completion is
/// reaped and it is completed to its owner (the PML, or the code that made it). The
/// handle lends only shared references to it, and the body's fields are `Cell`s (or
/// atomics), so that a completion that writes the request re-entrantly, from a
/// progress call made in the middle of an operation on it, never aliases a `&mut`.
/// Threads hand a request over through a counter of the body (release/acquire) or a
/// lock, as the C MTL does, so two threads never use it at once. Whether a handle may
/// cross threads depends on the body, so the component claims `Send` for its own.
pub struct ReqRef<B>(NonNull<MtlRequest<B>>);

impl<B> Clone for ReqRef<B> {
    #[inline(always)]
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for ReqRef<B> {}
impl<B> PartialEq for ReqRef<B> {
    #[inline(always)]
    fn eq(&self, o: &Self) -> bool {
        self.0 == o.0
    }
}
impl<B> Eq for ReqRef<B> {}
impl<B> fmt::Debug for ReqRef<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ReqRef").field(&self.0).finish()
    }
}

impl<B> ReqRef<B> {
    /// The request, shared for as long as the handle is borrowed.
    #[inline(always)]
    pub fn get(&self) -> &MtlRequest<B> {
        // SAFETY: the handle's invariant: a live, initialised request that does not
        // move, used by one thread at a time, whose fields are all Cells or atomics, so
        // a shared reference stays valid while other handles write it.
        unsafe { self.0.as_ref() }
    }

    /// Initialise the PML's request `req`, with our bytes behind it, with `body`.
    ///
    /// # Safety
    /// `req` is the PML's request of the current operation, with
    /// [`MtlRequest::EXTRA`] bytes of ours behind its head, alive until we complete it.
    #[inline]
    pub unsafe fn init_at(req: *mut sys::mca_mtl_request_t, body: B) -> Self {
        let r = req as *mut MtlRequest<B>;
        // SAFETY: the caller's promise: room for a request behind the head (never
        // null), which the PML filled in and which is written back unchanged; the old
        // bytes are overwritten without being dropped.
        unsafe {
            r.write(MtlRequest {
                head: Cell::new(req.read()),
                ctx: Cell::new(fi::fi_context2::default()),
                body,
            });
            ReqRef(NonNull::new_unchecked(r))
        }
    }

    /// The PML's request `req`, initialised by an earlier [`ReqRef::init_at`].
    ///
    /// # Safety
    /// `req` heads a request of ours the PML has not seen complete.
    #[inline(always)]
    pub unsafe fn of_pml(req: NonNull<sys::mca_mtl_request_t>) -> Self {
        ReqRef(req.cast())
    }

    /// The request an operation's context belongs to (a completion's `op_context`).
    ///
    /// # Safety
    /// `ctx` is null or what [`ReqRef::context_for_post`] returned for an operation whose
    /// completion is being reaped now.
    #[inline]
    pub unsafe fn of_context(ctx: *mut c_void) -> Option<Self> {
        // The caller's promise: ctx is the ctx field of a live request, so the request
        // starts offset_of!(MtlRequest<B>, ctx) bytes before it.
        let r = ctx.wrapping_byte_sub(offset_of!(MtlRequest<B>, ctx)) as *mut MtlRequest<B>;
        NonNull::new(ctx).and(NonNull::new(r)).map(ReqRef)
    }

    /// The request at `addr` ([`ReqRef::addr`]); `None` for 0.
    ///
    /// # Safety
    /// `addr` is 0 or the address of a live request whose invariant still holds.
    #[inline(always)]
    pub unsafe fn of_addr(addr: u64) -> Option<Self> {
        NonNull::new(addr as *mut MtlRequest<B>).map(ReqRef)
    }

    /// A handle to `r`, an internal request of the caller's.
    ///
    /// # Safety
    /// `r` is neither moved, freed nor used other than through handles until its last
    /// completion is reaped (the caller waits for it, or keeps it alive until the
    /// component is torn down).
    #[inline(always)]
    pub unsafe fn of(r: &mut MtlRequest<B>) -> Self {
        ReqRef(NonNull::from(r))
    }

    /// A request on the heap that lives until [`ReqRef::into_box`].
    #[inline]
    pub fn leak(r: Box<MtlRequest<B>>) -> Self {
        ReqRef(NonNull::from(Box::leak(r)))
    }

    /// Take back a request made by [`ReqRef::leak`].
    ///
    /// # Safety
    /// `self` came from [`ReqRef::leak`], no operation of it is in flight, and no
    /// handle to it is used afterwards.
    #[inline]
    pub unsafe fn into_box(self) -> Box<MtlRequest<B>> {
        // SAFETY: the caller's promise: the Box `leak` leaked, with nothing in flight
        // and no handle used afterwards.
        unsafe { Box::from_raw(self.0.as_ptr()) }
    }

    /// The address, as software matching's tokens carry it.
    #[inline(always)]
    pub fn addr(self) -> u64 {
        self.0.as_ptr() as u64
    }

    /// The address a handle to `r` would have (to find a request by its handle).
    #[inline(always)]
    pub fn addr_of(r: &MtlRequest<B>) -> u64 {
        r as *const MtlRequest<B> as u64
    }

    /// The context to post an operation of this request with, filled with `garbage`
    /// first when it is given (the scribble test hook).
    #[inline]
    pub fn context_for_post(self, garbage: Option<fi::fi_context2>) -> OpContext {
        if let Some(g) = garbage {
            self.get().ctx.set(g);
        }
        self.posted_context()
    }

    /// The context an operation of this request was posted with (to cancel it).
    #[inline]
    pub fn posted_context(self) -> OpContext {
        // SAFETY: the handle's invariant: the request, and with it its ctx field, lives
        // until the operation's completion is reaped; Rust code writes ctx only before
        // a post (`context_for_post`), never while the provider holds it.
        unsafe { OpContext::new(NonNull::from(&self.get().ctx).cast()) }
    }

    /// Publish `status` to the PML's request and tell the PML it is complete. The
    /// handle is not used afterwards (the PML may free the request).
    #[inline]
    pub fn complete_with(self, status: Status) {
        // SAFETY: the handle's invariant: a live request, whose PML ompi_request_t (if
        // any) outlives it; nothing uses the handle after the callback.
        unsafe { request::complete(self.get().head.as_ptr(), status) }
    }

    /// Tell the PML a cancel did not take.
    #[inline]
    pub fn mark_not_cancelled(self) {
        // SAFETY: the handle's invariant: a live request, headed by the PML's.
        unsafe { request::mark_not_cancelled(self.get().head.as_ptr()) }
    }

    /// The heap block of a request followed by `tail` bytes.
    fn tail_layout(tail: usize) -> Option<std::alloc::Layout> {
        // A request's size is a multiple of its alignment, so the tail follows it.
        std::alloc::Layout::from_size_align(
            size_of::<MtlRequest<B>>() + tail,
            std::mem::align_of::<MtlRequest<B>>(),
        )
        .ok()
    }

    /// `r` followed, in one heap block, by a copy of `head` then `data`: the handle
    /// and the address of the copy; `None` without memory. Freed by
    /// [`ReqRef::free_with_tail`].
    pub fn alloc_with_tail(r: MtlRequest<B>, head: &[u8], data: &[u8]) -> Option<(Self, *mut u8)> {
        let layout = Self::tail_layout(head.len() + data.len())?;
        // SAFETY: the layout has a non-zero size (it holds a request); a block that is
        // not null has room for the request followed by both copies.
        unsafe {
            let p = NonNull::new(std::alloc::alloc(layout) as *mut MtlRequest<B>)?;
            p.write(r);
            let tail = (p.as_ptr() as *mut u8).add(size_of::<MtlRequest<B>>());
            ptr::copy_nonoverlapping(head.as_ptr(), tail, head.len());
            ptr::copy_nonoverlapping(data.as_ptr(), tail.add(head.len()), data.len());
            Some((ReqRef(p), tail))
        }
    }

    /// Drop and free a request made by [`ReqRef::alloc_with_tail`] with `tail` bytes.
    ///
    /// # Safety
    /// `self` came from `alloc_with_tail` with `tail` bytes in all, no operation of it
    /// is in flight, and no handle to it is used afterwards.
    pub unsafe fn free_with_tail(self, tail: usize) {
        // SAFETY: the caller's promise: the block alloc_with_tail made, with that
        // layout, used no more.
        unsafe {
            let r = self.0.as_ptr();
            ptr::drop_in_place(r);
            if let Some(layout) = Self::tail_layout(tail) {
                std::alloc::dealloc(r as *mut u8, layout);
            }
        }
    }
}
