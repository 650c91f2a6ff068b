//! Safe posting on an [`Endpoint`] for callers whose memory and contexts are typed
//! ([`Local`], [`OpContext`], `buffer.rs`): untagged sends, receives and injects, RMA
//! reads and writes, and atomics. Each method is an `#[inline]` wrapper of one
//! libfabric call, like the raw ones of `ep.rs`; the lifetime contract that makes it
//! sound was taken when the `Local` and the `OpContext` were made.
//!
//! Threads: below `FI_THREAD_SAFE` the caller still serialises calls on one domain
//! (see the module documentation of `fabric`), as for every data-path call.
//!
//! What it owns: nothing. What it must not touch: tagged messages (`ep.rs`, the MTL's).

use super::buffer::{Local, OpContext};
use super::domain::Domain;
use super::ep::Endpoint;
use super::error::{Error, Result};
use libfabric_sys as fi;
use libfabric_sys::fi_addr_t;
use std::ffi::c_void;
use std::ptr;

/// Map a posting call's return value: 0 is success, negative is an error.
#[inline(always)]
fn posted(ret: isize) -> Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(Error::from_ret(ret))
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

impl Endpoint {
    /// `fi_send` of `buf` to `dest`.
    #[inline]
    pub fn post_send(&self, buf: Local, dest: fi_addr_t, ctx: OpContext) -> Result<()> {
        // SAFETY: the endpoint is open; the buffer stays valid until the completion
        // (`Local`'s invariant) and so does the context (`OpContext`'s).
        unsafe { self.send(buf.addr(), buf.len(), buf.desc(), dest, ctx.as_ptr()) }
    }

    /// `fi_inject` of `bytes` to `dest`: the provider copies them before it returns.
    #[inline]
    pub fn inject_bytes(&self, bytes: &[u8], dest: fi_addr_t) -> Result<()> {
        // SAFETY: the endpoint is open; `bytes` is valid for the call, which is all
        // an inject needs.
        unsafe { self.inject(bytes.as_ptr().cast(), bytes.len(), dest) }
    }

    /// `fi_recv` into `buf` from any source.
    #[inline]
    pub fn post_recv(&self, buf: Local, ctx: OpContext) -> Result<()> {
        // SAFETY: the endpoint is open; the provider writes the buffer, which `Local`'s
        // contract keeps valid (and unwritten by others) until the completion, as
        // `OpContext`'s keeps the context.
        unsafe { self.recv(buf.addr(), buf.len(), buf.desc(), u64::MAX, ctx.as_ptr()) }
    }

    /// `fi_recvmsg` of `buf` as one multi-receive buffer (`FI_MULTI_RECV`).
    #[inline]
    pub fn post_recv_multi(&self, buf: Local, ctx: OpContext) -> Result<()> {
        // SAFETY: the endpoint is open; `Local` and `OpContext` keep the buffer and the
        // context valid until the completion that releases the buffer.
        unsafe { self.recv_multi(buf.addr(), buf.len(), buf.desc(), ctx.as_ptr()) }
    }

    /// An RMA write of `local` to `remote`, or a read of `remote` into it, with
    /// explicit operation `flags` when they are not 0 (`fi_writemsg`/`fi_readmsg`,
    /// for `FI_DELIVERY_COMPLETE`, which a provider may not apply from the endpoint's
    /// default op flags), else `fi_write`/`fi_read`.
    #[inline]
    pub fn post_rma(
        &self,
        dir: Dir,
        local: Local,
        remote: Remote,
        ctx: OpContext,
        flags: u64,
    ) -> Result<()> {
        let (buf, len, desc, c) = (local.addr(), local.len(), local.desc(), ctx.as_ptr());
        let Remote { peer, addr, key } = remote;
        // SAFETY: the endpoint is open; the local range and the context stay valid
        // until the completion (the invariants of `Local` and `OpContext`); the remote
        // range is the peer provider's to check against the key.
        unsafe {
            match (dir, flags) {
                (Dir::Write, 0) => self.write(buf, len, desc, peer, addr, key, c),
                (Dir::Write, f) => self.write_flags(buf, len, desc, peer, addr, key, c, f),
                (Dir::Read, 0) => self.read(buf, len, desc, peer, addr, key, c),
                (Dir::Read, f) => self.read_flags(buf, len, desc, peer, addr, key, c, f),
            }
        }
    }

    /// A non-fetching atomic of the one element at `operand` on `remote`: with
    /// `delivery`, by `fi_atomicmsg` with `FI_DELIVERY_COMPLETE` (it completes once
    /// applied at the target), else by `fi_atomic`.
    #[inline]
    pub fn post_atomic(
        &self,
        operand: Local,
        remote: Remote,
        op: AtomicOp,
        ctx: OpContext,
        delivery: bool,
    ) -> Result<()> {
        let Remote { peer, addr, key } = remote;
        if !delivery {
            // SAFETY: the endpoint is open; the operand and the context stay valid
            // until the completion (the invariants of `Local` and `OpContext`).
            return posted(unsafe {
                fi::fi_atomic(
                    self.as_ptr(),
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
        // SAFETY: the endpoint is open; the operand and the context stay valid until the
        // completion (`Local`, `OpContext`); msg and what it points to live for the call
        // (the provider copies them).
        posted(unsafe {
            fi::fi_atomicmsg(
                self.as_ptr(),
                &msg,
                (fi::FI_DELIVERY_COMPLETE | fi::FI_COMPLETION) as u64,
            )
        })
    }

    /// `fi_fetch_atomic` of the one element at `operand` on `remote`, the previous
    /// value into `result`.
    #[inline]
    pub fn post_fetch_atomic(
        &self,
        operand: Local,
        result: Local,
        remote: Remote,
        op: AtomicOp,
        ctx: OpContext,
    ) -> Result<()> {
        let Remote { peer, addr, key } = remote;
        // SAFETY: the endpoint is open; operand, result and context stay valid until
        // the completion (the invariants of `Local` and `OpContext`).
        posted(unsafe {
            fi::fi_fetch_atomic(
                self.as_ptr(),
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
    pub fn post_compare_atomic(
        &self,
        operand: Local,
        compare: Local,
        result: Local,
        remote: Remote,
        datatype: fi::fi_datatype,
        ctx: OpContext,
    ) -> Result<()> {
        let Remote { peer, addr, key } = remote;
        // SAFETY: the endpoint is open; operand, compare value, result and context stay
        // valid until the completion (the invariants of `Local` and `OpContext`).
        posted(unsafe {
            fi::fi_compare_atomic(
                self.as_ptr(),
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

impl Domain {
    /// Whether the provider offers atomic `op.op` on `op.datatype` for the kind of
    /// atomic `flags` names (0, `FI_FETCH_ATOMIC` or `FI_COMPARE_ATOMIC`):
    /// `fi_query_atomic`.
    pub fn query_atomic(&self, op: AtomicOp, flags: u64) -> bool {
        let mut attr = fi::fi_atomic_attr::default();
        // SAFETY: the domain is open; attr is a valid out parameter.
        unsafe { fi::fi_query_atomic(self.as_ptr(), op.datatype, op.op, &mut attr, flags) == 0 }
    }
}
