//! RDMA: `put` and `get`, and the machinery the provider's atomics share with them:
//! the per-operation context ([`RdmaOp`]), posting with one retry after progress
//! (`run`), the queue of operations the provider refused with `-FI_EAGAIN`
//! ([`Deferred`]), and completions. Registration is `registration.rs`, the provider's
//! atomics `provider_atomics.rs`, emulated ones `amo.rs`.
//!
//! Addressing: the target address is relative to the remote `Handle`'s base (see
//! `registration.rs`). With `FI_MR_LOCAL` the local side passes the descriptor of
//! the local handle, registering the local buffer on the fly when the caller has none.
//!
//! Where the provider mixes up writes of more than one packet (udp;ofi_rxd), a put
//! longer than one is done by the target's read (`put_by_read`) where active
//! messages are on, else as writes of one packet each ([`State::write_max`]),
//! completing with the last.
//!
//! What it owns: the per-operation contexts ([`RdmaOp`], boxed, freed at completion)
//! and the deferred operations. What it must not touch: registrations beyond
//! making and giving back the temporary ones of `FI_MR_LOCAL`.

use super::module::{lock, Module, PeerEp, State};
use super::op_context::{Ctx, OpKind};
use super::progress::progress_module;
use super::registration::{deregister, register, Handle, Registration, HANDLE};
use super::resolve::Again;
use crate::fabric::{Dir, Error, Local, OpContext, Remote};
use crate::ompi::btl::{rdma_args, RdmaArgs, RdmaCallback};
use crate::ompi::component::ffi_guard;
use crate::ompi::error::OpalCode;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// One RDMA or atomic operation in flight: boxed, leaked to the provider while it is
/// posted, and taken back at its completion (progress) or when the post fails.
#[repr(C)]
pub struct RdmaOp {
    ctx: Ctx,
    cb: RdmaCallback,
    /// Operands live here until the completion (not injected).
    operand: u64,
    compare: u64,
    /// A local registration made for this operation (FI_MR_LOCAL without a handle).
    temp: Option<Box<Registration>>,
    /// Of one write of a put split in parts ([`State::write_max`]): the whole put,
    /// which completes with its last part.
    whole: Option<Arc<Whole>>,
}

// SAFETY: an operation has one holder at a time (the path posting it, the provider,
// a queue behind the module's mutex, or the completion), which hands it on; its
// callback's pointers are Open MPI's, valid from any thread until called
// (`RdmaCallback`), and its registration is boxed and ours.
unsafe impl Send for RdmaOp {}

/// A put split in parts: the operation, completed when the last part completes.
struct Whole {
    op: Mutex<Option<Box<RdmaOp>>>,
    /// The descriptor of the whole op's own registration, for its parts (an address,
    /// only handed on); the op keeps the registration until it completes.
    desc: Option<usize>,
    /// The parts not yet completed, and the first error.
    parts: AtomicUsize,
    part_err: AtomicI32,
}

impl RdmaOp {
    fn new(cb: RdmaCallback, operand: u64, compare: u64) -> Box<RdmaOp> {
        Box::new(RdmaOp {
            ctx: Ctx::new(OpKind::Rdma),
            cb,
            operand,
            compare,
            temp: None,
            whole: None,
        })
    }
}

/// Puts up to this size go as writes of one packet even where `put_by_read`
/// is on: over udp;ofi_rxd 4 KiB took 17 us as four writes against 22 us read by the
/// target, 64 KiB 208 us against 110 us.
pub const PUT_BY_READ_MIN: usize = 4096;

/// What a write needs beyond its payload in the provider's packet where
/// [`State::write_max`] splits puts: rxd's RMA header with room for four target
/// ranges (its inline limit for writes is its packet less about 200 bytes).
pub const WRITE_HEADROOM: usize = 256;

