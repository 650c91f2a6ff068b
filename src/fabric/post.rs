//! The data path's one posting API, for both components. The unsafe part of posting
//! an operation is three promises, each carried by a type whose constructor is
//! `unsafe`:
//! - [`Serialized`]: no other thread calls into the domain's objects now (or the domain
//!   is `FI_THREAD_SAFE`); the lock that serialises progress hands it out;
//! - [`Local`] (`buffer.rs`): the memory stays valid for the operation's accesses (and,
//!   where the provider writes it, untouched by anyone else) until its completion is
//!   reaped;
//! - [`OpContext`] (`buffer.rs`): the context stays valid until then, and the
//!   completion hands it back.
//!
//! Given those, [`EpRef`] posts and [`CqRef`] polls with safe `#[inline]` one-call
//! methods: no allocation, no lock, no reference count per call. Both are borrowed
//! views of an open object: from its owner ([`Endpoint::data_path`],
//! [`CompletionQueue::tagged`]), or, for a component that keeps the owner elsewhere,
//! from the raw fid with the promise that it stays open ([`EpRef::from_raw`]).
//!
//! # Which domain a `Serialized` is for
//! The proof is not branded with its domain: a brand would have to travel in every
//! `EpRef` and be compared on every post. Misuse is ruled out by where proofs come
//! from instead. The crate makes them only in `MaybeLockGuard::serialized`
//! (`common::sync`), and each lock serialises exactly one domain: the MTL opens one
//! domain and posts under its `Mtl::lock` only; each BTL module opens one domain and
//! posts only under its own `State::fi_lock` (`State::fi`), on endpoints of
//! that `State`. A proof borrows its guard, so it cannot outlive the lock it stands
//! for.
//!
//! What it owns: discharging the data-path contract of libfabric's posting calls.
//! What it must not touch: opening or closing objects (the owners').

use super::buffer::{Local, OpContext};
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

/// Which way an RMA operation moves data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Write,
    Read,
}

/// The far side of an RMA or atomic operation: the peer, the target address as its
/// registration expects it, and the registration's key. Safe to name: the peer's
/// provider lets an operation reach only what the key registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    pub peer: fi_addr_t,
    pub addr: u64,
    pub key: u64,
}

/// An atomic's datatype and operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtomicOp {
    pub datatype: fi::fi_datatype,
    pub op: fi::fi_op,
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

/// The iovec of a range.
#[inline(always)]
fn iov(l: Local) -> fi::iovec {
    fi::iovec {
        iov_base: l.addr(),
        iov_len: l.len(),
    }
}

/// The descriptor array of a two-range vector operation: null when neither range has
/// a descriptor (what a provider without `FI_MR_LOCAL` is given), else both.
#[inline(always)]
fn descs2(d: &mut [*mut c_void; 2]) -> *mut *mut c_void {
    if d[0].is_null() && d[1].is_null() {
        ptr::null_mut()
    } else {
        d.as_mut_ptr()
    }
}

