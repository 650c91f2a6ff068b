//! The receive path of active messages: posting the receive buffers (multi-receive
//! ones where the provider has them, see [`receive_layout`]), receive completions,
//! assembling pieces, and handing each fragment to the callback registered for its
//! tag (or to the BTL's own requests: `amo`, `put_by_read`, `resolve`).
//!
//! What it owns: the posting of receive buffers, and those the provider refused
//! (`State::unposted`). What it must not touch: the send path (`send.rs`).

use super::frag::RecvBuf;
use super::wire::{AmHeader, BadAm, PieceHeader, HDR, PIECE_MAGIC};
use crate::btl::module::{lock, Module, State};
use crate::btl::op_context::{Ctx, OpKind};
use crate::btl::{amo, put_by_read};
use crate::fabric::{Buffer, Error};
use libfabric_sys as fi;
use std::sync::atomic::Ordering;

/// How `rd_num` (`n`) fragments' worth of receive memory is posted: `(buffers,
/// bytes each)`. Multi-receive buffers take one fragment after another, so the same
/// memory goes as a quarter as many buffers, at least two (one fills while the other
/// is posted again) of at least two largest fragments each.
pub fn receive_layout(n: usize, frag: usize, multi: bool) -> (usize, usize) {
    if !multi {
        return (n, frag);
    }
    let count = n.div_ceil(4).max(2);
    (count, n.div_ceil(count).max(2) * frag)
}

/// A receive buffer with no receive posted: made, or released by the provider.
/// Invariant: the buffer is not posted, and this is the one handle that may post it.
pub struct Idle(&'static RecvBuf);

impl Idle {
    /// # Safety
    /// The provider released `rb` (its last completion says so, or its receive was
    /// never posted) and no other `Idle` of it exists.
    #[inline(always)]
    unsafe fn new(rb: &'static RecvBuf) -> Idle {
        Idle(rb)
    }
}

/// Post `n` receive buffers on each receive context (as multi-receive buffers, see
/// [`receive_layout`], where the module has them).
pub fn post_receives(state: &State, n: usize) -> Result<(), Error> {
    let (n, cap) = receive_layout(n, HDR + state.frag_payload, state.multi_recv);
    for cx in (0..state.ctxs.len()).flat_map(|cx| std::iter::repeat_n(cx, n)) {
        let mut buf = Buffer::zeroed(cap).ok_or(Error::NOMEM)?;
        if state.mr_local {
            state.register_buffer(&mut buf)?;
        }
        // Leaked for the module's life; teardown frees it (the list below) once the
        // endpoint is closed.
        let rb: &'static RecvBuf = Box::leak(Box::new(RecvBuf {
            ctx: Ctx::new(OpKind::Recv),
            cx,
            buf,
        }));
        lock(&state.recv_bufs).push(rb as *const RecvBuf as *mut RecvBuf);
        repost(state, Idle(rb))?;
    }
    Ok(())
}

/// Post (again) one receive buffer, progressing while the provider pushes back.
fn repost(state: &State, rb: Idle) -> Result<(), Error> {
    loop {
        match try_post(state, &rb) {
            Err(Error::AGAIN) => {
                // Receives are only refused for lack of resources: reap some.
                crate::ompi::progress::progress();
            }
            other => return other,
        }
    }
}

/// One attempt at posting receive buffer `rb`. On success `rb` is the provider's:
/// the caller drops the handle.
fn try_post(state: &State, rb: &Idle) -> Result<(), Error> {
    let r = rb.0;
    let scribble = crate::common::quirks::scribble_contexts();
    // SAFETY: the buffer is not posted (Idle's invariant), and it and its context stay
    // put, used by this receive only, until its completion is reaped or the endpoint
    // closes, before teardown frees them.
    let (local, ctx) = unsafe { (r.buf.local(), r.ctx.fi.context(scribble)) };
    let rx = state.ctxs[r.cx].rx.data_path();
    state.fi(|s| rx.recv(s, local, state.multi_recv, ctx))
}

/// Post again the receive buffers the provider refused (see [`recv_complete`]), at
/// most once per [`crate::common::sync::Unposted::INTERVAL`]. Called by progress.
pub fn post_unposted(state: &State) {
    if state.closing.load(Ordering::Relaxed) {
        return;
    }
    let (posted, all) = state.unposted.retry(|rb| try_post(state, rb).is_ok());
    if posted > 0 && all {
        log::info!(
            "the receive buffers {} refused are posted again",
            state.provider
        );
    }
}

