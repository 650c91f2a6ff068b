//! The data path's safe view of the fabric. The unsafe part of posting an operation is
//! three promises, each carried by a type whose constructor is `unsafe`:
//! - [`Serialized`]: no other thread calls into the domain's objects now (or the domain
//!   is `FI_THREAD_SAFE`); the lock that serialises progress hands it out;
//! - [`SendBuf`] / [`RecvBuf`]: the memory stays valid (and, for a receive, untouched by
//!   anyone but the provider) until the operation's completion is reaped;
//! - [`OpContext`]: the context stays valid until then, and the completion hands it
//!   back.
//!
//! Given those, [`EpRef`] posts and [`CqRef`] polls with safe `#[inline]` one-call
//! methods: no allocation, no lock, no reference count per call. Both are borrowed
//! views of an open object: from its owner ([`Endpoint::data_path`],
//! [`CompletionQueue::tagged`]), or, for a component that keeps the owner elsewhere,
//! from the raw fid with the promise that it stays open ([`EpRef::from_raw`]).
//!
//! What it owns: discharging the data-path contract of `ep.rs`. What it must not touch:
//! opening or closing objects (the owners').

use super::buffer::OpContext;
use super::cq::CompletionQueue;
use super::ep::Endpoint;
use super::error::{Error, Result};
use super::FI_ADDR_UNSPEC;
use libfabric_sys as fi;
use libfabric_sys::{fi_addr_t, fi_cq_tagged_entry};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};

/// Proof that, while it lives, no other thread calls into the objects of the domain it
/// is used with, or that the domain is `FI_THREAD_SAFE`. Not `Send`: it stands for the
/// lock (or the single thread) of the thread that holds it.
pub struct Serialized<'a>(PhantomData<(&'a (), *const ())>);

impl Serialized<'_> {
    /// # Safety
    /// Until the value is dropped, no other thread calls into the objects of the domain
    /// it is used with, unless that domain's threading level is `FI_THREAD_SAFE`.
    #[inline(always)]
    pub unsafe fn assume() -> Self {
        Serialized(PhantomData)
    }
}

/// The context of one operation at `ctx`, an `fi_context2` the provider may use as
/// scratch (`FI_CONTEXT`/`FI_CONTEXT2` mode) and that the completion hands back: for a
/// component whose contexts live in structures of its own layout (the MTL's requests)
/// rather than in a [`Scratch`](super::buffer::Scratch).
///
/// # Safety
/// `ctx` stays valid, and neither read nor written by anyone but the provider, from
/// each post that uses it until that operation's completion is reaped.
#[inline(always)]
pub unsafe fn op_context(ctx: NonNull<fi::fi_context2>) -> OpContext {
    OpContext::from_raw(ctx.as_ptr().cast())
}

/// Memory a send reads.
#[derive(Clone, Copy, Debug)]
pub struct SendBuf {
    ptr: *const u8,
    len: usize,
}

impl SendBuf {
    /// No data (a zero-byte message).
    pub const EMPTY: SendBuf = SendBuf {
        ptr: ptr::null(),
        len: 0,
    };

    /// # Safety
    /// `ptr` holds `len` readable bytes (or `len` is 0) that stay valid and unchanged
    /// until the completion of every operation posted with the buffer is reaped.
    #[inline(always)]
    pub unsafe fn new(ptr: *const u8, len: usize) -> Self {
        SendBuf { ptr, len }
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
    fn iov(self) -> fi::iovec {
        fi::iovec {
            iov_base: self.ptr as *mut c_void,
            iov_len: self.len,
        }
    }
}

/// Memory a receive (or an RMA read) writes.
#[derive(Clone, Copy, Debug)]
pub struct RecvBuf {
    ptr: *mut u8,
    len: usize,
}

impl RecvBuf {
    /// No room (a zero-byte receive).
    pub const EMPTY: RecvBuf = RecvBuf {
        ptr: ptr::null_mut(),
        len: 0,
    };

    /// # Safety
    /// `ptr` holds `len` writable bytes (or `len` is 0) that stay valid, and that no
    /// one but the provider reads or writes, until the completion of every operation
    /// posted with the buffer is reaped.
    #[inline(always)]
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        RecvBuf { ptr, len }
    }

    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first `n` bytes (at most all of them), under the same promise.
    #[inline(always)]
    pub fn prefix(self, n: usize) -> RecvBuf {
        RecvBuf {
            ptr: self.ptr,
            len: n.min(self.len),
        }
    }

