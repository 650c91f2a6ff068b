//! Active messages for ob1: fragments (`alloc`, `free`, `prepare_src`), `send`,
//! `sendi`, the pre-posted receive buffers and the dispatch of received fragments to
//! `mca_btl_base_active_message_trigger`.
//!
//! Wire format: an 8-byte [`AmHeader`] (the active-message tag, a magic byte, two
//! zero bytes and the payload length; 8 bytes keep the payload aligned) followed by
//! the payload, sent with untagged `fi_send`/`fi_inject`
//! into receive buffers of `HDR + max_send_size` bytes posted `btl_ofi_rd_num` at a
//! time, or, where the provider has `FI_MULTI_RECV`, into multi-receive buffers of the
//! same memory ([`receive_layout`]), so that a fragment costs no receive call. A
//! fragment's header and payload are one contiguous buffer, so a send is one call.
//!
//! What it owns: fragments, receive buffers and the queue of sends that met
//! `-FI_EAGAIN`. What it must not touch: provider setup (`module.rs`), RDMA.

use super::module::{lock, Module, PeerEp, State};
use crate::fabric::{Error, MemoryRegion};
use libfabric_sys as fi;
use ompi_sys as sys;
use std::mem::offset_of;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;

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

/// A fragment whose pieces are arriving.
pub struct Assembly {
    tag: u8,
    payload: Vec<u8>,
    got: usize,
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

/// Write the header of fragment `f` for `tag` and its current payload length.
///
/// # Safety
/// `f` is one of our fragments, not on the wire.
pub(super) unsafe fn write_header(f: *mut Frag, tag: u8) {
    // SAFETY: caller's contract; the buffer starts with HDR header bytes.
    unsafe {
        let h = AmHeader {
            tag,
            len: (*f).segment.seg_len as u32,
        }
        .encode();
        ptr::copy_nonoverlapping(h.as_ptr(), (*f).buf, HDR);
    }
}

/// What kind of operation a completion context belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Kind {
    Send,
    Recv,
    Rdma,
}

impl Kind {
    /// What a log line calls such an operation.
    pub fn what(self) -> &'static str {
        match self {
            Kind::Send => "a send",
            Kind::Recv => "a receive",
            Kind::Rdma => "an RDMA or atomic operation",
        }
    }

    /// The kind of the operation whose context is `ctx`, or `None` for a null context.
    ///
    /// # Safety
    /// `ctx` is null or the context of an operation this BTL posted (it starts with a
    /// [`Ctx`]).
    pub unsafe fn of(ctx: *mut c_void) -> Option<Kind> {
        // SAFETY: caller's contract.
        (!ctx.is_null()).then(|| unsafe { (*(ctx as *const Ctx)).kind })
    }
}

/// The head of every operation context handed to libfabric: the provider's scratch
/// space (FI_CONTEXT/FI_CONTEXT2) and the kind that says which struct contains it.
#[repr(C)]
pub struct Ctx {
    pub fi: fi::fi_context2,
    pub kind: Kind,
}

impl Ctx {
    pub fn new(kind: Kind) -> Ctx {
        Ctx {
            fi: fi::fi_context2::default(),
            kind,
        }
    }

    /// The context handed to libfabric for an operation about to be posted.
    #[inline(always)]
    pub fn as_op_context(&mut self) -> *mut c_void {
        crate::common::quirks::scribble(&mut self.fi);
        self as *mut Ctx as *mut c_void
    }
}

/// A send fragment. The descriptor comes first: Open MPI sees only that.
#[repr(C)]
pub struct Frag {
    pub base: sys::mca_btl_base_descriptor_t,
    pub ctx: Ctx,
    pub segment: sys::mca_btl_base_segment_t,
    pub endpoint: *mut PeerEp,
    /// HDR bytes of header, then `cap` bytes of payload.
    pub buf: *mut u8,
    pub cap: usize,
    pub mr: Option<MemoryRegion>,
    /// Sent in pieces: payload bytes already out, and the message id (0: none yet).
    pub sent: usize,
    pub piece_id: u64,
}

/// A pre-posted receive buffer.
#[repr(C)]
pub struct RecvBuf {
    pub ctx: Ctx,
    /// The receive context it is posted on (index into the module's contexts).
    pub cx: usize,
    pub buf: *mut u8,
    pub cap: usize,
    pub mr: Option<MemoryRegion>,
}

#[inline]
fn module_of(btl: *mut sys::mca_btl_base_module_t) -> *mut Module {
    btl as *mut Module
}

/// A fresh or recycled fragment with room for `cap` payload bytes (`cap` at most the
/// module's fragment size).
pub(super) fn get_frag(st: &State) -> Option<*mut Frag> {
    if let Some(f) = lock(&st.frags).pop() {
        return Some(f);
    }
    let cap = st.frag_payload;
    // Zeroed, once per fragment: what goes on the wire must not carry old heap
    // contents to the peer, and not everything does get written per send (the padding
    // of ob1's headers; valgrind: "sendmsg points to uninitialised bytes").
    // SAFETY: plain allocation, checked.
    let buf = unsafe { libc::calloc(1, HDR + cap) } as *mut u8;
    if buf.is_null() {
        return None;
    }
    let mr = if st.mr_local {
        // SAFETY: buf lives as long as the fragment (freed after the region).
        match unsafe { st.register(buf as *const c_void, HDR + cap) } {
            Ok(m) => Some(m),
            Err(e) => {
                log::warn!("registering a fragment buffer on {}: {e}", st.provider);
                // SAFETY: allocated above.
                unsafe { libc::free(buf as *mut c_void) };
                return None;
            }
        }
    } else {
        None
    };
    let f = Box::new(Frag {
        // SAFETY: a zeroed descriptor is valid (integers, null pointers, None).
        base: unsafe { std::mem::zeroed() },
        ctx: Ctx::new(Kind::Send),
        segment: sys::mca_btl_base_segment_t::default(),
        endpoint: ptr::null_mut(),
        buf,
        cap,
        mr,
        sent: 0,
        piece_id: 0,
    });
    Some(Box::into_raw(f))
}

