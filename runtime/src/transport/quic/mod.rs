//! QUIC transport: quinn-proto's connection state machines, TLS 1.3 with per-rank self-signed
//! certificates whose fingerprints travel through the authenticated rendezvous and are pinned by
//! every peer.
//!
//! One QUIC connection per pair of ranks (the higher rank connects), and on it one long-lived
//! unidirectional stream per direction carrying the same frames as TCP (48-byte wire header plus
//! payload), so messages of one (peer, tag) stay in order. There is no async runtime: the shared
//! engine and connection core (`../engine.rs`, `../core.rs`) run over this transport's driver
//! (`driver.rs`) as over TCP's; the thread that waits drives, and a background thread does so
//! only while nobody waits. QUIC's own keep-alives replace the core's; a silent peer is declared
//! dead after `dead_after` by the core's rule (and quinn's idle timeout), with the same typed
//! errors.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info};

use crate::error::{Error, Result};
use crate::store::Store;
use crate::transport::tcp::JobIdentity;
use crate::transport::LinkConfig;
use crate::transport::QuicConfig;

mod driver;
mod mixed;
mod tls;

use crate::transport::core::{Core, CoreConfig};
use crate::transport::engine::{Engine, Running, Wired};
use crate::transport::tcp::driver::TcpDriver;
use crate::transport::tcp::{shm, TcpSide};
use crate::transport::Watch;
use driver::QuicDriver;
use mixed::MixedDriver;

/// Store key under which rank `r` publishes `addr|fingerprint|host|tcp`: its UDP address, its
/// certificate's fingerprint, its host's id (the shared-memory set-up's: kernel boot, network and pid
/// namespaces) and, when it offers shared memory, the loopback address its TCP listener takes
/// the ranks of its host on (`-` otherwise).
pub fn quic_key(r: usize) -> String {
    format!("tutti/quic/{r}")
}

/// What one rank published under [`quic_key`].
struct Record {
    addr: SocketAddr,
    fp: [u8; 32],
    host: [u8; 32],
    tcp: Option<SocketAddr>,
}

impl Record {
    fn encode(&self) -> String {
        let tcp = self.tcp.map_or_else(|| "-".to_string(), |a| a.to_string());
        format!("{}|{}|{}|{tcp}", self.addr, tls::hex(&self.fp), tls::hex(&self.host))
    }

    fn decode(text: &str) -> Option<Record> {
        let mut it = text.split('|');
        let addr = it.next()?.parse().ok()?;
        let fp = tls::unhex(it.next()?)?;
        let host = tls::unhex(it.next()?)?;
        let tcp = match it.next()? {
            "-" => None,
            a => Some(a.parse().ok()?),
        };
        it.next().is_none().then_some(Record { addr, fp, host, tcp })
    }
}

/// The QUIC transport of one rank. In a job with shared memory on (`LinkConfig::shm`), the
/// ranks of one host talk through TCP's driver and its shared-memory rings instead
/// (`mixed.rs`): QUIC carries only the pairs on different hosts.
pub struct QuicTransport {
    rank: usize,
    /// The listener and dials for the ranks of this host (`None`: every link is QUIC's);
    /// stopped before the engine shuts down (declared first, so dropped first).
    near: Option<TcpSide>,
    /// The engine; dropping it shuts the connections down cleanly.
    wire: Running<MixedDriver>,
    local: SocketAddr,
    /// This rank's certificate fingerprint (as published); read by tests.
    #[allow(dead_code)]
    fp: [u8; 32],
}

impl std::fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicTransport")
            .field("rank", &self.rank)
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// Bytes quinn buffers per peer before the sender waits for stream credit.
const QUINN_WINDOW: u32 = 16 << 20;

/// Longest interval between keep-alives (see `transport_config`).
const KILL_PROBE: Duration = Duration::from_millis(200);

/// Most bytes a rank sends unacknowledged on loopback.
const LOOPBACK_SEND_WINDOW: u64 = 1 << 20;

/// Set the UDP socket buffers to `want` bytes (forcing past `net.core.rmem_max` where the process
/// may, as root does); returns the receive buffer the kernel granted.
fn udp_buffers(s: &socket2::SockRef<'_>, want: usize) -> usize {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    for (force, plain) in
        [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)]
    {
        let v = want as libc::c_int;
        // SAFETY: setsockopt with a valid fd and a c_int option value.
        let forced = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                force,
                (&v as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        } == 0;
        if !forced {
            // SAFETY: as above.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    plain,
                    (&v as *const libc::c_int).cast(),
                    size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
    }
    s.recv_buffer_size().unwrap_or(212_992)
}

