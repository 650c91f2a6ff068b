//! What each completion does to its request: a send's parts, a receive's status
//! and unpacking, a synchronous send's acknowledgement, probes and claims, and the
//! error completions of each kind.
//!
//! What it owns: the end of every operation the data path posts. What it must not
//! touch: reading the completion queue (`progress`).

use super::peer::{envelope, peer_addr};
use super::progress::retry;
use super::request::{Kind, Request};
use super::state::{rx_leave, Mtl};
use super::tag::{Envelope, Proto};
use crate::ompi;
use crate::ompi::comm::Comm;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;

/// # Safety
/// `e.op_context` must be the ctx of a live Request.
pub(super) unsafe fn on_completion(m: &Mtl, e: &fi::fi_cq_tagged_entry) {
    if e.op_context.is_null() {
        return;
    }
    // SAFETY: forwarded.
    let r = unsafe { Request::from_ctx(e.op_context) };
    // SAFETY: r is live until we complete it.
    let kind = unsafe { (*r).kind };
    match kind {
        Kind::Bounce => {
            if let Some(sm) = m.soft.as_deref() {
                // SAFETY: r is one of the bounce requests, e its completion.
                unsafe { super::softmatch::bounce_completed(m, sm, r, e) };
            }
        }
        Kind::SmRead => {
            // SAFETY: r is a live receive reading its message.
            unsafe { super::softmatch::read_done(m, r) };
        }
        Kind::Copied => {
            if let Some(sm) = m.soft.as_deref() {
                // SAFETY: a Copied request is a Box leaked when posting, owning its buffer.
                unsafe { super::softmatch::copied_sent(sm, r) };
            }
        }
        Kind::Send => {
            // SAFETY: r is live.
            unsafe { finish_part(r) };
        }
        Kind::Ack => {
            // SAFETY: Ack requests are the pool's, and this one's receive completed.
            unsafe { super::ack::arrived(m, r, e.tag) };
        }
        Kind::Recv => {
            // SAFETY: r is a live receive.
            unsafe {
                rx_leave(m, r);
                recv_done(m, r, e.tag, e.data, e.len, true, sys::MPI_SUCCESS as c_int)
            };
        }
        Kind::Claim => {
            // SAFETY: r is a live claim receive (on the heap, owned by a message).
            unsafe {
                (*r).matched_tag = e.tag;
                (*r).matched_data = e.data;
                (*r).status.count = e.len;
                let comm = (*r).comm();
                match comm.and_then(|c| Ok((c, envelope(m, c, e.tag, e.data)?))) {
                    Ok((comm, env)) if env.proto == Proto::Sync => {
                        send_ack(m, comm, env.source, env.sync_id)
                    }
                    Ok(_) => {}
                    Err(_) => (*r).status.error = sys::MPI_ERR_INTERN as c_int,
                }
                (*r).pending.store(0, Ordering::Release);
            }
        }
        Kind::Probe | Kind::Stash => {
            // SAFETY: r is a live probe on its caller's stack, or the breaker's request
            // it waits for.
            unsafe {
                (*r).probe_found = true;
                (*r).matched_tag = e.tag;
                (*r).matched_data = e.data;
                (*r).status.count = e.len;
                (*r).pending.store(0, Ordering::Release);
            }
        }
    }
}

/// One expected completion of `r` arrived; complete it when it was the last.
///
/// # Safety
/// `r` must be live.
pub(super) unsafe fn finish_part(r: *mut Request) {
    // SAFETY: forwarded.
    unsafe {
        if (*r).pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            if (*r).owns_buffer {
                libc::free((*r).buffer as *mut c_void);
                (*r).owns_buffer = false;
            }
            if ompi::request::has_pml(&(*r).sup) {
                Request::complete_to_pml(r);
            }
        }
    }
}

