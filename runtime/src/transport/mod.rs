//! The transport: point-to-point send and receive, nothing else.
//!
//! A [`Transport`] connects the `world_size` ranks of one job. Algorithms post sends of byte
//! ranges to a peer and receives into byte ranges from a peer, each under a [`MsgDesc`] (tag plus
//! fingerprint), and wait for them with a deadline. Several operations may be in flight per peer;
//! messages of one (peer, tag) arrive in order; a receive lands directly in the caller's buffer.
//!
//! The raw posting methods are `unsafe` because the transport keeps the buffer's address until the
//! operation completes or is cancelled (Gloo's `UnboundBuffer` model). Safe code uses
//! [`TransportExt`]: blocking [`send`](TransportExt::send) / [`recv`](TransportExt::recv) and
//! [`exchange`](TransportExt::exchange), which posts many operations and waits for all of them
//! while it holds the borrows.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::wire::MsgDesc;

/// Settings of a connection-based transport, shared by TCP and QUIC (QUIC's own are in
/// [`QuicConfig`]). Read from the environment by `rendezvous::Options::from_env`, where a
/// malformed value is an error naming the variable.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Address to listen on and advertise. Default: chosen by rendezvous (the interface that
    /// routes to `MASTER_ADDR`, or `TUTTI_SOCKET_IFNAME`). Hazard: a wildcard address would
    /// listen on every interface; rendezvous never picks one.
    pub bind_ip: IpAddr,
    /// Port to listen on; 0 (the default) lets the OS pick.
    pub port: u16,
    /// How long start-up waits for every peer to publish its address and connect. Default 300 s
    /// (like torchrun's rendezvous). Hazard: too short fails jobs whose ranks start slowly.
    pub connect_timeout: Duration,
    /// How long one whole handshake may take, however its bytes are split. Default 2 s. At most
    /// `MAX_HANDSHAKES` (64) run at once per listener; a dialling rank whose handshake breaks
    /// tries again until `connect_timeout`. Hazard: too long lets a silent client hold a
    /// handshake slot that long; too short fails handshakes on a badly overloaded host.
    pub handshake_timeout: Duration,
    /// How long a waiter spins (yielding) before blocking in the kernel. Default 50 µs. Hazard:
    /// long spins waste CPU that oversubscribed ranks need; zero costs latency on slow-waking VMs.
    pub spin: Duration,
    /// Flow control: payload bytes one peer may have waiting on this rank before their receives
    /// are posted (`TUTTI_WINDOW_BYTES`). Default 16 MiB. A sender past it waits, with its usual
    /// deadline and dead-peer checks, until the receiver posts. Hazard: smaller makes a sender
    /// that runs ahead of slow receivers wait sooner; larger holds more memory per peer.
    pub window: u64,
    /// Bytes of messages that may be buffered before their receive is posted, per rank, when a
    /// wait must move a parked message aside to reach a later one from the same peer. Default
    /// 1 GiB; beyond it the rank fails with `UnexpectedOverflow`. Hazard: larger lets such a
    /// program hold that much memory here.
    pub unexpected_limit: u64,
    /// Idle time after which a keep-alive is sent on a connection. Default 1 s; the connection
    /// core sends them at most a quarter of `dead_after` apart whatever this says, so a peer
    /// that only receives never looks dead. Keep-alives are
    /// sent by a background thread, so long computation between collectives keeps them going
    /// (over QUIC, quinn's keep-alives at this interval).
    pub keepalive_interval: Duration,
    /// A peer that an operation waits on and that sent nothing at all (not even a keep-alive)
    /// for this long is declared dead, and every rank is told. Default 5 s (5 missed
    /// keep-alives). The clock starts at the peer's first frame: a peer that has sent nothing
    /// yet may still be connecting the rest of its world, and is waited for until the
    /// operation's deadline. Hazard: shorter values can misjudge a peer whose host is badly overloaded.
    pub dead_after: Duration,
    /// How long an operation waits before asking its peer (one small probe frame) whether they
    /// are in the same collective; a disagreement fails both at once. Default 1 s. Hazard: very
    /// short values add a frame to every slow wait; it never changes results.
    pub probe_after: Duration,
    /// TCP congestion control for the data connections (`TUTTI_TCP_CONGESTION`; `system` keeps
    /// the system's default). Default `cubic`. Measured on the 2-core VM, whose system default
    /// is BBR: a 1 MiB exchange between 2 ranks over loopback took 330–680 µs with BBR and
    /// 160 µs with cubic (BBR paces by a bandwidth estimate that bursty collective traffic keeps
    /// low). An algorithm the kernel lacks is skipped (the system's default stays), with a
    /// debug log. Hazard: on long-haul links with loss, BBR may be the better choice.
    pub tcp_congestion: Option<String>,
    /// Whether the links between ranks of one host carry their frames through shared memory
    /// (`TUTTI_SHM`, default on; `0` keeps every byte on the network). Both ranks of a pair
    /// must offer it; a pair that cannot set it up stays on TCP. In a QUIC job such a pair
    /// goes through TCP's driver and its rings instead of QUIC (QUIC then carries only the
    /// pairs on different hosts).
    pub shm: bool,
    /// Whether TCP connects a pair of ranks when one of them first sends to or posts a receive
    /// from the other (`TUTTI_CONNECT=lazy`, the default) instead of connecting the full mesh
    /// at start-up (`TUTTI_CONNECT=eager`). Lazy: a ring or tree job holds the few connections
    /// it uses, and start-up costs O(1) store requests per rank; a rank that never started is
    /// still found at start-up (every rank waits until all published their addresses). Eager:
    /// `world - 1` connections per rank before the first call, and no call pays a connect.
    /// QUIC always connects the full mesh.
    pub lazy: bool,
}

