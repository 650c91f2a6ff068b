//! The monitor object libfabric imports: a static `fid_mem_monitor` with the export
//! ops libfabric calls, which only count (the release path does the work).
//!
//! What it owns: the static and its ops. What it must not touch: the import itself
//! (`mod.rs`, under the state lock).

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};

use libfabric_sys as fi;

/// The monitor libfabric imports. A static because libfabric keeps a pointer to it
/// until it is closed and the release path reaches it from inside `munmap`.
///
/// Invariant: written by us only under the [`STATE`] lock while not imported; while
/// imported, libfabric owns the fields it set at import (`fid.ops`, `fid.context`,
/// `import_ops`) and we only hand out the pointer.
pub(super) struct MonitorCell(pub(super) UnsafeCell<fi::fid_mem_monitor>);

// SAFETY: see the invariant above: all our writes are serialised by the STATE lock and
// happen while no other thread (libfabric or the release path) can read the object.
unsafe impl Sync for MonitorCell {}

pub(super) const ZERO_MONITOR: fi::fid_mem_monitor = fi::fid_mem_monitor {
    fid: fi::fid {
        fclass: 0,
        context: null_mut(),
        ops: null_mut(),
    },
    export_ops: null_mut(),
    import_ops: null_mut(),
};

pub(super) static MONITOR: MonitorCell = MonitorCell(UnsafeCell::new(ZERO_MONITOR));

/// Our `export_ops`. In an `UnsafeCell` only because libfabric's field is a `*mut`; it
/// is never written.
pub(super) struct ExportOps(pub(super) UnsafeCell<fi::fi_ops_mem_monitor>);

// SAFETY: never written after compile-time initialisation.
unsafe impl Sync for ExportOps {}

pub(super) static EXPORT_OPS: ExportOps = ExportOps(UnsafeCell::new(fi::fi_ops_mem_monitor {
    size: std::mem::size_of::<fi::fi_ops_mem_monitor>(),
    start: Some(export_start),
    stop: Some(export_stop),
    subscribe: Some(export_subscribe),
    unsubscribe: Some(export_unsubscribe),
    valid: Some(export_valid),
}));

pub(super) static LF_STARTS: AtomicU64 = AtomicU64::new(0);
pub(super) static LF_STOPS: AtomicU64 = AtomicU64::new(0);
pub(super) static LF_SUBSCRIBES: AtomicU64 = AtomicU64::new(0);
pub(super) static LF_UNSUBSCRIBES: AtomicU64 = AtomicU64::new(0);

// The export ops run under libfabric's cache and monitor locks: they only bump a
// counter. There is nothing to start or stop (Open MPI's patcher is always on) and no
// filtering by range: every release reaches notify, so every registration stays valid
// until notified. `unsafe extern "C"` only to match libfabric's field type.

pub(super) unsafe extern "C" fn export_start(_m: *mut fi::fid_mem_monitor) -> c_int {
    LF_STARTS.fetch_add(1, Ordering::SeqCst);
    0
}

pub(super) unsafe extern "C" fn export_stop(_m: *mut fi::fid_mem_monitor) {
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
