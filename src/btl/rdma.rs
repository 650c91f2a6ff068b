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
use super::registration::{deregister, local_desc, register, Handle, Registration};
use super::resolve::Again;
use crate::fabric::Error;
use crate::ompi::component::ffi_guard;
use crate::ompi::error::OpalCode;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// One RDMA or atomic operation in flight.
#[repr(C)]
pub struct RdmaOp {
    ctx: Ctx,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
    /// Operands live here until the completion (not injected).
    pub(super) operand: u64,
    pub(super) compare: u64,
    /// A local registration made for this operation (FI_MR_LOCAL without a handle).
    temp: *mut Registration,
    /// Of one write of a put split in parts ([`State::write_max`]): the whole put,
    /// which completes with its last part. Null otherwise.
    whole: *mut RdmaOp,
    /// Of a put split in parts: the parts not yet completed, and the first error.
    parts: AtomicUsize,
    part_err: AtomicI32,
}

/// Puts up to this size go as writes of one packet even where `put_by_read`
/// is on: over udp;ofi_rxd 4 KiB took 17 us as four writes against 22 us read by the
/// target, 64 KiB 208 us against 110 us.
pub const PUT_BY_READ_MIN: usize = 4096;

/// What a write needs beyond its payload in the provider's packet where
/// [`State::write_max`] splits puts: rxd's RMA header with room for four target
/// ranges (its inline limit for writes is its packet less about 200 bytes).
pub const WRITE_HEADROOM: usize = 256;

