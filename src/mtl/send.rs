//! Sends under provider matching (and the entry of software matching's): inject,
//! send and synchronous send, and the queue of sends that wait when the provider
//! pushes back, drained in order by progress.
//!
//! What it owns: the order of a peer's sends (MPI's non-overtaking rule) across the
//! provider's flow control. What it must not touch: receives and their queue.

use super::completion::finish_part;
use super::peer::peer;
use super::progress::{fi_to_ompi, retry, wait_until};
use super::request::{Kind, Request};
use super::state::{mtl, Mtl};
use super::tag::Proto;
use crate::ompi::comm::Comm;
use crate::ompi::convertor::{Convertor, SendData};
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;

/// One data send, as it is handed to the fabric (now, or later from progress when the
/// provider pushed back).
pub(super) struct PendingSend {
    /// The request whose completion the send produces (0 for an inject).
    req: usize,
    /// The transmit context, and the peer's address (its receive context's).
    tx: *mut fi::fid_ep,
    addr: u64,
    buf: *const u8,
    len: usize,
    bits: u64,
    /// Remote CQ data, when the layout or the protocol uses it.
    cqd: Option<u64>,
    /// An inject's private copy of the data (a deferred inject outlives the caller's
    /// buffer).
    copy: Option<Vec<u8>>,
}

// SAFETY: `buf` points at memory kept alive by the request that owns the send (the
// user's buffer or a pack buffer) until its completion; it is only read by libfabric.
unsafe impl Send for PendingSend {}

impl PendingSend {
    /// One attempt. The caller holds `m.lock`.
    fn issue(&self) -> isize {
        let (buf, len) = match &self.copy {
            Some(c) => (c.as_ptr(), c.len()),
            None => (self.buf, self.len),
        };
        let buf = buf as *const c_void;
        if self.req == 0 {
            // SAFETY: inject copies the data before returning.
            unsafe {
                match self.cqd {
                    Some(d) => fi::fi_tinjectdata(self.tx, buf, len, d, self.addr, self.bits),
                    None => fi::fi_tinject(self.tx, buf, len, self.addr, self.bits),
                }
            }
        } else {
            // SAFETY: the request is live until this send completes, and keeps the
            // data alive that long (see the struct).
            unsafe {
                let ctx = (*(self.req as *mut Request)).ctx_ptr();
                match self.cqd {
                    Some(d) => fi::fi_tsenddata(
                        self.tx,
                        buf,
                        len,
                        ptr::null_mut(),
                        d,
                        self.addr,
                        self.bits,
                        ctx,
                    ),
                    None => fi::fi_tsend(
                        self.tx,
                        buf,
                        len,
                        ptr::null_mut(),
                        self.addr,
                        self.bits,
                        ctx,
                    ),
                }
            }
        }
    }
}

/// Hand `p` to the fabric. A non-blocking caller (`may_defer`) never waits for the
/// provider: when it pushes back, or when earlier sends are still waiting, `p` joins
/// the queue that progress drains in order (MPI's non-overtaking rule), and an inject
/// keeps a copy of its data. A blocking caller waits for the queue, then retries.
fn send_or_defer(m: &Mtl, mut p: PendingSend, may_defer: bool) -> c_int {
    if may_defer {
        // The queue's mutex is taken only when sends are already waiting or the
        // provider pushed back (as for receives, see irecv).
        if !m.has_deferred_sends.load(Ordering::Acquire) {
            let ret = {
                let _g = m.lock.lock();
                p.issue()
            };
            if ret != -(fi::FI_EAGAIN as isize) {
                return if ret < 0 {
                    fi_to_ompi(ret)
                } else {
                    sys::OMPI_SUCCESS
                };
            }
            m.counters.eagain.fetch_add(1, Ordering::Relaxed);
        }
        let mut q = m.deferred_sends.lock().unwrap_or_else(|e| e.into_inner());
        if p.req == 0 && p.copy.is_none() {
            // SAFETY: the caller's buffer holds len bytes for the duration of this call.
            p.copy = Some(unsafe { std::slice::from_raw_parts(p.buf, p.len) }.to_vec());
        }
        q.push_back(p);
        m.has_deferred_sends.store(true, Ordering::Release);
        return sys::OMPI_SUCCESS;
    }
    wait_until(m, || !m.has_deferred_sends.load(Ordering::Acquire));
    let ret = retry(m, || p.issue());
    if ret < 0 {
        fi_to_ompi(ret)
    } else {
        sys::OMPI_SUCCESS
    }
}

