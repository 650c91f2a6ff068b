//! Sends under provider matching (and the entry of software matching's): inject,
//! send and synchronous send, and the queue of sends that wait when the provider
//! pushes back, drained in order by progress.
//!
//! What it owns: the order of a peer's sends (MPI's non-overtaking rule) across the
//! provider's flow control. What it must not touch: receives and their queue.

use super::completion::finish_part;
use super::peer::{peer, Peer};
use super::progress::{retry, to_ompi, wait_until, with_request};
use super::request::{Kind, Req, Request};
use super::state::{locked, mtl, Entry, Mtl};
use super::tag::Proto;
use crate::fabric::{self, Local, Serialized};
use crate::ompi::comm::Comm;
use crate::ompi::convertor::{Convertor, SendData};
use ompi_sys as sys;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;

/// One data send, as it is handed to the fabric (now, or later from progress when the
/// provider pushed back).
pub(super) struct PendingSend {
    /// The request whose completion the send produces (none for an inject).
    req: Option<Req>,
    /// The communicator id (its context is the transmit context), and the peer's
    /// address (its receive context's).
    cid: u32,
    addr: u64,
    /// The data of a send with a request (the request keeps it alive).
    buf: Local,
    bits: u64,
    /// Remote CQ data, when the layout or the protocol uses it.
    cqd: Option<u64>,
    /// An inject's private copy of the data, once it waits (a deferred inject outlives
    /// the caller's buffer).
    copy: Vec<u8>,
}

// SAFETY: `buf` describes memory kept alive by the request that owns the send (the
// user's buffer or a pack buffer) until its completion; only libfabric reads it.
unsafe impl Send for PendingSend {}

impl PendingSend {
    /// One attempt, under the lock (`s`); `data` is an inject's bytes.
    #[inline]
    fn issue(&self, m: &Mtl, s: &Serialized<'_>, data: &[u8]) -> fabric::Result<()> {
        let tx = m.ctx(self.cid).tx();
        match self.req {
            None => tx.tinject(s, data, self.addr, self.bits, self.cqd),
            Some(r) => tx.tsend(s, self.buf, self.addr, self.bits, self.cqd, r.op_context()),
        }
    }
}

/// Hand `p` (with `data`, an inject's bytes) to the fabric. A non-blocking caller
/// (`may_defer`) never waits for the provider: when it pushes back, or when earlier
/// sends are still waiting, `p` joins the queue that progress drains in order (MPI's
/// non-overtaking rule), and an inject keeps a copy of its data. A blocking caller
/// waits for the queue, then retries.
fn send_or_defer(m: &Mtl, mut p: PendingSend, data: &[u8], may_defer: bool) -> c_int {
    if may_defer {
        // The queue's mutex is taken only when sends are already waiting or the
        // provider pushed back (as for receives, see irecv).
        if !m.has_deferred_sends.load(Ordering::Acquire) {
            let ret = {
                let g = m.lock.lock();
                p.issue(m, &g.serialized(), data)
            };
            match ret {
                Err(e) if e.is_again() => {}
                other => return to_ompi(other),
            }
            m.counters.eagain.fetch_add(1, Ordering::Relaxed);
        }
        let mut q = match locked(&m.deferred_sends) {
            Ok(q) => q,
            Err(rc) => return rc,
        };
        if p.req.is_none() && p.copy.is_empty() {
            p.copy = data.to_vec();
        }
        q.push_back(p);
        m.has_deferred_sends.store(true, Ordering::Release);
        return sys::OMPI_SUCCESS;
    }
    wait_until(m, || !m.has_deferred_sends.load(Ordering::Acquire));
    to_ompi(retry(m, |s| p.issue(m, s, data)))
}