impl Default for LinkConfig {
    fn default() -> LinkConfig {
        LinkConfig {
            bind_ip: IpAddr::from([127, 0, 0, 1]),
            port: 0,
            connect_timeout: Duration::from_secs(300),
            handshake_timeout: Duration::from_secs(2),
            spin: Duration::from_micros(50),
            window: 16 << 20,
            unexpected_limit: 1 << 30,
            keepalive_interval: Duration::from_secs(1),
            dead_after: Duration::from_secs(5),
            probe_after: Duration::from_secs(1),
            tcp_congestion: Some("cubic".to_string()),
            shm: true,
            lazy: true,
        }
    }
}

/// Settings only the QUIC transport has; the ones it shares with TCP (timeouts, keep-alive,
/// dead-peer limit, spin, budgets) are in [`LinkConfig`]. Read from the environment by
/// `rendezvous::Options::from_env`, where a malformed value is an error naming the variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuicConfig {
    /// Datagram size on loopback, bytes (`TUTTI_QUIC_MTU`, 1,200 to 65,527). Default 65,000:
    /// the largest UDP payload less headroom for IP options.
    /// Hazard: above what one `sendmsg` may carry, every datagram is dropped.
    pub loopback_mtu: u16,
    /// Segmentation offload off loopback: batches of datagrams per `sendmsg` (`TUTTI_QUIC_GSO`,
    /// `1` or `0`). Default on. Hazard: off costs CPU per datagram; turn it off only on a
    /// network path that drops the batches.
    pub gso: bool,
}

impl QuicConfig {
    /// Smallest datagram QUIC allows.
    pub const MIN_MTU: u16 = 1_200;
    /// Largest UDP payload over IPv4.
    pub const MAX_MTU: u16 = 65_527;
}

impl Default for QuicConfig {
    fn default() -> QuicConfig {
        QuicConfig { loopback_mtu: 65_000, gso: true }
    }
}

#[cfg_attr(not(feature = "quic"), allow(dead_code))]
pub(crate) mod core;
pub(crate) mod engine;
pub(crate) mod matcher;
pub mod mem;
#[cfg_attr(not(feature = "quic"), allow(dead_code))]
pub(crate) mod queue;
#[cfg(feature = "quic")]
pub mod quic;
pub mod tcp;

