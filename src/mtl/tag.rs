//! The 64-bit OFI tag: how communicator id, source rank, protocol bits and MPI tag
//! share it in each `mtl_ofi_tag_mode`. Pure arithmetic, no libfabric.
//!
//! ```text
//! full (source in remote CQ data):  [ cid:30 ][ proto:2 ][ tag:32 ]
//! ofi_tag_1:                        [ cid:12 ][ source:18 ][ proto:2 ][ tag:32 ]
//! ofi_tag_2:                        [ cid:24 ][ source:18 ][ proto:2 ][ tag:20 ]
//! ```
//! Proto bits: `SYNC` marks a synchronous send whose receiver must acknowledge the
//! match; `ACK` marks that acknowledgement. An acknowledgement carries no MPI
//! envelope: its tag is the `ACK` bit plus the sender-chosen id of the synchronous
//! send, which travels to the receiver in the remote CQ data (the high 32 bits in
//! `full` mode, where the low 32 carry the source). So each synchronous send waits
//! for its own acknowledgement even when the receiver matches several of them out of
//! order. Negative MPI tags (Open MPI's collectives)
//! have the tag field's top bit set, so `MPI_ANY_TAG` ignores every tag bit but that
//! one and never matches a collective's message.

pub const PROTO_BITS: u32 = 2;

/// The three layouts of `mtl_ofi_tag_mode` (auto resolves to one of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagMode {
    Full,
    Tag1,
    Tag2,
}

impl TagMode {
    pub fn name(self) -> &'static str {
        match self {
            TagMode::Full => "ofi_tag_full",
            TagMode::Tag1 => "ofi_tag_1",
            TagMode::Tag2 => "ofi_tag_2",
        }
    }
}

/// The checked envelope of a received message ([`TagLayout::decode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Envelope {
    pub cid: u32,
    pub source: i32,
    pub tag: i32,
    pub proto: Proto,
    pub sync_id: u32,
}

/// Why a received envelope was rejected: a peer sent bits that no sender of this
/// layout produces (corruption, or a peer that is not one of ours).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadEnvelope {
    /// The communicator id is not the one of the receive (or of any communicator).
    Cid { got: u32, expected: u32 },
    /// The source rank is outside the communicator.
    Source { source: i64, size: i32 },
    /// The protocol bits are not those of an MPI message (an acknowledgement, or both
    /// bits set).
    Proto { bits: u64 },
}

impl std::fmt::Display for BadEnvelope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            BadEnvelope::Cid { got, expected } => write!(
                f,
                "communicator id {got} in a message for communicator id {expected}"
            ),
            BadEnvelope::Source { source, size } => write!(
                f,
                "source rank {source} outside a communicator of {size} ranks"
            ),
            BadEnvelope::Proto { bits } => {
                write!(f, "protocol bits of tag {bits:#x} are not an MPI message's")
            }
        }
    }
}

/// A resolved layout with its masks and shifts.
#[derive(Debug, Clone, Copy)]
pub struct TagLayout {
    pub mode: TagMode,
    pub cid_bits: u32,
    pub source_bits: u32,
    pub tag_bits: u32,
    tag_mask: u64,
    source_shift: u32,
    source_mask: u64,
    cid_shift: u32,
    sync: u64,
    ack: u64,
}

/// Which protocol a matched message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Plain,
    Sync,
    Ack,
}

impl TagLayout {
    pub const fn new(mode: TagMode) -> TagLayout {
        let (cid_bits, source_bits, tag_bits) = match mode {
            TagMode::Full => (30, 0, 32),
            TagMode::Tag1 => (12, 18, 32),
            TagMode::Tag2 => (24, 18, 20),
        };
        let tag_mask = (1u64 << tag_bits) - 1;
        let source_shift = tag_bits + PROTO_BITS;
        let source_mask = if source_bits == 0 {
            0
        } else {
            (1u64 << source_bits) - 1
        };
        TagLayout {
            mode,
            cid_bits,
            source_bits,
            tag_bits,
            tag_mask,
            source_shift,
            source_mask,
            cid_shift: source_shift + source_bits,
            sync: 1u64 << tag_bits,
            ack: 2u64 << tag_bits,
        }
    }

    /// Does the source rank travel in remote CQ data?
    pub fn source_in_data(&self) -> bool {
        self.source_bits == 0
    }

    /// Largest communicator id (for `mtl_max_contextid`).
    pub fn max_cid(&self) -> i32 {
        ((1u64 << self.cid_bits) - 1).min(i32::MAX as u64) as i32
    }

