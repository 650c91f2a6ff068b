//! Choosing the provider and opening its objects: the hints of a module's mode, the
//! domain (in order of preference, then again with manual progress where automatic
//! progress lags), the AV and the endpoint with its contexts and CQs.
//!
//! What it owns: nothing once the module is assembled (the objects move into its
//! `State`). What it must not touch: the module table and the memory the module
//! posts (`offer.rs`, `memory.rs`).

use super::{Config, ATOMICS_AM};
use crate::btl::module::{Context, Role};
use crate::common::{self, DomainHandle, DomainRequest};
use crate::fabric::{AddressVector, AvAttr, CompletionQueue, CqAttr, Endpoint, Hints};
use libfabric_sys as fi;
use std::sync::Arc;

const MR_MODES: u32 = fi::FI_MR_VIRT_ADDR
    | fi::FI_MR_ALLOCATED
    | fi::FI_MR_PROV_KEY
    | fi::FI_MR_LOCAL
    | fi::FI_MR_ENDPOINT;

/// The fi_info hints of a module: the capabilities its mode needs, with atomics,
/// delivery-complete writes and multi-receive buffers as asked.
fn hints_for(
    cfg: &Config,
    role: Role,
    atomics: bool,
    delivery: bool,
    multi: bool,
) -> crate::fabric::Result<Hints> {
    // shm lists neither locality capability: ask for none when every peer is local.
    let locality = if cfg.all_local || role == Role::OnHost {
        0
    } else {
        fi::FI_LOCAL_COMM | fi::FI_REMOTE_COMM
    };
    let threading = if cfg.mpi_threads {
        fi::FI_THREAD_SAFE
    } else {
        fi::FI_THREAD_DOMAIN
    };
    let mut caps = locality;
    if cfg.two_sided {
        caps |= (fi::FI_MSG | fi::FI_SEND | fi::FI_RECV) as u64;
        if multi {
            caps |= fi::FI_MULTI_RECV as u64;
        }
    }
    if cfg.one_sided {
        caps |= (fi::FI_RMA | fi::FI_READ | fi::FI_WRITE | fi::FI_REMOTE_READ | fi::FI_REMOTE_WRITE)
            as u64;
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
        .control_progress(cfg.progress)
        .data_progress(cfg.progress)
        .resource_mgmt(fi::FI_RM_ENABLED);
    if delivery {
        h = h.tx_op_flags(fi::FI_DELIVERY_COMPLETE as u64);
    }
    Ok(h)
}

/// The domain a module runs on, and what its hints asked for.
pub(super) struct Opened {
    pub(super) domain: DomainHandle,
    /// The provider's name, as first opened.
    pub(super) provider: String,
    /// The provider's atomics were asked for (and so are queried).
    pub(super) atomics: bool,
    /// Writes may ask for delivery completion.
    pub(super) delivery: bool,
    /// Multi-receive buffers were asked for.
    pub(super) multi: bool,
}

/// Choose the provider and open its domain: the first hints the common layer can
/// satisfy, in order of preference, then, where the provider lags under automatic
/// progress, the same again with manual progress.
pub(super) fn choose_provider(
    cfg: &Config,
    role: Role,
    atomics_mode: i64,
) -> Result<Opened, String> {
    let Config {
        one_sided,
        two_sided,
        progress,
        mpi_threads,
        all_local,
        ..
    } = *cfg;
    // Preference order: atomics, then RMA completions that mean remote delivery. A
    // provider without atomics still gets a module (two-sided and RDMA).
    let attempts: &[(bool, bool)] = if one_sided && atomics_mode != ATOMICS_AM {
        &[(true, true), (true, false), (false, true), (false, false)]
    } else if one_sided {
        &[(false, true), (false, false)]
    } else {
        &[(false, false)]
    };
    // Each with multi-receive buffers first (see `am::recv::post_receives`), where they matter.
    let multis: &[bool] = if two_sided { &[true, false] } else { &[false] };
    let mut failures = Vec::new();
    let mut opened = None;
    for (&(atomics, delivery), &multi) in attempts
        .iter()
        .flat_map(|a| multis.iter().map(move |m| (a, m)))
    {
        let hints = hints_for(cfg, role, atomics, delivery, multi)
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
        && crate::common::policy::of(&provider).manual_progress
        && domain.info().data_progress() != fi::FI_PROGRESS_MANUAL
    {
        let reopened = hints_for(cfg, role, atomics, delivery, multi)
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
    Ok(Opened {
        domain,
        provider,
        atomics,
        delivery,
        multi,
    })
}

/// The endpoint of a module and what reaches it.
pub(super) struct Endpoints {
    pub(super) ep: Arc<Endpoint>,
    pub(super) ctxs: Vec<Context>,
    pub(super) av: Arc<AddressVector>,
    /// Contexts opened: above 1 only on a scalable endpoint.
    pub(super) nctx: usize,
    pub(super) rx_ctx_bits: u32,
}

/// Open the AV and the endpoint (a scalable one when more than one context is asked
/// for and the provider allows it), enabled, with their CQs. Returns them and the
/// endpoint's name (for the modex).
pub(super) fn open_endpoints(
    cfg: &Config,
    role: Role,
    domain: &DomainHandle,
    provider: &str,
) -> Result<(Endpoints, Vec<u8>), String> {
    let Config {
        contexts,
        local_ranks,
        world,
        ..
    } = *cfg;
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
        let pair = Context {
            tx: Arc::clone(&ep),
            rx: Arc::clone(&ep),
            cq,
        };
        (ep, vec![pair])
    };
    let name = ep.getname().map_err(|x| e("fi_getname", x))?;
    Ok((
        Endpoints {
            ep,
            ctxs,
            av,
            nctx,
            rx_ctx_bits,
        },
        name,
    ))
}
