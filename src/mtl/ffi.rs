//! The MTL module's `extern "C"` entries: one thin adapter each, which turns the
//! PML's raw pointers into typed handles (`ompi::comm::Comm`, `ompi::convertor::
//! Convertor`, `ompi::message::Message`, our [`Req`], references for out-parameters),
//! takes the [`Entry`] that the state is reached through, and keeps panics out of C:
//! a caught panic marks the module failed ([`FAILED`]) and every later data-path call
//! is refused with `OMPI_ERROR`.
//!
//! What it owns: the promises about the PML's pointers, made once here, one `unsafe`
//! block per entry. What it must not touch: the data path itself (`send`, `recv`,
//! `probe`).

use super::probe::{improbe_impl, imrecv_impl, iprobe_impl};
use super::recv::{cancel_impl, irecv_impl};
use super::request::{Body, Kind, Req};
use super::send::{isend_impl, send_impl};
use super::state::{Entry, FAILED};
use crate::ompi::comm::Comm;
use crate::ompi::component::ffi_guard_module;
use crate::ompi::convertor::Convertor;
use crate::ompi::message::Message;
use ompi_sys as sys;
use std::os::raw::c_int;
use std::ptr::NonNull;

/// Run data-path entry `f` under the panic barrier (see the module docs).
#[inline(always)]
fn guard(what: &str, f: impl FnOnce() -> c_int) -> c_int {
    ffi_guard_module(what, &FAILED, sys::OMPI_ERROR, f)
}

/// # Safety
/// Called by pml cm with the arguments of its MTL interface for this entry.
pub unsafe extern "C" fn mtl_send(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    dest: c_int,
    tag: c_int,
    conv: *mut sys::opal_convertor_t,
    mode: sys::mca_pml_base_send_mode_t,
) -> c_int {
    guard("mtl send", || {
        // SAFETY: pml cm calls between init and finalize with its live communicator and
        // the send's prepared convertor (or null), both valid for the call.
        let (e, comm, conv) = unsafe {
            (
                Entry::enter(),
                Comm::from_raw(comm),
                Convertor::from_raw(conv),
            )
        };
        let Some(conv) = conv else {
            return sys::OMPI_ERR_BAD_PARAM;
        };
        send_impl(&e, comm, dest, tag, conv, mode)
    })
}

/// # Safety
/// Called by pml cm with the arguments of its MTL interface for this entry.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mtl_isend(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    dest: c_int,
    tag: c_int,
    conv: *mut sys::opal_convertor_t,
    mode: sys::mca_pml_base_send_mode_t,
    _blocking: bool,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    guard("mtl isend", || {
        // SAFETY: pml cm calls between init and finalize with its live communicator,
        // the send's prepared convertor (or null), both kept until the request
        // completes, and its request with mtl_request_size bytes of ours behind it,
        // alive until we complete it.
        let (e, comm, conv, r) = unsafe {
            let comm = Comm::from_raw(comm);
            (
                Entry::enter(),
                comm,
                Convertor::from_raw(conv),
                Req::init_at(req, Body::pml(Kind::Send, comm)),
            )
        };
        let Some(conv) = conv else {
            return sys::OMPI_ERR_BAD_PARAM;
        };
        isend_impl(&e, comm, dest, tag, conv, mode, r)
    })
}

/// # Safety
/// Called by pml cm with the arguments of its MTL interface for this entry.
pub unsafe extern "C" fn mtl_irecv(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
    conv: *mut sys::opal_convertor_t,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    guard("mtl irecv", || {
        // SAFETY: pml cm calls between init and finalize with its live communicator,
        // the receive's prepared convertor (or null), both kept until the request
        // completes, and its request with mtl_request_size bytes of ours behind it,
        // alive until we complete it.
        let (e, comm, conv, r) = unsafe {
            let comm = Comm::from_raw(comm);
            (
                Entry::enter(),
                comm,
                Convertor::from_raw(conv),
                Req::init_at(req, Body::pml(Kind::Recv, comm)),
            )
        };
        let Some(conv) = conv else {
            return sys::OMPI_ERR_BAD_PARAM;
        };
        irecv_impl(&e, comm, src, tag, conv, r)
    })
}

