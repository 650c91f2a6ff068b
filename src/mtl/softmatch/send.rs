//! The send paths of software matching: an eager message as one fast-box record, in
//! pieces, injected, from a copy or straight from the caller's buffer, and a larger one
//! by rendezvous (its buffer registered for the receiver's read, then an RTS). It owns
//! the copied sends' blocks ([`copied_sent`]) and the registration of a rendezvous
//! buffer until its FIN. It never touches the lists: a send matches nothing here.

use super::order::stamp;
use super::wire::{Hdr, ACK, EAGER, FIN, FRAG, HDR_LEN, RTS};
use super::SoftMatch;
use crate::common::fbox;
use crate::fabric::MemoryRegion;
use crate::mtl::peer::Peer;
use crate::mtl::progress;
use crate::mtl::request::Kind;
use crate::mtl::request::Request;
use crate::mtl::state::Mtl;
use crate::ompi::error::OpalCode;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;

/// Post header `h` and `len` bytes at `data` as one record in fast box `tx`: 0, or
/// -FI_EAGAIN when the ring is full (the caller progresses and retries, as for the
/// provider).
///
/// # Safety
/// `data` holds `len` bytes; `HDR_LEN + len` is at most the ring's largest record.
#[inline]
pub(super) unsafe fn fbox_post(tx: &fbox::Tx, h: &Hdr, data: *const u8, len: usize) -> isize {
    let Some(slot) = tx.reserve(HDR_LEN + len) else {
        return -(fi::FI_EAGAIN as isize);
    };
    let p = slot.payload();
    // SAFETY: the slot has room for HDR_LEN + len bytes; the sources hold them.
    unsafe {
        ptr::copy_nonoverlapping(h as *const Hdr as *const u8, p, HDR_LEN);
        if len > 0 {
            ptr::copy_nonoverlapping(data, p.add(HDR_LEN), len);
        }
    }
    slot.commit(HDR_LEN + len, 0);
    0
}

/// [`send`] returned this: the message went out with inject, the request is done.
pub const SENT_INLINE: c_int = 1;

/// The stack buffer a piece or an injected message is built in.
pub const PIECE_BUF: usize = 4096;

/// Send the eager message of `hdr` (`len` payload bytes at `data`) as pieces of at
/// most `sm.piece_max` bytes: injected, or, under a send window, each from a copy with
/// a completion of its own, at most `sm.send_window` in flight. Returns the provider's
/// code.
///
/// # Safety
/// `data` must hold `len` bytes.
unsafe fn send_pieces(
    m: &Mtl,
    sm: &SoftMatch,
    hdr: &Hdr,
    data: *const u8,
    len: usize,
    addr: u64,
) -> isize {
    let id = sm.next_piece_id.fetch_add(2, Ordering::Relaxed);
    let step = sm.piece_max - HDR_LEN;
    let mut tmp = std::mem::MaybeUninit::<[u8; PIECE_BUF]>::uninit();
    let tmp = tmp.as_mut_ptr() as *mut u8;
    let mut off = 0usize;
    // The message's number, taken by its first piece and carried by every piece.
    let mut num: Option<(u32, u64)> = None;
    while off < len {
        let n = step.min(len - off);
        let h = Hdr {
            kind: FRAG,
            len: len as u64,
            addr: off as u64,
            key: id,
            ..*hdr
        };
        if sm.send_window > 0 {
            sm.wait_for_window(m);
            // SAFETY: data holds len bytes.
            let ret = unsafe { send_copy(m, sm, &h, data.add(off), n, addr, &mut num) };
            if ret < 0 {
                return ret;
            }
            off += n;
            continue;
        }
        // SAFETY: HDR_LEN + n <= piece_max <= PIECE_BUF; data holds len bytes.
        unsafe {
            ptr::copy_nonoverlapping(&h as *const Hdr as *const u8, tmp, HDR_LEN);
            ptr::copy_nonoverlapping(data.add(off), tmp.add(HDR_LEN), n);
        }
        // SAFETY: the first HDR_LEN + n bytes of tmp are initialised, a header
        // first; inject copies them before returning.
        let ret = sm.post_numbered(m, addr, &mut num, |seq, src| unsafe {
            stamp(tmp, seq, src);
            fi::fi_inject(m.ep(), tmp as *const c_void, HDR_LEN + n, addr)
        });
        if ret < 0 {
            // The receiver holds the pieces so far until finalize; the error reaches
            // the sender's caller.
            return ret;
        }
        off += n;
    }
    0
}

