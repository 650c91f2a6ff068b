//! Per-peer message order, where the provider may break it: the numbers a sender
//! gives its messages to each destination ([`Order::numbered`], [`stamp`]) and the
//! receiver's view of each sender's stream, which holds a message that arrives early
//! until the ones before it have arrived ([`Order::arrive`], [`Order::release`]).
//! It knows nothing of matching: what a released message does is `bounce`'s, and it
//! never touches the lists, a request or the provider.

use super::wire::Hdr;
use crate::fabric;
use crate::mtl::state::locked;
use std::sync::Mutex;

/// Per-peer message order, kept by the MTL where the provider may deliver a peer's
/// messages out of the order they were sent, though it promises `FI_ORDER_SAS`
/// (`common::quirks::Quirks::reorders_messages`: udp;ofi_rxd 1.17, where an 8-byte
/// message can overtake the 0-byte one sent before it on the same communicator and
/// tag: mpi_tests `threads` at 2 ranks, and mpi_tests/repro/rxd_msg_flood.c without
/// MPI). MPI's non-overtaking rule needs that order: each message that matches (EAGER,
/// RTS, FRAG) is numbered per destination as it is posted, and the receiver holds one
/// that arrives early until the messages before it arrived.
pub(super) struct Order {
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
pub(super) enum Arrival {
    /// The next message: match it now, then what was held behind it (`held`: some
    /// messages of that sender are held).
    Next { held: bool },
    /// A later piece of a message already matched: add it now.
    Late,
    /// Ahead of a message still missing: held.
    Held,
}

impl Order {
    pub(super) fn new(me: u64) -> Order {
        Order {
            me,
            tx: Mutex::new(crate::common::IdMap::default()),
            rx: Mutex::new(crate::common::IdMap::default()),
        }
    }

    /// Post a message that matches to `addr` with `post(seq, src)`, which writes the
    /// two into the header it posts; the number is spent only when the post succeeds.
    pub(super) fn numbered(
        &self,
        addr: u64,
        post: impl FnOnce(u32, u64) -> fabric::Result<()>,
    ) -> fabric::Result<()> {
        // A poisoned table may have lost a number: refuse (`state::locked`).
        let Ok(mut tx) = locked(&self.tx) else {
            return Err(fabric::Error(libfabric_sys::FI_EOTHER as i32));
        };
        let next = tx.entry(addr).or_insert(1);
        let ret = post(*next, self.me);
        if ret.is_ok() {
            *next = next_seq(*next);
        }
        ret
    }

    /// Message `hdr` (numbered) arrived with `payload`.
    /// A poisoned table drops the message (`Held` for ever): the module is failed and
    /// refuses further calls (`state::locked`).
    pub(super) fn arrive(&self, hdr: &Hdr, payload: &[u8]) -> Arrival {
        let Ok(mut rx) = locked(&self.rx) else {
            return Arrival::Held;
        };
        let stream = rx.entry(hdr.src).or_insert_with(|| Stream {
            next: 1,
            held: Vec::new(),
        });
        match (hdr.seq.wrapping_sub(stream.next) as i32).cmp(&0) {
            std::cmp::Ordering::Equal => {
                stream.next = next_seq(stream.next);
                Arrival::Next {
                    held: !stream.held.is_empty(),
                }
            }
            std::cmp::Ordering::Less => Arrival::Late,
            std::cmp::Ordering::Greater => {
                stream.held.push((*hdr, payload.to_vec()));
                if stream.held.len() == HELD_WARN {
                    log::error!(
                        "{HELD_WARN} messages from process {:#x} wait for its message #{}, \
                         which has not arrived: the provider may have lost it",
                        hdr.src,
                        stream.next
                    );
                }
                Arrival::Held
            }
        }
    }

    /// The held messages of `src` that are now next (a message and any of its pieces),
    /// in arrival order; `None` when the next one has not arrived.
    pub(super) fn release(&self, src: u64) -> Option<Vec<(Hdr, Vec<u8>)>> {
        let mut rx = locked(&self.rx).ok()?;
        let stream = rx.get_mut(&src)?;
        let next = stream.next;
        if !stream.held.iter().any(|(h, _)| h.seq == next) {
            return None;
        }
        let (now, keep) = std::mem::take(&mut stream.held)
            .into_iter()
            .partition(|(h, _)| h.seq == next);
        stream.held = keep;
        stream.next = next_seq(next);
        Some(now)
    }
}

/// Write `seq` and `src` into the header at the start of `h` (as [`Hdr::to_bytes`]
/// lays it out); nothing for an unnumbered message (`seq` 0: the header already says
/// so).
pub(super) fn stamp(h: &mut [u8], seq: u32, src: u64) {
    if seq == 0 {
        return;
    }
    let (s, r) = (
        std::mem::offset_of!(Hdr, seq),
        std::mem::offset_of!(Hdr, src),
    );
    h[s..s + 4].copy_from_slice(&seq.to_ne_bytes());
    h[r..r + 8].copy_from_slice(&src.to_ne_bytes());
}

/// This process's name as a number (job << 32 | vpid), or a random one before Open MPI
/// has set the local process up.
pub(super) fn process_id() -> u64 {
    crate::ompi::proc::local_name().map_or_else(crate::common::random_odd, |(job, vpid)| {
        (u64::from(job) << 32) | u64::from(vpid)
    })
}

#[cfg(test)]
mod tests {
    use super::super::wire::EAGER;
    use super::*;
    use proptest::prelude::*;

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
        let mut post = |addr: u64, ret: crate::fabric::Result<()>| {
            let _ = o.numbered(addr, |seq, src| {
                seen.push((addr, seq, src));
                ret
            });
        };
        post(10, Ok(()));
        post(10, Err(crate::fabric::Error::AGAIN));
        post(10, Ok(()));
        post(20, Ok(()));
        post(10, Ok(()));
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
        /// However a sender's messages are shuffled on the way, matching sees them in
        /// the order sent.
        #[test]
        fn order_undoes_any_shuffle(perm in Just((1u32..=40).collect::<Vec<u32>>()).prop_shuffle()) {
            let o = Order::new(7);
            let arrivals: Vec<(u64, u32)> = perm.iter().map(|&s| (3, s)).collect();
            let got: Vec<u32> = feed(&o, &arrivals).into_iter().map(|(_, s)| s).collect();
            prop_assert_eq!(got, (1u32..=40).collect::<Vec<u32>>());
        }
    }
}
