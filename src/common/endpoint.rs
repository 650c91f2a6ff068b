//! The endpoint each component opens: `fi_endpoint`, the CQ and AV bindings and
//! `fi_enable`, with the one recovery a user cannot do by hand.
//!
//! The shm provider names its shared-memory region after the process id
//! (`/dev/shm/<pid>:<uid>:<endpoint index>`) and refuses to enable (`-FI_EBUSY`) when
//! that file exists. A job that was killed leaves its regions behind, and process ids
//! come round again (`kernel.pid_max` is 32768 on many systems), so a later, unrelated
//! job would fail at start-up with "Device or resource busy". The file belongs to a
//! process that no longer exists or to one we cannot touch, so it is left alone: the
//! endpoint is opened again under a name of its own, which peers learn through the
//! modex as usual.

use crate::fabric::{
    AddressVector, CompletionQueue, CqAttr, Domain, Endpoint, Error, Hints, InfoRef,
};
use libfabric_sys as fi;
use std::sync::Arc;

/// Names tried after the default one is taken.
const RENAME_ATTEMPTS: u32 = 4;

/// Open, bind (one CQ for transmit and receive, one AV) and enable an endpoint for
/// `info` on `dom`. The error names the call that failed and the provider.
pub fn open_enabled(
    dom: &Arc<Domain>,
    info: InfoRef<'_>,
    cq: &Arc<CompletionQueue>,
    av: &Arc<AddressVector>,
) -> Result<Endpoint, String> {
    let provider = info.provider_name().to_string();
    let fail = |(what, err): (&str, Error)| format!("{what} on {provider}: {err}");
    let first = attempt(dom, info, cq, av);
    if !matches!(first, Err(("fi_enable", e)) if e == Error::BUSY) || !is_shm(&provider) {
        return first.map_err(fail);
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    for n in 1..=RENAME_ATTEMPTS {
        let name = format!("fi_shm://{}_{stamp:x}_{n}", std::process::id());
        let hints = Hints::from_info(info).map_err(|e| fail(("fi_dupinfo", e)))?;
        let hints = hints.src_addr_str(&name);
        if let Some(e) = hints.error() {
            return Err(fail(("setting src_addr", e)));
        }
        match attempt(dom, hints.info(), cq, av) {
            Ok(ep) => {
                log::info!(
                    "{provider}: the default shared-memory name of this process is taken \
                     (a region left in /dev/shm by an earlier process with the same pid); \
                     using {}",
                    &name["fi_shm://".len()..]
                );
                return Ok(ep);
            }
            Err(("fi_enable", e)) if e == Error::BUSY => continue,
            Err(other) => return Err(fail(other)),
        }
    }
    first.map_err(fail)
}

/// `rx_ctx_bits` for an AV whose peers have `contexts` receive contexts: enough bits
/// for the index (0 with one context, i.e. no scalable endpoint).
pub fn rx_ctx_bits(contexts: usize) -> u32 {
    if contexts > 1 {
        usize::BITS - contexts.leading_zeros()
    } else {
        0
    }
}

/// `fi_rx_addr(addr, index, bits)`: `addr` aimed at the peer's receive context `index`.
#[inline(always)]
pub fn rx_addr(addr: fi::fi_addr_t, index: usize, bits: u32) -> fi::fi_addr_t {
    if bits == 0 {
        addr
    } else {
        addr | ((index as u64) << (64 - bits))
    }
}

/// The contexts a scalable endpoint of this process may have: `asked` (the value of
/// parameter `param`), capped at the provider's contexts per endpoint shared by the
/// `local_ranks` ranks of this node, with a warning when the cap bites.
pub fn contexts_within(asked: usize, info: InfoRef<'_>, local_ranks: usize, param: &str) -> usize {
    let max = (info.max_ep_ctx() / local_ranks.max(1)).max(1);
    if asked > max {
        log::warn!(
            "{param}={asked}: provider {} offers {} contexts per endpoint, {max} for each of the \
             {local_ranks} ranks on this node; using {max}",
            info.provider_name(),
            info.max_ep_ctx()
        );
    }
    asked.min(max)
}

/// One transmit/receive context pair of a scalable endpoint and the CQ both report
/// to (each context keeps the scalable endpoint open).
pub struct ScalableContext {
    pub tx: Endpoint,
    pub rx: Endpoint,
    pub cq: Arc<CompletionQueue>,
}

/// Open a scalable endpoint with `contexts` transmit and receive contexts for `info`
/// on `dom`, bind `av` (opened with `rx_ctx_bits` for them) and enable it; then give
/// each of the first `used` context pairs a CQ of its own and enable them. The error
/// names the call that failed and the provider.
pub fn open_scalable_enabled(
    dom: &Arc<Domain>,
    info: InfoRef<'_>,
    av: &Arc<AddressVector>,
    contexts: usize,
    used: usize,
) -> Result<(Arc<Endpoint>, Vec<ScalableContext>), String> {
    let provider = info.provider_name().to_string();
    let e = |what: &str, err: Error| format!("{what} on {provider}: {err}");
    let h = Hints::from_info(info)
        .map_err(|x| e("fi_dupinfo", x))?
        .ctx_cnt(contexts);
    if let Some(x) = h.error() {
        return Err(e("setting the context counts", x));
    }
    let sep = Arc::new(Endpoint::open_scalable(dom, h.info()).map_err(|x| e("fi_scalable_ep", x))?);
    sep.bind_av(av)
        .map_err(|x| e("fi_scalable_ep_bind(av)", x))?;
    set_options(&sep, &provider);
    sep.enable()
        .map_err(|x| e("fi_enable(scalable endpoint)", x))?;
    let mut ctxs = Vec::with_capacity(used);
    for i in 0..used {
        let cq = CompletionQueue::open(dom, &CqAttr::default()).map_err(|x| e("fi_cq_open", x))?;
        let tx = sep.tx_context(i).map_err(|x| e("fi_tx_context", x))?;
        let rx = sep.rx_context(i).map_err(|x| e("fi_rx_context", x))?;
        tx.bind_cq(&cq, fi::FI_TRANSMIT as u64)
            .map_err(|x| e("fi_ep_bind(tx context, cq)", x))?;
        rx.bind_cq(&cq, fi::FI_RECV as u64)
            .map_err(|x| e("fi_ep_bind(rx context, cq)", x))?;
        tx.enable().map_err(|x| e("fi_enable(tx context)", x))?;
        rx.enable().map_err(|x| e("fi_enable(rx context)", x))?;
        ctxs.push(ScalableContext { tx, rx, cq });
    }
    Ok((sep, ctxs))
}

/// The endpoint options of `opal_common_ofi_*` parameters, set before `fi_enable`
/// (efa refuses `FI_OPT_EFA_RNR_RETRY` on an enabled endpoint). A value the provider
/// has no option for, or refuses, leaves its default and gives a warning, once per
/// process: the job still runs, as it would without the parameter.
fn set_options(ep: &Endpoint, provider: &str) {
    let rnr = super::with_params(|p| p.int(super::idx::EFA_RNR_RETRY)).unwrap_or(-1);
    if rnr < 0 {
        return;
    }
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let warn_once = |msg: String| {
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            log::warn!("{msg}");
        }
    };
    if provider.split(';').next() != Some("efa") {
        warn_once(format!(
            "opal_common_ofi_efa_rnr_retry={rnr} is ignored: it sets FI_OPT_EFA_RNR_RETRY, an \
             option of the efa provider only, and this endpoint is {provider}"
        ));
        return;
    }
    let value = rnr as usize;
    // SAFETY: FI_OPT_EFA_RNR_RETRY takes a size_t (fi_ext.h; efa checks the length).
    match unsafe { ep.setopt(fi::FI_OPT_ENDPOINT as i32, fi::FI_OPT_EFA_RNR_RETRY, &value) } {
        Ok(()) => log::debug!("{provider}: FI_OPT_EFA_RNR_RETRY set to {value}"),
        Err(err) => warn_once(format!(
            "opal_common_ofi_efa_rnr_retry={rnr}: {provider} refused FI_OPT_EFA_RNR_RETRY \
             ({err}); its endpoints keep the provider's default retry count"
        )),
    }
}