/// Eager messages up to this size that do not fit the provider's inject are sent
/// from a copy, and their request completes at once (see [`send`]). Above it the
/// copy would cost more than the wait for the completion.
const COPY_MAX: usize = 16 << 10;

/// The one heap block of a copied send: its request, then header and payload.
fn copied_layout(total: usize) -> Option<std::alloc::Layout> {
    // A Request's size is a multiple of its alignment, so the copy follows it directly.
    std::alloc::Layout::from_size_align(
        std::mem::size_of::<Request>() + total,
        std::mem::align_of::<Request>(),
    )
    .ok()
}

/// Send header `h` and `len` bytes at `data` from a heap copy under a request of its
/// own ([`Kind::Copied`]), both in one block freed at completion. `num` is the
/// message's number (see [`SoftMatch::post_numbered`]). Returns the provider's code.
///
/// # Safety
/// `data` must hold `len` bytes (only read before this returns).
pub(super) unsafe fn send_copy(
    m: &Mtl,
    sm: &SoftMatch,
    h: &Hdr,
    data: *const u8,
    len: usize,
    addr: u64,
    num: &mut Option<(u32, u64)>,
) -> isize {
    let total = HDR_LEN + len;
    let Some(layout) = copied_layout(total) else {
        return -(fi::FI_ENOMEM as isize);
    };
    // SAFETY: the layout has a non-zero size (it holds a Request).
    let c = unsafe { std::alloc::alloc(layout) } as *mut Request;
    if c.is_null() {
        return -(fi::FI_ENOMEM as isize);
    }
    // SAFETY: c is a fresh block with room for a Request followed by total bytes;
    // both sources hold what is copied.
    let (buf, ctx) = unsafe {
        c.write(Request::internal(Kind::Copied, None));
        let buf = (c as *mut u8).add(std::mem::size_of::<Request>());
        ptr::copy_nonoverlapping(h as *const Hdr as *const u8, buf, HDR_LEN);
        if len > 0 {
            ptr::copy_nonoverlapping(data, buf.add(HDR_LEN), len);
        }
        (*c).buffer = buf;
        (*c).length = total;
        (buf, (*c).ctx_ptr())
    };
    // Counted before the post: another thread's progress may read its completion
    // before fi_send returns.
    sm.copies_in_flight.fetch_add(1, Ordering::Relaxed);
    // SAFETY: the block, a header first, lives until the completion frees it.
    let ret = sm.post_numbered(m, addr, num, |seq, src| unsafe {
        stamp(buf, seq, src);
        fi::fi_send(
            m.ep(),
            buf as *const c_void,
            total,
            ptr::null_mut(),
            addr,
            ctx,
        )
    });
    if ret < 0 {
        sm.copies_in_flight.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: not posted: still ours.
        unsafe { copied_free(c) };
    }
    ret
}

/// A [`Kind::Copied`] send completed (or failed): free its block.
///
/// # Safety
/// `r` must be a posted Copied request from [`send_copy`], not used afterwards.
pub unsafe fn copied_sent(sm: &SoftMatch, r: *mut Request) {
    sm.copies_in_flight.fetch_sub(1, Ordering::Relaxed);
    // SAFETY: forwarded.
    unsafe { copied_free(r) };
}

/// Free the block of a Copied request.
///
/// # Safety
/// `r` must be a Copied request from [`send_copy`], not used afterwards.
unsafe fn copied_free(r: *mut Request) {
    // SAFETY: r heads a block allocated in send_copy with the layout of its length.
    unsafe {
        let total = (*r).length;
        ptr::drop_in_place(r);
        if let Some(layout) = copied_layout(total) {
            std::alloc::dealloc(r as *mut u8, layout);
        }
    }
}