/// Reset a fragment for a new use and point its one segment at `len` payload bytes.
///
/// # Safety
/// `f` is a fragment of ours not in use.
pub(super) unsafe fn prime(
    f: *mut Frag,
    ep: *mut sys::mca_btl_base_endpoint_t,
    order: u8,
    flags: u32,
    len: usize,
) {
    // SAFETY: caller's contract.
    unsafe {
        let fr = &mut *f;
        fr.endpoint = ep as *mut PeerEp;
        fr.segment.seg_addr.pval = fr.buf.add(HDR) as *mut c_void;
        fr.segment.seg_len = len as u64;
        fr.base.des_segments = &mut fr.segment;
        fr.base.des_segment_count = 1;
        fr.base.des_cbfunc = None;
        fr.base.des_cbdata = ptr::null_mut();
        fr.base.des_context = ptr::null_mut();
        fr.base.des_flags = flags;
        fr.base.order = order;
        fr.ctx = Ctx::new(Kind::Send);
        fr.sent = 0;
        fr.piece_id = 0;
    }
}

/// Return a fragment to the free list.
fn put_frag(st: &State, f: *mut Frag) {
    lock(&st.frags).push(f);
}

/// Free a fragment's memory (finalize).
///
/// # Safety
/// `f` came from `get_frag` and is not in use.
pub unsafe fn free_frag_memory(f: *mut Frag) {
    // SAFETY: caller's contract; the region closes before the buffer is freed.
    unsafe {
        let fr = Box::from_raw(f);
        let buf = fr.buf;
        drop(fr);
        libc::free(buf as *mut c_void);
    }
}

/// Free a receive buffer (finalize, after the endpoint closed).
///
/// # Safety
/// `b` came from `post_receives` and no receive uses it.
pub unsafe fn free_recv_buf(b: *mut RecvBuf) {
    // SAFETY: caller's contract.
    unsafe {
        let rb = Box::from_raw(b);
        let buf = rb.buf;
        drop(rb);
        libc::free(buf as *mut c_void);
    }
}

/// How `rd_num` (`n`) fragments' worth of receive memory is posted: `(buffers,
/// bytes each)`. Multi-receive buffers take one fragment after another, so the same
/// memory goes as a quarter as many buffers, at least two (one fills while the other
/// is posted again) of at least two largest fragments each.
pub fn receive_layout(n: usize, frag: usize, multi: bool) -> (usize, usize) {
    if !multi {
        return (n, frag);
    }
    let count = n.div_ceil(4).max(2);
    (count, n.div_ceil(count).max(2) * frag)
}

/// Post `n` receive buffers on each receive context (as multi-receive buffers, see
/// [`receive_layout`], where the module has them).
///
/// # Safety
/// `mp` is a live module.
pub unsafe fn post_receives(mp: *mut Module, n: usize) -> Result<(), Error> {
    // SAFETY: caller's contract.
    let st = unsafe { &(*mp).st };
    let (n, cap) = receive_layout(n, HDR + st.frag_payload, st.multi_recv);
    for cx in (0..st.ctxs.len()).flat_map(|cx| std::iter::repeat_n(cx, n)) {
        // SAFETY: plain allocation, checked.
        let buf = unsafe { libc::malloc(cap) } as *mut u8;
        if buf.is_null() {
            return Err(Error::NOMEM);
        }
        let mr = if st.mr_local {
            // SAFETY: buf lives until free_recv_buf, after the region is dropped.
            match unsafe { st.register(buf as *const c_void, cap) } {
                Ok(m) => Some(m),
                Err(e) => {
                    // SAFETY: allocated above.
                    unsafe { libc::free(buf as *mut c_void) };
                    return Err(e);
                }
            }
        } else {
            None
        };
        let rb = Box::into_raw(Box::new(RecvBuf {
            ctx: Ctx::new(Kind::Recv),
            cx,
            buf,
            cap,
            mr,
        }));
        lock(&st.recv_bufs).push(rb);
        // SAFETY: rb is live until finalize.
        unsafe { repost(st, rb) }?;
    }
    Ok(())
}

/// Post (again) one receive buffer, progressing while the provider pushes back.
///
/// # Safety
/// `rb` is a live receive buffer of this module, not posted.
unsafe fn repost(st: &State, rb: *mut RecvBuf) -> Result<(), Error> {
    loop {
        // SAFETY: caller's contract.
        match unsafe { try_post(st, rb) } {
            Err(Error::AGAIN) => {
                // Receives are only refused for lack of resources: reap some.
                // SAFETY: plain call.
                unsafe { sys::opal_progress() };
            }
            other => return other,
        }
    }
}

