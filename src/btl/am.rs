//! Active messages for ob1: fragments (`alloc`, `free`, `prepare_src`), `send`,
//! `sendi`, the pre-posted receive buffers and the dispatch of received fragments to
//! `mca_btl_base_active_message_trigger`.
//!
//! Wire format: an 8-byte `wire::AmHeader` (the active-message tag, a magic byte, two
//! zero bytes and the payload length; 8 bytes keep the payload aligned) followed by the
//! payload, sent with untagged `fi_send`/`fi_inject` into receive buffers of
//! `HDR + max_send_size` bytes posted `btl_ofi_rd_num` at a time, or, where the
//! provider has `FI_MULTI_RECV`, into multi-receive buffers of the same memory
//! (`recv::receive_layout`), so that a fragment costs no receive call. A fragment's
//! header and payload are one contiguous buffer, so a send is one call.
//!
//! This file holds the entry points ob1 calls; the rooms behind them: `wire` (the
//! headers), `frag` (fragments and receive buffers), `send` (posting, queues, fast
//! boxes) and `recv` (receive buffers, pieces, dispatch to the callbacks).
//!
//! What it owns: fragments, receive buffers and the queue of sends that met
//! `-FI_EAGAIN`. What it must not touch: provider setup (`open.rs`), RDMA.

pub(super) mod frag;
pub(super) mod recv;
pub(super) mod send;
pub(super) mod wire;

use super::module::{Module, PeerEp};
use crate::fabric::Error;
use crate::ompi::convertor::Convertor;
use crate::ompi::error::OpalCode;
use frag::{get_frag, prime, put_frag, write_header, Frag};
use ompi_sys as sys;
use send::{post, send_frag};
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;
use wire::{AmHeader, HDR, INLINE_MAX};

#[inline]
fn module_of(btl: *mut sys::mca_btl_base_module_t) -> *mut Module {
    btl as *mut Module
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
    // SAFETY: forwarded from the caller: a prepared convertor, and size writable bytes
    // at dst that nothing else uses during the call.
    let (conv, dst) = unsafe {
        (
            Convertor::from_raw(conv),
            std::slice::from_raw_parts_mut(dst, size),
        )
    };
    conv.ok_or(sys::OPAL_ERROR)?.pack(dst)
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
        let state = unsafe { &(*module_of(btl)).state };
        if size > state.frag_payload {
            return ptr::null_mut();
        }
        let Some(f) = get_frag(state) else {
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
        put_frag(unsafe { &(*module_of(btl)).state }, des as *mut Frag);
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
        let state = unsafe { &(*module_of(btl)).state };
        if reserve > state.frag_payload {
            return ptr::null_mut();
        }
        // SAFETY: size is a valid in/out pointer.
        let want = unsafe { *size }.min(state.frag_payload - reserve);
        let Some(f) = get_frag(state) else {
            return ptr::null_mut();
        };
        // SAFETY: f is free; its payload has room for reserve + want bytes.
        let packed = match unsafe { pack(conv, (*f).buf.add(HDR + reserve), want) } {
            Ok(n) => n,
            Err(_) => {
                put_frag(state, f);
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
        let module = module_of(btl);
        // SAFETY: btl is our module.
        let state = unsafe { &(*module).state };
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
        if total > state.frag_payload || state.has_pending.load(Ordering::Relaxed) {
            return busy();
        }
        // Small enough to inject: built on the stack, no fragment taken from (and
        // given back to) the free list, whose lock is most of a small send's cost.
        if HDR + total <= state.inject_size.min(INLINE_MAX) && state.send_window == 0 {
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
            match state.fi(|| unsafe {
                state
                    .tx()
                    .inject(b as *const c_void, HDR + total, state.to(dest))
            }) {
                Ok(()) => return sys::OPAL_SUCCESS,
                // Never queued here: see the function's documentation.
                Err(Error::AGAIN) => return busy(),
                Err(e) => return e.to_opal(),
            }
        }
        let Some(f) = get_frag(state) else {
            return busy();
        };
        // SAFETY: f is free with room for total payload bytes; header is valid for
        // header_size bytes.
        unsafe {
            ptr::copy_nonoverlapping(header as *const u8, (*f).buf.add(HDR), header_size);
            if payload_size > 0
                && pack(conv, (*f).buf.add(HDR + header_size), payload_size).is_err()
            {
                put_frag(state, f);
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
        match unsafe { post(state, f) } {
            Ok(true) => {
                put_frag(state, f);
                sys::OPAL_SUCCESS
            }
            Ok(false) => sys::OPAL_SUCCESS,
            Err(Error::AGAIN) => {
                // Never queued here: see the function's documentation. The fragment
                // becomes the descriptor ob1 asked for (ob1 resets its convertor and
                // packs into it again), as `btl_alloc` would have made it.
                if descriptor.is_null() {
                    put_frag(state, f);
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
                put_frag(state, f);
                e.to_opal()
            }
        }
    })
}
