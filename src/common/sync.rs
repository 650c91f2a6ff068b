//! Locks for the data path that cost nothing when MPI runs without threads.
//!
//! Below `MPI_THREAD_MULTIPLE` only one thread is inside MPI at a time, so the BTL and
//! the MTL skip the locked instructions a mutex or an atomic swap would execute on
//! every poll (on this machine's cores they were the largest part of an empty poll of
//! ours, measured with `perf annotate`).

use crate::fabric::{Domain, Serialized};
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Take `m`, also when a panic poisoned it; the one lock helper of the crate for the
/// paths that may take a poisoned value. Every extern "C" entry runs under `ffi_guard`,
/// so a panic ends the call it happened in, and the data behind the mutex stays as that
/// call left it: each std collection keeps its own invariants through a panic, only
/// the relations between them may be half-updated. So this is for what does not rely
/// on those relations: component registration, teardown (which only drains and frees
/// what the collections hold), and collections that no code panics inside (pushes and
/// takes). A data path whose module marks itself failed after a panic refuses
/// instead (`mtl::state::locked`).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether several threads may be inside the component at once. "One at a time" is a
/// promise only `unsafe` code can make ([`Threads::of`]), because the locks below skip
/// their mutex on it: Open MPI makes it at component init (`enable_mpi_threads` false
/// below `MPI_THREAD_MULTIPLE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Threads {
    multiple: bool,
}

impl Threads {
    /// Several threads may call in at once: every lock is taken.
    pub const MULTIPLE: Threads = Threads { multiple: true };

    /// # Safety
    /// With `multiple` false: for as long as any lock built with the result lives, at
    /// most one thread at a time calls into the component (Open MPI's promise when it
    /// passes `enable_mpi_threads` false to the component's init).
    pub const unsafe fn of(multiple: bool) -> Threads {
        Threads { multiple }
    }

    /// May several threads call in at once?
    #[inline(always)]
    pub fn multiple(self) -> bool {
        self.multiple
    }
}

/// A mutex that is taken only when it must be (libfabric calls below
/// `FI_THREAD_SAFE` with MPI threads). Its guard is the [`Serialized`] proof that the
/// fabric's data-path calls take.
pub struct MaybeLock {
    enabled: bool,
    m: Mutex<()>,
}

/// Holds a [`MaybeLock`] until dropped.
pub struct MaybeLockGuard<'a> {
    _g: Option<MutexGuard<'a, ()>>,
}

impl MaybeLock {
    /// A lock taken whenever several threads may be inside MPI (whatever the provider's
    /// threading level).
    pub fn new(threads: Threads) -> Self {
        MaybeLock {
            enabled: threads.multiple(),
            m: Mutex::new(()),
        }
    }

    /// A lock for the libfabric calls on `domain`: taken with several threads, unless
    /// the domain is `FI_THREAD_SAFE`.
    pub fn for_domain(threads: Threads, domain: &Domain) -> Self {
        MaybeLock {
            enabled: threads.multiple() && domain.threading() != libfabric_sys::FI_THREAD_SAFE,
            m: Mutex::new(()),
        }
    }

    /// The mutex guards no data (only the order of libfabric calls), so a panic
    /// while it was held leaves nothing half-updated: a poisoned lock is taken.
    #[inline]
    pub fn lock(&self) -> MaybeLockGuard<'_> {
        MaybeLockGuard {
            _g: self.enabled.then(|| lock(&self.m)),
        }
    }
}

impl MaybeLockGuard<'_> {
    /// The proof the fabric's data-path calls take, for the domain this lock serialises.
    #[inline(always)]
    pub fn serialized(&self) -> Serialized<'_> {
        // SAFETY: while the guard lives, either the mutex is held, or the lock was built
        // without it from `Threads` (one thread at a time, `Threads::of`'s promise) or
        // for an FI_THREAD_SAFE domain; the proof borrows the guard.
        unsafe { Serialized::assume() }
    }
}

/// Data behind a mutex that is taken only with MPI threads. Without them one thread at
/// a time is inside MPI ([`Threads`]), and the code never holds two guards of one
/// `MaybeMutex` (it would deadlock on a real mutex), so the guard alone gives exclusive
/// access; debug builds check that no second guard is taken.
pub struct MaybeMutex<T> {
    enabled: bool,
    m: Mutex<()>,
    held: AtomicBool,
    v: UnsafeCell<T>,
}

// SAFETY: access to `v` goes through a guard: under the mutex with several threads, and
// by the one thread inside the component without them (the promise `Threads::of` holds
// its caller to).
unsafe impl<T: Send> Sync for MaybeMutex<T> {}

/// Exclusive access to a [`MaybeMutex`]'s data until dropped.
pub struct MaybeMutexGuard<'a, T> {
    owner: &'a MaybeMutex<T>,
    _g: Option<MutexGuard<'a, ()>>,
}

