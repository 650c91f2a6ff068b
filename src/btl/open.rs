//! Opening the modules: `init` reads the parameters, opens the module that reaches
//! every peer (and, in a job that spans hosts, one over shm for the peers on this
//! host) and publishes their endpoint names and fast-box segments in the modex.
//! `open_module` chooses the provider, opens its objects, sizes what the provider
//! allows and fills the module's table.
//!
//! What it owns: nothing after init returns (the modules are in `module::MODULES`).
//! What it must not touch: the data paths (`am`, `rdma`, `amo`), which only run on
//! a module once it is published.

mod memory;
mod objects;
mod offer;

use super::am;
use super::module::{lock, modex_encode, Module, Role, State, MODULES};
use super::teardown::destroy;
use super::template::{component, param, param_str, TEMPLATE};
use crate::common::policy::{self, Policy};
use crate::common::sync::{MaybeLock, Serial};
use crate::common::{self, fbox, IdMap};
use crate::ompi::modex;
use crate::ompi::params::btl as idx;
use libfabric_sys as fi;
use memory::{Receives, Registrations};
use objects::{Endpoints, Opened};
use offer::Table;
use ompi_sys as sys;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};

fn progress_of(s: Option<&str>) -> Result<fi::fi_progress, String> {
    match s.unwrap_or("unspec") {
        "unspec" | "" => Ok(fi::FI_PROGRESS_UNSPEC),
        "auto" => Ok(fi::FI_PROGRESS_AUTO),
        "manual" => Ok(fi::FI_PROGRESS_MANUAL),
        other => Err(format!(
            "btl_ofi_progress_mode={other}: expected unspec, auto or manual"
        )),
    }
}

/// Values of btl_ofi_atomics (mca_params/btl.params).
const ATOMICS_PROVIDER: i64 = 2;
const ATOMICS_AM: i64 = 3;

/// Build the module, or say why not.
pub fn init(
    _progress_threads: bool,
    mpi_threads: bool,
) -> Result<(*mut *mut sys::mca_btl_base_module_t, i32), String> {
    let cfg = read_config(mpi_threads)?;
    let modules = open_modules(&cfg)?;
    publish(modules)
}

/// Check the parameters and gather what every module shares.
fn read_config(mpi_threads: bool) -> Result<Config, String> {
    lock(&super::component::PARAMS)
        .as_ref()
        .map_or(Err("the BTL parameters were not registered".into()), |p| {
            p.check()
        })?;
    if TEMPLATE.copy().is_none() {
        return Err("the BTL parameters were not registered".into());
    }
    let mode = param(idx::MODE);
    let (one_sided, two_sided) = match mode {
        0 => (true, false),
        1 => (false, true),
        2 => (true, true),
        m => {
            return Err(format!(
                "btl_ofi_mode={m}: expected 0 (one-sided), 1 (two-sided) or 2 (both)"
            ))
        }
    };
    let num_cq_read = param(idx::NUM_CQ_READ);
    if num_cq_read < 1 {
        return Err(format!(
            "btl_ofi_num_cq_read={num_cq_read}: must be at least 1"
        ));
    }
    let rd_num = param(idx::RD_NUM);
    if two_sided && rd_num < 1 {
        return Err(format!("btl_ofi_rd_num={rd_num}: must be at least 1"));
    }
    let mut contexts = param(idx::NUM_CONTEXTS_PER_MODULE).max(1) as usize;
    if contexts > 1 && param(idx::DISABLE_SEP) != 0 {
        log::warn!(
            "btl_ofi_num_contexts_per_module={contexts} needs a scalable endpoint, which \
             btl_ofi_disable_sep=1 forbids: one context is used"
        );
        contexts = 1;
    }
    let progress = progress_of(param_str(idx::PROGRESS_MODE).as_deref())?;
    // Checked here; sized per module (for its eager limit).
    let fbox = param(idx::FBOX_SIZE).max(0) as u64;
    fbox::Sizes::new("btl_ofi_fbox_size", fbox, 1)
        .inspect_err(|e| log::warn!("{e}: the ofi BTL declines"))?;

    let (local_peers, world) = crate::ompi::btl::job_locality();
    let all_local = world > 0 && local_peers as u64 + 1 >= world as u64;
    Ok(Config {
        contexts,
        local_ranks: local_peers.max(0) as usize + 1,
        one_sided,
        two_sided,
        num_cq_read: num_cq_read as usize,
        rd_num,
        progress,
        mpi_threads,
        all_local,
        world,
        fbox,
    })
}

