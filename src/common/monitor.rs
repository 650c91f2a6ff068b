//! The memory monitor: which mechanism tells libfabric (and our own caches) that
//! memory is being released, chosen once per process.
//!
//! Owns: the exported `fid_mem_monitor` (a static: libfabric keeps a pointer to it and
//! the release path reaches it from inside `munmap`), the `mr_cache` import handle, the
//! registration of [`release::opal_release_cb`] with Open MPI, and the outcome of the
//! choice. Must not touch: the release path itself (see `release.rs`), libfabric
//! domains (the caller closes them before [`Monitor::teardown`]).
//!
//! # The choices
//!
//! - `opal`: Open MPI's patcher is the only patcher; every release it sees is forwarded
//!   to libfabric through an imported monitor (`fi_open("mr_cache")` +
//!   `fi_import_fid`). Needs Open MPI's hooks with free and munmap support and
//!   libfabric >= 1.14 (1.13's import had deadlocks, as Open MPI's C code notes).
//! - `userfaultfd`, `memhooks`, `disabled`: libfabric's own monitors, selected with
//!   libfabric's `FI_MR_CACHE_MONITOR` variable (values in 1.17: `userfaultfd`,
//!   `memhooks`, `disabled`; unset means userfaultfd when libfabric was built with it,
//!   memhooks otherwise; an unknown value is ignored). libfabric reads it exactly once,
//!   in `fi_ini` (`ofi_monitors_init`), which runs at the first `fi_getinfo`/`fi_fabric`
//!   of the process; `fi_open` does not run it. So these choices only take effect if
//!   [`Monitor::setup`] runs before the first `fi_getinfo`; afterwards the outcome
//!   carries a warning that the choice may not take effect. `disabled` also sets
//!   `FI_MR_CACHE_MAX_COUNT=0` (the util MR cache refuses to initialise with it) and
//!   `FI_EFA_MR_CACHE_ENABLE=0` (efa fails `fi_domain` when there is no monitor,
//!   instead of running uncached).
//! - `auto`: `opal` if possible, else `userfaultfd` if usable, else `disabled`. It never
//!   picks `memhooks`: while Open MPI's patcher is active that would be the second
//!   patcher this project exists to prevent.
//!
//! # Process-wide lifecycle
//!
//! [`Monitor::setup`] runs once per process, whichever component comes first; a
//! second call returns the stored outcome (success or failure). It is meant to run
//! after the first `fi_getinfo` and before the first `fi_domain` (libfabric 1.17's
//! `fi_ini` would otherwise reset the default monitor); if libfabric is not yet
//! initialised when `opal` is chosen, setup initialises it with a `fi_getinfo` that
//! matches no provider. [`Monitor::teardown`] runs after the last domain is closed:
//! the imported monitor must outlive every domain (libfabric 1.17 keeps it as the
//! default monitor; a cache attached to a closed import fails to start). Teardown
//! leaves nothing behind, so a later setup in the same process (or in a fresh copy of
//! this library after `dlclose`) can export again.
//!
//! Differences from Open MPI 4.1.4's `common_ofi.c`: the lock is released on every
//! path (the C code returns with its mutex held on the second call), every error is
//! reported, and when Open MPI's hooks are unavailable we choose userfaultfd or disable
//! caching explicitly instead of silently leaving libfabric on its own memhooks.

use std::cell::UnsafeCell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::ptr::null_mut;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use libfabric_sys as fi;
use libfabric_sys::macros::{fi_major, fi_minor, fi_version};
use ompi_sys as ompi;

use super::patch_check;
use super::release::{self, ReleaseStats};
use crate::fabric::{check, Error};

// ---------------------------------------------------------------------------------
// The choice

/// The `monitor` parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MonitorChoice {
    Auto,
    Opal,
    Userfaultfd,
    Memhooks,
    Disabled,
}

impl MonitorChoice {
    pub const ALL: [MonitorChoice; 5] = [
        MonitorChoice::Auto,
        MonitorChoice::Opal,
        MonitorChoice::Userfaultfd,
        MonitorChoice::Memhooks,
        MonitorChoice::Disabled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MonitorChoice::Auto => "auto",
            MonitorChoice::Opal => "opal",
            MonitorChoice::Userfaultfd => "userfaultfd",
            MonitorChoice::Memhooks => "memhooks",
            MonitorChoice::Disabled => "disabled",
        }
    }
}

impl fmt::Display for MonitorChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown `monitor` value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseChoiceError {
    pub input: String,
}

impl fmt::Display for ParseChoiceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let valid: Vec<&str> = MonitorChoice::ALL.iter().map(|c| c.as_str()).collect();
        write!(
            f,
            "unknown memory monitor '{}': valid values are {}",
            self.input,
            valid.join(", ")
        )
    }
}

impl std::error::Error for ParseChoiceError {}

impl FromStr for MonitorChoice {
    type Err = ParseChoiceError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        MonitorChoice::ALL
            .into_iter()
            .find(|c| c.as_str().eq_ignore_ascii_case(t))
            .ok_or_else(|| ParseChoiceError {
                input: s.to_string(),
            })
    }
}

/// The mechanism in use after setup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Active {
    /// Open MPI's patcher, exported into libfabric.
    Opal,
    /// libfabric's userfaultfd monitor.
    Userfaultfd,
    /// libfabric's own patcher.
    Memhooks,
    /// No libfabric registration caching.
    CachingDisabled,
}

impl fmt::Display for Active {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Active::Opal => "opal",
            Active::Userfaultfd => "userfaultfd",
            Active::Memhooks => "memhooks",
            Active::CachingDisabled => "disabled",
        })
    }
}

