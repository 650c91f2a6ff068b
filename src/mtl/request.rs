//! The MTL request: the bytes the PML allocates behind its `mca_mtl_request_t`, and
//! the internal requests (acknowledgements, probes, claims, blocking sends) that use
//! the same layout, so that every completion finds its request through the context.
//!
//! What it owns: the request's layout, its initialisation and its hand-over to the
//! PML. What it must not touch: what each kind of request does on completion
//! (`completion`).

use crate::fabric::FI_ADDR_UNSPEC;
use crate::ompi;
use crate::ompi::comm::Comm;
use crate::ompi::convertor::Convertor;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::mem::offset_of;
use std::os::raw::{c_int, c_void};
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

/// The MTL request: the PML allocates `mtl_request_size` bytes after its
/// `mca_mtl_request_t`, which is this struct's first field. Internal operations
/// (acknowledgements, probes, claims, blocking sends) use the same layout.
#[repr(C)]
pub struct Request {
    pub sup: sys::mca_mtl_request_t,
    /// Handed to libfabric as the operation context (FI_CONTEXT/FI_CONTEXT2 room).
    pub ctx: fi::fi_context2,
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
    pub(super) unsafe fn init(r: *mut Request, kind: Kind, comm: Option<Comm>) {
        // SAFETY: the caller guarantees the memory; we write each field without
        // reading the (uninitialised) old value.
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

    /// A fully owned internal request on the heap or the stack.
    pub(crate) fn internal(kind: Kind, comm: Option<Comm>) -> Request {
        let mut r = std::mem::MaybeUninit::<Request>::uninit();
        // SAFETY: r has room for a Request; sup is set right after.
        unsafe {
            Request::init(r.as_mut_ptr(), kind, comm);
            ptr::addr_of_mut!((*r.as_mut_ptr()).sup).write(ompi::request::NO_PML);
            r.assume_init()
        }
    }

    /// The request's communicator. Every send, receive, probe and claim has one; only
    /// software matching's buffers and the stall breaker's requests (before a claim
    /// gives them one) have none, and an error stands for it there.
    #[inline(always)]
    pub(super) fn comm(&self) -> Result<Comm, c_int> {
        self.comm.ok_or(sys::OMPI_ERR_BAD_PARAM)
    }

    #[inline]
    pub(super) fn ctx_ptr(&mut self) -> *mut c_void {
        crate::common::quirks::scribble(&mut self.ctx);
        ptr::addr_of_mut!(self.ctx) as *mut c_void
    }

    /// The request an operation context belongs to.
    ///
    /// # Safety
    /// `ctx` must be the `ctx` field of a live Request.
    #[inline]
    pub(super) unsafe fn from_ctx(ctx: *mut c_void) -> *mut Request {
        // SAFETY: forwarded; ctx lies offset_of!(Request, ctx) bytes into it.
        unsafe { (ctx as *mut u8).sub(offset_of!(Request, ctx)) as *mut Request }
    }

    /// Publish the status to the PML's request and tell the PML it is complete.
    ///
    /// # Safety
    /// `r` must be a live PML request (sup.ompi_req set).
    pub(super) unsafe fn complete_to_pml(r: *mut Request) {
        // SAFETY: forwarded; the PML's ompi_request_t outlives the MTL request, and
        // nothing here uses r after the callback.
        unsafe { ompi::request::complete(ptr::addr_of_mut!((*r).sup), (*r).status) }
    }
}
