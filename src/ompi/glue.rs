//! Declarations of the C glue in `opal_glue/`: Open MPI macros and static inline
//! helpers that Rust cannot call directly.
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};

unsafe extern "C" {
    pub fn ompi_ofi_glue_modex_send(
        component: *const sys::mca_base_component_t,
        data: *const c_void,
        size: usize,
    ) -> c_int;
    pub fn ompi_ofi_glue_modex_recv(
        component: *const sys::mca_base_component_t,
        peer: *const sys::opal_process_name_t,
        data: *mut *mut c_void,
        size: *mut usize,
    ) -> c_int;
    pub fn ompi_ofi_glue_free(p: *mut c_void);
}
