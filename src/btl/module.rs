//! BTL setup and teardown: the module template whose generic limits Open MPI's
//! `btl_ofi_*` parameters write into, provider selection for the requested mode, the
//! endpoint, the pre-posted receive buffers, the atomics advertised from
//! `fi_query_atomic`, add/del of procs, progress and flush.
//!
//! What it owns: the [`Module`]s of the process and their libfabric objects: one that
//! reaches every peer (the provider and NIC the common layer selects) and, in a job
//! that spans hosts, one over shm for the peers on this host when the provider lists
//! allow shm. Each module publishes its endpoint name as one record of the process's
//! modex blob. The data paths live in `am.rs`
//! (active messages) and `rdma.rs` (RDMA and atomics); the registration cache in
//! `rcache.rs`.
//!
//! Threading: libfabric calls on the endpoint and CQ go through [`Module::fi`], which
//! holds a mutex only when MPI threads are enabled and the domain is not
//! `FI_THREAD_SAFE`. No lock is held while an Open MPI callback runs, because callbacks
//! call back into the BTL.

use super::am::{self, Frag, RecvBuf, HDR};
use super::amo;
use super::rcache::{self, Cache};
use super::rdma::{self, Registration};
use super::resolve;
use crate::common::sync::{MaybeLock, Serial};
use crate::common::{self, fbox, release, DomainHandle, DomainRequest, IdMap};
use crate::fabric::{
    AddressVector, AvAttr, CompletionQueue, CqAttr, Endpoint, Hints, MemoryRegion,
};
use crate::ompi::component::ffi_guard;
use crate::ompi::modex;
use crate::ompi::params::btl as idx;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::collections::VecDeque;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What `add_procs` hands Open MPI as `mca_btl_base_endpoint_t`.
pub struct PeerEp {
    pub addr: fi::fi_addr_t,
    pub proc_: *mut sys::opal_proc_t,
    /// The ring claimed in the peer's fast-box segment (`common::fbox`), if any.
    pub fbox: Option<fbox::Tx>,
    /// Fragments to this peer waiting in `State::fbox_queue` (sent in order after them).
    pub fbox_waiting: AtomicUsize,
}

/// The module: Open MPI's struct first (Open MPI holds a pointer to it), our state after.
#[repr(C)]
pub struct Module {
    pub sup: sys::mca_btl_base_module_t,
    pub st: State,
}

/// Everything the data paths need.
pub struct State {
    /// The regular endpoint, or the scalable endpoint whose contexts are `ctxs`
    /// (memory regions bind to it under `FI_MR_ENDPOINT`).
    pub ep: Arc<Endpoint>,
    /// Transmit/receive context pairs, each with the CQ both report to: one pair (the
    /// endpoint itself) unless a scalable endpoint was opened
    /// (`btl_ofi_num_contexts_per_module`). Dropped before `ep`'s last reference.
    pub ctxs: Box<[Context]>,
    /// `rx_ctx_bits` of the AV: a thread on context `i` sends to the peer's receive
    /// context `i` (0 without a scalable endpoint).
    pub rx_ctx_bits: u32,
    /// Completions read from each context's CQ (counted with several contexts only).
    pub per_ctx: Box<[AtomicU64]>,
    pub av: Arc<AddressVector>,
    pub fi_lock: MaybeLock,
    pub provider: String,
    /// Which peers the module serves (and which modex record it reads).
    pub role: Role,
    pub two_sided: bool,
    pub one_sided: bool,
    pub mr_local: bool,
    /// Atomics are emulated with active messages (`amo.rs`).
    pub amo: bool,
    /// Writes ask for delivery completion explicitly (the provider accepted it).
    pub delivery: bool,
    pub mr_endpoint: bool,
    pub virt_addr: bool,
    pub prov_key: bool,
    pub mr_access: u64,
    pub inject_size: usize,
    /// Largest write posted as one (`rdma::btl_put` splits larger puts): one packet
    /// where sends of more than one break the provider
    /// (`common::quirks::Quirks::segments_unsafe`, whose writes take the same path),
    /// else unbounded.
    pub write_max: usize,
    /// Puts longer than `write_max` are done by the target's read (`amo::put_by_read`;
    /// needs active messages, `btl_ofi_mode` 2).
    pub put_by_read: bool,
    /// Fragments past the inject size up to [`am::PIECE_LIMIT`] go as trains of
    /// injects of at most this many bytes, 0 for never (see `am::send_pieces`).
    pub piece_max: usize,
    /// Message ids of pieces: a random per-process base, stepped by 2.
    pub next_piece_id: AtomicU64,
    /// Fragments arriving in pieces, by message id.
    pub assembly: crate::common::sync::MaybeMutex<crate::common::IdMap<u64, am::Assembly>>,
    /// Fragments assembled from pieces.
    pub assembled: AtomicU64,
    /// Payload bytes of a fragment (the module's max_send_size).
    pub frag_payload: usize,
    /// The receive buffers are multi-receive buffers (`am::post_receives`).
    pub multi_recv: bool,
    pub num_cq_read: usize,
    pub progress_threshold: usize,
    pub frags: Mutex<Vec<*mut Frag>>,
    /// Sends that met -FI_EAGAIN (or queued behind one), posted again by progress.
    pub pending: Mutex<VecDeque<*mut Frag>>,
    /// Mirrors `!pending.is_empty()`; only written with `pending` locked.
    pub has_pending: AtomicBool,
    /// Sends with a completion in flight at most (0: no limit); where set, nothing is
    /// injected (common::quirks::Quirks::flood_unsafe).
    pub send_window: usize,
    /// Held by the one thread that posts queued sends (see `am::drain_pending`).
    pub draining: Mutex<()>,
    pub recv_bufs: Mutex<Vec<*mut RecvBuf>>,
    /// Receive buffers the provider refused to take back, posted again by progress
    /// (`am::post_unposted`).
    pub unposted: crate::common::sync::Unposted<*mut RecvBuf>,
    pub peers: Mutex<Vec<*mut PeerEp>>,
    /// RDMA and atomic operations posted and not completed (flush waits for 0),
    /// including those deferred in `rdma_deferred`.
    pub rdma_outstanding: AtomicUsize,
    /// Gets and puts the provider refused with -FI_EAGAIN, posted again by progress,
    /// in order (`rdma::post_deferred`).
    pub rdma_deferred: Mutex<VecDeque<rdma::Deferred>>,
    /// Mirrors `!rdma_deferred.is_empty()`; only written with it locked.
    pub has_rdma_deferred: AtomicBool,
    /// Sends posted and not completed.
    pub send_outstanding: AtomicUsize,
    /// This process's fast-box segment (`common::fbox`), polled by progress.
    pub fbox: Option<fbox::Rx>,
    /// Fragments for fast boxes that were full (or had fragments waiting before them),
    /// in order, sent by progress (`am::drain_fbox`).
    pub fbox_queue: Mutex<VecDeque<*mut Frag>>,
    /// Mirrors `!fbox_queue.is_empty()`; only written with it locked.
    pub fbox_queued: AtomicBool,
    /// Fragments received through the fast boxes (those sent are counted per peer,
    /// `fbox::Tx::sent`).
    pub fbox_received: AtomicU64,
    pub rcache: Mutex<Cache<MemoryRegion>>,
    /// Registrations made outside the cache (caching off, or full) and still live, by
    /// the address of their `rdma::Registration`: find requests (`resolve`) look here
    /// after the cache. Locked after `rcache`, never before.
    pub outside: Mutex<IdMap<usize, rdma::Handle>>,
    /// The cache's release table, read by progress without the cache's mutex.
    pub rcache_slots: Arc<rcache::Slots>,
    pub rcache_sub: Option<release::SlotId>,
    pub error_cb: Mutex<sys::mca_btl_base_module_error_cb_fn_t>,
    /// Held while one call drains the completion queue.
    pub in_progress: Serial,
    pub closing: AtomicBool,
    pub cq_errors: AtomicU64,
    /// Received fragments dropped: a header that fails `am::AmHeader::decode`, or a
    /// tag nobody registered.
    pub bad_fragments: AtomicU64,
    /// Operations posted: put, get, atomic_op, atomic_fop, atomic_cswap.
    pub ops: [AtomicU64; 5],
    /// Gets and puts deferred on -FI_EAGAIN (`rdma::Deferred`).
    pub rdma_deferrals: AtomicU64,
    pub next_key: AtomicU64,
    /// Dropped last: the shared domain (and, for the last user, the memory monitor).
    pub domain: Option<DomainHandle>,
}

/// One transmit/receive context pair and its CQ (both the regular endpoint itself when
/// there is no scalable endpoint).
pub struct Context {
    pub tx: Arc<Endpoint>,
    pub rx: Arc<Endpoint>,
    pub cq: Arc<CompletionQueue>,
}

