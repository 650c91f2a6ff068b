//! MPI_T performance variables of a component: each a counter or level that Open MPI
//! reads through a `get_value` callback only when a tool or test reads it, so the data
//! path only bumps its counters and never publishes anything.
//!
//! Registered with the component (`mca_base_component_pvar_register`), so Open MPI
//! marks them invalid when it closes the component and never calls into an unloaded
//! library.

use ompi_sys as sys;
use std::ffi::CString;
use std::os::raw::{c_int, c_void};

/// A variable's class.
pub type Class = sys::_bindgen_ty_29;
/// Events since the handle was allocated.
pub const COUNTER: Class = sys::MCA_BASE_PVAR_CLASS_COUNTER;
/// The current value.
pub const LEVEL: Class = sys::MCA_BASE_PVAR_CLASS_LEVEL;

/// `mca_base_get_value_fn_t`: writes one unsigned long long for the variable whose
/// `ctx` is its index in the list given to [`register`].
pub type GetValue =
    unsafe extern "C" fn(*const sys::mca_base_pvar_t, *mut c_void, *mut c_void) -> c_int;

/// Register `(name, class, help)` variables with `component`; the `i`th gets `ctx` `i`.
/// A variable Open MPI refuses is logged and skipped (the component works without it).
///
/// # Safety
/// `component` is this library's component header (a static).
pub unsafe fn register(
    component: *const sys::mca_base_component_t,
    prefix: &str,
    vars: impl Iterator<Item = (&'static str, Class, &'static str)>,
    get_value: GetValue,
) {
    for (i, (name, class, help)) in vars.enumerate() {
        let (Ok(cname), Ok(chelp)) = (CString::new(name), CString::new(help)) else {
            continue;
        };
        // SAFETY: component is a component header (a static); name and help are copied
        // by Open MPI; get_value stays valid until Open MPI invalidates the variable at
        // component close (the IWG flag mca_base_component_pvar_register adds); ctx is
        // an index, never dereferenced.
        let rc = unsafe {
            sys::mca_base_component_pvar_register(
                component,
                cname.as_ptr(),
                chelp.as_ptr(),
                sys::OPAL_INFO_LVL_9,
                class as c_int,
                sys::MCA_BASE_VAR_TYPE_UNSIGNED_LONG_LONG,
                std::ptr::null_mut(),
                sys::MCA_BASE_VAR_BIND_NO_OBJECT as c_int,
                sys::MCA_BASE_PVAR_FLAG_READONLY | sys::MCA_BASE_PVAR_FLAG_CONTINUOUS,
                Some(get_value),
                None,
                None,
                i as *mut c_void,
            )
        };
        if rc < 0 {
            log::debug!("MPI_T variable {prefix}{name} not registered (rc {rc})");
        }
    }
}

/// The index a `get_value` callback was registered with.
///
/// # Safety
/// `pvar` is the variable Open MPI passes to the callback.
pub unsafe fn index(pvar: *const sys::mca_base_pvar_t) -> usize {
    // SAFETY: forwarded; ctx holds the index given at registration.
    unsafe { (*pvar).ctx as usize }
}

/// Write `v` where a `get_value` callback must.
///
/// # Safety
/// `value` is the callback's buffer, with room for one value of the registered type.
pub unsafe fn write(value: *mut c_void, v: u64) {
    // SAFETY: forwarded (count 1, unsigned long long).
    unsafe { *(value as *mut u64) = v };
}
