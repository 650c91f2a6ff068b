//! Progress: reading each module's completion queues and fast boxes, posting what
//! waits (queued sends, deferred RDMA, refused receive buffers, held operations),
//! routing each completion to its path by the kind its context names, and `flush`.
//!
//! What it owns: nothing; it only drives the queues the paths own. What it must not
//! touch: a module's setup or teardown.

use super::am;
use super::am::frag::{Frag, RecvBuf};
use super::module::{running, running_module, Module};
use super::op_context::{Ctx, OpKind};
use super::rdma::{self, RdmaOp};
use super::{put_by_read, resolve};
use crate::fabric::CompletionQueue;
use crate::ompi::component::ffi_guard;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::mem::offset_of;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::Ordering;

/// Completion errors logged as warnings per module; later ones are counted (and
/// logged at debug level).
const CQ_ERRORS_LOGGED: u64 = 8;

/// Read and dispatch completions of the module. Returns how many were handled.
pub(crate) fn progress_module(module: &'static Module) -> usize {
    let state = &module.state;
    // Re-entered from a callback (or running on another thread): the outer call keeps
    // draining, in order.
    let Some(_serial) = state.in_progress.try_enter() else {
        return 0;
    };
    let mut total = 0usize;
    if let Some(rx) = &state.fbox {
        // SAFETY: one poller: this thread holds the module's serial section.
        let n = unsafe {
            rx.poll_slices(state.num_cq_read, |tag, payload| {
                am::recv::dispatch(module, tag, payload)
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
        total += progress_cq(module, &state.ctxs[0].cq, state.num_cq_read);
    } else {
        for (c, count) in state.ctxs.iter().zip(state.per_ctx.iter()) {
            let n = progress_cq(
                module,
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

/// The operation a completion's context belongs to, given back by the provider.
enum Done {
    Send(Box<Frag>),
    Recv(&'static RecvBuf),
    Rdma(Box<RdmaOp>),
}

impl Done {
    fn kind(&self) -> OpKind {
        match self {
            Done::Send(_) => OpKind::Send,
            Done::Recv(_) => OpKind::Recv,
            Done::Rdma(_) => OpKind::Rdma,
        }
    }
}

/// Route one completion (`err` 0 on success, else the positive FI_E* code; `buf` and
/// `flags` as the completion gives them).
fn dispatch(
    module: &'static Module,
    done: Done,
    len: usize,
    err: i32,
    buf: *mut c_void,
    flags: u64,
) {
    match done {
        Done::Send(f) => am::send::send_complete(module, f, err),
        Done::Recv(rb) => am::recv::recv_complete(module, rb, len, err, buf, flags),
        Done::Rdma(op) => rdma::rdma_complete(module, op, err),
    }
}

/// Read and dispatch up to `budget` completions of `cq`, one of the module's.
fn progress_cq(module: &'static Module, cq: &CompletionQueue, budget: usize) -> usize {
    let state = &module.state;
    let mut total = 0usize;
    const CHUNK: usize = 64;
    // Not cleared: the provider writes the entries it returns (a cleared array cost a
    // 2.5 KiB memset on every poll).
    let mut entries = [std::mem::MaybeUninit::<fi::fi_cq_tagged_entry>::uninit(); CHUNK];
    // The operation of a completion's context (`None`: no context).
    let done = |ctx: *mut c_void| {
        let c = ctx as *const Ctx;
        // SAFETY: ctx comes from a completion of this module's CQ, each reported once:
        // every operation the BTL posts carries the Ctx of a fragment (leaked for the
        // send, `am::send::post`), a receive buffer (leaked for the module's life,
        // `am::recv::post_receives`) or an RDMA operation (leaked for the operation,
        // `rdma::run`), whose kind says which. All three are `#[repr(C)]`: a
        // fragment's Ctx lies offset_of!(Frag, ctx) bytes into it, the others' first.
        // The provider is done with the operation, so its owner comes back.
        unsafe {
            Some(match c.as_ref()?.kind {
                OpKind::Send => Done::Send(Box::from_raw(
                    ctx.byte_sub(offset_of!(Frag, ctx)) as *mut Frag
                )),
                OpKind::Recv => Done::Recv(&*(ctx as *const RecvBuf)),
                OpKind::Rdma => Done::Rdma(Box::from_raw(ctx as *mut RdmaOp)),
            })
        }
    };
    loop {
        let want = CHUNK.min(budget - total.min(budget)).max(1);
        let r = state.fi(|s| cq.read_uninit(s, &mut entries[..want]));
        match r {
            Ok(completed) => {
                let n = completed.len();
                for e in completed {
                    if let Some(d) = done(e.op_context) {
                        dispatch(module, d, e.len, 0, e.buf, e.flags);
                    }
                }
                total += n;
                if n < want || total >= budget {
                    break;
                }
            }
            Err(err) if err == crate::fabric::Error::AVAIL => {
                let entry = state.fi(|s| cq.readerr(s));
                match entry {
                    Ok(Some(ce)) => {
                        let seen = state.cq_errors.fetch_add(1, Ordering::Relaxed);
                        let d = done(ce.op_context);
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
                            let what = d
                                .as_ref()
                                .map_or("an operation without a context", |d| d.kind().what());
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
                        if let Some(d) = d {
                            dispatch(module, d, ce.len, ce.err, ce.buf, ce.flags);
                        }
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

/// Component progress: every module.
pub fn progress() -> i32 {
    let mut n = 0;
    for module in running() {
        n += progress_module(module);
        // Sweep closes invalidated registrations from a normal context.
        let state = &module.state;
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
        let Some(module) = running_module(btl) else {
            return sys::OPAL_ERR_BAD_PARAM;
        };
        while module.state.rdma_outstanding.load(Ordering::Acquire) > 0 {
            if progress_module(module) == 0 {
                // Another thread (or an outer frame) may be progressing: let Open MPI run.
                crate::ompi::progress::progress();
            }
        }
        sys::OPAL_SUCCESS
    })
}
