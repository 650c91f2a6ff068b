//! Provider selection against the real libfabric (no MPI): include/exclude lists with
//! Open MPI's matching rules, the first allowed provider in libfabric's order, and the
//! NIC choice among that provider's domains. The default exclude list is not applied
//! unless a test says so. A provider that is missing makes its test fail.

use libfabric_sys as fi;
use ompi_ofi::common::select::{
    filter_providers, is_in_list, parse_list, select_from_list, select_provider, Criteria,
    NicMethod, Selection, DEFAULT_EXCLUDE,
};
use ompi_ofi::fabric::{Error, Hints, InfoList, PciAddr};
use std::cell::Cell;

fn init_log() {
    let _ = env_logger::builder().is_test(true).try_init();
}

/// RDM + tagged, as the MTL asks (no FI_REMOTE_COMM, shm-compatible MR modes).
fn hints(prov: Option<&str>) -> Hints {
    let h = Hints::new()
        .expect("fi_allocinfo")
        .caps(fi::FI_TAGGED as u64)
        .ep_type(fi::FI_EP_RDM)
        .mode(fi::FI_CONTEXT | fi::FI_CONTEXT2)
        .mr_mode(fi::FI_MR_VIRT_ADDR | fi::FI_MR_ALLOCATED | fi::FI_MR_PROV_KEY);
    match prov {
        Some(p) => h.prov_name(p),
        None => h,
    }
}

fn must_select(h: &Hints, include: Option<&str>, exclude: Option<&str>, rank: u32) -> Selection {
    let inc = include.map(parse_list);
    let exc = exclude.map(parse_list);
    let criteria = Criteria {
        local_rank: rank,
        ..lists(inc.as_deref(), exc.as_deref())
    };
    select_provider(h, &criteria)
        .unwrap_or_else(|e| panic!("no provider for include {include:?} exclude {exclude:?}: {e}"))
}

/// The provider lists alone (local rank 0, no locality, any NIC).
fn lists<'a>(include: Option<&'a [String]>, exclude: Option<&'a [String]>) -> Criteria<'a> {
    Criteria {
        include,
        exclude,
        ..Default::default()
    }
}

fn check_selection(sel: &Selection) {
    let i = sel.info.info();
    assert_eq!(i.provider_name(), sel.provider);
    assert_eq!(i.fabric_name(), sel.fabric);
    assert_eq!(i.domain_name(), sel.domain);
    assert_eq!(i.ep_type(), fi::FI_EP_RDM);
    assert_ne!(i.caps() & fi::FI_TAGGED as u64, 0);
    assert!(sel.nics >= 1);
    assert!(
        sel.reason.starts_with(&format!(
            "provider {}, fabric {}, domain {}",
            sel.provider, sel.fabric, sel.domain
        )),
        "{}",
        sel.reason
    );
    assert!(
        sel.reason.contains("only NIC") || sel.reason.contains("chosen by"),
        "{}",
        sel.reason
    );
}

#[test]
fn tcp_by_hint_is_served_by_rxm() {
    init_log();
    let sel = must_select(&hints(Some("tcp")), Some("tcp"), None, 0);
    check_selection(&sel);
    assert_eq!(sel.provider, "tcp;ofi_rxm");
}

#[test]
fn udp_rxd_by_hint() {
    init_log();
    let sel = must_select(&hints(Some("udp;ofi_rxd")), None, None, 0);
    check_selection(&sel);
    assert_eq!(sel.provider, "udp;ofi_rxd");
}

#[test]
fn shm_by_hint() {
    init_log();
    let sel = must_select(&hints(Some("shm")), Some("shm"), None, 0);
    check_selection(&sel);
    assert_eq!(sel.provider, "shm");
    assert_eq!((sel.nics, sel.method), (1, NicMethod::Only));
    // shm only asks for FI_MR_VIRT_ADDR among the modes we offered
    assert_eq!(sel.info.info().mr_mode() & !fi::FI_MR_VIRT_ADDR, 0);
}

/// Without a provider hint the include list alone picks the provider, by prefix.
#[test]
fn include_list_picks_from_all_providers() {
    init_log();
    let list = InfoList::query(&hints(None)).expect("fi_getinfo");
    let names: Vec<&str> = list.iter().map(|i| i.provider_name()).collect();
    log::info!("libfabric order: {names:?}");
    for (include, want) in [
        ("tcp", "tcp;ofi_rxm"),
        ("TCP", "tcp;ofi_rxm"),
        ("udp", "udp;ofi_rxd"),
        ("udp;ofi_rxd", "udp;ofi_rxd"),
        ("shm", "shm"),
        ("shm,udp", ""), // whichever of the two libfabric lists first
    ] {
        let inc = parse_list(include);
        let sel = select_from_list(&list, &lists(Some(&inc), None))
            .unwrap_or_else(|e| panic!("include {include:?}: {e} (providers: {names:?})"));
        check_selection(&sel);
        if want.is_empty() {
            let first = names.iter().find(|n| is_in_list(&inc, n)).expect("a match");
            assert_eq!(sel.provider, *first, "include {include:?}");
        } else {
            assert_eq!(sel.provider, want, "include {include:?}");
        }
    }
    // the list entry must be a prefix of the provider name: the utility provider alone
    // does not match a layered name
    let inc = parse_list("ofi_rxm");
    assert_eq!(
        select_from_list(&list, &lists(Some(&inc), None)).err(),
        Some(Error::NODATA)
    );
}

