//! The MTL request: the bytes the PML allocates behind its `mca_mtl_request_t`, and
//! the internal requests (acknowledgements, probes, claims, blocking sends) that use
//! the same layout, so that every completion finds its request through the context.
//!
//! The layout itself (the PML's head, the context, then this body) and the handle's
//! raw accesses are `ompi::mtl_request`'s; this module owns the body: its fields,
//! their initialisation, and the memory its operations use. What it must not touch:
//! what each kind of request does on completion (`completion`).

use crate::fabric::FI_ADDR_UNSPEC;
use crate::fabric::{Local, MemoryRegion, OpContext};
use crate::ompi::comm::Comm;
use crate::ompi::convertor::{Convertor, OpBuffer, RecvBuffer, SendData};
use crate::ompi::mtl_request::{MtlRequest, ReqRef};
use libfabric_sys as fi;
use ompi_sys as sys;
use std::cell::Cell;
use std::mem::ManuallyDrop;
use std::os::raw::c_int;
use std::ptr;
use std::sync::atomic::AtomicI32;

/// What kind of operation a request's context belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Kind {
    /// A send the PML waits for (isend, or a blocking send on our stack).
    Send,
    /// A receive of the PML's.
    Recv,
    /// The receive of a synchronous send's acknowledgement (heap, owned by us).
    Ack,
    /// A peek (probe) on our stack.
    Probe,
    /// A claim receive after an mprobe (heap, owned by the message).
    Claim,
    /// A receive buffer of software matching (heap, owned by `SoftMatch`).
    Bounce,
    /// A receive of software matching reading a rendezvous message.
    SmRead,
    /// A copy of a small message in flight after its send request was completed
    /// (software matching; heap, buffer and request freed at completion).
    Copied,
    /// A peek, then the receive of the message peeked, taking it off a full provider
    /// queue (stall.rs; heap, owned by the breaker and then the stash).
    Stash,
}

/// The MTL's part of a request, after the PML's head and the operations' context
/// ([`MtlRequest`]). Internal operations (acknowledgements, probes, claims, blocking
/// sends) use the same layout.
///
/// Every field is a `Cell` (or an atomic), as [`ReqRef`] requires: handles lend only
/// shared references, and a completion may write the request re-entrantly.
#[repr(C)]
pub struct Body {
    /// What the request is. [`Kind::Copied`] is set only by [`Req::alloc_copied`],
    /// whose block `Req::free_copied` frees by that kind.
    kind: Cell<Kind>,
    /// Completions still expected before the request is complete.
    pub pending: AtomicI32,
    pub status: Cell<Status>,
    pub comm: Cell<Option<Comm>>,
    pub convertor: Cell<Option<Convertor>>,
    /// Where the data is received into (user memory, or a pack buffer we own), or the
    /// pack buffer a send owns.
    buf: Cell<OpBuffer>,
    /// Probe result: the matched tag/data/length, and found (after `cancel_requested`,
    /// where it takes no room of its own).
    pub matched_tag: Cell<u64>,
    pub matched_data: Cell<u64>,
    /// Cancel bookkeeping for receives.
    pub cancel_requested: Cell<bool>,
    pub probe_found: Cell<bool>,
    /// Software matching: the header sent or matched, the peer, the registration.
    pub sm_hdr: Cell<super::softmatch::Hdr>,
    pub sm_addr: Cell<u64>,
    /// The registration `Req::keep_mr` kept. Not dropped with the request, as the
    /// PML frees its requests without dropping them: `Req::take_mr` hands it back.
    sm_mr: Cell<Option<ManuallyDrop<Box<MemoryRegion>>>>,
    /// Source address a receive is posted with.
    pub post_addr: Cell<u64>,
    /// A receive with a negative tag (Open MPI's own), see [`Deferred`].
    pub rx_internal: Cell<bool>,
    /// Counted in [`RxBudget`]: posted to the provider and not yet completed.
    pub in_provider: Cell<bool>,
}

/// A whole request of the MTL.
pub type Request = MtlRequest<Body>;

/// A live request of the MTL, reached by address (see [`ReqRef`] for its invariant).
/// A handle is `Copy`: the MTL copies it only into what drops it before the request
/// completes (the waiting queues, the lists of software matching, the table of
/// synchronous sends), which is why its methods are crate-private.
pub type Req = ReqRef<Body>;

// SAFETY: a request is handed between threads only through its `pending` counter
// (release/acquire) or under a lock (the queues that hold handles), see `ReqRef`'s
// invariant; the body's raw pointers (its buffer, its registration, the PML's objects)
// are reached only by the thread that holds the request.
unsafe impl Send for Req {}

