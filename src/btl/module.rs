//! The module and its state: [`Module`] (Open MPI's struct first, then [`State`],
//! everything the data paths need), the peers handed to Open MPI as endpoints
//! ([`PeerEp`]), the transmit/receive [`Context`]s, the running modules
//! (`MODULES`) and the modex blob in which each module publishes its endpoint name.
//!
//! What it owns: the [`Module`]s of the process and their libfabric objects: one that
//! reaches every peer (the provider and NIC the common layer selects) and, in a job
//! that spans hosts, one over shm for the peers on this host when the provider lists
//! allow shm. Opening them is `open.rs`, their peers `procs.rs`, progress
//! `progress.rs`, closing them `teardown.rs`; the data paths live in `am.rs` (active
//! messages), `rdma.rs` (RDMA and atomics) and `amo.rs` (emulated atomics); the
//! registration cache in `rcache.rs`. What it must not touch: the data paths' logic;
//! it only holds their state.
//!
//! Threading: libfabric calls on the endpoint and CQ go through [`Module::fi`], which
//! holds a mutex only when MPI threads are enabled and the domain is not
//! `FI_THREAD_SAFE`. No lock is held while an Open MPI callback runs, because callbacks
//! call back into the BTL.

use super::am::{self, frag::Frag, frag::RecvBuf};
use super::progress::progress_module;
use super::rcache::{self, Cache};
use super::rdma;
use super::registration;
use crate::common::sync::{MaybeLock, Serial};
use crate::common::{fbox, release, DomainHandle, IdMap};
use crate::fabric::{AddressVector, Buffer, CompletionQueue, Endpoint, MemoryRegion};
use crate::ompi::proc::OpalProc;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub(crate) use crate::common::sync::lock;

/// What `add_procs` hands Open MPI as `mca_btl_base_endpoint_t`. Boxed in
/// `State::peers` from `add_procs` until `del_procs` (or teardown), which Open MPI
/// calls only once its operations to the peer are over.
pub struct PeerEp {
    pub addr: fi::fi_addr_t,
    pub proc_: OpalProc,
    /// The ring claimed in the peer's fast-box segment (`common::fbox`), if any.
    pub fbox: Option<fbox::Tx>,
    /// Fragments to this peer waiting in `State::fbox_queue` (sent in order after them).
    pub fbox_waiting: AtomicUsize,
}

impl PeerEp {
    /// The endpoint Open MPI passes back for this peer.
    #[inline(always)]
    pub fn as_endpoint(&self) -> *mut sys::mca_btl_base_endpoint_t {
        self as *const PeerEp as *mut sys::mca_btl_base_endpoint_t
    }
}

/// The module: Open MPI's struct first (Open MPI holds a pointer to it), our state after.
#[repr(C)]
pub struct Module {
    pub sup: sys::mca_btl_base_module_t,
    pub state: State,
}

