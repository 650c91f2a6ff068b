//! The MPI receives of software matching: posting one against the unexpected list
//! ([`irecv`]), probing and claiming unexpected messages, cancelling, and handing a
//! matched message to its receive ([`deliver`]): an eager payload copied, or an RTS
//! answered with a read of the sender's buffer and a FIN. Delivery runs with the lists'
//! lock released; the receive buffers are `bounce`'s, and this never reposts one.

use super::control::control;
use super::lists::{lock, matches, Posted, Unexpected};
use super::wire::{Hdr, ACK, EAGER, FIN};
use super::SoftMatch;
use crate::mtl::completion;
use crate::mtl::peer;
use crate::mtl::peer::Peer;
use crate::mtl::request::Kind;
use crate::mtl::request::Request;
use crate::mtl::state::Mtl;
use crate::mtl::tag::{Proto, TagLayout};
use crate::ompi::comm::Comm;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;

/// Where a matched message goes.
pub(super) enum Delivery {
    Eager(Vec<u8>),
    /// An eager message in pieces, already copied into the receive's buffer (as much
    /// of it as fits); the message's length.
    Filled(usize),
    /// An eager message in pieces that there was no memory for: the receive fails
    /// with `MPI_ERR_NO_MEM`.
    Lost,
    Rts,
}

impl Unexpected {
    /// What its receive gets.
    pub(super) fn delivery(self) -> Delivery {
        if self.lost {
            Delivery::Lost
        } else if self.hdr.kind == EAGER {
            Delivery::Eager(self.payload)
        } else {
            Delivery::Rts
        }
    }
}

/// Hand a matched message to receive `r` (lock not held).
pub(super) fn deliver(m: &Mtl, r: *mut Request, hdr: Hdr, what: Delivery, payload: Option<&[u8]>) {
    let l = &m.layout;
    // SAFETY: r is a live receive we matched.
    let req = unsafe { &mut *r };
    // Decoded once: the sender's address and the receive's status both come from it.
    let env = req
        .comm()
        .and_then(|comm| peer::envelope(m, comm, hdr.bits, hdr.data));
    let source = match env {
        Ok(ref e) => e.source,
        Err(_) => {
            // Logged (by envelope); the receive fails. An RTS sender is not told (it
            // is not a peer we can name).
            // SAFETY: r is live.
            unsafe {
                completion::recv_done_with(m, r, env, 0, false, sys::MPI_ERR_INTERN as c_int)
            };
            return;
        }
    };
    // Only acknowledgements and reads need the sender's address.
    let peer = || {
        req.comm()
            .and_then(|comm| peer::peer(comm, source))
            .unwrap_or(Peer::UNKNOWN)
    };
    match what {
        Delivery::Eager(_) | Delivery::Filled(_) | Delivery::Lost => {
            let mut status = sys::MPI_SUCCESS as c_int;
            let len = match what {
                Delivery::Filled(len) => len,
                Delivery::Lost => {
                    status = sys::MPI_ERR_NO_MEM as c_int;
                    0
                }
                Delivery::Eager(ref owned) => {
                    let bytes = payload.unwrap_or(owned);
                    let n = bytes.len().min(req.length);
                    if n > 0 {
                        // SAFETY: req.buffer holds req.length bytes.
                        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), req.buffer, n) };
                    }
                    bytes.len()
                }
                Delivery::Rts => unreachable!(),
            };
            if l.proto(hdr.bits) == Proto::Sync {
                let p = peer();
                control(m, p.addr, p.fbox(), ACK, hdr.token);
            }
            // SAFETY: r is live.
            unsafe { completion::recv_done_with(m, r, env, len, false, status) };
        }
        Delivery::Rts => {
            let p = peer();
            let addr = p.addr;
            let n = (hdr.len as usize).min(req.length);
            req.sm_hdr = hdr;
            req.sm_addr = addr;
            if n == 0 {
                control(m, addr, p.fbox(), FIN, hdr.token);
                // SAFETY: r is live.
                unsafe {
                    completion::recv_done_with(
                        m,
                        r,
                        env,
                        hdr.len as usize,
                        false,
                        sys::MPI_SUCCESS as c_int,
                    )
                };
                return;
            }
            req.kind = Kind::SmRead;
            // Not retried here: this may run inside progress, which then cannot read
            // the completions that make room, and shm refuses a peer's first operation
            // until that peer's progress has seen it (a peer reached only through fast
            // boxes until now). A refused read waits in `reads_waiting`.
            // SAFETY: r is a live receive in SmRead state.
            let ret = unsafe { post_read(m, r) };
            if ret == -(fi::FI_EAGAIN as isize) {
                if let Some(sm) = m.soft.as_deref() {
                    sm.reads().push_back(r);
                    sm.has_reads_waiting.store(true, Ordering::Release);
                    return;
                }
            }
            if ret < 0 {
                // SAFETY: r is live.
                unsafe { read_failed(m, r, ret) };
            }
        }
    }
}

