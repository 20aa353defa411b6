//! The one connect path: a membership (its epoch, the members' stable ids, this process's rank
//! in it, and the transport kind its options name) becomes a connected [`Group`]. Start-up,
//! shrink, grow and a replacement's first world all come through [`connect`]. Each transport
//! publishes and looks up its own addresses under keys its module owns; [`published`] asks the
//! kind in use whether a member got that far.
//!
//! ```text
//! rendezvous (start-up) ─┐
//! elastic (shrink, grow) ├─→ connect ─→ open_transport (tcp | quic) ─→ Group::with_parts
//! elastic (join)        ─┘       └─→ launcher::watch (notices fail the new transport)
//! ```
//!
//! A rebuilt world is connected under a [`Watch`]: a member the launcher reports gone since the
//! membership being replaced was formed (a newcomer: since this connect began), or whose
//! published address refuses connections, fails the connect at once (naming it) instead of
//! after [`REBUILD_CONNECT`], so the survivors agree again without it in about the time a first
//! loss takes. The launcher's notices are read from the first connect on, and a member that
//! ended while its world connected is named to the new transport once it exists.

use std::any::Any;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::info;

use crate::auth::JobKey;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::membership::Membership;
use crate::options::{Options, TransportKind};
use crate::rendezvous::{ifaddr, launcher};
use crate::store::Store;
use crate::transport::tcp::{JobIdentity, TcpTransport};
use crate::transport::{Transport, Watch};

/// How long a rebuilt world's connections may take before the members that did not come are
/// agreed away.
pub(crate) const REBUILD_CONNECT: Duration = Duration::from_secs(10);

/// Why a world is being connected, which sets its deadlines and whether it is watched.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Purpose {
    /// The job's first world: the connect may take `TUTTI_CONNECT_TIMEOUT` (a peer may be slow
    /// to start); operations then get the configured per-operation timeout.
    StartUp,
    /// A rebuilt world (shrink, grow, a replacement joining): operations get `wait`; the
    /// connect may take `wait` or [`REBUILD_CONNECT`], whichever is shorter, and is watched.
    Rebuild {
        /// The per-operation timeout of the group being rebuilt.
        wait: Duration,
    },
    /// A world whose members were chosen by the caller ([`Group::reconfigure`]): operations
    /// get `wait`; the connect may take `connect` (the members may reach the call at different
    /// times), and is watched.
    Reconfigure {
        /// The per-operation timeout of the new world.
        wait: Duration,
        /// How long the connect may take.
        connect: Duration,
    },
}

/// Connect the world of membership `epoch` (members `ids`, this process at `rank`), whose
/// rendezvous keys and job secret come from `cur`, the membership it follows (itself, at
/// start-up). `joined`: this process is a replacement taken in at this epoch.
///
/// # Errors
/// What the transport's connect returns: [`Error::Rendezvous`] naming the members that did not
/// come, or (rebuilds) the member that is gone; [`Error::Io`] when binding fails.
pub(crate) fn connect(
    cur: &Membership,
    rank: usize,
    epoch: u64,
    ids: Vec<u64>,
    keep: Vec<Arc<dyn Any + Send + Sync>>,
    joined: bool,
    purpose: Purpose,
) -> Result<Group> {
    let store = cur.epoch_store(epoch);
    let mut opts = cur.opts.clone();
    let timeout = match purpose {
        Purpose::StartUp => opts.timeout,
        Purpose::Rebuild { wait } => {
            opts.link.connect_timeout = opts.link.connect_timeout.min(wait).min(REBUILD_CONNECT);
            // The survivors' agreement needs to know now who came: a rebuilt world connects
            // its full mesh (watched), whatever `TUTTI_CONNECT` says.
            opts.link.lazy = false;
            wait
        }
        Purpose::Reconfigure { wait, connect } => {
            opts.link.connect_timeout = connect;
            // The caller learns at once whether every member came.
            opts.link.lazy = false;
            wait
        }
    };
    let start = Instant::now();
    if let Some(fd) = cur.launcher_fd {
        // Notices are stamped from now on, whatever this connect does.
        launcher::listen(fd);
    }
    // Stable ids are the members' launch ranks (what the launcher's notices name).
    let launch: Vec<usize> = ids.iter().map(|id| *id as usize).collect();
    let since = cutoffs(cur, &ids, start);
    let gone = || launcher::ended_since(&launch, &since);
    let watch = match purpose {
        Purpose::StartUp => Watch::NONE,
        Purpose::Rebuild { .. } | Purpose::Reconfigure { .. } => Watch::new(&gone),
    };
    let t = open_transport(
        rank,
        ids.len(),
        cur.epoch_job(epoch),
        &cur.token,
        store,
        cur.master_ip,
        &opts,
        watch,
    )?;
    if let Some(fd) = cur.launcher_fd {
        // A member that ended while the world connected is named now.
        launcher::watch(fd, &t, launch, start);
    }
    // Formed when its connect began: a notice after that is about a member of this world.
    let next =
        Membership { epoch, ids, joined, grows: Default::default(), formed: start, ..cur.clone() };
    let g = Group::with_parts(t, keep, Some(Arc::new(next)));
    g.set_timeout(timeout);
    Ok(g)
}