/// Bytes a peer may have unacknowledged towards us: the kernel's receive buffer shared by the
/// `world - 1` peers, with headroom. The kernel charges each datagram its buffer's true size:
/// about the payload for 64 KiB loopback datagrams, but roughly twice the payload and more for
/// 1,200–1,500-byte ones (measured off loopback: a window of half the buffer lost 14 % of the
/// datagrams), so small datagrams get a quarter as much.
fn in_flight_limit(rcvbuf: usize, world: usize, loopback: bool) -> u64 {
    let share = if loopback { 2 } else { 8 };
    let per_peer = rcvbuf / share / world.saturating_sub(1).max(1);
    per_peer.clamp(256 << 10, 128 << 20) as u64
}

fn transport_config(
    cfg: &LinkConfig,
    quic: &QuicConfig,
    loopback: bool,
    in_flight: u64,
) -> quinn_proto::TransportConfig {
    use quinn_proto::{AckFrequencyConfig, IdleTimeout, VarInt};
    let mut t = quinn_proto::TransportConfig::default();
    // What quinn holds for a peer that is not being read (its frame parked, see the driver):
    // part of the memory bound, so no larger than a datacenter bandwidth-delay product needs
    // (10 GB/s x 1.6 ms = 16 MiB).
    t.stream_receive_window(VarInt::from_u32(QUINN_WINDOW));
    t.receive_window(VarInt::from_u32(QUINN_WINDOW));
    // What this rank sends unacknowledged; sized from our own receive buffer, as the peers run
    // with the same settings (more than their kernel holds is dropped, and a drop halves the
    // congestion window).
    // On loopback the round trip is tens of µs, so 1 MiB in flight already covers it, and less
    // data in flight stays in cache: 64 MiB allreduce +25–40 % against the kernel-sized window
    // (docs/transport.md).
    t.send_window(if loopback { in_flight.min(LOOPBACK_SEND_WINDOW) } else { in_flight });
    // A keep-alive at least every 200 ms: besides keeping the connection alive, it is what makes
    // a killed peer's host answer "port unreachable" (the driver reads the ICMP error and fails
    // the link), so a dead process is named within about that long, not at the dead-peer limit.
    t.keep_alive_interval(Some(cfg.keepalive_interval.min(KILL_PROBE)));
    // Collectives are latency-bound request/response chains: acknowledge at once (the default
    // lets a receiver wait up to 25 ms, which stalls a sender whose window is full) and start
    // with a window that covers a pipeline segment instead of ten packets.
    let mut ack = AckFrequencyConfig::default();
    ack.max_ack_delay(Some(Duration::from_micros(500)));
    ack.ack_eliciting_threshold(VarInt::from_u32(1));
    t.ack_frequency_config(Some(ack));
    let mut cubic = quinn_proto::congestion::CubicConfig::default();
    cubic.initial_window(2 << 20);
    t.congestion_controller_factory(Arc::new(cubic));
    if let Ok(idle) = IdleTimeout::try_from(cfg.dead_after) {
        t.max_idle_timeout(Some(idle));
    }
    if loopback {
        // Loopback carries 64 KiB datagrams: start there, one datagram per `sendmsg` (no GSO):
        // a GSO batch of 64 KiB segments exceeds the kernel's 64 KiB limit per send, the batch
        // is dropped, quinn counts the losses, its black-hole detection falls back to 1,200-byte
        // packets and the congestion window collapses (see docs/transport.md).
        t.initial_mtu(quic.loopback_mtu);
        t.mtu_discovery_config(None);
    } else {
        // Probe up to jumbo frames (9,000-byte MTU less IPv6 and UDP headers); probes larger
        // than the interface allows fail locally and the search settles below.
        let mut mtud = quinn_proto::MtuDiscoveryConfig::default();
        mtud.upper_bound(8_952);
        t.mtu_discovery_config(Some(mtud));
    }
    // Batches of datagrams per `sendmsg` off loopback; `TUTTI_QUIC_GSO=0` turns them off.
    t.enable_segmentation_offload(!loopback && quic.gso);
    t
}

