//! `fi_info` in three shapes: [`Hints`] (what the caller asks `fi_getinfo` for, an owned
//! `fi_allocinfo`), [`InfoList`] (the owned list `fi_getinfo` returns, read through
//! borrowed [`InfoRef`]s) and [`OwnedInfo`] (one entry duplicated with `fi_dupinfo`, so
//! the chosen entry outlives the list). Everything is freed with `fi_freeinfo`.
//!
//! This module only reads and writes `fi_info`; choosing among entries is
//! `common::select`.

use super::error::{check, Error, Result};
use libfabric_sys as fi;
use libfabric_sys::macros::{fi_major, fi_minor, fi_version};
use std::ffi::{c_char, CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

/// The libfabric API version the components request from `fi_getinfo` and `fi_open`
/// (1.13: the first with the memory-monitor import the common code relies on).
pub const API_VERSION: u32 = fi_version(1, 13);

/// The version of the libfabric library loaded at run time (`fi_version()`), in
/// `FI_VERSION` encoding: see [`fi_major`] / [`fi_minor`] in `libfabric_sys::macros`.
pub fn runtime_version() -> u32 {
    // SAFETY: fi_version takes no argument and only returns a constant.
    unsafe { fi::fi_version() }
}

/// `"major.minor"` of an `FI_VERSION`-encoded version.
pub fn version_string(v: u32) -> String {
    format!("{}.{}", fi_major(v), fi_minor(v))
}

/// A PCI address (`fi_info->nic->bus_attr->attr.pci`), printed as `dddd:bb:dd.f`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddr {
    pub domain: u16,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

/// Borrow a C string owned by an `fi_info` as `&str`; NULL or non-UTF-8 reads as `""`
/// (libfabric's names are ASCII).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that lives at least as long as `'a`.
unsafe fn cstr<'a>(p: *const c_char) -> &'a str {
    if p.is_null() {
        ""
    } else {
        // SAFETY: non-NULL and NUL-terminated for 'a, per the caller.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
    }
}

// ---------------------------------------------------------------------------------
// Hints
// ---------------------------------------------------------------------------------

/// Hints setters that store one value in one field of a sub-attribute struct: each
/// `name(value: T) => attr.field;` becomes `pub fn name(self, value: T) -> Self`, which
/// records a missing struct (see `Hints::done`) instead of writing it.
macro_rules! attr_setters {
    ($($(#[$doc:meta])* $name:ident($value:ident: $ty:ty) => $attr:ident.$field:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, $value: $ty) -> Self {
                let set = self.$attr().map(|a| a.$field = $value);
                self.done(set)
            }
        )*
    };
}

/// Getters of one field of a sub-attribute struct, which read 0 when the entry lacks
/// that struct (0 is also every `*_UNSPEC` enumerator: `FI_EP_UNSPEC`,
/// `FI_THREAD_UNSPEC`, ...). A row `name() -> T = attr.field;` becomes
/// `pub fn name(&self) -> T`; a row `tx_name, rx_name -> T = field;` becomes the two
/// getters of the field that `tx_attr` and `rx_attr` both have.
macro_rules! attr_getters {
    () => {};
    ($(#[$doc:meta])* $name:ident() -> $ty:ty = $attr:ident.$field:ident; $($rest:tt)*) => {
        $(#[$doc])*
        pub fn $name(&self) -> $ty {
            self.$attr().map_or(0, |a| a.$field)
        }
        attr_getters! { $($rest)* }
    };
    ($(#[$doc:meta])* $tx:ident, $rx:ident -> $ty:ty = $field:ident; $($rest:tt)*) => {
        attr_getters! {
            $(#[$doc])* $tx() -> $ty = tx.$field;
            $(#[$doc])* $rx() -> $ty = rx.$field;
            $($rest)*
        }
    };
}

/// Hints for `fi_getinfo`: an owned `fi_allocinfo` filled through a builder.
///
/// ```no_run
/// # use ompi_ofi::fabric::{Hints, InfoList, API_VERSION};
/// # use libfabric_sys as fi;
/// let hints = Hints::new()?
///     .caps(fi::FI_TAGGED as u64)
///     .ep_type(fi::FI_EP_RDM)
///     .mode(fi::FI_CONTEXT | fi::FI_CONTEXT2)
///     .prov_name("tcp");
/// let list = InfoList::getinfo(API_VERSION, None, None, 0, Some(&hints))?;
/// # Ok::<(), ompi_ofi::fabric::Error>(())
/// ```
///
/// The setters cannot fail; a string with an interior NUL (or a failed allocation)
/// is remembered and reported by [`InfoList::getinfo`] (and [`Hints::error`]).
///
/// Invariant: `ptr` comes from `fi_allocinfo` or `fi_dupinfo`, is owned by this value,
/// and every string in it was allocated with C `malloc` (libfabric frees them).
pub struct Hints {
    ptr: NonNull<fi::fi_info>,
    deferred: Option<Error>,
}

/// The string fields the builder sets.
enum StrField {
    Provider,
    Fabric,
    Domain,
}

// SAFETY: the fi_info is plain heap data owned exclusively by this value; libfabric
// keeps no reference to hints, so it may be moved to and read from any thread.
unsafe impl Send for Hints {}
// SAFETY: shared access only reads the plain data (the setters take `self`).
unsafe impl Sync for Hints {}

impl Hints {
    /// Fresh hints from `fi_allocinfo` (all attribute structs allocated and zeroed,
    /// `nic` NULL).
    pub fn new() -> Result<Hints> {
        // SAFETY: fi_allocinfo has no precondition; NULL means out of memory.
        let p = unsafe { fi::fi_allocinfo() };
        NonNull::new(p)
            .map(|ptr| Hints {
                ptr,
                deferred: None,
            })
            .ok_or(Error::NOMEM)
    }

    /// Hints that start as a copy of one `fi_info` (e.g. a previous result, to ask again
    /// with one more capability).
    pub fn from_info(info: InfoRef<'_>) -> Result<Hints> {
        let owned = info.to_owned()?;
        let ptr = owned.ptr;
        std::mem::forget(owned);
        Ok(Hints {
            ptr,
            deferred: None,
        })
    }

    /// The first error a setter recorded, if any.
    pub fn error(&self) -> Option<Error> {
        self.deferred
    }

    /// Read the hints back with the same accessors as a result.
    pub fn info(&self) -> InfoRef<'_> {
        InfoRef {
            // SAFETY: ptr is a valid fi_info owned by self; the borrow ties the view to self.
            info: unsafe { self.ptr.as_ref() },
        }
    }

    /// The raw hints, for `fi_getinfo` or fields the builder does not cover.
    pub fn as_ptr(&self) -> *const fi::fi_info {
        self.ptr.as_ptr()
    }

    /// Mutable raw access for fields the builder does not cover. Strings stored in it
    /// must come from C `malloc` (`fi_freeinfo` frees them).
    pub fn as_mut_ptr(&mut self) -> *mut fi::fi_info {
        self.ptr.as_ptr()
    }

    fn raw(&mut self) -> &mut fi::fi_info {
        // SAFETY: ptr is valid and uniquely owned by self (invariant); the borrow is
        // tied to &mut self.
        unsafe { self.ptr.as_mut() }
    }
    fn tx_attr(&mut self) -> Option<&mut fi::fi_tx_attr> {
        // SAFETY: tx_attr is NULL or a valid struct owned by this fi_info.
        unsafe { self.raw().tx_attr.as_mut() }
    }
    fn rx_attr(&mut self) -> Option<&mut fi::fi_rx_attr> {
        // SAFETY: rx_attr is NULL or a valid struct owned by this fi_info.
        unsafe { self.raw().rx_attr.as_mut() }
    }
    fn ep_attr(&mut self) -> Option<&mut fi::fi_ep_attr> {
        // SAFETY: ep_attr is NULL or a valid struct owned by this fi_info.
        unsafe { self.raw().ep_attr.as_mut() }
    }
    fn domain_attr(&mut self) -> Option<&mut fi::fi_domain_attr> {
        // SAFETY: domain_attr is NULL or a valid struct owned by this fi_info.
        unsafe { self.raw().domain_attr.as_mut() }
    }
    fn fabric_attr(&mut self) -> Option<&mut fi::fi_fabric_attr> {
        // SAFETY: fabric_attr is NULL or a valid struct owned by this fi_info.
        unsafe { self.raw().fabric_attr.as_mut() }
    }

    /// Record a missing sub-attribute (only possible with `from_info` of a sparse
    /// fi_info): report it at getinfo time rather than guessing.
    fn done(mut self, set: Option<()>) -> Self {
        if set.is_none() {
            self.deferred.get_or_insert(Error::INVAL);
        }
        self
    }

    /// `s` copied with C `malloc` (what `fi_freeinfo` frees) and its length with the
    /// NUL; on failure the error is recorded for getinfo time and None returned.
    fn c_dup(&mut self, s: &str) -> Option<(*mut libc::c_char, usize)> {
        let Ok(c) = CString::new(s) else {
            self.deferred.get_or_insert(Error::INVAL);
            return None;
        };
        // SAFETY: c is a valid NUL-terminated string; strdup copies it with malloc.
        let dup = unsafe { libc::strdup(c.as_ptr()) };
        if dup.is_null() {
            self.deferred.get_or_insert(Error::NOMEM);
            return None;
        }
        Some((dup, c.as_bytes_with_nul().len()))
    }

    fn set_string(mut self, field: StrField, s: &str) -> Self {
        let Some((dup, _)) = self.c_dup(s) else {
            return self;
        };
        let slot = match field {
            StrField::Provider => self.fabric_attr().map(|a| &mut a.prov_name),
            StrField::Fabric => self.fabric_attr().map(|a| &mut a.name),
            StrField::Domain => self.domain_attr().map(|a| &mut a.name),
        };
        let stored = match slot {
            Some(slot) => {
                // SAFETY: the old string is NULL or was malloc'ed (invariant); it is
                // replaced, so it is freed exactly once.
                unsafe { libc::free((*slot).cast()) };
                *slot = dup;
                true
            }
            None => {
                // SAFETY: dup was just malloc'ed by strdup and is not stored anywhere.
                unsafe { libc::free(dup.cast()) };
                false
            }
        };
        self.done(stored.then_some(()))
    }

    /// `caps`: the capabilities required (`FI_TAGGED`, `FI_RMA`, ...).
    pub fn caps(mut self, caps: u64) -> Self {
        self.raw().caps = caps;
        self
    }
    /// `mode`: the modes the caller supports (`FI_CONTEXT`, `FI_CONTEXT2`, ...).
    pub fn mode(mut self, mode: u64) -> Self {
        self.raw().mode = mode;
        self
    }
    /// `addr_format` (`FI_SOCKADDR_IN`, `FI_ADDR_STR`, ...); 0 = unspecified.
    pub fn addr_format(mut self, format: u32) -> Self {
        self.raw().addr_format = format;
        self
    }
    attr_setters! {
        /// `ep_attr->type` (`FI_EP_RDM`, ...).
        ep_type(t: fi::fi_ep_type) => ep_attr.type_;
        /// `ep_attr->mem_tag_format`.
        mem_tag_format(format: u64) => ep_attr.mem_tag_format;
        /// `ep_attr->max_msg_size`.
        max_msg_size(size: usize) => ep_attr.max_msg_size;
    }
    /// `domain_attr->mr_mode`: the `FI_MR_*` bits the caller can handle.
    pub fn mr_mode(mut self, mr_mode: u32) -> Self {
        let set = self.domain_attr().map(|a| a.mr_mode = mr_mode as i32);
        self.done(set)
    }
    attr_setters! {
        /// `domain_attr->av_type` (`FI_AV_MAP`, `FI_AV_TABLE`).
        av_type(t: fi::fi_av_type) => domain_attr.av_type;
        /// `domain_attr->threading` (`FI_THREAD_SAFE`, `FI_THREAD_DOMAIN`, ...).
        threading(t: fi::fi_threading) => domain_attr.threading;
        /// `domain_attr->control_progress`.
        control_progress(p: fi::fi_progress) => domain_attr.control_progress;
        /// `domain_attr->data_progress`.
        data_progress(p: fi::fi_progress) => domain_attr.data_progress;
        /// `domain_attr->resource_mgmt` (`FI_RM_ENABLED`, ...).
        resource_mgmt(r: fi::fi_resource_mgmt) => domain_attr.resource_mgmt;
        /// `domain_attr->cq_data_size`: bytes of remote CQ data required.
        cq_data_size(size: usize) => domain_attr.cq_data_size;
    }
    /// `ep_attr->tx_ctx_cnt` and `rx_ctx_cnt`: the contexts of a scalable endpoint.
    pub fn ctx_cnt(mut self, n: usize) -> Self {
        let set = self.ep_attr().map(|a| {
            a.tx_ctx_cnt = n;
            a.rx_ctx_cnt = n;
        });
        self.done(set)
    }
    attr_setters! {
        /// `tx_attr->inject_size`: the minimum inject size required.
        inject_size(size: usize) => tx_attr.inject_size;
        /// `tx_attr->size`: transmit queue depth.
        tx_size(size: usize) => tx_attr.size;
        /// `rx_attr->size`: receive queue depth.
        rx_size(size: usize) => rx_attr.size;
        /// `rx_attr->total_buffered_recv`: room the provider keeps for messages that
        /// arrive before their receive (a hint most providers ignore or cap).
        total_buffered_recv(bytes: usize) => rx_attr.total_buffered_recv;
    }
    /// `tx_attr->msg_order` and `rx_attr->msg_order` (`FI_ORDER_SAS`, ...).
    pub fn msg_order(self, order: u64) -> Self {
        self.tx_msg_order(order).rx_msg_order(order)
    }
    attr_setters! {
        /// `tx_attr->msg_order`.
        tx_msg_order(order: u64) => tx_attr.msg_order;
        /// `rx_attr->msg_order`.
        rx_msg_order(order: u64) => rx_attr.msg_order;
        /// `tx_attr->op_flags`: default flags of transmit operations
        /// (e.g. `FI_COMPLETION` with selective completion).
        tx_op_flags(flags: u64) => tx_attr.op_flags;
        /// `rx_attr->op_flags`: default flags of receive operations.
        rx_op_flags(flags: u64) => rx_attr.op_flags;
    }
    /// `fabric_attr->prov_name`: a provider name, possibly layered (`"udp;ofi_rxd"`).
    /// libfabric matches it by name, so `"tcp"` also returns `tcp;ofi_rxm` for RDM.
    pub fn prov_name(self, name: &str) -> Self {
        self.set_string(StrField::Provider, name)
    }
    /// `fabric_attr->name`.
    pub fn fabric_name(self, name: &str) -> Self {
        self.set_string(StrField::Fabric, name)
    }
    /// `domain_attr->name`: restrict to one NIC/domain (e.g. `"lo"`).
    pub fn domain_name(self, name: &str) -> Self {
        self.set_string(StrField::Domain, name)
    }

    /// `src_addr` as a NUL-terminated string (the address format of `FI_ADDR_STR`
    /// providers such as shm, whose endpoint name derives from it).
    pub fn src_addr_str(mut self, addr: &str) -> Self {
        let Some((dup, len)) = self.c_dup(addr) else {
            return self;
        };
        let raw = self.raw();
        // SAFETY: the old src_addr is NULL or was malloc'ed (fi_dupinfo or a previous
        // call); it is replaced here, so it is freed exactly once.
        unsafe { libc::free(raw.src_addr) };
        raw.src_addr = dup.cast();
        raw.src_addrlen = len;
        self
    }

    /// A copy (`fi_dupinfo`).
    pub fn try_clone(&self) -> Result<Hints> {
        let mut h = Hints::from_info(self.info())?;
        h.deferred = self.deferred;
        Ok(h)
    }
}

impl Drop for Hints {
    fn drop(&mut self) {
        // SAFETY: ptr is owned by self (invariant) and freed exactly once here.
        unsafe { fi::fi_freeinfo(self.ptr.as_ptr()) }
    }
}

impl fmt::Debug for Hints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hints")
            .field("info", &self.info())
            .field("deferred", &self.deferred)
            .finish()
    }
}

// ---------------------------------------------------------------------------------
// InfoList
// ---------------------------------------------------------------------------------

/// The owned result of `fi_getinfo`, in libfabric's order (which is its preference
/// order). May be empty.
///
/// Invariant: `head` is NULL or the head of a list returned by `fi_getinfo` and owned
/// by this value.
pub struct InfoList {
    head: *mut fi::fi_info,
}

// SAFETY: the list is plain heap data owned by this value, libfabric keeps no
// reference to it; shared access only reads.
unsafe impl Send for InfoList {}
// SAFETY: see Send; no method mutates through &self.
unsafe impl Sync for InfoList {}

impl InfoList {
    /// `fi_getinfo(version, node, service, flags, hints)`. `-FI_ENODATA` ("no provider
    /// matches") is `Ok` with an empty list.
    pub fn getinfo(
        version: u32,
        node: Option<&str>,
        service: Option<&str>,
        flags: u64,
        hints: Option<&Hints>,
    ) -> Result<InfoList> {
        if let Some(e) = hints.and_then(Hints::error) {
            return Err(e);
        }
        let node = node
            .map(CString::new)
            .transpose()
            .map_err(|_| Error::INVAL)?;
        let service = service
            .map(CString::new)
            .transpose()
            .map_err(|_| Error::INVAL)?;
        let mut head: *mut fi::fi_info = ptr::null_mut();
        // SAFETY: node/service are NULL or NUL-terminated strings alive for the call;
        // hints is NULL or a valid fi_info; head is a valid out pointer.
        let ret = unsafe {
            fi::fi_getinfo(
                version,
                node.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
                service.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
                flags,
                hints.map_or(ptr::null(), Hints::as_ptr),
                &mut head,
            )
        };
        match check(ret) {
            Ok(()) => Ok(InfoList { head }),
            Err(e) if e == Error::NODATA => {
                if !head.is_null() {
                    // SAFETY: defensive: a list returned alongside ENODATA is ours.
                    unsafe { fi::fi_freeinfo(head) };
                }
                Ok(InfoList {
                    head: ptr::null_mut(),
                })
            }
            Err(e) => Err(e),
        }
    }

    /// [`InfoList::getinfo`] with [`API_VERSION`], no node/service, no flags.
    pub fn query(hints: &Hints) -> Result<InfoList> {
        InfoList::getinfo(API_VERSION, None, None, 0, Some(hints))
    }

    /// The entries in libfabric's order.
    pub fn iter(&self) -> InfoIter<'_> {
        InfoIter {
            next: self.head,
            _list: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.head.is_null()
    }

    pub fn first(&self) -> Option<InfoRef<'_>> {
        self.iter().next()
    }

    pub fn get(&self, index: usize) -> Option<InfoRef<'_>> {
        self.iter().nth(index)
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.head.is_null() {
            // SAFETY: head is owned by self (invariant) and freed exactly once here.
            unsafe { fi::fi_freeinfo(self.head) }
        }
    }
}

impl<'a> IntoIterator for &'a InfoList {
    type Item = InfoRef<'a>;
    type IntoIter = InfoIter<'a>;
    fn into_iter(self) -> InfoIter<'a> {
        self.iter()
    }
}

