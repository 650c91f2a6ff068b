//! [`CompletionQueue`]: the owner of a `fid_cq` (`fi_cq_open`), tagged format by
//! default. [`CompletionQueue::read`] is the progress hot path; error completions are
//! fetched with [`CompletionQueue::readerr`] into an owned [`CqErrEntry`].

use super::domain::Domain;
use super::error::{check, Error, Result};
use super::post::Serialized;
use libfabric_sys as fi;
use libfabric_sys::fi_cq_tagged_entry;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

/// Attributes for [`CompletionQueue::open`].
#[derive(Clone, Copy, Debug)]
pub struct CqAttr {
    /// Number of entries (0 = provider default).
    pub size: usize,
    /// `FI_CQ_FORMAT_*`; [`CompletionQueue::read`] needs `FI_CQ_FORMAT_TAGGED`.
    pub format: fi::fi_cq_format,
    /// `FI_WAIT_NONE` (polling, the default) or a wait object.
    pub wait_obj: fi::fi_wait_obj,
}

impl Default for CqAttr {
    fn default() -> Self {
        CqAttr {
            size: 0,
            format: fi::FI_CQ_FORMAT_TAGGED,
            wait_obj: fi::FI_WAIT_NONE,
        }
    }
}

/// An error completion, copied out of the provider (`fi_cq_readerr`).
#[derive(Clone)]
pub struct CqErrEntry {
    /// The positive `FI_E*` code (e.g. `FI_ECANCELED`, `FI_ETRUNC`).
    pub err: i32,
    /// Provider-specific error number, for [`CompletionQueue::strerror`].
    pub prov_errno: i32,
    /// The context given when the operation was posted.
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub buf: *mut c_void,
    pub data: u64,
    pub tag: u64,
    /// Overflow length (bytes that did not fit, for `FI_ETRUNC`).
    pub olen: usize,
    /// Provider error data, copied (the provider reuses its buffer).
    pub err_data: Vec<u8>,
}

impl CqErrEntry {
    /// `err` as an [`Error`].
    pub fn error(&self) -> Error {
        Error(self.err)
    }
}

impl fmt::Debug for CqErrEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqErrEntry")
            .field("err", &self.error())
            .field("prov_errno", &self.prov_errno)
            .field("op_context", &self.op_context)
            .field("flags", &format_args!("{:#x}", self.flags))
            .field("len", &self.len)
            .field("tag", &format_args!("{:#x}", self.tag))
            .field("olen", &self.olen)
            .finish()
    }
}

/// An open completion queue.
///
/// Invariant: `fid` is an open `fid_cq` owned by this value, opened on `domain` with
/// `format`.
pub struct CompletionQueue {
    fid: NonNull<fi::fid_cq>,
    format: fi::fi_cq_format,
    domain: Arc<Domain>,
}