/// What a connect in progress asks between its waits: whether a rank it waits for is already
/// known to have ended (the launcher said so), so a rebuild fails at once, naming it, instead of
/// waiting out its deadline for a process that will never come. [`Watch::NONE`] waits until the
/// deadline (start-up, where a peer may only be slow to start).
#[derive(Clone, Copy)]
pub(crate) struct Watch<'a> {
    gone: Option<&'a (dyn Fn() -> Option<(usize, String)> + Sync)>,
}

impl<'a> Watch<'a> {
    /// No watch: every wait lasts until its deadline.
    pub(crate) const NONE: Watch<'static> = Watch { gone: None };
    /// How often a watched wait looks again.
    const SLICE: Duration = Duration::from_millis(20);

    /// Watch with `gone`, which names a rank of the world being connected that has ended, and
    /// how.
    pub(crate) fn new(gone: &'a (dyn Fn() -> Option<(usize, String)> + Sync)) -> Watch<'a> {
        Watch { gone: Some(gone) }
    }

    /// [`Error::PeerLost`] naming the rank that ended, if one did (no operation: it was lost
    /// while connecting).
    pub(crate) fn check(&self, rank: usize) -> Result<()> {
        match self.gone.and_then(|f| f()) {
            None => Ok(()),
            Some((peer, what)) => Err(Error::PeerLost {
                rank,
                peer,
                ctx: None,
                detail: format!(
                    "rank {peer} of the world being connected is gone ({what}); connecting \
                     without it is for the survivors to agree on"
                ),
            }),
        }
    }

    /// How long one wait may last before the watch looks again: all of `left` without a watch.
    pub(crate) fn slice(&self, left: Duration) -> Duration {
        if self.gone.is_some() {
            left.min(Self::SLICE)
        } else {
            left
        }
    }

    /// `store`'s values at `keys`, in one round trip per slice of the wait
    /// (`Store::get_all`), waiting until `deadline` (then `on_timeout`'s error, given the key
    /// the store named as missing) and looking between slices.
    pub(crate) fn get_all(
        &self,
        store: &dyn crate::store::Store,
        rank: usize,
        keys: &[&str],
        deadline: Instant,
        on_timeout: impl FnOnce(&str) -> Error,
    ) -> Result<Vec<Vec<u8>>> {
        // Keys before the one a timed-out slice named are set: later slices wait on the rest
        // only, and the first ones are read once at the end.
        let mut from = 0;
        loop {
            self.check(rank)?;
            let left = deadline.saturating_duration_since(Instant::now());
            match store.get_all(&keys[from..], self.slice(left)) {
                Ok(rest) if from == 0 => return Ok(rest),
                Ok(rest) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let mut all = store.get_all(&keys[..from], left.max(Self::SLICE))?;
                    all.extend(rest);
                    return Ok(all);
                }
                Err(Error::StoreTimeout { key, .. }) if Instant::now() < deadline => {
                    from += keys[from..].iter().position(|k| *k == key).unwrap_or(0);
                }
                Err(Error::StoreTimeout { key, .. }) => return Err(on_timeout(&key)),
                Err(e) => return Err(e),
            }
        }
    }
}

/// Identifies a posted operation on one transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

/// Point-to-point message passing between the ranks of one job.
///
/// Implementations: [`mem::MemTransport`] (ranks as threads), [`tcp::TcpTransport`] and, with
/// the `quic` feature, `quic::QuicTransport` (ranks as processes). Collective algorithms see
/// only this trait.
pub trait Transport: Send + Sync {
    /// This process's rank in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the job.
    fn world_size(&self) -> usize;

    /// Name of the transport (`mem`, `tcp`, …), for logs and benchmarks.
    fn name(&self) -> &'static str;

