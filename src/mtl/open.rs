//! Opening the MTL, in phases: `init_module` reads the parameters and the job's shape,
//! chooses the provider, its matching and the tag layout (`open/provider.rs`), opens
//! the address vector, endpoint and completion queues (`open/objects.rs`), decides the
//! data path's settings and builds the state it reads (`open/settings.rs`), then
//! publishes the endpoint name in the modex, starts progress and fills the module's
//! table. Each phase logs what it decided, in this order.
//!
//! What it owns: nothing after init returns (the objects are in `setup::RESOURCES`,
//! the state in `state::MTL`). What it must not touch: the data path, which only runs
//! once the module is handed to pml cm.

mod objects;
mod provider;
mod settings;

use super::progress;
use super::setup;
use super::state::{self, Mtl};
use super::tag::TagMode;
use crate::common::fbox;
use crate::common::sync::lock;
use crate::ompi::params::mtl as idx;
use crate::ompi::{modex, proc};
use libfabric_sys as fi;
use objects::Objects;
use ompi_sys as sys;
use provider::{Chosen, Tags};
use std::sync::atomic::Ordering;

/// An `mtl_ofi_*` parameter (0 before registration).
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

/// Build the MTL: choose provider and tag mode, open the endpoint, publish its name.
pub fn init_module(
    _progress_threads: bool,
    mpi_threads: bool,
) -> Result<*mut sys::mca_mtl_base_module_t, String> {
    let mut cfg = read_config(mpi_threads)?;
    let chosen = provider::choose_provider(&cfg)?;
    let tags = provider::choose_tag_layout(&cfg, &chosen)?;
    // The name of the domain the MTL uses, in the messages of the phases below.
    let provider = chosen.domain.info().provider_name().to_string();
    let mut objects = objects::open_objects(&mut cfg, &chosen, &provider)?;
    let state = settings::build_state(&cfg, &chosen, &tags, &mut objects, &provider)?;
    start(&cfg, chosen, &tags, objects, state, &provider)
}

/// What the parameters and the job's shape decide before a provider is chosen.
struct Config {
    mpi_threads: bool,
    /// `mtl_ofi_fbox_size` (checked; 0: fast boxes off).
    fbox_size: u64,
    /// `mtl_ofi_tag_mode`; `None`: auto.
    requested: Option<TagMode>,
    /// A scalable endpoint is asked for (`mtl_ofi_enable_sep`); cleared where the
    /// provider or software matching cannot have one.
    want_sep: bool,
    /// `mtl_ofi_thread_grouping`, only with a scalable endpoint.
    grouping: bool,
    av_type: fi::fi_av_type,
    /// Other processes of the job on this node.
    local_peers: usize,
    /// The ranks of MPI_COMM_WORLD.
    world: usize,
    /// Every rank of the job is on this node.
    all_local: bool,
    /// The locality capabilities asked for (none in a job on one node).
    locality: u64,
    threading: fi::fi_threading,
}

/// Check the parameters and read what they and the job's shape decide.
fn read_config(mpi_threads: bool) -> Result<Config, String> {
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
    let want_sep = param(idx::ENABLE_SEP) != 0;
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
    let (world, local_peers) = proc::job_shape();
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
    Ok(Config {
        mpi_threads,
        fbox_size,
        requested,
        want_sep,
        grouping,
        av_type,
        local_peers,
        world,
        all_local,
        locality,
        threading,
    })
}

/// Publish the endpoint name (and the fast-box segment) in the modex, keep the
/// objects, hand the state to the data path, start progress and fill the module's
/// table.
fn start(
    cfg: &Config,
    chosen: Chosen,
    tags: &Tags,
    objects: Objects,
    state: Box<Mtl>,
    provider: &str,
) -> Result<*mut sys::mca_mtl_base_module_t, String> {
    let fbox_record = state
        .soft
        .as_ref()
        .and_then(|sm| sm.fbox.as_ref())
        .map(|rx| rx.record());
    modex::send(
        super::component::component(),
        &setup::modex_blob(&objects.name, fbox_record.as_deref()),
    )
    .map_err(|rc| format!("publishing the endpoint name through the modex failed ({rc})"))?;
    let summary = Summary::of(cfg, &chosen, &objects, &state, provider);
    let Objects { eps, cqs, av, .. } = objects;
    setup::keep_resources(eps, cqs, av, chosen.domain);
    state::MTL.store(Box::into_raw(state), Ordering::Release);
    crate::ompi::progress::register(progress::progress_cb);
    let m = setup::publish_module(&tags.layout);
    summary.log(tags);
    Ok(m)
}

/// What the last lines of the log say about the opened MTL.
struct Summary<'a> {
    provider: &'a str,
    inject_size: usize,
    soft: bool,
    soft_pieces: bool,
    soft_eager_max: usize,
    soft_buffers: String,
    rx_capacity: usize,
    rx_user_max: usize,
    all_local: bool,
    /// Every fabric call is serialised (MPI_THREAD_MULTIPLE).
    threaded_lock: bool,
    sep: bool,
    grouping: bool,
    nctx: usize,
    used: usize,
}

impl<'a> Summary<'a> {
    fn of(
        cfg: &Config,
        chosen: &Chosen,
        objects: &Objects,
        state: &Mtl,
        provider: &'a str,
    ) -> Summary<'a> {
        let info = chosen.domain.info();
        Summary {
            provider,
            inject_size: state.inject_size,
            soft: chosen.soft,
            soft_pieces: state.soft.as_ref().is_some_and(|s| s.eager_in_pieces()),
            soft_eager_max: state.soft.as_ref().map_or(0, |s| s.eager_max()),
            soft_buffers: state.soft.as_ref().map_or(String::new(), |s| s.buffers()),
            rx_capacity: info.rx_size(),
            rx_user_max: state.rx.user_max(),
            all_local: cfg.all_local,
            threaded_lock: settings::threaded_lock(cfg),
            sep: cfg.want_sep,
            grouping: cfg.grouping,
            nctx: objects.nctx,
            used: objects.used,
        }
    }

    fn log(&self, tags: &Tags) {
        let Summary {
            provider,
            inject_size,
            soft_eager_max,
            soft_buffers,
            rx_capacity,
            rx_user_max,
            nctx,
            used,
            ..
        } = self;
        let layout = &tags.layout;
        log::info!(
            "provider {provider}: tag mode {} ({} communicator ids, tags up to {}), inject {} bytes, \
             {}, {}{}",
            tags.mode.name(),
            layout.max_cid() as u64 + 1,
            layout.max_tag(),
            inject_size,
            if self.soft {
                if self.soft_pieces {
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
            if self.all_local {
                "local communication only"
            } else {
                "local and remote communication"
            },
            if self.threaded_lock {
                ", serialised for MPI_THREAD_MULTIPLE"
            } else {
                ""
            }
        );
        if self.sep {
            log::info!(
                "provider {provider}: scalable endpoint with {nctx} contexts, {}",
                if self.grouping {
                    format!("{used} in use, communicator id modulo {used} picks one (mtl_ofi_thread_grouping)")
                } else {
                    "context 0 carries all traffic (mtl_ofi_thread_grouping=0)".to_string()
                }
            );
        }
    }
}
