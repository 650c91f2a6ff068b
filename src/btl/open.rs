//! Opening the modules: `init` reads the parameters, opens the module that reaches
//! every peer (and, in a job that spans hosts, one over shm for the peers on this
//! host) and publishes their endpoint names and fast-box segments in the modex.
//! `open_module` chooses the provider, opens its objects, sizes what the provider
//! allows and fills the module's table.
//!
//! What it owns: nothing after init returns (the modules are in `module::MODULES`).
//! What it must not touch: the data paths (`am`, `rdma`, `amo`), which only run on
//! a module once it is published.

use super::am::{self, HDR};
use super::amo;
use super::module::{lock, modex_encode, Context, Module, Role, State, MAX_MODULES, MODULES};
use super::rcache::{self, Cache};
use super::rdma;
use super::teardown::destroy;
use super::template::{component, fill_table, param, param_str, TEMPLATE};
use crate::common::sync::{MaybeLock, Serial};
use crate::common::{self, fbox, release, DomainRequest, IdMap};
use crate::fabric::{AddressVector, AvAttr, CompletionQueue, CqAttr, Hints};
use crate::ompi::modex;
use crate::ompi::params::btl as idx;
use libfabric_sys as fi;
use ompi_sys as sys;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

unsafe extern "C" {
    fn ompi_ofi_btl_glue_job_size() -> u32;
}

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

const MR_MODES: u32 = fi::FI_MR_VIRT_ADDR
    | fi::FI_MR_ALLOCATED
    | fi::FI_MR_PROV_KEY
    | fi::FI_MR_LOCAL
    | fi::FI_MR_ENDPOINT;

