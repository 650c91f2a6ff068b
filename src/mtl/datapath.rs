//! The tagged data path: the `extern "C"` entries of the MTL module and the
//! completion handling behind them.
//!
//! What it owns: the request layout the PML allocates for us, the progress loop, the
//! synchronous-send protocol and the probe/claim path. What it must not touch: object
//! setup and teardown (`setup.rs`), provider selection (`common`).
//!
//! Threading: every call into the endpoint and the completion queue holds
//! [`Mtl::lock`] (a real mutex only when MPI threads are enabled and the provider is
//! not `FI_THREAD_SAFE`). Completions are read under the lock and dispatched after it
//! is released, because a completion may post (the acknowledgement of a synchronous
//! send) or call into the PML.

use super::tag::{Envelope, Proto, TagLayout};
use crate::common::fbox;
use crate::ompi::{self, glue};
use libfabric_sys as fi;
use ompi_sys as sys;
use std::collections::VecDeque;
use std::mem::offset_of;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

pub const FI_ADDR_UNSPEC: u64 = u64::MAX;

pub use crate::common::sync::MaybeLock;

/// The per-process MTL state the data path reads. Built by `setup.rs`.
pub struct Mtl {
    /// Transmit/receive contexts and their CQs: one entry, the regular endpoint (`tx`
    /// and `rx` both `ep`), unless `mtl_ofi_enable_sep` opened a scalable endpoint.
    pub ctxs: Box<[Ctx]>,
    /// `rx_ctx_bits` of the AV (0 without a scalable endpoint).
    pub rx_ctx_bits: u32,
    pub layout: TagLayout,
    pub inject_size: usize,
    /// `FI_DIRECTED_RECV` is in effect: named-source receives pass the source address.
    pub directed: bool,
    /// The provider meets a receive with a message that arrived before it only in its
    /// progress (`common::quirks::Quirks::lags_in_auto_progress`): a peek reads the completion
    /// queue first.
    pub lazy_matching: bool,
    pub events_per_progress: usize,
    pub lock: MaybeLock,
    /// Receives end with this many bytes of shared scratch, so that the provider never
    /// truncates (see `common::quirks::Quirks::truncation_unsafe`); null when unused.
    /// Its contents are garbage: whatever lands there is never read.
    pub overflow: *mut u8,
    pub overflow_len: usize,
    pub sync_ids: AtomicU32,
    pub counters: Counters,
    /// Matching in software (see softmatch.rs), for providers whose tag matching is
    /// broken.
    pub soft: Option<Box<super::softmatch::SoftMatch>>,
    /// Receives waiting for room in the provider's receive queue, in MPI order
    /// (request addresses).
    pub deferred: Mutex<Deferred>,
    /// How much of the provider's receive queue each class of receive may take.
    pub rx: RxBudget,
    /// Sends waiting for the provider, in order.
    pub(super) deferred_sends: Mutex<VecDeque<PendingSend>>,
    pub has_deferred_sends: std::sync::atomic::AtomicBool,
    pub has_deferred: std::sync::atomic::AtomicBool,
    /// `Deferred::stash` holds messages (stall.rs): receives and probes look there first.
    pub has_stash: std::sync::atomic::AtomicBool,
    /// A stall breaker runs (stall.rs).
    pub breaker_busy: std::sync::atomic::AtomicBool,
    /// Receives between their check of `has_deferred`/`has_stash` and their post on the
    /// fast path of `irecv` (counted only with MPI threads): the stall breaker waits
    /// for them before it looks at the provider.
    pub fast_posts: AtomicUsize,
    /// Receives posted to the provider from the deferred queue, or on the fast path
    /// under MPI threads. The stall breaker runs only when none was posted since its
    /// progress call read the completion queue: a receive posted after that read may
    /// not have met a message that arrived before it yet (sockets matches them in its
    /// progress), and a peek would report that message as unexpected.
    pub posted_gen: std::sync::atomic::AtomicU64,
    /// `MPI_Improbe` is between its peek and its exact receive (with MPI threads):
    /// receives take the slow path, behind the `deferred` lock it holds, so that none
    /// is posted to the provider in between.
    pub claim_busy: std::sync::atomic::AtomicBool,
}

/// One transmit/receive context pair and the CQ both report to.
#[derive(Clone, Copy)]
pub struct Ctx {
    pub tx: *mut fi::fid_ep,
    pub rx: *mut fi::fid_ep,
    pub cq: *mut fi::fid_cq,
}

impl Mtl {
    /// The context of communicator `cid`: `cid % contexts`, the same in every process
    /// (communicator ids are agreed by their members), so the sender addresses the
    /// receive context the receiver posts on. The C MTL numbers contexts in each
    /// process's order of communicator creation, which differs between processes
    /// that create different communicators.
    #[inline(always)]
    pub fn ctx(&self, cid: u32) -> &Ctx {
        if self.ctxs.len() == 1 {
            &self.ctxs[0]
        } else {
            &self.ctxs[cid as usize % self.ctxs.len()]
        }
    }

    /// `fi_rx_addr(addr, context of cid, rx_ctx_bits)`: the peer's receive context
    /// for communicator `cid`.
    #[inline(always)]
    pub fn rx_addr(&self, addr: u64, cid: u32) -> u64 {
        if self.rx_ctx_bits == 0 || addr == FI_ADDR_UNSPEC {
            addr
        } else {
            let index = cid as usize % self.ctxs.len();
            crate::common::endpoint::rx_addr(addr, index, self.rx_ctx_bits)
        }
    }

    /// The endpoint software matching uses: the regular endpoint (software matching
    /// never opens a scalable one).
    #[inline(always)]
    pub fn ep(&self) -> *mut fi::fid_ep {
        self.ctxs[0].tx
    }
}

/// Receives waiting for room in the provider's queue, in MPI order within each class
/// (request addresses). The two classes never match the same message: `internal`
/// holds Open MPI's own receives (negative tags: collectives over pml cm), which
/// `MPI_ANY_TAG` does not match (see tag.rs), `user` every other receive.
#[derive(Default)]
pub struct Deferred {
    pub user: VecDeque<usize>,
    pub internal: VecDeque<usize>,
    /// Messages of the user's class taken off the provider that no receive matched yet,
    /// oldest first (see stall.rs).
    pub stash: VecDeque<Box<Request>>,
}

impl Deferred {
    fn queue(&mut self, internal: bool) -> &mut VecDeque<usize> {
        if internal {
            &mut self.internal
        } else {
            &mut self.user
        }
    }

    fn is_empty(&self) -> bool {
        self.user.is_empty() && self.internal.is_empty()
    }

    /// Take `r` out of whichever queue holds it.
    fn remove(&mut self, r: usize) -> bool {
        for q in [&mut self.user, &mut self.internal] {
            if let Some(i) = q.iter().position(|&d| d == r) {
                q.remove(i);
                return true;
            }
        }
        false
    }
}

/// The provider's receive queue holds `capacity` receives. The user's receives may
/// fill it only up to `capacity - reserve`: a program may post more receives than the
/// queue holds before any of their sends, then enter a collective, whose receives
/// must still reach the provider (else the job deadlocks, as it does with the C MTL).
pub struct RxBudget {
    user: AtomicUsize,
    internal: AtomicUsize,
    user_max: usize,
    total_max: usize,
    threads: bool,
}

impl RxBudget {
    /// `capacity` 0: unknown, no limit of ours (the provider's `-FI_EAGAIN` still is).
    pub fn new(capacity: usize, threads: bool) -> RxBudget {
        let (user_max, total_max) = if capacity == 0 {
            (usize::MAX, usize::MAX)
        } else {
            let reserve = (capacity / 8).clamp(1, 256);
            (capacity.saturating_sub(reserve).max(1), capacity)
        };
        RxBudget {
            user: AtomicUsize::new(0),
            internal: AtomicUsize::new(0),
            user_max,
            total_max,
            threads,
        }
    }

    #[inline]
    fn counter(&self, internal: bool) -> &AtomicUsize {
        if internal {
            &self.internal
        } else {
            &self.user
        }
    }

    /// May one more receive of this class go to the provider?
    #[inline]
    pub fn room(&self, internal: bool) -> bool {
        let u = self.user.load(Ordering::Relaxed);
        let i = self.internal.load(Ordering::Relaxed);
        u.saturating_add(i) < self.total_max && (internal || u < self.user_max)
    }

    #[inline]
    fn change(&self, internal: bool, up: bool) {
        let c = self.counter(internal);
        if self.threads {
            if up {
                c.fetch_add(1, Ordering::Relaxed);
            } else {
                c.fetch_sub(1, Ordering::Relaxed);
            }
        } else {
            // One thread in MPI at a time: no locked instruction needed.
            let v = c.load(Ordering::Relaxed);
            c.store(
                if up { v + 1 } else { v.saturating_sub(1) },
                Ordering::Relaxed,
            );
        }
    }

    /// Are MPI threads enabled?
    pub fn threads(&self) -> bool {
        self.threads
    }

    /// How many of the user's receives may be in the provider at once.
    pub fn user_max(&self) -> usize {
        self.user_max
    }

    /// Receives of each class in the provider now (user, internal).
    pub fn posted(&self) -> (usize, usize) {
        (
            self.user.load(Ordering::Relaxed),
            self.internal.load(Ordering::Relaxed),
        )
    }
}

/// `r` is about to be posted: count it (before posting, so that its completion,
/// possibly on another thread, never finds the count at zero).
///
/// # Safety
/// `r` must be a live receive.
#[inline]
unsafe fn rx_enter(m: &Mtl, r: *mut Request) {
    // SAFETY: forwarded.
    unsafe {
        m.rx.change((*r).rx_internal, true);
        (*r).in_provider = true;
    }
}

/// `r` left the provider's queue (completed, failed, cancelled, or never got in).
///
/// # Safety
/// `r` must be a live receive.
#[inline]
unsafe fn rx_leave(m: &Mtl, r: *mut Request) {
    // SAFETY: forwarded.
    unsafe {
        if (*r).in_provider {
            (*r).in_provider = false;
            m.rx.change((*r).rx_internal, false);
        }
    }
}