/// This thread's number, handed out in order of first use: a thread keeps its context
/// (`number % contexts`), so its operations to one peer stay in order, and threads
/// spread over the contexts round robin (as the C BTL's thread-local choice).
fn thread_number() -> usize {
    use std::cell::Cell;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static NUMBER: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    NUMBER.with(|n| {
        if n.get() == usize::MAX {
            n.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        n.get()
    })
}

// SAFETY: the raw pointers (fragments, receive buffers, peers) are owned by the module
// and only touched under the mutexes above or by the single owner of an operation;
// libfabric calls are serialised by `fi_lock` below FI_THREAD_SAFE (see module docs).
unsafe impl Send for State {}
// SAFETY: as above.
unsafe impl Sync for State {}

impl State {
    /// This thread's context index.
    #[inline(always)]
    fn ctx_index(&self) -> usize {
        if self.ctxs.len() == 1 {
            0
        } else {
            thread_number() % self.ctxs.len()
        }
    }

    /// The transmit context of this thread.
    #[inline(always)]
    pub fn tx(&self) -> &Endpoint {
        &self.ctxs[self.ctx_index()].tx
    }

    /// `addr` (a peer's AV address) aimed at the peer's receive context that pairs
    /// with this thread's transmit context ([`State::tx`]).
    #[inline(always)]
    pub fn to(&self, addr: fi::fi_addr_t) -> fi::fi_addr_t {
        crate::common::endpoint::rx_addr(addr, self.ctx_index(), self.rx_ctx_bits)
    }

    /// Register `[base, base + len)` for this module's access rights, binding it to the
    /// endpoint when the provider wants `FI_MR_ENDPOINT`.
    ///
    /// # Safety
    /// The memory must stay mapped while the region lives (see `MemoryRegion::register`).
    pub unsafe fn register(
        &self,
        base: *const c_void,
        len: usize,
    ) -> crate::fabric::Result<MemoryRegion> {
        let key = if self.prov_key {
            0
        } else {
            self.next_key.fetch_add(1, Ordering::Relaxed)
        };
        // SAFETY: forwarded contract.
        let mr = unsafe {
            MemoryRegion::register(self.ep.domain(), base, len, self.mr_access, 0, key, 0)
        }?;
        if self.mr_endpoint {
            mr.bind_ep(&self.ep, 0)?;
            mr.enable()?;
        }
        Ok(mr)
    }

    /// Peers send requests that target this process's registrations (emulated
    /// atomics, puts by read), checked against the ranges `amo` keeps.
    #[inline]
    pub fn serves_requests(&self) -> bool {
        self.amo || self.put_by_read
    }

    /// Run one libfabric call under the threading lock.
    #[inline]
    pub fn fi<R>(&self, f: impl FnOnce() -> R) -> R {
        let _g = self.fi_lock.lock();
        f()
    }

    /// Progress from the send path when too much is outstanding.
    #[inline]
    pub fn maybe_progress(&self, module: *mut Module) {
        let n = self.rdma_outstanding.load(Ordering::Relaxed)
            + self.send_outstanding.load(Ordering::Relaxed);
        if n > self.progress_threshold {
            progress_module(module);
        }
    }
}

/// The most modules one process runs: one for every peer, one for on-host peers.
const MAX_MODULES: usize = 2;

/// Completion errors logged as warnings per module; later ones are counted (and
/// logged at debug level).
const CQ_ERRORS_LOGGED: u64 = 8;

/// The running modules (null before init and after finalize); the first reaches
/// every peer.
static MODULES: [AtomicPtr<Module>; MAX_MODULES] =
    [const { AtomicPtr::new(ptr::null_mut()) }; MAX_MODULES];

/// Which peers a module serves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    /// Every peer that publishes an address (the provider the selection chose).
    AllPeers,
    /// Only peers on this host, over shm, in a job that spans hosts.
    OnHost,
}

impl Role {
    /// The modex record of the module's endpoint name.
    fn record(self) -> u8 {
        match self {
            Role::AllPeers => 0,
            Role::OnHost => 1,
        }
    }

    /// The modex record of the module's fast-box segment (`fbox::Rx::record`).
    fn fbox_record(self) -> u8 {
        0x10 | self.record()
    }
}

/// The modex blob: records of a number (1 byte), a length (2 bytes, little-endian) and
/// the data: each module's endpoint name ([`Role::record`]) and fast-box segment
/// ([`Role::fbox_record`]).
fn modex_encode<'a>(records: impl Iterator<Item = (u8, &'a [u8])>) -> Vec<u8> {
    let mut out = Vec::new();
    for (rec, data) in records {
        out.push(rec);
        out.extend_from_slice(&(data.len() as u16).to_le_bytes());
        out.extend_from_slice(data);
    }
    out
}

/// The data of record `want` a peer published; None when it has none or the blob
/// is malformed (a peer's data is checked, never trusted).
fn modex_decode(blob: &[u8], want: u8) -> Option<&[u8]> {
    let mut rest = blob;
    while !rest.is_empty() {
        let (&rec, tail) = rest.split_first()?;
        let len = u16::from_le_bytes(tail.get(..2)?.try_into().ok()?) as usize;
        let name = tail.get(2..2 + len)?;
        if rec == want {
            return (!name.is_empty()).then_some(name);
        }
        rest = &tail[2 + len..];
    }
    None
}

/// The template whose generic fields `mca_btl_base_param_register` binds to the
/// `btl_ofi_*` variables. On the C heap and never freed: Open MPI keeps pointers to
/// its fields for as long as the variables exist, which may be after an unload.
static TEMPLATE: AtomicPtr<sys::mca_btl_base_module_t> = AtomicPtr::new(ptr::null_mut());

unsafe extern "C" {
    fn ompi_ofi_btl_glue_job_size() -> u32;
    fn mca_btl_base_param_register(
        version: *mut sys::mca_base_component_t,
        module: *mut sys::mca_btl_base_module_t,
    ) -> c_int;
}

const DEFAULT_EAGER: usize = 8 * 1024;
const DEFAULT_MAX_SEND: usize = 64 * 1024;

fn fill_table(m: &mut sys::mca_btl_base_module_t) {
    m.btl_add_procs = Some(add_procs);
    m.btl_del_procs = Some(del_procs);
    m.btl_register = None;
    m.btl_finalize = Some(finalize_cb);
    m.btl_alloc = Some(am::btl_alloc);
    m.btl_free = Some(am::btl_free);
    m.btl_prepare_src = Some(am::btl_prepare_src);
    m.btl_send = Some(am::btl_send);
    m.btl_sendi = Some(am::btl_sendi);
    m.btl_put = Some(rdma::btl_put);
    m.btl_get = Some(rdma::btl_get);
    m.btl_dump = None;
    m.btl_atomic_op = Some(rdma::btl_atomic_op);
    m.btl_atomic_fop = Some(rdma::btl_atomic_fop);
    m.btl_atomic_cswap = Some(rdma::btl_atomic_cswap);
    m.btl_register_mem = Some(rdma::btl_register_mem);
    m.btl_deregister_mem = Some(rdma::btl_deregister_mem);
    m.btl_register_error = Some(register_error);
    m.btl_flush = Some(flush);
}

/// Register the generic BTL parameters (`btl_ofi_exclusivity`, `eager_limit`, ...) on
/// the template.
// Never inlined: scripts/valgrind-ours recognises its deliberate leak by this
// function's name, which an inlined frame does not carry.
#[inline(never)]
pub fn register_base_params() {
    let mut t = TEMPLATE.load(Ordering::Acquire);
    if t.is_null() {
        // SAFETY: a zeroed module is a valid value (integers, nullable pointers, None).
        t = unsafe { libc::calloc(1, std::mem::size_of::<sys::mca_btl_base_module_t>()) }
            as *mut sys::mca_btl_base_module_t;
        if t.is_null() {
            return;
        }
        TEMPLATE.store(t, Ordering::Release);
    }
    // SAFETY: t is our template; nobody else writes it before registration.
    let m = unsafe { &mut *t };
    m.btl_component = super::component::mca_btl_ofi_component.get();
    m.btl_exclusivity = sys::MCA_BTL_EXCLUSIVITY_DEFAULT;
    m.btl_eager_limit = DEFAULT_EAGER;
    m.btl_rndv_eager_limit = DEFAULT_EAGER;
    m.btl_max_send_size = DEFAULT_MAX_SEND;
    m.btl_rdma_pipeline_send_length = DEFAULT_MAX_SEND;
    m.btl_rdma_pipeline_frag_size = 4 * 1024 * 1024;
    m.btl_min_rdma_pipeline_size = 0;
    m.btl_latency = 10;
    m.btl_bandwidth = 10000;
    m.btl_flags = sys::MCA_BTL_FLAGS_SEND
        | sys::MCA_BTL_FLAGS_RDMA
        | sys::MCA_BTL_FLAGS_RDMA_FLUSH
        | sys::MCA_BTL_FLAGS_ATOMIC_OPS
        | sys::MCA_BTL_FLAGS_ATOMIC_FOPS;
    m.btl_registration_handle_size = std::mem::size_of::<rdma::Handle>();
    fill_table(m);
    // SAFETY: the component struct and template are valid; Open MPI binds variables to
    // the template's fields, which live forever (see TEMPLATE).
    unsafe {
        mca_btl_base_param_register(super::component::component_ptr() as *mut _, t);
    }
}