/// The environment variables that select `active` in libfabric (read by libfabric at
/// its initialisation only).
pub fn env_settings(active: Active) -> &'static [(&'static str, &'static str)] {
    match active {
        Active::Opal => &[],
        Active::Userfaultfd => &[("FI_MR_CACHE_MONITOR", "userfaultfd")],
        Active::Memhooks => &[("FI_MR_CACHE_MONITOR", "memhooks")],
        Active::CachingDisabled => &[
            ("FI_MR_CACHE_MONITOR", "disabled"),
            ("FI_MR_CACHE_MAX_COUNT", "0"),
            ("FI_EFA_MR_CACHE_ENABLE", "0"),
        ],
    }
}

// ---------------------------------------------------------------------------------
// The decision, as a pure function

const FREE_AND_MUNMAP: u32 = ompi::OPAL_MEMORY_FREE_SUPPORT | ompi::OPAL_MEMORY_MUNMAP_SUPPORT;
const MIN_IMPORT_VERSION: u32 = fi_version(1, 14);

/// What the decision depends on; gathered by [`Monitor::setup`], built by hand in
/// tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// `opal_mem_hooks_support_level()` after opening Open MPI's memory framework.
    pub opal_support: u32,
    /// Open MPI's patcher is installed (a support level from it, or the patch check
    /// found one of its trampolines).
    pub opal_patcher_active: bool,
    /// `fi_version()` of the libfabric loaded at run time.
    pub libfabric_version: u32,
    /// Whether libfabric could use userfaultfd here, and why not.
    pub userfaultfd: Result<(), String>,
}

impl Probe {
    pub fn opal_free_and_munmap(&self) -> bool {
        self.opal_support & FREE_AND_MUNMAP == FREE_AND_MUNMAP
    }

    fn version(&self) -> String {
        version_string(self.libfabric_version)
    }

    /// Why `opal` cannot be used, if it cannot.
    fn opal_obstacle(&self) -> Option<String> {
        if !self.opal_free_and_munmap() {
            Some(format!(
                "Open MPI's memory hooks report support level {:#x}, not free and munmap \
                 (is the memory/patcher component disabled?)",
                self.opal_support
            ))
        } else if self.libfabric_version < MIN_IMPORT_VERSION {
            Some(format!(
                "libfabric {} is older than 1.14 (its monitor import can deadlock)",
                self.version()
            ))
        } else {
            None
        }
    }

    fn obstacle(&self, choice: MonitorChoice) -> Option<String> {
        match choice {
            MonitorChoice::Auto | MonitorChoice::Disabled => None,
            MonitorChoice::Opal => self.opal_obstacle(),
            MonitorChoice::Userfaultfd => self
                .userfaultfd
                .as_ref()
                .err()
                .map(|e| format!("userfaultfd is not usable: {e}")),
            MonitorChoice::Memhooks => self.opal_patcher_active.then(|| {
                "Open MPI's patcher is active and libfabric's memhooks would patch the same \
                 functions (mmap, munmap, mremap, madvise, shmat, shmdt, brk): two patchers \
                 cannot be stacked, the loser silently misses releases"
                    .to_string()
            }),
        }
    }

    fn alternatives(&self, except: MonitorChoice) -> String {
        let ok: Vec<&str> = MonitorChoice::ALL
            .into_iter()
            .filter(|c| *c != except && *c != MonitorChoice::Auto)
            .filter(|c| self.obstacle(*c).is_none())
            .map(|c| c.as_str())
            .collect();
        ok.join(", ")
    }
}

/// What to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub active: Active,
    pub reason: String,
}

/// An explicit choice that cannot be honoured here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decline {
    pub choice: MonitorChoice,
    pub message: String,
}

impl fmt::Display for Decline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The pure decision.
pub fn decide(choice: MonitorChoice, p: &Probe) -> Result<Plan, Decline> {
    if let Some(why) = p.obstacle(choice) {
        return Err(Decline {
            choice,
            message: format!(
                "memory monitor '{choice}' cannot be used: {why}; working alternatives here: {}",
                p.alternatives(choice)
            ),
        });
    }
    let plan = |active, reason: String| Ok(Plan { active, reason });
    match choice {
        MonitorChoice::Opal => plan(
            Active::Opal,
            format!(
                "requested; Open MPI's hooks support free and munmap and libfabric {} >= 1.14",
                p.version()
            ),
        ),
        MonitorChoice::Userfaultfd => plan(
            Active::Userfaultfd,
            "requested; userfaultfd is usable".into(),
        ),
        MonitorChoice::Memhooks => plan(
            Active::Memhooks,
            "requested; Open MPI's patcher is not active, so libfabric's memhooks is the only \
             patcher (our own caches get no release events from Open MPI)"
                .into(),
        ),
        MonitorChoice::Disabled => plan(
            Active::CachingDisabled,
            "requested: libfabric's registration caching is disabled".into(),
        ),
        MonitorChoice::Auto => match p.opal_obstacle() {
            None => plan(
                Active::Opal,
                format!(
                    "Open MPI's hooks support free and munmap and libfabric {} >= 1.14: \
                     releases seen by Open MPI's patcher are forwarded to libfabric (one \
                     patcher)",
                    p.version()
                ),
            ),
            Some(no_opal) => match &p.userfaultfd {
                Ok(()) => plan(
                    Active::Userfaultfd,
                    format!("{no_opal}; userfaultfd is usable, so libfabric uses it"),
                ),
                Err(no_uffd) => plan(
                    Active::CachingDisabled,
                    format!(
                        "{no_opal}; userfaultfd is not usable ({no_uffd}); memhooks is never \
                         chosen automatically{}: libfabric's registration caching is \
                         disabled rather than risk stale registrations",
                        if p.opal_patcher_active {
                            " (Open MPI's patcher is active)"
                        } else {
                            ""
                        }
                    ),
                ),
            },
        },
    }
}

