//! Probes and matched probes: `MPI_Iprobe`, `MPI_Improbe` and `MPI_Imrecv`, through
//! the provider's peek and an exact receive of what it found, or through software
//! matching's unexpected list.
//!
//! What it owns: the claim of a probed message, so that no later receive can take it.
//! What it must not touch: the receive queue, except through `stall.rs`'s stash.

use super::peer::{envelope, peer_addr};
use super::progress::{fi_to_ompi, idle, progress_cq, progress_mtl, retry, wait_until};
use super::request::{Kind, Request};
use super::state::{mtl, Mtl};
use super::tag::Envelope;
use crate::fabric::FI_ADDR_UNSPEC;
use crate::ompi;
use crate::ompi::comm::Comm;
use crate::ompi::convertor::{Convertor, RecvBuffer};
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::Ordering;

/// What a receive or probe of (`comm`, `src`, `tag`) matches: tag bits, ignore bits
/// and source address (provider matching).
fn pattern(m: &Mtl, comm: Comm, src: c_int, tag: c_int) -> Result<(u64, u64, u64), c_int> {
    let mut addr = FI_ADDR_UNSPEC;
    if src != sys::MPI_ANY_SOURCE && m.directed {
        addr = peer_addr(comm, src)?;
    }
    let (bits, ignore) = m.layout.recv_bits(comm.cid(), src, tag);
    Ok((bits, ignore, addr))
}

/// Peek for a matching message, in the stash first (stall.rs); on success returns
/// (tag bits, cq data, length).
fn peek(m: &Mtl, comm: Comm, src: c_int, tag: c_int) -> Result<Option<(u64, u64, usize)>, c_int> {
    let (bits, ignore, addr) = pattern(m, comm, src, tag)?;
    if let Some(found) = super::stall::peek_stash(m, comm, (bits, ignore, addr)) {
        return Ok(Some(found));
    }
    let cid = comm.cid();
    let (rx, addr) = (m.ctx(cid).rx, m.rx_addr(addr, cid));
    let mut r = Request::internal(Kind::Probe, Some(comm));
    peek_wait(m, &mut r, rx, addr, bits, ignore)?;
    Ok(if r.probe_found {
        Some((r.matched_tag, r.matched_data, r.status.count))
    } else {
        None
    })
}

/// Peek on `rx` with `r` (a `Probe` or `Stash` request) and wait for the answer:
/// `r.probe_found`, and then the message's tag bits, CQ data and length in `r`.
pub(super) fn peek_wait(
    m: &Mtl,
    r: &mut Request,
    rx: *mut fi::fid_ep,
    addr: u64,
    bits: u64,
    ignore: u64,
) -> Result<(), c_int> {
    if m.lazy_matching {
        // Receives posted so far meet the messages that arrived before them now, so
        // that the peek does not report a message an older receive is about to take.
        progress_cq(m);
    }
    r.pending.store(1, Ordering::Release);
    let msg = fi::fi_msg_tagged {
        msg_iov: ptr::null(),
        desc: ptr::null_mut(),
        iov_count: 0,
        addr,
        tag: bits,
        ignore,
        context: r.ctx_ptr(),
        data: 0,
    };
    let ret = retry(m, || {
        // SAFETY: a peek transfers no data; msg and r outlive the wait below.
        unsafe { fi::fi_trecvmsg(rx, &msg, fi::FI_PEEK as u64) }
    });
    if ret < 0 {
        return Err(fi_to_ompi(ret));
    }
    wait_until(m, || r.pending.load(Ordering::Acquire) <= 0);
    if r.status.error != 0 {
        return Err(r.status.error);
    }
    Ok(())
}