    /// Largest MPI tag (for `mtl_max_tag`): one bit is kept for negative tags.
    pub fn max_tag(&self) -> i32 {
        ((1u64 << (self.tag_bits - 1)) - 1).min(i32::MAX as u64) as i32
    }

    /// Largest source rank this layout can carry (unbounded with CQ data).
    pub fn max_source(&self) -> u64 {
        if self.source_in_data() {
            u32::MAX as u64
        } else {
            self.source_mask
        }
    }

    /// The tag a send carries.
    #[inline]
    pub fn send_tag(&self, cid: u32, source: i32, tag: i32, proto: Proto) -> u64 {
        let mut bits = (cid as u64) << self.cid_shift;
        if !self.source_in_data() {
            bits |= ((source as u64) & self.source_mask) << self.source_shift;
        }
        bits |= (tag as u32 as u64) & self.tag_mask;
        bits | self.proto_bits(proto)
    }

    fn proto_bits(&self, p: Proto) -> u64 {
        match p {
            Proto::Plain => 0,
            Proto::Sync => self.sync,
            Proto::Ack => self.ack,
        }
    }

    /// Match and ignore bits for a receive of (`cid`, `source`, `tag`), either of
    /// which may be the wildcard -1. The sync bit is ignored (a receive takes plain
    /// and synchronous sends alike); the ack bit must be clear.
    #[inline]
    pub fn recv_bits(&self, cid: u32, source: i32, tag: i32) -> (u64, u64) {
        let mut m = (cid as u64) << self.cid_shift;
        let mut ignore = self.sync;
        if !self.source_in_data() {
            if source < 0 {
                ignore |= self.source_mask << self.source_shift;
            } else {
                m |= ((source as u64) & self.source_mask) << self.source_shift;
            }
        }
        if tag < 0 && tag == -1 {
            // MPI_ANY_TAG: every tag bit but the sign bit of the tag field.
            ignore |= self.tag_mask >> 1;
        } else {
            m |= (tag as u32 as u64) & self.tag_mask;
        }
        (m, ignore)
    }

    /// Match and ignore bits that take every message a user's receive could match,
    /// on any communicator and from any source: a tag of 0 or more, plain or
    /// synchronous; never a negative tag (Open MPI's own) nor an acknowledgement.
    /// What the MTL peeks for when the provider's receive queue is full (stall.rs).
    pub fn user_any(&self) -> (u64, u64) {
        let cid = ((1u64 << self.cid_bits) - 1) << self.cid_shift;
        let source = self.source_mask << self.source_shift;
        (0, cid | source | (self.tag_mask >> 1) | self.sync)
    }

    /// The tag of the acknowledgement of synchronous send `id` (what the sender posts
    /// a receive for, and what the receiver sends back).
    #[inline]
    pub fn ack_tag(&self, id: u32) -> u64 {
        self.ack | ((id as u64) & self.tag_mask)
    }

    /// The receive for every acknowledgement, whatever its id: tag bits and ignore
    /// bits (acknowledgements carry no communicator or source, only the sender's id).
    #[inline]
    pub fn ack_any(&self) -> (u64, u64) {
        (self.ack, self.tag_mask)
    }

    /// The synchronous-send id an acknowledgement's tag carries.
    #[inline]
    pub fn ack_id(&self, bits: u64) -> u32 {
        (bits & self.tag_mask) as u32
    }

    /// Ids of synchronous sends wrap at this many.
    pub fn sync_id_space(&self) -> u64 {
        self.tag_mask + 1
    }

    /// The remote CQ data of a send from `source`, synchronous send `id`.
    #[inline]
    pub fn cq_data(&self, source: i32, id: u32) -> u64 {
        if self.source_in_data() {
            (source as u32 as u64) | ((id as u64) << 32)
        } else {
            id as u64
        }
    }

    /// The synchronous-send id found in a message's remote CQ data.
    #[inline]
    pub fn sync_id(&self, data: u64) -> u32 {
        if self.source_in_data() {
            (data >> 32) as u32
        } else {
            data as u32
        }
    }

    #[inline]
    pub fn proto(&self, bits: u64) -> Proto {
        if bits & self.ack != 0 {
            Proto::Ack
        } else if bits & self.sync != 0 {
            Proto::Sync
        } else {
            Proto::Plain
        }
    }

    /// The MPI tag of a matched message (sign-extended from the tag field).
    #[inline]
    pub fn mpi_tag(&self, bits: u64) -> i32 {
        let t = bits & self.tag_mask;
        let shift = 64 - self.tag_bits;
        (((t << shift) as i64) >> shift) as i32
    }

