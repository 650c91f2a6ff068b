//! The wire format of software matching: the header every message starts with
//! ([`Hdr`]), its decoding and the checks a received one must pass ([`BadHdr`]), the
//! message kinds, and the limits of eager messages that both sides of a job share.
//! Plain data: nothing here touches the provider, a request or the lists; what a
//! message does once it arrives is `bounce`'s and `recv`'s.

pub const HDR_LEN: usize = std::mem::size_of::<Hdr>();

pub(super) const EAGER: u32 = 1;
pub(super) const RTS: u32 = 2;
pub(super) const FIN: u32 = 3;
pub(super) const ACK: u32 = 4;
pub(super) const FRAG: u32 = 5;

/// The largest eager message where sends longer than one packet are unsafe
/// (`pieces_eager_max`, udp;ofi_rxd): larger ones are read by their receiver. Over rxd
/// every piece of one packet is acknowledged on its own, so the cost of a message in
/// pieces grows with its length faster than that of a read, whose exchange (RTS, read
/// request, data, FIN) costs more up front and little per packet: the two cost about
/// the same at this size, and above it the read is faster, one way and in a stream
/// (bench/pingpong.c over udp;ofi_rxd, `-s 8192,16384,65536` and its 1 MiB stream,
/// shows both sides).
pub const PIECES_EAGER_MAX: usize = 8192;

/// Injects per eager message at most where a send past the inject size is slow
/// (`send_past_inject_slow`, shm): larger messages are read by their receiver. On shm
/// a read is one `process_vm_readv`, whose cost hardly changes from 4 KiB to 16 KiB,
/// while each inject past the second adds to a message's latency: two injects cost
/// about what the read costs, three or more cost more (bench/pingpong.c over shm,
/// `-s 4096,8192,12244,16000`, shows it).
pub const SLOW_SEND_EAGER_INJECTS: usize = 2;

/// The header of every message.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct Hdr {
    pub kind: u32,
    /// The message's place in its sender's stream to this receiver, from 1, where the
    /// provider may deliver messages out of order ([`Order`](super::order::Order)); 0
    /// elsewhere and in FIN and ACK. Every piece of a FRAG message carries the
    /// message's number.
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
    /// sends waiting for one ([`SoftMatch`](super::SoftMatch) keeps them).
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
