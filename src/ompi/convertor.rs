//! Convertors as the data paths see them: the packed size of a send or receive, where
//! its data starts when it is one contiguous block, and packing and unpacking through
//! a buffer of ours when it is not.
//!
//! What it owns: every call into `opal_convertor_*` of the MTL and the BTL. What it
//! must not touch: the convertor's setup and lifetime, which are the PML's.

use super::glue;
use ompi_sys as sys;
use std::mem::MaybeUninit;
use std::os::raw::{c_int, c_void};
use std::ptr;

/// A convertor the PML prepared. Invariant: the pointer is a prepared convertor that
/// stays valid while the operation it was passed for lives (the PML keeps it in its
/// request until that request completes).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Convertor(*mut sys::opal_convertor_t);

/// What the data paths need to know about a convertor.
pub struct Info {
    /// Packed size in bytes.
    pub size: usize,
    /// Start of the data when it is one contiguous block (with the datatype's true
    /// lower bound applied, so MPI_BOTTOM with absolute addresses works).
    pub contig: Option<*mut u8>,
}

impl Convertor {
    /// A handle to `conv`; `None` for a null pointer.
    ///
    /// # Safety
    /// `conv` must be null or a prepared convertor valid for every use of the handle.
    #[inline(always)]
    pub unsafe fn from_raw(conv: *mut sys::opal_convertor_t) -> Option<Convertor> {
        (!conv.is_null()).then_some(Convertor(conv))
    }

    #[inline]
    pub fn info(self) -> Info {
        let (mut size, mut contig, mut start, mut need) =
            (0usize, 0 as c_int, ptr::null_mut(), 0 as c_int);
        // SAFETY: a prepared convertor (the type's invariant); the outputs are valid.
        unsafe {
            glue::ompi_ofi_glue_convertor_info(
                self.0,
                &mut size,
                &mut contig,
                &mut start,
                &mut need,
            )
        };
        Info {
            size,
            contig: (contig != 0).then_some(start as *mut u8),
        }
    }

    /// Pack the next `dst.len()` bytes of the data into `dst`; returns the length
    /// packed, or `OPAL_ERROR`.
    #[inline]
    pub fn pack(self, dst: &mut [u8]) -> Result<usize, c_int> {
        // SAFETY: viewed as `MaybeUninit`, dst is only written (by the pack), never
        // de-initialised: opal_convertor_pack stores bytes.
        let room = unsafe { &mut *(dst as *mut [u8] as *mut [MaybeUninit<u8>]) };
        self.pack_uninit(room).map(|b| b.len())
    }

    /// [`Convertor::pack`] into memory that need not be initialised: the bytes packed,
    /// the prefix of `dst` that the pack wrote.
    #[inline]
    pub fn pack_uninit(self, dst: &mut [MaybeUninit<u8>]) -> Result<&mut [u8], c_int> {
        if dst.is_empty() {
            return Ok(&mut []);
        }
        let mut iov = libc::iovec {
            iov_base: dst.as_mut_ptr() as *mut c_void,
            iov_len: dst.len(),
        };
        let mut count: u32 = 1;
        let mut max = dst.len();
        // SAFETY: a prepared convertor; iov describes dst, which is writable (the pack
        // only stores into it).
        let rc = unsafe {
            sys::opal_convertor_pack(
                self.0,
                &mut iov as *mut _ as *mut sys::iovec,
                &mut count,
                &mut max,
            )
        };
        if rc < 0 {
            return Err(sys::OPAL_ERROR);
        }
        // SAFETY: opal_convertor_pack wrote `max` bytes from the start of the iovec,
        // which is dst (at most dst.len(): it never packs past the iovec).
        Ok(unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), max.min(dst.len())) })
    }

    /// Unpack `src`, received bytes in our buffer, into the user's datatype (at most
    /// the convertor's own packed size is written).
    #[inline]
    pub fn unpack(self, src: &[u8]) {
        if src.is_empty() {
            return;
        }
        let mut iov = libc::iovec {
            iov_base: src.as_ptr() as *mut c_void,
            iov_len: src.len(),
        };
        let mut count: u32 = 1;
        let mut max = src.len();
        // SAFETY: a prepared convertor; the convertor only reads iov's bytes, and writes
        // at most its packed size into the user's memory it describes.
        unsafe {
            sys::opal_convertor_unpack(
                self.0,
                &mut iov as *mut _ as *mut sys::iovec,
                &mut count,
                &mut max,
            )
        };
    }
}

