//! Software matching: the MTL's own matching of MPI envelopes, over untagged messages,
//! for providers whose tag matching cannot be trusted (`common::quirks`:
//! `unexpected_ignores_mask`, shm in libfabric 1.17, where a wildcard receive misses
//! every message that arrived before it).
//!
//! Protocol (all untagged `FI_MSG`, every message starts with a [`Hdr`]):
//! - `EAGER`: envelope + payload, for messages that fit a bounce buffer
//!   ([`SoftMatch::eager_max`]);
//! - `RTS`: envelope + the sender's buffer address and memory key; the receiver reads
//!   the data with `fi_read` straight into the user's buffer, then answers `FIN`;
//! - `FIN`: the read is done (the sender's request completes; it also acknowledges a
//!   synchronous send, since the receive was matched);
//! - `ACK`: a synchronous eager send was matched.
//! - `FRAG`: one piece of an eager message larger than the provider's inject size,
//!   where a larger send is slow (shm, where eager means up to two injects) or unsafe
//!   (udp;ofi_rxd, where eager means up to [`PIECES_EAGER_MAX`]) ([`SoftMatch::new`]'s
//!   `piece_max` and `pieces_eager_max`):
//!   every piece carries the envelope, the message's length, its offset and a
//!   message id. The first piece to arrive matches a posted receive, and
//!   the pieces are written straight into it; without one, the receiver assembles
//!   the message and queues it as unexpected when the last piece arrives (or, when
//!   there is no memory for it, as lost: its receive fails).
//!
//! The receiver keeps `BOUNCE_COUNT` receive buffers posted (or, where the provider
//! has `FI_MULTI_RECV`, `MULTI_COUNT` multi-receive buffers of the same memory, so
//! that a message costs no receive call), a list of posted MPI receives and a list of
//! unexpected messages, both in arrival order, under one lock.
//! `FIN` and `ACK` carry the sender's request pointer as a token.
//!
//! On shm, a peer on the node that published a fast-box segment (`common::fbox`,
//! `mtl_ofi_fbox_size`) gets its messages through a shared-memory ring of its own
//! instead of the provider: an eager message as one record whatever its size (no
//! pieces), an RTS; a `FIN` or `ACK` when the ring has room, else through the provider
//! (they carry no order, and may be sent inside progress, which must not wait for
//! room). So every message that carries matching order takes one path to a peer and
//! arrives in order. Progress hands each record to [`bounce_done`] as it would a
//! receive buffer. The data of a larger message is still read through the provider.
//!
//! What it owns: the bounce buffers, both lists and its fast-box segment. Delivery to a
//! request happens after the lock is released.
//!
//! The rooms: `wire` is the header and its checks, `order` each peer's message order,
//! `lists` the posted and unexpected lists and the messages arriving in pieces, `send`
//! the send paths, `control` the FIN and ACK messages, `bounce` the receive buffers and
//! what arrives in them, `recv` the MPI receives (matching, delivery, rendezvous
//! reads). This file holds [`SoftMatch`], the state they share, and what the rest of
//! the MTL calls.

mod bounce;
mod control;
mod lists;
mod order;
mod recv;
mod send;
#[cfg(test)]
mod tests;
mod wire;

pub use bounce::{
    bounce_completed, bounce_done, bounce_failed, post_unposted, BOUNCE_COUNT, BOUNCE_LARGE,
    BOUNCE_SMALL, MULTI_COUNT, MULTI_SLOTS,
};
pub use control::post_waiting_controls;
pub use lists::Unexpected;
pub use recv::{cancel, claim, irecv, post_waiting_reads, probe, read_done, take};
pub use send::{copied_sent, send, send_injected, PIECE_BUF, SENT_INLINE};
pub use wire::{BadHdr, Hdr, HDR_LEN, PIECES_EAGER_MAX, SLOW_SEND_EAGER_INJECTS};

