//! The wire format of active messages: the 8-byte [`AmHeader`] in front of every
//! fragment, and the 24-byte [`PieceHeader`] of the pieces a fragment past the inject
//! size goes as on providers where such sends are slow (`recv::Assembly` gathers
//! them at the receiver). Decoding checks everything a peer sent.
//!
//! What it owns: the layout of the bytes only. What it must not touch: fragments,
//! buffers and the provider (`frag.rs`, `send.rs`, `recv.rs`).

use ompi_sys as sys;

/// Bytes of the wire header.
pub const HDR: usize = 8;

/// The largest message `sendi` builds on the stack to inject (and the largest piece).
pub const INLINE_MAX: usize = 4096;

/// Second byte of a piece's header.
pub const PIECE_MAGIC: u8 = 0xA6;

/// Bytes of a piece's header.
pub const PIECE_HDR: usize = 24;

/// Largest fragment payload sent in pieces; larger ones go whole (at 64 KiB the
/// copies through the inject buffers cost more than shm's own path).
pub const PIECE_LIMIT: usize = 16 << 10;

/// The header of a piece on the wire: `[tag][PIECE_MAGIC][0][0][piece length, u32]`,
/// then the message id (u64), the fragment's payload length (u32) and the piece's
/// offset in it (u32), all little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PieceHeader {
    pub tag: u8,
    pub len: u32,
    pub id: u64,
    pub total: u32,
    pub offset: u32,
}

impl PieceHeader {
    pub fn encode(self) -> [u8; PIECE_HDR] {
        let mut b = [0u8; PIECE_HDR];
        b[0] = self.tag;
        b[1] = PIECE_MAGIC;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.total.to_le_bytes());
        b[20..24].copy_from_slice(&self.offset.to_le_bytes());
        b
    }

    /// Decode and check a received piece (`bytes` is everything that arrived).
    pub fn decode(bytes: &[u8]) -> Result<(PieceHeader, &[u8]), BadAm> {
        if bytes.len() < PIECE_HDR {
            return Err(BadAm::Short(bytes.len()));
        }
        if bytes[1] != PIECE_MAGIC || bytes[2] != 0 || bytes[3] != 0 {
            return Err(BadAm::Format);
        }
        if bytes[0] as u32 >= sys::MCA_BTL_TAG_MAX {
            return Err(BadAm::Tag(bytes[0]));
        }
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let mut id = [0u8; 8];
        id.copy_from_slice(&bytes[8..16]);
        let h = PieceHeader {
            tag: bytes[0],
            len: u32_at(4),
            id: u64::from_le_bytes(id),
            total: u32_at(16),
            offset: u32_at(20),
        };
        let payload = &bytes[PIECE_HDR..];
        if h.len as usize != payload.len() || h.len == 0 {
            return Err(BadAm::Length {
                header: h.len,
                received: payload.len(),
            });
        }
        if h.id == 0
            || h.total as usize > PIECE_LIMIT
            || h.offset as u64 + h.len as u64 > h.total as u64
        {
            return Err(BadAm::Piece);
        }
        Ok((h, payload))
    }
}

/// Second byte of every header: a corrupted or foreign message rarely has it.
pub const AM_MAGIC: u8 = 0xA5;

/// The header of an active message on the wire:
/// `[tag][AM_MAGIC][0][0][payload length, u32 little-endian]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AmHeader {
    pub tag: u8,
    pub len: u32,
}

/// Why a received fragment was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadAm {
    /// Fewer bytes than a header.
    Short(usize),
    /// The magic byte or the reserved bytes are wrong.
    Format,
    /// A tag outside Open MPI's trigger table (`MCA_BTL_TAG_MAX`).
    Tag(u8),
    /// The header's payload length is not what arrived.
    Length { header: u32, received: usize },
    /// A piece outside its fragment, without a message id, or that disagrees with the
    /// pieces before it.
    Piece,
}

impl std::fmt::Display for BadAm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            BadAm::Short(n) => write!(f, "{n} bytes, less than the {HDR}-byte header"),
            BadAm::Format => write!(f, "not an active-message header (magic or reserved bytes)"),
            BadAm::Tag(t) => write!(f, "tag {t} is beyond the active-message table"),
            BadAm::Length { header, received } => write!(
                f,
                "the header says {header} payload bytes, {received} arrived"
            ),
            BadAm::Piece => write!(
                f,
                "a piece outside its fragment, without an id, or unlike the pieces before it"
            ),
        }
    }
}

impl AmHeader {
    pub fn encode(self) -> [u8; HDR] {
        let l = self.len.to_le_bytes();
        [self.tag, AM_MAGIC, 0, 0, l[0], l[1], l[2], l[3]]
    }

