//! Puts done by the target's read, where writes longer than one packet break the
//! provider (udp;ofi_rxd: `common::quirks::Quirks::segments_unsafe`, whose reads are
//! safe): the initiator registers its buffer and sends a put request (target address,
//! key and length, and its own buffer's address and key); the target checks the range
//! as for an emulated atomic, reads the data with `fi_read` straight into it, and
//! answers with a reply once the read completed, so that the put completes with its
//! data in place. `rdma::btl_put` sends puts above `rdma::PUT_BY_READ_MIN` this way
//! where `State::put_by_read` says so.
//!
//! Wire format (little-endian, after the 8-byte active-message header). Put request:
//! origin jobid u32, origin vpid u32, then id, address, key, length, source address,
//! source key (u64 each): 56 bytes. The reply is `amo`'s [`Reply`] under
//! [`TAG_REP`]: the put waits in `amo`'s table of operations waiting for a reply,
//! which gives its registration back. A read the provider pushes back on waits for
//! the next progress call.
//!
//! What it owns: the reads of put requests not yet posted. What it must not touch:
//! the atomics of `amo.rs`, whose request table, registered ranges and reply it
//! shares.

use super::amo::{
    my_name, origin_ep, put_u64s, range_ok, send, u32_at, u64_at, DecodeError, Pending, Reply,
    NEXT_ID, PENDING, TAG_REP,
};
use super::module::{lock, running_module, Module, PeerEp};
use super::rdma::Req;
use super::registration::Handle;
use crate::common::IdMap;
use crate::fabric::Local;
use crate::ompi::btl::RdmaCallback;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// Active-message tag of a put request (`MCA_BTL_TAG_BTL` + 0x12); its reply is a
/// [`Reply`] under [`TAG_REP`].
pub const TAG_PUT: u8 = sys::MCA_BTL_TAG_BTL as u8 + 0x12;

pub const PUT_LEN: usize = 56;

/// A decoded put request: read `len` bytes at `src` (key `src_key`) of the origin
/// into `[addr, addr + len)`, registered under `key` here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutRequest {
    pub origin: (u32, u32),
    pub id: u64,
    pub addr: u64,
    pub key: u64,
    pub len: u64,
    pub src: u64,
    pub src_key: u64,
}

impl PutRequest {
    pub fn encode(&self) -> [u8; PUT_LEN] {
        let mut b = [0u8; PUT_LEN];
        b[0..4].copy_from_slice(&self.origin.0.to_le_bytes());
        b[4..8].copy_from_slice(&self.origin.1.to_le_bytes());
        put_u64s(
            &mut b,
            8,
            &[
                self.id,
                self.addr,
                self.key,
                self.len,
                self.src,
                self.src_key,
            ],
        );
        b
    }

    pub fn decode(b: &[u8]) -> Result<PutRequest, DecodeError> {
        if b.len() != PUT_LEN {
            return Err(DecodeError::Length(b.len()));
        }
        Ok(PutRequest {
            origin: (u32_at(b, 0), u32_at(b, 4)),
            id: u64_at(b, 8),
            addr: u64_at(b, 16),
            key: u64_at(b, 24),
            len: u64_at(b, 32),
            src: u64_at(b, 40),
            src_key: u64_at(b, 48),
        })
    }
}

