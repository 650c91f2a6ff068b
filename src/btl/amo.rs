//! Atomics emulated with active messages, for providers without libfabric atomics
//! (`net`, or any provider with `btl_ofi_atomics=am`), so that osc rdma runs on every
//! provider.
//!
//! The initiator sends a request (operation, width, target address, the key of the
//! target's registration, operands) under a BTL-internal active-message tag. The
//! target's progress checks the address against the registrations it handed out with
//! `register_mem`, applies the operation with a CPU atomic instruction, and answers with
//! the previous value; the initiator writes it to the local result buffer and calls the
//! completion callback. Because the target uses CPU atomics, these operations are atomic
//! with respect to each other and to the target's own CPU atomics on the same word.
//!
//! Wire format (little-endian, after the 8-byte active-message header):
//! request: kind u8 (0 op, 1 fop, 2 cswap), width u8 (4 or 8), op u16, origin jobid
//! u32, origin vpid u32, 4 bytes padding, then id, address, key, operand, compare (u64
//! each): 56 bytes. Reply: id u64, old value u64, status i32, 4 bytes padding: 24 bytes.
//! Both are decoded by functions that reject anything out of range.
//!
//! Puts done by the target's read (`put_by_read.rs`) share the table of operations
//! waiting for a reply, the registered ranges and the reply itself.
//!
//! What it owns: the table of operations waiting for a reply, the table of
//! registered ranges a peer may target. What it must not touch: provider atomics
//! (`provider_atomics.rs`), the reads of puts by read (`put_by_read.rs`).

use super::am;
use super::module::{lock, Module};
use super::registration::{Handle, Registration};
use crate::common::IdMap;
use crate::ompi::component::ffi_guard;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

/// Active-message tags of the requests and replies (in the range Open MPI reserves
/// for BTL-internal messages, `MCA_BTL_TAG_BTL` + 0x10 and + 0x11).
pub const TAG_REQ: u8 = sys::MCA_BTL_TAG_BTL as u8 + 0x10;
pub const TAG_REP: u8 = sys::MCA_BTL_TAG_BTL as u8 + 0x11;

pub const REQ_LEN: usize = 56;
pub const REP_LEN: usize = 24;

/// What the emulation supports: every BTL operation on 64- and 32-bit integers, and
/// compare-and-swap.
pub const FLAGS: u32 = sys::MCA_BTL_ATOMIC_SUPPORTS_ADD
    | sys::MCA_BTL_ATOMIC_SUPPORTS_AND
    | sys::MCA_BTL_ATOMIC_SUPPORTS_OR
    | sys::MCA_BTL_ATOMIC_SUPPORTS_XOR
    | sys::MCA_BTL_ATOMIC_SUPPORTS_LAND
    | sys::MCA_BTL_ATOMIC_SUPPORTS_LOR
    | sys::MCA_BTL_ATOMIC_SUPPORTS_LXOR
    | sys::MCA_BTL_ATOMIC_SUPPORTS_SWAP
    | sys::MCA_BTL_ATOMIC_SUPPORTS_MIN
    | sys::MCA_BTL_ATOMIC_SUPPORTS_MAX
    | sys::MCA_BTL_ATOMIC_SUPPORTS_CSWAP
    | sys::MCA_BTL_ATOMIC_SUPPORTS_32BIT;

/// The operations, as the BTL interface numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Add,
    And,
    Or,
    Xor,
    Land,
    Lor,
    Lxor,
    Swap,
    Min,
    Max,
}

impl Op {
    pub fn from_btl(op: u32) -> Option<Op> {
        Some(match op {
            sys::MCA_BTL_ATOMIC_ADD => Op::Add,
            sys::MCA_BTL_ATOMIC_AND => Op::And,
            sys::MCA_BTL_ATOMIC_OR => Op::Or,
            sys::MCA_BTL_ATOMIC_XOR => Op::Xor,
            sys::MCA_BTL_ATOMIC_LAND => Op::Land,
            sys::MCA_BTL_ATOMIC_LOR => Op::Lor,
            sys::MCA_BTL_ATOMIC_LXOR => Op::Lxor,
            sys::MCA_BTL_ATOMIC_SWAP => Op::Swap,
            sys::MCA_BTL_ATOMIC_MIN => Op::Min,
            sys::MCA_BTL_ATOMIC_MAX => Op::Max,
            _ => return None,
        })
    }

