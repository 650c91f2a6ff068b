//! The per-process state of the MTL that the data path reads: the contexts and their
//! completion queues, the receive budget and the queues of receives and sends that
//! wait for the provider, and the counters. Built by `open.rs` (its settings are
//! decided in `open/settings.rs`).
//!
//! What it owns: the shape of that state and the accounting of the receive budget.
//! What it must not touch: posting or completing operations (`send`, `recv`,
//! `completion`).
//!
//! Threading: every call into the endpoint and the completion queue holds
//! [`Mtl::lock`] (a real mutex whenever MPI threads are enabled, whatever the
//! provider's `FI_THREAD_*` level: udp;ofi_rxd hangs with concurrent callers although
//! it claims `FI_THREAD_SAFE`). Completions are read under the lock and dispatched after it
//! is released, because a completion may post (the acknowledgement of a synchronous
//! send) or call into the PML.

use super::request::Req;
use super::request::Request;
use super::send::PendingSend;
use super::tag::TagLayout;
use crate::common::sync::MaybeLock;
use crate::fabric::{CompletionQueue, CqRef, Endpoint, EpRef, Local, FI_ADDR_UNSPEC};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The per-process MTL state the data path reads. Built by `open.rs`.
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
    /// truncates (see `common::quirks::Quirks::truncation_unsafe`); `None` when unused.
    /// Its contents are garbage: whatever lands there is never read.
    pub overflow: Option<crate::fabric::Scrap>,
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
    /// Synchronous sends waiting for their acknowledgement, and the pool of receives
    /// that takes them (provider matching).
    pub acks: super::ack::Acks,
}

/// One transmit/receive context pair and the CQ both report to, as the data path
/// posts and polls them. Their owners are kept in setup's resources, which finalize
/// closes only after it took the state out of [`MTL`], so the views stay valid while
/// the [`Mtl`] that holds this is reachable (the promise of [`Ctx::new`]); the
/// accessors lend them for a borrow of the `Ctx` only.
#[derive(Clone, Copy)]
pub struct Ctx {
    tx: EpRef<'static>,
    rx: EpRef<'static>,
    cq: CqRef<'static>,
}

impl Ctx {
    /// The views of `tx`, `rx` and `cq`; `None` unless the CQ has the tagged format.
    ///
    /// # Safety
    /// The three objects stay open while the [`Mtl`] this goes into is reachable.
    pub unsafe fn new(tx: &Endpoint, rx: &Endpoint, cq: &CompletionQueue) -> Option<Ctx> {
        cq.tagged()?;
        // SAFETY: the caller's promise: the objects (open, as their owners' invariants
        // say, and the CQ tagged, checked above) outlive every use of the views, which
        // the accessors tie to a borrow of the Ctx inside the state.
        unsafe {
            Some(Ctx {
                tx: EpRef::from_raw(NonNull::new_unchecked(tx.as_ptr())),
                rx: EpRef::from_raw(NonNull::new_unchecked(rx.as_ptr())),
                cq: CqRef::from_raw(NonNull::new_unchecked(cq.as_ptr())),
            })
        }
    }

    /// The transmit context, to post through.
    #[inline(always)]
    pub fn tx(&self) -> EpRef<'_> {
        self.tx
    }

    /// The receive context, to post through.
    #[inline(always)]
    pub fn rx(&self) -> EpRef<'_> {
        self.rx
    }

    /// The completion queue, to poll.
    #[inline(always)]
    pub fn cq(&self) -> CqRef<'_> {
        self.cq
    }
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
    pub fn ep(&self) -> EpRef<'_> {
        self.ctxs[0].tx()
    }

    /// The scratch receives end with (see `overflow`), empty when unused.
    #[inline(always)]
    pub fn overflow(&self) -> Local {
        match &self.overflow {
            None => Local::NONE,
            // SAFETY: finalize drops the area only once the PML finalized, when no
            // receive of ours is posted any more, so it outlives every one posted with it.
            Some(s) => unsafe { s.local() },
        }
    }
}

/// Receives waiting for room in the provider's queue, in MPI order within each class
/// (request addresses). The two classes never match the same message: `internal`
/// holds Open MPI's own receives (negative tags: collectives over pml cm), which
/// `MPI_ANY_TAG` does not match (see tag.rs), `user` every other receive.
#[derive(Default)]
pub struct Deferred {
    pub user: VecDeque<Req>,
    pub internal: VecDeque<Req>,
    /// Messages of the user's class taken off the provider that no receive matched yet,
    /// oldest first (see stall.rs).
    pub stash: VecDeque<Box<Request>>,
}