/// Put requests whose read the provider pushed back on: (module, origin endpoint,
/// request), retried by [`retry_reads`].
static DEFERRED: Mutex<Vec<(usize, usize, PutRequest)>> = Mutex::new(Vec::new());
static HAS_DEFERRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Post a put of `size` bytes as a request that the target read them (see the
/// module documentation); `r` holds `btl_put`'s arguments.
pub(super) fn post(r: Req, size: usize) -> c_int {
    let (Some(peer), Some(handle)) = (r.peer, r.handle) else {
        return sys::OPAL_ERR_BAD_PARAM;
    };
    let local_address = r.local.addr();
    if local_address.is_null() {
        return sys::OPAL_ERR_BAD_PARAM;
    }
    let module = r.module;
    let state = &module.state;
    let Some(reg) = super::registration::register(state, local_address, size) else {
        return sys::OPAL_ERR_OUT_OF_RESOURCE;
    };
    let h = reg.handle;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let req = PutRequest {
        origin: my_name(),
        id,
        addr: r.remote_address,
        key: handle.key,
        len: size as u64,
        src: (local_address as u64).wrapping_sub(h.base),
        src_key: h.key,
    };
    lock(&PENDING).get_or_insert_with(IdMap::default).insert(
        id,
        Pending {
            module,
            cb: r.cb,
            result_width: 0,
            reg: Some(reg),
        },
    );
    state.rdma_outstanding.fetch_add(1, Ordering::AcqRel);
    let rc = send(module, peer.as_endpoint(), TAG_PUT, &req.encode());
    if rc != sys::OPAL_SUCCESS {
        state.rdma_outstanding.fetch_sub(1, Ordering::AcqRel);
        // Nothing reads the registration (the request was not sent).
        if let Some(reg) = lock(&PENDING)
            .as_mut()
            .and_then(|p| p.remove(&id))
            .and_then(|p| p.reg)
        {
            super::registration::deregister(state, reg);
        }
        return rc;
    }
    state.ops[0].fetch_add(1, Ordering::Relaxed);
    sys::OPAL_SUCCESS
}

/// A put request arrived: check it, read its data (or defer the read), or answer
/// with an error.
pub fn on_put(module: &'static Module, bytes: &[u8]) {
    let state = &module.state;
    let req = match PutRequest::decode(bytes) {
        Ok(r) => r,
        Err(e) => {
            log::warn!(
                "dropping a malformed put request on {}: {e}",
                state.provider
            );
            return;
        }
    };
    let Some(ep) = origin_ep(module, req.origin) else {
        log::warn!(
            "dropping a put request from an unknown process ({}, {}) on {}",
            req.origin.0,
            req.origin.1,
            state.provider
        );
        return;
    };
    if !range_ok(module, req.key, req.addr, req.len) {
        log::warn!(
            "refusing a put to {:#x} (key {:#x}, {} bytes) from process {}: not in a registered region",
            req.addr,
            req.key,
            req.len,
            req.origin.1
        );
        answer(module, ep, req.id, sys::OPAL_ERR_BAD_PARAM);
        return;
    }
    read_for(module, ep, req);
}

/// Post the read of put request `req` from `ep`; defer it when the provider pushes
/// back, answer with the error when it fails. The read completes through
/// [`put_read_done`], with the origin's endpoint and the request's id as its context.
fn read_for(module: &'static Module, ep: *mut sys::mca_btl_base_endpoint_t, req: PutRequest) {
    // (src is already relative to the origin's registration.)
    let handle = Handle::unchecked(req.src_key, 0);
    let addr = req.addr as *mut c_void;
    // SAFETY: ep is a live peer of the module (origin_ep, or deferred by this module's
    // progress, which del_procs does not run across); range_ok found the target range
    // in memory this process registered and keeps until deregister_mem; put_read_done
    // takes the endpoint and the id as its context and data, once.
    let (peer, local, cb) = unsafe {
        (
            crate::ompi::btl::endpoint::<PeerEp>(ep),
            Local::new(addr, req.len as usize, ptr::null_mut()),
            RdmaCallback::new(
                ep,
                addr,
                ptr::null_mut(),
                Some(put_read_done),
                ep.cast(),
                req.id as usize as *mut c_void,
            ),
        )
    };
    let r = Req {
        module,
        peer,
        local,
        remote_address: req.src,
        handle: Some(handle),
        cb,
    };
    let rc = super::rdma::get(r);
    if rc == sys::OPAL_SUCCESS {
        return;
    }
    if rc == sys::OPAL_ERR_OUT_OF_RESOURCE {
        lock(&DEFERRED).push((module as *const Module as usize, ep as usize, req));
        HAS_DEFERRED.store(true, Ordering::Release);
    } else {
        answer(module, ep, req.id, rc);
    }
}

/// Post the reads deferred on `module` (from its progress).
pub fn retry_reads(module: &'static Module) {
    if !HAS_DEFERRED.load(Ordering::Acquire) {
        return;
    }
    let me = module as *const Module as usize;
    let mine: Vec<(usize, usize, PutRequest)> = {
        let mut d = lock(&DEFERRED);
        let (mine, rest) = d.drain(..).partition(|&(m, _, _)| m == me);
        *d = rest;
        HAS_DEFERRED.store(!d.is_empty(), Ordering::Release);
        mine
    };
    for (_, ep, req) in mine {
        read_for(module, ep as *mut sys::mca_btl_base_endpoint_t, req);
    }
}

/// Drop the deferred reads of `module` (finalize).
pub fn forget_module(module: &Module) {
    let me = module as *const Module as usize;
    lock(&DEFERRED).retain(|&(m, _, _)| m != me);
}

/// Answer put request `id` of `ep` with `status`.
fn answer(module: &'static Module, ep: *mut sys::mca_btl_base_endpoint_t, id: u64, status: c_int) {
    let rep = Reply { id, old: 0, status };
    let rc = send(module, ep, TAG_REP, &rep.encode());
    if rc != sys::OPAL_SUCCESS {
        log::error!(
            "cannot answer a put request on {} ({rc}): the initiator will wait",
            module.state.provider
        );
    }
}

/// The read of a put request completed: answer the origin (the endpoint is the
/// context, the request's id the data; see [`read_for`]).
unsafe extern "C" fn put_read_done(
    btl: *mut sys::mca_btl_base_module_t,
    _endpoint: *mut sys::mca_btl_base_endpoint_t,
    _local_address: *mut c_void,
    _local_handle: *mut sys::mca_btl_base_registration_handle_t,
    context: *mut c_void,
    cbdata: *mut c_void,
    status: c_int,
) {
    // Called back by this BTL's own get (read_for) on one of its running modules.
    if let Some(module) = running_module(btl) {
        answer(module, context.cast(), cbdata as usize as u64, status);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_requests_round_trip_and_short_ones_are_rejected() {
        let p = PutRequest {
            origin: (7, 3),
            id: 5,
            addr: 0x7fff_0000_1000,
            key: 9,
            len: 1 << 20,
            src: 0x1234,
            src_key: 11,
        };
        assert_eq!(PutRequest::decode(&p.encode()), Ok(p));
        assert_eq!(
            PutRequest::decode(&p.encode()[..PUT_LEN - 1]),
            Err(DecodeError::Length(PUT_LEN - 1))
        );
    }
}