/// Post the read of receive `r` (in SmRead state, its RTS in `sm_hdr`): the
/// provider's code.
///
/// # Safety
/// `r` is a live receive whose buffer holds its length until the read completes.
unsafe fn post_read(m: &Mtl, r: *mut Request) -> isize {
    // SAFETY: forwarded.
    let req = unsafe { &mut *r };
    let hdr = req.sm_hdr;
    let n = (hdr.len as usize).min(req.length);
    let _g = m.lock.lock();
    // SAFETY: the buffer holds n bytes until the read completes.
    unsafe {
        fi::fi_read(
            m.ep(),
            req.buffer as *mut c_void,
            n,
            ptr::null_mut(),
            req.sm_addr,
            hdr.addr,
            hdr.key,
            req.ctx_ptr(),
        )
    }
}

/// The read of receive `r` could not be posted (`ret`): tell the sender, fail the
/// receive.
///
/// # Safety
/// `r` is a live receive in SmRead state.
unsafe fn read_failed(m: &Mtl, r: *mut Request, ret: isize) {
    // SAFETY: forwarded.
    let req = unsafe { &mut *r };
    let hdr = req.sm_hdr;
    log::error!(
        "reading a {}-byte message failed: {}",
        hdr.len,
        crate::fabric::Error::from_ret(ret)
    );
    req.kind = Kind::Recv;
    send_fin(m, req);
    // SAFETY: r is live.
    unsafe { fail_recv(m, r, &hdr) };
}

/// The sender of the message receive `req` holds (`sm_hdr`), if it can be named.
fn sender(m: &Mtl, req: &Request) -> Option<peer::Peer> {
    let comm = req.comm().ok()?;
    let env = peer::envelope(m, comm, req.sm_hdr.bits, req.sm_hdr.data).ok()?;
    peer::peer(comm, env.source).ok()
}

/// Tell the sender of the message receive `req` holds that its data was read (or the
/// read failed): a FIN, through the sender's fast box when there is one.
fn send_fin(m: &Mtl, req: &Request) {
    let from = sender(m, req);
    let fbox = from.as_ref().and_then(|p| p.fbox());
    control(m, req.sm_addr, fbox, FIN, req.sm_hdr.token);
}

/// Post the reads the provider refused (see [`deliver`]), in order, until it refuses
/// one again. Called by progress outside its serial section.
pub fn post_waiting_reads(m: &Mtl, sm: &SoftMatch) {
    loop {
        let Some(r) = sm.reads().pop_front() else {
            break;
        };
        // SAFETY: a live receive in SmRead state, queued by deliver.
        let ret = unsafe { post_read(m, r) };
        if ret == -(fi::FI_EAGAIN as isize) {
            sm.reads().push_front(r);
            return;
        }
        if ret < 0 {
            // SAFETY: as above.
            unsafe { read_failed(m, r, ret) };
        }
    }
    let q = sm.reads();
    sm.has_reads_waiting.store(!q.is_empty(), Ordering::Release);
}