/// Completion of an RDMA or atomic operation (`err` 0, or the positive FI_E* code).
/// Takes the box the provider gave back (or the post did not take), and frees it.
#[allow(clippy::boxed_local)]
pub fn rdma_complete(module: &'static Module, mut op: Box<RdmaOp>, err: i32) {
    if let Some(whole) = op.whole.take() {
        if err != 0 {
            let _ = whole
                .part_err
                .compare_exchange(0, err, Ordering::AcqRel, Ordering::Relaxed);
        }
        if whole.parts.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last part: the whole put is complete, and ours to finish.
            let err = whole.part_err.load(Ordering::Acquire);
            if let Some(w) = lock(&whole.op).take() {
                rdma_complete(module, w, err);
            }
        }
        return;
    }
    let state = &module.state;
    if let Some(t) = op.temp.take() {
        deregister(state, t);
    }
    let status = if err == 0 {
        sys::OPAL_SUCCESS
    } else {
        Error(err).to_opal()
    };
    op.cb.complete(module.btl(), status);
    state.rdma_outstanding.fetch_sub(1, Ordering::AcqRel);
}

/// One-sided operations posted (`State::ops`), the provider's and the emulated alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub puts: u64,
    pub gets: u64,
    /// `btl_atomic_op` (non-fetching).
    pub atomics: u64,
    /// `btl_atomic_fop`.
    pub fetching_atomics: u64,
    /// `btl_atomic_cswap`.
    pub cswaps: u64,
    /// Gets and puts the provider refused with -FI_EAGAIN and progress posted later
    /// ([`Deferred`]).
    pub deferred: u64,
    /// Fragments sent and received through fast boxes (`common::fbox`).
    pub fbox_sent: u64,
    pub fbox_received: u64,
}

/// Everything an RDMA or atomic entry point receives, typed.
#[derive(Clone, Copy)]
pub(super) struct Req {
    pub module: &'static Module,
    /// The peer (`None`: Open MPI passed no endpoint).
    pub peer: Option<&'static PeerEp>,
    /// The caller's local buffer, with the descriptor of its handle when it has one.
    pub local: Local,
    pub remote_address: u64,
    /// The remote handle, read once (`None`: Open MPI passed none): the original may
    /// change under us (see `resolve`).
    pub handle: Option<Handle>,
    pub cb: RdmaCallback,
}

/// What an RDMA or atomic entry point receives, as `ompi::btl::rdma_args` types it for
/// this BTL (call it with [`Args`]' parameters).
pub(super) type Args = RdmaArgs<'static, Module, PeerEp, HANDLE>;

impl Req {
    /// The request of an entry point's arguments, with the remote handle's bytes
    /// decoded.
    #[inline]
    pub(super) fn new(a: Args, remote_address: u64) -> Req {
        Req {
            module: a.module,
            peer: a.peer,
            local: a.local,
            remote_address,
            handle: a.remote_handle.map(Handle::from_bytes),
            cb: a.cb,
        }
    }
}

/// How an operation is posted: `post(state, op, local, remote)`, giving the
/// operation back when the provider refuses it.
pub(super) type PostResult = Result<(), (Box<RdmaOp>, Error)>;