impl QuicTransport {
    /// Connect this rank to every other rank over QUIC, exchanging addresses and certificate
    /// fingerprints through `store`. With `cfg.shm` on, the ranks of this host are linked on
    /// first use through TCP's driver and shared memory instead (both ranks of a pair must offer
    /// it); every QUIC link connects before this returns.
    ///
    /// # Errors
    /// [`Error::Io`] when the UDP socket (or, with `cfg.shm`, the loopback TCP listener) cannot
    /// be bound; [`Error::Rendezvous`] naming the ranks that did not publish or connect in time,
    /// or whose certificate did not match.
    pub fn connect(
        id: &JobIdentity,
        store: Arc<dyn Store>,
        cfg: &LinkConfig,
        quic: &QuicConfig,
    ) -> Result<QuicTransport> {
        Self::connect_as(id, store, cfg, quic, Start::default(), Watch::NONE)
    }

    /// [`QuicTransport::connect`] with the test overrides in `start`, failing at once when
    /// `watch` says a peer has ended (a rebuild; start-up passes `Watch::NONE`).
    pub(crate) fn connect_as(
        id: &JobIdentity,
        store: Arc<dyn Store>,
        cfg: &LinkConfig,
        quic: &QuicConfig,
        start_as: Start,
        watch: Watch<'_>,
    ) -> Result<QuicTransport> {
        let loopback = start_as.loopback;
        let (rank, world) = (id.rank, id.world);
        let start = Instant::now();
        let deadline = start + cfg.connect_timeout;
        let rv = |detail: String| Error::Rendezvous { rank, detail };
        let me = tls::Identity::generate().map_err(rv)?;
        let sock = UdpSocket::bind(SocketAddr::new(cfg.bind_ip, cfg.port))
            .map_err(|e| Error::io(rank, format!("binding UDP {}", cfg.bind_ip), &e))?;
        let local = sock.local_addr().map_err(|e| Error::io(rank, "UDP address", &e))?;
        // Bursts of a pipeline segment overflow the default UDP receive buffer (~200 KiB) and
        // every drop halves the congestion window: ask for 32 MiB (the kernel caps it at
        // net.core.rmem_max / wmem_max unless we may force it), then keep what the peers may
        // have in flight towards us within what the kernel will actually hold.
        let rcvbuf = udp_buffers(&socket2::SockRef::from(&sock), 32 << 20);
        // The ranks of this host reach our TCP listener on loopback (the same network
        // namespace is part of the host's id).
        // Without a host id (no boot id to read), or a listener, this rank offers no pair
        // shared memory: it publishes no listener, and its peers then take its pairs for QUIC's
        // as it does.
        let host = start_as.host.or_else(shm::known_host_id);
        let mut near_side = match host {
            Some(_) if cfg.shm => {
                let lo = std::net::IpAddr::from(std::net::Ipv4Addr::LOCALHOST);
                // Port 0 whatever `cfg.port` says: that one is the UDP socket's.
                let any_port = LinkConfig { port: 0, ..cfg.clone() };
                TcpSide::bind(id, store.clone(), &any_port, lo)
                    .map_err(|e| debug!(rank, "no loopback listener, every pair on QUIC: {e}"))
                    .ok()
            }
            _ => None,
        };
        let host = host.unwrap_or([0; 32]);
        let mine =
            Record { addr: local, fp: me.fp, host, tcp: near_side.as_ref().map(|t| t.local()) };
        crate::store::set_signed(
            store.as_ref(),
            &id.key,
            id.job,
            &quic_key(rank),
            mine.encode().as_bytes(),
        )?;
        // Everyone's address and fingerprint, from the authenticated store.
        let mut peers: Vec<Option<Record>> = (0..world).map(|_| None).collect();
        let others: Vec<usize> = (0..world).filter(|j| *j != rank).collect();
        let keys: Vec<String> = others.iter().map(|j| quic_key(*j)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let raws = watch.get_all(store.as_ref(), rank, &refs, deadline, |missing| {
            let j = refs.iter().position(|k| *k == missing).map_or(0, |i| others[i]);
            rv(format!(
                "rank {j} did not publish its QUIC address within {:?}",
                cfg.connect_timeout
            ))
        })?;
        for (&j, raw) in others.iter().zip(raws) {
            let raw = crate::store::open_signed(&id.key, id.job, &quic_key(j), raw)
                .ok_or_else(|| crate::store::forged(rank, j, "QUIC address and certificate"))?;
            let text = String::from_utf8_lossy(&raw).into_owned();
            peers[j] = Some(Record::decode(&text).ok_or_else(|| {
                rv(format!("rank {j} published a malformed QUIC address {text:?}"))
            })?);
        }
        // A pair of this host whose ranks both offer shared memory goes through TCP's driver;
        // both read the same two records, so both agree.
        let near: Vec<bool> = peers
            .iter()
            .map(|p| {
                p.as_ref().is_some_and(|p| mine.tcp.is_some() && p.tcp.is_some() && p.host == host)
            })
            .collect();
        let far = |j: &usize| peers[*j].is_some() && !near[*j];
        if near.iter().all(|n| !n) {
            near_side = None; // its listener closes: nobody dials it
        }
        let allowed: HashMap<[u8; 32], usize> =
            (0..world).filter(far).filter_map(|j| peers[j].as_ref().map(|p| (p.fp, j))).collect();
        // Every QUIC peer on this host's loopback (a single-machine job): 64 KiB datagrams work.
        let loopback = loopback.unwrap_or_else(|| {
            cfg.bind_ip.is_loopback()
                || (0..world)
                    .filter(far)
                    .all(|j| peers[j].as_ref().is_some_and(|p| p.addr.ip().is_loopback()))
        });
        // Sized for the whole world, as on every rank (however many of its peers share its
        // host): a rank's peers size what they send it from the same rule.
        let in_flight = in_flight_limit(rcvbuf, world, loopback);
        let transport = Arc::new(transport_config(cfg, quic, loopback, in_flight));
        let server_tls =
            tls::server_config(&me, allowed.clone()).map_err(|e| rv(format!("TLS: {e}")))?;
        let server_crypto = quinn_proto::crypto::rustls::QuicServerConfig::try_from(server_tls)
            .map_err(|e| rv(format!("QUIC TLS: {e}")))?;
        let mut server = quinn_proto::ServerConfig::with_crypto(Arc::new(server_crypto));
        server.transport_config(transport.clone());
        let mut ec = quinn_proto::EndpointConfig::default();
        if loopback {
            // Accept the large datagrams loopback allows (see `transport_config`).
            let _ = ec.max_udp_payload_size(65_527);
        }
        // Off loopback: path MTU discovery (quinn-udp forbids fragmentation on the socket) and
        // batches of datagrams per `sendmsg` (GSO).
        let ep = quinn_proto::Endpoint::new(Arc::new(ec), Some(Arc::new(server)), !loopback, None);
        let core_cfg = if near_side.is_some() {
            // The links of this host connect on first use and need the core's keep-alives (on
            // the QUIC links too they are cheap); they park what TCP's driver would not buffer.
            let mut c = CoreConfig::from_link(cfg, crate::transport::tcp::driver::EAGER_MAX, true);
            c.lazy = true;
            c
        } else {
            // Any size may be buffered eagerly (the peer's window still parks: flow control);
            // quinn sends its own keep-alives (see `transport_config`).
            CoreConfig::from_link(cfg, u64::MAX, false)
        };
        let mut core = Core::new(rank, world, core_cfg, Instant::now());
        for j in (0..world).filter(far) {
            core.set_park_above(j, u64::MAX);
        }
        let tcp = TcpDriver::empty(
            world,
            cfg.tcp_congestion.clone(),
            near_side.is_some(),
            near_side.as_ref().map(TcpSide::connector),
        );
        let engine = QuicDriver::new(rank, world, sock, !loopback, ep, allowed)
            .and_then(|d| Engine::new(core, MixedDriver::new(d, tcp, near.clone()), cfg.spin))
            .map_err(|e| Error::io(rank, "configuring the UDP socket", &e))?;
        for j in (0..rank).filter(far) {
            let Some(p) = &peers[j] else { continue };
            let client_tls = tls::client_config(&me, p.fp).map_err(|e| rv(format!("TLS: {e}")))?;
            let crypto = quinn_proto::crypto::rustls::QuicClientConfig::try_from(client_tls)
                .map_err(|e| rv(format!("QUIC TLS: {e}")))?;
            let mut cc = quinn_proto::ClientConfig::new(Arc::new(crypto));
            cc.transport_config(transport.clone());
            driver::connect_to(&engine, j, cc, p.addr).map_err(rv)?;
        }
        driver::establish(&engine, deadline, watch).map_err(|e| match e {
            Ok(e) => rv(format!(
                "{e} (within {:?}; a refused certificate also ends here)",
                cfg.connect_timeout
            )),
            Err(gone) => gone,
        })?;
        let wire = Running::start(engine, format!("tutti-quic-{rank}"))
            .map_err(|e| Error::io(rank, "spawning the QUIC driver thread", &e))?;
        if let Some(side) = near_side.as_mut() {
            for (j, p) in peers.iter().enumerate().filter(|(j, _)| near[*j]) {
                if let Some(a) = p.as_ref().and_then(|p| p.tcp) {
                    side.know_addr(j, a);
                }
            }
            // A rank whose pair is QUIC's has no business with this listener.
            side.only(near.clone());
            side.start(wire.shared())?;
        }
        let shared = near.iter().filter(|n| **n).count();
        info!(
            rank, world, %local, loopback, same_host = shared, elapsed = ?start.elapsed(),
            "quic transport connected"
        );
        Ok(QuicTransport { rank, near: near_side, wire, local, fp: me.fp })
    }

    /// The UDP address this rank listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Wired for QuicTransport {
    type Driver = MixedDriver;
    const NAME: &'static str = "quic";

    fn engine(&self) -> &Engine<MixedDriver> {
        self.wire.engine()
    }

    fn listen_addr(&self) -> Option<SocketAddr> {
        Some(self.local_addr())
    }

    fn publish_failure(&self) {
        if let Some(side) = &self.near {
            side.note_failure();
        }
    }
}

/// Test overrides of [`QuicTransport::connect_as`]; the default is what a job does.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Start {
    /// Whether the path is treated as loopback (tests run the network path — small
    /// datagrams, GSO, `recvmmsg`, MTU discovery — on 127.0.0.1 with `Some(false)`).
    pub(crate) loopback: Option<bool>,
    /// The host id to publish in place of this host's: ranks of one process given different
    /// ids take each other for ranks of other hosts (a job across hosts, in one process).
    pub(crate) host: Option<[u8; 32]>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::quic_world;
    use crate::transport::{Transport, TransportExt};
    use crate::wire::{DType, Fingerprint, MsgDesc, OpKind, Tag};

