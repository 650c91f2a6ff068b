//! The send paths of software matching: an eager message as one fast-box record, in
//! pieces, injected, from a copy or straight from the caller's buffer, and a larger one
//! by rendezvous (its buffer registered for the receiver's read, then an RTS). It owns
//! the copied sends' blocks ([`copied_sent`]) and the registration of a rendezvous
//! buffer until its FIN. It never touches the lists: a send matches nothing here.

use super::order::stamp;
use super::wire::{Hdr, ACK, EAGER, FIN, FRAG, HDR_LEN, RTS};
use super::SoftMatch;
use crate::common::fbox;
use crate::fabric::buffer::StackMsg;
use crate::fabric::{self, Error, Local, MemoryRegion};
use crate::mtl::peer::Peer;
use crate::mtl::progress;
use crate::mtl::request::{Kind, Req, Request};
use crate::mtl::state::Mtl;
use crate::ompi::convertor::SendData;
use crate::ompi::error::OpalCode;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::Ordering;

/// Post header `h` and `data` as one record in fast box `tx`: `Error::AGAIN` when the
/// ring is full (the caller progresses and retries, as for the provider).
#[inline]
pub(super) fn fbox_post(tx: &fbox::Tx, h: &Hdr, data: &[u8]) -> fabric::Result<()> {
    if tx.send(&[&h.to_bytes(), data], 0) {
        Ok(())
    } else {
        Err(Error::AGAIN)
    }
}

/// [`send`] returned this: the message went out with inject, the request is done.
pub const SENT_INLINE: c_int = 1;

/// The stack buffer a piece or an injected message is built in.
pub const PIECE_BUF: usize = 4096;

/// `h` followed by `data` in `tmp` (not zeroed first: only the bytes written are
/// handed on, and zeroing 4 KiB costs more than the rest of a small send); `None` when
/// they do not fit.
#[inline(always)]
fn assemble<'a>(tmp: &'a mut StackMsg<PIECE_BUF>, h: &Hdr, data: &[u8]) -> Option<&'a mut [u8]> {
    if HDR_LEN + data.len() > PIECE_BUF {
        return None;
    }
    tmp.clear();
    tmp.push(&h.to_bytes());
    tmp.push(data);
    Some(tmp.bytes_mut())
}

/// Send the eager message of `hdr` (`data` its payload) as pieces of at most
/// `sm.piece_max` bytes: injected, or, under a send window, each from a copy with a
/// completion of its own, at most `sm.send_window` in flight.
fn send_pieces(m: &Mtl, sm: &SoftMatch, hdr: &Hdr, data: &[u8], addr: u64) -> fabric::Result<()> {
    let len = data.len();
    let id = sm.next_piece_id.fetch_add(2, Ordering::Relaxed);
    let step = sm.piece_max - HDR_LEN;
    let mut tmp = StackMsg::<PIECE_BUF>::default();
    // The message's number, taken by its first piece and carried by every piece.
    let mut num: Option<(u32, u64)> = None;
    for (i, piece) in data.chunks(step).enumerate() {
        let h = Hdr {
            kind: FRAG,
            len: len as u64,
            addr: (i * step) as u64,
            key: id,
            ..*hdr
        };
        if sm.send_window > 0 {
            sm.wait_for_window(m);
            send_copy(m, sm, &h, piece, addr, &mut num)?;
            continue;
        }
        // HDR_LEN + piece <= piece_max <= PIECE_BUF.
        let Some(bytes) = assemble(&mut tmp, &h, piece) else {
            return Err(Error::INVAL);
        };
        let ep = m.ep();
        // The receiver holds the pieces so far until finalize; an error reaches the
        // sender's caller.
        sm.post_numbered(m, addr, &mut num, |s, seq, src| {
            stamp(bytes, seq, src);
            ep.inject(s, bytes, addr)
        })?;
    }
    Ok(())
}

/// Eager messages up to this size that do not fit the provider's inject are sent
/// from a copy, and their request completes at once (see [`send`]). Above it the
/// copy would cost more than the wait for the completion.
const COPY_MAX: usize = 16 << 10;

