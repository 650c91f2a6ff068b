//! MTL setup and teardown: the module table handed to pml cm, the objects `open`
//! opened (kept until finalize), the address exchange, add/del of procs and
//! communicators, and finalize. The module is opened in phases by `open.rs` and
//! `open/`.
//!
//! What it owns: the libfabric objects of the MTL (kept in [`RESOURCES`]) and the
//! peers' endpoints stored in their procs. It must not touch the data path's requests.

use super::ffi;
use super::peer::PeerEndpoint;
use super::progress;
use super::request::REQUEST_EXTRA;
use super::state;
use super::tag::TagLayout;
use crate::common::sync::lock;
use crate::common::{fbox, DomainHandle};
use crate::fabric::{AddressVector, CompletionQueue, Endpoint, Scrap};
use crate::ompi::comm::Comm;
use crate::ompi::component::{ffi_guard, Exported};
use crate::ompi::error::OpalCode;
use crate::ompi::modex;
use crate::ompi::proc::{self, Proc, Slot};
use ompi_sys as sys;
use std::os::raw::c_int;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// The libfabric objects of the MTL, dropped (closed) at finalize: endpoint first,
/// then CQ and AV, then the shared domain.
struct Resources {
    /// The endpoint, or a scalable endpoint's contexts (each keeps the scalable
    /// endpoint open); closed before the CQs.
    _eps: Vec<Endpoint>,
    _cqs: Vec<Arc<CompletionQueue>>,
    av: Arc<AddressVector>,
    _domain: DomainHandle,
    /// The procs whose MTL slot holds our [`PeerEndpoint`].
    peers: Vec<Proc>,
}

// SAFETY: Resources lives in the RESOURCES mutex and is used only by init, add/del_procs
// (and the peer lookup that calls add_procs_inner) and finalize, one thread at a time:
// the endpoints are only closed there, which the domain's FI_THREAD_DOMAIN or
// FI_THREAD_SAFE level allows from any thread, and the procs live until after
// del_procs.
unsafe impl Send for Resources {}

static RESOURCES: Mutex<Option<Resources>> = Mutex::new(None);
static CID_WARNED: AtomicBool = AtomicBool::new(false);
/// The module's `mtl_max_contextid`, as add_comm compares ids with it.
static MAX_CID: AtomicU32 = AtomicU32::new(0);

static MODULE: Exported<sys::mca_mtl_base_module_t> = Exported::new(sys::mca_mtl_base_module_t {
    mtl_max_contextid: 0,
    mtl_max_tag: 0,
    mtl_request_size: 0,
    mtl_flags: 0,
    mtl_add_procs: Some(mtl_add_procs),
    mtl_del_procs: Some(mtl_del_procs),
    mtl_finalize: Some(mtl_finalize),
    mtl_send: Some(ffi::mtl_send),
    mtl_isend: Some(ffi::mtl_isend),
    mtl_irecv: Some(ffi::mtl_irecv),
    mtl_iprobe: Some(ffi::mtl_iprobe),
    mtl_imrecv: Some(ffi::mtl_imrecv),
    mtl_improbe: Some(ffi::mtl_improbe),
    mtl_cancel: Some(ffi::mtl_cancel),
    mtl_add_comm: Some(mtl_add_comm),
    mtl_del_comm: Some(mtl_del_comm),
});

/// The module handed to pml cm.
pub fn module_ptr() -> *mut sys::mca_mtl_base_module_t {
    MODULE.get()
}

/// Keep the objects `open` opened until finalize.
pub(super) fn keep_resources(
    eps: Vec<Endpoint>,
    cqs: Vec<Arc<CompletionQueue>>,
    av: Arc<AddressVector>,
    domain: DomainHandle,
) {
    *lock(&RESOURCES) = Some(Resources {
        _eps: eps,
        _cqs: cqs,
        av,
        _domain: domain,
        peers: Vec::new(),
    });
}