/// Send the queued sends, in order, until the provider pushes back again.
pub(super) fn post_deferred_sends(m: &Mtl) {
    let Ok(mut q) = locked(&m.deferred_sends) else {
        return;
    };
    while let Some(p) = q.front() {
        let ret = {
            let g = m.lock.lock();
            p.issue(m, &g.serialized(), &p.copy)
        };
        match ret {
            Err(e) if e.is_again() => return,
            Ok(()) => {
                q.pop_front();
            }
            Err(e) => {
                log::error!("a deferred send failed: {e}");
                if let Some(r) = q.pop_front().and_then(|p| p.req) {
                    // Its send will not complete: finish it with the error (all parts).
                    r.update_status(|s| s.error = sys::MPI_ERR_INTERN as c_int);
                    r.pending().store(1, Ordering::Release);
                    finish_part(r);
                }
            }
        }
    }
    m.has_deferred_sends.store(false, Ordering::Release);
}

/// Post the send of `data` to `addr` for request `r`, which takes the data over (see
/// [`Req::send_buf`]). A synchronous send first waits for its acknowledgement in
/// `ack` (so `r.pending` counts two completions).
#[allow(clippy::too_many_arguments)]
fn post_send(
    m: &Mtl,
    r: Req,
    addr: u64,
    data: SendData,
    comm: Comm,
    tag: c_int,
    sync: bool,
    may_defer: bool,
) -> c_int {
    let l = &m.layout;
    let me = comm.my_rank();
    let cid = comm.cid();
    let mut p = PendingSend {
        req: Some(r),
        cid,
        addr: m.rx_addr(addr, cid),
        buf: r.send_buf(data),
        bits: l.send_tag(cid, me, tag, Proto::Plain),
        cqd: l.source_in_data().then(|| l.cq_data(me, 0)),
        copy: Vec::new(),
    };
    if sync {
        let id = m.sync_ids.fetch_add(1, Ordering::Relaxed) & (l.sync_id_space() - 1) as u32;
        // Two completions are expected from here on.
        r.pending().store(2, Ordering::Release);
        if let Err(rc) = super::ack::expect(m, r, id) {
            r.free_buffer();
            return rc;
        }
        p.bits = l.send_tag(cid, me, tag, Proto::Sync);
        p.cqd = Some(l.cq_data(me, id));
    } else {
        r.pending().store(1, Ordering::Release);
    }
    let sync_id = sync.then(|| l.sync_id(p.cqd.unwrap_or(0)));
    let rc = send_or_defer(m, p, &[], may_defer);
    if rc != sys::OMPI_SUCCESS {
        // Not posted: the pack buffer goes back.
        r.free_buffer();
        if let Some(id) = sync_id {
            // Not sent: no acknowledgement comes.
            super::ack::forget(m, id);
        }
    }
    rc
}

/// Send a small message with inject: no completion, the buffer is free on return.
#[inline]
fn inject(m: &Mtl, addr: u64, data: &SendData, comm: Comm, tag: c_int, may_defer: bool) -> c_int {
    let l = &m.layout;
    let me = comm.my_rank();
    let cid = comm.cid();
    let p = PendingSend {
        req: None,
        cid,
        addr: m.rx_addr(addr, cid),
        buf: Local::NONE,
        bits: l.send_tag(cid, me, tag, Proto::Plain),
        cqd: l.source_in_data().then(|| l.cq_data(me, 0)),
        copy: Vec::new(),
    };
    send_or_defer(m, p, data.bytes(), may_defer)
}

/// What every send starts with: the running MTL, the peer, the data (packed when it
/// is not contiguous) and whether the send is synchronous.
#[inline]
fn prepare(
    e: &Entry,
    comm: Comm,
    dest: c_int,
    conv: Convertor,
    mode: sys::mca_pml_base_send_mode_t,
) -> Result<(&Mtl, Peer, SendData, bool), c_int> {
    let m = mtl(e).ok_or(sys::OMPI_ERR_NOT_AVAILABLE)?;
    let to = peer(comm, dest)?;
    let data = SendData::of(conv)?;
    Ok((m, to, data, mode == sys::MCA_PML_BASE_SEND_SYNCHRONOUS))
}