/// Prepare an operation context, post it with `post`, retrying once after progress
/// on -FI_EAGAIN. Then a get or a put of one write (`defer`: its direction) is
/// deferred to progress ([`Deferred`]); anything else returns OUT_OF_RESOURCE, and
/// the caller retries.
pub(super) fn run(
    r: Req,
    kind: usize,
    operand: u64,
    compare: u64,
    defer: Option<Dir>,
    post: impl Fn(&State, Box<RdmaOp>, Local, Remote) -> PostResult,
) -> c_int {
    let module = r.module;
    let state = &module.state;
    let (Some(peer), Some(rh)) = (r.peer, r.handle) else {
        return sys::OPAL_ERR_BAD_PARAM;
    };
    let remote = Remote {
        peer: state.to(peer.addr),
        addr: r.remote_address.wrapping_sub(rh.base),
        key: rh.key,
    };
    let local = r.local;
    let mut op = RdmaOp::new(r.cb, operand, compare);
    if local.desc().is_null() && state.mr_local && !local.is_empty() {
        let Some(t) = register(state, local.addr(), local.len()) else {
            return sys::OPAL_ERR_OUT_OF_RESOURCE;
        };
        op.temp = Some(t);
    }
    state.rdma_outstanding.fetch_add(1, Ordering::AcqRel);
    // Behind operations already deferred, in order.
    if let Some(dir) = defer.filter(|_| state.has_rdma_deferred.load(Ordering::Relaxed)) {
        defer_op(
            state,
            Deferred {
                op,
                dir,
                local,
                remote,
            },
            false,
        );
        state.ops[kind].fetch_add(1, Ordering::Relaxed);
        return sys::OPAL_SUCCESS;
    }
    let mut res = post(state, op, local, remote);
    if let Err((op, Error::AGAIN)) = res {
        progress_module(module);
        res = post(state, op, local, remote);
    }
    let res = match (res, defer) {
        (Err((op, Error::AGAIN)), Some(dir)) => {
            defer_op(
                state,
                Deferred {
                    op,
                    dir,
                    local,
                    remote,
                },
                false,
            );
            Ok(())
        }
        (res, _) => res,
    };
    match res {
        Ok(()) => {
            state.ops[kind].fetch_add(1, Ordering::Relaxed);
            state.maybe_progress(module);
            sys::OPAL_SUCCESS
        }
        Err((mut op, e)) => {
            state.rdma_outstanding.fetch_sub(1, Ordering::AcqRel);
            if let Some(t) = op.temp.take() {
                deregister(state, t);
            }
            if e == Error::AGAIN {
                sys::OPAL_ERR_OUT_OF_RESOURCE
            } else {
                log::warn!(
                    "posting an RDMA/atomic operation on {}: {e}",
                    state.provider
                );
                e.to_opal()
            }
        }
    }
}

/// Post `op` with `post(context, local, operand, compare)`, which gets the operation's
/// context, its local range (with the descriptor of the registration made for it, if
/// any) and its operands as ranges to post: the operation is leaked to the provider
/// and comes back at its completion (progress), or here when the post fails.
#[inline]
pub(super) fn post_op(
    op: Box<RdmaOp>,
    local: Local,
    post: impl FnOnce(OpContext, Local, Local, Local) -> Result<(), Error>,
) -> PostResult {
    let scribble = crate::common::quirks::scribble_contexts();
    let raw = Box::into_raw(op);
    // SAFETY: raw is the operation just leaked, which nothing else holds: its context
    // and operands stay put, and are only read by the provider, until the completion,
    // whose context gives the box back (progress); the box is taken back here only when
    // the post fails, so that nothing is in flight. A registration made for the local
    // range (the op's own, or its whole put's) covers it and lives until then.
    unsafe {
        let o = &*raw;
        let desc = o.temp.as_ref().map(|t| t.desc).or_else(|| {
            o.whole
                .as_ref()
                .and_then(|w| w.desc.map(|d| d as *mut c_void))
        });
        let local = desc.map_or(local, |d| local.with_desc(d));
        let ctx = o.ctx.fi.context(scribble);
        let operand = Local::new((&raw const o.operand).cast_mut().cast(), 8, ptr::null_mut());
        let compare = Local::new((&raw const o.compare).cast_mut().cast(), 8, ptr::null_mut());
        post(ctx, local, operand, compare).map_err(|e| (Box::from_raw(raw), e))
    }
}

/// A get, or a put of one write, that the provider refused with -FI_EAGAIN: posted
/// again from progress ([`post_deferred`]), in order, and completed through its
/// callback like any other.
///
/// Returning OUT_OF_RESOURCE instead is correct but costly with ob1: Open MPI 4.1.4's
/// ob1 has no RDMA retry (`rdma_retries_limit` is 0), so a refused get makes it send
/// that message by copy instead. And a get ob1 posts from its callback for an
/// arriving rendezvous header runs inside this module's progress, which cannot run
/// again to make room: on shm, 1 MiB messages streamed 16 at a time met -FI_EAGAIN on
/// about 9 gets in 10, at one read in flight, and went by copy at 6 GB/s.
pub struct Deferred {
    op: Box<RdmaOp>,
    dir: Dir,
    local: Local,
    remote: Remote,
}

