//! [`Endpoint`]: the owner of a `fid_ep` (`fi_endpoint`), with the control calls (bind,
//! enable, getname, setopt) as safe methods, and the few tagged calls the fabric tests
//! drive with raw pointers (`tests/fabric.rs`) as `unsafe` one-call wrappers. The
//! components post through the typed API of `post.rs` ([`Endpoint::data_path`]).
//!
//! Every posting method returns `Ok(())` when the operation was queued,
//! `Err(Error::AGAIN)` when the provider is out of resources (progress the CQs and
//! retry) and another `Err` on failure.
//!
//! Contexts: providers that require `FI_CONTEXT`/`FI_CONTEXT2` mode use the memory at
//! `context` as scratch space until the completion is reaped, so `context` must then
//! point to a (zeroable) `fi_context2` (or `fi_context`) that outlives the operation.

use super::av::AddressVector;
use super::cq::CompletionQueue;
use super::domain::Domain;
use super::error::{check, Error, Result};
use super::info::InfoRef;
use libfabric_sys as fi;
use libfabric_sys::fi_addr_t;
use std::ffi::c_void;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex};

/// Objects kept alive because they are bound to the endpoint.
enum Bound {
    Av(#[allow(dead_code)] Arc<AddressVector>),
    Cq(#[allow(dead_code)] Arc<CompletionQueue>),
    /// The scalable endpoint a transmit or receive context belongs to.
    Parent(#[allow(dead_code)] Arc<Endpoint>),
}

/// An open endpoint.
///
/// Invariant: `fid` is an open `fid_ep` owned by this value, opened on `domain`; every
/// AV and CQ bound to it is held in `bound` until after it is closed.
pub struct Endpoint {
    fid: NonNull<fi::fid_ep>,
    domain: Arc<Domain>,
    bound: Mutex<Vec<Bound>>,
}

// SAFETY: the endpoint is only used through libfabric calls, whose thread safety is
// the domain's negotiated threading level; below FI_THREAD_SAFE the caller serializes
// (module docs of `fabric`; the unsafe data-path methods repeat it). `bound` is a Mutex.
unsafe impl Send for Endpoint {}
// SAFETY: as for Send.
unsafe impl Sync for Endpoint {}

/// Map a posting call's return value: 0 is success, negative is an error.
#[inline(always)]
fn posted(ret: isize) -> Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(Error::from_ret(ret))
    }
}

impl Endpoint {
    /// `fi_endpoint` on `domain`, with `info` (default: the info the domain was opened
    /// with). Bind an AV and CQ(s), then [`Endpoint::enable`].
    pub fn open(domain: &Arc<Domain>, info: Option<InfoRef<'_>>) -> Result<Endpoint> {
        let owned;
        let info_ptr = match info {
            Some(i) => {
                owned = i.to_owned()?;
                owned.as_open_ptr()
            }
            None => domain.owned_info().as_open_ptr(),
        };
        let mut fid: *mut fi::fid_ep = ptr::null_mut();
        // SAFETY: the domain is open (we hold an Arc); info_ptr is a valid fi_info that
        // fi_endpoint only reads; out pointer valid; context NULL is allowed.
        check(unsafe { fi::fi_endpoint(domain.as_ptr(), info_ptr, &mut fid, ptr::null_mut()) })?;
        let fid = NonNull::new(fid).ok_or(Error::NOMEM)?;
        Ok(Endpoint {
            fid,
            domain: Arc::clone(domain),
            bound: Mutex::new(Vec::new()),
        })
    }

    /// `fi_scalable_ep` on `domain` with `info`, whose `ep_attr` names the number of
    /// transmit and receive contexts. Bind an AV, enable, then open the contexts with
    /// [`Endpoint::tx_context`] and [`Endpoint::rx_context`].
    pub fn open_scalable(domain: &Arc<Domain>, info: InfoRef<'_>) -> Result<Endpoint> {
        let owned = info.to_owned()?;
        let mut fid: *mut fi::fid_ep = ptr::null_mut();
        // SAFETY: as in `open`.
        check(unsafe {
            fi::fi_scalable_ep(
                domain.as_ptr(),
                owned.as_open_ptr(),
                &mut fid,
                ptr::null_mut(),
            )
        })?;
        let fid = NonNull::new(fid).ok_or(Error::NOMEM)?;
        Ok(Endpoint {
            fid,
            domain: Arc::clone(domain),
            bound: Mutex::new(Vec::new()),
        })
    }

    /// `fi_tx_context(sep, index)`: transmit context `index` of this scalable endpoint
    /// (which it keeps alive). Bind a CQ with `FI_TRANSMIT` and enable it.
    pub fn tx_context(self: &Arc<Self>, index: usize) -> Result<Endpoint> {
        self.context(index, true)
    }

