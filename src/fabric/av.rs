//! [`AddressVector`]: the owner of a `fid_av` (`fi_av_open`), which maps peer addresses
//! (the bytes a peer's `fi_getname` produced, exchanged through the modex) to
//! `fi_addr_t` handles used on the data path.

use super::domain::Domain;
use super::error::{check, to_result, Error, Result};
use libfabric_sys as fi;
use libfabric_sys::fi_addr_t;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;

/// Zero bytes appended to an address before handing it to the provider. Providers read
/// their own fixed address size (shm: a 264-byte `struct smr_addr`, however short the
/// name it carries), not the length we pass, so a short but well-formed name must not
/// lead to a read past our buffer. 1 KiB covers every provider address in 1.17.
const ADDR_PAD: usize = 1024;

/// Attributes for [`AddressVector::open`].
#[derive(Clone, Copy, Debug)]
pub struct AvAttr {
    /// `FI_AV_MAP`, `FI_AV_TABLE`, or `FI_AV_UNSPEC` (provider's choice).
    pub av_type: fi::fi_av_type,
    /// Expected number of addresses (a sizing hint; 0 = provider default).
    pub count: usize,
    /// Bits of an `fi_addr_t` that select a peer's receive context (`fi_rx_addr`),
    /// for scalable endpoints; 0 otherwise.
    pub rx_ctx_bits: i32,
}

impl Default for AvAttr {
    fn default() -> Self {
        AvAttr {
            av_type: fi::FI_AV_UNSPEC,
            count: 0,
            rx_ctx_bits: 0,
        }
    }
}

/// An open address vector.
///
/// Invariant: `fid` is an open `fid_av` owned by this value, opened on `domain`.
pub struct AddressVector {
    fid: NonNull<fi::fid_av>,
    domain: Arc<Domain>,
    av_type: fi::fi_av_type,
}

// SAFETY: the AV is only used through libfabric calls, whose thread safety is the
// domain's negotiated threading level; below FI_THREAD_SAFE the caller serializes
// (module docs of `fabric`).
unsafe impl Send for AddressVector {}
// SAFETY: as for Send.
unsafe impl Sync for AddressVector {}

impl AddressVector {
    /// `fi_av_open` on `domain`.
    pub fn open(domain: &Arc<Domain>, attr: &AvAttr) -> Result<Arc<AddressVector>> {
        let mut a = fi::fi_av_attr {
            type_: attr.av_type,
            count: attr.count,
            rx_ctx_bits: attr.rx_ctx_bits,
            ..Default::default()
        };
        let mut fid: *mut fi::fid_av = ptr::null_mut();
        // SAFETY: the domain is open (we hold an Arc); attr and out pointer are valid
        // for the call; context NULL is allowed.
        check(unsafe { fi::fi_av_open(domain.as_ptr(), &mut a, &mut fid, ptr::null_mut()) })?;
        let fid = NonNull::new(fid).ok_or(Error::NOMEM)?;
        Ok(Arc::new(AddressVector {
            fid,
            domain: Arc::clone(domain),
            // the provider writes back its choice when asked for FI_AV_UNSPEC
            av_type: a.type_,
        }))
    }

    pub fn domain(&self) -> &Arc<Domain> {
        &self.domain
    }

    /// The AV type the provider opened (`FI_AV_MAP` / `FI_AV_TABLE`).
    pub fn av_type(&self) -> fi::fi_av_type {
        self.av_type
    }

    /// Insert one address (the bytes of a peer's [`super::Endpoint::getname`]).
    /// Returns its `fi_addr_t`, or `FI_EADDRNOTAVAIL` if the provider refused it.
    pub fn insert(&self, addr: &[u8]) -> Result<fi_addr_t> {
        if addr.is_empty() {
            return Err(Error::INVAL);
        }
        let mut buf = Vec::with_capacity(addr.len() + ADDR_PAD);
        buf.extend_from_slice(addr);
        buf.resize(addr.len() + ADDR_PAD, 0);
        let mut out = super::FI_ADDR_NOTAVAIL;
        // SAFETY: buf holds the address followed by ADDR_PAD zero bytes, more than any
        // provider reads for one address; out is valid for one fi_addr_t.
        let n = unsafe { self.insert_raw(buf.as_ptr().cast(), 1, &mut out, 0) }?;
        if n != 1 || out == super::FI_ADDR_NOTAVAIL {
            return Err(Error(fi::FI_EADDRNOTAVAIL as i32));
        }
        Ok(out)
    }

