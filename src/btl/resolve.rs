//! Remote handles that do not cover their target: the operation is held, the target
//! is asked for the registration that does, and the operation runs again with it.
//!
//! Why: Open MPI 4.1.4's osc rdma, on a dynamic window whose ranks share a node,
//! passes the BTL a pointer into the target's table of attached regions, which lives
//! in shared memory, after it released the table's lock
//! (`ompi_osc_rdma_find_dynamic_region`, then `osc_rdma_get_remote_segment` takes
//! `region->btl_handle_data`). If the target attaches a region below that one in the
//! meantime, `ompi_osc_rdma_attach` moves the table up by one entry (`memmove`), and
//! the handle the BTL reads is the neighbouring region's. The provider then refuses
//! the access: MPICH's `rma/linked_list_lockall` over tcp failed in 10 runs of 30 with
//! "target region ... out of registered range" and `MPI_ERR_RMA_RANGE`. A BTL that
//! registers nothing (vader) never reads the handle, so stock Open MPI does not show
//! it.
//!
//! How: every `Handle` carries the range its registration covers. An operation
//! (put, get or atomic, native or emulated) whose target range lies outside its handle
//! is held here, and a find request (the target address and length) goes to the target
//! as an active message. The target answers with the handle of a live registration
//! that covers the range (in its cache, or made outside it: `State::outside`), or with
//! none. The operation is then issued again, from progress, through the module's own
//! path for it (what its entry point runs after the check), with the handle found; if none was found, it fails with
//! `OPAL_ERR_PERM` (the target has no registration there, so no handle could reach
//! it). The normal path pays one comparison and a 5-word hash per operation.
//!
//! Wire format (little-endian, after the 8-byte active-message header). Find: origin
//! jobid u32, origin vpid u32, then id, address, length (u64 each): 32 bytes. Found: id
//! u64, found u32 (0 or 1), 4 bytes padding, then the handle (key, base, start, end,
//! check, u64 each): 56 bytes.
//!
//! What it owns: the held operations, and those found but not yet issued again.

use super::amo;
use super::module::{lock, Module};
use super::rdma::Req;
use super::registration::{self, Handle};
use crate::common::IdMap;
use ompi_sys as sys;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Active-message tags of a find request and its answer (`MCA_BTL_TAG_BTL` + 0x13 and
/// + 0x14, after those of `amo`).
pub const TAG_FIND: u8 = sys::MCA_BTL_TAG_BTL as u8 + 0x13;
pub const TAG_FOUND: u8 = sys::MCA_BTL_TAG_BTL as u8 + 0x14;

pub const FIND_LEN: usize = 32;
pub const FOUND_LEN: usize = 56;

/// The entry point an operation came through, with its own arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Again {
    Put {
        size: usize,
    },
    Get {
        size: usize,
    },
    Op {
        op: sys::mca_btl_base_atomic_op_t,
        operand: u64,
        flags: c_int,
    },
    Fop {
        op: sys::mca_btl_base_atomic_op_t,
        operand: u64,
        flags: c_int,
    },
    Cswap {
        compare: u64,
        value: u64,
        flags: c_int,
    },
}

impl Again {
    /// Bytes the operation touches at the target.
    pub fn target_len(&self) -> usize {
        match *self {
            Again::Put { size } | Again::Get { size } => size,
            Again::Op { flags, .. } | Again::Fop { flags, .. } | Again::Cswap { flags, .. } => {
                if flags as u32 & sys::MCA_BTL_ATOMIC_FLAG_32BIT != 0 {
                    4
                } else {
                    8
                }
            }
        }
    }
}

/// A find request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Find {
    pub origin: (u32, u32),
    pub id: u64,
    pub addr: u64,
    pub len: u64,
}

