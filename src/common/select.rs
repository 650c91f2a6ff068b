//! Provider selection: which `fi_info` entry the components open.
//!
//! Three steps, each usable on its own:
//! 1. the include/exclude lists of `opal_common_ofi_provider_include/exclude`, matched
//!    exactly as Open MPI 4.1.4's common/ofi does ([`is_in_list`], [`filter_providers`]);
//! 2. the first remaining provider in libfabric's order;
//! 3. among that provider's entries on the same fabric, one NIC (domain) per process:
//!    the closest by PCI locality when the provider reports bus attributes and the
//!    caller can measure distance, otherwise spread by local rank ([`choose_nic`]).
//!
//! [`select_provider`] does all three on a fresh `fi_getinfo`. The hwloc query and the
//! MCA parameters belong to the component; they come in as arguments. This module holds
//! no `unsafe` code.

use crate::fabric::{Error, Hints, InfoList, InfoRef, OwnedInfo, PciAddr, Result};

/// Open MPI's default `provider_exclude` (4.1.4's list plus `net`, the 1.17 successor of
/// `tcp`): providers that are slow or local-only. Every provider on a machine without
/// RDMA hardware is in it, so jobs there set an include list.
pub const DEFAULT_EXCLUDE: &str = "shm,sockets,tcp,udp,rstream,usnic,net";

/// What the component prints when both lists are set: like the C code, the include
/// list wins and the exclude list is ignored.
pub fn both_set_warning() -> &'static str {
    "both opal_common_ofi_provider_include and opal_common_ofi_provider_exclude are \
     set; they are mutually exclusive: using the include list and ignoring the exclude list"
}

/// Split a comma-separated list: entries are trimmed and empty ones dropped.
///
/// (`opal_argv_split` also drops empty entries; it does not trim, so with the C code
/// `"tcp, shm"` never matches `shm`. Trimming is a deliberate kindness.)
pub fn parse_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `opal_common_ofi_is_in_list`: `prov_name` is in `list` when some entry is a
/// case-insensitive prefix of it (`strncasecmp(item, entry, strlen(entry)) == 0`).
/// So `tcp` matches `tcp` and `tcp;ofi_rxm`, `udp` matches `udp;ofi_rxd`, but
/// `ofi_rxm` does not match `tcp;ofi_rxm` and `tcp;ofi_rxm` does not match `tcp`.
/// (An empty entry would match everything, as in C; [`parse_list`] never yields one.)
pub fn is_in_list<S: AsRef<str>>(list: &[S], prov_name: &str) -> bool {
    list.iter().any(|e| {
        let e = e.as_ref().as_bytes();
        let item = prov_name.as_bytes();
        item.len() >= e.len() && item[..e.len()].eq_ignore_ascii_case(e)
    })
}

/// Anything with a provider name, so that [`filter_providers`] works on `fi_info`
/// entries and, in tests, on plain names.
pub trait ProviderName {
    fn provider_name(&self) -> &str;
}

impl ProviderName for InfoRef<'_> {
    fn provider_name(&self) -> &str {
        InfoRef::provider_name(self)
    }
}
impl ProviderName for &str {
    fn provider_name(&self) -> &str {
        self
    }
}
impl ProviderName for String {
    fn provider_name(&self) -> &str {
        self
    }
}

/// Keep the entries the lists allow, in order. Like the C components: a non-empty
/// include list keeps only matching entries and the exclude list is then ignored;
/// otherwise a non-empty exclude list drops matching entries; an empty list counts as
/// unset (Open MPI turns an empty string parameter into NULL).
pub fn filter_providers<T: ProviderName>(
    infos: impl IntoIterator<Item = T>,
    include: Option<&[String]>,
    exclude: Option<&[String]>,
) -> Vec<T> {
    let include = include.filter(|l| !l.is_empty());
    let exclude = exclude.filter(|l| !l.is_empty());
    infos
        .into_iter()
        .filter(|i| {
            let name = i.provider_name();
            match (include, exclude) {
                (Some(inc), _) => {
                    let keep = is_in_list(inc, name);
                    if !keep {
                        log::debug!("provider {name:?} not in include list");
                    }
                    keep
                }
                (None, Some(exc)) => {
                    let drop = is_in_list(exc, name);
                    if drop {
                        log::debug!("provider {name:?} in exclude list");
                    }
                    !drop
                }
                (None, None) => true,
            }
        })
        .collect()
}

/// Distance from this process to a NIC at a PCI address (smaller is closer; `None`:
/// unknown). The component implements it with hwloc.
pub type Locality<'a> = &'a dyn Fn(&PciAddr) -> Option<u32>;

