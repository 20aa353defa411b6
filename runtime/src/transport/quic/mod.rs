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

use tracing::info;

use crate::error::{Error, Result};
use crate::store::Store;
use crate::transport::tcp::JobIdentity;
use crate::transport::LinkConfig;
use crate::transport::QuicConfig;

mod driver;
mod tls;

use crate::transport::core::{Core, CoreConfig};
use crate::transport::engine::{Engine, Running, Wired};
use crate::transport::Watch;
use driver::QuicDriver;

/// Store key under which rank `r` publishes `addr|fingerprint`.
pub fn quic_key(r: usize) -> String {
    format!("tutti/quic/{r}")
}

/// The QUIC transport of one rank.
pub struct QuicTransport {
    rank: usize,
    /// The engine; dropping it shuts the connections down cleanly.
    wire: Running<QuicDriver>,
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
    /// fingerprints through `store`.
    ///
    /// # Errors
    /// [`Error::Io`] when the UDP socket cannot be bound; [`Error::Rendezvous`] naming the ranks
    /// that did not publish or connect in time, or whose certificate did not match.
    pub fn connect(
        id: &JobIdentity,
        store: &dyn Store,
        cfg: &LinkConfig,
        quic: &QuicConfig,
    ) -> Result<QuicTransport> {
        Self::connect_as(id, store, cfg, quic, None, Watch::NONE)
    }

    /// [`QuicTransport::connect`], with `loopback` overriding whether the path is treated as
    /// loopback (tests run the network path — small datagrams, GSO, `recvmmsg`, MTU discovery —
    /// on 127.0.0.1 with `Some(false)`), failing at once when `watch` says a peer has ended (a
    /// rebuild; start-up passes `Watch::NONE`).
    pub(crate) fn connect_as(
        id: &JobIdentity,
        store: &dyn Store,
        cfg: &LinkConfig,
        quic: &QuicConfig,
        loopback: Option<bool>,
        watch: Watch<'_>,
    ) -> Result<QuicTransport> {
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
        let mine = format!("{local}|{}", tls::hex(&me.fp));
        crate::store::set_signed(store, &id.key, id.job, &quic_key(rank), mine.as_bytes())?;
        // Everyone's address and fingerprint, from the authenticated store.
        let mut peers: Vec<Option<(SocketAddr, [u8; 32])>> = vec![None; world];
        let others: Vec<usize> = (0..world).filter(|j| *j != rank).collect();
        let keys: Vec<String> = others.iter().map(|j| quic_key(*j)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let raws = watch.get_all(store, rank, &refs, deadline, |missing| {
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
            let parsed =
                text.split_once('|').and_then(|(a, f)| Some((a.parse().ok()?, tls::unhex(f)?)));
            peers[j] = Some(parsed.ok_or_else(|| {
                rv(format!("rank {j} published a malformed QUIC address {text:?}"))
            })?);
        }
        let allowed: HashMap<[u8; 32], usize> =
            peers.iter().enumerate().filter_map(|(j, p)| p.map(|(_, fp)| (fp, j))).collect();
        // Every peer on this host's loopback (a single-machine job): 64 KiB datagrams work.
        let loopback = loopback.unwrap_or_else(|| {
            cfg.bind_ip.is_loopback()
                || peers.iter().flatten().all(|(addr, _)| addr.ip().is_loopback())
        });
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
        let core = Core::new(
            rank,
            world,
            // Any size may be buffered eagerly (the peer's window still parks: flow control);
            // quinn sends its own keep-alives (see `transport_config`).
            CoreConfig::from_link(cfg, u64::MAX, false),
            Instant::now(),
        );
        let engine = QuicDriver::new(rank, world, sock, !loopback, ep, allowed)
            .and_then(|d| Engine::new(core, d, cfg.spin))
            .map_err(|e| Error::io(rank, "configuring the UDP socket", &e))?;
        for (j, p) in peers.iter().enumerate().take(rank) {
            let Some((addr, fp)) = p else { continue };
            let client_tls = tls::client_config(&me, *fp).map_err(|e| rv(format!("TLS: {e}")))?;
            let crypto = quinn_proto::crypto::rustls::QuicClientConfig::try_from(client_tls)
                .map_err(|e| rv(format!("QUIC TLS: {e}")))?;
            let mut cc = quinn_proto::ClientConfig::new(Arc::new(crypto));
            cc.transport_config(transport.clone());
            driver::connect_to(&engine, j, cc, *addr).map_err(rv)?;
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
        info!(rank, world, %local, loopback, elapsed = ?start.elapsed(), "quic transport connected");
        Ok(QuicTransport { rank, wire, local, fp: me.fp })
    }

    /// The UDP address this rank listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Wired for QuicTransport {
    type Driver = QuicDriver;
    const NAME: &'static str = "quic";

    fn engine(&self) -> &Engine<QuicDriver> {
        self.wire.engine()
    }

    fn listen_addr(&self) -> Option<SocketAddr> {
        Some(self.local_addr())
    }
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
        let (ts, _server) = crate::testing::job(2, &LinkConfig::default(), |id, store, cfg| {
            QuicTransport::connect_as(
                id,
                store.as_ref(),
                cfg,
                &QuicConfig::default(),
                Some(false),
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
                QuicTransport::connect(&id, &store as &dyn Store, &cfg, &QuicConfig::default())
            });
            // Rank 1's slot: the store holds a published fingerprint that is not the stranger's,
            // so rank 0 (accepting, in start-up) must refuse the stranger's certificate.
            let store = TcpStore::connect(addr, 1, 2, Some(&key), Duration::from_secs(30)).unwrap();
            let published = tls::Identity::generate().unwrap();
            let raw = store.get(&quic_key(0), Duration::from_secs(30)).unwrap();
            let raw = crate::store::open_signed(&key, 7, &quic_key(0), raw).unwrap();
            let text = String::from_utf8(raw).unwrap();
            let (a, f) = text.split_once('|').unwrap();
            let fake = format!("127.0.0.1:9|{}", tls::hex(&published.fp));
            crate::store::set_signed(&store, &key, 7, &quic_key(1), fake.as_bytes()).unwrap();
            let target: SocketAddr = a.parse().unwrap();
            let refused = stranger_refused(target, tls::unhex(f).unwrap(), Duration::from_secs(3));
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
        let store = TcpStore::connect(addr, 0, 2, None, Duration::from_secs(30)).unwrap();
        let fake = tls::Identity::generate().unwrap();
        store.set(&quic_key(1), format!("127.0.0.1:9|{}", tls::hex(&fake.fp)).as_bytes()).unwrap();
        store.set(&crate::transport::tcp::addr_key(0), b"127.0.0.1:9").unwrap();
        let id = JobIdentity { rank: 0, world: 2, job: 7, key: key.clone() };
        let e = QuicTransport::connect(&id, &store as &dyn Store, &cfg, &QuicConfig::default())
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
        let store: Arc<dyn Store> = Arc::new(store);
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
}
