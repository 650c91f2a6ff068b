//! Teardown: `finalize` (component close) and `finalize_cb` (Open MPI's module
//! finalize) unpublish a module and `destroy` it: counters logged, libfabric objects
//! closed children first, then the memory behind posted receives and fragments.
//!
//! What it owns: nothing while modules run. What it must not touch: a module that is
//! still published in `module::MODULES`.

use super::module::{fbox_sent_of, lock, Module, State, MODULES};
use super::{amo, put_by_read, rdma, resolve};
use crate::ompi::component::ffi_guard;
use ompi_sys as sys;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;

pub(super) extern "C" fn finalize_cb(btl: *mut sys::mca_btl_base_module_t) -> c_int {
    ffi_guard("btl finalize", sys::OPAL_ERROR, || {
        MODULES
            .unpublish(Some(btl as *mut Module))
            .for_each(destroy);
        sys::OPAL_SUCCESS
    })
}

/// Free a module: unpublished, or never published.
pub(super) fn destroy(mut owned: Box<Module>) {
    amo::forget_module(&owned);
    put_by_read::forget_module(&owned);
    resolve::forget_module(&owned);
    let state = &mut owned.state;
    state.closing.store(true, Ordering::Release);
    // Unsubscribes (before the cache's slots may go).
    drop(state.rcache_sub.take());
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
        // SAFETY: leaked by post_receives for the module's life, which ends here: the
        // endpoint is closed, so no receive uses the buffer any more, and the refused
        // ones kept in `unposted` are only references to it.
        drop(unsafe { Box::from_raw(b) });
    }
    // Free-listed and never-posted fragments are ours (their regions close before
    // their buffers are freed).
    drop((frags, pending, fbox_queue));
    drop(peers);
    drop(domain);
}

/// Tear the module down (idempotent). No sleep: the endpoint close discards whatever
/// is still in flight.
pub fn finalize() {
    MODULES.unpublish(None).for_each(destroy);
    // The module array itself is freed by Open MPI's btl base.
}
