//! The process-wide fan-out of memory-release events.
//!
//! Open MPI's patcher (the one patcher in the process) calls [`opal_release_cb`] from
//! inside `munmap`, `madvise`, `mremap`, `shmdt` or a shrinking `brk`, on any thread,
//! possibly while that thread is inside `malloc` holding the allocator's locks.
//! [`dispatch`] forwards each event to libfabric's `import_ops->notify` (when our
//! monitor is imported, see `monitor.rs`) and to every in-process subscriber (our own
//! registration cache, for example).
//!
//! Owns: the fixed subscriber table, the libfabric notify target, the event counters.
//! Must not touch: anything that allocates, frees, locks or logs on the dispatch path.
//!
//! # Why the dispatch path is allocation- and lock-free
//!
//! Everything [`dispatch`] touches is a `static` made of atomics, created at compile
//! time: [`CAPACITY`] slots of (state word, function, context), the notify target, two
//! in-flight counters, an epoch and the counters. Dispatch does loads, `fetch_add`s and
//! indirect calls only; it has no `Vec`, no `Box`, no `Mutex`, no thread-local (a
//! thread-local of a `dlopen`ed library can be allocated lazily by `__tls_get_addr`), no
//! `log!`, and no operation that can panic: the only indexing is `in_flight[e & 1]`
//! into a two-element array, slots are walked with an iterator, and the counters use
//! `fetch_add`, which wraps instead of overflow-checking.
//!
//! # Unsubscribing while another thread dispatches
//!
//! The protocol is a two-counter epoch scheme (a tiny sleepable RCU):
//! - a dispatcher reads `epoch`, increments `in_flight[epoch & 1]`, re-reads `epoch` and
//!   retries if it changed; then it reads the slots, calls the live subscribers and
//!   decrements the same counter when done;
//! - [`unsubscribe`] marks the slot `RETIRING` (dispatchers skip it from then on), flips
//!   `epoch` and waits until the counter of the old epoch drains to zero. Any dispatcher
//!   that could still have seen the slot live registered in the old counter, so when the
//!   wait ends nobody is calling the old (function, context) pair any more and the slot
//!   can be reused. New dispatchers count in the other counter, so the wait is bounded
//!   by the dispatches in flight at the flip, not by the event rate.
//!
//! The wait happens in `unsubscribe` (and in `monitor::teardown`), never in dispatch.
//! Caveat: calling [`unsubscribe`] from inside a subscriber (i.e. from inside a
//! dispatch on the same thread) would wait for itself forever. Subscribers must not do
//! that, and must not allocate, lock, log or panic either: they run in the same context
//! as dispatch. A panic in a subscriber cannot unwind into C (the callback is
//! `extern "C"`): the process aborts.
//!
//! All counter and epoch operations that the protocol relies on are `SeqCst`; the
//! statistics are `Relaxed`.

use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use libfabric_sys as fi;

/// Number of subscriber slots. Subscribers are components of this library (the BTL's
/// registration cache, maybe an MTL cache later), not user code: eight is plenty.
pub const CAPACITY: usize = 8;

/// A subscriber: called with the released range and the context given at subscription.
/// `extern "C"` so the same type can cross the C ABI boundary when the common code is
/// built as its own shared library (see DESIGN.md, "One common state per process").
pub type Subscriber = extern "C" fn(addr: usize, len: usize, ctx: usize);

/// libfabric's `fi_ops_mem_notify::notify`.
pub type NotifyFn = unsafe extern "C" fn(*mut fi::fid_mem_monitor, *const c_void, usize);

/// Handle of one subscription. The generation makes a stale handle (from before a
/// slot was reused) harmless: unsubscribing with it does nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotId {
    index: u32,
    generation: u32,
}

impl SlotId {
    /// Pack into one integer for a C ABI.
    pub fn to_raw(self) -> u64 {
        ((self.generation as u64) << 32) | self.index as u64
    }
    /// Inverse of [`SlotId::to_raw`].
    pub fn from_raw(raw: u64) -> SlotId {
        SlotId {
            index: raw as u32,
            generation: (raw >> 32) as u32,
        }
    }
}

/// The table is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubscribeError {
    pub capacity: usize,
}

impl fmt::Display for SubscribeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "all {} memory-release subscriber slots are in use",
            self.capacity
        )
    }
}

