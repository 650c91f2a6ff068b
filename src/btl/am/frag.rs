//! Send fragments and receive buffers: their memory (registered under
//! `FI_MR_LOCAL`), the free list of fragments, priming a fragment for a send and
//! writing its header.
//!
//! Ownership: a fragment is a `Box<Frag>` with one holder at a time: the free list,
//! ob1 (as a descriptor pointer, from `alloc`/`prepare_src` until it hands it back to
//! `send` or `free`), a queue, or the provider (leaked while a send is in flight, taken
//! back by progress at its completion). Whoever holds the box may use it; the
//! pointers given away are turned back into the box only where ob1 or the provider
//! returns them (the entry points and progress).
//!
//! What it owns: the memory of fragments and receive buffers, from their allocation
//! to teardown. What it must not touch: posting them (`send.rs`, `recv.rs`).

use super::wire::{AmHeader, HDR};
use crate::btl::module::{lock, PeerEp, State};
use crate::btl::op_context::{Ctx, OpKind};
use crate::fabric::Buffer;
use ompi_sys as sys;
use std::ptr;

/// A send fragment. The descriptor comes first: Open MPI sees only that.
///
/// Invariant: `endpoint` is null or a peer of the module the fragment belongs to:
/// ob1 primes fragments only for peers it has from `add_procs`, and `del_procs` fails
/// a departing peer's queued fragments before it drops the peer.
#[repr(C)]
pub struct Frag {
    pub base: sys::mca_btl_base_descriptor_t,
    pub ctx: Ctx,
    pub segment: sys::mca_btl_base_segment_t,
    endpoint: *mut PeerEp,
    /// HDR bytes of header, then `frag_payload` bytes of payload (registered under
    /// `FI_MR_LOCAL`).
    pub buf: Buffer,
    /// Sent in pieces: payload bytes already out, and the message id (0: none yet).
    pub sent: usize,
    pub piece_id: u64,
}

// SAFETY: a fragment has one holder at a time (see the module documentation), which
// hands it on through the module's mutexes; the descriptor's pointers are ob1's
// callback data and our own segment, the endpoint a live peer (the type's invariant).
unsafe impl Send for Frag {}

impl Frag {
    /// The descriptor Open MPI knows this fragment by, giving the box up: ob1 (or
    /// the provider) holds it until it comes back through an entry point (or a
    /// completion).
    #[inline(always)]
    pub fn into_descriptor(self: Box<Self>) -> *mut sys::mca_btl_base_descriptor_t {
        Box::into_raw(self).cast()
    }

    /// The peer this fragment is primed for. Not borrowed from the fragment: the peer
    /// lives on while the fragment is handed on, until `del_procs`.
    #[inline(always)]
    pub fn peer(&self) -> &'static PeerEp {
        // SAFETY: a primed fragment's endpoint is a live peer of its module (the
        // type's invariant), boxed in the module's peers until del_procs, which Open
        // MPI calls only after its operations to the peer are over and which fails the
        // peer's queued fragments first.
        unsafe { &*self.endpoint }
    }

    #[inline(always)]
    pub fn endpoint(&self) -> *mut PeerEp {
        self.endpoint
    }

    /// Payload bytes in the fragment.
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.segment.seg_len as usize
    }

    /// The active-message tag, the first byte of the header written before posting.
    #[inline(always)]
    pub fn tag(&self) -> u8 {
        self.buf.bytes()[0]
    }

    /// The payload written so far (after the header).
    #[inline(always)]
    pub fn payload(&self) -> &[u8] {
        &self.buf.bytes()[HDR..HDR + self.len()]
    }

    /// Header and payload, as they go on the wire.
    #[inline(always)]
    pub fn wire(&self) -> &[u8] {
        &self.buf.bytes()[..HDR + self.len()]
    }

    /// Room for the payload, from `at` bytes past the header on.
    #[inline(always)]
    pub fn payload_mut(&mut self, at: usize) -> &mut [u8] {
        &mut self.buf.bytes_mut()[HDR + at..]
    }

    /// Write the header for `tag` and the current payload length.
    #[inline]
    pub fn write_header(&mut self, tag: u8) {
        let h = AmHeader {
            tag,
            len: self.segment.seg_len as u32,
        }
        .encode();
        self.buf.bytes_mut()[..HDR].copy_from_slice(&h);
    }

    /// Reset the fragment for a new use and point its one segment at `len` payload
    /// bytes, for the peer at `ep` (an endpoint from `add_procs`).
    #[inline]
    pub fn prime(
        &mut self,
        ep: *mut sys::mca_btl_base_endpoint_t,
        order: u8,
        flags: u32,
        len: usize,
    ) {
        self.endpoint = ep as *mut PeerEp;
        self.segment.seg_addr.pval = self.buf.as_ptr().wrapping_add(HDR).cast();
        self.segment.seg_len = len as u64;
        self.base.des_segments = &mut self.segment;
        self.base.des_segment_count = 1;
        self.base.des_cbfunc = None;
        self.base.des_cbdata = ptr::null_mut();
        self.base.des_context = ptr::null_mut();
        self.base.des_flags = flags;
        self.base.order = order;
        self.ctx = Ctx::new(OpKind::Send);
        self.sent = 0;
        self.piece_id = 0;
    }
}

/// A pre-posted receive buffer. Made at module open and leaked for the module's life:
/// the provider holds it while it is posted, and teardown frees it after the
/// endpoint is closed (`free_recv_buf`).
#[repr(C)]
pub struct RecvBuf {
    pub ctx: Ctx,
    /// The receive context it is posted on (index into the module's contexts).
    pub cx: usize,
    /// Registered under `FI_MR_LOCAL`.
    pub buf: Buffer,
}

/// A fresh or recycled fragment with room for the module's fragment size.
pub(in crate::btl) fn get_frag(state: &State) -> Option<Box<Frag>> {
    if let Some(f) = lock(&state.frags).pop() {
        return Some(f);
    }
    // Zeroed, once per fragment: what goes on the wire must not carry old heap
    // contents to the peer, and not everything does get written per send (the padding
    // of ob1's headers; valgrind: "sendmsg points to uninitialised bytes").
    let mut buf = Buffer::zeroed(HDR + state.frag_payload)?;
    if state.mr_local {
        if let Err(e) = state.register_buffer(&mut buf) {
            log::warn!("registering a fragment buffer on {}: {e}", state.provider);
            return None;
        }
    }
    Some(Box::new(Frag {
        base: sys::mca_btl_base_descriptor_t::default(),
        ctx: Ctx::new(OpKind::Send),
        segment: sys::mca_btl_base_segment_t::default(),
        endpoint: ptr::null_mut(),
        buf,
        sent: 0,
        piece_id: 0,
    }))
}

/// Return a fragment to the free list.
pub(in crate::btl) fn put_frag(state: &State, f: Box<Frag>) {
    lock(&state.frags).push(f);
}