/// Queue `d` (at the front: `front`, when it was the queue's head).
fn defer_op(state: &State, d: Deferred, front: bool) {
    let mut q = lock(&state.rdma_deferred);
    if front {
        q.push_front(d);
    } else {
        state.rdma_deferrals.fetch_add(1, Ordering::Relaxed);
        q.push_back(d);
    }
    state.has_rdma_deferred.store(true, Ordering::Relaxed);
}

/// Post the deferred operations of `module` in order, until the provider refuses
/// one again. Called from the module's progress (serialized); an operation that
/// fails otherwise completes through its callback with the error.
pub(super) fn post_deferred(module: &'static Module) {
    let state = &module.state;
    loop {
        let Some(d) = ({
            let mut q = lock(&state.rdma_deferred);
            let d = q.pop_front();
            if q.is_empty() {
                state.has_rdma_deferred.store(false, Ordering::Relaxed);
            }
            d
        }) else {
            return;
        };
        let Deferred {
            op,
            dir,
            local,
            remote,
        } = d;
        match rma(state, dir, local, remote, op) {
            Ok(()) => {}
            Err((op, Error::AGAIN)) => {
                defer_op(
                    state,
                    Deferred {
                        op,
                        dir,
                        local,
                        remote,
                    },
                    true,
                );
                return;
            }
            Err((op, e)) => {
                log::warn!(
                    "posting a deferred RDMA operation on {}: {e}",
                    state.provider
                );
                // Never posted: ours to complete, once.
                rdma_complete(module, op, e.0);
            }
        }
    }
}

/// Free the deferred operations of a module being destroyed (Open MPI no longer
/// waits for their callbacks).
pub(super) fn discard_deferred(state: &State) {
    let q = std::mem::take(&mut *lock(&state.rdma_deferred));
    state.has_rdma_deferred.store(false, Ordering::Relaxed);
    for mut d in q {
        if let Some(t) = d.op.temp.take() {
            deregister(state, t);
        }
    }
}

pub(crate) extern "C" fn btl_put(
    btl: *mut sys::mca_btl_base_module_t,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    remote_address: u64,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    size: usize,
    _flags: c_int,
    _order: c_int,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
) -> c_int {
    ffi_guard("btl put", sys::OPAL_ERROR, || {
        // SAFETY: the arguments of osc's or ob1's put, as the BTL interface defines
        // them: the local buffer holds size bytes until the callback.
        let args = unsafe {
            rdma_args::<Module, PeerEp, Registration, HANDLE>(
                btl,
                endpoint,
                local_address,
                size,
                local_handle,
                remote_handle,
                cbfunc,
                cbcontext,
                cbdata,
            )
        };
        let mut r = Req::new(args, remote_address);
        if let Some(rc) = super::resolve::hold_if_stale(&mut r, Again::Put { size }) {
            return rc;
        }
        put(r, size)
    })
}

/// A put of `size` bytes (its handle checked by `resolve`).
pub(super) fn put(r: Req, size: usize) -> c_int {
    let module = r.module;
    let state = &module.state;
    if size > state.write_max.max(PUT_BY_READ_MIN) && state.put_by_read {
        return super::put_by_read::post(r, size);
    }
    let defer = (size <= state.write_max).then_some(Dir::Write);
    run(r, 0, 0, 0, defer, |state, op, local, remote| {
        if size > state.write_max {
            return put_in_parts(module, op, local, size, remote);
        }
        rma(state, Dir::Write, local, remote, op)
    })
}