use crate::common::fbox;
use crate::fabric::{self, Domain, Serialized};
use crate::mtl::progress;
use crate::mtl::request::{Kind, Req};
use crate::mtl::state::{locked, Mtl};
use crate::ompi::error::OpalCode;
use bounce::post_bounce;
use lists::Lists;
use order::{process_id, Order};
use std::collections::VecDeque;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The software-matching state of the MTL.
pub struct SoftMatch {
    lists: crate::common::sync::MaybeMutex<Lists>,
    /// Sends waiting for a FIN (rendezvous) or ACK (synchronous eager): token -> the
    /// kind expected. A FIN/ACK whose token is not here is rejected, never
    /// dereferenced: the token is a pointer, and it comes from the wire.
    waiting: Mutex<crate::common::IdMap<u64, u32>>,
    /// Received messages rejected by [`Hdr::decode`] or the token check.
    pub rejected: AtomicU64,
    /// Held while one thread reads and dispatches completions.
    pub progress: crate::common::sync::Serial,
    bounces: Vec<Req>,
    /// Copied sends posted and not yet completed (finalize waits for them).
    pub copies_in_flight: AtomicUsize,
    domain: Arc<Domain>,
    next_key: AtomicU64,
    /// Bytes per bounce buffer ([`BOUNCE_SMALL`] or [`BOUNCE_LARGE`]).
    bounce_size: usize,
    /// Largest piece (header included) of an eager message sent in pieces; 0: such
    /// messages go whole.
    piece_max: usize,
    /// Message ids of pieces: a random per-process base plus a counter.
    next_piece_id: AtomicU64,
    /// Messages assembled from pieces (a counter for the verbose summary).
    pub assembled: AtomicU64,
    /// The receive buffers are multi-receive buffers ([`MULTI_COUNT`] of
    /// [`MULTI_SLOTS`] messages each): the provider fills one with message after
    /// message and reports it released (`FI_MULTI_RECV`) when less than a largest
    /// message is left.
    multi: bool,
    /// Per-peer message order, where the provider may break it.
    order: Option<Order>,
    /// Where many messages in flight break the provider
    /// (`common::quirks::Quirks::flood_unsafe`): every message through the provider
    /// (eager, piece, synchronous, rendezvous header, FIN, ACK) goes as a copy with a
    /// completion of its own (never inject), and a send waits while this many are in
    /// flight; a FIN or ACK, sent from progress, is queued instead
    /// ([`post_waiting_controls`]). 0: no limit.
    send_window: usize,
    /// Where eager messages longer than a piece go in pieces (a send longer than one
    /// inject is unsafe, `common::quirks::Quirks::segments_unsafe`, or slow,
    /// `send_past_inject_slow`), this is the largest eager message: larger ones are
    /// read by their receiver. 0: not so; the largest eager message is what a bounce
    /// buffer holds.
    pieces_eager_max: usize,
    /// This process's fast-box segment, polled by progress (see the module's
    /// documentation); set by setup before the endpoint name is published.
    pub fbox: Option<fbox::Rx>,
    /// Records received through `fbox`.
    pub fbox_received: AtomicU64,
    /// Matched receives whose read the provider refused, posted by progress.
    reads_waiting: Mutex<VecDeque<Req>>,
    /// Mirrors `!reads_waiting.is_empty()`.
    pub has_reads_waiting: AtomicBool,
    /// Receive buffers the provider refused to take back with an error other than
    /// `-FI_EAGAIN`, posted again by progress ([`post_unposted`]).
    pub unposted: crate::common::sync::Unposted<Req>,
    /// Under a send window: FIN and ACK messages (address, kind, token) that found the
    /// window full, sent by progress when it has room ([`post_waiting_controls`]).
    controls_waiting: Mutex<VecDeque<(u64, u32, u64)>>,
    /// Mirrors `!controls_waiting.is_empty()`.
    pub has_controls_waiting: AtomicBool,
    /// A thread is in [`post_waiting_controls`] (the progress its retries call must
    /// not enter it again).
    controls_flushing: AtomicBool,
}

// SAFETY: the request handles are our own heap requests or the PML's, touched under
// `lists` or the mutexes that hold them, or by the progress path that owns their
// completion; `fbox` is a shared-memory ring used by one poller (`poll_fbox`).
unsafe impl Send for SoftMatch {}

// SAFETY: every field shared between threads is a lock, an atomic or read-only after
// setup, and the fast-box ring is polled by one thread (`poll_fbox`).
unsafe impl Sync for SoftMatch {}