/// The bytes of a send: the user's memory when contiguous, else a buffer of ours that
/// holds the packed data (freed on drop unless the caller takes it over with
/// [`SendData::into_parts`]). Invariant: `ptr` holds `len` bytes, valid while the
/// operation the convertor was prepared for lives (the user's) or while this value
/// or its taker owns them (ours).
pub struct SendData {
    ptr: *const u8,
    len: usize,
    owned: bool,
}

/// Where the data of `conv` is: the user's memory when it is one contiguous block,
/// else a fresh `libc::malloc` buffer of its packed size (`owned`).
fn region(conv: Convertor) -> Result<(*mut u8, usize, bool), c_int> {
    let Info { size, contig } = conv.info();
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

impl SendData {
    /// The data of `conv`, packed only when it is not contiguous.
    pub fn of(conv: Convertor) -> Result<SendData, c_int> {
        let (ptr, len, owned) = region(conv)?;
        let data = SendData { ptr, len, owned };
        if owned {
            // SAFETY: ptr holds len bytes, allocated by region and not shared.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
            conv.pack(dst).map_err(|_| sys::OMPI_ERROR)?;
        }
        Ok(data)
    }

    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for the paths that copy them before returning (injects, copies).
    #[inline(always)]
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the invariant: ptr holds len bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Where the data starts, as a peer addresses it for an RMA read.
    #[inline(always)]
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Take the data apart: the caller owns a pack buffer (`owned`) from here, and frees
    /// it with `libc::free`.
    #[inline]
    pub fn into_parts(self) -> (*const u8, usize, bool) {
        let parts = (self.ptr, self.len, self.owned);
        std::mem::forget(self);
        parts
    }
}

impl Drop for SendData {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: owned buffers come from libc::malloc in `of`.
            unsafe { libc::free(self.ptr as *mut c_void) };
        }
    }
}

/// Where a receive lands: the user's memory when contiguous, else a buffer of ours
/// (`owned`, from `libc::malloc`) that is unpacked once the data arrived. Invariant as
/// for [`SendData`]; whoever takes it apart frees an owned buffer.
pub struct RecvBuffer {
    ptr: *mut u8,
    len: usize,
    owned: bool,
}

impl RecvBuffer {
    pub fn of(conv: Convertor) -> Result<RecvBuffer, c_int> {
        let (ptr, len, owned) = region(conv)?;
        Ok(RecvBuffer { ptr, len, owned })
    }

    /// Take the buffer apart: the caller owns a buffer of ours (`owned`) from here.
    #[inline]
    pub fn into_parts(self) -> (*mut u8, usize, bool) {
        (self.ptr, self.len, self.owned)
    }
}

/// The memory of a request's operations, kept in the request: none, the user's
/// memory (valid until the PML's request completes, from a [`RecvBuffer`] or
/// [`SendData`]), a buffer from `libc::malloc` that the request owns (`owned`, freed by
/// [`OpBuffer::free`]), or memory the request's owner keeps as long as the request (a
/// copied send's block). `Copy`, so that it can sit in a `Cell` of the request.
///
/// Invariant: `ptr` is null (and `len` 0), or holds `len` bytes that stay valid until
/// the operations posted with them complete, and, when `owned`, until `free`.
#[derive(Clone, Copy, Debug)]
pub struct OpBuffer {
    ptr: *mut u8,
    len: usize,
    owned: bool,
}

impl OpBuffer {
    pub const NONE: OpBuffer = OpBuffer {
        ptr: ptr::null_mut(),
        len: 0,
        owned: false,
    };

    /// The memory a receive lands in, taken over (with the pack buffer it may own).
    #[inline]
    pub fn recv(b: RecvBuffer) -> OpBuffer {
        OpBuffer {
            ptr: b.ptr,
            len: b.len,
            owned: b.owned,
        }
    }

    /// The data of a send, taken over (with the pack buffer it may own).
    #[inline]
    pub fn send(d: SendData) -> OpBuffer {
        let (ptr, len, owned) = d.into_parts();
        OpBuffer {
            ptr: ptr.cast_mut(),
            len,
            owned,
        }
    }