pub use crate::ompi::request::Status;

/// Bytes the PML must reserve after its request for us.
pub const REQUEST_EXTRA: usize = Request::EXTRA;

impl Body {
    /// The body of a PML request of `kind` on `comm` (for [`ReqRef::init_at`]).
    #[inline]
    pub(crate) fn pml(kind: Kind, comm: Comm) -> Body {
        Body::new(kind, Some(comm))
    }

    /// A new request of `kind` for `comm`.
    fn new(kind: Kind, comm: Option<Comm>) -> Body {
        Body {
            kind: Cell::new(kind),
            pending: AtomicI32::new(0),
            status: Cell::new(Status::default()),
            comm: Cell::new(comm),
            convertor: Cell::new(None),
            buf: Cell::new(OpBuffer::NONE),
            matched_tag: Cell::new(0),
            matched_data: Cell::new(0),
            cancel_requested: Cell::new(false),
            probe_found: Cell::new(false),
            sm_hdr: Cell::new(Default::default()),
            sm_addr: Cell::new(0),
            sm_mr: Cell::new(None),
            post_addr: Cell::new(FI_ADDR_UNSPEC),
            rx_internal: Cell::new(false),
            in_provider: Cell::new(false),
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind.get()
    }

    /// Change the kind of a request (a receive as software matching reads its
    /// message, `Recv` to `SmRead` and back; a stashed message as it is claimed). A
    /// [`Kind::Copied`] request stays one, and no other becomes one: `free_copied`
    /// frees a Copied request's block by that kind.
    pub fn set_kind(&self, kind: Kind) {
        if kind != Kind::Copied && self.kind.get() != Kind::Copied {
            self.kind.set(kind);
        }
    }

    /// Free the buffer this request owns, if any.
    ///
    /// # Safety
    /// No operation of the request that uses the buffer is in flight.
    #[inline]
    unsafe fn free_owned(&self) {
        let b = self.buf.get();
        if b.owned() {
            self.buf.set(OpBuffer::NONE);
            // SAFETY: no operation uses the buffer (the caller's promise), and the
            // field, its only copy, was cleared above, so it is freed once.
            unsafe { b.free() };
        }
    }
}

impl Request {
    /// A fully owned internal request (on the heap or the stack; reached through a
    /// [`Req`] while an operation of it is posted). A [`Kind::Copied`] request is made
    /// only by [`Req::alloc_copied`] (its block is freed by that kind): asked for one,
    /// this makes a [`Kind::Send`].
    pub(crate) fn of_kind(kind: Kind, comm: Option<Comm>) -> Request {
        let kind = if kind == Kind::Copied {
            Kind::Send
        } else {
            kind
        };
        MtlRequest::internal(Body::new(kind, comm))
    }

    /// The first `n` bytes (at most its length) of the buffer this request owns, once
    /// its receive completed; empty without one.
    #[inline]
    pub(super) fn received(&mut self, n: usize) -> &[u8] {
        let b = self.buf.get();
        if !b.owned() {
            return &[];
        }
        // SAFETY: `&mut self`: no handle, and so no operation, reaches the request.
        unsafe { b.bytes(0, n) }
    }

    /// Free the buffer this request owns, if any.
    #[inline]
    pub(super) fn free_buffer(&mut self) {
        // SAFETY: `&mut self`: no handle, and so no operation, reaches the request.
        unsafe { self.free_owned() }
    }
}

/// A getter per `Copy` field, and a setter per field that any value may take (not
/// every field needs both). The buffer fields, which `recv_buf` and `free_buffer`
/// trust, and the kind, which `free_copied` trusts, have no free setter.
macro_rules! fields {
    (read: $($rname:ident : $rt:ty),* ; write: $($name:ident / $set:ident : $t:ty),* $(,)?) => {
        #[allow(dead_code)]
        impl Req {
            $(
                #[inline(always)]
                pub(crate) fn $rname(self) -> $rt {
                    self.get().$rname.get()
                }
            )*
            $(
                #[inline(always)]
                pub(crate) fn $set(self, v: $t) {
                    self.get().$name.set(v)
                }
            )*
        }
    };
}

fields! {
    read: status: Status, comm: Option<Comm>, convertor: Option<Convertor>,
        probe_found: bool, matched_tag: u64, matched_data: u64,
        sm_hdr: super::softmatch::Hdr, sm_addr: u64, post_addr: u64,
        rx_internal: bool, in_provider: bool;
    write:
    status / set_status: Status,
    comm / set_comm: Option<Comm>,
    convertor / set_convertor: Option<Convertor>,
    probe_found / set_probe_found: bool,
    matched_tag / set_matched_tag: u64,
    matched_data / set_matched_data: u64,
    sm_hdr / set_sm_hdr: super::softmatch::Hdr,
    sm_addr / set_sm_addr: u64,
    post_addr / set_post_addr: u64,
    rx_internal / set_rx_internal: bool,
    in_provider / set_in_provider: bool,
}

impl Req {
    #[inline(always)]
    pub(crate) fn kind(self) -> Kind {
        self.get().kind()
    }

