//! What the provider reaches by address, as types, for both components: [`Local`] (a
//! local range it may read or write until an operation completes), [`Buffer`] (C-heap
//! memory with one owner), [`Scratch`] (its per-operation space) and [`OpContext`]
//! (the pointer a completion hands back). Their `unsafe` constructors carry the
//! lifetime contract once, where the memory is set up, so that posting with them is
//! safe (`post.rs`).
//!
//! What it owns: the memory of each [`Buffer`]. What it must not touch: Open MPI, and
//! what the operations mean (that is their owner's).

use libfabric_sys as fi;
use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};

/// The provider's scratch space of one operation (`FI_CONTEXT2`), which it writes
/// while the operation is in flight. In an `UnsafeCell`, so that the struct holding it
/// may stay shared meanwhile; Rust code never reads it.
#[repr(transparent)]
pub struct Scratch(UnsafeCell<fi::fi_context2>);

// SAFETY: only the provider reads or writes the cell, through the pointer of the one
// operation in flight with it (the contract of `Scratch::context`); no Rust code reads
// it, so sharing or moving the holder between threads races on nothing.
unsafe impl Sync for Scratch {}
// SAFETY: as for Sync: the raw pointers inside are the provider's, never followed here.
unsafe impl Send for Scratch {}

impl Default for Scratch {
    fn default() -> Self {
        Scratch(UnsafeCell::new(fi::fi_context2::default()))
    }
}

impl Scratch {
    /// The context of an operation about to be posted with this space, cleared (or,
    /// with `garbage`, a test hook, filled with a pattern, which shows a provider that
    /// relies on its contents).
    ///
    /// # Safety
    /// No operation posted with this space is in flight, and the space stays where it
    /// is, used by no other operation, until the completion of the one about to be
    /// posted is reaped (or its endpoint is closed).
    #[inline(always)]
    pub unsafe fn context(&self, garbage: bool) -> OpContext {
        let p = self.0.get();
        let word = if garbage {
            0xA5A5_A5A5_A5A5_A5A5usize
        } else {
            0
        };
        // SAFETY: no operation is in flight with this space (caller's contract), so
        // nothing else reads or writes it.
        for w in unsafe { (*p).internal.iter_mut() } {
            *w = word as *mut c_void;
        }
        OpContext(p.cast())
    }
}

/// The context of one operation: what the provider keeps its scratch space at and
/// hands back in the completion. Made only by [`Scratch::context`] and
/// [`OpContext::new`], whose contracts keep it valid until the completion is reaped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpContext(*mut c_void);

impl OpContext {
    /// The context of one operation at `ctx`, an `fi_context2` the provider may use as
    /// scratch (`FI_CONTEXT`/`FI_CONTEXT2` mode) and that the completion hands back:
    /// for a component whose contexts live in structures of its own layout (the MTL's
    /// requests) rather than in a [`Scratch`].
    ///
    /// # Safety
    /// `ctx` stays valid, and neither read nor written by anyone but the provider, from
    /// each post that uses it until that operation's completion is reaped.
    #[inline(always)]
    pub unsafe fn new(ctx: NonNull<fi::fi_context2>) -> OpContext {
        OpContext(ctx.as_ptr().cast())
    }

    #[inline(always)]
    pub fn as_ptr(self) -> *mut c_void {
        self.0
    }
}

/// A local range the provider may read (a send, a write, an atomic's operand) or
/// write (a receive, a read, an atomic's result) until an operation completes, with
/// the descriptor of its registration (null where the provider needs none).
///
/// Invariant (the contract of [`Local::new`]): the range stays valid for those
/// accesses until the completion of every operation posted with it is reaped.
#[derive(Clone, Copy, Debug)]
pub struct Local {
    addr: *mut c_void,
    len: usize,
    desc: *mut c_void,
}

// SAFETY: a Local is an address with the promise of `Local::new`, which holds whichever
// thread posts with it; it gives no access to the memory itself.
unsafe impl Send for Local {}
// SAFETY: as for Send: sharing a Local shares an address and its promise, no memory.
unsafe impl Sync for Local {}

