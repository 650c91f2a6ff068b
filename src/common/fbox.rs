//! Fast boxes: messages up to an eager limit between ranks of one node through
//! shared-memory rings, beside the shm provider (as `btl/vader`'s fast boxes beside
//! its FIFO). The BTL sends its active messages through them (`btl::am`), and the
//! MTL's software matching its messages (`mtl::softmatch`).
//!
//! Why: libfabric's shm cannot come near `btl/vader` for small messages. shm's own
//! inject and completion path alone takes 1.6 to 2.2 times vader's whole ping-pong
//! (bench/RESULTS.md, "ob1 over our BTL on shm: fast boxes"). A message that fits a box
//! costs a copy into the peer's ring and a copy out, with no provider call on either
//! side.
//!
//! Layout: every user on shm creates one segment (a `memfd`, so a killed job leaves
//! nothing in `/dev/shm`), with one ring per possible sender on the node, and
//! publishes `(pid, fd, cookie)` in the modex. A peer opens it through
//! `/proc/<pid>/fd/<fd>`, claims a ring (its own local rank's first) by writing its pid
//! into the ring's owner word, and from then on is the only process writing that ring.
//! Each ring is single-producer, single-consumer:
//!
//! ```text
//! ring: [owner u64][head u64] ... | [tail u64] ... | data: cap bytes
//!        line 0: the sender's       line 1: the receiver's
//! ```
//!
//! A record is an 8-byte header `[len u32][tag u8][kind u8][magic u16]` and the
//! payload, padded to 8 bytes. The sender writes the payload, zeroes the header word
//! that follows the record, then stores the header with release order; the receiver
//! polls the header word at its tail with acquire order. So the word at the receiver's
//! tail is always either 0 or a complete record, and no lap counter is needed. A
//! record that would cross the end is preceded by a wrap record that sends the
//! receiver to offset 0. The sender reads the receiver's tail only when its last view
//! of it leaves too little room.
//!
//! Order: a ring delivers in the order records were committed. A user that also sends
//! to the same peer through the provider must keep every message that carries
//! matching order on one path (the BTL: every fragment up to the eager limit goes
//! through the box, waiting in order when the ring is full, `btl::am::send::fbox_send`; the
//! MTL: every message of software matching but its FIN and ACK, which carry no order).
//! For the BTL, mixing paths was tried first: ob1 then sees many fragments out of
//! sequence. Under `MPI_THREAD_MULTIPLE`, threads sharing a communicator put fragments
//! out of sequence whatever the path; ob1 puts them back in order. (Receives completed
//! with no message or the wrong one there, in `mpi_tests/fbox.c`, came from the test's
//! `MPI_T_init_thread(MPI_THREAD_SINGLE)`, which drops Open MPI 4.1.4's own thread
//! level, so that ob1's blocking `MPI_Recv` shared one request among threads:
//! `btl/vader` did the same; docs/testing.md, "Open MPI 4.1.4's own layers".)
//!
//! What it owns: the segments and the rings' protocol. What it must not touch: the
//! provider, the dispatch of what arrives (the caller's closure).

use std::ffi::CString;
use std::io;
use std::os::raw::c_void;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

const LINE: usize = 64;
/// Bytes before the first ring: the segment header.
const SEG_HDR: usize = LINE;
/// Bytes of a ring before its data: the sender's line, the receiver's line.
const RING_CTRL: usize = 2 * LINE;
const SEG_MAGIC: u64 = 0x6f66_6962_6f78_0001; // "ofibox", version 1
const REC_MAGIC: u64 = 0xFB5A;
const KIND_MSG: u64 = 1;
const KIND_WRAP: u64 = 2;
/// Bytes of a record's header.
pub const REC_HDR: usize = 8;
/// Bytes of the modex record: pid, fd, cookie, segment length, rings, ring capacity,
/// largest payload.
pub const RECORD_LEN: usize = 4 + 4 + 8 + 8 + 4 + 4 + 4;

#[inline]
fn rec_len(payload: usize) -> usize {
    REC_HDR + payload.div_ceil(8) * 8
}

#[inline]
fn header(len: usize, tag: u8, kind: u64) -> u64 {
    len as u64 | (tag as u64) << 32 | kind << 40 | REC_MAGIC << 48
}

