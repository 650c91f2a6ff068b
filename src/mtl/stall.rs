//! More receives than the provider's queue holds, under provider matching.
//!
//! A receive that finds the provider's queue full waits in [`Deferred`] and is posted
//! when a slot frees. That alone deadlocks when the message that would free a slot
//! cannot be sent before a *waiting* receive matches: 5000 receives posted, then the
//! peer's blocking `MPI_Ssend` (or rendezvous `MPI_Send`) for the last one. The
//! message sits in the provider's unexpected queue, where no posted receive takes it
//! (the C MTL spins forever inside `MPI_Irecv` instead).
//!
//! So while receives of the user's class wait and the provider has no room for them,
//! an idle progress call breaks the stall: it peeks for the first unexpected message
//! of the user's class ([`TagLayout::user_any`]), receives exactly that message into a
//! buffer of its size, and hands it to the earliest waiting receive it matches, as the
//! provider would have had that receive been posted. A message no waiting receive
//! matches is kept in the *stash*; every receive and probe looks there first from then
//! on. MPI order holds: a provider-unexpected message matched no posted receive when
//! it arrived nor any posted since (the provider checks its unexpected queue when a
//! receive is posted), the waiting receives are younger than every posted one, and the
//! stash only ever holds the oldest unexpected messages, taken in arrival order.
//!
//! A synchronous send is acknowledged when a receive takes its message, not when it
//! enters the stash. Everything here holds the `deferred` lock, so no receive of the
//! user's class reaches the provider meanwhile (threads posting on the fast path are
//! waited for, see `Mtl::fast_posts`).
//!
//! [`Deferred`]: super::state::Deferred
//! [`TagLayout::user_any`]: super::tag::TagLayout::user_any

use super::completion::recv_done;
use super::peer::{envelope, peer_addr};
use super::probe::{peek_wait, recv_exact};
use super::request::{Kind, Req, Request};
use super::state::{locked, Deferred, Mtl};
use crate::fabric::{EpRef, FI_ADDR_UNSPEC};
use crate::ompi::comm::Comm;
use ompi_sys as sys;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};

/// Messages taken off the provider per idle progress call and receive context.
const BATCH: usize = 64;

/// Does a message of `bits`/`data` match a receive posted with `want`/`ignore` and
/// source address `addr` on `comm`?
fn matches(m: &Mtl, comm: Comm, want: u64, ignore: u64, addr: u64, bits: u64, data: u64) -> bool {
    if (bits ^ want) & !ignore != 0 {
        return false;
    }
    if addr == FI_ADDR_UNSPEC {
        return true;
    }
    // A named source that travels in the CQ data (the full layout).
    match envelope(m, comm, bits, data) {
        Ok(env) => peer_addr(comm, env.source) == Ok(addr),
        Err(_) => false,
    }
}

/// Does stashed message `s` match (`comm`, `want`/`ignore`, `addr`)?
fn stash_matches(m: &Mtl, comm: Comm, (want, ignore, addr): (u64, u64, u64), s: &Request) -> bool {
    let (bits, data) = (s.matched_tag.get(), s.matched_data.get());
    matches(m, comm, want, ignore, addr, bits, data)
}

/// Does stashed message `s` match receive `r` (its match bits and address set)?
fn matches_recv(m: &Mtl, r: Req, s: &Request) -> bool {
    let key = (r.matched_tag(), r.matched_data(), r.post_addr());
    // A receive without a communicator matches nothing (every receive has one).
    r.comm().is_some_and(|comm| stash_matches(m, comm, key, s))
}

/// Take the oldest stashed message receive `r` matches.
pub(super) fn take_for_recv(m: &Mtl, d: &mut Deferred, r: Req) -> Option<Box<Request>> {
    let i = d.stash.iter().position(|s| matches_recv(m, r, s))?;
    let s = d.stash.remove(i);
    if d.stash.is_empty() {
        m.has_stash.store(false, Ordering::SeqCst);
    }
    s
}

/// The oldest stashed message a probe of (`comm`, `want`/`ignore`, `addr`) matches.
fn find(m: &Mtl, d: &Deferred, comm: Comm, key: (u64, u64, u64)) -> Option<usize> {
    d.stash.iter().position(|s| stash_matches(m, comm, key, s))
}

/// `MPI_Iprobe` of the stash: tag bits, CQ data and length of the oldest match.
pub(super) fn peek_stash(
    m: &Mtl,
    comm: Comm,
    pattern: (u64, u64, u64),
) -> Result<Option<(u64, u64, usize)>, c_int> {
    if !m.has_stash.load(Ordering::SeqCst) {
        return Ok(None);
    }
    let d = locked(&m.deferred)?;
    Ok(find(m, &d, comm, pattern).map(|i| {
        let s = &d.stash[i];
        (
            s.matched_tag.get(),
            s.matched_data.get(),
            s.status.get().count,
        )
    }))
}

/// `MPI_Improbe` of the stash: the oldest match, taken out and acknowledged (an
/// mprobe matches a synchronous send), as a claimed message of `comm`.
pub(super) fn claim_stash(
    m: &Mtl,
    d: &mut Deferred,
    comm: Comm,
    pattern: (u64, u64, u64),
) -> Option<Box<Request>> {
    if d.stash.is_empty() {
        return None;
    }
    let i = find(m, d, comm, pattern)?;
    let s = d.stash.remove(i)?;
    if d.stash.is_empty() {
        m.has_stash.store(false, Ordering::SeqCst);
    }
    s.comm.set(Some(comm));
    s.set_kind(Kind::Claim);
    acknowledge(m, comm, &s);
    Some(s)
}

