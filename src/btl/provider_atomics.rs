//! The provider's atomics: `atomic_op`, `atomic_fop` and `atomic_cswap` with
//! `fi_atomic`, `fi_fetch_atomic` and `fi_compare_atomic`, for the operations and
//! widths `fi_query_atomic` offered (`open/offer.rs`). Atomics emulated with active
//! messages are `amo.rs`.
//!
//! What it owns: nothing; each operation is an [`RdmaOp`](super::rdma::RdmaOp)
//! posted through `rdma::run`. What it must not touch: the emulated atomics.

use super::module::Module;
use super::rdma::{ctx_of, run, Req};
use super::registration::Handle;
use super::resolve::Again;
use crate::fabric::Error;
use crate::ompi::component::ffi_guard;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::ptr;

/// BTL atomic op -> libfabric op, for the operations the BTL interface defines.
pub const ATOMIC_OPS: [(u32, fi::fi_op); 10] = [
    (sys::MCA_BTL_ATOMIC_SUPPORTS_ADD, fi::FI_SUM),
    (sys::MCA_BTL_ATOMIC_SUPPORTS_AND, fi::FI_BAND),
    (sys::MCA_BTL_ATOMIC_SUPPORTS_OR, fi::FI_BOR),
    (sys::MCA_BTL_ATOMIC_SUPPORTS_XOR, fi::FI_BXOR),
    (sys::MCA_BTL_ATOMIC_SUPPORTS_LAND, fi::FI_LAND),
    (sys::MCA_BTL_ATOMIC_SUPPORTS_LOR, fi::FI_LOR),
    (sys::MCA_BTL_ATOMIC_SUPPORTS_LXOR, fi::FI_LXOR),
    (sys::MCA_BTL_ATOMIC_SUPPORTS_SWAP, fi::FI_ATOMIC_WRITE),
    (sys::MCA_BTL_ATOMIC_SUPPORTS_MIN, fi::FI_MIN),
    (sys::MCA_BTL_ATOMIC_SUPPORTS_MAX, fi::FI_MAX),
];

/// The support bit and libfabric op of a BTL atomic op.
fn map_op(op: sys::mca_btl_base_atomic_op_t) -> Option<(u32, fi::fi_op)> {
    let i = match op {
        sys::MCA_BTL_ATOMIC_ADD => 0,
        sys::MCA_BTL_ATOMIC_AND => 1,
        sys::MCA_BTL_ATOMIC_OR => 2,
        sys::MCA_BTL_ATOMIC_XOR => 3,
        sys::MCA_BTL_ATOMIC_LAND => 4,
        sys::MCA_BTL_ATOMIC_LOR => 5,
        sys::MCA_BTL_ATOMIC_LXOR => 6,
        sys::MCA_BTL_ATOMIC_SWAP => 7,
        sys::MCA_BTL_ATOMIC_MIN => 8,
        sys::MCA_BTL_ATOMIC_MAX => 9,
        _ => return None,
    };
    Some(ATOMIC_OPS[i])
}

/// What an atomic this module does not offer (operation, width or float) returns:
/// `OPAL_ERR_NOT_SUPPORTED`, the one error on which osc rdma falls back to get, op and
/// put under its accumulate lock. Open MPI 4.1.4's osc rdma hands the BTL every
/// operation it maps without looking at `btl_atomic_flags` beyond the width
/// (`ompi_osc_rdma_fetch_and_op_atomic`), and `ompi_osc_rdma_gacc_amo` tries again,
/// forever, after any other error.
pub const UNSUPPORTED: c_int = sys::OPAL_ERR_NOT_SUPPORTED;

fn datatype(flags: c_int) -> Result<(fi::fi_datatype, usize), c_int> {
    if flags as u32 & sys::MCA_BTL_ATOMIC_FLAG_FLOAT != 0 {
        return Err(UNSUPPORTED);
    }
    Ok(if flags as u32 & sys::MCA_BTL_ATOMIC_FLAG_32BIT != 0 {
        (fi::FI_INT32, 4)
    } else {
        (fi::FI_INT64, 8)
    })
}

