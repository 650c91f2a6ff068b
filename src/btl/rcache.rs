//! The BTL's registration cache: memory registrations keyed by address range, bounded
//! by count and bytes, reused for covered requests, and invalidated by every memory
//! release that reaches the common release callback.
//!
//! What it owns: the entries (each holding its registration object `R`, a
//! `MemoryRegion` in the BTL) and a fixed table of [`Slot`]s that mirrors the address
//! range of every cached entry for the release callback. What it must not touch:
//! libfabric itself (the caller passes a `register` closure) and the release fan-out
//! (it only subscribes to it).
//!
//! # The release path
//!
//! [`Slots::invalidate`] runs inside `munmap` (or `free`, `madvise`, ...) on any thread,
//! possibly while that thread holds the allocator's locks or our own cache mutex. It
//! therefore only loads and compare-exchanges atomics in a table allocated once at
//! setup: no allocation, no lock, no logging. It marks the overlapping slots
//! `INVALID` and raises `dirty`; the entries are closed later by [`Cache::sweep`] from
//! a normal context (registration, deregistration, progress). An invalid entry is never
//! returned by a lookup again; if it is still in use, it is closed when its last user
//! deregisters it.
//!
//! Each slot word is `generation << 2 | state` (a sequence lock): the owner writes the
//! range only while the slot is `FREE`, then publishes `VALID` with a new generation;
//! the callback reads the word, the range, and the word again, and acts only if the
//! word did not change in between.

use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

const FREE: u64 = 0;
const VALID: u64 = 1;
const INVALID: u64 = 2;
const STATE: u64 = 3;

/// One published range. See the module docs for the protocol.
#[derive(Default)]
pub struct Slot {
    word: AtomicU64,
    base: AtomicUsize,
    end: AtomicUsize,
}

/// The table the release callback scans, shared with it through an `Arc`
/// (`common::release::subscribe_shared`).
pub struct Slots {
    slots: Box<[Slot]>,
    /// One past the highest slot ever published (bounds the callback's scan).
    high: AtomicUsize,
    /// Some slot was invalidated since the last sweep.
    dirty: AtomicBool,
    invalidations: AtomicU64,
}

impl Slots {
    pub fn new(capacity: usize) -> Slots {
        Slots {
            slots: (0..capacity).map(|_| Slot::default()).collect(),
            high: AtomicUsize::new(0),
            dirty: AtomicBool::new(false),
            invalidations: AtomicU64::new(0),
        }
    }

    /// Was some slot invalidated since the last sweep? (A hint: read without a lock.)
    #[inline]
    pub fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::Relaxed)
    }

    /// Mark every valid slot overlapping `[addr, addr + len)` invalid. Lock-free,
    /// allocation-free and panic-free: callable from inside `munmap`.
    pub fn invalidate(&self, addr: usize, len: usize) {
        let end = addr.saturating_add(len);
        let high = self.high.load(Ordering::Acquire).min(self.slots.len());
        for slot in self.slots.iter().take(high) {
            let w = slot.word.load(Ordering::Acquire);
            if w & STATE != VALID {
                continue;
            }
            let b = slot.base.load(Ordering::Relaxed);
            let e = slot.end.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if slot.word.load(Ordering::Relaxed) != w {
                continue;
            }
            if b < end
                && addr < e
                && slot
                    .word
                    .compare_exchange(
                        w,
                        (w & !STATE) | INVALID,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                self.invalidations.fetch_add(1, Ordering::Relaxed);
                self.dirty.store(true, Ordering::Release);
            }
        }
    }

    fn publish(&self, i: usize, base: usize, end: usize) {
        let s = &self.slots[i];
        let w = s.word.load(Ordering::Relaxed);
        debug_assert_eq!(w & STATE, FREE);
        s.base.store(base, Ordering::Relaxed);
        s.end.store(end, Ordering::Relaxed);
        s.word.store(((w >> 2) + 1) << 2 | VALID, Ordering::Release);
        self.high.fetch_max(i + 1, Ordering::AcqRel);
    }

    fn release(&self, i: usize) {
        let s = &self.slots[i];
        let w = s.word.load(Ordering::Relaxed);
        s.word.store(w & !STATE, Ordering::Release);
    }

    fn is_valid(&self, i: usize) -> bool {
        self.slots[i].word.load(Ordering::Acquire) & STATE == VALID
    }

    pub fn invalidations(&self) -> u64 {
        self.invalidations.load(Ordering::Relaxed)
    }
}

