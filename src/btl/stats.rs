//! The BTL's counters as MPI_T performance variables (`btl_ofi_rcache_*`,
//! `btl_ofi_rdma_*`).
//!
//! Open MPI reads a performance variable through its `get_value` callback when a tool
//! or test reads it, so the data path only bumps its counters and never publishes
//! anything (the string control variables these replace were reformatted and copied
//! at every registration and deregistration, about 8,000 instructions each).
//! Event counts are class COUNTER: MPI_T reports the events since the handle was
//! allocated. Live entries and bytes are class LEVEL: the current value.
//!
//! Registered with the component (`mca_base_component_pvar_register`), so Open MPI
//! marks them invalid when it closes the component and never calls into an unloaded
//! library.

use super::{module, rcache, rdma};
use crate::ompi::component::ffi_guard;
use ompi_sys as sys;
use std::ffi::CString;
use std::os::raw::{c_int, c_void};

/// One performance variable: its name after `btl_ofi_`, class, description, and the
/// value it reads from the counters.
struct Pvar {
    name: &'static str,
    class: sys::_bindgen_ty_29,
    help: &'static str,
    value: fn(&rcache::Stats, &rdma::OpCounts) -> u64,
}

const COUNTER: sys::_bindgen_ty_29 = sys::MCA_BASE_PVAR_CLASS_COUNTER;
const LEVEL: sys::_bindgen_ty_29 = sys::MCA_BASE_PVAR_CLASS_LEVEL;

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

/// Register every variable with the BTL component; a variable Open MPI refuses is
/// logged and skipped (the BTL works without it).
pub fn register() {
    let component = super::component::component_ptr();
    for (i, p) in PVARS.iter().enumerate() {
        let (Ok(name), Ok(help)) = (CString::new(p.name), CString::new(p.help)) else {
            continue;
        };
        // SAFETY: component is our component's header (a static); name and help are copied by
        // Open MPI; get_value stays valid until Open MPI invalidates the variable at
        // component close (the IWG flag mca_base_component_pvar_register adds); ctx is
        // an index, never dereferenced.
        let rc = unsafe {
            sys::mca_base_component_pvar_register(
                component,
                name.as_ptr(),
                help.as_ptr(),
                sys::OPAL_INFO_LVL_9,
                p.class as c_int,
                sys::MCA_BASE_VAR_TYPE_UNSIGNED_LONG_LONG,
                std::ptr::null_mut(),
                sys::MCA_BASE_VAR_BIND_NO_OBJECT as c_int,
                sys::MCA_BASE_PVAR_FLAG_READONLY | sys::MCA_BASE_PVAR_FLAG_CONTINUOUS,
                Some(get_value),
                None,
                None,
                i as *mut c_void,
            )
        };
        if rc < 0 {
            log::debug!(
                "btl: MPI_T variable btl_ofi_{} not registered (rc {rc})",
                p.name
            );
        }
    }
}

/// `mca_base_get_value_fn_t`: one unsigned long long, read now.
unsafe extern "C" fn get_value(
    pvar: *const sys::mca_base_pvar_t,
    value: *mut c_void,
    _obj: *mut c_void,
) -> c_int {
    ffi_guard("btl pvar read", sys::OPAL_ERROR, || {
        // SAFETY: Open MPI passes the variable it registered, whose ctx is our index.
        let i = unsafe { (*pvar).ctx } as usize;
        let Some(p) = PVARS.get(i) else {
            return sys::OPAL_ERR_BAD_PARAM;
        };
        let rc = module::rcache_stats().unwrap_or_default();
        let v = (p.value)(&rc, &module::op_counts());
        // SAFETY: value points at room for one value of the registered type (count 1).
        unsafe { *(value as *mut u64) = v };
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
