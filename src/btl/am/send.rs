//! The send path of active messages: posting a fragment (inject, send, or a train of
//! pieces), the queue of sends the provider pushed back (drained in order by one
//! thread at a time), fast boxes to peers on this node, and send completions.
//!
//! What it owns: the queue of pending sends and the queue of fragments waiting for
//! fast boxes. What it must not touch: receive buffers (`recv.rs`), RDMA.

use super::frag::{put_frag, Frag};
use super::wire::{PieceHeader, HDR, INLINE_MAX, PIECE_HDR, PIECE_LIMIT};
use crate::btl::module::{lock, Module, PeerEp, State};
use crate::fabric::Error;
use crate::ompi::error::OpalCode;
use ompi_sys as sys;
use std::mem::offset_of;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;

/// Finish a send: callback, then free if the BTL owns the descriptor.
///
/// # Safety
/// `f` is a fragment whose send completed (or failed).
unsafe fn finish_send(module: *mut Module, f: *mut Frag, status: c_int, always: bool) {
    // SAFETY: caller's contract.
    let (flags, cb, ep) = unsafe { ((*f).base.des_flags, (*f).base.des_cbfunc, (*f).endpoint) };
    if always || flags & sys::MCA_BTL_DES_SEND_ALWAYS_CALLBACK != 0 || status != sys::OPAL_SUCCESS {
        if let Some(cb) = cb {
            // SAFETY: the PML's callback with its own descriptor.
            unsafe { cb(module as *mut _, ep as *mut _, &mut (*f).base, status) };
        }
    }
    if flags & sys::MCA_BTL_DES_FLAGS_BTL_OWNERSHIP != 0 {
        // SAFETY: module is live.
        put_frag(unsafe { &(*module).state }, f);
    }
}

/// A send completion.
///
/// # Safety
/// `ctx` is the `ctx` field of one of our fragments.
pub unsafe fn send_complete(module: *mut Module, ctx: *mut c_void, err: i32) {
    // SAFETY: ctx lies offset_of!(Frag, ctx) bytes into its fragment.
    let f = unsafe { (ctx as *mut u8).sub(offset_of!(Frag, ctx)) as *mut Frag };
    // SAFETY: module is live.
    unsafe { &(*module).state }
        .send_outstanding
        .fetch_sub(1, Ordering::AcqRel);
    let status = if err == 0 {
        sys::OPAL_SUCCESS
    } else {
        Error(err).to_opal()
    };
    // SAFETY: the send is done.
    unsafe { finish_send(module, f, status, true) };
}

/// Try to put a fragment on the wire. `Ok(true)`: injected (complete now), `Ok(false)`:
/// posted (completion later), `Err(AGAIN)`: retry later.
///
/// # Safety
/// `f` is a primed fragment with its header written.
pub(super) unsafe fn post(state: &State, f: *mut Frag) -> Result<bool, Error> {
    // SAFETY: caller's contract.
    let frag = unsafe { &mut *f };
    let len = HDR + frag.segment.seg_len as usize;
    // SAFETY: endpoint came from add_procs.
    let dest = unsafe { (*frag.endpoint).addr };
    if state.send_window > 0 && state.send_outstanding.load(Ordering::Acquire) >= state.send_window
    {
        return Err(Error::AGAIN);
    }
    if len <= state.inject_size && state.send_window == 0 {
        // SAFETY: the buffer is valid for len bytes during the call.
        state.fi(|| unsafe {
            state
                .tx()
                .inject(frag.buf as *const c_void, len, state.to(dest))
        })?;
        return Ok(true);
    }
    if state.piece_max > PIECE_HDR && len - HDR <= PIECE_LIMIT {
        // SAFETY: forwarded.
        unsafe { send_pieces(state, frag, state.to(dest)) }?;
        return Ok(true);
    }
    let desc = frag.mr.as_ref().map_or(ptr::null_mut(), |m| m.desc());
    let ctx = frag.ctx.as_op_context();
    // Counted before the post: another thread may reap the completion first.
    state.send_outstanding.fetch_add(1, Ordering::AcqRel);
    state
        .fi(|| {
            // SAFETY: the fragment (buffer and context) stays ours until the completion.
            unsafe {
                state
                    .tx()
                    .send(frag.buf as *const c_void, len, desc, state.to(dest), ctx)
            }
        })
        .inspect_err(|_| {
            state.send_outstanding.fetch_sub(1, Ordering::AcqRel);
        })?;
    Ok(false)
}

