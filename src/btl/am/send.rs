//! The send path of active messages: posting a fragment (inject, send, or a train of
//! pieces), the queue of sends the provider pushed back (drained in order by one
//! thread at a time), fast boxes to peers on this node, and send completions.
//!
//! What it owns: the queue of pending sends and the queue of fragments waiting for
//! fast boxes. What it must not touch: receive buffers (`recv.rs`), RDMA.

use super::frag::{put_frag, Frag};
use super::wire::{PieceHeader, HDR, INLINE_MAX, PIECE_HDR, PIECE_LIMIT};
use crate::btl::module::{lock, Module, PeerEp, State};
use crate::fabric::buffer::StackMsg;
use crate::fabric::{Error, Local};
use crate::ompi::btl::notify_sent;
use crate::ompi::error::OpalCode;
use ompi_sys as sys;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;

/// Finish a send: callback, then back to the free list if the BTL owns the
/// descriptor; else ob1 owns it from here (and frees it with `btl_free`, possibly
/// from the callback).
fn finish_send(module: &'static Module, mut f: Box<Frag>, status: c_int, always: bool) {
    let flags = f.base.des_flags;
    let ep = f.endpoint().cast();
    let call =
        always || flags & sys::MCA_BTL_DES_SEND_ALWAYS_CALLBACK != 0 || status != sys::OPAL_SUCCESS;
    if flags & sys::MCA_BTL_DES_FLAGS_BTL_OWNERSHIP != 0 {
        if call {
            notify_sent(module.btl(), ep, &mut f.base, status);
        }
        put_frag(&module.state, f);
    } else {
        let f = Box::leak(f);
        if call {
            notify_sent(module.btl(), ep, &mut f.base, status);
        }
    }
}

/// A send completion: the fragment comes back from the provider.
pub fn send_complete(module: &'static Module, f: Box<Frag>, err: i32) {
    module.state.send_outstanding.fetch_sub(1, Ordering::AcqRel);
    let status = if err == 0 {
        sys::OPAL_SUCCESS
    } else {
        Error(err).to_opal()
    };
    finish_send(module, f, status, true);
}

/// What became of a fragment put on the wire.
pub(super) enum Posted {
    /// Injected (or sent in pieces): complete now, the fragment back.
    Injected(Box<Frag>),
    /// Posted: the provider holds it until the completion.
    InFlight,
    /// Not posted (`Error::AGAIN`: retry later).
    Refused(Box<Frag>, Error),
}

/// Try to put a primed fragment with its header written on the wire.
pub(super) fn post(state: &State, mut f: Box<Frag>) -> Posted {
    let len = HDR + f.len();
    let to = state.to(f.peer().addr);
    if state.send_window > 0 && state.send_outstanding.load(Ordering::Acquire) >= state.send_window
    {
        return Posted::Refused(f, Error::AGAIN);
    }
    if len <= state.inject_size && state.send_window == 0 {
        return match state.fi(|s| state.tx().inject(s, f.wire(), to)) {
            Ok(()) => Posted::Injected(f),
            Err(e) => Posted::Refused(f, e),
        };
    }
    if state.piece_max > PIECE_HDR && len - HDR <= PIECE_LIMIT {
        return match send_pieces(state, &mut f, to) {
            Ok(()) => Posted::Injected(f),
            Err(e) => Posted::Refused(f, e),
        };
    }
    let scribble = crate::common::quirks::scribble_contexts();
    // Counted before the post: another thread may reap the completion first.
    state.send_outstanding.fetch_add(1, Ordering::AcqRel);
    let raw = Box::into_raw(f);
    // SAFETY: raw is the fragment just leaked for this send, which nothing else holds:
    // its buffer (with its own registration) and its context stay put
    // until the completion, whose context gives the box back (progress); the box is
    // taken back here only when the post fails, so that nothing is in flight.
    let res = unsafe {
        let frag = &*raw;
        let local = frag.buf.local().part(0, len);
        let ctx = frag.ctx.fi.context(scribble);
        state
            .fi(|s| state.tx().send(s, local, Local::NONE, to, ctx))
            .map_err(|e| (Box::from_raw(raw), e))
    };
    match res {
        Ok(()) => Posted::InFlight,
        Err((f, e)) => {
            state.send_outstanding.fetch_sub(1, Ordering::AcqRel);
            Posted::Refused(f, e)
        }
    }
}