/// Send header `h` and `data` from a heap copy under a request of its own
/// ([`Kind::Copied`]), both in one block freed at completion. `num` is the message's
/// number (see [`SoftMatch::post_numbered`]).
pub(super) fn send_copy(
    m: &Mtl,
    sm: &SoftMatch,
    h: &Hdr,
    data: &[u8],
    addr: u64,
    num: &mut Option<(u32, u64)>,
) -> fabric::Result<()> {
    let c = Req::alloc_copied(&h.to_bytes(), data).ok_or(Error::NOMEM)?;
    let (buf, ctx) = (c.copied_buf(), c.op_context());
    // Counted before the post: another thread's progress may read its completion
    // before fi_send returns.
    sm.copies_in_flight.fetch_add(1, Ordering::Relaxed);
    let ep = m.ep();
    let ret = sm.post_numbered(m, addr, num, |s, seq, src| {
        c.stamp_copied(seq, src);
        ep.send(s, buf, Local::NONE, addr, ctx)
    });
    if ret.is_err() {
        sm.copies_in_flight.fetch_sub(1, Ordering::Relaxed);
        // Not posted: still ours, and no completion will come.
        c.free_copied();
    }
    ret
}

/// A [`Kind::Copied`] send completed (or failed): free its block.
pub fn copied_sent(sm: &SoftMatch, r: Req) {
    sm.copies_in_flight.fetch_sub(1, Ordering::Relaxed);
    // Its one completion is reaped: nothing references the block any more.
    r.free_copied();
}

/// A blocking send of an eager message `data` that goes as one inject: sent (complete)
/// on return, without a request. `None` when it does not go that way (larger than an
/// inject, or sent in pieces).
pub fn send_injected(
    m: &Mtl,
    sm: &SoftMatch,
    peer: Peer,
    data: &[u8],
    bits: u64,
    cqd: u64,
) -> Option<c_int> {
    let hdr = Hdr {
        kind: EAGER,
        bits,
        data: cqd,
        len: data.len() as u64,
        ..Default::default()
    };
    let ret = match peer.fbox() {
        // An eager message fits a record.
        Some(tx) if data.len() <= sm.eager_max() => {
            progress::retry(m, |_| fbox_post(tx, &hdr, data))
        }
        _ => inject_whole(m, sm, &hdr, data, peer.addr)?,
    };
    Some(progress::to_ompi(ret))
}

/// Inject header `hdr` and its payload `data` as one message, when they fit an inject
/// and are not sent in pieces: the provider's answer, `None` when they do not fit or
/// the provider takes no injects (a send window, see [`SoftMatch::new`]'s
/// `send_window`).
fn inject_whole(
    m: &Mtl,
    sm: &SoftMatch,
    hdr: &Hdr,
    data: &[u8],
    addr: u64,
) -> Option<fabric::Result<()>> {
    let total = HDR_LEN + data.len();
    let pieces = sm.piece_max;
    if sm.send_window > 0 || total > m.inject_size || (pieces > 0 && total > pieces) {
        return None;
    }
    let mut tmp = StackMsg::<PIECE_BUF>::default();
    let bytes = assemble(&mut tmp, hdr, data)?;
    let ep = m.ep();
    Some(progress::retry(m, |s| {
        sm.numbered(addr, |seq, src| {
            stamp(bytes, seq, src);
            ep.inject(s, bytes, addr)
        })
    }))
}

/// The eager message of send `req` went out of copies or injects (`ret`): nothing of
/// the caller's buffer is in flight. A synchronous send still waits for its
/// acknowledgement (`pending` 1); any other is complete ([`SENT_INLINE`]).
fn sent_from_copies(sm: &SoftMatch, r: Req, sync: bool, ret: fabric::Result<()>) -> c_int {
    if let Err(e) = ret {
        if sync {
            sm.forget(r.addr());
        }
        return e.to_opal();
    }
    if sync {
        return sys::OMPI_SUCCESS;
    }
    r.pending().store(0, Ordering::Release);
    SENT_INLINE
}

