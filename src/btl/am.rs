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
use crate::fabric::buffer::StackMsg;
use crate::fabric::Error;
use crate::ompi::convertor::Convertor;
use crate::ompi::error::OpalCode;
use frag::{get_frag, put_frag, Frag};
use ompi_sys as sys;
use send::{post, send_frag, Posted};
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;
use wire::{AmHeader, HDR, INLINE_MAX};

/// Pack the next `dst.len()` bytes of the convertor's data into `dst`; returns the
/// packed length.
#[inline]
fn pack(conv: Option<Convertor>, dst: &mut [u8]) -> Result<usize, c_int> {
    if dst.is_empty() {
        return Ok(0);
    }
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
        // SAFETY: Open MPI calls a module's entries only between its init and finalize.
        let module = unsafe { crate::ompi::btl::module::<Module>(btl) };
        alloc(module, ep, order, size, flags)
    })
}

/// A fragment for `size` payload bytes to `ep`, handed to ob1; null when there is none.
fn alloc(
    module: &'static Module,
    ep: *mut sys::mca_btl_base_endpoint_t,
    order: u8,
    size: usize,
    flags: u32,
) -> *mut sys::mca_btl_base_descriptor_t {
    let state = &module.state;
    if size > state.frag_payload {
        return ptr::null_mut();
    }
    let Some(mut f) = get_frag(state) else {
        return ptr::null_mut();
    };
    f.prime(ep, order, flags, size);
    f.into_descriptor()
}

pub(crate) extern "C" fn btl_free(
    btl: *mut sys::mca_btl_base_module_t,
    des: *mut sys::mca_btl_base_descriptor_t,
) -> c_int {
    crate::ompi::component::ffi_guard("btl free", sys::OPAL_ERROR, || {
        // SAFETY: btl is a live module of ours; des is a fragment of ours (its first
        // field) that ob1 gives back, and with it the box.
        let (module, f) = unsafe {
            (
                crate::ompi::btl::module::<Module>(btl),
                Box::from_raw(des as *mut Frag),
            )
        };
        put_frag(&module.state, f);
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
        // SAFETY: btl is a live module of ours; size is ob1's in/out length; conv is
        // the convertor ob1 prepared for this send and keeps during the call.
        let (module, size, conv) = unsafe {
            (
                crate::ompi::btl::module::<Module>(btl),
                &mut *size,
                Convertor::from_raw(conv),
            )
        };
        let state = &module.state;
        if reserve > state.frag_payload {
            return ptr::null_mut();
        }
        let want = (*size).min(state.frag_payload - reserve);
        let Some(mut f) = get_frag(state) else {
            return ptr::null_mut();
        };
        let packed = match pack(conv, &mut f.payload_mut(reserve)[..want]) {
            Ok(n) => n,
            Err(_) => {
                put_frag(state, f);
                return ptr::null_mut();
            }
        };
        f.prime(ep, order, flags, reserve + packed);
        *size = packed;
        f.into_descriptor()
    })
}

pub(crate) extern "C" fn btl_send(
    btl: *mut sys::mca_btl_base_module_t,
    _ep: *mut sys::mca_btl_base_endpoint_t,
    des: *mut sys::mca_btl_base_descriptor_t,
    tag: sys::mca_btl_base_tag_t,
) -> c_int {
    crate::ompi::component::ffi_guard("btl send", sys::OPAL_ERROR, || {
        // SAFETY: btl is a live module of ours; des is a fragment of ours (its first
        // field) that ob1 primed through alloc or prepare_src and hands over, box and
        // all, until the send's completion.
        let (module, mut f) = unsafe {
            (
                crate::ompi::btl::module::<Module>(btl),
                Box::from_raw(des as *mut Frag),
            )
        };
        f.write_header(tag);
        send_frag(module, f)
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
        // SAFETY: btl is a live module of ours and ep a peer of its add_procs; ob1
        // passes header_size readable bytes at header, the convertor it prepared for
        // this send, and a null or valid out pointer for a descriptor.
        let (module, peer, header, conv, descriptor) = unsafe {
            (
                crate::ompi::btl::module::<Module>(btl),
                crate::ompi::btl::endpoint::<PeerEp>(ep),
                std::slice::from_raw_parts(header as *const u8, header_size),
                Convertor::from_raw(conv),
                descriptor.as_mut(),
            )
        };
        let Some(peer) = peer else {
            return sys::OPAL_ERR_BAD_PARAM;
        };
        sendi(
            module,
            peer,
            Sendi {
                conv,
                header,
                payload_size,
                order,
                flags,
                tag,
            },
            descriptor,
        )
    })
}