/// Fill the module's limits for `layout` and return the module for pml cm.
pub(super) fn publish_module(layout: &TagLayout) -> *mut sys::mca_mtl_base_module_t {
    CID_WARNED.store(false, Ordering::Relaxed);
    // Open MPI hands out ids below mtl_max_contextid: every id the layout carries.
    let max_cid = (layout.max_cid() as u64 + 1).min(i32::MAX as u64) as i32;
    MAX_CID.store(max_cid as u32, Ordering::Relaxed);
    MODULE.publish_limits(crate::ompi::mtl_module::MtlLimits {
        max_contextid: max_cid,
        max_tag: layout.max_tag(),
        request_size: REQUEST_EXTRA,
    })
}

/// Scratch that receives end with on providers where truncation stalls: address space
/// only (MAP_NORESERVE), touched only by a message longer than its receive.
const OVERFLOW_MAX: usize = 1 << 30;

pub(super) fn overflow_area(max_msg: usize) -> Option<Scrap> {
    let len = max_msg.clamp(4096, OVERFLOW_MAX);
    let s = Scrap::map(len);
    if s.is_none() {
        log::warn!("no overflow area for receives ({len} bytes): a truncated receive may stall this provider");
    }
    s
}

/// The MTL's modex entry: the endpoint name's length (u16, little-endian), the name,
/// then the fast-box segment's record, if any (`common::fbox::Rx::record`).
pub(super) fn modex_blob(name: &[u8], fbox: Option<&[u8]>) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + name.len() + fbox.map_or(0, |r| r.len()));
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(fbox.unwrap_or_default());
    v
}

/// A peer's modex entry ([`modex_blob`]): its endpoint name and fast-box record;
/// `None` when malformed.
fn modex_parse(blob: &[u8]) -> Option<(&[u8], Option<&[u8]>)> {
    let n = u16::from_le_bytes(blob.get(..2)?.try_into().ok()?) as usize;
    let name = blob.get(2..2 + n).filter(|s| !s.is_empty())?;
    let rest = &blob[2 + n..];
    Some((name, (!rest.is_empty()).then_some(rest)))
}

/// Insert `procs` into the address vector (from their modex entries).
pub fn add_procs_inner(procs: &[Proc]) -> Result<(), c_int> {
    let mut res = lock(&RESOURCES);
    let Some(res) = res.as_mut() else {
        return Err(sys::OMPI_ERR_NOT_AVAILABLE);
    };
    // The largest record this process sends through a fast box, if it has them.
    let fbox_max = state::with_mtl(|m| {
        m.and_then(|m| m.soft.as_deref())
            .filter(|sm| sm.fbox.is_some())
            .map(|sm| sm.fbox_record_max())
    });
    for &p in procs {
        if !p.endpoint(Slot::Mtl).is_null() {
            continue;
        }
        let blob = modex::recv(super::component::component(), p.name()).inspect_err(|rc| {
            log::error!(
                "no endpoint name of a peer in the modex ({rc}): is the peer running our MTL?"
            );
        })?;
        let Some((addr, fbox_record)) = modex_parse(&blob) else {
            log::error!("a peer's modex entry is malformed ({} bytes)", blob.len());
            return Err(sys::OMPI_ERR_UNREACH);
        };
        let fiaddr = res.av.insert(addr).map_err(|e| {
            log::error!("fi_av_insert of a peer's address failed: {e}");
            e.to_opal()
        })?;
        // A fast box to a peer on this node, when both have fast boxes.
        let fbox = fbox_max
            .zip(fbox_record)
            .filter(|_| p.on_node())
            .and_then(|(max, rec)| {
                // A peer whose records are smaller than ours (another eager size) is
                // sent to through the provider.
                fbox::Tx::open(rec, proc::local_rank())
                    .and_then(|tx| {
                        if tx.max() >= max {
                            Ok(tx)
                        } else {
                            Err(format!("its records hold {} B, ours {max} B", tx.max()))
                        }
                    })
                    .inspect_err(|e| log::info!("no fast box to a peer: {e}"))
                    .ok()
            });
        let ep = Box::into_raw(Box::new(PeerEndpoint { addr: fiaddr, fbox }));
        p.set_endpoint(Slot::Mtl, ep.cast());
        res.peers.push(p);
    }
    Ok(())
}

