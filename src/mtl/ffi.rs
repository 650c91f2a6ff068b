//! The MTL module's `extern "C"` entries: one thin adapter each, which turns the
//! PML's raw pointers into the handles of `ompi::comm` and `ompi::convertor` (and
//! references where the PML passes out-parameters), and keeps panics out of C.
//!
//! What it owns: the promises about the PML's pointers, made once here. What it must
//! not touch: the data path itself (`send`, `recv`, `probe`).

use super::probe::{improbe_impl, imrecv_impl, iprobe_impl};
use super::recv::{cancel_impl, irecv_impl};
use super::send::{isend_impl, send_impl};
use crate::ompi::comm::Comm;
use crate::ompi::component::ffi_guard;
use crate::ompi::convertor::Convertor;
use ompi_sys as sys;
use std::os::raw::c_int;

/// The PML's communicator.
///
/// # Safety
/// `comm` is the live communicator the PML passed to an entry point; it outlives the
/// operation (the PML frees a communicator only after its operations completed).
#[inline(always)]
unsafe fn comm_of(comm: *mut sys::ompi_communicator_t) -> Comm {
    // SAFETY: forwarded from the caller: a live communicator of the PML's.
    unsafe { Comm::from_raw(comm) }
}

/// The PML's convertor, or `OMPI_ERR_BAD_PARAM` for none.
///
/// # Safety
/// `conv` is null or the prepared convertor of the operation, which the PML keeps
/// until the operation completes.
#[inline(always)]
unsafe fn conv_of(conv: *mut sys::opal_convertor_t) -> Result<Convertor, c_int> {
    // SAFETY: forwarded from the caller.
    unsafe { Convertor::from_raw(conv) }.ok_or(sys::OMPI_ERR_BAD_PARAM)
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
    ffi_guard("mtl send", sys::OMPI_ERROR, || {
        // SAFETY: the PML passes its live communicator and the send's convertor.
        let (comm, conv) = unsafe { (comm_of(comm), conv_of(conv)) };
        conv.map_or_else(|e| e, |conv| send_impl(comm, dest, tag, conv, mode))
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
    ffi_guard("mtl isend", sys::OMPI_ERROR, || {
        // SAFETY: the PML passes its live communicator and the send's convertor.
        let (comm, conv) = unsafe { (comm_of(comm), conv_of(conv)) };
        conv.map_or_else(
            |e| e,
            // SAFETY: req is the PML's request with mtl_request_size bytes of ours
            // behind it, alive until we complete it.
            |conv| unsafe { isend_impl(comm, dest, tag, conv, mode, req) },
        )
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
    ffi_guard("mtl irecv", sys::OMPI_ERROR, || {
        // SAFETY: the PML passes its live communicator and the receive's convertor.
        let (comm, conv) = unsafe { (comm_of(comm), conv_of(conv)) };
        conv.map_or_else(
            |e| e,
            // SAFETY: req is the PML's request with mtl_request_size bytes of ours
            // behind it, alive until we complete it.
            |conv| unsafe { irecv_impl(comm, src, tag, conv, req) },
        )
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
    ffi_guard("mtl iprobe", sys::OMPI_ERROR, || {
        // SAFETY: the PML passes its live communicator, a valid flag and the caller's
        // status or null, none of them aliased during the call.
        let (comm, flag, status) = unsafe { (comm_of(comm), flag.as_mut(), status.as_mut()) };
        let Some(flag) = flag else {
            return sys::OMPI_ERR_BAD_PARAM;
        };
        iprobe_impl(comm, src, tag, flag, status)
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
    ffi_guard("mtl improbe", sys::OMPI_ERROR, || {
        // SAFETY: the PML passes its live communicator, valid flag and message
        // out-pointers and the caller's status or null, none aliased during the call.
        let (comm, flag, message, status) = unsafe {
            (
                comm_of(comm),
                flag.as_mut(),
                message.as_mut(),
                status.as_mut(),
            )
        };
        let (Some(flag), Some(message)) = (flag, message) else {
            return sys::OMPI_ERR_BAD_PARAM;
        };
        improbe_impl(comm, src, tag, flag, message, status)
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
    ffi_guard("mtl imrecv", sys::OMPI_ERROR, || {
        // SAFETY: the PML passes the receive's convertor and the message handle that
        // improbe published, not aliased during the call.
        let (conv, message) = unsafe { (conv_of(conv), message.as_mut()) };
        let (Ok(conv), Some(message)) = (conv, message) else {
            return sys::OMPI_ERR_BAD_PARAM;
        };
        // SAFETY: *message is a message improbe published (its req_ptr is ours); req
        // is the PML's request with our bytes behind it, alive until we complete it.
        unsafe { imrecv_impl(conv, message, req) }
    })
}

/// # Safety
/// Called by pml cm with the arguments of its MTL interface for this entry.
pub unsafe extern "C" fn mtl_cancel(
    _mtl: *mut sys::mca_mtl_base_module_t,
    req: *mut sys::mca_mtl_request_t,
    _flag: c_int,
) -> c_int {
    // SAFETY: req is a request of ours the PML has not seen complete.
    ffi_guard("mtl cancel", sys::OMPI_ERROR, || unsafe {
        cancel_impl(req)
    })
}
