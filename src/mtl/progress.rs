//! The progress loop: fast boxes, then the completion queues, then whatever waits
//! for the provider (software matching's reads and controls, deferred sends and
//! receives, the stall breaker); and the waits and retries built on it.
//!
//! What it owns: the order of one round of progress, and yielding the core when a
//! round found nothing. What it must not touch: what a completion does
//! (`completion`).

use super::completion::{on_completion, on_error};
use super::recv::post_deferred;
use super::request::{Req, Request};
use super::send::post_deferred_sends;
use super::state::{mtl, Entry, Mtl, FAILED};
use crate::fabric::{self, CqRef, Error, Serialized};
use crate::ompi::component::ffi_guard_module;
use crate::ompi::error::OpalCode;
use crate::ompi::{self};
use libfabric_sys as fi;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;

/// Read and dispatch completions. Returns how many were handled.
pub fn progress_mtl(m: &Mtl) -> usize {
    let gen = m.posted_gen.load(Ordering::SeqCst);
    let n = progress_cq(m);
    if let Some(sm) = m.soft.as_deref() {
        if sm.has_reads_waiting.load(Ordering::Acquire) {
            super::softmatch::post_waiting_reads(m, sm);
        }
        if sm.unposted.any() {
            super::softmatch::post_unposted(m, sm);
        }
        if sm.has_controls_waiting.load(Ordering::Acquire) {
            super::softmatch::post_waiting_controls(m, sm);
        }
    }
    if m.has_deferred_sends.load(Ordering::Acquire) {
        post_deferred_sends(m);
    }
    if m.has_deferred.load(Ordering::Acquire) {
        post_deferred(m);
        if n == 0 && m.soft.is_none() {
            super::stall::break_stall(m, gen);
        }
    }
    n
}

pub(super) fn progress_cq(m: &Mtl) -> usize {
    // Software matching must see messages in the order the CQ delivers them: one
    // thread reads and dispatches at a time (a re-entrant call from a dispatch, or
    // another thread, returns at once).
    let _serial = match m.soft.as_deref() {
        Some(sm) => match sm.progress.try_enter() {
            Some(g) => Some(g),
            None => return 0,
        },
        None => None,
    };
    // Fast boxes first: a peer's records before its completions (they carry no order
    // between them, see softmatch).
    let boxed = match (m.soft.as_deref(), _serial.as_ref()) {
        (Some(sm), Some(serial)) => sm.poll_fbox(m, m.events_per_progress, serial),
        _ => 0,
    };
    if m.ctxs.len() == 1 {
        return boxed + progress_one_cq(m, m.ctxs[0].cq(), m.events_per_progress);
    }
    let mut total = boxed;
    for (c, count) in m.ctxs.iter().zip(m.counters.per_ctx.iter()) {
        let n = progress_one_cq(
            m,
            c.cq(),
            m.events_per_progress.saturating_sub(total).max(1),
        );
        if n > 0 {
            count.fetch_add(n as u64, Ordering::Relaxed);
        }
        total += n;
    }
    total
}

/// Read and dispatch up to `budget` completions of `cq`.
fn progress_one_cq(m: &Mtl, cq: CqRef<'_>, budget: usize) -> usize {
    const CHUNK: usize = 32;
    let mut total = 0usize;
    loop {
        let mut entries = [std::mem::MaybeUninit::<fi::fi_cq_tagged_entry>::uninit(); CHUNK];
        let want = CHUNK.min(budget.saturating_sub(total)).max(1);
        // Completions are copied out under the lock and dispatched after it.
        let (done, err): (&[fi::fi_cq_tagged_entry], _) = {
            let g = m.lock.lock();
            let s = g.serialized();
            match cq.read(&s, &mut entries[..want]) {
                Ok(done) => (done, None),
                Err(e) if e == Error::AVAIL => (&[], cq.readerr(&s).ok().flatten()),
                Err(e) => {
                    log::error!("fi_cq_read: {e}");
                    (&[], None)
                }
            }
        };
        let n = done.len();
        for e in done {
            on_completion(m, e);
        }
        total += n;
        if let Some(e) = err {
            total += 1;
            on_error(m, &e);
            continue;
        }
        if n < want || total >= budget {
            return total;
        }
    }
}

/// The progress callback registered with Open MPI.
pub extern "C" fn progress_cb() -> c_int {
    // SAFETY: Open MPI calls the callback only while it is registered: from init until
    // finalize unregisters it, before the state is freed.
    let e = unsafe { Entry::enter() };
    ffi_guard_module("mtl progress", &FAILED, 0, || match mtl(&e) {
        Some(m) => progress_mtl(m) as c_int,
        None => 0,
    })
}

/// Spin on progress until `done` holds.
#[inline]
pub(super) fn wait_until(m: &Mtl, done: impl Fn() -> bool) {
    while !done() {
        if progress_mtl(m) == 0 {
            idle();
        }
    }
}

/// Run `f` with a handle to `req`, an internal request of the caller's (on its stack or
/// in a Box it keeps), then wait until no completion of it is pending, so that no
/// handle `f` used outlives `req`. `f` leaves `pending` at 0 when it posted nothing.
#[inline]
pub(super) fn with_request<R>(m: &Mtl, req: &mut Request, f: impl FnOnce(Req) -> R) -> R {
    // SAFETY: `req` is borrowed for this whole call, reached only through the handle
    // meanwhile, and the call returns only once no completion of it is pending.
    let r = unsafe { Req::of(req) };
    let out = f(r);
    wait_until(m, || r.pending().load(Ordering::Acquire) <= 0);
    out
}

/// Nothing progressed: give the core away when Open MPI says to
/// (`mpi_yield_when_idle`, on by itself when a node is oversubscribed), as
/// `opal_progress` does, else spin. A rank blocked in a send spinning on a shared core
/// would hold off the very peer it waits for.
#[inline]
pub(super) fn idle() {
    if ompi::progress::yield_when_idle() {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Retry `op` while it fails with `Error::AGAIN`, progressing between attempts (flow
/// control). `op` runs under the lock, whose proof it gets.
#[inline]
pub(super) fn retry(
    m: &Mtl,
    mut op: impl FnMut(&Serialized<'_>) -> fabric::Result<()>,
) -> fabric::Result<()> {
    loop {
        let ret = {
            let g = m.lock.lock();
            op(&g.serialized())
        };
        match ret {
            Err(e) if e.is_again() => {}
            other => return other,
        }
        m.counters.eagain.fetch_add(1, Ordering::Relaxed);
        if progress_mtl(m) == 0 {
            idle();
        }
    }
}

/// An error of the data path as the code the PML gets.
#[inline]
pub(super) fn to_ompi(r: fabric::Result<()>) -> c_int {
    match r {
        Ok(()) => ompi_sys::OMPI_SUCCESS,
        Err(e) => e.to_opal(),
    }
}