/// What `sendi` sends: ob1's header, then `payload_size` bytes packed from `conv`.
struct Sendi<'a> {
    conv: Option<Convertor>,
    header: &'a [u8],
    payload_size: usize,
    order: u8,
    flags: u32,
    tag: u8,
}

impl Sendi<'_> {
    fn total(&self) -> usize {
        self.header.len() + self.payload_size
    }

    /// Header and packed payload after what `m` holds (`total()` bytes, which fit: the
    /// caller checked), none of it cleared first.
    fn write_to<const N: usize>(&self, m: &mut StackMsg<N>) -> Result<(), c_int> {
        m.push(self.header);
        if self.payload_size > 0 {
            let conv = self.conv.ok_or(sys::OPAL_ERROR)?;
            m.fill(self.payload_size, |room| conv.pack_uninit(room))?;
        }
        Ok(())
    }

    /// Header and packed payload into `dst` (`total()` bytes).
    fn write(&self, dst: &mut [u8]) -> Result<(), c_int> {
        let (h, rest) = dst.split_at_mut(self.header.len());
        h.copy_from_slice(self.header);
        if self.payload_size > 0 {
            pack(self.conv, &mut rest[..self.payload_size])?;
        }
        Ok(())
    }
}

fn sendi(
    module: &'static Module,
    peer: &PeerEp,
    msg: Sendi<'_>,
    descriptor: Option<&mut *mut sys::mca_btl_base_descriptor_t>,
) -> c_int {
    let state = &module.state;
    let total = msg.total();
    let ep = peer.as_endpoint();
    let busy = |descriptor: Option<&mut *mut sys::mca_btl_base_descriptor_t>| {
        if let Some(d) = descriptor {
            *d = alloc(module, ep, msg.order, total, msg.flags);
        }
        sys::OPAL_ERR_RESOURCE_BUSY
    };
    if let Some(tx) = peer.fbox.as_ref() {
        if total <= tx.max() {
            // With fragments waiting for this peer's box, or the box full, ob1 sends
            // it with `btl_send`, which queues it in order (`fbox_send`).
            if peer.fbox_waiting.load(Ordering::Acquire) > 0 {
                return busy(descriptor);
            }
            let Some(mut slot) = tx.reserve(total) else {
                return busy(descriptor);
            };
            if msg.write(slot.payload_mut()).is_err() {
                return sys::OPAL_ERROR; // the slot is dropped unsent
            }
            slot.commit(total, msg.tag);
            return sys::OPAL_SUCCESS;
        }
    }
    if total > state.frag_payload || state.has_pending.load(Ordering::Relaxed) {
        return busy(descriptor);
    }
    // Small enough to inject: built on the stack, no fragment taken from (and
    // given back to) the free list, whose lock is most of a small send's cost.
    if HDR + total <= state.inject_size.min(INLINE_MAX) && state.send_window == 0 {
        let mut b = StackMsg::<INLINE_MAX>::default();
        let h = AmHeader {
            tag: msg.tag,
            len: total as u32,
        }
        .encode();
        b.push(&h);
        let sent = msg.write_to(&mut b).map(|()| {
            let to = state.to(peer.addr);
            state.fi(|s| state.tx().inject(s, b.bytes(), to))
        });
        match sent {
            Err(_) => return sys::OPAL_ERROR,
            Ok(Ok(())) => return sys::OPAL_SUCCESS,
            // Never queued here: see the function's documentation.
            Ok(Err(Error::AGAIN)) => return busy(descriptor),
            Ok(Err(e)) => return e.to_opal(),
        }
    }
    let Some(mut f) = get_frag(state) else {
        return busy(descriptor);
    };
    if msg.write(&mut f.payload_mut(0)[..total]).is_err() {
        put_frag(state, f);
        return sys::OPAL_ERROR;
    }
    f.prime(
        ep,
        msg.order,
        msg.flags | sys::MCA_BTL_DES_FLAGS_BTL_OWNERSHIP,
        total,
    );
    f.write_header(msg.tag);
    match post(state, f) {
        Posted::Injected(f) => {
            put_frag(state, f);
            sys::OPAL_SUCCESS
        }
        Posted::InFlight => sys::OPAL_SUCCESS,
        Posted::Refused(mut f, Error::AGAIN) => {
            // Never queued here: see the function's documentation. The fragment
            // becomes the descriptor ob1 asked for (ob1 resets its convertor and
            // packs into it again), as `btl_alloc` would have made it.
            match descriptor {
                None => put_frag(state, f),
                Some(d) => {
                    f.prime(ep, msg.order, msg.flags, total);
                    *d = f.into_descriptor();
                }
            }
            sys::OPAL_ERR_RESOURCE_BUSY
        }
        Posted::Refused(f, e) => {
            put_frag(state, f);
            e.to_opal()
        }
    }
}