impl Deferred {
    pub(super) fn queue(&mut self, internal: bool) -> &mut VecDeque<Req> {
        if internal {
            &mut self.internal
        } else {
            &mut self.user
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.user.is_empty() && self.internal.is_empty()
    }

    /// Take `r` out of whichever queue holds it.
    pub(super) fn remove(&mut self, r: Req) -> bool {
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
#[inline]
pub(super) fn rx_enter(m: &Mtl, r: Req) {
    m.rx.change(r.rx_internal(), true);
    r.set_in_provider(true);
}

/// `r` left the provider's queue (completed, failed, cancelled, or never got in).
#[inline]
pub(super) fn rx_leave(m: &Mtl, r: Req) {
    if r.in_provider() {
        r.set_in_provider(false);
        m.rx.change(r.rx_internal(), false);
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

// SAFETY: the raw fid pointers belong to a domain opened at FI_THREAD_DOMAIN or
// FI_THREAD_SAFE (open/provider.rs asks for one of them), which lets any thread call
// into its objects as long as the calls are serialised. They are: every call goes
// through `Ctx`'s views and takes the `Serialized` proof of `lock`, a real mutex chosen
// from the MPI thread level (open/settings.rs `threaded_lock`, `Threads`), not from the
// FI_THREAD_* level. The objects live until finalize, which takes the state out of
// `MTL` before it closes them.
unsafe impl Send for Mtl {}
// SAFETY: shared references reach the fid pointers and the overflow area only through
// fabric calls serialised as for Send; everything else the data path shares is
// atomics, locks (`MaybeLock`/`MaybeMutex`, real under MPI threads) or fixed at init.
unsafe impl Sync for Mtl {}

/// The running MTL of this process (null before init and after finalize).
pub static MTL: AtomicPtr<Mtl> = AtomicPtr::new(ptr::null_mut());

/// Set when a panic was caught in an entry point (`ompi::component::ffi_guard_module`):
/// the state's lists may be half-updated, so the data path refuses every later call;
/// teardown still runs and releases what it can.
pub static FAILED: AtomicBool = AtomicBool::new(false);

/// One call into the module, from an entry point: the state it reaches through
/// [`mtl`] lives as long as the call. Not `Send`, and never stored.
pub struct Entry(PhantomData<*const ()>);

impl Entry {
    /// # Safety
    /// Called at the start of an entry point that the PML makes between the module's
    /// init and `mtl_finalize` (or of the progress callback while it is registered),
    /// and dropped before the entry returns: finalize takes the state out of [`MTL`]
    /// before it frees it, and no entry runs after it (the PML's contract).
    #[inline(always)]
    pub unsafe fn enter() -> Entry {
        Entry(PhantomData)
    }
}

/// The running state, for the duration of the entry `e` (none before init, after
/// finalize, or once a panic marked the module failed).
#[inline]
pub(super) fn mtl(e: &Entry) -> Option<&Mtl> {
    let _ = e;
    if FAILED.load(Ordering::Relaxed) {
        return None;
    }
    let p = MTL.load(Ordering::Acquire);
    // SAFETY: MTL points to a leaked Box that finalize frees only after taking it out
    // of MTL, when no entry runs any more (`Entry::enter`'s promise); the reference
    // lives no longer than the entry `e`.
    unsafe { p.as_ref() }
}

/// The running state for the call of `f`, from the module's control entries
/// (add_procs, add_comm, the MPI_T variables), which Open MPI makes between init and
/// finalize and never at the same time as finalize (both are MPI calls it serialises
/// with MPI_Finalize). The reference cannot leave `f`.
pub(super) fn with_mtl<R>(f: impl FnOnce(Option<&Mtl>) -> R) -> R {
    // SAFETY: the reference lives only for the call of `f`, which is inside one of
    // the control entries above: between init and finalize, never during finalize.
    let e = unsafe { Entry::enter() };
    f(mtl(&e))
}

/// Take `lock` on the data path. A poisoned lock means a panic happened while it was
/// held, so its data may be half-updated: the module is marked failed (the panicking
/// entry's guard does so too, but another thread may get here first) and the caller
/// refuses with `OMPI_ERROR`. Teardown takes such locks with `common::sync::lock`
/// instead: it only drains and frees.
#[inline]
pub(crate) fn locked<T>(lock: &Mutex<T>) -> Result<MutexGuard<'_, T>, c_int> {
    lock.lock().map_err(|_| {
        FAILED.store(true, Ordering::Relaxed);
        log::error!("a lock of the MTL was poisoned by a panic: the module refuses further calls");
        ompi_sys::OMPI_ERROR
    })
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