/// A blocking send of an eager message that goes as one inject: sent (complete) on
/// return, without a request. `None` when it does not go that way (synchronous,
/// larger than an inject, or sent in pieces).
///
/// # Safety
/// `ptr_` holds `len` bytes.
pub unsafe fn send_injected(
    m: &Mtl,
    sm: &SoftMatch,
    peer: Peer,
    ptr_: *const u8,
    len: usize,
    bits: u64,
    data: u64,
) -> Option<c_int> {
    let hdr = Hdr {
        kind: EAGER,
        bits,
        data,
        len: len as u64,
        ..Default::default()
    };
    let ret = match peer.fbox() {
        Some(tx) if len <= sm.eager_max() => progress::retry(m, || {
            // SAFETY: forwarded; an eager message fits a record.
            unsafe { fbox_post(tx, &hdr, ptr_, len) }
        }),
        // SAFETY: forwarded.
        _ => unsafe { inject_whole(m, sm, &hdr, ptr_, len, peer.addr) }?,
    };
    Some(if ret < 0 {
        progress::fi_to_ompi(ret)
    } else {
        sys::OMPI_SUCCESS
    })
}

/// Inject header `hdr` and its `len` payload bytes as one message, when they fit an
/// inject and are not sent in pieces: the provider's return value, `None` when they
/// do not fit or the provider takes no injects (a send window, see
/// [`SoftMatch::new`]'s `send_window`).
///
/// # Safety
/// `ptr_` holds `len` bytes.
unsafe fn inject_whole(
    m: &Mtl,
    sm: &SoftMatch,
    hdr: &Hdr,
    ptr_: *const u8,
    len: usize,
    addr: u64,
) -> Option<isize> {
    let total = HDR_LEN + len;
    let pieces = sm.piece_max;
    if sm.send_window > 0
        || total > m.inject_size
        || total > PIECE_BUF
        || (pieces > 0 && total > pieces)
    {
        return None;
    }
    // Not zeroed: only the `total` bytes written below are handed to inject (zeroing
    // 4 KiB costs more than the rest of a small send).
    let mut tmp = std::mem::MaybeUninit::<[u8; PIECE_BUF]>::uninit();
    let tmp = tmp.as_mut_ptr() as *mut u8;
    // SAFETY: both sources hold the bytes copied; tmp has room for total.
    unsafe {
        ptr::copy_nonoverlapping(hdr as *const Hdr as *const u8, tmp, HDR_LEN);
        if len > 0 {
            ptr::copy_nonoverlapping(ptr_, tmp.add(HDR_LEN), len);
        }
    }
    Some(progress::retry(m, || {
        sm.numbered(addr, |seq, src| {
            // SAFETY: the first `total` bytes of tmp are initialised (a header first);
            // inject copies them before returning.
            unsafe {
                stamp(tmp, seq, src);
                fi::fi_inject(m.ep(), tmp as *const c_void, total, addr)
            }
        })
    }))
}

/// The eager message of send `req` went out of copies or injects (`ret`, the provider's
/// code): nothing of the caller's buffer is in flight. A synchronous send still waits
/// for its acknowledgement (`pending` 1); any other is complete ([`SENT_INLINE`]).
fn sent_from_copies(sm: &SoftMatch, req: &Request, sync: bool, ret: isize) -> c_int {
    if ret < 0 {
        if sync {
            sm.forget(req as *const Request as u64);
        }
        return progress::fi_to_ompi(ret);
    }
    if sync {
        return sys::OMPI_SUCCESS;
    }
    req.pending.store(0, Ordering::Release);
    SENT_INLINE
}

/// Post the send of `data` (`len` bytes at `ptr`) for request `r`. Returns
/// `OMPI_SUCCESS` (completions will follow), [`SENT_INLINE`], or an error.
///
/// # Safety
/// `r` must be a live request that stays alive until its completions arrive, and
/// `ptr_` must hold `len` bytes that stay valid until then.
#[allow(clippy::too_many_arguments)]
pub unsafe fn send(
    m: &Mtl,
    sm: &SoftMatch,
    r: *mut Request,
    peer: Peer,
    ptr_: *const u8,
    len: usize,
    bits: u64,
    data: u64,
    sync: bool,
) -> c_int {
    // SAFETY: r is live (the PML's request or the caller's stack request).
    let req = unsafe { &mut *r };
    let addr = peer.addr;
    req.sm_addr = addr;
    if len <= sm.eager_max() {
        req.sm_hdr = Hdr {
            kind: EAGER,
            bits,
            data,
            len: len as u64,
            token: r as u64,
            ..Default::default()
        };
        if let Some(tx) = peer.fbox() {
            // SAFETY: forwarded; an eager message fits a record.
            return unsafe { send_eager_fbox(m, sm, r, tx, ptr_, len, sync) };
        }
        // SAFETY: forwarded.
        return unsafe { send_eager(m, sm, r, ptr_, len, addr, sync) };
    }
    // SAFETY: forwarded.
    unsafe { send_rendezvous(m, sm, r, peer, ptr_, len, bits, data) }
}

