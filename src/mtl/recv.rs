//! Receives under provider matching (and the entry of software matching's): the
//! fast path, the queue of receives waiting for room in the provider's receive queue,
//! and cancel.
//!
//! What it owns: the order of receives within each class across the provider's
//! queue. What it must not touch: the stall breaker's stash (`stall.rs`), which it
//! only asks.

use super::peer::peer_addr;
use super::progress::{progress_mtl, to_ompi};
use super::request::{Kind, Req};
use super::state::{locked, mtl, rx_enter, rx_leave, Deferred, Entry, Mtl};
use crate::fabric::{self, Serialized, FI_ADDR_UNSPEC};
use crate::ompi::comm::Comm;
use crate::ompi::convertor::{Convertor, RecvBuffer};
use ompi_sys as sys;
use std::os::raw::c_int;
use std::sync::atomic::Ordering;

/// A receive into the PML's request `r` (initialised by the entry).
pub(super) fn irecv_impl(
    e: &Entry,
    comm: Comm,
    src: c_int,
    tag: c_int,
    conv: Convertor,
    r: Req,
) -> c_int {
    let Some(m) = mtl(e) else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let mut addr = FI_ADDR_UNSPEC;
    if src != sys::MPI_ANY_SOURCE && m.directed {
        addr = match peer_addr(comm, src) {
            Ok(a) => a,
            Err(e) => return e,
        };
    }
    match RecvBuffer::of(conv) {
        Ok(b) => r.set_recv_buffer(b),
        Err(e) => return e,
    }
    r.set_convertor(Some(conv));
    let (bits, ignore) = m.layout.recv_bits(comm.cid(), src, tag);
    if let Some(sm) = m.soft.as_deref() {
        return super::softmatch::irecv(m, sm, r, bits, ignore);
    }
    r.set_post_addr(addr);
    r.set_matched_tag(bits);
    r.set_matched_data(ignore);
    let internal = tag < 0 && tag != sys::MPI_ANY_TAG;
    r.set_rx_internal(internal);
    // Receives are posted in MPI order within their class (see `Deferred`): once one
    // had to wait for room in the provider's queue, every later one of its class waits
    // behind it. The queue's mutex is taken only then; a thread that queued a receive
    // set the flag before returning, so its own later receives see it. The same holds
    // while messages wait in the stash (stall.rs).
    let threads = m.rx.threads();
    if threads {
        m.fast_posts.fetch_add(1, Ordering::SeqCst);
    }
    if !m.has_deferred.load(Ordering::SeqCst)
        && !m.has_stash.load(Ordering::SeqCst)
        && !m.claim_busy.load(Ordering::SeqCst)
        && m.rx.room(internal)
    {
        let ret = {
            let g = m.lock.lock();
            rx_enter(m, r);
            post_recv(m, &g.serialized(), r)
        };
        if threads {
            if ret.is_ok() {
                m.posted_gen.fetch_add(1, Ordering::SeqCst);
            }
            m.fast_posts.fetch_sub(1, Ordering::SeqCst);
        }
        match ret {
            Ok(()) => return sys::OMPI_SUCCESS,
            Err(e) if e.is_again() => {
                rx_leave(m, r);
                m.counters.eagain.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                rx_leave(m, r);
                // Not posted: a buffer of ours goes.
                r.free_buffer();
                return to_ompi(Err(e));
            }
        }
    } else if threads {
        m.fast_posts.fetch_sub(1, Ordering::SeqCst);
    }
    let mut deferred = match locked(&m.deferred) {
        Ok(d) => d,
        Err(rc) => return rc,
    };
    // A message taken off a full provider queue may be waiting for it (stall.rs).
    if !internal && !deferred.stash.is_empty() {
        if let Some(s) = super::stall::take_for_recv(m, &mut deferred, r) {
            drop(deferred);
            // r is in no queue.
            super::stall::deliver(m, r, s);
            return sys::OMPI_SUCCESS;
        }
    }
    deferred.queue(internal).push_back(r);
    m.has_deferred.store(true, Ordering::SeqCst);
    // The other class may have room (a collective's receive behind the user's).
    drain_deferred(m, &mut deferred);
    sys::OMPI_SUCCESS
}