/// A blocking send (`MPI_Send`, `MPI_Ssend`): complete on return.
pub(super) fn send_impl(
    e: &Entry,
    comm: Comm,
    dest: c_int,
    tag: c_int,
    conv: Convertor,
    mode: sys::mca_pml_base_send_mode_t,
) -> c_int {
    let (m, to, data, sync) = match prepare(e, comm, dest, conv, mode) {
        Ok(p) => p,
        Err(rc) => return rc,
    };
    let addr = to.addr;
    if let Some(sm) = m.soft.as_deref() {
        let (bits, cqd) = soft_envelope(m, comm, tag, sync);
        if !sync {
            if let Some(rc) = super::softmatch::send_injected(m, sm, to, data.bytes(), bits, cqd) {
                return rc;
            }
        }
        let mut req = Request::of_kind(Kind::Send, Some(comm));
        let rc = with_request(m, &mut req, |r| {
            let rc = super::softmatch::send(m, sm, r, to, data, bits, cqd, sync);
            if rc != sys::OMPI_SUCCESS {
                // Sent inline, or not sent: nothing of it is in flight.
                r.pending().store(0, Ordering::Release);
            }
            rc
        });
        return match rc {
            super::softmatch::SENT_INLINE => sys::OMPI_SUCCESS,
            sys::OMPI_SUCCESS => blocking_result(&req),
            rc => rc,
        };
    }
    if !sync && data.len() <= m.inject_size {
        return inject(m, addr, &data, comm, tag, false);
    }
    let mut req = Request::of_kind(Kind::Send, Some(comm));
    let rc = with_request(m, &mut req, |r| {
        let rc = post_send(m, r, addr, data, comm, tag, sync, false);
        if rc != sys::OMPI_SUCCESS {
            // Not sent: nothing of it is in flight.
            r.pending().store(0, Ordering::Release);
        }
        rc
    });
    if rc != sys::OMPI_SUCCESS {
        // If the synchronous send failed after its acknowledgement receive was
        // posted, that receive can never match (no message went out); the endpoint
        // reclaims it at finalize.
        return rc;
    }
    blocking_result(&req)
}

/// What a completed blocking send returns.
fn blocking_result(r: &Request) -> c_int {
    match r.status.get().error {
        0 => sys::OMPI_SUCCESS,
        e => e,
    }
}

/// The envelope of a software-matched send: tag bits and CQ-data word.
fn soft_envelope(m: &Mtl, comm: Comm, tag: c_int, sync: bool) -> (u64, u64) {
    let me = comm.my_rank();
    let proto = if sync { Proto::Sync } else { Proto::Plain };
    (
        m.layout.send_tag(comm.cid(), me, tag, proto),
        m.layout.cq_data(me, 0),
    )
}

/// A non-blocking send into the PML's request `r` (initialised by the entry).
pub(super) fn isend_impl(
    e: &Entry,
    comm: Comm,
    dest: c_int,
    tag: c_int,
    conv: Convertor,
    mode: sys::mca_pml_base_send_mode_t,
    r: Req,
) -> c_int {
    let (m, to, data, sync) = match prepare(e, comm, dest, conv, mode) {
        Ok(p) => p,
        Err(rc) => return rc,
    };
    let addr = to.addr;
    if let Some(sm) = m.soft.as_deref() {
        let (bits, cqd) = soft_envelope(m, comm, tag, sync);
        let rc = super::softmatch::send(m, sm, r, to, data, bits, cqd, sync);
        if rc == super::softmatch::SENT_INLINE {
            r.complete_to_pml();
            return sys::OMPI_SUCCESS;
        }
        return rc;
    }
    if !sync && data.len() <= m.inject_size {
        let rc = inject(m, addr, &data, comm, tag, true);
        if rc == sys::OMPI_SUCCESS {
            r.complete_to_pml();
        }
        return rc;
    }
    post_send(m, r, addr, data, comm, tag, sync, true)
}