/// A receive completed: hand the payload to the registered callback, then repost the
/// buffer (a multi-receive buffer only when the provider released it: `FI_MULTI_RECV`
/// in `flags`; its fragment is at `buf`).
pub fn recv_complete(
    module: &'static Module,
    rb: &'static RecvBuf,
    len: usize,
    err: i32,
    buf: *const std::os::raw::c_void,
    flags: u64,
) {
    let state = &module.state;
    let released = !state.multi_recv || flags & fi::FI_MULTI_RECV as u64 != 0;
    let fragment = err == 0 && (!state.multi_recv || len > 0);
    // SAFETY: the completion is rb's (progress routes it by its context): the provider
    // wrote the fragment's bytes and writes them again only once rb is posted again,
    // after the dispatch below; and when it released rb, no receive is posted with it
    // and this completion is the one that says so.
    let (bytes, idle) = unsafe {
        (
            fragment.then(|| rb.buf.received(state.multi_recv, buf, len)),
            released.then(|| Idle::new(rb)),
        )
    };
    if err != 0 {
        if state.closing.load(Ordering::Relaxed) || err == fi::FI_ECANCELED as i32 {
            return;
        }
        log::warn!(
            "a receive completed with an error on {}: {}",
            state.provider,
            Error(err)
        );
    }
    // (A multi-receive buffer may be released by a completion without a fragment.)
    match bytes {
        None => {}
        Some(None) => {
            state.bad_fragments.fetch_add(1, Ordering::Relaxed);
            log::error!(
                "dropping a fragment that {} placed outside its receive buffer ({buf:p}, \
                 buffer {:p} of {} bytes)",
                state.provider,
                rb.buf.as_ptr(),
                rb.buf.len()
            );
        }
        Some(Some(bytes)) if bytes.len() > 1 && bytes[1] == PIECE_MAGIC => {
            piece_arrived(module, bytes);
        }
        Some(Some(bytes)) => match AmHeader::decode(bytes) {
            // The payload: HDR bytes in, h.len long (checked against what arrived).
            Ok((h, _)) => dispatch(module, h.tag, &mut bytes[HDR..HDR + h.len as usize]),
            Err(e) => {
                state.bad_fragments.fetch_add(1, Ordering::Relaxed);
                log::error!("dropping a received fragment on {}: {e}", state.provider);
            }
        },
    }
    let Some(idle) = idle else { return };
    if state.closing.load(Ordering::Relaxed) {
        return;
    }
    let ret = if crate::common::sync::refuse_repost() {
        Err(Error(fi::FI_EIO as i32))
    } else {
        try_post_again(state, &idle)
    };
    if let Err(e) = ret {
        // Kept, not lost: with no buffer posted the module would stop receiving.
        if let Some(n) = state.unposted.push(idle) {
            log::error!(
                "re-posting a receive buffer on {}: {e}; progress tries again ({n} refused \
                 so far)",
                state.provider
            );
        }
    }
}

/// [`repost`] of a buffer the caller keeps when it fails.
fn try_post_again(state: &State, rb: &Idle) -> Result<(), Error> {
    loop {
        match try_post(state, rb) {
            Err(Error::AGAIN) => crate::ompi::progress::progress(),
            other => return other,
        }
    }
}

/// A fragment whose pieces are arriving.
pub struct Assembly {
    tag: u8,
    payload: Vec<u8>,
    got: usize,
}

/// A piece arrived: add it to its fragment; dispatch the fragment when it is whole.
fn piece_arrived(module: &'static Module, bytes: &[u8]) {
    let state = &module.state;
    let whole = PieceHeader::decode(bytes).and_then(|(h, chunk)| {
        let mut asm = state.assembly.lock();
        let a = asm.entry(h.id).or_insert_with(|| Assembly {
            tag: h.tag,
            payload: vec![0u8; h.total as usize],
            got: 0,
        });
        if a.tag != h.tag
            || a.payload.len() != h.total as usize
            || a.got + chunk.len() > a.payload.len()
        {
            asm.remove(&h.id);
            return Err(BadAm::Piece);
        }
        let at = h.offset as usize;
        a.payload[at..at + chunk.len()].copy_from_slice(chunk);
        a.got += chunk.len();
        if a.got < a.payload.len() {
            return Ok(None);
        }
        Ok(asm.remove(&h.id))
    });
    match whole {
        Ok(None) => {}
        Ok(Some(mut a)) => {
            state.assembled.fetch_add(1, Ordering::Relaxed);
            dispatch(module, a.tag, &mut a.payload);
        }
        Err(e) => {
            state.bad_fragments.fetch_add(1, Ordering::Relaxed);
            log::error!("dropping a received piece on {}: {e}", state.provider);
        }
    }
}

/// Hand a decoded fragment (its payload, which the callback may read and write until
/// it returns) to the callback registered for its tag.
pub(in crate::btl) fn dispatch(module: &'static Module, tag: u8, payload: &mut [u8]) {
    let state = &module.state;
    if (state.amo && tag == amo::TAG_REQ) || (state.serves_requests() && tag == amo::TAG_REP) {
        amo::on_message(module, tag, payload);
        return;
    }
    if state.put_by_read && tag == put_by_read::TAG_PUT {
        put_by_read::on_put(module, payload);
        return;
    }
    if state.one_sided
        && (tag == crate::btl::resolve::TAG_FIND || tag == crate::btl::resolve::TAG_FOUND)
    {
        crate::btl::resolve::on_message(module, tag, payload);
        return;
    }
    if !crate::ompi::btl::deliver(module.btl(), tag, payload) {
        state.bad_fragments.fetch_add(1, Ordering::Relaxed);
        log::warn!("dropping a fragment with active-message tag {tag}, which nobody registered");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_receive_buffers_hold_the_memory_of_rd_num_fragments() {
        assert_eq!(receive_layout(8, 1000, false), (8, 1000));
        assert_eq!(receive_layout(8, 1000, true), (2, 4000));
        assert_eq!(receive_layout(1, 1000, true), (2, 2000));
        assert_eq!(receive_layout(64, 1000, true), (16, 4000));
        assert_eq!(receive_layout(9, 1000, true), (3, 3000));
        for n in 1..=1024 {
            let (count, bytes) = receive_layout(n, 1000, true);
            assert!(count >= 2 && bytes >= 2000, "{n}");
            assert!(count * bytes >= n * 1000, "{n}");
        }
    }
}
