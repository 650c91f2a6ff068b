//! The memory monitor against the real libfabric (no MPI job).
//!
//! libfabric's monitor state is process-global: it initialises once (reading
//! `FI_MR_CACHE_MONITOR` then), accepts one imported monitor at a time, and keeps the
//! import as its default monitor. So every order-dependent check lives in the ONE test
//! function of this binary, [`monitor_lifecycle`], as phases that run in sequence:
//!
//! 0. the patch self-check on this still unpatched process;
//! 1. an environment choice (`userfaultfd`) made before libfabric initialises is what
//!    libfabric reads;
//! 2. our import is refused as BUSY while another monitor is imported;
//! 3. export with stand-in Open MPI hooks: idempotent setup, a second import is BUSY, a
//!    domain opened after the import, a release reaching libfabric's notify and a
//!    subscriber (counted), unsubscribe, domain closed, then teardown;
//! 4. setup again after teardown works;
//! 5. the real thing: `opal_init_util` and Open MPI's memory framework install Open
//!    MPI's patcher in this process; a real `munmap` reaches our subscriber and
//!    libfabric through it. Last, because the patcher stays installed.
//!
//! The provider for the domains is `OMPI_OFI_TEST_PROVIDER`, `tcp` by default (the one
//! variable that names the provider of every test); a provider that yields no domain
//! fails the test.
//!
//! Run with `RUST_LOG=info FI_LOG_LEVEL=info cargo test --test monitor -- --nocapture`
//! to see libfabric's "setting imported memory monitor as default".

use std::ffi::{c_char, c_int, c_void, CString};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};

use libfabric_sys as fi;
use libfabric_sys::macros::fi_version;
use ompi_ofi::common::monitor::{
    libfabric_initialised, libfabric_monitor_variable, probe_userfaultfd, Active, Monitor,
    MonitorChoice, MonitorError, OpalHooks, OpalReleaseFn,
};
use ompi_ofi::common::patch_check::{self, Owner};
use ompi_ofi::common::release;
use ompi_ofi::ompi::memhooks::OpenMpiHooks;
use ompi_sys as ompi;

// ---------------------------------------------------------------------------------
// Counting allocator: proves the dispatch path does not allocate (Rust side; what
// libfabric's notify does is libfabric's business)

struct Counting;

thread_local! {
    static COUNT_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
static ALLOCS_COUNTED: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; the bookkeeping is a const
// thread-local bool (no lazy initialisation, no destructor) and an atomic.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if COUNT_HERE.with(|c| c.get()) {
            ALLOCS_COUNTED.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: same contract as our caller's.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        if COUNT_HERE.with(|c| c.get()) {
            ALLOCS_COUNTED.fetch_add(1, Ordering::SeqCst);
        }
        // SAFETY: same contract as our caller's.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Rust allocations and frees made by `f` on this thread.
fn allocations_in(f: impl FnOnce()) -> u64 {
    let before = ALLOCS_COUNTED.load(Ordering::SeqCst);
    COUNT_HERE.with(|c| c.set(true));
    f();
    COUNT_HERE.with(|c| c.set(false));
    ALLOCS_COUNTED.load(Ordering::SeqCst) - before
}

// ---------------------------------------------------------------------------------
// Stand-in for Open MPI's memory hooks

/// Pretends Open MPI's hooks have a given support level and records the callback.
struct FakeOpal {
    support: AtomicI32,
    callback: AtomicUsize,
    registers: AtomicU64,
    unregisters: AtomicU64,
}

impl FakeOpal {
    const fn new(support: i32) -> FakeOpal {
        FakeOpal {
            support: AtomicI32::new(support),
            callback: AtomicUsize::new(0),
            registers: AtomicU64::new(0),
            unregisters: AtomicU64::new(0),
        }
    }

