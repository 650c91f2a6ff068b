//! What a module offers: the atomics (the provider's, from `fi_query_atomic`, or
//! emulated by active messages), and the module table: the template with this
//! provider's limits, the flags of the services offered and their entry points, and
//! whether long puts are done by the target's read.
//!
//! What it owns: nothing once the module is assembled. What it must not touch: the
//! provider's objects (`objects.rs`), beyond querying the domain's atomics.

use super::objects::Opened;
use super::{Config, ATOMICS_AM, ATOMICS_PROVIDER};
use crate::btl::am::wire::HDR;
use crate::btl::module::Role;
use crate::btl::template::{fill_table, param, TEMPLATE};
use crate::btl::{amo, provider_atomics, rdma};
use crate::common::policy::Policy;
use crate::ompi::params::btl as idx;
use libfabric_sys as fi;
use ompi_sys as sys;

/// The atomics the provider supports, as `btl_atomic_flags`, from `fi_query_atomic`.
fn query_atomics(domain: &crate::fabric::Domain) -> u32 {
    let ok = |datatype: fi::fi_datatype, op: fi::fi_op, flags: u64| {
        domain.query_atomic(crate::fabric::AtomicOp { datatype, op }, flags)
    };
    let fetch = fi::FI_FETCH_ATOMIC;
    let mut flags = 0u32;
    let mut all32 = true;
    for (btl, op) in provider_atomics::ATOMIC_OPS {
        if ok(fi::FI_INT64, op, 0) && ok(fi::FI_INT64, op, fetch) {
            flags |= btl;
            all32 &= ok(fi::FI_INT32, op, 0) && ok(fi::FI_INT32, op, fetch);
        }
    }
    let compare = fi::FI_COMPARE_ATOMIC;
    if ok(fi::FI_INT64, fi::FI_CSWAP, compare) {
        flags |= sys::MCA_BTL_ATOMIC_SUPPORTS_CSWAP;
        all32 &= ok(fi::FI_INT32, fi::FI_CSWAP, compare);
    }
    if flags != 0 && all32 {
        flags |= sys::MCA_BTL_ATOMIC_SUPPORTS_32BIT;
    }
    flags
}

/// Which atomics a module offers.
pub(super) struct AtomicsChoice {
    /// Atomics are emulated with active messages (`amo.rs`).
    pub(super) amo: bool,
    /// The `btl_atomic_flags` they support.
    pub(super) flags: u32,
}

/// The provider's atomics as far as `fi_query_atomic` says, or atomics by active
/// messages (`btl_ofi_atomics`).
pub(super) fn choose_atomics(
    cfg: &Config,
    opened: &Opened,
    atomics_mode: i64,
    policy: &Policy,
    provider: &str,
) -> AtomicsChoice {
    let provider_atomics = if opened.atomics {
        query_atomics(opened.domain.domain())
    } else {
        0
    };
    // Atomics by active messages: asked for, or (auto) the provider has none or its
    // own crash (common::quirks). They need both services: the request travels as an
    // active message to the window's registration.
    let atomics_crash = policy.emulate_atomics;
    let amo = cfg.one_sided
        && cfg.two_sided
        && match atomics_mode {
            ATOMICS_AM => true,
            ATOMICS_PROVIDER => false,
            _ => provider_atomics & !sys::MCA_BTL_ATOMIC_SUPPORTS_32BIT == 0 || atomics_crash,
        };
    if amo && atomics_crash && provider_atomics != 0 && atomics_mode != ATOMICS_AM {
        log::info!(
            "provider {provider}: atomics by active messages (its own atomics crash it under osc rdma; \
             btl_ofi_atomics=provider uses them anyway)"
        );
    }
    if atomics_mode == ATOMICS_AM && !amo {
        log::warn!(
            "btl_ofi_atomics=am needs btl_ofi_mode 2 (active messages and RDMA): no atomics offered"
        );
    }
    let flags = if amo {
        amo::FLAGS
    } else if atomics_mode == ATOMICS_AM {
        0
    } else {
        provider_atomics
    };
    AtomicsChoice { amo, flags }
}

/// The module's table and the limits that come with it.
pub(super) struct Table {
    /// Open MPI's struct: the template with what this provider allows.
    pub(super) sup: sys::mca_btl_base_module_t,
    /// Largest write posted as one (`State::write_max`).
    pub(super) write_max: usize,
    /// Atomics are emulated, and offered.
    pub(super) amo: bool,
    /// Local buffers pass their descriptors (`State::mr_local`).
    pub(super) mr_local: bool,
}