    fn desc(step: u32) -> MsgDesc {
        MsgDesc {
            tag: Tag { group: 0, seq: 0, step },
            fp: Fingerprint {
                op: OpKind::Control,
                dtype: DType::U8,
                redop: 0,
                root: u32::MAX,
                count: 0,
                settings: 0,
            },
        }
    }

    fn exchange_ok(ts: &[QuicTransport], step: u32) {
        std::thread::scope(|s| {
            s.spawn(|| ts[0].send(1, desc(step), b"still fine", Duration::from_secs(30)).unwrap());
            let mut b = [0u8; 10];
            ts[1].recv(0, desc(step), &mut b, Duration::from_secs(30)).unwrap();
            assert_eq!(&b, b"still fine");
        });
    }

    #[test]
    fn the_network_path_delivers_every_size_exactly() {
        // The path taken off loopback (1,200–1,472-byte datagrams, GSO batches, `recvmmsg`,
        // MTU discovery), forced on 127.0.0.1: messages from 0 bytes to 8 MiB both ways at once,
        // content checked byte for byte.
        let cfg = LinkConfig { shm: false, ..LinkConfig::default() };
        let (ts, _server) = crate::testing::job(2, &cfg, |id, store, cfg| {
            QuicTransport::connect_as(
                id,
                store,
                cfg,
                &QuicConfig::default(),
                Start { loopback: Some(false), host: None },
                Watch::NONE,
            )
        })
        .unwrap();
        let sizes = [0usize, 1, 1199, 1472, 60_000, 65_536, 1 << 20, 8 << 20];
        let pattern = |r: usize, n: usize| -> Vec<u8> {
            (0..n).map(|i| (i.wrapping_mul(31) ^ r.wrapping_mul(7) ^ (i >> 9)) as u8).collect()
        };
        std::thread::scope(|s| {
            for (r, t) in ts.iter().enumerate() {
                s.spawn(move || {
                    for (k, &n) in sizes.iter().enumerate() {
                        let out = pattern(r, n);
                        let mut got = vec![0u8; n];
                        let peer = 1 - r;
                        let step = k as u32;
                        std::thread::scope(|s2| {
                            s2.spawn(|| {
                                t.send(peer, desc(step), &out, Duration::from_secs(60)).unwrap()
                            });
                            let len = t
                                .recv(peer, desc(step), &mut got, Duration::from_secs(60))
                                .unwrap();
                            assert_eq!(len, n);
                        });
                        assert!(got == pattern(peer, n), "rank {r}: {n} bytes differ");
                    }
                });
            }
        });
    }