    /// `fi_rx_context(sep, index)`: receive context `index`, as [`Endpoint::tx_context`].
    pub fn rx_context(self: &Arc<Self>, index: usize) -> Result<Endpoint> {
        self.context(index, false)
    }

    fn context(self: &Arc<Self>, index: usize, tx: bool) -> Result<Endpoint> {
        let mut fid: *mut fi::fid_ep = ptr::null_mut();
        let index = index as i32;
        // SAFETY: the scalable endpoint is open; default attributes (NULL); out pointer
        // valid; context NULL is allowed.
        check(unsafe {
            if tx {
                fi::fi_tx_context(
                    self.fid.as_ptr(),
                    index,
                    ptr::null_mut(),
                    &mut fid,
                    ptr::null_mut(),
                )
            } else {
                fi::fi_rx_context(
                    self.fid.as_ptr(),
                    index,
                    ptr::null_mut(),
                    &mut fid,
                    ptr::null_mut(),
                )
            }
        })?;
        let fid = NonNull::new(fid).ok_or(Error::NOMEM)?;
        let ep = Endpoint {
            fid,
            domain: Arc::clone(&self.domain),
            bound: Mutex::new(Vec::new()),
        };
        ep.keep(Bound::Parent(Arc::clone(self)));
        Ok(ep)
    }

    pub fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    fn keep(&self, b: Bound) {
        self.bound.lock().unwrap_or_else(|p| p.into_inner()).push(b);
    }

    fn as_fid(&self) -> *mut fi::fid {
        // SAFETY: fid is a valid fid_ep; taking the address of its embedded fid.
        unsafe { &mut (*self.fid.as_ptr()).fid }
    }

    /// `fi_ep_bind` of an address vector. The endpoint keeps the AV alive.
    pub fn bind_av(&self, av: &Arc<AddressVector>) -> Result<()> {
        // SAFETY: both objects are open; the AV stays alive while bound (kept below).
        check(unsafe { fi::fi_ep_bind(self.fid.as_ptr(), av.as_fid(), 0) })?;
        self.keep(Bound::Av(Arc::clone(av)));
        Ok(())
    }

    /// `fi_ep_bind` of a completion queue with `flags`: `FI_TRANSMIT`, `FI_RECV`, or
    /// both, optionally `| FI_SELECTIVE_COMPLETION`. The endpoint keeps the CQ alive.
    pub fn bind_cq(&self, cq: &Arc<CompletionQueue>, flags: u64) -> Result<()> {
        // SAFETY: both objects are open; the CQ stays alive while bound (kept below).
        check(unsafe { fi::fi_ep_bind(self.fid.as_ptr(), cq.as_fid(), flags) })?;
        self.keep(Bound::Cq(Arc::clone(cq)));
        Ok(())
    }

    /// `fi_enable`: after binding, before posting.
    pub fn enable(&self) -> Result<()> {
        // SAFETY: the endpoint is open.
        check(unsafe { fi::fi_enable(self.fid.as_ptr()) })
    }

    /// `fi_getname`: this endpoint's address, the bytes peers insert into their AV.
    pub fn getname(&self) -> Result<Vec<u8>> {
        let mut cap = fi::FI_NAME_MAX as usize;
        loop {
            let mut buf = vec![0u8; cap];
            let mut len = cap;
            // SAFETY: the endpoint is open; buf has len writable bytes.
            let ret = unsafe { fi::fi_getname(self.as_fid(), buf.as_mut_ptr().cast(), &mut len) };
            match check(ret) {
                Ok(()) => {
                    buf.truncate(len.min(cap));
                    return Ok(buf);
                }
                Err(e) if e == Error(fi::FI_ETOOSMALL as i32) && len > cap => cap = len,
                Err(e) => return Err(e),
            }
        }
    }

    /// `fi_setopt(ep, level, optname, value, size_of::<T>())`, e.g.
    /// `FI_OPT_ENDPOINT, FI_OPT_EFA_RNR_RETRY, &n_retries: &usize`, before `enable`.
    ///
    /// # Safety
    /// `T` must be the type the option is documented to take (the provider may read
    /// its own idea of the size).
    pub unsafe fn setopt<T>(&self, level: i32, optname: i32, value: &T) -> Result<()> {
        // SAFETY: the endpoint is open; value is valid for size_of::<T>() bytes, the
        // type is the caller's contract.
        check(unsafe {
            fi::fi_setopt(
                self.as_fid(),
                level,
                optname,
                (value as *const T).cast(),
                std::mem::size_of::<T>(),
            )
        })
    }

