use super::*;

fn probe(support: u32, patcher: bool, version: (u32, u32), uffd: bool) -> Probe {
    Probe {
        opal_support: support,
        opal_patcher_active: patcher,
        libfabric_version: fi_version(version.0, version.1),
        userfaultfd: if uffd {
            Ok(())
        } else {
            Err("userfaultfd: permission denied".into())
        },
    }
}

const BOTH: u32 = FREE_AND_MUNMAP;

/// The mechanism `decide` picks, for a choice it must honour.
#[track_caller]
fn chosen(choice: MonitorChoice, p: &Probe) -> Active {
    decide(choice, p).unwrap().active
}

/// `text` contains `part`; on failure the whole text is shown.
#[track_caller]
fn says(text: &str, part: &str) {
    assert!(text.contains(part), "{text:?} does not contain {part:?}");
}

/// `text` ends with `tail`; on failure the whole text is shown.
#[track_caller]
fn ends_with(text: &str, tail: &str) {
    assert!(text.ends_with(tail), "{text:?} does not end with {tail:?}");
}

#[test]
fn parse_is_case_insensitive_and_lists_valid_values() {
    assert_eq!("auto".parse(), Ok(MonitorChoice::Auto));
    assert_eq!(" OPAL ".parse(), Ok(MonitorChoice::Opal));
    assert_eq!("UserFaultFD".parse(), Ok(MonitorChoice::Userfaultfd));
    assert_eq!("memhooks".parse(), Ok(MonitorChoice::Memhooks));
    assert_eq!("Disabled".parse(), Ok(MonitorChoice::Disabled));
    let e = "uffd".parse::<MonitorChoice>().unwrap_err();
    assert_eq!(
            e.to_string(),
            "unknown memory monitor 'uffd': valid values are auto, opal, userfaultfd, memhooks, disabled"
        );
    for c in MonitorChoice::ALL {
        assert_eq!(c.as_str().parse(), Ok(c));
    }
}

#[test]
fn auto_prefers_opal_then_userfaultfd_then_disabled() {
    let p = probe(BOTH, true, (1, 17), true);
    assert_eq!(chosen(MonitorChoice::Auto, &p), Active::Opal);

    // hooks without munmap support are not enough
    let p = probe(ompi::OPAL_MEMORY_FREE_SUPPORT, true, (1, 17), true);
    let plan = decide(MonitorChoice::Auto, &p).unwrap();
    assert_eq!(plan.active, Active::Userfaultfd);
    says(&plan.reason, "support level 0x1");

    // libfabric too old for the import
    let p = probe(BOTH, true, (1, 13), true);
    let plan = decide(MonitorChoice::Auto, &p).unwrap();
    assert_eq!(plan.active, Active::Userfaultfd);
    says(&plan.reason, "1.13 is older than 1.14");

    // nothing usable: caching disabled, and it says so; never memhooks
    let p = probe(BOTH, true, (1, 13), false);
    let plan = decide(MonitorChoice::Auto, &p).unwrap();
    assert_eq!(plan.active, Active::CachingDisabled);
    says(&plan.reason, "caching is disabled");
    says(&plan.reason, "Open MPI's patcher is active");
    let p = probe(0, false, (1, 17), false);
    assert_eq!(chosen(MonitorChoice::Auto, &p), Active::CachingDisabled);
}

#[test]
fn explicit_choices_that_cannot_be_honoured_decline_with_alternatives() {
    let no_hooks = probe(0, false, (1, 17), true);
    let d = decide(MonitorChoice::Opal, &no_hooks).unwrap_err();
    assert_eq!(d.choice, MonitorChoice::Opal);
    says(&d.message, "support level 0x0");
    ends_with(
        &d.message,
        "working alternatives here: userfaultfd, memhooks, disabled",
    );

    let no_uffd = probe(BOTH, true, (1, 17), false);
    let d = decide(MonitorChoice::Userfaultfd, &no_uffd).unwrap_err();
    says(&d.message, "permission denied");
    ends_with(&d.message, "alternatives here: opal, disabled");

    let patcher = probe(BOTH, true, (1, 17), true);
    let d = decide(MonitorChoice::Memhooks, &patcher).unwrap_err();
    says(&d.message, "two patchers");
    ends_with(&d.message, "alternatives here: opal, userfaultfd, disabled");

    // the patch check alone (support level 0) also counts as an active patcher
    let d = decide(MonitorChoice::Memhooks, &probe(0, true, (1, 17), true)).unwrap_err();
    assert!(d.message.contains("patcher is active"));
}

