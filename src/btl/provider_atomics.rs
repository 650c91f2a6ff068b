//! The provider's atomics: `atomic_op`, `atomic_fop` and `atomic_cswap` with
//! `fi_atomic`, `fi_fetch_atomic` and `fi_compare_atomic`, for the operations and
//! widths `fi_query_atomic` offered (`open/offer.rs`). Atomics emulated with active
//! messages are `amo.rs`.
//!
//! What it owns: nothing; each operation is an [`RdmaOp`](super::rdma::RdmaOp)
//! posted through `rdma::run`. What it must not touch: the emulated atomics.

use super::module::{Module, PeerEp};
use super::rdma::{post_op, run, Req};
use super::registration::{Registration, HANDLE};
use super::resolve::Again;
use crate::fabric::{AtomicOp, Local};
use crate::ompi::btl::rdma_args;
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

fn supported(module: &Module, bit: u32, width: usize) -> bool {
    let f = module.sup.btl_atomic_flags;
    f & bit != 0 && (width == 8 || f & sys::MCA_BTL_ATOMIC_SUPPORTS_32BIT != 0)
}

/// The datatype and libfabric operation of a BTL atomic `op` with `flags`, if this
/// module offers it.
fn offered(
    module: &Module,
    op: sys::mca_btl_base_atomic_op_t,
    flags: c_int,
) -> Result<(AtomicOp, usize), c_int> {
    let (datatype, width) = datatype(flags)?;
    match map_op(op).filter(|(b, _)| supported(module, *b, width)) {
        Some((_, op)) => Ok((AtomicOp { datatype, op }, width)),
        None => Err(UNSUPPORTED),
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
        // SAFETY: the arguments of osc's atomic_op, as the BTL interface defines them
        // (no local buffer).
        let args = unsafe {
            rdma_args::<Module, PeerEp, Registration, HANDLE>(
                btl,
                endpoint,
                ptr::null_mut(),
                0,
                ptr::null_mut(),
                remote_handle,
                cbfunc,
                cbcontext,
                cbdata,
            )
        };
        let mut r = Req::new(args, remote_address);
        let aop = match offered(r.module, op, flags) {
            Ok((aop, _)) => aop,
            Err(e) => return e,
        };
        if let Some(rc) = super::resolve::hold_if_stale(&mut r, Again::Op { op, operand, flags }) {
            return rc;
        }
        atomic_op(r, aop, operand)
    })
}

/// A non-fetching atomic (its handle checked by `resolve`).
fn atomic_op(r: Req, aop: AtomicOp, operand: u64) -> c_int {
    run(r, 2, operand, 0, None, |state, o, _local, remote| {
        // The operand lives in the op (little-endian, so its first 4 bytes are the
        // 32-bit value) until the completion. Like a put, with delivery a
        // non-fetching atomic completes when it has been applied at the target (osc
        // rdma flushes and unlocks on it).
        post_op(o, Local::NONE, |ctx, _, operand, _| {
            state.fi(|s| {
                state
                    .tx()
                    .atomic(s, operand, remote, aop, ctx, state.delivery)
            })
        })
    })
}

/// Reissue a held `btl_atomic_op`, `btl_atomic_fop` or `btl_atomic_cswap` with the
/// handle found (`resolve`): `None` when the module does not offer it.
pub(super) fn reissue(r: Req, again: Again) -> c_int {
    match again {
        Again::Op { op, operand, flags } => match offered(r.module, op, flags) {
            Ok((aop, _)) => atomic_op(r, aop, operand),
            Err(e) => e,
        },
        Again::Fop { op, operand, flags } => match offered(r.module, op, flags) {
            Ok((aop, _)) => atomic_fop(r, aop, operand),
            Err(e) => e,
        },
        Again::Cswap {
            compare,
            value,
            flags,
        } => match cswap_offered(r.module, flags) {
            Ok(dt) => atomic_cswap(r, dt, compare, value),
            Err(e) => e,
        },
        Again::Put { .. } | Again::Get { .. } => sys::OPAL_ERR_BAD_PARAM,
    }
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
        let width = datatype(flags).map_or(0, |(_, w)| w);
        // SAFETY: the arguments of osc's atomic_fop, as the BTL interface defines them:
        // the local buffer has room for the result until the callback.
        let args = unsafe {
            rdma_args::<Module, PeerEp, Registration, HANDLE>(
                btl,
                endpoint,
                local_address,
                width,
                local_handle,
                remote_handle,
                cbfunc,
                cbcontext,
                cbdata,
            )
        };
        let mut r = Req::new(args, remote_address);
        let aop = match offered(r.module, op, flags) {
            Ok((aop, _)) => aop,
            Err(e) => return e,
        };
        if let Some(rc) = super::resolve::hold_if_stale(&mut r, Again::Fop { op, operand, flags }) {
            return rc;
        }
        atomic_fop(r, aop, operand)
    })
}

/// A fetching atomic (its handle checked by `resolve`).
fn atomic_fop(r: Req, aop: AtomicOp, operand: u64) -> c_int {
    run(r, 3, operand, 0, None, |state, o, result, remote| {
        // The operand in the op, the result in the caller's registered buffer; both
        // live until the completion.
        post_op(o, result, |ctx, result, operand, _| {
            state.fi(|s| {
                state
                    .tx()
                    .fetch_atomic(s, operand, result, remote, aop, ctx)
            })
        })
    })
}

/// The datatype of a compare-and-swap with `flags`, if this module offers it.
fn cswap_offered(module: &Module, flags: c_int) -> Result<fi::fi_datatype, c_int> {
    let (dt, width) = datatype(flags)?;
    if !supported(module, sys::MCA_BTL_ATOMIC_SUPPORTS_CSWAP, width) {
        return Err(UNSUPPORTED);
    }
    Ok(dt)
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
        let width = datatype(flags).map_or(0, |(_, w)| w);
        // SAFETY: the arguments of osc's atomic_cswap, as the BTL interface defines
        // them: the local buffer has room for the result until the callback.
        let args = unsafe {
            rdma_args::<Module, PeerEp, Registration, HANDLE>(
                btl,
                endpoint,
                local_address,
                width,
                local_handle,
                remote_handle,
                cbfunc,
                cbcontext,
                cbdata,
            )
        };
        let mut r = Req::new(args, remote_address);
        let dt = match cswap_offered(r.module, flags) {
            Ok(dt) => dt,
            Err(e) => return e,
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
        atomic_cswap(r, dt, compare, value)
    })
}

/// A compare-and-swap (its handle checked by `resolve`).
fn atomic_cswap(r: Req, dt: fi::fi_datatype, compare: u64, value: u64) -> c_int {
    run(r, 4, value, compare, None, |state, o, result, remote| {
        // Value and compare live in the op, the result in the caller's registered
        // buffer, until the completion.
        post_op(o, result, |ctx, result, operand, cmp| {
            state.fi(|s| {
                state
                    .tx()
                    .compare_atomic(s, operand, cmp, result, remote, dt, ctx)
            })
        })
    })
}
