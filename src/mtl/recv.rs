//! Receives under provider matching (and the entry of software matching's): the
//! fast path, the queue of receives waiting for room in the provider's receive queue,
//! and cancel.
//!
//! What it owns: the order of receives within each class across the provider's
//! queue. What it must not touch: the stall breaker's stash (`stall.rs`), which it
//! only asks.

use super::peer::peer_addr;
use super::progress::{fi_to_ompi, progress_mtl};
use super::request::{Kind, Request};
use super::state::{mtl, rx_enter, rx_leave, Deferred, Mtl};
use crate::fabric::FI_ADDR_UNSPEC;
use crate::ompi;
use crate::ompi::comm::Comm;
use crate::ompi::convertor::{Convertor, RecvBuffer};
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;

pub(super) unsafe fn irecv_impl(
    comm: Comm,
    src: c_int,
    tag: c_int,
    conv: Convertor,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let r = req as *mut Request;
    // SAFETY: the PML allocated mtl_request_size bytes behind req.
    unsafe { Request::init(r, Kind::Recv, Some(comm)) };
    let mut addr = FI_ADDR_UNSPEC;
    if src != sys::MPI_ANY_SOURCE && m.directed {
        addr = match peer_addr(comm, src) {
            Ok(a) => a,
            Err(e) => return e,
        };
    }
    let RecvBuffer {
        ptr: buf,
        len,
        owned,
    } = match RecvBuffer::of(conv) {
        Ok(v) => v,
        Err(e) => return e,
    };
    // SAFETY: r is live.
    unsafe {
        (*r).convertor = Some(conv);
        (*r).buffer = buf;
        (*r).length = len;
        (*r).owns_buffer = owned;
    }
    let (bits, ignore) = m.layout.recv_bits(comm.cid(), src, tag);
    if let Some(sm) = m.soft.as_deref() {
        return super::softmatch::irecv(m, sm, r, bits, ignore);
    }
    // SAFETY: r is live.
    unsafe {
        (*r).post_addr = addr;
        (*r).matched_tag = bits;
        (*r).matched_data = ignore;
    }
    let internal = tag < 0 && tag != sys::MPI_ANY_TAG;
    // SAFETY: r is live.
    unsafe { (*r).rx_internal = internal };
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
            let _g = m.lock.lock();
            // SAFETY: r is live, with its buffer, address and match bits set.
            unsafe {
                rx_enter(m, r);
                post_recv(m, r)
            }
        };
        if threads {
            if ret >= 0 {
                m.posted_gen.fetch_add(1, Ordering::SeqCst);
            }
            m.fast_posts.fetch_sub(1, Ordering::SeqCst);
        }
        if ret >= 0 {
            return sys::OMPI_SUCCESS;
        }
        // SAFETY: not posted.
        unsafe { rx_leave(m, r) };
        if ret != -(fi::FI_EAGAIN as isize) {
            if owned {
                // SAFETY: not posted, still ours.
                unsafe { libc::free(buf as *mut c_void) };
            }
            return fi_to_ompi(ret);
        }
        m.counters.eagain.fetch_add(1, Ordering::Relaxed);
    } else if threads {
        m.fast_posts.fetch_sub(1, Ordering::SeqCst);
    }
    {
        let mut deferred = m.deferred.lock().unwrap_or_else(|e| e.into_inner());
        // A message taken off a full provider queue may be waiting for it (stall.rs).
        if !internal && !deferred.stash.is_empty() {
            // SAFETY: r is live with its match bits and address set.
            if let Some(s) = unsafe { super::stall::take_for_recv(m, &mut deferred, r) } {
                drop(deferred);
                // SAFETY: r is in no queue.
                unsafe { super::stall::deliver(m, r, s) };
                return sys::OMPI_SUCCESS;
            }
        }
        deferred.queue(internal).push_back(r as usize);
        m.has_deferred.store(true, Ordering::SeqCst);
        // The other class may have room (a collective's receive behind the user's).
        drain_deferred(m, &mut deferred);
    }
    sys::OMPI_SUCCESS
}

/// Post receive `r` to the provider (with the overflow area where needed).
///
/// # Safety
/// `r` must be a live receive whose buffer, `post_addr` and match bits
/// (`matched_tag`/`matched_data`) are set; the caller holds `m.lock`.
unsafe fn post_recv(m: &Mtl, r: *mut Request) -> isize {
    // SAFETY: forwarded.
    let (buf, len, addr, bits, ignore, ctx, cid) = unsafe {
        (
            (*r).buffer,
            (*r).length,
            (*r).post_addr,
            (*r).matched_tag,
            (*r).matched_data,
            (*r).ctx_ptr(),
            (*r).comm.map_or(0, Comm::cid),
        )
    };
    let (rx, addr) = (m.ctx(cid).rx, m.rx_addr(addr, cid));
    if m.overflow.is_null() {
        // SAFETY: buf is valid for len bytes until the receive completes (user memory
        // the PML keeps alive, or our buffer freed at completion).
        unsafe {
            fi::fi_trecv(
                rx,
                buf as *mut c_void,
                len,
                ptr::null_mut(),
                addr,
                bits,
                ignore,
                ctx,
            )
        }
    } else {
        let iov = [
            fi::iovec {
                iov_base: buf as *mut c_void,
                iov_len: len,
            },
            fi::iovec {
                iov_base: m.overflow as *mut c_void,
                iov_len: m.overflow_len,
            },
        ];
        // SAFETY: as above for buf; the overflow area lives until finalize and the
        // provider copies the iov array before returning.
        unsafe {
            fi::fi_trecvv(
                rx,
                iov.as_ptr(),
                ptr::null_mut(),
                2,
                addr,
                bits,
                ignore,
                ctx,
            )
        }
    }
}

