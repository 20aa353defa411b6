//! How a rank connects: the transport, its settings and timeouts ([`Options`]), read from the
//! `TUTTI_*` variables. Rendezvous, the connect path and elastic membership read it; it imports
//! none of them (only rendezvous's leaf helpers for interfaces and secrets).

use std::time::Duration;

use crate::error::{Error, Result};
use crate::rendezvous::{ifaddr, secret};
use crate::transport::{LinkConfig, QuicConfig};

/// Which transport connects the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    /// TCP with HMAC-authenticated connections (no encryption).
    Tcp,
    /// QUIC: TLS 1.3 with pinned per-rank certificates. Needs the `quic` cargo feature.
    Quic,
}

/// Options for [`init`](crate::rendezvous::init); [`Options::from_env`] reads the `TUTTI_*` variables.
#[derive(Clone)]
pub struct Options {
    /// Job secret (`TUTTI_TOKEN`, or read from `TUTTI_TOKEN_FILE`), at least 16 characters.
    /// Default: none; then a single-host job (store on a loopback address, or a file store)
    /// makes one and keeps it in a file only this user can read, and a job whose store is
    /// reachable from other hosts refuses to start unless `insecure` is set.
    pub token: Option<String>,
    /// `TUTTI_INSECURE=1`: let a job without a secret whose store is reachable from other hosts
    /// start, with rank 0 handing a fresh secret out through the store. Hazard: anyone who can
    /// reach the store can then read it and join the job. Logged at warn on every rank.
    pub insecure: bool,
    /// Interface filter (`TUTTI_SOCKET_IFNAME`, NCCL syntax). Default: the route to the master.
    pub ifname: Option<ifaddr::IfSpec>,
    /// Per-operation timeout (`TUTTI_TIMEOUT`, seconds). Default 30 s.
    pub timeout: Duration,
    /// Transport (`TUTTI_TRANSPORT`: `tcp` or `quic`). Default `tcp`.
    pub transport: TransportKind,
    /// Settings of both transports (`TUTTI_CONNECT_TIMEOUT`, `TUTTI_KEEPALIVE` and
    /// `TUTTI_DEAD_AFTER` in seconds, `TUTTI_SPIN_US`, `TUTTI_WINDOW_BYTES`,
    /// `TUTTI_TCP_CONGESTION`, `TUTTI_SHM`, `TUTTI_CONNECT`).
    pub link: LinkConfig,
    /// QUIC-only settings (`TUTTI_QUIC_MTU`, `TUTTI_QUIC_GSO`).
    pub quic: QuicConfig,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            token: None,
            insecure: false,
            ifname: None,
            timeout: crate::group::DEFAULT_TIMEOUT,
            transport: TransportKind::Tcp,
            link: LinkConfig::default(),
            quic: QuicConfig::default(),
        }
    }
}

/// Longest duration a setting may ask for (about 31 years): deadlines computed from it never
/// overflow.
const MAX_SECS: f64 = 1e9;

fn secs(name: &str, v: &str) -> Result<Duration> {
    let f: f64 = v
        .trim()
        .parse()
        .ok()
        .filter(|f: &f64| f.is_finite() && *f > 0.0 && *f <= MAX_SECS)
        .ok_or_else(|| {
            Error::Config(format!(
                "{name}={v:?} is not a number of seconds above 0 and at most {MAX_SECS:e}"
            ))
        })?;
    Ok(Duration::from_secs_f64(f))
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("token", &self.token.as_ref().map(|_| "(redacted)"))
            .field("insecure", &self.insecure)
            .field("ifname", &self.ifname)
            .field("timeout", &self.timeout)
            .field("transport", &self.transport)
            .field("link", &self.link)
            .field("quic", &self.quic)
            .finish()
    }
}

