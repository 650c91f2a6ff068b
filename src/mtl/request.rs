//! The MTL request: the bytes the PML allocates behind its `mca_mtl_request_t`, and
//! the internal requests (acknowledgements, probes, claims, blocking sends) that use
//! the same layout, so that every completion finds its request through the context.
//!
//! What it owns: the request's layout, its initialisation and its hand-over to the
//! PML. What it must not touch: what each kind of request does on completion
//! (`completion`).

use crate::fabric::FI_ADDR_UNSPEC;
use crate::fabric::{Local, MemoryRegion, OpContext};
use crate::ompi;
use crate::ompi::comm::Comm;
use crate::ompi::convertor::{Convertor, RecvBuffer, SendData};
use libfabric_sys as fi;
use ompi_sys as sys;
use std::mem::offset_of;
use std::os::raw::{c_int, c_void};
use std::ptr::{self, NonNull};
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

/// The MTL request: the PML allocates `mtl_request_size` bytes after its
/// `mca_mtl_request_t`, which is this struct's first field. Internal operations
/// (acknowledgements, probes, claims, blocking sends) use the same layout.
#[repr(C)]
pub struct Request {
    pub sup: sys::mca_mtl_request_t,
    /// Handed to libfabric as the operation context (FI_CONTEXT/FI_CONTEXT2 room).
    pub ctx: fi::fi_context2,
    /// What the request is. [`Kind::Copied`] is set only by [`Req::alloc_copied`],
    /// whose block `Req::free_copied` frees by that kind.
    pub kind: Kind,
    /// Completions still expected before the request is complete.
    pub pending: AtomicI32,
    pub status: Status,
    pub comm: Option<Comm>,
    pub convertor: Option<Convertor>,
    /// Where the data is received into (user memory, or a pack buffer we own).
    pub buffer: *mut u8,
    pub length: usize,
    pub owns_buffer: bool,
    /// Probe result: found, and the matched tag/data/length.
    pub probe_found: bool,
    pub matched_tag: u64,
    pub matched_data: u64,
    /// Cancel bookkeeping for receives.
    pub cancel_requested: bool,
    /// Software matching: the header sent or matched, the peer, the registration.
    pub sm_hdr: super::softmatch::Hdr,
    pub sm_addr: u64,
    pub sm_mr: *mut c_void,
    /// Source address a receive is posted with.
    pub post_addr: u64,
    /// A receive with a negative tag (Open MPI's own), see [`Deferred`].
    pub rx_internal: bool,
    /// Counted in [`RxBudget`]: posted to the provider and not yet completed.
    pub in_provider: bool,
}

pub use crate::ompi::request::Status;

/// Bytes the PML must reserve after its request for us.
pub const REQUEST_EXTRA: usize =
    std::mem::size_of::<Request>() - std::mem::size_of::<sys::mca_mtl_request_t>();

impl Request {
    /// Initialise every field but `sup` (which the PML filled in) in place.
    ///
    /// # Safety
    /// `r` must point to `size_of::<Request>()` writable bytes.
    unsafe fn init(r: *mut Request, kind: Kind, comm: Option<Comm>) {
        // SAFETY: the caller guarantees the memory; each field is written without
        // reading (or dropping) the uninitialised old value.
        unsafe {
            ptr::addr_of_mut!((*r).ctx).write(std::mem::zeroed());
            ptr::addr_of_mut!((*r).kind).write(kind);
            ptr::addr_of_mut!((*r).pending).write(AtomicI32::new(0));
            ptr::addr_of_mut!((*r).status).write(Status::default());
            ptr::addr_of_mut!((*r).comm).write(comm);
            ptr::addr_of_mut!((*r).convertor).write(None);
            ptr::addr_of_mut!((*r).buffer).write(ptr::null_mut());
            ptr::addr_of_mut!((*r).length).write(0);
            ptr::addr_of_mut!((*r).owns_buffer).write(false);
            ptr::addr_of_mut!((*r).probe_found).write(false);
            ptr::addr_of_mut!((*r).matched_tag).write(0);
            ptr::addr_of_mut!((*r).matched_data).write(0);
            ptr::addr_of_mut!((*r).cancel_requested).write(false);
            ptr::addr_of_mut!((*r).sm_hdr).write(Default::default());
            ptr::addr_of_mut!((*r).sm_addr).write(0);
            ptr::addr_of_mut!((*r).sm_mr).write(ptr::null_mut());
            ptr::addr_of_mut!((*r).post_addr).write(FI_ADDR_UNSPEC);
            ptr::addr_of_mut!((*r).rx_internal).write(false);
            ptr::addr_of_mut!((*r).in_provider).write(false);
        }
    }