    /// The source rank of a matched message, from the tag or the CQ data.
    #[inline]
    pub fn source(&self, bits: u64, data: u64) -> i32 {
        if self.source_in_data() {
            data as u32 as i32
        } else {
            ((bits >> self.source_shift) & self.source_mask) as i32
        }
    }

    #[inline]
    pub fn cid(&self, bits: u64) -> u32 {
        (bits >> self.cid_shift) as u32
    }

    /// Decode the envelope of a message received on communicator `cid` whose remote
    /// group has `size` ranks, checking what a peer could get wrong: the
    /// communicator id, the source rank (from the tag, or from the CQ data in the
    /// full layout) and the protocol bits. The MPI tag needs no check: every value of
    /// the tag field is a valid (possibly negative) MPI tag. A few compares: this runs
    /// for every received message.
    #[inline]
    pub fn decode(
        &self,
        bits: u64,
        data: u64,
        cid: u32,
        size: i32,
    ) -> Result<Envelope, BadEnvelope> {
        let got = self.cid(bits);
        if got != cid {
            return Err(BadEnvelope::Cid { got, expected: cid });
        }
        if bits & self.ack != 0 {
            return Err(BadEnvelope::Proto { bits });
        }
        let source = if self.source_in_data() {
            data as u32 as u64
        } else {
            (bits >> self.source_shift) & self.source_mask
        } as i64;
        if source >= size as i64 {
            return Err(BadEnvelope::Source { source, size });
        }
        Ok(Envelope {
            cid: got,
            source: source as i32,
            tag: self.mpi_tag(bits),
            proto: self.proto(bits),
            sync_id: self.sync_id(data),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(recv: (u64, u64), sent: u64) -> bool {
        (recv.0 & !recv.1) == (sent & !recv.1)
    }

    #[test]
    fn user_any_takes_user_messages_only() {
        for mode in [TagMode::Full, TagMode::Tag1, TagMode::Tag2] {
            let l = TagLayout::new(mode);
            let any = l.user_any();
            for cid in [0, 1, l.max_cid() as u32] {
                for src in [0, 3, l.max_source().min(1 << 17) as i32] {
                    for tag in [0, 1, l.max_tag()] {
                        for p in [Proto::Plain, Proto::Sync] {
                            assert!(matches(any, l.send_tag(cid, src, tag, p)), "{mode:?}");
                        }
                    }
                    for tag in [-2, -27] {
                        assert!(!matches(any, l.send_tag(cid, src, tag, Proto::Plain)));
                    }
                }
            }
            assert!(!matches(any, l.ack_tag(0)));
            assert!(!matches(any, l.ack_tag(77)));
        }
    }

    #[test]
    fn round_trip_every_mode() {
        for mode in [TagMode::Full, TagMode::Tag1, TagMode::Tag2] {
            let l = TagLayout::new(mode);
            for &tag in &[0, 1, 7, l.max_tag(), -2, -10, -27] {
                for &src in &[0, 1, 5, 1000] {
                    let cid = l.max_cid() as u32;
                    let s = l.send_tag(cid, src, tag, Proto::Plain);
                    assert_eq!(l.mpi_tag(s), tag, "{mode:?} tag {tag}");
                    assert_eq!(l.cid(s), cid);
                    if !l.source_in_data() {
                        assert_eq!(l.source(s, 0), src);
                    } else {
                        assert_eq!(l.source(s, src as u64), src);
                    }
                    assert!(matches(l.recv_bits(cid, src, tag), s));
                    assert!(matches(l.recv_bits(cid, -1, tag), s));
                    let sync = l.send_tag(cid, src, tag, Proto::Sync);
                    assert!(matches(l.recv_bits(cid, src, tag), sync));
                    assert_eq!(l.proto(sync), Proto::Sync);
                    let id = 12345u32 & (l.sync_id_space() - 1) as u32;
                    let data = l.cq_data(src, id);
                    assert_eq!(l.sync_id(data), id);
                    if l.source_in_data() {
                        assert_eq!(l.source(sync, data), src);
                    }
                    let ack = l.ack_tag(id);
                    assert_eq!(l.proto(ack), Proto::Ack);
                    let (any, ignore) = l.ack_any();
                    assert_eq!(
                        (ack ^ any) & !ignore,
                        0,
                        "the ack pool's receive matches it"
                    );
                    assert_eq!(l.ack_id(ack) as u64, id as u64 & (l.sync_id_space() - 1));
                    assert!(
                        !matches(l.ack_any(), s) && !matches(l.ack_any(), sync),
                        "the ack pool's receive never takes an MPI message"
                    );
                    assert!(
                        !matches(l.recv_bits(cid, src, tag), ack),
                        "an ack is never an MPI message"
                    );
                    assert!(matches((ack, 0), ack));
                }
            }
        }
    }

    #[test]
    fn any_tag_skips_negative_tags_and_other_comms() {
        for mode in [TagMode::Full, TagMode::Tag1, TagMode::Tag2] {
            let l = TagLayout::new(mode);
            let any = l.recv_bits(3, -1, -1);
            assert!(matches(any, l.send_tag(3, 1, 42, Proto::Plain)));
            assert!(matches(any, l.send_tag(3, 1, 0, Proto::Sync)));
            assert!(
                !matches(any, l.send_tag(3, 1, -10, Proto::Plain)),
                "collective tags are not MPI_ANY_TAG"
            );
            assert!(!matches(any, l.send_tag(4, 1, 42, Proto::Plain)));
            assert!(!matches(
                l.recv_bits(3, 1, 5),
                l.send_tag(3, 1, 6, Proto::Plain)
            ));
            if !l.source_in_data() {
                assert!(!matches(
                    l.recv_bits(3, 2, 5),
                    l.send_tag(3, 1, 5, Proto::Plain)
                ));
            }
        }
    }

    use proptest::prelude::*;

    fn layouts() -> impl Strategy<Value = TagLayout> {
        prop_oneof![
            Just(TagLayout::new(TagMode::Full)),
            Just(TagLayout::new(TagMode::Tag1)),
            Just(TagLayout::new(TagMode::Tag2)),
        ]
    }

    proptest! {
        /// Arbitrary bits and data: decode never panics, and what it accepts is in range.
        #[test]
        fn decode_random_never_panics(
            l in layouts(), bits in any::<u64>(), data in any::<u64>(),
            cid in any::<u32>(), size in any::<i32>(),
        ) {
            if let Ok(e) = l.decode(bits, data, cid, size) {
                prop_assert_eq!(e.cid, cid);
                prop_assert!(e.source >= 0 && e.source < size);
                prop_assert!(e.proto != Proto::Ack);
            }
        }

        /// Valid envelopes round-trip.
        #[test]
        fn decode_round_trips(
            l in layouts(), cid in any::<u32>(), size in 1i32..=(1 << 18),
            src_frac in 0.0f64..1.0, tag in any::<i32>(), sync in any::<bool>(), id in any::<u32>(),
        ) {
            let cid = cid & l.max_cid() as u32;
            let src = ((size as f64 * src_frac) as i32).min(size - 1);
            // The tag field holds tag_bits bits: wider tags are not representable.
            let tag = l.mpi_tag(tag as u32 as u64);
            let id = (id as u64 & (l.sync_id_space() - 1)) as u32;
            let proto = if sync { Proto::Sync } else { Proto::Plain };
            let bits = l.send_tag(cid, src, tag, proto);
            let e = l.decode(bits, l.cq_data(src, id), cid, size).unwrap();
            prop_assert_eq!(e, Envelope { cid, source: src, tag, proto, sync_id: id });
        }

        /// A source at or beyond the communicator size, another communicator's id or
        /// the acknowledgement bit are rejected.
        #[test]
        fn decode_rejects_out_of_range(
            l in layouts(), cid in any::<u32>(), size in 1i32..1000, extra in 0i32..1000,
            tag in any::<i32>(), flip in 0u32..30,
        ) {
            let cid = cid & l.max_cid() as u32;
            let src = size + extra;
            let bits = l.send_tag(cid, src, tag, Proto::Plain);
            let data = l.cq_data(src, 0);
            let source_fits = (src as u64) <= l.max_source();
            if source_fits {
                prop_assert!(
                    matches!(l.decode(bits, data, cid, size), Err(BadEnvelope::Source { .. })),
                    "source out of range accepted"
                );
            }
            let ok = l.send_tag(cid, 0, tag, Proto::Plain);
            let other = cid ^ (1 << (flip % l.cid_bits));
            prop_assert!(
                matches!(l.decode(ok, 0, other, size), Err(BadEnvelope::Cid { .. })),
                "foreign communicator id accepted"
            );
            prop_assert!(
                matches!(l.decode(l.ack_tag(7) | (ok & !l.tag_mask), 0, cid, size), Err(BadEnvelope::Proto { .. })),
                "acknowledgement accepted as a message"
            );
        }
    }

    #[test]
    fn limits() {
        assert_eq!(TagLayout::new(TagMode::Full).max_cid(), (1 << 30) - 1);
        assert_eq!(TagLayout::new(TagMode::Tag1).max_cid(), 4095);
        assert_eq!(TagLayout::new(TagMode::Tag2).max_tag(), (1 << 19) - 1);
        assert_eq!(TagLayout::new(TagMode::Full).max_tag(), i32::MAX);
    }
}