fn supported(btl: *mut sys::mca_btl_base_module_t, bit: u32, width: usize) -> bool {
    // SAFETY: btl is our module.
    let f = unsafe { (*btl).btl_atomic_flags };
    f & bit != 0 && (width == 8 || f & sys::MCA_BTL_ATOMIC_SUPPORTS_32BIT != 0)
}

#[inline]
fn posted(ret: isize) -> Result<(), Error> {
    if ret == 0 {
        Ok(())
    } else {
        Err(Error::from_ret(ret))
    }
}

pub(crate) extern "C" fn btl_atomic_op(
    btl: *mut sys::mca_btl_base_module_t,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    remote_address: u64,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    op: sys::mca_btl_base_atomic_op_t,
    operand: u64,
    flags: c_int,
    _order: c_int,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
) -> c_int {
    ffi_guard("btl atomic_op", sys::OPAL_ERROR, || {
        let (dt, width) = match datatype(flags) {
            Ok(v) => v,
            Err(e) => return e,
        };
        let Some((bit, fop)) = map_op(op).filter(|(b, _)| supported(btl, *b, width)) else {
            return UNSUPPORTED;
        };
        let _ = bit;
        let mut r = Req {
            mp: btl as *mut Module,
            endpoint,
            local_address: ptr::null_mut(),
            local_handle: ptr::null_mut(),
            remote_address,
            remote_handle,
            handle: Handle::default(),
            cbfunc,
            cbcontext,
            cbdata,
        };
        if let Some(rc) = super::resolve::hold_if_stale(&mut r, Again::Op { op, operand, flags }) {
            return rc;
        }
        run(
            r,
            2,
            0,
            operand,
            0,
            None,
            |state, o, _desc, dest, raddr, key| {
                // SAFETY: the operand lives in the op (little-endian, so its first 4 bytes
                // are the 32-bit value) until the completion.
                let buf = unsafe { &raw const (*o).operand } as *const c_void;
                state.fi(|| {
                    // SAFETY: the operand lives in the op until the completion; the endpoint
                    // is open and calls are serialised by fi.
                    posted(unsafe {
                        if state.delivery {
                            // Like a put, a non-fetching atomic completes when it has been
                            // applied at the target (osc rdma flushes and unlocks on it).
                            let ioc = fi::fi_ioc {
                                addr: buf as *mut c_void,
                                count: 1,
                            };
                            let rma = fi::fi_rma_ioc {
                                addr: raddr,
                                count: 1,
                                key,
                            };
                            let mut desc: *mut c_void = ptr::null_mut();
                            let msg = fi::fi_msg_atomic {
                                msg_iov: &ioc,
                                desc: &mut desc,
                                iov_count: 1,
                                addr: dest,
                                rma_iov: &rma,
                                rma_iov_count: 1,
                                datatype: dt,
                                op: fop,
                                context: ctx_of(o),
                                data: 0,
                            };
                            fi::fi_atomicmsg(
                                state.tx().as_ptr(),
                                &msg,
                                (fi::FI_DELIVERY_COMPLETE | fi::FI_COMPLETION) as u64,
                            )
                        } else {
                            fi::fi_atomic(
                                state.tx().as_ptr(),
                                buf,
                                1,
                                ptr::null_mut(),
                                dest,
                                raddr,
                                key,
                                dt,
                                fop,
                                ctx_of(o),
                            )
                        }
                    })
                })
            },
        )
    })
}