    /// A fully owned internal request (on the heap or the stack; reached through a
    /// [`Req`] while an operation of it is posted). A [`Kind::Copied`] request is made
    /// only by [`Req::alloc_copied`] (its block is freed by that kind): asked for one,
    /// this makes a [`Kind::Send`].
    pub(crate) fn internal(kind: Kind, comm: Option<Comm>) -> Request {
        let kind = if kind == Kind::Copied {
            Kind::Send
        } else {
            kind
        };
        Request::internal_of(kind, comm)
    }

    fn internal_of(kind: Kind, comm: Option<Comm>) -> Request {
        let mut r = std::mem::MaybeUninit::<Request>::uninit();
        // SAFETY: r has room for a Request; init writes every field but sup, written
        // right after, so the whole value is initialised.
        unsafe {
            Request::init(r.as_mut_ptr(), kind, comm);
            ptr::addr_of_mut!((*r.as_mut_ptr()).sup).write(ompi::request::NO_PML);
            r.assume_init()
        }
    }

    /// The first `n` bytes (at most its length) of the buffer this request owns, once
    /// its receive completed; empty without one.
    #[inline]
    pub(super) fn received(&self, n: usize) -> &[u8] {
        if !self.owns_buffer || self.buffer.is_null() {
            return &[];
        }
        // SAFETY: an owned buffer holds `length` bytes (`Req::alloc_buffer`), and
        // `&self` means no operation on the request is in flight.
        unsafe { std::slice::from_raw_parts(self.buffer, n.min(self.length)) }
    }

    /// Free the buffer this request owns, if any.
    #[inline]
    pub(super) fn free_buffer(&mut self) {
        if self.owns_buffer {
            // SAFETY: an owned buffer comes from libc::malloc (`Req::alloc_buffer`, the
            // convertor's pack buffers), and `&mut self` means nothing references it.
            unsafe { libc::free(self.buffer as *mut c_void) };
            self.owns_buffer = false;
            self.buffer = ptr::null_mut();
        }
    }
}

/// The one heap block of a copied send: its request, then its bytes.
fn copied_layout(total: usize) -> Option<std::alloc::Layout> {
    // A Request's size is a multiple of its alignment, so the copy follows it directly.
    std::alloc::Layout::from_size_align(
        std::mem::size_of::<Request>() + total,
        std::mem::align_of::<Request>(),
    )
    .ok()
}

/// A live request of ours, reached by address: the PML's (from an entry point), or an
/// internal one (an acknowledgement pool's, a probe's, a claim's, a bounce buffer's, a
/// blocking send's on the caller's stack).
///
/// Invariant: the handle points to an initialised [`Request`] that stays alive, and
/// does not move, until its last completion is reaped and it is completed to its owner
/// (the PML, or the code that made it). Its fields are read and written one at a time
/// through the handle (raw reads and writes, never a reference to the whole request),
/// so that a completion that writes the request re-entrantly, from a progress call
/// made in the middle of an operation on it, never aliases a live `&mut Request`.
/// Threads hand a request over through its `pending` counter (release/acquire) or a
/// lock, as the C MTL does. A handle is `Copy`: the MTL copies it only into what drops
/// it before the request completes (the waiting queues, the lists of software
/// matching, the table of synchronous sends), which is why its methods are crate-private.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Req(NonNull<Request>);

