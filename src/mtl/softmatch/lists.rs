//! The lists of software matching: posted receives and unexpected messages, both in
//! arrival order, and the eager messages whose pieces are arriving ([`Partial`]), with
//! what matching a message against a receive means ([`matches()`]) and how pieces add
//! up to a message ([`add_piece`]). All of it lives under the one lock of
//! [`SoftMatch`](super::SoftMatch)`::lists`; nothing here calls the provider or
//! completes a request (delivery happens after the lock is released, in `recv`).

use super::wire::{Hdr, EAGER};
use crate::mtl::request::Req;
use std::collections::VecDeque;

/// An envelope decoded from a header, as the matching sees it.
pub(super) fn matches(bits: u64, ignore: u64, msg: u64) -> bool {
    (bits | ignore) == (msg | ignore)
}

pub(super) struct Posted {
    pub(super) req: Req,
    pub(super) bits: u64,
    pub(super) ignore: u64,
}

/// A message that arrived before its receive.
pub struct Unexpected {
    pub hdr: Hdr,
    pub payload: Vec<u8>,
    /// Arrived in pieces without memory to hold it: its receive fails with
    /// `MPI_ERR_NO_MEM` (the payload is empty).
    pub lost: bool,
}

/// An eager message whose pieces are arriving ([`FRAG`](super::wire::FRAG)).
pub(super) struct Partial {
    /// The first piece's header (every piece must agree with it).
    hdr: Hdr,
    /// The posted receive it matched when its first piece arrived: the pieces go
    /// straight into its buffer. Matching then is matching in order: the pieces of one
    /// message are sent back to back and a peer's messages arrive in the order sent,
    /// so nothing its sender sent later can arrive in between.
    target: Option<Req>,
    /// Without a target: the message so far, queued as unexpected when whole.
    pub(super) payload: Vec<u8>,
    /// Bytes received so far.
    pub(super) got: usize,
    /// Without a target, and no memory for the message: its pieces are counted and
    /// dropped, and the whole is queued as lost.
    pub(super) lost: bool,
}

pub(super) struct Lists {
    pub(super) posted: VecDeque<Posted>,
    pub(super) unexpected: VecDeque<Unexpected>,
    /// Messages in pieces, by message id.
    pub(super) partial: crate::common::IdMap<u64, Partial>,
}

impl Lists {
    /// Take the first posted receive that matches a message with envelope `bits`.
    pub(super) fn take_posted(&mut self, bits: u64) -> Option<Req> {
        // The common case first: the oldest receive matches (a ping-pong, a receive
        // per expected message).
        if let Some(p) = self.posted.front() {
            if matches(p.bits, p.ignore, bits) {
                return self.posted.pop_front().map(|p| p.req);
            }
        }
        let i = self
            .posted
            .iter()
            .position(|p| matches(p.bits, p.ignore, bits))?;
        self.posted.remove(i).map(|p| p.req)
    }
}

pub(super) fn lock(
    lists: &crate::common::sync::MaybeMutex<Lists>,
) -> crate::common::sync::MaybeMutexGuard<'_, Lists> {
    lists.lock()
}

/// What the piece just added completed.
pub(super) enum Whole {
    /// Pieces are missing.
    Not,
    /// A message with a target, filled: deliver it.
    Filled(Req, Hdr),
    /// A message without one (or without memory for it: `lost`): match it now, or
    /// queue it.
    Owned(Unexpected),
}

/// Add piece `hdr`/`payload` to its message. `Err` when the piece disagrees with the
/// ones before it (its message is dropped; a receive it had matched fails).
pub(super) fn add_piece(
    lists: &mut Lists,
    hdr: &Hdr,
    payload: &[u8],
) -> Result<Whole, Option<Req>> {
    let len = hdr.len as usize;
    if !lists.partial.contains_key(&hdr.key) {
        let target = lists.take_posted(hdr.bits);
        let mut payload = Vec::new();
        let mut lost = false;
        if target.is_none() {
            // Assembled here; its length comes from the wire (at most the eager
            // limit, Hdr::decode): a failed allocation loses the message, and the
            // receive that matches it fails, instead of the process.
            if payload.try_reserve_exact(len).is_ok() {
                payload.resize(len, 0);
            } else {
                log::error!(
                    "no memory for an unexpected message of {len} bytes: the receive that \
                     matches it fails with MPI_ERR_NO_MEM"
                );
                lost = true;
            }
        }
        lists.partial.insert(
            hdr.key,
            Partial {
                hdr: Hdr { addr: 0, ..*hdr },
                target,
                payload,
                got: 0,
                lost,
            },
        );
    }
    let p = lists.partial.get_mut(&hdr.key).expect("inserted above");
    let first = &p.hdr;
    let agrees = first.bits == hdr.bits
        && first.data == hdr.data
        && first.len == hdr.len
        && first.token == hdr.token
        && p.got + payload.len() <= len;
    if !agrees {
        let p = lists.partial.remove(&hdr.key).expect("present");
        return Err(p.target);
    }
    // decode checked that the piece lies inside the message.
    let at = hdr.addr as usize;
    match p.target {
        Some(r) => {
            // The live receive we matched: only the part of the piece that fits it.
            r.write_at(at, payload);
        }
        None if p.lost => {}
        None => p.payload[at..at + payload.len()].copy_from_slice(payload),
    }
    p.got += payload.len();
    if p.got < len {
        return Ok(Whole::Not);
    }
    let p = lists.partial.remove(&hdr.key).expect("present");
    let whole = Hdr {
        kind: EAGER,
        addr: 0,
        key: 0,
        ..p.hdr
    };
    Ok(match p.target {
        Some(r) => Whole::Filled(r, whole),
        None => Whole::Owned(Unexpected {
            hdr: whole,
            payload: p.payload,
            lost: p.lost,
        }),
    })
}