impl Local {
    /// `len` bytes at `addr`, registered under `desc` (or null).
    ///
    /// # Safety
    /// `[addr, addr + len)` (nothing when `len` is 0) is mapped and stays valid for
    /// the provider to read, with nothing else writing it, and, when it is posted to
    /// be written (a receive, a read, a fetching atomic's result), for the provider to
    /// write, with nothing else reading it, until the completion of every operation
    /// posted with this range (or a part of it) is reaped; `desc` is null or the
    /// descriptor of a registration covering the range that lives as long.
    #[inline(always)]
    pub unsafe fn new(addr: *mut c_void, len: usize, desc: *mut c_void) -> Local {
        Local { addr, len, desc }
    }

    /// No local memory (an atomic without a result).
    pub const NONE: Local = Local {
        addr: ptr::null_mut(),
        len: 0,
        desc: ptr::null_mut(),
    };

    /// `len` bytes from `off` on, clamped to the range.
    #[inline]
    pub fn part(&self, off: usize, len: usize) -> Local {
        let off = off.min(self.len);
        Local {
            addr: self.addr.wrapping_byte_add(off),
            len: len.min(self.len - off),
            desc: self.desc,
        }
    }

    /// The same range under another descriptor (a registration made for it).
    ///
    /// # Safety
    /// `desc` is the descriptor of a registration covering the range, live until the
    /// completions of the operations posted with the result are reaped.
    #[inline]
    pub unsafe fn with_desc(self, desc: *mut c_void) -> Local {
        Local { desc, ..self }
    }

    #[inline(always)]
    pub fn addr(&self) -> *mut c_void {
        self.addr
    }

    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline(always)]
    pub fn desc(&self) -> *mut c_void {
        self.desc
    }
}

/// Zeroed C-heap memory with one owner, handed to the provider (as a [`Local`]) and to
/// Open MPI by address. Zeroed, so that what goes on the wire never carries old heap
/// contents and every byte may be read as a slice.
///
/// Invariant: `ptr` holds `len` initialised bytes from `calloc`, freed by `Drop`,
/// which first closes `mr`, a registration covering them.
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    mr: Option<super::MemoryRegion>,
}