/// The sizes of a segment's rings, from a `*_ofi_fbox_size` parameter and the eager
/// limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    /// Data bytes of each ring (a multiple of 64).
    pub cap: usize,
    /// The largest payload a record carries (the user's eager limit).
    pub max: usize,
}

impl Sizes {
    /// The largest payload rings of `cap` bytes carry: two records of it fit with a
    /// wrap's waste and the header words after them.
    pub fn max_for(cap: usize) -> usize {
        (cap / 4).saturating_sub(2 * REC_HDR) / 8 * 8
    }

    /// The sizes from parameter `param` (`btl_ofi_fbox_size`, `mtl_ofi_fbox_size`) of
    /// value `size` for records of up to `max` bytes (the user's eager limit): `None`
    /// when `size` is 0 (fast boxes off); a ring too small for `max` grown to fit it
    /// (logged); a size outside 4096 to 16 MiB refused.
    pub fn new(param: &str, size: u64, max: usize) -> Result<Option<Sizes>, String> {
        if size == 0 {
            return Ok(None);
        }
        if !(4096..=1 << 24).contains(&size) {
            return Err(format!(
                "{param}={size}: expected 0 (off) or 4096 to 16 MiB"
            ));
        }
        let max = max.max(1);
        let mut cap = size as usize / 64 * 64;
        if Sizes::max_for(cap) < max {
            let need = (4 * (max.div_ceil(8) * 8 + 2 * REC_HDR)).div_ceil(64) * 64;
            log::info!(
                "{param}={size} cannot hold messages of {max} B (the eager limit): \
                 fast boxes of {need} B"
            );
            cap = need;
        }
        Ok(Some(Sizes { cap, max }))
    }

    /// Sizes a peer published are what [`Sizes::new`] makes.
    fn valid(cap: usize, max: usize) -> bool {
        (4096..=1 << 30).contains(&cap)
            && cap.is_multiple_of(64)
            && (1..=Sizes::max_for(cap)).contains(&max)
    }
}

/// A mapping of a segment, unmapped on drop.
struct Map {
    base: *mut u8,
    len: usize,
}

impl Map {
    fn new(fd: i32, len: usize) -> io::Result<Map> {
        // SAFETY: a fresh shared mapping of fd; checked for failure.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Map {
            base: p as *mut u8,
            len,
        })
    }

    /// The 8-byte word at `off`, shared with other processes.
    #[inline(always)]
    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.len);
        // SAFETY: in bounds and aligned (the mapping is page-aligned); the segment's
        // words are only accessed atomically or as payload bytes of records, which the
        // protocol hands from one side to the other with release/acquire order.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: our mapping; nothing refers to it after the owner's drop.
        unsafe { libc::munmap(self.base as *mut c_void, self.len) };
    }
}

fn ring_offset(ring: usize, cap: usize) -> usize {
    SEG_HDR + ring * (RING_CTRL + cap)
}

/// This process's segment: the rings peers write to it.
pub struct Rx {
    map: Map,
    fd: i32,
    cookie: u64,
    rings: usize,
    sizes: Sizes,
    /// Tags of valid records are below this.
    tags: u32,
    /// The next record's position in each ring (bytes since the start, not wrapped).
    /// Only the thread in its user's progress touches them.
    tails: Box<[AtomicU64]>,
}

// SAFETY: the mapping is shared memory accessed through atomics; tails are atomics.
unsafe impl Send for Rx {}
// SAFETY: as above; `poll`'s contract keeps one poller at a time.
unsafe impl Sync for Rx {}

