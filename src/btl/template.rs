//! The module template and the component's parameters: the struct whose generic
//! fields `mca_btl_base_param_register` binds to the `btl_ofi_*` variables, the
//! table of entry points every module starts from, and reading the BTL's own
//! parameters.
//!
//! What it owns: the template (never freed, see [`TEMPLATE`]). What it must not
//! touch: a running module (`open.rs` copies the template into each one).

use super::module::lock;
use super::{am, procs, progress, provider_atomics, rdma, registration, teardown};
use crate::ompi::btl::Template;
use ompi_sys as sys;

/// The template whose generic fields `mca_btl_base_param_register` binds to the
/// `btl_ofi_*` variables (on the C heap and never freed, see `ompi::btl::Template`).
pub(super) static TEMPLATE: Template = Template::new();

const DEFAULT_EAGER: usize = 8 * 1024;
const DEFAULT_MAX_SEND: usize = 64 * 1024;

pub(super) fn fill_table(m: &mut sys::mca_btl_base_module_t) {
    m.btl_add_procs = Some(procs::add_procs);
    m.btl_del_procs = Some(procs::del_procs);
    m.btl_register = None;
    m.btl_finalize = Some(teardown::finalize_cb);
    m.btl_alloc = Some(am::btl_alloc);
    m.btl_free = Some(am::btl_free);
    m.btl_prepare_src = Some(am::btl_prepare_src);
    m.btl_send = Some(am::btl_send);
    m.btl_sendi = Some(am::btl_sendi);
    m.btl_put = Some(rdma::btl_put);
    m.btl_get = Some(rdma::btl_get);
    m.btl_dump = None;
    m.btl_atomic_op = Some(provider_atomics::btl_atomic_op);
    m.btl_atomic_fop = Some(provider_atomics::btl_atomic_fop);
    m.btl_atomic_cswap = Some(provider_atomics::btl_atomic_cswap);
    m.btl_register_mem = Some(registration::btl_register_mem);
    m.btl_deregister_mem = Some(registration::btl_deregister_mem);
    m.btl_register_error = Some(procs::register_error);
    m.btl_flush = Some(progress::flush);
}

/// Register the generic BTL parameters (`btl_ofi_exclusivity`, `eager_limit`, ...) on
/// the template (its allocation is the deliberate leak that scripts/valgrind-ours
/// knows by `ompi::btl::Template::register`).
pub fn register_base_params() {
    TEMPLATE.register(super::component::component_ptr(), |m| {
        m.btl_component = super::component::mca_btl_ofi_component.get();
        m.btl_exclusivity = sys::MCA_BTL_EXCLUSIVITY_DEFAULT;
        m.btl_eager_limit = DEFAULT_EAGER;
        m.btl_rndv_eager_limit = DEFAULT_EAGER;
        m.btl_max_send_size = DEFAULT_MAX_SEND;
        m.btl_rdma_pipeline_send_length = DEFAULT_MAX_SEND;
        m.btl_rdma_pipeline_frag_size = 4 * 1024 * 1024;
        m.btl_min_rdma_pipeline_size = 0;
        m.btl_latency = 10;
        m.btl_bandwidth = 10000;
        m.btl_flags = sys::MCA_BTL_FLAGS_SEND
            | sys::MCA_BTL_FLAGS_RDMA
            | sys::MCA_BTL_FLAGS_RDMA_FLUSH
            | sys::MCA_BTL_FLAGS_ATOMIC_OPS
            | sys::MCA_BTL_FLAGS_ATOMIC_FOPS;
        m.btl_registration_handle_size = std::mem::size_of::<registration::Handle>();
        fill_table(m);
    });
}

pub(super) fn component() -> &'static sys::mca_base_component_t {
    super::component::component()
}

pub(super) fn param(i: usize) -> i64 {
    lock(&super::component::PARAMS)
        .as_ref()
        .map(|p| p.int(i))
        .unwrap_or(0)
}

pub(super) fn param_str(i: usize) -> Option<String> {
    lock(&super::component::PARAMS)
        .as_ref()
        .and_then(|p| p.string(i))
}