    /// How the frames to `peer` travel: `shm` for a TCP connection to a rank of this host that
    /// moves its frames through shared memory, otherwise the transport's [`name`](Transport::name).
    fn link_kind(&self, peer: usize) -> &'static str {
        let _ = peer;
        self.name()
    }

    /// Connect the links to `peers` that are not connected yet (a transport that connects on
    /// first use, `LinkConfig::lazy`), and wait until they are. Transports that connect every
    /// link up front return at once. A peer that cannot be reached fails the transport, as a
    /// lost link does.
    ///
    /// # Errors
    /// The failure that poisoned the transport (a peer that refused or could not be reached,
    /// named), or [`Error::Rendezvous`] naming the peers still unconnected after `timeout`.
    fn connect_peers(&self, peers: &[usize], timeout: Duration) -> Result<()> {
        let _ = (peers, timeout);
        Ok(())
    }

    /// Make this transport's failure known to the peers not connected to it yet (TCP, whose
    /// links connect on first use: its abort reason in the store, where a peer that dials it
    /// later reads it). Called by [`Group::fail`](crate::Group::fail) after recording a
    /// failure; does nothing when not poisoned, or done already. It may only start the work
    /// (TCP writes the note on a thread of its own); dropping the transport waits for it,
    /// within a bound.
    fn publish_failure(&self) {}

    /// Whether the link to `peer` is connected now (always, for transports that connect
    /// every link up front; one that connects on first use says false until it did).
    fn is_connected(&self, peer: usize) -> bool {
        let _ = peer;
        true
    }

    /// Whether this rank can map `peer`'s [windows](crate::window::Window): the peer runs in
    /// this process (in memory) or on this host over a shared-memory link. Collectives that
    /// read peers' memory directly run only where this holds for every peer.
    fn shares_memory_with(&self, peer: usize) -> bool {
        peer != self.rank() && matches!(self.link_kind(peer), "shm" | "mem")
    }

    /// Whether this rank offers shared memory to the ranks of its host (`LinkConfig::shm`):
    /// a link to a peer of this host, connected now, would go through it (given the peer
    /// offers it too). What the collectives ask of a peer whose link is not connected yet
    /// ([`is_connected`](Transport::is_connected)), where
    /// [`shares_memory_with`](Transport::shares_memory_with) cannot say.
    fn offers_shared_memory(&self) -> bool {
        false
    }

    /// Post a send of `len` bytes at `data` to `peer` under `desc`.
    ///
    /// # Safety
    /// `data..data+len` must stay valid for reads, and must not be written, until
    /// [`wait`](Transport::wait) or [`test`](Transport::test) reports the operation finished, or
    /// [`cancel`](Transport::cancel) returns.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad peer; the poisoning error once the transport failed.
    unsafe fn post_send(
        &self,
        peer: usize,
        desc: MsgDesc,
        data: *const u8,
        len: usize,
    ) -> Result<OpId>;

    /// Post a receive of at most `cap` bytes into `buf` from `peer` under `desc`.
    ///
    /// # Safety
    /// `buf..buf+cap` must stay valid for writes, and must not be accessed, until the operation
    /// finished or [`cancel`](Transport::cancel) returns.
    ///
    /// # Errors
    /// As [`post_send`](Transport::post_send).
    unsafe fn post_recv(
        &self,
        peer: usize,
        desc: MsgDesc,
        buf: *mut u8,
        cap: usize,
    ) -> Result<OpId>;

    /// Wait until `op` finishes or `deadline` passes. Returns the bytes moved. A finished
    /// operation is forgotten: wait for each at most once.
    ///
    /// # Errors
    /// [`Error::Timeout`] at the deadline (the operation stays posted: cancel it or wait again);
    /// the operation's own failure ([`Error::PeerLost`], [`Error::Mismatch`], …).
    fn wait(&self, op: OpId, deadline: Instant) -> Result<usize>;

    /// Make progress without blocking; `Some(bytes)` when `op` has finished (and is forgotten).
    ///
    /// # Errors
    /// As [`wait`](Transport::wait), without timeouts.
    fn test(&self, op: OpId) -> Result<Option<usize>>;

    /// Withdraw a posted operation. When this returns, the transport no longer touches its buffer
    /// (a partly written send is completed from a private copy; a partly read receive is
    /// drained). Unknown or finished ids are ignored.
    fn cancel(&self, op: OpId);

    /// Fail every pending and future operation with [`Error::Aborted`] and tell every peer
    /// `reason`: [`fail`](Transport::fail) with that cause. Idempotent, callable from any
    /// thread, never blocks for long.
    fn abort(&self, reason: &str);

    /// Record `cause` as this transport's failure and tell every peer `reason` (an abort frame
    /// on every link): every pending and future operation fails, the later ones with
    /// [`Error::Poisoned`] of the cause. The transport is the one owner of a rank's failure
    /// state: the first failure wins — this call, a peer's abort, a lost link, a local
    /// [`abort`](Transport::abort) — and [`poisoned`](Transport::poisoned) reports it to every
    /// group over the transport from then on. Returns whether this call was that first failure.
    /// Callable from any thread, never blocks for long.
    fn fail(&self, cause: Error, reason: &str) -> bool;

    /// Someone who watches the processes (the launcher) reports that `peer`'s process has
    /// ended: fail as a lost connection to it would, with `detail` as the cause — operations
    /// with `peer` fail naming it, the transport is poisoned and the other peers are told.
    /// Transports that see such losses themselves need not override the default, an
    /// [`abort`](Transport::abort) naming the peer. Out-of-range ranks and our own are ignored.
    fn peer_died(&self, peer: usize, detail: &str) {
        if peer < self.world_size() && peer != self.rank() {
            self.abort(&format!("peer rank {peer} ended: {detail}"));
        }
    }

    /// The error that poisoned this transport, if any.
    fn poisoned(&self) -> Option<Error>;

    /// For a wait on `peer` that began at `since` with no operation posted to it (direct reads
    /// wait on a peer's memory): apply the dead-peer rule — a peer from which nothing, not
    /// even a keep-alive, arrived for the dead-peer limit since the later of its last traffic
    /// and `since` is declared lost, as for a waiting operation — and report the transport's
    /// failure.
    ///
    /// # Errors
    /// The error that poisoned the transport (this peer's loss, or any earlier failure).
    fn check_peer(&self, peer: usize, since: Instant) -> Result<()> {
        let _ = (peer, since);
        match self.poisoned() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// For a wait on `peer`'s memory (direct reads) with no link to `peer` connected, which
    /// would tell: the dead-peer rule from what the kernel says of its process (`state`, of the
    /// owner of `peer`'s [window](crate::window::Window::owner)). Ended, 100 ms after the first
    /// look that saw it (time for the abort of a rank that failed and then exited to arrive
    /// through other ranks and name the real cause): `peer` is lost; stopped for the
    /// dead-peer limit since the later of the first look that saw it stopped and `since`: lost
    /// as a silent peer. Either fails the transport as a lost link does: operations with `peer`
    /// name it, the transport is poisoned, the connected peers are told. Then report the
    /// transport's failure. A caller that read an end looks again at what it waits for first:
    /// a peer that published it and then exited is no failure.
    ///
    /// # Errors
    /// The error that poisoned the transport (this peer's loss, or any earlier failure).
    fn check_process(
        &self,
        peer: usize,
        state: &crate::window::ProcessState,
        since: Instant,
    ) -> Result<()> {
        let _ = (peer, state, since);
        match self.poisoned() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Whether a message under `desc`'s tag from `peer` has arrived (whole, or its header)
    /// and waits for a receive: a receive posted now would match it at once. Never blocks.
    /// For receiving from whichever peer sends first ([`Group::recv_any`](crate::Group::recv_any)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad peer; the poisoning error once the transport failed.
    fn probe(&self, peer: usize, desc: MsgDesc) -> Result<bool>;

    /// The peers this transport knows are gone: their connection closed or broke, or they
    /// fell silent past the dead-peer limit (a peer that sent an abort is alive, and not
    /// listed). What a survivor reports when the ranks agree on who is left. Default: none
    /// known.
    fn lost_peers(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Payload bytes this rank holds for messages that arrived whole before their receives
    /// were posted, from every peer together, sends to itself included. Flow control keeps
    /// each peer's share within [`LinkConfig::window`] (plus messages a wait moved aside to
    /// reach a later one, within [`LinkConfig::unexpected_limit`]); sends to itself are bounded
    /// by neither, and a message still arriving is not counted yet. What to look at when a
    /// rank's memory grows while its peers run ahead of it. Never blocks for long (it takes the
    /// connection core's lock). Default: 0 (a transport that holds nothing it was not asked
    /// for).
    fn unexpected_bytes(&self) -> u64 {
        0
    }

    /// The address this rank listens on and published to its peers (`None` for transports
    /// without one, such as the in-memory transport).
    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        None
    }
}

/// One operation for [`TransportExt::exchange`].
#[derive(Debug)]
pub enum Op<'a> {
    /// Send `data` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Tag and fingerprint.
        desc: MsgDesc,
        /// Payload.
        data: &'a [u8],
    },
    /// Receive from `peer` into `buf`; `received` is set to the bytes that arrived.
    Recv {
        /// Source rank.
        peer: usize,
        /// Tag and fingerprint.
        desc: MsgDesc,
        /// Destination.
        buf: &'a mut [u8],
        /// Bytes received, set by `exchange`.
        received: usize,
    },
}