    /// Play Open MPI's patcher: call the registered release callback.
    fn release(&self, addr: usize, len: usize) {
        let cb = self.callback.load(Ordering::SeqCst);
        assert_ne!(cb, 0, "no release callback registered");
        // SAFETY: `cb` was stored from an `OpalReleaseFn` by register_release.
        let f: OpalReleaseFn = unsafe { std::mem::transmute::<usize, OpalReleaseFn>(cb) };
        // SAFETY: the callback takes any range; it does not touch the memory.
        unsafe { f(addr as *mut c_void, len, null_mut(), false) };
    }
}

impl OpalHooks for FakeOpal {
    fn open_memory_framework(&self) -> i32 {
        ompi::OPAL_SUCCESS
    }
    fn support_level(&self) -> i32 {
        self.support.load(Ordering::SeqCst)
    }
    fn register_release(&self, cb: OpalReleaseFn) -> i32 {
        self.registers.fetch_add(1, Ordering::SeqCst);
        self.callback.store(cb as usize, Ordering::SeqCst);
        ompi::OPAL_SUCCESS
    }
    fn unregister_release(&self, cb: OpalReleaseFn) -> i32 {
        self.unregisters.fetch_add(1, Ordering::SeqCst);
        let was = self.callback.swap(0, Ordering::SeqCst);
        assert_eq!(
            was, cb as usize,
            "unregistering a callback that was not registered"
        );
        ompi::OPAL_SUCCESS
    }
}

const FREE_AND_MUNMAP: i32 =
    (ompi::OPAL_MEMORY_FREE_SUPPORT | ompi::OPAL_MEMORY_MUNMAP_SUPPORT) as i32;
static HOOKS: FakeOpal = FakeOpal::new(FREE_AND_MUNMAP);
static NO_HOOKS: FakeOpal = FakeOpal::new(0);
static REAL: OpenMpiHooks = OpenMpiHooks;

// ---------------------------------------------------------------------------------
// A second, foreign monitor (someone else's import)

struct Foreign(
    std::cell::UnsafeCell<fi::fid_mem_monitor>,
    std::cell::UnsafeCell<fi::fi_ops_mem_monitor>,
);
// SAFETY: used from the single test thread only; libfabric reads it under its locks.
unsafe impl Sync for Foreign {}

unsafe extern "C" fn f_start(_m: *mut fi::fid_mem_monitor) -> c_int {
    0
}
unsafe extern "C" fn f_stop(_m: *mut fi::fid_mem_monitor) {}
unsafe extern "C" fn f_sub(_m: *mut fi::fid_mem_monitor, _a: *const c_void, _l: usize) -> c_int {
    0
}
unsafe extern "C" fn f_unsub(_m: *mut fi::fid_mem_monitor, _a: *const c_void, _l: usize) {}
unsafe extern "C" fn f_valid(_m: *mut fi::fid_mem_monitor, _a: *const c_void, _l: usize) -> bool {
    true
}

static FOREIGN: Foreign = Foreign(
    std::cell::UnsafeCell::new(fi::fid_mem_monitor {
        fid: fi::fid {
            fclass: 0,
            context: null_mut(),
            ops: null_mut(),
        },
        export_ops: null_mut(),
        import_ops: null_mut(),
    }),
    std::cell::UnsafeCell::new(fi::fi_ops_mem_monitor {
        size: std::mem::size_of::<fi::fi_ops_mem_monitor>(),
        start: Some(f_start),
        stop: Some(f_stop),
        subscribe: Some(f_sub),
        unsubscribe: Some(f_unsub),
        valid: Some(f_valid),
    }),
);

/// Try to import FOREIGN; returns fi_import_fid's code.
fn import_foreign() -> c_int {
    let mut cache: *mut fi::fid = null_mut();
    // SAFETY: valid arguments for fi_open("mr_cache"); FOREIGN is a static that lives
    // as long as the process; the cache handle is closed right after.
    unsafe {
        let rc = fi::fi_open(
            fi_version(1, 13),
            c"mr_cache".as_ptr(),
            null_mut(),
            0,
            0,
            &mut cache,
            null_mut(),
        );
        assert_eq!(rc, 0, "fi_open(mr_cache)");
        let m = FOREIGN.0.get();
        (*m).fid.fclass = fi::FI_CLASS_MEM_MONITOR as usize;
        (*m).export_ops = FOREIGN.1.get();
        let rc = fi::fi_import_fid(cache, &raw mut (*m).fid, 0);
        assert_eq!(fi::fi_close(cache), 0);
        rc
    }
}