/// Messages sent through fast boxes to the peers known now.
pub fn fbox_sent() -> u64 {
    lock(&RESOURCES).as_ref().map_or(0, |res| {
        res.peers
            .iter()
            .filter_map(|&p| {
                let ep = p.endpoint(Slot::Mtl) as *const PeerEndpoint;
                // SAFETY: each proc in the list holds our PeerEndpoint until
                // release_peers takes it out (under the RESOURCES lock held here).
                unsafe { ep.as_ref() }?.fbox.as_ref().map(|t| t.sent())
            })
            .sum()
    })
}

fn release_peers(res: &mut Resources, only: Option<&[Proc]>) {
    res.peers.retain(|&p| {
        if only.is_some_and(|o| !o.contains(&p)) {
            return true;
        }
        let ep = p.endpoint(Slot::Mtl) as *mut PeerEndpoint;
        if !ep.is_null() {
            p.set_endpoint(Slot::Mtl, ptr::null_mut());
            // SAFETY: add_procs_inner stored this Box in the slot, and it leaves the
            // slot only here, once (the slot is cleared first).
            drop(unsafe { Box::from_raw(ep) });
        }
        false
    });
}

extern "C" fn mtl_add_procs(
    _m: *mut sys::mca_mtl_base_module_t,
    nprocs: usize,
    procs: *mut *mut sys::ompi_proc_t,
) -> c_int {
    ffi_guard("mtl add_procs", sys::OMPI_ERROR, || {
        // SAFETY: the PML passes nprocs pointers to live procs (or none).
        let procs = unsafe { proc::procs(procs, nprocs) };
        if procs.is_empty() {
            return sys::OMPI_SUCCESS;
        }
        match add_procs_inner(procs) {
            Ok(()) => sys::OMPI_SUCCESS,
            Err(rc) => rc,
        }
    })
}

extern "C" fn mtl_del_procs(
    _m: *mut sys::mca_mtl_base_module_t,
    nprocs: usize,
    procs: *mut *mut sys::ompi_proc_t,
) -> c_int {
    ffi_guard("mtl del_procs", sys::OMPI_ERROR, || {
        // SAFETY: the PML passes nprocs pointers to live procs (or none); they live
        // until after del_procs returns.
        let procs = unsafe { proc::procs(procs, nprocs) };
        if procs.is_empty() {
            return sys::OMPI_SUCCESS;
        }
        if let Some(res) = lock(&RESOURCES).as_mut() {
            release_peers(res, Some(procs));
        }
        sys::OMPI_SUCCESS
    })
}

extern "C" fn mtl_add_comm(
    _m: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
) -> c_int {
    ffi_guard("mtl add_comm", sys::OMPI_ERROR, || {
        let max = MAX_CID.load(Ordering::Relaxed);
        // SAFETY: the PML passes a live communicator, for the duration of the call.
        let cid = unsafe { Comm::from_raw(comm) }.cid();
        // Open MPI hands out ids below mtl_max_contextid and fails the next
        // communicator creation itself (MPI_ERR_INTERN, without a word and without
        // calling us) once they are all taken: the last id is where we can say why.
        if cid.saturating_add(1) >= max && !CID_WARNED.swap(true, Ordering::Relaxed) {
            log::warn!(
                "communicator id {cid} is the last one the MTL's tag mode ({}) can carry \
                 ({max} ids): once all are in use, creating another communicator fails with \
                 MPI_ERR_INTERN until some are freed; mtl_ofi_tag_mode=ofi_tag_2 or \
                 ofi_tag_full carries more where the provider allows it",
                state::with_mtl(|m| m.map_or("?", |m| m.layout.mode.name()))
            );
        }
        if cid >= max {
            log::error!(
                "communicator id {cid} does not fit the MTL's tag mode (ids below {max}): \
                 the communicator cannot be used"
            );
            return sys::OMPI_ERR_OUT_OF_RESOURCE;
        }
        sys::OMPI_SUCCESS
    })
}