/// [`send`] of an eager message (its header in `sm_hdr`) to a peer with fast box `tx`:
/// one record.
///
/// # Safety
/// As for [`send`]; `len` is at most the eager limit.
#[inline]
unsafe fn send_eager_fbox(
    m: &Mtl,
    sm: &SoftMatch,
    r: *mut Request,
    tx: &fbox::Tx,
    ptr_: *const u8,
    len: usize,
    sync: bool,
) -> c_int {
    // SAFETY: r is live (the caller's contract).
    let req = unsafe { &mut *r };
    // The record is the whole message: only a synchronous send's ACK is left.
    req.pending.store(sync as i32, Ordering::Release);
    if sync {
        sm.expect(r as u64, ACK);
    }
    let h = req.sm_hdr;
    // SAFETY: ptr_ holds len bytes; an eager message fits a record.
    let ret = progress::retry(m, || unsafe { fbox_post(tx, &h, ptr_, len) });
    if ret < 0 {
        if sync {
            sm.forget(r as u64);
        }
        return progress::fi_to_ompi(ret);
    }
    if sync {
        sys::OMPI_SUCCESS
    } else {
        SENT_INLINE
    }
}

/// [`send`] of an eager message (its header in `sm_hdr`) through the provider to
/// `addr`: in pieces, injected, from a copy, or from the caller's buffer.
///
/// # Safety
/// As for [`send`].
#[inline]
unsafe fn send_eager(
    m: &Mtl,
    sm: &SoftMatch,
    r: *mut Request,
    ptr_: *const u8,
    len: usize,
    addr: u64,
    sync: bool,
) -> c_int {
    // SAFETY: r is live (the caller's contract).
    let req = unsafe { &mut *r };
    req.pending
        .store(if sync { 2 } else { 1 }, Ordering::Release);
    if sync {
        sm.expect(r as u64, ACK);
    }
    let total = HDR_LEN + len;
    if sm.piece_max > 0 && total > sm.piece_max {
        if sync {
            // Only the acknowledgement is left once the pieces are out.
            req.pending.store(1, Ordering::Release);
        }
        // SAFETY: ptr_ holds len bytes.
        let ret = unsafe { send_pieces(m, sm, &req.sm_hdr, ptr_, len, addr) };
        return sent_from_copies(sm, req, sync, ret);
    }
    if !sync {
        // SAFETY: ptr_ holds len bytes.
        if let Some(ret) = unsafe { inject_whole(m, sm, &req.sm_hdr, ptr_, len, addr) } {
            if ret < 0 {
                return progress::fi_to_ompi(ret);
            }
            req.pending.store(0, Ordering::Release);
            return SENT_INLINE;
        }
    }
    if (!sync || sm.send_window > 0) && len <= COPY_MAX {
        // A synchronous send under a send window goes as a copy in the window too;
        // only its acknowledgement is left after it.
        if sync {
            req.pending.store(1, Ordering::Release);
        }
        sm.wait_for_window(m);
        // Complete the request now, as an inject would: the message goes out of a
        // copy that is freed at its completion. Programs written against ob1 (and
        // most MTLs, whose small sends complete at once) test for this.
        // SAFETY: ptr_ holds len bytes; the copy gets its own request.
        let ret = unsafe { send_copy(m, sm, &req.sm_hdr, ptr_, len, addr, &mut None) };
        return sent_from_copies(sm, req, sync, ret);
    }
    // SAFETY: forwarded.
    unsafe { send_eager_sendv(m, sm, r, ptr_, len, addr, sync) }
}

