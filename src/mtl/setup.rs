//! MTL setup and teardown: hints, tag mode, endpoint, address exchange, the module
//! table handed to pml cm, and add/del of procs and communicators.
//!
//! What it owns: the libfabric objects of the MTL (kept in [`RESOURCES`]) and the
//! [`Mtl`] state the data path reads. It must not touch the data path's requests.

use super::ffi;
use super::peer::PeerEndpoint;
use super::progress;
use super::request::REQUEST_EXTRA;
use super::state::{self, Mtl};
use super::tag::{TagLayout, TagMode};
use crate::common::{self, fbox, DomainHandle, DomainRequest};
use crate::fabric::{AddressVector, AvAttr, CompletionQueue, CqAttr, Endpoint, Hints};
use crate::ompi::component::{ffi_guard, Exported};
use crate::ompi::error::OpalCode;
use crate::ompi::params::mtl as idx;
use crate::ompi::{glue, modex};
use libfabric_sys as fi;
use ompi_sys as sys;
use std::os::raw::c_int;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// The libfabric objects of the MTL, dropped (closed) at finalize: endpoint first,
/// then CQ and AV, then the shared domain.
struct Resources {
    /// The endpoint, or a scalable endpoint's contexts (each keeps the scalable
    /// endpoint open); closed before the CQs.
    _eps: Vec<Endpoint>,
    _cqs: Vec<Arc<CompletionQueue>>,
    av: Arc<AddressVector>,
    _domain: DomainHandle,
    peers: Vec<*mut sys::ompi_proc_t>,
}

// SAFETY: the proc pointers are only dereferenced from MPI calls, which Open MPI
// serialises for add/del_procs and finalize.
unsafe impl Send for Resources {}

static RESOURCES: Mutex<Option<Resources>> = Mutex::new(None);
static CID_WARNED: AtomicBool = AtomicBool::new(false);

use crate::common::sync::lock;

static MODULE: Exported<sys::mca_mtl_base_module_t> = Exported::new(sys::mca_mtl_base_module_t {
    mtl_max_contextid: 0,
    mtl_max_tag: 0,
    mtl_request_size: 0,
    mtl_flags: 0,
    mtl_add_procs: Some(mtl_add_procs),
    mtl_del_procs: Some(mtl_del_procs),
    mtl_finalize: Some(mtl_finalize),
    mtl_send: Some(ffi::mtl_send),
    mtl_isend: Some(ffi::mtl_isend),
    mtl_irecv: Some(ffi::mtl_irecv),
    mtl_iprobe: Some(ffi::mtl_iprobe),
    mtl_imrecv: Some(ffi::mtl_imrecv),
    mtl_improbe: Some(ffi::mtl_improbe),
    mtl_cancel: Some(ffi::mtl_cancel),
    mtl_add_comm: Some(mtl_add_comm),
    mtl_del_comm: Some(mtl_del_comm),
});

/// The module handed to pml cm.
pub fn module_ptr() -> *mut sys::mca_mtl_base_module_t {
    MODULE.get()
}

fn param(i: usize) -> i64 {
    lock(&super::component::PARAMS)
        .as_ref()
        .map(|p| p.int(i))
        .unwrap_or(0)
}

fn check_params() -> Result<(), String> {
    lock(&super::component::PARAMS)
        .as_ref()
        .map_or(Err("the MTL parameters were not registered".into()), |p| {
            p.check()
        })
}

fn progress_of(v: i64) -> fi::fi_progress {
    match v {
        1 => fi::FI_PROGRESS_AUTO,
        2 => fi::FI_PROGRESS_MANUAL,
        _ => fi::FI_PROGRESS_UNSPEC,
    }
}

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