/// One attempt at posting receive buffer `rb`.
///
/// # Safety
/// As [`repost`].
unsafe fn try_post(st: &State, rb: *mut RecvBuf) -> Result<(), Error> {
    // SAFETY: caller's contract.
    let r = unsafe { &mut *rb };
    let desc = r.mr.as_ref().map_or(ptr::null_mut(), |m| m.desc());
    r.ctx = Ctx::new(Kind::Recv);
    let ctx = r.ctx.as_op_context();
    // SAFETY: the buffer and context live until the completion is reaped (or the
    // endpoint closes, before the buffer is freed).
    st.fi(|| unsafe {
        let rx = &st.ctxs[r.cx].rx;
        if st.multi_recv {
            rx.recv_multi(r.buf as *mut c_void, r.cap, desc, ctx)
        } else {
            rx.recv(r.buf as *mut c_void, r.cap, desc, u64::MAX, ctx)
        }
    })
}

/// Post again the receive buffers the provider refused (see [`recv_complete`]), at
/// most once per [`crate::common::sync::Unposted::INTERVAL`]. Called by progress.
pub fn post_unposted(st: &State) {
    if st.closing.load(Ordering::Relaxed) {
        return;
    }
    // SAFETY: a live receive buffer of this module, not posted (recv_complete).
    let (posted, all) = st.unposted.retry(|&rb| unsafe { try_post(st, rb) }.is_ok());
    if posted > 0 && all {
        log::info!(
            "the receive buffers {} refused are posted again",
            st.provider
        );
    }
}

/// A receive completed: hand the payload to the registered callback, then repost the
/// buffer (a multi-receive buffer only when the provider released it: `FI_MULTI_RECV`
/// in `flags`; its fragment is at `buf`).
///
/// # Safety
/// `ctx` is the Ctx of one of our receive buffers.
pub unsafe fn recv_complete(
    mp: *mut Module,
    ctx: *mut c_void,
    len: usize,
    err: i32,
    buf: *const c_void,
    flags: u64,
) {
    let rb = ctx as *mut RecvBuf; // Ctx is RecvBuf's first field
                                  // SAFETY: mp is the live module.
    let st = unsafe { &(*mp).st };
    // SAFETY: rb is live until finalize.
    let (base, cap) = unsafe { ((*rb).buf, (*rb).cap) };
    let released = !st.multi_recv || flags & fi::FI_MULTI_RECV as u64 != 0;
    if err != 0 {
        if st.closing.load(Ordering::Relaxed) || err == fi::FI_ECANCELED as i32 {
            return;
        }
        log::warn!(
            "a receive completed with an error on {}: {}",
            st.provider,
            Error(err)
        );
    } else if !st.multi_recv || len > 0 {
        // (A multi-receive buffer may be released by a completion without a fragment.)
        // SAFETY: rb's buffer, ours until reposted below.
        match unsafe { crate::fabric::ep::received(base, cap, st.multi_recv, buf, len) } {
            None => {
                st.bad_fragments.fetch_add(1, Ordering::Relaxed);
                log::error!(
                    "dropping a fragment that {} placed outside its receive buffer ({buf:p}, \
                     buffer {base:p} of {cap} bytes)",
                    st.provider
                );
            }
            Some(bytes) if bytes.len() > 1 && bytes[1] == PIECE_MAGIC => {
                // SAFETY: mp is live; rb stays ours until reposted below.
                unsafe { piece_arrived(mp, bytes) };
            }
            Some(bytes) => match AmHeader::decode(bytes) {
                // SAFETY: mp is live; the payload (HDR bytes in, h.len long, checked
                // against what arrived) stays ours until we repost below.
                Ok((h, _)) => unsafe {
                    dispatch(
                        mp,
                        h.tag,
                        bytes.as_ptr().add(HDR) as *mut u8,
                        h.len as usize,
                    )
                },
                Err(e) => {
                    st.bad_fragments.fetch_add(1, Ordering::Relaxed);
                    log::error!("dropping a received fragment on {}: {e}", st.provider);
                }
            },
        }
    }
    if !released || st.closing.load(Ordering::Relaxed) {
        return;
    }
    let ret = if crate::common::sync::refuse_repost() {
        Err(Error(fi::FI_EIO as i32))
    } else {
        // SAFETY: rb is ours and no longer posted.
        unsafe { repost(st, rb) }
    };
    if let Err(e) = ret {
        // Kept, not lost: with no buffer posted the module would stop receiving.
        if let Some(n) = st.unposted.push(rb) {
            log::error!(
                "re-posting a receive buffer on {}: {e}; progress tries again ({n} refused \
                 so far)",
                st.provider
            );
        }
    }
}

/// A piece arrived: add it to its fragment; dispatch the fragment when it is whole.
///
/// # Safety
/// `mp` is the live module.
unsafe fn piece_arrived(mp: *mut Module, bytes: &[u8]) {
    // SAFETY: mp is live.
    let st = unsafe { &(*mp).st };
    let whole = PieceHeader::decode(bytes).and_then(|(h, chunk)| {
        let mut asm = st.assembly.lock();
        let a = asm.entry(h.id).or_insert_with(|| Assembly {
            tag: h.tag,
            payload: vec![0u8; h.total as usize],
            got: 0,
        });
        if a.tag != h.tag
            || a.payload.len() != h.total as usize
            || a.got + chunk.len() > a.payload.len()
        {
            asm.remove(&h.id);
            return Err(BadAm::Piece);
        }
        let at = h.offset as usize;
        a.payload[at..at + chunk.len()].copy_from_slice(chunk);
        a.got += chunk.len();
        if a.got < a.payload.len() {
            return Ok(None);
        }
        Ok(asm.remove(&h.id))
    });
    match whole {
        Ok(None) => {}
        Ok(Some(mut a)) => {
            st.assembled.fetch_add(1, Ordering::Relaxed);
            let len = a.payload.len();
            // SAFETY: the payload holds len bytes and lives until the callback returns.
            unsafe { dispatch(mp, a.tag, a.payload.as_mut_ptr(), len) };
        }
        Err(e) => {
            st.bad_fragments.fetch_add(1, Ordering::Relaxed);
            log::error!("dropping a received piece on {}: {e}", st.provider);
        }
    }
}

