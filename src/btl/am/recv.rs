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
use crate::fabric::Error;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::c_void;
use std::ptr;
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

/// Post `n` receive buffers on each receive context (as multi-receive buffers, see
/// [`receive_layout`], where the module has them).
///
/// # Safety
/// `module` is live.
pub unsafe fn post_receives(module: *mut Module, n: usize) -> Result<(), Error> {
    // SAFETY: caller's contract.
    let state = unsafe { &(*module).state };
    let (n, cap) = receive_layout(n, HDR + state.frag_payload, state.multi_recv);
    for cx in (0..state.ctxs.len()).flat_map(|cx| std::iter::repeat_n(cx, n)) {
        // SAFETY: plain allocation, checked.
        let buf = unsafe { libc::malloc(cap) } as *mut u8;
        if buf.is_null() {
            return Err(Error::NOMEM);
        }
        let mr = if state.mr_local {
            // SAFETY: buf lives until free_recv_buf, after the region is dropped.
            match unsafe { state.register(buf as *const c_void, cap) } {
                Ok(m) => Some(m),
                Err(e) => {
                    // SAFETY: allocated above.
                    unsafe { libc::free(buf as *mut c_void) };
                    return Err(e);
                }
            }
        } else {
            None
        };
        let rb = Box::into_raw(Box::new(RecvBuf {
            ctx: Ctx::new(OpKind::Recv),
            cx,
            buf,
            cap,
            mr,
        }));
        lock(&state.recv_bufs).push(rb);
        // SAFETY: rb is live until finalize.
        unsafe { repost(state, rb) }?;
    }
    Ok(())
}

/// Post (again) one receive buffer, progressing while the provider pushes back.
///
/// # Safety
/// `rb` is a live receive buffer of this module, not posted.
unsafe fn repost(state: &State, rb: *mut RecvBuf) -> Result<(), Error> {
    loop {
        // SAFETY: caller's contract.
        match unsafe { try_post(state, rb) } {
            Err(Error::AGAIN) => {
                // Receives are only refused for lack of resources: reap some.
                crate::ompi::progress::progress();
            }
            other => return other,
        }
    }
}

/// One attempt at posting receive buffer `rb`.
///
/// # Safety
/// As [`repost`].
unsafe fn try_post(state: &State, rb: *mut RecvBuf) -> Result<(), Error> {
    // SAFETY: caller's contract.
    let r = unsafe { &mut *rb };
    let desc = r.mr.as_ref().map_or(ptr::null_mut(), |m| m.desc());
    r.ctx = Ctx::new(OpKind::Recv);
    let ctx = r.ctx.as_op_context();
    // SAFETY: the buffer and context live until the completion is reaped (or the
    // endpoint closes, before the buffer is freed).
    state.fi(|| unsafe {
        let rx = &state.ctxs[r.cx].rx;
        if state.multi_recv {
            rx.recv_multi(r.buf as *mut c_void, r.cap, desc, ctx)
        } else {
            rx.recv(r.buf as *mut c_void, r.cap, desc, u64::MAX, ctx)
        }
    })
}

