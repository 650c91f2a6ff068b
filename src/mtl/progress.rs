//! The progress loop: fast boxes, then the completion queues, then whatever waits
//! for the provider (software matching's reads and controls, deferred sends and
//! receives, the stall breaker); and the waits and retries built on it.
//!
//! What it owns: the order of one round of progress, and yielding the core when a
//! round found nothing. What it must not touch: what a completion does
//! (`completion`).

use super::completion::{on_completion, on_error};
use super::recv::post_deferred;
use super::send::post_deferred_sends;
use super::state::{mtl, Mtl};
use crate::ompi::component::ffi_guard;
use crate::ompi::error::OpalCode;
use crate::ompi::{self};
use libfabric_sys as fi;
use std::os::raw::{c_int, c_void};
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
    let boxed = match m.soft.as_deref() {
        // SAFETY: under the serial section taken above.
        Some(sm) => unsafe { sm.poll_fbox(m, m.events_per_progress) },
        None => 0,
    };
    if m.ctxs.len() == 1 {
        return boxed + progress_one_cq(m, m.ctxs[0].cq, m.events_per_progress);
    }
    let mut total = boxed;
    for (c, count) in m.ctxs.iter().zip(m.counters.per_ctx.iter()) {
        let n = progress_one_cq(m, c.cq, m.events_per_progress.saturating_sub(total).max(1));
        if n > 0 {
            count.fetch_add(n as u64, Ordering::Relaxed);
        }
        total += n;
    }
    total
}

/// Read and dispatch up to `budget` completions of `cq`.
fn progress_one_cq(m: &Mtl, cq: *mut fi::fid_cq, budget: usize) -> usize {
    const CHUNK: usize = 32;
    let mut total = 0usize;
    loop {
        let mut entries = [std::mem::MaybeUninit::<fi::fi_cq_tagged_entry>::uninit(); CHUNK];
        let want = CHUNK.min(budget.saturating_sub(total)).max(1);
        let (n, err) = {
            let _g = m.lock.lock();
            // SAFETY: the CQ is open; entries has room for `want` tagged entries.
            let ret = unsafe { fi::fi_cq_read(cq, entries.as_mut_ptr() as *mut c_void, want) };
            if ret == -(fi::FI_EAVAIL as isize) {
                // SAFETY: zeroed is a valid fi_cq_err_entry; err_data stays null so the
                // provider gives its own buffer.
                let mut e: fi::fi_cq_err_entry = unsafe { std::mem::zeroed() };
                // SAFETY: CQ open, e valid.
                let r = unsafe { fi::fi_cq_readerr(cq, &mut e, 0) };
                (0, if r >= 0 { Some(e) } else { None })
            } else if ret < 0 {
                if ret != -(fi::FI_EAGAIN as isize) {
                    log::error!("fi_cq_read: {}", crate::fabric::Error::from_ret(ret));
                }
                (0, None)
            } else {
                (ret as usize, None)
            }
        };
        // SAFETY: fi_cq_read wrote the first n entries.
        let read = unsafe {
            std::slice::from_raw_parts(entries.as_ptr() as *const fi::fi_cq_tagged_entry, n)
        };
        for e in read {
            // SAFETY: every operation we post carries the ctx of a live Request.
            unsafe { on_completion(m, e) };
        }
        total += n;
        if let Some(e) = err {
            total += 1;
            // SAFETY: as above.
            unsafe { on_error(m, &e) };
            continue;
        }
        if n < want || total >= budget {
            return total;
        }
    }
}

/// The progress callback registered with Open MPI.
pub extern "C" fn progress_cb() -> c_int {
    ffi_guard("mtl progress", 0, || match mtl() {
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

/// Retry `op` while it returns -FI_EAGAIN, progressing between attempts (flow control).
#[inline]
pub(super) fn retry(m: &Mtl, mut op: impl FnMut() -> isize) -> isize {
    loop {
        let ret = {
            let _g = m.lock.lock();
            op()
        };
        if ret != -(fi::FI_EAGAIN as isize) {
            return ret;
        }
        m.counters.eagain.fetch_add(1, Ordering::Relaxed);
        if progress_mtl(m) == 0 {
            idle();
        }
    }
}

pub(super) fn fi_to_ompi(ret: isize) -> c_int {
    crate::fabric::Error::from_ret(ret).to_opal()
}