impl fmt::Debug for InfoList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Iterator over an [`InfoList`].
pub struct InfoIter<'a> {
    next: *mut fi::fi_info,
    _list: PhantomData<&'a InfoList>,
}

impl<'a> Iterator for InfoIter<'a> {
    type Item = InfoRef<'a>;
    fn next(&mut self) -> Option<InfoRef<'a>> {
        // SAFETY: next is NULL or an entry of a list that lives for 'a.
        let info = unsafe { self.next.as_ref() }?;
        self.next = info.next;
        Some(InfoRef { info })
    }
}

// ---------------------------------------------------------------------------------
// InfoRef
// ---------------------------------------------------------------------------------

/// A borrowed view of one `fi_info` with typed accessors. A missing sub-attribute
/// (NULL pointer) reads as zero / `""`.
#[derive(Clone, Copy)]
pub struct InfoRef<'a> {
    info: &'a fi::fi_info,
}

impl<'a> InfoRef<'a> {
    /// View a raw `fi_info`.
    ///
    /// # Safety
    /// `ptr` must point to a valid `fi_info` (with valid or NULL sub-pointers) that is
    /// neither freed nor mutated during `'a`.
    pub unsafe fn from_raw(ptr: *const fi::fi_info) -> Option<InfoRef<'a>> {
        // SAFETY: per the caller's contract.
        unsafe { ptr.as_ref() }.map(|info| InfoRef { info })
    }

    pub fn as_ptr(&self) -> *const fi::fi_info {
        self.info
    }

    fn tx(&self) -> Option<&'a fi::fi_tx_attr> {
        // SAFETY: tx_attr is NULL or valid for the life of the info ('a).
        unsafe { self.info.tx_attr.as_ref() }
    }
    fn rx(&self) -> Option<&'a fi::fi_rx_attr> {
        // SAFETY: rx_attr is NULL or valid for 'a.
        unsafe { self.info.rx_attr.as_ref() }
    }
    fn ep(&self) -> Option<&'a fi::fi_ep_attr> {
        // SAFETY: ep_attr is NULL or valid for 'a.
        unsafe { self.info.ep_attr.as_ref() }
    }
    fn dom(&self) -> Option<&'a fi::fi_domain_attr> {
        // SAFETY: domain_attr is NULL or valid for 'a.
        unsafe { self.info.domain_attr.as_ref() }
    }
    fn fab(&self) -> Option<&'a fi::fi_fabric_attr> {
        // SAFETY: fabric_attr is NULL or valid for 'a.
        unsafe { self.info.fabric_attr.as_ref() }
    }

    /// `fabric_attr->prov_name`, e.g. `"tcp;ofi_rxm"`.
    pub fn provider_name(&self) -> &'a str {
        // SAFETY: prov_name is NULL or a string owned by the info for 'a.
        self.fab().map_or("", |f| unsafe { cstr(f.prov_name) })
    }
    /// `fabric_attr->prov_version`.
    pub fn provider_version(&self) -> u32 {
        self.fab().map_or(0, |f| f.prov_version)
    }
    /// `fabric_attr->name`, e.g. `"192.0.2.0/24"`.
    pub fn fabric_name(&self) -> &'a str {
        // SAFETY: name is NULL or a string owned by the info for 'a.
        self.fab().map_or("", |f| unsafe { cstr(f.name) })
    }
    /// `domain_attr->name`, e.g. `"eth0"`.
    pub fn domain_name(&self) -> &'a str {
        // SAFETY: name is NULL or a string owned by the info for 'a.
        self.dom().map_or("", |d| unsafe { cstr(d.name) })
    }
    pub fn caps(&self) -> u64 {
        self.info.caps
    }
    pub fn mode(&self) -> u64 {
        self.info.mode
    }
    pub fn addr_format(&self) -> u32 {
        self.info.addr_format
    }
    /// `src_addrlen`: length of the source address libfabric filled in (if any).
    pub fn src_addrlen(&self) -> usize {
        self.info.src_addrlen
    }
    /// `src_addr` as bytes (empty when absent).
    pub fn src_addr(&self) -> &'a [u8] {
        if self.info.src_addr.is_null() || self.info.src_addrlen == 0 {
            &[]
        } else {
            // SAFETY: src_addr points to src_addrlen bytes owned by the info for 'a.
            unsafe {
                std::slice::from_raw_parts(self.info.src_addr.cast::<u8>(), self.info.src_addrlen)
            }
        }
    }
    /// `domain_attr->mr_mode` (`FI_MR_*` bits).
    pub fn mr_mode(&self) -> u32 {
        self.dom().map_or(0, |d| d.mr_mode as u32)
    }
    /// `domain_attr->max_ep_tx_ctx` and `max_ep_rx_ctx`, the smaller: how many
    /// contexts a scalable endpoint can have (1: no scalable endpoints).
    pub fn max_ep_ctx(&self) -> usize {
        self.dom()
            .map_or(0, |d| d.max_ep_tx_ctx.min(d.max_ep_rx_ctx))
    }
    attr_getters! {
        /// `tx_attr->inject_size`.
        inject_size() -> usize = tx.inject_size;
        /// `tx_attr->size` and `rx_attr->size`: the queue depths.
        tx_size, rx_size -> usize = size;
        tx_caps, rx_caps -> u64 = caps;
        tx_msg_order, rx_msg_order -> u64 = msg_order;
        tx_op_flags, rx_op_flags -> u64 = op_flags;
        tx_iov_limit, rx_iov_limit -> usize = iov_limit;
        ep_type() -> fi::fi_ep_type = ep.type_;
        protocol() -> u32 = ep.protocol;
        max_msg_size() -> usize = ep.max_msg_size;
        mem_tag_format() -> u64 = ep.mem_tag_format;
        tx_ctx_cnt() -> usize = ep.tx_ctx_cnt;
        rx_ctx_cnt() -> usize = ep.rx_ctx_cnt;
        mr_key_size() -> usize = dom.mr_key_size;
        cq_data_size() -> usize = dom.cq_data_size;
        threading() -> fi::fi_threading = dom.threading;
        control_progress() -> fi::fi_progress = dom.control_progress;
        data_progress() -> fi::fi_progress = dom.data_progress;
        resource_mgmt() -> fi::fi_resource_mgmt = dom.resource_mgmt;
        av_type() -> fi::fi_av_type = dom.av_type;
        /// `domain_attr->mr_iov_limit`.
        mr_iov_limit() -> usize = dom.mr_iov_limit;
        /// `domain_attr->max_err_data`.
        max_err_data() -> usize = dom.max_err_data;
    }

    /// The NIC's PCI address, where the provider reports `nic->bus_attr` of type
    /// `FI_BUS_PCI`. None of the software providers (tcp, udp, shm, ...) does.
    pub fn pci(&self) -> Option<PciAddr> {
        // SAFETY: nic is NULL or a valid fid_nic owned by the info for 'a.
        let nic = unsafe { self.info.nic.as_ref() }?;
        // SAFETY: bus_attr is NULL or valid for 'a.
        let bus = unsafe { nic.bus_attr.as_ref() }?;
        if bus.bus_type != fi::FI_BUS_PCI {
            return None;
        }
        // SAFETY: bus_type FI_BUS_PCI says the pci member of the union is the live one.
        let pci = unsafe { bus.attr.pci };
        Some(PciAddr {
            domain: pci.domain_id,
            bus: pci.bus_id,
            device: pci.device_id,
            function: pci.function_id,
        })
    }

    /// `nic->device_attr->name`, where the provider reports one.
    pub fn nic_name(&self) -> Option<&'a str> {
        // SAFETY: nic and device_attr are NULL or valid for 'a; name is NULL or a
        // string owned by them.
        unsafe {
            let nic = self.info.nic.as_ref()?;
            let dev = nic.device_attr.as_ref()?;
            let s = cstr(dev.name);
            (!s.is_empty()).then_some(s)
        }
    }

    /// A copy of this one entry (`fi_dupinfo`, which does not follow `next`).
    pub fn to_owned(&self) -> Result<OwnedInfo> {
        // SAFETY: info is a valid fi_info; fi_dupinfo copies it (and only it).
        let p = unsafe { fi::fi_dupinfo(self.info) };
        NonNull::new(p)
            .map(|ptr| OwnedInfo { ptr })
            .ok_or(Error::NOMEM)
    }

    /// libfabric's full YAML-like description (`fi_tostr(FI_TYPE_INFO)`), for logs.
    pub fn to_verbose_string(&self) -> String {
        // fi_tostr would print the whole list from here; print a lone copy instead.
        let Ok(one) = self.to_owned() else {
            return String::new();
        };
        // SAFETY: one is a valid single fi_info; fi_tostr returns a pointer to a
        // thread-local NUL-terminated buffer that we copy before any other call.
        unsafe {
            let s = fi::fi_tostr(one.ptr.as_ptr().cast(), fi::FI_TYPE_INFO);
            if s.is_null() {
                String::new()
            } else {
                CStr::from_ptr(s).to_string_lossy().into_owned()
            }
        }
    }
}