/// Post receive `r` (its buffer, `post_addr` and match bits `matched_tag` /
/// `matched_data` set) to the provider, with the overflow area where needed, under
/// the lock (`s`).
#[inline]
fn post_recv(m: &Mtl, s: &Serialized<'_>, r: Req) -> fabric::Result<()> {
    let cid = r.comm().map_or(0, Comm::cid);
    let (rx, addr) = (m.ctx(cid).rx(), m.rx_addr(r.post_addr(), cid));
    rx.trecv(
        s,
        r.recv_buf(),
        m.overflow(),
        addr,
        r.matched_tag(),
        r.matched_data(),
        r.op_context(),
    )
}

/// Post the receives that waited for room, in order, until the provider is full again.
pub(super) fn post_deferred(m: &Mtl) {
    // Not from a progress call nested in a holder of the lock (the stall breaker's, or
    // a completion's acknowledgement under it): the holder drains. A poisoned queue is
    // left alone (`state::locked`).
    if let Ok(mut deferred) = m.deferred.try_lock() {
        drain_deferred(m, &mut deferred);
    }
}

/// Post from the head of each class's queue while that class has room. No waiting
/// receive matches a stashed message (each looked in the stash when it was queued, and
/// a message is stashed only when no waiting receive matches it), so none is looked
/// up here.
fn drain_deferred(m: &Mtl, deferred: &mut Deferred) {
    'classes: for internal in [true, false] {
        while m.rx.room(internal) {
            // Deferred receives are live PML requests (a cancelled one is removed
            // from the queue before it completes).
            let Some(&r) = deferred.queue(internal).front() else {
                break;
            };
            let ret = {
                let g = m.lock.lock();
                rx_enter(m, r);
                post_recv(m, &g.serialized(), r)
            };
            match ret {
                Err(e) if e.is_again() => {
                    rx_leave(m, r);
                    // The provider itself is full: neither class gets in now.
                    break 'classes;
                }
                Ok(()) => {
                    deferred.queue(internal).pop_front();
                    m.posted_gen.fetch_add(1, Ordering::SeqCst);
                }
                Err(e) => {
                    deferred.queue(internal).pop_front();
                    log::error!("posting a receive failed: {e}");
                    // Not posted: complete it with the error.
                    rx_leave(m, r);
                    r.update_status(|s| s.error = sys::MPI_ERR_INTERN as c_int);
                    r.free_buffer();
                    r.complete_to_pml();
                }
            }
        }
    }
    if deferred.is_empty() {
        m.has_deferred.store(false, Ordering::SeqCst);
    }
}

/// `MPI_Cancel` of the PML's request `r`, one of ours it has not seen complete.
pub(super) fn cancel_impl(e: &Entry, r: Req) -> c_int {
    let Some(m) = mtl(e) else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    if r.kind() != Kind::Recv {
        // A send cannot be taken back once handed to the fabric: report "not cancelled".
        r.mark_not_cancelled();
        return sys::OMPI_SUCCESS;
    }
    // Drain completions first: the receive may already have matched.
    progress_mtl(m);
    if let Some(sm) = m.soft.as_deref() {
        if super::softmatch::cancel(sm, r) {
            // No longer posted anywhere.
            r.update_status(|s| {
                s.cancelled = true;
                s.error = sys::MPI_SUCCESS as c_int;
            });
            r.free_buffer();
            r.complete_to_pml();
        }
        return sys::OMPI_SUCCESS;
    }
    let waiting = match locked(&m.deferred) {
        Ok(mut deferred) => deferred.remove(r),
        Err(rc) => return rc,
    };
    if waiting {
        // Never reached the provider: cancelled here.
        r.update_status(|s| s.cancelled = true);
        r.free_buffer();
        r.complete_to_pml();
        return sys::OMPI_SUCCESS;
    }
    let rx = m.ctx(r.comm().map_or(0, Comm::cid)).rx();
    // A receive that already completed is not found; one that is cancelled completes
    // with FI_ECANCELED.
    let ret = {
        let g = m.lock.lock();
        rx.cancel(&g.serialized(), r.op_context())
    };
    if ret.is_err() {
        r.mark_not_cancelled();
    }
    sys::OMPI_SUCCESS
}