// ---------------------------------------------------------------------------------
// Probes of the running system

const UFFD_API: u64 = 0xAA;
const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// The features libfabric's userfaultfd monitor asks for at start.
const UFFD_LIBFABRIC_FEATURES: u64 =
    UFFD_FEATURE_EVENT_REMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_UNMAP;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `_IOWR(UFFDIO, _UFFDIO_API, struct uffdio_api)`.
const fn iowr(ty: u64, nr: u64, size: u64) -> u64 {
    (3 << 30) | (size << 16) | (ty << 8) | nr
}
const UFFDIO_API: u64 = iowr(0xAA, 0x3F, std::mem::size_of::<UffdioApi>() as u64);

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

/// The version of the libfabric loaded at run time.
pub fn libfabric_runtime_version() -> u32 {
    // SAFETY: fi_version has no preconditions.
    unsafe { fi::fi_version() }
}

/// Has libfabric run its one-time initialisation (`fi_ini`)? `fi_ini` defines the core
/// variable `mr_cache_monitor`; before it, `fi_param_get` does not know the name.
pub fn libfabric_initialised() -> bool {
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
    r != -(fi::FI_ENOENT as i32)
}

/// Run libfabric's initialisation with a `fi_getinfo` that matches no provider.
fn force_libfabric_init() -> Result<(), MonitorError> {
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

// ---------------------------------------------------------------------------------
// Open MPI's memory hooks, behind a trait so that tests without MPI can stand in

/// The type of `opal_mem_hooks_callback_fn_t`.
pub type OpalReleaseFn = unsafe extern "C" fn(*mut c_void, usize, *mut c_void, bool);

/// What setup needs from Open MPI's memory hooks. [`OpenMpiHooks`] is the real one.
/// Return values are `OPAL_*` codes.
pub trait OpalHooks: Sync {
    /// Open Open MPI's memory framework (reference counted; opening it installs the
    /// patcher once per process).
    fn open_memory_framework(&self) -> i32;
    /// `opal_mem_hooks_support_level()`.
    fn support_level(&self) -> i32;
    /// `opal_mem_hooks_register_release(cb, NULL)`.
    fn register_release(&self, cb: OpalReleaseFn) -> i32;
    /// `opal_mem_hooks_unregister_release(cb)`.
    fn unregister_release(&self, cb: OpalReleaseFn) -> i32;
}

extern "C" {
    // In libopen-pal; not in ompi-sys's bindings (its wrapper.h does not include
    // opal/mca/memory/base/base.h).
    static mut opal_memory_base_framework: ompi::mca_base_framework_t;
}

/// Open MPI's memory hooks in `libopen-pal`. Needs `opal_init` (or `opal_init_util`
/// plus `opal_mem_hooks_init`) to have run, as it has inside any MPI process.
pub struct OpenMpiHooks;

impl OpalHooks for OpenMpiHooks {
    fn open_memory_framework(&self) -> i32 {
        // SAFETY: the framework is a static of libopen-pal, which is loaded (we link
        // it); mca_base_framework_open is reference counted and thread safe enough for
        // our single call under the monitor lock.
        unsafe { ompi::mca_base_framework_open(&raw mut opal_memory_base_framework, 0) }
    }
    fn support_level(&self) -> i32 {
        // SAFETY: reads a static int of libopen-pal.
        unsafe { ompi::opal_mem_hooks_support_level() }
    }
    fn register_release(&self, cb: OpalReleaseFn) -> i32 {
        // SAFETY: `cb` stays valid until unregistered (teardown unregisters it before
        // this library can be unloaded); cbdata is unused.
        unsafe { ompi::opal_mem_hooks_register_release(Some(cb), null_mut()) }
    }
    fn unregister_release(&self, cb: OpalReleaseFn) -> i32 {
        // SAFETY: removes a callback registered above; takes Open MPI's list lock.
        unsafe { ompi::opal_mem_hooks_unregister_release(Some(cb)) }
    }
}

// ---------------------------------------------------------------------------------
// The exported monitor object

/// The monitor libfabric imports. A static because libfabric keeps a pointer to it
/// until it is closed and the release path reaches it from inside `munmap`.
///
/// Invariant: written by us only under the [`STATE`] lock while not imported; while
/// imported, libfabric owns the fields it set at import (`fid.ops`, `fid.context`,
/// `import_ops`) and we only hand out the pointer.
struct MonitorCell(UnsafeCell<fi::fid_mem_monitor>);

// SAFETY: see the invariant above: all our writes are serialised by the STATE lock and
// happen while no other thread (libfabric or the release path) can read the object.
unsafe impl Sync for MonitorCell {}

const ZERO_MONITOR: fi::fid_mem_monitor = fi::fid_mem_monitor {
    fid: fi::fid {
        fclass: 0,
        context: null_mut(),
        ops: null_mut(),
    },
    export_ops: null_mut(),
    import_ops: null_mut(),
};

static MONITOR: MonitorCell = MonitorCell(UnsafeCell::new(ZERO_MONITOR));

/// Our `export_ops`. In an `UnsafeCell` only because libfabric's field is a `*mut`; it
/// is never written.
struct ExportOps(UnsafeCell<fi::fi_ops_mem_monitor>);

// SAFETY: never written after compile-time initialisation.
unsafe impl Sync for ExportOps {}

static EXPORT_OPS: ExportOps = ExportOps(UnsafeCell::new(fi::fi_ops_mem_monitor {
    size: std::mem::size_of::<fi::fi_ops_mem_monitor>(),
    start: Some(export_start),
    stop: Some(export_stop),
    subscribe: Some(export_subscribe),
    unsubscribe: Some(export_unsubscribe),
    valid: Some(export_valid),
}));

static LF_STARTS: AtomicU64 = AtomicU64::new(0);
static LF_STOPS: AtomicU64 = AtomicU64::new(0);
static LF_SUBSCRIBES: AtomicU64 = AtomicU64::new(0);
static LF_UNSUBSCRIBES: AtomicU64 = AtomicU64::new(0);

// The export ops run under libfabric's cache and monitor locks: they only bump a
// counter. There is nothing to start or stop (Open MPI's patcher is always on) and no
// filtering by range: every release reaches notify, so every registration stays valid
// until notified. `unsafe extern "C"` only to match libfabric's field type.

unsafe extern "C" fn export_start(_m: *mut fi::fid_mem_monitor) -> c_int {
    LF_STARTS.fetch_add(1, Ordering::SeqCst);
    0
}

unsafe extern "C" fn export_stop(_m: *mut fi::fid_mem_monitor) {
    LF_STOPS.fetch_add(1, Ordering::SeqCst);
}

unsafe extern "C" fn export_subscribe(
    _m: *mut fi::fid_mem_monitor,
    _addr: *const c_void,
    _len: usize,
) -> c_int {
    LF_SUBSCRIBES.fetch_add(1, Ordering::Relaxed);
    0
}

unsafe extern "C" fn export_unsubscribe(
    _m: *mut fi::fid_mem_monitor,
    _addr: *const c_void,
    _len: usize,
) {
    LF_UNSUBSCRIBES.fetch_add(1, Ordering::Relaxed);
}

unsafe extern "C" fn export_valid(
    _m: *mut fi::fid_mem_monitor,
    _addr: *const c_void,
    _len: usize,
) -> bool {
    true
}

// ---------------------------------------------------------------------------------
// Outcome, errors, statistics

/// What setup did, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MonitorOutcome {
    pub requested: MonitorChoice,
    pub active: Active,
    pub reason: String,
    /// Our release callback is registered with Open MPI: subscribers of `release.rs`
    /// receive events. When false our own registration caches must not cache.
    pub release_events: bool,
    /// Environment variables set for libfabric.
    pub env: Vec<(String, String)>,
    /// Things that may defeat the choice (late environment, patch check problems).
    pub warnings: Vec<String>,
}

