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

use crate::ompi::error::OpalCode;
use std::fmt;
use std::ptr::null_mut;
use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use libfabric_sys as fi;
use libfabric_sys::macros::fi_version;
use ompi_sys as ompi;

use super::patch_check;
use super::release::{self, ReleaseStats};
use crate::fabric::{self, check, Error};

mod export;
mod hooks;
mod system;
#[cfg(test)]
mod tests;

use export::*;
pub use hooks::{OpalHooks, OpalReleaseFn};
pub use system::*;

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
        fabric::version_string(self.libfabric_version)
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
        libfabric_version: fabric::runtime_version(),
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
