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
use super::module::{lock, Module, PeerEp};
use super::rdma::Req;
use super::registration::{Registration, HANDLE};
use super::resolve::Again;
use crate::common::IdMap;
use crate::ompi::btl::{rdma_args, RdmaCallback};
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

/// The word an atomic request targets: 4 or 8 bytes.
pub(super) enum Word<'a> {
    W32(&'a AtomicI32),
    W64(&'a AtomicI64),
}

/// Apply `kind` to `word`; returns the previous value (for 32 bits in the low 4
/// bytes, which is what the BTL hands back).
fn apply(kind: AtomicKind, word: Word<'_>, operand: u64, compare: u64) -> u64 {
    match word {
        Word::W32(a) => {
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
        }
        Word::W64(a) => {
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
}

/// An operation waiting for its reply.
pub(super) struct Pending {
    pub(super) module: &'static Module,
    pub(super) cb: RdmaCallback,
    /// Bytes of result to write at the caller's local address (0: not fetching).
    pub(super) result_width: usize,
    /// A put's registration of its source buffer (an atomic has none), given back at
    /// the reply.
    pub(super) reg: Option<Box<Registration>>,
}

// SAFETY: the module lives until teardown, which drops its entries first
// (`forget_module`); the callback's pointers are Open MPI's, valid until it is called
// (`RdmaCallback`); the registration is boxed and ours. An entry is used only by the
// thread that takes it out of the table.
unsafe impl Send for Pending {}

/// Registered ranges per (module, key): what a peer may target.
type Ranges = IdMap<(usize, u64), Vec<(usize, usize)>>;

pub(super) static PENDING: Mutex<Option<IdMap<u64, Pending>>> = Mutex::new(None);
static REGIONS: Mutex<Option<Ranges>> = Mutex::new(None);
pub(super) static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// What the tables know a module by.
fn id_of(module: &Module) -> usize {
    module as *const Module as usize
}

/// A registration handed to Open MPI (`register_mem`): peers may now target it.
pub fn note_region(module: &Module, key: u64, base: usize, len: usize) {
    lock(&REGIONS)
        .get_or_insert_with(IdMap::default)
        .entry((id_of(module), key))
        .or_default()
        .push((base, len));
}

/// The registration was given back (`deregister_mem`).
pub fn forget_region(module: &Module, key: u64, base: usize, len: usize) {
    let mut g = lock(&REGIONS);
    let Some(map) = g.as_mut() else { return };
    let id = (id_of(module), key);
    if let Some(v) = map.get_mut(&id) {
        if let Some(i) = v.iter().position(|&r| r == (base, len)) {
            v.swap_remove(i);
        }
        if v.is_empty() {
            map.remove(&id);
        }
    }
}

/// Whether `[addr, addr + width)` lies in a range registered under `key`.
fn target_ok(module: &Module, key: u64, addr: u64, width: usize) -> bool {
    if addr == 0 || !addr.is_multiple_of(width as u64) {
        return false;
    }
    let g = lock(&REGIONS);
    let Some(v) = g.as_ref().and_then(|m| m.get(&(id_of(module), key))) else {
        return false;
    };
    let (a, w) = (addr as usize, width);
    v.iter()
        .any(|&(b, l)| a >= b && a.checked_add(w).is_some_and(|e| e <= b + l))
}

/// Whether `[addr, addr + len)` lies in one range registered under `key`.
pub(super) fn range_ok(module: &Module, key: u64, addr: u64, len: u64) -> bool {
    let g = lock(&REGIONS);
    let Some(v) = g.as_ref().and_then(|m| m.get(&(id_of(module), key))) else {
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
pub fn forget_module(module: &Module) {
    let id = id_of(module);
    if let Some(m) = lock(&REGIONS).as_mut() {
        m.retain(|&(k, _), _| k != id);
    }
    if let Some(p) = lock(&PENDING).as_mut() {
        p.retain(|_, op| id_of(op.module) != id);
    }
}

/// This process's name, which the target answers to.
pub(super) fn my_name() -> (u32, u32) {
    crate::ompi::proc::local_name().unwrap_or((0, 0))
}

/// Send `bytes` under `tag` to `ep`. The fragment is the BTL's; it is recycled at its
/// completion.
pub(super) fn send(
    module: &'static Module,
    ep: *mut sys::mca_btl_base_endpoint_t,
    tag: u8,
    bytes: &[u8],
) -> c_int {
    let Some(mut f) = am::frag::get_frag(&module.state) else {
        return sys::OPAL_ERR_OUT_OF_RESOURCE;
    };
    // A free fragment has room for frag_payload >= REQ_LEN bytes.
    f.prime(
        ep,
        sys::MCA_BTL_NO_ORDER as u8,
        sys::MCA_BTL_DES_FLAGS_BTL_OWNERSHIP,
        bytes.len(),
    );
    f.payload_mut(0)[..bytes.len()].copy_from_slice(bytes);
    f.write_header(tag);
    am::send::send_frag(module, f).min(sys::OPAL_SUCCESS)
}

/// Check and hold (`resolve`) an emulated atomic, then post it.
fn start(
    r: Req,
    kind: AtomicKind,
    flags: c_int,
    operand: u64,
    compare: u64,
    again: Again,
) -> c_int {
    if flags as u32 & sys::MCA_BTL_ATOMIC_FLAG_FLOAT != 0 {
        return super::provider_atomics::UNSUPPORTED;
    }
    if r.peer.is_none() || r.handle.is_none() {
        return sys::OPAL_ERR_BAD_PARAM;
    }
    let mut r = r;
    if let Some(rc) = super::resolve::hold_if_stale(&mut r, again) {
        return rc;
    }
    emit(r, kind, flags, operand, compare)
}

/// Send the request of an emulated atomic (its handle checked by `resolve`).
fn emit(r: Req, kind: AtomicKind, flags: c_int, operand: u64, compare: u64) -> c_int {
    let (Some(peer), Some(handle)) = (r.peer, r.handle) else {
        return sys::OPAL_ERR_BAD_PARAM;
    };
    let width = width_of(flags);
    let fetching = !matches!(kind, AtomicKind::Op(_));
    if fetching && r.cb.local_address().is_null() {
        return sys::OPAL_ERR_BAD_PARAM;
    }
    let module = r.module;
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let req = Request {
        kind,
        width,
        origin: my_name(),
        id,
        addr: r.remote_address,
        key: handle.key,
        operand,
        compare,
    };
    lock(&PENDING).get_or_insert_with(IdMap::default).insert(
        id,
        Pending {
            module,
            cb: r.cb,
            result_width: if fetching { width } else { 0 },
            reg: None,
        },
    );
    let state = &module.state;
    state.rdma_outstanding.fetch_add(1, Ordering::AcqRel);
    let rc = send(module, peer.as_endpoint(), TAG_REQ, &req.encode());
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

/// Reissue a held emulated atomic with the handle found (`resolve`).
pub(super) fn reissue(r: Req, again: Again) -> c_int {
    let (kind, flags, operand, compare) = match again {
        Again::Op { op, operand, flags } => match Op::from_btl(op) {
            Some(o) => (AtomicKind::Op(o), flags, operand, 0),
            None => return super::provider_atomics::UNSUPPORTED,
        },
        Again::Fop { op, operand, flags } => match Op::from_btl(op) {
            Some(o) => (AtomicKind::Fop(o), flags, operand, 0),
            None => return super::provider_atomics::UNSUPPORTED,
        },
        Again::Cswap {
            compare,
            value,
            flags,
        } => (AtomicKind::Cswap, flags, value, compare),
        Again::Put { .. } | Again::Get { .. } => return sys::OPAL_ERR_BAD_PARAM,
    };
    if flags as u32 & sys::MCA_BTL_ATOMIC_FLAG_FLOAT != 0 {
        return super::provider_atomics::UNSUPPORTED;
    }
    emit(r, kind, flags, operand, compare)
}

/// A request or reply arrived (called from the receive path for our two tags).
pub fn on_message(module: &'static Module, tag: u8, bytes: &[u8]) {
    if tag == TAG_REQ {
        on_request(module, bytes);
    } else {
        on_reply(module, bytes);
    }
}

/// An atomic request arrived: apply it (where its target is registered) and answer
/// with the previous value.
fn on_request(module: &'static Module, bytes: &[u8]) {
    let state = &module.state;
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
        let addr = req.addr as usize;
        // SAFETY: target_ok found the word in memory this process registered for
        // remote access (register_mem) and has not deregistered, aligned to its width;
        // peers and this process's own CPU atomics reach it only atomically.
        let word = unsafe {
            if req.width == 4 {
                Word::W32(AtomicI32::from_ptr(addr as *mut i32))
            } else {
                Word::W64(AtomicI64::from_ptr(addr as *mut i64))
            }
        };
        (
            apply(req.kind, word, req.operand, req.compare),
            sys::OPAL_SUCCESS,
        )
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
    let rc = send(module, ep, TAG_REP, &rep.encode());
    if rc != sys::OPAL_SUCCESS {
        log::error!(
            "cannot answer an atomic request on {} ({rc}): the initiator will wait",
            state.provider
        );
    }
}

/// A reply arrived: complete the atomic (or the put by read) waiting for it.
fn on_reply(module: &'static Module, bytes: &[u8]) {
    let state = &module.state;
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
    if id_of(p.module) != id_of(module) {
        log::warn!("an atomic reply arrived on another module than its request");
    }
    if let Some(reg) = p.reg {
        // The put's registration; its read is over (the reply says so).
        super::registration::deregister(&p.module.state, reg);
    }
    if rep.status == sys::OPAL_SUCCESS && p.result_width > 0 {
        // Little-endian: the first bytes are the 32-bit value.
        p.cb.write_result(&rep.old.to_le_bytes()[..p.result_width]);
    }
    let status = if rep.status == sys::OPAL_SUCCESS {
        sys::OPAL_SUCCESS
    } else {
        sys::OPAL_ERROR
    };
    p.cb.complete(module.btl(), status);
    state.rdma_outstanding.fetch_sub(1, Ordering::AcqRel);
}

/// The endpoint of process `origin` on `module`.
pub(super) fn origin_ep(
    module: &'static Module,
    origin: (u32, u32),
) -> Option<*mut sys::mca_btl_base_endpoint_t> {
    lock(&module.state.peers)
        .iter()
        .find(|pe| {
            let n = pe.proc_.name();
            (n.jobid, n.vpid) == origin
        })
        .map(|pe| PeerEp::as_endpoint(pe))
}

/// The width of the operands an atomic with `flags` works on.
fn width_of(flags: c_int) -> usize {
    if flags as u32 & sys::MCA_BTL_ATOMIC_FLAG_32BIT != 0 {
        4
    } else {
        8
    }
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
        // SAFETY: the arguments of osc's atomic_op, as the BTL interface defines them
        // (no local buffer).
        let args = unsafe {
            rdma_args::<Module, PeerEp, Registration, HANDLE>(
                btl,
                endpoint,
                ptr::null_mut(),
                width_of(flags),
                ptr::null_mut(),
                remote_handle,
                cbfunc,
                cbcontext,
                cbdata,
            )
        };
        let r = Req::new(args, remote_address);
        start(
            r,
            AtomicKind::Op(o),
            flags,
            operand,
            0,
            Again::Op { op, operand, flags },
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
        // SAFETY: the arguments of osc's atomic_fop, as the BTL interface defines them:
        // the local buffer has room for the result until the callback.
        let args = unsafe {
            rdma_args::<Module, PeerEp, Registration, HANDLE>(
                btl,
                endpoint,
                local_address,
                width_of(flags),
                local_handle,
                remote_handle,
                cbfunc,
                cbcontext,
                cbdata,
            )
        };
        let r = Req::new(args, remote_address);
        start(
            r,
            AtomicKind::Fop(o),
            flags,
            operand,
            0,
            Again::Fop { op, operand, flags },
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
        // SAFETY: the arguments of osc's atomic_cswap, as the BTL interface defines
        // them: the local buffer has room for the result until the callback.
        let args = unsafe {
            rdma_args::<Module, PeerEp, Registration, HANDLE>(
                btl,
                endpoint,
                local_address,
                width_of(flags),
                local_handle,
                remote_handle,
                cbfunc,
                cbcontext,
                cbdata,
            )
        };
        let r = Req::new(args, remote_address);
        let again = Again::Cswap {
            compare,
            value,
            flags,
        };
        start(r, AtomicKind::Cswap, flags, value, compare, again)
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
        let w64 = AtomicI64::new(10);
        let w32 = AtomicI32::new(-4);
        let a = || Word::W64(&w64);
        assert_eq!(apply(AtomicKind::Fop(Op::Add), a(), 5, 0), 10);
        assert_eq!(apply(AtomicKind::Cswap, a(), 1, 15), 15);
        assert_eq!(apply(AtomicKind::Cswap, a(), 2, 15), 1);
        let b = || Word::W32(&w32);
        assert_eq!(
            apply(AtomicKind::Op(Op::Max), b(), 3, 0),
            (-4i32) as u32 as u64
        );
        assert_eq!(
            apply(AtomicKind::Fop(Op::Min), b(), (-9i32) as u32 as u64, 0),
            3
        );
        assert_eq!(w64.into_inner(), 1);
        assert_eq!(w32.into_inner(), -9);
    }
}