/// Build the MTL: choose provider and tag mode, open the endpoint, publish its name.
pub fn init_module(
    _progress_threads: bool,
    mpi_threads: bool,
) -> Result<*mut sys::mca_mtl_base_module_t, String> {
    check_params()?;
    let fbox_size = param(idx::FBOX_SIZE).max(0) as u64;
    fbox::Sizes::new("mtl_ofi_fbox_size", fbox_size, 1)
        .inspect_err(|e| log::warn!("{e}: the ofi MTL declines"))?;
    let requested = match param(idx::TAG_MODE) {
        2 => Some(TagMode::Tag1),
        3 => Some(TagMode::Tag2),
        4 => Some(TagMode::Full),
        _ => None,
    };
    let mut want_sep = param(idx::ENABLE_SEP) != 0;
    let mut grouping = param(idx::THREAD_GROUPING) != 0;
    if grouping && !want_sep {
        log::warn!(
            "mtl_ofi_thread_grouping=1 needs a scalable endpoint (mtl_ofi_enable_sep=1); \
             ignored, one regular endpoint is used"
        );
        grouping = false;
    }
    let av_type = if param(idx::AV) == 2 {
        fi::FI_AV_TABLE
    } else {
        fi::FI_AV_MAP
    };
    // SAFETY: opal_process_info and the world size are set up before MTL init.
    let (local_peers, world) = unsafe {
        (
            sys::opal_process_info.num_local_peers,
            sys::ompi_proc_world_size(),
        )
    };
    let all_local = local_peers + 1 >= world;
    // A job on one node asks for no locality capability at all: shm lists neither
    // FI_LOCAL_COMM nor FI_REMOTE_COMM, and asking for remote communication is what
    // keeps the C MTL off shm.
    let locality = if all_local {
        0
    } else {
        fi::FI_LOCAL_COMM | fi::FI_REMOTE_COMM
    };
    let threading = if mpi_threads {
        fi::FI_THREAD_SAFE
    } else {
        fi::FI_THREAD_DOMAIN
    };
    let make_hints = |cq_data: bool| -> crate::fabric::Result<Hints> {
        let mut h = Hints::new()?
            .caps(fi::FI_TAGGED as u64 | fi::FI_DIRECTED_RECV | locality)
            .mode(fi::FI_CONTEXT | fi::FI_CONTEXT2)
            .ep_type(fi::FI_EP_RDM)
            .mr_mode(fi::FI_MR_VIRT_ADDR | fi::FI_MR_ALLOCATED | fi::FI_MR_PROV_KEY)
            .av_type(av_type)
            .threading(threading)
            .control_progress(progress_of(param(idx::CONTROL_PROGRESS)))
            .data_progress(progress_of(param(idx::DATA_PROGRESS)))
            .resource_mgmt(fi::FI_RM_ENABLED)
            .msg_order(fi::FI_ORDER_SAS as u64);
        if cq_data {
            h = h.cq_data_size(4);
        }
        Ok(h)
    };
    let hints = make_hints(true).map_err(|e| format!("cannot allocate fi_info hints: {e}"))?;
    let domain = common::open_domain(DomainRequest {
        component: "mtl",
        hints,
        threading_fallback: mpi_threads.then_some(fi::FI_THREAD_DOMAIN),
        spans_hosts: !all_local,
    })
    .map_err(|e| e.to_string())?;
    // Now that the provider is chosen (in libfabric's order, as the C component
    // does), open it again the way the MTL wants it, if it agrees: a deep receive
    // queue; and for a provider whose tag matching cannot be trusted, software
    // matching over untagged messages and RMA reads. The first handle is dropped
    // after the second is open, so the memory monitor stays up.
    let name = domain.info().provider_name().to_string();
    let quirks = crate::common::quirks::of(&name);
    let want_soft = match param(idx::MATCHING) {
        2 => {
            if quirks.tag_matching_unsafe() {
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
        _ => quirks.tag_matching_unsafe(),
    };
    // Software matching receives into a few multi-receive buffers where the provider
    // offers them (`multi`): one buffer takes many messages, where a buffer per message
    // costs a receive call per message (shm, 64-byte messages one way: 0.22 us against
    // 0.34 us reposting per message, in a raw libfabric ping-pong).
    let refine = |deep: bool, multi: bool| -> Result<DomainHandle, String> {
        let mut h = make_hints(!want_soft)
            .map_err(|e| format!("cannot allocate fi_info hints: {e}"))?
            .prov_name(&name);
        if want_soft {
            h = h.caps(
                fi::FI_TAGGED as u64
                    | fi::FI_MSG as u64
                    | fi::FI_RMA as u64
                    | fi::FI_READ as u64
                    | fi::FI_REMOTE_READ as u64
                    | if multi { fi::FI_MULTI_RECV as u64 } else { 0 }
                    | locality,
            );
        }
        if deep {
            h = h.rx_size(RX_QUEUE);
        }
        if name.split(';').any(|l| l == "ofi_rxm") {
            h = h.inject_size(RXM_INJECT);
        }
        if quirks.unexpected_unbuffered {
            h = h.total_buffered_recv(common::quirks::UNEXPECTED_BUFFER);
        }
        if quirks.lags_in_auto_progress
            && progress_of(param(idx::DATA_PROGRESS)) == fi::FI_PROGRESS_UNSPEC
        {
            h = h.data_progress(fi::FI_PROGRESS_MANUAL);
        }
        common::open_domain(DomainRequest {
            component: "mtl",
            hints: h,
            threading_fallback: mpi_threads.then_some(fi::FI_THREAD_DOMAIN),
            spans_hosts: !all_local,
        })
        .map_err(|e| e.to_string())
    };
    let domain = match refine(true, want_soft) {
        Ok(d) => d,
        Err(_) if want_soft => refine(false, true)
            .or_else(|_| refine(true, false))
            .or_else(|_| refine(false, false))
            .map_err(|e| format!("{name} with software matching: {e}"))?,
        Err(_) => {
            log::warn!(
                "provider {name} does not accept {RX_QUEUE} posted receives: a program that posts more \
                 receives than its queue holds before the matching sends can deadlock"
            );
            if quirks.unexpected_unbuffered {
                refine(false, false).unwrap_or(domain)
            } else {
                domain
            }
        }
    };
    let soft = want_soft;
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
    let info = domain.info();
    if quirks.lags_in_auto_progress {
        log::info!(
            "provider {name}: data progress {} (manual makes our completion-queue reads match \
             receives posted after their message arrived)",
            match info.data_progress() {
                fi::FI_PROGRESS_MANUAL => "manual",
                fi::FI_PROGRESS_AUTO => "automatic",
                _ => "unspecified",
            }
        );
    }
    let cq_data = info.cq_data_size();
    let directed = info.caps() & fi::FI_DIRECTED_RECV != 0;
    let mode = match requested {
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
    let layout = TagLayout::new(mode);
    // Serialise every fabric call under MPI_THREAD_MULTIPLE, even when the provider
    // claims FI_THREAD_SAFE: udp;ofi_rxd hangs with concurrent callers (threads test).
    let threaded_lock = mpi_threads;
    // SAFETY: mpi_threads is Open MPI's enable_mpi_threads: false only when one thread at
    // a time calls into MPI.
    let threads = unsafe { crate::common::sync::Threads::of(mpi_threads) };
    let inject_size = info.inject_size();
    // The depth of the provider's receive queue: the MTL keeps part of it for Open
    // MPI's own receives (state::RxBudget).
    let rx_capacity = info.rx_size();
    let rx = state::RxBudget::new(rx_capacity, mpi_threads);
    let rx_user_max = rx.user_max();
    let provider = info.provider_name().to_string();

    let e = |what: &str, err: crate::fabric::Error| format!("{what} on {provider}: {err}");
    let dom = domain.domain().clone();
    // Scalable endpoint: as many contexts as asked, within the provider's limit shared
    // by the ranks of this node (as the C MTL provisions them).
    if want_sep && soft {
        log::warn!(
            "mtl_ofi_enable_sep=1: not with software matching (provider {provider}); \
             one regular endpoint is used"
        );
        want_sep = false;
    } else if want_sep && info.max_ep_ctx() < 2 {
        log::warn!(
            "mtl_ofi_enable_sep=1: provider {provider} offers no scalable endpoints (at most {} \
             transmit/receive contexts per endpoint); one regular endpoint is used",
            info.max_ep_ctx()
        );
        want_sep = false;
    }
    let nctx = if !want_sep {
        if param(idx::NUM_CTXTS) > 1 && param(idx::ENABLE_SEP) == 0 {
            log::warn!("mtl_ofi_num_ctxts applies only with mtl_ofi_enable_sep=1; ignored");
        }
        1
    } else {
        crate::common::endpoint::contexts_within(
            param(idx::NUM_CTXTS).max(1) as usize,
            info,
            local_peers.max(0) as usize + 1,
            "mtl_ofi_num_ctxts",
        )
    };
    // Without thread grouping only context 0 carries traffic (as in the C MTL).
    let used = if grouping { nctx } else { 1 };
    // As the C MTL: the bit length of the context count, also for one context.
    let rx_ctx_bits = if want_sep {
        crate::common::endpoint::rx_ctx_bits(nctx).max(1)
    } else {
        0
    };
    let av = AddressVector::open(
        &dom,
        &AvAttr {
            av_type,
            count: world.max(1) as usize * nctx,
            rx_ctx_bits: rx_ctx_bits as i32,
        },
    )
    .map_err(|x| e("fi_av_open", x))?;
    let open_cq =
        || CompletionQueue::open(&dom, &CqAttr::default()).map_err(|x| e("fi_cq_open", x));
    let mut eps = Vec::new();
    let mut cqs = Vec::new();
    let mut ctxs = Vec::new();
    let name;
    if want_sep {
        let (sep, contexts) =
            crate::common::endpoint::open_scalable_enabled(&dom, domain.info(), &av, nctx, used)?;
        name = sep.getname().map_err(|x| e("fi_getname", x))?;
        for c in contexts {
            ctxs.push(state::Ctx {
                tx: c.tx.as_ptr(),
                rx: c.rx.as_ptr(),
                cq: c.cq.as_ptr(),
            });
            eps.push(c.tx);
            eps.push(c.rx);
            cqs.push(c.cq);
        }
    } else {
        let cq = open_cq()?;
        let ep = crate::common::endpoint::open_enabled(&dom, domain.info(), &cq, &av)?;
        name = ep.getname().map_err(|x| e("fi_getname", x))?;
        ctxs.push(state::Ctx {
            tx: ep.as_ptr(),
            rx: ep.as_ptr(),
            cq: cq.as_ptr(),
        });
        eps.push(ep);
        cqs.push(cq);
    }
    let quirks = crate::common::quirks::of(&provider);
    let (overflow, overflow_len) = if quirks.truncation_unsafe {
        overflow_area(info.max_msg_size())
    } else {
        (ptr::null_mut(), 0)
    };
    let events = param(idx::PROGRESS_EVENT_CNT).max(1) as usize;
    let state = Box::new(Mtl {
        ctxs: ctxs.into_boxed_slice(),
        rx_ctx_bits,
        layout,
        inject_size,
        // Only the full layout needs directed receives (the source is not in the tag);
        // the others match the source in the tag bits.
        directed: directed && layout.source_in_data(),
        lazy_matching: quirks.lags_in_auto_progress,
        events_per_progress: events,
        lock: crate::common::sync::MaybeLock::new(threads),
        overflow,
        overflow_len,
        sync_ids: AtomicU32::new(0),
        counters: state::Counters {
            per_ctx: (0..if used > 1 { used } else { 0 })
                .map(|_| Default::default())
                .collect(),
            ..Default::default()
        },
        soft: None,
        deferred: Default::default(),
        rx,
        deferred_sends: Default::default(),
        has_deferred_sends: Default::default(),
        has_deferred: Default::default(),
        has_stash: Default::default(),
        breaker_busy: Default::default(),
        fast_posts: Default::default(),
        posted_gen: Default::default(),
        claim_busy: Default::default(),
        acks: Default::default(),
    });
    let mut state = state;
    if soft {
        // Matching in software relies on untagged messages from one peer completing in
        // the order they were sent. net keeps that at any size (it streams over one
        // socket), and its RMA reads are protocol exchanges of their own, so 64 KiB
        // goes eagerly there; ofi_rxm completes a message past its eager size
        // (rendezvous) after the smaller ones sent behind it: 16 KiB.
        // Where a send past the inject size is unsafe (udp;ofi_rxd mixes up sends of
        // more than one packet, common::quirks::Quirks::segments_unsafe; its reads are
        // safe) or slow (shm moves it with process_vm_readv: 3.9 us one way at 4 KiB
        // on this project's virtual machine, against 1.2 to 1.5 us as two injects),
        // eager messages longer than one inject go as trains of injects, and a receive
        // buffer holds one of them. Past PIECES_EAGER_MAX (rxd) or
        // SLOW_SEND_EAGER_INJECTS injects (shm) the receiver reads the message.
        let pieces = (quirks.segments_unsafe || quirks.send_past_inject_slow)
            && state.inject_size > 2 * super::softmatch::HDR_LEN;
        let piece_max = if pieces {
            state.inject_size.min(super::softmatch::PIECE_BUF)
        } else {
            0
        };
        let pieces_eager_max = if !pieces {
            0
        } else if quirks.segments_unsafe {
            super::softmatch::PIECES_EAGER_MAX
        } else {
            super::softmatch::SLOW_SEND_EAGER_INJECTS * (piece_max - super::softmatch::HDR_LEN)
        };
        let bounce = if pieces {
            piece_max
        } else if quirks.unexpected_stalls {
            super::softmatch::BOUNCE_LARGE
        } else {
            super::softmatch::BOUNCE_SMALL
        };
        // Multi-receive buffers where the endpoint has them and takes the minimum
        // free space: a largest message must always fit the rest of a buffer.
        let multi_unsafe = quirks.multi_recv_unsafe || quirks.flood_unsafe;
        if multi_unsafe {
            log::info!(
                "provider {provider}: multi-receive buffers lose messages here \
                 (common::quirks); one receive buffer per message"
            );
        }
        let multi = domain.info().caps() & fi::FI_MULTI_RECV as u64 != 0 && !multi_unsafe && {
            // SAFETY: FI_OPT_MIN_MULTI_RECV takes a size_t.
            match unsafe {
                eps[0].setopt(
                    fi::FI_OPT_ENDPOINT as i32,
                    fi::FI_OPT_MIN_MULTI_RECV as i32,
                    &bounce,
                )
            } {
                Ok(()) => true,
                Err(err) => {
                    log::info!(
                        "provider {provider}: no minimum for multi-receive buffers ({err}); \
                         one receive buffer per message"
                    );
                    false
                }
            }
        };
        let mut sm = Box::new(super::softmatch::SoftMatch::new(
            dom.clone(),
            threads,
            bounce,
            piece_max,
            multi,
            quirks.reorders_messages,
            if quirks.flood_unsafe {
                common::quirks::SEND_WINDOW
            } else {
                0
            },
            pieces_eager_max,
        ));
        sm.post_bounces(&state)
            .map_err(|rc| format!("posting receive buffers failed ({rc})"))?;
        // Fast boxes (softmatch, common::fbox): on shm, with peers on the node.
        if crate::common::endpoint::is_shm(&provider) && local_peers > 0 && sm.fbox_fits() {
            let sizes = fbox::Sizes::new("mtl_ofi_fbox_size", fbox_size, sm.fbox_record_max())?;
            if let Some(sizes) = sizes {
                match fbox::Rx::create(local_peers as usize + 1, sizes, 1) {
                    Ok(rx) => sm.fbox = Some(rx),
                    Err(e) => log::info!("provider {provider}: no fast boxes: {e}"),
                }
            }
        }
        state.soft = Some(sm);
    }
    let fbox_record = state
        .soft
        .as_ref()
        .and_then(|sm| sm.fbox.as_ref())
        .map(|rx| rx.record());
    modex::send(
        super::component::component(),
        &modex_blob(&name, fbox_record.as_deref()),
    )
    .map_err(|rc| format!("publishing the endpoint name through the modex failed ({rc})"))?;
    *lock(&RESOURCES) = Some(Resources {
        _eps: eps,
        _cqs: cqs,
        av,
        _domain: domain,
        peers: Vec::new(),
    });
    let soft_eager_max = state.soft.as_ref().map_or(0, |s| s.eager_max());
    let soft_pieces = state.soft.as_ref().is_some_and(|s| s.eager_in_pieces());
    let soft_buffers = state.soft.as_ref().map_or(String::new(), |s| s.buffers());
    state::MTL.store(Box::into_raw(state), Ordering::Release);
    // SAFETY: a plain function pointer registration.
    unsafe { sys::opal_progress_register(Some(progress::progress_cb)) };
    CID_WARNED.store(false, Ordering::Relaxed);

    let m = MODULE.get();
    // SAFETY: the module is ours and not yet handed to the PML.
    unsafe {
        // Open MPI hands out ids below mtl_max_contextid: every id the layout carries.
        (*m).mtl_max_contextid = (layout.max_cid() as u64 + 1).min(i32::MAX as u64) as i32;
        (*m).mtl_max_tag = layout.max_tag();
        (*m).mtl_request_size = REQUEST_EXTRA;
    }
    log::info!(
        "provider {provider}: tag mode {} ({} communicator ids, tags up to {}), inject {} bytes, \
         {}, {}{}",
        mode.name(),
        layout.max_cid() as u64 + 1,
        layout.max_tag(),
        inject_size,
        if soft {
            if soft_pieces {
                format!(
                    "{soft_buffers}, messages up to {soft_eager_max} bytes in pieces of one \
                     inject, larger ones read from the sender"
                )
            } else {
                format!(
                    "{soft_buffers}, messages above {soft_eager_max} bytes read from the sender"
                )
            }
        } else {
            format!(
                "receive queue {rx_capacity} ({rx_user_max} of it for the application's receives)"
            )
        },
        if all_local {
            "local communication only"
        } else {
            "local and remote communication"
        },
        if threaded_lock {
            ", serialised for MPI_THREAD_MULTIPLE"
        } else {
            ""
        }
    );
    if want_sep {
        log::info!(
            "provider {provider}: scalable endpoint with {nctx} contexts, {}",
            if grouping {
                format!("{used} in use, communicator id modulo {used} picks one (mtl_ofi_thread_grouping)")
            } else {
                "context 0 carries all traffic (mtl_ofi_thread_grouping=0)".to_string()
            }
        );
    }
    Ok(m)
}

/// Scratch that receives end with on providers where truncation stalls: address space
/// only (MAP_NORESERVE), touched only by a message longer than its receive.
const OVERFLOW_MAX: usize = 1 << 30;

fn overflow_area(max_msg: usize) -> (*mut u8, usize) {
    let len = max_msg.clamp(4096, OVERFLOW_MAX);
    // SAFETY: an anonymous private mapping; checked for failure.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        log::warn!("no overflow area for receives ({len} bytes): a truncated receive may stall this provider");
        (ptr::null_mut(), 0)
    } else {
        (p as *mut u8, len)
    }
}

/// Release the overflow area (after the endpoint can no longer write into it: called
/// from finalize before the objects close, which is fine because no receive is posted
/// any more once the PML finalizes).
fn overflow_unmap(m: &Mtl) {
    if !m.overflow.is_null() {
        // SAFETY: the mapping made in overflow_area, of overflow_len bytes.
        unsafe { libc::munmap(m.overflow as *mut libc::c_void, m.overflow_len) };
    }
}

/// The MTL's modex entry: the endpoint name's length (u16, little-endian), the name,
/// then the fast-box segment's record, if any (`common::fbox::Rx::record`).
fn modex_blob(name: &[u8], fbox: Option<&[u8]>) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + name.len() + fbox.map_or(0, |r| r.len()));
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(fbox.unwrap_or_default());
    v
}

