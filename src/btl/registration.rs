//! Memory registration: `register_mem`/`deregister_mem` through the registration
//! cache, and the [`Handle`] a peer receives for a registration.
//!
//! Addressing: the registration handle a peer receives is [`Handle`] (the key and the
//! base the target address is relative to). With `FI_MR_VIRT_ADDR` the base is 0 and
//! the virtual address goes on the wire; otherwise the operation carries the offset
//! into the region. With `FI_MR_PROV_KEY` the key is the provider's; otherwise ours
//! (a per-process counter). Every handle carries the range it covers and a checksum
//! (see `resolve`).
//!
//! What it owns: the [`Registration`]s handed to Open MPI, and those made outside the
//! cache (`State::outside`). What it must not touch: the cache's own bookkeeping
//! (`rcache.rs`), beyond acquiring and releasing entries.

use super::module::{lock, Module, State};
use super::rcache::{Acquired, Ticket};
use crate::fabric::MemoryRegion;
use crate::ompi::component::ffi_guard;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;

/// What a peer needs to reach a registration (sent by value to peers).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Handle {
    pub key: u64,
    /// Subtracted from the target address: 0 with FI_MR_VIRT_ADDR, else the region base.
    pub base: u64,
    /// The registered range `[start, end)`: an operation outside it holds a handle
    /// that is not its target's (see `resolve`).
    pub start: u64,
    pub end: u64,
    /// A checksum of the four words above: a handle read while someone rewrote it
    /// (osc rdma's table of dynamic regions, see `resolve`) does not pass it.
    pub check: u64,
}

impl Handle {
    /// The handle of registration `mr` on a module that does (`virt`) or does not
    /// address by virtual address.
    pub fn of(mr: &MemoryRegion, virt: bool) -> Handle {
        let start = mr.addr() as u64;
        Handle::sealed(
            mr.key().unwrap_or(0),
            if virt { 0 } else { start },
            start,
            start.saturating_add(mr.len() as u64),
        )
    }

    /// Read a handle from memory another process may be rewriting as we read (osc
    /// rdma's table of dynamic regions, see `resolve`): exactly once, with one
    /// volatile read, so that the compiler cannot read it again for a later use and
    /// see other bytes than the ones checked. `p` need not be aligned.
    ///
    /// # Safety
    /// `p` points to `size_of::<Handle>()` readable bytes.
    pub unsafe fn read_once(p: *const u8) -> Handle {
        const N: usize = std::mem::size_of::<Handle>();
        // SAFETY: caller's contract; [u8; N] has alignment 1.
        let b: [u8; N] = unsafe { ptr::read_volatile(p as *const [u8; N]) };
        let w = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        Handle {
            key: w(0),
            base: w(1),
            start: w(2),
            end: w(3),
            check: w(4),
        }
    }

    /// A handle for a range not checked on this side (the target checks it).
    pub fn unchecked(key: u64, base: u64) -> Handle {
        Handle::sealed(key, base, 0, u64::MAX)
    }

    /// A handle with its checksum.
    pub fn sealed(key: u64, base: u64, start: u64, end: u64) -> Handle {
        let mut h = Handle {
            key,
            base,
            start,
            end,
            check: 0,
        };
        h.check = h.sum();
        h
    }

    fn sum(&self) -> u64 {
        use std::hash::Hasher;
        let mut h = crate::common::IdHasher::default();
        // A seed, so that an all-zero handle (zeroed memory) does not pass.
        h.write_u64(0x4f46_4948_414e_444c);
        for w in [self.key, self.base, self.start, self.end] {
            h.write_u64(w);
        }
        h.finish()
    }

    /// Is this a whole handle (not one torn by a concurrent rewrite) of a registration
    /// covering `[addr, addr + len)`?
    #[inline]
    pub fn covers(&self, addr: u64, len: usize) -> bool {
        addr >= self.start
            && addr.saturating_add(len as u64) <= self.end
            && self.check == self.sum()
    }
}

/// What `register_mem` returns: the handle first, then what only the owner needs.
#[repr(C)]
pub struct Registration {
    pub handle: Handle,
    pub desc: *mut c_void,
    /// The range asked for.
    base: usize,
    len: usize,
    ticket: Ticket,
    /// The region when not cached (else the cache owns it).
    own: Option<MemoryRegion>,
}

