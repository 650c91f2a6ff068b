//! The OFI MTL: tagged messaging under pml cm.
//!
//! `component` is the exported component, `open` opens the module in phases, `setup`
//! holds its table, its objects and its procs and tears it down,
//! `ffi` holds the module's entry points. The tagged data path is `state` (what it
//! reads), `request`, `peer`, `send`, `recv`, `probe`, `progress`, `completion` and `ack` (synchronous sends' acknowledgements);
//! `tag` holds the 64-bit tag layouts, `softmatch` the MTL's own matching where the
//! provider's cannot be trusted, `stall` the stall breaker, `stats` the MPI_T counters.
pub mod ack;
pub mod completion;
pub mod component;
pub mod ffi;
mod open;
pub mod peer;
pub mod probe;
pub mod progress;
pub mod recv;
pub mod request;
pub mod send;
pub mod setup;
pub mod softmatch;
pub mod stall;
pub mod state;
pub mod stats;
pub mod tag;

pub use open::init_module;

/// Release everything at component close.
pub fn finalize_component() {
    setup::finalize();
}
