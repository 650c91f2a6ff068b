//! [`Fabric`]: the owner of a `fid_fabric` (`fi_fabric`), the root of every other
//! object. It keeps a copy of the `fi_info` it was opened from.

use super::error::{check, Error, Result};
use super::info::{InfoRef, OwnedInfo};
use libfabric_sys as fi;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

/// An open fabric.
///
/// Invariant: `fid` is an open `fid_fabric` owned by this value.
pub struct Fabric {
    fid: NonNull<fi::fid_fabric>,
    info: OwnedInfo,
}

// SAFETY: a fabric has no thread affinity. After open, the only libfabric calls made on
// it are fi_domain (Domain::open) and fi_close (Drop, with no other reference left);
// concurrent Domain::open calls fall under the caller's threading duty documented in
// the `fabric` module docs. &self methods otherwise only read the owned info.
unsafe impl Send for Fabric {}
// SAFETY: see Send.
unsafe impl Sync for Fabric {}

impl Fabric {
    /// `fi_fabric` with the fabric attributes of `info`.
    pub fn open(info: InfoRef<'_>) -> Result<Arc<Fabric>> {
        let info = info.to_owned()?;
        // SAFETY: fabric_attr of our private copy is NULL-checked below; it is only read
        // by fi_fabric. The out pointer is valid.
        let attr = unsafe { (*info.as_open_ptr()).fabric_attr };
        if attr.is_null() {
            return Err(Error::INVAL);
        }
        let mut fid: *mut fi::fid_fabric = ptr::null_mut();
        // SAFETY: attr is a valid fi_fabric_attr; context NULL is allowed.
        check(unsafe { fi::fi_fabric(attr, &mut fid, ptr::null_mut()) })?;
        let fid = NonNull::new(fid).ok_or(Error::NOMEM)?;
        Ok(Arc::new(Fabric { fid, info }))
    }

    /// The `fi_info` this fabric was opened from.
    pub fn info(&self) -> InfoRef<'_> {
        self.info.info()
    }

    /// `fabric_attr->name`.
    pub fn name(&self) -> &str {
        self.info.info().fabric_name()
    }
}

// Every domain holds an Arc of its fabric, so none is still open at the close.
fid_owner!(Fabric, fid_fabric, "fabric");

impl fmt::Debug for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        super::debug_provider_name(f, "Fabric", self.info(), self.name())
    }
}