#[derive(Default)]
pub struct Counters {
    pub cq_errors: AtomicU64,
    pub eagain: AtomicU64,
    /// Received messages whose envelope failed [`TagLayout::decode`].
    pub bad_envelopes: AtomicU64,
    /// Messages taken off the provider while receives waited for room (stall.rs).
    pub stalls_broken: AtomicU64,
    /// Exact receives of a peeked message that another receive took (`recv_exact`).
    pub exact_lost: AtomicU64,
    /// Completions read from each context's CQ, counted only with several contexts
    /// (a scalable endpoint with thread grouping).
    pub per_ctx: Box<[AtomicU64]>,
}

// SAFETY: the raw fid pointers are only used under `lock` when the provider's
// threading level requires it (see setup.rs, which chooses the lock from the
// negotiated FI_THREAD_* level); the objects live until finalize.
unsafe impl Send for Mtl {}
// SAFETY: as above.
unsafe impl Sync for Mtl {}

/// The running MTL of this process (null before init and after finalize).
pub static MTL: AtomicPtr<Mtl> = AtomicPtr::new(ptr::null_mut());

#[inline]
pub(super) fn mtl() -> Option<&'static Mtl> {
    let p = MTL.load(Ordering::Acquire);
    // SAFETY: MTL points to a leaked Box that finalize frees only after the PML has
    // stopped calling us (mtl_finalize is the last call of the module).
    unsafe { p.as_ref() }
}

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
    pub comm: *mut sys::ompi_communicator_t,
    pub convertor: *mut sys::opal_convertor_t,
    /// Where the data is received into (user memory, or a pack buffer we own).
    pub buffer: *mut u8,
    pub length: usize,
    pub owns_buffer: bool,
    /// The parent of an acknowledgement receive.
    pub parent: *mut Request,
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

#[derive(Clone, Copy, Default, Debug)]
pub struct Status {
    pub source: c_int,
    pub tag: c_int,
    pub error: c_int,
    pub cancelled: bool,
    pub count: usize,
}

/// Bytes the PML must reserve after its request for us.
pub const REQUEST_EXTRA: usize =
    std::mem::size_of::<Request>() - std::mem::size_of::<sys::mca_mtl_request_t>();