// SAFETY: the CQ is only used through libfabric calls, whose thread safety is the
// domain's negotiated threading level; below FI_THREAD_SAFE the caller serializes
// (module docs of `fabric`). With FI_THREAD_COMPLETION it must serialize per CQ.
unsafe impl Send for CompletionQueue {}
// SAFETY: as for Send.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// `fi_cq_open` on `domain`.
    pub fn open(domain: &Arc<Domain>, attr: &CqAttr) -> Result<Arc<CompletionQueue>> {
        let mut a = fi::fi_cq_attr {
            size: attr.size,
            format: attr.format,
            wait_obj: attr.wait_obj,
            ..Default::default()
        };
        let mut fid: *mut fi::fid_cq = ptr::null_mut();
        // SAFETY: the domain is open (we hold an Arc); attr and out pointer are valid
        // for the call; context NULL is allowed.
        check(unsafe { fi::fi_cq_open(domain.as_ptr(), &mut a, &mut fid, ptr::null_mut()) })?;
        let fid = NonNull::new(fid).ok_or(Error::NOMEM)?;
        Ok(Arc::new(CompletionQueue {
            fid,
            format: attr.format,
            domain: Arc::clone(domain),
        }))
    }

    pub fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    pub fn format(&self) -> fi::fi_cq_format {
        self.format
    }

    /// `fi_cq_read` into `entries`: the number of completions read, `Ok(0)` when there
    /// are none (`-FI_EAGAIN`), `Err(Error::AVAIL)` when an error completion is at the
    /// head (fetch it with [`CompletionQueue::readerr`]). Reading also drives the
    /// provider's manual progress. The CQ must have been opened with the tagged format
    /// (`Err(INVAL)` otherwise). `_s`: calls on the domain are serialised now (two
    /// threads must not read one CQ at once below `FI_THREAD_SAFE`).
    #[inline]
    pub fn read(&self, s: &Serialized<'_>, entries: &mut [fi_cq_tagged_entry]) -> Result<usize> {
        // SAFETY: an initialised entry is a valid MaybeUninit entry, and the provider
        // writes only whole, valid entries.
        let uninit = unsafe {
            std::slice::from_raw_parts_mut(
                entries
                    .as_mut_ptr()
                    .cast::<std::mem::MaybeUninit<fi_cq_tagged_entry>>(),
                entries.len(),
            )
        };
        self.read_uninit(s, uninit).map(|e| e.len())
    }

    /// [`CompletionQueue::read`] into uninitialised storage (the data path polls with a
    /// stack array it need not clear each time); returns the entries read.
    #[inline]
    pub fn read_uninit<'e>(
        &self,
        s: &Serialized<'_>,
        entries: &'e mut [std::mem::MaybeUninit<fi_cq_tagged_entry>],
    ) -> Result<&'e [fi_cq_tagged_entry]> {
        self.tagged().ok_or(Error::INVAL)?.read(s, entries)
    }

    /// `fi_cq_read` into a buffer of the CQ's own format; returns the raw result
    /// (`-FI_EAGAIN` included).
    ///
    /// # Safety
    /// `buf` must have room for `count` entries of the format the CQ was opened with.
    #[inline]
    pub unsafe fn read_raw(&self, buf: *mut c_void, count: usize) -> isize {
        // SAFETY: the CQ is open; buffer size is the caller's contract.
        unsafe { fi::fi_cq_read(self.fid.as_ptr(), buf, count) }
    }

    /// `fi_cq_readerr`: the error completion at the head of the queue, `Ok(None)` if
    /// there is none, with the provider's error data copied.
    pub fn readerr(&self, _s: &Serialized<'_>) -> Result<Option<CqErrEntry>> {
        // err_data_size 0: the provider points err_data at its own buffer (API >= 1.5).
        let mut e = fi::fi_cq_err_entry::default();
        // SAFETY: the CQ is open; e is a valid, zeroed error entry; calls on the domain
        // are serialised (`_s`).
        let ret = unsafe { fi::fi_cq_readerr(self.fid.as_ptr(), &mut e, 0) };
        if ret < 0 {
            let err = Error::from_ret(ret);
            return if err.is_again() { Ok(None) } else { Err(err) };
        }
        if ret == 0 {
            return Ok(None);
        }
        let err_data = if e.err_data.is_null() || e.err_data_size == 0 {
            Vec::new()
        } else {
            // SAFETY: the provider set err_data to err_data_size bytes that stay valid
            // until the next readerr on this CQ; we copy them now.
            unsafe { std::slice::from_raw_parts(e.err_data.cast::<u8>(), e.err_data_size) }.to_vec()
        };
        Ok(Some(CqErrEntry {
            err: e.err,
            prov_errno: e.prov_errno,
            op_context: e.op_context,
            flags: e.flags,
            len: e.len,
            buf: e.buf,
            data: e.data,
            tag: e.tag,
            olen: e.olen,
            err_data,
        }))
    }

    /// `fi_cq_strerror`: the provider's description of an error completion.
    pub fn strerror(&self, entry: &CqErrEntry) -> String {
        let mut buf = vec![0u8; 256];
        let err_data: *const c_void = if entry.err_data.is_empty() {
            ptr::null()
        } else {
            entry.err_data.as_ptr().cast()
        };
        // SAFETY: the CQ is open; err_data is NULL or our copy of the provider's error
        // data; buf has buf.len() writable bytes. The result points into buf or to a
        // static string.
        let p = unsafe {
            fi::fi_cq_strerror(
                self.fid.as_ptr(),
                entry.prov_errno,
                err_data,
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if p.is_null() {
            return entry.error().to_string();
        }
        if p.cast::<u8>() == buf.as_ptr() {
            // Copied into buf, possibly truncated without a terminator (strncpy).
            if let Some(last) = buf.last_mut() {
                *last = 0;
            }
            return CStr::from_bytes_until_nul(&buf)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
        }
        // SAFETY: p is not buf, so it is a static NUL-terminated string of the provider.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// The raw CQ, for calls this crate does not wrap.
    pub fn as_ptr(&self) -> *mut fi::fid_cq {
        self.fid.as_ptr()
    }

    /// The open fid (the invariant), for the data path's view of it (`post.rs`).
    #[inline(always)]
    pub(super) fn fid(&self) -> NonNull<fi::fid_cq> {
        self.fid
    }

    pub(crate) fn as_fid(&self) -> *mut fi::fid {
        // SAFETY: fid is a valid fid_cq; taking the address of its embedded fid.
        unsafe { &mut (*self.fid.as_ptr()).fid }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: fid is open and owned (invariant); endpoints bound to this CQ hold an
        // Arc of it, so none is still open. The domain Arc is released afterwards.
        unsafe { super::close_fid(self.as_fid(), "cq") }
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("domain", &self.domain.name())
            .field("format", &self.format)
            .finish()
    }
}