impl crate::common::release::Invalidate for Slots {
    fn invalidate(&self, addr: usize, len: usize) {
        Slots::invalidate(self, addr, len);
    }
}

/// Counters of the cache, for the close-time report and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub hits: u64,
    pub misses: u64,
    pub invalidations: u64,
    pub evictions: u64,
    /// Registrations made outside the cache (caching off, table full, no release events).
    pub uncached: u64,
    pub live_entries: u64,
    pub live_bytes: u64,
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "hits {} misses {} invalidations {} evictions {} uncached {} live entries {} live bytes {}",
            self.hits, self.misses, self.invalidations, self.evictions, self.uncached, self.live_entries, self.live_bytes
        )
    }
}

/// An entry handed out by [`Cache::acquire`]; give it back with [`Cache::release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ticket {
    /// Index of a cached entry.
    Cached(usize),
    /// Not cached: the caller owns the registration and drops it when done.
    Uncached,
}

struct Entry<R> {
    base: usize,
    end: usize,
    access: u64,
    refs: usize,
    last_use: u64,
    reg: R,
}

/// The cache proper. Not thread-safe by itself: the BTL keeps it in a mutex, which the
/// release callback never takes.
pub struct Cache<R> {
    slots: Arc<Slots>,
    entries: Vec<Option<Entry<R>>>,
    max_bytes: u64,
    enabled: bool,
    tick: u64,
    stats: Stats,
}

/// What [`Cache::acquire`] returns: the registration (shared with the cache, or owned)
/// and the ticket to release it with.
pub enum Acquired<'a, R> {
    Cached(usize, &'a R),
    Uncached(R),
}

impl<R> Cache<R> {
    /// A cache of at most `max_entries` entries and `max_bytes` bytes (0: unbounded).
    /// With `enabled` false (no release events, or `max_entries` 0) nothing is cached.
    pub fn new(max_entries: usize, max_bytes: u64, enabled: bool) -> Cache<R> {
        let cap = if enabled { max_entries } else { 0 };
        Cache {
            slots: Arc::new(Slots::new(cap)),
            entries: (0..cap).map(|_| None).collect(),
            max_bytes,
            enabled: enabled && cap > 0,
            tick: 0,
            stats: Stats::default(),
        }
    }

    /// The table to subscribe to memory releases.
    pub fn slots(&self) -> &Arc<Slots> {
        &self.slots
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Find a valid entry covering `[base, base + len)` with at least `access`, or
    /// register one with `register(page_base, page_len)`. Entries are page-aligned.
    pub fn acquire<E>(
        &mut self,
        base: usize,
        len: usize,
        access: u64,
        register: impl FnOnce(usize, usize) -> Result<R, E>,
    ) -> Result<Acquired<'_, R>, E> {
        self.sweep();
        self.tick += 1;
        let end = base.saturating_add(len.max(1));
        let hit = self.entries.iter().enumerate().find_map(|(i, e)| {
            let e = e.as_ref()?;
            (e.base <= base
                && end <= e.end
                && e.access & access == access
                && self.slots.is_valid(i))
            .then_some(i)
        });
        if let Some(i) = hit {
            self.stats.hits += 1;
            let tick = self.tick;
            let e = self.entries[i].as_mut().expect("hit entry");
            e.refs += 1;
            e.last_use = tick;
            return Ok(Acquired::Cached(i, &e.reg));
        }
        self.stats.misses += 1;
        let page = page_size();
        let pbase = base & !(page - 1);
        let pend = end.div_ceil(page).saturating_mul(page);
        let plen = pend - pbase;
        if !self.enabled || self.make_room(plen as u64).is_none() {
            self.stats.uncached += 1;
            return Ok(Acquired::Uncached(register(base, len)?));
        }
        let reg = register(pbase, plen)?;
        let i = self.make_room(plen as u64).expect("room was made above");
        self.slots.publish(i, pbase, pend);
        self.entries[i] = Some(Entry {
            base: pbase,
            end: pend,
            access,
            refs: 1,
            last_use: self.tick,
            reg,
        });
        self.stats.live_entries += 1;
        self.stats.live_bytes += plen as u64;
        let e = self.entries[i].as_ref().expect("just inserted");
        Ok(Acquired::Cached(i, &e.reg))
    }