/// Open the module that reaches every peer and, in a job across hosts, the one over
/// shm for the peers on this host. Returns each with its endpoint name.
/// A module opened, with its endpoint name.
type Named = (Box<Module>, Vec<u8>);

fn open_modules(cfg: &Config) -> Result<Vec<Named>, String> {
    let primary = open_module(cfg, Role::AllPeers)?;
    let mut modules = vec![primary];
    // A job across hosts: on-host peers over shm when the provider lists allow it.
    // The primary module still reaches every peer, so that osc rdma (which needs one
    // BTL reaching all of a window's peers) keeps working; shm wins ob1's sends to
    // on-host peers by exclusivity.
    let primary_provider = modules[0].0.state.provider.clone();
    // Other ranks on this node (`local_ranks` counts this one too).
    let local_peers = cfg.local_ranks > 1;
    if !cfg.all_local
        && cfg.two_sided
        && !common::endpoint::is_shm(&primary_provider)
        && local_peers
    {
        match open_module(cfg, Role::OnHost) {
            Ok(m) => {
                log::info!(
                    "peers on this host over shm, peers on other hosts over {primary_provider}"
                );
                modules.push(m);
            }
            Err(e) => {
                log::info!("peers on this host over {primary_provider} too (no shm module: {e})")
            }
        }
    }
    Ok(modules)
}

/// Publish the modules' endpoint names and fast-box segments in the modex, then the
/// modules themselves (in `MODULES` and the array Open MPI receives); on failure
/// destroy them.
fn publish(modules: Vec<Named>) -> Result<(*mut *mut sys::mca_btl_base_module_t, i32), String> {
    let mut records: Vec<(u8, Vec<u8>)> = Vec::new();
    for (module, name) in &modules {
        let state = &module.state;
        records.push((state.role.record(), name.clone()));
        if let Some(rx) = &state.fbox {
            records.push((state.role.fbox_record(), rx.record()));
        }
    }
    let blob = modex_encode(records.iter().map(|(rec, data)| (*rec, data.as_slice())));
    if let Err(rc) = modex::send(component(), &blob) {
        modules.into_iter().for_each(|(m, _)| destroy(m));
        return Err(format!(
            "publishing the endpoint names through the modex failed ({rc})"
        ));
    }
    let Some(mut arr) = crate::ompi::btl::ModuleArray::new(modules.len()) else {
        modules.into_iter().for_each(|(m, _)| destroy(m));
        return Err("out of memory".into());
    };
    let n = modules.len();
    for (i, (m, _)) in modules.into_iter().enumerate() {
        // Open MPI calls the module through this pointer until it finalizes it, which
        // gives the box back (teardown).
        arr.set(i, MODULES.publish(i, m).cast());
    }
    Ok((arr.into_raw(), n as i32))
}

/// What every module of this process shares.
struct Config {
    /// Contexts asked for (`btl_ofi_num_contexts_per_module`, 1 under `disable_sep`).
    contexts: usize,
    /// Ranks of this job on this node (they share the provider's contexts).
    local_ranks: usize,
    one_sided: bool,
    two_sided: bool,
    num_cq_read: usize,
    rd_num: i64,
    progress: fi::fi_progress,
    mpi_threads: bool,
    all_local: bool,
    world: u32,
    /// `btl_ofi_fbox_size` (checked; 0: fast boxes off).
    fbox: u64,
}