/// Post again the receive buffers the provider refused (see [`recv_complete`]), at
/// most once per [`crate::common::sync::Unposted::INTERVAL`]. Called by progress.
pub fn post_unposted(state: &State) {
    if state.closing.load(Ordering::Relaxed) {
        return;
    }
    // SAFETY: a live receive buffer of this module, not posted (recv_complete).
    let (posted, all) = state
        .unposted
        .retry(|&rb| unsafe { try_post(state, rb) }.is_ok());
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
///
/// # Safety
/// `ctx` is the Ctx of one of our receive buffers.
pub unsafe fn recv_complete(
    module: *mut Module,
    ctx: *mut c_void,
    len: usize,
    err: i32,
    buf: *const c_void,
    flags: u64,
) {
    // Ctx is RecvBuf's first field.
    let rb = ctx as *mut RecvBuf;
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    // SAFETY: rb is live until finalize.
    let (base, cap) = unsafe { ((*rb).buf, (*rb).cap) };
    let released = !state.multi_recv || flags & fi::FI_MULTI_RECV as u64 != 0;
    if err != 0 {
        if state.closing.load(Ordering::Relaxed) || err == fi::FI_ECANCELED as i32 {
            return;
        }
        log::warn!(
            "a receive completed with an error on {}: {}",
            state.provider,
            Error(err)
        );
    } else if !state.multi_recv || len > 0 {
        // (A multi-receive buffer may be released by a completion without a fragment.)
        // SAFETY: rb's buffer, ours until reposted below.
        match unsafe { crate::fabric::ep::received(base, cap, state.multi_recv, buf, len) } {
            None => {
                state.bad_fragments.fetch_add(1, Ordering::Relaxed);
                log::error!(
                    "dropping a fragment that {} placed outside its receive buffer ({buf:p}, \
                     buffer {base:p} of {cap} bytes)",
                    state.provider
                );
            }
            Some(bytes) if bytes.len() > 1 && bytes[1] == PIECE_MAGIC => {
                // SAFETY: module is live; rb stays ours until reposted below.
                unsafe { piece_arrived(module, bytes) };
            }
            Some(bytes) => match AmHeader::decode(bytes) {
                // SAFETY: module is live; the payload (HDR bytes in, h.len long, checked
                // against what arrived) stays ours until we repost below.
                Ok((h, _)) => unsafe {
                    dispatch(
                        module,
                        h.tag,
                        bytes.as_ptr().add(HDR) as *mut u8,
                        h.len as usize,
                    )
                },
                Err(e) => {
                    state.bad_fragments.fetch_add(1, Ordering::Relaxed);
                    log::error!("dropping a received fragment on {}: {e}", state.provider);
                }
            },
        }
    }
    if !released || state.closing.load(Ordering::Relaxed) {
        return;
    }
    let ret = if crate::common::sync::refuse_repost() {
        Err(Error(fi::FI_EIO as i32))
    } else {
        // SAFETY: rb is ours and no longer posted.
        unsafe { repost(state, rb) }
    };
    if let Err(e) = ret {
        // Kept, not lost: with no buffer posted the module would stop receiving.
        if let Some(n) = state.unposted.push(rb) {
            log::error!(
                "re-posting a receive buffer on {}: {e}; progress tries again ({n} refused \
                 so far)",
                state.provider
            );
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
///
/// # Safety
/// `module` is live.
unsafe fn piece_arrived(module: *mut Module, bytes: &[u8]) {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
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
            let len = a.payload.len();
            // SAFETY: the payload holds len bytes and lives until the callback returns.
            unsafe { dispatch(module, a.tag, a.payload.as_mut_ptr(), len) };
        }
        Err(e) => {
            state.bad_fragments.fetch_add(1, Ordering::Relaxed);
            log::error!("dropping a received piece on {}: {e}", state.provider);
        }
    }
}

/// Hand a decoded fragment to the callback registered for its tag.
///
/// # Safety
/// `module` is live; `payload` points to `len` received bytes of one of our
/// receive buffers, which stays ours (not reposted) until this returns.
pub(in crate::btl) unsafe fn dispatch(module: *mut Module, tag: u8, payload: *mut u8, len: usize) {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    if (state.amo && tag == amo::TAG_REQ) || (state.serves_requests() && tag == amo::TAG_REP) {
        // SAFETY: the payload holds len received bytes until the buffer is reposted.
        unsafe { amo::on_message(module, tag, payload, len) };
        return;
    }
    if state.put_by_read && tag == put_by_read::TAG_PUT {
        // SAFETY: as above.
        unsafe { put_by_read::on_message(module, payload, len) };
        return;
    }
    if state.one_sided
        && (tag == crate::btl::resolve::TAG_FIND || tag == crate::btl::resolve::TAG_FOUND)
    {
        // SAFETY: as above.
        unsafe { crate::btl::resolve::on_message(module, tag, payload, len) };
        return;
    }
    // SAFETY: the trigger table is Open MPI's, filled by the PML before traffic;
    // tag < MCA_BTL_TAG_MAX, its length (checked by AmHeader::decode).
    let trig = unsafe {
        *(&raw const sys::mca_btl_base_active_message_trigger
            as *const sys::mca_btl_active_message_callback_t)
            .add(tag as usize)
    };
    let Some(cb) = trig.cbfunc else {
        // SAFETY: module is live.
        unsafe { &(*module).state }
            .bad_fragments
            .fetch_add(1, Ordering::Relaxed);
        log::warn!("dropping a fragment with active-message tag {tag}, which nobody registered");
        return;
    };
    let mut seg = sys::mca_btl_base_segment_t {
        seg_addr: sys::opal_ptr_t {
            pval: payload as *mut c_void,
        },
        seg_len: len as u64,
    };
    // SAFETY: zeroed is a valid descriptor; it only lives for the callback.
    let mut des: sys::mca_btl_base_descriptor_t = unsafe { std::mem::zeroed() };
    des.des_segments = &mut seg;
    des.des_segment_count = 1;
    // SAFETY: the callback may use (and write) the payload until it returns; we
    // repost after.
    unsafe {
        cb(
            module as *mut sys::mca_btl_base_module_t,
            tag,
            &mut des,
            trig.cbdata,
        )
    };
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
