//! Acknowledgements of synchronous sends under provider matching.
//!
//! The receiver of a synchronous send injects a zero-byte acknowledgement tagged with
//! the sender's id of that send ([`TagLayout::ack_tag`]). The sender takes every
//! acknowledgement with a small pool of receives per receive context that match any
//! id ([`TagLayout::ack_any`]), and finds the send by its id here. One receive posted
//! per synchronous send instead would fill the provider's receive queue once more
//! synchronous sends are in flight than it holds (tcp;ofi_rxm 1.17 holds 2,048):
//! the receiver's own receives then wait for room that only the acknowledgements they
//! would send free, and both ranks hang (`mpi_tests/ssend.c`'s flood of 4,096
//! `MPI_Issend` before the receiver posts).
//!
//! What it owns: the pool's receives and the table of sends waiting for their
//! acknowledgement. What it must not touch: software matching's own acknowledgements
//! (`softmatch::control`), which carry no provider tag.
//!
//! [`TagLayout::ack_tag`]: super::tag::TagLayout::ack_tag
//! [`TagLayout::ack_any`]: super::tag::TagLayout::ack_any

use super::completion::finish_part;
use super::progress::retry;
use super::request::{Kind, Req, Request};
use super::state::{locked, Mtl};
use crate::common::IdMap;
use crate::fabric::{self, Local, FI_ADDR_UNSPEC};
use crate::ompi::error::OpalCode;
use libfabric_sys as fi;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Receives of the pool per receive context at most: acknowledgements that arrive
/// while all of them are being reposted wait in the provider as unexpected messages.
pub const POOL: usize = 16;

/// Receives of the pool per receive context for a provider whose receive queue holds
/// `capacity` receives (0: unknown): a sixteenth of the queue, between 1 and [`POOL`].
/// A full pool in a small queue leaves no room for the receives of the data: with
/// `FI_OFI_RXM_RX_SIZE=4`, 16 posted acknowledgement receives hung the first
/// `MPI_Ssend` (scripts/test-hostile, "tiny rxm rx queue"). The MTL's receive budget
/// counts the pool as posted from the start ([`super::state::RxBudget`]).
pub fn pool_size(capacity: usize) -> usize {
    if capacity == 0 {
        POOL
    } else {
        (capacity / 16).clamp(1, POOL)
    }
}

/// The pool and the sends waiting for their acknowledgement.
#[derive(Default)]
pub struct Acks {
    /// Receives of the pool per receive context ([`pool_size`]).
    per_context: usize,
    /// The pool's requests with the index of the context each is posted on. They
    /// live as long as the MTL state, which is dropped after the endpoint closed.
    pool: Mutex<Vec<(usize, Box<Request>)>>,
    /// The pool is posted (on the first synchronous send).
    ready: AtomicBool,
    /// Synchronous sends by id.
    waiting: Mutex<IdMap<u32, Req>>,
}

impl Acks {
    /// No pool posted yet; `per_context` receives per context once it is.
    pub fn new(per_context: usize) -> Acks {
        Acks {
            per_context,
            ..Default::default()
        }
    }
}

/// Post pool receive `r` on context `index`.
fn post(m: &Mtl, index: usize, r: Req) -> fabric::Result<()> {
    let (bits, ignore) = m.layout.ack_any();
    let rx = m.ctxs[index].rx();
    let ctx = r.op_context();
    retry(m, |s| {
        rx.trecv(
            s,
            Local::NONE,
            Local::NONE,
            FI_ADDR_UNSPEC,
            bits,
            ignore,
            ctx,
        )
    })
}

/// Post the pool on every context, once.
fn ensure_pool(m: &Mtl) -> Result<(), c_int> {
    if m.acks.ready.load(Ordering::Acquire) {
        return Ok(());
    }
    let mut pool = locked(&m.acks.pool)?;
    if m.acks.ready.load(Ordering::Acquire) {
        return Ok(());
    }
    for index in 0..m.ctxs.len() {
        // After a failed try, the receives posted then are in `pool` already.
        let have = pool.iter().filter(|(i, _)| *i == index).count();
        for _ in have..m.acks.per_context {
            let mut r = Box::new(Request::of_kind(Kind::Ack, None));
            // SAFETY: the Box goes into `pool` below (or is dropped unposted), which
            // keeps it, unmoved on the heap, until the MTL state is dropped after the
            // endpoint closed; it is used only through handles meanwhile.
            let h = unsafe { Req::of(&mut r) };
            if let Err(e) = post(m, index, h) {
                log::error!(
                    "posting the receives of synchronous sends' acknowledgements failed: {e}"
                );
                // The ones posted stay in `pool`; the next try posts the rest.
                return Err(e.to_opal());
            }
            pool.push((index, r));
        }
    }
    m.acks.ready.store(true, Ordering::Release);
    Ok(())
}

/// Synchronous send `r` with id `id` waits for its acknowledgement from now on.
pub(super) fn expect(m: &Mtl, r: Req, id: u32) -> Result<(), c_int> {
    ensure_pool(m)?;
    if locked(&m.acks.waiting)?.insert(id, r).is_some() {
        log::warn!(
            "synchronous send id {id} is still in flight from an earlier send: more \
             synchronous sends in flight than the tag layout has ids"
        );
    }
    Ok(())
}

/// Synchronous send `id` failed before it went out: no acknowledgement comes.
pub(super) fn forget(m: &Mtl, id: u32) {
    if let Ok(mut w) = locked(&m.acks.waiting) {
        w.remove(&id);
    }
}

/// The context index pool request `r` is posted on.
fn index_of(m: &Mtl, r: Req) -> Option<usize> {
    if m.ctxs.len() == 1 {
        return Some(0);
    }
    locked(&m.acks.pool)
        .ok()?
        .iter()
        .find(|(_, b)| Req::addr_of(b) == r.addr())
        .map(|(i, _)| *i)
}

/// Post pool request `r` again after its completion.
fn repost(m: &Mtl, r: Req) {
    let Some(index) = index_of(m, r) else {
        log::error!("an acknowledgement completed on a receive that is not the pool's");
        return;
    };
    if let Err(e) = post(m, index, r) {
        log::error!("reposting an acknowledgement receive failed: {e}");
    }
}

/// An acknowledgement with tag `bits` arrived in pool request `r`, whose receive
/// completed.
pub(super) fn arrived(m: &Mtl, r: Req, bits: u64) {
    let id = m.layout.ack_id(bits);
    let send = locked(&m.acks.waiting).ok().and_then(|mut w| w.remove(&id));
    repost(m, r);
    match send {
        // A waiting synchronous send is live until both its completions came.
        Some(send) => finish_part(send),
        None => log::error!("an acknowledgement for no synchronous send in flight (id {id})"),
    }
}

/// Pool request `r` completed with error `code`: cancelled when the endpoint closes,
/// else logged and posted again.
pub(super) fn failed(m: &Mtl, r: Req, code: u32) {
    if code == fi::FI_ECANCELED {
        return;
    }
    log::error!(
        "an acknowledgement receive failed: {}",
        crate::fabric::Error(code as i32)
    );
    repost(m, r);
}

#[cfg(test)]
mod tests {
    use super::{pool_size, POOL};

    #[test]
    fn pool_leaves_room_in_small_queues() {
        assert_eq!(pool_size(0), POOL);
        assert_eq!(pool_size(4), 1);
        assert_eq!(pool_size(64), 4);
        assert_eq!(pool_size(2048), POOL);
        assert_eq!(pool_size(4096), POOL);
    }
}
