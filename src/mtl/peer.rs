//! Peers and envelopes: the fabric address and fast box of a rank, stored in its
//! `ompi_proc_t` by add_procs, and the checked decoding of a received envelope.
//!
//! What it owns: the lookup of a peer from (communicator, rank). What it must not
//! touch: the insertion of addresses into the address vector (`setup.rs`).

use super::state::Mtl;
use super::tag::Envelope;
use crate::common::fbox;
use crate::fabric::FI_ADDR_UNSPEC;
use crate::ompi::comm::Comm;
use crate::ompi::proc::Slot;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::c_int;
use std::ptr;
use std::sync::atomic::Ordering;

/// What add_procs stores in `proc_endpoints[OMPI_PROC_ENDPOINT_TAG_MTL]`.
pub struct PeerEndpoint {
    pub addr: fi::fi_addr_t,
    /// The ring claimed in the peer's fast-box segment (software matching on shm,
    /// `softmatch`), if any.
    pub fbox: Option<fbox::Tx>,
}

/// A peer as the send paths see it: its fabric address and fast box.
#[derive(Clone, Copy)]
pub struct Peer {
    pub addr: fi::fi_addr_t,
    fbox: *const fbox::Tx,
}

impl Peer {
    /// A peer that cannot be named (its messages go nowhere).
    pub const UNKNOWN: Peer = Peer {
        addr: FI_ADDR_UNSPEC,
        fbox: ptr::null(),
    };

    /// The ring to the peer's fast-box segment, if any.
    #[inline(always)]
    pub fn fbox(&self) -> Option<&fbox::Tx> {
        // SAFETY: the ring lives in the peer's PeerEndpoint until del_procs, after
        // which nothing is sent to the peer.
        unsafe { self.fbox.as_ref() }
    }
}

/// The fabric address of `rank` in `comm`, adding the proc if it was not yet known.
#[inline]
pub(super) fn peer_addr(comm: Comm, rank: c_int) -> Result<fi::fi_addr_t, c_int> {
    peer(comm, rank).map(|p| p.addr)
}

/// `rank` of `comm` ([`Peer`]), adding the proc if it was not yet known.
#[inline]
pub(super) fn peer(comm: Comm, rank: c_int) -> Result<Peer, c_int> {
    let of = |ep: *mut PeerEndpoint| {
        // SAFETY: we stored a PeerEndpoint there; it lives until del_procs.
        let ep = unsafe { &*ep };
        Peer {
            addr: ep.addr,
            fbox: ep
                .fbox
                .as_ref()
                .map_or(ptr::null(), |t| t as *const fbox::Tx),
        }
    };
    let Some(proc_) = comm.peer_proc(rank) else {
        return Err(sys::OMPI_ERR_BAD_PARAM);
    };
    let ep = proc_.endpoint(Slot::Mtl) as *mut PeerEndpoint;
    if !ep.is_null() {
        return Ok(of(ep));
    }
    super::setup::add_procs_inner(&[proc_])?;
    // Now filled in by add_procs.
    let ep = proc_.endpoint(Slot::Mtl) as *mut PeerEndpoint;
    if ep.is_null() {
        Err(sys::OMPI_ERR_UNREACH)
    } else {
        Ok(of(ep))
    }
}

/// Decode and check the envelope of a message received on `comm`. A rejected one is
/// logged and counted, and the caller reports it through the request or return code
/// (never a lookup of a rank outside the communicator, which would read out of bounds).
pub(super) fn envelope(m: &Mtl, comm: Comm, bits: u64, data: u64) -> Result<Envelope, c_int> {
    m.layout
        .decode(bits, data, comm.cid(), comm.remote_size())
        .map_err(|e| {
            m.counters.bad_envelopes.fetch_add(1, Ordering::Relaxed);
            log::error!("rejected a received message (tag {bits:#x}, data {data:#x}): {e}");
            sys::OMPI_ERROR
        })
}