    /// Insert `count` addresses packed back to back in `addrs` in one call, as the MTL
    /// does with the names gathered from the modex. Fails with `FI_EADDRNOTAVAIL` if
    /// any address was refused (use [`AddressVector::insert_raw`] to see which).
    ///
    /// # Safety
    /// `addrs` must hold `count` complete provider addresses laid out the way the
    /// provider reads them: each exactly as long as `fi_getname` reports for this
    /// provider (all peers of one provider have names of the same length). The provider
    /// decides how many bytes it reads; a shorter buffer makes it read past the end.
    pub unsafe fn insert_many(&self, addrs: &[u8], count: usize) -> Result<Vec<fi_addr_t>> {
        if count == 0 {
            return Ok(Vec::new());
        }
        if addrs.is_empty() || !addrs.len().is_multiple_of(count) {
            return Err(Error::INVAL);
        }
        let mut out = vec![super::FI_ADDR_NOTAVAIL; count];
        // SAFETY: the caller guarantees addrs holds count provider addresses; out has
        // room for count handles.
        let n = unsafe { self.insert_raw(addrs.as_ptr().cast(), count, out.as_mut_ptr(), 0) }?;
        if n != count || out.contains(&super::FI_ADDR_NOTAVAIL) {
            return Err(Error(fi::FI_EADDRNOTAVAIL as i32));
        }
        Ok(out)
    }

    /// `fi_av_insert` as is: returns the number of addresses inserted; entries of
    /// `fi_addr` for refused addresses are `FI_ADDR_NOTAVAIL`.
    ///
    /// # Safety
    /// `addr` points to `count` complete provider addresses (see
    /// [`AddressVector::insert_many`]); `fi_addr` is NULL (allowed only for
    /// `FI_AV_TABLE`) or has room for `count` handles. Both stay valid for the call.
    pub unsafe fn insert_raw(
        &self,
        addr: *const c_void,
        count: usize,
        fi_addr: *mut fi_addr_t,
        flags: u64,
    ) -> Result<usize> {
        // SAFETY: the AV is open; pointer validity is the caller's contract.
        let ret = unsafe {
            fi::fi_av_insert(
                self.fid.as_ptr(),
                addr,
                count,
                fi_addr,
                flags,
                ptr::null_mut(),
            )
        };
        to_result(ret as isize)
    }

    /// `fi_av_remove` of the given handles.
    pub fn remove(&self, addrs: &[fi_addr_t]) -> Result<()> {
        if addrs.is_empty() {
            return Ok(());
        }
        // libfabric takes a non-const array but does not write to it; give it a copy.
        let mut copy = addrs.to_vec();
        // SAFETY: the AV is open; copy holds addrs.len() handles for the call.
        check(unsafe { fi::fi_av_remove(self.fid.as_ptr(), copy.as_mut_ptr(), copy.len(), 0) })
    }

    /// `fi_av_lookup`: the raw address behind a handle.
    pub fn lookup(&self, addr: fi_addr_t) -> Result<Vec<u8>> {
        let mut cap = 256usize;
        loop {
            // One spare byte: shm 1.17 writes a NUL at addr[*addrlen] (one past the
            // length it is given).
            let mut buf = vec![0u8; cap + 1];
            let mut len = cap;
            // SAFETY: the AV is open; buf has cap + 1 writable bytes and len says cap.
            check(unsafe {
                fi::fi_av_lookup(self.fid.as_ptr(), addr, buf.as_mut_ptr().cast(), &mut len)
            })?;
            if len <= cap {
                buf.truncate(len);
                return Ok(buf);
            }
            cap = len;
        }
    }

    /// `fi_av_straddr`: a printable form of a raw address, for logs.
    pub fn straddr(&self, addr: &[u8]) -> String {
        let mut padded = addr.to_vec();
        padded.resize(addr.len() + ADDR_PAD, 0);
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: the AV is open; padded holds the address plus zero padding (see
        // ADDR_PAD); buf has len writable bytes.
        let p = unsafe {
            fi::fi_av_straddr(
                self.fid.as_ptr(),
                padded.as_ptr().cast(),
                buf.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if p.is_null() {
            return String::new();
        }
        // Providers truncate into buf; make sure it is terminated before reading.
        if let Some(last) = buf.last_mut() {
            *last = 0;
        }
        CStr::from_bytes_until_nul(&buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

// Endpoints bound to this AV hold an Arc of it; the domain Arc is released after
// the close.
fid_owner!(AddressVector, fid_av, "av");

impl fmt::Debug for AddressVector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AddressVector")
            .field("domain", &self.domain.name())
            .field("av_type", &self.av_type)
            .finish()
    }
}
