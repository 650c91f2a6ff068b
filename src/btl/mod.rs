//! The OFI BTL: active messages for ob1, RDMA and atomics for osc rdma, and a
//! registration cache that memory releases invalidate.
//!
//! Where things live:
//! - `component` is the exported component; `template` the module template whose
//!   fields the `btl_ofi_*` parameters write, and the parameters themselves.
//! - `module` holds the module and its state (`Module`, `State`, the peers, the
//!   running modules); `open` builds the modules in phases (provider, endpoint,
//!   atomics, table, memory), `procs` adds and removes peers, `progress` reads the
//!   completion queues and routes each completion, `teardown` closes the modules.
//! - `am` is the active-message path (`am::wire` headers, `am::frag` fragments and
//!   receive buffers, `am::send`, `am::recv`); `op_context` the head of every
//!   libfabric operation context.
//! - `rdma` is put and get, `registration` memory registration and the handles
//!   peers receive, `provider_atomics` the provider's atomics, `amo` atomics
//!   emulated with active messages for providers without them, `put_by_read` puts
//!   done by the target's read where long writes break the provider. Fast boxes, the
//!   node-local rings, are `common::fbox`.
//! - `resolve` re-targets operations whose remote handle does not cover them (an osc
//!   rdma race), `rcache` the registration cache, `stats` its counters and the RDMA
//!   counters as MPI_T performance variables.
//!
//! Unsafe code: each entry point Open MPI calls turns its pointers into types in one
//! block (`ompi::btl`: the module, the peer, an RDMA call's arguments; a fragment's
//! box), and progress turns each completion's context back into its owner; past those
//! the paths post through `fabric`'s typed methods and call Open MPI through
//! `ompi::btl`.
pub mod am;
pub mod amo;
pub mod component;
pub mod module;
mod op_context;
mod open;
mod procs;
mod progress;
mod provider_atomics;
mod put_by_read;
pub mod rcache;
pub mod rdma;
mod registration;
pub mod resolve;
pub mod stats;
mod teardown;
mod template;

use ompi_sys as sys;

/// Build the BTL modules, or say why not.
pub fn init_modules(
    progress_threads: bool,
    mpi_threads: bool,
) -> Result<(*mut *mut sys::mca_btl_base_module_t, i32), String> {
    open::init(progress_threads, mpi_threads)
}

/// Register the generic BTL parameters (exclusivity, eager limits) for our module template.
pub fn register_base_params() {
    template::register_base_params();
}

/// Component progress.
pub fn progress() -> i32 {
    progress::progress()
}

/// Release everything at component close.
pub fn finalize_component() {
    teardown::finalize();
}