    /// The new value from the old one and the operand (signed, as libfabric's
    /// FI_INT64/FI_INT32 atomics).
    fn apply(self, old: i64, v: i64) -> i64 {
        let b = |x: bool| x as i64;
        match self {
            Op::Add => old.wrapping_add(v),
            Op::And => old & v,
            Op::Or => old | v,
            Op::Xor => old ^ v,
            Op::Land => b(old != 0 && v != 0),
            Op::Lor => b(old != 0 || v != 0),
            Op::Lxor => b((old != 0) != (v != 0)),
            Op::Swap => v,
            Op::Min => old.min(v),
            Op::Max => old.max(v),
        }
    }
}

/// What the request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicKind {
    /// Non-fetching operation.
    Op(Op),
    /// Fetching operation.
    Fop(Op),
    /// Compare-and-swap.
    Cswap,
}

/// A decoded request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub kind: AtomicKind,
    pub width: usize,
    pub origin: (u32, u32),
    pub id: u64,
    pub addr: u64,
    pub key: u64,
    pub operand: u64,
    pub compare: u64,
}

/// A decoded reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    pub id: u64,
    pub old: u64,
    pub status: i32,
}

/// Why a message was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    Length(usize),
    Kind(u8),
    Width(u8),
    Op(u16),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Length(n) => write!(f, "length {n}"),
            DecodeError::Kind(k) => write!(f, "unknown request kind {k}"),
            DecodeError::Width(w) => write!(f, "operand width {w}"),
            DecodeError::Op(o) => write!(f, "unknown operation {o:#x}"),
        }
    }
}

/// Write `vals` little-endian from byte `at` of `b` on.
pub(super) fn put_u64s(b: &mut [u8], at: usize, vals: &[u64]) {
    for (i, v) in vals.iter().enumerate() {
        b[at + 8 * i..at + 8 * i + 8].copy_from_slice(&v.to_le_bytes());
    }
}

pub(super) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

pub(super) fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

impl Request {
    pub fn encode(&self) -> [u8; REQ_LEN] {
        let (kind, op) = match self.kind {
            AtomicKind::Op(o) => (0u8, o),
            AtomicKind::Fop(o) => (1u8, o),
            AtomicKind::Cswap => (2u8, Op::Swap),
        };
        let mut b = [0u8; REQ_LEN];
        b[0] = kind;
        b[1] = self.width as u8;
        b[2..4].copy_from_slice(&(op_code(op) as u16).to_le_bytes());
        b[4..8].copy_from_slice(&self.origin.0.to_le_bytes());
        b[8..12].copy_from_slice(&self.origin.1.to_le_bytes());
        put_u64s(
            &mut b,
            16,
            &[self.id, self.addr, self.key, self.operand, self.compare],
        );
        b
    }

    pub fn decode(b: &[u8]) -> Result<Request, DecodeError> {
        if b.len() != REQ_LEN {
            return Err(DecodeError::Length(b.len()));
        }
        let width = match b[1] {
            4 => 4,
            8 => 8,
            w => return Err(DecodeError::Width(w)),
        };
        let code = u16::from_le_bytes([b[2], b[3]]);
        let op = || Op::from_btl(code as u32).ok_or(DecodeError::Op(code));
        let kind = match b[0] {
            0 => AtomicKind::Op(op()?),
            1 => AtomicKind::Fop(op()?),
            2 => AtomicKind::Cswap,
            k => return Err(DecodeError::Kind(k)),
        };
        Ok(Request {
            kind,
            width,
            origin: (u32_at(b, 4), u32_at(b, 8)),
            id: u64_at(b, 16),
            addr: u64_at(b, 24),
            key: u64_at(b, 32),
            operand: u64_at(b, 40),
            compare: u64_at(b, 48),
        })
    }
}