fn component() -> &'static sys::mca_base_component_t {
    // SAFETY: the component struct is a static of this library.
    unsafe { &*super::component::component_ptr() }
}

fn param(i: usize) -> i64 {
    lock(&super::component::PARAMS)
        .as_ref()
        .map(|p| p.int(i))
        .unwrap_or(0)
}

fn param_str(i: usize) -> Option<String> {
    lock(&super::component::PARAMS)
        .as_ref()
        .and_then(|p| p.string(i))
}

fn progress_of(s: Option<&str>) -> Result<fi::fi_progress, String> {
    match s.unwrap_or("unspec") {
        "unspec" | "" => Ok(fi::FI_PROGRESS_UNSPEC),
        "auto" => Ok(fi::FI_PROGRESS_AUTO),
        "manual" => Ok(fi::FI_PROGRESS_MANUAL),
        other => Err(format!(
            "btl_ofi_progress_mode={other}: expected unspec, auto or manual"
        )),
    }
}

/// Values of btl_ofi_atomics (mca_params/btl.params).
const ATOMICS_PROVIDER: i64 = 2;
const ATOMICS_AM: i64 = 3;

const MR_MODES: u32 = fi::FI_MR_VIRT_ADDR
    | fi::FI_MR_ALLOCATED
    | fi::FI_MR_PROV_KEY
    | fi::FI_MR_LOCAL
    | fi::FI_MR_ENDPOINT;

/// The atomics the provider supports, as `btl_atomic_flags`, from `fi_query_atomic`.
fn query_atomics(domain: *mut fi::fid_domain) -> u32 {
    let ok = |dt: fi::fi_datatype, op: fi::fi_op, flags: u64| {
        let mut attr = fi::fi_atomic_attr::default();
        // SAFETY: the domain is open; attr is a valid out parameter.
        unsafe { fi::fi_query_atomic(domain, dt, op, &mut attr, flags) == 0 }
    };
    let fetch = fi::FI_FETCH_ATOMIC;
    let mut flags = 0u32;
    let mut all32 = true;
    for (btl, op) in rdma::ATOMIC_OPS {
        if ok(fi::FI_INT64, op, 0) && ok(fi::FI_INT64, op, fetch) {
            flags |= btl;
            all32 &= ok(fi::FI_INT32, op, 0) && ok(fi::FI_INT32, op, fetch);
        }
    }
    let compare = fi::FI_COMPARE_ATOMIC;
    if ok(fi::FI_INT64, fi::FI_CSWAP, compare) {
        flags |= sys::MCA_BTL_ATOMIC_SUPPORTS_CSWAP;
        all32 &= ok(fi::FI_INT32, fi::FI_CSWAP, compare);
    }
    if flags != 0 && all32 {
        flags |= sys::MCA_BTL_ATOMIC_SUPPORTS_32BIT;
    }
    flags
}

/// Build the module, or say why not.
pub fn init(
    _progress_threads: bool,
    mpi_threads: bool,
) -> Result<(*mut *mut sys::mca_btl_base_module_t, i32), String> {
    lock(&super::component::PARAMS)
        .as_ref()
        .map_or(Err("the BTL parameters were not registered".into()), |p| {
            p.check()
        })?;
    let template = TEMPLATE.load(Ordering::Acquire);
    if template.is_null() {
        return Err("the BTL parameters were not registered".into());
    }
    let mode = param(idx::MODE);
    let (one_sided, two_sided) = match mode {
        0 => (true, false),
        1 => (false, true),
        2 => (true, true),
        m => {
            return Err(format!(
                "btl_ofi_mode={m}: expected 0 (one-sided), 1 (two-sided) or 2 (both)"
            ))
        }
    };
    let num_cq_read = param(idx::NUM_CQ_READ);
    if num_cq_read < 1 {
        return Err(format!(
            "btl_ofi_num_cq_read={num_cq_read}: must be at least 1"
        ));
    }
    let rd_num = param(idx::RD_NUM);
    if two_sided && rd_num < 1 {
        return Err(format!("btl_ofi_rd_num={rd_num}: must be at least 1"));
    }
    let mut contexts = param(idx::NUM_CONTEXTS_PER_MODULE).max(1) as usize;
    if contexts > 1 && param(idx::DISABLE_SEP) != 0 {
        log::warn!(
            "btl_ofi_num_contexts_per_module={contexts} needs a scalable endpoint, which \
             btl_ofi_disable_sep=1 forbids: one context is used"
        );
        contexts = 1;
    }
    let progress = progress_of(param_str(idx::PROGRESS_MODE).as_deref())?;
    // Checked here; sized per module (for its eager limit).
    let fbox = param(idx::FBOX_SIZE).max(0) as u64;
    fbox::Sizes::new("btl_ofi_fbox_size", fbox, 1)
        .inspect_err(|e| log::warn!("{e}: the ofi BTL declines"))?;

    // SAFETY: opal_process_info and the modex are set up before BTL init.
    let (local_peers, world) = unsafe {
        (
            sys::opal_process_info.num_local_peers,
            ompi_ofi_btl_glue_job_size(),
        )
    };
    let all_local = world > 0 && local_peers as u64 + 1 >= world as u64;
    let cfg = Config {
        contexts,
        local_ranks: local_peers.max(0) as usize + 1,
        one_sided,
        two_sided,
        num_cq_read: num_cq_read as usize,
        rd_num,
        progress,
        mpi_threads,
        all_local,
        world,
        fbox,
    };
    let primary = open_module(&cfg, Role::AllPeers)?;
    let mut modules = vec![primary];
    // A job across hosts: on-host peers over shm when the provider lists allow it.
    // The primary module still reaches every peer, so that osc rdma (which needs one
    // BTL reaching all of a window's peers) keeps working; shm wins ob1's sends to
    // on-host peers by exclusivity.
    // SAFETY: modules[0] is our fresh module.
    let primary_provider = unsafe { (*modules[0].0).st.provider.clone() };
    if !all_local && two_sided && !common::endpoint::is_shm(&primary_provider) && local_peers > 0 {
        match open_module(&cfg, Role::OnHost) {
            Ok(m) => {
                log::info!(
                    "peers on this host over shm, peers on other hosts over {primary_provider}"
                );
                modules.push(m);
            }
            Err(e) => {
                log::info!("peers on this host over {primary_provider} too (no shm module: {e})")
            }
        }
    }
    let mut records: Vec<(u8, Vec<u8>)> = Vec::new();
    for (mp, name) in &modules {
        // SAFETY: every module in the list is ours and live.
        let st = unsafe { &(*(*mp)).st };
        records.push((st.role.record(), name.clone()));
        if let Some(rx) = &st.fbox {
            records.push((st.role.fbox_record(), rx.record()));
        }
    }
    let blob = modex_encode(records.iter().map(|(rec, data)| (*rec, data.as_slice())));
    let publish = modex::send(component(), &blob)
        .map_err(|rc| format!("publishing the endpoint names through the modex failed ({rc})"));
    // SAFETY: Open MPI frees the module array with free().
    let arr = unsafe {
        libc::malloc(MAX_MODULES * std::mem::size_of::<*mut sys::mca_btl_base_module_t>())
    } as *mut *mut sys::mca_btl_base_module_t;
    if publish.is_err() || arr.is_null() {
        for (mp, _) in modules {
            // SAFETY: nothing else knows mp yet.
            unsafe { destroy(mp) };
        }
        if !arr.is_null() {
            // SAFETY: from malloc above, not handed out.
            unsafe { libc::free(arr.cast()) };
        }
        return Err(publish.err().unwrap_or_else(|| "out of memory".into()));
    }
    for (i, (mp, _)) in modules.iter().enumerate() {
        MODULES[i].store(*mp, Ordering::Release);
        // SAFETY: arr has room for MAX_MODULES pointers.
        unsafe { *arr.add(i) = *mp as *mut sys::mca_btl_base_module_t };
    }
    Ok((arr, modules.len() as i32))
}

/// What every module of this process shares.
struct Config {
    /// Contexts asked for (`btl_ofi_num_contexts_per_module`, 1 under `disable_sep`).
    contexts: usize,
    /// Ranks of this job on this node (they share the provider's contexts).
    local_ranks: usize,
    one_sided: bool,
    two_sided: bool,
    num_cq_read: usize,
    rd_num: i64,
    progress: fi::fi_progress,
    mpi_threads: bool,
    all_local: bool,
    world: u32,
    /// `btl_ofi_fbox_size` (checked; 0: fast boxes off).
    fbox: u64,
}