/// Post one write of `local`, or a read into it, for `op`.
fn rma(state: &State, dir: Dir, local: Local, remote: Remote, op: Box<RdmaOp>) -> PostResult {
    // A put completes when its data is at the target: osc rdma releases the target's
    // lock right after, possibly with a CPU atomic on shared memory that nothing
    // orders after the write. A read completes when its data is here, whatever the
    // flags; FI_DELIVERY_COMPLETE on a read only chose shm's slower path, where the
    // target copies (a command it must progress) instead of the reader's own
    // single copy: 64 KiB gets took 13 to 14 us against 3.8 to 5.4, 1 MiB 131 to 183
    // against 63 to 91, and ob1 streamed 1 MiB messages at 7 to 9 GB/s against 16 to
    // 18 (and met -FI_EAGAIN on 9 gets in 10).
    let flags = if state.delivery && dir == Dir::Write {
        fi::FI_DELIVERY_COMPLETE as u64
    } else {
        0
    };
    post_op(op, local, |ctx, local, _, _| {
        state.fi(|s| state.tx().rma(s, dir, local, remote, ctx, flags))
    })
}

/// Post the put of `op` as writes of at most [`State::write_max`] bytes each, every
/// one with a context of its own; `op` completes with the last of them. Once one
/// part is posted this no longer fails: it waits out flow control with progress, and
/// a later part that cannot be posted completes the put with that error.
fn put_in_parts(
    module: &'static Module,
    op: Box<RdmaOp>,
    local: Local,
    size: usize,
    remote: Remote,
) -> PostResult {
    let state = &module.state;
    let step = state.write_max;
    let n = size.div_ceil(step);
    // The parts count down from n before any can complete.
    let desc = op.temp.as_ref().map(|t| t.desc as usize);
    let whole = Arc::new(Whole {
        op: Mutex::new(Some(op)),
        desc,
        parts: AtomicUsize::new(n),
        part_err: AtomicI32::new(0),
    });
    for i in 0..n {
        let off = i * step;
        let len = step.min(size - off);
        let mut part = RdmaOp::new(RdmaCallback::NONE, 0, 0);
        part.whole = Some(Arc::clone(&whole));
        let local = local.part(off, len);
        let remote = Remote {
            addr: remote.addr.wrapping_add(off as u64),
            ..remote
        };
        let res = loop {
            match rma(state, Dir::Write, local, remote, part) {
                Err((p, Error::AGAIN)) if i > 0 => {
                    part = p;
                    progress_module(module);
                }
                res => break res,
            }
        };
        if let Err((p, e)) = res {
            drop(p);
            if i == 0 {
                // Nothing posted: the caller frees op (and retries on AGAIN).
                return match lock(&whole.op).take() {
                    Some(op) => Err((op, e)),
                    None => Ok(()),
                };
            }
            log::warn!(
                "posting part {i} of {n} of a put on {}: {e}",
                state.provider
            );
            // The parts not posted are taken off the count (which may make this the
            // last).
            let _ = whole
                .part_err
                .compare_exchange(0, e.0, Ordering::AcqRel, Ordering::Relaxed);
            if whole.parts.fetch_sub(n - i, Ordering::AcqRel) == n - i {
                if let Some(op) = lock(&whole.op).take() {
                    rdma_complete(module, op, e.0);
                }
            }
            return Ok(());
        }
    }
    Ok(())
}

pub(crate) extern "C" fn btl_get(
    btl: *mut sys::mca_btl_base_module_t,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    remote_address: u64,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    size: usize,
    _flags: c_int,
    _order: c_int,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
) -> c_int {
    ffi_guard("btl get", sys::OPAL_ERROR, || {
        // SAFETY: the arguments of osc's or ob1's get, as the BTL interface defines
        // them: the local buffer has room for size bytes until the callback.
        let args = unsafe {
            rdma_args::<Module, PeerEp, Registration, HANDLE>(
                btl,
                endpoint,
                local_address,
                size,
                local_handle,
                remote_handle,
                cbfunc,
                cbcontext,
                cbdata,
            )
        };
        let mut r = Req::new(args, remote_address);
        if let Some(rc) = super::resolve::hold_if_stale(&mut r, Again::Get { size }) {
            return rc;
        }
        get(r)
    })
}

/// A get into the request's local buffer (its handle checked by `resolve`).
pub(super) fn get(r: Req) -> c_int {
    run(r, 1, 0, 0, Some(Dir::Read), |state, op, local, remote| {
        rma(state, Dir::Read, local, remote, op)
    })
}