impl Reply {
    pub fn encode(&self) -> [u8; REP_LEN] {
        let mut b = [0u8; REP_LEN];
        b[0..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..16].copy_from_slice(&self.old.to_le_bytes());
        b[16..20].copy_from_slice(&self.status.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Reply, DecodeError> {
        if b.len() != REP_LEN {
            return Err(DecodeError::Length(b.len()));
        }
        Ok(Reply {
            id: u64_at(b, 0),
            old: u64_at(b, 8),
            status: u32_at(b, 16) as i32,
        })
    }
}

fn op_code(op: Op) -> u32 {
    match op {
        Op::Add => sys::MCA_BTL_ATOMIC_ADD,
        Op::And => sys::MCA_BTL_ATOMIC_AND,
        Op::Or => sys::MCA_BTL_ATOMIC_OR,
        Op::Xor => sys::MCA_BTL_ATOMIC_XOR,
        Op::Land => sys::MCA_BTL_ATOMIC_LAND,
        Op::Lor => sys::MCA_BTL_ATOMIC_LOR,
        Op::Lxor => sys::MCA_BTL_ATOMIC_LXOR,
        Op::Swap => sys::MCA_BTL_ATOMIC_SWAP,
        Op::Min => sys::MCA_BTL_ATOMIC_MIN,
        Op::Max => sys::MCA_BTL_ATOMIC_MAX,
    }
}

/// Apply `kind` to the `width`-byte word at `addr`; returns the previous value
/// (for 32 bits in the low 4 bytes, which is what the BTL hands back).
///
/// # Safety
/// `addr` is aligned to `width` and `width` bytes there are mapped, writable memory
/// that other parties only access atomically.
unsafe fn apply(kind: AtomicKind, width: usize, addr: usize, operand: u64, compare: u64) -> u64 {
    if width == 4 {
        // SAFETY: caller's contract.
        let a = unsafe { AtomicI32::from_ptr(addr as *mut i32) };
        let (v, c) = (operand as i32, compare as i32);
        let old = match kind {
            AtomicKind::Cswap => {
                match a.compare_exchange(c, v, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(o) | Err(o) => o,
                }
            }
            AtomicKind::Op(op) | AtomicKind::Fop(op) => {
                match a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| {
                    Some(op.apply(o as i64, v as i64) as i32)
                }) {
                    Ok(o) | Err(o) => o,
                }
            }
        };
        old as u32 as u64
    } else {
        // SAFETY: caller's contract.
        let a = unsafe { AtomicI64::from_ptr(addr as *mut i64) };
        let (v, c) = (operand as i64, compare as i64);
        let old = match kind {
            AtomicKind::Cswap => {
                match a.compare_exchange(c, v, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(o) | Err(o) => o,
                }
            }
            AtomicKind::Op(op) | AtomicKind::Fop(op) => {
                match a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| {
                    Some(op.apply(o, v))
                }) {
                    Ok(o) | Err(o) => o,
                }
            }
        };
        old as u64
    }
}

/// An operation waiting for its reply.
pub(super) struct Pending {
    pub(super) mp: *mut Module,
    pub(super) endpoint: *mut sys::mca_btl_base_endpoint_t,
    pub(super) local_address: *mut c_void,
    pub(super) local_handle: *mut sys::mca_btl_base_registration_handle_t,
    pub(super) cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    pub(super) cbcontext: *mut c_void,
    pub(super) cbdata: *mut c_void,
    /// Bytes of result to write at `local_address` (0: not fetching).
    pub(super) result_width: usize,
    /// A put's registration of its source buffer (null for an atomic), given back at
    /// the reply.
    pub(super) reg: *mut Registration,
}

// SAFETY: the pointers are Open MPI's, handed to us for the duration of the operation;
// the entry is only used by the one thread that takes it out of the table.
unsafe impl Send for Pending {}

/// Registered ranges per (module, key): what a peer may target.
type Ranges = IdMap<(usize, u64), Vec<(usize, usize)>>;