/// A synchronous send's message was matched: tell its sender.
fn acknowledge(m: &Mtl, comm: Comm, s: &Request) {
    if let Ok(env) = envelope(m, comm, s.matched_tag.get(), s.matched_data.get()) {
        if env.proto == super::tag::Proto::Sync {
            super::completion::send_ack(m, comm, env.source, env.sync_id);
        }
    }
}

/// Complete receive `r` (taken off the waiting queue, never posted, in no queue any
/// more) with stashed message `s`: copy, unpack, acknowledge, report. Call without the
/// `deferred` lock.
pub(super) fn deliver(m: &Mtl, r: Req, mut s: Box<Request>) {
    let len = s.status.get().count;
    r.write_at(0, s.received(len));
    recv_done(
        m,
        r,
        s.matched_tag.get(),
        s.matched_data.get(),
        len,
        true,
        sys::MPI_SUCCESS as c_int,
    );
    free(s);
}

/// Free a stashed message (its buffer, allocated in take_first).
fn free(mut s: Box<Request>) {
    s.free_buffer();
}

/// Drop every stashed message (finalize): they were never received. Teardown takes
/// the queue also when a panic poisoned it: it only frees what is there.
pub(super) fn discard_all(m: &Mtl) {
    let mut d = crate::common::sync::lock(&m.deferred);
    if !d.stash.is_empty() {
        log::info!(
            "finalize: {} messages taken off a full provider queue were never received",
            d.stash.len()
        );
    }
    for s in d.stash.drain(..) {
        free(s);
    }
    m.has_stash.store(false, Ordering::SeqCst);
}

/// Clears the flag it holds when dropped (`Mtl::breaker_busy`, `Mtl::claim_busy`).
pub(super) struct Busy<'a>(pub(super) &'a AtomicBool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Break a stall if there is one (see the module documentation). Called from an idle
/// progress call while receives wait; a nested or concurrent call returns at once, and
/// so does one after which a receive was posted (`gen`: `Mtl::posted_gen` before the
/// call read the completion queue).
pub(super) fn break_stall(m: &Mtl, gen: u64) {
    if m.breaker_busy.swap(true, Ordering::Acquire) {
        return;
    }
    let _busy = Busy(&m.breaker_busy);
    let mut ready: Vec<(Req, Box<Request>)> = Vec::new();
    {
        // A progress call nested in a holder of the lock (a completion's
        // acknowledgement) must not wait for it.
        let Ok(mut d) = m.deferred.try_lock() else {
            return;
        };
        // Receives still waiting after the drain that precedes us: our budget or the
        // provider itself (-FI_EAGAIN below our budget) had no room for them.
        if d.user.is_empty() {
            return;
        }
        // Receives posted on the fast path by other threads land before we look.
        while m.fast_posts.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        // A receive posted since the completion queue was read may not have met its
        // message yet: the next idle progress call looks again.
        if m.posted_gen.load(Ordering::SeqCst) != gen {
            return;
        }
        let (want, ignore) = m.layout.user_any();
        let mut seen: Vec<EpRef<'_>> = Vec::new();
        for c in m.ctxs.iter() {
            if seen.contains(&c.rx()) {
                continue;
            }
            seen.push(c.rx());
            for _ in 0..BATCH {
                let s = match take_first(m, c.rx(), want, ignore) {
                    Ok(Some(s)) => s,
                    Ok(None) => break,
                    Err(rc) => {
                        log::error!(
                            "taking a message off a full receive queue failed ({rc}); \
                             receives waiting for room may not complete"
                        );
                        break;
                    }
                };
                // Waiting receives are live PML requests.
                let i = d.user.iter().position(|&r| matches_recv(m, r, &s));
                match i.and_then(|i| d.user.remove(i)) {
                    Some(r) => ready.push((r, s)),
                    None => {
                        d.stash.push_back(s);
                        m.has_stash.store(true, Ordering::SeqCst);
                    }
                }
                m.counters.stalls_broken.fetch_add(1, Ordering::Relaxed);
            }
        }
        if d.user.is_empty() && d.internal.is_empty() {
            m.has_deferred.store(false, Ordering::Release);
        }
    }
    for (r, s) in ready {
        // Taken off the waiting queue: ours to complete.
        deliver(m, r, s);
    }
}

/// Peek on `rx` for the first unexpected message of `want`/`ignore` and receive exactly
/// it (its tag bits, with nothing ignored) into a buffer of its length.
fn take_first(
    m: &Mtl,
    rx: EpRef<'_>,
    want: u64,
    ignore: u64,
) -> Result<Option<Box<Request>>, c_int> {
    let mut s = Box::new(Request::of_kind(Kind::Stash, None));
    peek_wait(m, &mut s, rx, FI_ADDR_UNSPEC, want, ignore)?;
    if !s.probe_found.get() {
        return Ok(None);
    }
    let (bits, len) = (s.matched_tag.get(), s.status.get().count);
    let from = sender(m, bits, s.matched_data.get());
    let got = recv_exact(m, &mut s, rx, from, bits, len)?;
    Ok(got.then_some(s))
}

/// The address to receive a peeked message from: where the source travels in CQ data
/// rather than in the tag bits, messages of several senders share the bits, and a
/// receive from any address could take another sender's message than the one peeked
/// (seen on sockets: "Stash failed: Truncation error" when the other was longer).
fn sender(m: &Mtl, bits: u64, data: u64) -> u64 {
    if !m.layout.source_in_data() {
        return FI_ADDR_UNSPEC;
    }
    let cid = m.layout.cid(bits);
    let Some(comm) = Comm::lookup(cid) else {
        return FI_ADDR_UNSPEC;
    };
    match envelope(m, comm, bits, data).and_then(|env| peer_addr(comm, env.source)) {
        Ok(addr) => m.rx_addr(addr, cid),
        Err(_) => FI_ADDR_UNSPEC,
    }
}