impl Module {
    /// The pointer Open MPI knows this module by, for callbacks.
    #[inline(always)]
    pub fn btl(&self) -> *mut sys::mca_btl_base_module_t {
        self as *const Module as *mut sys::mca_btl_base_module_t
    }
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
    /// Puts longer than `write_max` are done by the target's read (`put_by_read`;
    /// needs active messages, `btl_ofi_mode` 2).
    pub put_by_read: bool,
    /// Fragments past the inject size up to `am::wire::PIECE_LIMIT` go as trains of
    /// injects of at most this many bytes, 0 for never (see `am::send::send_pieces`).
    pub piece_max: usize,
    /// Message ids of pieces: a random per-process base, stepped by 2.
    pub next_piece_id: AtomicU64,
    /// Fragments arriving in pieces, by message id.
    pub assembly: crate::common::sync::MaybeMutex<crate::common::IdMap<u64, am::recv::Assembly>>,
    /// Fragments assembled from pieces.
    pub assembled: AtomicU64,
    /// Payload bytes of a fragment (the module's max_send_size).
    pub frag_payload: usize,
    /// The receive buffers are multi-receive buffers (`am::recv::post_receives`).
    pub multi_recv: bool,
    pub num_cq_read: usize,
    pub progress_threshold: usize,
    pub frags: Mutex<Vec<Box<Frag>>>,
    /// Sends that met -FI_EAGAIN (or queued behind one), posted again by progress.
    pub pending: Mutex<VecDeque<Box<Frag>>>,
    /// Mirrors `!pending.is_empty()`; only written with `pending` locked.
    pub has_pending: AtomicBool,
    /// Sends with a completion in flight at most (0: no limit); where set, nothing is
    /// injected (common::quirks::Quirks::flood_unsafe).
    pub send_window: usize,
    /// Held by the one thread that posts queued sends (see `am::send::drain_pending`).
    pub draining: Mutex<()>,
    pub recv_bufs: Mutex<Vec<*mut RecvBuf>>,
    /// Receive buffers the provider refused to take back, posted again by progress
    /// (`am::recv::post_unposted`).
    pub unposted: crate::common::sync::Unposted<am::recv::Idle>,
    pub peers: Mutex<Vec<Box<PeerEp>>>,
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
    /// in order, sent by progress (`am::send::drain_fbox`).
    pub fbox_queue: Mutex<VecDeque<Box<Frag>>>,
    /// Mirrors `!fbox_queue.is_empty()`; only written with it locked.
    pub fbox_queued: AtomicBool,
    /// Fragments received through the fast boxes (those sent are counted per peer,
    /// `fbox::Tx::sent`).
    pub fbox_received: AtomicU64,
    pub rcache: Mutex<Cache<MemoryRegion>>,
    /// Registrations made outside the cache (caching off, or full) and still live, by
    /// the address of their `registration::Registration`: find requests (`resolve`) look here
    /// after the cache. Locked after `rcache`, never before.
    pub outside: Mutex<IdMap<usize, registration::Handle>>,
    /// The cache's release table, read by progress without the cache's mutex.
    pub rcache_slots: Arc<rcache::Slots>,
    pub rcache_sub: Option<release::Subscription<rcache::Slots>>,
    pub error_cb: Mutex<sys::mca_btl_base_module_error_cb_fn_t>,
    /// Held while one call drains the completion queue.
    pub in_progress: Serial,
    pub closing: AtomicBool,
    pub cq_errors: AtomicU64,
    /// Received fragments dropped: a header that fails `am::wire::AmHeader::decode`, or a
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

// SAFETY: the raw pointers State holds (receive buffers, fragments and peers inside
// them, Open MPI's error callback) are owned by the module and only followed under
// the mutexes above or by the single owner of an operation; libfabric calls are
// serialised by `fi_lock` below FI_THREAD_SAFE (see the module documentation).
unsafe impl Send for State {}

// SAFETY: the same ownership rules make shared access from several threads sound.
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
    pub fn tx(&self) -> crate::fabric::EpRef<'_> {
        self.ctxs[self.ctx_index()].tx.data_path()
    }

    /// `addr` (a peer's AV address) aimed at the peer's receive context that pairs
    /// with this thread's transmit context ([`State::tx`]).
    #[inline(always)]
    pub fn to(&self, addr: fi::fi_addr_t) -> fi::fi_addr_t {
        crate::common::endpoint::rx_addr(addr, self.ctx_index(), self.rx_ctx_bits)
    }

    /// The key to request for a new registration (ignored with `FI_MR_PROV_KEY`).
    pub fn next_key(&self) -> u64 {
        if self.prov_key {
            0
        } else {
            self.next_key.fetch_add(1, Ordering::Relaxed)
        }
    }

    /// Finish a new registration: bind it to the endpoint and enable it when the
    /// provider wants `FI_MR_ENDPOINT`.
    pub fn finish_registration(&self, mr: &MemoryRegion) -> crate::fabric::Result<()> {
        if self.mr_endpoint {
            mr.bind_ep(&self.ep, 0)?;
            mr.enable()?;
        }
        Ok(())
    }

    /// Register `buf` for this module's access rights, kept by the buffer.
    pub fn register_buffer(&self, buf: &mut Buffer) -> crate::fabric::Result<()> {
        let mr = buf.register(self.ep.domain(), self.mr_access, self.next_key())?;
        self.finish_registration(mr)
    }

    /// Peers send requests that target this process's registrations (emulated
    /// atomics, puts by read), checked against the ranges `amo` keeps.
    #[inline]
    pub fn serves_requests(&self) -> bool {
        self.amo || self.put_by_read
    }

    /// Run one libfabric call under the threading lock, with the lock's proof (the
    /// one proof this module's posts and polls take, for its one domain).
    #[inline]
    pub fn fi<R>(&self, f: impl FnOnce(&crate::fabric::Serialized<'_>) -> R) -> R {
        let g = self.fi_lock.lock();
        f(&g.serialized())
    }

    /// Progress from the send path when too much is outstanding.
    #[inline]
    pub fn maybe_progress(&self, module: &'static Module) {
        let n = self.rdma_outstanding.load(Ordering::Relaxed)
            + self.send_outstanding.load(Ordering::Relaxed);
        if n > self.progress_threshold {
            progress_module(module);
        }
    }
}

