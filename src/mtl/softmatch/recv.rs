//! The MPI receives of software matching: posting one against the unexpected list
//! ([`irecv`]), probing and claiming unexpected messages, cancelling, and handing a
//! matched message to its receive ([`deliver`]): an eager payload copied, or an RTS
//! answered with a read of the sender's buffer and a FIN. Delivery runs with the lists'
//! lock released; the receive buffers are `bounce`'s, and this never reposts one.

use super::control::control;
use super::lists::{lock, matches, Posted, Unexpected};
use super::wire::{Hdr, ACK, EAGER, FIN};
use super::SoftMatch;
use crate::fabric;
use crate::mtl::completion;
use crate::mtl::peer;
use crate::mtl::peer::Peer;
use crate::mtl::request::{Kind, Req};
use crate::mtl::state::Mtl;
use crate::mtl::tag::{Proto, TagLayout};
use crate::ompi::comm::Comm;
use ompi_sys as sys;
use std::os::raw::c_int;
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
pub(super) fn deliver(m: &Mtl, r: Req, hdr: Hdr, what: Delivery, payload: Option<&[u8]>) {
    let l = &m.layout;
    // Decoded once: the sender's address and the receive's status both come from it.
    let comm = r.comm().ok_or(sys::OMPI_ERR_BAD_PARAM);
    let env = comm.and_then(|comm| peer::envelope(m, comm, hdr.bits, hdr.data));
    let source = match env {
        Ok(ref e) => e.source,
        Err(_) => {
            // Logged (by envelope); the receive fails. An RTS sender is not told (it
            // is not a peer we can name).
            completion::recv_done_with(m, r, env, 0, false, sys::MPI_ERR_INTERN as c_int);
            return;
        }
    };
    // Only acknowledgements and reads need the sender's address.
    let peer = || {
        comm.and_then(|comm| peer::peer(comm, source))
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
                    r.write_at(0, bytes);
                    bytes.len()
                }
                Delivery::Rts => unreachable!(),
            };
            if l.proto(hdr.bits) == Proto::Sync {
                let p = peer();
                control(m, p.addr, p.fbox(), ACK, hdr.token);
            }
            completion::recv_done_with(m, r, env, len, false, status);
        }
        Delivery::Rts => {
            let p = peer();
            let addr = p.addr;
            let n = (hdr.len as usize).min(r.length());
            r.set_sm_hdr(hdr);
            r.set_sm_addr(addr);
            if n == 0 {
                control(m, addr, p.fbox(), FIN, hdr.token);
                completion::recv_done_with(
                    m,
                    r,
                    env,
                    hdr.len as usize,
                    false,
                    sys::MPI_SUCCESS as c_int,
                );
                return;
            }
            r.set_kind(Kind::SmRead);
            // Not retried here: this may run inside progress, which then cannot read
            // the completions that make room, and shm refuses a peer's first operation
            // until that peer's progress has seen it (a peer reached only through fast
            // boxes until now). A refused read waits in `reads_waiting`.
            match post_read(m, r) {
                Err(e) if e.is_again() => {
                    if let Some(sm) = m.soft.as_deref() {
                        if let Some(mut q) = sm.reads() {
                            q.push_back(r);
                            sm.has_reads_waiting.store(true, Ordering::Release);
                            return;
                        }
                    }
                    read_failed(m, r, e);
                }
                Err(e) => read_failed(m, r, e),
                Ok(()) => {}
            }
        }
    }
}

/// Post the read of receive `r` (in SmRead state, its RTS in `sm_hdr`, its buffer
/// valid until the read completes).
fn post_read(m: &Mtl, r: Req) -> fabric::Result<()> {
    let hdr = r.sm_hdr();
    let buf = r.recv_buf().part(0, hdr.len as usize);
    let far = fabric::Remote {
        peer: r.sm_addr(),
        addr: hdr.addr,
        key: hdr.key,
    };
    let g = m.lock.lock();
    let s = g.serialized();
    m.ep()
        .rma(&s, fabric::Dir::Read, buf, far, r.op_context(), 0)
}

/// The read of receive `r` (in SmRead state) could not be posted (`e`): tell the
/// sender, fail the receive.
fn read_failed(m: &Mtl, r: Req, e: fabric::Error) {
    let hdr = r.sm_hdr();
    log::error!("reading a {}-byte message failed: {e}", hdr.len);
    r.set_kind(Kind::Recv);
    send_fin(m, r);
    fail_recv(m, r, &hdr);
}

/// The sender of the message receive `r` holds (`sm_hdr`), if it can be named.
fn sender(m: &Mtl, r: Req) -> Option<peer::Peer> {
    let comm = r.comm()?;
    let hdr = r.sm_hdr();
    let env = peer::envelope(m, comm, hdr.bits, hdr.data).ok()?;
    peer::peer(comm, env.source).ok()
}

/// Tell the sender of the message receive `r` holds that its data was read (or the
/// read failed): a FIN, through the sender's fast box when there is one.
fn send_fin(m: &Mtl, r: Req) {
    let from = sender(m, r);
    let fbox = from.as_ref().and_then(|p| p.fbox());
    control(m, r.sm_addr(), fbox, FIN, r.sm_hdr().token);
}

/// Post the reads the provider refused (see [`deliver`]), in order, until it refuses
/// one again. Called by progress outside its serial section.
pub fn post_waiting_reads(m: &Mtl, sm: &SoftMatch) {
    // Live receives in SmRead state, queued by deliver.
    while let Some(r) = sm.reads().and_then(|mut q| q.pop_front()) {
        match post_read(m, r) {
            Err(e) if e.is_again() => {
                if let Some(mut q) = sm.reads() {
                    q.push_front(r);
                }
                return;
            }
            Err(e) => read_failed(m, r, e),
            Ok(()) => {}
        }
    }
    let waiting = sm.reads().is_some_and(|q| !q.is_empty());
    sm.has_reads_waiting.store(waiting, Ordering::Release);
}

/// Complete receive `r`, matched with the message of `hdr`, with an internal error
/// (already logged) and nothing received.
pub(super) fn fail_recv(m: &Mtl, r: Req, hdr: &Hdr) {
    completion::recv_done(
        m,
        r,
        hdr.bits,
        hdr.data,
        0,
        false,
        sys::MPI_ERR_INTERN as c_int,
    );
}

/// A read into receive `r` (in `SmRead` state) finished: tell the sender, complete
/// the receive.
pub fn read_done(m: &Mtl, r: Req) {
    r.set_kind(Kind::Recv);
    let hdr = r.sm_hdr();
    send_fin(m, r);
    completion::recv_done(
        m,
        r,
        hdr.bits,
        hdr.data,
        hdr.len as usize,
        false,
        sys::MPI_SUCCESS as c_int,
    );
}

/// Post receive `r` (buffer, length and convertor already set).
pub fn irecv(m: &Mtl, sm: &SoftMatch, r: Req, bits: u64, ignore: u64) -> c_int {
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
pub fn take(m: &Mtl, r: Req, u: Unexpected) {
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
pub fn cancel(sm: &SoftMatch, r: Req) -> bool {
    let mut lists = lock(&sm.lists);
    match lists.posted.iter().position(|p| p.req == r) {
        Some(i) => {
            lists.posted.remove(i);
            true
        }
        None => false,
    }
}