pub(super) static PENDING: Mutex<Option<IdMap<u64, Pending>>> = Mutex::new(None);
static REGIONS: Mutex<Option<Ranges>> = Mutex::new(None);
pub(super) static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A registration handed to Open MPI (`register_mem`): peers may now target it.
pub fn note_region(module: *mut Module, key: u64, base: usize, len: usize) {
    lock(&REGIONS)
        .get_or_insert_with(IdMap::default)
        .entry((module as usize, key))
        .or_default()
        .push((base, len));
}

/// The registration was given back (`deregister_mem`).
pub fn forget_region(module: *mut Module, key: u64, base: usize, len: usize) {
    let mut g = lock(&REGIONS);
    let Some(map) = g.as_mut() else { return };
    if let Some(v) = map.get_mut(&(module as usize, key)) {
        if let Some(i) = v.iter().position(|&r| r == (base, len)) {
            v.swap_remove(i);
        }
        if v.is_empty() {
            map.remove(&(module as usize, key));
        }
    }
}

/// Whether `[addr, addr + width)` lies in a range registered under `key`.
fn target_ok(module: *mut Module, key: u64, addr: u64, width: usize) -> bool {
    if addr == 0 || !addr.is_multiple_of(width as u64) {
        return false;
    }
    let g = lock(&REGIONS);
    let Some(v) = g.as_ref().and_then(|m| m.get(&(module as usize, key))) else {
        return false;
    };
    let (a, w) = (addr as usize, width);
    v.iter()
        .any(|&(b, l)| a >= b && a.checked_add(w).is_some_and(|e| e <= b + l))
}

/// Whether `[addr, addr + len)` lies in one range registered under `key`.
pub(super) fn range_ok(module: *mut Module, key: u64, addr: u64, len: u64) -> bool {
    let g = lock(&REGIONS);
    let Some(v) = g.as_ref().and_then(|m| m.get(&(module as usize, key))) else {
        return false;
    };
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    addr != 0
        && v.iter()
            .any(|&(b, l)| addr >= b as u64 && end <= (b as u64).saturating_add(l as u64))
}

/// Drop every record of `module` (finalize).
pub fn forget_module(module: *mut Module) {
    if let Some(m) = lock(&REGIONS).as_mut() {
        m.retain(|&(k, _), _| k != module as usize);
    }
    if let Some(p) = lock(&PENDING).as_mut() {
        p.retain(|_, op| op.mp != module);
    }
}

/// This process's name, which the target answers to.
pub(super) fn my_name() -> (u32, u32) {
    crate::ompi::proc::local_name().unwrap_or((0, 0))
}

/// Send `bytes` under `tag` to `ep`. The fragment is the BTL's; it is recycled at its
/// completion.
pub(super) fn send(
    module: *mut Module,
    ep: *mut sys::mca_btl_base_endpoint_t,
    tag: u8,
    bytes: &[u8],
) -> c_int {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    let Some(f) = am::frag::get_frag(state) else {
        return sys::OPAL_ERR_OUT_OF_RESOURCE;
    };
    // SAFETY: f is a free fragment with room for frag_payload >= REQ_LEN bytes.
    unsafe {
        am::frag::prime(
            f,
            ep,
            sys::MCA_BTL_NO_ORDER as u8,
            sys::MCA_BTL_DES_FLAGS_BTL_OWNERSHIP,
            bytes.len(),
        );
        ptr::copy_nonoverlapping(bytes.as_ptr(), (*f).buf.add(am::wire::HDR), bytes.len());
        am::frag::write_header(f, tag);
        am::send::send_frag(module, f).min(sys::OPAL_SUCCESS)
    }
}