/// An open endpoint, borrowed for `'a`. Equal views are of the same endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
        buf: Local,
        dest: fi_addr_t,
        tag: u64,
        data: Option<u64>,
        ctx: OpContext,
    ) -> Result<()> {
        let (p, len, d, c) = (buf.addr(), buf.len(), buf.desc(), ctx.as_ptr());
        // SAFETY: the endpoint is open for 'a; `Local` keeps the buffer (and its
        // descriptor) valid and `OpContext` the context until the completion is reaped;
        // `_s` says no other thread is in the domain.
        posted(unsafe {
            match data {
                Some(cqd) => fi::fi_tsenddata(self.ep(), p, len, d, cqd, dest, tag, c),
                None => fi::fi_tsend(self.ep(), p, len, d, dest, tag, c),
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
        // SAFETY: the endpoint is open for 'a; an inject reads `buf` only during the
        // call, for which the borrow keeps it valid; `_s` serialises the domain.
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
        buf: Local,
        overflow: Local,
        src: fi_addr_t,
        tag: u64,
        ignore: u64,
        ctx: OpContext,
    ) -> Result<()> {
        let c = ctx.as_ptr();
        if overflow.is_empty() {
            let (p, len, d) = (buf.addr(), buf.len(), buf.desc());
            // SAFETY: the endpoint is open for 'a; `Local` keeps the buffer writable by
            // the provider alone and `OpContext` the context valid until the completion
            // is reaped; `_s` serialises the domain.
            return posted(unsafe { fi::fi_trecv(self.ep(), p, len, d, src, tag, ignore, c) });
        }
        let v = [iov(buf), iov(overflow)];
        let mut d = [buf.desc(), overflow.desc()];
        // SAFETY: as for fi_trecv, for both ranges; the iovec and descriptor arrays
        // live for the call, which copies them.
        posted(unsafe {
            fi::fi_trecvv(
                self.ep(),
                v.as_ptr(),
                descs2(&mut d),
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
        // SAFETY: the endpoint is open for 'a; a peek transfers no data; msg lives for
        // the call, which copies it; `OpContext` keeps the context valid until the
        // completion; `_s` serialises the domain.
        posted(unsafe { fi::fi_trecvmsg(self.ep(), &msg, fi::FI_PEEK as u64) })
    }

    /// `fi_send` of `buf` (untagged), or `fi_sendv` of `buf` then `more` when `more` is
    /// not empty.
    #[inline]
    pub fn send(
        self,
        _s: &Serialized<'_>,
        buf: Local,
        more: Local,
        dest: fi_addr_t,
        ctx: OpContext,
    ) -> Result<()> {
        let c = ctx.as_ptr();
        if more.is_empty() {
            let (p, len, d) = (buf.addr(), buf.len(), buf.desc());
            // SAFETY: the endpoint is open for 'a; `Local` keeps the buffer readable and
            // `OpContext` the context valid until the completion is reaped; `_s`
            // serialises the domain.
            return posted(unsafe { fi::fi_send(self.ep(), p, len, d, dest, c) });
        }
        let v = [iov(buf), iov(more)];
        let mut d = [buf.desc(), more.desc()];
        // SAFETY: as for fi_send, for both ranges; the iovec and descriptor arrays live
        // for the call, which copies them.
        posted(unsafe { fi::fi_sendv(self.ep(), v.as_ptr(), descs2(&mut d), 2, dest, c) })
    }

    /// `fi_inject` (untagged): the provider copies `buf` before returning.
    #[inline]
    pub fn inject(self, _s: &Serialized<'_>, buf: &[u8], dest: fi_addr_t) -> Result<()> {
        // SAFETY: the endpoint is open for 'a; an inject reads `buf` only during the
        // call, for which the borrow keeps it valid; `_s` serialises the domain.
        posted(unsafe { fi::fi_inject(self.ep(), buf.as_ptr().cast(), buf.len(), dest) })
    }

    /// `fi_recv` from any source (untagged), or, with `multi`, `fi_recvmsg` of a
    /// multi-receive buffer (`FI_MULTI_RECV`), which the provider fills message after
    /// message until it reports the buffer released.
    #[inline]
    pub fn recv(self, _s: &Serialized<'_>, buf: Local, multi: bool, ctx: OpContext) -> Result<()> {
        let c = ctx.as_ptr();
        if !multi {
            let (p, len, d) = (buf.addr(), buf.len(), buf.desc());
            // SAFETY: the endpoint is open for 'a; `Local` keeps the buffer writable by
            // the provider alone and `OpContext` the context valid until the completion
            // is reaped; `_s` serialises the domain.
            return posted(unsafe { fi::fi_recv(self.ep(), p, len, d, FI_ADDR_UNSPEC, c) });
        }
        let mut v = iov(buf);
        let mut desc = buf.desc();
        let msg = fi::fi_msg {
            msg_iov: &mut v,
            desc: &mut desc,
            iov_count: 1,
            addr: FI_ADDR_UNSPEC,
            context: c,
            data: 0,
        };
        // SAFETY: as for fi_recv, until the completion that releases the buffer; msg
        // and what it points to live for the call, which copies them.
        posted(unsafe { fi::fi_recvmsg(self.ep(), &msg, fi::FI_MULTI_RECV as u64) })
    }

    /// An RMA write of `local` to `remote`, or a read of `remote` into it, with
    /// explicit operation `flags` when they are not 0 (`fi_writemsg`/`fi_readmsg`,
    /// for `FI_DELIVERY_COMPLETE`, which a provider may not apply from the endpoint's
    /// default op flags; `FI_COMPLETION` is added), else `fi_write`/`fi_read`.
    #[inline]
    pub fn rma(
        self,
        _s: &Serialized<'_>,
        dir: Dir,
        local: Local,
        remote: Remote,
        ctx: OpContext,
        flags: u64,
    ) -> Result<()> {
        let (buf, len, desc, c) = (local.addr(), local.len(), local.desc(), ctx.as_ptr());
        let Remote { peer, addr, key } = remote;
        if flags == 0 {
            // SAFETY: the endpoint is open for 'a; `Local` keeps the local range valid
            // for the transfer (and, for a read, written by the provider alone) and
            // `OpContext` the context until the completion is reaped; the remote range
            // is the peer provider's to check against the key; `_s` serialises.
            return posted(unsafe {
                match dir {
                    Dir::Write => fi::fi_write(self.ep(), buf, len, desc, peer, addr, key, c),
                    Dir::Read => fi::fi_read(self.ep(), buf, len, desc, peer, addr, key, c),
                }
            });
        }
        let v = fi::iovec {
            iov_base: buf,
            iov_len: len,
        };
        let mut d = desc;
        let rma = fi::fi_rma_iov { addr, len, key };
        let msg = fi::fi_msg_rma {
            msg_iov: &v,
            desc: &mut d,
            iov_count: 1,
            addr: peer,
            rma_iov: &rma,
            rma_iov_count: 1,
            context: c,
            data: 0,
        };
        let flags = flags | fi::FI_COMPLETION as u64;
        // SAFETY: as for fi_write/fi_read above; msg and what it points to live for
        // the call, which copies them.
        posted(unsafe {
            match dir {
                Dir::Write => fi::fi_writemsg(self.ep(), &msg, flags),
                Dir::Read => fi::fi_readmsg(self.ep(), &msg, flags),
            }
        })
    }

    /// A non-fetching atomic of the one element at `operand` on `remote`: with
    /// `delivery`, by `fi_atomicmsg` with `FI_DELIVERY_COMPLETE` (it completes once
    /// applied at the target), else by `fi_atomic`.
    #[inline]
    pub fn atomic(
        self,
        _s: &Serialized<'_>,
        operand: Local,
        remote: Remote,
        op: AtomicOp,
        ctx: OpContext,
        delivery: bool,
    ) -> Result<()> {
        let Remote { peer, addr, key } = remote;
        if !delivery {
            // SAFETY: the endpoint is open for 'a; `Local` keeps the operand readable
            // and `OpContext` the context valid until the completion is reaped; `_s`
            // serialises the domain.
            return posted(unsafe {
                fi::fi_atomic(
                    self.ep(),
                    operand.addr(),
                    1,
                    ptr::null_mut(),
                    peer,
                    addr,
                    key,
                    op.datatype,
                    op.op,
                    ctx.as_ptr(),
                )
            });
        }
        let ioc = fi::fi_ioc {
            addr: operand.addr(),
            count: 1,
        };
        let rma = fi::fi_rma_ioc {
            addr,
            count: 1,
            key,
        };
        let mut desc: *mut c_void = ptr::null_mut();
        let msg = fi::fi_msg_atomic {
            msg_iov: &ioc,
            desc: &mut desc,
            iov_count: 1,
            addr: peer,
            rma_iov: &rma,
            rma_iov_count: 1,
            datatype: op.datatype,
            op: op.op,
            context: ctx.as_ptr(),
            data: 0,
        };
        // SAFETY: as for fi_atomic above; msg and what it points to live for the call,
        // which copies them.
        posted(unsafe {
            fi::fi_atomicmsg(
                self.ep(),
                &msg,
                (fi::FI_DELIVERY_COMPLETE | fi::FI_COMPLETION) as u64,
            )
        })
    }

    /// `fi_fetch_atomic` of the one element at `operand` on `remote`, the previous
    /// value into `result`.
    #[inline]
    pub fn fetch_atomic(
        self,
        _s: &Serialized<'_>,
        operand: Local,
        result: Local,
        remote: Remote,
        op: AtomicOp,
        ctx: OpContext,
    ) -> Result<()> {
        let Remote { peer, addr, key } = remote;
        // SAFETY: the endpoint is open for 'a; `Local` keeps the operand readable and
        // the result writable by the provider alone, and `OpContext` the context valid,
        // until the completion is reaped; `_s` serialises the domain.
        posted(unsafe {
            fi::fi_fetch_atomic(
                self.ep(),
                operand.addr(),
                1,
                ptr::null_mut(),
                result.addr(),
                result.desc(),
                peer,
                addr,
                key,
                op.datatype,
                op.op,
                ctx.as_ptr(),
            )
        })
    }

    /// `fi_compare_atomic` (`FI_CSWAP`) of the one element at `operand` against the
    /// one at `compare` on `remote`, the previous value into `result`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn compare_atomic(
        self,
        _s: &Serialized<'_>,
        operand: Local,
        compare: Local,
        result: Local,
        remote: Remote,
        datatype: fi::fi_datatype,
        ctx: OpContext,
    ) -> Result<()> {
        let Remote { peer, addr, key } = remote;
        // SAFETY: the endpoint is open for 'a; `Local` keeps operand and compare value
        // readable and the result writable by the provider alone, and `OpContext` the
        // context valid, until the completion is reaped; `_s` serialises the domain.
        posted(unsafe {
            fi::fi_compare_atomic(
                self.ep(),
                operand.addr(),
                1,
                ptr::null_mut(),
                compare.addr(),
                ptr::null_mut(),
                result.addr(),
                result.desc(),
                peer,
                addr,
                key,
                datatype,
                fi::FI_CSWAP,
                ctx.as_ptr(),
            )
        })
    }

    /// `fi_cancel` of the operation posted with `ctx` (one that already completed is
    /// not found). A cancelled operation still completes, with `FI_ECANCELED`.
    #[inline]
    pub fn cancel(self, _s: &Serialized<'_>, ctx: OpContext) -> Result<()> {
        // SAFETY: the endpoint is open for 'a; the provider only compares ctx with its
        // posted operations; `_s` serialises the domain.
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
