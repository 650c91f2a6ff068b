//! Teardown: `finalize` (component close) and `finalize_cb` (Open MPI's module
//! finalize) unpublish a module and `destroy` it: counters logged, libfabric objects
//! closed children first, then the memory behind posted receives and fragments.
//!
//! What it owns: nothing while modules run. What it must not touch: a module that is
//! still published in `module::MODULES`.

use super::am;
use super::module::{fbox_sent_of, lock, Module, State, MODULES};
use super::{amo, put_by_read, rdma, resolve};
use crate::common::release;
use crate::ompi::component::ffi_guard;
use ompi_sys as sys;
use std::os::raw::c_int;
use std::ptr;
use std::sync::atomic::Ordering;

pub(super) extern "C" fn finalize_cb(btl: *mut sys::mca_btl_base_module_t) -> c_int {
    ffi_guard("btl finalize", sys::OPAL_ERROR, || {
        for slot in &MODULES {
            if slot
                .compare_exchange(
                    btl as *mut Module,
                    ptr::null_mut(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                // SAFETY: unpublished above; Open MPI no longer calls this module.
                unsafe { destroy(btl as *mut Module) };
            }
        }
        sys::OPAL_SUCCESS
    })
}

/// Free a module that was never published.
///
/// # Safety
/// `module` came from `Box::into_raw` and nobody else uses it.
pub(super) unsafe fn destroy(module: *mut Module) {
    // SAFETY: forwarded contract.
    let mut owned = unsafe { Box::from_raw(module) };
    amo::forget_module(module);
    put_by_read::forget_module(module);
    resolve::forget_module(module);
    let state = &mut owned.state;
    state.closing.store(true, Ordering::Release);
    if let Some(id) = state.rcache_sub.take() {
        release::unsubscribe(id);
    }
    let stats = lock(&state.rcache).stats();
    log::info!("registration cache: {stats}");
    let ops: Vec<u64> = state
        .ops
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .collect();
    log::info!(
        "finalize: {} puts, {} gets, {} atomics, {} fetching atomics, {} compare-and-swaps; {} completion errors, \
         {} received fragments dropped, {} assembled from pieces, {} gets and puts deferred on \
         -FI_EAGAIN, {} sends and {} RDMA operations outstanding",
        ops[0],
        ops[1],
        ops[2],
        ops[3],
        ops[4],
        state.cq_errors.load(Ordering::Relaxed),
        state.bad_fragments.load(Ordering::Relaxed),
        state.assembled.load(Ordering::Relaxed),
        state.rdma_deferrals.load(Ordering::Relaxed),
        state.send_outstanding.load(Ordering::Relaxed),
        state.rdma_outstanding.load(Ordering::Relaxed)
    );
    if state.fbox.is_some() {
        log::info!(
            "fast boxes: {} fragments sent, {} received",
            fbox_sent_of(state),
            state.fbox_received.load(Ordering::Relaxed)
        );
    }
    let held = resolve::HELD_OPS.load(Ordering::Relaxed);
    if held > 0 {
        log::info!(
            "{held} operations came with a remote handle not covering their target; the \
             target had a registration covering {} of them (see btl/resolve.rs)",
            resolve::FOUND_OPS.load(Ordering::Relaxed)
        );
    }
    if !state.per_ctx.is_empty() {
        let counts: Vec<u64> = state
            .per_ctx
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect();
        log::info!("completions per scalable-endpoint context: {counts:?}");
    }
    // The endpoint first (it cancels the posted receives), then the memory behind them.
    let recv_bufs = std::mem::take(&mut *lock(&state.recv_bufs));
    let frags = std::mem::take(&mut *lock(&state.frags));
    let pending = std::mem::take(&mut *lock(&state.pending));
    let fbox_queue = std::mem::take(&mut *lock(&state.fbox_queue));
    let peers = std::mem::take(&mut *lock(&state.peers));
    rdma::discard_deferred(state);
    lock(&state.rcache).clear();
    let State {
        ep,
        ctxs,
        av,
        domain,
        ..
    } = owned.state;
    // A scalable endpoint's contexts before the endpoint; CQs after what reports to
    // them (each endpoint keeps its CQ alive).
    drop(ctxs);
    drop(ep);
    drop(av);
    for b in recv_bufs {
        // SAFETY: the endpoint is closed: no receive uses the buffer any more.
        unsafe { am::frag::free_recv_buf(b) };
    }
    for f in frags.into_iter().chain(pending).chain(fbox_queue) {
        // SAFETY: free-listed or never-posted fragments are ours.
        unsafe { am::frag::free_frag_memory(f) };
    }
    for p in peers {
        // SAFETY: from Box::into_raw in add_procs.
        drop(unsafe { Box::from_raw(p) });
    }
    drop(domain);
}

/// Tear the module down (idempotent). No sleep: the endpoint close discards whatever
/// is still in flight.
pub fn finalize() {
    for slot in &MODULES {
        let module = slot.swap(ptr::null_mut(), Ordering::AcqRel);
        if !module.is_null() {
            // SAFETY: unpublished above; Open MPI no longer calls the module.
            unsafe { destroy(module) };
        }
    }
    // The module array itself is freed by Open MPI's btl base.
}