impl Request {
    /// Initialise every field but `sup` (which the PML filled in) in place.
    ///
    /// # Safety
    /// `r` must point to `size_of::<Request>()` writable bytes.
    unsafe fn init(r: *mut Request, kind: Kind, comm: *mut sys::ompi_communicator_t) {
        // SAFETY: the caller guarantees the memory; we write each field without
        // reading the (uninitialised) old value.
        unsafe {
            ptr::addr_of_mut!((*r).ctx).write(std::mem::zeroed());
            ptr::addr_of_mut!((*r).kind).write(kind);
            ptr::addr_of_mut!((*r).pending).write(AtomicI32::new(0));
            ptr::addr_of_mut!((*r).status).write(Status::default());
            ptr::addr_of_mut!((*r).comm).write(comm);
            ptr::addr_of_mut!((*r).convertor).write(ptr::null_mut());
            ptr::addr_of_mut!((*r).buffer).write(ptr::null_mut());
            ptr::addr_of_mut!((*r).length).write(0);
            ptr::addr_of_mut!((*r).owns_buffer).write(false);
            ptr::addr_of_mut!((*r).parent).write(ptr::null_mut());
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
    pub(crate) fn internal(kind: Kind, comm: *mut sys::ompi_communicator_t) -> Request {
        let mut r = std::mem::MaybeUninit::<Request>::uninit();
        // SAFETY: r has room for a Request; sup is set right after.
        unsafe {
            Request::init(r.as_mut_ptr(), kind, comm);
            ptr::addr_of_mut!((*r.as_mut_ptr()).sup).write(sys::mca_mtl_request_t {
                ompi_req: ptr::null_mut(),
                completion_callback: None,
            });
            r.assume_init()
        }
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
    unsafe fn from_ctx(ctx: *mut c_void) -> *mut Request {
        // SAFETY: forwarded; ctx lies offset_of!(Request, ctx) bytes into it.
        unsafe { (ctx as *mut u8).sub(offset_of!(Request, ctx)) as *mut Request }
    }

    /// Publish the status to the PML's request and tell the PML it is complete.
    ///
    /// # Safety
    /// `r` must be a live PML request (sup.ompi_req set).
    unsafe fn complete_to_pml(r: *mut Request) {
        // SAFETY: forwarded; the PML's ompi_request_t outlives the MTL request.
        unsafe {
            let st = (*r).status;
            let oreq = (*r).sup.ompi_req;
            if !oreq.is_null() {
                let s = &mut (*oreq).req_status;
                s.MPI_SOURCE = st.source;
                s.MPI_TAG = st.tag;
                s.MPI_ERROR = st.error;
                s._ucount = st.count;
                s._cancelled = st.cancelled as c_int;
            }
            if let Some(cb) = (*r).sup.completion_callback {
                cb(ptr::addr_of_mut!((*r).sup));
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Peers

/// What add_procs stores in `proc_endpoints[OMPI_PROC_ENDPOINT_TAG_MTL]`.
pub struct PeerEndpoint {
    pub addr: fi::fi_addr_t,
    /// The ring claimed in the peer's fast-box segment (software matching on shm,
    /// `softmatch`), if any.
    pub fbox: Option<fbox::Tx>,
}

/// A peer as the send paths see it: its fabric address and fast box.
#[derive(Clone, Copy)]
pub struct Peer {
    pub addr: fi::fi_addr_t,
    fbox: *const fbox::Tx,
}

impl Peer {
    /// A peer that cannot be named (its messages go nowhere).
    pub const UNKNOWN: Peer = Peer {
        addr: FI_ADDR_UNSPEC,
        fbox: ptr::null(),
    };

    /// The ring to the peer's fast-box segment, if any.
    #[inline(always)]
    pub fn fbox(&self) -> Option<&fbox::Tx> {
        // SAFETY: the ring lives in the peer's PeerEndpoint until del_procs, after
        // which nothing is sent to the peer.
        unsafe { self.fbox.as_ref() }
    }
}

/// The fabric address of `rank` in `comm`, adding the proc if it was not yet known.
#[inline]
pub(super) fn peer_addr(
    comm: *mut sys::ompi_communicator_t,
    rank: c_int,
) -> Result<fi::fi_addr_t, c_int> {
    peer(comm, rank).map(|p| p.addr)
}

/// `rank` of `comm` ([`Peer`]), adding the proc if it was not yet known.
#[inline]
pub(super) fn peer(comm: *mut sys::ompi_communicator_t, rank: c_int) -> Result<Peer, c_int> {
    let of = |ep: *mut PeerEndpoint| {
        // SAFETY: we stored a PeerEndpoint there; it lives until del_procs.
        let ep = unsafe { &*ep };
        Peer {
            addr: ep.addr,
            fbox: ep
                .fbox
                .as_ref()
                .map_or(ptr::null(), |t| t as *const fbox::Tx),
        }
    };
    // SAFETY: comm is a live communicator the PML passed; the glue resolves sentinels.
    let proc_ = unsafe { glue::ompi_ofi_glue_comm_peer(comm, rank) };
    if proc_.is_null() {
        return Err(sys::OMPI_ERR_BAD_PARAM);
    }
    // SAFETY: proc_ is a live ompi_proc_t.
    let ep = unsafe { (*proc_).proc_endpoints[sys::OMPI_PROC_ENDPOINT_TAG_MTL as usize] }
        as *mut PeerEndpoint;
    if !ep.is_null() {
        return Ok(of(ep));
    }
    let mut procs = [proc_];
    super::setup::add_procs_inner(&mut procs)?;
    // SAFETY: as above, now filled in by add_procs.
    let ep = unsafe { (*proc_).proc_endpoints[sys::OMPI_PROC_ENDPOINT_TAG_MTL as usize] }
        as *mut PeerEndpoint;
    if ep.is_null() {
        Err(sys::OMPI_ERR_UNREACH)
    } else {
        Ok(of(ep))
    }
}

#[inline]
fn comm_cid(comm: *mut sys::ompi_communicator_t) -> u32 {
    // SAFETY: comm is a live communicator.
    unsafe { (*comm).c_contextid }
}

/// The size of the communicator's remote group (its size for an intracommunicator):
/// the bound of a received source rank.
#[inline]
fn comm_size(comm: *mut sys::ompi_communicator_t) -> c_int {
    // (Not ompi_comm_remote_size, which is 0 for an intracommunicator.)
    // SAFETY: comm is a live communicator; its remote group (the local group for an
    // intracommunicator) lives as long as it.
    unsafe {
        let g = (*comm).c_remote_group;
        if g.is_null() {
            0
        } else {
            (*g).grp_proc_count
        }
    }
}

/// Decode and check the envelope of a message received on `comm`. A rejected one is
/// logged and counted, and the caller reports it through the request or return code
/// (never a lookup of a rank outside the communicator, which would read out of bounds).
pub(super) fn envelope(
    m: &Mtl,
    comm: *mut sys::ompi_communicator_t,
    bits: u64,
    data: u64,
) -> Result<Envelope, c_int> {
    m.layout
        .decode(bits, data, comm_cid(comm), comm_size(comm))
        .map_err(|e| {
            m.counters.bad_envelopes.fetch_add(1, Ordering::Relaxed);
            log::error!("rejected a received message (tag {bits:#x}, data {data:#x}): {e}");
            sys::OMPI_ERROR
        })
}

#[inline]
fn comm_rank(comm: *mut sys::ompi_communicator_t) -> c_int {
    // SAFETY: comm is a live communicator.
    unsafe { (*comm).c_my_rank }
}

// ---------------------------------------------------------------------------
// Data: the convertor

/// What the data path needs to know about a convertor.
struct ConvInfo {
    /// Packed size in bytes.
    size: usize,
    /// Start of the data when it is one contiguous block (with the datatype's true
    /// lower bound applied, so MPI_BOTTOM with absolute addresses works).
    contig: Option<*mut u8>,
}

#[inline]
fn convertor_info(conv: *mut sys::opal_convertor_t) -> ConvInfo {
    let (mut size, mut contig, mut start, mut need) =
        (0usize, 0 as c_int, ptr::null_mut(), 0 as c_int);
    // SAFETY: conv is a prepared convertor from the PML; the outputs are valid.
    unsafe {
        glue::ompi_ofi_glue_convertor_info(conv, &mut size, &mut contig, &mut start, &mut need)
    };
    ConvInfo {
        size,
        contig: (contig != 0).then_some(start as *mut u8),
    }
}

struct SendData {
    ptr: *const u8,
    len: usize,
    owned: bool,
}

impl Drop for SendData {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: owned buffers come from libc::malloc in pack().
            unsafe { libc::free(self.ptr as *mut c_void) };
        }
    }
}

/// The bytes of a send: the user's memory when contiguous, else packed.
fn pack(conv: *mut sys::opal_convertor_t) -> Result<SendData, c_int> {
    let ConvInfo { size, contig } = convertor_info(conv);
    if size == 0 {
        return Ok(SendData {
            ptr: ptr::null(),
            len: 0,
            owned: false,
        });
    }
    if let Some(start) = contig {
        return Ok(SendData {
            ptr: start,
            len: size,
            owned: false,
        });
    }
    // SAFETY: plain allocation; checked for null.
    let buf = unsafe { libc::malloc(size) } as *mut u8;
    if buf.is_null() {
        return Err(sys::OMPI_ERR_OUT_OF_RESOURCE);
    }
    let mut iov = libc::iovec {
        iov_base: buf as *mut c_void,
        iov_len: size,
    };
    let mut count: u32 = 1;
    let mut max = size;
    // SAFETY: iov describes `size` writable bytes.
    let rc = unsafe {
        sys::opal_convertor_pack(
            conv,
            &mut iov as *mut _ as *mut sys::iovec,
            &mut count,
            &mut max,
        )
    };
    if rc < 0 {
        // SAFETY: allocated above.
        unsafe { libc::free(buf as *mut c_void) };
        return Err(sys::OMPI_ERROR);
    }
    Ok(SendData {
        ptr: buf,
        len: size,
        owned: true,
    })
}

/// Where a receive lands: the user's memory when contiguous, else a buffer we unpack.
fn recv_buffer(conv: *mut sys::opal_convertor_t) -> Result<(*mut u8, usize, bool), c_int> {
    let ConvInfo { size, contig } = convertor_info(conv);
    if size == 0 {
        return Ok((ptr::null_mut(), 0, false));
    }
    if let Some(start) = contig {
        return Ok((start, size, false));
    }
    // SAFETY: plain allocation; checked for null.
    let buf = unsafe { libc::malloc(size) } as *mut u8;
    if buf.is_null() {
        return Err(sys::OMPI_ERR_OUT_OF_RESOURCE);
    }
    Ok((buf, size, true))
}

/// Unpack `len` received bytes from our buffer into the user's datatype.
fn unpack(conv: *mut sys::opal_convertor_t, buf: *mut u8, len: usize) {
    if len == 0 || conv.is_null() {
        return;
    }
    let mut iov = libc::iovec {
        iov_base: buf as *mut c_void,
        iov_len: len,
    };
    let mut count: u32 = 1;
    let mut max = len;
    // SAFETY: buf holds len received bytes; the convertor writes at most its own
    // packed size into user memory.
    unsafe {
        sys::opal_convertor_unpack(
            conv,
            &mut iov as *mut _ as *mut sys::iovec,
            &mut count,
            &mut max,
        )
    };
}

// ---------------------------------------------------------------------------
// Progress

/// Read and dispatch completions. Returns how many were handled.
pub fn progress_mtl(m: &Mtl) -> usize {
    let gen = m.posted_gen.load(Ordering::SeqCst);
    let n = progress_cq(m);
    if let Some(sm) = m.soft.as_deref() {
        if sm.has_reads_waiting.load(Ordering::Acquire) {
            super::softmatch::post_waiting_reads(m, sm);
        }
        if sm.unposted.any() {
            super::softmatch::post_unposted(m, sm);
        }
        if sm.has_controls_waiting.load(Ordering::Acquire) {
            super::softmatch::post_waiting_controls(m, sm);
        }
    }
    if m.has_deferred_sends.load(Ordering::Acquire) {
        post_deferred_sends(m);
    }
    if m.has_deferred.load(Ordering::Acquire) {
        post_deferred(m);
        if n == 0 && m.soft.is_none() {
            super::stall::break_stall(m, gen);
        }
    }
    n
}

fn progress_cq(m: &Mtl) -> usize {
    // Software matching must see messages in the order the CQ delivers them: one
    // thread reads and dispatches at a time (a re-entrant call from a dispatch, or
    // another thread, returns at once).
    let _serial = match m.soft.as_deref() {
        Some(sm) => match sm.progress.try_enter() {
            Some(g) => Some(g),
            None => return 0,
        },
        None => None,
    };
    // Fast boxes first: a peer's records before its completions (they carry no order
    // between them, see softmatch).
    let boxed = match m.soft.as_deref() {
        // SAFETY: under the serial section taken above.
        Some(sm) => unsafe { sm.poll_fbox(m, m.events_per_progress) },
        None => 0,
    };
    if m.ctxs.len() == 1 {
        return boxed + progress_one_cq(m, m.ctxs[0].cq, m.events_per_progress);
    }
    let mut total = boxed;
    for (c, count) in m.ctxs.iter().zip(m.counters.per_ctx.iter()) {
        let n = progress_one_cq(m, c.cq, m.events_per_progress.saturating_sub(total).max(1));
        if n > 0 {
            count.fetch_add(n as u64, Ordering::Relaxed);
        }
        total += n;
    }
    total
}

/// Read and dispatch up to `budget` completions of `cq`.
fn progress_one_cq(m: &Mtl, cq: *mut fi::fid_cq, budget: usize) -> usize {
    const CHUNK: usize = 32;
    let mut total = 0usize;
    loop {
        let mut entries = [std::mem::MaybeUninit::<fi::fi_cq_tagged_entry>::uninit(); CHUNK];
        let want = CHUNK.min(budget.saturating_sub(total)).max(1);
        let (n, err) = {
            let _g = m.lock.lock();
            // SAFETY: the CQ is open; entries has room for `want` tagged entries.
            let ret = unsafe { fi::fi_cq_read(cq, entries.as_mut_ptr() as *mut c_void, want) };
            if ret == -(fi::FI_EAVAIL as isize) {
                // SAFETY: zeroed is a valid fi_cq_err_entry; err_data stays null so the
                // provider gives its own buffer.
                let mut e: fi::fi_cq_err_entry = unsafe { std::mem::zeroed() };
                // SAFETY: CQ open, e valid.
                let r = unsafe { fi::fi_cq_readerr(cq, &mut e, 0) };
                (0, if r >= 0 { Some(e) } else { None })
            } else if ret < 0 {
                if ret != -(fi::FI_EAGAIN as isize) {
                    log::error!("fi_cq_read: {}", crate::fabric::Error::from_ret(ret));
                }
                (0, None)
            } else {
                (ret as usize, None)
            }
        };
        // SAFETY: fi_cq_read wrote the first n entries.
        let read = unsafe {
            std::slice::from_raw_parts(entries.as_ptr() as *const fi::fi_cq_tagged_entry, n)
        };
        for e in read {
            // SAFETY: every operation we post carries the ctx of a live Request.
            unsafe { on_completion(m, e) };
        }
        total += n;
        if let Some(e) = err {
            total += 1;
            // SAFETY: as above.
            unsafe { on_error(m, &e) };
            continue;
        }
        if n < want || total >= budget {
            return total;
        }
    }
}

/// The progress callback registered with Open MPI.
pub extern "C" fn progress_cb() -> c_int {
    ffi_guard("mtl progress", 0, || match mtl() {
        Some(m) => progress_mtl(m) as c_int,
        None => 0,
    })
}

/// Spin on progress until `done` holds.
#[inline]
pub(super) fn wait_until(m: &Mtl, done: impl Fn() -> bool) {
    while !done() {
        if progress_mtl(m) == 0 {
            idle();
        }
    }
}

/// Nothing progressed: give the core away when Open MPI says to
/// (`mpi_yield_when_idle`, on by itself when a node is oversubscribed), as
/// `opal_progress` does, else spin. A rank blocked in a send spinning on a shared core
/// would hold off the very peer it waits for.
#[inline]
fn idle() {
    if ompi::progress::yield_when_idle() {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Retry `op` while it returns -FI_EAGAIN, progressing between attempts (flow control).
#[inline]
pub(super) fn retry(m: &Mtl, mut op: impl FnMut() -> isize) -> isize {
    loop {
        let ret = {
            let _g = m.lock.lock();
            op()
        };
        if ret != -(fi::FI_EAGAIN as isize) {
            return ret;
        }
        m.counters.eagain.fetch_add(1, Ordering::Relaxed);
        if progress_mtl(m) == 0 {
            idle();
        }
    }
}

pub(super) fn fi_to_ompi(ret: isize) -> c_int {
    crate::fabric::Error::from_ret(ret).to_opal()
}

/// # Safety
/// `e.op_context` must be the ctx of a live Request.
unsafe fn on_completion(m: &Mtl, e: &fi::fi_cq_tagged_entry) {
    if e.op_context.is_null() {
        return;
    }
    // SAFETY: forwarded.
    let r = unsafe { Request::from_ctx(e.op_context) };
    // SAFETY: r is live until we complete it.
    let kind = unsafe { (*r).kind };
    match kind {
        Kind::Bounce => {
            if let Some(sm) = m.soft.as_deref() {
                // SAFETY: r is one of the bounce requests, e its completion.
                unsafe { super::softmatch::bounce_completed(m, sm, r, e) };
            }
        }
        Kind::SmRead => {
            // SAFETY: r is a live receive reading its message.
            unsafe { super::softmatch::read_done(m, r) };
        }
        Kind::Copied => {
            if let Some(sm) = m.soft.as_deref() {
                // SAFETY: a Copied request is a Box leaked when posting, owning its buffer.
                unsafe { super::softmatch::copied_sent(sm, r) };
            }
        }
        Kind::Send => {
            // SAFETY: r is live.
            unsafe { finish_part(r) };
        }
        Kind::Ack => {
            // SAFETY: an Ack request is a Box we leaked when posting; its parent is a
            // live send request waiting for it.
            unsafe {
                let parent = (*r).parent;
                drop(Box::from_raw(r));
                finish_part(parent);
            }
        }
        Kind::Recv => {
            // SAFETY: r is a live receive.
            unsafe {
                rx_leave(m, r);
                recv_done(m, r, e.tag, e.data, e.len, true, sys::MPI_SUCCESS as c_int)
            };
        }
        Kind::Claim => {
            // SAFETY: r is a live claim receive (on the heap, owned by a message).
            unsafe {
                (*r).matched_tag = e.tag;
                (*r).matched_data = e.data;
                (*r).status.count = e.len;
                match envelope(m, (*r).comm, e.tag, e.data) {
                    Ok(env) if env.proto == Proto::Sync => {
                        send_ack(m, (*r).comm, env.source, env.sync_id)
                    }
                    Ok(_) => {}
                    Err(_) => (*r).status.error = sys::MPI_ERR_INTERN as c_int,
                }
                (*r).pending.store(0, Ordering::Release);
            }
        }
        Kind::Probe | Kind::Stash => {
            // SAFETY: r is a live probe on its caller's stack, or the breaker's request
            // it waits for.
            unsafe {
                (*r).probe_found = true;
                (*r).matched_tag = e.tag;
                (*r).matched_data = e.data;
                (*r).status.count = e.len;
                (*r).pending.store(0, Ordering::Release);
            }
        }
    }
}

/// One expected completion of `r` arrived; complete it when it was the last.
///
/// # Safety
/// `r` must be live.
pub(super) unsafe fn finish_part(r: *mut Request) {
    // SAFETY: forwarded.
    unsafe {
        if (*r).pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            if (*r).owns_buffer {
                libc::free((*r).buffer as *mut c_void);
                (*r).owns_buffer = false;
            }
            if !(*r).sup.ompi_req.is_null() {
                Request::complete_to_pml(r);
            }
        }
    }
}

/// Complete receive `r` with the message of `tag`/`data` (remote CQ data), `len`
/// bytes long. `ack`: acknowledge a synchronous send (the provider matched it; false
/// where software matching acknowledges itself or the message was not delivered).
/// The data word is read whether or not the completion carries FI_REMOTE_CQ_DATA,
/// as the C MTL does: sockets leaves the flag off on some completions (always when
/// the word sent was 0, i.e. from rank 0 with synchronous-send id 0).
///
/// # Safety
/// `r` must be a live receive request.
pub(super) unsafe fn recv_done(
    m: &Mtl,
    r: *mut Request,
    tag: u64,
    data: u64,
    len: usize,
    ack: bool,
    error: c_int,
) {
    // SAFETY: forwarded.
    unsafe {
        let env = envelope(m, (*r).comm, tag, data);
        recv_done_with(m, r, env, len, ack, error)
    }
}

/// [`recv_done`] with the envelope already decoded by [`envelope`] (software
/// matching decodes it once per message, for the sender's address and here).
///
/// # Safety
/// `r` must be a live receive request.
pub(super) unsafe fn recv_done_with(
    m: &Mtl,
    r: *mut Request,
    env: Result<Envelope, c_int>,
    len: usize,
    ack: bool,
    error: c_int,
) {
    // SAFETY: forwarded.
    unsafe {
        let Ok(env) = env else {
            // Not a message any peer of this communicator sent: fail the receive
            // (the data that landed in the buffer is not delivered).
            (*r).status.source = sys::MPI_ANY_SOURCE;
            (*r).status.tag = sys::MPI_ANY_TAG;
            (*r).status.error = sys::MPI_ERR_INTERN as c_int;
            (*r).status.count = 0;
            if (*r).owns_buffer {
                libc::free((*r).buffer as *mut c_void);
                (*r).buffer = ptr::null_mut();
                (*r).owns_buffer = false;
            }
            Request::complete_to_pml(r);
            return;
        };
        (*r).status.source = env.source;
        (*r).status.tag = env.tag;
        // A message longer than the receive: the provider said so (error), or it
        // reported the full length (udp;ofi_rxd does not flag truncation), or the
        // excess went to the overflow area.
        (*r).status.error = if len > (*r).length {
            sys::MPI_ERR_TRUNCATE as c_int
        } else {
            error
        };
        (*r).status.count = len.min((*r).length);
        if env.proto == Proto::Sync && ack {
            send_ack(m, (*r).comm, env.source, env.sync_id);
        }
        if (*r).owns_buffer {
            unpack((*r).convertor, (*r).buffer, (*r).status.count);
            libc::free((*r).buffer as *mut c_void);
            (*r).buffer = ptr::null_mut();
            (*r).owns_buffer = false;
        }
        Request::complete_to_pml(r);
    }
}

/// Tell the sender of a synchronous send that it was matched.
pub(super) fn send_ack(m: &Mtl, comm: *mut sys::ompi_communicator_t, source: c_int, id: u32) {
    let addr = match peer_addr(comm, source) {
        Ok(a) => a,
        Err(_) => {
            log::error!("cannot acknowledge a synchronous send from rank {source}: unknown peer");
            return;
        }
    };
    let tag = m.layout.ack_tag(id);
    let cid = comm_cid(comm);
    let (tx, addr) = (m.ctx(cid).tx, m.rx_addr(addr, cid));
    let ret = retry(m, || {
        // SAFETY: a zero-byte inject carries no buffer; the endpoint is open.
        unsafe { fi::fi_tinject(tx, ptr::null(), 0, addr, tag) }
    });
    if ret < 0 {
        log::error!(
            "acknowledging a synchronous send to rank {source} failed: {}",
            crate::fabric::Error::from_ret(ret)
        );
    }
}

/// # Safety
/// `e.op_context` must be null or the ctx of a live Request.
unsafe fn on_error(m: &Mtl, e: &fi::fi_cq_err_entry) {
    if e.op_context.is_null() {
        m.counters.cq_errors.fetch_add(1, Ordering::Relaxed);
        log::error!(
            "completion error without context: {}",
            crate::fabric::Error(e.err)
        );
        return;
    }
    // SAFETY: forwarded.
    let r = unsafe { Request::from_ctx(e.op_context) };
    // SAFETY: r is live.
    let kind = unsafe { (*r).kind };
    // shm reports some errors negated.
    let code = e.err.unsigned_abs();
    if kind == Kind::Recv {
        // SAFETY: r is a live receive; every error completion ends its time in the
        // provider's queue.
        unsafe { rx_leave(m, r) };
    }
    match kind {
        Kind::Probe | Kind::Stash if code == fi::FI_ENOMSG => {
            // SAFETY: live probe.
            unsafe {
                (*r).probe_found = false;
                (*r).pending.store(0, Ordering::Release);
            }
        }
        Kind::Recv if code == fi::FI_ETRUNC => {
            // SAFETY: live receive; the provider wrote at most the posted length.
            unsafe {
                let len = (*r).length;
                recv_done(
                    m,
                    r,
                    e.tag,
                    e.data,
                    len,
                    true,
                    sys::MPI_ERR_TRUNCATE as c_int,
                );
            }
        }
        Kind::Claim | Kind::Stash if code == fi::FI_ECANCELED => {
            // recv_exact's receive, cancelled: another receive took the message.
            // SAFETY: live request its caller waits for.
            unsafe {
                (*r).status.cancelled = true;
                (*r).pending.store(0, Ordering::Release);
            }
        }
        Kind::Recv if code == fi::FI_ECANCELED => {
            // SAFETY: live receive, never matched.
            unsafe {
                (*r).status.cancelled = true;
                (*r).status.error = sys::MPI_SUCCESS as c_int;
                if (*r).owns_buffer {
                    libc::free((*r).buffer as *mut c_void);
                    (*r).owns_buffer = false;
                }
                Request::complete_to_pml(r);
            }
        }
        _ => {
            m.counters.cq_errors.fetch_add(1, Ordering::Relaxed);
            log::error!(
                "{kind:?} failed: {} (provider error {})",
                crate::fabric::Error(e.err),
                e.prov_errno
            );
            // SAFETY: r is live; each kind is completed the way its owner expects.
            unsafe {
                (*r).status.error = sys::MPI_ERR_INTERN as c_int;
                match kind {
                    Kind::Send => {
                        (*r).status.error = sys::MPI_ERR_INTERN as c_int;
                        // A failed send will not get its acknowledgement either.
                        (*r).pending.store(1, Ordering::Release);
                        finish_part(r);
                    }
                    Kind::Ack => {
                        let parent = (*r).parent;
                        drop(Box::from_raw(r));
                        (*parent).status.error = sys::MPI_ERR_INTERN as c_int;
                        finish_part(parent);
                    }
                    Kind::Recv => {
                        if (*r).owns_buffer {
                            libc::free((*r).buffer as *mut c_void);
                            (*r).owns_buffer = false;
                        }
                        Request::complete_to_pml(r);
                    }
                    Kind::Claim | Kind::Probe | Kind::Stash => {
                        (*r).pending.store(0, Ordering::Release);
                    }
                    Kind::Bounce => {
                        if let Some(sm) = m.soft.as_deref() {
                            super::softmatch::bounce_failed(m, sm, r, code, e.flags);
                        }
                    }
                    Kind::Copied => {
                        // Its MPI request completed when it was posted, as an inject's
                        // does: the error is logged and counted only.
                        if let Some(sm) = m.soft.as_deref() {
                            super::softmatch::copied_sent(sm, r);
                        }
                    }
                    Kind::SmRead => {
                        (*r).kind = Kind::Recv;
                        let hdr = (*r).sm_hdr;
                        recv_done(
                            m,
                            r,
                            hdr.bits,
                            hdr.data,
                            0,
                            false,
                            sys::MPI_ERR_INTERN as c_int,
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Sends

/// One data send, as it is handed to the fabric (now, or later from progress when the
/// provider pushed back).
pub(super) struct PendingSend {
    /// The request whose completion the send produces (0 for an inject).
    req: usize,
    /// The transmit context, and the peer's address (its receive context's).
    tx: *mut fi::fid_ep,
    addr: u64,
    buf: *const u8,
    len: usize,
    bits: u64,
    /// Remote CQ data, when the layout or the protocol uses it.
    cqd: Option<u64>,
    /// An inject's private copy of the data (a deferred inject outlives the caller's
    /// buffer).
    copy: Option<Vec<u8>>,
}

// SAFETY: `buf` points at memory kept alive by the request that owns the send (the
// user's buffer or a pack buffer) until its completion; it is only read by libfabric.
unsafe impl Send for PendingSend {}

impl PendingSend {
    /// One attempt. The caller holds `m.lock`.
    fn issue(&self) -> isize {
        let (buf, len) = match &self.copy {
            Some(c) => (c.as_ptr(), c.len()),
            None => (self.buf, self.len),
        };
        let buf = buf as *const c_void;
        if self.req == 0 {
            // SAFETY: inject copies the data before returning.
            unsafe {
                match self.cqd {
                    Some(d) => fi::fi_tinjectdata(self.tx, buf, len, d, self.addr, self.bits),
                    None => fi::fi_tinject(self.tx, buf, len, self.addr, self.bits),
                }
            }
        } else {
            // SAFETY: the request is live until this send completes, and keeps the
            // data alive that long (see the struct).
            unsafe {
                let ctx = (*(self.req as *mut Request)).ctx_ptr();
                match self.cqd {
                    Some(d) => fi::fi_tsenddata(
                        self.tx,
                        buf,
                        len,
                        ptr::null_mut(),
                        d,
                        self.addr,
                        self.bits,
                        ctx,
                    ),
                    None => fi::fi_tsend(
                        self.tx,
                        buf,
                        len,
                        ptr::null_mut(),
                        self.addr,
                        self.bits,
                        ctx,
                    ),
                }
            }
        }
    }
}

/// Hand `p` to the fabric. A non-blocking caller (`may_defer`) never waits for the
/// provider: when it pushes back, or when earlier sends are still waiting, `p` joins
/// the queue that progress drains in order (MPI's non-overtaking rule), and an inject
/// keeps a copy of its data. A blocking caller waits for the queue, then retries.
fn send_or_defer(m: &Mtl, mut p: PendingSend, may_defer: bool) -> c_int {
    if may_defer {
        // The queue's mutex is taken only when sends are already waiting or the
        // provider pushed back (as for receives, see irecv).
        if !m.has_deferred_sends.load(Ordering::Acquire) {
            let ret = {
                let _g = m.lock.lock();
                p.issue()
            };
            if ret != -(fi::FI_EAGAIN as isize) {
                return if ret < 0 {
                    fi_to_ompi(ret)
                } else {
                    sys::OMPI_SUCCESS
                };
            }
            m.counters.eagain.fetch_add(1, Ordering::Relaxed);
        }
        let mut q = m.deferred_sends.lock().unwrap_or_else(|e| e.into_inner());
        if p.req == 0 && p.copy.is_none() {
            // SAFETY: the caller's buffer holds len bytes for the duration of this call.
            p.copy = Some(unsafe { std::slice::from_raw_parts(p.buf, p.len) }.to_vec());
        }
        q.push_back(p);
        m.has_deferred_sends.store(true, Ordering::Release);
        return sys::OMPI_SUCCESS;
    }
    wait_until(m, || !m.has_deferred_sends.load(Ordering::Acquire));
    let ret = retry(m, || p.issue());
    if ret < 0 {
        fi_to_ompi(ret)
    } else {
        sys::OMPI_SUCCESS
    }
}

/// Send the queued sends, in order, until the provider pushes back again.
fn post_deferred_sends(m: &Mtl) {
    let mut q = m.deferred_sends.lock().unwrap_or_else(|e| e.into_inner());
    while let Some(p) = q.front() {
        let ret = {
            let _g = m.lock.lock();
            p.issue()
        };
        if ret == -(fi::FI_EAGAIN as isize) {
            return;
        }
        let p = q.pop_front();
        if ret < 0 {
            log::error!(
                "a deferred send failed: {}",
                crate::fabric::Error::from_ret(ret)
            );
            if let Some(p) = p.filter(|p| p.req != 0) {
                let r = p.req as *mut Request;
                // SAFETY: the request is live and its send will not complete: finish
                // it with the error (all its parts).
                unsafe {
                    (*r).status.error = sys::MPI_ERR_INTERN as c_int;
                    (*r).pending.store(1, Ordering::Release);
                    finish_part(r);
                }
            }
        }
    }
    m.has_deferred_sends.store(false, Ordering::Release);
}

/// Post the send of `data` to `addr` for request `r`. For a synchronous send, first
/// post the receive of its acknowledgement (so `r.pending` counts two completions).
#[allow(clippy::too_many_arguments)]
fn post_send(
    m: &Mtl,
    r: *mut Request,
    addr: u64,
    data: &SendData,
    comm: *mut sys::ompi_communicator_t,
    tag: c_int,
    sync: bool,
    may_defer: bool,
) -> c_int {
    let l = &m.layout;
    let me = comm_rank(comm);
    let cid = comm_cid(comm);
    let mut p = PendingSend {
        req: r as usize,
        tx: m.ctx(cid).tx,
        addr: m.rx_addr(addr, cid),
        buf: data.ptr,
        len: data.len,
        bits: l.send_tag(cid, me, tag, Proto::Plain),
        cqd: l.source_in_data().then(|| l.cq_data(me, 0)),
        copy: None,
    };
    if sync {
        let id = m.sync_ids.fetch_add(1, Ordering::Relaxed) & (l.sync_id_space() - 1) as u32;
        let mut ack = Box::new(Request::internal(Kind::Ack, comm));
        ack.parent = r;
        let ctx = ack.ctx_ptr();
        let ack_ptr = Box::into_raw(ack);
        let ack_tag = l.ack_tag(id);
        // SAFETY: r is live; two completions are expected from here on.
        unsafe { (*r).pending.store(2, Ordering::Release) };
        let rx = m.ctx(cid).rx;
        let ret = retry(m, || {
            // SAFETY: zero-byte receive; ctx lives in a leaked Box until completion.
            unsafe {
                fi::fi_trecv(
                    rx,
                    ptr::null_mut(),
                    0,
                    ptr::null_mut(),
                    FI_ADDR_UNSPEC,
                    ack_tag,
                    0,
                    ctx,
                )
            }
        });
        if ret < 0 {
            // SAFETY: the receive was not posted, so we still own the Box.
            unsafe { drop(Box::from_raw(ack_ptr)) };
            return fi_to_ompi(ret);
        }
        p.bits = l.send_tag(cid, me, tag, Proto::Sync);
        p.cqd = Some(l.cq_data(me, id));
    } else {
        // SAFETY: r is live.
        unsafe { (*r).pending.store(1, Ordering::Release) };
    }
    // If a synchronous send fails after its acknowledgement receive was posted, that
    // receive never matches (no message went out); the endpoint reclaims it at close.
    send_or_defer(m, p, may_defer)
}

/// Send a small message with inject: no completion, the buffer is free on return.
#[inline]
fn inject(
    m: &Mtl,
    addr: u64,
    data: &SendData,
    comm: *mut sys::ompi_communicator_t,
    tag: c_int,
    may_defer: bool,
) -> c_int {
    let l = &m.layout;
    let me = comm_rank(comm);
    let cid = comm_cid(comm);
    let p = PendingSend {
        req: 0,
        tx: m.ctx(cid).tx,
        addr: m.rx_addr(addr, cid),
        buf: data.ptr,
        len: data.len,
        bits: l.send_tag(cid, me, tag, Proto::Plain),
        cqd: l.source_in_data().then(|| l.cq_data(me, 0)),
        copy: None,
    };
    send_or_defer(m, p, may_defer)
}

fn send_impl(
    comm: *mut sys::ompi_communicator_t,
    dest: c_int,
    tag: c_int,
    conv: *mut sys::opal_convertor_t,
    mode: sys::mca_pml_base_send_mode_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let to = match peer(comm, dest) {
        Ok(p) => p,
        Err(e) => return e,
    };
    let addr = to.addr;
    let data = match pack(conv) {
        Ok(d) => d,
        Err(e) => return e,
    };
    let sync = mode == sys::MCA_PML_BASE_SEND_SYNCHRONOUS;
    if let Some(sm) = m.soft.as_deref() {
        let (bits, cqd) = soft_envelope(m, comm, tag, sync);
        if !sync {
            // SAFETY: data holds data.len bytes until the end of this function.
            let sent = unsafe {
                super::softmatch::send_injected(m, sm, to, data.ptr, data.len, bits, cqd)
            };
            if let Some(rc) = sent {
                return rc;
            }
        }
        let mut r = Request::internal(Kind::Send, comm);
        // SAFETY: r lives on this stack until its completions (we wait below); data
        // lives until the end of this function.
        let rc = unsafe {
            super::softmatch::send(m, sm, &mut r, to, data.ptr, data.len, bits, cqd, sync)
        };
        if rc == super::softmatch::SENT_INLINE {
            return sys::OMPI_SUCCESS;
        }
        if rc != sys::OMPI_SUCCESS {
            return rc;
        }
        wait_until(m, || r.pending.load(Ordering::Acquire) <= 0);
        return if r.status.error != 0 {
            r.status.error
        } else {
            sys::OMPI_SUCCESS
        };
    }
    if !sync && data.len <= m.inject_size {
        return inject(m, addr, &data, comm, tag, false);
    }
    let mut r = Request::internal(Kind::Send, comm);
    let rp: *mut Request = &mut r;
    let rc = post_send(m, rp, addr, &data, comm, tag, sync, false);
    if rc != sys::OMPI_SUCCESS {
        // If the synchronous send failed after its acknowledgement receive was
        // posted, that receive can never match (no message went out); the endpoint
        // reclaims it at finalize.
        return rc;
    }
    wait_until(m, || r.pending.load(Ordering::Acquire) <= 0);
    if r.status.error != 0 {
        r.status.error
    } else {
        sys::OMPI_SUCCESS
    }
}

/// The envelope of a software-matched send: tag bits and CQ-data word.
fn soft_envelope(
    m: &Mtl,
    comm: *mut sys::ompi_communicator_t,
    tag: c_int,
    sync: bool,
) -> (u64, u64) {
    let me = comm_rank(comm);
    let proto = if sync { Proto::Sync } else { Proto::Plain };
    (
        m.layout.send_tag(comm_cid(comm), me, tag, proto),
        m.layout.cq_data(me, 0),
    )
}

fn isend_impl(
    comm: *mut sys::ompi_communicator_t,
    dest: c_int,
    tag: c_int,
    conv: *mut sys::opal_convertor_t,
    mode: sys::mca_pml_base_send_mode_t,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let r = req as *mut Request;
    // SAFETY: the PML allocated mtl_request_size bytes behind req.
    unsafe { Request::init(r, Kind::Send, comm) };
    let to = match peer(comm, dest) {
        Ok(p) => p,
        Err(e) => return e,
    };
    let addr = to.addr;
    let data = match pack(conv) {
        Ok(d) => d,
        Err(e) => return e,
    };
    let sync = mode == sys::MCA_PML_BASE_SEND_SYNCHRONOUS;
    if let Some(sm) = m.soft.as_deref() {
        if data.owned {
            // SAFETY: r is live; it owns the pack buffer until its last completion.
            unsafe {
                (*r).buffer = data.ptr as *mut u8;
                (*r).owns_buffer = true;
            }
        }
        let (bits, cqd) = soft_envelope(m, comm, tag, sync);
        // SAFETY: r is the PML's request, alive until completed; the data is the
        // user's buffer or a pack buffer the request owns until its completion.
        let rc =
            unsafe { super::softmatch::send(m, sm, r, to, data.ptr, data.len, bits, cqd, sync) };
        if rc == super::softmatch::SENT_INLINE || rc != sys::OMPI_SUCCESS {
            // Nothing in flight: the buffer goes back to `data`, which frees it.
            // SAFETY: r is live.
            unsafe { (*r).owns_buffer = false };
            if rc == super::softmatch::SENT_INLINE {
                // SAFETY: r is the PML's live request.
                unsafe { Request::complete_to_pml(r) };
                return sys::OMPI_SUCCESS;
            }
            return rc;
        }
        if data.owned {
            std::mem::forget(data);
        }
        return rc;
    }
    if !sync && data.len <= m.inject_size {
        let rc = inject(m, addr, &data, comm, tag, true);
        if rc == sys::OMPI_SUCCESS {
            // SAFETY: r is the PML's live request.
            unsafe { Request::complete_to_pml(r) };
        }
        return rc;
    }
    if data.owned {
        // The pack buffer must outlive the send: the request owns it from here and
        // frees it when its last completion arrives (finish_part).
        // SAFETY: r is live.
        unsafe {
            (*r).buffer = data.ptr as *mut u8;
            (*r).owns_buffer = true;
        }
    }
    let rc = post_send(m, r, addr, &data, comm, tag, sync, true);
    if data.owned {
        if rc != sys::OMPI_SUCCESS {
            // Not posted: the request gives the buffer back to `data`, which frees it.
            // SAFETY: r is live.
            unsafe { (*r).owns_buffer = false };
        } else {
            std::mem::forget(data);
        }
    }
    rc
}

// ---------------------------------------------------------------------------
// Receives and probes

fn irecv_impl(
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
    conv: *mut sys::opal_convertor_t,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let r = req as *mut Request;
    // SAFETY: the PML allocated mtl_request_size bytes behind req.
    unsafe { Request::init(r, Kind::Recv, comm) };
    let mut addr = FI_ADDR_UNSPEC;
    if src != sys::MPI_ANY_SOURCE && m.directed {
        addr = match peer_addr(comm, src) {
            Ok(a) => a,
            Err(e) => return e,
        };
    }
    let (buf, len, owned) = match recv_buffer(conv) {
        Ok(v) => v,
        Err(e) => return e,
    };
    // SAFETY: r is live.
    unsafe {
        (*r).convertor = conv;
        (*r).buffer = buf;
        (*r).length = len;
        (*r).owns_buffer = owned;
    }
    let (bits, ignore) = m.layout.recv_bits(comm_cid(comm), src, tag);
    if let Some(sm) = m.soft.as_deref() {
        return super::softmatch::irecv(m, sm, r, bits, ignore);
    }
    // SAFETY: r is live.
    unsafe {
        (*r).post_addr = addr;
        (*r).matched_tag = bits;
        (*r).matched_data = ignore;
    }
    let internal = tag < 0 && tag != sys::MPI_ANY_TAG;
    // SAFETY: r is live.
    unsafe { (*r).rx_internal = internal };
    // Receives are posted in MPI order within their class (see `Deferred`): once one
    // had to wait for room in the provider's queue, every later one of its class waits
    // behind it. The queue's mutex is taken only then; a thread that queued a receive
    // set the flag before returning, so its own later receives see it. The same holds
    // while messages wait in the stash (stall.rs).
    let threads = m.rx.threads();
    if threads {
        m.fast_posts.fetch_add(1, Ordering::SeqCst);
    }
    if !m.has_deferred.load(Ordering::SeqCst)
        && !m.has_stash.load(Ordering::SeqCst)
        && !m.claim_busy.load(Ordering::SeqCst)
        && m.rx.room(internal)
    {
        let ret = {
            let _g = m.lock.lock();
            // SAFETY: r is live, with its buffer, address and match bits set.
            unsafe {
                rx_enter(m, r);
                post_recv(m, r)
            }
        };
        if threads {
            if ret >= 0 {
                m.posted_gen.fetch_add(1, Ordering::SeqCst);
            }
            m.fast_posts.fetch_sub(1, Ordering::SeqCst);
        }
        if ret >= 0 {
            return sys::OMPI_SUCCESS;
        }
        // SAFETY: not posted.
        unsafe { rx_leave(m, r) };
        if ret != -(fi::FI_EAGAIN as isize) {
            if owned {
                // SAFETY: not posted, still ours.
                unsafe { libc::free(buf as *mut c_void) };
            }
            return fi_to_ompi(ret);
        }
        m.counters.eagain.fetch_add(1, Ordering::Relaxed);
    } else if threads {
        m.fast_posts.fetch_sub(1, Ordering::SeqCst);
    }
    {
        let mut deferred = m.deferred.lock().unwrap_or_else(|e| e.into_inner());
        // A message taken off a full provider queue may be waiting for it (stall.rs).
        if !internal && !deferred.stash.is_empty() {
            // SAFETY: r is live with its match bits and address set.
            if let Some(s) = unsafe { super::stall::take_for_recv(m, &mut deferred, r) } {
                drop(deferred);
                // SAFETY: r is in no queue.
                unsafe { super::stall::deliver(m, r, s) };
                return sys::OMPI_SUCCESS;
            }
        }
        deferred.queue(internal).push_back(r as usize);
        m.has_deferred.store(true, Ordering::SeqCst);
        // The other class may have room (a collective's receive behind the user's).
        drain_deferred(m, &mut deferred);
    }
    sys::OMPI_SUCCESS
}

/// Post receive `r` to the provider (with the overflow area where needed).
///
/// # Safety
/// `r` must be a live receive whose buffer, `post_addr` and match bits
/// (`matched_tag`/`matched_data`) are set; the caller holds `m.lock`.
unsafe fn post_recv(m: &Mtl, r: *mut Request) -> isize {
    // SAFETY: forwarded.
    let (buf, len, addr, bits, ignore, ctx, cid) = unsafe {
        (
            (*r).buffer,
            (*r).length,
            (*r).post_addr,
            (*r).matched_tag,
            (*r).matched_data,
            (*r).ctx_ptr(),
            comm_cid((*r).comm),
        )
    };
    let (rx, addr) = (m.ctx(cid).rx, m.rx_addr(addr, cid));
    if m.overflow.is_null() {
        // SAFETY: buf is valid for len bytes until the receive completes (user memory
        // the PML keeps alive, or our buffer freed at completion).
        unsafe {
            fi::fi_trecv(
                rx,
                buf as *mut c_void,
                len,
                ptr::null_mut(),
                addr,
                bits,
                ignore,
                ctx,
            )
        }
    } else {
        let iov = [
            fi::iovec {
                iov_base: buf as *mut c_void,
                iov_len: len,
            },
            fi::iovec {
                iov_base: m.overflow as *mut c_void,
                iov_len: m.overflow_len,
            },
        ];
        // SAFETY: as above for buf; the overflow area lives until finalize and the
        // provider copies the iov array before returning.
        unsafe {
            fi::fi_trecvv(
                rx,
                iov.as_ptr(),
                ptr::null_mut(),
                2,
                addr,
                bits,
                ignore,
                ctx,
            )
        }
    }
}

/// Post the receives that waited for room, in order, until the provider is full again.
fn post_deferred(m: &Mtl) {
    // Not from a progress call nested in a holder of the lock (the stall breaker's, or
    // a completion's acknowledgement under it): the holder drains.
    match m.deferred.try_lock() {
        Ok(mut deferred) => drain_deferred(m, &mut deferred),
        Err(std::sync::TryLockError::Poisoned(e)) => drain_deferred(m, &mut e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => {}
    }
}

/// Post from the head of each class's queue while that class has room. No waiting
/// receive matches a stashed message (each looked in the stash when it was queued, and
/// a message is stashed only when no waiting receive matches it), so none is looked
/// up here.
fn drain_deferred(m: &Mtl, deferred: &mut Deferred) {
    'classes: for internal in [true, false] {
        while m.rx.room(internal) {
            let Some(&r) = deferred.queue(internal).front() else {
                break;
            };
            let r = r as *mut Request;
            let ret = {
                let _g = m.lock.lock();
                // SAFETY: deferred receives are live PML requests (a cancelled one is
                // removed from the queue before it completes).
                unsafe {
                    rx_enter(m, r);
                    post_recv(m, r)
                }
            };
            if ret == -(fi::FI_EAGAIN as isize) {
                // SAFETY: not posted.
                unsafe { rx_leave(m, r) };
                // The provider itself is full: neither class gets in now.
                break 'classes;
            }
            deferred.queue(internal).pop_front();
            if ret >= 0 {
                m.posted_gen.fetch_add(1, Ordering::SeqCst);
            }
            if ret < 0 {
                log::error!(
                    "posting a receive failed: {}",
                    crate::fabric::Error::from_ret(ret)
                );
                // SAFETY: r is live and not posted: complete it with the error.
                unsafe {
                    rx_leave(m, r);
                    (*r).status.error = sys::MPI_ERR_INTERN as c_int;
                    if (*r).owns_buffer {
                        libc::free((*r).buffer as *mut c_void);
                        (*r).owns_buffer = false;
                    }
                    Request::complete_to_pml(r);
                }
            }
        }
    }
    if deferred.is_empty() {
        m.has_deferred.store(false, Ordering::SeqCst);
    }
}

/// What a receive or probe of (`comm`, `src`, `tag`) matches: tag bits, ignore bits
/// and source address (provider matching).
fn pattern(
    m: &Mtl,
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
) -> Result<(u64, u64, u64), c_int> {
    let mut addr = FI_ADDR_UNSPEC;
    if src != sys::MPI_ANY_SOURCE && m.directed {
        addr = peer_addr(comm, src)?;
    }
    let (bits, ignore) = m.layout.recv_bits(comm_cid(comm), src, tag);
    Ok((bits, ignore, addr))
}

/// Peek for a matching message, in the stash first (stall.rs); on success returns
/// (tag bits, cq data, length).
fn peek(
    m: &Mtl,
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
) -> Result<Option<(u64, u64, usize)>, c_int> {
    let (bits, ignore, addr) = pattern(m, comm, src, tag)?;
    if let Some(found) = super::stall::peek_stash(m, comm, (bits, ignore, addr)) {
        return Ok(Some(found));
    }
    let cid = comm_cid(comm);
    let (rx, addr) = (m.ctx(cid).rx, m.rx_addr(addr, cid));
    let mut r = Request::internal(Kind::Probe, comm);
    peek_wait(m, &mut r, rx, addr, bits, ignore)?;
    Ok(if r.probe_found {
        Some((r.matched_tag, r.matched_data, r.status.count))
    } else {
        None
    })
}

/// Peek on `rx` with `r` (a `Probe` or `Stash` request) and wait for the answer:
/// `r.probe_found`, and then the message's tag bits, CQ data and length in `r`.
pub(super) fn peek_wait(
    m: &Mtl,
    r: &mut Request,
    rx: *mut fi::fid_ep,
    addr: u64,
    bits: u64,
    ignore: u64,
) -> Result<(), c_int> {
    if m.lazy_matching {
        // Receives posted so far meet the messages that arrived before them now, so
        // that the peek does not report a message an older receive is about to take.
        progress_cq(m);
    }
    r.pending.store(1, Ordering::Release);
    let msg = fi::fi_msg_tagged {
        msg_iov: ptr::null(),
        desc: ptr::null_mut(),
        iov_count: 0,
        addr,
        tag: bits,
        ignore,
        context: r.ctx_ptr(),
        data: 0,
    };
    let ret = retry(m, || {
        // SAFETY: a peek transfers no data; msg and r outlive the wait below.
        unsafe { fi::fi_trecvmsg(rx, &msg, fi::FI_PEEK as u64) }
    });
    if ret < 0 {
        return Err(fi_to_ompi(ret));
    }
    wait_until(m, || r.pending.load(Ordering::Acquire) <= 0);
    if r.status.error != 0 {
        return Err(r.status.error);
    }
    Ok(())
}

/// Receive exactly the message a peek found (its tag bits, nothing ignored; from
/// `addr`; `len` bytes) into a buffer of its size that `r` then owns, and wait for it.
/// `Ok(false)`: another receive of the provider's took the message (see below). On
/// failure or `Ok(false)`, `r` owns no buffer.
/// The oldest unexpected message with these bits is the one peeked, so a plain receive
/// takes it, through every protocol of the provider's (a claim would not gather
/// ofi_rxm's segmented messages).
pub(super) fn recv_exact(
    m: &Mtl,
    r: &mut Request,
    rx: *mut fi::fid_ep,
    addr: u64,
    bits: u64,
    len: usize,
) -> Result<bool, c_int> {
    if len > 0 {
        // SAFETY: plain allocation; checked.
        let b = unsafe { libc::malloc(len) } as *mut u8;
        if b.is_null() {
            return Err(sys::OMPI_ERR_OUT_OF_RESOURCE);
        }
        r.buffer = b;
        r.length = len;
        r.owns_buffer = true;
    }
    r.pending.store(1, Ordering::Release);
    let (buf, ctx) = (r.buffer, r.ctx_ptr());
    let ret = retry(m, || {
        // SAFETY: buf holds len bytes until the receive completes (we wait below).
        unsafe {
            fi::fi_trecv(
                rx,
                buf as *mut c_void,
                len,
                ptr::null_mut(),
                addr,
                bits,
                0,
                ctx,
            )
        }
    });
    if ret < 0 {
        if r.owns_buffer {
            // SAFETY: not posted; ours.
            unsafe { libc::free(buf as *mut c_void) };
            r.owns_buffer = false;
        }
        return Err(fi_to_ompi(ret));
    }
    // The peeked message may go to a receive posted before this one that the
    // provider had not matched it with yet when it answered the peek (sockets: a
    // receive just drained from the deferred queue meets the buffered message only in
    // the provider's next progress). This receive would then wait for a second message
    // with these bits. So after a while it is cancelled: a receive the provider
    // already matched (a large message still arriving) is not cancelled, and it
    // completes as usual.
    let start = std::time::Instant::now();
    let mut cancel_sent = false;
    while r.pending.load(Ordering::Acquire) > 0 {
        if progress_mtl(m) == 0 {
            idle();
            if !cancel_sent && start.elapsed() > EXACT_PATIENCE {
                cancel_sent = true;
                // SAFETY: rx is the endpoint it was posted on; ctx is its context.
                unsafe { fi::fi_cancel(&mut (*rx).fid, ctx) };
            }
        }
    }
    if r.status.error != 0 || r.status.cancelled {
        if r.owns_buffer {
            // SAFETY: the receive completed; nothing references the buffer.
            unsafe { libc::free(r.buffer as *mut c_void) };
            r.owns_buffer = false;
        }
        if r.status.cancelled {
            m.counters.exact_lost.fetch_add(1, Ordering::Relaxed);
            return Ok(false);
        }
        return Err(r.status.error);
    }
    Ok(true)
}

/// How long [`recv_exact`] waits for a message it knows has arrived before it asks
/// the provider whether another receive took it.
const EXACT_PATIENCE: std::time::Duration = std::time::Duration::from_millis(10);

fn fill_status(status: *mut sys::ompi_status_public_t, env: &Envelope, len: usize) {
    if status.is_null() {
        return;
    }
    // The PML passes the caller's own status: MPI_ERROR is left as the caller set it
    // (MPI 3.1, 3.2.5: only the calls that return several statuses write it), as ob1's
    // probes leave it.
    // SAFETY: the PML passes a valid status (or null, handled above).
    unsafe {
        (*status).MPI_SOURCE = env.source;
        (*status).MPI_TAG = env.tag;
        (*status)._ucount = len;
        (*status)._cancelled = 0;
    }
}

fn iprobe_impl(
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
    flag: *mut c_int,
    status: *mut sys::ompi_status_public_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let found = match m.soft.as_deref() {
        Some(sm) => {
            let (bits, ignore) = m.layout.recv_bits(comm_cid(comm), src, tag);
            match super::softmatch::probe(sm, bits, ignore) {
                Some(found) => Some(found),
                None => {
                    // Not arrived yet: one round of Open MPI's progress (which yields
                    // the core when nothing happened, see ompi::progress), then look
                    // again at what it brought.
                    ompi::progress::progress();
                    super::softmatch::probe(sm, bits, ignore)
                }
            }
        }
        None => match peek(m, comm, src, tag) {
            Ok(None) => {
                // The peek's own answer is an event of our progress, so the rounds
                // inside it never count as idle: give Open MPI's progress its round.
                ompi::progress::progress();
                None
            }
            Ok(found) => found,
            Err(rc) => return rc,
        },
    };
    match found {
        Some((bits, data, len)) => {
            let env = match envelope(m, comm, bits, data) {
                Ok(env) => env,
                Err(rc) => return rc,
            };
            // SAFETY: flag is valid.
            unsafe { *flag = 1 };
            fill_status(status, &env, len);
            sys::OMPI_SUCCESS
        }
        None => {
            // SAFETY: flag is valid.
            unsafe { *flag = 0 };
            sys::OMPI_SUCCESS
        }
    }
}

/// A message matched by mprobe: received in full into our buffer, waiting for mrecv.
enum Claimed {
    /// Received by the fabric into our buffer.
    Fabric(Box<Request>),
    /// Taken off the software-matching unexpected list.
    Soft(super::softmatch::Unexpected),
}

fn improbe_impl(
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
    flag: *mut c_int,
    message: *mut *mut sys::ompi_message_t,
    status: *mut sys::ompi_status_public_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    if let Some(sm) = m.soft.as_deref() {
        let (bits, ignore) = m.layout.recv_bits(comm_cid(comm), src, tag);
        let claimed = super::softmatch::claim(m, sm, comm, bits, ignore).or_else(|| {
            // As in iprobe: Open MPI's progress (yielding when idle), then again.
            ompi::progress::progress();
            super::softmatch::claim(m, sm, comm, bits, ignore)
        });
        let Some(u) = claimed else {
            // SAFETY: flag is a valid out pointer.
            unsafe { *flag = 0 };
            return sys::OMPI_SUCCESS;
        };
        let (b, d, len) = (u.hdr.bits, u.hdr.data, u.hdr.len as usize);
        return publish_message(m, comm, Claimed::Soft(u), b, d, len, flag, message, status);
    }
    let req = match claim_provider(m, comm, src, tag) {
        Ok(Some(req)) => req,
        Ok(None) => {
            // As in iprobe: the peek's answer was our progress's only event.
            ompi::progress::progress();
            // SAFETY: flag is a valid out pointer.
            unsafe { *flag = 0 };
            return sys::OMPI_SUCCESS;
        }
        Err(rc) => return rc,
    };
    let (mbits, mdata, mlen) = (req.matched_tag, req.matched_data, req.status.count);
    publish_message(
        m,
        comm,
        Claimed::Fabric(req),
        mbits,
        mdata,
        mlen,
        flag,
        message,
        status,
    )
}

/// `MPI_Improbe` under provider matching: take the oldest message of (`comm`, `src`,
/// `tag`), from the stash (stall.rs) or the provider, received in full into our buffer.
/// The `deferred` lock is held throughout, so that the stall breaker cannot take the
/// message between the peek and the receive (the receive would then take the next
/// message with the same bits).
fn claim_provider(
    m: &Mtl,
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
) -> Result<Option<Box<Request>>, c_int> {
    let (bits, ignore, addr) = pattern(m, comm, src, tag)?;
    let mut d = m.deferred.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = super::stall::claim_stash(m, &mut d, comm, (bits, ignore, addr)) {
        return Ok(Some(c));
    }
    // No receive of another thread's gets into the provider until the message is ours.
    let _busy = m.rx.threads().then(|| {
        m.claim_busy.store(true, Ordering::SeqCst);
        while m.fast_posts.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        super::stall::Busy(&m.claim_busy)
    });
    let cid = comm_cid(comm);
    let rx = m.ctx(cid).rx;
    let mut probe = Request::internal(Kind::Probe, comm);
    peek_wait(m, &mut probe, rx, m.rx_addr(addr, cid), bits, ignore)?;
    if !probe.probe_found {
        return Ok(None);
    }
    let (bits, len) = (probe.matched_tag, probe.status.count);
    // Receive exactly that message now, so that no later receive can take it: same
    // tag bits (communicator, source, tag, protocol) and, where the source does not
    // travel in the tag, the same source address.
    let source = envelope(m, comm, bits, probe.matched_data)?.source;
    let mut addr = FI_ADDR_UNSPEC;
    if m.layout.source_in_data() {
        addr = peer_addr(comm, source)?;
    }
    let mut req = Box::new(Request::internal(Kind::Claim, comm));
    let got = recv_exact(m, &mut req, rx, m.rx_addr(addr, cid), bits, len)?;
    drop(d);
    Ok(got.then_some(req))
}

/// Hand a claimed message to Open MPI as an `MPI_Message`.
#[allow(clippy::too_many_arguments)]
fn publish_message(
    m: &Mtl,
    comm: *mut sys::ompi_communicator_t,
    claimed: Claimed,
    bits: u64,
    data: u64,
    len: usize,
    flag: *mut c_int,
    message: *mut *mut sys::ompi_message_t,
    status: *mut sys::ompi_status_public_t,
) -> c_int {
    let env = match envelope(m, comm, bits, data) {
        Ok(env) => env,
        Err(rc) => {
            // Claimed but not deliverable: drop it (already logged).
            if let Claimed::Fabric(c) = claimed {
                if c.owns_buffer {
                    // SAFETY: allocated in improbe, not referenced any more.
                    unsafe { libc::free(c.buffer as *mut c_void) };
                }
            }
            return rc;
        }
    };
    // SAFETY: glue allocation from Open MPI's free list.
    let msg = unsafe { glue::ompi_ofi_glue_message_alloc() };
    if msg.is_null() {
        return sys::OMPI_ERR_OUT_OF_RESOURCE;
    }
    // SAFETY: msg is a fresh message; flag/message/status valid.
    unsafe {
        (*msg).comm = comm;
        (*msg).req_ptr = Box::into_raw(Box::new(claimed)) as *mut c_void;
        (*msg).peer = env.source;
        (*msg).count = len;
        *message = msg;
        *flag = 1;
    }
    fill_status(status, &env, len);
    sys::OMPI_SUCCESS
}

fn imrecv_impl(
    conv: *mut sys::opal_convertor_t,
    message: *mut *mut sys::ompi_message_t,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    // SAFETY: message holds a message we created in improbe.
    let msg = unsafe { *message };
    // SAFETY: req_ptr is the Claimed we leaked there.
    let claimed = unsafe { Box::from_raw((*msg).req_ptr as *mut Claimed) };
    let r = req as *mut Request;
    // SAFETY: PML request memory.
    unsafe { Request::init(r, Kind::Recv, (*msg).comm) };
    let c = match *claimed {
        Claimed::Fabric(c) => c,
        Claimed::Soft(u) => {
            // SAFETY: the message handle is ours to return; then null it.
            unsafe {
                glue::ompi_ofi_glue_message_return(msg);
                *message = ptr::addr_of_mut!(sys::ompi_message_null.message);
            }
            let (buf, len, owned) = match recv_buffer(conv) {
                Ok(v) => v,
                Err(e) => return e,
            };
            // SAFETY: r is live.
            unsafe {
                (*r).convertor = conv;
                (*r).buffer = buf;
                (*r).length = len;
                (*r).owns_buffer = owned;
            }
            super::softmatch::take(m, r, u);
            return sys::OMPI_SUCCESS;
        }
    };
    let ConvInfo { size, contig } = convertor_info(conv);
    let len = c.status.count;
    let n = len.min(size);
    if n > 0 {
        if let Some(start) = contig {
            // SAFETY: start is the user's contiguous buffer of `size` bytes; our
            // buffer holds `len` bytes.
            unsafe { ptr::copy_nonoverlapping(c.buffer, start, n) };
        } else {
            unpack(conv, c.buffer, n);
        }
    }
    // SAFETY: r is live; status from the claimed message.
    unsafe {
        (*r).status.source = m.layout.source(c.matched_tag, c.matched_data);
        (*r).status.tag = m.layout.mpi_tag(c.matched_tag);
        (*r).status.count = n;
        (*r).status.error = if len > size {
            sys::MPI_ERR_TRUNCATE as c_int
        } else {
            sys::MPI_SUCCESS as c_int
        };
    }
    if c.owns_buffer {
        // SAFETY: allocated in improbe.
        unsafe { libc::free(c.buffer as *mut c_void) };
    }
    drop(c);
    // SAFETY: the message handle is ours to return (as ob1 does); then null it.
    unsafe {
        glue::ompi_ofi_glue_message_return(msg);
        *message = ptr::addr_of_mut!(sys::ompi_message_null.message);
        Request::complete_to_pml(r);
    }
    sys::OMPI_SUCCESS
}

fn cancel_impl(req: *mut sys::mca_mtl_request_t) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let r = req as *mut Request;
    // SAFETY: r is a live request of ours.
    let kind = unsafe { (*r).kind };
    if kind != Kind::Recv {
        // A send cannot be taken back once handed to the fabric: report "not cancelled".
        // SAFETY: the PML's request is live.
        unsafe {
            if !(*r).sup.ompi_req.is_null() {
                (*(*r).sup.ompi_req).req_status._cancelled = 0;
            }
        }
        return sys::OMPI_SUCCESS;
    }
    // Drain completions first: the receive may already have matched.
    progress_mtl(m);
    if let Some(sm) = m.soft.as_deref() {
        if super::softmatch::cancel(sm, r) {
            // SAFETY: r is live and no longer posted anywhere.
            unsafe {
                (*r).status.cancelled = true;
                (*r).status.error = sys::MPI_SUCCESS as c_int;
                if (*r).owns_buffer {
                    libc::free((*r).buffer as *mut c_void);
                    (*r).owns_buffer = false;
                }
                Request::complete_to_pml(r);
            }
        }
        return sys::OMPI_SUCCESS;
    }
    let waiting = {
        let mut deferred = m.deferred.lock().unwrap_or_else(|e| e.into_inner());
        deferred.remove(r as usize)
    };
    if waiting {
        // Never reached the provider: cancelled here.
        // SAFETY: r is live and queued nowhere now.
        unsafe {
            (*r).status.cancelled = true;
            if (*r).owns_buffer {
                libc::free((*r).buffer as *mut c_void);
                (*r).owns_buffer = false;
            }
            Request::complete_to_pml(r);
        }
        return sys::OMPI_SUCCESS;
    }
    // SAFETY: r is live.
    let (ctx, rx) = unsafe { ((*r).ctx_ptr(), m.ctx(comm_cid((*r).comm)).rx) };
    let ret = {
        let _g = m.lock.lock();
        // SAFETY: the endpoint is open; ctx is the context of a posted receive (or of
        // one that already completed, which fi_cancel ignores).
        unsafe { fi::fi_cancel(&mut (*rx).fid, ctx) }
    };
    if ret != 0 {
        // SAFETY: as above.
        unsafe {
            if !(*r).sup.ompi_req.is_null() {
                (*(*r).sup.ompi_req).req_status._cancelled = 0;
            }
        }
    }
    sys::OMPI_SUCCESS
}

// ---------------------------------------------------------------------------
// The module's extern "C" entries (one thin adapter each).

use crate::ompi::component::ffi_guard;

pub extern "C" fn mtl_send(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    dest: c_int,
    tag: c_int,
    conv: *mut sys::opal_convertor_t,
    mode: sys::mca_pml_base_send_mode_t,
) -> c_int {
    ffi_guard("mtl send", sys::OMPI_ERROR, || {
        send_impl(comm, dest, tag, conv, mode)
    })
}

pub extern "C" fn mtl_isend(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    dest: c_int,
    tag: c_int,
    conv: *mut sys::opal_convertor_t,
    mode: sys::mca_pml_base_send_mode_t,
    _blocking: bool,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    ffi_guard("mtl isend", sys::OMPI_ERROR, || {
        isend_impl(comm, dest, tag, conv, mode, req)
    })
}

pub extern "C" fn mtl_irecv(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
    conv: *mut sys::opal_convertor_t,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    ffi_guard("mtl irecv", sys::OMPI_ERROR, || {
        irecv_impl(comm, src, tag, conv, req)
    })
}

pub extern "C" fn mtl_iprobe(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
    flag: *mut c_int,
    status: *mut sys::ompi_status_public_t,
) -> c_int {
    ffi_guard("mtl iprobe", sys::OMPI_ERROR, || {
        iprobe_impl(comm, src, tag, flag, status)
    })
}

pub extern "C" fn mtl_improbe(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
    flag: *mut c_int,
    message: *mut *mut sys::ompi_message_t,
    status: *mut sys::ompi_status_public_t,
) -> c_int {
    ffi_guard("mtl improbe", sys::OMPI_ERROR, || {
        improbe_impl(comm, src, tag, flag, message, status)
    })
}

pub extern "C" fn mtl_imrecv(
    _mtl: *mut sys::mca_mtl_base_module_t,
    conv: *mut sys::opal_convertor_t,
    message: *mut *mut sys::ompi_message_t,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    ffi_guard("mtl imrecv", sys::OMPI_ERROR, || {
        imrecv_impl(conv, message, req)
    })
}

pub extern "C" fn mtl_cancel(
    _mtl: *mut sys::mca_mtl_base_module_t,
    req: *mut sys::mca_mtl_request_t,
    _flag: c_int,
) -> c_int {
    ffi_guard("mtl cancel", sys::OMPI_ERROR, || cancel_impl(req))
}

#[cfg(test)]
mod rx_budget_tests {
    use super::RxBudget;

    #[test]
    fn user_receives_leave_the_reserve_to_internal_ones() {
        for threads in [false, true] {
            let b = RxBudget::new(1024, threads);
            assert_eq!(b.user_max(), 896);
            for _ in 0..896 {
                assert!(b.room(false));
                b.change(false, true);
            }
            assert!(!b.room(false), "the user class stops at capacity - reserve");
            for _ in 0..128 {
                assert!(b.room(true), "internal receives use the reserve");
                b.change(true, true);
            }
            assert!(!b.room(true), "nothing past the capacity");
            b.change(false, false);
            assert!(b.room(true) && b.room(false));
            assert_eq!(b.posted(), (895, 128));
        }
    }

    #[test]
    fn small_and_unknown_queues() {
        let b = RxBudget::new(4, false);
        assert_eq!(b.user_max(), 3);
        let u = RxBudget::new(0, false);
        assert!(u.room(false) && u.room(true));
        // A count never wraps below zero without threads.
        u.change(false, false);
        assert_eq!(u.posted(), (0, 0));
    }
}