/// Receive exactly the message a peek found (its tag bits, nothing ignored; from
/// `addr`; `len` bytes) into a buffer of its size that `r` then owns, and wait for it.
/// `Ok(false)`: another receive of the provider's took the message (see below). On
/// failure or `Ok(false)`, `r` owns no buffer.
/// The oldest unexpected message with these bits is the one peeked, so a plain receive
/// takes it, through every protocol of the provider's (a claim would not gather
/// ofi_rxm's segmented messages).
pub(super) fn recv_exact(
    m: &Mtl,
    r: &mut Request,
    rx: *mut fi::fid_ep,
    addr: u64,
    bits: u64,
    len: usize,
) -> Result<bool, c_int> {
    if len > 0 {
        // SAFETY: plain allocation; checked.
        let b = unsafe { libc::malloc(len) } as *mut u8;
        if b.is_null() {
            return Err(sys::OMPI_ERR_OUT_OF_RESOURCE);
        }
        r.buffer = b;
        r.length = len;
        r.owns_buffer = true;
    }
    r.pending.store(1, Ordering::Release);
    let (buf, ctx) = (r.buffer, r.ctx_ptr());
    let ret = retry(m, || {
        // SAFETY: buf holds len bytes until the receive completes (we wait below).
        unsafe {
            fi::fi_trecv(
                rx,
                buf as *mut c_void,
                len,
                ptr::null_mut(),
                addr,
                bits,
                0,
                ctx,
            )
        }
    });
    if ret < 0 {
        if r.owns_buffer {
            // SAFETY: not posted; ours.
            unsafe { libc::free(buf as *mut c_void) };
            r.owns_buffer = false;
        }
        return Err(fi_to_ompi(ret));
    }
    // The peeked message may go to a receive posted before this one that the
    // provider had not matched it with yet when it answered the peek (sockets: a
    // receive just drained from the deferred queue meets the buffered message only in
    // the provider's next progress). This receive would then wait for a second message
    // with these bits. So after a while it is cancelled: a receive the provider
    // already matched (a large message still arriving) is not cancelled, and it
    // completes as usual.
    let start = std::time::Instant::now();
    let mut cancel_sent = false;
    while r.pending.load(Ordering::Acquire) > 0 {
        if progress_mtl(m) == 0 {
            idle();
            if !cancel_sent && start.elapsed() > EXACT_PATIENCE {
                cancel_sent = true;
                // SAFETY: rx is the endpoint it was posted on; ctx is its context.
                unsafe { fi::fi_cancel(&mut (*rx).fid, ctx) };
            }
        }
    }
    if r.status.error != 0 || r.status.cancelled {
        if r.owns_buffer {
            // SAFETY: the receive completed; nothing references the buffer.
            unsafe { libc::free(r.buffer as *mut c_void) };
            r.owns_buffer = false;
        }
        if r.status.cancelled {
            m.counters.exact_lost.fetch_add(1, Ordering::Relaxed);
            return Ok(false);
        }
        return Err(r.status.error);
    }
    Ok(true)
}

/// How long [`recv_exact`] waits for a message it knows has arrived before it asks
/// the provider whether another receive took it.
const EXACT_PATIENCE: std::time::Duration = std::time::Duration::from_millis(10);

fn fill_status(status: Option<&mut sys::ompi_status_public_t>, env: &Envelope, len: usize) {
    let Some(status) = status else {
        return;
    };
    // The PML passes the caller's own status: MPI_ERROR is left as the caller set it
    // (MPI 3.1, 3.2.5: only the calls that return several statuses write it), as ob1's
    // probes leave it.
    status.MPI_SOURCE = env.source;
    status.MPI_TAG = env.tag;
    status._ucount = len;
    status._cancelled = 0;
}

pub(super) fn iprobe_impl(
    comm: Comm,
    src: c_int,
    tag: c_int,
    flag: &mut c_int,
    status: Option<&mut sys::ompi_status_public_t>,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let found = match m.soft.as_deref() {
        Some(sm) => {
            let (bits, ignore) = m.layout.recv_bits(comm.cid(), src, tag);
            match super::softmatch::probe(sm, bits, ignore) {
                Some(found) => Some(found),
                None => {
                    // Not arrived yet: one round of Open MPI's progress (which yields
                    // the core when nothing happened, see ompi::progress), then look
                    // again at what it brought.
                    ompi::progress::progress();
                    super::softmatch::probe(sm, bits, ignore)
                }
            }
        }
        None => match peek(m, comm, src, tag) {
            Ok(None) => {
                // The peek's own answer is an event of our progress, so the rounds
                // inside it never count as idle: give Open MPI's progress its round.
                ompi::progress::progress();
                None
            }
            Ok(found) => found,
            Err(rc) => return rc,
        },
    };
    match found {
        Some((bits, data, len)) => {
            let env = match envelope(m, comm, bits, data) {
                Ok(env) => env,
                Err(rc) => return rc,
            };
            *flag = 1;
            fill_status(status, &env, len);
            sys::OMPI_SUCCESS
        }
        None => {
            *flag = 0;
            sys::OMPI_SUCCESS
        }
    }
}

