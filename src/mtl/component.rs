//! The exported `mca_mtl_ofi_component` and its open/close/register/init entry points.

use crate::common;
use crate::ompi::component::{base_component, ffi_guard, Exported};
use crate::ompi::params::{Registered, MTL};
use ompi_sys as sys;
use std::sync::Mutex;

#[no_mangle]
pub static mca_mtl_ofi_component: Exported<sys::mca_mtl_base_component_2_0_0_t> =
    Exported::new(sys::mca_mtl_base_component_2_0_0_t {
        mtl_version: base_component(
            "ompi",
            "mtl",
            (2, 0, 0),
            Some(open),
            Some(close),
            Some(register),
            Some(query),
        ),
        mtl_data: sys::mca_base_component_data_t {
            param_field: 0,
            reserved: [0; 32],
        },
        mtl_init: Some(init),
    });

/// The MTL's registered parameters (`mtl_ofi_*`).
pub static PARAMS: Mutex<Option<Registered>> = Mutex::new(None);

extern "C" fn register() -> i32 {
    mca_mtl_ofi_component.register("mtl register", MTL, &PARAMS, |header| {
        common::register_params(header);
        super::stats::register();
    })
}

/// The component header, for the modex and parameter registration.
pub fn component() -> &'static sys::mca_base_component_t {
    mca_mtl_ofi_component.header()
}

pub fn component_ptr() -> *const sys::mca_base_component_t {
    mca_mtl_ofi_component.header_ptr()
}

/// mca_base_select asks for a priority and a module; pml cm then calls `mtl_init`.
extern "C" fn query(module: *mut *mut sys::mca_base_module_t, priority: *mut i32) -> i32 {
    ffi_guard("mtl query", sys::OPAL_ERROR, || {
        let prio = crate::common::sync::lock(&PARAMS)
            .as_ref()
            .map(|p| p.int(crate::ompi::params::mtl::PRIORITY))
            .unwrap_or(25);
        // SAFETY: Open MPI passes valid out pointers.
        unsafe {
            *priority = prio as i32;
            *module = super::setup::module_ptr() as *mut sys::mca_base_module_t;
        }
        sys::OPAL_SUCCESS
    })
}

extern "C" fn open() -> i32 {
    ffi_guard("mtl open", sys::OPAL_ERROR, || {
        common::open_output();
        sys::OPAL_SUCCESS
    })
}

extern "C" fn close() -> i32 {
    ffi_guard("mtl close", sys::OPAL_ERROR, || {
        super::finalize_component();
        common::close_output();
        sys::OPAL_SUCCESS
    })
}

extern "C" fn init(
    enable_progress_threads: bool,
    enable_mpi_threads: bool,
) -> *mut sys::mca_mtl_base_module_t {
    ffi_guard(
        "mtl init",
        std::ptr::null_mut(),
        || match super::init_module(enable_progress_threads, enable_mpi_threads) {
            Ok(m) => m,
            Err(reason) => {
                log::info!("declining: {reason}");
                std::ptr::null_mut()
            }
        },
    )
}