/// A peer's modex entry ([`modex_blob`]): its endpoint name and fast-box record;
/// `None` when malformed.
fn modex_parse(blob: &[u8]) -> Option<(&[u8], Option<&[u8]>)> {
    let n = u16::from_le_bytes(blob.get(..2)?.try_into().ok()?) as usize;
    let name = blob.get(2..2 + n).filter(|s| !s.is_empty())?;
    let rest = &blob[2 + n..];
    Some((name, (!rest.is_empty()).then_some(rest)))
}

/// Insert `procs` into the address vector (from their modex entries).
pub fn add_procs_inner(procs: &mut [*mut sys::ompi_proc_t]) -> Result<(), c_int> {
    let mut res = lock(&RESOURCES);
    let Some(res) = res.as_mut() else {
        return Err(sys::OMPI_ERR_NOT_AVAILABLE);
    };
    // The largest record this process sends through a fast box, if it has them.
    let fbox_max = state::with_mtl(|m| {
        m.and_then(|m| m.soft.as_deref())
            .filter(|sm| sm.fbox.is_some())
            .map(|sm| sm.fbox_record_max())
    });
    for &p in procs.iter() {
        // SAFETY: p is a live proc from the PML.
        let slot = unsafe { &mut (*p).proc_endpoints[sys::OMPI_PROC_ENDPOINT_TAG_MTL as usize] };
        if !slot.is_null() {
            continue;
        }
        // SAFETY: p is live; the glue returns its embedded process name.
        let name = unsafe { &*glue::ompi_ofi_glue_proc_name(p) };
        let blob = modex::recv(super::component::component(), name).inspect_err(|rc| {
            log::error!(
                "no endpoint name of a peer in the modex ({rc}): is the peer running our MTL?"
            );
        })?;
        let Some((addr, fbox_record)) = modex_parse(&blob) else {
            log::error!("a peer's modex entry is malformed ({} bytes)", blob.len());
            return Err(sys::OMPI_ERR_UNREACH);
        };
        let fiaddr = res.av.insert(addr).map_err(|e| {
            log::error!("fi_av_insert of a peer's address failed: {e}");
            e.to_opal()
        })?;
        // A fast box to a peer on this node, when both have fast boxes.
        // SAFETY: p is live.
        let on_node = u32::from(unsafe { (*p).super_.proc_flags }) & sys::OPAL_PROC_ON_NODE != 0;
        let fbox = fbox_max
            .zip(fbox_record)
            .filter(|_| on_node)
            .and_then(|(max, rec)| {
                // SAFETY: set up before MTL init.
                let me = unsafe { sys::opal_process_info.my_local_rank }.max(0) as usize;
                // A peer whose records are smaller than ours (another eager size) is
                // sent to through the provider.
                fbox::Tx::open(rec, me)
                    .and_then(|tx| {
                        if tx.max() >= max {
                            Ok(tx)
                        } else {
                            Err(format!("its records hold {} B, ours {max} B", tx.max()))
                        }
                    })
                    .inspect_err(|e| log::info!("no fast box to a peer: {e}"))
                    .ok()
            });
        *slot = Box::into_raw(Box::new(PeerEndpoint { addr: fiaddr, fbox })) as *mut _;
        res.peers.push(p);
    }
    Ok(())
}

