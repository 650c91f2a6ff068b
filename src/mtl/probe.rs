//! Probes and matched probes: `MPI_Iprobe`, `MPI_Improbe` and `MPI_Imrecv`, through
//! the provider's peek and an exact receive of what it found, or through software
//! matching's unexpected list.
//!
//! What it owns: the claim of a probed message, so that no later receive can take it.
//! What it must not touch: the receive queue, except through `stall.rs`'s stash.

use super::peer::{envelope, peer_addr};
use super::progress::{idle, progress_cq, progress_mtl, retry, with_request};
use super::request::{Kind, Req, Request};
use super::state::{locked, mtl, Entry, Mtl};
use super::tag::Envelope;
use crate::fabric::{EpRef, Local, FI_ADDR_UNSPEC};
use crate::ompi;
use crate::ompi::comm::Comm;
use crate::ompi::convertor::{Convertor, RecvBuffer};
use crate::ompi::error::OpalCode;
use crate::ompi::message::Message;
use ompi_sys as sys;
use std::os::raw::c_int;
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
    if let Some(found) = super::stall::peek_stash(m, comm, (bits, ignore, addr))? {
        return Ok(Some(found));
    }
    let cid = comm.cid();
    let (rx, addr) = (m.ctx(cid).rx(), m.rx_addr(addr, cid));
    let mut r = Request::of_kind(Kind::Probe, Some(comm));
    peek_wait(m, &mut r, rx, addr, bits, ignore)?;
    Ok(if r.probe_found.get() {
        Some((
            r.matched_tag.get(),
            r.matched_data.get(),
            r.status.get().count,
        ))
    } else {
        None
    })
}

/// Peek on `rx` with `req` (a `Probe` or `Stash` request) and wait for the answer:
/// `req.probe_found.get()`, and then the message's tag bits, CQ data and length in `req`.
pub(super) fn peek_wait(
    m: &Mtl,
    req: &mut Request,
    rx: EpRef<'_>,
    addr: u64,
    bits: u64,
    ignore: u64,
) -> Result<(), c_int> {
    if m.lazy_matching {
        // Receives posted so far meet the messages that arrived before them now, so
        // that the peek does not report a message an older receive is about to take.
        progress_cq(m);
    }
    // The answer is waited for before `with_request` returns.
    with_request(m, req, |r| {
        r.pending().store(1, Ordering::Release);
        let ctx = r.op_context();
        retry(m, |s| rx.tpeek(s, addr, bits, ignore, ctx)).map_err(|e| {
            r.pending().store(0, Ordering::Release);
            e.to_opal()
        })
    })?;
    match req.status.get().error {
        0 => Ok(()),
        e => Err(e),
    }
}

/// Receive exactly the message a peek found (its tag bits, nothing ignored; from
/// `addr`; `len` bytes) into a buffer of its size that `req` then owns, and wait for
/// it. `Ok(false)`: another receive of the provider's took the message (see below). On
/// failure or `Ok(false)`, `req` owns no buffer.
/// The oldest unexpected message with these bits is the one peeked, so a plain receive
/// takes it, through every protocol of the provider's (a claim would not gather
/// ofi_rxm's segmented messages).
pub(super) fn recv_exact(
    m: &Mtl,
    req: &mut Request,
    rx: EpRef<'_>,
    addr: u64,
    bits: u64,
    len: usize,
) -> Result<bool, c_int> {
    with_request(m, req, |r| exact(m, r, rx, addr, bits, len))
}