/// Hand a decoded fragment to the callback registered for its tag.
///
/// # Safety
/// `mp` is the live module; `payload` points to `len` received bytes of one of our
/// receive buffers, which stays ours (not reposted) until this returns.
pub(super) unsafe fn dispatch(mp: *mut Module, tag: u8, payload: *mut u8, len: usize) {
    // SAFETY: mp is live.
    let st = unsafe { &(*mp).st };
    if (st.amo && tag == super::amo::TAG_REQ)
        || (st.serves_requests() && tag == super::amo::TAG_REP)
        || (st.put_by_read && tag == super::amo::TAG_PUT)
    {
        // SAFETY: the payload holds len received bytes until the buffer is reposted.
        unsafe { super::amo::on_message(mp, tag, payload, len) };
        return;
    }
    if st.one_sided && (tag == super::resolve::TAG_FIND || tag == super::resolve::TAG_FOUND) {
        // SAFETY: as above.
        unsafe { super::resolve::on_message(mp, tag, payload, len) };
        return;
    }
    // SAFETY: the trigger table is Open MPI's, filled by the PML before traffic;
    // tag < MCA_BTL_TAG_MAX, its length (checked by AmHeader::decode).
    let trig = unsafe {
        *(&raw const sys::mca_btl_base_active_message_trigger
            as *const sys::mca_btl_active_message_callback_t)
            .add(tag as usize)
    };
    let Some(cb) = trig.cbfunc else {
        // SAFETY: mp is live.
        unsafe { &(*mp).st }
            .bad_fragments
            .fetch_add(1, Ordering::Relaxed);
        log::warn!("dropping a fragment with active-message tag {tag}, which nobody registered");
        return;
    };
    let mut seg = sys::mca_btl_base_segment_t {
        seg_addr: sys::opal_ptr_t {
            pval: payload as *mut c_void,
        },
        seg_len: len as u64,
    };
    // SAFETY: zeroed is a valid descriptor; it only lives for the callback.
    let mut des: sys::mca_btl_base_descriptor_t = unsafe { std::mem::zeroed() };
    des.des_segments = &mut seg;
    des.des_segment_count = 1;
    // SAFETY: the callback may use (and write) the payload until it returns; we
    // repost after.
    unsafe {
        cb(
            mp as *mut sys::mca_btl_base_module_t,
            tag,
            &mut des,
            trig.cbdata,
        )
    };
}

/// Finish a send: callback, then free if the BTL owns the descriptor.
///
/// # Safety
/// `f` is a fragment whose send completed (or failed).
unsafe fn finish_send(mp: *mut Module, f: *mut Frag, status: c_int, always: bool) {
    // SAFETY: caller's contract.
    let (flags, cb, ep) = unsafe { ((*f).base.des_flags, (*f).base.des_cbfunc, (*f).endpoint) };
    if always || flags & sys::MCA_BTL_DES_SEND_ALWAYS_CALLBACK != 0 || status != sys::OPAL_SUCCESS {
        if let Some(cb) = cb {
            // SAFETY: the PML's callback with its own descriptor.
            unsafe { cb(mp as *mut _, ep as *mut _, &mut (*f).base, status) };
        }
    }
    if flags & sys::MCA_BTL_DES_FLAGS_BTL_OWNERSHIP != 0 {
        // SAFETY: mp is live.
        put_frag(unsafe { &(*mp).st }, f);
    }
}

/// A send completion.
///
/// # Safety
/// `ctx` is the `ctx` field of one of our fragments.
pub unsafe fn send_complete(mp: *mut Module, ctx: *mut c_void, err: i32) {
    // SAFETY: ctx lies offset_of!(Frag, ctx) bytes into its fragment.
    let f = unsafe { (ctx as *mut u8).sub(offset_of!(Frag, ctx)) as *mut Frag };
    // SAFETY: mp is live.
    unsafe { &(*mp).st }
        .send_outstanding
        .fetch_sub(1, Ordering::AcqRel);
    let status = if err == 0 {
        sys::OPAL_SUCCESS
    } else {
        Error(err).to_opal()
    };
    // SAFETY: the send is done.
    unsafe { finish_send(mp, f, status, true) };
}