/// Messages sent through fast boxes to the peers known now.
pub fn fbox_sent() -> u64 {
    lock(&RESOURCES).as_ref().map_or(0, |res| {
        res.peers
            .iter()
            // SAFETY: each proc in the list holds our PeerEndpoint until released.
            .filter_map(|&p| unsafe {
                let ep = (*p).proc_endpoints[sys::OMPI_PROC_ENDPOINT_TAG_MTL as usize]
                    as *const PeerEndpoint;
                ep.as_ref()?.fbox.as_ref().map(|t| t.sent())
            })
            .sum()
    })
}

fn release_peers(res: &mut Resources, only: Option<&[*mut sys::ompi_proc_t]>) {
    res.peers.retain(|&p| {
        if only.is_some_and(|o| !o.contains(&p)) {
            return true;
        }
        // SAFETY: p is a live proc whose MTL slot holds our PeerEndpoint.
        unsafe {
            let slot = &mut (*p).proc_endpoints[sys::OMPI_PROC_ENDPOINT_TAG_MTL as usize];
            if !slot.is_null() {
                drop(Box::from_raw(*slot as *mut PeerEndpoint));
                *slot = ptr::null_mut();
            }
        }
        false
    });
}

extern "C" fn mtl_add_procs(
    _m: *mut sys::mca_mtl_base_module_t,
    nprocs: usize,
    procs: *mut *mut sys::ompi_proc_t,
) -> c_int {
    ffi_guard("mtl add_procs", sys::OMPI_ERROR, || {
        if nprocs == 0 || procs.is_null() {
            return sys::OMPI_SUCCESS;
        }
        // SAFETY: the PML passes nprocs valid proc pointers.
        let procs = unsafe { std::slice::from_raw_parts_mut(procs, nprocs) };
        match add_procs_inner(procs) {
            Ok(()) => sys::OMPI_SUCCESS,
            Err(rc) => rc,
        }
    })
}