/// One NIC the chosen provider offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicCandidate {
    pub domain: String,
    pub pci: Option<PciAddr>,
}

/// How [`choose_nic`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NicMethod {
    /// Only one NIC to choose from.
    Only,
    /// Closest NICs by PCI locality, then spread by local rank among them.
    Locality { distance: u32, tied: usize },
    /// No locality information: `local_rank % n`.
    Spread,
}

/// The result of [`choose_nic`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicChoice {
    /// Index into the candidate slice.
    pub index: usize,
    pub method: NicMethod,
    /// E.g. `"domain eth1, chosen by spread (local rank 1 of 2 NICs)"`.
    pub reason: String,
}

/// Choose a NIC for the process with local rank `local_rank`. With `locality` and PCI
/// data, the NICs at the smallest distance win and ties are spread by local rank;
/// without (none of the software providers reports PCI data), `local_rank % n`.
/// `None` only for an empty slice.
pub fn choose_nic(
    candidates: &[NicCandidate],
    local_rank: u32,
    locality: Option<Locality<'_>>,
) -> Option<NicChoice> {
    let n = candidates.len();
    if n == 0 {
        return None;
    }
    if n == 1 {
        return Some(NicChoice {
            index: 0,
            method: NicMethod::Only,
            reason: format!("domain {}, the only NIC", candidates[0].domain),
        });
    }
    let distances: Vec<Option<u32>> = candidates
        .iter()
        .map(|c| match (locality, &c.pci) {
            (Some(f), Some(pci)) => f(pci),
            _ => None,
        })
        .collect();
    if let Some(best) = distances.iter().flatten().copied().min() {
        let tied: Vec<usize> = (0..n).filter(|&i| distances[i] == Some(best)).collect();
        let k = local_rank as usize % tied.len();
        let index = tied[k];
        return Some(NicChoice {
            index,
            method: NicMethod::Locality {
                distance: best,
                tied: tied.len(),
            },
            reason: format!(
                "domain {}, chosen by locality (distance {best}, local rank {local_rank} \
                 of {} NICs at that distance, {n} NICs in all)",
                candidates[index].domain,
                tied.len()
            ),
        });
    }
    let index = local_rank as usize % n;
    Some(NicChoice {
        index,
        method: NicMethod::Spread,
        reason: format!(
            "domain {}, chosen by spread (local rank {local_rank} of {n} NICs)",
            candidates[index].domain
        ),
    })
}

/// Whether `other` can stand in for `first` on another NIC: same provider and fabric,
/// same endpoint type and address format, at least the capabilities of `first`, no
/// mode bit `first` did not have, and the same inject size, message size and tag
/// format (the components size their protocols from `first`).
pub fn same_provider_entry(first: InfoRef<'_>, other: InfoRef<'_>) -> bool {
    first.fabric_name() == other.fabric_name() && same_provider_any_fabric(first, other)
}

/// [`same_provider_entry`] without the fabric: for NICs the user named
/// (`nic_include`), which may sit on different fabrics (for tcp: subnets).
pub fn same_provider_any_fabric(first: InfoRef<'_>, other: InfoRef<'_>) -> bool {
    first.provider_name() == other.provider_name()
        && first.ep_type() == other.ep_type()
        && first.addr_format() == other.addr_format()
        && other.caps() & first.caps() == first.caps()
        && other.mode() & !first.mode() == 0
        && first.inject_size() == other.inject_size()
        && first.max_msg_size() == other.max_msg_size()
        && first.mem_tag_format() == other.mem_tag_format()
}

/// Which NICs (domains) a process may use, beyond the provider lists: the
/// `opal_common_ofi_nic_include/exclude` parameters and where the job's peers are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NicPolicy {
    /// Only these domain or fabric names (exact). Candidates may then span fabrics.
    pub include: Option<Vec<String>>,
    /// Never these domain or fabric names (exact); ignored with `include`.
    pub exclude: Option<Vec<String>>,
    /// Some peers are on other hosts: a loopback NIC cannot reach them, so it is never
    /// chosen (its address would be published to peers that cannot use it).
    pub spans_hosts: bool,
}

/// Whether a fabric name is a loopback network as the IP providers (tcp, udp, net,
/// sockets) name it: `127.0.0.1/32`, `127.0.0.0/8`, `::1/128`.
pub fn is_loopback_fabric(fabric: &str) -> bool {
    fabric.starts_with("127.") || fabric == "::1" || fabric.starts_with("::1/")
}

impl NicPolicy {
    fn named(list: &[String], domain: &str, fabric: &str) -> bool {
        list.iter().any(|e| e == domain || e == fabric)
    }