/// Completion of an RDMA or atomic operation.
///
/// # Safety
/// `ctx` is the Ctx of a live RdmaOp of this module.
pub unsafe fn rdma_complete(module: *mut Module, ctx: *mut c_void, err: i32) {
    // SAFETY: Ctx is RdmaOp's first field; the op came from Box::into_raw.
    let op = unsafe { Box::from_raw(ctx as *mut RdmaOp) };
    if !op.whole.is_null() {
        // SAFETY: a part's whole put lives until its last part completes.
        let whole = unsafe { &*op.whole };
        if err != 0 {
            let _ = whole
                .part_err
                .compare_exchange(0, err, Ordering::AcqRel, Ordering::Relaxed);
        }
        if whole.parts.fetch_sub(1, Ordering::AcqRel) == 1 {
            let err = whole.part_err.load(Ordering::Acquire);
            // SAFETY: the last part: the whole put is complete, and ours to finish.
            unsafe { rdma_complete(module, op.whole as *mut c_void, err) };
        }
        return;
    }
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    if !op.temp.is_null() {
        // SAFETY: a registration we made for this operation.
        unsafe { deregister(state, op.temp) };
    }
    let status = if err == 0 {
        sys::OPAL_SUCCESS
    } else {
        Error(err).to_opal()
    };
    if let Some(cb) = op.cbfunc {
        // SAFETY: the caller's callback with its own arguments.
        unsafe {
            cb(
                module as *mut _,
                op.endpoint,
                op.local_address,
                op.local_handle,
                op.cbcontext,
                op.cbdata,
                status,
            )
        };
    }
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

/// Everything an RDMA entry point receives, bundled.
#[derive(Clone, Copy)]
pub(super) struct Req {
    pub mp: *mut Module,
    pub endpoint: *mut sys::mca_btl_base_endpoint_t,
    pub local_address: *mut c_void,
    pub local_handle: *mut sys::mca_btl_base_registration_handle_t,
    pub remote_address: u64,
    pub remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    /// The remote handle as read, once, by `resolve::hold_if_stale`: the original may
    /// change under us (see `resolve`).
    pub handle: Handle,
    pub cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    pub cbcontext: *mut c_void,
    pub cbdata: *mut c_void,
}

/// Prepare an operation context, post it with `post(op, desc, dest, raddr, key)`,
/// retrying once after progress on -FI_EAGAIN. Then a get or a put of one write
/// (`defer`: its direction) is deferred to progress ([`Deferred`]); anything else
/// returns OUT_OF_RESOURCE, and the caller retries.
pub(super) fn run(
    r: Req,
    kind: usize,
    local_len: usize,
    operand: u64,
    compare: u64,
    defer: Option<Dir>,
    post: impl Fn(&State, *mut RdmaOp, *mut c_void, fi::fi_addr_t, u64, u64) -> Result<(), Error>,
) -> c_int {
    // SAFETY: module is ours.
    let state = unsafe { &(*r.mp).state };
    if r.endpoint.is_null() || r.remote_handle.is_null() {
        return sys::OPAL_ERR_BAD_PARAM;
    }
    // SAFETY: the endpoint came from add_procs.
    let dest = unsafe { (*(r.endpoint as *mut PeerEp)).addr };
    let rh = r.handle;
    let raddr = r.remote_address.wrapping_sub(rh.base);
    let dest = state.to(dest);
    let mut temp = ptr::null_mut();
    // SAFETY: local_handle is null or ours.
    let mut desc = unsafe { local_desc(r.local_handle) };
    if desc.is_null() && state.mr_local && local_len > 0 && !r.local_address.is_null() {
        match register(state, r.local_address, local_len) {
            Some(t) => {
                temp = t;
                // SAFETY: t is a live registration.
                desc = unsafe { (*t).desc };
            }
            None => return sys::OPAL_ERR_OUT_OF_RESOURCE,
        }
    }
    let op = Box::into_raw(Box::new(RdmaOp {
        ctx: Ctx::new(OpKind::Rdma),
        endpoint: r.endpoint,
        local_address: r.local_address,
        local_handle: r.local_handle,
        cbfunc: r.cbfunc,
        cbcontext: r.cbcontext,
        cbdata: r.cbdata,
        operand,
        compare,
        temp,
        whole: ptr::null_mut(),
        parts: AtomicUsize::new(0),
        part_err: AtomicI32::new(0),
    }));
    state.rdma_outstanding.fetch_add(1, Ordering::AcqRel);
    let deferred = |dir| Deferred {
        op,
        dir,
        local: r.local_address,
        len: local_len,
        desc,
        dest,
        raddr,
        key: rh.key,
    };
    // Behind operations already deferred, in order.
    if let Some(dir) = defer.filter(|_| state.has_rdma_deferred.load(Ordering::Relaxed)) {
        defer_op(state, deferred(dir), false);
        state.ops[kind].fetch_add(1, Ordering::Relaxed);
        return sys::OPAL_SUCCESS;
    }
    let mut res = post(state, op, desc, dest, raddr, rh.key);
    if res == Err(Error::AGAIN) {
        progress_module(r.mp);
        res = post(state, op, desc, dest, raddr, rh.key);
    }
    if let (Err(Error::AGAIN), Some(dir)) = (res, defer) {
        defer_op(state, deferred(dir), false);
        res = Ok(());
    }
    match res {
        Ok(()) => {
            state.ops[kind].fetch_add(1, Ordering::Relaxed);
            state.maybe_progress(r.mp);
            sys::OPAL_SUCCESS
        }
        Err(e) => {
            state.rdma_outstanding.fetch_sub(1, Ordering::AcqRel);
            // SAFETY: not posted: still ours.
            let op = unsafe { Box::from_raw(op) };
            if !op.temp.is_null() {
                // SAFETY: made above, unused.
                unsafe { deregister(state, op.temp) };
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
    op: *mut RdmaOp,
    dir: Dir,
    local: *mut c_void,
    len: usize,
    desc: *mut c_void,
    dest: fi::fi_addr_t,
    raddr: u64,
    key: u64,
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
pub(super) fn post_deferred(module: *mut Module) {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
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
        // SAFETY: the operation's buffers and regions stay valid until its completion
        // (the BTL contract), and op is ours until then.
        let res = state.fi(|| unsafe {
            rma(
                state, d.dir, d.local, d.len, d.desc, d.dest, d.raddr, d.key, d.op,
            )
        });
        match res {
            Ok(()) => {}
            Err(Error::AGAIN) => {
                defer_op(state, d, true);
                return;
            }
            Err(e) => {
                log::warn!(
                    "posting a deferred RDMA operation on {}: {e}",
                    state.provider
                );
                // SAFETY: never posted: ours to complete, once.
                unsafe { rdma_complete(module, ctx_of(d.op), e.0) };
            }
        }
    }
}

/// Free the deferred operations of a module being destroyed (Open MPI no longer
/// waits for their callbacks).
pub(super) fn discard_deferred(state: &State) {
    let q = std::mem::take(&mut *lock(&state.rdma_deferred));
    state.has_rdma_deferred.store(false, Ordering::Relaxed);
    for d in q {
        // SAFETY: never posted: the operation is ours.
        let op = unsafe { Box::from_raw(d.op) };
        if !op.temp.is_null() {
            // SAFETY: a registration made for this operation only.
            unsafe { deregister(state, op.temp) };
        }
    }
}

#[inline]
pub(super) fn ctx_of(op: *mut RdmaOp) -> *mut c_void {
    // SAFETY: op is a live operation of ours (Box::into_raw in `run`), not yet posted;
    // its Ctx is the first field of the repr(C) struct, so the context is op itself.
    unsafe { (*op).ctx.as_op_context() }
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
        let mut r = Req {
            mp: btl as *mut Module,
            endpoint,
            local_address,
            local_handle,
            remote_address,
            remote_handle,
            handle: Handle::default(),
            cbfunc,
            cbcontext,
            cbdata,
        };
        if let Some(rc) = super::resolve::hold_if_stale(&mut r, Again::Put { size }) {
            return rc;
        }
        let module = btl as *mut Module;
        // SAFETY: btl is our module.
        let state = unsafe { &(*module).state };
        if size > state.write_max.max(PUT_BY_READ_MIN) && state.put_by_read {
            // SAFETY: module is ours; the rest is the caller's put.
            return unsafe { super::put_by_read::post(r, size) };
        }
        let defer = (size <= state.write_max).then_some(Dir::Write);
        run(
            r,
            0,
            size,
            0,
            0,
            defer,
            |state, op, desc, dest, raddr, key| {
                if size > state.write_max {
                    // SAFETY: as for one write, below.
                    return unsafe {
                        put_in_parts(module, op, local_address, size, desc, dest, raddr, key)
                    };
                }
                // SAFETY: the local buffer and the remote region stay valid until the
                // completion (the BTL contract); op lives until then.
                state.fi(|| unsafe {
                    rma(
                        state,
                        Dir::Write,
                        local_address,
                        size,
                        desc,
                        dest,
                        raddr,
                        key,
                        op,
                    )
                })
            },
        )
    })
}

/// Which way an RMA operation moves data.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Dir {
    Write,
    Read,
}

/// Post one write of `len` bytes from `local`, or read into it, for `op`.
///
/// # Safety
/// `local` holds `len` bytes and the remote range is registered, both until the
/// completion; `op` lives until then.
#[allow(clippy::too_many_arguments)]
unsafe fn rma(
    state: &State,
    dir: Dir,
    local: *mut c_void,
    len: usize,
    desc: *mut c_void,
    dest: fi::fi_addr_t,
    raddr: u64,
    key: u64,
    op: *mut RdmaOp,
) -> Result<(), Error> {
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
    let tx = state.tx();
    // SAFETY: forwarded.
    unsafe {
        match (dir, flags) {
            (Dir::Write, 0) => tx.write(local, len, desc, dest, raddr, key, ctx_of(op)),
            (Dir::Write, f) => tx.write_flags(local, len, desc, dest, raddr, key, ctx_of(op), f),
            (Dir::Read, 0) => tx.read(local, len, desc, dest, raddr, key, ctx_of(op)),
            (Dir::Read, f) => tx.read_flags(local, len, desc, dest, raddr, key, ctx_of(op), f),
        }
    }
}

/// Post the put of `op` as writes of at most [`State::write_max`] bytes each, every
/// one with a context of its own; `op` completes with the last of them. Once one
/// part is posted this no longer fails: it waits out flow control with progress, and
/// a later part that cannot be posted completes the put with that error.
///
/// # Safety
/// As for [`rma`], for `size` bytes.
#[allow(clippy::too_many_arguments)]
unsafe fn put_in_parts(
    module: *mut Module,
    op: *mut RdmaOp,
    local: *mut c_void,
    size: usize,
    desc: *mut c_void,
    dest: fi::fi_addr_t,
    raddr: u64,
    key: u64,
) -> Result<(), Error> {
    // SAFETY: module is ours.
    let state = unsafe { &(*module).state };
    let step = state.write_max;
    let n = size.div_ceil(step);
    // SAFETY: op is ours and not posted; parts count down from n before any can
    // complete.
    unsafe { (*op).parts.store(n, Ordering::Release) };
    for i in 0..n {
        let off = i * step;
        let len = step.min(size - off);
        let part = Box::into_raw(Box::new(RdmaOp {
            ctx: Ctx::new(OpKind::Rdma),
            endpoint: ptr::null_mut(),
            local_address: ptr::null_mut(),
            local_handle: ptr::null_mut(),
            cbfunc: None,
            cbcontext: ptr::null_mut(),
            cbdata: ptr::null_mut(),
            operand: 0,
            compare: 0,
            temp: ptr::null_mut(),
            whole: op,
            parts: AtomicUsize::new(0),
            part_err: AtomicI32::new(0),
        }));
        // SAFETY: a part of the caller's range.
        let local = unsafe { (local as *mut u8).add(off) } as *mut c_void;
        let raddr = raddr.wrapping_add(off as u64);
        let res = loop {
            // SAFETY: the caller's contract, for this part.
            let res = state
                .fi(|| unsafe { rma(state, Dir::Write, local, len, desc, dest, raddr, key, part) });
            if res != Err(Error::AGAIN) || i == 0 {
                break res;
            }
            progress_module(module);
        };
        if let Err(e) = res {
            // SAFETY: not posted: still ours.
            drop(unsafe { Box::from_raw(part) });
            if i == 0 {
                // Nothing posted: the caller frees op (and retries on AGAIN).
                return Err(e);
            }
            log::warn!(
                "posting part {i} of {n} of a put on {}: {e}",
                state.provider
            );
            // SAFETY: op lives until its last posted part completes; the parts not
            // posted are taken off its count (which may make this the last).
            unsafe {
                let whole = &*op;
                let _ =
                    whole
                        .part_err
                        .compare_exchange(0, e.0, Ordering::AcqRel, Ordering::Relaxed);
                if whole.parts.fetch_sub(n - i, Ordering::AcqRel) == n - i {
                    rdma_complete(module, op as *mut c_void, e.0);
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
        let mut r = Req {
            mp: btl as *mut Module,
            endpoint,
            local_address,
            local_handle,
            remote_address,
            remote_handle,
            handle: Handle::default(),
            cbfunc,
            cbcontext,
            cbdata,
        };
        if let Some(rc) = super::resolve::hold_if_stale(&mut r, Again::Get { size }) {
            return rc;
        }
        run(
            r,
            1,
            size,
            0,
            0,
            Some(Dir::Read),
            |state, op, desc, dest, raddr, key| {
                // SAFETY: as in put.
                state.fi(|| unsafe {
                    rma(
                        state,
                        Dir::Read,
                        local_address,
                        size,
                        desc,
                        dest,
                        raddr,
                        key,
                        op,
                    )
                })
            },
        )
    })
}