extern "C" fn mtl_del_procs(
    _m: *mut sys::mca_mtl_base_module_t,
    nprocs: usize,
    procs: *mut *mut sys::ompi_proc_t,
) -> c_int {
    ffi_guard("mtl del_procs", sys::OMPI_ERROR, || {
        if nprocs == 0 || procs.is_null() {
            return sys::OMPI_SUCCESS;
        }
        // SAFETY: as in add_procs.
        let procs = unsafe { std::slice::from_raw_parts(procs, nprocs) };
        if let Some(res) = lock(&RESOURCES).as_mut() {
            release_peers(res, Some(procs));
        }
        sys::OMPI_SUCCESS
    })
}

extern "C" fn mtl_add_comm(
    _m: *mut sys::mca_mtl_base_module_t,
    comm: *mut sys::ompi_communicator_t,
) -> c_int {
    ffi_guard("mtl add_comm", sys::OMPI_ERROR, || {
        // SAFETY: MODULE is initialised before the PML adds communicators.
        let max = unsafe { (*MODULE.get()).mtl_max_contextid } as u32;
        // SAFETY: comm is live.
        let cid = unsafe { (*comm).c_contextid };
        // Open MPI hands out ids below mtl_max_contextid and fails the next
        // communicator creation itself (MPI_ERR_INTERN, without a word and without
        // calling us) once they are all taken: the last id is where we can say why.
        if cid.saturating_add(1) >= max && !CID_WARNED.swap(true, Ordering::Relaxed) {
            log::warn!(
                "communicator id {cid} is the last one the MTL's tag mode ({}) can carry \
                 ({max} ids): once all are in use, creating another communicator fails with \
                 MPI_ERR_INTERN until some are freed; mtl_ofi_tag_mode=ofi_tag_2 or \
                 ofi_tag_full carries more where the provider allows it",
                state::with_mtl(|m| m.map_or("?", |m| m.layout.mode.name()))
            );
        }
        if cid >= max {
            log::error!(
                "communicator id {cid} does not fit the MTL's tag mode (ids below {max}): \
                 the communicator cannot be used"
            );
            return sys::OMPI_ERR_OUT_OF_RESOURCE;
        }
        sys::OMPI_SUCCESS
    })
}