/// Try to put a fragment on the wire. `Ok(true)`: injected (complete now), `Ok(false)`:
/// posted (completion later), `Err(AGAIN)`: retry later.
///
/// # Safety
/// `f` is a primed fragment with its header written.
unsafe fn post(st: &State, f: *mut Frag) -> Result<bool, Error> {
    // SAFETY: caller's contract.
    let fr = unsafe { &mut *f };
    let len = HDR + fr.segment.seg_len as usize;
    // SAFETY: endpoint came from add_procs.
    let dest = unsafe { (*fr.endpoint).addr };
    if st.send_window > 0 && st.send_outstanding.load(Ordering::Acquire) >= st.send_window {
        return Err(Error::AGAIN);
    }
    if len <= st.inject_size && st.send_window == 0 {
        // SAFETY: the buffer is valid for len bytes during the call.
        st.fi(|| unsafe { st.tx().inject(fr.buf as *const c_void, len, st.to(dest)) })?;
        return Ok(true);
    }
    if st.piece_max > PIECE_HDR && len - HDR <= PIECE_LIMIT {
        // SAFETY: forwarded.
        unsafe { send_pieces(st, fr, st.to(dest)) }?;
        return Ok(true);
    }
    let desc = fr.mr.as_ref().map_or(ptr::null_mut(), |m| m.desc());
    let ctx = fr.ctx.as_op_context();
    // Counted before the post: another thread may reap the completion first.
    st.send_outstanding.fetch_add(1, Ordering::AcqRel);
    // SAFETY: the fragment (buffer and context) stays ours until the completion.
    st.fi(|| unsafe {
        st.tx()
            .send(fr.buf as *const c_void, len, desc, st.to(dest), ctx)
    })
    .inspect_err(|_| {
        st.send_outstanding.fetch_sub(1, Ordering::AcqRel);
    })?;
    Ok(false)
}

/// Send the payload of `fr` as pieces (see the module documentation), from where an
/// earlier call stopped: `Err(AGAIN)` leaves `fr.sent` at the pieces already out, and
/// the fragment waits in order for progress to call again.
///
/// # Safety
/// `fr` is a primed fragment with its header written.
unsafe fn send_pieces(st: &State, fr: &mut Frag, to: u64) -> Result<(), Error> {
    let total = fr.segment.seg_len as usize;
    let step = st.piece_max - PIECE_HDR;
    if fr.piece_id == 0 {
        fr.piece_id = st.next_piece_id.fetch_add(2, Ordering::Relaxed);
    }
    // SAFETY: the tag is the first byte of the header written before posting.
    let tag = unsafe { *fr.buf };
    let mut buf = std::mem::MaybeUninit::<[u8; INLINE_MAX]>::uninit();
    let b = buf.as_mut_ptr() as *mut u8;
    while fr.sent < total {
        let n = step.min(total - fr.sent);
        let h = PieceHeader {
            tag,
            len: n as u32,
            id: fr.piece_id,
            total: total as u32,
            offset: fr.sent as u32,
        }
        .encode();
        // SAFETY: b has room for PIECE_HDR + n <= piece_max <= INLINE_MAX bytes; the
        // fragment holds total payload bytes after its header.
        unsafe {
            ptr::copy_nonoverlapping(h.as_ptr(), b, PIECE_HDR);
            ptr::copy_nonoverlapping(fr.buf.add(HDR + fr.sent), b.add(PIECE_HDR), n);
        }
        // SAFETY: the first PIECE_HDR + n bytes of b are written; inject copies them.
        st.fi(|| unsafe { st.tx().inject(b as *const c_void, PIECE_HDR + n, to) })?;
        fr.sent += n;
    }
    Ok(())
}

/// Post queued sends in order until the provider pushes back again.
///
/// One thread drains at a time: the front fragment is posted before it is popped, so
/// two drainers (progress and a sender on other threads under MPI_THREAD_MULTIPLE) would
/// both post it: a duplicated fragment, seen by ob1 as a message longer than the one
/// sent, or a double completion and a stall (scripts/test-hostile, tiny queues). A
/// thread that finds another one draining leaves the queue to it.
pub(crate) fn drain_pending(mp: *mut Module) {
    // SAFETY: mp is live.
    let st = unsafe { &(*mp).st };
    let _drainer = match st.draining.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    loop {
        let f = {
            let q = lock(&st.pending);
            match q.front() {
                Some(&f) => f,
                None => {
                    // Under the lock, so that a concurrent enqueue cannot be hidden.
                    st.has_pending.store(false, Ordering::Relaxed);
                    return;
                }
            }
        };
        // SAFETY: queued fragments are primed and ours.
        match unsafe { post(st, f) } {
            Err(Error::AGAIN) => return,
            r => {
                lock(&st.pending).pop_front();
                match r {
                    // SAFETY: injected: complete now (its callback was deferred).
                    Ok(true) => unsafe { finish_send(mp, f, sys::OPAL_SUCCESS, true) },
                    Ok(false) => {}
                    Err(e) => {
                        log::warn!("a queued send failed on {}: {e}", st.provider);
                        // SAFETY: not posted: report the error through its callback.
                        unsafe { finish_send(mp, f, e.to_opal(), true) };
                    }
                }
            }
        }
    }
}

fn enqueue(st: &State, f: *mut Frag) {
    let mut q = lock(&st.pending);
    q.push_back(f);
    st.has_pending.store(true, Ordering::Relaxed);
}

