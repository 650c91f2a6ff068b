//! The shared fabric and domain: one per process for the BTL and the MTL when their
//! needs are compatible, reference counted, and the order of the memory monitor
//! around them (set up after the first `fi_getinfo` and before the first `fi_domain`,
//! torn down after the last domain closes).
//!
//! What it owns: the list of open domains and the count of handles. It must not know
//! what the components do with their domains.

use super::select::{self, Selection};
use crate::fabric::{Domain, Error, Fabric, Hints, InfoRef, OwnedInfo};
use crate::ompi::params::common as idx;
use libfabric_sys as fi;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

/// What a component asks of the common layer.
pub struct DomainRequest {
    /// "btl" or "mtl", for messages.
    pub component: &'static str,
    pub hints: Hints,
    /// If nothing matches `hints`, try again with this threading level.
    pub threading_fallback: Option<fi::fi_threading>,
    /// Some peers of the job are on other hosts (no loopback NIC then).
    pub spans_hosts: bool,
}

/// Why a component declines, in words for the user.
#[derive(Debug, Clone)]
pub struct Decline(pub String);

impl fmt::Display for Decline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

struct Shared {
    domain: Arc<Domain>,
    info: OwnedInfo,
}

/// A component's reference to a shared domain. Dropping the last handle closes the
/// domain and then tears the memory monitor down.
pub struct DomainHandle {
    /// Dropped by hand in `Drop`, before the monitor may be torn down.
    shared: std::mem::ManuallyDrop<Arc<Shared>>,
    /// The entry selected for this component (its endpoint is opened from it).
    info: OwnedInfo,
}

impl DomainHandle {
    /// The entry selected for this component.
    pub fn info(&self) -> InfoRef<'_> {
        self.info.info()
    }
    pub fn domain(&self) -> &Arc<Domain> {
        &self.shared.domain
    }
    pub fn threading(&self) -> fi::fi_threading {
        self.shared.domain.threading()
    }
}

struct Registry {
    domains: Vec<Weak<Shared>>,
    handles: usize,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    domains: Vec::new(),
    handles: 0,
});

fn lock() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drop for DomainHandle {
    fn drop(&mut self) {
        let mut reg = lock();
        reg.handles = reg.handles.saturating_sub(1);
        // The domain closes here if we held the last reference.
        // SAFETY: `shared` is dropped exactly once, here, and never used afterwards.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.shared) };
        reg.domains.retain(|w| w.strong_count() > 0);
        if reg.handles == 0 {
            // Free the list itself too: Open MPI may dlclose us next, and a static's
            // heap buffer would outlive the library (valgrind: definitely lost).
            reg.domains = Vec::new();
            drop(reg);
            super::monitor_teardown();
        }
    }
}

fn list_param(p: &crate::ompi::params::Registered, i: usize) -> Option<Vec<String>> {
    p.string(i)
        .map(|s| select::parse_list(&s))
        .filter(|v| !v.is_empty())
}

/// Select a provider for `req`, set up the memory monitor, and open (or share) the
/// domain. On failure the component declines with the returned message.
pub fn open_domain(req: DomainRequest) -> Result<DomainHandle, Decline> {
    let (include, mut exclude, exclude_set, monitor_choice, checked, mut nics, rxm_rx_size) =
        super::with_params(|p| {
            (
                list_param(p, idx::PROVIDER_INCLUDE),
                list_param(p, idx::PROVIDER_EXCLUDE),
                p.is_set(idx::PROVIDER_EXCLUDE),
                p.enum_name(idx::MEMORY_MONITOR)
                    .unwrap_or("auto")
                    .to_string(),
                p.check(),
                select::NicPolicy {
                    include: list_param(p, idx::NIC_INCLUDE),
                    exclude: list_param(p, idx::NIC_EXCLUDE),
                    spans_hosts: false,
                },
                p.int(idx::RXM_MSG_RX_SIZE),
            )
        })
        .ok_or_else(|| Decline("the common OFI parameters were not registered".into()))?;
    checked.map_err(Decline)?;
    if include.is_some() && exclude.is_some() {
        if exclude_set {
            log::warn!("{}", select::both_set_warning());
        }
        exclude = None;
    }
    if nics.include.is_some() && nics.exclude.is_some() {
        log::warn!(
            "both opal_common_ofi_nic_include and opal_common_ofi_nic_exclude are set: using the \
             include list and ignoring the exclude list"
        );
        nics.exclude = None;
    }
    nics.spans_hosts = req.spans_hosts;

    // Before the first fi_getinfo: libfabric reads its own monitor choice and its
    // providers' variables when it initialises, and the export into it must precede
    // the first fi_domain.
    set_rxm_prepost(rxm_rx_size);
    super::monitor_prepare(&monitor_choice)?;

    let opened = open_prepared(req, include, exclude, nics);
    // A decline after the monitor was set up (no provider, say) must not leave the
    // export behind: Open MPI unloads a component that declines, and libfabric and
    // Open MPI's hooks would keep pointers into the unloaded library (seen: a
    // segfault at exit after the BTL declined for lack of a provider).
    if opened.is_err() && lock().handles == 0 {
        super::monitor_teardown();
    }
    opened
}

