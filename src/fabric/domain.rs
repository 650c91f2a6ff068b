//! [`Domain`]: the owner of a `fid_domain` (`fi_domain`). It keeps its [`Fabric`] alive
//! and a copy of the `fi_info` it was opened with, whose negotiated attributes
//! (threading, mr_mode, inject size, ...) the data paths consult.

use super::error::{check, Error, Result};
use super::fabric::Fabric;
use super::info::{InfoRef, OwnedInfo};
use libfabric_sys as fi;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

/// An open domain (one NIC, or one local shared-memory region).
///
/// Invariant: `fid` is an open `fid_domain` owned by this value, opened on `fabric`.
pub struct Domain {
    fid: NonNull<fi::fid_domain>,
    info: OwnedInfo,
    fabric: Arc<Fabric>,
}

// SAFETY: the domain is used through libfabric calls whose thread safety is the
// negotiated `threading` level ([`Domain::threading`]): at FI_THREAD_SAFE libfabric
// serializes; below it the caller serializes all calls on this domain's objects, as
// documented in the module docs of `fabric`. The owned info is plain data.
unsafe impl Send for Domain {}
// SAFETY: as for Send.
unsafe impl Sync for Domain {}

impl Domain {
    /// `fi_domain(fabric, info)`. `info` should be an entry of the same fabric (usually
    /// the one the fabric was opened from, or one chosen by `common::select`).
    pub fn open(fabric: &Arc<Fabric>, info: InfoRef<'_>) -> Result<Arc<Domain>> {
        let info = info.to_owned()?;
        let mut fid: *mut fi::fid_domain = ptr::null_mut();
        // SAFETY: the fabric is open (we hold an Arc); info is our private valid copy,
        // only read by fi_domain; the out pointer is valid; context NULL is allowed.
        check(unsafe {
            fi::fi_domain(
                fabric.as_ptr(),
                info.as_open_ptr(),
                &mut fid,
                ptr::null_mut(),
            )
        })?;
        let fid = NonNull::new(fid).ok_or(Error::NOMEM)?;
        Ok(Arc::new(Domain {
            fid,
            info,
            fabric: Arc::clone(fabric),
        }))
    }

    /// The `fi_info` this domain was opened with (its negotiated attributes).
    pub fn info(&self) -> InfoRef<'_> {
        self.info.info()
    }

    pub(crate) fn owned_info(&self) -> &OwnedInfo {
        &self.info
    }

    pub fn fabric(&self) -> &Arc<Fabric> {
        &self.fabric
    }

    /// `domain_attr->name`.
    pub fn name(&self) -> &str {
        self.info.info().domain_name()
    }

    /// The negotiated threading level: below `FI_THREAD_SAFE` the caller serializes all
    /// calls on this domain's objects.
    pub fn threading(&self) -> fi::fi_threading {
        self.info.info().threading()
    }

    /// The negotiated `FI_MR_*` mode bits.
    pub fn mr_mode(&self) -> u32 {
        self.info.info().mr_mode()
    }

    /// `FI_MR_ENDPOINT`: memory regions must be bound to an endpoint and enabled.
    pub fn mr_endpoint(&self) -> bool {
        self.mr_mode() & fi::FI_MR_ENDPOINT != 0
    }

    /// `FI_MR_LOCAL`: local buffers need a registration and its `desc`.
    pub fn mr_local(&self) -> bool {
        self.mr_mode() & fi::FI_MR_LOCAL != 0
    }
}

// Every child holds an Arc of the domain; the fabric Arc is released after the
// close, so the fabric outlives the domain.
fid_owner!(Domain, fid_domain, "domain");

impl fmt::Debug for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        super::debug_provider_name(f, "Domain", self.info(), self.name())
    }
}

impl Domain {
    /// Whether the provider offers atomic `op.op` on `op.datatype` for the kind of
    /// atomic `flags` names (0, `FI_FETCH_ATOMIC` or `FI_COMPARE_ATOMIC`):
    /// `fi_query_atomic`.
    pub fn query_atomic(&self, op: super::AtomicOp, flags: u64) -> bool {
        let mut attr = libfabric_sys::fi_atomic_attr::default();
        // SAFETY: the domain is open; attr is a valid out parameter.
        unsafe {
            libfabric_sys::fi_query_atomic(self.as_ptr(), op.datatype, op.op, &mut attr, flags) == 0
        }
    }
}
