//! The `log` backend inside Open MPI: every record goes through Open MPI's output
//! framework (`opal_output_verbose` with a fixed `"%s"` format) on one stream, filtered
//! by `opal_common_ofi_verbose`.
//!
//! Levels: error and warn always print; info is verbose level 1 (the chosen provider,
//! NIC and memory monitor); debug is level 10; trace is level 50.
//! Never log from the memory-release callback: formatting allocates.

use log::{Level, LevelFilter, Log, Metadata, Record};
use ompi_sys as sys;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

static STREAM: AtomicI32 = AtomicI32::new(-1);
static VERBOSE: AtomicI32 = AtomicI32::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

struct OpalLogger;
static LOGGER: OpalLogger = OpalLogger;

/// The verbose level at which a record prints.
pub fn level_number(l: Level) -> i32 {
    match l {
        Level::Error | Level::Warn => 0,
        Level::Info => 1,
        Level::Debug => 10,
        Level::Trace => 50,
    }
}

fn filter_for(verbose: i32) -> LevelFilter {
    match verbose {
        i32::MIN..=0 => LevelFilter::Warn,
        1..=9 => LevelFilter::Info,
        10..=49 => LevelFilter::Debug,
        _ => LevelFilter::Trace,
    }
}

impl Log for OpalLogger {
    fn enabled(&self, m: &Metadata) -> bool {
        level_number(m.level()) <= VERBOSE.load(Ordering::Relaxed)
    }

    fn log(&self, r: &Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let stream = STREAM.load(Ordering::Relaxed);
        // Open MPI's stream already prefixes "[host:pid]"; name the part that speaks.
        let target = r.target().trim_start_matches("ompi_ofi::");
        let target = target.split("::").next().unwrap_or(target);
        let what = match r.level() {
            Level::Error => "error: ",
            Level::Warn => "warning: ",
            _ => "",
        };
        let msg = format!(" ofi/{target}: {what}{}\n", r.args());
        let Ok(c) = CString::new(msg.replace('\0', " ")) else {
            return;
        };
        // SAFETY: a fixed "%s" format with one valid C string argument.
        unsafe {
            sys::opal_output_verbose(
                level_number(r.level()),
                stream.max(0),
                c"%s".as_ptr(),
                c.as_ptr(),
            )
        };
    }

    fn flush(&self) {}
}

/// Open the output stream (once per load of the library) and install the logger.
/// Called from every component's open; later calls only update the verbosity.
pub fn init(verbose: i32) {
    VERBOSE.store(verbose, Ordering::Relaxed);
    if STREAM.load(Ordering::Relaxed) < 0 {
        // SAFETY: opal_output_open(NULL) opens a default stream to stderr.
        let id = unsafe { sys::opal_output_open(std::ptr::null_mut()) };
        if id >= 0 {
            // SAFETY: id is a stream we just opened.
            unsafe { sys::opal_output_set_verbosity(id, verbose.max(0)) };
        }
        STREAM.store(id, Ordering::Relaxed);
    } else {
        // SAFETY: the stream is open.
        unsafe { sys::opal_output_set_verbosity(STREAM.load(Ordering::Relaxed), verbose.max(0)) };
    }
    if !INSTALLED.swap(true, Ordering::AcqRel) {
        // Fails only if a logger is already installed in this copy of the library
        // (a standalone test installed env_logger): keep that one.
        let _ = log::set_logger(&LOGGER);
    }
    log::set_max_level(filter_for(verbose));
}

/// Close the stream (the library may be unloaded after this).
pub fn fini() {
    let id = STREAM.swap(-1, Ordering::AcqRel);
    if id >= 0 {
        // SAFETY: id is a stream we opened and no longer use.
        unsafe { sys::opal_output_close(id) };
    }
}

/// The current verbose level.
pub fn verbose() -> i32 {
    VERBOSE.load(Ordering::Relaxed)
}
