//! Building the component structs Open MPI loads, and the panic barrier every
//! `extern "C"` entry point goes through.

use super::params::{Owner, ParamSpec, Registered};
use ompi_sys as sys;
use std::cell::UnsafeCell;
use std::mem::offset_of;
use std::os::raw::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

/// This project's own component version, shown by `ompi_info` so that users (and
/// tests) can tell our components from the C ones.
pub const VERSION: (i32, i32, i32) = (0, 1, 0);

/// A C struct exported to Open MPI as a data symbol. Open MPI reads it (and may write
/// into it) from its own threads during component open/close, which are serialised by
/// the MCA framework.
#[repr(transparent)]
pub struct Exported<T>(UnsafeCell<T>);

// SAFETY: Open MPI accesses the component struct only from MCA framework open,
// select and close, which it serialises; we never hand out references to it.
unsafe impl<T> Sync for Exported<T> {}

impl<T> Exported<T> {
    pub const fn new(v: T) -> Self {
        Exported(UnsafeCell::new(v))
    }
    pub fn get(&self) -> *mut T {
        self.0.get()
    }
}

/// A framework's component struct, which embeds the MCA header every component has.
pub trait ComponentStruct {
    /// Where the header lies in the struct.
    const HEADER_OFFSET: usize;
}

impl ComponentStruct for sys::mca_btl_base_component_3_0_0_t {
    const HEADER_OFFSET: usize = offset_of!(Self, btl_version);
}

impl ComponentStruct for sys::mca_mtl_base_component_2_0_0_t {
    const HEADER_OFFSET: usize = offset_of!(Self, mtl_version);
}

impl<T: ComponentStruct> Exported<T> {
    /// The component's MCA header, for calls that take the component (the modex,
    /// parameter and pvar registration). Computing it reads nothing.
    pub fn header_ptr(&self) -> *const sys::mca_base_component_t {
        self.get()
            .cast::<u8>()
            .wrapping_add(T::HEADER_OFFSET)
            .cast()
    }

    /// The component's MCA header as a reference, for the modex.
    pub fn header(&'static self) -> &'static sys::mca_base_component_t {
        // SAFETY: the header lies inside this exported static, which lives as long as
        // the library; Open MPI writes to it only during MCA open and close, which do
        // not overlap the calls that hold this reference.
        unsafe { &*self.header_ptr() }
    }

    /// The component's `register` entry point: its own parameter table, kept in
    /// `params` for its later reads, then `more` (the common parameters, statistics,
    /// ...) with the component's header.
    pub fn register(
        &'static self,
        what: &str,
        table: &'static [ParamSpec],
        params: &Mutex<Option<Registered>>,
        more: impl FnOnce(*const sys::mca_base_component_t),
    ) -> i32 {
        ffi_guard(what, sys::OPAL_ERROR, || {
            let header = self.header_ptr();
            let reg = Registered::register(table, Owner::Component(header));
            *crate::common::sync::lock(params) = Some(reg);
            more(header);
            sys::OPAL_SUCCESS
        })
    }
}

/// A fixed-size, NUL-padded C name.
pub const fn cname<const N: usize>(s: &str) -> [c_char; N] {
    let b = s.as_bytes();
    let mut out = [0 as c_char; N];
    let mut i = 0;
    while i < b.len() && i < N - 1 {
        out[i] = b[i] as c_char;
        i += 1;
    }
    out
}

/// The MCA 2.1.0 header of a component named `ofi` of the given framework.
pub const fn base_component(
    project: &str,
    framework: &str,
    framework_version: (i32, i32, i32),
    open: sys::mca_base_open_component_1_0_0_fn_t,
    close: sys::mca_base_close_component_1_0_0_fn_t,
    register: sys::mca_base_register_component_params_2_0_0_fn_t,
    query: sys::mca_base_query_component_2_0_0_fn_t,
) -> sys::mca_base_component_t {
    sys::mca_base_component_t {
        mca_major_version: 2,
        mca_minor_version: 1,
        mca_release_version: 0,
        mca_project_name: cname(project),
        mca_project_major_version: sys::OMPI_MAJOR_VERSION as i32,
        mca_project_minor_version: sys::OMPI_MINOR_VERSION as i32,
        mca_project_release_version: sys::OMPI_RELEASE_VERSION as i32,
        mca_type_name: cname(framework),
        mca_type_major_version: framework_version.0,
        mca_type_minor_version: framework_version.1,
        mca_type_release_version: framework_version.2,
        mca_component_name: cname("ofi"),
        mca_component_major_version: VERSION.0,
        mca_component_minor_version: VERSION.1,
        mca_component_release_version: VERSION.2,
        mca_open_component: open,
        mca_close_component: close,
        mca_query_component: query,
        mca_register_component_params: register,
        mca_component_flags: 0,
        reserved: [0; 28],
    }
}

/// Run `f` at the C boundary: a panic becomes `on_panic` (and is logged), so that no
/// panic ever unwinds into Open MPI.
pub fn ffi_guard<R>(what: &str, on_panic: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(e) => {
            log::error!("internal error in {what}: {}", panic_message(&*e));
            on_panic
        }
    }
}

/// [`ffi_guard`] for the data-path entries of a module whose state a panic may leave
/// half-updated: a caught panic sets `failed`, and while it is set the call is refused
/// with `refused` without running `f`. Teardown entries use [`ffi_guard`], so that
/// they still release what they can.
pub fn ffi_guard_module<R>(
    what: &str,
    failed: &std::sync::atomic::AtomicBool,
    refused: R,
    f: impl FnOnce() -> R,
) -> R {
    use std::sync::atomic::Ordering;
    if failed.load(Ordering::Relaxed) {
        return refused;
    }
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(e) => {
            failed.store(true, Ordering::Relaxed);
            log::error!(
                "internal error in {what}: {}; the module refuses further calls",
                panic_message(&*e)
            );
            refused
        }
    }
}

/// What a caught panic said.
fn panic_message(e: &(dyn std::any::Any + Send)) -> String {
    e.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| e.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}