/// The most modules one process runs: one for every peer, one for on-host peers.
pub(super) const MAX_MODULES: usize = 2;

/// The running modules (none before init and after finalize); the first reaches
/// every peer.
pub(super) static MODULES: crate::ompi::btl::Published<Module, MAX_MODULES> =
    crate::ompi::btl::Published::new();

/// The running modules, the one that reaches every peer first.
pub(super) fn running() -> impl Iterator<Item = &'static Module> {
    MODULES.iter()
}

/// The running module Open MPI knows as `btl`, looked up rather than cast: for the
/// entry points off the data path (`None`: not one of ours, or not running).
pub(super) fn running_module(btl: *mut sys::mca_btl_base_module_t) -> Option<&'static Module> {
    running().find(|m| m.btl() == btl)
}

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
    pub(super) fn record(self) -> u8 {
        match self {
            Role::AllPeers => 0,
            Role::OnHost => 1,
        }
    }

    /// The modex record of the module's fast-box segment (`fbox::Rx::record`).
    pub(super) fn fbox_record(self) -> u8 {
        0x10 | self.record()
    }
}

/// The modex blob: records of a number (1 byte), a length (2 bytes, little-endian) and
/// the data: each module's endpoint name ([`Role::record`]) and fast-box segment
/// ([`Role::fbox_record`]).
pub(super) fn modex_encode<'a>(records: impl Iterator<Item = (u8, &'a [u8])>) -> Vec<u8> {
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
pub(super) fn modex_decode(blob: &[u8], want: u8) -> Option<&[u8]> {
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

/// The registration cache's counters of the module that reaches every peer.
pub fn rcache_stats() -> Option<rcache::Stats> {
    running().next().map(|m| lock(&m.state.rcache).stats())
}

/// The one-sided operations posted by every running module (`btl_ofi_rdma_*`).
pub fn op_counts() -> rdma::OpCounts {
    let mut c = [0u64; 5];
    let (mut deferred, mut fbox_sent, mut fbox_received) = (0, 0, 0);
    for m in running() {
        {
            for (sum, n) in c.iter_mut().zip(&m.state.ops) {
                *sum += n.load(Ordering::Relaxed);
            }
            deferred += m.state.rdma_deferrals.load(Ordering::Relaxed);
            fbox_received += m.state.fbox_received.load(Ordering::Relaxed);
            fbox_sent += fbox_sent_of(&m.state);
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
pub(super) fn fbox_sent_of(state: &State) -> u64 {
    lock(&state.peers)
        .iter()
        .filter_map(|p| p.fbox.as_ref().map(fbox::Tx::sent))
        .sum()
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
