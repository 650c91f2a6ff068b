//! What each completion does to its request: a send's parts, a receive's status
//! and unpacking, a synchronous send's acknowledgement, probes and claims, and the
//! error completions of each kind.
//!
//! What it owns: the end of every operation the data path posts. What it must not
//! touch: reading the completion queue (`progress`).

use super::peer::{envelope, peer_addr};
use super::progress::retry;
use super::request::{Kind, Req};
use super::state::{rx_leave, Mtl};
use super::tag::{Envelope, Proto};
use crate::ompi::comm::Comm;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::Ordering;

/// The request a completion reports on; `None` for an operation posted without one.
#[inline(always)]
fn request_of(ctx: *mut c_void) -> Option<Req> {
    // SAFETY: every operation the MTL posts carries the context of a live request
    // (`Req::op_context`, the data path's only way to make one), which lives until this
    // completion of it is reaped; the completion queues report nothing else.
    unsafe { Req::of_context(ctx) }
}

/// A completion `e` read from a completion queue.
pub(super) fn on_completion(m: &Mtl, e: &fi::fi_cq_tagged_entry) {
    let Some(r) = request_of(e.op_context) else {
        return;
    };
    match r.kind() {
        Kind::Bounce => {
            if let Some(sm) = m.soft.as_deref() {
                super::softmatch::bounce_completed(m, sm, r, e);
            }
        }
        Kind::SmRead => super::softmatch::read_done(m, r),
        Kind::Copied => {
            if let Some(sm) = m.soft.as_deref() {
                super::softmatch::copied_sent(sm, r);
            }
        }
        Kind::Send => finish_part(r),
        Kind::Ack => super::ack::arrived(m, r, e.tag),
        Kind::Recv => {
            rx_leave(m, r);
            recv_done(m, r, e.tag, e.data, e.len, true, sys::MPI_SUCCESS as c_int);
        }
        Kind::Claim => {
            r.set_matched_tag(e.tag);
            r.set_matched_data(e.data);
            r.update_status(|s| s.count = e.len);
            let comm = r.comm().ok_or(sys::OMPI_ERR_BAD_PARAM);
            match comm.and_then(|c| Ok((c, envelope(m, c, e.tag, e.data)?))) {
                Ok((comm, env)) if env.proto == Proto::Sync => {
                    send_ack(m, comm, env.source, env.sync_id)
                }
                Ok(_) => {}
                Err(_) => r.update_status(|s| s.error = sys::MPI_ERR_INTERN as c_int),
            }
            r.pending().store(0, Ordering::Release);
        }
        Kind::Probe | Kind::Stash => {
            r.set_probe_found(true);
            r.set_matched_tag(e.tag);
            r.set_matched_data(e.data);
            r.update_status(|s| s.count = e.len);
            r.pending().store(0, Ordering::Release);
        }
    }
}

/// One expected completion of `r` arrived; complete it when it was the last.
pub(super) fn finish_part(r: Req) {
    if r.pending().fetch_sub(1, Ordering::AcqRel) == 1 {
        r.free_buffer();
        if r.has_pml() {
            r.complete_to_pml();
        }
    }
}

/// Complete receive `r` with the message of `tag`/`data` (remote CQ data), `len`
/// bytes long. `ack`: acknowledge a synchronous send (the provider matched it; false
/// where software matching acknowledges itself or the message was not delivered).
/// The data word is read whether or not the completion carries FI_REMOTE_CQ_DATA,
/// as the C MTL does: sockets leaves the flag off on some completions (always when
/// the word sent was 0, i.e. from rank 0 with synchronous-send id 0).
pub(super) fn recv_done(m: &Mtl, r: Req, tag: u64, data: u64, len: usize, ack: bool, error: c_int) {
    let env = r
        .comm()
        .ok_or(sys::OMPI_ERR_BAD_PARAM)
        .and_then(|comm| envelope(m, comm, tag, data));
    recv_done_with(m, r, env, len, ack, error)
}

