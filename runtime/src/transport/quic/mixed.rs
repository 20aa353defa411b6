//! The driver of a QUIC job: QUIC between hosts, and between the ranks of one host TCP's
//! driver with its shared-memory rings (`../tcp/shm.rs`), under one engine and one core.
//!
//! Which driver carries a pair is decided once, at start-up, from what both ranks published:
//! a pair on one host (the same kernel boot, network and pid namespaces) whose ranks both offer
//! shared memory goes through TCP's driver — connected on first use, its frames in the rings —
//! and every other pair through QUIC, connected at start-up as before. Both ranks of a pair read
//! the same two records, so they agree. The core sees one link per peer either way: framing,
//! matching, flow control, deadlines, aborts and the mismatch checks are the same code on both.
//!
//! With no pair on one host (or shared memory off) the TCP half holds nothing, connects
//! nothing and costs no system call: the job runs as a QUIC-only job did. With no pair on
//! another host, the UDP socket is neither read nor polled.

use std::time::{Duration, Instant};

use super::driver::{HasQuic, QuicDriver};
use crate::transport::core::{Core, LinkFail};
use crate::transport::engine::{Driver, Mode};
use crate::transport::tcp::driver::TcpDriver;
use crate::transport::tcp::HasTcp;

/// QUIC's driver for the peers on other hosts, TCP's for those on this one.
pub(crate) struct MixedDriver {
    quic: QuicDriver,
    tcp: TcpDriver,
    /// Per peer: its link goes through TCP's driver.
    near: Vec<bool>,
    /// Some peer's link goes through TCP's driver.
    any_near: bool,
    /// Some peer's link goes through QUIC (without one, the UDP socket is never read: a QUIC
    /// job on one host spins and sleeps on its rings alone).
    any_far: bool,
}

impl MixedDriver {
    /// `quic` for every peer but those `near` marks, which go through `tcp`.
    pub(crate) fn new(quic: QuicDriver, tcp: TcpDriver, near: Vec<bool>) -> MixedDriver {
        let any_near = near.iter().any(|n| *n);
        let any_far = quic.has_peers();
        MixedDriver { quic, tcp, near, any_near, any_far }
    }

    fn near(&self, peer: usize) -> bool {
        self.near.get(peer).copied().unwrap_or(false)
    }
}

impl HasQuic for MixedDriver {
    fn quic(&mut self) -> &mut QuicDriver {
        &mut self.quic
    }
}

impl HasTcp for MixedDriver {
    fn tcp(&mut self) -> &mut TcpDriver {
        &mut self.tcp
    }
}

impl Driver for MixedDriver {
    const WAITING_NAP: Duration = QuicDriver::WAITING_NAP;

    fn look_while_spinning(&self) -> bool {
        // A look serves only what it finds flagged: QUIC's timers and held-back stream bytes
        // need a pass.
        self.any_near && !self.any_far && self.tcp.look_while_spinning()
    }

    fn arm(&mut self, core: &Core, mode: Mode) -> bool {
        // Both asked: a ring's wake-up must be armed even when QUIC has input already.
        let tcp = self.any_near && self.tcp.arm(core, mode);
        self.quic.arm(core, mode) | tcp
    }

    fn hot_spin(&self) -> bool {
        self.any_near && self.tcp.hot_spin()
    }

    fn spin_progress(&self) -> u64 {
        if self.any_near {
            self.tcp.spin_progress()
        } else {
            0
        }
    }

    fn link_kind(&self, peer: usize) -> Option<&'static str> {
        if self.near(peer) {
            self.tcp.link_kind(peer)
        } else {
            Some("quic")
        }
    }

    fn offers_shared_memory(&self) -> bool {
        self.tcp.offers_shared_memory()
    }

    fn dial(&mut self, core: &mut Core, peer: usize) {
        if self.near(peer) {
            self.tcp.dial(core, peer);
        } else {
            // QUIC links are all connected (or failed) before start-up returns.
            core.link_failed(peer, LinkFail::Lost("its QUIC link was never connected".into()));
        }
    }

    fn flush(&mut self, core: &mut Core, peer: usize, now: Instant) {
        if self.near(peer) {
            self.tcp.flush(core, peer, now);
        } else {
            self.quic.flush(core, peer, now);
        }
    }

    fn read(&mut self, core: &mut Core, peer: usize, now: Instant) {
        if self.near(peer) {
            self.tcp.read(core, peer, now);
        } else {
            self.quic.read(core, peer, now);
        }
    }

    fn progress(&mut self, core: &mut Core, mode: Mode, now: Instant) {
        if self.any_near {
            self.tcp.progress(core, mode, now);
        }
        if self.any_far {
            self.quic.progress(core, mode, now);
        }
    }

    fn next_timer(&mut self) -> Option<Instant> {
        if self.any_far {
            self.quic.next_timer()
        } else {
            None
        }
    }

    fn poll_set(&mut self, core: &Core, mode: Mode, fds: &mut Vec<libc::pollfd>) {
        if self.any_near {
            self.tcp.poll_set(core, mode, fds);
        }
        if self.any_far {
            self.quic.poll_set(core, mode, fds);
        }
    }

    fn ready(&mut self, core: &mut Core, mode: Mode, fds: &[libc::pollfd], now: Instant) {
        // TCP's driver finds its connections by descriptor and skips the UDP socket's.
        if self.any_near {
            self.tcp.ready(core, mode, fds, now);
        }
        let udp = self.quic.fd();
        if self.any_far && fds.iter().any(|f| f.fd == udp && f.revents != 0) {
            self.quic.ready(core, mode, fds, now);
        }
    }

    fn link_down(&mut self, core: &mut Core, peer: usize) {
        if self.near(peer) {
            self.tcp.link_down(core, peer);
        } else {
            self.quic.link_down(core, peer);
        }
    }

    fn shutdown_step(&mut self, core: &mut Core, now: Instant) -> bool {
        let tcp = !self.any_near || self.tcp.shutdown_step(core, now);
        let quic = self.quic.shutdown_step(core, now);
        tcp && quic
    }

    fn close(&mut self, core: &mut Core, now: Instant) {
        self.tcp.close(core, now);
        self.quic.close(core, now);
    }
}
