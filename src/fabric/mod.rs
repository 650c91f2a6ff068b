//! Safe owners of libfabric objects. Each owner closes its object in `Drop` and keeps
//! its parent alive, so objects are closed in the right order by construction.
//!
//! What lives here: `fi_info` handling ([`info`]), and one owner per libfabric object:
//! [`Fabric`], [`Domain`], [`AddressVector`], [`CompletionQueue`], [`Endpoint`],
//! [`MemoryRegion`]. This is one of the few modules allowed to hold `unsafe` code; it
//! must not know about Open MPI (no MCA parameters, no opal calls) nor about provider
//! selection policy (that is `common::select`).
//!
//! # Ownership and close order
//!
//! `Domain` holds an `Arc<Fabric>`; `AddressVector`, `CompletionQueue`, `Endpoint` and
//! `MemoryRegion` hold an `Arc<Domain>`. An `Endpoint` keeps an `Arc` of every AV and CQ
//! bound to it, and a `MemoryRegion` bound to an endpoint (`FI_MR_ENDPOINT`) keeps an
//! `Arc` of that endpoint. `Drop` first calls `fi_close` on the object and only then
//! releases the `Arc`s, so a parent is never closed before its children.
//! A failed `fi_close` is logged with `log::warn!` and otherwise ignored: `Drop` never
//! panics.
//!
//! # Threads
//!
//! The owners are `Send` and `Sync`. libfabric defines thread safety per domain through
//! the negotiated `domain_attr->threading` ([`Domain::threading`]):
//! - `FI_THREAD_SAFE`: any object may be used from any thread concurrently;
//! - `FI_THREAD_DOMAIN` (what Open MPI asks for unless `MPI_THREAD_MULTIPLE`) and the
//!   finer levels: the caller must serialize every call on the objects of one domain
//!   (the components do it the way the C code does, with their own progress lock or
//!   by being single-threaded).
//!
//! Rust cannot check the second rule, so it is the caller's job; every `unsafe`
//! data-path method repeats it in its `# Safety` section.
//!
//! # Data path
//!
//! The `unsafe` posting methods of [`Endpoint`] and [`CompletionQueue::read`] are
//! `#[inline]` wrappers of a single libfabric call: no allocation, no locking, no
//! bookkeeping. `-FI_EAGAIN` comes back as [`Error::AGAIN`] and means "progress, then
//! retry".

/// The owner's end of one libfabric object, for a type whose `fid: NonNull<fi::fid_*>`
/// field is open and owned by the value alone (each type states this invariant), and
/// whose children hold an `Arc` of it (see "Ownership and close order"): `as_ptr` and
/// `as_fid` for the calls, and the `Drop` that closes the object once.
macro_rules! fid_owner {
    ($owner:ident, $raw:ident, $what:literal) => {
        impl $owner {
            /// The raw object, for calls this crate does not wrap.
            #[inline]
            pub fn as_ptr(&self) -> *mut libfabric_sys::$raw {
                self.fid.as_ptr()
            }

            /// The object's embedded `struct fid`, for `fi_close` and `fi_*_bind`.
            #[inline]
            pub(crate) fn as_fid(&self) -> *mut libfabric_sys::fid {
                // SAFETY: `fid` points to an open object (the type's invariant); this
                // takes the address of its embedded `struct fid` and reads nothing.
                unsafe { &raw mut (*self.fid.as_ptr()).fid }
            }
        }

        impl Drop for $owner {
            fn drop(&mut self) {
                // SAFETY: `fid` is open and owned by this value alone (the type's
                // invariant) and is never used after this call; every object opened
                // under it holds an `Arc` of this owner, so none is still open, and the
                // owner's own `Arc`s of its parents are released after this body (field
                // drop order), so the parents outlive the close.
                unsafe { $crate::fabric::close_fid(self.as_fid(), $what) }
            }
        }
    };
}

pub mod av;
pub mod buffer;
pub mod cq;
pub mod domain;
pub mod ep;
pub mod error;
#[allow(clippy::module_inception)]
pub mod fabric;
pub mod info;
pub mod mr;
pub mod post;

pub use av::{AddressVector, AvAttr};
pub use buffer::{Buffer, Local, OpContext, Scrap, Scratch};
pub use cq::{CompletionQueue, CqAttr, CqErrEntry};
pub use domain::Domain;
pub use ep::Endpoint;
pub use error::{check, to_result, Error, Result};
pub use fabric::Fabric;
pub use info::{
    runtime_version, version_string, Hints, InfoIter, InfoList, InfoRef, OwnedInfo, PciAddr,
    API_VERSION,
};
pub use mr::MemoryRegion;
pub use post::{AtomicOp, CqRef, Dir, EpRef, Remote, Serialized};

pub use libfabric_sys::{
    fi_addr_t, fi_context, fi_context2, fi_cq_tagged_entry, fi_msg_tagged, iovec,
};

/// `FI_ADDR_UNSPEC`: "any source" for receives (a C macro, `((uint64_t) -1)`).
pub const FI_ADDR_UNSPEC: fi_addr_t = u64::MAX;
/// `FI_ADDR_NOTAVAIL`: what `fi_av_insert` stores for an address it could not insert.
pub const FI_ADDR_NOTAVAIL: fi_addr_t = u64::MAX;
/// `FI_KEY_NOTAVAIL`: what `fi_mr_key` returns when the key is not (yet) available.
pub const FI_KEY_NOTAVAIL: u64 = u64::MAX;

/// `Debug` of an owner known by its provider and its own name (a fabric, a domain).
fn debug_provider_name(
    f: &mut std::fmt::Formatter<'_>,
    owner: &str,
    info: InfoRef<'_>,
    name: &str,
) -> std::fmt::Result {
    f.debug_struct(owner)
        .field("provider", &info.provider_name())
        .field("name", &name)
        .finish()
}

/// Close a fid from a `Drop` impl: never panics, logs a failure.
///
/// # Safety
/// `fid` must be an open libfabric object owned by the caller and not used afterwards.
unsafe fn close_fid(fid: *mut libfabric_sys::fid, what: &str) {
    // SAFETY: the caller owns the open object and never touches it again.
    let ret = unsafe { libfabric_sys::fi_close(fid) };
    if ret != 0 {
        log::warn!("fi_close({what}) failed: {}", Error::from_ret(ret as isize));
    }
}