fn close_foreign() {
    // SAFETY: FOREIGN was imported (libfabric set its close op); closing forgets it.
    unsafe {
        let m = FOREIGN.0.get();
        assert_eq!(fi::fi_close(&raw mut (*m).fid), 0);
        (*m).fid.ops = null_mut();
        (*m).import_ops = null_mut();
    }
}

// ---------------------------------------------------------------------------------
// libfabric: info, fabric, domain (raw; the safe wrappers live in another branch)

fn provider() -> String {
    std::env::var("OMPI_OFI_TEST_PROVIDER").unwrap_or_else(|_| "tcp".into())
}

struct Info(*mut fi::fi_info);

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: the list came from fi_getinfo and is freed once.
        unsafe { fi::fi_freeinfo(self.0) }
    }
}

fn getinfo(prov: &str) -> Info {
    let name = CString::new(prov).unwrap();
    // SAFETY: hints from fi_allocinfo, prov_name strdup'ed (fi_freeinfo frees it),
    // the result list is owned by the returned Info.
    unsafe {
        let hints = fi::fi_allocinfo();
        assert!(!hints.is_null());
        (*(*hints).fabric_attr).prov_name = libc::strdup(name.as_ptr());
        (*hints).mode = !0;
        let mut info: *mut fi::fi_info = null_mut();
        let rc = fi::fi_getinfo(
            fi_version(1, 14),
            std::ptr::null(),
            std::ptr::null(),
            0,
            hints,
            &mut info,
        );
        fi::fi_freeinfo(hints);
        assert!(
            rc == 0 && !info.is_null(),
            "provider {prov:?} (OMPI_OFI_TEST_PROVIDER) has no fi_info here: fi_getinfo returned {rc}"
        );
        Info(info)
    }
}

struct Domain {
    fabric: *mut fi::fid_fabric,
    domain: *mut fi::fid_domain,
}

fn open_domain(info: &Info) -> Domain {
    // SAFETY: info.0 is a valid fi_info; out pointers are valid; objects are closed in
    // Domain::close, children first.
    unsafe {
        let mut fabric: *mut fi::fid_fabric = null_mut();
        let rc = fi::fi_fabric((*info.0).fabric_attr, &mut fabric, null_mut());
        assert_eq!(rc, 0, "fi_fabric");
        let mut domain: *mut fi::fid_domain = null_mut();
        let rc = fi::fi_domain(fabric, info.0, &mut domain, null_mut());
        assert_eq!(rc, 0, "fi_domain");
        Domain { fabric, domain }
    }
}

impl Domain {
    fn close(self) {
        // SAFETY: both were opened by open_domain; the domain is closed before its fabric.
        unsafe {
            assert_eq!(fi::fi_close(&raw mut (*self.domain).fid), 0, "close domain");
            assert_eq!(fi::fi_close(&raw mut (*self.fabric).fid), 0, "close fabric");
        }
    }
}

// ---------------------------------------------------------------------------------
// A subscriber that records what it sees

static SEEN_CALLS: AtomicU64 = AtomicU64::new(0);
static SEEN_ADDR: AtomicUsize = AtomicUsize::new(0);
static SEEN_LEN: AtomicUsize = AtomicUsize::new(0);
/// Only releases starting at this address are recorded (other threads munmap too).
static WATCH: AtomicUsize = AtomicUsize::new(usize::MAX);

static BAD_CTX: AtomicU64 = AtomicU64::new(0);