impl std::error::Error for SubscribeError {}

/// Snapshot of the event counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReleaseStats {
    /// Release events dispatched.
    pub events: u64,
    /// Sum of the lengths of those events (wrapping).
    pub bytes: u64,
    /// Events forwarded to libfabric's `notify`.
    pub libfabric_notifies: u64,
    /// Subscriber invocations (one event with two subscribers counts two).
    pub subscriber_calls: u64,
}

impl fmt::Display for ReleaseStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} release events ({} bytes), {} forwarded to libfabric, {} subscriber calls",
            self.events, self.bytes, self.libfabric_notifies, self.subscriber_calls
        )
    }
}

// Slot state: generation in the upper 32 bits, tag in the lower bits.
const TAG_MASK: u64 = 0b11;
const EMPTY: u64 = 0;
const WRITING: u64 = 1;
const LIVE: u64 = 2;
const RETIRING: u64 = 3;

const fn state(generation: u32, tag: u64) -> u64 {
    ((generation as u64) << 32) | tag
}

struct Slot {
    state: AtomicU64,
    func: AtomicUsize,
    ctx: AtomicUsize,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            state: AtomicU64::new(EMPTY),
            func: AtomicUsize::new(0),
            ctx: AtomicUsize::new(0),
        }
    }
}

/// A release fan-out. The process uses one, [`GLOBAL`] (through the free functions of
/// this module); unit tests build their own.
pub struct Registry {
    slots: [Slot; CAPACITY],
    /// `NotifyFn` as an address; 0 when no monitor is imported.
    notify: AtomicUsize,
    monitor: AtomicPtr<fi::fid_mem_monitor>,
    epoch: AtomicU64,
    in_flight: [AtomicU64; 2],
    /// Serialises the writers (subscribe, unsubscribe, notify changes). Never taken by
    /// dispatch.
    writers: Mutex<()>,
    events: AtomicU64,
    bytes: AtomicU64,
    notifies: AtomicU64,
    subscriber_calls: AtomicU64,
}

/// Decrements the in-flight counter of the epoch a dispatcher entered.
struct ReadGuard<'a>(&'a AtomicU64);

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

impl Registry {
    /// An empty registry; `const` so that the process-wide one is a plain static.
    pub const fn new() -> Registry {
        Registry {
            slots: [
                Slot::new(),
                Slot::new(),
                Slot::new(),
                Slot::new(),
                Slot::new(),
                Slot::new(),
                Slot::new(),
                Slot::new(),
            ],
            notify: AtomicUsize::new(0),
            monitor: AtomicPtr::new(std::ptr::null_mut()),
            epoch: AtomicU64::new(0),
            in_flight: [AtomicU64::new(0), AtomicU64::new(0)],
            writers: Mutex::new(()),
            events: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            notifies: AtomicU64::new(0),
            subscriber_calls: AtomicU64::new(0),
        }
    }