/// Send the queued sends, in order, until the provider pushes back again.
pub(super) fn post_deferred_sends(m: &Mtl) {
    let mut q = m.deferred_sends.lock().unwrap_or_else(|e| e.into_inner());
    while let Some(p) = q.front() {
        let ret = {
            let _g = m.lock.lock();
            p.issue()
        };
        if ret == -(fi::FI_EAGAIN as isize) {
            return;
        }
        let p = q.pop_front();
        if ret < 0 {
            log::error!(
                "a deferred send failed: {}",
                crate::fabric::Error::from_ret(ret)
            );
            if let Some(p) = p.filter(|p| p.req != 0) {
                let r = p.req as *mut Request;
                // SAFETY: the request is live and its send will not complete: finish
                // it with the error (all its parts).
                unsafe {
                    (*r).status.error = sys::MPI_ERR_INTERN as c_int;
                    (*r).pending.store(1, Ordering::Release);
                    finish_part(r);
                }
            }
        }
    }
    m.has_deferred_sends.store(false, Ordering::Release);
}

/// Post the send of `data` to `addr` for request `r`. A synchronous send first waits
/// for its acknowledgement in `ack` (so `r.pending` counts two completions).
#[allow(clippy::too_many_arguments)]
fn post_send(
    m: &Mtl,
    r: *mut Request,
    addr: u64,
    data: &SendData,
    comm: Comm,
    tag: c_int,
    sync: bool,
    may_defer: bool,
) -> c_int {
    let l = &m.layout;
    let me = comm.my_rank();
    let cid = comm.cid();
    let mut p = PendingSend {
        req: r as usize,
        tx: m.ctx(cid).tx,
        addr: m.rx_addr(addr, cid),
        buf: data.ptr,
        len: data.len,
        bits: l.send_tag(cid, me, tag, Proto::Plain),
        cqd: l.source_in_data().then(|| l.cq_data(me, 0)),
        copy: None,
    };
    if sync {
        let id = m.sync_ids.fetch_add(1, Ordering::Relaxed) & (l.sync_id_space() - 1) as u32;
        // SAFETY: r is live; two completions are expected from here on.
        unsafe { (*r).pending.store(2, Ordering::Release) };
        if let Err(rc) = super::ack::expect(m, r, id) {
            return rc;
        }
        p.bits = l.send_tag(cid, me, tag, Proto::Sync);
        p.cqd = Some(l.cq_data(me, id));
    } else {
        // SAFETY: r is live.
        unsafe { (*r).pending.store(1, Ordering::Release) };
    }
    let sync_id = sync.then(|| l.sync_id(p.cqd.unwrap_or(0)));
    let rc = send_or_defer(m, p, may_defer);
    if let (Some(id), true) = (sync_id, rc != sys::OMPI_SUCCESS) {
        // Not sent: no acknowledgement comes.
        super::ack::forget(m, id);
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
        req: 0,
        tx: m.ctx(cid).tx,
        addr: m.rx_addr(addr, cid),
        buf: data.ptr,
        len: data.len,
        bits: l.send_tag(cid, me, tag, Proto::Plain),
        cqd: l.source_in_data().then(|| l.cq_data(me, 0)),
        copy: None,
    };
    send_or_defer(m, p, may_defer)
}