pub(crate) extern "C" fn btl_atomic_fop(
    btl: *mut sys::mca_btl_base_module_t,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    remote_address: u64,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    op: sys::mca_btl_base_atomic_op_t,
    operand: u64,
    flags: c_int,
    _order: c_int,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
) -> c_int {
    ffi_guard("btl atomic_fop", sys::OPAL_ERROR, || {
        let (dt, width) = match datatype(flags) {
            Ok(v) => v,
            Err(e) => return e,
        };
        let Some((_, fop)) = map_op(op).filter(|(b, _)| supported(btl, *b, width)) else {
            return UNSUPPORTED;
        };
        let mut r = Req {
            mp: btl as *mut Module,
            endpoint,
            local_address,
            local_handle,
            remote_address,
            remote_handle,
            handle: Handle::default(),
            cbfunc,
            cbcontext,
            cbdata,
        };
        if let Some(rc) = super::resolve::hold_if_stale(&mut r, Again::Fop { op, operand, flags }) {
            return rc;
        }
        run(
            r,
            3,
            width,
            operand,
            0,
            None,
            |state, o, desc, dest, raddr, key| {
                // SAFETY: operand in the op, result in the caller's registered buffer; both
                // live until the completion.
                let buf = unsafe { &raw const (*o).operand } as *const c_void;
                state.fi(|| {
                    // SAFETY: see above; the endpoint is open and calls are serialised by fi.
                    posted(unsafe {
                        fi::fi_fetch_atomic(
                            state.tx().as_ptr(),
                            buf,
                            1,
                            ptr::null_mut(),
                            local_address,
                            desc,
                            dest,
                            raddr,
                            key,
                            dt,
                            fop,
                            ctx_of(o),
                        )
                    })
                })
            },
        )
    })
}

pub(crate) extern "C" fn btl_atomic_cswap(
    btl: *mut sys::mca_btl_base_module_t,
    endpoint: *mut sys::mca_btl_base_endpoint_t,
    local_address: *mut c_void,
    remote_address: u64,
    local_handle: *mut sys::mca_btl_base_registration_handle_t,
    remote_handle: *mut sys::mca_btl_base_registration_handle_t,
    compare: u64,
    value: u64,
    flags: c_int,
    _order: c_int,
    cbfunc: sys::mca_btl_base_rdma_completion_fn_t,
    cbcontext: *mut c_void,
    cbdata: *mut c_void,
) -> c_int {
    ffi_guard("btl atomic_cswap", sys::OPAL_ERROR, || {
        let (dt, width) = match datatype(flags) {
            Ok(v) => v,
            Err(e) => return e,
        };
        if !supported(btl, sys::MCA_BTL_ATOMIC_SUPPORTS_CSWAP, width) {
            return UNSUPPORTED;
        }
        let mut r = Req {
            mp: btl as *mut Module,
            endpoint,
            local_address,
            local_handle,
            remote_address,
            remote_handle,
            handle: Handle::default(),
            cbfunc,
            cbcontext,
            cbdata,
        };
        if let Some(rc) = super::resolve::hold_if_stale(
            &mut r,
            Again::Cswap {
                compare,
                value,
                flags,
            },
        ) {
            return rc;
        }
        run(
            r,
            4,
            width,
            value,
            compare,
            None,
            |state, o, desc, dest, raddr, key| {
                // SAFETY: value and compare live in the op, the result in the caller's
                // registered buffer, until the completion.
                let (buf, cmp) = unsafe {
                    (
                        &raw const (*o).operand as *const c_void,
                        &raw const (*o).compare as *const c_void,
                    )
                };
                state.fi(|| {
                    // SAFETY: see above; the endpoint is open and calls are serialised by fi.
                    posted(unsafe {
                        fi::fi_compare_atomic(
                            state.tx().as_ptr(),
                            buf,
                            1,
                            ptr::null_mut(),
                            cmp,
                            ptr::null_mut(),
                            local_address,
                            desc,
                            dest,
                            raddr,
                            key,
                            dt,
                            fi::FI_CSWAP,
                            ctx_of(o),
                        )
                    })
                })
            },
        )
    })
}