extern "C" fn mtl_del_comm(
    _m: *mut sys::mca_mtl_base_module_t,
    _comm: *mut sys::ompi_communicator_t,
) -> c_int {
    sys::OMPI_SUCCESS
}

extern "C" fn mtl_finalize(_m: *mut sys::mca_mtl_base_module_t) -> c_int {
    ffi_guard("mtl finalize", sys::OMPI_ERROR, || {
        finalize();
        sys::OMPI_SUCCESS
    })
}

/// Tear everything down (idempotent): progress, state, peers, then the objects.
pub fn finalize() {
    let p = state::MTL.swap(ptr::null_mut(), Ordering::AcqRel);
    let m = if p.is_null() {
        None
    } else {
        crate::ompi::progress::unregister(progress::progress_cb);
        // SAFETY: p came from Box::into_raw in open.rs (start), and the PML no longer
        // calls us.
        Some(unsafe { Box::from_raw(p) })
    };
    // Small sends of software matching completed when posted, from copies, and
    // control messages waiting for the send window: let them leave before the
    // endpoint closes (a peer may still be waiting for them).
    if let Some(m) = m.as_deref() {
        if let Some(sm) = m.soft.as_deref() {
            let start = std::time::Instant::now();
            while sm.sends_left() > 0 {
                if start.elapsed() > std::time::Duration::from_secs(10) {
                    log::warn!(
                        "finalize: {} small sends still in flight after 10 s; closing anyway",
                        sm.sends_left()
                    );
                    break;
                }
                progress::progress_mtl(m);
            }
        }
    }
    let fbox_sent = fbox_sent();
    // Close the endpoint first: only then can nothing write into the memory that
    // receives were posted with (bounce buffers, the overflow area).
    if let Some(mut res) = lock(&RESOURCES).take() {
        release_peers(&mut res, None);
        drop(res);
    }
    if let Some(mut m) = m {
        super::stall::discard_all(&m);
        // Unmapped here, before the objects close, which is fine because no receive
        // is posted any more once the PML finalizes.
        drop(m.overflow.take());
        if let Some(sm) = m.soft.as_mut() {
            sm.free_bounces();
        }
        let c = &m.counters;
        log::debug!(
            "finalize: {} completion errors, {} EAGAIN retries, {} messages taken off a full \
             receive queue, {} peeked there that another receive took first, {} messages \
             assembled from pieces, {} received messages rejected, {} messages sent and {} \
             received through fast boxes",
            c.cq_errors.load(Ordering::Relaxed),
            c.eagain.load(Ordering::Relaxed),
            c.stalls_broken.load(Ordering::Relaxed),
            c.exact_lost.load(Ordering::Relaxed),
            m.soft
                .as_ref()
                .map_or(0, |sm| sm.assembled.load(Ordering::Relaxed)),
            c.bad_envelopes.load(Ordering::Relaxed)
                + m.soft
                    .as_ref()
                    .map_or(0, |sm| sm.rejected.load(Ordering::Relaxed)),
            fbox_sent,
            m.soft
                .as_ref()
                .map_or(0, |sm| sm.fbox_received.load(Ordering::Relaxed))
        );
        if !c.per_ctx.is_empty() {
            let counts: Vec<u64> = c
                .per_ctx
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect();
            log::info!("completions per scalable-endpoint context: {counts:?}");
        }
    }
}