/// [`recv_done`] with the envelope already decoded by [`envelope`] (software
/// matching decodes it once per message, for the sender's address and here).
pub(super) fn recv_done_with(
    m: &Mtl,
    r: Req,
    env: Result<Envelope, c_int>,
    len: usize,
    ack: bool,
    error: c_int,
) {
    let Ok(env) = env else {
        // Not a message any peer of this communicator sent: fail the receive
        // (the data that landed in the buffer is not delivered).
        r.update_status(|s| {
            s.source = sys::MPI_ANY_SOURCE;
            s.tag = sys::MPI_ANY_TAG;
            s.error = sys::MPI_ERR_INTERN as c_int;
            s.count = 0;
        });
        r.free_buffer();
        r.complete_to_pml();
        return;
    };
    // A message longer than the receive: the provider said so (error), or it
    // reported the full length (udp;ofi_rxd does not flag truncation), or the
    // excess went to the overflow area.
    let length = r.length();
    r.update_status(|s| {
        s.source = env.source;
        s.tag = env.tag;
        s.error = if len > length {
            sys::MPI_ERR_TRUNCATE as c_int
        } else {
            error
        };
        s.count = len.min(length);
    });
    if env.proto == Proto::Sync && ack {
        if let Some(comm) = r.comm() {
            send_ack(m, comm, env.source, env.sync_id);
        }
    }
    r.unpack_owned(r.status().count);
    r.complete_to_pml();
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
    let (tx, addr) = (m.ctx(cid).tx(), m.rx_addr(addr, cid));
    if let Err(e) = retry(m, |s| tx.tinject(s, &[], addr, tag, None)) {
        log::error!("acknowledging a synchronous send to rank {source} failed: {e}");
    }
}

/// An error completion `e` read from a completion queue.
pub(super) fn on_error(m: &Mtl, e: &fi::fi_cq_err_entry) {
    let Some(r) = request_of(e.op_context) else {
        m.counters.cq_errors.fetch_add(1, Ordering::Relaxed);
        log::error!(
            "completion error without context: {}",
            crate::fabric::Error(e.err)
        );
        return;
    };
    let kind = r.kind();
    // shm reports some errors negated.
    let code = e.err.unsigned_abs();
    if kind == Kind::Recv {
        // Every error completion ends a receive's time in the provider's queue.
        rx_leave(m, r);
    }
    match kind {
        Kind::Probe | Kind::Stash if code == fi::FI_ENOMSG => {
            r.set_probe_found(false);
            r.pending().store(0, Ordering::Release);
        }
        Kind::Recv if code == fi::FI_ETRUNC => {
            // The provider wrote at most the posted length.
            let len = r.length();
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
        Kind::Claim | Kind::Stash if code == fi::FI_ECANCELED => {
            // recv_exact's receive, cancelled: another receive took the message.
            r.update_status(|s| s.cancelled = true);
            r.pending().store(0, Ordering::Release);
        }
        Kind::Recv if code == fi::FI_ECANCELED => {
            // Never matched.
            r.update_status(|s| {
                s.cancelled = true;
                s.error = sys::MPI_SUCCESS as c_int;
            });
            r.free_buffer();
            r.complete_to_pml();
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
            fail(m, r, kind, code, e.flags);
        }
    }
}

/// Complete `r`, whose operation failed with `code`, the way its owner expects.
fn fail(m: &Mtl, r: Req, kind: Kind, code: u32, flags: u64) {
    r.update_status(|s| s.error = sys::MPI_ERR_INTERN as c_int);
    match kind {
        Kind::Send => {
            // A failed send will not get its acknowledgement either.
            r.pending().store(1, Ordering::Release);
            finish_part(r);
        }
        // The pool's receives have their own arm in `on_error`.
        Kind::Ack => {}
        Kind::Recv => {
            r.free_buffer();
            r.complete_to_pml();
        }
        Kind::Claim | Kind::Probe | Kind::Stash => {
            r.pending().store(0, Ordering::Release);
        }
        Kind::Bounce => {
            if let Some(sm) = m.soft.as_deref() {
                super::softmatch::bounce_failed(m, sm, r, code, flags);
            }
        }
        Kind::Copied => {
            // Its MPI request completed when it was posted, as an inject's does: the
            // error is logged and counted only.
            if let Some(sm) = m.soft.as_deref() {
                super::softmatch::copied_sent(sm, r);
            }
        }
        Kind::SmRead => {
            r.set_kind(Kind::Recv);
            let hdr = r.sm_hdr();
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