    #[inline(always)]
    fn iov(self) -> fi::iovec {
        fi::iovec {
            iov_base: self.ptr.cast(),
            iov_len: self.len,
        }
    }
}

/// Map a posting call's return value: 0 is success, negative is an error.
#[inline(always)]
fn posted(ret: isize) -> Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(Error::from_ret(ret))
    }
}

/// An open endpoint, borrowed for `'a`.
#[derive(Clone, Copy, Debug)]
pub struct EpRef<'a> {
    fid: NonNull<fi::fid_ep>,
    _open: PhantomData<&'a Endpoint>,
}

impl Endpoint {
    /// This endpoint as the data path posts through it.
    #[inline(always)]
    pub fn data_path(&self) -> EpRef<'_> {
        EpRef {
            fid: self.fid(),
            _open: PhantomData,
        }
    }
}

impl<'a> EpRef<'a> {
    /// # Safety
    /// `ep` is an open endpoint that stays open for `'a`.
    #[inline(always)]
    pub unsafe fn from_raw(ep: NonNull<fi::fid_ep>) -> Self {
        EpRef {
            fid: ep,
            _open: PhantomData,
        }
    }

    #[inline(always)]
    fn ep(self) -> *mut fi::fid_ep {
        self.fid.as_ptr()
    }

    /// `fi_tsend`, or `fi_tsenddata` with remote CQ data `data`.
    #[inline]
    pub fn tsend(
        self,
        _s: &Serialized<'_>,
        buf: SendBuf,
        dest: fi_addr_t,
        tag: u64,
        data: Option<u64>,
        ctx: OpContext,
    ) -> Result<()> {
        let (p, len, c) = (buf.ptr.cast(), buf.len, ctx.as_ptr());
        // SAFETY: the endpoint is open for 'a; the buffer and the context stay valid until
        // the completion (their constructors' promises); calls are serialised (`_s`).
        posted(unsafe {
            match data {
                Some(d) => fi::fi_tsenddata(self.ep(), p, len, ptr::null_mut(), d, dest, tag, c),
                None => fi::fi_tsend(self.ep(), p, len, ptr::null_mut(), dest, tag, c),
            }
        })
    }

    /// `fi_tinject` (or `fi_tinjectdata`): the provider copies `buf` before returning; no
    /// completion. `buf` must not exceed the inject size.
    #[inline]
    pub fn tinject(
        self,
        _s: &Serialized<'_>,
        buf: &[u8],
        dest: fi_addr_t,
        tag: u64,
        data: Option<u64>,
    ) -> Result<()> {
        let (p, len) = (buf.as_ptr().cast(), buf.len());
        // SAFETY: the endpoint is open for 'a; buf is valid for the call, which copies it;
        // calls are serialised (`_s`).
        posted(unsafe {
            match data {
                Some(d) => fi::fi_tinjectdata(self.ep(), p, len, d, dest, tag),
                None => fi::fi_tinject(self.ep(), p, len, dest, tag),
            }
        })
    }