impl Options {
    /// Read `TUTTI_TOKEN` or `TUTTI_TOKEN_FILE`, `TUTTI_INSECURE`, `TUTTI_SOCKET_IFNAME`, `TUTTI_TIMEOUT`, `TUTTI_CONNECT_TIMEOUT`,
    /// `TUTTI_TRANSPORT`, `TUTTI_KEEPALIVE`, `TUTTI_DEAD_AFTER`, `TUTTI_QUIC_MTU`,
    /// `TUTTI_QUIC_GSO`, `TUTTI_SPIN_US`, `TUTTI_WINDOW_BYTES`, `TUTTI_TCP_CONGESTION`, `TUTTI_SHM` and `TUTTI_CONNECT`; an
    /// empty variable counts as unset.
    ///
    /// # Errors
    /// [`Error::Config`] naming a malformed variable.
    pub fn from_env() -> Result<Options> {
        Options::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`Options::from_env`] with the variables looked up by `lookup`.
    ///
    /// # Errors
    /// As [`Options::from_env`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Options> {
        let mut o = Options::default();
        let get = |k: &str| lookup(k).filter(|v| !v.is_empty());
        o.token = match (get("TUTTI_TOKEN"), get("TUTTI_TOKEN_FILE")) {
            (Some(_), Some(_)) => {
                return Err(Error::Config(
                    "both TUTTI_TOKEN and TUTTI_TOKEN_FILE are set: set one".into(),
                ))
            }
            (Some(t), None) => {
                secret::check_token(&t, "TUTTI_TOKEN")?;
                Some(t)
            }
            (None, Some(f)) => Some(secret::read_token_file(std::path::Path::new(&f))?),
            (None, None) => None,
        };
        if let Some(v) = get("TUTTI_INSECURE") {
            o.insecure = match v.trim() {
                "1" => true,
                "0" => false,
                _ => return Err(Error::Config(format!("TUTTI_INSECURE={v:?}: expected 1 or 0"))),
            };
        }
        if let Some(v) = get("TUTTI_SOCKET_IFNAME") {
            o.ifname = Some(v.parse()?);
        }
        if let Some(v) = get("TUTTI_TIMEOUT") {
            o.timeout = secs("TUTTI_TIMEOUT", &v)?;
        }
        if let Some(v) = get("TUTTI_CONNECT_TIMEOUT") {
            o.link.connect_timeout = secs("TUTTI_CONNECT_TIMEOUT", &v)?;
        }
        if let Some(v) = get("TUTTI_TRANSPORT") {
            o.transport = match v.trim() {
                "tcp" => TransportKind::Tcp,
                "quic" => TransportKind::Quic,
                other => {
                    return Err(Error::Config(format!(
                        "TUTTI_TRANSPORT={other:?}: expected tcp or quic"
                    )))
                }
            };
        }
        if let Some(v) = get("TUTTI_KEEPALIVE") {
            o.link.keepalive_interval = secs("TUTTI_KEEPALIVE", &v)?;
        }
        if let Some(v) = get("TUTTI_DEAD_AFTER") {
            o.link.dead_after = secs("TUTTI_DEAD_AFTER", &v)?;
        }
        if let Some(v) = get("TUTTI_QUIC_MTU") {
            o.quic.loopback_mtu = v
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|m| (QuicConfig::MIN_MTU..=QuicConfig::MAX_MTU).contains(m))
                .ok_or_else(|| {
                    Error::Config(format!(
                        "TUTTI_QUIC_MTU={v:?} is not a datagram size from {} to {} bytes",
                        QuicConfig::MIN_MTU,
                        QuicConfig::MAX_MTU
                    ))
                })?;
        }
        if let Some(v) = get("TUTTI_QUIC_GSO") {
            o.quic.gso = match v.trim() {
                "1" => true,
                "0" => false,
                _ => return Err(Error::Config(format!("TUTTI_QUIC_GSO={v:?}: expected 1 or 0"))),
            };
        }
        if let Some(v) = get("TUTTI_WINDOW_BYTES") {
            o.link.window = v.trim().parse::<u64>().ok().filter(|w| *w > 0).ok_or_else(|| {
                Error::Config(format!("TUTTI_WINDOW_BYTES={v:?} is not a positive byte count"))
            })?;
        }
        if let Some(v) = get("TUTTI_TCP_CONGESTION") {
            let v = v.trim();
            if v.is_empty()
                || v.len() > 15
                || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            {
                return Err(Error::Config(format!(
                    "TUTTI_TCP_CONGESTION={v:?} is not an algorithm name (e.g. cubic, reno, bbr) or `system`"
                )));
            }
            o.link.tcp_congestion = (v != "system").then(|| v.to_string());
        }
        if let Some(v) = get(HOST_CPUS_ENV) {
            parse_host_cpus(&v)?;
        }
        if let Some(v) = get("TUTTI_SHM") {
            o.link.shm = match v.as_str() {
                "1" => true,
                "0" => false,
                _ => return Err(Error::Config(format!("TUTTI_SHM={v:?}: expected 1 or 0"))),
            };
        }
        if let Some(v) = get("TUTTI_CONNECT") {
            o.link.lazy = match v.trim() {
                "lazy" => true,
                "eager" => false,
                _ => {
                    return Err(Error::Config(format!(
                        "TUTTI_CONNECT={v:?}: expected `lazy` (connect each pair on first use) \
                         or `eager` (the full mesh at start-up)"
                    )))
                }
            };
        }
        if let Some(v) = get("TUTTI_SPIN_US") {
            let us: u64 = v.trim().parse().map_err(|_| {
                Error::Config(format!("TUTTI_SPIN_US={v:?} is not a whole number of µs"))
            })?;
            o.link.spin = Duration::from_micros(us);
        }
        Ok(o)
    }
}

/// The variable a launcher that binds each rank to CPUs of its own sets: how many CPUs the
/// ranks of this host share among them ([`host_cpus`]).
pub const HOST_CPUS_ENV: &str = "TUTTI_HOST_CPUS";

fn parse_host_cpus(v: &str) -> Result<usize> {
    v.trim().parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(|| {
        Error::Config(format!("{HOST_CPUS_ENV}={v:?} is not a positive number of CPUs"))
    })
}

/// How many CPUs the ranks of this host share among them, which decides whether a wait may
/// spin on a core of its own: [`HOST_CPUS_ENV`] where a launcher that binds each rank to a
/// CPU set it (`tutti-run --bind`, `collbench --np`), else the CPUs this process may run on.
/// A malformed value is refused when the rank starts (its options are read then).
pub fn host_cpus() -> usize {
    std::env::var(HOST_CPUS_ENV)
        .ok()
        .and_then(|v| parse_host_cpus(&v).ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