impl Rx {
    /// Create a segment with room for `rings` senders, whose records carry tags below
    /// `tags` (a record with another is malformed).
    pub fn create(rings: usize, sizes: Sizes, tags: u32) -> io::Result<Rx> {
        let len = ring_offset(rings, sizes.cap);
        let name = CString::new("ompi-ofi-fbox").expect("no NUL");
        // SAFETY: a plain syscall with a valid name.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let close = |e: io::Error| {
            // SAFETY: fd is the memfd opened above, not yet closed or handed on.
            unsafe { libc::close(fd) };
            e
        };
        // SAFETY: fd is the memfd opened above; ftruncate only sizes it.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(close(io::Error::last_os_error()));
        }
        let map = Map::new(fd, len).map_err(close)?;
        let cookie = crate::common::random_odd();
        map.word(8).store(cookie, Ordering::Relaxed);
        map.word(16).store(rings as u64, Ordering::Relaxed);
        map.word(24).store(sizes.cap as u64, Ordering::Relaxed);
        map.word(0).store(SEG_MAGIC, Ordering::Release);
        Ok(Rx {
            map,
            fd,
            cookie,
            rings,
            sizes,
            tags,
            tails: (0..rings).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// The sizes of the segment's rings.
    pub fn sizes(&self) -> Sizes {
        self.sizes
    }

    /// What peers need to open the segment (published in the modex).
    pub fn record(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(RECORD_LEN);
        // SAFETY: getpid has no preconditions and cannot fail.
        v.extend_from_slice(&(unsafe { libc::getpid() } as u32).to_le_bytes());
        v.extend_from_slice(&(self.fd as u32).to_le_bytes());
        v.extend_from_slice(&self.cookie.to_le_bytes());
        v.extend_from_slice(&(self.map.len as u64).to_le_bytes());
        v.extend_from_slice(&(self.rings as u32).to_le_bytes());
        v.extend_from_slice(&(self.sizes.cap as u32).to_le_bytes());
        v.extend_from_slice(&(self.sizes.max as u32).to_le_bytes());
        v
    }

    /// [`Rx::poll`] with each payload as a slice, valid (and writable) until `f`
    /// returns.
    ///
    /// # Safety
    /// As [`Rx::poll`]: one caller at a time.
    #[inline]
    pub unsafe fn poll_slices(&self, budget: usize, mut f: impl FnMut(u8, &mut [u8])) -> usize {
        // SAFETY: one caller at a time (forwarded); poll hands out `len` bytes inside
        // the ring that the sender no longer touches until our tail passes them,
        // which is after `f` returns.
        unsafe {
            self.poll(budget, |tag, p, len| {
                f(tag, std::slice::from_raw_parts_mut(p, len))
            })
        }
    }

    /// Hand up to `budget` records of each ring to `f(tag, payload, len)`, oldest
    /// first; returns how many. The payload stays valid (and may be written) until `f`
    /// returns. A malformed record stops its ring for good, with an error logged.
    ///
    /// # Safety
    /// One caller at a time (its user's progress, under a serial section).
    pub unsafe fn poll(&self, budget: usize, mut f: impl FnMut(u8, *mut u8, usize)) -> usize {
        let cap = self.sizes.cap;
        let mut n = 0;
        for (ring, tail) in self.tails.iter().enumerate() {
            let mut t = tail.load(Ordering::Relaxed);
            if t == u64::MAX {
                continue;
            }
            let r = ring_offset(ring, cap);
            let data = r + RING_CTRL;
            let start = t;
            let mut got = 0;
            while got < budget {
                let off = (t % cap as u64) as usize;
                let h = self.map.word(data + off).load(Ordering::Acquire);
                if h == 0 {
                    break;
                }
                let len = (h & 0xffff_ffff) as usize;
                let tag = (h >> 32) as u8;
                let kind = (h >> 40) & 0xff;
                let ok = h >> 48 == REC_MAGIC
                    && match kind {
                        KIND_WRAP => true,
                        KIND_MSG => {
                            len <= self.sizes.max
                                && off + rec_len(len) <= cap
                                && (tag as u32) < self.tags
                        }
                        _ => false,
                    };
                if !ok {
                    log::error!(
                        "fast box {ring}: a malformed record ({h:#x} at offset {off}); \
                         the ring is no longer read"
                    );
                    t = u64::MAX;
                    break;
                }
                if kind == KIND_WRAP {
                    t += (cap - off) as u64;
                    continue;
                }
                // SAFETY: the record lies within the ring (checked above); the sender
                // wrote it before its release store of the header and does not touch
                // it again until our tail passes it.
                f(tag, unsafe { self.map.base.add(data + off + REC_HDR) }, len);
                t += rec_len(len) as u64;
                got += 1;
                // Released one by one: the sender may be waiting for room.
                self.map.word(r + LINE).store(t, Ordering::Release);
            }
            if t != start {
                tail.store(t, Ordering::Relaxed);
            }
            n += got;
        }
        n
    }
}

impl Drop for Rx {
    fn drop(&mut self) {
        // SAFETY: our fd (the mapping is dropped after, by its own Drop).
        unsafe { libc::close(self.fd) };
    }
}

/// A ring claimed in a peer's segment: what this process sends it through.
pub struct Tx {
    map: Map,
    /// Offset of the claimed ring's control lines.
    ring: usize,
    sizes: Sizes,
    /// Held while one thread writes a record.
    busy: AtomicBool,
    /// The receiver's tail as last read (only under `busy`).
    seen_tail: AtomicU64,
    owner: u64,
    /// Records sent (only written under `busy`).
    sent: AtomicU64,
}

// SAFETY: shared memory accessed through atomics and under `busy`.
unsafe impl Send for Tx {}
// SAFETY: as for Send: the mapping is shared through atomics, and payload writes under `busy`.
unsafe impl Sync for Tx {}

impl Tx {
    /// Open a peer's segment from its modex record and claim a ring, trying `prefer`
    /// (this process's local rank) first.
    pub fn open(record: &[u8], prefer: usize) -> Result<Tx, String> {
        if record.len() != RECORD_LEN {
            return Err(format!("a record of {} bytes", record.len()));
        }
        let u32_at = |i: usize| u32::from_le_bytes(record[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(record[i..i + 8].try_into().unwrap());
        let (pid, fd, cookie, len) = (u32_at(0), u32_at(4), u64_at(8), u64_at(16) as usize);
        let (rings, cap, max) = (
            u32_at(24) as usize,
            u32_at(28) as usize,
            u32_at(32) as usize,
        );
        if !Sizes::valid(cap, max) {
            return Err(format!("rings of {cap} B for records of {max} B"));
        }
        let sizes = Sizes { cap, max };
        if rings == 0 || len != ring_offset(rings, cap) {
            return Err(format!("{rings} rings of {cap} B in {len} B"));
        }
        let path = CString::new(format!("/proc/{pid}/fd/{fd}")).expect("no NUL");
        // SAFETY: path is a NUL-terminated C string that lives across the call.
        let f = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if f < 0 {
            return Err(format!(
                "opening {}: {}",
                path.to_string_lossy(),
                io::Error::last_os_error()
            ));
        }
        // SAFETY: libc::stat is plain integers, for which all zeroes is a valid value.
        let mut sb: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: f is the descriptor opened above; sb is a writable stat.
        let r = if unsafe { libc::fstat(f, &mut sb) } != 0 {
            Err(format!("fstat: {}", io::Error::last_os_error()))
        } else if (sb.st_size as u64) < len as u64 {
            Err(format!("the segment has {} B, not {len}", sb.st_size))
        } else {
            Map::new(f, len).map_err(|e| format!("mmap: {e}"))
        };
        // SAFETY: ours; the mapping stays after close.
        unsafe { libc::close(f) };
        let map = r?;
        if map.word(0).load(Ordering::Acquire) != SEG_MAGIC
            || map.word(8).load(Ordering::Relaxed) != cookie
            || map.word(16).load(Ordering::Relaxed) != rings as u64
            || map.word(24).load(Ordering::Relaxed) != cap as u64
        {
            return Err("not the segment the peer published".into());
        }
        // SAFETY: getpid has no preconditions and cannot fail.
        let owner = u64::from(unsafe { libc::getpid() } as u32) | 1 << 32;
        let order =
            std::iter::once(prefer % rings).chain((0..rings).filter(|&i| i != prefer % rings));
        for i in order {
            let r = ring_offset(i, cap);
            let w = map.word(r);
            if w.compare_exchange(0, owner, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return Ok(Tx {
                    seen_tail: AtomicU64::new(map.word(r + LINE).load(Ordering::Acquire)),
                    map,
                    ring: r,
                    sizes,
                    busy: AtomicBool::new(false),
                    owner,
                    sent: AtomicU64::new(0),
                });
            }
        }
        Err(format!("all {rings} rings are taken"))
    }

    /// Records sent through this ring.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// The largest payload a record carries.
    #[inline(always)]
    pub fn max(&self) -> usize {
        self.sizes.max
    }

    /// Room for a record of `len` payload bytes (`len <= max()`), or `None` when the
    /// ring is full. Waits (spinning, then yielding) while another thread of this
    /// process writes the ring: for a copy of at most `max()` bytes.
    #[inline]
    pub fn reserve(&self, len: usize) -> Option<Slot<'_>> {
        let mut spins = 0u32;
        while self
            .busy
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // Releases busy when dropped: on every return below without a slot.
        let claim = Slot {
            tx: self,
            off: 0,
            len,
        };
        let cap = self.sizes.cap;
        let head = self.map.word(self.ring + 8).load(Ordering::Relaxed);
        let off = (head % cap as u64) as usize;
        let rec = rec_len(len);
        let wrap = off + rec > cap;
        // The record, the header word after it, and what a wrap skips.
        let need = (rec + REC_HDR + if wrap { cap - off } else { 0 }) as u64;
        let mut tail = self.seen_tail.load(Ordering::Relaxed);
        if need > cap as u64 - (head - tail) {
            tail = self.map.word(self.ring + LINE).load(Ordering::Acquire);
            self.seen_tail.store(tail, Ordering::Relaxed);
            if need > cap as u64 - (head - tail) {
                return None; // drops the claim: releases busy
            }
        }
        let data = self.ring + RING_CTRL;
        if wrap {
            self.map.word(data).store(0, Ordering::Relaxed);
            self.map
                .word(data + off)
                .store(header(0, 0, KIND_WRAP), Ordering::Release);
            self.map
                .word(self.ring + 8)
                .store(head + (cap - off) as u64, Ordering::Relaxed);
            return Some(claim); // the record goes at offset 0
        }
        // Not `Slot { off, ..claim }`: that copies the fields and then drops the claim,
        // releasing busy while the new slot is written.
        let mut slot = claim;
        slot.off = off;
        Some(slot)
    }
}

impl Tx {
    /// Send one record made of `parts`, one after the other, under tag 0: `false` when
    /// the ring has no room for it now.
    #[inline]
    pub fn send(&self, parts: &[&[u8]], tag: u8) -> bool {
        let len = parts.iter().map(|p| p.len()).sum();
        let Some(slot) = self.reserve(len) else {
            return false;
        };
        let mut at = slot.payload();
        for p in parts {
            // SAFETY: the slot has room for `len` bytes (reserve), the sum of the parts'
            // lengths; the parts are ours to read and do not overlap the ring.
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr(), at, p.len());
                at = at.add(p.len());
            }
        }
        slot.commit(len, tag);
        true
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        // The ring is free for another process (head stays in its line for the next
        // owner; the receiver never resets).
        let _ = self.map.word(self.ring).compare_exchange(
            self.owner,
            0,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

/// A record being written: [`Slot::payload`], then [`Slot::commit`]. Dropped without a
/// commit, nothing is sent.
pub struct Slot<'a> {
    tx: &'a Tx,
    off: usize,
    /// The payload length reserved.
    len: usize,
}

impl Slot<'_> {
    /// Where the payload goes (room for the `len` given to `reserve`).
    #[inline(always)]
    pub fn payload(&self) -> *mut u8 {
        // SAFETY: within the ring's data (reserve checked the room).
        unsafe {
            self.tx
                .map
                .base
                .add(self.tx.ring + RING_CTRL + self.off + REC_HDR)
        }
    }

    /// The payload's room (the `len` given to `reserve`), to write before the commit.
    #[inline(always)]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        // SAFETY: reserve checked that the record's `len` bytes lie within the ring's
        // data; this thread holds the ring (busy) and the receiver reads them only
        // after the commit publishes the header.
        unsafe { std::slice::from_raw_parts_mut(self.payload(), self.len) }
    }

    /// Publish `len` payload bytes (at most the reserved length) under `tag`.
    #[inline]
    pub fn commit(self, len: usize, tag: u8) {
        let tx = self.tx;
        let cap = tx.sizes.cap;
        let data = tx.ring + RING_CTRL;
        let rec = rec_len(len);
        let next = (self.off + rec) % cap;
        tx.map.word(data + next).store(0, Ordering::Relaxed);
        tx.map
            .word(data + self.off)
            .store(header(len, tag, KIND_MSG), Ordering::Release);
        let head = tx.map.word(tx.ring + 8).load(Ordering::Relaxed);
        tx.map
            .word(tx.ring + 8)
            .store(head + rec as u64, Ordering::Relaxed);
        // Under busy: a plain increment, no locked instruction.
        tx.sent
            .store(tx.sent.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        // Drop releases busy.
    }
}

impl Drop for Slot<'_> {
    #[inline]
    fn drop(&mut self) {
        self.tx.busy.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(rings: usize, cap: u64, max: usize) -> (Rx, Tx) {
        let rx = Rx::create(
            rings,
            Sizes::new("fbox_size", cap, max).unwrap().unwrap(),
            256,
        )
        .unwrap();
        let tx = Tx::open(&rx.record(), 0).unwrap();
        (rx, tx)
    }

    fn drain(rx: &Rx) -> Vec<(u8, Vec<u8>)> {
        let mut out = Vec::new();
        // SAFETY: this test thread is the segment's only poller.
        unsafe {
            rx.poll(usize::MAX, |tag, p, len| {
                out.push((tag, std::slice::from_raw_parts(p, len).to_vec()))
            })
        };
        out
    }

    #[test]
    fn sizes_are_checked() {
        assert_eq!(Sizes::new("fbox_size", 0, 4096), Ok(None));
        assert!(Sizes::new("fbox_size", 1000, 16).is_err());
        assert!(Sizes::new("fbox_size", (1 << 24) + 64, 16).is_err());
        let s = |cap, max| Ok(Some(Sizes { cap, max }));
        assert_eq!(Sizes::new("fbox_size", 65536, 8192), s(65536, 8192));
        assert_eq!(Sizes::new("fbox_size", 65600, 8192), s(65600, 8192));
        assert_eq!(Sizes::new("fbox_size", 4100, 8192), s(32832, 8192));
        assert_eq!(
            Sizes::new("fbox_size", 1 << 24, 1 << 22),
            s((1 << 24) + 64, 1 << 22)
        );
        assert_eq!(
            Sizes::new("fbox_size", 1 << 24, 1 << 23),
            s((1 << 25) + 64, 1 << 23)
        );
        for size in [4096u64, 4160, 32768, 1 << 20, 1 << 24] {
            for max in [1usize, 8, 1000, 4096, 8192, 65536, 1 << 22] {
                let z = Sizes::new("fbox_size", size, max).unwrap().unwrap();
                assert_eq!(z.max, max);
                assert!(Sizes::valid(z.cap, z.max), "{size} {max}");
                // Two largest records, their header words and a wrap's waste fit.
                assert!(
                    2 * (rec_len(z.max) + REC_HDR) + rec_len(z.max) <= z.cap,
                    "{size} {max}"
                );
            }
        }
    }

    #[test]
    fn records_arrive_in_order_across_many_wraps() {
        let (rx, tx) = pair(2, 4096, 1000);
        let mut sent = 0usize;
        let mut got = Vec::new();
        let mut lens = (0..5000usize).map(|i| (i * 37) % 1001);
        let mut next = lens.next();
        while let Some(len) = next {
            match tx.reserve(len) {
                Some(s) => {
                    for k in 0..len {
                        // SAFETY: the slot has room for len bytes.
                        unsafe { *s.payload().add(k) = (sent + k) as u8 };
                    }
                    s.commit(len, (sent % 7) as u8);
                    sent += 1;
                    next = lens.next();
                }
                None => got.extend(drain(&rx)),
            }
        }
        got.extend(drain(&rx));
        assert_eq!(got.len(), 5000);
        for (i, (tag, bytes)) in got.iter().enumerate() {
            assert_eq!(*tag as usize, i % 7);
            assert_eq!(bytes.len(), (i * 37) % 1001, "record {i}");
            assert!(
                bytes.iter().enumerate().all(|(k, &b)| b == (i + k) as u8),
                "record {i}"
            );
        }
    }

    #[test]
    fn a_full_ring_refuses_and_an_uncommitted_slot_sends_nothing() {
        let (rx, tx) = pair(1, 4096, 1000);
        let mut n = 0;
        while let Some(s) = tx.reserve(1000) {
            s.commit(1000, 1);
            n += 1;
        }
        assert!((2..=4).contains(&n), "{n} records of 1000 B in 4096 B");
        assert_eq!(drain(&rx).len(), n);
        drop(tx.reserve(8).unwrap());
        assert!(drain(&rx).is_empty());
        tx.reserve(8).unwrap().commit(8, 2);
        assert_eq!(drain(&rx).len(), 1);
    }

    #[test]
    fn rings_are_claimed_once_and_freed_on_drop() {
        let rx = Rx::create(2, Sizes::new("fbox_size", 4096, 64).unwrap().unwrap(), 256).unwrap();
        assert_eq!(rx.sizes, Sizes { cap: 4096, max: 64 });
        let a = Tx::open(&rx.record(), 1).unwrap();
        let b = Tx::open(&rx.record(), 1).unwrap();
        assert_ne!(a.ring, b.ring);
        assert!(Tx::open(&rx.record(), 0).is_err());
        a.reserve(5).unwrap().commit(5, 3);
        drop(a);
        let c = Tx::open(&rx.record(), 1).unwrap();
        c.reserve(6).unwrap().commit(6, 4);
        let got = drain(&rx);
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![3, 4]);
    }

    #[test]
    fn threads_sharing_a_ring_never_write_over_each_other() {
        let (rx, tx) = pair(1, 8192, 256);
        let tx = std::sync::Arc::new(tx);
        let (threads, n) = (4usize, 20_000u32);
        let senders: Vec<_> = (0..threads)
            .map(|t| {
                let tx = std::sync::Arc::clone(&tx);
                std::thread::spawn(move || {
                    let mut i = 0u32;
                    while i < n {
                        let len = 4 + (i as usize * 7) % 200;
                        if let Some(s) = tx.reserve(len) {
                            // SAFETY: reserve gave room for len payload bytes at the slot.
                            unsafe {
                                ptr::copy_nonoverlapping(i.to_le_bytes().as_ptr(), s.payload(), 4);
                                ptr::write_bytes(s.payload().add(4), t as u8 ^ i as u8, len - 4);
                            }
                            s.commit(len, t as u8);
                            i += 1;
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                })
            })
            .collect();
        let mut next = vec![0u32; threads];
        let mut total = 0;
        while total < threads * n as usize {
            // SAFETY: this test thread is the segment's only poller.
            total += unsafe {
                rx.poll(64, |tag, p, len| {
                    let b = std::slice::from_raw_parts(p, len);
                    let i = u32::from_le_bytes(b[..4].try_into().unwrap());
                    let t = tag as usize;
                    assert_eq!(i, next[t], "thread {t}");
                    assert_eq!(len, 4 + (i as usize * 7) % 200);
                    assert!(
                        b[4..].iter().all(|&x| x == t as u8 ^ i as u8),
                        "thread {t} record {i}"
                    );
                    next[t] += 1;
                })
            };
        }
        for s in senders {
            s.join().unwrap();
        }
    }

    #[test]
    fn a_concurrent_sender_and_receiver_agree_on_every_byte() {
        let (rx, tx) = pair(1, 8192, 512);
        let n = 200_000usize;
        let t = std::thread::spawn(move || {
            let mut i = 0;
            while i < n {
                let len = (i * 13) % 513;
                if let Some(s) = tx.reserve(len) {
                    // SAFETY: reserve gave room for len payload bytes at the slot.
                    unsafe { ptr::write_bytes(s.payload(), i as u8, len) };
                    s.commit(len, (i % 5) as u8);
                    i += 1;
                } else {
                    std::hint::spin_loop();
                }
            }
        });
        let mut i = 0;
        while i < n {
            // SAFETY: this test thread is the segment's only poller.
            unsafe {
                rx.poll(64, |tag, p, len| {
                    assert_eq!(tag as usize, i % 5);
                    assert_eq!(len, (i * 13) % 513);
                    let b = std::slice::from_raw_parts(p, len);
                    assert!(b.iter().all(|&x| x == i as u8), "record {i}");
                    i += 1;
                })
            };
        }
        t.join().unwrap();
    }
}