/// Runs inside munmap: records, never panics.
extern "C" fn subscriber(addr: usize, len: usize, ctx: usize) {
    if ctx != 0xC0FFEE {
        BAD_CTX.fetch_add(1, Ordering::SeqCst);
    }
    let w = WATCH.load(Ordering::SeqCst);
    if w == usize::MAX || w == addr {
        SEEN_CALLS.fetch_add(1, Ordering::SeqCst);
        SEEN_ADDR.store(addr, Ordering::SeqCst);
        SEEN_LEN.store(len, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------------------

#[test]
fn monitor_lifecycle() {
    let _ = env_logger::builder().is_test(true).try_init();
    phase0_patch_check_unpatched();
    phase1_env_choice_before_init();
    let info = getinfo(&provider());
    phase2_import_busy_when_another_monitor_is_imported();
    phase3_export_dispatch_teardown(&info);
    phase4_setup_again(&info);
    phase5_real_open_mpi(&info);
}

fn phase0_patch_check_unpatched() {
    let report = patch_check::check();
    log::info!("phase 0: {report}");
    assert_eq!(
        report.owner_of("munmap"),
        Some(&Owner::Unpatched),
        "{report}"
    );
    assert!(!report.openmpi_patched(), "{report}");
    assert!(report.conflicts().is_empty(), "{report}");
    assert!(report.problems(false).is_empty(), "{report}");
}

fn phase1_env_choice_before_init() {
    assert!(
        !libfabric_initialised(),
        "nothing may call fi_getinfo before phase 1"
    );
    let uffd = probe_userfaultfd();
    let result = Monitor::setup(MonitorChoice::Userfaultfd, &NO_HOOKS);
    match (&uffd, &result) {
        (Ok(()), Ok(outcome)) => {
            log::info!("phase 1: {outcome}");
            assert_eq!(outcome.active, Active::Userfaultfd);
            assert!(
                !outcome.release_events,
                "no Open MPI hooks, no release events"
            );
            assert!(outcome.warnings.is_empty(), "{outcome}");
            assert_eq!(
                outcome.env,
                vec![("FI_MR_CACHE_MONITOR".to_string(), "userfaultfd".to_string())]
            );
            assert!(!Monitor::is_exported());
            // libfabric initialises now and reads what setup wrote.
            drop(getinfo(&provider()));
            assert!(libfabric_initialised());
            assert_eq!(libfabric_monitor_variable().as_deref(), Some("userfaultfd"));
        }
        (Err(why), Err(MonitorError::Declined(d))) => {
            log::warn!("phase 1: userfaultfd unusable here ({why}); declined: {d}");
            assert!(d.message.contains("userfaultfd is not usable"));
        }
        (u, r) => panic!("userfaultfd probe {u:?} but setup returned {r:?}"),
    }
    assert_eq!(NO_HOOKS.registers.load(Ordering::SeqCst), 0);
    Monitor::teardown().expect("teardown after an environment choice");
    assert!(Monitor::outcome().is_none());
    std::env::remove_var("FI_MR_CACHE_MONITOR");
}

fn phase2_import_busy_when_another_monitor_is_imported() {
    assert_eq!(
        import_foreign(),
        0,
        "the first import of the process must be accepted"
    );
    let err = Monitor::setup(MonitorChoice::Opal, &HOOKS).unwrap_err();
    assert_eq!(err, MonitorError::ImportBusy);
    assert!(
        err.to_string()
            .contains("another monitor was imported first"),
        "{err}"
    );
    // The failure is the stored outcome: a second caller sees the same.
    assert_eq!(
        Monitor::setup(MonitorChoice::Opal, &HOOKS),
        Err(MonitorError::ImportBusy)
    );
    assert_eq!(
        HOOKS.registers.load(Ordering::SeqCst),
        0,
        "nothing registered on failure"
    );
    assert!(!Monitor::is_exported());
    close_foreign();
    Monitor::teardown().expect("teardown after a failed setup");
}

fn phase3_export_dispatch_teardown(info: &Info) {
    let outcome = Monitor::setup(MonitorChoice::Opal, &HOOKS).expect("export into libfabric");
    log::info!("phase 3: {outcome}");
    assert_eq!(outcome.active, Active::Opal);
    assert!(outcome.release_events);
    assert!(outcome.env.is_empty());
    // The stand-in hooks claim support but nothing patched munmap: the self-check says so.
    assert!(
        outcome
            .warnings
            .iter()
            .any(|w| w.contains("munmap is unpatched")),
        "{outcome}"
    );
    assert!(Monitor::is_exported());
    assert_eq!(HOOKS.registers.load(Ordering::SeqCst), 1);

    // Idempotent: same outcome, no second registration or import.
    assert_eq!(
        Monitor::setup(MonitorChoice::Opal, &HOOKS),
        Ok(outcome.clone())
    );
    assert_eq!(Monitor::setup(MonitorChoice::Auto, &HOOKS), Ok(outcome));
    assert_eq!(HOOKS.registers.load(Ordering::SeqCst), 1);

    // Anyone else's import is now refused by libfabric.
    assert_eq!(import_foreign(), -(fi::FI_EBUSY as c_int));

    // A domain opened after the import, a release while it is open.
    let domain = open_domain(info);
    let id = release::subscribe(subscriber, 0xC0FFEE).expect("subscribe");
    SEEN_CALLS.store(0, Ordering::SeqCst);
    WATCH.store(usize::MAX, Ordering::SeqCst);
    let before = Monitor::stats();
    HOOKS.release(0x7000_0000, 0x2000);
    let after = Monitor::stats();
    assert_eq!(SEEN_CALLS.load(Ordering::SeqCst), 1);
    assert_eq!(SEEN_ADDR.load(Ordering::SeqCst), 0x7000_0000);
    assert_eq!(SEEN_LEN.load(Ordering::SeqCst), 0x2000);
    assert_eq!(after.release.events - before.release.events, 1);
    assert_eq!(after.release.bytes - before.release.bytes, 0x2000);
    assert_eq!(
        after.release.libfabric_notifies - before.release.libfabric_notifies,
        1
    );
    assert_eq!(
        after.release.subscriber_calls - before.release.subscriber_calls,
        1
    );

    // Nothing on the release path allocates or frees (with libfabric's notify and a
    // subscriber both in the path).
    assert!(allocations_in(|| drop(std::hint::black_box(vec![1u8; 64]))) >= 2);
    assert_eq!(
        allocations_in(|| {
            for i in 0..1000 {
                HOOKS.release(0x7200_0000 + i * 0x1000, 0x1000);
            }
        }),
        0
    );
    assert_eq!(SEEN_CALLS.load(Ordering::SeqCst), 1001);
    SEEN_CALLS.store(1, Ordering::SeqCst);
    let before = Monitor::stats();
    assert!(release::unsubscribe(id));
    HOOKS.release(0x7000_0000, 0x1000);
    assert_eq!(
        SEEN_CALLS.load(Ordering::SeqCst),
        1,
        "called after unsubscribe"
    );
    let last = Monitor::stats();
    assert_eq!(
        last.release.libfabric_notifies - before.release.libfabric_notifies,
        1
    );
    assert_eq!(
        last.release.subscriber_calls - before.release.subscriber_calls,
        0
    );
    log::info!("phase 3: {last}");

    // Order: the domain first, then the monitor.
    domain.close();
    Monitor::teardown().expect("teardown");
    assert_eq!(HOOKS.unregisters.load(Ordering::SeqCst), 1);
    assert!(!Monitor::is_exported());
    assert!(Monitor::outcome().is_none());
    assert_eq!(
        Monitor::stats(),
        Default::default(),
        "teardown resets the counters"
    );
    Monitor::teardown().expect("a second teardown is a no-op");
    assert_eq!(HOOKS.unregisters.load(Ordering::SeqCst), 1);
}

fn phase4_setup_again(info: &Info) {
    let outcome =
        Monitor::setup(MonitorChoice::Opal, &HOOKS).expect("a fresh export after teardown");
    assert_eq!(outcome.active, Active::Opal);
    assert!(Monitor::is_exported());
    let domain = open_domain(info);
    HOOKS.release(0x7100_0000, 0x1000);
    assert_eq!(Monitor::stats().release.libfabric_notifies, 1);
    domain.close();
    Monitor::teardown().expect("teardown");
    assert_eq!(HOOKS.registers.load(Ordering::SeqCst), 2);
    assert_eq!(HOOKS.unregisters.load(Ordering::SeqCst), 2);
}

fn phase5_real_open_mpi(info: &Info) {
    // What MPI_Init does for the memory hooks: opal_init_util, opal_mem_hooks_init.
    let mut argc: c_int = 1;
    let arg0 = CString::new("monitor-test").unwrap();
    let mut argv_vec: [*mut c_char; 2] = [arg0.as_ptr() as *mut c_char, null_mut()];
    let mut argv = argv_vec.as_mut_ptr();
    // SAFETY: argc/argv describe a NULL-terminated vector that outlives the call;
    // opal_init_util and opal_mem_hooks_init are Open MPI's own initialisation.
    unsafe {
        assert_eq!(
            ompi::opal_init_util(&mut argc, &mut argv),
            ompi::OPAL_SUCCESS
        );
        assert_eq!(ompi::opal_mem_hooks_init(), ompi::OPAL_SUCCESS);
    }

    let outcome = Monitor::setup(MonitorChoice::Auto, &REAL).expect("auto with Open MPI");
    log::info!("phase 5: {outcome}");
    assert_eq!(outcome.active, Active::Opal, "{outcome}");
    assert!(outcome.release_events);
    assert!(outcome.warnings.is_empty(), "{outcome}");

    let report = patch_check::check();
    log::info!("phase 5: {report}");
    assert!(
        report.owner_of("munmap").is_some_and(|o| o.is_openmpi()),
        "{report}"
    );
    assert!(report.problems(true).is_empty(), "{report}");

    // The first outcome stands for the whole process, even for a different request.
    assert!(matches!(
        Monitor::setup(MonitorChoice::Memhooks, &REAL),
        Ok(ref o) if o.active == Active::Opal
    ));

    let domain = open_domain(info);
    let id = release::subscribe(subscriber, 0xC0FFEE).expect("subscribe");
    let len = 1 << 20;
    // SAFETY: a fresh anonymous mapping, unmapped once below, never dereferenced.
    let region = unsafe {
        libc::mmap(
            null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(region, libc::MAP_FAILED);
    SEEN_CALLS.store(0, Ordering::SeqCst);
    WATCH.store(region as usize, Ordering::SeqCst);
    let before = Monitor::stats();
    // SAFETY: unmapping the mapping created above.
    assert_eq!(unsafe { libc::munmap(region, len) }, 0);
    let after = Monitor::stats();
    assert_eq!(
        SEEN_CALLS.load(Ordering::SeqCst),
        1,
        "a real munmap must reach the subscriber"
    );
    assert_eq!(SEEN_ADDR.load(Ordering::SeqCst), region as usize);
    assert_eq!(SEEN_LEN.load(Ordering::SeqCst), len);
    assert!(after.release.events > before.release.events);
    assert!(after.release.libfabric_notifies > before.release.libfabric_notifies);
    log::info!("phase 5: {after}");

    domain.close();
    Monitor::teardown().expect("teardown with Open MPI");
    assert!(!Monitor::is_exported());

    // Unregistered: a real munmap no longer reaches us.
    // SAFETY: as above.
    let region = unsafe {
        libc::mmap(
            null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(region, libc::MAP_FAILED);
    WATCH.store(region as usize, Ordering::SeqCst);
    SEEN_CALLS.store(0, Ordering::SeqCst);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::munmap(region, len) }, 0);
    assert_eq!(
        SEEN_CALLS.load(Ordering::SeqCst),
        0,
        "callback still registered after teardown"
    );
    assert!(release::unsubscribe(id));
    assert_eq!(
        BAD_CTX.load(Ordering::SeqCst),
        0,
        "subscriber got a wrong context"
    );
}