/// Open one module: its domain, endpoint and receive buffers. Returns the module and
/// its endpoint name (for the modex).
///
/// In phases, in this order (each logs what it decided): the provider's domain, the
/// endpoint and its contexts, the atomics, the number of receive buffers, the module
/// table, the registration cache, the receive mode, puts by read, fast boxes; then
/// the module is assembled and its receive buffers posted.
fn open_module(cfg: &Config, role: Role) -> Result<Named, String> {
    let atomics_mode = param(idx::ATOMICS);
    let opened = objects::choose_provider(cfg, role, atomics_mode)?;
    let provider = opened.provider.clone();
    let (endpoints, name) = objects::open_endpoints(cfg, role, &opened.domain, &provider)?;
    let policy = policy::of(&provider);
    let atomics_choice = offer::choose_atomics(cfg, &opened, atomics_mode, &policy, &provider);
    let rd_num = memory::receive_buffer_count(cfg, opened.domain.info(), &policy, &provider);
    let table = offer::module_table(cfg, role, &opened, &atomics_choice, &policy, &provider);
    let registrations = memory::registration_cache(opened.domain.info().caps())?;
    let frag_payload = table.sup.btl_max_send_size;
    let multi_recv =
        memory::receive_mode(&opened, &endpoints.ctxs, frag_payload, &policy, &provider);
    let put_by_read = offer::puts_by_read(&table, &provider);
    let fbox = memory::fast_boxes(cfg, role, &table.sup, &provider);
    let (asked_atomics, mr_mode, nctx) = (
        opened.atomics,
        opened.domain.info().mr_mode(),
        endpoints.nctx,
    );
    let module = assemble_module(
        cfg,
        role,
        opened,
        endpoints,
        table,
        registrations,
        Receives {
            multi_recv,
            put_by_read,
            fbox,
        },
        &policy,
        &provider,
    );
    if cfg.two_sided {
        if let Err(err) = am::recv::post_receives(&module.state, rd_num as usize) {
            destroy(module);
            return Err(format!("posting receive buffers on {provider}: {err}"));
        }
    }
    log_opened(&module, cfg, asked_atomics, mr_mode, rd_num, nctx);
    Ok((module, name))
}

/// The module, from what the phases produced.
#[allow(clippy::too_many_arguments)]
fn assemble_module(
    cfg: &Config,
    role: Role,
    opened: Opened,
    endpoints: Endpoints,
    table: Table,
    registrations: Registrations,
    receives: Receives,
    policy: &Policy,
    provider: &str,
) -> Box<Module> {
    let Opened {
        domain, delivery, ..
    } = opened;
    let Endpoints {
        ep,
        ctxs,
        av,
        nctx,
        rx_ctx_bits,
    } = endpoints;
    let Table {
        sup,
        write_max,
        amo,
        mr_local,
    } = table;
    let Registrations {
        access,
        cache,
        subscription: rcache_sub,
    } = registrations;
    let Receives {
        multi_recv,
        put_by_read,
        fbox,
    } = receives;
    // SAFETY: cfg.mpi_threads is Open MPI's enable_mpi_threads of the component's init:
    // false only when one thread at a time calls into MPI.
    let threads = unsafe { crate::common::sync::Threads::of(cfg.mpi_threads) };
    let mpi_threads = threads.multiple();
    let mr_mode = domain.info().mr_mode();
    let inject_size = domain.info().inject_size();
    let frag_payload = sup.btl_max_send_size;
    let module = Box::new(Module {
        sup,
        state: State {
            ep,
            ctxs: ctxs.into_boxed_slice(),
            rx_ctx_bits,
            per_ctx: (0..if nctx > 1 { nctx } else { 0 })
                .map(|_| AtomicU64::new(0))
                .collect(),
            av,
            fi_lock: MaybeLock::for_domain(threads, domain.domain()),
            provider: provider.to_string(),
            role,
            two_sided: sup.btl_flags & sys::MCA_BTL_FLAGS_SEND != 0,
            one_sided: sup.btl_flags & sys::MCA_BTL_FLAGS_RDMA != 0,
            mr_local,
            amo,
            delivery,
            mr_endpoint: mr_mode & fi::FI_MR_ENDPOINT != 0,
            virt_addr: mr_mode & fi::FI_MR_VIRT_ADDR != 0,
            prov_key: mr_mode & fi::FI_MR_PROV_KEY != 0,
            mr_access: access,
            inject_size,
            write_max,
            put_by_read,
            piece_max: if policy.slow_sends_in_pieces {
                inject_size.min(am::wire::INLINE_MAX)
            } else {
                0
            },
            next_piece_id: AtomicU64::new(crate::common::random_odd()),
            assembly: crate::common::sync::MaybeMutex::new(
                crate::common::IdMap::default(),
                threads,
            ),
            assembled: AtomicU64::new(0),
            frag_payload,
            multi_recv,
            num_cq_read: cfg.num_cq_read,
            progress_threshold: param(idx::PROGRESS_THRESHOLD).max(0) as usize,
            frags: Mutex::new(Vec::new()),
            pending: Mutex::new(VecDeque::new()),
            has_pending: AtomicBool::new(false),
            send_window: policy.send_window,
            draining: Mutex::new(()),
            recv_bufs: Mutex::new(Vec::new()),
            peers: Mutex::new(Vec::new()),
            rdma_outstanding: AtomicUsize::new(0),
            rdma_deferred: Mutex::new(VecDeque::new()),
            has_rdma_deferred: AtomicBool::new(false),
            unposted: Default::default(),
            send_outstanding: AtomicUsize::new(0),
            fbox,
            fbox_queue: Mutex::new(VecDeque::new()),
            fbox_queued: AtomicBool::new(false),
            fbox_received: AtomicU64::new(0),
            rcache_slots: Arc::clone(cache.slots()),
            rcache: Mutex::new(cache),
            outside: Mutex::new(IdMap::default()),
            rcache_sub,
            error_cb: Mutex::new(None),
            in_progress: Serial::new(mpi_threads),
            closing: AtomicBool::new(false),
            cq_errors: AtomicU64::new(0),
            bad_fragments: AtomicU64::new(0),
            ops: Default::default(),
            rdma_deferrals: AtomicU64::new(0),
            next_key: AtomicU64::new(1),
            domain: Some(domain),
        },
    });
    module
}

