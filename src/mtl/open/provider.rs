//! Choosing the provider, its matching and the tag layout: the provider comes first,
//! in libfabric's order as the C component takes it; then its domain is opened again
//! the way the MTL wants it (a deep receive queue; software matching over untagged
//! messages and RMA reads where the provider's tag matching cannot be trusted); then
//! the tag mode follows from what the domain offers.
//!
//! What it owns: the hints and the domain until `open_objects` opens the endpoint on
//! it. What it must not touch: the endpoint and the data path's settings.

use super::{param, progress_of, Config};
use crate::common::policy::Policy;
use crate::common::quirks::{self, Quirks};
use crate::common::{self, DomainHandle, DomainRequest};
use crate::fabric::Hints;
use crate::mtl::tag::{TagLayout, TagMode};
use crate::ompi::params::mtl as idx;
use libfabric_sys as fi;

/// Receives the MTL asks the provider to accept posted at once. MPI lets a program
/// post any number of receives before a matching send can happen (and Open MPI's
/// collectives post theirs behind them), so a small provider queue deadlocks: ask
/// for a deep one. Providers that match in software accept it. Receives beyond it
/// wait in our queue in MPI order. Memory is the limit: tcp;ofi_rxm keeps about 450
/// bytes per entry, so 65536 cost 28 MiB per rank (130 MiB for an 8-rank hello world,
/// the C MTL 104 MiB); 4096 costs under 2 MiB.
const RX_QUEUE: usize = 4096;

/// Inject size asked of ofi_rxm (which offers 64 bytes unless asked, and accepts up to
/// its eager buffer, 16 KiB). A send up to the inject size completes as soon as it is
/// posted, as eager sends do in ob1 and most MTLs; programs written against them test
/// for that (mpi4py's test suite: six isends to self, then `MPI_Testall` false must mean
/// that none has completed). rxm copies eager data into its own buffer either way.
const RXM_INJECT: usize = 16384;

/// The provider chosen and its domain, opened the way the MTL uses it.
pub(super) struct Chosen {
    pub(super) domain: DomainHandle,
    /// The provider's name as the first selection found it.
    pub(super) name: String,
    /// What the MTL does about it.
    pub(super) policy: Policy,
    /// Matching in software.
    pub(super) soft: bool,
    /// The handle of the first selection, when the domain was opened again: kept open
    /// until init returns, after the endpoint opened on the second.
    pub(super) _first: Option<DomainHandle>,
}

/// The hints of both openings; `cq_data`: ask for remote CQ data (provider
/// matching's synchronous sends need it).
fn hints(cfg: &Config, cq_data: bool) -> crate::fabric::Result<Hints> {
    let mut h = Hints::new()?
        .caps(fi::FI_TAGGED as u64 | fi::FI_DIRECTED_RECV | cfg.locality)
        .mode(fi::FI_CONTEXT | fi::FI_CONTEXT2)
        .ep_type(fi::FI_EP_RDM)
        .mr_mode(fi::FI_MR_VIRT_ADDR | fi::FI_MR_ALLOCATED | fi::FI_MR_PROV_KEY)
        .av_type(cfg.av_type)
        .threading(cfg.threading)
        .control_progress(progress_of(param(idx::CONTROL_PROGRESS)))
        .data_progress(progress_of(param(idx::DATA_PROGRESS)))
        .resource_mgmt(fi::FI_RM_ENABLED)
        .msg_order(fi::FI_ORDER_SAS as u64);
    if cq_data {
        h = h.cq_data_size(4);
    }
    Ok(h)
}

/// Choose the provider (as the C component does), decide its matching, and open it
/// again the way the MTL wants it, if it agrees.
pub(super) fn choose_provider(cfg: &Config) -> Result<Chosen, String> {
    let hints = hints(cfg, true).map_err(|e| format!("cannot allocate fi_info hints: {e}"))?;
    let first = common::open_domain(DomainRequest {
        component: "mtl",
        hints,
        threading_fallback: cfg.mpi_threads.then_some(fi::FI_THREAD_DOMAIN),
        spans_hosts: !cfg.all_local,
    })
    .map_err(|e| e.to_string())?;
    let name = first.info().provider_name().to_string();
    let quirks = quirks::of(&name);
    let policy = Policy::of_quirks(&quirks);
    let soft = want_software_matching(&name, &quirks, &policy);
    let (domain, first) = reopen(cfg, first, &name, &policy, soft)?;
    if soft {
        log::info!(
            "provider {name}: matching in software ({})",
            if param(idx::MATCHING) == 3 {
                "mtl_ofi_matching=software"
            } else if quirks.unexpected_ignores_mask {
                "its unexpected-message matching ignores tag masks"
            } else {
                "its tag matching stalls on unexpected messages"
            }
        );
    }
    if policy.manual_progress {
        log::info!(
            "provider {name}: data progress {} (manual makes our completion-queue reads match \
             receives posted after their message arrived)",
            match domain.info().data_progress() {
                fi::FI_PROGRESS_MANUAL => "manual",
                fi::FI_PROGRESS_AUTO => "automatic",
                _ => "unspecified",
            }
        );
    }
    Ok(Chosen {
        domain,
        name,
        policy,
        soft,
        _first: first,
    })
}

