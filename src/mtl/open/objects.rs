//! Opening the MTL's fabric objects on the chosen domain: the address vector, and the
//! regular endpoint with its completion queue or a scalable endpoint's contexts, each
//! with its own.
//!
//! What it owns: the objects until `start` keeps them in `setup::RESOURCES`. What it
//! must not touch: the domain's choice, and the settings of the data path.

use super::provider::Chosen;
use super::{param, Config};
use crate::common::endpoint;
use crate::fabric::{AddressVector, AvAttr, CompletionQueue, CqAttr, Endpoint, InfoRef};
use crate::mtl::state;
use crate::ompi::params::mtl as idx;
use std::sync::Arc;

/// The objects the MTL opened.
pub(super) struct Objects {
    /// The endpoint, or a scalable endpoint's contexts (each keeps the scalable
    /// endpoint open); closed before the CQs.
    pub(super) eps: Vec<Endpoint>,
    pub(super) cqs: Vec<Arc<CompletionQueue>>,
    /// What the data path posts on (moved into the state).
    pub(super) ctxs: Vec<state::Ctx>,
    pub(super) av: Arc<AddressVector>,
    /// The endpoint name, for the modex.
    pub(super) name: Vec<u8>,
    /// Contexts opened (1 without a scalable endpoint).
    pub(super) nctx: usize,
    /// Contexts that carry traffic: all with thread grouping, else context 0.
    pub(super) used: usize,
    /// `rx_ctx_bits` of the AV (0 without a scalable endpoint).
    pub(super) rx_ctx_bits: u32,
}

/// Open the address vector and the endpoint (or the scalable endpoint's contexts).
/// Clears `cfg.want_sep` where a scalable endpoint cannot be had.
pub(super) fn open_objects(
    cfg: &mut Config,
    chosen: &Chosen,
    provider: &str,
) -> Result<Objects, String> {
    let info = chosen.domain.info();
    let e = |what: &str, err: crate::fabric::Error| format!("{what} on {provider}: {err}");
    let ctx_of = |tx: &Endpoint, rx: &Endpoint, cq: &CompletionQueue| {
        // SAFETY: the owners go into the Objects returned, which setup keeps in its
        // resources until finalize, after it took the state holding the Ctx out of MTL.
        unsafe { state::Ctx::new(tx, rx, cq) }
            .ok_or_else(|| format!("the completion queue on {provider} is not tagged"))
    };
    let dom = chosen.domain.domain().clone();
    let nctx = contexts(cfg, info, chosen.soft, provider);
    // Without thread grouping only context 0 carries traffic (as in the C MTL).
    let used = if cfg.grouping { nctx } else { 1 };
    // As the C MTL: the bit length of the context count, also for one context.
    let rx_ctx_bits = if cfg.want_sep {
        endpoint::rx_ctx_bits(nctx).max(1)
    } else {
        0
    };
    let av = AddressVector::open(
        &dom,
        &AvAttr {
            av_type: cfg.av_type,
            count: cfg.world.max(1) * nctx,
            rx_ctx_bits: rx_ctx_bits as i32,
        },
    )
    .map_err(|x| e("fi_av_open", x))?;
    let mut eps = Vec::new();
    let mut cqs = Vec::new();
    let mut ctxs = Vec::new();
    let name;
    if cfg.want_sep {
        let (sep, contexts) = endpoint::open_scalable_enabled(&dom, info, &av, nctx, used)?;
        name = sep.getname().map_err(|x| e("fi_getname", x))?;
        for c in contexts {
            ctxs.push(ctx_of(&c.tx, &c.rx, &c.cq)?);
            eps.push(c.tx);
            eps.push(c.rx);
            cqs.push(c.cq);
        }
    } else {
        let cq = CompletionQueue::open(&dom, &CqAttr::default()).map_err(|x| e("fi_cq_open", x))?;
        let ep = endpoint::open_enabled(&dom, info, &cq, &av)?;
        name = ep.getname().map_err(|x| e("fi_getname", x))?;
        ctxs.push(ctx_of(&ep, &ep, &cq)?);
        eps.push(ep);
        cqs.push(cq);
    }
    Ok(Objects {
        eps,
        cqs,
        ctxs,
        av,
        name,
        nctx,
        used,
        rx_ctx_bits,
    })
}

/// The number of contexts: 1 without a scalable endpoint; with one, as many as asked,
/// within the provider's limit shared by the ranks of this node (as the C MTL
/// provisions them).
fn contexts(cfg: &mut Config, info: InfoRef<'_>, soft: bool, provider: &str) -> usize {
    if cfg.want_sep && soft {
        log::warn!(
            "mtl_ofi_enable_sep=1: not with software matching (provider {provider}); \
             one regular endpoint is used"
        );
        cfg.want_sep = false;
    } else if cfg.want_sep && info.max_ep_ctx() < 2 {
        log::warn!(
            "mtl_ofi_enable_sep=1: provider {provider} offers no scalable endpoints (at most {} \
             transmit/receive contexts per endpoint); one regular endpoint is used",
            info.max_ep_ctx()
        );
        cfg.want_sep = false;
    }
    if !cfg.want_sep {
        if param(idx::NUM_CTXTS) > 1 && param(idx::ENABLE_SEP) == 0 {
            log::warn!("mtl_ofi_num_ctxts applies only with mtl_ofi_enable_sep=1; ignored");
        }
        1
    } else {
        endpoint::contexts_within(
            param(idx::NUM_CTXTS).max(1) as usize,
            info,
            cfg.local_peers + 1,
            "mtl_ofi_num_ctxts",
        )
    }
}