/// Send a primed fragment with its header written; the BTL's send contract.
///
/// # Safety
/// `f` is ours, primed, header written.
pub(super) unsafe fn send_frag(mp: *mut Module, f: *mut Frag) -> c_int {
    // SAFETY: mp is live.
    let st = unsafe { &(*mp).st };
    // SAFETY: forwarded.
    if let Some(rc) = unsafe { fbox_send(mp, st, f) } {
        return rc;
    }
    if st.has_pending.load(Ordering::Relaxed) {
        drain_pending(mp);
        if st.has_pending.load(Ordering::Relaxed) {
            enqueue(st, f);
            return sys::OPAL_SUCCESS;
        }
    }
    // SAFETY: forwarded.
    let r = unsafe { post(st, f) };
    st.maybe_progress(mp);
    match r {
        Ok(true) => {
            // Injected: the data is gone. Like btl/self, call back only when asked.
            // SAFETY: f is complete.
            unsafe { finish_send(mp, f, sys::OPAL_SUCCESS, false) };
            1
        }
        Ok(false) => sys::OPAL_SUCCESS,
        Err(Error::AGAIN) => {
            // Flow control: the fragment waits in order and goes out from progress.
            enqueue(st, f);
            sys::OPAL_SUCCESS
        }
        Err(e) => {
            log::warn!("fi_send on {}: {e}", st.provider);
            e.to_opal()
        }
    }
}

/// Copy fragment `f` into `slot` and publish it.
///
/// # Safety
/// `f` is a primed fragment with its header written; `slot` has room for its length.
#[inline]
unsafe fn fbox_write(f: *mut Frag, slot: crate::common::fbox::Slot<'_>) {
    // SAFETY: the fragment holds its header (the tag first) and seg_len payload bytes.
    unsafe {
        let len = (*f).segment.seg_len as usize;
        ptr::copy_nonoverlapping((*f).buf.add(HDR), slot.payload(), len);
        slot.commit(len, *(*f).buf);
    }
}

/// Send `f` through its peer's fast box when it fits one: at once when the box has
/// room and nothing waits for it (`Some(1)`: complete, as an inject), else queued in
/// order behind what waits (`Some(OPAL_SUCCESS)`: `drain_fbox` sends it and calls
/// back). `None`: the fragment goes through the provider. A fragment that fits never
/// goes through the provider, so a peer's fragments that carry ob1's matching order
/// arrive in that order (common::fbox).
///
/// # Safety
/// `f` is ours, primed, header written; its endpoint came from add_procs.
unsafe fn fbox_send(mp: *mut Module, st: &State, f: *mut Frag) -> Option<c_int> {
    // SAFETY: caller's contract.
    let (peer, len) = unsafe { (&*(*f).endpoint, (*f).segment.seg_len as usize) };
    let tx = peer.fbox.as_ref()?;
    if len > tx.max() {
        return None;
    }
    if peer.fbox_waiting.load(Ordering::Acquire) == 0 {
        if let Some(slot) = tx.reserve(len) {
            // SAFETY: the slot has room for len bytes; f is complete after.
            unsafe {
                fbox_write(f, slot);
                finish_send(mp, f, sys::OPAL_SUCCESS, false);
            }
            return Some(1);
        }
    }
    let mut q = lock(&st.fbox_queue);
    peer.fbox_waiting.fetch_add(1, Ordering::AcqRel);
    q.push_back(f);
    st.fbox_queued.store(true, Ordering::Relaxed);
    Some(sys::OPAL_SUCCESS)
}

/// Send the fragments waiting for fast boxes, each peer's in order, as far as their
/// boxes have room, and call back for each one sent. From progress only.
pub(crate) fn drain_fbox(mp: *mut Module) {
    // SAFETY: mp is live.
    let st = unsafe { &(*mp).st };
    let mut sent = Vec::new();
    {
        let mut q = lock(&st.fbox_queue);
        let mut full: Vec<*mut PeerEp> = Vec::new();
        q.retain(|&f| {
            // SAFETY: queued fragments are ours, primed, with live endpoints (del_procs
            // takes a peer's out before dropping the peer).
            let (ep, len) = unsafe { ((*f).endpoint, (*f).segment.seg_len as usize) };
            if full.contains(&ep) {
                return true;
            }
            // SAFETY: as above.
            let peer = unsafe { &*ep };
            match peer.fbox.as_ref().and_then(|tx| tx.reserve(len)) {
                Some(slot) => {
                    // SAFETY: the slot has room for len bytes.
                    unsafe { fbox_write(f, slot) };
                    peer.fbox_waiting.fetch_sub(1, Ordering::AcqRel);
                    sent.push(f);
                    false
                }
                None => {
                    full.push(ep);
                    true
                }
            }
        });
        st.fbox_queued.store(!q.is_empty(), Ordering::Relaxed);
    }
    for f in sent {
        // SAFETY: sent: complete; its callback was deferred.
        unsafe { finish_send(mp, f, sys::OPAL_SUCCESS, true) };
    }
}

/// A peer is going: its fragments still waiting for its fast box fail (unreachable).
///
/// # Safety
/// `mp` is the live module; `peer` is live and no longer listed.
pub(super) unsafe fn forget_fbox_peer(mp: *mut Module, peer: *mut PeerEp) {
    // SAFETY: caller's contract.
    let st = unsafe { &(*mp).st };
    let mut gone = Vec::new();
    {
        let mut q = lock(&st.fbox_queue);
        q.retain(|&f| {
            // SAFETY: queued fragments are ours.
            if unsafe { (*f).endpoint } != peer {
                return true;
            }
            gone.push(f);
            false
        });
        st.fbox_queued.store(!q.is_empty(), Ordering::Relaxed);
    }
    for f in gone {
        // SAFETY: never sent: report the failure through its callback.
        unsafe { finish_send(mp, f, sys::OPAL_ERR_UNREACH, true) };
    }
}