/// [`recv_exact`] with the handle of its request.
fn exact(m: &Mtl, r: Req, rx: EpRef<'_>, addr: u64, bits: u64, len: usize) -> Result<bool, c_int> {
    r.alloc_buffer(len)?;
    r.pending().store(1, Ordering::Release);
    let (buf, ctx) = (r.recv_buf(), r.op_context());
    if let Err(e) = retry(m, |s| rx.trecv(s, buf, Local::NONE, addr, bits, 0, ctx)) {
        r.pending().store(0, Ordering::Release);
        // Not posted; ours.
        r.free_buffer();
        return Err(e.to_opal());
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
    while r.pending().load(Ordering::Acquire) > 0 {
        if progress_mtl(m) == 0 {
            idle();
            if !cancel_sent && start.elapsed() > EXACT_PATIENCE {
                cancel_sent = true;
                let g = m.lock.lock();
                // Not found once it completed; the answer comes as its completion.
                let _ = rx.cancel(&g.serialized(), r.posted_context());
            }
        }
    }
    let status = r.status();
    if status.error != 0 || status.cancelled {
        // The receive completed; nothing references the buffer.
        r.free_buffer();
        if status.cancelled {
            m.counters.exact_lost.fetch_add(1, Ordering::Relaxed);
            return Ok(false);
        }
        return Err(status.error);
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
    e: &Entry,
    comm: Comm,
    src: c_int,
    tag: c_int,
    flag: &mut c_int,
    status: Option<&mut sys::ompi_status_public_t>,
) -> c_int {
    let Some(m) = mtl(e) else {
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
pub(super) enum Claimed {
    /// Received by the fabric into our buffer.
    Fabric(Box<Request>),
    /// Taken off the software-matching unexpected list.
    Soft(super::softmatch::Unexpected),
}

// SAFETY: the MTL publishes no other type behind a message (`publish_message`), and the
// BTL publishes none.
unsafe impl ompi::message::Claim for Claimed {}

pub(super) fn improbe_impl(
    e: &Entry,
    comm: Comm,
    src: c_int,
    tag: c_int,
    flag: &mut c_int,
    message: &mut *mut sys::ompi_message_t,
    status: Option<&mut sys::ompi_status_public_t>,
) -> c_int {
    let Some(m) = mtl(e) else {
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
    let (mbits, mdata, mlen) = (
        req.matched_tag.get(),
        req.matched_data.get(),
        req.status.get().count,
    );
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
    let mut d = locked(&m.deferred)?;
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
    let rx = m.ctx(cid).rx();
    let mut probe = Request::of_kind(Kind::Probe, Some(comm));
    peek_wait(m, &mut probe, rx, m.rx_addr(addr, cid), bits, ignore)?;
    if !probe.probe_found.get() {
        return Ok(None);
    }
    let (bits, len) = (probe.matched_tag.get(), probe.status.get().count);
    // Receive exactly that message now, so that no later receive can take it: same
    // tag bits (communicator, source, tag, protocol) and, where the source does not
    // travel in the tag, the same source address.
    let source = envelope(m, comm, bits, probe.matched_data.get())?.source;
    let mut addr = FI_ADDR_UNSPEC;
    if m.layout.source_in_data() {
        addr = peer_addr(comm, source)?;
    }
    let mut req = Box::new(Request::of_kind(Kind::Claim, Some(comm)));
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
            if let Claimed::Fabric(mut c) = claimed {
                // Received in improbe; not referenced any more.
                c.free_buffer();
            }
            return rc;
        }
    };
    let Some(msg) = ompi::message::publish(comm, env.source, len, Box::new(claimed)) else {
        return sys::OMPI_ERR_OUT_OF_RESOURCE;
    };
    *message = msg;
    *flag = 1;
    fill_status(status, &env, len);
    sys::OMPI_SUCCESS
}

/// `MPI_Imrecv` of `message` into the PML's request `r` (initialised by the entry).
pub(super) fn imrecv_impl(e: &Entry, conv: Convertor, mut message: Message<'_>, r: Req) -> c_int {
    let Some(m) = mtl(e) else {
        return sys::OMPI_ERR_NOT_AVAILABLE;
    };
    let Some(claimed) = message.take::<Claimed>() else {
        return sys::OMPI_ERR_BAD_PARAM;
    };
    let c = match *claimed {
        Claimed::Fabric(c) => c,
        Claimed::Soft(u) => {
            // The message is received: its handle goes back to Open MPI.
            message.give_back();
            match RecvBuffer::of(conv) {
                Ok(b) => r.set_recv_buffer(b),
                Err(e) => return e,
            }
            r.set_convertor(Some(conv));
            super::softmatch::take(m, r, u);
            return sys::OMPI_SUCCESS;
        }
    };
    let mut c = c;
    let len = c.status.get().count;
    let size = conv.info().size;
    let n = conv.deliver(c.received(len));
    let (source, tag) = (
        m.layout.source(c.matched_tag.get(), c.matched_data.get()),
        m.layout.mpi_tag(c.matched_tag.get()),
    );
    r.update_status(|s| {
        s.source = source;
        s.tag = tag;
        s.count = n;
        s.error = if len > size {
            sys::MPI_ERR_TRUNCATE as c_int
        } else {
            sys::MPI_SUCCESS as c_int
        };
    });
    // Allocated in improbe.
    c.free_buffer();
    drop(c);
    // The message is received: its handle goes back to Open MPI (as ob1 does).
    message.give_back();
    r.complete_to_pml();
    sys::OMPI_SUCCESS
}