impl fmt::Debug for InfoRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Info")
            .field("provider", &self.provider_name())
            .field("fabric", &self.fabric_name())
            .field("domain", &self.domain_name())
            .field("caps", &format_args!("{:#x}", self.caps()))
            .field("mode", &format_args!("{:#x}", self.mode()))
            .field("ep_type", &self.ep_type())
            .field("mr_mode", &format_args!("{:#x}", self.mr_mode()))
            .field("threading", &self.threading())
            .field("inject_size", &self.inject_size())
            .field("cq_data_size", &self.cq_data_size())
            .field("pci", &self.pci())
            .finish()
    }
}

// ---------------------------------------------------------------------------------
// OwnedInfo
// ---------------------------------------------------------------------------------

/// One `fi_info` entry owned on its own (a `fi_dupinfo` copy with `next == NULL`).
///
/// Invariant: `ptr` comes from `fi_dupinfo`, is owned by this value and is not mutated
/// while shared (libfabric's open calls take `fi_info *` but only read it).
pub struct OwnedInfo {
    ptr: NonNull<fi::fi_info>,
}

// SAFETY: plain heap data owned by this value; libfabric keeps no reference to the
// fi_info passed to fi_fabric/fi_domain/fi_endpoint beyond the call.
unsafe impl Send for OwnedInfo {}
// SAFETY: shared access only reads.
unsafe impl Sync for OwnedInfo {}