/// Send the payload of `frag` as pieces (see the module documentation), from where an
/// earlier call stopped: `Err(AGAIN)` leaves `frag.sent` at the pieces already out, and
/// the fragment waits in order for progress to call again.
fn send_pieces(state: &State, frag: &mut Frag, to: u64) -> Result<(), Error> {
    let total = frag.len();
    let step = state.piece_max - PIECE_HDR;
    if frag.piece_id == 0 {
        frag.piece_id = state.next_piece_id.fetch_add(2, Ordering::Relaxed);
    }
    let tag = frag.tag();
    while frag.sent < total {
        let n = step.min(total - frag.sent);
        let h = PieceHeader {
            tag,
            len: n as u32,
            id: frag.piece_id,
            total: total as u32,
            offset: frag.sent as u32,
        }
        .encode();
        let chunk = &frag.payload()[frag.sent..frag.sent + n];
        // PIECE_HDR + n <= piece_max <= INLINE_MAX bytes.
        let mut b = StackMsg::<INLINE_MAX>::default();
        b.push(&h);
        b.push(chunk);
        state.fi(|s| state.tx().inject(s, b.bytes(), to))?;
        frag.sent += n;
    }
    Ok(())
}

/// Post queued sends in order until the provider pushes back again.
///
/// One thread drains at a time: two drainers (progress and a sender on other threads
/// under MPI_THREAD_MULTIPLE) would take fragments out of order, or post the front one
/// twice: a duplicated fragment, seen by ob1 as a message longer than the one sent, or
/// a double completion and a stall (scripts/test-hostile, tiny queues). A thread that
/// finds another one draining leaves the queue to it. The front fragment goes back to
/// the front when the provider refuses it.
pub(crate) fn drain_pending(module: &'static Module) {
    let state = &module.state;
    let _drainer = match state.draining.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    loop {
        let f = {
            let mut q = lock(&state.pending);
            match q.pop_front() {
                Some(f) => f,
                None => {
                    // Under the lock, so that a concurrent enqueue cannot be hidden.
                    state.has_pending.store(false, Ordering::Relaxed);
                    return;
                }
            }
        };
        match post(state, f) {
            Posted::Refused(f, Error::AGAIN) => {
                lock(&state.pending).push_front(f);
                return;
            }
            // Injected: complete now (its callback was deferred).
            Posted::Injected(f) => finish_send(module, f, sys::OPAL_SUCCESS, true),
            Posted::InFlight => {}
            Posted::Refused(f, e) => {
                log::warn!("a queued send failed on {}: {e}", state.provider);
                // Not posted: report the error through its callback.
                finish_send(module, f, e.to_opal(), true);
            }
        }
    }
}

fn enqueue(state: &State, f: Box<Frag>) {
    let mut q = lock(&state.pending);
    q.push_back(f);
    state.has_pending.store(true, Ordering::Relaxed);
}

/// Send a primed fragment with its header written; the BTL's send contract.
pub(in crate::btl) fn send_frag(module: &'static Module, f: Box<Frag>) -> c_int {
    let state = &module.state;
    let f = match fbox_send(module, state, f) {
        Ok(rc) => return rc,
        Err(f) => f,
    };
    if state.has_pending.load(Ordering::Relaxed) {
        drain_pending(module);
        if state.has_pending.load(Ordering::Relaxed) {
            enqueue(state, f);
            return sys::OPAL_SUCCESS;
        }
    }
    let r = post(state, f);
    state.maybe_progress(module);
    match r {
        Posted::Injected(f) => {
            // Injected: the data is gone. Like btl/self, call back only when asked.
            finish_send(module, f, sys::OPAL_SUCCESS, false);
            1
        }
        Posted::InFlight => sys::OPAL_SUCCESS,
        Posted::Refused(f, Error::AGAIN) => {
            // Flow control: the fragment waits in order and goes out from progress.
            enqueue(state, f);
            sys::OPAL_SUCCESS
        }
        Posted::Refused(f, e) => {
            log::warn!("fi_send on {}: {e}", state.provider);
            // ob1 keeps the descriptor after an error, as before the call.
            let _ = f.into_descriptor();
            e.to_opal()
        }
    }
}