    #[test]
    fn random_udp_datagrams_do_not_disturb_the_group() {
        let ts = quic_world(2, &LinkConfig::default()).unwrap();
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut x: u64 = 0x1234_5678;
        for i in 0..2000 {
            let len = 1 + (i * 37) % 1400;
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (x >> 56) as u8
                })
                .collect();
            let _ = sock.send_to(&junk, ts[(i % 2) as usize].local_addr());
        }
        exchange_ok(&ts, 1);
        assert!(ts[0].poisoned().is_none() && ts[1].poisoned().is_none());
    }

    /// A stranger's connection attempt to `target`, driven by hand with quinn-proto: `Some(reason)`
    /// when the target closed it within `within`, `None` when it stayed unanswered or open.
    fn stranger_refused(target: SocketAddr, pin: [u8; 32], within: Duration) -> Option<String> {
        let stranger = tls::Identity::generate().unwrap();
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
        let mut ep = quinn_proto::Endpoint::new(
            Arc::new(quinn_proto::EndpointConfig::default()),
            None,
            false,
            None,
        );
        // Even pinning the target's real fingerprint (so the client side is satisfied), the
        // stranger's own certificate is not in the job's published set: the target refuses.
        let crypto = quinn_proto::crypto::rustls::QuicClientConfig::try_from(
            tls::client_config(&stranger, pin).unwrap(),
        )
        .unwrap();
        let cc = quinn_proto::ClientConfig::new(Arc::new(crypto));
        let (_, mut conn) = ep.connect(Instant::now(), cc, target, "tutti").unwrap();
        let end = Instant::now() + within;
        let mut buf = Vec::new();
        let mut rx = vec![0u8; 65_536];
        while Instant::now() < end {
            let now = Instant::now();
            if conn.poll_timeout().is_some_and(|t| t <= now) {
                conn.handle_timeout(now);
            }
            loop {
                buf.clear();
                let Some(t) = conn.poll_transmit(now, 1, &mut buf) else { break };
                sock.send_to(&buf[..t.size], t.destination).unwrap();
            }
            if let Ok((n, from)) = sock.recv_from(&mut rx) {
                let data = bytes::BytesMut::from(&rx[..n]);
                buf.clear();
                if let Some(quinn_proto::DatagramEvent::ConnectionEvent(_, ev)) =
                    ep.handle(Instant::now(), from, None, None, data, &mut buf)
                {
                    conn.handle_event(ev);
                }
            }
            while let Some(ev) = conn.poll() {
                if let quinn_proto::Event::ConnectionLost { reason } = ev {
                    return Some(reason.to_string());
                }
            }
        }
        None
    }

    #[test]
    fn a_certificate_that_was_not_published_is_refused_during_start_up() {
        use crate::auth::JobKey;
        use crate::store::{StoreServer, TcpStore};
        let key = JobKey::from_token("tutti-test");
        let server =
            StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), 2, Some(key.clone()))
                .unwrap();
        let addr = server.addr();
        let cfg = LinkConfig { connect_timeout: Duration::from_secs(4), ..LinkConfig::default() };
        std::thread::scope(|s| {
            let rank0 = s.spawn(|| {
                let store = TcpStore::connect(addr, 0, 2, Some(&key), Duration::from_secs(30))?;
                let id = JobIdentity { rank: 0, world: 2, job: 7, key: key.clone() };
                QuicTransport::connect(&id, Arc::new(store), &cfg, &QuicConfig::default())
            });
            // Rank 1's slot: the store holds a published fingerprint that is not the stranger's,
            // so rank 0 (accepting, in start-up) must refuse the stranger's certificate.
            let store = TcpStore::connect(addr, 1, 2, Some(&key), Duration::from_secs(30)).unwrap();
            let published = tls::Identity::generate().unwrap();
            let raw = store.get(&quic_key(0), Duration::from_secs(30)).unwrap();
            let raw = crate::store::open_signed(&key, 7, &quic_key(0), raw).unwrap();
            let rec = Record::decode(&String::from_utf8(raw).unwrap()).unwrap();
            // Another host's rank: its pair with rank 0 is QUIC's.
            let fake = Record {
                addr: "127.0.0.1:9".parse().unwrap(),
                fp: published.fp,
                host: [7; 32],
                tcp: None,
            };
            crate::store::set_signed(&store, &key, 7, &quic_key(1), fake.encode().as_bytes())
                .unwrap();
            let refused = stranger_refused(rec.addr, rec.fp, Duration::from_secs(3));
            let reason = refused.expect("a stranger's QUIC connection was not refused");
            assert!(reason.contains("not published"), "refused for another reason: {reason}");
            // Rank 0 never got its real rank 1, and says so.
            let err = rank0.join().unwrap().unwrap_err().to_string();
            assert!(err.contains("[1]"), "{err}");
        });
    }

    #[test]
    fn a_forged_endpoint_in_the_store_is_refused_naming_it() {
        // Someone who can write to the store but lacks the job secret (an unauthenticated
        // store, a rewritten answer) publishes rank 1's endpoint: rank 0 refuses it before
        // connecting anywhere, over QUIC and TCP alike.
        use crate::auth::JobKey;
        use crate::store::{StoreServer, TcpStore};
        let key = JobKey::from_token("tutti-test-forgery");
        let server = StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), 2, None).unwrap();
        let addr = server.addr();
        let cfg = LinkConfig { connect_timeout: Duration::from_secs(10), ..LinkConfig::default() };
        let store: Arc<dyn Store> =
            Arc::new(TcpStore::connect(addr, 0, 2, None, Duration::from_secs(30)).unwrap());
        let fake = tls::Identity::generate().unwrap();
        let forged =
            Record { addr: "127.0.0.1:9".parse().unwrap(), fp: fake.fp, host: [7; 32], tcp: None };
        store.set(&quic_key(1), forged.encode().as_bytes()).unwrap();
        store.set(&crate::transport::tcp::addr_key(0), b"127.0.0.1:9").unwrap();
        let id = JobIdentity { rank: 0, world: 2, job: 7, key: key.clone() };
        let e = QuicTransport::connect(&id, store.clone(), &cfg, &QuicConfig::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 1's published QUIC address") && e.contains("fails its check"),
            "{e}"
        );
        // Over TCP, rank 0 has arrived (the forger counted it in), and the full mesh looks up
        // every address at start-up (connecting on first use would find it at the first call).
        store.add(crate::transport::tcp::UP_KEY, 1).unwrap();
        let id = JobIdentity { rank: 1, world: 2, job: 7, key };
        let cfg = LinkConfig { lazy: false, ..cfg };
        let e =
            crate::transport::tcp::TcpTransport::connect(&id, store, &cfg).unwrap_err().to_string();
        assert!(e.contains("rank 0's published address") && e.contains("fails its check"), "{e}");
    }

    #[test]
    fn a_connection_after_start_up_is_refused() {
        let ts = quic_world(2, &LinkConfig::default()).unwrap();
        let refused = stranger_refused(ts[0].local_addr(), ts[0].fp, Duration::from_secs(3));
        assert!(refused.is_some(), "a QUIC connection after start-up was not refused");
        exchange_ok(&ts, 2);
    }

    #[test]
    fn a_quic_job_links_the_ranks_of_one_host_through_shared_memory() {
        // Four ranks playing two hosts (0, 1 | 2, 3): before any use, the pairs of one host are
        // unconnected and the others on QUIC; after every pair exchanged a message both ways,
        // exact, the pairs of one host are on shared memory.
        let cfg = LinkConfig { connect_timeout: Duration::from_secs(60), ..LinkConfig::default() };
        let ts = crate::testing::quic_hosts_world(4, &cfg, |r| (r / 2) as u8).unwrap();
        let same = |a: usize, b: usize| a / 2 == b / 2;
        for (r, t) in ts.iter().enumerate() {
            assert!(t.offers_shared_memory());
            for p in (0..4).filter(|p| *p != r) {
                let want = if same(r, p) { "unconnected" } else { "quic" };
                assert_eq!(t.link_kind(p), want, "rank {r} to {p} before use");
            }
        }
        std::thread::scope(|s| {
            for (r, t) in ts.iter().enumerate() {
                s.spawn(move || {
                    for p in (0..4).filter(|p| *p != r) {
                        let d = desc(p as u32 * 4 + r as u32);
                        let msg: Vec<u8> =
                            (0..100_000).map(|i| (i * 7 + r * 3 + p) as u8).collect();
                        t.send(p, d, &msg, Duration::from_secs(30)).unwrap();
                    }
                    for p in (0..4).filter(|p| *p != r) {
                        let d = desc(r as u32 * 4 + p as u32);
                        let mut got = vec![0u8; 100_000];
                        assert_eq!(
                            t.recv(p, d, &mut got, Duration::from_secs(30)).unwrap(),
                            100_000
                        );
                        let want: Vec<u8> =
                            (0..100_000).map(|i| (i * 7 + p * 3 + r) as u8).collect();
                        assert!(got == want, "rank {r}: the bytes from {p} differ");
                    }
                });
            }
        });
        for (r, t) in ts.iter().enumerate() {
            for p in (0..4).filter(|p| *p != r) {
                let want = if same(r, p) { "shm" } else { "quic" };
                assert_eq!(t.link_kind(p), want, "rank {r} to {p} after use");
            }
        }
    }

    #[test]
    fn without_shared_memory_a_quic_job_on_one_host_is_all_quic() {
        let ts = quic_world(3, &LinkConfig::default()).unwrap();
        for (r, t) in ts.iter().enumerate() {
            assert!(!t.offers_shared_memory());
            for p in (0..3).filter(|p| *p != r) {
                assert_eq!(t.link_kind(p), "quic");
            }
        }
        assert!(ts.iter().all(|t| t.near.is_none()));
    }

    #[test]
    fn a_rank_without_shared_memory_keeps_its_pairs_on_quic_and_both_sides_agree() {
        // Three ranks of one host; rank 1 has shared memory off. Its pairs are QUIC's on both
        // sides; the pair 0–2 links through shared memory. Every pair exchanges exact bytes.
        let cfg = LinkConfig { connect_timeout: Duration::from_secs(60), ..LinkConfig::default() };
        let (ts, _server) = crate::testing::job(3, &cfg, |id, store, cfg| {
            let cfg = LinkConfig { shm: id.rank != 1, ..cfg.clone() };
            QuicTransport::connect(id, store, &cfg, &QuicConfig::default())
        })
        .unwrap();
        std::thread::scope(|s| {
            for (r, t) in ts.iter().enumerate() {
                s.spawn(move || {
                    for p in (0..3).filter(|p| *p != r) {
                        let d = desc(10 + p as u32 * 3 + r as u32);
                        t.send(p, d, &[r as u8; 5000], Duration::from_secs(30)).unwrap();
                    }
                    for p in (0..3).filter(|p| *p != r) {
                        let d = desc(10 + r as u32 * 3 + p as u32);
                        let mut got = [0u8; 5000];
                        t.recv(p, d, &mut got, Duration::from_secs(30)).unwrap();
                        assert!(got.iter().all(|b| *b == p as u8), "rank {r} from {p}");
                    }
                });
            }
        });
        let kind = |a: usize, b: usize| ts[a].link_kind(b);
        assert_eq!((kind(0, 1), kind(1, 0)), ("quic", "quic"));
        assert_eq!((kind(2, 1), kind(1, 2)), ("quic", "quic"));
        assert_eq!((kind(0, 2), kind(2, 0)), ("shm", "shm"));
        assert!(ts[1].near.is_none());
    }

    #[test]
    fn a_quic_jobs_listener_refuses_a_rank_whose_pair_is_quics() {
        use crate::transport::tcp::handshake::Status;
        let ts =
            crate::testing::quic_hosts_world(4, &LinkConfig::default(), |r| (r / 2) as u8).unwrap();
        let side = ts[0].near.as_ref().expect("rank 0 has a rank of its host");
        assert_eq!(side.accept_status(2), Status::WrongRank);
        assert_eq!(side.accept_status(3), Status::WrongRank);
        assert_eq!(side.accept_status(1), Status::Ok);
    }

    #[test]
    fn a_record_decodes_only_whole() {
        let r = Record {
            addr: "127.0.0.1:4000".parse().unwrap(),
            fp: [0xab; 32],
            host: [3; 32],
            tcp: Some("127.0.0.1:5000".parse().unwrap()),
        };
        let text = r.encode();
        let back = Record::decode(&text).expect("its own encoding");
        assert_eq!((back.addr, back.fp, back.host, back.tcp), (r.addr, r.fp, r.host, r.tcp));
        let none = Record { tcp: None, ..r };
        assert!(none.encode().ends_with("|-"));
        assert_eq!(Record::decode(&none.encode()).unwrap().tcp, None);
        // The former two-field record, a short fingerprint, a bad listener, a field too many.
        let (fp, host) = (tls::hex(&[0xab; 32]), tls::hex(&[3; 32]));
        for bad in [
            format!("127.0.0.1:4000|{fp}"),
            format!("127.0.0.1:4000|{}|{host}|-", &fp[2..]),
            format!("127.0.0.1:4000|{fp}|{host}|nowhere"),
            format!("127.0.0.1:4000|{fp}|{host}|-|x"),
            format!("localhost|{fp}|{host}|-"),
        ] {
            assert!(Record::decode(&bad).is_none(), "{bad}");
        }
    }
}
