//! The BTL's counters as MPI_T performance variables (`btl_ofi_rcache_*`,
//! `btl_ofi_rdma_*`, `btl_ofi_fbox_*`).
//!
//! Open MPI reads a performance variable through its `get_value` callback when a tool
//! or test reads it (`ompi::pvar`), so the data path only bumps its counters and never
//! publishes anything (the string control variables these replace were reformatted
//! and copied at every registration and deregistration, about 8,000 instructions each).
//! Event counts are class COUNTER: MPI_T reports the events since the handle was
//! allocated. Live entries and bytes are class LEVEL: the current value.

use super::{module, rcache, rdma};
use crate::ompi::pvar::{self, Table, Var, COUNTER, LEVEL};
use ompi_sys as sys;

/// The BTL's variables (`ompi::pvar`).
pub struct Btl;

// SAFETY: component() is the BTL component's header, a static.
unsafe impl Table for Btl {
    type Counts = (rcache::Stats, rdma::OpCounts);
    const PREFIX: &'static str = "btl_ofi_";
    const VARS: &'static [Var<Self::Counts>] = PVARS;

    fn component() -> *const sys::mca_base_component_t {
        super::component::component_ptr()
    }

    fn counts() -> Self::Counts {
        (
            module::rcache_stats().unwrap_or_default(),
            module::op_counts(),
        )
    }
}

/// The MPI_T table of docs/parameters.md lists these; keep the two in step.
const PVARS: &[Var<(rcache::Stats, rdma::OpCounts)>] = &[
    Var {
        name: "rcache_hits",
        class: COUNTER,
        help: "Registrations served from the BTL's registration cache",
        value: |(s, _)| s.hits,
    },
    Var {
        name: "rcache_misses",
        class: COUNTER,
        help: "Registrations the registration cache had to make (and then kept)",
        value: |(s, _)| s.misses,
    },
    Var {
        name: "rcache_invalidations",
        class: COUNTER,
        help: "Cached registrations invalidated because their memory was released",
        value: |(s, _)| s.invalidations,
    },
    Var {
        name: "rcache_evictions",
        class: COUNTER,
        help: "Cached registrations evicted to stay within btl_ofi_rcache_max_entries and btl_ofi_rcache_max_bytes",
        value: |(s, _)| s.evictions,
    },
    Var {
        name: "rcache_uncached",
        class: COUNTER,
        help: "Registrations made outside the cache (caching off, cache full of registrations in use, or no memory release events)",
        value: |(s, _)| s.uncached,
    },
    Var {
        name: "rcache_live_entries",
        class: LEVEL,
        help: "Registrations the cache holds now",
        value: |(s, _)| s.live_entries,
    },
    Var {
        name: "rcache_live_bytes",
        class: LEVEL,
        help: "Bytes the cache's registrations cover now",
        value: |(s, _)| s.live_bytes,
    },
    Var {
        name: "rdma_puts",
        class: COUNTER,
        help: "Puts posted through the BTL (btl_put), by the provider or emulated",
        value: |(_, o)| o.puts,
    },
    Var {
        name: "rdma_gets",
        class: COUNTER,
        help: "Gets posted through the BTL (btl_get), by the provider or emulated",
        value: |(_, o)| o.gets,
    },
    Var {
        name: "rdma_atomics",
        class: COUNTER,
        help: "Non-fetching atomics posted through the BTL (btl_atomic_op)",
        value: |(_, o)| o.atomics,
    },
    Var {
        name: "rdma_fetching_atomics",
        class: COUNTER,
        help: "Fetching atomics posted through the BTL (btl_atomic_fop)",
        value: |(_, o)| o.fetching_atomics,
    },
    Var {
        name: "rdma_deferred",
        class: COUNTER,
        help: "Gets and puts the provider refused with -FI_EAGAIN, queued and posted again by progress (ob1 would otherwise send the message by copy)",
        value: |(_, o)| o.deferred,
    },
    Var {
        name: "rdma_cswaps",
        class: COUNTER,
        help: "Compare-and-swaps posted through the BTL (btl_atomic_cswap)",
        value: |(_, o)| o.cswaps,
    },
    Var {
        name: "fbox_sent",
        class: COUNTER,
        help: "Active-message fragments sent through fast boxes (shared-memory rings to peers on this node, btl_ofi_fbox_size)",
        value: |(_, o)| o.fbox_sent,
    },
    Var {
        name: "fbox_received",
        class: COUNTER,
        help: "Active-message fragments received through this process's fast boxes",
        value: |(_, o)| o.fbox_received,
    },
];

/// Register every variable with the BTL component.
pub fn register() {
    pvar::register::<Btl>();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_reads_its_own_field_and_the_docs_list_them() {
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
        let counts = (rc, ops);
        let got: Vec<u64> = PVARS.iter().map(|p| (p.value)(&counts)).collect();
        assert_eq!(got, (1..=15).collect::<Vec<u64>>());
        pvar::assert_documented::<Btl>();
    }
}