/// Send the payload of `frag` as pieces (see the module documentation), from where an
/// earlier call stopped: `Err(AGAIN)` leaves `frag.sent` at the pieces already out, and
/// the fragment waits in order for progress to call again.
///
/// # Safety
/// `frag` is a primed fragment with its header written.
unsafe fn send_pieces(state: &State, frag: &mut Frag, to: u64) -> Result<(), Error> {
    let total = frag.segment.seg_len as usize;
    let step = state.piece_max - PIECE_HDR;
    if frag.piece_id == 0 {
        frag.piece_id = state.next_piece_id.fetch_add(2, Ordering::Relaxed);
    }
    // SAFETY: the tag is the first byte of the header written before posting.
    let tag = unsafe { *frag.buf };
    let mut buf = std::mem::MaybeUninit::<[u8; INLINE_MAX]>::uninit();
    let b = buf.as_mut_ptr() as *mut u8;
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
        // SAFETY: b has room for PIECE_HDR + n <= piece_max <= INLINE_MAX bytes; the
        // fragment holds total payload bytes after its header.
        unsafe {
            ptr::copy_nonoverlapping(h.as_ptr(), b, PIECE_HDR);
            ptr::copy_nonoverlapping(frag.buf.add(HDR + frag.sent), b.add(PIECE_HDR), n);
        }
        // SAFETY: the first PIECE_HDR + n bytes of b are written; inject copies them.
        state.fi(|| unsafe { state.tx().inject(b as *const c_void, PIECE_HDR + n, to) })?;
        frag.sent += n;
    }
    Ok(())
}

/// Post queued sends in order until the provider pushes back again.
///
/// One thread drains at a time: the front fragment is posted before it is popped, so
/// two drainers (progress and a sender on other threads under MPI_THREAD_MULTIPLE) would
/// both post it: a duplicated fragment, seen by ob1 as a message longer than the one
/// sent, or a double completion and a stall (scripts/test-hostile, tiny queues). A
/// thread that finds another one draining leaves the queue to it.
pub(crate) fn drain_pending(module: *mut Module) {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    let _drainer = match state.draining.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    loop {
        let f = {
            let q = lock(&state.pending);
            match q.front() {
                Some(&f) => f,
                None => {
                    // Under the lock, so that a concurrent enqueue cannot be hidden.
                    state.has_pending.store(false, Ordering::Relaxed);
                    return;
                }
            }
        };
        // SAFETY: queued fragments are primed and ours.
        match unsafe { post(state, f) } {
            Err(Error::AGAIN) => return,
            r => {
                lock(&state.pending).pop_front();
                match r {
                    // SAFETY: injected: complete now (its callback was deferred).
                    Ok(true) => unsafe { finish_send(module, f, sys::OPAL_SUCCESS, true) },
                    Ok(false) => {}
                    Err(e) => {
                        log::warn!("a queued send failed on {}: {e}", state.provider);
                        // SAFETY: not posted: report the error through its callback.
                        unsafe { finish_send(module, f, e.to_opal(), true) };
                    }
                }
            }
        }
    }
}

fn enqueue(state: &State, f: *mut Frag) {
    let mut q = lock(&state.pending);
    q.push_back(f);
    state.has_pending.store(true, Ordering::Relaxed);
}

/// Send a primed fragment with its header written; the BTL's send contract.
///
/// # Safety
/// `f` is ours, primed, header written.
pub(in crate::btl) unsafe fn send_frag(module: *mut Module, f: *mut Frag) -> c_int {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    // SAFETY: forwarded.
    if let Some(rc) = unsafe { fbox_send(module, state, f) } {
        return rc;
    }
    if state.has_pending.load(Ordering::Relaxed) {
        drain_pending(module);
        if state.has_pending.load(Ordering::Relaxed) {
            enqueue(state, f);
            return sys::OPAL_SUCCESS;
        }
    }
    // SAFETY: forwarded.
    let r = unsafe { post(state, f) };
    state.maybe_progress(module);
    match r {
        Ok(true) => {
            // Injected: the data is gone. Like btl/self, call back only when asked.
            // SAFETY: f is complete.
            unsafe { finish_send(module, f, sys::OPAL_SUCCESS, false) };
            1
        }
        Ok(false) => sys::OPAL_SUCCESS,
        Err(Error::AGAIN) => {
            // Flow control: the fragment waits in order and goes out from progress.
            enqueue(state, f);
            sys::OPAL_SUCCESS
        }
        Err(e) => {
            log::warn!("fi_send on {}: {e}", state.provider);
            e.to_opal()
        }
    }
}