// SAFETY: a request is handed between threads only through its `pending` counter
// (release/acquire) or under a lock (the queues that hold handles), see the invariant.
unsafe impl Send for Req {}

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
                    // SAFETY: the handle's invariant: a live, initialised Request; the
                    // field is read by value, without a reference to the request.
                    unsafe { ptr::addr_of!((*self.0.as_ptr()).$rname).read() }
                }
            )*
            $(
                #[inline(always)]
                pub(crate) fn $set(self, v: $t) {
                    // SAFETY: the handle's invariant: a live, initialised Request; the
                    // field holds a Copy value, overwritten without a reference to the
                    // request.
                    unsafe { ptr::addr_of_mut!((*self.0.as_ptr()).$name).write(v) }
                }
            )*
        }
    };
}

fields! {
    read: kind: Kind, length: usize, owns_buffer: bool, sup: sys::mca_mtl_request_t,
        status: Status, comm: Option<Comm>, convertor: Option<Convertor>,
        probe_found: bool, matched_tag: u64, matched_data: u64,
        sm_hdr: super::softmatch::Hdr, sm_addr: u64, sm_mr: *mut c_void, post_addr: u64,
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
    /// Change the kind of a receive as software matching reads its message (`Recv` to
    /// `SmRead` and back). A [`Kind::Copied`] request stays one, and no other becomes one:
    /// `free_copied` frees a Copied request's block by that kind.
    #[inline]
    pub(crate) fn set_kind(self, kind: Kind) {
        if kind == Kind::Copied || self.kind() == Kind::Copied {
            return;
        }
        // SAFETY: the handle's invariant: a live, initialised Request; a plain field
        // write of a Copy value.
        unsafe { ptr::addr_of_mut!((*self.0.as_ptr()).kind).write(kind) }
    }

    /// Initialise the PML's request `req`, with our bytes behind it, as a request of
    /// `kind`.
    ///
    /// # Safety
    /// `req` is the PML's request of the current operation, with `mtl_request_size`
    /// bytes of ours behind its head, alive until we complete it.
    #[inline]
    pub(crate) unsafe fn init_pml(req: *mut sys::mca_mtl_request_t, kind: Kind, comm: Comm) -> Req {
        let r = req as *mut Request;
        // SAFETY: the caller's promise: room for a Request, whose head the PML filled in; the PML's
        // request is never null.
        unsafe {
            Request::init(r, kind, Some(comm));
            Req(NonNull::new_unchecked(r))
        }
    }

    /// The PML's request `req`, initialised by an earlier [`Req::init_pml`].
    ///
    /// # Safety
    /// `req` heads a request of ours the PML has not seen complete.
    #[inline]
    pub(crate) unsafe fn of_pml(req: NonNull<sys::mca_mtl_request_t>) -> Req {
        Req(req.cast())
    }

    /// The request an operation's context belongs to (a completion's `op_context`).
    ///
    /// # Safety
    /// `ctx` is null or what [`Req::op_context`] returned for an operation whose
    /// completion is being reaped now.
    #[inline]
    pub(crate) unsafe fn of_context(ctx: *mut c_void) -> Option<Req> {
        // The caller's promise: ctx is the ctx field of a live Request, so the request
        // starts offset_of!(Request, ctx) bytes before it.
        let r = ctx.wrapping_byte_sub(offset_of!(Request, ctx)) as *mut Request;
        NonNull::new(ctx).and(NonNull::new(r)).map(Req)
    }

    /// The request whose address software matching sent as a token ([`Req::addr`]);
    /// `None` for 0.
    ///
    /// # Safety
    /// `token` is 0 or the address of a live request of ours that still expects the
    /// completion the token stands for.
    #[inline]
    pub(crate) unsafe fn of_token(token: u64) -> Option<Req> {
        NonNull::new(token as *mut Request).map(Req)
    }

    /// What a receive completion reports in this request's buffer: `len` bytes at its
    /// start, or, in a multi-receive buffer (`multi`), at the completion's `buf` (an
    /// address, only compared); `None` when `buf` lies outside the buffer. The bytes
    /// stay valid until the buffer is posted again.
    #[inline]
    pub(crate) fn received_at<'a>(self, multi: bool, buf: usize, len: usize) -> Option<&'a [u8]> {
        // SAFETY: the handle's invariant; the buffer holds `length` bytes (see
        // `recv_buf`) and its receive completed, so nothing writes it until it is
        // posted again, which the caller does only after it is done with the bytes.
        unsafe {
            let r = self.0.as_ptr();
            crate::fabric::ep::received((*r).buffer, (*r).length, multi, buf as *const c_void, len)
        }
    }

    /// A handle to `r`, an internal request of the caller's.
    ///
    /// # Safety
    /// `r` is neither moved, freed nor used other than through handles until its last
    /// completion is reaped (the caller waits for it, or keeps it alive until the MTL is
    /// torn down).
    #[inline(always)]
    pub(crate) unsafe fn of(r: &mut Request) -> Req {
        Req(NonNull::from(r))
    }

    /// The address, as software matching's tokens carry it.
    #[inline(always)]
    pub(crate) fn addr(self) -> u64 {
        self.0.as_ptr() as u64
    }

    /// The address a handle to `r` would have (to find a request by its handle).
    #[inline(always)]
    pub(crate) fn addr_of(r: &Request) -> u64 {
        r as *const Request as u64
    }

    /// The completions still expected.
    #[inline(always)]
    pub(crate) fn pending(&self) -> &AtomicI32 {
        // SAFETY: the handle's invariant: a live Request; the counter is an atomic,
        // shared with whoever completes the request, borrowed only as long as `self`.
        unsafe { &(*self.0.as_ptr()).pending }
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
        // SAFETY: the handle's invariant: the request, and with it its ctx field, lives
        // until the operation's completion is reaped; no operation of it is in flight
        // while it is being posted, so nothing else uses ctx now, and afterwards only the
        // provider does (the data path only takes its address).
        unsafe {
            let ctx = ptr::addr_of_mut!((*self.0.as_ptr()).ctx);
            crate::common::quirks::scribble(&mut *ctx);
            OpContext::new(NonNull::new_unchecked(ctx))
        }
    }

    /// The context an operation of this request was posted with (to cancel it).
    #[inline]
    pub(crate) fn posted_context(self) -> OpContext {
        // SAFETY: the handle's invariant: the request, and with it its ctx field, lives
        // until the operation's completion is reaped; no one but the provider reads or
        // writes ctx (the data path only takes its address).
        unsafe {
            let ctx = ptr::addr_of_mut!((*self.0.as_ptr()).ctx);
            OpContext::new(NonNull::new_unchecked(ctx))
        }
    }

    /// Take over the memory a receive lands in (the user's, or a buffer of ours that
    /// this request now owns and frees at completion).
    #[inline]
    pub(crate) fn set_recv_buffer(self, b: RecvBuffer) {
        let (ptr, len, owned) = b.into_parts();
        self.set_raw_buffer(ptr, len, owned);
    }

    /// Give the request a fresh buffer of `len` bytes it owns (freed at completion).
    pub(crate) fn alloc_buffer(self, len: usize) -> Result<(), c_int> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: plain allocation; checked for null below.
        let b = unsafe { libc::malloc(len) } as *mut u8;
        if b.is_null() {
            return Err(sys::OMPI_ERR_OUT_OF_RESOURCE);
        }
        self.set_raw_buffer(b, len, true);
        Ok(())
    }

    #[inline(always)]
    fn set_raw_buffer(self, ptr: *mut u8, len: usize, owned: bool) {
        // SAFETY: the handle's invariant: a live Request; plain field writes.
        unsafe {
            let r = self.0.as_ptr();
            ptr::addr_of_mut!((*r).buffer).write(ptr);
            ptr::addr_of_mut!((*r).length).write(len);
            ptr::addr_of_mut!((*r).owns_buffer).write(owned);
        }
    }

    /// Where the request's receive lands, for the fabric.
    #[inline]
    pub(crate) fn recv_buf(self) -> Local {
        // SAFETY: buffer and length are set only from a `RecvBuffer` (the user's memory,
        // valid until the PML's request completes, or ours) or by `alloc_buffer` (ours,
        // freed only by `free_buffer` after the completion), so they describe memory
        // that stays valid, and that only the provider touches, until the receive
        // completes.
        unsafe {
            let r = self.0.as_ptr();
            Local::new(
                ptr::addr_of!((*r).buffer).read().cast(),
                ptr::addr_of!((*r).length).read(),
                ptr::null_mut(),
            )
        }
    }

    /// The data of a send, for the fabric: the request takes over a pack buffer (and
    /// frees it at its last completion, or the caller with [`Req::free_buffer`] when
    /// the post fails); a contiguous user buffer stays the PML's.
    #[inline]
    pub(crate) fn send_buf(self, data: SendData) -> Local {
        let (ptr, len, owned) = data.into_parts();
        if owned {
            self.set_raw_buffer(ptr as *mut u8, len, true);
        }
        // SAFETY: a pack buffer is owned by the request from here until its last
        // completion (or a failed post); the user's contiguous buffer is valid until
        // the PML's request completes, which is after the send's completion.
        unsafe { Local::new(ptr.cast_mut().cast(), len, ptr::null_mut()) }
    }

    /// Copy `bytes` into the request's buffer at `at`, as much as fits; the bytes
    /// copied.
    #[inline]
    pub(crate) fn write_at(self, at: usize, bytes: &[u8]) -> usize {
        let cap = self.length();
        if at >= cap {
            return 0;
        }
        let n = bytes.len().min(cap - at);
        if n > 0 {
            // SAFETY: the buffer holds `length` bytes (see `recv_buf`), no operation
            // writes it now (the caller matched the message itself), and n <= cap - at.
            unsafe {
                let b = ptr::addr_of!((*self.0.as_ptr()).buffer).read();
                ptr::copy_nonoverlapping(bytes.as_ptr(), b.add(at), n);
            }
        }
        n
    }

    /// Free the buffer the request owns, if any.
    #[inline]
    pub(crate) fn free_buffer(self) {
        if self.owns_buffer() {
            // SAFETY: the handle's invariant; the owned buffer came from libc::malloc
            // (`alloc_buffer`, a convertor's pack buffer) and its operation is over.
            unsafe {
                let r = self.0.as_ptr();
                libc::free(ptr::addr_of!((*r).buffer).read() as *mut c_void);
                ptr::addr_of_mut!((*r).buffer).write(ptr::null_mut());
                ptr::addr_of_mut!((*r).owns_buffer).write(false);
            }
        }
    }

    /// Unpack the first `n` received bytes of the buffer the request owns into the
    /// user's datatype, then free it.
    #[inline]
    pub(crate) fn unpack_owned(self, n: usize) {
        if !self.owns_buffer() {
            return;
        }
        if let Some(conv) = self.convertor() {
            let n = n.min(self.length());
            // SAFETY: the owned buffer holds `length` bytes, of which the receive that
            // just completed wrote the first n; nothing else references it.
            let bytes = unsafe {
                let b = ptr::addr_of!((*self.0.as_ptr()).buffer).read();
                std::slice::from_raw_parts(b, n)
            };
            conv.unpack(bytes);
        }
        self.free_buffer();
    }

    /// Keep `mr`, the registration of a rendezvous send's buffer, until [`Req::take_mr`].
    #[inline]
    pub(crate) fn keep_mr(self, mr: MemoryRegion) {
        drop(self.take_mr());
        let p = Box::into_raw(Box::new(mr)) as *mut c_void;
        // SAFETY: the handle's invariant; a plain field write.
        unsafe { ptr::addr_of_mut!((*self.0.as_ptr()).sm_mr).write(p) }
    }

    /// Take back the registration [`Req::keep_mr`] kept, if any.
    #[inline]
    pub(crate) fn take_mr(self) -> Option<Box<MemoryRegion>> {
        // SAFETY: the handle's invariant; sm_mr is null or the Box `keep_mr` leaked,
        // taken once (cleared here).
        unsafe {
            let f = ptr::addr_of_mut!((*self.0.as_ptr()).sm_mr);
            let p = f.read() as *mut MemoryRegion;
            f.write(ptr::null_mut());
            (!p.is_null()).then(|| Box::from_raw(p))
        }
    }

    /// The software-matching header kept in the request, as the first part of a send
    /// (the request lives until the send's completion, and nothing but
    /// [`Req::stamp_sm_hdr`] between attempts writes the header meanwhile).
    #[inline]
    pub(crate) fn sm_hdr_buf(self) -> Local {
        // SAFETY: the handle's invariant: the request, with its header, lives until the
        // send's completion, and the header is written only before each attempt.
        unsafe {
            Local::new(
                ptr::addr_of_mut!((*self.0.as_ptr()).sm_hdr).cast(),
                std::mem::size_of::<super::softmatch::Hdr>(),
                ptr::null_mut(),
            )
        }
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
        let total = head.len() + data.len();
        let layout = copied_layout(total)?;
        // SAFETY: the layout has a non-zero size (it holds a Request); a block that is
        // not null has room for a Request followed by total bytes, into which the two
        // sources, which hold what is copied, are copied.
        let c = unsafe {
            let c = NonNull::new(std::alloc::alloc(layout) as *mut Request)?;
            let p = c.as_ptr();
            p.write(Request::internal_of(Kind::Copied, None));
            let buf = (p as *mut u8).add(std::mem::size_of::<Request>());
            ptr::copy_nonoverlapping(head.as_ptr(), buf, head.len());
            ptr::copy_nonoverlapping(data.as_ptr(), buf.add(head.len()), data.len());
            (*p).buffer = buf;
            (*p).length = total;
            c
        };
        Some(Req(c))
    }

    /// The copy of a [`Req::alloc_copied`] request, to send.
    #[inline]
    pub(crate) fn copied_buf(self) -> Local {
        // SAFETY: the handle's invariant; a Copied request's buffer is the copy in its
        // own block, which lives until `free_copied` after its completion.
        unsafe {
            let r = self.0.as_ptr();
            Local::new((*r).buffer.cast(), (*r).length, ptr::null_mut())
        }
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
        // SAFETY: a Copied request heads a block from alloc_copied with the layout of
        // its length (the only place that makes one); its operation is over.
        unsafe {
            let r = self.0.as_ptr();
            let total = (*r).length;
            ptr::drop_in_place(r);
            if let Some(layout) = copied_layout(total) {
                std::alloc::dealloc(r as *mut u8, layout);
            }
        }
    }

    /// A PML request stands behind this one.
    #[inline(always)]
    pub(crate) fn has_pml(self) -> bool {
        ompi::request::has_pml(&self.sup())
    }

    /// Publish the status to the PML's request and tell the PML it is complete. The
    /// handle is not used afterwards (the PML may free the request).
    #[inline]
    pub(crate) fn complete_to_pml(self) {
        // SAFETY: the handle's invariant: a live request, which the PML's
        // ompi_request_t outlives; nothing uses the handle after the callback.
        unsafe {
            let r = self.0.as_ptr();
            ompi::request::complete(ptr::addr_of_mut!((*r).sup), (*r).status)
        }
    }

    /// Tell the PML a cancel did not take.
    #[inline]
    pub(crate) fn mark_not_cancelled(self) {
        // SAFETY: the handle's invariant: a live request, headed by the PML's.
        unsafe { ompi::request::mark_not_cancelled(ptr::addr_of_mut!((*self.0.as_ptr()).sup)) }
    }

    /// A request on the heap that lives until [`Req::into_box`].
    #[inline]
    pub(crate) fn leak(r: Box<Request>) -> Req {
        Req(NonNull::from(Box::leak(r)))
    }

    /// Take back a request made by [`Req::leak`].
    ///
    /// # Safety
    /// `self` came from [`Req::leak`], no operation of it is in flight, and no handle
    /// to it is used afterwards.
    #[inline]
    pub(crate) unsafe fn into_box(self) -> Box<Request> {
        // SAFETY: the caller's promise: the Box `leak` leaked, with nothing in flight and no
        // handle used afterwards.
        unsafe { Box::from_raw(self.0.as_ptr()) }
    }
}