/// The atomics the provider supports, as `btl_atomic_flags`, from `fi_query_atomic`.
fn query_atomics(domain: *mut fi::fid_domain) -> u32 {
    let ok = |dt: fi::fi_datatype, op: fi::fi_op, flags: u64| {
        let mut attr = fi::fi_atomic_attr::default();
        // SAFETY: the domain is open; attr is a valid out parameter.
        unsafe { fi::fi_query_atomic(domain, dt, op, &mut attr, flags) == 0 }
    };
    let fetch = fi::FI_FETCH_ATOMIC;
    let mut flags = 0u32;
    let mut all32 = true;
    for (btl, op) in rdma::ATOMIC_OPS {
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

/// Build the module, or say why not.
pub fn init(
    _progress_threads: bool,
    mpi_threads: bool,
) -> Result<(*mut *mut sys::mca_btl_base_module_t, i32), String> {
    lock(&super::component::PARAMS)
        .as_ref()
        .map_or(Err("the BTL parameters were not registered".into()), |p| {
            p.check()
        })?;
    let template = TEMPLATE.load(Ordering::Acquire);
    if template.is_null() {
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

    // SAFETY: opal_process_info and the modex are set up before BTL init.
    let (local_peers, world) = unsafe {
        (
            sys::opal_process_info.num_local_peers,
            ompi_ofi_btl_glue_job_size(),
        )
    };
    let all_local = world > 0 && local_peers as u64 + 1 >= world as u64;
    let cfg = Config {
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
    };
    let primary = open_module(&cfg, Role::AllPeers)?;
    let mut modules = vec![primary];
    // A job across hosts: on-host peers over shm when the provider lists allow it.
    // The primary module still reaches every peer, so that osc rdma (which needs one
    // BTL reaching all of a window's peers) keeps working; shm wins ob1's sends to
    // on-host peers by exclusivity.
    // SAFETY: modules[0] is our fresh module.
    let primary_provider = unsafe { (*modules[0].0).st.provider.clone() };
    if !all_local && two_sided && !common::endpoint::is_shm(&primary_provider) && local_peers > 0 {
        match open_module(&cfg, Role::OnHost) {
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
    let mut records: Vec<(u8, Vec<u8>)> = Vec::new();
    for (mp, name) in &modules {
        // SAFETY: every module in the list is ours and live.
        let st = unsafe { &(*(*mp)).st };
        records.push((st.role.record(), name.clone()));
        if let Some(rx) = &st.fbox {
            records.push((st.role.fbox_record(), rx.record()));
        }
    }
    let blob = modex_encode(records.iter().map(|(rec, data)| (*rec, data.as_slice())));
    let publish = modex::send(component(), &blob)
        .map_err(|rc| format!("publishing the endpoint names through the modex failed ({rc})"));
    // SAFETY: Open MPI frees the module array with free().
    let arr = unsafe {
        libc::malloc(MAX_MODULES * std::mem::size_of::<*mut sys::mca_btl_base_module_t>())
    } as *mut *mut sys::mca_btl_base_module_t;
    if publish.is_err() || arr.is_null() {
        for (mp, _) in modules {
            // SAFETY: nothing else knows mp yet.
            unsafe { destroy(mp) };
        }
        if !arr.is_null() {
            // SAFETY: from malloc above, not handed out.
            unsafe { libc::free(arr.cast()) };
        }
        return Err(publish.err().unwrap_or_else(|| "out of memory".into()));
    }
    for (i, (mp, _)) in modules.iter().enumerate() {
        MODULES[i].store(*mp, Ordering::Release);
        // SAFETY: arr has room for MAX_MODULES pointers.
        unsafe { *arr.add(i) = *mp as *mut sys::mca_btl_base_module_t };
    }
    Ok((arr, modules.len() as i32))
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
fn open_module(cfg: &Config, role: Role) -> Result<(*mut Module, Vec<u8>), String> {
    let Config {
        contexts,
        local_ranks,
        one_sided,
        two_sided,
        num_cq_read,
        rd_num,
        progress,
        mpi_threads,
        all_local,
        world,
        fbox,
    } = *cfg;
    let template = TEMPLATE.load(Ordering::Acquire);
    // shm lists neither locality capability: ask for none when every peer is local.
    let locality = if all_local || role == Role::OnHost {
        0
    } else {
        fi::FI_LOCAL_COMM | fi::FI_REMOTE_COMM
    };
    let threading = if mpi_threads {
        fi::FI_THREAD_SAFE
    } else {
        fi::FI_THREAD_DOMAIN
    };
    let make_hints = |atomics: bool, delivery: bool, multi: bool| -> crate::fabric::Result<Hints> {
        let mut caps = locality;
        if two_sided {
            caps |= (fi::FI_MSG | fi::FI_SEND | fi::FI_RECV) as u64;
            if multi {
                caps |= fi::FI_MULTI_RECV as u64;
            }
        }
        if one_sided {
            caps |= (fi::FI_RMA
                | fi::FI_READ
                | fi::FI_WRITE
                | fi::FI_REMOTE_READ
                | fi::FI_REMOTE_WRITE) as u64;
            if atomics {
                caps |= fi::FI_ATOMIC as u64;
            }
        }
        let mut h = Hints::new()?;
        if role == Role::OnHost {
            h = h.prov_name("shm");
        }
        let mut h = h
            .caps(caps)
            .mode(fi::FI_CONTEXT | fi::FI_CONTEXT2)
            .ep_type(fi::FI_EP_RDM)
            .mr_mode(MR_MODES)
            .threading(threading)
            .control_progress(progress)
            .data_progress(progress)
            .resource_mgmt(fi::FI_RM_ENABLED);
        if delivery {
            h = h.tx_op_flags(fi::FI_DELIVERY_COMPLETE as u64);
        }
        Ok(h)
    };
    // Preference order: atomics, then RMA completions that mean remote delivery. A
    // provider without atomics still gets a module (two-sided and RDMA).
    let atomics_mode = param(idx::ATOMICS);
    let attempts: &[(bool, bool)] = if one_sided && atomics_mode != ATOMICS_AM {
        &[(true, true), (true, false), (false, true), (false, false)]
    } else if one_sided {
        &[(false, true), (false, false)]
    } else {
        &[(false, false)]
    };
    // Each with multi-receive buffers first (see `am::post_receives`), where they matter.
    let multis: &[bool] = if two_sided { &[true, false] } else { &[false] };
    let mut failures = Vec::new();
    let mut opened = None;
    for (&(atomics, delivery), &multi) in attempts
        .iter()
        .flat_map(|a| multis.iter().map(move |m| (a, m)))
    {
        let hints = make_hints(atomics, delivery, multi)
            .map_err(|e| format!("cannot allocate fi_info hints: {e}"))?;
        match common::open_domain(DomainRequest {
            component: "btl",
            hints,
            threading_fallback: mpi_threads.then_some(fi::FI_THREAD_DOMAIN),
            spans_hosts: !all_local && role == Role::AllPeers,
        }) {
            Ok(d) => {
                opened = Some((d, atomics, delivery, multi));
                break;
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    let Some((mut domain, atomics, delivery, multi)) = opened else {
        failures.dedup();
        return Err(failures.join("; "));
    };
    // A provider that lags under automatic progress (sockets: floods of unexpected
    // messages stall) is opened again, the same way, with manual progress, unless
    // btl_ofi_progress_mode chose.
    let provider = domain.info().provider_name().to_string();
    if progress == fi::FI_PROGRESS_UNSPEC
        && crate::common::quirks::of(&provider).lags_in_auto_progress
        && domain.info().data_progress() != fi::FI_PROGRESS_MANUAL
    {
        let reopened = make_hints(atomics, delivery, multi)
            .map_err(|e| format!("cannot allocate fi_info hints: {e}"))
            .and_then(|h| {
                common::open_domain(DomainRequest {
                    component: "btl",
                    hints: h
                        .prov_name(&provider)
                        .control_progress(fi::FI_PROGRESS_MANUAL)
                        .data_progress(fi::FI_PROGRESS_MANUAL),
                    threading_fallback: mpi_threads.then_some(fi::FI_THREAD_DOMAIN),
                    spans_hosts: !all_local && role == Role::AllPeers,
                })
                .map_err(|e| e.to_string())
            });
        match reopened {
            Ok(d) => {
                log::info!("provider {provider}: manual progress (its own progress thread lags)");
                domain = d;
            }
            Err(e) => log::info!("provider {provider}: automatic progress (manual refused: {e})"),
        }
    }
    let info = domain.info();
    let mr_mode = info.mr_mode();
    let e = |what: &str, err: crate::fabric::Error| format!("{what} on {provider}: {err}");
    let dom = domain.domain().clone();
    // Contexts: a scalable endpoint when more than one is asked for and the provider
    // has them, within its limit shared by the ranks of this node.
    let nctx = if contexts <= 1 {
        1
    } else if info.max_ep_ctx() < 2 {
        if role == Role::AllPeers {
            log::warn!(
                "btl_ofi_num_contexts_per_module={contexts}: provider {provider} offers no scalable \
                 endpoints (at most {} transmit/receive contexts per endpoint); one context is used",
                info.max_ep_ctx()
            );
        }
        1
    } else if mr_mode & fi::FI_MR_ENDPOINT != 0 {
        log::warn!(
            "btl_ofi_num_contexts_per_module={contexts}: provider {provider} binds memory \
             regions to endpoints (FI_MR_ENDPOINT), which this BTL does not do for scalable \
             endpoints; one context is used"
        );
        1
    } else {
        crate::common::endpoint::contexts_within(
            contexts,
            info,
            local_ranks,
            "btl_ofi_num_contexts_per_module",
        )
    };
    let rx_ctx_bits = crate::common::endpoint::rx_ctx_bits(nctx);
    let av = AddressVector::open(
        &dom,
        &AvAttr {
            av_type: fi::FI_AV_TABLE,
            count: world.max(1) as usize,
            rx_ctx_bits: rx_ctx_bits as i32,
        },
    )
    .or_else(|_| {
        AddressVector::open(
            &dom,
            &AvAttr {
                av_type: fi::FI_AV_UNSPEC,
                count: world.max(1) as usize,
                rx_ctx_bits: rx_ctx_bits as i32,
            },
        )
    })
    .map_err(|x| e("fi_av_open", x))?;
    // Delivery completion was asked in the hints so that the provider must accept it;
    // the endpoint itself gets no default transmit flags: puts ask for it per operation
    // (rdma.rs), and as a default it would also apply to every active message (on shm
    // that turns an inline send into one the receiver must acknowledge).
    let ep_info = Hints::from_info(info)
        .map(|h| h.tx_op_flags(0))
        .map_err(|x| e("fi_dupinfo", x))?;
    let (ep, ctxs) = if nctx > 1 {
        let (sep, contexts) =
            crate::common::endpoint::open_scalable_enabled(&dom, ep_info.info(), &av, nctx, nctx)?;
        let ctxs = contexts
            .into_iter()
            .map(|c| Context {
                tx: Arc::new(c.tx),
                rx: Arc::new(c.rx),
                cq: c.cq,
            })
            .collect();
        (sep, ctxs)
    } else {
        let cq = CompletionQueue::open(&dom, &CqAttr::default()).map_err(|x| e("fi_cq_open", x))?;
        let ep = Arc::new(crate::common::endpoint::open_enabled(
            &dom,
            ep_info.info(),
            &cq,
            &av,
        )?);
        let ctx = Context {
            tx: Arc::clone(&ep),
            rx: Arc::clone(&ep),
            cq,
        };
        (ep, vec![ctx])
    };
    let name = ep.getname().map_err(|x| e("fi_getname", x))?;

    let provider_atomics = if atomics {
        query_atomics(dom.as_ptr())
    } else {
        0
    };
    // Atomics by active messages: asked for, or (auto) the provider has none or its
    // own crash (common::quirks). They need both services: the request travels as an
    // active message to the window's registration.
    let quirks = crate::common::quirks::of(&provider);
    let atomics_crash = quirks.atomics_crash;
    let amo = one_sided
        && two_sided
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
    let atomic_flags = if amo {
        amo::FLAGS
    } else if atomics_mode == ATOMICS_AM {
        0
    } else {
        provider_atomics
    };
    let inject_size = info.inject_size();
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
    // fragments ob1 keeps in flight find one (common::quirks::FLOOD_RECV_BUFFERS).
    let floor = crate::common::quirks::FLOOD_RECV_BUFFERS as i64;
    let rd_num = if two_sided
        && quirks.flood_unsafe
        && rd_num < floor
        && (rx_depth == 0 || rx_depth as i64 >= floor)
    {
        log::info!(
            "provider {provider}: unexpected messages break it (common::quirks): \
             {floor} receive buffers instead of btl_ofi_rd_num={rd_num}"
        );
        floor
    } else {
        rd_num
    };
    let max_msg = info.max_msg_size();
    let caps = info.caps();

    // The module: the template (with the user's values) plus what this provider allows.
    // SAFETY: the template was registered above and is only read here.
    let mut sup = unsafe { *template };
    fill_table(&mut sup);
    sup.btl_component = super::component::mca_btl_ofi_component.get();
    sup.btl_max_send_size = sup
        .btl_max_send_size
        .clamp(1, max_msg.saturating_sub(HDR).max(1));
    let one_packet = inject_size.saturating_sub(HDR);
    if two_sided
        && quirks.segments_unsafe
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
    let write_max = if one_sided && quirks.segments_unsafe && inject_size > rdma::WRITE_HEADROOM * 2
    {
        inject_size - rdma::WRITE_HEADROOM
    } else {
        usize::MAX
    };
    sup.btl_eager_limit = sup.btl_eager_limit.clamp(1, sup.btl_max_send_size);
    sup.btl_rndv_eager_limit = sup.btl_rndv_eager_limit.min(sup.btl_eager_limit);
    let mut capable = sys::MCA_BTL_FLAGS_SEND_INPLACE;
    if two_sided {
        capable |= sys::MCA_BTL_FLAGS_SEND;
    }
    if one_sided {
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
    let amo = amo && sup.btl_atomic_op.is_some();
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
    let mr_local = mr_mode & fi::FI_MR_LOCAL != 0 || param(idx::FORCE_MR_LOCAL) != 0;
    let threshold = if mr_local { 0 } else { usize::MAX };
    sup.btl_get_local_registration_threshold = threshold;
    sup.btl_put_local_registration_threshold = threshold;

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
    let max_bytes = lock(&super::component::PARAMS)
        .as_ref()
        .map(|p| p.size(idx::RCACHE_MAX_BYTES))
        .unwrap_or(0);
    if !release_events && max_entries > 0 {
        log::info!(
            "memory release events do not reach this library: the registration cache is disabled"
        );
    }
    let cache = Cache::new(max_entries, max_bytes, release_events);
    let rcache_sub = if cache.enabled() {
        match release::subscribe(rcache::release_cb, Arc::as_ptr(cache.slots()) as usize) {
            Ok(id) => Some(id),
            Err(e) => {
                return Err(format!(
                    "cannot subscribe the registration cache to memory releases: {e}"
                ))
            }
        }
    } else {
        None
    };

    if role == Role::OnHost {
        // Ahead of the primary module for ob1's sends to on-host peers, and preferred
        // by osc rdma for windows whose peers are all on this host.
        sup.btl_exclusivity = sup.btl_exclusivity.saturating_add(1);
        sup.btl_latency = (sup.btl_latency / 2).max(1);
    }
    let frag_payload = sup.btl_max_send_size;
    // Multi-receive buffers need the provider to release one before less than a
    // largest fragment is left in it, and to keep track of large fragments in them
    // (and of unexpected messages matched to them: not so on flood_unsafe providers).
    let multi_unsafe = quirks.multi_recv_unsafe || quirks.flood_unsafe;
    if multi && multi_unsafe {
        log::info!(
            "provider {provider}: multi-receive buffers lose messages here \
             (common::quirks); one receive buffer per fragment"
        );
    }
    let multi_recv = multi
        && !multi_unsafe
        && ctxs.iter().all(|c| {
            let min: usize = am::HDR + frag_payload;
            // SAFETY: FI_OPT_MIN_MULTI_RECV takes a size_t.
            let r = unsafe {
                c.rx.setopt(
                    fi::FI_OPT_ENDPOINT as i32,
                    fi::FI_OPT_MIN_MULTI_RECV as i32,
                    &min,
                )
            };
            if let Err(err) = &r {
                log::info!(
                    "provider {provider}: no minimum for multi-receive buffers ({err}); one \
                     receive buffer per fragment"
                );
            }
            r.is_ok()
        });
    let put_by_read = write_max < usize::MAX && sup.btl_flags & sys::MCA_BTL_FLAGS_SEND != 0;
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
    // Fast boxes for the module whose peers are all on this host.
    // Every fragment that carries ob1's matching order (match, rendezvous and get
    // headers, at most the eager limit) fits a box, so that a peer's such fragments
    // take one path, in order (see common::fbox).
    // Also under MPI_THREAD_MULTIPLE. They were kept off there for a while, after
    // mpi_tests/fbox's threads part saw a thread's messages overtake each other; that
    // was the test's MPI_T_init_thread(MPI_THREAD_SINGLE), which drops Open MPI 4.1.4's
    // own thread level, so that ob1's MPI_Recv shared one request among threads
    // (btl/vader the same; docs/testing.md, "Open MPI 4.1.4's own layers").
    let on_shm = (common::endpoint::is_shm(&provider) || role == Role::OnHost) && local_ranks > 1;
    let fbox = if fbox > 0 && sup.btl_flags & sys::MCA_BTL_FLAGS_SEND != 0 && on_shm {
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
    };
    let module = Box::new(Module {
        sup,
        st: State {
            ep,
            ctxs: ctxs.into_boxed_slice(),
            rx_ctx_bits,
            per_ctx: (0..if nctx > 1 { nctx } else { 0 })
                .map(|_| AtomicU64::new(0))
                .collect(),
            av,
            fi_lock: MaybeLock::new(mpi_threads && domain.threading() != fi::FI_THREAD_SAFE),
            provider: provider.clone(),
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
            piece_max: if quirks.send_past_inject_slow {
                inject_size.min(am::INLINE_MAX)
            } else {
                0
            },
            next_piece_id: AtomicU64::new(crate::common::random_odd()),
            assembly: crate::common::sync::MaybeMutex::new(
                crate::common::IdMap::default(),
                mpi_threads,
            ),
            assembled: AtomicU64::new(0),
            frag_payload,
            multi_recv,
            num_cq_read,
            progress_threshold: param(idx::PROGRESS_THRESHOLD).max(0) as usize,
            frags: Mutex::new(Vec::new()),
            pending: Mutex::new(VecDeque::new()),
            has_pending: AtomicBool::new(false),
            send_window: if quirks.flood_unsafe {
                crate::common::quirks::SEND_WINDOW
            } else {
                0
            },
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
    let mp = Box::into_raw(module);
    if two_sided {
        // SAFETY: mp is our fresh module.
        if let Err(err) = unsafe { am::post_receives(mp, rd_num as usize) } {
            // SAFETY: nothing else knows mp yet.
            unsafe { destroy(mp) };
            return Err(format!("posting receive buffers on {provider}: {err}"));
        }
    }
    // SAFETY: mp is live.
    let m = unsafe { &(*mp).sup };
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
            let (n, bytes) = am::receive_layout(rd_num as usize, am::HDR + m.btl_max_send_size, multi_recv);
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
    Ok((mp, name))
}