#[test]
fn exclude_list_skips_in_order() {
    init_log();
    let list = InfoList::query(&hints(None)).expect("fi_getinfo");
    let exc = parse_list("tcp, udp");
    let sel = select_from_list(&list, &lists(None, Some(&exc))).expect("something besides tcp/udp");
    check_selection(&sel);
    assert!(!is_in_list(&exc, &sel.provider), "{}", sel.provider);
    let allowed = filter_providers(list.iter(), None, Some(&exc));
    assert_eq!(allowed[0].provider_name(), sel.provider);
    // include wins when both are set (the caller warns)
    let inc = parse_list("udp");
    let sel = select_from_list(&list, &lists(Some(&inc), Some(&exc))).expect("udp");
    assert_eq!(sel.provider, "udp;ofi_rxd");
}

/// Open MPI's default exclude list removes every provider this machine has that
/// serves RDM + tagged (the reason jobs here set an include list).
#[test]
fn default_exclude_leaves_no_local_provider() {
    init_log();
    let list = InfoList::query(&hints(None)).expect("fi_getinfo");
    let exc = parse_list(DEFAULT_EXCLUDE);
    let left: Vec<&str> = filter_providers(list.iter(), None, Some(&exc))
        .iter()
        .map(|i| i.provider_name())
        .collect();
    log::info!("left by the default exclude list: {left:?}");
    for p in &left {
        assert!(!is_in_list(&exc, p));
    }
    for p in ["tcp;ofi_rxm", "udp;ofi_rxd", "shm", "sockets", "net"] {
        assert!(!left.contains(&p), "{p} survived the default exclude list");
    }
    match select_from_list(&list, &lists(None, Some(&exc))) {
        Err(e) => assert_eq!(e, Error::NODATA),
        Ok(sel) => assert!(!is_in_list(&exc, &sel.provider)),
    }
}

/// Every local rank gets an entry of the same provider and fabric; without PCI data
/// the locality function is never consulted and the choice is by spread.
#[test]
fn nic_choice_by_local_rank() {
    init_log();
    let list = InfoList::query(&hints(Some("tcp"))).expect("fi_getinfo");
    let calls = Cell::new(0u32);
    let locality = |_: &PciAddr| {
        calls.set(calls.get() + 1);
        Some(0)
    };
    let first = select_from_list(&list, &Criteria::default()).expect("tcp");
    for rank in 0..4 {
        let sel = select_from_list(
            &list,
            &Criteria {
                local_rank: rank,
                locality: Some(&locality),
                ..Default::default()
            },
        )
        .expect("tcp");
        check_selection(&sel);
        assert_eq!(
            (sel.provider.as_str(), sel.fabric.as_str()),
            (first.provider.as_str(), first.fabric.as_str())
        );
        assert!(!matches!(sel.method, NicMethod::Locality { .. }));
        log::info!("local rank {rank}: {}", sel.reason);
    }
    let has_pci = list.iter().any(|i| i.pci().is_some());
    if !has_pci {
        assert_eq!(calls.get(), 0, "locality consulted without PCI data");
    }
}

/// A domain hint restricts the candidates to that NIC. libfabric 1.17 itself ignores
/// it for tcp (first entry: eth0), so select_provider enforces it.
#[test]
fn domain_hint_restricts_to_loopback() {
    init_log();
    let raw = InfoList::query(&hints(Some("tcp")).domain_name("lo")).expect("fi_getinfo");
    let first = raw.first().expect("tcp entries");
    log::info!(
        "libfabric's first answer to domain \"lo\": {}",
        first.domain_name()
    );
    assert!(
        raw.iter().any(|i| i.domain_name() == "lo"),
        "no tcp entry on lo"
    );
    let sel = must_select(&hints(Some("tcp")).domain_name("lo"), None, None, 1);
    check_selection(&sel);
    assert_eq!(sel.domain, "lo");
    assert_eq!((sel.nics, sel.method), (1, NicMethod::Only));
    let sel = must_select(
        &hints(Some("tcp")).fabric_name("127.0.0.1/32"),
        None,
        None,
        0,
    );
    assert_eq!(
        (sel.fabric.as_str(), sel.domain.as_str()),
        ("127.0.0.1/32", "lo")
    );
}

#[test]
fn missing_provider_is_an_error_not_an_empty_success() {
    init_log();
    let err = select_provider(&hints(Some("no_such_provider_xyz")), &Criteria::default()).err();
    assert_eq!(err, Some(Error::NODATA));
}
