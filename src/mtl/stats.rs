//! The MTL's counters as MPI_T performance variables (`mtl_ofi_*`, `ompi::pvar`).

use crate::ompi::component::ffi_guard;
use crate::ompi::pvar::{self, Class, COUNTER};
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::Ordering;

/// One performance variable: its name after `mtl_ofi_`, class, description, and how it
/// is read.
struct Pvar {
    name: &'static str,
    class: Class,
    help: &'static str,
    value: fn() -> u64,
}

/// The README's MPI_T table lists these; keep the two in step.
const PVARS: &[Pvar] = &[
    Pvar {
        name: "fbox_sent",
        class: COUNTER,
        help: "Messages of software matching sent through fast boxes (shared-memory rings to peers on this node, mtl_ofi_fbox_size)",
        value: super::setup::fbox_sent,
    },
    Pvar {
        name: "fbox_received",
        class: COUNTER,
        help: "Messages of software matching received through this process's fast boxes",
        value: || {
            super::datapath::mtl()
                .and_then(|m| m.soft.as_deref())
                .map_or(0, |sm| sm.fbox_received.load(Ordering::Relaxed))
        },
    },
];

/// The names MPI_T knows the variables by, in registration order.
pub fn names() -> impl Iterator<Item = String> {
    PVARS.iter().map(|p| format!("mtl_ofi_{}", p.name))
}

/// Register every variable with the MTL component.
pub fn register() {
    // SAFETY: the MTL component's header, a static.
    unsafe {
        pvar::register(
            super::component::component_ptr(),
            "mtl_ofi_",
            PVARS.iter().map(|p| (p.name, p.class, p.help)),
            get_value,
        )
    };
}

/// `mca_base_get_value_fn_t`: one unsigned long long, read now.
unsafe extern "C" fn get_value(
    pvar: *const sys::mca_base_pvar_t,
    value: *mut c_void,
    _obj: *mut c_void,
) -> c_int {
    ffi_guard("mtl pvar read", sys::OPAL_ERROR, || {
        // SAFETY: Open MPI passes the variable it registered.
        let i = unsafe { pvar::index(pvar) };
        let Some(p) = PVARS.get(i) else {
            return sys::OPAL_ERR_BAD_PARAM;
        };
        // SAFETY: Open MPI's buffer for the value.
        unsafe { pvar::write(value, (p.value)()) };
        sys::OPAL_SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_lists_every_variable() {
        let names: Vec<String> = names().collect();
        let readme = include_str!("../../README.md");
        for n in &names {
            assert!(
                readme.contains(&format!("`{n}`")),
                "README's MPI_T table lacks {n}"
            );
        }
    }
}
