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

use crate::fabric::{AddressVector, CompletionQueue, Domain, Endpoint, Error, Hints, InfoRef};
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

fn is_shm(provider: &str) -> bool {
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
    ep.enable().map_err(|e| ("fi_enable", e))?;
    Ok(ep)
}

#[cfg(test)]
mod tests {
    use super::is_shm;

    #[test]
    fn only_the_shm_provider_is_renamed() {
        assert!(is_shm("shm"));
        assert!(!is_shm("tcp;ofi_rxm"));
        assert!(!is_shm("shmx"));
        assert!(!is_shm("efa"));
    }
}
