//! The receive buffers of software matching (bounce buffers, or multi-receive buffers
//! where the provider has `FI_MULTI_RECV`): posting and reposting them, their
//! completions, and what arrives in them or in a fast box: a message is decoded, put
//! back in its sender's order, and dispatched ([`bounce_done`]). Nothing here keeps a
//! reference into a buffer past the call that received it, and the MPI receives are
//! `recv`'s: a matched message goes to [`deliver`] with the lists' lock released.

use super::lists::{add_piece, lock, Unexpected, Whole};
use super::order::Arrival;
use super::recv::{deliver, fail_recv, Delivery};
use super::send::drop_mr;
use super::wire::{Hdr, ACK, EAGER, FIN, FRAG, HDR_LEN};
use super::SoftMatch;
use crate::fabric::{self, Serialized};
use crate::mtl::completion;
use crate::mtl::progress;
use crate::mtl::request::Req;
use crate::mtl::state::Mtl;
use libfabric_sys as fi;
use std::sync::atomic::Ordering;

/// Receive buffers posted, one message each, where the provider has no `FI_MULTI_RECV`.
pub const BOUNCE_COUNT: usize = 64;

/// Multi-receive buffers posted, where the provider offers `FI_MULTI_RECV`.
pub const MULTI_COUNT: usize = 4;

/// Largest messages one multi-receive buffer holds: with [`MULTI_COUNT`], as much
/// memory as [`BOUNCE_COUNT`] single buffers.
pub const MULTI_SLOTS: usize = BOUNCE_COUNT / MULTI_COUNT;

/// Bounce buffers where messages go whole (ofi_rxm under `mtl_ofi_matching=software`),
/// so that messages above 16 KiB are read straight into the receive buffer.
pub const BOUNCE_SMALL: usize = 16384;

/// Bounce buffers where an RMA read is a protocol exchange of the provider's own
/// (net): up to 64 KiB of payload goes eagerly, one message instead of RTS, read
/// request, read response and FIN, which cost more than the one message at that size
/// (bench/pingpong.c over net, `-s 65536`, shows it).
pub const BOUNCE_LARGE: usize = 65536 + HDR_LEN;

/// Post bounce buffer `r`, progressing while the provider pushes back.
pub(super) fn post_bounce(m: &Mtl, sm: &SoftMatch, r: Req) -> fabric::Result<()> {
    progress::retry(m, |s| try_post_bounce(m, sm, s, r))
}

/// One attempt at posting bounce buffer `r` (its buffer lives until finalize), under
/// the lock (`s`).
fn try_post_bounce(m: &Mtl, sm: &SoftMatch, s: &Serialized<'_>, r: Req) -> fabric::Result<()> {
    m.ep().recv(s, r.recv_buf(), sm.multi, r.op_context())
}

/// Post bounce buffer `r` again after its completion. A buffer the provider refuses
/// (an error other than `-FI_EAGAIN`) is kept for [`post_unposted`], not lost: fewer
/// posted buffers slow the traffic, none would stop it.
fn repost(m: &Mtl, sm: &SoftMatch, r: Req) {
    let ret = if crate::common::sync::refuse_repost() {
        Err(fabric::Error(libfabric_sys::FI_EIO as i32))
    } else {
        post_bounce(m, sm, r)
    };
    if let Err(e) = ret {
        if let Some(n) = sm.unposted.push(r) {
            log::error!(
                "reposting a receive buffer failed: {e}; progress tries again ({n} refused \
                 so far)"
            );
        }
    }
}

/// Post again the receive buffers the provider refused, at most once per
/// [`crate::common::sync::Unposted::INTERVAL`]. Called by progress outside its serial
/// section.
pub fn post_unposted(m: &Mtl, sm: &SoftMatch) {
    let (posted, all) = sm.unposted.retry(|&r| {
        let g = m.lock.lock();
        try_post_bounce(m, sm, &g.serialized(), r).is_ok()
    });
    if posted > 0 && all {
        log::info!("the receive buffers the provider refused are posted again");
    }
}

/// A completion of receive buffer `b` (one of the bounce requests; `e` its
/// completion): a message of `e.len` bytes at its start, or at `e.buf` in a
/// multi-receive buffer, which the provider may also report released.
pub fn bounce_completed(m: &Mtl, sm: &SoftMatch, b: Req, e: &fi::fi_cq_tagged_entry) {
    let released = !sm.multi || e.flags & fi::FI_MULTI_RECV as u64 != 0;
    // A multi-receive buffer may be released by a completion of its own, without a
    // message.
    if !sm.multi || e.len > 0 {
        // The bounce buffer, not reposted before bounce_done returns.
        match b.received_at(sm.multi, e.buf as usize, e.len) {
            Some(bytes) => bounce_done(m, sm, bytes),
            None => {
                sm.rejected.fetch_add(1, Ordering::Relaxed);
                log::error!(
                    "dropping a received message that the provider placed outside its \
                     receive buffer ({:p}, buffer of {} bytes)",
                    e.buf,
                    b.length()
                );
            }
        }
    }
    if released {
        repost(m, sm, b);
    }
}