    /// The registration of a valid entry covering `[base, base + len)`, without
    /// taking a reference (the caller only reads what a peer needs to reach it).
    pub fn find(&self, base: usize, len: usize) -> Option<&R> {
        let end = base.saturating_add(len.max(1));
        self.entries.iter().enumerate().find_map(|(i, e)| {
            let e = e.as_ref()?;
            (e.base <= base && end <= e.end && self.slots.is_valid(i)).then_some(&e.reg)
        })
    }

    /// A free slot index, evicting unused entries (least recently used first) until
    /// the count and byte bounds allow `bytes` more. `None` if it cannot.
    fn make_room(&mut self, bytes: u64) -> Option<usize> {
        loop {
            let over_bytes = self.max_bytes > 0 && self.stats.live_bytes + bytes > self.max_bytes;
            let free = self.entries.iter().position(|e| e.is_none());
            if let (Some(i), false) = (free, over_bytes) {
                return Some(i);
            }
            if self.max_bytes > 0 && bytes > self.max_bytes {
                return None;
            }
            let victim = self
                .entries
                .iter()
                .enumerate()
                .filter_map(|(i, e)| e.as_ref().filter(|e| e.refs == 0).map(|e| (e.last_use, i)))
                .min()?;
            self.remove(victim.1);
            self.stats.evictions += 1;
        }
    }

    fn remove(&mut self, i: usize) -> Option<R> {
        let e = self.entries[i].take()?;
        self.slots.release(i);
        self.stats.live_entries -= 1;
        self.stats.live_bytes -= (e.end - e.base) as u64;
        Some(e.reg)
    }

    /// Give back an entry from [`Cache::acquire`]. Returns the registration when it
    /// must be closed now (it was invalidated and this was its last user).
    pub fn release(&mut self, i: usize) -> Option<R> {
        let e = self.entries.get_mut(i)?.as_mut()?;
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 && !self.slots.is_valid(i) {
            return self.remove(i);
        }
        None
    }

    /// Drop every unused invalidated entry (normal context only).
    pub fn sweep(&mut self) {
        // A plain load first: progress calls this on every poll, and the swap's locked
        // instruction is not free.
        if !self.slots.is_dirty() || !self.slots.dirty.swap(false, Ordering::AcqRel) {
            return;
        }
        for i in 0..self.entries.len() {
            if self.entries[i].as_ref().is_some_and(|e| e.refs == 0) && !self.slots.is_valid(i) {
                drop(self.remove(i));
            }
        }
    }

    /// Is the entry still valid (not invalidated by a release)?
    pub fn is_valid(&self, i: usize) -> bool {
        self.entries.get(i).is_some_and(|e| e.is_some()) && self.slots.is_valid(i)
    }

    pub fn stats(&self) -> Stats {
        Stats {
            invalidations: self.slots.invalidations(),
            ..self.stats
        }
    }

    /// Remove everything (at finalize); entries still in use are dropped too.
    pub fn clear(&mut self) {
        for i in 0..self.entries.len() {
            drop(self.remove(i));
        }
    }
}

