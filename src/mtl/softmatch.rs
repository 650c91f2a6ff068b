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

use super::datapath::{self, Kind, Mtl, Peer, Request, FI_ADDR_UNSPEC};
use super::tag::{Proto, TagLayout};
use crate::common::fbox;
use crate::fabric::{Domain, MemoryRegion};
use libfabric_sys as fi;
use ompi_sys as sys;
use std::collections::VecDeque;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub const BOUNCE_COUNT: usize = 64;
/// Multi-receive buffers posted, where the provider offers `FI_MULTI_RECV`.
pub const MULTI_COUNT: usize = 4;
/// Largest messages one multi-receive buffer holds: with [`MULTI_COUNT`], as much
/// memory as [`BOUNCE_COUNT`] single buffers.
pub const MULTI_SLOTS: usize = BOUNCE_COUNT / MULTI_COUNT;
pub const HDR_LEN: usize = std::mem::size_of::<Hdr>();
/// Bounce buffers where messages go whole (ofi_rxm under `mtl_ofi_matching=software`),
/// so that messages above 16 KiB are read straight into the receive buffer.
pub const BOUNCE_SMALL: usize = 16384;
/// Bounce buffers where an RMA read is a protocol exchange of the provider's own
/// (net): up to 64 KiB of payload goes eagerly, one message instead of RTS, read
/// request, read response and FIN (64 KiB over net: 11.9 us eager against 24.5 us
/// read).
pub const BOUNCE_LARGE: usize = 65536 + HDR_LEN;

const EAGER: u32 = 1;
const RTS: u32 = 2;
const FIN: u32 = 3;
const ACK: u32 = 4;
const FRAG: u32 = 5;

/// The header of every message.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct Hdr {
    pub kind: u32,
    /// The message's place in its sender's stream to this receiver, from 1, where the
    /// provider may deliver messages out of order ([`Order`]); 0 elsewhere and in
    /// FIN and ACK. Every piece of a FRAG message carries the message's number.
    pub seq: u32,
    /// The envelope, in the MTL's tag layout.
    pub bits: u64,
    /// The CQ-data word of the layout (the source in the full layout).
    pub data: u64,
    /// Payload length (EAGER), message length (RTS, FRAG).
    pub len: u64,
    /// RTS: the sender's buffer and key. FRAG: the offset of this piece and the
    /// message id.
    pub addr: u64,
    pub key: u64,
    /// RTS/EAGER: the sender's request (for FIN/ACK); FIN/ACK: that request.
    pub token: u64,
    /// The sender's process name (job << 32 | vpid) where `seq` is set, else 0.
    pub src: u64,
}

/// Why a received protocol message was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadHdr {
    /// Fewer bytes than a header.
    Short(usize),
    /// A kind no sender uses.
    Kind(u32),
    /// Padding or a field that this kind never sets is not zero.
    Reserved,
    /// The header's length disagrees with what arrived (EAGER), or an RTS for a
    /// message small enough to travel eagerly, or a payload after a control header.
    Length { header: u64, payload: usize },
    /// A FIN or ACK without a token.
    Token,
    /// A FRAG piece that reaches past its message, or one without a message id.
    Piece,
}

impl std::fmt::Display for BadHdr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            BadHdr::Short(n) => write!(f, "{n} bytes, less than a {HDR_LEN}-byte header"),
            BadHdr::Kind(k) => write!(f, "unknown kind {k}"),
            BadHdr::Reserved => write!(f, "a reserved field is not zero"),
            BadHdr::Length { header, payload } => write!(
                f,
                "length {header} in the header, {payload} payload bytes received"
            ),
            BadHdr::Token => write!(f, "a control message without a token"),
            BadHdr::Piece => write!(f, "a piece outside its message, or without a message id"),
        }
    }
}

impl Hdr {
    /// The bytes of this header as sent.
    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        let words = [
            self.bits, self.data, self.len, self.addr, self.key, self.token, self.src,
        ];
        b[0..4].copy_from_slice(&self.kind.to_ne_bytes());
        b[4..8].copy_from_slice(&self.seq.to_ne_bytes());
        for (i, w) in words.iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_ne_bytes());
        }
        b
    }

    /// Decode and check the header at the start of a received message (`bytes` is
    /// everything that arrived). Returns the header and the payload after it. Checks
    /// only what the receiver can know; the token of a FIN/ACK is checked against the
    /// sends waiting for one ([`SoftMatch`] keeps them).
    /// `eager_max` is the largest eager payload of this job (both sides use the same).
    pub fn decode(bytes: &[u8], eager_max: usize) -> Result<(Hdr, &[u8]), BadHdr> {
        if bytes.len() < HDR_LEN {
            return Err(BadHdr::Short(bytes.len()));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[8 + 8 * i..16 + 8 * i]);
            u64::from_ne_bytes(w)
        };
        let mut k = [0u8; 4];
        k.copy_from_slice(&bytes[0..4]);
        let mut seq = [0u8; 4];
        seq.copy_from_slice(&bytes[4..8]);
        let h = Hdr {
            kind: u32::from_ne_bytes(k),
            seq: u32::from_ne_bytes(seq),
            bits: word(0),
            data: word(1),
            len: word(2),
            addr: word(3),
            key: word(4),
            token: word(5),
            src: word(6),
        };
        let payload = &bytes[HDR_LEN..];
        let bad_len = || BadHdr::Length {
            header: h.len,
            payload: payload.len(),
        };
        match h.kind {
            EAGER => {
                if h.len != payload.len() as u64 || h.addr != 0 || h.key != 0 {
                    return Err(if h.len != payload.len() as u64 {
                        bad_len()
                    } else {
                        BadHdr::Reserved
                    });
                }
            }
            RTS => {
                if !payload.is_empty() || h.len <= eager_max as u64 {
                    return Err(bad_len());
                }
            }
            FRAG => {
                if payload.is_empty() || h.len > eager_max as u64 {
                    return Err(bad_len());
                }
                if h.key == 0
                    || h.addr
                        .checked_add(payload.len() as u64)
                        .is_none_or(|end| end > h.len)
                {
                    return Err(BadHdr::Piece);
                }
            }
            FIN | ACK => {
                if !payload.is_empty() || h.len != 0 {
                    return Err(bad_len());
                }
                if h.bits != 0
                    || h.data != 0
                    || h.addr != 0
                    || h.key != 0
                    || h.seq != 0
                    || h.src != 0
                {
                    return Err(BadHdr::Reserved);
                }
                if h.token == 0 {
                    return Err(BadHdr::Token);
                }
            }
            k => return Err(BadHdr::Kind(k)),
        }
        Ok((h, payload))
    }
}

/// An envelope decoded from a header, as the matching sees it.
fn matches(bits: u64, ignore: u64, msg: u64) -> bool {
    (bits | ignore) == (msg | ignore)
}

struct Posted {
    req: *mut Request,
    bits: u64,
    ignore: u64,
}

/// A message that arrived before its receive.
pub struct Unexpected {
    pub hdr: Hdr,
    pub payload: Vec<u8>,
    /// Arrived in pieces without memory to hold it: its receive fails with
    /// `MPI_ERR_NO_MEM` (the payload is empty).
    pub lost: bool,
}

impl Unexpected {
    /// What its receive gets.
    fn delivery(self) -> Delivery {
        if self.lost {
            Delivery::Lost
        } else if self.hdr.kind == EAGER {
            Delivery::Eager(self.payload)
        } else {
            Delivery::Rts
        }
    }
}