/// Say how the module opened: services, limits, receive buffers, atomics, contexts.
/// `atomics`: the provider's atomics were asked for; `rd_num`: receive buffers per
/// context; `nctx`: contexts.
fn log_opened(
    module: &Module,
    cfg: &Config,
    atomics: bool,
    mr_mode: u32,
    rd_num: i64,
    nctx: usize,
) {
    let Config {
        two_sided,
        one_sided,
        all_local,
        ..
    } = *cfg;
    let state = &module.state;
    let provider = &state.provider;
    let (role, delivery, mr_local, amo) = (state.role, state.delivery, state.mr_local, state.amo);
    let (inject_size, multi_recv) = (state.inject_size, state.multi_recv);
    let m = &module.sup;
    log::info!(
        "provider {provider}{}: {}{}{}, mr_mode {:#x}{}, inject {inject_size} B, eager {} B, max send {} B, atomics {:#x}{}{}",
        if role == Role::OnHost {
            " (peers on this host)"
        } else {
            ""
        },
        match (two_sided, one_sided) {
            (true, true) => "active messages and RDMA",
            (true, false) => "active messages only",
            _ => "RDMA only",
        },
        if two_sided {
            let (n, bytes) = am::recv::receive_layout(rd_num as usize, am::wire::HDR + m.btl_max_send_size, multi_recv);
            format!(
                " ({n} {}receive buffers of {bytes} B)",
                if multi_recv { "multi-" } else { "" }
            )
        } else {
            String::new()
        },
        if delivery { " (delivery-complete)" } else { "" },
        mr_mode,
        if mr_local {
            " (local descriptors: FI_MR_LOCAL)"
        } else {
            ""
        },
        m.btl_eager_limit,
        m.btl_max_send_size,
        m.btl_atomic_flags,
        if amo {
            " (emulated with active messages)"
        } else if atomics {
            ""
        } else {
            " (provider has no atomics)"
        },
        if all_local { ", local communication only" } else { "" },
    );
    if nctx > 1 {
        log::info!(
            "provider {provider}: scalable endpoint with {nctx} contexts (each thread keeps one, \
             round robin), {rd_num} receive buffers on each"
        );
    }
}
