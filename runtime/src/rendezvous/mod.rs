//! Rendezvous: from environment variables to a connected [`Group`].
//!
//! ```text
//! env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TUTTI_*)
//!   → rank 0 serves the TCP store on MASTER_ADDR:MASTER_PORT (or TUTTI_STORE names a store
//!     served elsewhere, or a file store)
//!   → every rank claims its rank number (duplicates are refused), learns the job id and token
//!   → every rank listens on its chosen address (port from the OS) and publishes it (with its
//!     certificate's fingerprint over QUIC)
//!   → full mesh of authenticated connections (TCP with an HMAC handshake, or QUIC with TLS 1.3
//!     and pinned certificates, TUTTI_TRANSPORT) → Group
//! ```

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::auth::{self, JobKey};
use crate::connect::Purpose;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::membership::Membership;
use crate::store::{FileStore, SignedStore, Store, StoreServer, TcpStore, TorchStore};

pub mod env;
pub mod ifaddr;
pub mod launcher;
pub mod secret;
pub mod slurm;

pub use crate::options::{Options, TransportKind};
pub use env::{EnvInfo, Launcher, StoreSpec};

/// True when a launcher (tutti-run, torchrun, srun, mpirun) set the rank environment: a
/// program then takes its one rank from [`init_from_env`] instead of starting ranks itself.
pub fn launched() -> bool {
    ["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Rendezvous from the environment and connect: what a program launched by `tutti-run`,
/// torchrun, srun or mpirun calls first.
///
/// # Errors
/// [`Error::Config`] for missing or malformed variables; [`Error::Store`] and
/// [`Error::Rendezvous`] naming the ranks that could not be reached or disagree.
pub fn init_from_env() -> Result<Group> {
    let r = EnvInfo::from_env().and_then(|env| init(&env, &Options::from_env()?));
    if let Err(e) = &r {
        launcher::record_failure(&e.to_string());
    }
    r
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::Config(format!("cannot resolve MASTER_ADDR {host:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("MASTER_ADDR {host:?} resolves to no address")))
}

/// A short public digest of a job secret (for matching a secret file to its maker).
fn secret_digest(token: &str) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(format!("tutti-secret-id\0{token}").as_bytes());
    d[..8].to_vec()
}

/// Rendezvous with explicit environment and options.
///
/// # Errors
/// As [`init_from_env`].
pub fn init(env: &EnvInfo, opts: &Options) -> Result<Group> {
    // The call clock measures its rate while the rendezvous runs.
    crate::clock::init();
    let (rank, world) = (env.rank, env.world);
    let deadline = opts.link.connect_timeout;
    let until = Instant::now() + deadline;
    let mut keep: Vec<Arc<dyn std::any::Any + Send + Sync>> = Vec::new();
    // Where the store is, and whether it is on this host only.
    let (tcp_addr, local) = match &env.store {
        StoreSpec::File(_) => (None, true),
        StoreSpec::Tcp { host, port }
        | StoreSpec::Remote { host, port }
        | StoreSpec::Torch { host, port } => {
            let a = resolve(host, *port)?;
            (Some(a), a.ip().is_loopback())
        }
    };
    // The secret: given, or made by rank 0 and kept privately on this host, or (explicitly
    // insecure) handed out through the store.
    let secret_file = match (&opts.token, &env.store, tcp_addr) {
        (Some(_), _, _) => None,
        (None, StoreSpec::File(dir), _) => {
            secret::private_dir(dir)?;
            Some(dir.join("secret"))
        }
        (None, _, Some(a)) if local => {
            Some(secret::local_dir()?.join(format!("store-{}.secret", a.port())))
        }
        (None, _, _) if opts.insecure => {
            warn!(
                rank,
                "TUTTI_INSECURE=1: no job secret; rank 0 hands one out through the store, and \
                 anyone who can reach the store can join this job"
            );
            None
        }
        (None, _, _) => {
            return Err(Error::Config(
                "this job's store is reachable from other hosts and there is no job secret: \
                 set TUTTI_TOKEN (or TUTTI_TOKEN_FILE) to the same random string on every rank, \
                 e.g. `export TUTTI_TOKEN=$(openssl rand -hex 16)`, or start with tutti-run; \
                 TUTTI_INSECURE=1 runs without one"
                    .into(),
            ))
        }
    };
    let mut token = opts.token.clone();
    if let (None, Some(path)) = (&token, &secret_file) {
        if rank == 0 {
            let (guard, t) = secret::LocalSecret::create(path.clone())?;
            keep.push(Arc::new(guard));
            token = Some(t);
        } else {
            token = Some(secret::wait_local(path, rank, until)?);
        }
    }
    let key = token.as_deref().map(JobKey::from_token);
    let (store, master_ip): (Arc<dyn Store>, Option<IpAddr>) = match (&env.store, tcp_addr) {
        (StoreSpec::File(dir), _) => {
            let fs = FileStore::new(dir)?;
            keep.push(Arc::new(fs.leaver(world)));
            match &key {
                Some(k) => (Arc::new(SignedStore::new(fs, k.clone())), None),
                None => (Arc::new(fs), None),
            }
        }
        (StoreSpec::Torch { .. }, Some(addr)) => {
            let ts = TorchStore::connect(addr, &format!("tutti-{}", env.restart), deadline)?;
            if let (Some(path), Some(t)) = (&secret_file, &token) {
                token = Some(agree_local_secret(&ts, rank, path, t.clone(), deadline, until)?);
            }
            let s: Arc<dyn Store> = match token.as_deref() {
                Some(t) => Arc::new(SignedStore::new(ts, JobKey::from_token(t))),
                None => Arc::new(ts),
            };
            (s, Some(addr.ip()))
        }
        (_, Some(addr)) => {
            if rank == 0 && matches!(env.store, StoreSpec::Tcp { .. }) {
                keep.push(Arc::new(StoreServer::start(addr, world, key.clone())?));
            }
            let s = match (&secret_file, rank) {
                // A secret file may hold an older job's secret until rank 0 replaces it: when
                // the store refuses ours, read the file again.
                (Some(path), r) if r != 0 => loop {
                    let t = token.clone().unwrap_or_default();
                    let k = JobKey::from_token(&t);
                    match TcpStore::connect(addr, rank, world, Some(&k), deadline) {
                        Ok(s) => break s,
                        Err(e) if Instant::now() < until => {
                            let again = secret::wait_local(path, rank, until)?;
                            if again == t {
                                return Err(e);
                            }
                            token = Some(again);
                        }
                        Err(e) => return Err(e),
                    }
                },
                _ => TcpStore::connect(addr, rank, world, key.as_ref(), deadline)?,
            };
            (Arc::new(s), Some(addr.ip()))
        }
        (_, None) => {
            return Err(Error::Config("a TCP store without an address (internal error)".into()))
        }
    };
    if env.join {
        let token = token.ok_or_else(|| {
            Error::Config("a joining process needs the job secret (TUTTI_TOKEN)".into())
        })?;
        return crate::elastic::join(rank, store, token, master_ip, opts, env.launcher_fd, keep);
    }
    connect(rank, world, store, token, master_ip, opts, env.launcher_fd, keep)
}

/// Where the job secret comes from when the ranks rendezvous on a store handed to them
/// ([`init_on_store`]).
#[derive(Debug, Clone)]
pub enum Secret {
    /// Every rank was given the same secret (`TUTTI_TOKEN`).
    Given(String),
    /// All ranks are on this host: rank 0 makes one in this private file, the others read it
    /// (and check, through the store, that it is the one rank 0 made).
    LocalFile(std::path::PathBuf),
    /// Rank 0 makes one and publishes it in the store: whoever can read the store can join.
    ThroughStore,
}

/// Rendezvous over a store someone else serves (for example the store torch hands to a
/// process-group backend) and connect the full mesh: claim the rank, agree on the job, connect.
/// The caller chooses how the ranks share a secret.
///
/// # Errors
/// [`Error::Store`] and [`Error::Rendezvous`] naming the ranks that could not be reached or
/// disagree; [`Error::Config`] for a malformed secret.
pub fn init_on_store(
    rank: usize,
    world: usize,
    store: Arc<dyn Store>,
    secret: Secret,
    master_ip: Option<IpAddr>,
    opts: &Options,
) -> Result<Group> {
    let deadline = opts.link.connect_timeout;
    let until = Instant::now() + deadline;
    let mut keep: Vec<Arc<dyn std::any::Any + Send + Sync>> = Vec::new();
    let token = match secret {
        Secret::Given(t) => {
            secret::check_token(&t, "the job secret")?;
            Some(t)
        }
        Secret::ThroughStore => None,
        Secret::LocalFile(path) => {
            if let Some(dir) = path.parent() {
                secret::private_dir(dir)?;
            }
            let t = if rank == 0 {
                let (guard, t) = secret::LocalSecret::create(path.clone())?;
                keep.push(Arc::new(guard));
                t
            } else {
                secret::wait_local(&path, rank, until)?
            };
            Some(agree_local_secret(store.as_ref(), rank, &path, t, deadline, until)?)
        }
    };
    let store: Arc<dyn Store> = match token.as_deref() {
        Some(t) => Arc::new(SignedStore::new(store, JobKey::from_token(t))),
        None => store,
    };
    connect(rank, world, store, token, master_ip, opts, None, keep)
}

/// A secret file may hold an older job's secret until rank 0 replaces it, and a store handed
/// to us cannot tell: rank 0 publishes a digest of the secret it made, and the others read the
/// file again until theirs matches.
fn agree_local_secret(
    store: &dyn Store,
    rank: usize,
    path: &std::path::Path,
    mut mine: String,
    deadline: Duration,
    until: Instant,
) -> Result<String> {
    if rank == 0 {
        store.set("tutti/secret-id", &secret_digest(&mine))?;
        return Ok(mine);
    }
    let want = crate::store::get_or(store, "tutti/secret-id", deadline, || Error::Rendezvous {
        rank,
        detail: format!("rank 0 did not join the store within {deadline:?}"),
    })?;
    while secret_digest(&mine) != want {
        if Instant::now() >= until {
            return Err(Error::Rendezvous {
                rank,
                detail: format!(
                    "the job secret in {} is not the one rank 0 made (is rank 0 on this host, \
                     running as this user?)",
                    path.display()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
        mine = secret::wait_local(path, rank, until)?;
    }
    Ok(mine)
}

/// The rendezvous after the store and the secret are settled: claim the rank, learn the job
/// id (and, without a secret, the one rank 0 publishes), connect the transport.
#[allow(clippy::too_many_arguments)]
fn connect(
    rank: usize,
    world: usize,
    store: Arc<dyn Store>,
    token: Option<String>,
    master_ip: Option<IpAddr>,
    opts: &Options,
    launcher_fd: Option<i32>,
    keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
) -> Result<Group> {
    let deadline = opts.link.connect_timeout;
    let claims = store.add(&format!("tutti/rank/{rank}"), 1)?;
    if claims > 1 {
        return Err(Error::Rendezvous {
            rank,
            detail: format!(
                "{claims} processes claim rank {rank}: duplicate RANK values, or two jobs share \
                 one store (MASTER_PORT)"
            ),
        });
    }
    let (token, job) = if rank == 0 {
        let token = match token {
            Some(t) => t,
            None => {
                let t = auth::random_token().map_err(Error::Config)?;
                store.set("tutti/token", t.as_bytes())?;
                t
            }
        };
        let job = u64::from_le_bytes(auth::random::<8>().map_err(Error::Config)?);
        store.set("tutti/job", &job.to_le_bytes())?;
        (token, job)
    } else {
        let job = crate::connect::job_id(store.as_ref(), rank, deadline)?;
        let token = match token {
            Some(t) => t,
            None => String::from_utf8_lossy(&store.get("tutti/token", deadline)?).into_owned(),
        };
        (token, job)
    };
    let membership = Membership {
        store,
        token,
        job,
        epoch: 0,
        ids: (0..world as u64).collect(),
        opts: opts.clone(),
        master_ip,
        launcher_fd,
        joined: false,
        grows: Default::default(),
        formed: Instant::now(),
    };
    let ids = membership.ids.clone();
    crate::connect::connect(&membership, rank, 0, ids, keep, false, Purpose::StartUp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::QuicConfig;

    fn with(vars: &[(&str, &str)]) -> Result<Options> {
        let vars: Vec<(String, String)> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Options::from_lookup(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    /// Ranks handed one store (a directory here, as torch hands a backend its store) connect
    /// and exchange a message, with each way of sharing the secret; a rank with another secret
    /// is refused.
    #[test]
    fn ranks_rendezvous_on_a_store_they_are_handed() {
        let base = std::env::temp_dir().join(format!("tutti-onstore-{}", std::process::id()));
        let secrets = [
            Secret::Given("a-secret-of-enough-length".into()),
            Secret::ThroughStore,
            Secret::LocalFile(base.join("secret-dir").join("job.secret")),
        ];
        for (k, secret) in secrets.into_iter().enumerate() {
            let dir = base.join(format!("store-{k}"));
            let store: Arc<dyn Store> = Arc::new(FileStore::new(&dir).unwrap());
            let opts = Options::from_lookup(|_| None).unwrap();
            let n = 3;
            let got: Vec<u8> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..n)
                    .map(|r| {
                        let (store, secret, opts) = (store.clone(), secret.clone(), opts.clone());
                        s.spawn(move || {
                            let g = init_on_store(r, n, store, secret, None, &opts).unwrap();
                            let mut b = [0u8; 1];
                            g.send((r + 1) % n, 7, &[r as u8 + 10]).unwrap();
                            g.recv((r + n - 1) % n, 7, &mut b).unwrap();
                            b[0]
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(got, vec![12, 10, 11], "secret #{k}");
        }
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn quic_settings_parse_strictly() {
        let o = with(&[]).unwrap();
        assert_eq!(o.quic, QuicConfig::default());
        let o = with(&[("TUTTI_QUIC_MTU", "9000"), ("TUTTI_QUIC_GSO", "0")]).unwrap();
        assert_eq!(o.quic, QuicConfig { loopback_mtu: 9000, gso: false });
        for (k, v) in [
            ("TUTTI_QUIC_MTU", "1199"),
            ("TUTTI_QUIC_MTU", "65528"),
            ("TUTTI_QUIC_MTU", "big"),
            ("TUTTI_QUIC_GSO", "off"),
            ("TUTTI_QUIC_GSO", "2"),
        ] {
            let e = with(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(v), "{k}={v}: {e}");
        }
    }

    #[test]
    fn every_malformed_variable_is_named() {
        for (k, v) in [
            ("TUTTI_TIMEOUT", "soon"),
            ("TUTTI_CONNECT_TIMEOUT", "-1"),
            ("TUTTI_TRANSPORT", "udp"),
            ("TUTTI_KEEPALIVE", "0"),
            ("TUTTI_DEAD_AFTER", "inf"),
            ("TUTTI_TIMEOUT", "1e20"),
            ("TUTTI_CONNECT_TIMEOUT", "NaN"),
            ("TUTTI_SPIN_US", "1.5"),
            ("TUTTI_WINDOW_BYTES", "0"),
            ("TUTTI_WINDOW_BYTES", "16M"),
            ("TUTTI_TCP_CONGESTION", "cu bic"),
            ("TUTTI_TCP_CONGESTION", "a-very-long-algorithm-name"),
            ("TUTTI_SHM", "yes"),
            ("TUTTI_SHM", "2"),
        ] {
            let e = with(&[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k), "{k}={v}: {e}");
        }
        let o = with(&[("TUTTI_TIMEOUT", "2.5"), ("TUTTI_TRANSPORT", "quic")]).unwrap();
        assert_eq!(o.timeout, Duration::from_millis(2500));
        assert_eq!(o.transport, TransportKind::Quic);
        assert_eq!(with(&[("TUTTI_WINDOW_BYTES", "4096")]).unwrap().link.window, 4096);
        // Cubic unless told otherwise; `system` keeps the kernel's default.
        assert_eq!(with(&[]).unwrap().link.tcp_congestion.as_deref(), Some("cubic"));
        let cc = |v| with(&[("TUTTI_TCP_CONGESTION", v)]).unwrap().link.tcp_congestion;
        assert_eq!(cc("reno").as_deref(), Some("reno"));
        assert_eq!(cc("system"), None);
        // Shared memory between ranks of one host unless turned off.
        assert!(with(&[]).unwrap().link.shm);
        assert!(!with(&[("TUTTI_SHM", "0")]).unwrap().link.shm);
        assert!(with(&[("TUTTI_SHM", "1")]).unwrap().link.shm);
    }
}