impl fmt::Display for MonitorOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "memory monitor {} (requested {}): {}; release events to our caches: {}",
            self.active,
            self.requested,
            self.reason,
            if self.release_events { "yes" } else { "no" }
        )?;
        for w in &self.warnings {
            write!(f, "; warning: {w}")?;
        }
        Ok(())
    }
}

/// Why setup or teardown failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MonitorError {
    /// An explicit choice cannot be honoured; the message names the reason and the
    /// working alternatives.
    Declined(Decline),
    /// `fi_import_fid` returned `-FI_EBUSY`.
    ImportBusy,
    /// Another libfabric call failed.
    Fabric { op: &'static str, err: Error },
    /// An Open MPI call failed with an `OPAL_*` code.
    Opal { op: &'static str, rc: i32 },
    /// Teardown refused: libfabric still has a registration cache on our monitor
    /// (`start` without `stop`), i.e. a domain is still open. Closing the monitor now
    /// would leave libfabric calling through a forgotten import.
    InUse {
        caches_started: u64,
        caches_stopped: u64,
    },
}

impl MonitorError {
    /// The Open MPI code for the component boundary.
    pub fn to_opal(&self) -> i32 {
        match self {
            MonitorError::Declined(_) => ompi::OPAL_ERR_NOT_AVAILABLE,
            MonitorError::ImportBusy => ompi::OPAL_ERR_RESOURCE_BUSY,
            MonitorError::Fabric { err, .. } => err.to_opal(),
            MonitorError::Opal { rc, .. } => *rc,
            MonitorError::InUse { .. } => ompi::OPAL_ERR_RESOURCE_BUSY,
        }
    }
}

impl fmt::Display for MonitorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MonitorError::Declined(d) => write!(f, "{d}"),
            MonitorError::ImportBusy => write!(
                f,
                "libfabric refused our memory monitor (-FI_EBUSY): another monitor was \
                 imported first, or a cache is already attached to libfabric's default monitor \
                 (was a domain opened before the monitor setup?)"
            ),
            MonitorError::Fabric { op, err } => write!(f, "{op} failed: {err}"),
            MonitorError::Opal { op, rc } => write!(f, "{op} failed with Open MPI code {rc}"),
            MonitorError::InUse {
                caches_started,
                caches_stopped,
            } => write!(
                f,
                "the memory monitor is still in use by libfabric ({caches_started} cache \
                 start(s), {caches_stopped} stop(s)): close every domain before the teardown"
            ),
        }
    }
}

impl std::error::Error for MonitorError {}

/// Counters of the release path and of libfabric's calls into our monitor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorStats {
    pub release: ReleaseStats,
    /// `start` calls: libfabric attached the first cache to our monitor.
    pub libfabric_starts: u64,
    pub libfabric_stops: u64,
    /// Registrations libfabric asked us to watch.
    pub libfabric_subscribes: u64,
    pub libfabric_unsubscribes: u64,
}

impl fmt::Display for MonitorStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}; libfabric monitor calls: {} start, {} stop, {} subscribe, {} unsubscribe",
            self.release,
            self.libfabric_starts,
            self.libfabric_stops,
            self.libfabric_subscribes,
            self.libfabric_unsubscribes
        )
    }
}