/// Post one emulated atomic.
#[allow(clippy::too_many_arguments)]
fn start(
    btl: *mut sys::mca_btl_base_module_t,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    remote_address: u64,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    kind: AtomicKind,
    flags: c_int,
    operand: u64,
    compare: u64,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
    again: super::resolve::Again,
) -> c_int {
    if flags as u32 & sys::MCA_BTL_ATOMIC_FLAG_FLOAT != 0 {
        return super::provider_atomics::UNSUPPORTED;
    }
    if endpoint.is_null() || remote_handle.is_null() {
        return sys::OPAL_ERR_BAD_PARAM;
    }
    let mut r = super::rdma::Req {
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
    if let Some(rc) = super::resolve::hold_if_stale(&mut r, again) {
        return rc;
    }
    let width = if flags as u32 & sys::MCA_BTL_ATOMIC_FLAG_32BIT != 0 {
        4
    } else {
        8
    };
    let fetching = !matches!(kind, AtomicKind::Op(_));
    if fetching && local_address.is_null() {
        return sys::OPAL_ERR_BAD_PARAM;
    }
    let module = btl as *mut Module;
    let key = r.handle.key;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let req = Request {
        kind,
        width,
        origin: my_name(),
        id,
        addr: remote_address,
        key,
        operand,
        compare,
    };
    lock(&PENDING).get_or_insert_with(IdMap::default).insert(
        id,
        Pending {
            mp: module,
            endpoint,
            local_address,
            local_handle,
            cbfunc,
            cbcontext,
            cbdata,
            result_width: if fetching { width } else { 0 },
            reg: ptr::null_mut(),
        },
    );
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    state.rdma_outstanding.fetch_add(1, Ordering::AcqRel);
    let rc = send(module, endpoint, TAG_REQ, &req.encode());
    if rc != sys::OPAL_SUCCESS {
        state.rdma_outstanding.fetch_sub(1, Ordering::AcqRel);
        if let Some(p) = lock(&PENDING).as_mut() {
            p.remove(&id);
        }
        return rc;
    }
    let i = match kind {
        AtomicKind::Op(_) => 2,
        AtomicKind::Fop(_) => 3,
        AtomicKind::Cswap => 4,
    };
    state.ops[i].fetch_add(1, Ordering::Relaxed);
    sys::OPAL_SUCCESS
}

/// A request or reply arrived (called from the receive path for our two tags).
///
/// # Safety
/// `module` is live; `payload` holds `len` received bytes.
pub unsafe fn on_message(module: *mut Module, tag: u8, payload: *const u8, len: usize) {
    // SAFETY: caller's contract.
    let bytes = unsafe { std::slice::from_raw_parts(payload, len) };
    if tag == TAG_REQ {
        on_request(module, bytes);
    } else {
        on_reply(module, bytes);
    }
}

/// An atomic request arrived: apply it (where its target is registered) and answer
/// with the previous value.
fn on_request(module: *mut Module, bytes: &[u8]) {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    let req = match Request::decode(bytes) {
        Ok(r) => r,
        Err(e) => {
            log::warn!(
                "dropping a malformed atomic request on {}: {e}",
                state.provider
            );
            return;
        }
    };
    // The origin, to answer to.
    let Some(ep) = origin_ep(module, req.origin) else {
        log::warn!(
            "dropping an atomic request from an unknown process ({}, {}) on {}",
            req.origin.0,
            req.origin.1,
            state.provider
        );
        return;
    };
    let (old, status) = if target_ok(module, req.key, req.addr, req.width) {
        // SAFETY: the word lies in memory this process registered for remote
        // access and has not deregistered, aligned to its width.
        let old = unsafe {
            apply(
                req.kind,
                req.width,
                req.addr as usize,
                req.operand,
                req.compare,
            )
        };
        (old, sys::OPAL_SUCCESS)
    } else {
        log::warn!(
            "refusing an atomic on {:#x} (key {:#x}, {} bytes) from process {}: not in a registered region",
            req.addr,
            req.key,
            req.width,
            req.origin.1
        );
        (0, sys::OPAL_ERR_BAD_PARAM)
    };
    let rep = Reply {
        id: req.id,
        old,
        status,
    };
    let rc = send(module, ep as *mut _, TAG_REP, &rep.encode());
    if rc != sys::OPAL_SUCCESS {
        log::error!(
            "cannot answer an atomic request on {} ({rc}): the initiator will wait",
            state.provider
        );
    }
}

/// A reply arrived: complete the atomic (or the put by read) waiting for it.
fn on_reply(module: *mut Module, bytes: &[u8]) {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    let rep = match Reply::decode(bytes) {
        Ok(r) => r,
        Err(e) => {
            log::warn!(
                "dropping a malformed atomic reply on {}: {e}",
                state.provider
            );
            return;
        }
    };
    let Some(p) = lock(&PENDING).as_mut().and_then(|m| m.remove(&rep.id)) else {
        log::warn!(
            "dropping an atomic reply for unknown operation {} on {}",
            rep.id,
            state.provider
        );
        return;
    };
    if p.mp != module {
        log::warn!("an atomic reply arrived on another module than its request");
    }
    if !p.reg.is_null() {
        // SAFETY: the put's registration; its read is over (the reply says so).
        unsafe { super::registration::deregister(&(*p.mp).state, p.reg) };
    }
    if rep.status == sys::OPAL_SUCCESS && p.result_width > 0 {
        // SAFETY: the caller's result buffer holds result_width bytes until we
        // call back (little-endian: the first bytes are the 32-bit value).
        unsafe {
            ptr::copy_nonoverlapping(
                rep.old.to_le_bytes().as_ptr(),
                p.local_address as *mut u8,
                p.result_width,
            )
        };
    }
    let status = if rep.status == sys::OPAL_SUCCESS {
        sys::OPAL_SUCCESS
    } else {
        sys::OPAL_ERROR
    };
    if let Some(cb) = p.cbfunc {
        // SAFETY: the caller's callback with its own arguments.
        unsafe {
            cb(
                module as *mut _,
                p.endpoint,
                p.local_address,
                p.local_handle,
                p.cbcontext,
                p.cbdata,
                status,
            )
        };
    }
    state.rdma_outstanding.fetch_sub(1, Ordering::AcqRel);
}

/// The endpoint of process `origin` on `module`.
pub(super) fn origin_ep(
    module: *mut Module,
    origin: (u32, u32),
) -> Option<*mut super::module::PeerEp> {
    // SAFETY: module is live.
    let state = unsafe { &(*module).state };
    lock(&state.peers).iter().copied().find(|&pe| {
        // SAFETY: listed peers are live until del_procs.
        let n = unsafe { (*(*pe).proc_).proc_name };
        (n.jobid, n.vpid) == origin
    })
}

pub(crate) extern "C" fn btl_atomic_op(
    btl: *mut sys::mca_btl_base_module_t,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    remote_address: u64,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    op: sys::mca_btl_base_atomic_op_t,
    operand: u64,
    flags: c_int,
    _order: c_int,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
) -> c_int {
    ffi_guard("btl atomic_op (am)", sys::OPAL_ERROR, || {
        let Some(o) = Op::from_btl(op) else {
            return super::provider_atomics::UNSUPPORTED;
        };
        start(
            btl,
            endpoint,
            ptr::null_mut(),
            ptr::null_mut(),
            remote_address,
            remote_handle,
            AtomicKind::Op(o),
            flags,
            operand,
            0,
            cbfunc,
            cbcontext,
            cbdata,
            super::resolve::Again::Op { op, operand, flags },
        )
    })
}

pub(crate) extern "C" fn btl_atomic_fop(
    btl: *mut sys::mca_btl_base_module_t,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    remote_address: u64,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    op: sys::mca_btl_base_atomic_op_t,
    operand: u64,
    flags: c_int,
    _order: c_int,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
) -> c_int {
    ffi_guard("btl atomic_fop (am)", sys::OPAL_ERROR, || {
        let Some(o) = Op::from_btl(op) else {
            return super::provider_atomics::UNSUPPORTED;
        };
        start(
            btl,
            endpoint,
            local_address,
            local_handle,
            remote_address,
            remote_handle,
            AtomicKind::Fop(o),
            flags,
            operand,
            0,
            cbfunc,
            cbcontext,
            cbdata,
            super::resolve::Again::Fop { op, operand, flags },
        )
    })
}

pub(crate) extern "C" fn btl_atomic_cswap(
    btl: *mut sys::mca_btl_base_module_t,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    remote_address: u64,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    compare: u64,
    value: u64,
    flags: c_int,
    _order: c_int,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
) -> c_int {
    ffi_guard("btl atomic_cswap (am)", sys::OPAL_ERROR, || {
        start(
            btl,
            endpoint,
            local_address,
            local_handle,
            remote_address,
            remote_handle,
            AtomicKind::Cswap,
            flags,
            value,
            compare,
            cbfunc,
            cbcontext,
            cbdata,
            super::resolve::Again::Cswap {
                compare,
                value,
                flags,
            },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Request {
        Request {
            kind: AtomicKind::Fop(Op::Max),
            width: 4,
            origin: (7, 3),
            id: 42,
            addr: 0x7fff_0000_1000,
            key: 9,
            operand: u64::MAX,
            compare: 5,
        }
    }

    #[test]
    fn requests_and_replies_round_trip() {
        let r = sample();
        assert_eq!(Request::decode(&r.encode()), Ok(r));
        let c = Request {
            kind: AtomicKind::Cswap,
            ..r
        };
        assert_eq!(Request::decode(&c.encode()), Ok(c));
        let p = Reply {
            id: 1,
            old: 2,
            status: -3,
        };
        assert_eq!(Reply::decode(&p.encode()), Ok(p));
    }

    #[test]
    fn malformed_requests_are_rejected() {
        let b = sample().encode();
        assert_eq!(Request::decode(&b[..55]), Err(DecodeError::Length(55)));
        let mut w = b;
        w[1] = 2;
        assert_eq!(Request::decode(&w), Err(DecodeError::Width(2)));
        let mut k = b;
        k[0] = 3;
        assert_eq!(Request::decode(&k), Err(DecodeError::Kind(3)));
        let mut o = b;
        o[2..4].copy_from_slice(&0x7777u16.to_le_bytes());
        assert_eq!(Request::decode(&o), Err(DecodeError::Op(0x7777)));
        assert_eq!(Reply::decode(&[0; 23]), Err(DecodeError::Length(23)));
    }

    #[test]
    fn operations_match_the_btl_definitions() {
        assert_eq!(Op::Add.apply(5, -7), -2);
        assert_eq!(Op::And.apply(0b1100, 0b1010), 0b1000);
        assert_eq!(Op::Or.apply(0b1100, 0b1010), 0b1110);
        assert_eq!(Op::Xor.apply(0b1100, 0b1010), 0b0110);
        assert_eq!(Op::Land.apply(3, 0), 0);
        assert_eq!(Op::Land.apply(3, 4), 1);
        assert_eq!(Op::Lor.apply(0, 0), 0);
        assert_eq!(Op::Lor.apply(0, 9), 1);
        assert_eq!(Op::Lxor.apply(2, 9), 0);
        assert_eq!(Op::Lxor.apply(0, 9), 1);
        assert_eq!(Op::Swap.apply(1, 2), 2);
        assert_eq!(Op::Min.apply(-1, 1), -1);
        assert_eq!(Op::Max.apply(-1, 1), 1);
    }

    #[test]
    fn cpu_atomics_on_32_and_64_bits() {
        let mut w64: i64 = 10;
        let mut w32: i32 = -4;
        // SAFETY: aligned locals, only touched here.
        unsafe {
            let a = &mut w64 as *mut i64 as usize;
            assert_eq!(apply(AtomicKind::Fop(Op::Add), 8, a, 5, 0), 10);
            assert_eq!(apply(AtomicKind::Cswap, 8, a, 1, 15), 15);
            assert_eq!(apply(AtomicKind::Cswap, 8, a, 2, 15), 1);
            let b = &mut w32 as *mut i32 as usize;
            assert_eq!(
                apply(AtomicKind::Op(Op::Max), 4, b, 3, 0),
                (-4i32) as u32 as u64
            );
            assert_eq!(
                apply(AtomicKind::Fop(Op::Min), 4, b, (-9i32) as u32 as u64, 0),
                3
            );
        }
        assert_eq!(w64, 1);
        assert_eq!(w32, -9);
    }
}
