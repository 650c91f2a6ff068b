//! MPI_T performance variables of a component: each a counter or level that Open MPI
//! reads through a `get_value` callback only when a tool or test reads it, so the data
//! path only bumps its counters and never publishes anything.
//!
//! A component lists its variables as a [`Table`] (`btl::stats`, `mtl::stats`). They
//! are registered with the component (`mca_base_component_pvar_register`), so Open MPI
//! marks them invalid when it closes the component and never calls into an unloaded
//! library.

use crate::ompi::component::ffi_guard;
use ompi_sys as sys;
use std::ffi::CString;
use std::os::raw::{c_int, c_void};

/// A variable's class.
pub type Class = sys::_bindgen_ty_29;
/// Events since the handle was allocated.
pub const COUNTER: Class = sys::MCA_BASE_PVAR_CLASS_COUNTER;
/// The current value.
pub const LEVEL: Class = sys::MCA_BASE_PVAR_CLASS_LEVEL;

/// One variable: its name after the table's prefix, class, description, and the value
/// it reads from a snapshot of the counters.
pub struct Var<C> {
    pub name: &'static str,
    pub class: Class,
    pub help: &'static str,
    pub value: fn(&C) -> u64,
}

/// A component's variables, all `unsigned long long`.
///
/// # Safety
/// [`Table::component`] returns this library's header of the component (a static).
pub unsafe trait Table: 'static {
    /// One read of the counters, from which each variable picks its value.
    type Counts;
    /// `btl_ofi_`, `mtl_ofi_`.
    const PREFIX: &'static str;
    /// The MPI_T table of docs/parameters.md lists these; keep the two in step.
    const VARS: &'static [Var<Self::Counts>];
    /// The component the variables are registered with.
    fn component() -> *const sys::mca_base_component_t;
    /// The counters now.
    fn counts() -> Self::Counts;
}

/// The names MPI_T knows `T`'s variables by, in registration order.
pub fn names<T: Table>() -> impl Iterator<Item = String> {
    T::VARS.iter().map(|v| format!("{}{}", T::PREFIX, v.name))
}

/// Register `T`'s variables; the `i`th gets `ctx` `i`. A variable Open MPI refuses is
/// logged and skipped (the component works without it).
pub fn register<T: Table>() {
    for (i, v) in T::VARS.iter().enumerate() {
        let (Ok(name), Ok(help)) = (CString::new(v.name), CString::new(v.help)) else {
            continue;
        };
        // SAFETY: the component header is a static (Table's contract); name and help
        // are copied by Open MPI; get_value stays valid until Open MPI invalidates the
        // variable at component close (the IWG flag mca_base_component_pvar_register
        // adds); ctx is an index, never dereferenced.
        let rc = unsafe {
            sys::mca_base_component_pvar_register(
                T::component(),
                name.as_ptr(),
                help.as_ptr(),
                sys::OPAL_INFO_LVL_9,
                v.class as c_int,
                sys::MCA_BASE_VAR_TYPE_UNSIGNED_LONG_LONG,
                std::ptr::null_mut(),
                sys::MCA_BASE_VAR_BIND_NO_OBJECT as c_int,
                sys::MCA_BASE_PVAR_FLAG_READONLY | sys::MCA_BASE_PVAR_FLAG_CONTINUOUS,
                Some(get_value::<T>),
                None,
                None,
                i as *mut c_void,
            )
        };
        if rc < 0 {
            log::debug!(
                "MPI_T variable {}{} not registered (rc {rc})",
                T::PREFIX,
                v.name
            );
        }
    }
}

/// `mca_base_get_value_fn_t`: one unsigned long long, read now.
unsafe extern "C" fn get_value<T: Table>(
    pvar: *const sys::mca_base_pvar_t,
    value: *mut c_void,
    _obj: *mut c_void,
) -> c_int {
    ffi_guard("pvar read", sys::OPAL_ERROR, || {
        // SAFETY: Open MPI passes the variable it registered, whose ctx is our index.
        let i = unsafe { (*pvar).ctx } as usize;
        let Some(v) = T::VARS.get(i) else {
            return sys::OPAL_ERR_BAD_PARAM;
        };
        let n = (v.value)(&T::counts());
        // SAFETY: value points at room for one value of the registered type (count 1).
        unsafe { *(value as *mut u64) = n };
        sys::OPAL_SUCCESS
    })
}

/// Test helper: the MPI_T table of docs/parameters.md names every variable of `T`,
/// and no name twice.
#[cfg(test)]
pub fn assert_documented<T: Table>() {
    let names: Vec<String> = names::<T>().collect();
    let doc = include_str!("../../docs/parameters.md");
    for n in &names {
        assert!(
            doc.contains(&format!("`{n}`")),
            "the MPI_T table of docs/parameters.md lacks {n}"
        );
    }
    let mut dedup = names.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(dedup.len(), names.len());
}

/// [`assert_documented`] under its name from when the table was in README.md, for the
/// callers that still use it (`mtl::stats`); it checks docs/parameters.md too.
#[cfg(test)]
pub fn assert_readme_lists<T: Table>() {
    assert_documented::<T>()
}
