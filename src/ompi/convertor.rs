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