/// Open one module: its domain, endpoint and receive buffers. Returns the module and
/// its endpoint name (for the modex).
fn open_module(cfg: &Config, role: Role) -> Result<(*mut Module, Vec<u8>), String> {
    let Config {
        contexts,
        local_ranks,
        one_sided,
        two_sided,
        num_cq_read,
        rd_num,
        progress,
        mpi_threads,
        all_local,
        world,
        fbox,
    } = *cfg;
    let template = TEMPLATE.load(Ordering::Acquire);
    // shm lists neither locality capability: ask for none when every peer is local.
    let locality = if all_local || role == Role::OnHost {
        0
    } else {
        fi::FI_LOCAL_COMM | fi::FI_REMOTE_COMM
    };
    let threading = if mpi_threads {
        fi::FI_THREAD_SAFE
    } else {
        fi::FI_THREAD_DOMAIN
    };
    let make_hints = |atomics: bool, delivery: bool, multi: bool| -> crate::fabric::Result<Hints> {
        let mut caps = locality;
        if two_sided {
            caps |= (fi::FI_MSG | fi::FI_SEND | fi::FI_RECV) as u64;
            if multi {
                caps |= fi::FI_MULTI_RECV as u64;
            }
        }
        if one_sided {
            caps |= (fi::FI_RMA
                | fi::FI_READ
                | fi::FI_WRITE
                | fi::FI_REMOTE_READ
                | fi::FI_REMOTE_WRITE) as u64;
            if atomics {
                caps |= fi::FI_ATOMIC as u64;
            }
        }
        let mut h = Hints::new()?;
        if role == Role::OnHost {
            h = h.prov_name("shm");
        }
        let mut h = h
            .caps(caps)
            .mode(fi::FI_CONTEXT | fi::FI_CONTEXT2)
            .ep_type(fi::FI_EP_RDM)
            .mr_mode(MR_MODES)
            .threading(threading)
            .control_progress(progress)
            .data_progress(progress)
            .resource_mgmt(fi::FI_RM_ENABLED);
        if delivery {
            h = h.tx_op_flags(fi::FI_DELIVERY_COMPLETE as u64);
        }
        Ok(h)
    };
    // Preference order: atomics, then RMA completions that mean remote delivery. A
    // provider without atomics still gets a module (two-sided and RDMA).
    let atomics_mode = param(idx::ATOMICS);
    let attempts: &[(bool, bool)] = if one_sided && atomics_mode != ATOMICS_AM {
        &[(true, true), (true, false), (false, true), (false, false)]
    } else if one_sided {
        &[(false, true), (false, false)]
    } else {
        &[(false, false)]
    };
    // Each with multi-receive buffers first (see `am::post_receives`), where they matter.
    let multis: &[bool] = if two_sided { &[true, false] } else { &[false] };
    let mut failures = Vec::new();
    let mut opened = None;
    for (&(atomics, delivery), &multi) in attempts
        .iter()
        .flat_map(|a| multis.iter().map(move |m| (a, m)))
    {
        let hints = make_hints(atomics, delivery, multi)
            .map_err(|e| format!("cannot allocate fi_info hints: {e}"))?;
        match common::open_domain(DomainRequest {
            component: "btl",
            hints,
            threading_fallback: mpi_threads.then_some(fi::FI_THREAD_DOMAIN),
            spans_hosts: !all_local && role == Role::AllPeers,
        }) {
            Ok(d) => {
                opened = Some((d, atomics, delivery, multi));
                break;
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    let Some((mut domain, atomics, delivery, multi)) = opened else {
        failures.dedup();
        return Err(failures.join("; "));
    };
    // A provider that lags under automatic progress (sockets: floods of unexpected
    // messages stall) is opened again, the same way, with manual progress, unless
    // btl_ofi_progress_mode chose.
    let provider = domain.info().provider_name().to_string();
    if progress == fi::FI_PROGRESS_UNSPEC
        && crate::common::quirks::of(&provider).lags_in_auto_progress
        && domain.info().data_progress() != fi::FI_PROGRESS_MANUAL
    {
        let reopened = make_hints(atomics, delivery, multi)
            .map_err(|e| format!("cannot allocate fi_info hints: {e}"))
            .and_then(|h| {
                common::open_domain(DomainRequest {
                    component: "btl",
                    hints: h
                        .prov_name(&provider)
                        .control_progress(fi::FI_PROGRESS_MANUAL)
                        .data_progress(fi::FI_PROGRESS_MANUAL),
                    threading_fallback: mpi_threads.then_some(fi::FI_THREAD_DOMAIN),
                    spans_hosts: !all_local && role == Role::AllPeers,
                })
                .map_err(|e| e.to_string())
            });
        match reopened {
            Ok(d) => {
                log::info!("provider {provider}: manual progress (its own progress thread lags)");
                domain = d;
            }
            Err(e) => log::info!("provider {provider}: automatic progress (manual refused: {e})"),
        }
    }
    let info = domain.info();
    let mr_mode = info.mr_mode();
    let e = |what: &str, err: crate::fabric::Error| format!("{what} on {provider}: {err}");
    let dom = domain.domain().clone();
    // Contexts: a scalable endpoint when more than one is asked for and the provider
    // has them, within its limit shared by the ranks of this node.
    let nctx = if contexts <= 1 {
        1
    } else if info.max_ep_ctx() < 2 {
        if role == Role::AllPeers {
            log::warn!(
                "btl_ofi_num_contexts_per_module={contexts}: provider {provider} offers no scalable \
                 endpoints (at most {} transmit/receive contexts per endpoint); one context is used",
                info.max_ep_ctx()
            );
        }
        1
    } else if mr_mode & fi::FI_MR_ENDPOINT != 0 {
        log::warn!(
            "btl_ofi_num_contexts_per_module={contexts}: provider {provider} binds memory \
             regions to endpoints (FI_MR_ENDPOINT), which this BTL does not do for scalable \
             endpoints; one context is used"
        );
        1
    } else {
        crate::common::endpoint::contexts_within(
            contexts,
            info,
            local_ranks,
            "btl_ofi_num_contexts_per_module",
        )
    };
    let rx_ctx_bits = crate::common::endpoint::rx_ctx_bits(nctx);
    let av = AddressVector::open(
        &dom,
        &AvAttr {
            av_type: fi::FI_AV_TABLE,
            count: world.max(1) as usize,
            rx_ctx_bits: rx_ctx_bits as i32,
        },
    )
    .or_else(|_| {
        AddressVector::open(
            &dom,
            &AvAttr {
                av_type: fi::FI_AV_UNSPEC,
                count: world.max(1) as usize,
                rx_ctx_bits: rx_ctx_bits as i32,
            },
        )
    })
    .map_err(|x| e("fi_av_open", x))?;
    // Delivery completion was asked in the hints so that the provider must accept it;
    // the endpoint itself gets no default transmit flags: puts ask for it per operation
    // (rdma.rs), and as a default it would also apply to every active message (on shm
    // that turns an inline send into one the receiver must acknowledge).
    let ep_info = Hints::from_info(info)
        .map(|h| h.tx_op_flags(0))
        .map_err(|x| e("fi_dupinfo", x))?;
    let (ep, ctxs) = if nctx > 1 {
        let (sep, contexts) =
            crate::common::endpoint::open_scalable_enabled(&dom, ep_info.info(), &av, nctx, nctx)?;
        let ctxs = contexts
            .into_iter()
            .map(|c| Context {
                tx: Arc::new(c.tx),
                rx: Arc::new(c.rx),
                cq: c.cq,
            })
            .collect();
        (sep, ctxs)
    } else {
        let cq = CompletionQueue::open(&dom, &CqAttr::default()).map_err(|x| e("fi_cq_open", x))?;
        let ep = Arc::new(crate::common::endpoint::open_enabled(
            &dom,
            ep_info.info(),
            &cq,
            &av,
        )?);
        let ctx = Context {
            tx: Arc::clone(&ep),
            rx: Arc::clone(&ep),
            cq,
        };
        (ep, vec![ctx])
    };
    let name = ep.getname().map_err(|x| e("fi_getname", x))?;

    let provider_atomics = if atomics {
        query_atomics(dom.as_ptr())
    } else {
        0
    };
    // Atomics by active messages: asked for, or (auto) the provider has none or its
    // own crash (common::quirks). They need both services: the request travels as an
    // active message to the window's registration.
    let quirks = crate::common::quirks::of(&provider);
    let atomics_crash = quirks.atomics_crash;
    let amo = one_sided
        && two_sided
        && match atomics_mode {
            ATOMICS_AM => true,
            ATOMICS_PROVIDER => false,
            _ => provider_atomics & !sys::MCA_BTL_ATOMIC_SUPPORTS_32BIT == 0 || atomics_crash,
        };
    if amo && atomics_crash && provider_atomics != 0 && atomics_mode != ATOMICS_AM {
        log::info!(
            "provider {provider}: atomics by active messages (its own atomics crash it under osc rdma; \
             btl_ofi_atomics=provider uses them anyway)"
        );
    }
    if atomics_mode == ATOMICS_AM && !amo {
        log::warn!(
            "btl_ofi_atomics=am needs btl_ofi_mode 2 (active messages and RDMA): no atomics offered"
        );
    }
    let atomic_flags = if amo {
        amo::FLAGS
    } else if atomics_mode == ATOMICS_AM {
        0
    } else {
        provider_atomics
    };
    let inject_size = info.inject_size();
    // More receive buffers than the provider's receive queue holds can never all be
    // posted, and nothing frees a slot during init (no peer sends yet): posting would
    // spin forever in MPI_Init (seen with FI_OFI_RXM_RX_SIZE=4). Use the queue depth.
    let rx_depth = info.rx_size();
    let rd_num = if rx_depth > 0 && rd_num as usize > rx_depth {
        log::warn!(
            "btl_ofi_rd_num={rd_num} exceeds the receive queue of {} ({rx_depth} entries): \
             using {rx_depth}",
            info.provider_name()
        );
        rx_depth as i64
    } else {
        rd_num
    };
    // Where unexpected messages break the provider, post enough buffers that the
    // fragments ob1 keeps in flight find one (common::quirks::FLOOD_RECV_BUFFERS).
    let floor = crate::common::quirks::FLOOD_RECV_BUFFERS as i64;
    let rd_num = if two_sided
        && quirks.flood_unsafe
        && rd_num < floor
        && (rx_depth == 0 || rx_depth as i64 >= floor)
    {
        log::info!(
            "provider {provider}: unexpected messages break it (common::quirks): \
             {floor} receive buffers instead of btl_ofi_rd_num={rd_num}"
        );
        floor
    } else {
        rd_num
    };
    let max_msg = info.max_msg_size();
    let caps = info.caps();

    // The module: the template (with the user's values) plus what this provider allows.
    // SAFETY: the template was registered above and is only read here.
    let mut sup = unsafe { *template };
    fill_table(&mut sup);
    sup.btl_component = super::component::mca_btl_ofi_component.get();
    sup.btl_max_send_size = sup
        .btl_max_send_size
        .clamp(1, max_msg.saturating_sub(HDR).max(1));
    let one_packet = inject_size.saturating_sub(HDR);
    if two_sided
        && quirks.segments_unsafe
        && one_packet > 0
        && sup.btl_max_send_size > one_packet
        && !crate::ompi::params::user_set("opal", "btl", "ofi", "max_send_size")
    {
        log::info!(
            "provider {provider}: messages of more than one packet break it under load \
             (common::quirks): fragments of at most {one_packet} B (btl_ofi_max_send_size \
             overrides)"
        );
        sup.btl_max_send_size = one_packet;
    }
    let write_max = if one_sided && quirks.segments_unsafe && inject_size > rdma::WRITE_HEADROOM * 2
    {
        inject_size - rdma::WRITE_HEADROOM
    } else {
        usize::MAX
    };
    sup.btl_eager_limit = sup.btl_eager_limit.clamp(1, sup.btl_max_send_size);
    sup.btl_rndv_eager_limit = sup.btl_rndv_eager_limit.min(sup.btl_eager_limit);
    let mut capable = sys::MCA_BTL_FLAGS_SEND_INPLACE;
    if two_sided {
        capable |= sys::MCA_BTL_FLAGS_SEND;
    }
    if one_sided {
        capable |= sys::MCA_BTL_FLAGS_RDMA | sys::MCA_BTL_FLAGS_RDMA_FLUSH;
        if atomic_flags & !sys::MCA_BTL_ATOMIC_SUPPORTS_32BIT != 0 {
            capable |= sys::MCA_BTL_FLAGS_ATOMIC_OPS | sys::MCA_BTL_FLAGS_ATOMIC_FOPS;
        }
    }
    // Open MPI 4.1's flag enumerator loses "atomics" when it round-trips the default
    // ("fetching-atomics" contains it): fetching atomics imply the plain ones.
    if sup.btl_flags & sys::MCA_BTL_FLAGS_ATOMIC_FOPS != 0 {
        sup.btl_flags |= sys::MCA_BTL_FLAGS_ATOMIC_OPS;
    }
    sup.btl_flags &= capable;
    sup.btl_atomic_flags = if sup.btl_flags & sys::MCA_BTL_FLAGS_ATOMIC_OPS != 0 {
        atomic_flags
    } else {
        0
    };
    if sup.btl_flags & sys::MCA_BTL_FLAGS_SEND == 0 {
        sup.btl_alloc = None;
        sup.btl_free = None;
        sup.btl_prepare_src = None;
        sup.btl_send = None;
        sup.btl_sendi = None;
    }
    if sup.btl_flags & sys::MCA_BTL_FLAGS_RDMA == 0 {
        sup.btl_put = None;
        sup.btl_get = None;
        sup.btl_register_mem = None;
        sup.btl_deregister_mem = None;
        sup.btl_flush = None;
        sup.btl_registration_handle_size = 0;
    }
    if sup.btl_flags & sys::MCA_BTL_FLAGS_ATOMIC_OPS == 0 {
        sup.btl_atomic_op = None;
        sup.btl_atomic_fop = None;
        sup.btl_atomic_cswap = None;
    } else if amo {
        sup.btl_atomic_op = Some(amo::btl_atomic_op);
        sup.btl_atomic_fop = Some(amo::btl_atomic_fop);
        sup.btl_atomic_cswap = Some(amo::btl_atomic_cswap);
    }
    let amo = amo && sup.btl_atomic_op.is_some();
    sup.btl_get_limit = if sup.btl_get_limit == 0 {
        max_msg
    } else {
        sup.btl_get_limit.min(max_msg)
    };
    sup.btl_put_limit = if sup.btl_put_limit == 0 {
        max_msg
    } else {
        sup.btl_put_limit.min(max_msg)
    };
    // Forcing it exercises, on any provider, the path that providers needing local
    // descriptors (efa with FI_MR_LOCAL, verbs) take: passing a descriptor the
    // provider does not need is allowed.
    let mr_local = mr_mode & fi::FI_MR_LOCAL != 0 || param(idx::FORCE_MR_LOCAL) != 0;
    let threshold = if mr_local { 0 } else { usize::MAX };
    sup.btl_get_local_registration_threshold = threshold;
    sup.btl_put_local_registration_threshold = threshold;

    let mut access = 0u64;
    if caps & fi::FI_MSG as u64 != 0 {
        access |= (fi::FI_SEND | fi::FI_RECV) as u64;
    }
    if caps & (fi::FI_RMA | fi::FI_ATOMIC) as u64 != 0 {
        access |= (fi::FI_READ | fi::FI_WRITE | fi::FI_REMOTE_READ | fi::FI_REMOTE_WRITE) as u64;
    }
    let release_events = common::monitor::Monitor::outcome()
        .and_then(|o| o.ok())
        .is_some_and(|o| o.release_events);
    let max_entries = param(idx::RCACHE_MAX_ENTRIES).max(0) as usize;
    let max_bytes = lock(&super::component::PARAMS)
        .as_ref()
        .map(|p| p.size(idx::RCACHE_MAX_BYTES))
        .unwrap_or(0);
    if !release_events && max_entries > 0 {
        log::info!(
            "memory release events do not reach this library: the registration cache is disabled"
        );
    }
    let cache = Cache::new(max_entries, max_bytes, release_events);
    let rcache_sub = if cache.enabled() {
        match release::subscribe(rcache::release_cb, Arc::as_ptr(cache.slots()) as usize) {
            Ok(id) => Some(id),
            Err(e) => {
                return Err(format!(
                    "cannot subscribe the registration cache to memory releases: {e}"
                ))
            }
        }
    } else {
        None
    };

    if role == Role::OnHost {
        // Ahead of the primary module for ob1's sends to on-host peers, and preferred
        // by osc rdma for windows whose peers are all on this host.
        sup.btl_exclusivity = sup.btl_exclusivity.saturating_add(1);
        sup.btl_latency = (sup.btl_latency / 2).max(1);
    }
    let frag_payload = sup.btl_max_send_size;
    // Multi-receive buffers need the provider to release one before less than a
    // largest fragment is left in it, and to keep track of large fragments in them
    // (and of unexpected messages matched to them: not so on flood_unsafe providers).
    let multi_unsafe = quirks.multi_recv_unsafe || quirks.flood_unsafe;
    if multi && multi_unsafe {
        log::info!(
            "provider {provider}: multi-receive buffers lose messages here \
             (common::quirks); one receive buffer per fragment"
        );
    }
    let multi_recv = multi
        && !multi_unsafe
        && ctxs.iter().all(|c| {
            let min: usize = am::HDR + frag_payload;
            // SAFETY: FI_OPT_MIN_MULTI_RECV takes a size_t.
            let r = unsafe {
                c.rx.setopt(
                    fi::FI_OPT_ENDPOINT as i32,
                    fi::FI_OPT_MIN_MULTI_RECV as i32,
                    &min,
                )
            };
            if let Err(err) = &r {
                log::info!(
                    "provider {provider}: no minimum for multi-receive buffers ({err}); one \
                     receive buffer per fragment"
                );
            }
            r.is_ok()
        });
    let put_by_read = write_max < usize::MAX && sup.btl_flags & sys::MCA_BTL_FLAGS_SEND != 0;
    if write_max < usize::MAX {
        log::info!(
            "provider {provider}: writes of more than one packet break it under load \
             (common::quirks): puts go as writes of at most {write_max} B{}",
            if put_by_read {
                format!(
                    ", or above {} B are read by the target",
                    rdma::PUT_BY_READ_MIN
                )
            } else {
                String::new()
            }
        );
    }
    // Fast boxes for the module whose peers are all on this host.
    // Every fragment that carries ob1's matching order (match, rendezvous and get
    // headers, at most the eager limit) fits a box, so that a peer's such fragments
    // take one path, in order (see common::fbox).
    // Also under MPI_THREAD_MULTIPLE. They were kept off there for a while, after
    // mpi_tests/fbox's threads part saw a thread's messages overtake each other; that
    // was the test's MPI_T_init_thread(MPI_THREAD_SINGLE), which drops Open MPI 4.1.4's
    // own thread level, so that ob1's MPI_Recv shared one request among threads
    // (btl/vader the same; docs/testing.md, "Open MPI 4.1.4's own layers").
    let on_shm = (common::endpoint::is_shm(&provider) || role == Role::OnHost) && local_ranks > 1;
    let fbox = if fbox > 0 && sup.btl_flags & sys::MCA_BTL_FLAGS_SEND != 0 && on_shm {
        fbox::Sizes::new(
            "btl_ofi_fbox_size",
            fbox,
            sup.btl_eager_limit.max(sup.btl_rndv_eager_limit),
        )
        .and_then(|sizes| {
            let sizes = sizes.ok_or("off")?;
            fbox::Rx::create(local_ranks, sizes, sys::MCA_BTL_TAG_MAX).map_err(|e| e.to_string())
        })
        .inspect_err(|e| log::info!("no fast boxes on {provider}: {e}"))
        .ok()
    } else {
        None
    };
    let module = Box::new(Module {
        sup,
        st: State {
            ep,
            ctxs: ctxs.into_boxed_slice(),
            rx_ctx_bits,
            per_ctx: (0..if nctx > 1 { nctx } else { 0 })
                .map(|_| AtomicU64::new(0))
                .collect(),
            av,
            fi_lock: MaybeLock::new(mpi_threads && domain.threading() != fi::FI_THREAD_SAFE),
            provider: provider.clone(),
            role,
            two_sided: sup.btl_flags & sys::MCA_BTL_FLAGS_SEND != 0,
            one_sided: sup.btl_flags & sys::MCA_BTL_FLAGS_RDMA != 0,
            mr_local,
            amo,
            delivery,
            mr_endpoint: mr_mode & fi::FI_MR_ENDPOINT != 0,
            virt_addr: mr_mode & fi::FI_MR_VIRT_ADDR != 0,
            prov_key: mr_mode & fi::FI_MR_PROV_KEY != 0,
            mr_access: access,
            inject_size,
            write_max,
            put_by_read,
            piece_max: if quirks.send_past_inject_slow {
                inject_size.min(am::INLINE_MAX)
            } else {
                0
            },
            next_piece_id: AtomicU64::new(crate::common::random_odd()),
            assembly: crate::common::sync::MaybeMutex::new(
                crate::common::IdMap::default(),
                mpi_threads,
            ),
            assembled: AtomicU64::new(0),
            frag_payload,
            multi_recv,
            num_cq_read,
            progress_threshold: param(idx::PROGRESS_THRESHOLD).max(0) as usize,
            frags: Mutex::new(Vec::new()),
            pending: Mutex::new(VecDeque::new()),
            has_pending: AtomicBool::new(false),
            send_window: if quirks.flood_unsafe {
                crate::common::quirks::SEND_WINDOW
            } else {
                0
            },
            draining: Mutex::new(()),
            recv_bufs: Mutex::new(Vec::new()),
            peers: Mutex::new(Vec::new()),
            rdma_outstanding: AtomicUsize::new(0),
            rdma_deferred: Mutex::new(VecDeque::new()),
            has_rdma_deferred: AtomicBool::new(false),
            unposted: Default::default(),
            send_outstanding: AtomicUsize::new(0),
            fbox,
            fbox_queue: Mutex::new(VecDeque::new()),
            fbox_queued: AtomicBool::new(false),
            fbox_received: AtomicU64::new(0),
            rcache_slots: Arc::clone(cache.slots()),
            rcache: Mutex::new(cache),
            outside: Mutex::new(IdMap::default()),
            rcache_sub,
            error_cb: Mutex::new(None),
            in_progress: Serial::new(mpi_threads),
            closing: AtomicBool::new(false),
            cq_errors: AtomicU64::new(0),
            bad_fragments: AtomicU64::new(0),
            ops: Default::default(),
            rdma_deferrals: AtomicU64::new(0),
            next_key: AtomicU64::new(1),
            domain: Some(domain),
        },
    });
    let mp = Box::into_raw(module);
    if two_sided {
        // SAFETY: mp is our fresh module.
        if let Err(err) = unsafe { am::post_receives(mp, rd_num as usize) } {
            // SAFETY: nothing else knows mp yet.
            unsafe { destroy(mp) };
            return Err(format!("posting receive buffers on {provider}: {err}"));
        }
    }
    // SAFETY: mp is live.
    let m = unsafe { &(*mp).sup };
    log::info!(
        "provider {provider}{}: {}{}{}, mr_mode {:#x}{}, inject {inject_size} B, eager {} B, max send {} B, atomics {:#x}{}{}",
        if role == Role::OnHost {
            " (peers on this host)"
        } else {
            ""
        },
        match (two_sided, one_sided) {
            (true, true) => "active messages and RDMA",
            (true, false) => "active messages only",
            _ => "RDMA only",
        },
        if two_sided {
            let (n, bytes) = am::receive_layout(rd_num as usize, am::HDR + m.btl_max_send_size, multi_recv);
            format!(
                " ({n} {}receive buffers of {bytes} B)",
                if multi_recv { "multi-" } else { "" }
            )
        } else {
            String::new()
        },
        if delivery { " (delivery-complete)" } else { "" },
        mr_mode,
        if mr_local {
            " (local descriptors: FI_MR_LOCAL)"
        } else {
            ""
        },
        m.btl_eager_limit,
        m.btl_max_send_size,
        m.btl_atomic_flags,
        if amo {
            " (emulated with active messages)"
        } else if atomics {
            ""
        } else {
            " (provider has no atomics)"
        },
        if all_local { ", local communication only" } else { "" },
    );
    if nctx > 1 {
        log::info!(
            "provider {provider}: scalable endpoint with {nctx} contexts (each thread keeps one, \
             round robin), {rd_num} receive buffers on each"
        );
    }
    Ok((mp, name))
}

/// Read and dispatch completions of the module. Returns how many were handled.
pub(crate) fn progress_module(mp: *mut Module) -> usize {
    // SAFETY: mp is a live module (in MODULES or the argument of a module entry).
    let st = unsafe { &(*mp).st };
    // Re-entered from a callback (or running on another thread): the outer call keeps
    // draining, in order.
    let Some(_serial) = st.in_progress.try_enter() else {
        return 0;
    };
    let mut total = 0usize;
    if let Some(rx) = &st.fbox {
        // SAFETY: one poller: we hold the serial section.
        let n = unsafe { rx.poll(st.num_cq_read, |tag, p, len| am::dispatch(mp, tag, p, len)) };
        if n > 0 {
            st.fbox_received.fetch_add(n as u64, Ordering::Relaxed);
            total += n;
        }
        if st.fbox_queued.load(Ordering::Relaxed) {
            am::drain_fbox(mp);
        }
    }
    if st.has_pending.load(Ordering::Relaxed) {
        am::drain_pending(mp);
    }
    if st.has_rdma_deferred.load(Ordering::Relaxed) {
        rdma::post_deferred(mp);
    }
    amo::retry_reads(mp);
    resolve::reissue(mp);
    if st.unposted.any() {
        am::post_unposted(st);
    }
    if st.ctxs.len() == 1 {
        total += progress_cq(mp, st, &st.ctxs[0].cq, st.num_cq_read);
    } else {
        for (c, count) in st.ctxs.iter().zip(st.per_ctx.iter()) {
            let n = progress_cq(mp, st, &c.cq, st.num_cq_read.saturating_sub(total).max(1));
            if n > 0 {
                count.fetch_add(n as u64, Ordering::Relaxed);
            }
            total += n;
        }
    }
    if total > 0 && st.has_pending.load(Ordering::Relaxed) {
        am::drain_pending(mp);
    }
    if total > 0 && st.has_rdma_deferred.load(Ordering::Relaxed) {
        rdma::post_deferred(mp);
    }
    total
}

/// Read and dispatch up to `budget` completions of `cq`, one of the module's.
fn progress_cq(mp: *mut Module, st: &State, cq: &CompletionQueue, budget: usize) -> usize {
    let mut total = 0usize;
    const CHUNK: usize = 64;
    // Not cleared: the provider writes the entries it returns (a cleared array cost a
    // 2.5 KiB memset on every poll).
    let mut entries = [std::mem::MaybeUninit::<fi::fi_cq_tagged_entry>::uninit(); CHUNK];
    loop {
        let want = CHUNK.min(budget - total.min(budget)).max(1);
        let r = st.fi(|| cq.read_uninit(&mut entries[..want]));
        match r {
            Ok(done) => {
                let n = done.len();
                for e in done {
                    // SAFETY: every operation we post carries the Ctx of a live op.
                    unsafe { dispatch(mp, e.op_context, e.len, 0, e.buf, e.flags) };
                }
                total += n;
                if n < want || total >= budget {
                    break;
                }
            }
            Err(err) if err == crate::fabric::Error::AVAIL => {
                let entry = st.fi(|| cq.readerr());
                match entry {
                    Ok(Some(ce)) => {
                        let seen = st.cq_errors.fetch_add(1, Ordering::Relaxed);
                        if !st.closing.load(Ordering::Relaxed) || ce.err != fi::FI_ECANCELED as i32
                        {
                            // The operation's own callback carries the error to ob1 or
                            // osc; this says what it was. A failing peer can produce
                            // thousands: the first few are enough.
                            let level = if seen < CQ_ERRORS_LOGGED {
                                log::Level::Warn
                            } else {
                                log::Level::Debug
                            };
                            // SAFETY: the entry's context is null or one we posted.
                            let what = unsafe { am::Kind::of(ce.op_context) }
                                .map_or("an operation without a context", am::Kind::what);
                            log::log!(
                                level,
                                "completion error on {} ({what}): {}{}",
                                st.provider,
                                cq.strerror(&ce),
                                if seen + 1 == CQ_ERRORS_LOGGED {
                                    " (further ones are only counted)"
                                } else {
                                    ""
                                }
                            );
                        }
                        // SAFETY: as above.
                        unsafe { dispatch(mp, ce.op_context, ce.len, ce.err, ce.buf, ce.flags) };
                        total += 1;
                    }
                    _ => break,
                }
            }
            Err(err) => {
                if err != crate::fabric::Error::AGAIN {
                    log::debug!("fi_cq_read on {}: {err}", st.provider);
                }
                break;
            }
        }
    }
    total
}

/// Route one completion (`err` 0 on success, else the positive FI_E* code; `buf` and
/// `flags` as the completion gives them).
///
/// # Safety
/// `ctx` is the context of an operation posted by this module.
unsafe fn dispatch(
    mp: *mut Module,
    ctx: *mut c_void,
    len: usize,
    err: i32,
    buf: *mut c_void,
    flags: u64,
) {
    // SAFETY: caller's contract: ctx is null or one we posted.
    let Some(kind) = (unsafe { am::Kind::of(ctx) }) else {
        return;
    };
    // SAFETY: forwarded: the kind names the containing operation.
    unsafe {
        match kind {
            am::Kind::Send => am::send_complete(mp, ctx, err),
            am::Kind::Recv => am::recv_complete(mp, ctx, len, err, buf, flags),
            am::Kind::Rdma => rdma::rdma_complete(mp, ctx, err),
        }
    }
}

/// Component progress: every module.
pub fn progress() -> i32 {
    let mut n = 0;
    for slot in &MODULES {
        let mp = slot.load(Ordering::Acquire);
        if mp.is_null() {
            continue;
        }
        n += progress_module(mp);
        // SAFETY: mp is live; sweep closes invalidated registrations from a normal
        // context.
        let st = unsafe { &(*mp).st };
        if st.rcache_slots.is_dirty() {
            if let Ok(mut c) = st.rcache.try_lock() {
                c.sweep();
            }
        }
    }
    n as i32
}

extern "C" fn add_procs(
    btl: *mut sys::mca_btl_base_module_t,
    nprocs: usize,
    procs: *mut *mut sys::opal_proc_t,
    endpoints: *mut *mut sys::mca_btl_base_endpoint_t,
    reachable: *mut sys::opal_bitmap_t,
) -> c_int {
    ffi_guard("btl add_procs", sys::OPAL_ERROR, || {
        if nprocs == 0 || procs.is_null() || endpoints.is_null() {
            return sys::OPAL_SUCCESS;
        }
        // SAFETY: btl is our module.
        let st = unsafe { &(*(btl as *mut Module)).st };
        // SAFETY: Open MPI passes nprocs procs and nprocs endpoint slots.
        let (procs, eps) = unsafe {
            (
                std::slice::from_raw_parts(procs, nprocs),
                std::slice::from_raw_parts_mut(endpoints, nprocs),
            )
        };
        let mut peers = lock(&st.peers);
        let mut reached = 0usize;
        for (i, &p) in procs.iter().enumerate() {
            // SAFETY: each peer pointer in our list is live until del_procs.
            if let Some(&known) = peers.iter().find(|&&pe| unsafe { (*pe).proc_ } == p) {
                eps[i] = known as *mut _;
            } else {
                // SAFETY: p is a live opal_proc_t.
                let (name, flags) = unsafe { (&(*p).proc_name, (*p).proc_flags) };
                // SAFETY: plain call; the local proc exists after opal_init.
                let me = unsafe { sys::opal_proc_local_get() };
                if st.role == Role::OnHost
                    && (u32::from(flags) & sys::OPAL_PROC_ON_NODE == 0 || p == me)
                {
                    // Another host (or this process, which the self BTL serves): the
                    // module for every peer has it.
                    continue;
                }
                let blob = match modex::recv(component(), name) {
                    Ok(a) => a,
                    Err(_) => continue, // the peer does not run this BTL: unreachable
                };
                let Some(addr) = modex_decode(&blob, st.role.record()) else {
                    continue; // no endpoint of this kind (or a malformed record)
                };
                let fiaddr = match st.av.insert(addr) {
                    Ok(a) => a,
                    Err(e) => {
                        log::warn!("fi_av_insert of a peer's address on {}: {e}", st.provider);
                        continue;
                    }
                };
                let fbox = st.fbox.as_ref().and_then(|_| {
                    let rec = modex_decode(&blob, st.role.fbox_record())?;
                    // SAFETY: set up before BTL init.
                    let me = unsafe { sys::opal_process_info.my_local_rank }.max(0) as usize;
                    fbox::Tx::open(rec, me)
                        .inspect_err(|e| {
                            log::info!("no fast box to a peer on {}: {e}", st.provider)
                        })
                        .ok()
                });
                let pe = Box::into_raw(Box::new(PeerEp {
                    addr: fiaddr,
                    proc_: p,
                    fbox,
                    fbox_waiting: AtomicUsize::new(0),
                }));
                peers.push(pe);
                eps[i] = pe as *mut _;
                reached += 1;
            }
            if !reachable.is_null() {
                // SAFETY: reachable is a bitmap of at least nprocs bits.
                unsafe { sys::opal_bitmap_set_bit(reachable, i as c_int) };
            }
        }
        if reached > 0 && st.role == Role::OnHost {
            log::info!(
                "add_procs: {reached} peer(s) on this host over {}",
                st.provider
            );
        } else if reached > 0 {
            log::debug!("add_procs: {reached} new peer(s) over {}", st.provider);
        }
        sys::OPAL_SUCCESS
    })
}

extern "C" fn del_procs(
    btl: *mut sys::mca_btl_base_module_t,
    nprocs: usize,
    _procs: *mut *mut sys::opal_proc_t,
    endpoints: *mut *mut sys::mca_btl_base_endpoint_t,
) -> c_int {
    ffi_guard("btl del_procs", sys::OPAL_ERROR, || {
        if nprocs == 0 || endpoints.is_null() {
            return sys::OPAL_SUCCESS;
        }
        // SAFETY: btl is our module; endpoints holds nprocs entries.
        let (st, eps) = unsafe {
            (
                &(*(btl as *mut Module)).st,
                std::slice::from_raw_parts(endpoints, nprocs),
            )
        };
        let mut peers = lock(&st.peers);
        for &e in eps {
            if let Some(pos) = peers
                .iter()
                .position(|&p| p as *mut sys::mca_btl_base_endpoint_t == e)
            {
                let p = peers.swap_remove(pos);
                // SAFETY: btl is our module; p is live until dropped below.
                unsafe { am::forget_fbox_peer(btl as *mut Module, p) };
                // SAFETY: p came from Box::into_raw in add_procs and is no longer listed.
                drop(unsafe { Box::from_raw(p) });
            }
        }
        sys::OPAL_SUCCESS
    })
}

/// Kept, never called: ob1's error handler (the one registered here) aborts the job
/// on any call (`mca_pml_ob1_error_handler`: `ompi_rte_abort`), and osc rdma registers
/// none. Errors reach the caller through each operation's callback and status instead.
extern "C" fn register_error(
    btl: *mut sys::mca_btl_base_module_t,
    cb: sys::mca_btl_base_module_error_cb_fn_t,
) -> c_int {
    ffi_guard("btl register_error", sys::OPAL_ERROR, || {
        // SAFETY: btl is our module.
        *lock(unsafe { &(*(btl as *mut Module)).st.error_cb }) = cb;
        sys::OPAL_SUCCESS
    })
}

/// Wait until every RDMA and atomic operation posted so far has completed.
extern "C" fn flush(
    btl: *mut sys::mca_btl_base_module_t,
    _ep: *mut sys::mca_btl_base_endpoint_t,
) -> c_int {
    ffi_guard("btl flush", sys::OPAL_ERROR, || {
        let mp = btl as *mut Module;
        // SAFETY: btl is our module.
        let st = unsafe { &(*mp).st };
        while st.rdma_outstanding.load(Ordering::Acquire) > 0 {
            if progress_module(mp) == 0 {
                // Another thread (or an outer frame) may be progressing: let Open MPI run.
                // SAFETY: plain call.
                unsafe { sys::opal_progress() };
            }
        }
        sys::OPAL_SUCCESS
    })
}

extern "C" fn finalize_cb(btl: *mut sys::mca_btl_base_module_t) -> c_int {
    ffi_guard("btl finalize", sys::OPAL_ERROR, || {
        for slot in &MODULES {
            if slot
                .compare_exchange(
                    btl as *mut Module,
                    ptr::null_mut(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                // SAFETY: unpublished above; Open MPI no longer calls this module.
                unsafe { destroy(btl as *mut Module) };
            }
        }
        sys::OPAL_SUCCESS
    })
}

/// Free a module that was never published.
///
/// # Safety
/// `mp` came from `Box::into_raw` and nobody else uses it.
unsafe fn destroy(mp: *mut Module) {
    // SAFETY: forwarded contract.
    let mut module = unsafe { Box::from_raw(mp) };
    amo::forget_module(mp);
    resolve::forget_module(mp);
    let st = &mut module.st;
    st.closing.store(true, Ordering::Release);
    if let Some(id) = st.rcache_sub.take() {
        release::unsubscribe(id);
    }
    let stats = lock(&st.rcache).stats();
    log::info!("registration cache: {stats}");
    let ops: Vec<u64> = st.ops.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    log::info!(
        "finalize: {} puts, {} gets, {} atomics, {} fetching atomics, {} compare-and-swaps; {} completion errors, \
         {} received fragments dropped, {} assembled from pieces, {} gets and puts deferred on \
         -FI_EAGAIN, {} sends and {} RDMA operations outstanding",
        ops[0],
        ops[1],
        ops[2],
        ops[3],
        ops[4],
        st.cq_errors.load(Ordering::Relaxed),
        st.bad_fragments.load(Ordering::Relaxed),
        st.assembled.load(Ordering::Relaxed),
        st.rdma_deferrals.load(Ordering::Relaxed),
        st.send_outstanding.load(Ordering::Relaxed),
        st.rdma_outstanding.load(Ordering::Relaxed)
    );
    if st.fbox.is_some() {
        log::info!(
            "fast boxes: {} fragments sent, {} received",
            fbox_sent_of(st),
            st.fbox_received.load(Ordering::Relaxed)
        );
    }
    let held = resolve::HELD_OPS.load(Ordering::Relaxed);
    if held > 0 {
        log::info!(
            "{held} operations came with a remote handle not covering their target; the \
             target had a registration covering {} of them (see btl/resolve.rs)",
            resolve::FOUND_OPS.load(Ordering::Relaxed)
        );
    }
    if !st.per_ctx.is_empty() {
        let counts: Vec<u64> = st
            .per_ctx
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect();
        log::info!("completions per scalable-endpoint context: {counts:?}");
    }
    // The endpoint first (it cancels the posted receives), then the memory behind them.
    let recv_bufs = std::mem::take(&mut *lock(&st.recv_bufs));
    let frags = std::mem::take(&mut *lock(&st.frags));
    let pending = std::mem::take(&mut *lock(&st.pending));
    let fbox_queue = std::mem::take(&mut *lock(&st.fbox_queue));
    let peers = std::mem::take(&mut *lock(&st.peers));
    rdma::discard_deferred(st);
    lock(&st.rcache).clear();
    let State {
        ep,
        ctxs,
        av,
        domain,
        ..
    } = module.st;
    // A scalable endpoint's contexts before the endpoint; CQs after what reports to
    // them (each endpoint keeps its CQ alive).
    drop(ctxs);
    drop(ep);
    drop(av);
    for b in recv_bufs {
        // SAFETY: the endpoint is closed: no receive uses the buffer any more.
        unsafe { am::free_recv_buf(b) };
    }
    for f in frags.into_iter().chain(pending).chain(fbox_queue) {
        // SAFETY: free-listed or never-posted fragments are ours.
        unsafe { am::free_frag_memory(f) };
    }
    for p in peers {
        // SAFETY: from Box::into_raw in add_procs.
        drop(unsafe { Box::from_raw(p) });
    }
    drop(domain);
}

/// Tear the module down (idempotent). No sleep: the endpoint close discards whatever
/// is still in flight.
pub fn finalize() {
    for slot in &MODULES {
        let mp = slot.swap(ptr::null_mut(), Ordering::AcqRel);
        if !mp.is_null() {
            // SAFETY: unpublished above; Open MPI no longer calls the module.
            unsafe { destroy(mp) };
        }
    }
    // The module array itself is freed by Open MPI's btl base.
}

/// The registration cache's counters of the module that reaches every peer.
pub fn rcache_stats() -> Option<rcache::Stats> {
    let mp = MODULES[0].load(Ordering::Acquire);
    // SAFETY: mp is null or live.
    unsafe { mp.as_ref() }.map(|m| lock(&m.st.rcache).stats())
}

/// The one-sided operations posted by every running module (`btl_ofi_rdma_*`).
pub fn op_counts() -> rdma::OpCounts {
    let mut c = [0u64; 5];
    let (mut deferred, mut fbox_sent, mut fbox_received) = (0, 0, 0);
    for slot in &MODULES {
        let mp = slot.load(Ordering::Acquire);
        // SAFETY: mp is null or live.
        if let Some(m) = unsafe { mp.as_ref() } {
            for (sum, n) in c.iter_mut().zip(&m.st.ops) {
                *sum += n.load(Ordering::Relaxed);
            }
            deferred += m.st.rdma_deferrals.load(Ordering::Relaxed);
            fbox_received += m.st.fbox_received.load(Ordering::Relaxed);
            fbox_sent += fbox_sent_of(&m.st);
        }
    }
    rdma::OpCounts {
        puts: c[0],
        gets: c[1],
        atomics: c[2],
        fetching_atomics: c[3],
        cswaps: c[4],
        deferred,
        fbox_sent,
        fbox_received,
    }
}

/// Fragments this module sent through fast boxes (counted per peer ring).
fn fbox_sent_of(st: &State) -> u64 {
    lock(&st.peers)
        .iter()
        // SAFETY: listed peers are live.
        .filter_map(|&p| unsafe { (*p).fbox.as_ref() }.map(fbox::Tx::sent))
        .sum()
}

/// The registration of a handle we returned (local use only).
///
/// # Safety
/// `h` is null or a handle returned by our `register_mem`.
#[inline]
pub unsafe fn local_desc(h: *mut sys::mca_btl_base_registration_handle_t) -> *mut c_void {
    if h.is_null() {
        ptr::null_mut()
    } else {
        // SAFETY: our handles point to a Registration (its first field is the Handle).
        unsafe { (*(h as *const Registration)).desc }
    }
}

#[cfg(test)]
mod tests {
    use super::{modex_decode, modex_encode, Role};
    use proptest::prelude::*;

    #[test]
    fn both_records_round_trip() {
        let blob = modex_encode(
            [
                (Role::AllPeers.record(), &b"tcp-name"[..]),
                (Role::OnHost.record(), &b"shm-name"[..]),
            ]
            .into_iter(),
        );
        assert_eq!(
            modex_decode(&blob, Role::AllPeers.record()),
            Some(&b"tcp-name"[..])
        );
        assert_eq!(
            modex_decode(&blob, Role::OnHost.record()),
            Some(&b"shm-name"[..])
        );
        let one = modex_encode([(Role::AllPeers.record(), &b"x"[..])].into_iter());
        assert_eq!(modex_decode(&one, Role::OnHost.record()), None);
    }

    #[test]
    fn malformed_blobs_are_refused() {
        assert_eq!(modex_decode(&[], Role::AllPeers.record()), None);
        assert_eq!(modex_decode(&[0], Role::AllPeers.record()), None);
        assert_eq!(
            modex_decode(&[0, 5, 0, b'a'], Role::AllPeers.record()),
            None
        );
        assert_eq!(modex_decode(&[0, 0, 0], Role::AllPeers.record()), None);
        assert_eq!(
            modex_decode(&[7, 1, 0, b'a', 0, 1], Role::AllPeers.record()),
            None
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = modex_decode(&bytes, Role::AllPeers.record());
            let _ = modex_decode(&bytes, Role::OnHost.record());
        }

        #[test]
        fn names_round_trip(a in proptest::collection::vec(any::<u8>(), 1..300),
                            b in proptest::collection::vec(any::<u8>(), 1..300)) {
            let blob = modex_encode([
                (Role::AllPeers.record(), &a[..]),
                (Role::OnHost.fbox_record(), &b[..]),
                (Role::OnHost.record(), &b[..]),
            ].into_iter());
            prop_assert_eq!(modex_decode(&blob, Role::AllPeers.record()), Some(&a[..]));
            prop_assert_eq!(modex_decode(&blob, Role::OnHost.record()), Some(&b[..]));
            prop_assert_eq!(modex_decode(&blob, Role::OnHost.fbox_record()), Some(&b[..]));
            prop_assert_eq!(modex_decode(&blob, Role::AllPeers.fbox_record()), None);
        }
    }
}
