//! Send fragments and receive buffers: their memory (registered under
//! `FI_MR_LOCAL`), the free list of fragments, priming a fragment for a send and
//! writing its header.
//!
//! What it owns: the memory of fragments and receive buffers, from their allocation
//! to `free_frag_memory`/`free_recv_buf` at teardown. What it must not touch:
//! posting them (`send.rs`, `recv.rs`).

use super::wire::{AmHeader, HDR};
use crate::btl::module::{lock, PeerEp, State};
use crate::btl::op_context::{Ctx, OpKind};
use crate::fabric::MemoryRegion;
use ompi_sys as sys;
use std::os::raw::c_void;
use std::ptr;

/// Write the header of fragment `f` for `tag` and its current payload length.
///
/// # Safety
/// `f` is one of our fragments, not on the wire.
pub(in crate::btl) unsafe fn write_header(f: *mut Frag, tag: u8) {
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

/// A fresh or recycled fragment with room for `cap` payload bytes (`cap` at most the
/// module's fragment size).
pub(in crate::btl) fn get_frag(state: &State) -> Option<*mut Frag> {
    if let Some(f) = lock(&state.frags).pop() {
        return Some(f);
    }
    let cap = state.frag_payload;
    // Zeroed, once per fragment: what goes on the wire must not carry old heap
    // contents to the peer, and not everything does get written per send (the padding
    // of ob1's headers; valgrind: "sendmsg points to uninitialised bytes").
    // SAFETY: plain allocation, checked.
    let buf = unsafe { libc::calloc(1, HDR + cap) } as *mut u8;
    if buf.is_null() {
        return None;
    }
    let mr = if state.mr_local {
        // SAFETY: buf lives as long as the fragment (freed after the region).
        match unsafe { state.register(buf as *const c_void, HDR + cap) } {
            Ok(m) => Some(m),
            Err(e) => {
                log::warn!("registering a fragment buffer on {}: {e}", state.provider);
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
        ctx: Ctx::new(OpKind::Send),
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
pub(in crate::btl) unsafe fn prime(
    f: *mut Frag,
    ep: *mut sys::mca_btl_base_endpoint_t,
    order: u8,
    flags: u32,
    len: usize,
) {
    // SAFETY: caller's contract.
    unsafe {
        let frag = &mut *f;
        frag.endpoint = ep as *mut PeerEp;
        frag.segment.seg_addr.pval = frag.buf.add(HDR) as *mut c_void;
        frag.segment.seg_len = len as u64;
        frag.base.des_segments = &mut frag.segment;
        frag.base.des_segment_count = 1;
        frag.base.des_cbfunc = None;
        frag.base.des_cbdata = ptr::null_mut();
        frag.base.des_context = ptr::null_mut();
        frag.base.des_flags = flags;
        frag.base.order = order;
        frag.ctx = Ctx::new(OpKind::Send);
        frag.sent = 0;
        frag.piece_id = 0;
    }
}

/// Return a fragment to the free list.
pub(super) fn put_frag(state: &State, f: *mut Frag) {
    lock(&state.frags).push(f);
}

/// Free a fragment's memory (finalize).
///
/// # Safety
/// `f` came from `get_frag` and is not in use.
pub unsafe fn free_frag_memory(f: *mut Frag) {
    // SAFETY: caller's contract; the region closes before the buffer is freed.
    unsafe {
        let frag = Box::from_raw(f);
        let buf = frag.buf;
        drop(frag);
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