/// Pack `size` bytes from the convertor at `dst`. Returns the packed length.
///
/// # Safety
/// `dst` has room for `size` bytes; `conv` is a prepared convertor.
unsafe fn pack(
    conv: *mut sys::opal_convertor_t,
    dst: *mut u8,
    size: usize,
) -> Result<usize, c_int> {
    if size == 0 {
        return Ok(0);
    }
    let mut iov = libc::iovec {
        iov_base: dst as *mut c_void,
        iov_len: size,
    };
    let mut count: u32 = 1;
    let mut max = size;
    // SAFETY: iov describes size writable bytes.
    let rc = unsafe {
        sys::opal_convertor_pack(
            conv,
            &mut iov as *mut _ as *mut sys::iovec,
            &mut count,
            &mut max,
        )
    };
    if rc < 0 {
        return Err(sys::OPAL_ERROR);
    }
    Ok(max)
}

pub(crate) extern "C" fn btl_alloc(
    btl: *mut sys::mca_btl_base_module_t,
    ep: *mut sys::mca_btl_base_endpoint_t,
    order: u8,
    size: usize,
    flags: u32,
) -> *mut sys::mca_btl_base_descriptor_t {
    crate::ompi::component::ffi_guard("btl alloc", ptr::null_mut(), || {
        // SAFETY: btl is our module.
        let st = unsafe { &(*module_of(btl)).st };
        if size > st.frag_payload {
            return ptr::null_mut();
        }
        let Some(f) = get_frag(st) else {
            return ptr::null_mut();
        };
        // SAFETY: f is a free fragment.
        unsafe {
            prime(f, ep, order, flags, size);
            &mut (*f).base
        }
    })
}

pub(crate) extern "C" fn btl_free(
    btl: *mut sys::mca_btl_base_module_t,
    des: *mut sys::mca_btl_base_descriptor_t,
) -> c_int {
    crate::ompi::component::ffi_guard("btl free", sys::OPAL_ERROR, || {
        // SAFETY: btl is our module; des is one of our fragments (its first field).
        put_frag(unsafe { &(*module_of(btl)).st }, des as *mut Frag);
        sys::OPAL_SUCCESS
    })
}

pub(crate) extern "C" fn btl_prepare_src(
    btl: *mut sys::mca_btl_base_module_t,
    ep: *mut sys::mca_btl_base_endpoint_t,
    conv: *mut sys::opal_convertor_t,
    order: u8,
    reserve: usize,
    size: *mut usize,
    flags: u32,
) -> *mut sys::mca_btl_base_descriptor_t {
    crate::ompi::component::ffi_guard("btl prepare_src", ptr::null_mut(), || {
        // SAFETY: btl is our module.
        let st = unsafe { &(*module_of(btl)).st };
        if reserve > st.frag_payload {
            return ptr::null_mut();
        }
        // SAFETY: size is a valid in/out pointer.
        let want = unsafe { *size }.min(st.frag_payload - reserve);
        let Some(f) = get_frag(st) else {
            return ptr::null_mut();
        };
        // SAFETY: f is free; its payload has room for reserve + want bytes.
        let packed = match unsafe { pack(conv, (*f).buf.add(HDR + reserve), want) } {
            Ok(n) => n,
            Err(_) => {
                put_frag(st, f);
                return ptr::null_mut();
            }
        };
        // SAFETY: as above.
        unsafe {
            prime(f, ep, order, flags, reserve + packed);
            *size = packed;
            &mut (*f).base
        }
    })
}

pub(crate) extern "C" fn btl_send(
    btl: *mut sys::mca_btl_base_module_t,
    _ep: *mut sys::mca_btl_base_endpoint_t,
    des: *mut sys::mca_btl_base_descriptor_t,
    tag: sys::mca_btl_base_tag_t,
) -> c_int {
    crate::ompi::component::ffi_guard("btl send", sys::OPAL_ERROR, || {
        let f = des as *mut Frag;
        // SAFETY: des is one of our fragments; the header precedes the payload.
        unsafe {
            write_header(f, tag);
            send_frag(module_of(btl), f)
        }
    })
}