/// Complete receive `r` with the message of `tag`/`data` (remote CQ data), `len`
/// bytes long. `ack`: acknowledge a synchronous send (the provider matched it; false
/// where software matching acknowledges itself or the message was not delivered).
/// The data word is read whether or not the completion carries FI_REMOTE_CQ_DATA,
/// as the C MTL does: sockets leaves the flag off on some completions (always when
/// the word sent was 0, i.e. from rank 0 with synchronous-send id 0).
///
/// # Safety
/// `r` must be a live receive request.
pub(super) unsafe fn recv_done(
    m: &Mtl,
    r: *mut Request,
    tag: u64,
    data: u64,
    len: usize,
    ack: bool,
    error: c_int,
) {
    // SAFETY: forwarded.
    unsafe {
        let env = (*r).comm().and_then(|comm| envelope(m, comm, tag, data));
        recv_done_with(m, r, env, len, ack, error)
    }
}

/// [`recv_done`] with the envelope already decoded by [`envelope`] (software
/// matching decodes it once per message, for the sender's address and here).
///
/// # Safety
/// `r` must be a live receive request.
pub(super) unsafe fn recv_done_with(
    m: &Mtl,
    r: *mut Request,
    env: Result<Envelope, c_int>,
    len: usize,
    ack: bool,
    error: c_int,
) {
    // SAFETY: forwarded.
    unsafe {
        let Ok(env) = env else {
            // Not a message any peer of this communicator sent: fail the receive
            // (the data that landed in the buffer is not delivered).
            (*r).status.source = sys::MPI_ANY_SOURCE;
            (*r).status.tag = sys::MPI_ANY_TAG;
            (*r).status.error = sys::MPI_ERR_INTERN as c_int;
            (*r).status.count = 0;
            if (*r).owns_buffer {
                libc::free((*r).buffer as *mut c_void);
                (*r).buffer = ptr::null_mut();
                (*r).owns_buffer = false;
            }
            Request::complete_to_pml(r);
            return;
        };
        (*r).status.source = env.source;
        (*r).status.tag = env.tag;
        // A message longer than the receive: the provider said so (error), or it
        // reported the full length (udp;ofi_rxd does not flag truncation), or the
        // excess went to the overflow area.
        (*r).status.error = if len > (*r).length {
            sys::MPI_ERR_TRUNCATE as c_int
        } else {
            error
        };
        (*r).status.count = len.min((*r).length);
        if env.proto == Proto::Sync && ack {
            if let Ok(comm) = (*r).comm() {
                send_ack(m, comm, env.source, env.sync_id);
            }
        }
        if (*r).owns_buffer {
            if let Some(conv) = (*r).convertor {
                conv.unpack(std::slice::from_raw_parts((*r).buffer, (*r).status.count));
            }
            libc::free((*r).buffer as *mut c_void);
            (*r).buffer = ptr::null_mut();
            (*r).owns_buffer = false;
        }
        Request::complete_to_pml(r);
    }
}

/// Tell the sender of a synchronous send that it was matched.
pub(super) fn send_ack(m: &Mtl, comm: Comm, source: c_int, id: u32) {
    let addr = match peer_addr(comm, source) {
        Ok(a) => a,
        Err(_) => {
            log::error!("cannot acknowledge a synchronous send from rank {source}: unknown peer");
            return;
        }
    };
    let tag = m.layout.ack_tag(id);
    let cid = comm.cid();
    let (tx, addr) = (m.ctx(cid).tx, m.rx_addr(addr, cid));
    let ret = retry(m, || {
        // SAFETY: a zero-byte inject carries no buffer; the endpoint is open.
        unsafe { fi::fi_tinject(tx, ptr::null(), 0, addr, tag) }
    });
    if ret < 0 {
        log::error!(
            "acknowledging a synchronous send to rank {source} failed: {}",
            crate::fabric::Error::from_ret(ret)
        );
    }
}