    /// Decode and check the header of a received fragment; `bytes` is everything that
    /// arrived. Returns the header and the payload. A few compares per fragment.
    #[inline]
    pub fn decode(bytes: &[u8]) -> Result<(AmHeader, &[u8]), BadAm> {
        if bytes.len() < HDR {
            return Err(BadAm::Short(bytes.len()));
        }
        if bytes[1] != AM_MAGIC || bytes[2] != 0 || bytes[3] != 0 {
            return Err(BadAm::Format);
        }
        let tag = bytes[0];
        if tag as u32 >= sys::MCA_BTL_TAG_MAX {
            return Err(BadAm::Tag(tag));
        }
        let len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        let payload = &bytes[HDR..];
        if len as usize != payload.len() {
            return Err(BadAm::Length {
                header: len,
                received: payload.len(),
            });
        }
        Ok((AmHeader { tag, len }, payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(tag: u8, payload: &[u8]) -> Vec<u8> {
        let mut v = AmHeader {
            tag,
            len: payload.len() as u32,
        }
        .encode()
        .to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn rejects_the_obvious() {
        assert_eq!(AmHeader::decode(&[1, 2, 3]), Err(BadAm::Short(3)));
        // Tag 255 would index one past Open MPI's 255-entry trigger table.
        assert_eq!(AmHeader::decode(&frame(255, b"x")), Err(BadAm::Tag(255)));
        let mut f = frame(0x41, b"abc");
        f[1] = 0;
        assert_eq!(AmHeader::decode(&f), Err(BadAm::Format));
        let mut f = frame(0x41, b"abc");
        f.push(0);
        assert_eq!(
            AmHeader::decode(&f),
            Err(BadAm::Length {
                header: 3,
                received: 4
            })
        );
    }

    fn piece(id: u64, total: u32, offset: u32, n: usize) -> Vec<u8> {
        let mut v = PieceHeader {
            tag: 0x41,
            len: n as u32,
            id,
            total,
            offset,
        }
        .encode()
        .to_vec();
        v.extend(std::iter::repeat_n(7u8, n));
        v
    }

    #[test]
    fn pieces_decode_inside_their_fragment_only() {
        let bytes = piece(9, 8000, 4072, 3928);
        let (h, p) = PieceHeader::decode(&bytes).unwrap();
        assert_eq!(
            (h.tag, h.id, h.total, h.offset, p.len()),
            (0x41, 9, 8000, 4072, 3928)
        );
        for (bytes, why) in [
            (piece(9, 8000, 4073, 3928), "past the end"),
            (piece(0, 8000, 0, 100), "no id"),
            (
                piece(9, PIECE_LIMIT as u32 + 1, 0, 100),
                "a fragment above the piece limit",
            ),
            (piece(9, 8000, u32::MAX, 100), "offset overflows"),
        ] {
            assert_eq!(
                PieceHeader::decode(&bytes).err(),
                Some(BadAm::Piece),
                "{why}"
            );
        }
        assert!(matches!(
            PieceHeader::decode(&piece(9, 8000, 0, 0)),
            Err(BadAm::Length { .. })
        ));
        let mut b = piece(9, 8000, 0, 10);
        b.push(0);
        assert!(
            PieceHeader::decode(&b).is_err(),
            "longer than its header says"
        );
        // an ordinary fragment is not a piece, and a piece is not an ordinary fragment
        assert_eq!(
            PieceHeader::decode(&frame(0x41, &[0u8; 40])).err(),
            Some(BadAm::Format)
        );
        assert_eq!(
            AmHeader::decode(&piece(9, 8000, 0, 10)).err(),
            Some(BadAm::Format)
        );
    }

    proptest! {
        /// Random bytes: never a panic; what is accepted is self-consistent.
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok((h, p)) = AmHeader::decode(&bytes) {
                prop_assert!((h.tag as u32) < sys::MCA_BTL_TAG_MAX);
                prop_assert_eq!(h.len as usize, p.len());
                prop_assert_eq!(p, &bytes[HDR..]);
            }
        }

        /// Valid fragments round-trip.
        #[test]
        fn valid_round_trip(tag in 0u8..255, payload in proptest::collection::vec(any::<u8>(), 0..256)) {
            let f = frame(tag, &payload);
            let (h, p) = AmHeader::decode(&f).unwrap();
            prop_assert_eq!(h, AmHeader { tag, len: payload.len() as u32 });
            prop_assert_eq!(p, &payload[..]);
        }

        /// Any change to a valid header's bytes, or a truncated or extended fragment,
        /// is either rejected or still decodes to exactly what the bytes say (a
        /// different but valid tag).
        #[test]
        fn mutated_header_rejected_or_consistent(
            tag in 0u8..255, payload in proptest::collection::vec(any::<u8>(), 0..64),
            at in 0usize..HDR, x in 1u8..=255, cut in 0usize..80,
        ) {
            let mut f = frame(tag, &payload);
            f[at] ^= x;
            match AmHeader::decode(&f) {
                Ok((h, _)) => {
                    prop_assert_eq!(at, 0, "only the tag byte may change and stay valid");
                    prop_assert_eq!(h.tag, tag ^ x);
                }
                Err(e) => prop_assert!(at != 0 || e == BadAm::Tag(tag ^ x)),
            }
            let f = frame(tag, &payload);
            let cut = cut.min(f.len());
            if cut != f.len() {
                prop_assert!(AmHeader::decode(&f[..cut]).is_err());
            }
        }
    }
}