impl<T> MaybeMutex<T> {
    pub fn new(v: T, threads: Threads) -> Self {
        MaybeMutex {
            enabled: threads.multiple(),
            m: Mutex::new(()),
            held: AtomicBool::new(false),
            v: UnsafeCell::new(v),
        }
    }

    /// A panic while a guard was held may have left the data half-updated. The mutex is
    /// then taken anyway: without threads there is no mutex to be poisoned, so this
    /// only arises with several threads, after the panicking entry's module was marked
    /// failed (the MTL's `ffi_guard_module`), where a call already inside finishes on
    /// the lists as the panic left them (each std collection whole, see [`lock`]).
    #[inline]
    pub fn lock(&self) -> MaybeMutexGuard<'_, T> {
        let g = self.enabled.then(|| lock(&self.m));
        debug_assert!(
            !self.held.load(Ordering::Relaxed),
            "MaybeMutex locked twice at once"
        );
        if cfg!(debug_assertions) {
            self.held.store(true, Ordering::Relaxed);
        }
        MaybeMutexGuard { owner: self, _g: g }
    }
}

impl<T> Deref for MaybeMutexGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: the guard gives exclusive access: the mutex is held, or one thread at
        // a time is inside the component and it holds no other guard (see MaybeMutex).
        unsafe { &*self.owner.v.get() }
    }
}

impl<T> DerefMut for MaybeMutexGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard gives exclusive access: the mutex is held, or one thread at
        // a time is inside the component and it holds no other guard (see MaybeMutex).
        unsafe { &mut *self.owner.v.get() }
    }
}

impl<T> Drop for MaybeMutexGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        if cfg!(debug_assertions) {
            self.owner.held.store(false, Ordering::Relaxed);
        }
    }
}

/// One caller at a time in a section that must not be re-entered (draining a
/// completion queue in order): a re-entrant call from a callback, or a second thread,
/// is turned away rather than made to wait.
pub struct Serial {
    busy: AtomicBool,
    threads: bool,
}

/// Holds a [`Serial`] until dropped.
pub struct SerialGuard<'a>(&'a Serial);

impl Serial {
    /// `threads`: several threads may call [`Serial::try_enter`] at once.
    pub const fn new(threads: bool) -> Self {
        Serial {
            busy: AtomicBool::new(false),
            threads,
        }
    }

    /// Enter, or `None` when the section is already occupied.
    #[inline]
    pub fn try_enter(&self) -> Option<SerialGuard<'_>> {
        if self.busy.load(Ordering::Relaxed) {
            return None;
        }
        if self.threads {
            if self.busy.swap(true, Ordering::Acquire) {
                return None;
            }
        } else {
            // One thread in MPI at a time: a plain store claims it.
            self.busy.store(true, Ordering::Relaxed);
        }
        Some(SerialGuard(self))
    }
}

impl SerialGuard<'_> {
    /// Is this the guard of `s`?
    #[inline(always)]
    pub fn is_of(&self, s: &Serial) -> bool {
        std::ptr::eq(self.0, s)
    }
}

impl Drop for SerialGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

/// Receive buffers the provider refused to take back (an error other than
/// `-FI_EAGAIN` when one is posted again after its completion), kept for progress to
/// post again rather than lost: a component that loses them all stops receiving.
/// Progress checks [`Unposted::any`] (one relaxed load) and calls [`Unposted::retry`],
/// which tries at most once per [`Unposted::INTERVAL`], so a provider that keeps
/// refusing costs neither a busy loop nor a log line per poll.
pub struct Unposted<T> {
    bufs: Mutex<Vec<T>>,
    /// Mirrors `!bufs.is_empty()`; only written with `bufs` locked.
    waiting: AtomicBool,
    /// When the next retry may run.
    next: Mutex<Option<std::time::Instant>>,
    /// Buffers refused so far.
    refused: std::sync::atomic::AtomicU64,
}

impl<T> Default for Unposted<T> {
    fn default() -> Self {
        Unposted {
            bufs: Mutex::new(Vec::new()),
            waiting: AtomicBool::new(false),
            next: Mutex::new(None),
            refused: Default::default(),
        }
    }
}

impl<T> Unposted<T> {
    /// The least time between two retries.
    pub const INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

    /// Keep `buf` for a later retry. Returns how many buffers were refused so far when
    /// that is worth a log line (the 1st, 2nd, 4th, 8th...), so that a provider that
    /// keeps refusing does not flood the log.
    pub fn push(&self, buf: T) -> Option<u64> {
        // Only pushes and takes happen under `bufs`: a poisoned Vec is whole (`lock`).
        let mut b = lock(&self.bufs);
        b.push(buf);
        self.waiting.store(true, Ordering::Release);
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        n.is_power_of_two().then_some(n)
    }