/// An eager message whose pieces are arriving ([`FRAG`]).
struct Partial {
    /// The first piece's header (every piece must agree with it).
    hdr: Hdr,
    /// The posted receive it matched when its first piece arrived: the pieces go
    /// straight into its buffer. Matching then is matching in order: the pieces of one
    /// message are sent back to back and a peer's messages arrive in the order sent,
    /// so nothing its sender sent later can arrive in between.
    target: Option<*mut Request>,
    /// Without a target: the message so far, queued as unexpected when whole.
    payload: Vec<u8>,
    /// Bytes received so far.
    got: usize,
    /// Without a target, and no memory for the message: its pieces are counted and
    /// dropped, and the whole is queued as lost.
    lost: bool,
}

struct Lists {
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Unexpected>,
    /// Messages in pieces, by message id.
    partial: crate::common::IdMap<u64, Partial>,
}

impl Lists {
    /// Take the first posted receive that matches a message with envelope `bits`.
    fn take_posted(&mut self, bits: u64) -> Option<*mut Request> {
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
    bounces: Vec<*mut Request>,
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
    reads_waiting: Mutex<VecDeque<*mut Request>>,
    /// Mirrors `!reads_waiting.is_empty()`.
    pub has_reads_waiting: AtomicBool,
    /// Receive buffers the provider refused to take back with an error other than
    /// `-FI_EAGAIN`, posted again by progress ([`post_unposted`]).
    pub unposted: crate::common::sync::Unposted<*mut Request>,
    /// Under a send window: FIN and ACK messages (address, kind, token) that found the
    /// window full, sent by progress when it has room ([`post_waiting_controls`]).
    controls_waiting: Mutex<VecDeque<(u64, u32, u64)>>,
    /// Mirrors `!controls_waiting.is_empty()`.
    pub has_controls_waiting: AtomicBool,
    /// A thread is in [`post_waiting_controls`] (the progress its retries call must
    /// not enter it again).
    controls_flushing: AtomicBool,
}

/// The largest eager message where sends longer than one packet are unsafe
/// (`pieces_eager_max`, udp;ofi_rxd): larger ones are read by their receiver. Over rxd
/// a piece of one packet costs about 2.8 us one way (each is acknowledged on its own)
/// and a read about 17 us plus 1.5 us per packet (RTS, read request, data, FIN): at
/// 8 KiB both took 23.5 us; at 16 KiB pieces 42 us against 33 us read, at 64 KiB 162
/// against 99, and a 1 MiB stream 395 MB/s against 700 (the C MTL's 690 to 720).
pub const PIECES_EAGER_MAX: usize = 8192;

/// Injects per eager message at most where a send past the inject size is slow
/// (`send_past_inject_slow`, shm): larger messages are read by their receiver. On shm
/// a read costs 3.2 to 3.5 us one way at any size from 4 KiB to 16 KiB (one
/// `process_vm_readv`), while each inject past the second adds 0.6 to 1 us (as pieces,
/// 8,192 bytes took 3.4 to 4.2 us, 12,244 5.1 to 5.9, 16,000 5.8 to 6.4).
pub const SLOW_SEND_EAGER_INJECTS: usize = 2;

/// Per-peer message order, kept by the MTL where the provider may deliver a peer's
/// messages out of the order they were sent, though it promises `FI_ORDER_SAS`
/// (`common::quirks::Quirks::reorders_messages`: udp;ofi_rxd 1.17, where an 8-byte
/// message overtook the 0-byte one sent before it on the same communicator and tag,
/// one `threads` run in four). MPI's non-overtaking rule needs that order: each message
/// that matches (EAGER, RTS, FRAG) is numbered per destination as it is posted, and
/// the receiver holds one that arrives early until the messages before it arrived.
struct Order {
    /// This process, as its messages name it (`Hdr::src`).
    me: u64,
    /// The number of the next message to each destination address. Held across the
    /// post, so that the numbers go out in the order posted.
    tx: Mutex<crate::common::IdMap<u64, u32>>,
    /// Per sending process.
    rx: Mutex<crate::common::IdMap<u64, Stream>>,
}

/// What a receiver knows of one sender's messages.
struct Stream {
    /// The number of the next message to match.
    next: u32,
    /// Messages (and pieces) that arrived ahead of `next`, in arrival order.
    held: Vec<(Hdr, Vec<u8>)>,
}

/// Held messages from one peer past which a missing message is reported as lost.
const HELD_WARN: usize = 4096;

/// The number after `n`; 0 is never used (it means unnumbered).
fn next_seq(n: u32) -> u32 {
    match n.wrapping_add(1) {
        0 => 1,
        n => n,
    }
}

/// Where a numbered message stands against its sender's stream.
#[derive(Debug, PartialEq, Eq)]
enum Arrival {
    /// The next message: match it now, then what was held behind it (`held`: some
    /// messages of that sender are held).
    Next { held: bool },
    /// A later piece of a message already matched: add it now.
    Late,
    /// Ahead of a message still missing: held.
    Held,
}

impl Order {
    fn new(me: u64) -> Order {
        Order {
            me,
            tx: Mutex::new(crate::common::IdMap::default()),
            rx: Mutex::new(crate::common::IdMap::default()),
        }
    }

    /// Post a message that matches to `addr` with `post(seq, src)`, which writes the
    /// two into the header it posts; the number is spent only when the post succeeds.
    fn numbered(&self, addr: u64, post: impl FnOnce(u32, u64) -> isize) -> isize {
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let next = tx.entry(addr).or_insert(1);
        let ret = post(*next, self.me);
        if ret >= 0 {
            *next = next_seq(*next);
        }
        ret
    }

    /// Message `hdr` (numbered) arrived with `payload`.
    fn arrive(&self, hdr: &Hdr, payload: &[u8]) -> Arrival {
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        let st = rx.entry(hdr.src).or_insert_with(|| Stream {
            next: 1,
            held: Vec::new(),
        });
        match (hdr.seq.wrapping_sub(st.next) as i32).cmp(&0) {
            std::cmp::Ordering::Equal => {
                st.next = next_seq(st.next);
                Arrival::Next {
                    held: !st.held.is_empty(),
                }
            }
            std::cmp::Ordering::Less => Arrival::Late,
            std::cmp::Ordering::Greater => {
                st.held.push((*hdr, payload.to_vec()));
                if st.held.len() == HELD_WARN {
                    log::error!(
                        "{HELD_WARN} messages from process {:#x} wait for its message #{}, \
                         which has not arrived: the provider may have lost it",
                        hdr.src,
                        st.next
                    );
                }
                Arrival::Held
            }
        }
    }