/// Whether `provider` (a name as `fi_info` gives it, perhaps `core;utility`) is shm.
pub fn is_shm(provider: &str) -> bool {
    provider.split(';').next() == Some("shm")
}

fn attempt(
    dom: &Arc<Domain>,
    info: InfoRef<'_>,
    cq: &Arc<CompletionQueue>,
    av: &Arc<AddressVector>,
) -> Result<Endpoint, (&'static str, Error)> {
    let ep = Endpoint::open(dom, Some(info)).map_err(|e| ("fi_endpoint", e))?;
    ep.bind_cq(cq, (fi::FI_TRANSMIT | fi::FI_RECV) as u64)
        .map_err(|e| ("fi_ep_bind(cq)", e))?;
    ep.bind_av(av).map_err(|e| ("fi_ep_bind(av)", e))?;
    set_options(&ep, info.provider_name());
    ep.enable().map_err(|e| ("fi_enable", e))?;
    Ok(ep)
}

#[cfg(test)]
mod tests {
    use super::{is_shm, rx_addr, rx_ctx_bits};

    #[test]
    fn receive_context_addressing_as_fi_rx_addr() {
        assert_eq!(rx_ctx_bits(1), 0);
        assert_eq!(rx_ctx_bits(2), 2);
        assert_eq!(rx_ctx_bits(4), 3);
        assert_eq!(rx_ctx_bits(16), 5);
        assert_eq!(rx_addr(7, 3, 0), 7);
        assert_eq!(rx_addr(7, 3, 3), 7 | (3u64 << 61));
        assert_eq!(rx_addr(7, 0, 3), 7);
    }

    #[test]
    fn only_the_shm_provider_is_renamed() {
        assert!(is_shm("shm"));
        assert!(!is_shm("tcp;ofi_rxm"));
        assert!(!is_shm("shmx"));
        assert!(!is_shm("efa"));
    }
}
