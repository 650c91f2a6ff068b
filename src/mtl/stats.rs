//! The MTL's counters as MPI_T performance variables (`mtl_ofi_*`, `ompi::pvar`).

use crate::ompi::pvar::{self, Table, Var, COUNTER};
use ompi_sys as sys;
use std::sync::atomic::Ordering;

/// The MTL's variables.
pub struct Mtl;

/// What the MTL's variables read.
#[derive(Default)]
pub struct Counts {
    pub fbox_sent: u64,
    pub fbox_received: u64,
}

// SAFETY: component() is the MTL component's header, a static.
unsafe impl Table for Mtl {
    type Counts = Counts;
    const PREFIX: &'static str = "mtl_ofi_";
    const VARS: &'static [Var<Counts>] = &[
        Var {
            name: "fbox_sent",
            class: COUNTER,
            help: "Messages of software matching sent through fast boxes (shared-memory rings to peers on this node, mtl_ofi_fbox_size)",
            value: |c| c.fbox_sent,
        },
        Var {
            name: "fbox_received",
            class: COUNTER,
            help: "Messages of software matching received through this process's fast boxes",
            value: |c| c.fbox_received,
        },
    ];

    fn component() -> *const sys::mca_base_component_t {
        super::component::component_ptr()
    }

    fn counts() -> Counts {
        Counts {
            fbox_sent: super::setup::fbox_sent(),
            fbox_received: super::state::with_mtl(|m| {
                m.and_then(|m| m.soft.as_deref())
                    .map_or(0, |sm| sm.fbox_received.load(Ordering::Relaxed))
            }),
        }
    }
}

/// Register every variable with the MTL component.
pub fn register() {
    pvar::register::<Mtl>();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_reads_its_own_field_and_the_readme_lists_them() {
        let c = Counts {
            fbox_sent: 1,
            fbox_received: 2,
        };
        let got: Vec<u64> = Mtl::VARS.iter().map(|v| (v.value)(&c)).collect();
        assert_eq!(got, [1, 2]);
        pvar::assert_readme_lists::<Mtl>();
    }
}
