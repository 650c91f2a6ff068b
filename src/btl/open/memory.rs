//! The memory a module posts or registers: how many receive buffers (and whether
//! multi-receive ones), the access rights and registration cache, and this process's
//! fast-box segment.
//!
//! What it owns: nothing once the module is assembled. What it must not touch: the
//! module table (`offer.rs`), which it only reads.

use super::objects::Opened;
use super::Config;
use crate::btl::am;
use crate::btl::module::{lock, Context, Role};
use crate::btl::rcache::{self, Cache};
use crate::btl::template::param;
use crate::common::policy::Policy;
use crate::common::{self, fbox, release};
use crate::fabric::{InfoRef, MemoryRegion};
use crate::ompi::params::btl as idx;
use libfabric_sys as fi;
use ompi_sys as sys;

/// `btl_ofi_rd_num`, within what the provider's receive queue holds, and at least
/// what a provider that unexpected messages break needs.
pub(super) fn receive_buffer_count(
    cfg: &Config,
    info: InfoRef<'_>,
    policy: &Policy,
    provider: &str,
) -> i64 {
    let rd_num = cfg.rd_num;
    // More receive buffers than the provider's receive queue holds can never all be
    // posted, and nothing frees a slot during init (no peer sends yet): posting would
    // spin forever in MPI_Init (seen with FI_OFI_RXM_RX_SIZE=4). Use the queue depth.
    let rx_depth = info.rx_size();
    let rd_num = if rx_depth > 0 && rd_num as usize > rx_depth {
        log::warn!(
            "btl_ofi_rd_num={rd_num} exceeds the receive queue of {} ({rx_depth} entries): \
             using {rx_depth}",
            info.provider_name()
        );
        rx_depth as i64
    } else {
        rd_num
    };
    // Where unexpected messages break the provider, post enough buffers that the
    // fragments ob1 keeps in flight find one (common::policy::Policy::min_recv_buffers).
    let floor = policy.min_recv_buffers as i64;
    if cfg.two_sided && floor > 0 && rd_num < floor && (rx_depth == 0 || rx_depth as i64 >= floor) {
        log::info!(
            "provider {provider}: unexpected messages break it (common::quirks): \
             {floor} receive buffers instead of btl_ofi_rd_num={rd_num}"
        );
        floor
    } else {
        rd_num
    }
}

/// Memory registration: the access rights a module's regions get, and its
/// registration cache, subscribed to memory releases when it is on.
pub(super) struct Registrations {
    pub(super) access: u64,
    pub(super) cache: Cache<MemoryRegion>,
    pub(super) subscription: Option<release::Subscription<rcache::Slots>>,
}

/// The access rights for the provider's capabilities `caps`, and the registration
/// cache (`btl_ofi_rcache_*`), off when memory release events do not reach us.
pub(super) fn registration_cache(caps: u64) -> Result<Registrations, String> {
    let mut access = 0u64;
    if caps & fi::FI_MSG as u64 != 0 {
        access |= (fi::FI_SEND | fi::FI_RECV) as u64;
    }
    if caps & (fi::FI_RMA | fi::FI_ATOMIC) as u64 != 0 {
        access |= (fi::FI_READ | fi::FI_WRITE | fi::FI_REMOTE_READ | fi::FI_REMOTE_WRITE) as u64;
    }
    let release_events = common::monitor::Monitor::outcome()
        .and_then(|o| o.ok())
        .is_some_and(|o| o.release_events);
    let max_entries = param(idx::RCACHE_MAX_ENTRIES).max(0) as usize;
    let max_bytes = lock(&crate::btl::component::PARAMS)
        .as_ref()
        .map(|p| p.size(idx::RCACHE_MAX_BYTES))
        .unwrap_or(0);
    if !release_events && max_entries > 0 {
        log::info!(
            "memory release events do not reach this library: the registration cache is disabled"
        );
    }
    let cache = Cache::new(max_entries, max_bytes, release_events);
    let subscription = if cache.enabled() {
        match release::subscribe_shared(cache.slots()) {
            Ok(sub) => Some(sub),
            Err(e) => {
                return Err(format!(
                    "cannot subscribe the registration cache to memory releases: {e}"
                ))
            }
        }
    } else {
        None
    };
    Ok(Registrations {
        access,
        cache,
        subscription,
    })
}

/// Whether the receive buffers are multi-receive buffers: asked for in the hints, safe
/// on this provider, and given a minimum of one largest fragment on every context.
pub(super) fn receive_mode(
    opened: &Opened,
    ctxs: &[Context],
    frag_payload: usize,
    policy: &Policy,
    provider: &str,
) -> bool {
    let multi = opened.multi;
    // Multi-receive buffers need the provider to release one before less than a
    // largest fragment is left in it, and to keep track of large fragments in them
    // (and of unexpected messages matched to them: not so on flood_unsafe providers).
    let multi_unsafe = !policy.multi_recv;
    if multi && multi_unsafe {
        log::info!(
            "provider {provider}: multi-receive buffers lose messages here \
             (common::quirks); one receive buffer per fragment"
        );
    }
    multi
        && !multi_unsafe
        && ctxs.iter().all(|c| {
            let min: usize = am::wire::HDR + frag_payload;
            let r = c.rx.set_min_multi_recv(min);
            if let Err(err) = &r {
                log::info!(
                    "provider {provider}: no minimum for multi-receive buffers ({err}); one \
                     receive buffer per fragment"
                );
            }
            r.is_ok()
        })
}

/// This process's fast-box segment, for the module whose peers are all on this host.
pub(super) fn fast_boxes(
    cfg: &Config,
    role: Role,
    sup: &sys::mca_btl_base_module_t,
    provider: &str,
) -> Option<fbox::Rx> {
    let Config {
        local_ranks, fbox, ..
    } = *cfg;
    // Fast boxes for the module whose peers are all on this host.
    // Every fragment that carries ob1's matching order (match, rendezvous and get
    // headers, at most the eager limit) fits a box, so that a peer's such fragments
    // take one path, in order (see common::fbox).
    // Also under MPI_THREAD_MULTIPLE. They were kept off there for a while, after
    // mpi_tests/fbox's threads part saw a thread's messages overtake each other; that
    // was the test's MPI_T_init_thread(MPI_THREAD_SINGLE), which drops Open MPI 4.1.4's
    // own thread level, so that ob1's MPI_Recv shared one request among threads
    // (btl/vader the same; docs/testing.md, "Open MPI 4.1.4's own layers").
    let on_shm = (common::endpoint::is_shm(provider) || role == Role::OnHost) && local_ranks > 1;
    if fbox > 0 && sup.btl_flags & sys::MCA_BTL_FLAGS_SEND != 0 && on_shm {
        fbox::Sizes::new(
            "btl_ofi_fbox_size",
            fbox,
            sup.btl_eager_limit.max(sup.btl_rndv_eager_limit),
        )
        .and_then(|sizes| {
            let sizes = sizes.ok_or("off")?;
            fbox::Rx::create(local_ranks, sizes, sys::MCA_BTL_TAG_MAX).map_err(|e| e.to_string())
        })
        .inspect_err(|e| log::info!("no fast boxes on {provider}: {e}"))
        .ok()
    } else {
        None
    }
}

/// How a module receives, and what it serves beyond ob1's fragments.
pub(super) struct Receives {
    pub(super) multi_recv: bool,
    pub(super) put_by_read: bool,
    pub(super) fbox: Option<fbox::Rx>,
}
