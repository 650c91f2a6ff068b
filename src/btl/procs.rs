//! The peers of a module: `add_procs` resolves each peer's endpoint name from the
//! modex into an AV address (and opens its fast box), `del_procs` forgets them,
//! `register_error` keeps the error callback Open MPI hands over.
//!
//! What it owns: the [`PeerEp`]s handed to Open MPI as endpoints, from `add_procs`
//! until `del_procs` (or teardown). What it must not touch: the data paths, beyond
//! failing a departing peer's queued fast-box fragments (`am`).

use super::am;
use super::module::{lock, modex_decode, running_module, Module, PeerEp, Role};
use super::template::component;
use crate::common::fbox;
use crate::ompi::btl::Reachable;
use crate::ompi::component::ffi_guard;
use crate::ompi::modex;
use crate::ompi::proc::OpalProc;
use ompi_sys as sys;
use std::os::raw::c_int;
use std::sync::atomic::AtomicUsize;

pub(super) extern "C" fn add_procs(
    btl: *mut sys::mca_btl_base_module_t,
    nprocs: usize,
    procs: *mut *mut sys::opal_proc_t,
    endpoints: *mut *mut sys::mca_btl_base_endpoint_t,
    reachable: *mut sys::opal_bitmap_t,
) -> c_int {
    ffi_guard("btl add_procs", sys::OPAL_ERROR, || {
        if nprocs == 0 || procs.is_null() || endpoints.is_null() {
            return sys::OPAL_SUCCESS;
        }
        // SAFETY: btl is a live module of ours; Open MPI passes nprocs live procs
        // (OpalProc is a transparent proc pointer), nprocs endpoint slots, and a null
        // or nprocs-bit reachability bitmap.
        let (module, procs, eps, reachable) = unsafe {
            (
                crate::ompi::btl::module::<Module>(btl),
                std::slice::from_raw_parts(procs as *const OpalProc, nprocs),
                std::slice::from_raw_parts_mut(endpoints, nprocs),
                Reachable::new(reachable, nprocs),
            )
        };
        let state = &module.state;
        let mut peers = lock(&state.peers);
        let mut reached = 0usize;
        for (i, &peer) in procs.iter().enumerate() {
            if let Some(known) = peers.iter().find(|pe| pe.proc_ == peer) {
                eps[i] = known.as_endpoint();
            } else {
                let name = peer.name();
                if state.role == Role::OnHost && (!peer.on_node() || peer.is_self()) {
                    // Another host (or this process, which the self BTL serves): the
                    // module for every peer has it.
                    continue;
                }
                let blob = match modex::recv(component(), name) {
                    Ok(a) => a,
                    Err(_) => continue, // the peer does not run this BTL: unreachable
                };
                let Some(addr) = modex_decode(&blob, state.role.record()) else {
                    continue; // no endpoint of this kind (or a malformed record)
                };
                let fiaddr = match state.av.insert(addr) {
                    Ok(a) => a,
                    Err(e) => {
                        log::warn!(
                            "fi_av_insert of a peer's address on {}: {e}",
                            state.provider
                        );
                        continue;
                    }
                };
                let fbox = state.fbox.as_ref().and_then(|_| {
                    let rec = modex_decode(&blob, state.role.fbox_record())?;
                    fbox::Tx::open(rec, crate::ompi::proc::local_rank())
                        .inspect_err(|e| {
                            log::info!("no fast box to a peer on {}: {e}", state.provider)
                        })
                        .ok()
                });
                let pe = Box::new(PeerEp {
                    addr: fiaddr,
                    proc_: peer,
                    fbox,
                    fbox_waiting: AtomicUsize::new(0),
                });
                eps[i] = pe.as_endpoint();
                peers.push(pe);
                reached += 1;
            }
            reachable.mark(i);
        }
        if reached > 0 && state.role == Role::OnHost {
            log::info!(
                "add_procs: {reached} peer(s) on this host over {}",
                state.provider
            );
        } else if reached > 0 {
            log::debug!("add_procs: {reached} new peer(s) over {}", state.provider);
        }
        sys::OPAL_SUCCESS
    })
}

pub(super) extern "C" fn del_procs(
    btl: *mut sys::mca_btl_base_module_t,
    nprocs: usize,
    _procs: *mut *mut sys::opal_proc_t,
    endpoints: *mut *mut sys::mca_btl_base_endpoint_t,
) -> c_int {
    ffi_guard("btl del_procs", sys::OPAL_ERROR, || {
        if nprocs == 0 || endpoints.is_null() {
            return sys::OPAL_SUCCESS;
        }
        // SAFETY: btl is a live module of ours; endpoints holds nprocs entries.
        let (module, eps) = unsafe {
            (
                crate::ompi::btl::module::<Module>(btl),
                std::slice::from_raw_parts(endpoints, nprocs),
            )
        };
        let mut peers = lock(&module.state.peers);
        for &e in eps {
            if let Some(pos) = peers.iter().position(|p| p.as_endpoint() == e) {
                let p = peers.swap_remove(pos);
                // Its queued fragments fail before the peer goes.
                am::send::forget_fbox_peer(module, &*p);
                drop(p);
            }
        }
        sys::OPAL_SUCCESS
    })
}

/// Kept, never called: ob1's error handler (the one registered here) aborts the job
/// on any call (`mca_pml_ob1_error_handler`: `ompi_rte_abort`), and osc rdma registers
/// none. Errors reach the caller through each operation's callback and status instead.
pub(super) extern "C" fn register_error(
    btl: *mut sys::mca_btl_base_module_t,
    cb: sys::mca_btl_base_module_error_cb_fn_t,
) -> c_int {
    ffi_guard("btl register_error", sys::OPAL_ERROR, || {
        let Some(module) = running_module(btl) else {
            return sys::OPAL_ERR_BAD_PARAM;
        };
        *lock(&module.state.error_cb) = cb;
        sys::OPAL_SUCCESS
    })
}
