//! The OFI MTL: tagged messaging under pml cm.
//!
//! `component` is the exported component, `setup` builds and tears down the module,
//! `datapath` is the tagged data path, `tag` the 64-bit tag layouts, `softmatch` the
//! MTL's own matching where the provider's cannot be trusted, `stall` the stall breaker,
//! `stats` the MPI_T counters.
pub mod component;
pub mod datapath;
pub mod setup;
pub mod softmatch;
pub mod stall;
pub mod stats;
pub mod tag;

pub use setup::init_module;

/// Release everything at component close.
pub fn finalize_component() {
    setup::finalize();
}