/// `mtl_ofi_matching`: provider (2), software (3), or auto, which matches in software
/// where the provider's tag matching is known to fail. Forcing the provider's there
/// says what to expect.
fn want_software_matching(name: &str, quirks: &Quirks, policy: &Policy) -> bool {
    match param(idx::MATCHING) {
        2 => {
            if policy.software_matching {
                log::warn!(
                    "mtl_ofi_matching=provider on {name}: its tag matching is known to fail here \
                     ({}); expect {}",
                    if quirks.unexpected_ignores_mask {
                        "wildcard receives miss messages that arrived before them"
                    } else if quirks.segments_unsafe {
                        "many or large unexpected messages stall, and matching an unexpected \
                         message sends the rest of a longer message in flight from that peer \
                         astray"
                    } else {
                        "many or large unexpected messages stall"
                    },
                    if quirks.unexpected_ignores_mask {
                        "wrong matches"
                    } else if quirks.segments_unsafe {
                        "hangs and lost data"
                    } else {
                        "hangs"
                    }
                );
            }
            false
        }
        3 => true,
        _ => policy.software_matching,
    }
}

/// Open the chosen provider again with a deep receive queue and, for software
/// matching, the capabilities it needs, falling back step by step to what the
/// provider agrees to. Returns the domain, and the first handle while it is still
/// needed: it is dropped only after the second is open, so the memory monitor stays
/// up.
fn reopen(
    cfg: &Config,
    first: DomainHandle,
    name: &str,
    policy: &Policy,
    soft: bool,
) -> Result<(DomainHandle, Option<DomainHandle>), String> {
    let refine = |deep: bool, multi: bool| refine(cfg, name, policy, soft, deep, multi);
    Ok(match refine(true, soft) {
        Ok(d) => (d, Some(first)),
        Err(_) if soft => {
            let d = refine(false, true)
                .or_else(|_| refine(true, false))
                .or_else(|_| refine(false, false))
                .map_err(|e| format!("{name} with software matching: {e}"))?;
            (d, Some(first))
        }
        Err(_) => {
            log::warn!(
                "provider {name} does not accept {RX_QUEUE} posted receives: a program that posts more \
                 receives than its queue holds before the matching sends can deadlock"
            );
            let d = if policy.unexpected_buffer > 0 {
                refine(false, false).unwrap_or(first)
            } else {
                first
            };
            (d, None)
        }
    })
}

/// One attempt of [`reopen`]: `deep` asks for [`RX_QUEUE`] receives, `multi` for
/// multi-receive buffers. Software matching receives into a few multi-receive buffers
/// where the provider offers them: one buffer takes many messages, where a buffer per
/// message costs a receive call per message (shm, 64-byte messages one way: 0.22 us
/// against 0.34 us reposting per message, in a raw libfabric ping-pong).
fn refine(
    cfg: &Config,
    name: &str,
    policy: &Policy,
    soft: bool,
    deep: bool,
    multi: bool,
) -> Result<DomainHandle, String> {
    let mut h = hints(cfg, !soft)
        .map_err(|e| format!("cannot allocate fi_info hints: {e}"))?
        .prov_name(name);
    if soft {
        h = h.caps(
            fi::FI_TAGGED as u64
                | fi::FI_MSG as u64
                | fi::FI_RMA as u64
                | fi::FI_READ as u64
                | fi::FI_REMOTE_READ as u64
                | if multi { fi::FI_MULTI_RECV as u64 } else { 0 }
                | cfg.locality,
        );
    }
    if deep {
        h = h.rx_size(RX_QUEUE);
    }
    if name.split(';').any(|l| l == "ofi_rxm") {
        h = h.inject_size(RXM_INJECT);
    }
    if policy.unexpected_buffer > 0 {
        h = h.total_buffered_recv(policy.unexpected_buffer);
    }
    if policy.manual_progress && progress_of(param(idx::DATA_PROGRESS)) == fi::FI_PROGRESS_UNSPEC {
        h = h.data_progress(fi::FI_PROGRESS_MANUAL);
    }
    common::open_domain(DomainRequest {
        component: "mtl",
        hints: h,
        threading_fallback: cfg.mpi_threads.then_some(fi::FI_THREAD_DOMAIN),
        spans_hosts: !cfg.all_local,
    })
    .map_err(|e| e.to_string())
}

/// The tag layout and what the domain offers for it.
pub(super) struct Tags {
    pub(super) mode: TagMode,
    pub(super) layout: TagLayout,
    /// `FI_DIRECTED_RECV` is offered.
    pub(super) directed: bool,
}

/// `mtl_ofi_tag_mode`, or (auto) the widest layout the domain carries: the full one
/// where it offers 8 bytes of remote CQ data and directed receives.
pub(super) fn choose_tag_layout(cfg: &Config, chosen: &Chosen) -> Result<Tags, String> {
    let (name, soft) = (&chosen.name, chosen.soft);
    let info = chosen.domain.info();
    let cq_data = info.cq_data_size();
    let directed = info.caps() & fi::FI_DIRECTED_RECV != 0;
    let mode = match cfg.requested {
        // Software matching matches the tag bits only: the source must be in them.
        None if soft => TagMode::Tag1,
        Some(TagMode::Full) if soft => {
            log::warn!(
                "mtl_ofi_tag_mode=ofi_tag_full: matching in software on {name} carries the \
                 source in the tag, not in CQ data; using ofi_tag_1"
            );
            TagMode::Tag1
        }
        None if cq_data >= 8 && directed => TagMode::Full,
        None => TagMode::Tag1,
        Some(TagMode::Full) if cq_data < 8 || !directed => {
            return Err(format!(
            "mtl_ofi_tag_mode=ofi_tag_full needs 8 bytes of remote CQ data and directed receives, \
                 provider {} offers {cq_data} bytes{}; use ofi_tag_1 or ofi_tag_2",
            info.provider_name(),
            if directed {
                ""
            } else {
                " and no directed receive"
            }
        ))
        }
        Some(m) => m,
    };
    if cq_data < 4 && !soft {
        return Err(format!(
            "provider {} offers no remote CQ data, which synchronous sends need to identify their acknowledgement",
            info.provider_name()
        ));
    }
    Ok(Tags {
        mode,
        layout: TagLayout::new(mode),
        directed,
    })
}