// ---------------------------------------------------------------------------------
// Process-wide state

/// What setup holds and teardown must give back.
#[derive(Default)]
struct Held {
    /// `opal_release_cb` is registered with Open MPI.
    registered: bool,
    /// MONITOR was accepted by `fi_import_fid`.
    imported: bool,
    /// The `mr_cache` fid from `fi_open`, as an address (0 = none).
    cache_fid: usize,
}

struct State {
    requested: MonitorChoice,
    result: Result<MonitorOutcome, MonitorError>,
    hooks: &'static dyn OpalHooks,
    held: Held,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn lock_state() -> std::sync::MutexGuard<'static, Option<State>> {
    // A panic under the lock leaves at worst a stale Option; setup and teardown both
    // cope with whatever is there.
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

fn release_cb() -> OpalReleaseFn {
    release::opal_release_cb
}

/// The process-wide memory monitor. All functions are associated: there is one per
/// process (per loaded copy of this library).
pub struct Monitor;

impl Monitor {
    /// Choose and install the memory monitor, once per process. A second call returns
    /// the first call's outcome (with a warning in the log if it asked for a different
    /// choice). See the module documentation for when to call it.
    pub fn setup(
        choice: MonitorChoice,
        hooks: &'static dyn OpalHooks,
    ) -> Result<MonitorOutcome, MonitorError> {
        let mut state = lock_state();
        if let Some(s) = state.as_ref() {
            if s.requested != choice {
                log::warn!(
                    "memory monitor already set up with '{}'; ignoring the request for '{}'",
                    s.requested,
                    choice
                );
            }
            return s.result.clone();
        }
        let mut held = Held::default();
        let result = setup_inner(choice, hooks, &mut held);
        match &result {
            Ok(outcome) => {
                log::info!("{outcome}");
                for w in &outcome.warnings {
                    log::warn!("memory monitor: {w}");
                }
            }
            Err(e) => {
                log::warn!("memory monitor setup failed: {e}");
                if let Err(undo) = release_held(hooks, &mut held) {
                    log::warn!("memory monitor: undoing a failed setup: {undo}");
                }
            }
        }
        *state = Some(State {
            requested: choice,
            result: result.clone(),
            hooks,
            held,
        });
        result
    }

    /// Undo setup: unregister the release callback, stop forwarding to libfabric, wait
    /// for releases in flight, close the imported monitor and the `mr_cache` handle,
    /// log and reset the counters. Call it after the last domain is closed; while
    /// libfabric still has a cache on our monitor it refuses with
    /// [`MonitorError::InUse`] and changes nothing. Idempotent; a later
    /// [`Monitor::setup`] starts afresh.
    ///
    /// Open MPI's memory framework, opened by setup, is deliberately left open: its
    /// patcher is installed only at the first open of the process, and closing the
    /// framework to zero removes the patches while a later open still reports full
    /// support, silently without hooks (Open MPI 4.1.4's C code never closes it either).
    pub fn teardown() -> Result<(), MonitorError> {
        let mut state = lock_state();
        if state.is_none() {
            return Ok(());
        }
        let (started, stopped) = (
            LF_STARTS.load(Ordering::SeqCst),
            LF_STOPS.load(Ordering::SeqCst),
        );
        if started > stopped {
            return Err(MonitorError::InUse {
                caches_started: started,
                caches_stopped: stopped,
            });
        }
        let Some(mut s) = state.take() else {
            return Ok(());
        };
        let result = release_held(s.hooks, &mut s.held);
        log::info!("memory monitor teardown: {}", stats());
        let left = release::GLOBAL.subscribers();
        if left > 0 {
            log::warn!(
                "memory monitor teardown: {left} release subscriber(s) still registered; \
                 they receive no events until the next setup"
            );
        }
        release::GLOBAL.reset_stats();
        for c in [&LF_STARTS, &LF_STOPS, &LF_SUBSCRIBES, &LF_UNSUBSCRIBES] {
            c.store(0, Ordering::Relaxed);
        }
        if let Err(e) = &result {
            log::warn!("memory monitor teardown: {e}");
        }
        result
    }

    /// The stored outcome, if setup has run.
    pub fn outcome() -> Option<Result<MonitorOutcome, MonitorError>> {
        lock_state().as_ref().map(|s| s.result.clone())
    }

    /// Whether releases are currently forwarded to libfabric (our monitor is imported).
    pub fn is_exported() -> bool {
        release::GLOBAL.forwards_to_libfabric()
    }