/// `opal_common_ofi_rxm_msg_rx_size` as `FI_OFI_RXM_MSG_RX_SIZE`, once per process,
/// unless the user set the variable. With a shared receive context (its default over
/// tcp) ofi_rxm posts 4096 eager buffers of 16 KiB unless told otherwise: 64 MiB per
/// process before the first message, most of the 100 MiB an 8-rank hello world took
/// per rank over tcp (the C MTL's too). It posts a new buffer for each one a message
/// takes, so fewer in advance does not cap unexpected messages.
fn set_rxm_prepost(n: i64) {
    const VAR: &str = "FI_OFI_RXM_MSG_RX_SIZE";
    static DONE: std::sync::Once = std::sync::Once::new();
    if n <= 0 {
        return;
    }
    DONE.call_once(|| {
        if let Ok(v) = std::env::var(VAR) {
            log::info!("{VAR}={v} from the environment (opal_common_ofi_rxm_msg_rx_size={n} not applied)");
            return;
        }
        if super::monitor::libfabric_initialised() {
            log::info!(
                "libfabric was initialised before this component: opal_common_ofi_rxm_msg_rx_size={n} \
                 ({VAR}) may not take effect"
            );
        }
        // setenv races with getenv on other threads; at component open Open MPI's helper
        // threads do not read it, and libfabric reads it in fi_ini, which this precedes.
        std::env::set_var(VAR, n.to_string());
        log::debug!("{VAR}={n} (opal_common_ofi_rxm_msg_rx_size)");
    });
}

fn open_prepared(
    req: DomainRequest,
    include: Option<Vec<String>>,
    exclude: Option<Vec<String>>,
    nics: select::NicPolicy,
) -> Result<DomainHandle, Decline> {
    let local_rank = crate::ompi::proc::local_rank() as u32;
    let locality = super::locality::pci_distance;
    let criteria = select::Criteria {
        include: include.as_deref(),
        exclude: exclude.as_deref(),
        local_rank,
        locality: Some(&locality),
        nics,
    };
    let mut selection = select::select_provider(&req.hints, &criteria);
    if matches!(selection, Err(Error::NODATA)) {
        if let Some(t) = req.threading_fallback {
            let hints = req
                .hints
                .try_clone()
                .map_err(|e| Decline(format!("cannot copy fi_info hints: {e}")))?
                .threading(t);
            selection = select::select_provider(&hints, &criteria);
        }
    }
    let sel: Selection = selection.map_err(|e| {
        Decline(match e {
            Error::NODATA => format!(
                "no OFI provider offers what the {} needs{}{}{}",
                req.component,
                include
                    .as_ref()
                    .map(|i| format!(", among opal_common_ofi_provider_include={}", i.join(",")))
                    .unwrap_or_default(),
                exclude
                    .as_ref()
                    .map(|x| format!(", after opal_common_ofi_provider_exclude={}", x.join(",")))
                    .unwrap_or_default(),
                nic_note(&criteria.nics),
            ),
            e => format!("fi_getinfo failed: {e}"),
        })
    })?;

    let mut reg = lock();
    reg.domains.retain(|w| w.strong_count() > 0);
    let chosen = sel.info.info();
    let found = reg.domains.iter().filter_map(|w| w.upgrade()).find(|s| {
        let i = s.info.info();
        i.provider_name() == chosen.provider_name()
            && i.fabric_name() == chosen.fabric_name()
            && i.domain_name() == chosen.domain_name()
            && i.caps() & chosen.caps() == chosen.caps()
            && i.mr_mode() == chosen.mr_mode()
            && s.domain.threading() == chosen.threading()
            // A component that asked for manual progress (the MTL on sockets) must
            // not get a domain opened for automatic progress, nor the other way round.
            && i.data_progress() == chosen.data_progress()
            && i.control_progress() == chosen.control_progress()
    });
    let shared = match found {
        Some(s) => {
            log::info!(
                "{}: sharing the domain {} opened by the other component",
                req.component,
                chosen.domain_name()
            );
            s
        }
        None => {
            let fabric = Fabric::open(chosen)
                .map_err(|e| Decline(format!("fi_fabric on {}: {e}", sel.provider)))?;
            let domain = Domain::open(&fabric, chosen)
                .map_err(|e| Decline(format!("fi_domain on {}: {e}", sel.provider)))?;
            let info = chosen
                .to_owned()
                .map_err(|e| Decline(format!("fi_dupinfo: {e}")))?;
            let s = Arc::new(Shared { domain, info });
            reg.domains.push(Arc::downgrade(&s));
            s
        }
    };
    reg.handles += 1;
    Ok(DomainHandle {
        shared: std::mem::ManuallyDrop::new(shared),
        info: sel.info,
    })
}

/// The NIC restrictions, for a decline message.
fn nic_note(nics: &select::NicPolicy) -> String {
    let mut s = String::new();
    if let Some(i) = &nics.include {
        s += &format!(", on NICs opal_common_ofi_nic_include={}", i.join(","));
    } else if let Some(x) = &nics.exclude {
        s += &format!(", without NICs opal_common_ofi_nic_exclude={}", x.join(","));
    }
    if nics.spans_hosts {
        s += " (the job spans hosts: no loopback NIC, and no provider limited to one host)";
    }
    s
}