/// A message matched by mprobe: received in full into our buffer, waiting for mrecv.
enum Claimed {
    /// Received by the fabric into our buffer.
    Fabric(Box<Request>),
    /// Taken off the software-matching unexpected list.
    Soft(super::softmatch::Unexpected),
}

pub(super) fn improbe_impl(
    comm: Comm,
    src: c_int,
    tag: c_int,
    flag: &mut c_int,
    message: &mut *mut sys::ompi_message_t,
    status: Option<&mut sys::ompi_status_public_t>,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    if let Some(sm) = m.soft.as_deref() {
        let (bits, ignore) = m.layout.recv_bits(comm.cid(), src, tag);
        let claimed = super::softmatch::claim(m, sm, comm, bits, ignore).or_else(|| {
            // As in iprobe: Open MPI's progress (yielding when idle), then again.
            ompi::progress::progress();
            super::softmatch::claim(m, sm, comm, bits, ignore)
        });
        let Some(u) = claimed else {
            *flag = 0;
            return sys::OMPI_SUCCESS;
        };
        let (b, d, len) = (u.hdr.bits, u.hdr.data, u.hdr.len as usize);
        return publish_message(m, comm, Claimed::Soft(u), b, d, len, flag, message, status);
    }
    let req = match claim_provider(m, comm, src, tag) {
        Ok(Some(req)) => req,
        Ok(None) => {
            // As in iprobe: the peek's answer was our progress's only event.
            ompi::progress::progress();
            *flag = 0;
            return sys::OMPI_SUCCESS;
        }
        Err(rc) => return rc,
    };
    let (mbits, mdata, mlen) = (req.matched_tag, req.matched_data, req.status.count);
    publish_message(
        m,
        comm,
        Claimed::Fabric(req),
        mbits,
        mdata,
        mlen,
        flag,
        message,
        status,
    )
}

/// `MPI_Improbe` under provider matching: take the oldest message of (`comm`, `src`,
/// `tag`), from the stash (stall.rs) or the provider, received in full into our buffer.
/// The `deferred` lock is held throughout, so that the stall breaker cannot take the
/// message between the peek and the receive (the receive would then take the next
/// message with the same bits).
fn claim_provider(
    m: &Mtl,
    comm: Comm,
    src: c_int,
    tag: c_int,
) -> Result<Option<Box<Request>>, c_int> {
    let (bits, ignore, addr) = pattern(m, comm, src, tag)?;
    let mut d = m.deferred.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = super::stall::claim_stash(m, &mut d, comm, (bits, ignore, addr)) {
        return Ok(Some(c));
    }
    // No receive of another thread's gets into the provider until the message is ours.
    let _busy = m.rx.threads().then(|| {
        m.claim_busy.store(true, Ordering::SeqCst);
        while m.fast_posts.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        super::stall::Busy(&m.claim_busy)
    });
    let cid = comm.cid();
    let rx = m.ctx(cid).rx;
    let mut probe = Request::internal(Kind::Probe, Some(comm));
    peek_wait(m, &mut probe, rx, m.rx_addr(addr, cid), bits, ignore)?;
    if !probe.probe_found {
        return Ok(None);
    }
    let (bits, len) = (probe.matched_tag, probe.status.count);
    // Receive exactly that message now, so that no later receive can take it: same
    // tag bits (communicator, source, tag, protocol) and, where the source does not
    // travel in the tag, the same source address.
    let source = envelope(m, comm, bits, probe.matched_data)?.source;
    let mut addr = FI_ADDR_UNSPEC;
    if m.layout.source_in_data() {
        addr = peer_addr(comm, source)?;
    }
    let mut req = Box::new(Request::internal(Kind::Claim, Some(comm)));
    let got = recv_exact(m, &mut req, rx, m.rx_addr(addr, cid), bits, len)?;
    drop(d);
    Ok(got.then_some(req))
}