pub(super) fn send_impl(
    comm: Comm,
    dest: c_int,
    tag: c_int,
    conv: Convertor,
    mode: sys::mca_pml_base_send_mode_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let to = match peer(comm, dest) {
        Ok(p) => p,
        Err(e) => return e,
    };
    let addr = to.addr;
    let data = match SendData::of(conv) {
        Ok(d) => d,
        Err(e) => return e,
    };
    let sync = mode == sys::MCA_PML_BASE_SEND_SYNCHRONOUS;
    if let Some(sm) = m.soft.as_deref() {
        let (bits, cqd) = soft_envelope(m, comm, tag, sync);
        if !sync {
            // SAFETY: data holds data.len bytes until the end of this function.
            let sent = unsafe {
                super::softmatch::send_injected(m, sm, to, data.ptr, data.len, bits, cqd)
            };
            if let Some(rc) = sent {
                return rc;
            }
        }
        let mut r = Request::internal(Kind::Send, Some(comm));
        // SAFETY: r lives on this stack until its completions (we wait below); data
        // lives until the end of this function.
        let rc = unsafe {
            super::softmatch::send(m, sm, &mut r, to, data.ptr, data.len, bits, cqd, sync)
        };
        if rc == super::softmatch::SENT_INLINE {
            return sys::OMPI_SUCCESS;
        }
        if rc != sys::OMPI_SUCCESS {
            return rc;
        }
        wait_until(m, || r.pending.load(Ordering::Acquire) <= 0);
        return if r.status.error != 0 {
            r.status.error
        } else {
            sys::OMPI_SUCCESS
        };
    }
    if !sync && data.len <= m.inject_size {
        return inject(m, addr, &data, comm, tag, false);
    }
    let mut r = Request::internal(Kind::Send, Some(comm));
    let rp: *mut Request = &mut r;
    let rc = post_send(m, rp, addr, &data, comm, tag, sync, false);
    if rc != sys::OMPI_SUCCESS {
        // If the synchronous send failed after its acknowledgement receive was
        // posted, that receive can never match (no message went out); the endpoint
        // reclaims it at finalize.
        return rc;
    }
    wait_until(m, || r.pending.load(Ordering::Acquire) <= 0);
    if r.status.error != 0 {
        r.status.error
    } else {
        sys::OMPI_SUCCESS
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

pub(super) unsafe fn isend_impl(
    comm: Comm,
    dest: c_int,
    tag: c_int,
    conv: Convertor,
    mode: sys::mca_pml_base_send_mode_t,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let r = req as *mut Request;
    // SAFETY: the PML allocated mtl_request_size bytes behind req.
    unsafe { Request::init(r, Kind::Send, Some(comm)) };
    let to = match peer(comm, dest) {
        Ok(p) => p,
        Err(e) => return e,
    };
    let addr = to.addr;
    let data = match SendData::of(conv) {
        Ok(d) => d,
        Err(e) => return e,
    };
    let sync = mode == sys::MCA_PML_BASE_SEND_SYNCHRONOUS;
    if let Some(sm) = m.soft.as_deref() {
        if data.owned {
            // SAFETY: r is live; it owns the pack buffer until its last completion.
            unsafe {
                (*r).buffer = data.ptr as *mut u8;
                (*r).owns_buffer = true;
            }
        }
        let (bits, cqd) = soft_envelope(m, comm, tag, sync);
        // SAFETY: r is the PML's request, alive until completed; the data is the
        // user's buffer or a pack buffer the request owns until its completion.
        let rc =
            unsafe { super::softmatch::send(m, sm, r, to, data.ptr, data.len, bits, cqd, sync) };
        if rc == super::softmatch::SENT_INLINE || rc != sys::OMPI_SUCCESS {
            // Nothing in flight: the buffer goes back to `data`, which frees it.
            // SAFETY: r is live.
            unsafe { (*r).owns_buffer = false };
            if rc == super::softmatch::SENT_INLINE {
                // SAFETY: r is the PML's live request.
                unsafe { Request::complete_to_pml(r) };
                return sys::OMPI_SUCCESS;
            }
            return rc;
        }
        if data.owned {
            std::mem::forget(data);
        }
        return rc;
    }
    if !sync && data.len <= m.inject_size {
        let rc = inject(m, addr, &data, comm, tag, true);
        if rc == sys::OMPI_SUCCESS {
            // SAFETY: r is the PML's live request.
            unsafe { Request::complete_to_pml(r) };
        }
        return rc;
    }
    if data.owned {
        // The pack buffer must outlive the send: the request owns it from here and
        // frees it when its last completion arrives (finish_part).
        // SAFETY: r is live.
        unsafe {
            (*r).buffer = data.ptr as *mut u8;
            (*r).owns_buffer = true;
        }
    }
    let rc = post_send(m, r, addr, &data, comm, tag, sync, true);
    if data.owned {
        if rc != sys::OMPI_SUCCESS {
            // Not posted: the request gives the buffer back to `data`, which frees it.
            // SAFETY: r is live.
            unsafe { (*r).owns_buffer = false };
        } else {
            std::mem::forget(data);
        }
    }
    rc
}