fn page_size() -> usize {
    let p = crate::common::patch_check::page_size();
    if p.is_power_of_two() {
        p
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(
        c: &mut Cache<(usize, usize)>,
        base: usize,
        len: usize,
    ) -> (Option<usize>, (usize, usize)) {
        match c.acquire(base, len, 1, |b, l| Ok::<_, ()>((b, l))).unwrap() {
            Acquired::Cached(i, r) => (Some(i), *r),
            Acquired::Uncached(r) => (None, r),
        }
    }

    #[test]
    fn hit_miss_and_cover() {
        let mut c = Cache::new(4, 0, true);
        let (i, r) = reg(&mut c, 0x10010, 100);
        assert_eq!(r, (0x10000, 0x1000));
        let (j, _) = reg(&mut c, 0x10100, 200);
        assert_eq!(i, j);
        assert_eq!(c.stats().hits, 1);
        assert_eq!(c.stats().misses, 1);
        c.release(i.unwrap());
        c.release(i.unwrap());
        assert_eq!(c.stats().live_entries, 1);
    }

    #[test]
    fn find_returns_valid_covering_entries_only() {
        let mut c = Cache::new(4, 0, true);
        reg(&mut c, 0x50010, 100);
        reg(&mut c, 0x52000, 8192);
        assert_eq!(c.find(0x50ff0, 16), Some(&(0x50000, 0x1000)));
        assert_eq!(c.find(0x53ff8, 8), Some(&(0x52000, 0x2000)));
        // Straddles the end of the first entry; between the two; past the second.
        assert_eq!(c.find(0x50ff8, 16), None);
        assert_eq!(c.find(0x51000, 8), None);
        assert_eq!(c.find(0x54000, 1), None);
        c.slots().invalidate(0x52000, 1);
        assert_eq!(c.find(0x53ff8, 8), None);
        assert_eq!(
            c.stats().hits,
            0,
            "find takes no reference and counts nothing"
        );
    }

    #[test]
    fn release_invalidates_and_reregisters() {
        let mut c = Cache::new(4, 0, true);
        let (i, _) = reg(&mut c, 0x20000, 4096);
        assert!(c.release(i.unwrap()).is_none());
        c.slots().invalidate(0x20800, 16);
        assert_eq!(c.stats().invalidations, 1);
        let (j, _) = reg(&mut c, 0x20000, 4096);
        assert!(j.is_some());
        assert_eq!(c.stats().misses, 2);
        assert_eq!(c.stats().hits, 0);
        assert_eq!(c.stats().live_entries, 1);
    }

    #[test]
    fn in_use_entry_is_not_reused_after_invalidation() {
        let mut c = Cache::new(4, 0, true);
        let (i, _) = reg(&mut c, 0x30000, 4096);
        c.slots().invalidate(0x30000, 1);
        let (j, _) = reg(&mut c, 0x30000, 4096);
        assert_ne!(i, j);
        // the old user releases: closed now
        assert!(c.release(i.unwrap()).is_some());
        assert_eq!(c.stats().live_entries, 1);
    }

    #[test]
    fn eviction_by_count_and_bytes() {
        let mut c = Cache::new(2, 0, true);
        for k in 0..3 {
            let (i, _) = reg(&mut c, 0x100000 * (k + 1), 10);
            c.release(i.unwrap());
        }
        assert_eq!(c.stats().evictions, 1);
        assert_eq!(c.stats().live_entries, 2);
        let mut c = Cache::new(8, 8192, true);
        let (a, _) = reg(&mut c, 0x100000, 4096);
        let (_b, _) = reg(&mut c, 0x200000, 4096);
        // both in use: a third cannot be cached
        let (x, _) = reg(&mut c, 0x300000, 4096);
        assert!(x.is_none());
        c.release(a.unwrap());
        let (y, _) = reg(&mut c, 0x300000, 4096);
        assert!(y.is_some());
        assert_eq!(c.stats().evictions, 1);
    }

    #[test]
    fn disabled_never_caches() {
        let mut c = Cache::new(16, 0, false);
        let (i, _) = reg(&mut c, 0x1000, 10);
        let (j, _) = reg(&mut c, 0x1000, 10);
        assert!(i.is_none() && j.is_none());
        assert_eq!(c.stats().uncached, 2);
    }
}