/// Post the send of `data` for request `r`. Returns `OMPI_SUCCESS` (completions will
/// follow; `r` keeps what it needs of `data`), [`SENT_INLINE`], or an error.
#[allow(clippy::too_many_arguments)]
pub fn send(
    m: &Mtl,
    sm: &SoftMatch,
    r: Req,
    peer: Peer,
    data: SendData,
    bits: u64,
    cqd: u64,
    sync: bool,
) -> c_int {
    let addr = peer.addr;
    r.set_sm_addr(addr);
    let len = data.len();
    if len <= sm.eager_max() {
        r.set_sm_hdr(Hdr {
            kind: EAGER,
            bits,
            data: cqd,
            len: len as u64,
            token: r.addr(),
            ..Default::default()
        });
        if let Some(tx) = peer.fbox() {
            // An eager message fits a record.
            return send_eager_fbox(m, sm, r, tx, data.bytes(), sync);
        }
        return send_eager(m, sm, r, data, addr, sync);
    }
    send_rendezvous(m, sm, r, peer, data, bits, cqd)
}

/// [`send`] of an eager message (its header in `sm_hdr`) to a peer with fast box `tx`:
/// one record.
#[inline]
fn send_eager_fbox(
    m: &Mtl,
    sm: &SoftMatch,
    r: Req,
    tx: &fbox::Tx,
    data: &[u8],
    sync: bool,
) -> c_int {
    // The record is the whole message: only a synchronous send's ACK is left.
    r.pending().store(sync as i32, Ordering::Release);
    if sync {
        sm.expect(r.addr(), ACK);
    }
    let h = r.sm_hdr();
    if let Err(e) = progress::retry(m, |_| fbox_post(tx, &h, data)) {
        if sync {
            sm.forget(r.addr());
        }
        return e.to_opal();
    }
    if sync {
        sys::OMPI_SUCCESS
    } else {
        SENT_INLINE
    }
}

/// [`send`] of an eager message (its header in `sm_hdr`) through the provider to
/// `addr`: in pieces, injected, from a copy, or from the caller's buffer.
#[inline]
fn send_eager(m: &Mtl, sm: &SoftMatch, r: Req, data: SendData, addr: u64, sync: bool) -> c_int {
    r.pending()
        .store(if sync { 2 } else { 1 }, Ordering::Release);
    if sync {
        sm.expect(r.addr(), ACK);
    }
    let len = data.len();
    let total = HDR_LEN + len;
    if sm.piece_max > 0 && total > sm.piece_max {
        if sync {
            // Only the acknowledgement is left once the pieces are out.
            r.pending().store(1, Ordering::Release);
        }
        let ret = send_pieces(m, sm, &r.sm_hdr(), data.bytes(), addr);
        return sent_from_copies(sm, r, sync, ret);
    }
    if !sync {
        if let Some(ret) = inject_whole(m, sm, &r.sm_hdr(), data.bytes(), addr) {
            if let Err(e) = ret {
                return e.to_opal();
            }
            r.pending().store(0, Ordering::Release);
            return SENT_INLINE;
        }
    }
    if (!sync || sm.send_window > 0) && len <= COPY_MAX {
        // A synchronous send under a send window goes as a copy in the window too;
        // only its acknowledgement is left after it.
        if sync {
            r.pending().store(1, Ordering::Release);
        }
        sm.wait_for_window(m);
        // Complete the request now, as an inject would: the message goes out of a
        // copy that is freed at its completion. Programs written against ob1 (and
        // most MTLs, whose small sends complete at once) test for this.
        let ret = send_copy(m, sm, &r.sm_hdr(), data.bytes(), addr, &mut None);
        return sent_from_copies(sm, r, sync, ret);
    }
    send_eager_sendv(m, sm, r, data, addr, sync)
}