    /// Whether a NIC (domain `domain` on fabric `fabric`) may be used; `Err` says why not.
    pub fn allows(&self, domain: &str, fabric: &str) -> std::result::Result<(), &'static str> {
        let include = self.include.as_deref().filter(|l| !l.is_empty());
        let exclude = self.exclude.as_deref().filter(|l| !l.is_empty());
        if let Some(inc) = include {
            if !Self::named(inc, domain, fabric) {
                return Err("not in nic_include");
            }
        } else if let Some(exc) = exclude {
            if Self::named(exc, domain, fabric) {
                return Err("in nic_exclude");
            }
        }
        if self.spans_hosts && is_loopback_fabric(fabric) {
            return Err("loopback, and the job spans hosts");
        }
        Ok(())
    }

    /// Whether the candidates may come from several fabrics (the user named the NICs).
    fn any_fabric(&self) -> bool {
        self.include.as_ref().is_some_and(|l| !l.is_empty())
    }
}

/// The outcome of [`select_provider`].
#[derive(Debug)]
pub struct Selection {
    /// The chosen entry, owned (outlives the list).
    pub info: OwnedInfo,
    pub provider: String,
    pub fabric: String,
    pub domain: String,
    /// Distinct NICs (domains) the provider offered on that fabric.
    pub nics: usize,
    pub method: NicMethod,
    /// E.g. `"provider tcp;ofi_rxm, fabric 127.0.0.1/32, domain lo, the only NIC"`.
    pub reason: String,
}

/// What the caller asks of a selection besides the hints: the provider lists (the
/// caller applies the default exclude list, or not), its local rank and a locality
/// measure for the NIC choice, and the NIC policy. `Default` is no lists, local rank 0,
/// no locality, any NIC.
#[derive(Clone, Default)]
pub struct Criteria<'a> {
    pub include: Option<&'a [String]>,
    pub exclude: Option<&'a [String]>,
    pub local_rank: u32,
    pub locality: Option<Locality<'a>>,
    pub nics: NicPolicy,
}

/// Steps 1-3 on an existing list (see the module docs). `Err(NODATA)` when no entry
/// survives the lists.
pub fn select_from_list(list: &InfoList, criteria: &Criteria<'_>) -> Result<Selection> {
    select_from_entries(list.iter().collect(), criteria)
}

fn select_from_entries(entries: Vec<InfoRef<'_>>, criteria: &Criteria<'_>) -> Result<Selection> {
    let Criteria {
        include,
        exclude,
        local_rank,
        locality,
        ref nics,
    } = *criteria;
    let total = entries.len();
    let allowed: Vec<InfoRef<'_>> = filter_providers(entries, include, exclude)
        .into_iter()
        .filter(|i| match nics.allows(i.domain_name(), i.fabric_name()) {
            Ok(()) => true,
            Err(why) => {
                log::debug!(
                    "{} fabric {} domain {}: {why}",
                    i.provider_name(),
                    i.fabric_name(),
                    i.domain_name()
                );
                false
            }
        })
        .collect();
    let Some(&first) = allowed.first() else {
        log::info!(
            "no provider left: {total} from fi_getinfo, include {include:?}, exclude {exclude:?}, \
             NICs {nics:?}"
        );
        return Err(Error::NODATA);
    };
    // One candidate per domain (providers list several entries per NIC: one per
    // address, per protocol version, ...): the first compatible entry of each.
    // Like the C layer, only NICs on the first entry's fabric, unless the user named
    // the NICs.
    let same = |i: InfoRef<'_>| {
        if nics.any_fabric() {
            same_provider_any_fabric(first, i)
        } else {
            same_provider_entry(first, i)
        }
    };
    let mut entries: Vec<InfoRef<'_>> = Vec::new();
    for i in allowed.iter().copied() {
        if same(i) && !entries.iter().any(|e| e.domain_name() == i.domain_name()) {
            entries.push(i);
        }
    }
    let candidates: Vec<NicCandidate> = entries
        .iter()
        .map(|i| NicCandidate {
            domain: i.domain_name().to_owned(),
            pci: i.pci(),
        })
        .collect();
    // `first` is compatible with itself, so there is at least one candidate.
    let choice = choose_nic(&candidates, local_rank, locality).ok_or(Error::NODATA)?;
    let chosen = entries[choice.index];
    let reason = format!(
        "provider {}, fabric {}, {}",
        chosen.provider_name(),
        chosen.fabric_name(),
        choice.reason
    );
    log::info!("{reason}");
    Ok(Selection {
        info: chosen.to_owned()?,
        provider: chosen.provider_name().to_owned(),
        fabric: chosen.fabric_name().to_owned(),
        domain: chosen.domain_name().to_owned(),
        nics: candidates.len(),
        method: choice.method,
        reason,
    })
}