extern "C" fn mtl_del_comm(
    _m: *mut sys::mca_mtl_base_module_t,
    _comm: *mut sys::ompi_communicator_t,
) -> c_int {
    sys::OMPI_SUCCESS
}

extern "C" fn mtl_finalize(_m: *mut sys::mca_mtl_base_module_t) -> c_int {
    ffi_guard("mtl finalize", sys::OMPI_ERROR, || {
        finalize();
        sys::OMPI_SUCCESS
    })
}

/// Tear everything down (idempotent): progress, state, peers, then the objects.
pub fn finalize() {
    let p = state::MTL.swap(ptr::null_mut(), Ordering::AcqRel);
    let m = if p.is_null() {
        None
    } else {
        // SAFETY: unregistering the callback we registered.
        unsafe { sys::opal_progress_unregister(Some(progress::progress_cb)) };
        // SAFETY: p came from Box::into_raw in init_module and the PML no longer calls us.
        Some(unsafe { Box::from_raw(p) })
    };
    // Small sends of software matching completed when posted, from copies, and
    // control messages waiting for the send window: let them leave before the
    // endpoint closes (a peer may still be waiting for them).
    if let Some(m) = m.as_deref() {
        if let Some(sm) = m.soft.as_deref() {
            let start = std::time::Instant::now();
            while sm.sends_left() > 0 {
                if start.elapsed() > std::time::Duration::from_secs(10) {
                    log::warn!(
                        "finalize: {} small sends still in flight after 10 s; closing anyway",
                        sm.sends_left()
                    );
                    break;
                }
                progress::progress_mtl(m);
            }
        }
    }
    let fbox_sent = fbox_sent();
    // Close the endpoint first: only then can nothing write into the memory that
    // receives were posted with (bounce buffers, the overflow area).
    if let Some(mut res) = lock(&RESOURCES).take() {
        release_peers(&mut res, None);
        drop(res);
    }
    if let Some(mut m) = m {
        super::stall::discard_all(&m);
        overflow_unmap(&m);
        if let Some(sm) = m.soft.as_mut() {
            sm.free_bounces();
        }
        let c = &m.counters;
        log::debug!(
            "finalize: {} completion errors, {} EAGAIN retries, {} messages taken off a full \
             receive queue, {} peeked there that another receive took first, {} messages \
             assembled from pieces, {} received messages rejected, {} messages sent and {} \
             received through fast boxes",
            c.cq_errors.load(Ordering::Relaxed),
            c.eagain.load(Ordering::Relaxed),
            c.stalls_broken.load(Ordering::Relaxed),
            c.exact_lost.load(Ordering::Relaxed),
            m.soft
                .as_ref()
                .map_or(0, |sm| sm.assembled.load(Ordering::Relaxed)),
            c.bad_envelopes.load(Ordering::Relaxed)
                + m.soft
                    .as_ref()
                    .map_or(0, |sm| sm.rejected.load(Ordering::Relaxed)),
            fbox_sent,
            m.soft
                .as_ref()
                .map_or(0, |sm| sm.fbox_received.load(Ordering::Relaxed))
        );
        if !c.per_ctx.is_empty() {
            let counts: Vec<u64> = c
                .per_ctx
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect();
            log::info!("completions per scalable-endpoint context: {counts:?}");
        }
    }
}
