//! Helpers to build whole jobs inside one process, for tests, examples and benchmarks.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::auth::JobKey;
use crate::error::Result;
use crate::group::Group;
use crate::store::{Store, StoreServer, TcpStore};
use crate::transport::mem::MemTransport;
use crate::transport::tcp::{JobIdentity, TcpTransport};
use crate::transport::LinkConfig;
use crate::transport::Transport;

/// Which transport a test job uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// In-memory.
    Mem,
    /// TCP over 127.0.0.1, every byte through the sockets (`LinkConfig::shm` off).
    Tcp,
    /// TCP connections over 127.0.0.1 whose frames go through shared memory (all ranks share
    /// this host).
    Shm,
    /// As [`Kind::Shm`], with the full mesh connected at start-up (`LinkConfig::lazy` off);
    /// the other TCP kinds connect each pair on first use.
    Eager,
    /// QUIC over 127.0.0.1, every pair on QUIC (`LinkConfig::shm` off).
    #[cfg(feature = "quic")]
    Quic,
    /// A QUIC job whose ranks play hosts of two ([`quic_hosts_world`]): ranks 0 and 1 one
    /// host, 2 and 3 the next, and so on (so a job of 2 ranks is one host, with no QUIC link).
    /// Pairs of one host go through shared memory (connected on first use), the others through
    /// QUIC over 127.0.0.1.
    #[cfg(feature = "quic")]
    QuicShm,
}

/// A job of `n` ranks on 127.0.0.1, all in this process: one token-authenticated store (port
/// from the OS), and `connect` run for every rank on its own thread. Returns the transports in
/// rank order and the store server (keep it alive while connecting).
///
/// # Errors
/// The first rank's failure, in rank order.
pub fn job<T: Send>(
    n: usize,
    cfg: &LinkConfig,
    connect: impl Fn(&JobIdentity, Arc<dyn Store>, &LinkConfig) -> Result<T> + Sync,
) -> Result<(Vec<T>, Arc<StoreServer>)> {
    let key = JobKey::from_token("tutti-test");
    let server =
        Arc::new(StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), n, Some(key.clone()))?);
    let addr = server.addr();
    let job = 0x7475_7474_6900_0000 ^ addr.port() as u64;
    let connect = &connect;
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (key, cfg, server) = (key.clone(), cfg.clone(), server.clone());
                s.spawn(move || {
                    let store = TcpStore::connect(addr, rank, n, Some(&key), cfg.connect_timeout)?;
                    let id = JobIdentity { rank, world: n, job, key };
                    // The server lives while a transport may still look up an address.
                    connect(&id, Arc::new(Served { store, _server: server }), &cfg)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| match h.join() {
                Ok(r) => r,
                Err(p) => std::panic::resume_unwind(p),
            })
            .collect()
    });
    let ts = results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok((ts, server))
}

/// A TCP job of `n` ranks on 127.0.0.1, all in this process (one store, ports from the OS).
/// Returns the transports in rank order and the store server (keep it alive while connecting).
///
/// # Errors
/// Any rendezvous failure.
pub fn tcp_world(n: usize, cfg: &LinkConfig) -> Result<(Vec<TcpTransport>, Arc<StoreServer>)> {
    job(n, &LinkConfig { shm: false, ..cfg.clone() }, TcpTransport::connect)
}

/// As [`tcp_world`], with the connections' frames going through shared memory (every rank is
/// on this host).
///
/// # Errors
/// Any rendezvous failure.
pub fn shm_world(n: usize, cfg: &LinkConfig) -> Result<(Vec<TcpTransport>, Arc<StoreServer>)> {
    job(n, &LinkConfig { shm: true, ..cfg.clone() }, TcpTransport::connect)
}

/// A QUIC job of `n` ranks on 127.0.0.1, all in this process, every pair on QUIC
/// (`LinkConfig::shm` off: with it on, ranks of one host link through shared memory).
///
/// # Errors
/// Any rendezvous failure.
#[cfg(feature = "quic")]
pub fn quic_world(
    n: usize,
    cfg: &LinkConfig,
) -> Result<Vec<crate::transport::quic::QuicTransport>> {
    let quic = crate::transport::QuicConfig::default();
    Ok(job(n, &LinkConfig { shm: false, ..cfg.clone() }, |id, store, cfg| {
        crate::transport::quic::QuicTransport::connect(id, store, cfg, &quic)
    })?
    .0)
}

