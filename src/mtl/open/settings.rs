//! The data path's settings, decided from the domain and the provider's policy
//! (`common::policy`), and the state built from them: the lock, the overflow area, the
//! receive budget and, for software matching, its receive buffers, pieces, send window
//! and fast boxes.
//!
//! What it owns: the state until `start` hands it to the data path. What it must not
//! touch: the fabric objects beyond setting the endpoint's multi-receive minimum.

use super::objects::Objects;
use super::provider::{Chosen, Tags};
use super::{param, Config};
use crate::common::fbox;
use crate::common::sync::Threads;
use crate::fabric::Endpoint;
use crate::mtl::ack;
use crate::mtl::setup::overflow_area;
use crate::mtl::softmatch::{self, SoftMatch};
use crate::mtl::state::{self, Mtl};
use crate::ompi::params::mtl as idx;
use libfabric_sys as fi;
use std::sync::atomic::AtomicU32;

/// Every fabric call is serialised under MPI_THREAD_MULTIPLE, even when the provider
/// claims FI_THREAD_SAFE: udp;ofi_rxd hangs with concurrent callers (threads test).
pub(super) fn threaded_lock(cfg: &Config) -> bool {
    cfg.mpi_threads
}

/// The thread level the data path's locks are built for (`threaded_lock`).
fn threads(cfg: &Config) -> Threads {
    // SAFETY: cfg.mpi_threads is Open MPI's enable_mpi_threads of the MTL's init: false
    // only when one thread at a time calls into MPI.
    unsafe { Threads::of(threaded_lock(cfg)) }
}

/// The state the data path reads, with software matching set up where it is used.
pub(super) fn build_state(
    cfg: &Config,
    chosen: &Chosen,
    tags: &Tags,
    objects: &mut Objects,
    provider: &str,
) -> Result<Box<Mtl>, String> {
    let info = chosen.domain.info();
    let policy = &chosen.policy;
    // The depth of the provider's receive queue: the MTL keeps part of it for Open
    // MPI's own receives (state::RxBudget).
    // The acknowledgement pool of synchronous sends takes its receives off the top.
    let acks = ack::pool_size(info.rx_size());
    let rx = state::RxBudget::new(
        match info.rx_size() {
            0 => 0,
            n => n.saturating_sub(acks).max(1),
        },
        cfg.mpi_threads,
    );
    let overflow = if policy.overflow_receives {
        overflow_area(info.max_msg_size())
    } else {
        None
    };
    let used = objects.used;
    let mut state = Box::new(Mtl {
        ctxs: std::mem::take(&mut objects.ctxs).into_boxed_slice(),
        rx_ctx_bits: objects.rx_ctx_bits,
        layout: tags.layout,
        inject_size: info.inject_size(),
        // Only the full layout needs directed receives (the source is not in the tag);
        // the others match the source in the tag bits.
        directed: tags.directed && tags.layout.source_in_data(),
        lazy_matching: policy.lazy_matching,
        events_per_progress: param(idx::PROGRESS_EVENT_CNT).max(1) as usize,
        lock: crate::common::sync::MaybeLock::new(threads(cfg)),
        overflow,
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
        acks: ack::Acks::new(acks),
    });
    if chosen.soft {
        let sm = software_matching(cfg, chosen, &objects.eps[0], &state, provider)?;
        state.soft = Some(sm);
    }
    Ok(state)
}

/// Software matching: its receive buffers (posted here), the pieces eager messages
/// travel in, its send window and, on shm, its fast boxes.
fn software_matching(
    cfg: &Config,
    chosen: &Chosen,
    ep: &Endpoint,
    state: &Mtl,
    provider: &str,
) -> Result<Box<SoftMatch>, String> {
    let policy = &chosen.policy;
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
    let pieces = policy.sends_in_pieces() && state.inject_size > 2 * softmatch::HDR_LEN;
    let piece_max = if pieces {
        state.inject_size.min(softmatch::PIECE_BUF)
    } else {
        0
    };
    let pieces_eager_max = if !pieces {
        0
    } else if policy.one_packet_sends {
        softmatch::PIECES_EAGER_MAX
    } else {
        softmatch::SLOW_SEND_EAGER_INJECTS * (piece_max - softmatch::HDR_LEN)
    };
    let bounce = if pieces {
        piece_max
    } else if policy.large_bounces {
        softmatch::BOUNCE_LARGE
    } else {
        softmatch::BOUNCE_SMALL
    };
    let multi = multi_receive(chosen, ep, bounce, provider);
    let mut sm = Box::new(SoftMatch::new(
        chosen.domain.domain().clone(),
        threads(cfg),
        bounce,
        piece_max,
        multi,
        policy.restore_order,
        policy.send_window,
        pieces_eager_max,
    ));
    sm.post_bounces(state)
        .map_err(|rc| format!("posting receive buffers failed ({rc})"))?;
    // Fast boxes (softmatch, common::fbox): on shm, with peers on the node.
    if crate::common::endpoint::is_shm(provider) && cfg.local_peers > 0 && sm.fbox_fits() {
        let sizes = fbox::Sizes::new("mtl_ofi_fbox_size", cfg.fbox_size, sm.fbox_record_max())?;
        if let Some(sizes) = sizes {
            match fbox::Rx::create(cfg.local_peers + 1, sizes, 1) {
                Ok(rx) => sm.fbox = Some(rx),
                Err(e) => log::info!("provider {provider}: no fast boxes: {e}"),
            }
        }
    }
    Ok(sm)
}

/// Multi-receive buffers where the endpoint has them, the policy allows them and the
/// endpoint takes the minimum free space: a largest message (`bounce`) must always
/// fit the rest of a buffer.
fn multi_receive(chosen: &Chosen, ep: &Endpoint, bounce: usize, provider: &str) -> bool {
    if !chosen.policy.multi_recv {
        log::info!(
            "provider {provider}: multi-receive buffers lose messages here \
             (common::quirks); one receive buffer per message"
        );
    }
    chosen.domain.info().caps() & fi::FI_MULTI_RECV as u64 != 0 && chosen.policy.multi_recv && {
        // SAFETY: FI_OPT_MIN_MULTI_RECV takes a size_t, and `bounce` is one that lives
        // for the call (the provider copies it).
        match unsafe {
            ep.setopt(
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
    }
}
