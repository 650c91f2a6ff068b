//! The OFI MTL: tagged messaging under pml cm.
pub mod component;

use ompi_sys as sys;

/// Build the MTL module, or say why not.
pub fn init_module(_progress_threads: bool, _mpi_threads: bool) -> Result<*mut sys::mca_mtl_base_module_t, String> {
    Err("the tagged data path is not implemented yet".into())
}

/// Release everything at component close.
pub fn finalize_component() {}