/// Send a small message at once, or decline. When the provider pushes back
/// (`-FI_EAGAIN`) it declines, and ob1 sends the message the regular way (`btl_send`,
/// completion by callback). ob1 packs for `sendi` from a convertor of its own, or
/// resets its own after a decline, so nothing is lost by declining after packing.
/// `sendi`'s success tells ob1 the message is sent, and the caller's `MPI_Send`
/// returns on it: a message queued here instead would wait for this process
/// to call MPI again, which a program need not do. MPICH's `rma/mutex_bench_shared`
/// hung that way in 8 runs of 15 over tcp: a rank passed a lock on with `MPI_Send`,
/// rxm refused the message while it connected to that peer, and the rank then spun on
/// `osc sm` atomics, which make no progress. Declined, the `MPI_Send` waits for the
/// message's completion instead (an `MPI_Isend` returns, its request incomplete).
/// Retrying with progress inside `sendi` instead made each `MPI_Isend` of a flood wait
/// for the provider (many_posted over net at 4 ranks stalled past its 30 s watchdog
/// once in CI).
pub(crate) extern "C" fn btl_sendi(
    btl: *mut sys::mca_btl_base_module_t,
    ep: *mut sys::mca_btl_base_endpoint_t,
    conv: *mut sys::opal_convertor_t,
    header: *mut c_void,
    header_size: usize,
    payload_size: usize,
    order: u8,
    flags: u32,
    tag: sys::mca_btl_base_tag_t,
    descriptor: *mut *mut sys::mca_btl_base_descriptor_t,
) -> c_int {
    crate::ompi::component::ffi_guard("btl sendi", sys::OPAL_ERROR, || {
        let mp = module_of(btl);
        // SAFETY: btl is our module.
        let st = unsafe { &(*mp).st };
        let total = header_size + payload_size;
        let busy = || {
            if !descriptor.is_null() {
                // SAFETY: valid out pointer.
                unsafe { *descriptor = btl_alloc(btl, ep, order, total, flags) };
            }
            sys::OPAL_ERR_RESOURCE_BUSY
        };
        // SAFETY: the endpoint came from add_procs.
        let peer = unsafe { &*(ep as *mut PeerEp) };
        if let Some(tx) = peer.fbox.as_ref() {
            if total <= tx.max() {
                // With fragments waiting for this peer's box, or the box full, ob1 sends
                // it with `btl_send`, which queues it in order (`fbox_send`).
                if peer.fbox_waiting.load(Ordering::Acquire) > 0 {
                    return busy();
                }
                let Some(slot) = tx.reserve(total) else {
                    return busy();
                };
                let b = slot.payload();
                // SAFETY: the slot has room for total bytes; header is valid for
                // header_size bytes.
                unsafe {
                    ptr::copy_nonoverlapping(header as *const u8, b, header_size);
                    if payload_size > 0 && pack(conv, b.add(header_size), payload_size).is_err() {
                        return sys::OPAL_ERROR; // the slot is dropped unsent
                    }
                }
                slot.commit(total, tag);
                return sys::OPAL_SUCCESS;
            }
        }
        if total > st.frag_payload || st.has_pending.load(Ordering::Relaxed) {
            return busy();
        }
        // Small enough to inject: built on the stack, no fragment taken from (and
        // given back to) the free list, whose lock is most of a small send's cost.
        if HDR + total <= st.inject_size.min(INLINE_MAX) && st.send_window == 0 {
            let mut buf = std::mem::MaybeUninit::<[u8; INLINE_MAX]>::uninit();
            let b = buf.as_mut_ptr() as *mut u8;
            let h = AmHeader {
                tag,
                len: total as u32,
            }
            .encode();
            // SAFETY: b has room for HDR + total bytes; header is valid for header_size.
            unsafe {
                ptr::copy_nonoverlapping(h.as_ptr(), b, HDR);
                ptr::copy_nonoverlapping(header as *const u8, b.add(HDR), header_size);
                if payload_size > 0 && pack(conv, b.add(HDR + header_size), payload_size).is_err() {
                    return sys::OPAL_ERROR;
                }
            }
            // SAFETY: endpoint came from add_procs.
            let dest = unsafe { (*(ep as *mut PeerEp)).addr };
            // SAFETY: the first HDR + total bytes of b are written; inject copies them.
            match st.fi(|| unsafe { st.tx().inject(b as *const c_void, HDR + total, st.to(dest)) })
            {
                Ok(()) => return sys::OPAL_SUCCESS,
                // Never queued here: see the function's documentation.
                Err(Error::AGAIN) => return busy(),
                Err(e) => return e.to_opal(),
            }
        }
        let Some(f) = get_frag(st) else { return busy() };
        // SAFETY: f is free with room for total payload bytes; header is valid for
        // header_size bytes.
        unsafe {
            ptr::copy_nonoverlapping(header as *const u8, (*f).buf.add(HDR), header_size);
            if payload_size > 0
                && pack(conv, (*f).buf.add(HDR + header_size), payload_size).is_err()
            {
                put_frag(st, f);
                return sys::OPAL_ERROR;
            }
            prime(
                f,
                ep,
                order,
                flags | sys::MCA_BTL_DES_FLAGS_BTL_OWNERSHIP,
                total,
            );
            write_header(f, tag);
        }
        // SAFETY: f is primed with its header.
        match unsafe { post(st, f) } {
            Ok(true) => {
                put_frag(st, f);
                sys::OPAL_SUCCESS
            }
            Ok(false) => sys::OPAL_SUCCESS,
            Err(Error::AGAIN) => {
                // Never queued here: see the function's documentation. The fragment
                // becomes the descriptor ob1 asked for (ob1 resets its convertor and
                // packs into it again), as `btl_alloc` would have made it.
                if descriptor.is_null() {
                    put_frag(st, f);
                } else {
                    // SAFETY: f is ours, not posted; descriptor is a valid out pointer.
                    unsafe {
                        prime(f, ep, order, flags, total);
                        *descriptor = &mut (*f).base;
                    }
                }
                sys::OPAL_ERR_RESOURCE_BUSY
            }
            Err(e) => {
                put_frag(st, f);
                e.to_opal()
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn multi_receive_buffers_hold_the_memory_of_rd_num_fragments() {
        assert_eq!(receive_layout(8, 1000, false), (8, 1000));
        assert_eq!(receive_layout(8, 1000, true), (2, 4000));
        assert_eq!(receive_layout(1, 1000, true), (2, 2000));
        assert_eq!(receive_layout(64, 1000, true), (16, 4000));
        assert_eq!(receive_layout(9, 1000, true), (3, 3000));
        for n in 1..=1024 {
            let (count, bytes) = receive_layout(n, 1000, true);
            assert!(count >= 2 && bytes >= 2000, "{n}");
            assert!(count * bytes >= n * 1000, "{n}");
        }
    }

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
