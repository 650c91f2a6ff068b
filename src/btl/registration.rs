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

    /// Its size: what a peer's handle holds, read at once (`ompi::btl::read_handle`).
    pub const SIZE: usize = std::mem::size_of::<Handle>();

    /// A handle from its bytes in memory (native byte order, as `#[repr(C)]` lays it
    /// out).
    pub fn from_bytes(b: [u8; Handle::SIZE]) -> Handle {
        let w = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i * 8..i * 8 + 8]);
            u64::from_ne_bytes(a)
        };
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

/// The size of a [`Handle`], which a peer's handle is read as at once.
pub(super) const HANDLE: usize = Handle::SIZE;

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
pub(super) fn register(state: &State, base: *mut c_void, len: usize) -> Option<Box<Registration>> {
    let mut cache = lock(&state.rcache);
    let virt = state.virt_addr;
    let res = cache.acquire(base as usize, len, state.mr_access, |b, l| {
        let key = state.next_key();
        // SAFETY: Open MPI registers memory it keeps mapped until deregister_mem; a
        // release of it before then invalidates the entry (release callback), and the
        // cache closes the region before it drops the entry.
        let mr = unsafe {
            MemoryRegion::register(
                state.ep.domain(),
                b as *const c_void,
                l,
                state.mr_access,
                0,
                key,
                0,
            )
        }?;
        state.finish_registration(&mr)?;
        Ok::<_, crate::fabric::Error>(mr)
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
    let r = Box::new(reg);
    if let Some(h) = outside {
        lock(&state.outside).insert(r.id(), h);
    }
    Some(r)
}

impl crate::ompi::btl::LocalHandle for Registration {
    fn desc(&self) -> *mut c_void {
        self.desc
    }
}

impl Registration {
    /// What `State::outside` knows it by: its address, stable while it is boxed.
    fn id(&self) -> usize {
        self as *const Registration as usize
    }

    /// The range asked for: `(base, len)`.
    pub(super) fn range(&self) -> (usize, usize) {
        (self.base, self.len)
    }
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

/// Give a registration back (no operation uses it any more).
pub(super) fn deregister(state: &State, reg: Box<Registration>) {
    match reg.ticket {
        Ticket::Cached(i) => {
            let closed = lock(&state.rcache).release(i);
            drop(closed);
        }
        Ticket::Uncached => {
            lock(&state.outside).remove(&reg.id());
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
        // SAFETY: Open MPI calls a module's entries only between its init and finalize.
        let module = unsafe { crate::ompi::btl::module::<Module>(btl) };
        let state = &module.state;
        register(state, base, size).map_or(ptr::null_mut(), |r| {
            if state.serves_requests() {
                super::amo::note_region(module, r.handle.key, base as usize, size);
            }
            // Open MPI holds the registration (by its handle, the first field) until
            // deregister_mem gives it back.
            Box::into_raw(r) as *mut sys::mca_btl_base_registration_handle_t
        })
    })
}

pub(crate) extern "C" fn btl_deregister_mem(
    btl: *mut sys::mca_btl_base_module_t,
    h: *mut sys::mca_btl_base_registration_handle_t,
) -> c_int {
    ffi_guard("btl deregister_mem", sys::OPAL_ERROR, || {
        if !h.is_null() {
            // SAFETY: btl is a live module of ours; h came from our register_mem
            // (Box::into_raw) and Open MPI gives it back once, with the box.
            let (module, r) = unsafe {
                (
                    crate::ompi::btl::module::<Module>(btl),
                    Box::from_raw(h as *mut Registration),
                )
            };
            if module.state.serves_requests() {
                let (base, len) = r.range();
                super::amo::forget_region(module, r.handle.key, base, len);
            }
            deregister(&module.state, r);
        }
        sys::OPAL_SUCCESS
    })
}