#[test]
fn explicit_choices_that_can_be_honoured() {
    let p = probe(BOTH, true, (1, 17), true);
    assert_eq!(chosen(MonitorChoice::Opal, &p), Active::Opal);
    assert_eq!(chosen(MonitorChoice::Userfaultfd, &p), Active::Userfaultfd);
    assert_eq!(chosen(MonitorChoice::Disabled, &p), Active::CachingDisabled);
    let no_patcher = probe(0, false, (1, 17), false);
    assert_eq!(
        chosen(MonitorChoice::Memhooks, &no_patcher),
        Active::Memhooks
    );
    assert_eq!(
        chosen(MonitorChoice::Disabled, &no_patcher),
        Active::CachingDisabled
    );
}

#[test]
fn environment_for_each_mechanism() {
    assert!(env_settings(Active::Opal).is_empty());
    assert_eq!(
        env_settings(Active::Userfaultfd),
        &[("FI_MR_CACHE_MONITOR", "userfaultfd")]
    );
    assert_eq!(
        env_settings(Active::Memhooks),
        &[("FI_MR_CACHE_MONITOR", "memhooks")]
    );
    assert!(env_settings(Active::CachingDisabled).contains(&("FI_MR_CACHE_MONITOR", "disabled")));
    assert!(env_settings(Active::CachingDisabled).contains(&("FI_MR_CACHE_MAX_COUNT", "0")));
}

#[test]
fn uffdio_api_matches_the_kernel_header() {
    // <linux/userfaultfd.h>: UFFDIO_API == 0xc018aa3f on x86-64, struct of 24 bytes.
    assert_eq!(std::mem::size_of::<UffdioApi>(), 24);
    assert_eq!(UFFDIO_API, 0xc018_aa3f);
    assert_eq!(UFFD_LIBFABRIC_FEATURES, 0x4c);
}

struct NoHooks;
impl OpalHooks for NoHooks {
    fn open_memory_framework(&self) -> i32 {
        ompi::OPAL_ERR_NOT_AVAILABLE
    }
    fn support_level(&self) -> i32 {
        0
    }
    fn register_release(&self, _cb: OpalReleaseFn) -> i32 {
        ompi::OPAL_ERR_NOT_SUPPORTED
    }
    fn unregister_release(&self, _cb: OpalReleaseFn) -> i32 {
        ompi::OPAL_ERR_NOT_FOUND
    }
}
static NO_HOOKS: NoHooks = NoHooks;

/// The only unit test that touches the process-wide STATE and export counters.
#[test]
fn teardown_refuses_while_libfabric_has_a_cache_on_the_monitor() {
    *lock_state() = Some(State {
        requested: MonitorChoice::Opal,
        result: Err(MonitorError::ImportBusy),
        hooks: &NO_HOOKS,
        held: Held::default(),
    });
    // What libfabric does when the first cache attaches to the monitor.
    // SAFETY: the export ops ignore their monitor argument.
    unsafe { export_start(null_mut()) };
    let e = Monitor::teardown().unwrap_err();
    assert_eq!(
        e,
        MonitorError::InUse {
            caches_started: 1,
            caches_stopped: 0
        }
    );
    assert!(e.to_string().contains("close every domain"), "{e}");
    assert!(
        Monitor::outcome().is_some(),
        "a refused teardown changes nothing"
    );
    // SAFETY: as above.
    unsafe { export_stop(null_mut()) };
    assert_eq!(Monitor::teardown(), Ok(()));
    assert!(Monitor::outcome().is_none());
    assert_eq!(Monitor::stats(), MonitorStats::default());
}

#[test]
fn errors_map_to_opal_codes_and_read_well() {
    assert_eq!(
        MonitorError::ImportBusy.to_opal(),
        ompi::OPAL_ERR_RESOURCE_BUSY
    );
    assert!(MonitorError::ImportBusy
        .to_string()
        .contains("another monitor was imported first, or a cache is already attached"));
    let d = MonitorError::Declined(Decline {
        choice: MonitorChoice::Opal,
        message: "x".into(),
    });
    assert_eq!(d.to_opal(), ompi::OPAL_ERR_NOT_AVAILABLE);
}