/// Copy fragment `f` into `slot` and publish it.
///
/// # Safety
/// `f` is a primed fragment with its header written; `slot` has room for its length.
#[inline]
unsafe fn fbox_write(f: *mut Frag, slot: crate::common::fbox::Slot<'_>) {
    // SAFETY: the fragment holds its header (the tag first) and seg_len payload bytes.
    unsafe {
        let len = (*f).segment.seg_len as usize;
        ptr::copy_nonoverlapping((*f).buf.add(HDR), slot.payload(), len);
        slot.commit(len, *(*f).buf);
    }
}

/// Send `f` through its peer's fast box when it fits one: at once when the box has
/// room and nothing waits for it (`Some(1)`: complete, as an inject), else queued in
/// order behind what waits (`Some(OPAL_SUCCESS)`: `drain_fbox` sends it and calls
/// back). `None`: the fragment goes through the provider. A fragment that fits never
/// goes through the provider, so a peer's fragments that carry ob1's matching order
/// arrive in that order (common::fbox).
///
/// # Safety
/// `f` is ours, primed, header written; its endpoint came from add_procs.
unsafe fn fbox_send(module: *mut Module, state: &State, f: *mut Frag) -> Option<c_int> {
    // SAFETY: caller's contract.
    let (peer, len) = unsafe { (&*(*f).endpoint, (*f).segment.seg_len as usize) };
    let tx = peer.fbox.as_ref()?;
    if len > tx.max() {
        return None;
    }
    if peer.fbox_waiting.load(Ordering::Acquire) == 0 {
        if let Some(slot) = tx.reserve(len) {
            // SAFETY: the slot has room for len bytes; f is complete after.
            unsafe {
                fbox_write(f, slot);
                finish_send(module, f, sys::OPAL_SUCCESS, false);
            }
            return Some(1);
        }
    }
    let mut q = lock(&state.fbox_queue);
    peer.fbox_waiting.fetch_add(1, Ordering::AcqRel);
    q.push_back(f);
    state.fbox_queued.store(true, Ordering::Relaxed);
    Some(sys::OPAL_SUCCESS)
}

/// Send the fragments waiting for fast boxes, each peer's in order, as far as their
/// boxes have room, and call back for each one sent. From progress only.
pub(crate) fn drain_fbox(module: *mut Module) {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    let mut sent = Vec::new();
    {
        let mut q = lock(&state.fbox_queue);
        let mut full: Vec<*mut PeerEp> = Vec::new();
        q.retain(|&f| {
            // SAFETY: queued fragments are ours, primed, with live endpoints (del_procs
            // takes a peer's out before dropping the peer).
            let (ep, len) = unsafe { ((*f).endpoint, (*f).segment.seg_len as usize) };
            if full.contains(&ep) {
                return true;
            }
            // SAFETY: as above.
            let peer = unsafe { &*ep };
            match peer.fbox.as_ref().and_then(|tx| tx.reserve(len)) {
                Some(slot) => {
                    // SAFETY: the slot has room for len bytes.
                    unsafe { fbox_write(f, slot) };
                    peer.fbox_waiting.fetch_sub(1, Ordering::AcqRel);
                    sent.push(f);
                    false
                }
                None => {
                    full.push(ep);
                    true
                }
            }
        });
        state.fbox_queued.store(!q.is_empty(), Ordering::Relaxed);
    }
    for f in sent {
        // SAFETY: sent: complete; its callback was deferred.
        unsafe { finish_send(module, f, sys::OPAL_SUCCESS, true) };
    }
}

/// A peer is going: its fragments still waiting for its fast box fail (unreachable).
///
/// # Safety
/// `module` is live; `peer` is live and no longer listed.
pub(in crate::btl) unsafe fn forget_fbox_peer(module: *mut Module, peer: *mut PeerEp) {
    // SAFETY: caller's contract.
    let state = unsafe { &(*module).state };
    let mut gone = Vec::new();
    {
        let mut q = lock(&state.fbox_queue);
        q.retain(|&f| {
            // SAFETY: queued fragments are ours.
            if unsafe { (*f).endpoint } != peer {
                return true;
            }
            gone.push(f);
            false
        });
        state.fbox_queued.store(!q.is_empty(), Ordering::Relaxed);
    }
    for f in gone {
        // SAFETY: never sent: report the failure through its callback.
        unsafe { finish_send(module, f, sys::OPAL_ERR_UNREACH, true) };
    }
}
