//! Unit tests of the wire format (decoding, its checks, round trips) and of the
//! assembly of messages in pieces. They build headers and lists by hand and touch no
//! provider, request or MTL. The tests of per-peer order are next to their code, in
//! `order`.

use super::bounce::BOUNCE_SMALL;
use super::lists::{add_piece, Lists, Whole};
use super::wire::{BadHdr, Hdr, ACK, EAGER, FIN, FRAG, HDR_LEN, RTS};
use proptest::prelude::*;
use std::collections::VecDeque;

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
