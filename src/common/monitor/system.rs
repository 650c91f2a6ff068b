//! Probes of the running system the monitor's choice depends on: whether
//! userfaultfd is usable here, whether libfabric has run its one-time initialisation
//! yet, and the monitor it reads from the environment.
//!
//! What it owns: those probes and their explanations. What it must not touch: the
//! choice itself (`mod.rs`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::null_mut;

use libfabric_sys as fi;
use libfabric_sys::macros::fi_version;

use crate::fabric::Error;

use super::*;

const UFFD_API: u64 = 0xAA;
const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// The features libfabric's userfaultfd monitor asks for at start.
pub(super) const UFFD_LIBFABRIC_FEATURES: u64 =
    UFFD_FEATURE_EVENT_REMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_UNMAP;

#[repr(C)]
pub(super) struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `_IOWR(UFFDIO, _UFFDIO_API, struct uffdio_api)`.
const fn iowr(ty: u64, nr: u64, size: u64) -> u64 {
    (3 << 30) | (size << 16) | (ty << 8) | nr
}
pub(super) const UFFDIO_API: u64 = iowr(0xAA, 0x3F, std::mem::size_of::<UffdioApi>() as u64);

/// Can libfabric's userfaultfd monitor start here? Does what it does at start: open a
/// userfaultfd with `O_CLOEXEC | O_NONBLOCK` and negotiate the unmap/remove/remap
/// events, then closes the descriptor.
pub fn probe_userfaultfd() -> Result<(), String> {
    // SAFETY: userfaultfd(2) takes one flags argument and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        return Err(explain_uffd_error(&err));
    }
    let fd = fd as c_int;
    let mut api = UffdioApi {
        api: UFFD_API,
        features: UFFD_LIBFABRIC_FEATURES,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api` (24 bytes, matching
    // `UffdioApi`) through the pointer, which is valid for the call.
    let r = unsafe { libc::ioctl(fd, UFFDIO_API as libc::c_ulong, &mut api as *mut UffdioApi) };
    let err = std::io::Error::last_os_error();
    // SAFETY: `fd` is the descriptor we opened above and nobody else has it.
    unsafe { libc::close(fd) };
    if r < 0 {
        return Err(format!(
            "the kernel refuses the userfaultfd events libfabric needs (unmap, remove, remap): {err}"
        ));
    }
    Ok(())
}

fn explain_uffd_error(err: &std::io::Error) -> String {
    match err.raw_os_error() {
        Some(libc::EPERM) => {
            let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "unreadable".into());
            // SAFETY: geteuid has no preconditions.
            let euid = unsafe { libc::geteuid() };
            format!(
                "userfaultfd: permission denied (euid {euid}, \
                 /proc/sys/vm/unprivileged_userfaultfd = {sysctl}; an unprivileged process \
                 needs it set to 1, or CAP_SYS_PTRACE)"
            )
        }
        Some(libc::ENOSYS) => {
            "userfaultfd: not implemented (kernel without CONFIG_USERFAULTFD, or blocked by a \
             seccomp filter)"
                .into()
        }
        _ => format!("userfaultfd: {err}"),
    }
}

/// `fi_param_get` of the core variable `mr_cache_monitor`: libfabric's return code and,
/// on success, the value it read from the environment (NULL when unset).
fn mr_cache_monitor_param() -> (c_int, *mut c_char) {
    let mut value: *mut c_char = null_mut();
    // SAFETY: a NULL provider means the core provider; the name is NUL-terminated and
    // `value` is a valid `char *` slot for a string parameter.
    let r = unsafe {
        fi::fi_param_get(
            null_mut(),
            c"mr_cache_monitor".as_ptr(),
            (&mut value as *mut *mut c_char).cast::<c_void>(),
        )
    };
    (r, value)
}

/// Has libfabric run its one-time initialisation (`fi_ini`)? `fi_ini` defines the core
/// variable `mr_cache_monitor`; before it, `fi_param_get` does not know the name.
pub fn libfabric_initialised() -> bool {
    mr_cache_monitor_param().0 != -(fi::FI_ENOENT as i32)
}

/// The `mr_cache_monitor` value libfabric sees in the environment, if initialised.
pub fn libfabric_monitor_variable() -> Option<String> {
    let (r, value) = mr_cache_monitor_param();
    if r != 0 || value.is_null() {
        return None;
    }
    // SAFETY: on success a non-NULL `value` points into the environment (libfabric
    // reads it with getenv), a NUL-terminated string copied here at once.
    Some(
        unsafe { CStr::from_ptr(value) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// Run libfabric's initialisation with a `fi_getinfo` that matches no provider.
pub(super) fn force_libfabric_init() -> Result<(), MonitorError> {
    // SAFETY: fi_allocinfo returns a zeroed fi_info with its attribute structs, or NULL.
    let hints = unsafe { fi::fi_allocinfo() };
    if hints.is_null() {
        return Err(MonitorError::Fabric {
            op: "fi_allocinfo",
            err: Error::NOMEM,
        });
    }
    let mut info: *mut fi::fi_info = null_mut();
    // SAFETY: `hints` is a valid fi_info from fi_allocinfo; prov_name is freed by
    // fi_freeinfo with free(), so it comes from strdup. fi_getinfo only reads hints and
    // writes `info`; both lists are freed exactly once.
    let rc = unsafe {
        let fabric_attr = (*hints).fabric_attr;
        if !fabric_attr.is_null() {
            (*fabric_attr).prov_name = libc::strdup(c"ompi-ofi-monitor-init-only".as_ptr());
        }
        let rc = fi::fi_getinfo(
            fi_version(1, 13),
            std::ptr::null(),
            std::ptr::null(),
            0,
            hints,
            &mut info,
        );
        fi::fi_freeinfo(hints);
        if !info.is_null() {
            fi::fi_freeinfo(info);
        }
        rc
    };
    if libfabric_initialised() {
        Ok(())
    } else {
        Err(MonitorError::Fabric {
            op: "fi_getinfo (to initialise libfabric)",
            err: if rc < 0 {
                Error::from_ret(rc as isize)
            } else {
                Error::INVAL
            },
        })
    }
}