/// Safe conveniences over the raw [`Transport`] methods.
pub trait TransportExt: Transport {
    /// Send `data` to `peer` and wait until it is handed to the transport's wire.
    ///
    /// # Errors
    /// As [`Transport::wait`].
    fn send(&self, peer: usize, desc: MsgDesc, data: &[u8], timeout: Duration) -> Result<()> {
        let mut ops = [Op::Send { peer, desc, data }];
        self.exchange(&mut ops, timeout)
    }

    /// Receive from `peer` into `buf`; returns the bytes received.
    ///
    /// # Errors
    /// As [`Transport::wait`]; [`Error::TooLong`] when the message does not fit.
    fn recv(&self, peer: usize, desc: MsgDesc, buf: &mut [u8], timeout: Duration) -> Result<usize> {
        let mut ops = [Op::Recv { peer, desc, buf, received: 0 }];
        self.exchange(&mut ops, timeout)?;
        match ops {
            [Op::Recv { received, .. }] => Ok(received),
            _ => unreachable!("the array holds the one receive built above"),
        }
    }

    /// Post every operation, then wait for all of them (in order) within `timeout`. On the first
    /// error the rest are cancelled and the error is returned.
    ///
    /// # Errors
    /// The first failure among the operations.
    fn exchange(&self, ops: &mut [Op<'_>], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut ids = Vec::with_capacity(ops.len());
        let mut result = Ok(());
        for op in ops.iter_mut() {
            // SAFETY: the buffers are borrowed for the whole call and every posted id is waited
            // for or cancelled below before the borrows end.
            let posted = unsafe {
                match op {
                    Op::Send { peer, desc, data } => {
                        self.post_send(*peer, *desc, data.as_ptr(), data.len())
                    }
                    Op::Recv { peer, desc, buf, .. } => {
                        self.post_recv(*peer, *desc, buf.as_mut_ptr(), buf.len())
                    }
                }
            };
            match posted {
                Ok(id) => ids.push(id),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let mut done = 0;
        if result.is_ok() {
            for (i, id) in ids.iter().enumerate() {
                match self.wait(*id, deadline) {
                    Ok(n) => {
                        if let Op::Recv { received, .. } = &mut ops[i] {
                            *received = n;
                        }
                        done = i + 1;
                    }
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
        }
        for id in &ids[done..] {
            self.cancel(*id);
        }
        result
    }
}

impl<T: Transport + ?Sized> TransportExt for T {}

#[cfg(test)]
mod flow_tests;
#[cfg(test)]
mod rogue_tests;
#[cfg(test)]
mod tests;