    /// Current counters.
    pub fn stats() -> MonitorStats {
        stats()
    }
}

fn stats() -> MonitorStats {
    MonitorStats {
        release: release::stats(),
        libfabric_starts: LF_STARTS.load(Ordering::Relaxed),
        libfabric_stops: LF_STOPS.load(Ordering::Relaxed),
        libfabric_subscribes: LF_SUBSCRIBES.load(Ordering::Relaxed),
        libfabric_unsubscribes: LF_UNSUBSCRIBES.load(Ordering::Relaxed),
    }
}

fn setup_inner(
    choice: MonitorChoice,
    hooks: &'static dyn OpalHooks,
    held: &mut Held,
) -> Result<MonitorOutcome, MonitorError> {
    // Opening Open MPI's memory framework installs its patcher. An explicit memhooks
    // request must not install it (it would then be refused as the second patcher);
    // for every other choice the patcher feeds our own caches even when libfabric uses
    // something else.
    // Open MPI's patcher is installed when its memory framework opens, which any
    // registration cache of Open MPI's does sooner or later: so "available" counts as
    // "active", also for a memhooks request (allowed only with `--mca memory ^patcher`).
    let support = match hooks.open_memory_framework() {
        rc if rc == ompi::OPAL_SUCCESS => hooks.support_level(),
        rc => {
            log::info!("memory monitor: Open MPI's memory framework did not open ({rc})");
            0
        }
    };
    let support = support.max(0) as u32;
    let patches = patch_check::check();
    log::debug!("memory monitor: patch check before setup: {patches}");
    let probe = Probe {
        opal_support: support,
        opal_patcher_active: support & FREE_AND_MUNMAP != 0 || patches.openmpi_patched(),
        libfabric_version: libfabric_runtime_version(),
        userfaultfd: probe_userfaultfd(),
    };
    let plan = decide(choice, &probe).map_err(MonitorError::Declined)?;
    let mut warnings = Vec::new();
    let mut env = Vec::new();

    if plan.active == Active::Opal {
        if !libfabric_initialised() {
            log::debug!("memory monitor: initialising libfabric before the import");
            force_libfabric_init()?;
        }
        if let Ok(v) = std::env::var("FI_MR_CACHE_MONITOR") {
            warnings.push(format!(
                "FI_MR_CACHE_MONITOR={v} in the environment is overridden by the imported \
                 Open MPI monitor"
            ));
        }
        export(held)?;
    } else {
        let initialised = libfabric_initialised();
        for &(name, value) in env_settings(plan.active) {
            match std::env::var(name) {
                Ok(old) if old == value => {}
                Ok(old) => warnings.push(format!("{name} was '{old}', set to '{value}'")),
                Err(_) => {}
            }
            // setenv races with getenv on other threads. At component open/init Open
            // MPI's helper threads do not read these variables, and libfabric reads
            // them only in fi_ini, which is exactly what we must precede.
            std::env::set_var(name, value);
            env.push((name.to_string(), value.to_string()));
        }
        if initialised && !env.is_empty() {
            warnings.push(format!(
                "libfabric was already initialised (it reads FI_MR_CACHE_MONITOR once, at its \
                 first fi_getinfo): '{}' may not take effect in this process",
                plan.active
            ));
        }
    }

    // Our own subscribers want Open MPI's release events whatever libfabric uses.
    let mut release_events = false;
    if choice != MonitorChoice::Memhooks && support & FREE_AND_MUNMAP != 0 {
        let rc = hooks.register_release(release_cb());
        if rc == ompi::OPAL_SUCCESS || rc == ompi::OPAL_EXISTS {
            held.registered = true;
            release_events = true;
        } else if plan.active == Active::Opal {
            return Err(MonitorError::Opal {
                op: "opal_mem_hooks_register_release",
                rc,
            });
        } else {
            warnings.push(format!(
                "opal_mem_hooks_register_release failed ({rc}): our caches get no release events"
            ));
        }
    }

    warnings.extend(patches.problems(plan.active == Active::Opal));
    Ok(MonitorOutcome {
        requested: choice,
        active: plan.active,
        reason: plan.reason,
        release_events,
        env,
        warnings,
    })
}

/// `fi_open("mr_cache")` + `fi_import_fid` of [`MONITOR`], then route releases to
/// libfabric's notify.
fn export(held: &mut Held) -> Result<(), MonitorError> {
    let mut cache: *mut fi::fid = null_mut();
    // SAFETY: "mr_cache" is NUL-terminated, attr is NULL with length 0 as 1.17
    // requires, and `cache` is a valid out pointer.
    let rc = unsafe {
        fi::fi_open(
            fi_version(1, 13),
            c"mr_cache".as_ptr(),
            null_mut(),
            0,
            0,
            &mut cache,
            null_mut(),
        )
    };
    check(rc).map_err(|err| MonitorError::Fabric {
        op: "fi_open(\"mr_cache\")",
        err,
    })?;
    held.cache_fid = cache as usize;

    let m = MONITOR.0.get();
    // SAFETY: we hold the STATE lock and nothing is imported (STATE was empty, or a
    // teardown released the previous import), so neither libfabric nor the release
    // path can be reading MONITOR.
    unsafe {
        m.write(fi::fid_mem_monitor {
            fid: fi::fid {
                fclass: fi::FI_CLASS_MEM_MONITOR as usize,
                context: null_mut(),
                ops: null_mut(),
            },
            export_ops: EXPORT_OPS.0.get(),
            import_ops: null_mut(),
        });
    }
    // SAFETY: `cache` is the live mr_cache fid; `m` points to a static monitor that
    // stays valid until teardown closes it. libfabric fills fid.ops, fid.context and
    // import_ops on success.
    let rc = unsafe { fi::fi_import_fid(cache, &raw mut (*m).fid, 0) };
    if rc == -(fi::FI_EBUSY as i32) {
        return Err(MonitorError::ImportBusy);
    }
    check(rc).map_err(|err| MonitorError::Fabric {
        op: "fi_import_fid",
        err,
    })?;
    held.imported = true;

    // SAFETY: libfabric set import_ops to its static notify table during the import
    // above, on this thread; nobody else writes it while imported.
    let notify = unsafe { (*m).import_ops.as_ref().and_then(|ops| ops.notify) };
    match notify {
        Some(n) => {
            release::GLOBAL.set_libfabric_notify(m, n);
            Ok(())
        }
        None => Err(MonitorError::Fabric {
            op: "fi_import_fid (no notify operation)",
            err: Error::NOSYS,
        }),
    }
}

/// Give back whatever `held` says we hold, in the safe order: no new events from Open
/// MPI, no event in flight towards libfabric, then close the monitor and the handle.
fn release_held(hooks: &dyn OpalHooks, held: &mut Held) -> Result<(), MonitorError> {
    let mut first: Option<MonitorError> = None;
    if held.registered {
        let rc = hooks.unregister_release(release_cb());
        if rc != ompi::OPAL_SUCCESS {
            first.get_or_insert(MonitorError::Opal {
                op: "opal_mem_hooks_unregister_release",
                rc,
            });
        }
        held.registered = false;
    }
    // Waits until no dispatch is inside libfabric's notify. (Open MPI's own list walk
    // may still call our callback briefly after unregistering; with notify cleared that
    // only reaches our subscribers.)
    release::GLOBAL.clear_libfabric_notify();
    let m = MONITOR.0.get();
    if held.imported {
        // SAFETY: MONITOR was imported, so libfabric set fid.ops to its close op
        // (which forgets the import). No dispatch uses it any more (cleared above)
        // and the caller has closed every domain.
        let rc = unsafe { fi::fi_close(&raw mut (*m).fid) };
        if let Err(err) = check(rc) {
            first.get_or_insert(MonitorError::Fabric {
                op: "fi_close(monitor)",
                err,
            });
        }
        held.imported = false;
    }
    // SAFETY: not imported any more (or never was); we hold the STATE lock.
    unsafe { m.write(ZERO_MONITOR) };
    if held.cache_fid != 0 {
        // SAFETY: the handle from fi_open, closed exactly once here.
        let rc = unsafe { fi::fi_close(held.cache_fid as *mut fi::fid) };
        if let Err(err) = check(rc) {
            first.get_or_insert(MonitorError::Fabric {
                op: "fi_close(mr_cache)",
                err,
            });
        }
        held.cache_fid = 0;
    }
    match first {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// libfabric's name for a version, e.g. "1.17".
pub fn version_string(v: u32) -> String {
    format!("{}.{}", fi_major(v), fi_minor(v))
}

/// The `mr_cache_monitor` value libfabric sees in the environment, if initialised.
pub fn libfabric_monitor_variable() -> Option<String> {
    let mut value: *mut c_char = null_mut();
    // SAFETY: as in `libfabric_initialised`; on success `value` points into the
    // environment (getenv), which we copy at once.
    let r = unsafe {
        fi::fi_param_get(
            null_mut(),
            c"mr_cache_monitor".as_ptr(),
            (&mut value as *mut *mut c_char).cast::<c_void>(),
        )
    };
    if r != 0 || value.is_null() {
        return None;
    }
    // SAFETY: non-null NUL-terminated string from getenv.
    Some(
        unsafe { CStr::from_ptr(value) }
            .to_string_lossy()
            .into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(support: u32, patcher: bool, version: (u32, u32), uffd: bool) -> Probe {
        Probe {
            opal_support: support,
            opal_patcher_active: patcher,
            libfabric_version: fi_version(version.0, version.1),
            userfaultfd: if uffd {
                Ok(())
            } else {
                Err("userfaultfd: permission denied".into())
            },
        }
    }

    const BOTH: u32 = FREE_AND_MUNMAP;

    #[test]
    fn parse_is_case_insensitive_and_lists_valid_values() {
        assert_eq!("auto".parse(), Ok(MonitorChoice::Auto));
        assert_eq!(" OPAL ".parse(), Ok(MonitorChoice::Opal));
        assert_eq!("UserFaultFD".parse(), Ok(MonitorChoice::Userfaultfd));
        assert_eq!("memhooks".parse(), Ok(MonitorChoice::Memhooks));
        assert_eq!("Disabled".parse(), Ok(MonitorChoice::Disabled));
        let e = "uffd".parse::<MonitorChoice>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown memory monitor 'uffd': valid values are auto, opal, userfaultfd, memhooks, disabled"
        );
        for c in MonitorChoice::ALL {
            assert_eq!(c.as_str().parse(), Ok(c));
        }
    }

    #[test]
    fn auto_prefers_opal_then_userfaultfd_then_disabled() {
        let p = probe(BOTH, true, (1, 17), true);
        assert_eq!(
            decide(MonitorChoice::Auto, &p).unwrap().active,
            Active::Opal
        );

        // hooks without munmap support are not enough
        let p = probe(ompi::OPAL_MEMORY_FREE_SUPPORT, true, (1, 17), true);
        let plan = decide(MonitorChoice::Auto, &p).unwrap();
        assert_eq!(plan.active, Active::Userfaultfd);
        assert!(plan.reason.contains("support level 0x1"), "{}", plan.reason);

        // libfabric too old for the import
        let p = probe(BOTH, true, (1, 13), true);
        let plan = decide(MonitorChoice::Auto, &p).unwrap();
        assert_eq!(plan.active, Active::Userfaultfd);
        assert!(
            plan.reason.contains("1.13 is older than 1.14"),
            "{}",
            plan.reason
        );

        // nothing usable: caching disabled, and it says so; never memhooks
        let p = probe(BOTH, true, (1, 13), false);
        let plan = decide(MonitorChoice::Auto, &p).unwrap();
        assert_eq!(plan.active, Active::CachingDisabled);
        assert!(
            plan.reason.contains("caching is disabled"),
            "{}",
            plan.reason
        );
        assert!(
            plan.reason.contains("Open MPI's patcher is active"),
            "{}",
            plan.reason
        );
        let p = probe(0, false, (1, 17), false);
        assert_eq!(
            decide(MonitorChoice::Auto, &p).unwrap().active,
            Active::CachingDisabled
        );
    }

    #[test]
    fn explicit_choices_that_cannot_be_honoured_decline_with_alternatives() {
        let no_hooks = probe(0, false, (1, 17), true);
        let d = decide(MonitorChoice::Opal, &no_hooks).unwrap_err();
        assert_eq!(d.choice, MonitorChoice::Opal);
        assert!(d.message.contains("support level 0x0"), "{}", d.message);
        assert!(
            d.message
                .ends_with("working alternatives here: userfaultfd, memhooks, disabled"),
            "{}",
            d.message
        );

        let no_uffd = probe(BOTH, true, (1, 17), false);
        let d = decide(MonitorChoice::Userfaultfd, &no_uffd).unwrap_err();
        assert!(d.message.contains("permission denied"), "{}", d.message);
        assert!(
            d.message.ends_with("alternatives here: opal, disabled"),
            "{}",
            d.message
        );

        let patcher = probe(BOTH, true, (1, 17), true);
        let d = decide(MonitorChoice::Memhooks, &patcher).unwrap_err();
        assert!(d.message.contains("two patchers"), "{}", d.message);
        assert!(
            d.message
                .ends_with("alternatives here: opal, userfaultfd, disabled"),
            "{}",
            d.message
        );

        // the patch check alone (support level 0) also counts as an active patcher
        let d = decide(MonitorChoice::Memhooks, &probe(0, true, (1, 17), true)).unwrap_err();
        assert!(d.message.contains("patcher is active"));
    }

    #[test]
    fn explicit_choices_that_can_be_honoured() {
        let p = probe(BOTH, true, (1, 17), true);
        assert_eq!(
            decide(MonitorChoice::Opal, &p).unwrap().active,
            Active::Opal
        );
        assert_eq!(
            decide(MonitorChoice::Userfaultfd, &p).unwrap().active,
            Active::Userfaultfd
        );
        assert_eq!(
            decide(MonitorChoice::Disabled, &p).unwrap().active,
            Active::CachingDisabled
        );
        let no_patcher = probe(0, false, (1, 17), false);
        assert_eq!(
            decide(MonitorChoice::Memhooks, &no_patcher).unwrap().active,
            Active::Memhooks
        );
        assert_eq!(
            decide(MonitorChoice::Disabled, &no_patcher).unwrap().active,
            Active::CachingDisabled
        );
    }

    #[test]
    fn environment_for_each_mechanism() {
        assert!(env_settings(Active::Opal).is_empty());
        assert_eq!(
            env_settings(Active::Userfaultfd),
            &[("FI_MR_CACHE_MONITOR", "userfaultfd")]
        );
        assert_eq!(
            env_settings(Active::Memhooks),
            &[("FI_MR_CACHE_MONITOR", "memhooks")]
        );
        assert!(
            env_settings(Active::CachingDisabled).contains(&("FI_MR_CACHE_MONITOR", "disabled"))
        );
        assert!(env_settings(Active::CachingDisabled).contains(&("FI_MR_CACHE_MAX_COUNT", "0")));
    }

    #[test]
    fn uffdio_api_matches_the_kernel_header() {
        // <linux/userfaultfd.h>: UFFDIO_API == 0xc018aa3f on x86-64, struct of 24 bytes.
        assert_eq!(std::mem::size_of::<UffdioApi>(), 24);
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFD_LIBFABRIC_FEATURES, 0x4c);
    }

    struct NoHooks;
    impl OpalHooks for NoHooks {
        fn open_memory_framework(&self) -> i32 {
            ompi::OPAL_ERR_NOT_AVAILABLE
        }
        fn support_level(&self) -> i32 {
            0
        }
        fn register_release(&self, _cb: OpalReleaseFn) -> i32 {
            ompi::OPAL_ERR_NOT_SUPPORTED
        }
        fn unregister_release(&self, _cb: OpalReleaseFn) -> i32 {
            ompi::OPAL_ERR_NOT_FOUND
        }
    }
    static NO_HOOKS: NoHooks = NoHooks;

    /// The only unit test that touches the process-wide STATE and export counters.
    #[test]
    fn teardown_refuses_while_libfabric_has_a_cache_on_the_monitor() {
        *lock_state() = Some(State {
            requested: MonitorChoice::Opal,
            result: Err(MonitorError::ImportBusy),
            hooks: &NO_HOOKS,
            held: Held::default(),
        });
        // What libfabric does when the first cache attaches to the monitor.
        // SAFETY: the export ops ignore their monitor argument.
        unsafe { export_start(null_mut()) };
        let e = Monitor::teardown().unwrap_err();
        assert_eq!(
            e,
            MonitorError::InUse {
                caches_started: 1,
                caches_stopped: 0
            }
        );
        assert!(e.to_string().contains("close every domain"), "{e}");
        assert!(
            Monitor::outcome().is_some(),
            "a refused teardown changes nothing"
        );
        // SAFETY: as above.
        unsafe { export_stop(null_mut()) };
        assert_eq!(Monitor::teardown(), Ok(()));
        assert!(Monitor::outcome().is_none());
        assert_eq!(Monitor::stats(), MonitorStats::default());
    }

    #[test]
    fn errors_map_to_opal_codes_and_read_well() {
        assert_eq!(
            MonitorError::ImportBusy.to_opal(),
            ompi::OPAL_ERR_RESOURCE_BUSY
        );
        assert!(MonitorError::ImportBusy
            .to_string()
            .contains("another monitor was imported first, or a cache is already attached"));
        let d = MonitorError::Declined(Decline {
            choice: MonitorChoice::Opal,
            message: "x".into(),
        });
        assert_eq!(d.to_opal(), ompi::OPAL_ERR_NOT_AVAILABLE);
    }
}