/// # Safety
/// `e.op_context` must be null or the ctx of a live Request.
pub(super) unsafe fn on_error(m: &Mtl, e: &fi::fi_cq_err_entry) {
    if e.op_context.is_null() {
        m.counters.cq_errors.fetch_add(1, Ordering::Relaxed);
        log::error!(
            "completion error without context: {}",
            crate::fabric::Error(e.err)
        );
        return;
    }
    // SAFETY: forwarded.
    let r = unsafe { Request::from_ctx(e.op_context) };
    // SAFETY: r is live.
    let kind = unsafe { (*r).kind };
    // shm reports some errors negated.
    let code = e.err.unsigned_abs();
    if kind == Kind::Recv {
        // SAFETY: r is a live receive; every error completion ends its time in the
        // provider's queue.
        unsafe { rx_leave(m, r) };
    }
    match kind {
        Kind::Probe | Kind::Stash if code == fi::FI_ENOMSG => {
            // SAFETY: live probe.
            unsafe {
                (*r).probe_found = false;
                (*r).pending.store(0, Ordering::Release);
            }
        }
        Kind::Recv if code == fi::FI_ETRUNC => {
            // SAFETY: live receive; the provider wrote at most the posted length.
            unsafe {
                let len = (*r).length;
                recv_done(
                    m,
                    r,
                    e.tag,
                    e.data,
                    len,
                    true,
                    sys::MPI_ERR_TRUNCATE as c_int,
                );
            }
        }
        Kind::Claim | Kind::Stash if code == fi::FI_ECANCELED => {
            // recv_exact's receive, cancelled: another receive took the message.
            // SAFETY: live request its caller waits for.
            unsafe {
                (*r).status.cancelled = true;
                (*r).pending.store(0, Ordering::Release);
            }
        }
        Kind::Recv if code == fi::FI_ECANCELED => {
            // SAFETY: live receive, never matched.
            unsafe {
                (*r).status.cancelled = true;
                (*r).status.error = sys::MPI_SUCCESS as c_int;
                if (*r).owns_buffer {
                    libc::free((*r).buffer as *mut c_void);
                    (*r).owns_buffer = false;
                }
                Request::complete_to_pml(r);
            }
        }
        Kind::Ack => {
            if code != fi::FI_ECANCELED {
                m.counters.cq_errors.fetch_add(1, Ordering::Relaxed);
            }
            super::ack::failed(m, r, code);
        }
        _ => {
            m.counters.cq_errors.fetch_add(1, Ordering::Relaxed);
            log::error!(
                "{kind:?} failed: {} (provider error {})",
                crate::fabric::Error(e.err),
                e.prov_errno
            );
            // SAFETY: r is live; each kind is completed the way its owner expects.
            unsafe {
                (*r).status.error = sys::MPI_ERR_INTERN as c_int;
                match kind {
                    Kind::Send => {
                        (*r).status.error = sys::MPI_ERR_INTERN as c_int;
                        // A failed send will not get its acknowledgement either.
                        (*r).pending.store(1, Ordering::Release);
                        finish_part(r);
                    }
                    // The pool's receives have their own arm above.
                    Kind::Ack => {}
                    Kind::Recv => {
                        if (*r).owns_buffer {
                            libc::free((*r).buffer as *mut c_void);
                            (*r).owns_buffer = false;
                        }
                        Request::complete_to_pml(r);
                    }
                    Kind::Claim | Kind::Probe | Kind::Stash => {
                        (*r).pending.store(0, Ordering::Release);
                    }
                    Kind::Bounce => {
                        if let Some(sm) = m.soft.as_deref() {
                            super::softmatch::bounce_failed(m, sm, r, code, e.flags);
                        }
                    }
                    Kind::Copied => {
                        // Its MPI request completed when it was posted, as an inject's
                        // does: the error is logged and counted only.
                        if let Some(sm) = m.soft.as_deref() {
                            super::softmatch::copied_sent(sm, r);
                        }
                    }
                    Kind::SmRead => {
                        (*r).kind = Kind::Recv;
                        let hdr = (*r).sm_hdr;
                        recv_done(
                            m,
                            r,
                            hdr.bits,
                            hdr.data,
                            0,
                            false,
                            sys::MPI_ERR_INTERN as c_int,
                        );
                    }
                }
            }
        }
    }
}