    /// `fi_trecv` into `buf`, and, when `overflow` is not empty, `fi_trecvv` into `buf`
    /// then `overflow` (where a longer message goes instead of being truncated).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn trecv(
        self,
        _s: &Serialized<'_>,
        buf: RecvBuf,
        overflow: RecvBuf,
        src: fi_addr_t,
        tag: u64,
        ignore: u64,
        ctx: OpContext,
    ) -> Result<()> {
        let c = ctx.as_ptr();
        if overflow.is_empty() {
            // SAFETY: the endpoint is open for 'a; the buffer and the context stay valid
            // until the completion (their constructors' promises); calls are serialised.
            return posted(unsafe {
                fi::fi_trecv(
                    self.ep(),
                    buf.ptr.cast(),
                    buf.len,
                    ptr::null_mut(),
                    src,
                    tag,
                    ignore,
                    c,
                )
            });
        }
        let iov = [buf.iov(), overflow.iov()];
        // SAFETY: the endpoint is open for 'a; both buffers and the context stay valid until
        // the completion (their constructors' promises); the provider copies the iovec array
        // before returning.
        posted(unsafe {
            fi::fi_trecvv(
                self.ep(),
                iov.as_ptr(),
                ptr::null_mut(),
                2,
                src,
                tag,
                ignore,
                c,
            )
        })
    }

    /// `fi_trecvmsg` with `FI_PEEK`: is a message of `tag`/`ignore` from `src` waiting?
    /// The answer is a completion (found) or an `FI_ENOMSG` error completion.
    #[inline]
    pub fn tpeek(
        self,
        _s: &Serialized<'_>,
        src: fi_addr_t,
        tag: u64,
        ignore: u64,
        ctx: OpContext,
    ) -> Result<()> {
        let msg = fi::fi_msg_tagged {
            msg_iov: ptr::null(),
            desc: ptr::null_mut(),
            iov_count: 0,
            addr: src,
            tag,
            ignore,
            context: ctx.as_ptr(),
            data: 0,
        };
        // SAFETY: the endpoint is open for 'a; a peek transfers no data; msg lives for the
        // call (the provider copies it); the context stays valid until the completion;
        // calls are serialised.
        posted(unsafe { fi::fi_trecvmsg(self.ep(), &msg, fi::FI_PEEK as u64) })
    }

    /// `fi_send` of `buf` (untagged), or `fi_sendv` of `buf` then `more` when `more` is
    /// not empty.
    #[inline]
    pub fn send(
        self,
        _s: &Serialized<'_>,
        buf: SendBuf,
        more: SendBuf,
        dest: fi_addr_t,
        ctx: OpContext,
    ) -> Result<()> {
        let c = ctx.as_ptr();
        if more.is_empty() {
            // SAFETY: the endpoint is open for 'a; the buffer and the context stay valid
            // until the completion (their constructors' promises); calls are serialised.
            return posted(unsafe {
                fi::fi_send(self.ep(), buf.ptr.cast(), buf.len, ptr::null_mut(), dest, c)
            });
        }
        let iov = [buf.iov(), more.iov()];
        // SAFETY: the endpoint is open for 'a; both buffers and the context stay valid until
        // the completion (their constructors' promises); the provider copies the iovec array
        // before returning.
        posted(unsafe { fi::fi_sendv(self.ep(), iov.as_ptr(), ptr::null_mut(), 2, dest, c) })
    }

    /// `fi_inject` (untagged): the provider copies `buf` before returning.
    #[inline]
    pub fn inject(self, _s: &Serialized<'_>, buf: &[u8], dest: fi_addr_t) -> Result<()> {
        // SAFETY: the endpoint is open for 'a; buf is valid for the call, which copies it;
        // calls are serialised.
        posted(unsafe { fi::fi_inject(self.ep(), buf.as_ptr().cast(), buf.len(), dest) })
    }

    /// `fi_recv` from any source (untagged), or, with `multi`, `fi_recvmsg` of a
    /// multi-receive buffer (`FI_MULTI_RECV`), which the provider fills message after
    /// message until it reports the buffer released.
    #[inline]
    pub fn recv(
        self,
        _s: &Serialized<'_>,
        buf: RecvBuf,
        multi: bool,
        ctx: OpContext,
    ) -> Result<()> {
        let c = ctx.as_ptr();
        if !multi {
            // SAFETY: the endpoint is open for 'a; the buffer and the context stay valid
            // until the completion (their constructors' promises); calls are serialised.
            return posted(unsafe {
                fi::fi_recv(
                    self.ep(),
                    buf.ptr.cast(),
                    buf.len,
                    ptr::null_mut(),
                    FI_ADDR_UNSPEC,
                    c,
                )
            });
        }
        let mut iov = buf.iov();
        let mut desc: *mut c_void = ptr::null_mut();
        let msg = fi::fi_msg {
            msg_iov: &mut iov,
            desc: &mut desc,
            iov_count: 1,
            addr: FI_ADDR_UNSPEC,
            context: c,
            data: 0,
        };
        // SAFETY: the endpoint is open for 'a; the buffer and the context stay valid until the
        // completion (their constructors' promises); msg and what it points to live for the call (the
        // provider copies them).
        posted(unsafe { fi::fi_recvmsg(self.ep(), &msg, fi::FI_MULTI_RECV as u64) })
    }

    /// `fi_read`: RMA read of `buf.len()` bytes at the peer's `addr` (registration `key`)
    /// into `buf`. The peer keeps the region registered until it hears the read is done.
    #[inline]
    pub fn read(
        self,
        _s: &Serialized<'_>,
        buf: RecvBuf,
        src: fi_addr_t,
        addr: u64,
        key: u64,
        ctx: OpContext,
    ) -> Result<()> {
        // SAFETY: the endpoint is open for 'a; the local buffer and the context stay valid
        // until the completion (their constructors' promises); a remote region that is
        // gone fails the read on the peer's side, it does not touch our memory; calls
        // are serialised.
        posted(unsafe {
            fi::fi_read(
                self.ep(),
                buf.ptr.cast(),
                buf.len,
                ptr::null_mut(),
                src,
                addr,
                key,
                ctx.as_ptr(),
            )
        })
    }

    /// `fi_cancel` of the operation posted with `ctx` (one that already completed is
    /// not found). A cancelled operation still completes, with `FI_ECANCELED`.
    #[inline]
    pub fn cancel(self, _s: &Serialized<'_>, ctx: OpContext) -> Result<()> {
        // SAFETY: the endpoint is open for 'a; the provider only compares ctx with its
        // posted operations; calls are serialised.
        let ret = unsafe { fi::fi_cancel(&mut (*self.ep()).fid, ctx.as_ptr()) };
        posted(ret)
    }
}