    /// The held messages of `src` that are now next (a message and any of its pieces),
    /// in arrival order; `None` when the next one has not arrived.
    fn release(&self, src: u64) -> Option<Vec<(Hdr, Vec<u8>)>> {
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        let st = rx.get_mut(&src)?;
        let next = st.next;
        if !st.held.iter().any(|(h, _)| h.seq == next) {
            return None;
        }
        let (now, keep) = std::mem::take(&mut st.held)
            .into_iter()
            .partition(|(h, _)| h.seq == next);
        st.held = keep;
        st.next = next_seq(next);
        Some(now)
    }
}

/// Write `seq` and `src` into the header at `h` (as [`Hdr::to_bytes`] lays it out);
/// nothing for an unnumbered message (`seq` 0: the header already says so).
///
/// # Safety
/// `h` must hold a header's bytes.
unsafe fn stamp(h: *mut u8, seq: u32, src: u64) {
    if seq == 0 {
        return;
    }
    // SAFETY: forwarded; the offsets are those of Hdr's fields (repr(C)).
    unsafe {
        ptr::write_unaligned(h.add(std::mem::offset_of!(Hdr, seq)) as *mut u32, seq);
        ptr::write_unaligned(h.add(std::mem::offset_of!(Hdr, src)) as *mut u64, src);
    }
}

// SAFETY: the raw pointers are our own heap requests, touched under `lists` or by the
// progress path that owns their completion.
unsafe impl Send for SoftMatch {}
// SAFETY: as above.
unsafe impl Sync for SoftMatch {}

fn lock(
    l: &crate::common::sync::MaybeMutex<Lists>,
) -> crate::common::sync::MaybeMutexGuard<'_, Lists> {
    l.lock()
}

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
        threads: bool,
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
            progress: crate::common::sync::Serial::new(threads),
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
    fn numbered(&self, addr: u64, post: impl FnOnce(u32, u64) -> isize) -> isize {
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
        mut post: impl FnMut(u32, u64) -> isize,
    ) -> isize {
        datapath::retry(m, || match *num {
            Some((seq, src)) => post(seq, src),
            None => self.numbered(addr, |seq, src| {
                let ret = post(seq, src);
                if ret >= 0 {
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
                self.controls().len()
            } else {
                0
            }
    }

    fn controls(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, u32, u64)>> {
        self.controls_waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Under a send window, progress until fewer than `send_window` copies are in
    /// flight.
    fn wait_for_window(&self, m: &Mtl) {
        if self.send_window > 0 {
            datapath::wait_until(m, || {
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
    /// to `budget` per ring; returns how many.
    ///
    /// # Safety
    /// Under the progress serial section (one poller).
    pub unsafe fn poll_fbox(&self, m: &Mtl, budget: usize) -> usize {
        let Some(rx) = self.fbox.as_ref() else {
            return 0;
        };
        // SAFETY: one poller (the caller's contract); the record is valid until the
        // closure returns, and bounce_done keeps no reference into it.
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
            let mut r = Box::new(Request::internal(Kind::Bounce, ptr::null_mut()));
            // SAFETY: plain allocation, checked.
            let buf = unsafe { libc::malloc(size) } as *mut u8;
            if buf.is_null() {
                return Err(sys::OMPI_ERR_OUT_OF_RESOURCE);
            }
            r.buffer = buf;
            r.length = size;
            r.owns_buffer = true;
            let p = Box::into_raw(r);
            self.bounces.push(p);
            let ret = post_bounce(m, self, p);
            if ret < 0 {
                log::error!(
                    "posting a receive buffer failed: {}",
                    crate::fabric::Error::from_ret(ret)
                );
                return Err(datapath::fi_to_ompi(ret));
            }
        }
        Ok(())
    }

    fn reads(&self) -> std::sync::MutexGuard<'_, VecDeque<*mut Request>> {
        self.reads_waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn expect(&self, token: u64, kind: u32) {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(token, kind);
    }

    fn forget(&self, token: u64) {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&token);
    }

    /// Take the send waiting for a `kind` control message with `token`, if any.
    fn take_waiting(&self, token: u64, kind: u32) -> bool {
        let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if w.get(&token) == Some(&kind) {
            w.remove(&token);
            true
        } else {
            false
        }
    }

    /// Free the bounce buffers (the endpoint is closed: nothing is posted any more).
    pub fn free_bounces(&mut self) {
        for p in self.bounces.drain(..) {
            // SAFETY: our leaked Box, not referenced by the fabric any more.
            unsafe {
                libc::free((*p).buffer as *mut c_void);
                drop(Box::from_raw(p));
            }
        }
    }
}

/// Post bounce buffer `r`, progressing while the provider pushes back; returns the
/// provider's code.
fn post_bounce(m: &Mtl, sm: &SoftMatch, r: *mut Request) -> isize {
    datapath::retry(m, || try_post_bounce(m, sm, r))
}

/// One attempt at posting bounce buffer `r`. The caller holds `m.lock`.
fn try_post_bounce(m: &Mtl, sm: &SoftMatch, r: *mut Request) -> isize {
    // SAFETY: r is one of our bounce requests; its buffer lives until finalize.
    let (buf, len, ctx) = unsafe { ((*r).buffer, (*r).length, (*r).ctx_ptr()) };
    if sm.multi {
        // SAFETY: see above.
        unsafe {
            crate::fabric::ep::recv_multi(m.ep(), buf as *mut c_void, len, ptr::null_mut(), ctx)
        }
    } else {
        // SAFETY: see above.
        unsafe {
            fi::fi_recv(
                m.ep(),
                buf as *mut c_void,
                len,
                ptr::null_mut(),
                FI_ADDR_UNSPEC,
                ctx,
            )
        }
    }
}

/// Post bounce buffer `r` again after its completion. A buffer the provider refuses
/// (an error other than `-FI_EAGAIN`) is kept for [`post_unposted`], not lost: fewer
/// posted buffers slow the traffic, none would stop it.
fn repost(m: &Mtl, sm: &SoftMatch, r: *mut Request) {
    let ret = if crate::common::sync::refuse_repost() {
        -(fi::FI_EIO as isize)
    } else {
        post_bounce(m, sm, r)
    };
    if ret < 0 {
        if let Some(n) = sm.unposted.push(r) {
            log::error!(
                "reposting a receive buffer failed: {}; progress tries again ({n} refused \
                 so far)",
                crate::fabric::Error::from_ret(ret)
            );
        }
    }
}

/// Post again the receive buffers the provider refused, at most once per
/// [`crate::common::sync::Unposted::INTERVAL`]. Called by progress outside its serial
/// section.
pub fn post_unposted(m: &Mtl, sm: &SoftMatch) {
    let (posted, all) = sm.unposted.retry(|&r| {
        let _g = m.lock.lock();
        try_post_bounce(m, sm, r) >= 0
    });
    if posted > 0 && all {
        log::info!("the receive buffers the provider refused are posted again");
    }
}

/// Send a control message (FIN or ACK) with `token` to `addr`: through `fbox` when
/// given and not full (control messages carry no order), else through the provider:
/// injected, or, under a send window (a provider that many messages in flight break,
/// [`SoftMatch`]'s `send_window`), from a copy with a completion of its own while the
/// window has room, else queued for progress ([`post_waiting_controls`]). It may be
/// called from progress, so it never waits for the window.
fn control(m: &Mtl, addr: u64, fbox: Option<&fbox::Tx>, kind: u32, token: u64) {
    let h = Hdr {
        kind,
        token,
        ..Default::default()
    };
    // SAFETY: h is a header; no payload.
    if fbox.is_some_and(|tx| unsafe { fbox_post(tx, &h, ptr::null(), 0) } == 0) {
        return;
    }
    if let Some(sm) = m.soft.as_deref().filter(|sm| sm.send_window > 0) {
        // Control messages carry no order: one may pass those queued before it.
        if sm.has_controls_waiting.load(Ordering::Acquire) || !sm.window_open() {
            sm.controls().push_back((addr, kind, token));
            sm.has_controls_waiting.store(true, Ordering::Release);
        } else {
            control_copy(m, sm, &h, addr);
        }
        return;
    }
    let ret = datapath::retry(m, || {
        // SAFETY: inject copies the header before returning.
        unsafe { fi::fi_inject(m.ep(), &h as *const Hdr as *const c_void, HDR_LEN, addr) }
    });
    log_control_error(ret);
}

/// Send control header `h` to `addr` as a copy in the send window, unnumbered (seq 0,
/// as control messages are).
fn control_copy(m: &Mtl, sm: &SoftMatch, h: &Hdr, addr: u64) {
    // SAFETY: h is a header, no payload.
    let ret = unsafe { send_copy(m, sm, h, ptr::null(), 0, addr, &mut Some((0, 0))) };
    log_control_error(ret);
}

fn log_control_error(ret: isize) {
    if ret < 0 {
        log::error!(
            "sending a protocol message failed: {}",
            crate::fabric::Error::from_ret(ret)
        );
    }
}

/// Send the control messages that found the send window full, in order, while it has
/// room. Called by progress; one thread at a time, and not again from the progress
/// that a send's retry runs inside it.
pub fn post_waiting_controls(m: &Mtl, sm: &SoftMatch) {
    if sm
        .controls_flushing
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return;
    }
    flush_controls(m, sm);
    sm.controls_flushing.store(false, Ordering::Release);
}

fn flush_controls(m: &Mtl, sm: &SoftMatch) {
    while sm.window_open() {
        let next = {
            let mut q = sm.controls();
            let next = q.pop_front();
            if q.is_empty() {
                sm.has_controls_waiting.store(false, Ordering::Release);
            }
            next
        };
        let Some((addr, kind, token)) = next else {
            return;
        };
        let h = Hdr {
            kind,
            token,
            ..Default::default()
        };
        control_copy(m, sm, &h, addr);
    }
}

// ---------------------------------------------------------------------------
// Sending

/// Post header `h` and `len` bytes at `data` as one record in fast box `tx`: 0, or
/// -FI_EAGAIN when the ring is full (the caller progresses and retries, as for the
/// provider).
///
/// # Safety
/// `data` holds `len` bytes; `HDR_LEN + len` is at most the ring's largest record.
#[inline]
unsafe fn fbox_post(tx: &fbox::Tx, h: &Hdr, data: *const u8, len: usize) -> isize {
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
unsafe fn send_copy(
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
        c.write(Request::internal(Kind::Copied, ptr::null_mut()));
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

/// This process's name as a number (job << 32 | vpid), or a random one before Open MPI
/// has set the local process up.
fn process_id() -> u64 {
    crate::common::local_name().map_or_else(crate::common::random_odd, |(job, vpid)| {
        (u64::from(job) << 32) | u64::from(vpid)
    })
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
        Some(tx) if len <= sm.eager_max() => datapath::retry(m, || {
            // SAFETY: forwarded; an eager message fits a record.
            unsafe { fbox_post(tx, &hdr, ptr_, len) }
        }),
        // SAFETY: forwarded.
        _ => unsafe { inject_whole(m, sm, &hdr, ptr_, len, peer.addr) }?,
    };
    Some(if ret < 0 {
        datapath::fi_to_ompi(ret)
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
    // 4 KiB cost more than the rest of a small send).
    let mut tmp = std::mem::MaybeUninit::<[u8; PIECE_BUF]>::uninit();
    let tmp = tmp.as_mut_ptr() as *mut u8;
    // SAFETY: both sources hold the bytes copied; tmp has room for total.
    unsafe {
        ptr::copy_nonoverlapping(hdr as *const Hdr as *const u8, tmp, HDR_LEN);
        if len > 0 {
            ptr::copy_nonoverlapping(ptr_, tmp.add(HDR_LEN), len);
        }
    }
    Some(datapath::retry(m, || {
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

/// The eager message of send `rq` went out of copies or injects (`ret`, the provider's
/// code): nothing of the caller's buffer is in flight. A synchronous send still waits
/// for its acknowledgement (`pending` 1); any other is complete ([`SENT_INLINE`]).
fn sent_from_copies(sm: &SoftMatch, rq: &Request, sync: bool, ret: isize) -> c_int {
    if ret < 0 {
        if sync {
            sm.forget(rq as *const Request as u64);
        }
        return datapath::fi_to_ompi(ret);
    }
    if sync {
        return sys::OMPI_SUCCESS;
    }
    rq.pending.store(0, Ordering::Release);
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
    let rq = unsafe { &mut *r };
    let addr = peer.addr;
    rq.sm_addr = addr;
    if len <= sm.eager_max() {
        rq.sm_hdr = Hdr {
            kind: EAGER,
            bits,
            data,
            len: len as u64,
            token: r as u64,
            ..Default::default()
        };
        if let Some(tx) = peer.fbox() {
            // The record is the whole message: only a synchronous send's ACK is left.
            rq.pending.store(sync as i32, Ordering::Release);
            if sync {
                sm.expect(r as u64, ACK);
            }
            let h = rq.sm_hdr;
            // SAFETY: ptr_ holds len bytes; an eager message fits a record.
            let ret = datapath::retry(m, || unsafe { fbox_post(tx, &h, ptr_, len) });
            if ret < 0 {
                if sync {
                    sm.forget(r as u64);
                }
                return datapath::fi_to_ompi(ret);
            }
            return if sync { sys::OMPI_SUCCESS } else { SENT_INLINE };
        }
        rq.pending
            .store(if sync { 2 } else { 1 }, Ordering::Release);
        if sync {
            sm.expect(r as u64, ACK);
        }
        let total = HDR_LEN + len;
        if sm.piece_max > 0 && total > sm.piece_max {
            if sync {
                // Only the acknowledgement is left once the pieces are out.
                rq.pending.store(1, Ordering::Release);
            }
            // SAFETY: ptr_ holds len bytes.
            let ret = unsafe { send_pieces(m, sm, &rq.sm_hdr, ptr_, len, addr) };
            return sent_from_copies(sm, rq, sync, ret);
        }
        if !sync {
            // SAFETY: ptr_ holds len bytes.
            if let Some(ret) = unsafe { inject_whole(m, sm, &rq.sm_hdr, ptr_, len, addr) } {
                if ret < 0 {
                    return datapath::fi_to_ompi(ret);
                }
                rq.pending.store(0, Ordering::Release);
                return SENT_INLINE;
            }
        }
        if (!sync || sm.send_window > 0) && len <= COPY_MAX {
            // A synchronous send under a send window goes as a copy in the window too;
            // only its acknowledgement is left after it.
            if sync {
                rq.pending.store(1, Ordering::Release);
            }
            sm.wait_for_window(m);
            // Complete the request now, as an inject would: the message goes out of a
            // copy that is freed at its completion. Programs written against ob1 (and
            // most MTLs, whose small sends complete at once) test for this.
            // SAFETY: ptr_ holds len bytes; the copy gets its own request.
            let ret = unsafe { send_copy(m, sm, &rq.sm_hdr, ptr_, len, addr, &mut None) };
            return sent_from_copies(sm, rq, sync, ret);
        }
        let iov = [
            fi::iovec {
                iov_base: &mut rq.sm_hdr as *mut Hdr as *mut c_void,
                iov_len: HDR_LEN,
            },
            fi::iovec {
                iov_base: ptr_ as *mut c_void,
                iov_len: len,
            },
        ];
        let ctx = rq.ctx_ptr();
        let n = if len == 0 { 1 } else { 2 };
        let hdr = iov[0].iov_base as *mut u8;
        let ret = datapath::retry(m, || {
            sm.numbered(addr, |seq, src| {
                // SAFETY: the header lives in the request and the data in the caller's
                // buffer until the send completes.
                unsafe {
                    stamp(hdr, seq, src);
                    fi::fi_sendv(m.ep(), iov.as_ptr(), ptr::null_mut(), n, addr, ctx)
                }
            })
        });
        return if ret < 0 {
            if sync {
                sm.forget(r as u64);
            }
            datapath::fi_to_ompi(ret)
        } else {
            sys::OMPI_SUCCESS
        };
    }
    // Rendezvous: expose the buffer, send the RTS, wait for FIN.
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
    rq.sm_mr = Box::into_raw(Box::new(mr)) as *mut c_void;
    rq.sm_hdr = Hdr {
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
    rq.pending.store(1, Ordering::Release);
    let h = rq.sm_hdr;
    sm.expect(r as u64, FIN);
    let ret = if peer.fbox().is_none() && sm.send_window > 0 {
        // Under a send window the header goes as a copy in the window.
        sm.wait_for_window(m);
        // SAFETY: a header, no payload.
        unsafe { send_copy(m, sm, &h, ptr::null(), 0, addr, &mut None) }
    } else {
        datapath::retry(m, || {
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
        drop_mr(rq);
        return datapath::fi_to_ompi(ret);
    }
    sys::OMPI_SUCCESS
}

fn drop_mr(rq: &mut Request) {
    if !rq.sm_mr.is_null() {
        // SAFETY: the Box leaked in send().
        unsafe { drop(Box::from_raw(rq.sm_mr as *mut MemoryRegion)) };
        rq.sm_mr = ptr::null_mut();
    }
}

// ---------------------------------------------------------------------------
// Receiving

/// Where a matched message goes.
enum Delivery {
    Eager(Vec<u8>),
    /// An eager message in pieces, already copied into the receive's buffer (as much
    /// of it as fits); the message's length.
    Filled(usize),
    /// An eager message in pieces that there was no memory for: the receive fails
    /// with `MPI_ERR_NO_MEM`.
    Lost,
    Rts,
}

/// Hand a matched message to receive `r` (lock not held).
fn deliver(m: &Mtl, r: *mut Request, hdr: Hdr, what: Delivery, payload: Option<&[u8]>) {
    let l = &m.layout;
    // SAFETY: r is a live receive we matched.
    let rq = unsafe { &mut *r };
    // Decoded once: the sender's address and the receive's status both come from it.
    let env = datapath::envelope(m, rq.comm, hdr.bits, hdr.data);
    let source = match env {
        Ok(ref e) => e.source,
        Err(_) => {
            // Logged (by envelope); the receive fails. An RTS sender is not told (it
            // is not a peer we can name).
            // SAFETY: r is live.
            unsafe { datapath::recv_done_with(m, r, env, 0, false, sys::MPI_ERR_INTERN as c_int) };
            return;
        }
    };
    // Only acknowledgements and reads need the sender's address.
    let peer = || datapath::peer(rq.comm, source).unwrap_or(Peer::UNKNOWN);
    match what {
        Delivery::Eager(_) | Delivery::Filled(_) | Delivery::Lost => {
            let mut status = sys::MPI_SUCCESS as c_int;
            let len = match what {
                Delivery::Filled(len) => len,
                Delivery::Lost => {
                    status = sys::MPI_ERR_NO_MEM as c_int;
                    0
                }
                Delivery::Eager(ref owned) => {
                    let bytes = payload.unwrap_or(owned);
                    let n = bytes.len().min(rq.length);
                    if n > 0 {
                        // SAFETY: rq.buffer holds rq.length bytes.
                        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), rq.buffer, n) };
                    }
                    bytes.len()
                }
                Delivery::Rts => unreachable!(),
            };
            if l.proto(hdr.bits) == Proto::Sync {
                let p = peer();
                control(m, p.addr, p.fbox(), ACK, hdr.token);
            }
            // SAFETY: r is live.
            unsafe { datapath::recv_done_with(m, r, env, len, false, status) };
        }
        Delivery::Rts => {
            let p = peer();
            let addr = p.addr;
            let n = (hdr.len as usize).min(rq.length);
            rq.sm_hdr = hdr;
            rq.sm_addr = addr;
            if n == 0 {
                control(m, addr, p.fbox(), FIN, hdr.token);
                // SAFETY: r is live.
                unsafe {
                    datapath::recv_done_with(
                        m,
                        r,
                        env,
                        hdr.len as usize,
                        false,
                        sys::MPI_SUCCESS as c_int,
                    )
                };
                return;
            }
            rq.kind = Kind::SmRead;
            // Not retried here: this may run inside progress, which then cannot read
            // the completions that make room, and shm refuses a peer's first operation
            // until that peer's progress has seen it (a peer reached only through fast
            // boxes until now). A refused read waits in `reads_waiting`.
            // SAFETY: r is a live receive in SmRead state.
            let ret = unsafe { post_read(m, r) };
            if ret == -(fi::FI_EAGAIN as isize) {
                if let Some(sm) = m.soft.as_deref() {
                    sm.reads().push_back(r);
                    sm.has_reads_waiting.store(true, Ordering::Release);
                    return;
                }
            }
            if ret < 0 {
                // SAFETY: r is live.
                unsafe { read_failed(m, r, ret) };
            }
        }
    }
}

/// Post the read of receive `r` (in SmRead state, its RTS in `sm_hdr`): the
/// provider's code.
///
/// # Safety
/// `r` is a live receive whose buffer holds its length until the read completes.
unsafe fn post_read(m: &Mtl, r: *mut Request) -> isize {
    // SAFETY: forwarded.
    let rq = unsafe { &mut *r };
    let hdr = rq.sm_hdr;
    let n = (hdr.len as usize).min(rq.length);
    let _g = m.lock.lock();
    // SAFETY: the buffer holds n bytes until the read completes.
    unsafe {
        fi::fi_read(
            m.ep(),
            rq.buffer as *mut c_void,
            n,
            ptr::null_mut(),
            rq.sm_addr,
            hdr.addr,
            hdr.key,
            rq.ctx_ptr(),
        )
    }
}

/// The read of receive `r` could not be posted (`ret`): tell the sender, fail the
/// receive.
///
/// # Safety
/// `r` is a live receive in SmRead state.
unsafe fn read_failed(m: &Mtl, r: *mut Request, ret: isize) {
    // SAFETY: forwarded.
    let rq = unsafe { &mut *r };
    let hdr = rq.sm_hdr;
    log::error!(
        "reading a {}-byte message failed: {}",
        hdr.len,
        crate::fabric::Error::from_ret(ret)
    );
    rq.kind = Kind::Recv;
    send_fin(m, rq);
    // SAFETY: r is live.
    unsafe { fail_recv(m, r, &hdr) };
}

/// The sender of the message receive `rq` holds (`sm_hdr`), if it can be named.
fn sender(m: &Mtl, rq: &Request) -> Option<datapath::Peer> {
    let env = datapath::envelope(m, rq.comm, rq.sm_hdr.bits, rq.sm_hdr.data).ok()?;
    datapath::peer(rq.comm, env.source).ok()
}

/// Tell the sender of the message receive `rq` holds that its data was read (or the
/// read failed): a FIN, through the sender's fast box when there is one.
fn send_fin(m: &Mtl, rq: &Request) {
    let from = sender(m, rq);
    let fbox = from.as_ref().and_then(|p| p.fbox());
    control(m, rq.sm_addr, fbox, FIN, rq.sm_hdr.token);
}

/// Post the reads the provider refused (see [`deliver`]), in order, until it refuses
/// one again. Called by progress outside its serial section.
pub fn post_waiting_reads(m: &Mtl, sm: &SoftMatch) {
    loop {
        let Some(r) = sm.reads().pop_front() else {
            break;
        };
        // SAFETY: a live receive in SmRead state, queued by deliver.
        let ret = unsafe { post_read(m, r) };
        if ret == -(fi::FI_EAGAIN as isize) {
            sm.reads().push_front(r);
            return;
        }
        if ret < 0 {
            // SAFETY: as above.
            unsafe { read_failed(m, r, ret) };
        }
    }
    let q = sm.reads();
    sm.has_reads_waiting.store(!q.is_empty(), Ordering::Release);
}

/// Complete receive `r`, matched with the message of `hdr`, with an internal error
/// (already logged) and nothing received.
///
/// # Safety
/// `r` must be a live receive of ours to complete.
unsafe fn fail_recv(m: &Mtl, r: *mut Request, hdr: &Hdr) {
    // SAFETY: forwarded.
    unsafe {
        datapath::recv_done(
            m,
            r,
            hdr.bits,
            hdr.data,
            0,
            false,
            sys::MPI_ERR_INTERN as c_int,
        )
    };
}

/// A read into receive `r` finished: tell the sender, complete the receive.
///
/// # Safety
/// `r` must be a live receive in `SmRead` state.
pub unsafe fn read_done(m: &Mtl, r: *mut Request) {
    // SAFETY: forwarded.
    let rq = unsafe { &mut *r };
    rq.kind = Kind::Recv;
    let hdr = rq.sm_hdr;
    send_fin(m, rq);
    // SAFETY: r is live.
    unsafe {
        datapath::recv_done(
            m,
            r,
            hdr.bits,
            hdr.data,
            hdr.len as usize,
            false,
            sys::MPI_SUCCESS as c_int,
        )
    };
}

/// A completion of receive buffer `b`: a message of `e.len` bytes at its start, or at
/// `e.buf` in a multi-receive buffer, which the provider may also report released.
///
/// # Safety
/// `b` must be one of the bounce requests, and `e` its completion.
pub unsafe fn bounce_completed(
    m: &Mtl,
    sm: &SoftMatch,
    b: *mut Request,
    e: &fi::fi_cq_tagged_entry,
) {
    // SAFETY: b is a bounce request; its buffer holds `length` bytes until finalize.
    let (base, cap) = unsafe { ((*b).buffer, (*b).length) };
    let released = !sm.multi || e.flags & fi::FI_MULTI_RECV as u64 != 0;
    // A multi-receive buffer may be released by a completion of its own, without a
    // message.
    if !sm.multi || e.len > 0 {
        // SAFETY: the bounce buffer, not reposted before bounce_done returns.
        match unsafe { crate::fabric::ep::received(base, cap, sm.multi, e.buf, e.len) } {
            Some(bytes) => bounce_done(m, sm, bytes),
            None => {
                sm.rejected.fetch_add(1, Ordering::Relaxed);
                log::error!(
                    "dropping a received message that the provider placed outside its \
                     receive buffer ({:p}, buffer {base:p} of {cap} bytes)",
                    e.buf
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
pub fn bounce_failed(m: &Mtl, sm: &SoftMatch, b: *mut Request, code: u32, flags: u64) {
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
            let r = hdr.token as *mut Request;
            // SAFETY: the token is the pointer of our own send request, registered in
            // `waiting` when it was sent and alive until this last completion.
            unsafe {
                if hdr.kind == FIN {
                    drop_mr(&mut *r);
                }
                datapath::finish_part(r);
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
                        // SAFETY: r is the live receive the message had matched.
                        unsafe { fail_recv(m, r, &hdr) };
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

/// What the piece just added completed.
enum Whole {
    /// Pieces are missing.
    Not,
    /// A message with a target, filled: deliver it.
    Filled(*mut Request, Hdr),
    /// A message without one (or without memory for it: `lost`): match it now, or
    /// queue it.
    Owned(Unexpected),
}

/// Add piece `hdr`/`payload` to its message. `Err` when the piece disagrees with the
/// ones before it (its message is dropped; a receive it had matched fails).
fn add_piece(lists: &mut Lists, hdr: &Hdr, payload: &[u8]) -> Result<Whole, Option<*mut Request>> {
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
            // SAFETY: r is a live receive we matched; its buffer holds rq.length bytes,
            // and only the part of the piece below that is written.
            unsafe {
                let cap = (*r).length;
                if at < cap {
                    let n = payload.len().min(cap - at);
                    ptr::copy_nonoverlapping(payload.as_ptr(), (*r).buffer.add(at), n);
                }
            }
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

/// Post receive `r` (buffer, length and convertor already set).
pub fn irecv(m: &Mtl, sm: &SoftMatch, r: *mut Request, bits: u64, ignore: u64) -> c_int {
    let found = {
        let mut lists = lock(&sm.lists);
        match lists
            .unexpected
            .iter()
            .position(|u| matches(bits, ignore, u.hdr.bits))
        {
            Some(i) => lists.unexpected.remove(i),
            None => {
                lists.posted.push_back(Posted {
                    req: r,
                    bits,
                    ignore,
                });
                None
            }
        }
    };
    if let Some(u) = found {
        take(m, r, u);
    }
    sys::OMPI_SUCCESS
}

/// Deliver an unexpected message to `r`.
pub fn take(m: &Mtl, r: *mut Request, u: Unexpected) {
    let hdr = u.hdr;
    deliver(m, r, hdr, u.delivery(), None);
}

/// The first unexpected message matching (`bits`, `ignore`): its envelope and length.
pub fn probe(sm: &SoftMatch, bits: u64, ignore: u64) -> Option<(u64, u64, usize)> {
    let lists = lock(&sm.lists);
    lists
        .unexpected
        .iter()
        .find(|u| matches(bits, ignore, u.hdr.bits))
        .map(|u| (u.hdr.bits, u.hdr.data, u.hdr.len as usize))
}

/// Remove the first unexpected message matching (`bits`, `ignore`) (mprobe). A
/// synchronous eager message is acknowledged now: it is matched.
pub fn claim(
    m: &Mtl,
    sm: &SoftMatch,
    comm: *mut sys::ompi_communicator_t,
    bits: u64,
    ignore: u64,
) -> Option<Unexpected> {
    let u = {
        let mut lists = lock(&sm.lists);
        let i = lists
            .unexpected
            .iter()
            .position(|u| matches(bits, ignore, u.hdr.bits))?;
        lists.unexpected.remove(i)?
    };
    if u.hdr.kind == EAGER && m.layout.proto(u.hdr.bits) == Proto::Sync {
        if let Ok(env) = datapath::envelope(m, comm, u.hdr.bits, u.hdr.data) {
            if let Ok(p) = datapath::peer(comm, env.source) {
                control(m, p.addr, p.fbox(), ACK, u.hdr.token);
            }
        }
        let mut u = u;
        // Acknowledged: deliver it as a plain message later.
        u.hdr.bits &= !sync_bit(&m.layout);
        return Some(u);
    }
    Some(u)
}

fn sync_bit(l: &TagLayout) -> u64 {
    l.send_tag(0, 0, 0, Proto::Sync) ^ l.send_tag(0, 0, 0, Proto::Plain)
}

/// Cancel receive `r` if it is still waiting for a message.
pub fn cancel(sm: &SoftMatch, r: *mut Request) -> bool {
    let mut lists = lock(&sm.lists);
    match lists.posted.iter().position(|p| p.req == r) {
        Some(i) => {
            lists.posted.remove(i);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const EAGER_MAX_TEST: usize = BOUNCE_SMALL - HDR_LEN;

    fn frame(h: &Hdr, payload: &[u8]) -> Vec<u8> {
        let mut v = h.to_bytes().to_vec();
        v.extend_from_slice(payload);
        v
    }

    fn valid() -> impl Strategy<Value = (Hdr, Vec<u8>)> {
        let eager = (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..64),
            any::<u32>(),
            any::<u64>(),
        )
            .prop_map(|(bits, data, token, p, seq, src)| {
                (
                    Hdr {
                        kind: EAGER,
                        bits,
                        data,
                        len: p.len() as u64,
                        token,
                        seq,
                        src,
                        ..Default::default()
                    },
                    p,
                )
            });
        let rts = (
            any::<u64>(),
            any::<u64>(),
            (EAGER_MAX_TEST as u64 + 1)..u64::MAX,
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
        )
            .prop_map(|(bits, data, len, addr, key, token)| {
                (
                    Hdr {
                        kind: RTS,
                        bits,
                        data,
                        len,
                        addr,
                        key,
                        token,
                        ..Default::default()
                    },
                    vec![],
                )
            });
        let ctl = (prop_oneof![Just(FIN), Just(ACK)], 1u64..).prop_map(|(kind, token)| {
            (
                Hdr {
                    kind,
                    token,
                    ..Default::default()
                },
                vec![],
            )
        });
        prop_oneof![eager, rts, ctl]
    }

    #[test]
    fn rejects_the_obvious() {
        assert_eq!(
            Hdr::decode(&[0u8; 10], EAGER_MAX_TEST).err(),
            Some(BadHdr::Short(10))
        );
        let h = Hdr {
            kind: 9,
            ..Default::default()
        };
        assert_eq!(
            Hdr::decode(&frame(&h, &[]), EAGER_MAX_TEST).err(),
            Some(BadHdr::Kind(9))
        );
        let h = Hdr {
            kind: FIN,
            ..Default::default()
        };
        assert_eq!(
            Hdr::decode(&frame(&h, &[]), EAGER_MAX_TEST).err(),
            Some(BadHdr::Token)
        );
        let h = Hdr {
            kind: EAGER,
            len: 100,
            ..Default::default()
        };
        assert_eq!(
            Hdr::decode(&frame(&h, &[1, 2, 3]), EAGER_MAX_TEST).err(),
            Some(BadHdr::Length {
                header: 100,
                payload: 3
            })
        );
        let h = Hdr {
            kind: RTS,
            len: 10,
            ..Default::default()
        };
        assert!(
            Hdr::decode(&frame(&h, &[]), EAGER_MAX_TEST).is_err(),
            "an RTS below the eager limit"
        );
    }

    fn piece(len: u64, addr: u64, key: u64, n: usize) -> Vec<u8> {
        let h = Hdr {
            kind: FRAG,
            bits: 7,
            data: 3,
            len,
            addr,
            key,
            token: 11,
            ..Default::default()
        };
        frame(&h, &vec![5u8; n])
    }

    #[test]
    fn pieces_decode_inside_their_message_only() {
        let bytes = piece(10000, 4040, 9, 4040);
        let ok = Hdr::decode(&bytes, EAGER_MAX_TEST).unwrap();
        assert_eq!((ok.0.kind, ok.0.addr, ok.1.len()), (FRAG, 4040, 4040));
        // the last piece ends exactly at the message's end
        assert!(Hdr::decode(&piece(10000, 8080, 9, 1920), EAGER_MAX_TEST).is_ok());
        for (bytes, why) in [
            (piece(10000, 8081, 9, 1920), "past the end"),
            (piece(10000, u64::MAX - 10, 9, 100), "offset overflows"),
            (piece(10000, 0, 0, 100), "no message id"),
        ] {
            assert_eq!(
                Hdr::decode(&bytes, EAGER_MAX_TEST).err(),
                Some(BadHdr::Piece),
                "{why}"
            );
        }
        assert!(
            matches!(
                Hdr::decode(&piece(10000, 0, 9, 0), EAGER_MAX_TEST),
                Err(BadHdr::Length { .. })
            ),
            "an empty piece"
        );
        assert!(
            matches!(
                Hdr::decode(&piece(EAGER_MAX_TEST as u64 + 1, 0, 9, 10), EAGER_MAX_TEST),
                Err(BadHdr::Length { .. })
            ),
            "a message in pieces above the eager limit"
        );
    }

    fn lists() -> Lists {
        Lists {
            posted: VecDeque::new(),
            unexpected: VecDeque::new(),
            partial: crate::common::IdMap::default(),
        }
    }

    fn hdr_of(bytes: &[u8]) -> (Hdr, Vec<u8>) {
        let (h, p) = Hdr::decode(bytes, EAGER_MAX_TEST).unwrap();
        (h, p.to_vec())
    }

    #[test]
    fn pieces_assemble_in_any_interleaving_of_messages() {
        let mut l = lists();
        let msg = |seed: u8, len: usize| -> Vec<u8> {
            (0..len).map(|i| (i as u8).wrapping_mul(seed)).collect()
        };
        let (a, b) = (msg(3, 9000), msg(7, 5000));
        let cut = |m: &[u8], key: u64, step: usize| -> Vec<(Hdr, Vec<u8>)> {
            m.chunks(step)
                .enumerate()
                .map(|(i, c)| {
                    let h = Hdr {
                        kind: FRAG,
                        bits: key,
                        len: m.len() as u64,
                        addr: (i * step) as u64,
                        key,
                        ..Default::default()
                    };
                    hdr_of(&frame(&h, c))
                })
                .collect()
        };
        let (pa, pb) = (cut(&a, 21, 4040), cut(&b, 23, 4040));
        let order = [(&pa, 0), (&pb, 0), (&pa, 1), (&pb, 1), (&pa, 2)];
        let mut done = vec![];
        for (i, (ps, k)) in order.iter().enumerate() {
            let (h, p) = &ps[*k];
            match add_piece(&mut l, h, p) {
                Ok(Whole::Not) => {}
                Ok(Whole::Owned(u)) => done.push((i, u.hdr, u.payload)),
                _ => panic!("piece {i}"),
            }
        }
        assert_eq!(done.len(), 2);
        assert_eq!((done[0].0, done[0].1.kind, done[0].1.len), (3, EAGER, 5000));
        assert_eq!(done[0].2, b);
        assert_eq!((done[1].0, done[1].1.len), (4, 9000));
        assert_eq!(done[1].2, a);
        assert!(l.partial.is_empty());
    }

    #[test]
    fn a_piece_that_disagrees_drops_its_message() {
        let mut l = lists();
        let (h, p) = hdr_of(&piece(6000, 0, 9, 4040));
        assert!(matches!(add_piece(&mut l, &h, &p), Ok(Whole::Not)));
        // same id, another length
        let (h2, p2) = hdr_of(&piece(7000, 4040, 9, 1960));
        assert!(matches!(add_piece(&mut l, &h2, &p2), Err(None)));
        assert!(l.partial.is_empty());
        // a repeated piece overfills its message
        let (h, p) = hdr_of(&piece(6000, 0, 9, 4040));
        assert!(matches!(add_piece(&mut l, &h, &p), Ok(Whole::Not)));
        assert!(matches!(add_piece(&mut l, &h, &p), Err(None)));
    }

    #[test]
    fn an_unexpected_message_without_memory_is_lost_not_fatal() {
        let mut l = lists();
        // No allocation of this size can succeed: the message is counted, not held.
        let huge = (isize::MAX as u64) - 1;
        let of = |bytes: &[u8]| {
            let (h, p) = Hdr::decode(bytes, isize::MAX as usize).unwrap();
            (h, p.to_vec())
        };
        let (h, p) = of(&piece(huge, 0, 9, 4040));
        assert!(matches!(add_piece(&mut l, &h, &p), Ok(Whole::Not)));
        assert!(l.partial[&9].lost && l.partial[&9].payload.is_empty());
        let (h, p) = of(&piece(huge, 4040, 9, 4040));
        assert!(matches!(add_piece(&mut l, &h, &p), Ok(Whole::Not)));
        assert_eq!(l.partial[&9].got, 8080);
        // A lost message that completes is handed on as lost (its receive fails).
        let mut l = lists();
        let (h, p) = hdr_of(&piece(6000, 0, 4, 4040));
        assert!(matches!(add_piece(&mut l, &h, &p), Ok(Whole::Not)));
        let part = l.partial.get_mut(&4).unwrap();
        part.lost = true;
        part.payload = Vec::new();
        let (h, p) = hdr_of(&piece(6000, 4040, 4, 1960));
        match add_piece(&mut l, &h, &p) {
            Ok(Whole::Owned(u)) if u.lost => assert_eq!((u.hdr.kind, u.hdr.len), (EAGER, 6000)),
            _ => panic!("not lost"),
        }
        assert!(l.partial.is_empty());
    }

    /// A numbered message from `src`, its payload its number.
    fn numbered_msg(src: u64, seq: u32) -> (Hdr, Vec<u8>) {
        (
            Hdr {
                kind: EAGER,
                seq,
                src,
                len: 4,
                ..Default::default()
            },
            seq.to_ne_bytes().to_vec(),
        )
    }

    /// Feed `arrivals` to `o` as the receive path does; returns the numbers in the
    /// order they were handed to matching.
    fn feed(o: &Order, arrivals: &[(u64, u32)]) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        for &(src, seq) in arrivals {
            let (h, p) = numbered_msg(src, seq);
            match o.arrive(&h, &p) {
                Arrival::Held => {}
                Arrival::Late => out.push((src, seq)),
                Arrival::Next { held } => {
                    out.push((src, seq));
                    if !held {
                        continue;
                    }
                    while let Some(now) = o.release(src) {
                        out.extend(now.iter().map(|(h, _)| (h.src, h.seq)));
                    }
                }
            }
        }
        out
    }

    #[test]
    fn order_restores_each_senders_stream() {
        let o = Order::new(7);
        // Sender 1 in order; sender 2's third message first, then its second.
        let got = feed(&o, &[(1, 1), (2, 3), (1, 2), (2, 2), (2, 1), (1, 3)]);
        assert_eq!(got, vec![(1, 1), (1, 2), (2, 1), (2, 2), (2, 3), (1, 3)]);
        assert!(o.rx.lock().unwrap().values().all(|s| s.held.is_empty()));
    }

    #[test]
    fn order_pieces_of_a_message_share_its_number() {
        let o = Order::new(7);
        // Two pieces of message 2 arrive before message 1, a third after both.
        let got = feed(&o, &[(1, 2), (1, 2), (1, 1), (1, 2), (1, 3)]);
        assert_eq!(got, vec![(1, 1), (1, 2), (1, 2), (1, 2), (1, 3)]);
    }

    #[test]
    fn order_wraps_past_zero() {
        let o = Order::new(7);
        o.rx.lock().unwrap().insert(
            1,
            Stream {
                next: u32::MAX,
                held: Vec::new(),
            },
        );
        // After u32::MAX comes 1 (0 means unnumbered).
        assert_eq!(next_seq(u32::MAX), 1);
        let got = feed(&o, &[(1, 1), (1, u32::MAX), (1, 2)]);
        assert_eq!(got, vec![(1, u32::MAX), (1, 1), (1, 2)]);
    }

    #[test]
    fn order_numbers_per_destination_and_only_what_was_posted() {
        let o = Order::new(0x55);
        let mut seen = Vec::new();
        let mut post = |addr: u64, ret: isize| {
            o.numbered(addr, |seq, src| {
                seen.push((addr, seq, src));
                ret
            })
        };
        post(10, 0);
        post(10, -(fi::FI_EAGAIN as isize));
        post(10, 0);
        post(20, 0);
        post(10, 0);
        assert_eq!(
            seen,
            vec![
                (10, 1, 0x55),
                (10, 2, 0x55),
                (10, 2, 0x55),
                (20, 1, 0x55),
                (10, 3, 0x55)
            ]
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
            if let Ok((h, p)) = Hdr::decode(&bytes, EAGER_MAX_TEST) {
                prop_assert!(matches!(h.kind, EAGER | RTS | FIN | ACK | FRAG));
                prop_assert_eq!(p.len(), bytes.len() - HDR_LEN);
                if h.kind == EAGER {
                    prop_assert_eq!(h.len as usize, p.len());
                } else if h.kind == FRAG {
                    prop_assert!(!p.is_empty() && h.addr + p.len() as u64 <= h.len);
                } else {
                    prop_assert!(p.is_empty());
                }
            }
        }

        #[test]
        fn valid_round_trip((h, p) in valid()) {
            let f = frame(&h, &p);
            let (d, dp) = Hdr::decode(&f, EAGER_MAX_TEST).unwrap();
            prop_assert_eq!(d.to_bytes(), h.to_bytes());
            prop_assert_eq!(dp, &p[..]);
        }

        /// However a sender's messages are shuffled on the way, matching sees them in
        /// the order sent.
        #[test]
        fn order_undoes_any_shuffle(perm in Just((1u32..=40).collect::<Vec<u32>>()).prop_shuffle()) {
            let o = Order::new(7);
            let arrivals: Vec<(u64, u32)> = perm.iter().map(|&s| (3, s)).collect();
            let got: Vec<u32> = feed(&o, &arrivals).into_iter().map(|(_, s)| s).collect();
            prop_assert_eq!(got, (1u32..=40).collect::<Vec<u32>>());
        }

        /// A mutated valid message decodes only to exactly what its bytes say, and a
        /// truncated or extended one is rejected.
        #[test]
        fn mutated_rejected_or_consistent((h, p) in valid(), at in 0usize..HDR_LEN, x in 1u8..=255, extra in 1usize..8) {
            let mut f = frame(&h, &p);
            f[at] ^= x;
            if let Ok((d, _)) = Hdr::decode(&f, EAGER_MAX_TEST) {
                prop_assert_eq!(d.to_bytes().to_vec(), f[..HDR_LEN].to_vec());
            }
            let f = frame(&h, &p);
            prop_assert!(Hdr::decode(&f[..HDR_LEN - 1], EAGER_MAX_TEST).is_err());
            let mut longer = f.clone();
            longer.extend(std::iter::repeat_n(0u8, extra));
            prop_assert!(Hdr::decode(&longer, EAGER_MAX_TEST).is_err());
        }
    }
}