/// Register (or find in the cache) `[base, base + len)`.
pub(super) fn register(state: &State, base: *mut c_void, len: usize) -> Option<*mut Registration> {
    let mut cache = lock(&state.rcache);
    let virt = state.virt_addr;
    let res = cache.acquire(base as usize, len, state.mr_access, |b, l| {
        // SAFETY: Open MPI registers memory it keeps mapped until deregister_mem; a
        // release of it before then invalidates the entry (release callback).
        unsafe { state.register(b as *const c_void, l) }
    });
    let reg = match res {
        Ok(Acquired::Cached(i, mr)) => Registration {
            handle: Handle::of(mr, virt),
            desc: mr.desc(),
            base: base as usize,
            len,
            ticket: Ticket::Cached(i),
            own: None,
        },
        Ok(Acquired::Uncached(mr)) => Registration {
            handle: Handle::of(&mr, virt),
            desc: mr.desc(),
            base: base as usize,
            len,
            ticket: Ticket::Uncached,
            own: Some(mr),
        },
        Err(e) => {
            log::warn!(
                "fi_mr_reg of {len} bytes at {base:p} on {}: {e}",
                state.provider
            );
            return None;
        }
    };
    let outside = (reg.ticket == Ticket::Uncached).then_some(reg.handle);
    let r = Box::into_raw(Box::new(reg));
    if let Some(h) = outside {
        lock(&state.outside).insert(r as usize, h);
    }
    Some(r)
}

/// The handle of a live registration of this module covering `[addr, addr + len)`:
/// a cache entry, or one made outside the cache (a find request, `resolve`).
pub(super) fn live_handle(state: &State, addr: u64, len: usize) -> Option<Handle> {
    let cached = lock(&state.rcache)
        .find(addr as usize, len)
        .map(|mr| Handle::of(mr, state.virt_addr));
    cached.or_else(|| {
        lock(&state.outside)
            .values()
            .find(|h| h.covers(addr, len))
            .copied()
    })
}

/// Give a registration back.
///
/// # Safety
/// `r` came from [`register`] and is no longer used by any operation.
pub(super) unsafe fn deregister(state: &State, r: *mut Registration) {
    // SAFETY: caller's contract.
    let reg = unsafe { Box::from_raw(r) };
    match reg.ticket {
        Ticket::Cached(i) => {
            let closed = lock(&state.rcache).release(i);
            drop(closed);
        }
        Ticket::Uncached => {
            lock(&state.outside).remove(&(r as usize));
        }
    }
    drop(reg);
}

pub(crate) extern "C" fn btl_register_mem(
    btl: *mut sys::mca_btl_base_module_t,
    _ep: *mut sys::mca_btl_base_endpoint_t,
    base: *mut c_void,
    size: usize,
    _flags: u32,
) -> *mut sys::mca_btl_base_registration_handle_t {
    ffi_guard("btl register_mem", ptr::null_mut(), || {
        // SAFETY: btl is our module.
        let state = unsafe { &(*(btl as *mut Module)).state };
        register(state, base, size).map_or(ptr::null_mut(), |r| {
            if state.serves_requests() {
                // SAFETY: r is the live registration just made.
                let key = unsafe { (*r).handle.key };
                super::amo::note_region(btl as *mut Module, key, base as usize, size);
            }
            r as *mut sys::mca_btl_base_registration_handle_t
        })
    })
}

pub(crate) extern "C" fn btl_deregister_mem(
    btl: *mut sys::mca_btl_base_module_t,
    h: *mut sys::mca_btl_base_registration_handle_t,
) -> c_int {
    ffi_guard("btl deregister_mem", sys::OPAL_ERROR, || {
        if !h.is_null() {
            // SAFETY: btl is our module; h came from our register_mem.
            let state = unsafe { &(*(btl as *mut Module)).state };
            let r = h as *mut Registration;
            if state.serves_requests() {
                // SAFETY: r is live until deregister below.
                let (key, base, len) = unsafe { ((*r).handle.key, (*r).base, (*r).len) };
                super::amo::forget_region(btl as *mut Module, key, base, len);
            }
            // SAFETY: h came from our register_mem.
            unsafe { deregister(state, r) };
        }
        sys::OPAL_SUCCESS
    })
}

/// The registration of a handle we returned (local use only).
///
/// # Safety
/// `h` is null or a handle returned by our `register_mem`.
#[inline]
pub unsafe fn local_desc(h: *mut sys::mca_btl_base_registration_handle_t) -> *mut c_void {
    if h.is_null() {
        ptr::null_mut()
    } else {
        // SAFETY: our handles point to a Registration (its first field is the Handle).
        unsafe { (*(h as *const Registration)).desc }
    }
}
