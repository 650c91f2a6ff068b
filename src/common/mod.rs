//! Common OFI code shared by the BTL and the MTL: the common MCA parameters, the
//! output stream, provider selection, the shared fabric/domain and the memory monitor.
//!
//! Everything here exists once per process (one shared object holds common, BTL and
//! MTL). The BTL and MTL reach it only through the functions of this module, a narrow
//! interface that could become a C ABI if the components are ever built apart.

use crate::ompi::output;
use crate::ompi::params::{common as idx, Owner, Registered, COMMON};
use ompi_sys as sys;
use std::sync::Mutex;

static PARAMS: Mutex<Option<Registered>> = Mutex::new(None);
static OUTPUT_USERS: Mutex<u32> = Mutex::new(0);

use crate::common::sync::lock;

/// Register the `opal_common_ofi_*` parameters (once per load) and the
/// `<component>_ofi_*` synonyms of the component that calls.
pub fn register_params(component: *const sys::mca_base_component_t) {
    let mut p = lock(&PARAMS);
    let reg = p.get_or_insert_with(|| Registered::register(COMMON, Owner::Common));
    reg.add_synonyms(component);
}

/// Run `f` with the common parameters (registered by whichever component came first).
pub fn with_params<R>(f: impl FnOnce(&Registered) -> R) -> Option<R> {
    lock(&PARAMS).as_ref().map(f)
}

/// Open the output stream at `opal_common_ofi_verbose` (each component's open calls it).
pub fn open_output() {
    // Errors and warnings print at every verbosity: a negative value (refused at init
    // as out of range) must not silence the message that says so.
    let verbose = with_params(|p| p.int(idx::VERBOSE)).unwrap_or(0).max(0) as i32;
    output::init(verbose);
    *lock(&OUTPUT_USERS) += 1;
}

/// Close the output stream when the last component closes.
pub fn close_output() {
    let mut n = lock(&OUTPUT_USERS);
    *n = n.saturating_sub(1);
    if *n == 0 {
        output::fini();
    }
}

/// A random odd number: the start of this process's message ids for pieces (the MTL's
/// software matching, the BTL), so that the ids of two senders never meet at one
/// receiver in practice (process ids can repeat across containers sharing a node).
/// Stepped by 2, an id is never 0.
pub fn random_odd() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: b has 8 writable bytes.
    let n = unsafe {
        libc::getrandom(
            b.as_mut_ptr() as *mut std::os::raw::c_void,
            8,
            libc::GRND_NONBLOCK,
        )
    };
    let r = u64::from_ne_bytes(b);
    let fallback = || {
        // SAFETY: plain calls.
        let pid = unsafe { libc::getpid() } as u64;
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        (pid << 40) ^ t
    };
    let base = if n == 8 { r } else { fallback() };
    // Never 0 (a piece's id must not be), even after the counter wraps: the low bit is
    // set and the counter steps by 2.
    base | 1
}

/// A hash map for the data path's integer keys (peer addresses, process names, request
/// tokens, message ids): one multiply per word instead of SipHash, whose 300-odd
/// instructions per lookup were a tenth of the MTL's own work per message on
/// udp;ofi_rxd (`callgrind`). The keys come from this job's own processes, so a
/// collision-resistant hash buys nothing.
pub type IdMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

/// The hasher of [`IdMap`]: Fibonacci hashing, word by word.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..b.len()].copy_from_slice(b);
            self.write_u64(u64::from_ne_bytes(w));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn finish(&self) -> u64 {
        // hashbrown takes the bucket from the low bits and a tag from the top 7:
        // fold the product's well-mixed high half into both (murmur3's finaliser).
        let x = (self.0 ^ (self.0 >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^ (x >> 33)
    }
}

pub mod endpoint;
pub mod fbox;
pub mod locality;
pub mod monitor;
pub mod patch_check;
pub mod policy;
pub mod quirks;
pub mod release;
pub mod select;
pub mod shared;
pub mod sync;

pub use shared::{open_domain, Decline, DomainHandle, DomainRequest};

static OPAL_HOOKS: crate::ompi::memhooks::OpenMpiHooks = crate::ompi::memhooks::OpenMpiHooks;

/// Before the first `fi_getinfo` (whichever component comes first): choose and
/// install the memory monitor, run the patch self-check, and publish both in the
/// read-only `opal_common_ofi_memory_monitor_status`. Idempotent.
pub(crate) fn monitor_prepare(choice: &str) -> Result<(), Decline> {
    let choice: monitor::MonitorChoice = choice
        .parse()
        .map_err(|e: monitor::ParseChoiceError| Decline(e.to_string()))?;
    let first = monitor::Monitor::outcome().is_none();
    let outcome =
        monitor::Monitor::setup(choice, &OPAL_HOOKS).map_err(|e| Decline(e.to_string()))?;
    if first {
        let report = patch_check::check();
        let owner = match report.owner_of("munmap") {
            Some(o) => o.to_string(),
            None => "not found".into(),
        };
        log::info!("patch self-check: owner of munmap: {owner}");
        log::debug!("patch self-check: {}", report.summary());
        for w in outcome.warnings.iter().chain(
            report
                .problems(outcome.active == monitor::Active::Opal)
                .iter(),
        ) {
            log::warn!("{w}");
        }
        let status = format!(
            "{}; munmap: {owner}; release events to our caches: {}",
            outcome.active,
            if outcome.release_events { "yes" } else { "no" }
        );
        with_params(|p| p.set_status(idx::MEMORY_MONITOR_STATUS, &status));
    }
    Ok(())
}

/// After the last domain closed: remove the export and print the counters.
pub(crate) fn monitor_teardown() {
    let stats = monitor::Monitor::stats();
    if let Err(e) = monitor::Monitor::teardown() {
        log::warn!("memory monitor teardown: {e}");
    }
    log::info!(
        "memory monitor: {} release events ({} bytes), {} forwarded to libfabric, {} to our caches; \
         libfabric cache starts {}, subscribes {}",
        stats.release.events,
        stats.release.bytes,
        stats.release.libfabric_notifies,
        stats.release.subscriber_calls,
        stats.libfabric_starts,
        stats.libfabric_subscribes
    );
}

#[cfg(test)]
mod tests {
    use super::IdHasher;
    use std::hash::{BuildHasher, BuildHasherDefault};

    /// The keys the data path uses: page-aligned addresses, small AV indices, request
    /// pointers 64 bytes apart, process names (job << 32 | rank). Their hashes must
    /// spread over the low bits (the bucket) and the top 7 (hashbrown's tag) about as
    /// a random function's do: 1,024 keys fill about 647 of 1,024 buckets.
    #[test]
    fn id_hasher_spreads_aligned_and_small_keys() {
        let b = BuildHasherDefault::<IdHasher>::default();
        for name in ["pages", "indices", "requests", "names"] {
            let key = |i: u64| match name {
                "pages" => 0x7f00_0000_0000 + (i << 12),
                "indices" => i,
                "requests" => 0x5555_0000_0000 + i * 64,
                _ => (0x1234u64 << 32) | i,
            };
            let mut low = std::collections::HashSet::new();
            let mut top = std::collections::HashSet::new();
            for i in 0..1024 {
                let h = b.hash_one(key(i));
                low.insert(h & 1023);
                top.insert(h >> 57);
            }
            assert!(
                low.len() > 600,
                "{name}: {} of 1024 low-bit buckets",
                low.len()
            );
            assert!(top.len() > 100, "{name}: {} of 128 tags", top.len());
        }
    }
}
