//! [`Endpoint`]: the owner of a `fid_ep` (`fi_endpoint`), with the control calls (bind,
//! enable, getname, setopt) as safe methods and the data-path calls as `unsafe`
//! `#[inline]` one-call wrappers taking raw pointers, for the MTL and BTL hot paths.
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
use libfabric_sys::{fi_addr_t, fi_msg_tagged, iovec};
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
    // Data path. Common safety contract of every method below:
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

    /// `fi_tsenddata`: with remote CQ data.
    ///
    /// # Safety
    /// The buffer must stay valid until the completion is reaped; see the data-path
    /// contract in the source above.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tsenddata(
        &self,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        data: u64,
        dest: fi_addr_t,
        tag: u64,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe {
            fi::fi_tsenddata(self.fid.as_ptr(), buf, len, desc, data, dest, tag, context)
        })
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

    /// `fi_tinjectdata`: [`Endpoint::tinject`] with remote CQ data.
    ///
    /// # Safety
    /// `buf` is valid for `len` bytes for the call; see the data-path contract.
    #[inline]
    pub unsafe fn tinjectdata(
        &self,
        buf: *const c_void,
        len: usize,
        data: u64,
        dest: fi_addr_t,
        tag: u64,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_tinjectdata(self.fid.as_ptr(), buf, len, data, dest, tag) })
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

    /// `fi_tsendv`: gather from `count` iovecs.
    ///
    /// # Safety
    /// The iovecs' buffers must stay valid until the completion is reaped; `iov` and
    /// `desc` (NULL or `count` entries) are valid for the call; see the data-path
    /// contract.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tsendv(
        &self,
        iov: *const iovec,
        desc: *mut *mut c_void,
        count: usize,
        dest: fi_addr_t,
        tag: u64,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_tsendv(self.fid.as_ptr(), iov, desc, count, dest, tag, context) })
    }

    /// `fi_trecvv`: scatter into `count` iovecs.
    ///
    /// # Safety
    /// The iovecs' buffers must stay valid until the completion is reaped; see the
    /// data-path contract.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn trecvv(
        &self,
        iov: *const iovec,
        desc: *mut *mut c_void,
        count: usize,
        src: fi_addr_t,
        tag: u64,
        ignore: u64,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe {
            fi::fi_trecvv(
                self.fid.as_ptr(),
                iov,
                desc,
                count,
                src,
                tag,
                ignore,
                context,
            )
        })
    }

    /// `fi_tsendmsg` with `flags` (`FI_REMOTE_CQ_DATA`, `FI_INJECT`,
    /// `FI_COMPLETION`, `FI_TRANSMIT_COMPLETE`, ...).
    ///
    /// # Safety
    /// `msg` and its arrays are valid for the call; the buffers it describes stay valid
    /// until the completion is reaped; see the data-path contract.
    #[inline]
    pub unsafe fn tsendmsg(&self, msg: *const fi_msg_tagged, flags: u64) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_tsendmsg(self.fid.as_ptr(), msg, flags) })
    }

    /// `fi_trecvmsg` with `flags` (`FI_PEEK`, `FI_CLAIM`, `FI_DISCARD`, ...).
    ///
    /// # Safety
    /// As [`Endpoint::tsendmsg`]; with `FI_PEEK | FI_CLAIM` the context must stay valid
    /// until the claiming receive completes.
    #[inline]
    pub unsafe fn trecvmsg(&self, msg: *const fi_msg_tagged, flags: u64) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_trecvmsg(self.fid.as_ptr(), msg, flags) })
    }

    /// `fi_send` (untagged message).
    ///
    /// # Safety
    /// The buffer must stay valid until the completion is reaped; see the data-path
    /// contract.
    #[inline]
    pub unsafe fn send(
        &self,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: fi_addr_t,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_send(self.fid.as_ptr(), buf, len, desc, dest, context) })
    }

    /// `fi_senddata` (untagged, with remote CQ data).
    ///
    /// # Safety
    /// The buffer must stay valid until the completion is reaped; see the data-path
    /// contract.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn senddata(
        &self,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        data: u64,
        dest: fi_addr_t,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_senddata(self.fid.as_ptr(), buf, len, desc, data, dest, context) })
    }

    /// `fi_recv` (untagged message).
    ///
    /// # Safety
    /// The buffer must stay valid, and untouched by anyone else, until the completion
    /// is reaped; see the data-path contract.
    #[inline]
    pub unsafe fn recv(
        &self,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        src: fi_addr_t,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_recv(self.fid.as_ptr(), buf, len, desc, src, context) })
    }

    /// `fi_recvmsg` of one multi-receive buffer (`FI_MULTI_RECV`) from any source.
    ///
    /// # Safety
    /// As [`Endpoint::recv`].
    #[inline]
    pub unsafe fn recv_multi(
        &self,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { recv_multi(self.fid.as_ptr(), buf, len, desc, context) })
    }

    /// `fi_inject` (untagged, buffer reusable on return, no completion).
    ///
    /// # Safety
    /// `buf` is valid for `len` bytes for the call; see the data-path contract.
    #[inline]
    pub unsafe fn inject(&self, buf: *const c_void, len: usize, dest: fi_addr_t) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_inject(self.fid.as_ptr(), buf, len, dest) })
    }

    /// `fi_read`: RMA read of `len` bytes at remote `addr` (registration `key`) into
    /// `buf`.
    ///
    /// # Safety
    /// The local buffer must stay valid, and untouched, until the completion is reaped;
    /// the remote region must stay registered until then; see the data-path contract.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn read(
        &self,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        src: fi_addr_t,
        addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_read(self.fid.as_ptr(), buf, len, desc, src, addr, key, context) })
    }

    /// `fi_readmsg` of one buffer with explicit operation `flags` (`FI_COMPLETION` is
    /// always added), for flags the endpoint does not have by default.
    ///
    /// # Safety
    /// As [`Endpoint::read`].
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn read_flags(
        &self,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        src: fi_addr_t,
        addr: u64,
        key: u64,
        context: *mut c_void,
        flags: u64,
    ) -> Result<()> {
        with_rma_msg(buf, len, desc, src, addr, key, context, |msg| {
            // SAFETY: the endpoint is open; msg and what it points to live during the
            // call (the provider copies them); the buffers are the caller's contract.
            posted(unsafe {
                fi::fi_readmsg(self.fid.as_ptr(), msg, flags | fi::FI_COMPLETION as u64)
            })
        })
    }

    /// `fi_write`: RMA write of `buf` to remote `addr` (registration `key`).
    ///
    /// # Safety
    /// The local buffer must stay valid until the completion is reaped; the remote
    /// region must stay registered until then; see the data-path contract.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn write(
        &self,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: fi_addr_t,
        addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe { fi::fi_write(self.fid.as_ptr(), buf, len, desc, dest, addr, key, context) })
    }

    /// `fi_writemsg` of one buffer with explicit `flags` (`FI_COMPLETION` is added):
    /// for `FI_DELIVERY_COMPLETE` on a write, which a provider may not apply from the
    /// endpoint's default op flags.
    ///
    /// # Safety
    /// As [`Endpoint::write`].
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn write_flags(
        &self,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: fi_addr_t,
        addr: u64,
        key: u64,
        context: *mut c_void,
        flags: u64,
    ) -> Result<()> {
        with_rma_msg(
            buf as *mut c_void,
            len,
            desc,
            dest,
            addr,
            key,
            context,
            |msg| {
                // SAFETY: the endpoint is open; msg and what it points to live during the
                // call (the provider copies them); the buffers are the caller's contract.
                posted(unsafe {
                    fi::fi_writemsg(self.fid.as_ptr(), msg, flags | fi::FI_COMPLETION as u64)
                })
            },
        )
    }

    /// `fi_writedata`: [`Endpoint::write`] with remote CQ data.
    ///
    /// # Safety
    /// As [`Endpoint::write`].
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn writedata(
        &self,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        data: u64,
        dest: fi_addr_t,
        addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the endpoint is open; the rest is the caller's contract.
        posted(unsafe {
            fi::fi_writedata(
                self.fid.as_ptr(),
                buf,
                len,
                desc,
                data,
                dest,
                addr,
                key,
                context,
            )
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

/// Run `f` with the `fi_msg_rma` of one local buffer and one remote range (the form
/// `fi_readmsg` and `fi_writemsg` take); the message points at locals of this call.
#[inline]
#[allow(clippy::too_many_arguments)]
fn with_rma_msg<R>(
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    peer: fi_addr_t,
    addr: u64,
    key: u64,
    context: *mut c_void,
    f: impl FnOnce(&fi::fi_msg_rma) -> R,
) -> R {
    let iov = fi::iovec {
        iov_base: buf,
        iov_len: len,
    };
    let mut d = desc;
    let rma = fi::fi_rma_iov { addr, len, key };
    let msg = fi::fi_msg_rma {
        msg_iov: &iov,
        desc: &mut d,
        iov_count: 1,
        addr: peer,
        rma_iov: &rma,
        rma_iov_count: 1,
        context,
        data: 0,
    };
    f(&msg)
}

/// `fi_recvmsg(ep, ...)` of one multi-receive buffer (`FI_MULTI_RECV`) from any source;
/// the provider's return value. For the data paths that keep raw endpoint pointers.
///
/// # Safety
/// `ep` is an open endpoint; `buf` (and `desc`, a descriptor or null) stay valid until
/// the provider releases the buffer or the endpoint closes; `context` as for `fi_recv`.
#[inline]
pub unsafe fn recv_multi(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    context: *mut c_void,
) -> isize {
    let mut iov = libc::iovec {
        iov_base: buf,
        iov_len: len,
    };
    let mut desc = desc;
    let msg = fi::fi_msg {
        msg_iov: &mut iov as *mut libc::iovec as *const _,
        desc: &mut desc,
        iov_count: 1,
        addr: u64::MAX, // FI_ADDR_UNSPEC
        context,
        data: 0,
    };
    // SAFETY: msg and what it points to live for the call (the provider copies them);
    // the rest is the caller's contract.
    unsafe { fi::fi_recvmsg(ep, &msg, fi::FI_MULTI_RECV as u64) }
}

/// The bytes a receive completion reports in a buffer of `cap` bytes at `base`: `len`
/// bytes at its start, or, in a multi-receive buffer (`multi`), at the completion's
/// `buf`. The length is clamped to the buffer (a provider never reports more than was
/// posted); `None` when `buf` lies outside the buffer.
///
/// # Safety
/// `base` holds `cap` bytes, valid and unchanged for `'a`.
#[inline]
pub unsafe fn received<'a>(
    base: *const u8,
    cap: usize,
    multi: bool,
    buf: *const c_void,
    len: usize,
) -> Option<&'a [u8]> {
    let at = if multi {
        (buf as usize).wrapping_sub(base as usize)
    } else {
        0
    };
    if at >= cap {
        return None;
    }
    // SAFETY: at < cap, so the slice lies inside the buffer (caller's contract).
    Some(unsafe { std::slice::from_raw_parts(base.add(at), len.min(cap - at)) })
}