/// # Safety
/// Called by pml cm with the arguments of its MTL interface for this entry.
pub unsafe extern "C" fn mtl_iprobe(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
    flag: *mut c_int,
    status: *mut sys::ompi_status_public_t,
) -> c_int {
    guard("mtl iprobe", || {
        // SAFETY: pml cm calls between init and finalize with its live communicator, a
        // valid flag and the caller's status or null, none of them aliased during the
        // call.
        let (e, comm, flag, status) = unsafe {
            (
                Entry::enter(),
                Comm::from_raw(comm),
                flag.as_mut(),
                status.as_mut(),
            )
        };
        let Some(flag) = flag else {
            return sys::OMPI_ERR_BAD_PARAM;
        };
        iprobe_impl(&e, comm, src, tag, flag, status)
    })
}

/// # Safety
/// Called by pml cm with the arguments of its MTL interface for this entry.
pub unsafe extern "C" fn mtl_improbe(
    _mtl: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
    src: c_int,
    tag: c_int,
    flag: *mut c_int,
    message: *mut *mut sys::ompi_message_t,
    status: *mut sys::ompi_status_public_t,
) -> c_int {
    guard("mtl improbe", || {
        // SAFETY: pml cm calls between init and finalize with its live communicator,
        // valid flag and message out-pointers and the caller's status or null, none
        // aliased during the call.
        let (e, comm, flag, message, status) = unsafe {
            (
                Entry::enter(),
                Comm::from_raw(comm),
                flag.as_mut(),
                message.as_mut(),
                status.as_mut(),
            )
        };
        let (Some(flag), Some(message)) = (flag, message) else {
            return sys::OMPI_ERR_BAD_PARAM;
        };
        improbe_impl(&e, comm, src, tag, flag, message, status)
    })
}

/// # Safety
/// Called by pml cm with the arguments of its MTL interface for this entry.
pub unsafe extern "C" fn mtl_imrecv(
    _mtl: *mut sys::mca_mtl_base_module_t,
    conv: *mut sys::opal_convertor_t,
    message: *mut *mut sys::ompi_message_t,
    req: *mut sys::mca_mtl_request_t,
) -> c_int {
    guard("mtl imrecv", || {
        // SAFETY: pml cm calls between init and finalize with the receive's prepared
        // convertor (or null), kept until the request completes; the caller's handle
        // of a message improbe published (or null), not aliased during the call; and
        // its request with mtl_request_size bytes of ours behind it, alive until we
        // complete it.
        let (e, conv, message, r) = unsafe {
            let (Some(conv), Some(message)) = (Convertor::from_raw(conv), message.as_mut()) else {
                return sys::OMPI_ERR_BAD_PARAM;
            };
            let message = Message::from_raw(message);
            let r = Req::init_at(req, Body::pml(Kind::Recv, message.comm()));
            (Entry::enter(), conv, message, r)
        };
        imrecv_impl(&e, conv, message, r)
    })
}

/// # Safety
/// Called by pml cm with the arguments of its MTL interface for this entry.
pub unsafe extern "C" fn mtl_cancel(
    _mtl: *mut sys::mca_mtl_base_module_t,
    req: *mut sys::mca_mtl_request_t,
    _flag: c_int,
) -> c_int {
    guard("mtl cancel", || {
        let Some(req) = NonNull::new(req) else {
            return sys::OMPI_ERR_BAD_PARAM;
        };
        // SAFETY: pml cm calls between init and finalize with a request of ours it has
        // not seen complete.
        let (e, r) = unsafe { (Entry::enter(), Req::of_pml(req)) };
        cancel_impl(&e, r)
    })
}
