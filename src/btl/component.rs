//! The exported `mca_btl_ofi_component` and its open/close/register/init entry points.

use crate::common;
use crate::ompi::component::{base_component, ffi_guard, Exported};
use crate::ompi::params::{Registered, BTL};
use ompi_sys as sys;
use std::sync::Mutex;

#[no_mangle]
pub static mca_btl_ofi_component: Exported<sys::mca_btl_base_component_3_0_0_t> =
    Exported::new(sys::mca_btl_base_component_3_0_0_t {
        btl_version: base_component(
            "opal",
            "btl",
            (3, 1, 0),
            Some(open),
            Some(close),
            Some(register),
            None,
        ),
        btl_data: sys::mca_base_component_data_t {
            param_field: 0,
            reserved: [0; 32],
        },
        btl_init: Some(init),
        btl_progress: Some(progress),
    });

/// The BTL's registered parameters (`btl_ofi_*`).
pub static PARAMS: Mutex<Option<Registered>> = Mutex::new(None);

extern "C" fn register() -> i32 {
    mca_btl_ofi_component.register("btl register", BTL, &PARAMS, |header| {
        common::register_params(header);
        super::register_base_params();
        super::stats::register();
    })
}

/// The component header, for the modex and parameter registration.
pub fn component() -> &'static sys::mca_base_component_t {
    mca_btl_ofi_component.header()
}

pub fn component_ptr() -> *const sys::mca_base_component_t {
    mca_btl_ofi_component.header_ptr()
}

extern "C" fn open() -> i32 {
    ffi_guard("btl open", sys::OPAL_ERROR, || {
        common::open_output();
        sys::OPAL_SUCCESS
    })
}

extern "C" fn close() -> i32 {
    ffi_guard("btl close", sys::OPAL_ERROR, || {
        super::finalize_component();
        common::close_output();
        sys::OPAL_SUCCESS
    })
}

extern "C" fn init(
    num_btls: *mut i32,
    enable_progress_threads: bool,
    enable_mpi_threads: bool,
) -> *mut *mut sys::mca_btl_base_module_t {
    ffi_guard("btl init", std::ptr::null_mut(), || {
        let (modules, n) = match super::init_modules(enable_progress_threads, enable_mpi_threads) {
            Ok(v) => v,
            Err(reason) => {
                log::info!("declining: {reason}");
                (std::ptr::null_mut(), 0)
            }
        };
        // SAFETY: Open MPI passes a null or valid out pointer for the module count.
        if let Some(count) = unsafe { num_btls.as_mut() } {
            *count = n;
        }
        modules
    })
}

extern "C" fn progress() -> i32 {
    ffi_guard("btl progress", 0, super::progress)
}