/// A QUIC job of `n` ranks on 127.0.0.1 with shared memory on, whose rank `r` says it runs on
/// host `host(r)` (a host id of its own per value): pairs that say the same host link through
/// shared memory, the others through QUIC — a job across hosts, in one process.
///
/// # Errors
/// Any rendezvous failure.
#[cfg(feature = "quic")]
pub fn quic_hosts_world(
    n: usize,
    cfg: &LinkConfig,
    host: impl Fn(usize) -> u8 + Sync,
) -> Result<Vec<crate::transport::quic::QuicTransport>> {
    use crate::transport::quic::{QuicTransport, Start};
    let quic = crate::transport::QuicConfig::default();
    let cfg = LinkConfig { shm: true, ..cfg.clone() };
    Ok(job(n, &cfg, |id, store, cfg| {
        let start = Start { loopback: None, host: Some([host(id.rank); 32]) };
        QuicTransport::connect_as(id, store, cfg, &quic, start, crate::transport::Watch::NONE)
    })?
    .0)
}

/// A test job's store client that keeps the job's store server alive: transports that connect
/// on first use look addresses up after start-up.
struct Served {
    store: TcpStore,
    _server: Arc<StoreServer>,
}

impl Store for Served {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.store.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.store.get(key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.store.add(key, delta)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.store.delete(key)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.store.check(keys)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.store.wait(keys, timeout)
    }
    fn get_all(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.store.get_all(keys, timeout)
    }
    fn describe(&self) -> String {
        self.store.describe()
    }
}

/// Transports of a job of `n` ranks of the given kind, in rank order.
///
/// # Errors
/// Rendezvous failures (TCP).
pub fn world(kind: Kind, n: usize) -> Result<Vec<Arc<dyn Transport>>> {
    Ok(match kind {
        Kind::Mem => {
            MemTransport::world(n).into_iter().map(|t| Arc::new(t) as Arc<dyn Transport>).collect()
        }
        Kind::Tcp => {
            let cfg =
                LinkConfig { connect_timeout: Duration::from_secs(60), ..LinkConfig::default() };
            let (ts, _server) = tcp_world(n, &cfg)?;
            ts.into_iter().map(|t| Arc::new(t) as Arc<dyn Transport>).collect()
        }
        Kind::Shm | Kind::Eager => {
            let cfg = LinkConfig {
                connect_timeout: Duration::from_secs(60),
                lazy: kind == Kind::Shm,
                ..LinkConfig::default()
            };
            let (ts, _server) = shm_world(n, &cfg)?;
            ts.into_iter().map(|t| Arc::new(t) as Arc<dyn Transport>).collect()
        }
        #[cfg(feature = "quic")]
        Kind::Quic => {
            let cfg =
                LinkConfig { connect_timeout: Duration::from_secs(60), ..LinkConfig::default() };
            quic_world(n, &cfg)?.into_iter().map(|t| Arc::new(t) as Arc<dyn Transport>).collect()
        }
        #[cfg(feature = "quic")]
        Kind::QuicShm => {
            let cfg =
                LinkConfig { connect_timeout: Duration::from_secs(60), ..LinkConfig::default() };
            quic_hosts_world(n, &cfg, |r| (r / 2) as u8)?
                .into_iter()
                .map(|t| Arc::new(t) as Arc<dyn Transport>)
                .collect()
        }
    })
}

/// World groups of a job of `n` ranks of the given kind, in rank order.
///
/// # Errors
/// Rendezvous failures (TCP).
pub fn groups(kind: Kind, n: usize) -> Result<Vec<Group>> {
    Ok(world(kind, n)?.into_iter().map(Group::new).collect())
}

/// The ranks a benchmark binary runs: under a launcher ([`crate::launched`]), its one rank from
/// the environment; otherwise `n` ranks of `kind` as threads. Returns `f`'s results in rank
/// order and a line saying which it was, for the benchmark's header.
///
/// # Errors
/// Rendezvous errors, or failing to connect the threads' job.
pub fn ranks_here<T: Send>(
    kind: Kind,
    n: usize,
    f: impl Fn(Group) -> T + Sync,
) -> Result<(Vec<T>, String)> {
    if crate::launched() {
        let g = crate::init_from_env()?;
        let how = format!("{} ranks from the launcher's environment", g.size());
        return Ok((vec![f(g)], how));
    }
    let over = match kind {
        Kind::Mem => "memory",
        Kind::Tcp => "TCP",
        Kind::Shm => "shared memory",
        Kind::Eager => "shared memory (full mesh)",
        #[cfg(feature = "quic")]
        Kind::Quic => "QUIC",
        #[cfg(feature = "quic")]
        Kind::QuicShm => "QUIC between two simulated hosts, shared memory within each",
    };
    Ok((run(groups(kind, n)?, f), format!("{n} ranks over {over} (threads)")))
}

/// Run `f(group)` on one thread per rank and collect the results in rank order. A panic on any
/// rank is re-raised.
pub fn run<T: Send>(groups: Vec<Group>, f: impl Fn(Group) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = groups.into_iter().map(|g| s.spawn(move || f(g))).collect();
        hs.into_iter()
            .map(|h| match h.join() {
                Ok(v) => v,
                Err(p) => std::panic::resume_unwind(p),
            })
            .collect()
    })
}