// SAFETY: plain memory owned by this value; Rust's borrow rules on `&Buffer` and
// `&mut Buffer` govern every access from Rust, and the provider reaches it only
// under the contract of `Buffer::local`.
unsafe impl Send for Buffer {}
// SAFETY: as for Send: `&Buffer` only reads.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// `len` zeroed bytes (at least one), or `None` when the allocation fails.
    pub fn zeroed(len: usize) -> Option<Buffer> {
        // SAFETY: a plain allocation, checked for null below.
        let p = unsafe { libc::calloc(1, len.max(1)) } as *mut u8;
        NonNull::new(p).map(|ptr| Buffer { ptr, len, mr: None })
    }

    /// Register the buffer on `domain` for `access` (requested key `key`, ignored with
    /// `FI_MR_PROV_KEY`), kept by the buffer: the region for the caller to finish
    /// (bind and enable it under `FI_MR_ENDPOINT`).
    pub fn register(
        &mut self,
        domain: &std::sync::Arc<super::Domain>,
        access: u64,
        key: u64,
    ) -> super::Result<&super::MemoryRegion> {
        // SAFETY: the buffer keeps the region and closes it before it frees the memory
        // (Drop), so the memory stays mapped while it is registered.
        let mr = unsafe {
            super::MemoryRegion::register(
                domain,
                self.ptr.as_ptr().cast(),
                self.len,
                access,
                0,
                key,
                0,
            )
        }?;
        Ok(self.mr.insert(mr))
    }

    /// The descriptor of the buffer's registration (null without one).
    #[inline(always)]
    pub fn desc(&self) -> *mut c_void {
        self.mr.as_ref().map_or(ptr::null_mut(), |m| m.desc())
    }

    #[inline(always)]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline(always)]
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the type's invariant: len initialised bytes, borrowed with self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    #[inline(always)]
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the type's invariant; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer as a range to post, with its registration's descriptor.
    ///
    /// # Safety
    /// As [`Local::new`]: the buffer is neither dropped nor reached through
    /// [`Buffer::bytes_mut`] (nor, while the provider writes it, [`Buffer::bytes`])
    /// until the completions of the operations posted with the range are reaped.
    #[inline(always)]
    pub unsafe fn local(&self) -> Local {
        Local {
            addr: self.ptr.as_ptr().cast(),
            len: self.len,
            desc: self.desc(),
        }
    }

    /// The bytes a receive completion reports in this buffer: `len` bytes at its
    /// start, or, in a multi-receive buffer (`multi`), at the completion's `buf`.
    /// Clamped to the buffer; `None` when `buf` lies outside it.
    ///
    /// # Safety
    /// The completion is this buffer's, and its bytes are not written again (the
    /// buffer is not posted again) nor reached otherwise while the slice lives; a
    /// multi-receive buffer's other fragments may still be written meanwhile, which
    /// is why only the fragment's own bytes are borrowed.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn received(
        &self,
        multi: bool,
        buf: *const c_void,
        len: usize,
    ) -> Option<&mut [u8]> {
        let at = if multi {
            (buf as usize).wrapping_sub(self.ptr.as_ptr() as usize)
        } else {
            0
        };
        if at >= self.len {
            return None;
        }
        // SAFETY: at < len, so the slice lies inside the buffer; the caller's contract
        // makes it the only access to those bytes while it lives.
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(at), len.min(self.len - at))
        })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // The registration first: it must not outlive the memory.
        drop(self.mr.take());
        // SAFETY: from calloc (the type's invariant), freed once.
        unsafe { libc::free(self.ptr.as_ptr().cast()) };
    }
}

