//! Address exchange over the modex (PMIx), for both components: each publishes its
//! endpoint name under its own component key and looks up its peers'.

use super::glue;
use ompi_sys as sys;
use std::os::raw::c_void;

/// Publish `data` for this process under `component`'s key.
pub fn send(component: &sys::mca_base_component_t, data: &[u8]) -> Result<(), i32> {
    // SAFETY: component points to our component struct; data is valid for the call
    // and copied by PMIx.
    let rc = unsafe {
        glue::ompi_ofi_glue_modex_send(component, data.as_ptr() as *const c_void, data.len())
    };
    if rc == sys::OPAL_SUCCESS {
        Ok(())
    } else {
        Err(rc)
    }
}

/// Fetch what `peer` published under `component`'s key.
pub fn recv(
    component: &sys::mca_base_component_t,
    peer: &sys::opal_process_name_t,
) -> Result<Vec<u8>, i32> {
    let mut data: *mut c_void = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: all pointers valid; on success data is a malloc'ed buffer of size bytes
    // that we copy and free with C's free.
    let rc = unsafe { glue::ompi_ofi_glue_modex_recv(component, peer, &mut data, &mut size) };
    if rc != sys::OPAL_SUCCESS {
        return Err(rc);
    }
    if data.is_null() {
        return Ok(Vec::new());
    }
    // SAFETY: data holds size bytes (see above).
    let v = unsafe { std::slice::from_raw_parts(data as *const u8, size) }.to_vec();
    // SAFETY: data came from C's allocator.
    unsafe { glue::ompi_ofi_glue_free(data) };
    Ok(v)
}