impl Find {
    pub fn encode(&self) -> [u8; FIND_LEN] {
        let mut b = [0u8; FIND_LEN];
        b[0..4].copy_from_slice(&self.origin.0.to_le_bytes());
        b[4..8].copy_from_slice(&self.origin.1.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Find, amo::DecodeError> {
        if b.len() != FIND_LEN {
            return Err(amo::DecodeError::Length(b.len()));
        }
        Ok(Find {
            origin: (u32_at(b, 0), u32_at(b, 4)),
            id: u64_at(b, 8),
            addr: u64_at(b, 16),
            len: u64_at(b, 24),
        })
    }
}

/// The answer to a find request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub id: u64,
    pub handle: Option<Handle>,
}

impl Found {
    pub fn encode(&self) -> [u8; FOUND_LEN] {
        let mut b = [0u8; FOUND_LEN];
        b[0..8].copy_from_slice(&self.id.to_le_bytes());
        if let Some(h) = self.handle {
            b[8..12].copy_from_slice(&1u32.to_le_bytes());
            b[16..24].copy_from_slice(&h.key.to_le_bytes());
            b[24..32].copy_from_slice(&h.base.to_le_bytes());
            b[32..40].copy_from_slice(&h.start.to_le_bytes());
            b[40..48].copy_from_slice(&h.end.to_le_bytes());
            b[48..56].copy_from_slice(&h.check.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<Found, amo::DecodeError> {
        if b.len() != FOUND_LEN {
            return Err(amo::DecodeError::Length(b.len()));
        }
        let handle = match u32_at(b, 8) {
            0 => None,
            1 => Some(Handle {
                key: u64_at(b, 16),
                base: u64_at(b, 24),
                start: u64_at(b, 32),
                end: u64_at(b, 40),
                check: u64_at(b, 48),
            }),
            k => return Err(amo::DecodeError::Kind(k.min(255) as u8)),
        };
        Ok(Found {
            id: u64_at(b, 0),
            handle,
        })
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A held operation: its entry point's arguments (`req.handle` is the handle it came
/// with).
struct Held {
    req: Req,
    again: Again,
}

// SAFETY: the request's pointers are Open MPI's, valid for the operation's duration
// (`Req::from_entry`), and its module lives until teardown, which drops what it holds
// first (`forget_module`); an entry is used only by the thread that takes it out of
// its table.
unsafe impl Send for Held {}

static HELD: Mutex<Option<IdMap<u64, Held>>> = Mutex::new(None);
/// Operations answered and waiting to be issued again with the handle found, or to
/// fail (none found).
static READY: Mutex<Vec<(Held, Option<Handle>)>> = Mutex::new(Vec::new());
static HAS_READY: AtomicBool = AtomicBool::new(false);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// Operations that were held, and of those, how many the target found a handle for.
pub static HELD_OPS: AtomicU64 = AtomicU64::new(0);
pub static FOUND_OPS: AtomicU64 = AtomicU64::new(0);

/// Called first by each RDMA and atomic entry point, whose request holds the remote
/// handle as read, once (the original may change under us: that is the race this
/// module is for). If it does not cover the operation's target range, the operation
/// is held and the target asked, and the entry point returns what this returns.
/// `None`: go on.
pub(super) fn hold_if_stale(req: &mut Req, again: Again) -> Option<c_int> {
    let (Some(peer), Some(had)) = (req.peer, req.handle) else {
        return None;
    };
    let len = again.target_len();
    if had.covers(req.remote_address, len) {
        return None;
    }
    let state = &req.module.state;
    if !state.two_sided {
        // No active messages to ask with: the provider decides.
        return None;
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    log::debug!(
        "a remote handle (key {:#x}, {:#x}..{:#x}) does not cover the target {:#x} ({len} bytes) \
         on {}: asking the target (operation {id})",
        had.key,
        had.start,
        had.end,
        req.remote_address,
        state.provider
    );
    lock(&HELD)
        .get_or_insert_with(IdMap::default)
        .insert(id, Held { req: *req, again });
    state.rdma_outstanding.fetch_add(1, Ordering::AcqRel);
    let find = Find {
        origin: amo::my_name(),
        id,
        addr: req.remote_address,
        len: len as u64,
    };
    let rc = amo::send(req.module, peer.as_endpoint(), TAG_FIND, &find.encode());
    if rc != sys::OPAL_SUCCESS {
        state.rdma_outstanding.fetch_sub(1, Ordering::AcqRel);
        if let Some(m) = lock(&HELD).as_mut() {
            m.remove(&id);
        }
        return Some(rc);
    }
    HELD_OPS.fetch_add(1, Ordering::Relaxed);
    Some(sys::OPAL_SUCCESS)
}

/// A find request or its answer arrived.
pub fn on_message(module: &'static Module, tag: u8, bytes: &[u8]) {
    let state = &module.state;
    if tag == TAG_FIND {
        let find = match Find::decode(bytes) {
            Ok(f) => f,
            Err(e) => {
                log::warn!(
                    "dropping a malformed find request on {}: {e}",
                    state.provider
                );
                return;
            }
        };
        let Some(ep) = amo::origin_ep(module, find.origin) else {
            log::warn!(
                "dropping a find request from an unknown process ({}, {}) on {}",
                find.origin.0,
                find.origin.1,
                state.provider
            );
            return;
        };
        let handle = usize::try_from(find.len)
            .ok()
            .and_then(|n| registration::live_handle(state, find.addr, n));
        let rep = Found {
            id: find.id,
            handle,
        };
        let rc = amo::send(module, ep, TAG_FOUND, &rep.encode());
        if rc != sys::OPAL_SUCCESS {
            log::error!(
                "cannot answer a find request on {} ({rc}): the initiator will wait",
                state.provider
            );
        }
        return;
    }
    let rep = match Found::decode(bytes) {
        Ok(r) => r,
        Err(e) => {
            log::warn!(
                "dropping a malformed find answer on {}: {e}",
                state.provider
            );
            return;
        }
    };
    let Some(held) = lock(&HELD).as_mut().and_then(|m| m.remove(&rep.id)) else {
        log::warn!(
            "dropping a find answer for unknown operation {} on {}",
            rep.id,
            state.provider
        );
        return;
    };
    log::debug!(
        "operation {}: the target has {}",
        rep.id,
        rep.handle
            .map_or("no registration covering it".to_string(), |h| format!(
                "key {:#x}, {:#x}..{:#x}",
                h.key, h.start, h.end
            ))
    );
    match rep.handle {
        Some(_) => {
            FOUND_OPS.fetch_add(1, Ordering::Relaxed);
        }
        None => {
            log::warn!(
                "a one-sided operation on {} addresses {:#x} ({} bytes) at its target, which \
                 has no registration there: it fails",
                state.provider,
                held.req.remote_address,
                held.again.target_len()
            );
        }
    }
    lock(&READY).push((held, rep.handle));
    HAS_READY.store(true, Ordering::Release);
}

/// Issue again the answered operations of `module` (from its progress), until the
/// provider pushes back.
pub(super) fn reissue(module: &'static Module) {
    if !HAS_READY.load(Ordering::Acquire) {
        return;
    }
    let mine: Vec<(Held, Option<Handle>)> = {
        let mut q = lock(&READY);
        let (mine, rest): (Vec<_>, Vec<_>) = q
            .drain(..)
            .partition(|(h, _)| std::ptr::eq(h.req.module, module));
        *q = rest;
        HAS_READY.store(!q.is_empty(), Ordering::Release);
        mine
    };
    let mut it = mine.into_iter();
    while let Some((held, handle)) = it.next() {
        let rc = match handle {
            Some(h) => issue(&held, h),
            // The access is to memory the target has not registered (or no longer
            // has). Not to the provider: shm (1.17) never completes an access with an
            // unknown key ("error processing command" at the target), so the origin
            // would wait forever; tcp;ofi_rxm reports -FI_EACCES, which this matches.
            None => sys::OPAL_ERR_PERM,
        };
        if rc == sys::OPAL_ERR_OUT_OF_RESOURCE {
            let mut q = lock(&READY);
            q.push((held, handle));
            q.extend(it);
            HAS_READY.store(true, Ordering::Release);
            return;
        }
        module.state.rdma_outstanding.fetch_sub(1, Ordering::AcqRel);
        if rc != sys::OPAL_SUCCESS {
            held.req.cb.complete(module.btl(), rc);
        }
    }
}

/// Run the operation of `held` again with `handle`, as its entry point would after
/// the handle check, through the module's own path for it (the entry points the
/// module's table holds: emulated atomics where `State::amo`, else the provider's).
fn issue(held: &Held, handle: Handle) -> c_int {
    let mut req = held.req;
    req.handle = Some(handle);
    match held.again {
        Again::Put { size } => super::rdma::put(req, size),
        Again::Get { .. } => super::rdma::get(req),
        again if req.module.state.amo => amo::reissue(req, again),
        again => super::provider_atomics::reissue(req, again),
    }
}

/// Drop what `module` holds (finalize: Open MPI no longer waits for it).
pub(super) fn forget_module(module: &Module) {
    if let Some(m) = lock(&HELD).as_mut() {
        m.retain(|_, h| !std::ptr::eq(h.req.module, module));
    }
    let mut q = lock(&READY);
    q.retain(|(h, _)| !std::ptr::eq(h.req.module, module));
    HAS_READY.store(!q.is_empty(), Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_round_trip() {
        let f = Find {
            origin: (7, 3),
            id: 42,
            addr: 0x0005_563e_f2be_71f0,
            len: 8,
        };
        assert_eq!(Find::decode(&f.encode()), Ok(f));
        assert!(Find::decode(&f.encode()[..31]).is_err());
    }

    #[test]
    fn found_round_trip() {
        let h = Handle::sealed(9, 0, 0x7000, 0x8000);
        for handle in [Some(h), None] {
            let f = Found { id: 5, handle };
            assert_eq!(Found::decode(&f.encode()), Ok(f));
        }
        let mut b = Found {
            id: 1,
            handle: None,
        }
        .encode();
        b[8] = 2;
        assert!(Found::decode(&b).is_err());
        assert!(Found::decode(&b[..55]).is_err());
    }

    #[test]
    fn covers_unchecked_and_torn() {
        let h = Handle::sealed(1, 0, 0x6000, 0x7000);
        assert!(h.covers(0x6ff8, 8));
        assert!(!h.covers(0x6ffc, 8));
        assert!(!h.covers(0x71f0, 8), "the neighbouring region's handle");
        assert!(!h.covers(0x5ff8, 8));
        assert!(Handle::unchecked(1, 0).covers(0x71f0, 8));
        assert!(Handle::unchecked(1, 0).covers(u64::MAX - 4, 8));
        // Torn: the key of one handle with the range of another.
        let other = Handle::sealed(2, 0, 0x7000, 0x8000);
        let torn = Handle {
            key: other.key,
            ..h
        };
        assert!(!torn.covers(0x6ff8, 8));
        assert!(!Handle { start: 0, ..h }.covers(0x6ff8, 8));
        assert!(
            !Handle::default().covers(0, 0),
            "a zeroed handle is not whole"
        );
    }

    #[test]
    fn atomic_widths() {
        let f32 = sys::MCA_BTL_ATOMIC_FLAG_32BIT as c_int;
        assert_eq!(Again::Put { size: 100 }.target_len(), 100);
        assert_eq!(
            Again::Cswap {
                compare: 0,
                value: 1,
                flags: f32
            }
            .target_len(),
            4
        );
        assert_eq!(
            Again::Fop {
                op: sys::MCA_BTL_ATOMIC_ADD,
                operand: 1,
                flags: 0
            }
            .target_len(),
            8
        );
    }
}