    /// `fi_getopt(ep, level, optname, value, size_of::<T>())`.
    ///
    /// # Safety
    /// `T` must be the type the option is documented to return.
    pub unsafe fn getopt<T>(&self, level: i32, optname: i32, value: &mut T) -> Result<usize> {
        let mut len = std::mem::size_of::<T>();
        // SAFETY: the endpoint is open; value is writable for len bytes, the type is
        // the caller's contract.
        check(unsafe {
            fi::fi_getopt(
                self.as_fid(),
                level,
                optname,
                (value as *mut T).cast(),
                &mut len,
            )
        })?;
        Ok(len)
    }

    /// The raw endpoint, for calls this crate does not wrap.
    #[inline]
    pub fn as_ptr(&self) -> *mut fi::fid_ep {
        self.fid.as_ptr()
    }

    /// The open fid (the invariant), for the data path's view of it (`post.rs`).
    #[inline(always)]
    pub(super) fn fid(&self) -> NonNull<fi::fid_ep> {
        self.fid
    }

    // ----------------------------------------------------------------------------
    // Raw tagged calls, for the fabric tests (the components use `post.rs`). Common
    // safety contract of every method below:
    // - every buffer (and iovec/desc array and message struct) passed in stays valid,
    //   and is neither freed nor (for receives and RMA targets) read or written by
    //   anyone else, until the operation's completion is reaped from the CQ (for the
    //   inject variants: until the call returns);
    // - `desc` is NULL or the `MemoryRegion::desc()` of a registration covering the
    //   buffer that outlives the operation (required when the domain has FI_MR_LOCAL);
    // - `context` is what the completion will carry; with FI_CONTEXT/FI_CONTEXT2 mode
    //   it must point to an `fi_context2` that outlives the operation;
    // - `addr` is an `fi_addr_t` from an AV bound to this endpoint (or FI_ADDR_UNSPEC
    //   for receives) and remote `addr`/`key` pairs denote a live remote registration;
    // - below FI_THREAD_SAFE the caller serializes calls on this domain's objects.
    // ----------------------------------------------------------------------------

    /// `fi_tsend`.
    ///
    /// # Safety
    /// The buffer must stay valid until the completion is reaped; see the data-path
    /// contract in the source above (desc, context, address, threading).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tsend(
        &self,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: fi_addr_t,
        tag: u64,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_tsend(self.fid.as_ptr(), buf, len, desc, dest, tag, context) })
    }

    /// `fi_tinject`: the buffer may be reused when the call returns; no completion.
    /// `len` must not exceed the domain's inject size.
    ///
    /// # Safety
    /// `buf` is valid for `len` bytes for the call; see the data-path contract.
    #[inline]
    pub unsafe fn tinject(
        &self,
        buf: *const c_void,
        len: usize,
        dest: fi_addr_t,
        tag: u64,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_tinject(self.fid.as_ptr(), buf, len, dest, tag) })
    }

    /// `fi_trecv`: match `tag` with the bits of `ignore` ignored.
    ///
    /// # Safety
    /// The buffer must stay valid, and untouched by anyone else, until the completion
    /// is reaped; see the data-path contract.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn trecv(
        &self,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        src: fi_addr_t,
        tag: u64,
        ignore: u64,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe {
            fi::fi_trecv(self.fid.as_ptr(), buf, len, desc, src, tag, ignore, context)
        })
    }

    /// `fi_cancel` of the operation posted with `context`. A cancelled operation
    /// completes with an error entry (`FI_ECANCELED`) that must still be reaped before
    /// its buffers and context are released.
    ///
    /// # Safety
    /// `context` identifies an operation posted on this endpoint (or is one the
    /// provider will not find); below FI_THREAD_SAFE the caller serializes.
    #[inline]
    pub unsafe fn cancel(&self, context: *mut c_void) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_cancel(self.as_fid(), context) })
    }
}

impl Endpoint {
    /// `FI_OPT_MIN_MULTI_RECV`: the provider releases a multi-receive buffer once less
    /// than `min` bytes are left in it.
    pub fn set_min_multi_recv(&self, min: usize) -> Result<()> {
        // SAFETY: FI_OPT_MIN_MULTI_RECV takes a size_t, which `min` is.
        unsafe {
            self.setopt(
                fi::FI_OPT_ENDPOINT as i32,
                fi::FI_OPT_MIN_MULTI_RECV as i32,
                &min,
            )
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: fid is open and owned (invariant); memory regions bound to this
        // endpoint hold an Arc of it, so none is still open. The bound AV/CQs and the
        // domain are released after this (field drop order), i.e. after the close.
        unsafe { super::close_fid(self.as_fid(), "endpoint") }
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("domain", &self.domain.name())
            .field("fid", &self.fid)
            .finish()
    }
}