/// Complete receive `r`, matched with the message of `hdr`, with an internal error
/// (already logged) and nothing received.
///
/// # Safety
/// `r` must be a live receive of ours to complete.
pub(super) unsafe fn fail_recv(m: &Mtl, r: *mut Request, hdr: &Hdr) {
    // SAFETY: forwarded.
    unsafe {
        completion::recv_done(
            m,
            r,
            hdr.bits,
            hdr.data,
            0,
            false,
            sys::MPI_ERR_INTERN as c_int,
        )
    };
}

/// A read into receive `r` finished: tell the sender, complete the receive.
///
/// # Safety
/// `r` must be a live receive in `SmRead` state.
pub unsafe fn read_done(m: &Mtl, r: *mut Request) {
    // SAFETY: forwarded.
    let req = unsafe { &mut *r };
    req.kind = Kind::Recv;
    let hdr = req.sm_hdr;
    send_fin(m, req);
    // SAFETY: r is live.
    unsafe {
        completion::recv_done(
            m,
            r,
            hdr.bits,
            hdr.data,
            hdr.len as usize,
            false,
            sys::MPI_SUCCESS as c_int,
        )
    };
}

/// Post receive `r` (buffer, length and convertor already set).
pub fn irecv(m: &Mtl, sm: &SoftMatch, r: *mut Request, bits: u64, ignore: u64) -> c_int {
    let found = {
        let mut lists = lock(&sm.lists);
        match lists
            .unexpected
            .iter()
            .position(|u| matches(bits, ignore, u.hdr.bits))
        {
            Some(i) => lists.unexpected.remove(i),
            None => {
                lists.posted.push_back(Posted {
                    req: r,
                    bits,
                    ignore,
                });
                None
            }
        }
    };
    if let Some(u) = found {
        take(m, r, u);
    }
    sys::OMPI_SUCCESS
}

/// Deliver an unexpected message to `r`.
pub fn take(m: &Mtl, r: *mut Request, u: Unexpected) {
    let hdr = u.hdr;
    deliver(m, r, hdr, u.delivery(), None);
}

/// The first unexpected message matching (`bits`, `ignore`): its envelope and length.
pub fn probe(sm: &SoftMatch, bits: u64, ignore: u64) -> Option<(u64, u64, usize)> {
    let lists = lock(&sm.lists);
    lists
        .unexpected
        .iter()
        .find(|u| matches(bits, ignore, u.hdr.bits))
        .map(|u| (u.hdr.bits, u.hdr.data, u.hdr.len as usize))
}

/// Remove the first unexpected message matching (`bits`, `ignore`) (mprobe). A
/// synchronous eager message is acknowledged now: it is matched.
pub fn claim(m: &Mtl, sm: &SoftMatch, comm: Comm, bits: u64, ignore: u64) -> Option<Unexpected> {
    let u = {
        let mut lists = lock(&sm.lists);
        let i = lists
            .unexpected
            .iter()
            .position(|u| matches(bits, ignore, u.hdr.bits))?;
        lists.unexpected.remove(i)?
    };
    if u.hdr.kind == EAGER && m.layout.proto(u.hdr.bits) == Proto::Sync {
        if let Ok(env) = peer::envelope(m, comm, u.hdr.bits, u.hdr.data) {
            if let Ok(p) = peer::peer(comm, env.source) {
                control(m, p.addr, p.fbox(), ACK, u.hdr.token);
            }
        }
        let mut u = u;
        // Acknowledged: deliver it as a plain message later.
        u.hdr.bits &= !sync_bit(&m.layout);
        return Some(u);
    }
    Some(u)
}

fn sync_bit(l: &TagLayout) -> u64 {
    l.send_tag(0, 0, 0, Proto::Sync) ^ l.send_tag(0, 0, 0, Proto::Plain)
}

/// Cancel receive `r` if it is still waiting for a message.
pub fn cancel(sm: &SoftMatch, r: *mut Request) -> bool {
    let mut lists = lock(&sm.lists);
    match lists.posted.iter().position(|p| p.req == r) {
        Some(i) => {
            lists.posted.remove(i);
            true
        }
        None => false,
    }
}