/// Whether member `r` of the world whose rendezvous keys are in `store` published its address
/// (it got as far as listening) over transport `kind`.
pub(crate) fn published(kind: TransportKind, store: &dyn Store, r: usize) -> bool {
    let key = match kind {
        TransportKind::Tcp => crate::transport::tcp::addr_key(r),
        #[cfg(feature = "quic")]
        TransportKind::Quic => crate::transport::quic::quic_key(r),
        #[cfg(not(feature = "quic"))]
        TransportKind::Quic => return false,
    };
    store.check(&[key.as_str()]).unwrap_or(false)
}

/// Since when a launcher notice about each member of `ids` counts: a member of `cur` since
/// `cur` formed; a newcomer (taken in by a grow, whose launch rank an ended process may have
/// had) since `start`, when this connect began — its predecessor's notice came before it asked
/// to join, so before the members decided to take it in.
fn cutoffs(cur: &Membership, ids: &[u64], start: Instant) -> Vec<Instant> {
    ids.iter().map(|id| if cur.ids.contains(id) { cur.formed } else { start }).collect()
}

/// The members `ids` of a world that `cur` was connecting that are gone: those the launcher
/// reported ended since `cur` formed (see [`launcher::ended_since`]); their ranks in that world.
pub(crate) fn gone_members(cur: &Membership, ids: &[u64]) -> Vec<usize> {
    let launch: Vec<usize> = ids.iter().map(|id| *id as usize).collect();
    launcher::all_ended_since(&launch, &cutoffs(cur, ids, Instant::now()))
}

/// Connect this rank's transport of kind `opts.transport` to the `world` ranks of `job`
/// through `store` (which a TCP transport keeps, to look up the peers it connects on first
/// use), under `watch`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn open_transport(
    rank: usize,
    world: usize,
    job: u64,
    token: &str,
    store: Arc<dyn Store>,
    master_ip: Option<IpAddr>,
    opts: &Options,
    watch: Watch<'_>,
) -> Result<Arc<dyn Transport>> {
    let mut link = opts.link.clone();
    link.bind_ip = ifaddr::select(opts.ifname.as_ref(), master_ip)?;
    let id = JobIdentity { rank, world, job, key: JobKey::from_token(token) };
    Ok(match opts.transport {
        TransportKind::Tcp => {
            let describe = store.describe();
            let t = TcpTransport::connect_watched(&id, store, &link, watch)?;
            info!(rank, world, local = %t.local_addr(), store = %describe, "rendezvous complete (tcp)");
            Arc::new(t)
        }
        #[cfg(feature = "quic")]
        TransportKind::Quic => {
            let t = crate::transport::quic::QuicTransport::connect_as(
                &id,
                store.clone(),
                &link,
                &opts.quic,
                crate::transport::quic::Start::default(),
                watch,
            )?;
            info!(rank, world, local = %t.local_addr(), store = %store.describe(), "rendezvous complete (quic)");
            Arc::new(t)
        }
        #[cfg(not(feature = "quic"))]
        TransportKind::Quic => {
            let _ = watch;
            return Err(Error::NotCompiledWith("quic"));
        }
    })
}

/// The job id rank 0 published in `store`, waiting up to `deadline` for it.
pub(crate) fn job_id(store: &dyn Store, rank: usize, deadline: Duration) -> Result<u64> {
    let raw = crate::store::get_or(store, "tutti/job", deadline, || Error::Rendezvous {
        rank,
        detail: format!("rank 0 did not publish the job id within {deadline:?}"),
    })?;
    <[u8; 8]>::try_from(raw.as_slice())
        .map(u64::from_le_bytes)
        .map_err(|_| Error::Rendezvous { rank, detail: "malformed job id in the store".into() })
}