    /// [`Body::set_kind`].
    #[inline]
    pub(crate) fn set_kind(self, kind: Kind) {
        self.get().set_kind(kind)
    }

    /// What a receive completion reports in this request's buffer: `len` bytes at its
    /// start, or, in a multi-receive buffer (`multi`), at the completion's `buf` (an
    /// address, only compared); `None` when `buf` lies outside the buffer. The bytes
    /// stay valid until the buffer is posted again.
    #[inline]
    pub(crate) fn received_at<'a>(self, multi: bool, buf: usize, len: usize) -> Option<&'a [u8]> {
        let b = self.get().buf.get();
        let at = if multi { buf.wrapping_sub(b.addr()) } else { 0 };
        if at >= b.len() {
            return None;
        }
        // SAFETY: the buffer's receive completed, so nothing writes it until it is
        // posted again, which the caller does only after it is done with the bytes.
        Some(unsafe { b.bytes(at, len) })
    }

    /// The completions still expected.
    #[inline(always)]
    pub(crate) fn pending(&self) -> &AtomicI32 {
        &self.get().pending
    }

    /// Change the status through `f` (on a copy, written back).
    #[inline(always)]
    pub(crate) fn update_status(self, f: impl FnOnce(&mut Status)) {
        let mut s = self.status();
        f(&mut s);
        self.set_status(s);
    }

    /// The context to post an operation of this request with (filled with garbage
    /// first under the test hook of `common::quirks::scribble`).
    #[inline]
    pub(crate) fn op_context(self) -> OpContext {
        let garbage = crate::common::quirks::scribble_contexts().then(|| {
            let mut c = fi::fi_context2::default();
            crate::common::quirks::scribble(&mut c);
            c
        });
        self.context_for_post(garbage)
    }

    /// Take over the memory a receive lands in (the user's, or a buffer of ours that
    /// this request now owns and frees at completion).
    #[inline]
    pub(crate) fn set_recv_buffer(self, b: RecvBuffer) {
        self.get().buf.set(OpBuffer::recv(b));
    }

    /// Give the request a fresh buffer of `len` bytes it owns (freed at completion).
    pub(crate) fn alloc_buffer(self, len: usize) -> Result<(), c_int> {
        if len == 0 {
            return Ok(());
        }
        let b = OpBuffer::alloc(len).ok_or(sys::OMPI_ERR_OUT_OF_RESOURCE)?;
        self.get().buf.set(b);
        Ok(())
    }

    /// Where the request's receive lands, for the fabric.
    #[inline]
    pub(crate) fn recv_buf(self) -> Local {
        self.get().buf.get().local()
    }

    /// The data of a send, for the fabric: the request takes over a pack buffer (and
    /// frees it at its last completion, or the caller with [`Req::free_buffer`] when
    /// the post fails); a contiguous user buffer stays the PML's.
    #[inline]
    pub(crate) fn send_buf(self, data: SendData) -> Local {
        let b = OpBuffer::send(data);
        if b.owned() {
            self.get().buf.set(b);
        }
        b.local()
    }

    /// Copy `bytes` into the request's buffer at `at`, as much as fits; the bytes
    /// copied.
    #[inline]
    pub(crate) fn write_at(self, at: usize, bytes: &[u8]) -> usize {
        // SAFETY: no operation uses the buffer now: the caller matched the message
        // itself (or stamps a copy not yet posted).
        unsafe { self.get().buf.get().write_at(at, bytes) }
    }

    /// Free the buffer the request owns, if any.
    #[inline]
    pub(crate) fn free_buffer(self) {
        // SAFETY: the MTL frees a request's buffer only once its operations are over
        // (at completion, or after a post failed).
        unsafe { self.get().free_owned() }
    }