/// An open completion queue of the tagged format, borrowed for `'a`.
#[derive(Clone, Copy, Debug)]
pub struct CqRef<'a> {
    fid: NonNull<fi::fid_cq>,
    _open: PhantomData<&'a CompletionQueue>,
}

impl CompletionQueue {
    /// This queue as the data path polls it; `None` unless it has the tagged format.
    #[inline(always)]
    pub fn tagged(&self) -> Option<CqRef<'_>> {
        if self.format() != fi::FI_CQ_FORMAT_TAGGED {
            return None;
        }
        Some(CqRef {
            fid: self.fid(),
            _open: PhantomData,
        })
    }
}

impl<'a> CqRef<'a> {
    /// # Safety
    /// `cq` is an open completion queue of the tagged format (`FI_CQ_FORMAT_TAGGED`)
    /// that stays open for `'a`.
    #[inline(always)]
    pub unsafe fn from_raw(cq: NonNull<fi::fid_cq>) -> Self {
        CqRef {
            fid: cq,
            _open: PhantomData,
        }
    }

    /// `fi_cq_read` into `entries`: the completions read (none for `-FI_EAGAIN`), or
    /// `Err(Error::AVAIL)` when an error completion is at the head (fetch it with
    /// [`CqRef::readerr`]). Reading also drives the provider's manual progress.
    #[inline]
    pub fn read<'e>(
        self,
        _s: &Serialized<'_>,
        entries: &'e mut [MaybeUninit<fi_cq_tagged_entry>],
    ) -> Result<&'e [fi_cq_tagged_entry]> {
        // SAFETY: the CQ is open for 'a and tagged-format, so the provider writes at most
        // entries.len() whole tagged entries into the slice; calls are serialised.
        let ret = unsafe {
            fi::fi_cq_read(
                self.fid.as_ptr(),
                entries.as_mut_ptr().cast(),
                entries.len(),
            )
        };
        if ret >= 0 {
            let n = (ret as usize).min(entries.len());
            // SAFETY: fi_cq_read wrote the first n entries.
            Ok(unsafe { std::slice::from_raw_parts(entries.as_ptr().cast(), n) })
        } else {
            let e = Error::from_ret(ret);
            if e.is_again() {
                Ok(&[])
            } else {
                Err(e)
            }
        }
    }

    /// `fi_cq_readerr`: the error completion at the head, `Ok(None)` if there is none.
    /// Its `err_data` points at the provider's buffer, valid until the next call on
    /// this CQ (nothing is copied: error completions answer every probe that finds
    /// nothing).
    #[inline]
    pub fn readerr(self, _s: &Serialized<'_>) -> Result<Option<fi::fi_cq_err_entry>> {
        // err_data_size 0: the provider points err_data at its own buffer (API >= 1.5).
        let mut e = fi::fi_cq_err_entry::default();
        // SAFETY: the CQ is open for 'a; e is a valid, zeroed error entry; calls are
        // serialised.
        let ret = unsafe { fi::fi_cq_readerr(self.fid.as_ptr(), &mut e, 0) };
        if ret < 0 {
            let err = Error::from_ret(ret);
            return if err.is_again() { Ok(None) } else { Err(err) };
        }
        Ok((ret > 0).then_some(e))
    }
}