/// `fi_getinfo(API_VERSION, hints)`, then [`select_from_list`]. The caller applies the
/// default exclude list (or not) and warns with [`both_set_warning`] when both lists
/// are set.
///
/// A fabric or domain name in the hints is enforced here too: libfabric 1.17 ignores
/// both for `tcp`, `tcp;ofi_rxm` and `udp;ofi_rxd` (asking for domain `lo` returns
/// `eth0` first).
pub fn select_provider(hints: &Hints, criteria: &Criteria<'_>) -> Result<Selection> {
    let list = InfoList::query(hints)?;
    let want = hints.info();
    let (fabric, domain) = (want.fabric_name(), want.domain_name());
    let entries: Vec<InfoRef<'_>> = list
        .iter()
        .filter(|i| {
            let keep = (fabric.is_empty() || i.fabric_name() == fabric)
                && (domain.is_empty() || i.domain_name() == domain);
            if !keep {
                log::debug!(
                    "{} fabric {} domain {} ignored the fabric/domain hint",
                    i.provider_name(),
                    i.fabric_name(),
                    i.domain_name()
                );
            }
            keep
        })
        .collect();
    select_from_entries(entries, criteria)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(s: &str) -> Vec<String> {
        parse_list(s)
    }

    #[test]
    fn parse_list_trims_and_drops_empties() {
        assert_eq!(l("tcp, shm,,  udp ,"), vec!["tcp", "shm", "udp"]);
        assert!(l("").is_empty());
        assert!(l(" , ,").is_empty());
        assert_eq!(l("udp;ofi_rxd"), vec!["udp;ofi_rxd"]);
    }

    #[test]
    fn is_in_list_is_case_insensitive_prefix_of_the_provider() {
        let list = l("tcp,PSM2");
        assert!(is_in_list(&list, "tcp"));
        assert!(is_in_list(&list, "tcp;ofi_rxm"));
        assert!(is_in_list(&list, "TCP;ofi_rxm"));
        assert!(is_in_list(&list, "psm2"));
        assert!(!is_in_list(&list, "psm"));
        assert!(!is_in_list(&list, "udp;ofi_rxd"));
        // the entry is the prefix, not the provider name
        assert!(!is_in_list(&l("tcp;ofi_rxm"), "tcp"));
        assert!(!is_in_list(&l("ofi_rxm"), "tcp;ofi_rxm"));
        assert!(is_in_list(&l("tcp;ofi_rxm"), "tcp;ofi_rxm"));
        // prefix semantics have consequences: "sock" excludes "sockets"
        assert!(is_in_list(&l("sock"), "sockets"));
        // empty entry matches everything, as in C (parse_list never produces one)
        assert!(is_in_list(&[""], "anything"));
        assert!(!is_in_list::<&str>(&[], "tcp"));
        // non-ASCII must not panic on a char boundary
        assert!(!is_in_list(&l("é"), "e"));
        assert!(!is_in_list(&l("t"), "é"));
    }

    #[test]
    fn default_exclude_hides_every_local_provider() {
        let ex = l(DEFAULT_EXCLUDE);
        for p in [
            "shm",
            "sockets",
            "tcp",
            "tcp;ofi_rxm",
            "udp;ofi_rxd",
            "net",
            "net;ofi_rxm",
            "usnic",
            "rstream",
        ] {
            assert!(is_in_list(&ex, p), "{p}");
        }
        for p in ["efa", "psm2", "psm3", "verbs;ofi_rxm", "cxi", "opx"] {
            assert!(!is_in_list(&ex, p), "{p}");
        }
    }

    #[test]
    fn filter_include_wins_over_exclude() {
        let provs = ["psm2", "tcp;ofi_rxm", "udp;ofi_rxd", "shm", "sockets"];
        let inc = l("udp,shm");
        let exc = l("udp");
        let got = filter_providers(provs, Some(&inc), Some(&exc));
        assert_eq!(got, vec!["udp;ofi_rxd", "shm"]);
        let got = filter_providers(provs, None, Some(&exc));
        assert_eq!(got, vec!["psm2", "tcp;ofi_rxm", "shm", "sockets"]);
        let got = filter_providers(provs, None, None);
        assert_eq!(got, provs.to_vec());
        // empty lists are unset
        let empty: Vec<String> = vec![];
        let got = filter_providers(provs, Some(&empty), Some(&exc));
        assert_eq!(got, vec!["psm2", "tcp;ofi_rxm", "shm", "sockets"]);
        let got = filter_providers(provs, Some(&l("verbs")), None);
        assert!(got.is_empty());
        assert!(both_set_warning().contains("include"));
    }

    fn nics(specs: &[(&str, Option<u8>)]) -> Vec<NicCandidate> {
        specs
            .iter()
            .map(|(d, bus)| NicCandidate {
                domain: d.to_string(),
                pci: bus.map(|b| PciAddr {
                    domain: 0,
                    bus: b,
                    device: 0,
                    function: 0,
                }),
            })
            .collect()
    }

    #[test]
    fn nic_policy_include_exclude_and_loopback() {
        let any = NicPolicy::default();
        assert!(any.allows("lo", "127.0.0.1/32").is_ok());
        let remote = NicPolicy {
            spans_hosts: true,
            ..Default::default()
        };
        assert!(remote.allows("lo", "127.0.0.1/32").is_err());
        assert!(remote.allows("lo", "::1/128").is_err());
        assert!(remote.allows("eth0", "10.0.0.0/24").is_ok());
        let inc = NicPolicy {
            include: Some(l("eth0,192.168.2.0/24")),
            exclude: Some(l("eth0")),
            spans_hosts: false,
        };
        assert!(inc.allows("eth0", "10.0.0.0/24").is_ok());
        assert!(inc.allows("eth1", "192.168.2.0/24").is_ok());
        assert_eq!(inc.allows("eth2", "10.0.0.0/24"), Err("not in nic_include"));
        // exact names: eth1 is not eth10
        assert!(inc.allows("eth00", "10.0.0.0/24").is_err());
        assert!(inc.any_fabric());
        let exc = NicPolicy {
            exclude: Some(l("eth1")),
            ..Default::default()
        };
        assert_eq!(exc.allows("eth1", "x"), Err("in nic_exclude"));
        assert!(exc.allows("eth0", "x").is_ok());
        assert!(!exc.any_fabric());
        assert!(is_loopback_fabric("127.0.0.0/8"));
        assert!(!is_loopback_fabric("10.127.0.0/16"));
    }

    #[test]
    fn choose_nic_spreads_without_locality() {
        let c = nics(&[("eth0", None), ("eth1", None)]);
        assert!(choose_nic(&[], 0, None).is_none());
        let a = choose_nic(&c, 0, None).unwrap();
        let b = choose_nic(&c, 1, None).unwrap();
        let d = choose_nic(&c, 2, None).unwrap();
        assert_eq!((a.index, b.index, d.index), (0, 1, 0));
        assert_eq!(b.method, NicMethod::Spread);
        assert_eq!(
            b.reason,
            "domain eth1, chosen by spread (local rank 1 of 2 NICs)"
        );
        let one = choose_nic(&c[..1], 5, None).unwrap();
        assert_eq!((one.index, one.method), (0, NicMethod::Only));
    }

    #[test]
    fn choose_nic_prefers_closest_then_spreads_among_ties() {
        // bus 0x10 and 0x30 are close (distance 0), 0x20 far (2), 0x40 unknown
        let c = nics(&[
            ("mlx0", Some(0x10)),
            ("mlx1", Some(0x20)),
            ("mlx2", Some(0x30)),
            ("mlx3", Some(0x40)),
        ]);
        let dist = |p: &PciAddr| match p.bus {
            0x10 | 0x30 => Some(0),
            0x20 => Some(2),
            _ => None,
        };
        let picks: Vec<usize> = (0..4)
            .map(|r| choose_nic(&c, r, Some(&dist)).unwrap().index)
            .collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
        let ch = choose_nic(&c, 1, Some(&dist)).unwrap();
        assert_eq!(
            ch.method,
            NicMethod::Locality {
                distance: 0,
                tied: 2
            }
        );
        assert!(
            ch.reason.contains("mlx2") && ch.reason.contains("locality"),
            "{}",
            ch.reason
        );
        // a locality function that knows nothing falls back to spread
        let unknown = |_: &PciAddr| None;
        let ch = choose_nic(&c, 3, Some(&unknown)).unwrap();
        assert_eq!((ch.index, ch.method), (3, NicMethod::Spread));
        // without PCI data the function is never consulted
        let c2 = nics(&[("eth0", None), ("eth1", None)]);
        let never = |_: &PciAddr| -> Option<u32> { panic!("no PCI data to ask about") };
        assert_eq!(
            choose_nic(&c2, 1, Some(&never)).unwrap().method,
            NicMethod::Spread
        );
    }
}
