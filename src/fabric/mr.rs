//! [`MemoryRegion`]: the owner of a `fid_mr` (`fi_mr_reg`). Gives the local descriptor
//! (`desc`) for `FI_MR_LOCAL` providers and the key a peer needs for RMA. With
//! `FI_MR_ENDPOINT` the region must be bound to an endpoint and enabled before use.
//!
//! The registration cache (which decides when to register and when a region is stale)
//! is not here: it lives in the BTL and is fed by the memory-release path.

use super::domain::Domain;
use super::ep::Endpoint;
use super::error::{check, Error, Result};
use libfabric_sys as fi;
use std::ffi::c_void;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex};

/// A registered memory region.
///
/// Invariant: `fid` is an open `fid_mr` owned by this value, registered on `domain`
/// for `[addr, addr + len)`; if bound to an endpoint, that endpoint is held in `ep`
/// until after the region is closed.
pub struct MemoryRegion {
    fid: NonNull<fi::fid_mr>,
    addr: usize,
    len: usize,
    ep: Mutex<Option<Arc<Endpoint>>>,
    domain: Arc<Domain>,
}

// SAFETY: the region is only used through libfabric calls (bind, enable, key, desc,
// close), whose thread safety is the domain's negotiated threading level; below
// FI_THREAD_SAFE the caller serializes (module docs of `fabric`). The memory it covers
// is the caller's responsibility (see `register`). `ep` is a Mutex.
unsafe impl Send for MemoryRegion {}
// SAFETY: as for Send.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// `fi_mr_reg(domain, buf, len, access, offset, requested_key, flags)`.
    /// `access`: `FI_SEND | FI_RECV | FI_READ | FI_WRITE | FI_REMOTE_READ |
    /// FI_REMOTE_WRITE`; `requested_key` is ignored with `FI_MR_PROV_KEY`.
    ///
    /// # Safety
    /// `[buf, buf + len)` must stay mapped and must not be reused for anything else
    /// while the region is registered: the provider (and, with remote access, a peer)
    /// may read or write it until the region is dropped. Releasing the memory first
    /// leaves a stale registration (see DESIGN.md, the memory-release path).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn register(
        domain: &Arc<Domain>,
        buf: *const c_void,
        len: usize,
        access: u64,
        offset: u64,
        requested_key: u64,
        flags: u64,
    ) -> Result<MemoryRegion> {
        let mut fid: *mut fi::fid_mr = ptr::null_mut();
        // SAFETY: the domain is open (we hold an Arc); the memory's lifetime is the
        // caller's contract; out pointer valid; context NULL is allowed.
        check(unsafe {
            fi::fi_mr_reg(
                domain.as_ptr(),
                buf,
                len,
                access,
                offset,
                requested_key,
                flags,
                &mut fid,
                ptr::null_mut(),
            )
        })?;
        let fid = NonNull::new(fid).ok_or(Error::NOMEM)?;
        Ok(MemoryRegion {
            fid,
            addr: buf as usize,
            len,
            ep: Mutex::new(None),
            domain: Arc::clone(domain),
        })
    }

    pub fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    /// Start address of the registered range.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Length of the registered range.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The key a peer uses for RMA to this region (`fi_mr_key`), or `None` while not
    /// available (`FI_KEY_NOTAVAIL`, e.g. before `enable` with `FI_MR_ENDPOINT`).
    pub fn key(&self) -> Option<u64> {
        // SAFETY: the region is open.
        let k = unsafe { fi::fi_mr_key(self.fid.as_ptr()) };
        (k != super::FI_KEY_NOTAVAIL).then_some(k)
    }

    /// The local descriptor (`fi_mr_desc`) to pass as `desc` on the data path.
    #[inline]
    pub fn desc(&self) -> *mut c_void {
        // SAFETY: the region is open.
        unsafe { fi::fi_mr_desc(self.fid.as_ptr()) }
    }

    /// `fi_mr_bind` to an endpoint (`FI_MR_ENDPOINT` domains). The region keeps the
    /// endpoint alive; call [`MemoryRegion::enable`] next.
    pub fn bind_ep(&self, ep: &Arc<Endpoint>, flags: u64) -> Result<()> {
        // SAFETY: region and endpoint are open; ep.as_ptr() is a valid fid_ep whose
        // first member is its fid. The endpoint is kept alive below.
        check(unsafe { fi::fi_mr_bind(self.fid.as_ptr(), &mut (*ep.as_ptr()).fid, flags) })?;
        *self.ep.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(ep));
        Ok(())
    }

    /// `fi_mr_enable` (`FI_MR_ENDPOINT` domains, after [`MemoryRegion::bind_ep`]).
    pub fn enable(&self) -> Result<()> {
        // SAFETY: the region is open.
        check(unsafe { fi::fi_mr_enable(self.fid.as_ptr()) })
    }
}

// The endpoint the region is bound to (FI_MR_ENDPOINT) and the domain are released
// after the close.
fid_owner!(MemoryRegion, fid_mr, "mr");

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("key", &self.key())
            .finish()
    }
}