/// [`send`] of an eager message (its header in `sm_hdr`) to `addr` straight from the
/// request's header and the caller's buffer: complete when the provider says so.
///
/// # Safety
/// As for [`send`].
#[inline]
unsafe fn send_eager_sendv(
    m: &Mtl,
    sm: &SoftMatch,
    r: *mut Request,
    ptr_: *const u8,
    len: usize,
    addr: u64,
    sync: bool,
) -> c_int {
    // SAFETY: r is live (the caller's contract).
    let req = unsafe { &mut *r };
    let iov = [
        fi::iovec {
            iov_base: &mut req.sm_hdr as *mut Hdr as *mut c_void,
            iov_len: HDR_LEN,
        },
        fi::iovec {
            iov_base: ptr_ as *mut c_void,
            iov_len: len,
        },
    ];
    let ctx = req.ctx_ptr();
    let n = if len == 0 { 1 } else { 2 };
    let hdr = iov[0].iov_base as *mut u8;
    let ret = progress::retry(m, || {
        sm.numbered(addr, |seq, src| {
            // SAFETY: the header lives in the request and the data in the caller's
            // buffer until the send completes.
            unsafe {
                stamp(hdr, seq, src);
                fi::fi_sendv(m.ep(), iov.as_ptr(), ptr::null_mut(), n, addr, ctx)
            }
        })
    });
    if ret < 0 {
        if sync {
            sm.forget(r as u64);
        }
        progress::fi_to_ompi(ret)
    } else {
        sys::OMPI_SUCCESS
    }
}

/// [`send`] of a message larger than the eager limit, by rendezvous: expose the
/// buffer, send the RTS, wait for FIN.
///
/// # Safety
/// As for [`send`].
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn send_rendezvous(
    m: &Mtl,
    sm: &SoftMatch,
    r: *mut Request,
    peer: Peer,
    ptr_: *const u8,
    len: usize,
    bits: u64,
    data: u64,
) -> c_int {
    // SAFETY: r is live (the caller's contract).
    let req = unsafe { &mut *r };
    let addr = peer.addr;
    let key = sm.next_key.fetch_add(1, Ordering::Relaxed);
    // SAFETY: the buffer stays valid until FIN, when the registration is dropped.
    let mr = unsafe {
        MemoryRegion::register(
            &sm.domain,
            ptr_ as *const c_void,
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
            return e.to_opal();
        }
    };
    let rkey = mr.key().unwrap_or(key);
    req.sm_mr = Box::into_raw(Box::new(mr)) as *mut c_void;
    req.sm_hdr = Hdr {
        kind: RTS,
        bits,
        data,
        len: len as u64,
        // Without FI_MR_VIRT_ADDR (udp;ofi_rxd, net) the peer addresses the region
        // by offset.
        addr: if sm.domain.mr_mode() & fi::FI_MR_VIRT_ADDR != 0 {
            ptr_ as u64
        } else {
            0
        },
        key: rkey,
        token: r as u64,
        ..Default::default()
    };
    req.pending.store(1, Ordering::Release);
    let h = req.sm_hdr;
    sm.expect(r as u64, FIN);
    let ret = if peer.fbox().is_none() && sm.send_window > 0 {
        // Under a send window the header goes as a copy in the window.
        sm.wait_for_window(m);
        // SAFETY: a header, no payload.
        unsafe { send_copy(m, sm, &h, ptr::null(), 0, addr, &mut None) }
    } else {
        progress::retry(m, || {
            if let Some(tx) = peer.fbox() {
                // SAFETY: a header, no payload.
                return unsafe { fbox_post(tx, &h, ptr::null(), 0) };
            }
            sm.numbered(addr, |seq, src| {
                let h = Hdr { seq, src, ..h };
                // SAFETY: inject copies the header.
                unsafe { fi::fi_inject(m.ep(), &h as *const Hdr as *const c_void, HDR_LEN, addr) }
            })
        })
    };
    if ret < 0 {
        sm.forget(r as u64);
        drop_mr(req);
        return progress::fi_to_ompi(ret);
    }
    sys::OMPI_SUCCESS
}

/// Drop the registration of rendezvous send `req`'s buffer, if it has one.
pub(super) fn drop_mr(req: &mut Request) {
    if !req.sm_mr.is_null() {
        // SAFETY: the Box leaked in send_rendezvous().
        unsafe { drop(Box::from_raw(req.sm_mr as *mut MemoryRegion)) };
        req.sm_mr = ptr::null_mut();
    }
}