    /// `len` (not 0) fresh bytes, owned; `None` without memory.
    pub fn alloc(len: usize) -> Option<OpBuffer> {
        // SAFETY: a plain allocation, checked for null below.
        let ptr = unsafe { libc::malloc(len) } as *mut u8;
        (!ptr.is_null()).then_some(OpBuffer {
            ptr,
            len,
            owned: true,
        })
    }

    /// `len` bytes at `ptr` that the caller keeps.
    ///
    /// # Safety
    /// As the type's invariant: the bytes stay valid until the operations posted with
    /// them complete.
    #[inline]
    pub unsafe fn kept(ptr: *mut u8, len: usize) -> OpBuffer {
        OpBuffer {
            ptr,
            len,
            owned: false,
        }
    }

    #[inline(always)]
    pub fn len(self) -> usize {
        self.len
    }

    #[inline(always)]
    pub fn is_empty(self) -> bool {
        self.len == 0
    }

    #[inline(always)]
    pub fn owned(self) -> bool {
        self.owned
    }

    /// Where the memory starts, as an address (to place a multi-receive fragment).
    #[inline(always)]
    pub fn addr(self) -> usize {
        self.ptr as usize
    }

    /// The memory as a range to post.
    #[inline(always)]
    pub fn local(self) -> crate::fabric::Local {
        // SAFETY: the type's invariant: the bytes stay valid until the operations
        // posted with them complete; the user does not touch a buffer an MPI operation
        // is using, and this crate reaches the bytes only through `bytes` and
        // `write_at`, whose callers promise that no operation uses them.
        unsafe { crate::fabric::Local::new(self.ptr.cast(), self.len, ptr::null_mut()) }
    }

    /// The bytes from `at` on, at most `len` of them (none past the end).
    ///
    /// # Safety
    /// No operation writes the bytes while the slice lives (the receive that wrote
    /// them completed), nor does anything else, and the buffer is not freed meanwhile.
    #[inline]
    pub unsafe fn bytes<'a>(self, at: usize, len: usize) -> &'a [u8] {
        if self.ptr.is_null() || at >= self.len {
            return &[];
        }
        // SAFETY: at < len, so the slice lies inside the buffer (the invariant); the
        // caller's promise keeps it unchanged.
        unsafe { std::slice::from_raw_parts(self.ptr.add(at), len.min(self.len - at)) }
    }

    /// Copy `bytes` in at `at`, as much as fits; the bytes copied.
    ///
    /// # Safety
    /// No operation reads or writes the buffer now, nor does anything else.
    #[inline]
    pub unsafe fn write_at(self, at: usize, bytes: &[u8]) -> usize {
        if self.ptr.is_null() || at >= self.len {
            return 0;
        }
        let n = bytes.len().min(self.len - at);
        // SAFETY: n <= len - at, inside the buffer (the invariant); the caller's promise
        // makes this the only access.
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(at), n) };
        n
    }

    /// Free an owned buffer (nothing otherwise).
    ///
    /// # Safety
    /// No operation uses the buffer any more, and no copy of this value is used
    /// afterwards.
    #[inline]
    pub unsafe fn free(self) {
        if self.owned {
            // SAFETY: owned buffers come from libc::malloc (`alloc`, a pack buffer of
            // `region`); the caller's promise makes this the last use.
            unsafe { libc::free(self.ptr.cast()) };
        }
    }
}

impl Convertor {
    /// Deliver `src`, bytes received into a buffer of ours, to the user's memory: a
    /// copy when it is one contiguous block, else an unpack. Returns the bytes
    /// delivered (at most the convertor's packed size).
    pub fn deliver(self, src: &[u8]) -> usize {
        let Info { size, contig } = self.info();
        let n = src.len().min(size);
        if n == 0 {
            return 0;
        }
        match contig {
            // SAFETY: start is the user's contiguous buffer of `size` bytes (the
            // convertor's invariant), n <= size, and src is ours, so they do not overlap.
            Some(start) => unsafe { ptr::copy_nonoverlapping(src.as_ptr(), start, n) },
            None => self.unpack(&src[..n]),
        }
        n
    }
}