impl OwnedInfo {
    /// The typed view.
    pub fn info(&self) -> InfoRef<'_> {
        InfoRef {
            // SAFETY: ptr is valid for as long as self (invariant).
            info: unsafe { self.ptr.as_ref() },
        }
    }

    pub fn as_ptr(&self) -> *const fi::fi_info {
        self.ptr.as_ptr()
    }

    /// The pointer libfabric's open calls want (`fi_info *`, read only by them).
    pub(crate) fn as_open_ptr(&self) -> *mut fi::fi_info {
        self.ptr.as_ptr()
    }

    /// Another copy (`fi_dupinfo`).
    pub fn try_clone(&self) -> Result<OwnedInfo> {
        self.info().to_owned()
    }
}

impl Drop for OwnedInfo {
    fn drop(&mut self) {
        // SAFETY: ptr is owned by self (invariant) and freed exactly once here.
        unsafe { fi::fi_freeinfo(self.ptr.as_ptr()) }
    }
}

impl fmt::Debug for OwnedInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.info().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_display() {
        let p = PciAddr {
            domain: 0,
            bus: 0x3b,
            device: 0,
            function: 1,
        };
        assert_eq!(p.to_string(), "0000:3b:00.1");
    }

    #[test]
    fn hints_builder_reads_back() {
        let h = Hints::new()
            .unwrap()
            .caps(fi::FI_TAGGED as u64)
            .mode(fi::FI_CONTEXT)
            .ep_type(fi::FI_EP_RDM)
            .mr_mode(fi::FI_MR_VIRT_ADDR)
            .threading(fi::FI_THREAD_DOMAIN)
            .inject_size(64)
            .mem_tag_format(0xffff)
            .cq_data_size(4)
            .msg_order(fi::FI_ORDER_SAS as u64)
            .prov_name("tcp")
            .prov_name("udp;ofi_rxd")
            .domain_name("lo");
        assert!(h.error().is_none());
        let i = h.info();
        assert_eq!(i.caps(), fi::FI_TAGGED as u64);
        assert_eq!(i.mode(), fi::FI_CONTEXT);
        assert_eq!(i.ep_type(), fi::FI_EP_RDM);
        assert_eq!(i.mr_mode(), fi::FI_MR_VIRT_ADDR);
        assert_eq!(i.threading(), fi::FI_THREAD_DOMAIN);
        assert_eq!(i.inject_size(), 64);
        assert_eq!(i.mem_tag_format(), 0xffff);
        assert_eq!(i.cq_data_size(), 4);
        assert_eq!(i.tx_msg_order(), fi::FI_ORDER_SAS as u64);
        assert_eq!(i.rx_msg_order(), fi::FI_ORDER_SAS as u64);
        assert_eq!(i.provider_name(), "udp;ofi_rxd");
        assert_eq!(i.domain_name(), "lo");
        assert_eq!(i.pci(), None);
        let c = h.try_clone().unwrap();
        assert_eq!(c.info().provider_name(), "udp;ofi_rxd");
    }

    #[test]
    fn interior_nul_is_deferred_error() {
        let h = Hints::new().unwrap().prov_name("tc\0p");
        assert_eq!(h.error(), Some(Error::INVAL));
        assert_eq!(
            InfoList::getinfo(API_VERSION, None, None, 0, Some(&h)).err(),
            Some(Error::INVAL)
        );
    }

    #[test]
    fn version_helpers() {
        assert_eq!(version_string(fi_version(1, 17)), "1.17");
        assert!(runtime_version() >= API_VERSION);
    }
}