/// Hand a claimed message to Open MPI as an `MPI_Message`.
#[allow(clippy::too_many_arguments)]
fn publish_message(
    m: &Mtl,
    comm: Comm,
    claimed: Claimed,
    bits: u64,
    data: u64,
    len: usize,
    flag: &mut c_int,
    message: &mut *mut sys::ompi_message_t,
    status: Option<&mut sys::ompi_status_public_t>,
) -> c_int {
    let env = match envelope(m, comm, bits, data) {
        Ok(env) => env,
        Err(rc) => {
            // Claimed but not deliverable: drop it (already logged).
            if let Claimed::Fabric(c) = claimed {
                if c.owns_buffer {
                    // SAFETY: allocated in improbe, not referenced any more.
                    unsafe { libc::free(c.buffer as *mut c_void) };
                }
            }
            return rc;
        }
    };
    let ours = Box::into_raw(Box::new(claimed));
    let Some(msg) = ompi::message::publish(comm, env.source, len, ours as *mut c_void) else {
        // SAFETY: not published: the claim is still only ours.
        drop(unsafe { Box::from_raw(ours) });
        return sys::OMPI_ERR_OUT_OF_RESOURCE;
    };
    *message = msg;
    *flag = 1;
    fill_status(status, &env, len);
    sys::OMPI_SUCCESS
}

/// # Safety
/// `*message` is a message [`improbe_impl`] published; `req` is the PML's request with
/// our bytes behind it, alive until we complete it.
pub(super) unsafe fn imrecv_impl(
    conv: Convertor,
    message: &mut *mut sys::ompi_message_t,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    let Some(m) = mtl() else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    // SAFETY: *message is a message improbe published, received now.
    let (comm, ours) = unsafe { ompi::message::parts(*message) };
    // SAFETY: what improbe published is the Claimed it leaked there.
    let claimed = unsafe { Box::from_raw(ours as *mut Claimed) };
    let r = req as *mut Request;
    // SAFETY: PML request memory.
    unsafe { Request::init(r, Kind::Recv, Some(comm)) };
    let c = match *claimed {
        Claimed::Fabric(c) => c,
        Claimed::Soft(u) => {
            // SAFETY: the message is received: its handle goes back to Open MPI.
            unsafe { ompi::message::give_back(message) };
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
            super::softmatch::take(m, r, u);
            return sys::OMPI_SUCCESS;
        }
    };
    let ompi::convertor::Info { size, contig } = conv.info();
    let len = c.status.count;
    let n = len.min(size);
    if n > 0 {
        if let Some(start) = contig {
            // SAFETY: start is the user's contiguous buffer of `size` bytes; our
            // buffer holds `len` bytes.
            unsafe { ptr::copy_nonoverlapping(c.buffer, start, n) };
        } else {
            // SAFETY: our buffer holds `len` >= n received bytes.
            conv.unpack(unsafe { std::slice::from_raw_parts(c.buffer, n) });
        }
    }
    // SAFETY: r is live; status from the claimed message.
    unsafe {
        (*r).status.source = m.layout.source(c.matched_tag, c.matched_data);
        (*r).status.tag = m.layout.mpi_tag(c.matched_tag);
        (*r).status.count = n;
        (*r).status.error = if len > size {
            sys::MPI_ERR_TRUNCATE as c_int
        } else {
            sys::MPI_SUCCESS as c_int
        };
    }
    if c.owns_buffer {
        // SAFETY: allocated in improbe.
        unsafe { libc::free(c.buffer as *mut c_void) };
    }
    drop(c);
    // SAFETY: the message is received: its handle goes back to Open MPI (as ob1
    // does); r is the PML's live request.
    unsafe {
        ompi::message::give_back(message);
        Request::complete_to_pml(r);
    }
    sys::OMPI_SUCCESS
}