/// Post the receives that waited for room, in order, until the provider is full again.
pub(super) fn post_deferred(m: &Mtl) {
    // Not from a progress call nested in a holder of the lock (the stall breaker's, or
    // a completion's acknowledgement under it): the holder drains.
    match m.deferred.try_lock() {
        Ok(mut deferred) => drain_deferred(m, &mut deferred),
        Err(std::sync::TryLockError::Poisoned(e)) => drain_deferred(m, &mut e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => {}
    }
}

/// Post from the head of each class's queue while that class has room. No waiting
/// receive matches a stashed message (each looked in the stash when it was queued, and
/// a message is stashed only when no waiting receive matches it), so none is looked
/// up here.
fn drain_deferred(m: &Mtl, deferred: &mut Deferred) {
    'classes: for internal in [true, false] {
        while m.rx.room(internal) {
            let Some(&r) = deferred.queue(internal).front() else {
                break;
            };
            let r = r as *mut Request;
            let ret = {
                let _g = m.lock.lock();
                // SAFETY: deferred receives are live PML requests (a cancelled one is
                // removed from the queue before it completes).
                unsafe {
                    rx_enter(m, r);
                    post_recv(m, r)
                }
            };
            if ret == -(fi::FI_EAGAIN as isize) {
                // SAFETY: not posted.
                unsafe { rx_leave(m, r) };
                // The provider itself is full: neither class gets in now.
                break 'classes;
            }
            deferred.queue(internal).pop_front();
            if ret >= 0 {
                m.posted_gen.fetch_add(1, Ordering::SeqCst);
            }
            if ret < 0 {
                log::error!(
                    "posting a receive failed: {}",
                    crate::fabric::Error::from_ret(ret)
                );
                // SAFETY: r is live and not posted: complete it with the error.
                unsafe {
                    rx_leave(m, r);
                    (*r).status.error = sys::MPI_ERR_INTERN as c_int;
                    if (*r).owns_buffer {
                        libc::free((*r).buffer as *mut c_void);
                        (*r).owns_buffer = false;
                    }
                    Request::complete_to_pml(r);
                }
            }
        }
    }
    if deferred.is_empty() {
        m.has_deferred.store(false, Ordering::SeqCst);
    }
}

pub(super) unsafe fn cancel_impl(req: *mut sys::mca_mtl_request_t) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let r = req as *mut Request;
    // SAFETY: r is a live request of ours.
    let kind = unsafe { (*r).kind };
    if kind != Kind::Recv {
        // A send cannot be taken back once handed to the fabric: report "not cancelled".
        // SAFETY: the PML's request is live.
        unsafe { ompi::request::mark_not_cancelled(ptr::addr_of_mut!((*r).sup)) };
        return sys::OMPI_SUCCESS;
    }
    // Drain completions first: the receive may already have matched.
    progress_mtl(m);
    if let Some(sm) = m.soft.as_deref() {
        if super::softmatch::cancel(sm, r) {
            // SAFETY: r is live and no longer posted anywhere.
            unsafe {
                (*r).status.cancelled = true;
                (*r).status.error = sys::MPI_SUCCESS as c_int;
                if (*r).owns_buffer {
                    libc::free((*r).buffer as *mut c_void);
                    (*r).owns_buffer = false;
                }
                Request::complete_to_pml(r);
            }
        }
        return sys::OMPI_SUCCESS;
    }
    let waiting = {
        let mut deferred = m.deferred.lock().unwrap_or_else(|e| e.into_inner());
        deferred.remove(r as usize)
    };
    if waiting {
        // Never reached the provider: cancelled here.
        // SAFETY: r is live and queued nowhere now.
        unsafe {
            (*r).status.cancelled = true;
            if (*r).owns_buffer {
                libc::free((*r).buffer as *mut c_void);
                (*r).owns_buffer = false;
            }
            Request::complete_to_pml(r);
        }
        return sys::OMPI_SUCCESS;
    }
    // SAFETY: r is live.
    let (ctx, rx) = unsafe { ((*r).ctx_ptr(), m.ctx((*r).comm.map_or(0, Comm::cid)).rx) };
    let ret = {
        let _g = m.lock.lock();
        // SAFETY: the endpoint is open; ctx is the context of a posted receive (or of
        // one that already completed, which fi_cancel ignores).
        unsafe { fi::fi_cancel(&mut (*rx).fid, ctx) }
    };
    if ret != 0 {
        // SAFETY: as above.
        unsafe { ompi::request::mark_not_cancelled(ptr::addr_of_mut!((*r).sup)) };
    }
    sys::OMPI_SUCCESS
}