    fn writers(&self) -> std::sync::MutexGuard<'_, ()> {
        // The guarded data is `()`: a poisoned lock protects nothing inconsistent.
        self.writers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Add a subscriber. Not callable from inside a dispatch (it takes the writer lock,
    /// which a thread interrupted inside `subscribe` may hold).
    pub fn subscribe(&self, func: Subscriber, ctx: usize) -> Result<SlotId, SubscribeError> {
        let _w = self.writers();
        for (index, slot) in self.slots.iter().enumerate() {
            let s = slot.state.load(Ordering::Acquire);
            if s & TAG_MASK != EMPTY {
                continue;
            }
            let generation = (s >> 32) as u32;
            if slot
                .state
                .compare_exchange(
                    s,
                    state(generation, WRITING),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_err()
            {
                continue;
            }
            slot.func.store(func as usize, Ordering::Relaxed);
            slot.ctx.store(ctx, Ordering::Relaxed);
            // Publishes func and ctx to dispatchers that load the state with Acquire.
            slot.state.store(state(generation, LIVE), Ordering::Release);
            return Ok(SlotId {
                index: index as u32,
                generation,
            });
        }
        Err(SubscribeError { capacity: CAPACITY })
    }

    /// Remove a subscriber and wait until no dispatch is still calling it. Returns
    /// false if the handle was stale (already unsubscribed). Must not be called from
    /// inside a subscriber: it would wait for its own dispatch.
    pub fn unsubscribe(&self, id: SlotId) -> bool {
        let _w = self.writers();
        let Some(slot) = self.slots.get(id.index as usize) else {
            return false;
        };
        let live = state(id.generation, LIVE);
        if slot
            .state
            .compare_exchange(
                live,
                state(id.generation, RETIRING),
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_err()
        {
            return false;
        }
        self.synchronize();
        slot.func.store(0, Ordering::Relaxed);
        slot.ctx.store(0, Ordering::Relaxed);
        slot.state.store(
            state(id.generation.wrapping_add(1), EMPTY),
            Ordering::Release,
        );
        true
    }

    /// Number of live subscribers.
    pub fn subscribers(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.state.load(Ordering::Acquire) & TAG_MASK == LIVE)
            .count()
    }

    /// Route events to libfabric's notify for `monitor` (which must stay valid until
    /// [`Registry::clear_libfabric_notify`] returns).
    pub(crate) fn set_libfabric_notify(&self, monitor: *mut fi::fid_mem_monitor, notify: NotifyFn) {
        let _w = self.writers();
        self.monitor.store(monitor, Ordering::SeqCst);
        self.notify.store(notify as usize, Ordering::SeqCst);
    }

    /// Stop routing events to libfabric and wait until no dispatch is inside notify:
    /// afterwards the monitor object may be closed.
    pub(crate) fn clear_libfabric_notify(&self) {
        let _w = self.writers();
        self.notify.store(0, Ordering::SeqCst);
        self.synchronize();
        self.monitor.store(std::ptr::null_mut(), Ordering::SeqCst);
    }

    /// Whether events currently reach libfabric.
    pub fn forwards_to_libfabric(&self) -> bool {
        self.notify.load(Ordering::Acquire) != 0
    }

    /// Flip the epoch and wait for the dispatches of the old epoch to finish. Called
    /// with the writer lock held.
    fn synchronize(&self) {
        let old = self.epoch.fetch_add(1, Ordering::SeqCst);
        let counter = &self.in_flight[(old & 1) as usize];
        let start = Instant::now();
        let mut warned = false;
        let mut spins = 0u32;
        while counter.load(Ordering::SeqCst) != 0 {
            if spins < 1000 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            if !warned && start.elapsed() > Duration::from_secs(5) {
                warned = true;
                log::warn!(
                    "memory-release unsubscribe has waited 5 s for a dispatch in flight; \
                     was it called from inside a release subscriber?"
                );
            }
        }
    }

    fn enter(&self) -> ReadGuard<'_> {
        loop {
            let e = self.epoch.load(Ordering::SeqCst);
            let counter = &self.in_flight[(e & 1) as usize];
            counter.fetch_add(1, Ordering::SeqCst);
            if self.epoch.load(Ordering::SeqCst) == e {
                return ReadGuard(counter);
            }
            // A writer flipped the epoch between our two loads: count in the new one.
            counter.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Forward one release to libfabric and to every live subscriber. Allocation-free,
    /// lock-free and panic-free; callable from inside `munmap` on any thread.
    pub fn dispatch(&self, addr: usize, len: usize) {
        self.events.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(len as u64, Ordering::Relaxed);
        let _guard = self.enter();

        let notify = self.notify.load(Ordering::SeqCst);
        if notify != 0 {
            let monitor = self.monitor.load(Ordering::SeqCst);
            // SAFETY: `notify` was stored from a `NotifyFn` by `set_libfabric_notify`
            // and is non-zero, so it is that function pointer. `monitor` is the object
            // libfabric accepted at import; `clear_libfabric_notify` zeroes `notify`
            // and waits for this guard's epoch before the monitor is closed, so both
            // stay valid for the whole call. libfabric's notify takes its own
            // mm_list_rwlock/mm_lock (as its memhooks monitor does from the same
            // context): that is libfabric's contract, not ours.
            unsafe {
                let f: NotifyFn = std::mem::transmute::<usize, NotifyFn>(notify);
                f(monitor, addr as *const c_void, len);
            }
            self.notifies.fetch_add(1, Ordering::Relaxed);
        }

        for slot in &self.slots {
            if slot.state.load(Ordering::Acquire) & TAG_MASK != LIVE {
                continue;
            }
            let func = slot.func.load(Ordering::Relaxed);
            let ctx = slot.ctx.load(Ordering::Relaxed);
            if func == 0 {
                continue;
            }
            // SAFETY: a LIVE slot's `func` was stored from a `Subscriber` before the
            // Release store of LIVE that our Acquire load observed, and it is not
            // changed until `unsubscribe` has waited for this dispatch (our guard).
            let f: Subscriber = unsafe { std::mem::transmute::<usize, Subscriber>(func) };
            f(addr, len, ctx);
            self.subscriber_calls.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Current counters.
    pub fn stats(&self) -> ReleaseStats {
        ReleaseStats {
            events: self.events.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            libfabric_notifies: self.notifies.load(Ordering::Relaxed),
            subscriber_calls: self.subscriber_calls.load(Ordering::Relaxed),
        }
    }

    /// Zero the counters (teardown, so that a fresh setup starts from zero).
    pub(crate) fn reset_stats(&self) {
        self.events.store(0, Ordering::Relaxed);
        self.bytes.store(0, Ordering::Relaxed);
        self.notifies.store(0, Ordering::Relaxed);
        self.subscriber_calls.store(0, Ordering::Relaxed);
    }
}

/// The process-wide registry fed by [`opal_release_cb`].
pub static GLOBAL: Registry = Registry::new();

/// Subscribe to every memory release of the process. See [`Registry::subscribe`].
pub fn subscribe(func: Subscriber, ctx: usize) -> Result<SlotId, SubscribeError> {
    GLOBAL.subscribe(func, ctx)
}

/// See [`Registry::unsubscribe`]. Never call it from inside a subscriber.
pub fn unsubscribe(id: SlotId) -> bool {
    GLOBAL.unsubscribe(id)
}

/// What a typed subscriber does with each release of `[addr, addr + len)`: it runs on
/// the release path (see [`Registry::dispatch`]), so it only loads and stores atomics.
pub trait Invalidate: Send + Sync + 'static {
    fn invalidate(&self, addr: usize, len: usize);
}

/// A subscription of a shared `T` to every memory release: keeps `T` alive while it
/// is subscribed, and unsubscribes when dropped (never drop it from a subscriber).
pub struct Subscription<T: Invalidate> {
    id: SlotId,
    _target: std::sync::Arc<T>,
}

/// Subscribe `target` to every memory release of the process (see [`subscribe`]).
pub fn subscribe_shared<T: Invalidate>(
    target: &std::sync::Arc<T>,
) -> Result<Subscription<T>, SubscribeError> {
    let id = subscribe(
        invalidate_shared::<T>,
        std::sync::Arc::as_ptr(target) as usize,
    )?;
    Ok(Subscription {
        id,
        _target: std::sync::Arc::clone(target),
    })
}

extern "C" fn invalidate_shared<T: Invalidate>(addr: usize, len: usize, ctx: usize) {
    // SAFETY: ctx is `Arc::as_ptr` of the T of a Subscription, which keeps it alive
    // until its Drop's unsubscribe returned, after which no dispatch calls this with it.
    let target = unsafe { &*(ctx as *const T) };
    target.invalidate(addr, len);
}

impl<T: Invalidate> Drop for Subscription<T> {
    fn drop(&mut self) {
        unsubscribe(self.id);
    }
}

/// Forward one release to libfabric and to the subscribers. See [`Registry::dispatch`].
pub fn dispatch(addr: usize, len: usize) {
    GLOBAL.dispatch(addr, len)
}

/// Counters of the process-wide registry.
pub fn stats() -> ReleaseStats {
    GLOBAL.stats()
}

/// The callback registered with `opal_mem_hooks_register_release`. Open MPI's patcher
/// calls it before the memory is released; `from_alloc` (the release comes from the
/// allocator rather than the user) does not change what must be invalidated.
pub extern "C" fn opal_release_cb(
    buf: *mut c_void,
    length: usize,
    _cbdata: *mut c_void,
    _from_alloc: bool,
) {
    GLOBAL.dispatch(buf as usize, length);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    extern "C" fn count(_addr: usize, len: usize, ctx: usize) {
        // SAFETY: every test passes the address of an AtomicU64 that outlives its
        // subscription or its use as the fake monitor (a static, or an Arc kept alive
        // until after unsubscribe).
        let c = unsafe { &*(ctx as *const AtomicU64) };
        c.fetch_add(len as u64, Ordering::SeqCst);
    }

    #[test]
    fn dispatch_reaches_subscribers_and_counts() {
        let r = Registry::new();
        static A: AtomicU64 = AtomicU64::new(0);
        static B: AtomicU64 = AtomicU64::new(0);
        let a = r.subscribe(count, &A as *const _ as usize).unwrap();
        let b = r.subscribe(count, &B as *const _ as usize).unwrap();
        assert_ne!(a, b);
        assert_eq!(r.subscribers(), 2);
        r.dispatch(0x1000, 10);
        assert_eq!(A.load(Ordering::SeqCst), 10);
        assert_eq!(B.load(Ordering::SeqCst), 10);
        assert!(r.unsubscribe(a));
        assert!(!r.unsubscribe(a), "a stale handle is refused");
        r.dispatch(0x1000, 5);
        assert_eq!(A.load(Ordering::SeqCst), 10);
        assert_eq!(B.load(Ordering::SeqCst), 15);
        let s = r.stats();
        assert_eq!(
            s,
            ReleaseStats {
                events: 2,
                bytes: 15,
                libfabric_notifies: 0,
                subscriber_calls: 3
            }
        );
        assert!(r.unsubscribe(b));
        r.reset_stats();
        assert_eq!(r.stats(), ReleaseStats::default());
    }

    #[test]
    fn capacity_and_slot_reuse_with_generations() {
        let r = Registry::new();
        static C: AtomicU64 = AtomicU64::new(0);
        let ctx = &C as *const _ as usize;
        let ids: Vec<SlotId> = (0..CAPACITY)
            .map(|_| r.subscribe(count, ctx).unwrap())
            .collect();
        assert_eq!(
            r.subscribe(count, ctx),
            Err(SubscribeError { capacity: CAPACITY })
        );
        assert!(r.unsubscribe(ids[3]));
        let again = r.subscribe(count, ctx).unwrap();
        assert_eq!(again.index, ids[3].index);
        assert_ne!(again.generation, ids[3].generation);
        assert!(
            !r.unsubscribe(ids[3]),
            "old generation must not remove the new subscriber"
        );
        assert_eq!(SlotId::from_raw(again.to_raw()), again);
        assert!(r.unsubscribe(again));
        for id in ids.iter().filter(|i| **i != ids[3]) {
            assert!(r.unsubscribe(*id));
        }
        assert_eq!(r.subscribers(), 0);
    }

    /// libfabric's `notify` as the registry calls it: the "monitor" is an AtomicU64
    /// that counts like a subscriber.
    unsafe extern "C" fn fake_notify(m: *mut fi::fid_mem_monitor, _a: *const c_void, len: usize) {
        count(0, len, m as usize);
    }

    #[test]
    fn libfabric_notify_is_routed_and_cleared() {
        let r = Registry::new();
        static N: AtomicU64 = AtomicU64::new(0);
        r.set_libfabric_notify(
            &N as *const AtomicU64 as *mut fi::fid_mem_monitor,
            fake_notify,
        );
        assert!(r.forwards_to_libfabric());
        r.dispatch(0, 7);
        r.clear_libfabric_notify();
        assert!(!r.forwards_to_libfabric());
        r.dispatch(0, 7);
        assert_eq!(N.load(Ordering::SeqCst), 7);
        assert_eq!(r.stats().libfabric_notifies, 1);
        assert_eq!(r.stats().events, 2);
    }

    /// After `unsubscribe` returns, the subscriber is never called again, even with
    /// dispatchers running flat out on other threads; the context can then be freed.
    #[test]
    fn unsubscribe_is_safe_against_concurrent_dispatch() {
        let r = Arc::new(Registry::new());
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let r = r.clone();
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        r.dispatch(0x2000, 1);
                    }
                })
            })
            .collect();
        for _ in 0..200 {
            let counter = Arc::new(AtomicU64::new(0));
            let id = r.subscribe(count, Arc::as_ptr(&counter) as usize).unwrap();
            while counter.load(Ordering::SeqCst) == 0 {
                std::hint::spin_loop();
            }
            assert!(r.unsubscribe(id));
            let after = counter.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_micros(50));
            assert_eq!(
                counter.load(Ordering::SeqCst),
                after,
                "called after unsubscribe"
            );
            // Dropping the context here is the point of the protocol.
            drop(counter);
        }
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
    }
}
