//! The BTL's counters as MPI_T performance variables (`btl_ofi_rcache_*`,
//! `btl_ofi_rdma_*`).
//!
//! Open MPI reads a performance variable through its `get_value` callback when a tool
//! or test reads it (`ompi::pvar`), so the data path only bumps its counters and never
//! publishes anything (the string control variables these replace were reformatted
//! and copied at every registration and deregistration, about 8,000 instructions each).
//! Event counts are class COUNTER: MPI_T reports the events since the handle was
//! allocated. Live entries and bytes are class LEVEL: the current value.

use super::{module, rcache, rdma};
use crate::ompi::component::ffi_guard;
use crate::ompi::pvar::{self, Class, COUNTER, LEVEL};
use ompi_sys as sys;
use std::os::raw::{c_int, c_void};

/// One performance variable: its name after `btl_ofi_`, class, description, and the
/// value it reads from the counters.
struct Pvar {
    name: &'static str,
    class: Class,
    help: &'static str,
    value: fn(&rcache::Stats, &rdma::OpCounts) -> u64,
}

/// The README's MPI_T table lists these; keep the two in step.
const PVARS: &[Pvar] = &[
    Pvar {
        name: "rcache_hits",
        class: COUNTER,
        help: "Registrations served from the BTL's registration cache",
        value: |s, _| s.hits,
    },
    Pvar {
        name: "rcache_misses",
        class: COUNTER,
        help: "Registrations the registration cache had to make (and then kept)",
        value: |s, _| s.misses,
    },
    Pvar {
        name: "rcache_invalidations",
        class: COUNTER,
        help: "Cached registrations invalidated because their memory was released",
        value: |s, _| s.invalidations,
    },
    Pvar {
        name: "rcache_evictions",
        class: COUNTER,
        help: "Cached registrations evicted to stay within btl_ofi_rcache_max_entries and btl_ofi_rcache_max_bytes",
        value: |s, _| s.evictions,
    },
    Pvar {
        name: "rcache_uncached",
        class: COUNTER,
        help: "Registrations made outside the cache (caching off, cache full of registrations in use, or no memory release events)",
        value: |s, _| s.uncached,
    },
    Pvar {
        name: "rcache_live_entries",
        class: LEVEL,
        help: "Registrations the cache holds now",
        value: |s, _| s.live_entries,
    },
    Pvar {
        name: "rcache_live_bytes",
        class: LEVEL,
        help: "Bytes the cache's registrations cover now",
        value: |s, _| s.live_bytes,
    },
    Pvar {
        name: "rdma_puts",
        class: COUNTER,
        help: "Puts posted through the BTL (btl_put), by the provider or emulated",
        value: |_, o| o.puts,
    },
    Pvar {
        name: "rdma_gets",
        class: COUNTER,
        help: "Gets posted through the BTL (btl_get), by the provider or emulated",
        value: |_, o| o.gets,
    },
    Pvar {
        name: "rdma_atomics",
        class: COUNTER,
        help: "Non-fetching atomics posted through the BTL (btl_atomic_op)",
        value: |_, o| o.atomics,
    },
    Pvar {
        name: "rdma_fetching_atomics",
        class: COUNTER,
        help: "Fetching atomics posted through the BTL (btl_atomic_fop)",
        value: |_, o| o.fetching_atomics,
    },
    Pvar {
        name: "rdma_deferred",
        class: COUNTER,
        help: "Gets and puts the provider refused with -FI_EAGAIN, queued and posted again by progress (ob1 would otherwise send the message by copy)",
        value: |_, o| o.deferred,
    },
    Pvar {
        name: "rdma_cswaps",
        class: COUNTER,
        help: "Compare-and-swaps posted through the BTL (btl_atomic_cswap)",
        value: |_, o| o.cswaps,
    },
    Pvar {
        name: "fbox_sent",
        class: COUNTER,
        help: "Active-message fragments sent through fast boxes (shared-memory rings to peers on this node, btl_ofi_fbox_size)",
        value: |_, o| o.fbox_sent,
    },
    Pvar {
        name: "fbox_received",
        class: COUNTER,
        help: "Active-message fragments received through this process's fast boxes",
        value: |_, o| o.fbox_received,
    },
];

/// The names MPI_T knows the variables by, in registration order.
pub fn names() -> impl Iterator<Item = String> {
    PVARS.iter().map(|p| format!("btl_ofi_{}", p.name))
}

/// Register every variable with the BTL component.
pub fn register() {
    // SAFETY: the BTL component's header, a static.
    unsafe {
        pvar::register(
            super::component::component_ptr(),
            "btl_ofi_",
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
    ffi_guard("btl pvar read", sys::OPAL_ERROR, || {
        // SAFETY: Open MPI passes the variable it registered.
        let i = unsafe { pvar::index(pvar) };
        let Some(p) = PVARS.get(i) else {
            return sys::OPAL_ERR_BAD_PARAM;
        };
        let rc = module::rcache_stats().unwrap_or_default();
        let v = (p.value)(&rc, &module::op_counts());
        // SAFETY: Open MPI's buffer for the value.
        unsafe { pvar::write(value, v) };
        sys::OPAL_SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_reads_its_own_field() {
        let rc = rcache::Stats {
            hits: 1,
            misses: 2,
            invalidations: 3,
            evictions: 4,
            uncached: 5,
            live_entries: 6,
            live_bytes: 7,
        };
        let ops = rdma::OpCounts {
            puts: 8,
            gets: 9,
            atomics: 10,
            fetching_atomics: 11,
            cswaps: 13,
            deferred: 12,
            fbox_sent: 14,
            fbox_received: 15,
        };
        let got: Vec<u64> = PVARS.iter().map(|p| (p.value)(&rc, &ops)).collect();
        assert_eq!(got, (1..=15).collect::<Vec<u64>>());
        let names: Vec<String> = names().collect();
        let readme = include_str!("../../README.md");
        for n in &names {
            assert!(
                readme.contains(&format!("`{n}`")),
                "README's MPI_T table lacks {n}"
            );
        }
        let mut dedup = names.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), names.len());
    }
}