/// Address space that the provider may write into and that no one reads: an anonymous
/// private mapping with `MAP_NORESERVE`, so that only the pages a write touches cost
/// memory (the MTL's overflow area, where the excess of a message longer than its
/// receive goes). Unmapped by `Drop`.
///
/// Invariant: `ptr` is a mapping of `len` bytes made by [`Scrap::map`], unmapped only
/// by `Drop`.
pub struct Scrap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: Rust code never reads or writes the mapping (only the provider does, through
// the ranges of `Scrap::local`); the value is an address and a length.
unsafe impl Send for Scrap {}
// SAFETY: as for Send: sharing a Scrap shares an address, no memory.
unsafe impl Sync for Scrap {}

impl Scrap {
    /// `len` bytes of address space, or `None` when the mapping fails.
    pub fn map(len: usize) -> Option<Scrap> {
        // SAFETY: an anonymous private mapping at an address the kernel picks; checked
        // for failure below.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        NonNull::new(p.cast()).map(|ptr| Scrap { ptr, len })
    }

    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole mapping as a range to receive into. Its contents are garbage that no
    /// one reads, so any number of receives may share it.
    ///
    /// # Safety
    /// The value is not dropped until the completions of the operations posted with
    /// the range are reaped (or their endpoint is closed).
    #[inline(always)]
    pub unsafe fn local(&self) -> Local {
        Local {
            addr: self.ptr.as_ptr().cast(),
            len: self.len,
            desc: ptr::null_mut(),
        }
    }
}

impl Drop for Scrap {
    fn drop(&mut self) {
        // SAFETY: the mapping of the invariant, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A message of at most `N` bytes built on the stack to be injected. Nothing is
/// cleared: the buffer starts uninitialised, and only the prefix written so far (by
/// [`StackMsg::push`] and [`StackMsg::fill`]) is ever read ([`StackMsg::bytes`]), so
/// a message costs the copies that build it and no clear of the buffer.
///
/// Invariant: the first `len` (at most `N`) bytes of `buf` are initialised.
pub struct StackMsg<const N: usize> {
    buf: [MaybeUninit<u8>; N],
    len: usize,
}

impl<const N: usize> Default for StackMsg<N> {
    #[inline(always)]
    fn default() -> Self {
        StackMsg {
            buf: [const { MaybeUninit::uninit() }; N],
            len: 0,
        }
    }
}

impl<const N: usize> StackMsg<N> {
    /// Append `bytes`, or as many as fit.
    #[inline(always)]
    pub fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(N - self.len);
        // SAFETY: n <= N - len, so the n bytes from len on lie inside the buffer, which
        // `&mut self` borrows alone and which cannot overlap the borrowed `bytes`.
        unsafe {
            ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.buf.as_mut_ptr().add(self.len).cast(),
                n,
            )
        };
        self.len += n;
    }

    /// Append `n` bytes (as many as fit) that `f` writes into the room it is given:
    /// `f` returns the initialised prefix of that room (what `MaybeUninit` writers,
    /// such as a convertor's pack, hand back), and the rest of the `n` bytes, if it
    /// wrote fewer, are cleared.
    #[inline]
    pub fn fill<E>(
        &mut self,
        n: usize,
        f: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<&mut [u8], E>,
    ) -> Result<(), E> {
        let n = n.min(N - self.len);
        let room = &mut self.buf[self.len..self.len + n];
        let at = room.as_ptr() as usize;
        let done = f(room)?;
        // A `&mut [u8]` is initialised memory; only one that starts at the room and
        // lies inside it counts as written there.
        let written = if done.as_ptr() as usize == at {
            done.len().min(n)
        } else {
            0
        };
        for b in &mut self.buf[self.len + written..self.len + n] {
            b.write(0);
        }
        self.len += n;
        Ok(())
    }

    /// The bytes written so far.
    #[inline(always)]
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the type's invariant: the first len bytes are initialised (push and
        // fill write every byte they count), borrowed with self.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().cast(), self.len) }
    }

    /// The bytes written so far, to change in place (a header stamped at each
    /// attempt).
    #[inline(always)]
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `bytes`; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr().cast(), self.len) }
    }

    /// Start a new message in the same buffer (nothing is cleared).
    #[inline(always)]
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn received_stays_inside_the_buffer() {
        let b = Buffer::zeroed(64).expect("allocation");
        let base = b.as_ptr() as usize;
        let len = |multi, at: usize, n| {
            // SAFETY: nothing is posted; each slice is dropped before the next.
            unsafe { b.received(multi, at as *const c_void, n) }.map(|s| s.len())
        };
        assert_eq!(len(false, 0, 10), Some(10));
        assert_eq!(len(false, 0, 100), Some(64));
        assert_eq!(len(true, base + 60, 10), Some(4));
        assert_eq!(len(true, base + 64, 1), None);
        assert_eq!(len(true, base - 1, 1), None);
    }

    #[test]
    fn stack_messages_hold_what_was_written() {
        let mut m = StackMsg::<8>::default();
        m.push(&[1, 2]);
        m.fill(3, |room| -> Result<&mut [u8], ()> {
            room[0].write(7);
            // SAFETY: the first byte of room was just written.
            Ok(unsafe { std::slice::from_raw_parts_mut(room.as_mut_ptr().cast(), 1) })
        })
        .unwrap();
        m.push(&[9; 10]);
        assert_eq!(m.bytes(), &[1, 2, 7, 0, 0, 9, 9, 9]);
    }

    #[test]
    fn parts_are_clamped() {
        let mut word = 0u64;
        // SAFETY: the range is a local that outlives the test; nothing is posted.
        let l = unsafe { Local::new((&raw mut word).cast(), 8, ptr::null_mut()) };
        assert_eq!(l.part(4, 8).len(), 4);
        assert_eq!(l.part(9, 1).len(), 0);
        assert_eq!(l.part(2, 2).addr() as usize, l.addr() as usize + 2);
    }
}