/// Copy fragment `f` into `slot` and publish it.
#[inline]
fn fbox_write(f: &Frag, mut slot: crate::common::fbox::Slot<'_>) {
    slot.payload_mut().copy_from_slice(f.payload());
    slot.commit(f.len(), f.tag());
}

/// Send `f` through its peer's fast box when it fits one: at once when the box has
/// room and nothing waits for it (`Ok(1)`: complete, as an inject), else queued in
/// order behind what waits (`Ok(OPAL_SUCCESS)`: `drain_fbox` sends it and calls
/// back). `Err`: the fragment goes through the provider. A fragment that fits never
/// goes through the provider, so a peer's fragments that carry ob1's matching order
/// arrive in that order (common::fbox).
fn fbox_send(module: &'static Module, state: &State, f: Box<Frag>) -> Result<c_int, Box<Frag>> {
    let peer = f.peer();
    let Some(tx) = peer.fbox.as_ref() else {
        return Err(f);
    };
    let len = f.len();
    if len > tx.max() {
        return Err(f);
    }
    if peer.fbox_waiting.load(Ordering::Acquire) == 0 {
        if let Some(slot) = tx.reserve(len) {
            fbox_write(&f, slot);
            finish_send(module, f, sys::OPAL_SUCCESS, false);
            return Ok(1);
        }
    }
    let mut q = lock(&state.fbox_queue);
    peer.fbox_waiting.fetch_add(1, Ordering::AcqRel);
    q.push_back(f);
    state.fbox_queued.store(true, Ordering::Relaxed);
    Ok(sys::OPAL_SUCCESS)
}

/// Send the fragments waiting for fast boxes, each peer's in order, as far as their
/// boxes have room, and call back for each one sent. From progress only.
pub(crate) fn drain_fbox(module: &'static Module) {
    let state = &module.state;
    let mut sent = Vec::new();
    {
        let mut q = lock(&state.fbox_queue);
        let mut full: Vec<*mut PeerEp> = Vec::new();
        let mut i = 0;
        while i < q.len() {
            let f = &q[i];
            // Queued fragments have live peers (del_procs takes a peer's out before
            // dropping the peer).
            let ep = f.endpoint();
            if full.contains(&ep) {
                i += 1;
                continue;
            }
            let (peer, len) = (f.peer(), f.len());
            match peer.fbox.as_ref().and_then(|tx| tx.reserve(len)) {
                Some(slot) => {
                    if let Some(f) = q.remove(i) {
                        fbox_write(&f, slot);
                        peer.fbox_waiting.fetch_sub(1, Ordering::AcqRel);
                        sent.push(f);
                    }
                }
                None => {
                    full.push(ep);
                    i += 1;
                }
            }
        }
        state.fbox_queued.store(!q.is_empty(), Ordering::Relaxed);
    }
    for f in sent {
        // Sent: complete; its callback was deferred.
        finish_send(module, f, sys::OPAL_SUCCESS, true);
    }
}

/// A peer is going: its fragments still waiting for its fast box fail (unreachable).
pub(in crate::btl) fn forget_fbox_peer(module: &'static Module, peer: *const PeerEp) {
    let state = &module.state;
    let mut gone = Vec::new();
    {
        let mut q = lock(&state.fbox_queue);
        let mut i = 0;
        while i < q.len() {
            if std::ptr::eq(q[i].endpoint(), peer) {
                gone.extend(q.remove(i));
            } else {
                i += 1;
            }
        }
        state.fbox_queued.store(!q.is_empty(), Ordering::Relaxed);
    }
    for f in gone {
        // Never sent: report the failure through its callback.
        finish_send(module, f, sys::OPAL_ERR_UNREACH, true);
    }
}