    /// Whether buffers wait.
    #[inline]
    pub fn any(&self) -> bool {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Unless the last retry was less than [`Unposted::INTERVAL`] ago (or another
    /// thread is retrying), hand each waiting buffer to `post`, which says whether it
    /// was posted; those it was not wait for the next retry. Returns how many were
    /// posted and whether none waits any more.
    pub fn retry(&self, mut post: impl FnMut(&T) -> bool) -> (usize, bool) {
        let now = std::time::Instant::now();
        {
            let Ok(mut next) = self.next.try_lock() else {
                return (0, false);
            };
            if next.is_some_and(|t| now < t) {
                return (0, false);
            }
            *next = Some(now + Self::INTERVAL);
        }
        let mut taken = std::mem::take(&mut *lock(&self.bufs));
        let before = taken.len();
        taken.retain(|b| !post(b));
        let posted = before - taken.len();
        let mut b = lock(&self.bufs);
        b.append(&mut taken);
        self.waiting.store(!b.is_empty(), Ordering::Release);
        (posted, b.is_empty())
    }
}

/// Test hook for [`Unposted`]: with `OMPI_OFI_TEST_REFUSE_REPOST=K` (K >= 1) in the
/// environment, every K-th time a receive buffer is posted again after a completion
/// the components act as if the provider had refused it with `-FI_EIO`, without
/// asking it. No provider here refuses a receive, so this is how the tests show that
/// such a buffer comes back (`scripts/test-param-paths`).
pub fn refuse_repost() -> bool {
    use std::sync::atomic::AtomicU64;
    static EVERY: AtomicU64 = AtomicU64::new(u64::MAX);
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut k = EVERY.load(Ordering::Relaxed);
    if k == u64::MAX {
        k = std::env::var("OMPI_OFI_TEST_REFUSE_REPOST")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        if EVERY.swap(k, Ordering::Relaxed) == u64::MAX && k > 0 {
            log::warn!(
                "OMPI_OFI_TEST_REFUSE_REPOST={k} (test hook): one receive buffer in {k} \
                 posted again is refused as by the provider"
            );
        }
    }
    k > 0 && (COUNT.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unposted_retries_no_more_often_than_its_interval() {
        let u = Unposted::<u32>::default();
        assert!(!u.any());
        assert_eq!(u.push(1), Some(1));
        assert_eq!(u.push(2), Some(2));
        assert!(u.any());
        // The first retry runs at once; buffer 2 is refused again.
        assert_eq!(u.retry(|&b| b == 1), (1, false));
        assert!(u.any());
        // Too soon: nothing is tried.
        let mut tried = 0;
        assert_eq!(
            u.retry(|_| {
                tried += 1;
                true
            }),
            (0, false)
        );
        assert_eq!(tried, 0);
        std::thread::sleep(Unposted::<u32>::INTERVAL + std::time::Duration::from_millis(2));
        assert_eq!(u.retry(|&b| b == 2), (1, true));
        assert!(!u.any());
        // Refusals 3, 4 and 5: only the 4th is logged (1st, 2nd, 4th, 8th...).
        assert_eq!(u.push(3), None);
        assert_eq!(u.push(4), Some(4));
        assert_eq!(u.push(5), None);
    }

    #[test]
    fn serial_turns_away_reentry_and_reopens() {
        for threads in [false, true] {
            let s = Serial::new(threads);
            let g = s.try_enter().expect("first entry");
            assert!(s.try_enter().is_none(), "re-entry must be refused");
            drop(g);
            assert!(s.try_enter().is_some(), "free again after the guard");
        }
    }

    #[test]
    fn serial_admits_one_thread_at_a_time() {
        use std::sync::atomic::AtomicUsize;
        let s = Serial::new(true);
        let inside = AtomicUsize::new(0);
        let max = AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    for _ in 0..20_000 {
                        if let Some(_g) = s.try_enter() {
                            let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                            max.fetch_max(n, Ordering::SeqCst);
                            inside.fetch_sub(1, Ordering::SeqCst);
                        }
                    }
                });
            }
        });
        assert_eq!(max.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn maybe_mutex_serialises_threads() {
        let m = MaybeMutex::new(0u64, Threads::MULTIPLE);
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    for _ in 0..10_000 {
                        *m.lock() += 1;
                    }
                });
            }
        });
        assert_eq!(*m.lock(), 40_000);
        // SAFETY: this test's one thread is the only one that touches `single`.
        let single = MaybeMutex::new(vec![1], unsafe { Threads::of(false) });
        single.lock().push(2);
        assert_eq!(*single.lock(), vec![1, 2]);
    }

    #[test]
    fn maybe_lock_only_when_enabled() {
        // SAFETY: this test's one thread is the only one that takes the lock.
        let single = MaybeLock::new(unsafe { Threads::of(false) });
        assert!(single.lock()._g.is_none());
        assert!(MaybeLock::new(Threads::MULTIPLE).lock()._g.is_some());
    }
}