/// [`send`] of an eager message (its header in `sm_hdr`) to `addr` straight from the
/// request's header and the caller's buffer: complete when the provider says so.
#[inline]
fn send_eager_sendv(
    m: &Mtl,
    sm: &SoftMatch,
    r: Req,
    data: SendData,
    addr: u64,
    sync: bool,
) -> c_int {
    let (hdr, buf) = (r.sm_hdr_buf(), r.send_buf(data));
    let ctx = r.op_context();
    let ep = m.ep();
    let ret = progress::retry(m, |s| {
        sm.numbered(addr, |seq, src| {
            r.stamp_sm_hdr(seq, src);
            ep.send(s, hdr, buf, addr, ctx)
        })
    });
    if let Err(e) = ret {
        if sync {
            sm.forget(r.addr());
        }
        // Not posted: a pack buffer goes.
        r.free_buffer();
        return e.to_opal();
    }
    sys::OMPI_SUCCESS
}

/// [`send`] of a message larger than the eager limit, by rendezvous: expose the
/// buffer, send the RTS, wait for FIN.
#[inline]
#[allow(clippy::too_many_arguments)]
fn send_rendezvous(
    m: &Mtl,
    sm: &SoftMatch,
    r: Req,
    peer: Peer,
    data: SendData,
    bits: u64,
    cqd: u64,
) -> c_int {
    let addr = peer.addr;
    let (len, base) = (data.len(), data.addr());
    let key = sm.next_key.fetch_add(1, Ordering::Relaxed);
    // The request keeps the data from here until its FIN (its last completion), when
    // the registration is dropped first.
    let _ = r.send_buf(data);
    // SAFETY: the buffer, now the request's (user memory the PML keeps until the
    // request completes, or a pack buffer the request frees at its last completion),
    // stays valid until FIN, when the registration is dropped (`drop_mr`) before the
    // request completes.
    let mr = unsafe {
        MemoryRegion::register(
            &sm.domain,
            base as *const c_void,
            len,
            fi::FI_REMOTE_READ as u64,
            0,
            key,
            0,
        )
    };
    let mr = match mr {
        Ok(mr) => mr,
        Err(e) => {
            log::error!("registering a {len}-byte send buffer failed: {e}");
            r.free_buffer();
            return e.to_opal();
        }
    };
    let rkey = mr.key().unwrap_or(key);
    r.keep_mr(mr);
    r.set_sm_hdr(Hdr {
        kind: RTS,
        bits,
        data: cqd,
        len: len as u64,
        // Without FI_MR_VIRT_ADDR (udp;ofi_rxd, net) the peer addresses the region
        // by offset.
        addr: if sm.domain.mr_mode() & fi::FI_MR_VIRT_ADDR != 0 {
            base
        } else {
            0
        },
        key: rkey,
        token: r.addr(),
        ..Default::default()
    });
    r.pending().store(1, Ordering::Release);
    let h = r.sm_hdr();
    sm.expect(r.addr(), FIN);
    let ret = if peer.fbox().is_none() && sm.send_window > 0 {
        // Under a send window the header goes as a copy in the window.
        sm.wait_for_window(m);
        send_copy(m, sm, &h, &[], addr, &mut None)
    } else {
        let ep = m.ep();
        progress::retry(m, |s| {
            if let Some(tx) = peer.fbox() {
                return fbox_post(tx, &h, &[]);
            }
            sm.numbered(addr, |seq, src| {
                let h = Hdr { seq, src, ..h };
                ep.inject(s, &h.to_bytes(), addr)
            })
        })
    };
    if let Err(e) = ret {
        sm.forget(r.addr());
        drop_mr(r);
        r.free_buffer();
        return e.to_opal();
    }
    sys::OMPI_SUCCESS
}

/// Drop the registration of rendezvous send `r`'s buffer, if it has one.
pub(super) fn drop_mr(r: Req) {
    drop(r.take_mr());
}

/// A new internal request of software matching's (a bounce buffer's).
pub(super) fn internal(kind: Kind) -> Box<Request> {
    Box::new(Request::of_kind(kind, None))
}