    /// Unpack the first `n` received bytes of the buffer the request owns into the
    /// user's datatype, then free it.
    #[inline]
    pub(crate) fn unpack_owned(self, n: usize) {
        let b = self.get().buf.get();
        if !b.owned() {
            return;
        }
        if let Some(conv) = self.convertor() {
            // SAFETY: the receive that just completed wrote the first n bytes, and
            // nothing else references the buffer, which the request owns.
            conv.unpack(unsafe { b.bytes(0, n) });
        }
        self.free_buffer();
    }

    /// Keep `mr`, the registration of a rendezvous send's buffer, until [`Req::take_mr`].
    #[inline]
    pub(crate) fn keep_mr(self, mr: MemoryRegion) {
        drop(self.take_mr());
        self.get().sm_mr.set(Some(ManuallyDrop::new(Box::new(mr))));
    }

    /// Take back the registration [`Req::keep_mr`] kept, if any.
    #[inline]
    pub(crate) fn take_mr(self) -> Option<Box<MemoryRegion>> {
        self.get().sm_mr.take().map(ManuallyDrop::into_inner)
    }

    /// The software-matching header kept in the request, as the first part of a send
    /// (the request lives until the send's completion, and nothing but
    /// [`Req::stamp_sm_hdr`] between attempts writes the header meanwhile).
    #[inline]
    pub(crate) fn sm_hdr_buf(self) -> Local {
        let h = &self.get().sm_hdr;
        // SAFETY: the handle's invariant: the request, with its header, lives until the
        // send's completion, and the header is written only before each attempt.
        unsafe { Local::new(h.as_ptr().cast(), std::mem::size_of_val(h), ptr::null_mut()) }
    }

    /// Number the header kept in the request (see `softmatch::order`); nothing for an
    /// unnumbered message (`seq` 0).
    #[inline]
    pub(crate) fn stamp_sm_hdr(self, seq: u32, src: u64) {
        if seq != 0 {
            let mut h = self.sm_hdr();
            h.seq = seq;
            h.src = src;
            self.set_sm_hdr(h);
        }
    }

    /// A request of kind [`Kind::Copied`] followed by a copy of `head` then `data`, in
    /// one block freed by [`Req::free_copied`]; `None` without memory.
    pub(crate) fn alloc_copied(head: &[u8], data: &[u8]) -> Option<Req> {
        let r = MtlRequest::internal(Body::new(Kind::Copied, None));
        let (c, copy) = ReqRef::alloc_with_tail(r, head, data)?;
        // SAFETY: the copy lives in the request's own block, freed by free_copied
        // after the send's completion.
        c.get()
            .buf
            .set(unsafe { OpBuffer::kept(copy, head.len() + data.len()) });
        Some(c)
    }

    /// The copy of a [`Req::alloc_copied`] request, to send.
    #[inline]
    pub(crate) fn copied_buf(self) -> Local {
        self.recv_buf()
    }

    /// Number the header at the start of a [`Req::alloc_copied`] request's copy (see
    /// `softmatch::order`).
    #[inline]
    pub(crate) fn stamp_copied(self, seq: u32, src: u64) {
        if seq != 0 {
            use super::softmatch::Hdr;
            self.write_at(std::mem::offset_of!(Hdr, seq), &seq.to_ne_bytes());
            self.write_at(std::mem::offset_of!(Hdr, src), &src.to_ne_bytes());
        }
    }

    /// Free a [`Req::alloc_copied`] request whose send completed, failed or was never
    /// posted; the handle is not used afterwards. A request of any other kind is left
    /// alone.
    pub(crate) fn free_copied(self) {
        if self.kind() != Kind::Copied {
            return;
        }
        // SAFETY: a Copied request is made only by alloc_copied, with a copy of
        // `length` bytes (never changed: its buffer has no other setter), and the
        // caller's operation on it is over.
        unsafe { self.free_with_tail(self.length()) }
    }

    /// The length of the request's buffer.
    #[inline(always)]
    pub(crate) fn length(self) -> usize {
        self.get().buf.get().len()
    }

    /// A PML request stands behind this one.
    #[inline(always)]
    pub(crate) fn has_pml(self) -> bool {
        self.get().has_pml()
    }

    /// Publish the status to the PML's request and tell the PML it is complete. The
    /// handle is not used afterwards (the PML may free the request).
    #[inline]
    pub(crate) fn complete_to_pml(self) {
        self.complete_with(self.status())
    }
}

#[cfg(test)]
mod tests {
    /// The bytes Open MPI reserves behind its request (mtl_request_size) for the
    /// layout of 64-bit Linux.
    #[test]
    fn request_extra_is_stable() {
        assert_eq!(super::REQUEST_EXTRA, 272);
    }
}