impl SoftMatch {
    /// `threads`: MPI_THREAD_MULTIPLE (progress may run on several threads);
    /// `bounce_size`: bytes per receive buffer, the same on every rank of the job;
    /// `piece_max`: send eager messages larger than this (the provider's inject size,
    /// at most 4 KiB) as pieces of this size, for a provider where a send past its
    /// inject size is slow (shm: `process_vm_readv`); 0 for none; `multi`: receive
    /// into multi-receive buffers (the endpoint has `FI_MULTI_RECV`, and its minimum
    /// free space set to `bounce_size`); `ordered`: number each peer's messages and
    /// restore their order on arrival ([`Order`]), for a provider that may break it;
    /// `send_window`: at most this many small sends in flight, none injected (0: no
    /// limit), for a provider that many messages in flight break; `pieces_eager_max`:
    /// with `piece_max`, eager messages are those up to this size whatever the bounce
    /// buffers hold (0: what a bounce buffer holds).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        domain: Arc<Domain>,
        threads: crate::common::sync::Threads,
        bounce_size: usize,
        piece_max: usize,
        multi: bool,
        ordered: bool,
        send_window: usize,
        pieces_eager_max: usize,
    ) -> SoftMatch {
        let piece_max = if piece_max > HDR_LEN {
            piece_max.min(PIECE_BUF)
        } else {
            0
        };
        SoftMatch {
            lists: crate::common::sync::MaybeMutex::new(
                Lists {
                    posted: VecDeque::new(),
                    unexpected: VecDeque::new(),
                    partial: crate::common::IdMap::default(),
                },
                threads,
            ),
            waiting: Mutex::new(crate::common::IdMap::default()),
            rejected: AtomicU64::new(0),
            progress: crate::common::sync::Serial::new(threads.multiple()),
            bounces: Vec::new(),
            copies_in_flight: AtomicUsize::new(0),
            domain,
            next_key: AtomicU64::new(1),
            bounce_size,
            piece_max,
            next_piece_id: AtomicU64::new(crate::common::random_odd()),
            assembled: AtomicU64::new(0),
            multi,
            order: ordered.then(|| Order::new(process_id())),
            send_window,
            pieces_eager_max: if piece_max > 0 { pieces_eager_max } else { 0 },
            fbox: None,
            fbox_received: AtomicU64::new(0),
            reads_waiting: Mutex::new(VecDeque::new()),
            has_reads_waiting: AtomicBool::new(false),
            unposted: Default::default(),
            controls_waiting: Mutex::new(VecDeque::new()),
            has_controls_waiting: AtomicBool::new(false),
            controls_flushing: AtomicBool::new(false),
        }
    }

    /// Post a message that matches to `addr` with `post(seq, src)` (see
    /// [`Order::numbered`]; unnumbered, `post(0, 0)`, where the provider keeps order).
    fn numbered(
        &self,
        addr: u64,
        post: impl FnOnce(u32, u64) -> fabric::Result<()>,
    ) -> fabric::Result<()> {
        match &self.order {
            Some(o) => o.numbered(addr, post),
            None => post(0, 0),
        }
    }

    /// Post a message that matches to `addr` with `post(seq, src)`, retried while the
    /// provider pushes back. `num` is the message's number: `None` for a new message,
    /// which takes the next one (and stores it there for its later pieces), or the
    /// number its first piece took.
    fn post_numbered(
        &self,
        m: &Mtl,
        addr: u64,
        num: &mut Option<(u32, u64)>,
        mut post: impl FnMut(&Serialized<'_>, u32, u64) -> fabric::Result<()>,
    ) -> fabric::Result<()> {
        progress::retry(m, |s| match *num {
            Some((seq, src)) => post(s, seq, src),
            None => self.numbered(addr, |seq, src| {
                let ret = post(s, seq, src);
                if ret.is_ok() {
                    *num = Some((seq, src));
                }
                ret
            }),
        })
    }

    /// Under a send window, the window has room for one more copy.
    fn window_open(&self) -> bool {
        self.copies_in_flight.load(Ordering::Relaxed) < self.send_window
    }

    /// Copies in flight and control messages waiting for the window (finalize waits
    /// until there are none).
    pub fn sends_left(&self) -> usize {
        self.copies_in_flight.load(Ordering::Relaxed)
            + if self.has_controls_waiting.load(Ordering::Acquire) {
                // Teardown asks too: a poisoned queue still says how many wait.
                crate::common::sync::lock(&self.controls_waiting).len()
            } else {
                0
            }
    }

    /// The queue of control messages waiting for the window; `None` once a panic
    /// poisoned it (`state::locked`).
    fn controls(&self) -> Option<std::sync::MutexGuard<'_, VecDeque<(u64, u32, u64)>>> {
        locked(&self.controls_waiting).ok()
    }

    /// Under a send window, progress until fewer than `send_window` copies are in
    /// flight.
    fn wait_for_window(&self, m: &Mtl) {
        if self.send_window > 0 {
            progress::wait_until(m, || {
                self.copies_in_flight.load(Ordering::Relaxed) < self.send_window
            });
        }
    }

    /// Eager messages longer than a piece go in pieces, up to `pieces_eager_max`.
    pub fn eager_in_pieces(&self) -> bool {
        self.pieces_eager_max > 0
    }

    /// The largest payload sent eagerly; larger messages are read by the receiver.
    pub fn eager_max(&self) -> usize {
        if self.pieces_eager_max > 0 {
            self.pieces_eager_max
        } else {
            self.bounce_size - HDR_LEN
        }
    }

    /// Whether fast boxes may carry this instance's messages: the provider keeps each
    /// peer's order (nothing numbered) and takes injects (no send window).
    pub fn fbox_fits(&self) -> bool {
        self.order.is_none() && self.send_window == 0
    }

    /// The largest record a fast box must carry: a header and the largest eager
    /// message.
    pub fn fbox_record_max(&self) -> usize {
        HDR_LEN + self.eager_max()
    }

    /// Hand every record waiting in this process's fast boxes to [`bounce_done`], up
    /// to `budget` per ring; returns how many. `serial`: the progress serial section
    /// is held (one poller); nothing is polled with another guard.
    pub fn poll_fbox(
        &self,
        m: &Mtl,
        budget: usize,
        serial: &crate::common::sync::SerialGuard<'_>,
    ) -> usize {
        let Some(rx) = self.fbox.as_ref().filter(|_| serial.is_of(&self.progress)) else {
            return 0;
        };
        // SAFETY: one poller: `serial` holds this instance's progress section; the record
        // is valid until the closure returns, and bounce_done keeps no reference into it.
        let n = unsafe {
            rx.poll(budget, |_, p, len| {
                bounce_done(m, self, std::slice::from_raw_parts(p, len))
            })
        };
        if n > 0 {
            self.fbox_received.fetch_add(n as u64, Ordering::Relaxed);
        }
        n
    }

    /// The receive buffers, in words.
    pub fn buffers(&self) -> String {
        let order = if self.order.is_some() {
            ", each peer's messages numbered and put back in order"
        } else {
            ""
        };
        let boxes = self.fbox.as_ref().map_or(String::new(), |rx| {
            format!(
                ", fast boxes of {} bytes to the ranks of this node (every message but the \
                 data of larger ones)",
                rx.sizes().cap
            )
        });
        if self.multi {
            format!(
                "{MULTI_COUNT} multi-receive buffers of {MULTI_SLOTS} largest messages{order}{boxes}"
            )
        } else {
            format!("{BOUNCE_COUNT} receive buffers{order}{boxes}")
        }
    }

    /// Allocate and post the bounce buffers (after the endpoint is enabled).
    pub fn post_bounces(&mut self, m: &Mtl) -> Result<(), c_int> {
        let (count, size) = if self.multi {
            (MULTI_COUNT, MULTI_SLOTS * self.bounce_size)
        } else {
            (BOUNCE_COUNT, self.bounce_size)
        };
        for _ in 0..count {
            let r = Req::leak(send::internal(Kind::Bounce));
            self.bounces.push(r);
            r.alloc_buffer(size)?;
            if let Err(e) = post_bounce(m, self, r) {
                log::error!("posting a receive buffer failed: {e}");
                return Err(e.to_opal());
            }
        }
        Ok(())
    }

    /// The reads waiting for the provider; `None` once a panic poisoned the queue
    /// (`state::locked`).
    fn reads(&self) -> Option<std::sync::MutexGuard<'_, VecDeque<Req>>> {
        locked(&self.reads_waiting).ok()
    }

    fn expect(&self, token: u64, kind: u32) {
        if let Ok(mut w) = locked(&self.waiting) {
            w.insert(token, kind);
        }
    }

    fn forget(&self, token: u64) {
        if let Ok(mut w) = locked(&self.waiting) {
            w.remove(&token);
        }
    }

    /// The send request a FIN or ACK's `token` names, once [`SoftMatch::take_waiting`]
    /// found it waiting.
    fn token_request(token: u64) -> Option<Req> {
        // SAFETY: the token is the address of our own send request, registered in
        // `waiting` when it was sent (`expect`), alive until this, its last
        // completion, and just taken out of `waiting` (so reached once).
        unsafe { Req::of_addr(token) }
    }

    /// Take the send waiting for a `kind` control message with `token`, if any (none
    /// once a panic poisoned the table: the token is then never trusted).
    fn take_waiting(&self, token: u64, kind: u32) -> bool {
        let Ok(mut w) = locked(&self.waiting) else {
            return false;
        };
        if w.get(&token) == Some(&kind) {
            w.remove(&token);
            true
        } else {
            false
        }
    }

    /// Free the bounce buffers (the endpoint is closed: nothing is posted any more).
    pub fn free_bounces(&mut self) {
        for r in self.bounces.drain(..) {
            r.free_buffer();
            // SAFETY: leaked by post_bounces; the endpoint is closed, so no operation of
            // it is in flight, and `bounces` held its only handle.
            drop(unsafe { r.into_box() });
        }
    }
}