/// The module: the template (with the user's values) plus what this provider allows:
/// sizes, flags, and the entry points of the services it offers.
pub(super) fn module_table(
    cfg: &Config,
    role: Role,
    opened: &Opened,
    atomics: &AtomicsChoice,
    policy: &Policy,
    provider: &str,
) -> Table {
    let Config {
        one_sided,
        two_sided,
        ..
    } = *cfg;
    let info = opened.domain.info();
    let inject_size = info.inject_size();
    let max_msg = info.max_msg_size();
    // Registered before init (read_config checks).
    let mut sup = TEMPLATE.copy().unwrap_or_default();
    fill_table(&mut sup);
    sup.btl_component = crate::btl::component::mca_btl_ofi_component.get();
    sup.btl_max_send_size = sup
        .btl_max_send_size
        .clamp(1, max_msg.saturating_sub(HDR).max(1));
    let one_packet = inject_size.saturating_sub(HDR);
    if two_sided
        && policy.one_packet_sends
        && one_packet > 0
        && sup.btl_max_send_size > one_packet
        && !crate::ompi::params::user_set("opal", "btl", "ofi", "max_send_size")
    {
        log::info!(
            "provider {provider}: messages of more than one packet break it under load \
             (common::quirks): fragments of at most {one_packet} B (btl_ofi_max_send_size \
             overrides)"
        );
        sup.btl_max_send_size = one_packet;
    }
    let write_max =
        if one_sided && policy.one_packet_sends && inject_size > rdma::WRITE_HEADROOM * 2 {
            inject_size - rdma::WRITE_HEADROOM
        } else {
            usize::MAX
        };
    sup.btl_eager_limit = sup.btl_eager_limit.clamp(1, sup.btl_max_send_size);
    sup.btl_rndv_eager_limit = sup.btl_rndv_eager_limit.min(sup.btl_eager_limit);
    let amo = offer_services(&mut sup, cfg, atomics);
    sup.btl_get_limit = if sup.btl_get_limit == 0 {
        max_msg
    } else {
        sup.btl_get_limit.min(max_msg)
    };
    sup.btl_put_limit = if sup.btl_put_limit == 0 {
        max_msg
    } else {
        sup.btl_put_limit.min(max_msg)
    };
    // Forcing it exercises, on any provider, the path that providers needing local
    // descriptors (efa with FI_MR_LOCAL, verbs) take: passing a descriptor the
    // provider does not need is allowed.
    let mr_local = info.mr_mode() & fi::FI_MR_LOCAL != 0 || param(idx::FORCE_MR_LOCAL) != 0;
    let threshold = if mr_local { 0 } else { usize::MAX };
    sup.btl_get_local_registration_threshold = threshold;
    sup.btl_put_local_registration_threshold = threshold;
    if role == Role::OnHost {
        // Ahead of the primary module for ob1's sends to on-host peers, and preferred
        // by osc rdma for windows whose peers are all on this host.
        sup.btl_exclusivity = sup.btl_exclusivity.saturating_add(1);
        sup.btl_latency = (sup.btl_latency / 2).max(1);
    }
    Table {
        sup,
        write_max,
        amo,
        mr_local,
    }
}

/// Keep the flags of the services the module offers (`btl_ofi_mode`, the atomics
/// chosen) and the entry points of those only. Returns whether atomics are emulated
/// and offered.
fn offer_services(
    sup: &mut sys::mca_btl_base_module_t,
    cfg: &Config,
    atomics: &AtomicsChoice,
) -> bool {
    let AtomicsChoice {
        amo,
        flags: atomic_flags,
    } = *atomics;
    let mut capable = sys::MCA_BTL_FLAGS_SEND_INPLACE;
    if cfg.two_sided {
        capable |= sys::MCA_BTL_FLAGS_SEND;
    }
    if cfg.one_sided {
        capable |= sys::MCA_BTL_FLAGS_RDMA | sys::MCA_BTL_FLAGS_RDMA_FLUSH;
        if atomic_flags & !sys::MCA_BTL_ATOMIC_SUPPORTS_32BIT != 0 {
            capable |= sys::MCA_BTL_FLAGS_ATOMIC_OPS | sys::MCA_BTL_FLAGS_ATOMIC_FOPS;
        }
    }
    // Open MPI 4.1's flag enumerator loses "atomics" when it round-trips the default
    // ("fetching-atomics" contains it): fetching atomics imply the plain ones.
    if sup.btl_flags & sys::MCA_BTL_FLAGS_ATOMIC_FOPS != 0 {
        sup.btl_flags |= sys::MCA_BTL_FLAGS_ATOMIC_OPS;
    }
    sup.btl_flags &= capable;
    sup.btl_atomic_flags = if sup.btl_flags & sys::MCA_BTL_FLAGS_ATOMIC_OPS != 0 {
        atomic_flags
    } else {
        0
    };
    if sup.btl_flags & sys::MCA_BTL_FLAGS_SEND == 0 {
        sup.btl_alloc = None;
        sup.btl_free = None;
        sup.btl_prepare_src = None;
        sup.btl_send = None;
        sup.btl_sendi = None;
    }
    if sup.btl_flags & sys::MCA_BTL_FLAGS_RDMA == 0 {
        sup.btl_put = None;
        sup.btl_get = None;
        sup.btl_register_mem = None;
        sup.btl_deregister_mem = None;
        sup.btl_flush = None;
        sup.btl_registration_handle_size = 0;
    }
    if sup.btl_flags & sys::MCA_BTL_FLAGS_ATOMIC_OPS == 0 {
        sup.btl_atomic_op = None;
        sup.btl_atomic_fop = None;
        sup.btl_atomic_cswap = None;
    } else if amo {
        sup.btl_atomic_op = Some(amo::btl_atomic_op);
        sup.btl_atomic_fop = Some(amo::btl_atomic_fop);
        sup.btl_atomic_cswap = Some(amo::btl_atomic_cswap);
    }
    amo && sup.btl_atomic_op.is_some()
}

/// Whether puts longer than `write_max` are done by the target's read (they need
/// active messages); says how puts go where writes are split.
pub(super) fn puts_by_read(table: &Table, provider: &str) -> bool {
    let write_max = table.write_max;
    let put_by_read = write_max < usize::MAX && table.sup.btl_flags & sys::MCA_BTL_FLAGS_SEND != 0;
    if write_max < usize::MAX {
        log::info!(
            "provider {provider}: writes of more than one packet break it under load \
             (common::quirks): puts go as writes of at most {write_max} B{}",
            if put_by_read {
                format!(
                    ", or above {} B are read by the target",
                    rdma::PUT_BY_READ_MIN
                )
            } else {
                String::new()
            }
        );
    }
    put_by_read
}
