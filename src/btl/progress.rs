//! Progress: reading each module's completion queues and fast boxes, posting what
//! waits (queued sends, deferred RDMA, refused receive buffers, held operations),
//! routing each completion to its path by the kind its context names, and `flush`.
//!
//! What it owns: nothing; it only drives the queues the paths own. What it must not
//! touch: a module's setup or teardown.

use super::am;
use super::module::{Module, State, MODULES};
use super::op_context::OpKind;
use super::rdma;
use super::{put_by_read, resolve};
use crate::fabric::CompletionQueue;
use crate::ompi::component::ffi_guard;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::Ordering;

/// Completion errors logged as warnings per module; later ones are counted (and
/// logged at debug level).
const CQ_ERRORS_LOGGED: u64 = 8;

/// Read and dispatch completions of the module. Returns how many were handled.
pub(crate) fn progress_module(module: *mut Module) -> usize {
    // SAFETY: module is live (in MODULES or the argument of a module entry).
    let state = unsafe { &(*module).state };
    // Re-entered from a callback (or running on another thread): the outer call keeps
    // draining, in order.
    let Some(_serial) = state.in_progress.try_enter() else {
        return 0;
    };
    let mut total = 0usize;
    if let Some(rx) = &state.fbox {
        // SAFETY: one poller: we hold the serial section.
        let n = unsafe {
            rx.poll(state.num_cq_read, |tag, p, len| {
                am::recv::dispatch(module, tag, p, len)
            })
        };
        if n > 0 {
            state.fbox_received.fetch_add(n as u64, Ordering::Relaxed);
            total += n;
        }
        if state.fbox_queued.load(Ordering::Relaxed) {
            am::send::drain_fbox(module);
        }
    }
    if state.has_pending.load(Ordering::Relaxed) {
        am::send::drain_pending(module);
    }
    if state.has_rdma_deferred.load(Ordering::Relaxed) {
        rdma::post_deferred(module);
    }
    put_by_read::retry_reads(module);
    resolve::reissue(module);
    if state.unposted.any() {
        am::recv::post_unposted(state);
    }
    if state.ctxs.len() == 1 {
        total += progress_cq(module, state, &state.ctxs[0].cq, state.num_cq_read);
    } else {
        for (c, count) in state.ctxs.iter().zip(state.per_ctx.iter()) {
            let n = progress_cq(
                module,
                state,
                &c.cq,
                state.num_cq_read.saturating_sub(total).max(1),
            );
            if n > 0 {
                count.fetch_add(n as u64, Ordering::Relaxed);
            }
            total += n;
        }
    }
    if total > 0 && state.has_pending.load(Ordering::Relaxed) {
        am::send::drain_pending(module);
    }
    if total > 0 && state.has_rdma_deferred.load(Ordering::Relaxed) {
        rdma::post_deferred(module);
    }
    total
}

/// Read and dispatch up to `budget` completions of `cq`, one of the module's.
fn progress_cq(module: *mut Module, state: &State, cq: &CompletionQueue, budget: usize) -> usize {
    let mut total = 0usize;
    const CHUNK: usize = 64;
    // Not cleared: the provider writes the entries it returns (a cleared array cost a
    // 2.5 KiB memset on every poll).
    let mut entries = [std::mem::MaybeUninit::<fi::fi_cq_tagged_entry>::uninit(); CHUNK];
    loop {
        let want = CHUNK.min(budget - total.min(budget)).max(1);
        let r = state.fi_serial(|s| cq.read_uninit(s, &mut entries[..want]));
        match r {
            Ok(done) => {
                let n = done.len();
                for e in done {
                    // SAFETY: every operation we post carries the Ctx of a live op.
                    unsafe { dispatch(module, e.op_context, e.len, 0, e.buf, e.flags) };
                }
                total += n;
                if n < want || total >= budget {
                    break;
                }
            }
            Err(err) if err == crate::fabric::Error::AVAIL => {
                let entry = state.fi_serial(|s| cq.readerr(s));
                match entry {
                    Ok(Some(ce)) => {
                        let seen = state.cq_errors.fetch_add(1, Ordering::Relaxed);
                        if !state.closing.load(Ordering::Relaxed)
                            || ce.err != fi::FI_ECANCELED as i32
                        {
                            // The operation's own callback carries the error to ob1 or
                            // osc; this says what it was. A failing peer can produce
                            // thousands: the first few are enough.
                            let level = if seen < CQ_ERRORS_LOGGED {
                                log::Level::Warn
                            } else {
                                log::Level::Debug
                            };
                            // SAFETY: the entry's context is null or one we posted.
                            let what = unsafe { OpKind::of(ce.op_context) }
                                .map_or("an operation without a context", OpKind::what);
                            log::log!(
                                level,
                                "completion error on {} ({what}): {}{}",
                                state.provider,
                                cq.strerror(&ce),
                                if seen + 1 == CQ_ERRORS_LOGGED {
                                    " (further ones are only counted)"
                                } else {
                                    ""
                                }
                            );
                        }
                        // SAFETY: as above.
                        unsafe {
                            dispatch(module, ce.op_context, ce.len, ce.err, ce.buf, ce.flags)
                        };
                        total += 1;
                    }
                    _ => break,
                }
            }
            Err(err) => {
                if err != crate::fabric::Error::AGAIN {
                    log::debug!("fi_cq_read on {}: {err}", state.provider);
                }
                break;
            }
        }
    }
    total
}

/// Route one completion (`err` 0 on success, else the positive FI_E* code; `buf` and
/// `flags` as the completion gives them).
///
/// # Safety
/// `ctx` is the context of an operation posted by this module.
unsafe fn dispatch(
    module: *mut Module,
    ctx: *mut c_void,
    len: usize,
    err: i32,
    buf: *mut c_void,
    flags: u64,
) {
    // SAFETY: caller's contract: ctx is null or one we posted.
    let Some(kind) = (unsafe { OpKind::of(ctx) }) else {
        return;
    };
    // SAFETY: forwarded: the kind names the containing operation.
    unsafe {
        match kind {
            OpKind::Send => am::send::send_complete(module, ctx, err),
            OpKind::Recv => am::recv::recv_complete(module, ctx, len, err, buf, flags),
            OpKind::Rdma => rdma::rdma_complete(module, ctx, err),
        }
    }
}

/// Component progress: every module.
pub fn progress() -> i32 {
    let mut n = 0;
    for slot in &MODULES {
        let module = slot.load(Ordering::Acquire);
        if module.is_null() {
            continue;
        }
        n += progress_module(module);
        // SAFETY: module is live; sweep closes invalidated registrations from a normal
        // context.
        let state = unsafe { &(*module).state };
        if state.rcache_slots.is_dirty() {
            if let Ok(mut c) = state.rcache.try_lock() {
                c.sweep();
            }
        }
    }
    n as i32
}

/// Wait until every RDMA and atomic operation posted so far has completed.
pub(super) extern "C" fn flush(
    btl: *mut sys::mca_btl_base_module_t,
    _ep: *mut sys::mca_btl_base_endpoint_t,
) -> c_int {
    ffi_guard("btl flush", sys::OPAL_ERROR, || {
        let module = btl as *mut Module;
        // SAFETY: btl is our module.
        let state = unsafe { &(*module).state };
        while state.rdma_outstanding.load(Ordering::Acquire) > 0 {
            if progress_module(module) == 0 {
                // Another thread (or an outer frame) may be progressing: let Open MPI run.
                crate::ompi::progress::progress();
            }
        }
        sys::OPAL_SUCCESS
    })
}