/// A receive into buffer `b` completed with error `code` (`flags` as reported): the
/// message is lost. A multi-receive buffer the provider did not release stays posted;
/// one it released is posted again, unless it was cancelled.
pub fn bounce_failed(m: &Mtl, sm: &SoftMatch, b: Req, code: u32, flags: u64) {
    if code == fi::FI_ECANCELED {
        return;
    }
    if sm.multi && flags & fi::FI_MULTI_RECV as u64 != 0 {
        log::error!("a receive into a multi-receive buffer failed; the buffer is posted again");
        repost(m, sm, b);
    } else if sm.multi {
        log::error!("a receive into a multi-receive buffer failed");
    } else {
        // The provider is done with the buffer (its receive completed).
        log::error!("a receive buffer failed; the buffer is posted again");
        repost(m, sm, b);
    }
}

/// A receive buffer received `bytes`, one message. The caller reposts the buffer
/// after this returns: nothing here keeps a reference into it.
pub fn bounce_done(m: &Mtl, sm: &SoftMatch, bytes: &[u8]) {
    let (hdr, payload) = match Hdr::decode(bytes, sm.eager_max()) {
        Ok(v) => v,
        Err(e) => {
            sm.rejected.fetch_add(1, Ordering::Relaxed);
            log::error!("dropping a received message: {e}");
            return;
        }
    };
    let Some(order) = sm.order.as_ref().filter(|_| hdr.seq != 0) else {
        return dispatch(m, sm, hdr, payload);
    };
    match order.arrive(&hdr, payload) {
        Arrival::Held => {}
        Arrival::Late => dispatch(m, sm, hdr, payload),
        Arrival::Next { held } => {
            dispatch(m, sm, hdr, payload);
            if !held {
                return;
            }
            while let Some(now) = order.release(hdr.src) {
                for (h, p) in now {
                    dispatch(m, sm, h, &p);
                }
            }
        }
    }
}

/// Act on received message `hdr` with `payload`, in its turn.
fn dispatch(m: &Mtl, sm: &SoftMatch, hdr: Hdr, payload: &[u8]) {
    match hdr.kind {
        FIN | ACK => {
            if !sm.take_waiting(hdr.token, hdr.kind) {
                sm.rejected.fetch_add(1, Ordering::Relaxed);
                log::error!(
                    "dropping a {} whose token {:#x} names no send waiting for one",
                    if hdr.kind == FIN { "FIN" } else { "ACK" },
                    hdr.token
                );
                return;
            }
            // decode rejects a FIN or ACK without a token.
            if let Some(r) = SoftMatch::token_request(hdr.token) {
                if hdr.kind == FIN {
                    drop_mr(r);
                }
                completion::finish_part(r);
            }
        }
        FRAG => {
            let whole = {
                let mut lists = lock(&sm.lists);
                match add_piece(&mut lists, &hdr, payload) {
                    Ok(Whole::Owned(u)) => match lists.take_posted(u.hdr.bits) {
                        Some(r) => Ok(Some((r, u.hdr, u.delivery()))),
                        None => {
                            lists.unexpected.push_back(u);
                            Ok(None)
                        }
                    },
                    Ok(Whole::Filled(r, h)) => Ok(Some((r, h, Delivery::Filled(h.len as usize)))),
                    Ok(Whole::Not) => {
                        return;
                    }
                    Err(target) => Err(target),
                }
            };
            match whole {
                Err(target) => {
                    sm.rejected.fetch_add(1, Ordering::Relaxed);
                    log::error!(
                        "dropping a message in pieces: the piece at {} of {} bytes disagrees \
                         with the pieces before it",
                        hdr.addr,
                        hdr.len
                    );
                    if let Some(r) = target {
                        // The live receive the message had matched.
                        fail_recv(m, r, &hdr);
                    }
                }
                Ok(matched) => {
                    sm.assembled.fetch_add(1, Ordering::Relaxed);
                    if let Some((r, h, what)) = matched {
                        deliver(m, r, h, what, None);
                    }
                }
            }
        }
        _ => {
            // EAGER or RTS (decode admits nothing else).
            let payload_len = (hdr.len as usize).min(payload.len());
            let matched = {
                let mut lists = lock(&sm.lists);
                let r = lists.take_posted(hdr.bits);
                if r.is_none() {
                    lists.unexpected.push_back(Unexpected {
                        hdr,
                        payload: payload[..payload_len].to_vec(),
                        lost: false,
                    });
                }
                r
            };
            if let Some(r) = matched {
                let what = if hdr.kind == EAGER {
                    Delivery::Eager(Vec::new())
                } else {
                    Delivery::Rts
                };
                deliver(m, r, hdr, what, Some(&payload[..payload_len]));
            }
        }
    }
}
