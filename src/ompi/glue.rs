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
    pub fn ompi_ofi_glue_comm_peer(
        comm: *mut sys::ompi_communicator_t,
        rank: c_int,
    ) -> *mut sys::ompi_proc_t;
    pub fn ompi_ofi_glue_comm_lookup(cid: u32) -> *mut sys::ompi_communicator_t;
    pub fn ompi_ofi_glue_comm_remote_size(comm: *mut sys::ompi_communicator_t) -> c_int;
    pub fn ompi_ofi_glue_convertor_info(
        conv: *mut sys::opal_convertor_t,
        packed_size: *mut usize,
        contiguous: *mut c_int,
        contig_start: *mut *mut std::os::raw::c_char,
        need_buffers: *mut c_int,
    );
    pub fn ompi_ofi_glue_message_alloc() -> *mut sys::ompi_message_t;
    pub fn ompi_ofi_glue_message_return(msg: *mut sys::ompi_message_t);
    pub fn ompi_ofi_glue_proc_name(p: *mut sys::ompi_proc_t) -> *const sys::opal_process_name_t;
}
