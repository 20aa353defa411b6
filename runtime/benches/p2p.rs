//! Point-to-point over loopback: tutti's TCP transport against raw blocking sockets, and tutti's
//! QUIC transport, in the same run. Prints one-way latency (half the ping-pong round trip) at
//! 8 B and streaming throughput at 64 MiB, medians of several repetitions, and the ratios.
//!
//! `cargo bench -p tutti-runtime --features testing --bench p2p` (`P2P_REPS`, `P2P_PINGS` to change the counts).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tutti_runtime::testing::tcp_world;
use tutti_runtime::transport::LinkConfig;
use tutti_runtime::{DType, Fingerprint, MsgDesc, OpKind, Tag, Transport, TransportExt};

const T: Duration = Duration::from_secs(60);

fn env(k: &str, d: usize) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

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

fn raw_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    (a, b)
}

/// Raw blocking ping-pong: one-way latency in µs.
fn raw_latency(pings: usize) -> f64 {
    let (mut a, mut b) = raw_pair();
    let h = std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        for _ in 0..pings {
            b.read_exact(&mut buf).unwrap();
            b.write_all(&buf).unwrap();
        }
    });
    let mut buf = [1u8; 8];
    let start = Instant::now();
    for _ in 0..pings {
        a.write_all(&buf).unwrap();
        a.read_exact(&mut buf).unwrap();
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / pings as f64 / 2.0;
    h.join().unwrap();
    us
}

/// Raw ping-pong on non-blocking sockets, spinning with `sched_yield` (no kernel wake-up):
/// one-way latency in µs. The fairest raw baseline for a spinning transport.
fn raw_latency_spin(pings: usize) -> f64 {
    fn read_spin(s: &mut TcpStream, buf: &mut [u8]) {
        let mut got = 0;
        while got < buf.len() {
            match s.read(&mut buf[got..]) {
                Ok(0) => panic!("closed"),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
    }
    let (mut a, mut b) = raw_pair();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    let h = std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        for _ in 0..pings {
            read_spin(&mut b, &mut buf);
            b.write_all(&buf).unwrap();
        }
    });
    let mut buf = [1u8; 8];
    let start = Instant::now();
    for _ in 0..pings {
        a.write_all(&buf).unwrap();
        read_spin(&mut a, &mut buf);
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / pings as f64 / 2.0;
    h.join().unwrap();
    us
}

/// Raw blocking stream of `len` bytes, `reps` times: GB/s.
fn raw_stream(len: usize, reps: usize) -> f64 {
    let (mut a, mut b) = raw_pair();
    let h = std::thread::spawn(move || {
        let mut buf = vec![0u8; len];
        for _ in 0..reps {
            b.read_exact(&mut buf).unwrap();
        }
        b.write_all(&[1]).unwrap();
    });
    let buf = vec![7u8; len];
    let start = Instant::now();
    for _ in 0..reps {
        a.write_all(&buf).unwrap();
    }
    let mut ack = [0u8; 1];
    a.read_exact(&mut ack).unwrap();
    let gbs = (len * reps) as f64 / start.elapsed().as_secs_f64() / 1e9;
    h.join().unwrap();
    gbs
}

fn tutti_pair() -> Vec<Arc<dyn Transport>> {
    let (ts, _server) = tcp_world(2, &LinkConfig::default()).unwrap();
    ts.into_iter().map(|t| Arc::new(t) as Arc<dyn Transport>).collect()
}

fn quic_pair() -> Vec<Arc<dyn Transport>> {
    let ts = tutti_runtime::testing::quic_world(2, &LinkConfig::default()).unwrap();
    ts.into_iter().map(|t| Arc::new(t) as Arc<dyn Transport>).collect()
}

fn tutti_latency(ts: &[Arc<dyn Transport>], pings: usize) -> f64 {
    let t1 = ts[1].clone();
    let h = std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        for _ in 0..pings {
            t1.recv(0, desc(0), &mut buf, T).unwrap();
            t1.send(0, desc(1), &buf, T).unwrap();
        }
    });
    let mut buf = [1u8; 8];
    let start = Instant::now();
    for _ in 0..pings {
        ts[0].send(1, desc(0), &buf, T).unwrap();
        ts[0].recv(1, desc(1), &mut buf, T).unwrap();
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / pings as f64 / 2.0;
    h.join().unwrap();
    us
}

fn tutti_stream(ts: &[Arc<dyn Transport>], len: usize, reps: usize) -> f64 {
    let t1 = ts[1].clone();
    let h = std::thread::spawn(move || {
        let mut buf = vec![0u8; len];
        for _ in 0..reps {
            t1.recv(0, desc(2), &mut buf, T).unwrap();
        }
        t1.send(0, desc(3), &[1], T).unwrap();
    });
    let buf = vec![7u8; len];
    let start = Instant::now();
    for _ in 0..reps {
        ts[0].send(1, desc(2), &buf, T).unwrap();
    }
    let mut ack = [0u8; 1];
    ts[0].recv(1, desc(3), &mut ack, T).unwrap();
    let gbs = (len * reps) as f64 / start.elapsed().as_secs_f64() / 1e9;
    h.join().unwrap();
    gbs
}

fn main() {
    let reps = env("P2P_REPS", 7);
    let pings = env("P2P_PINGS", 20000);
    let len = 64 << 20;
    let ts = tutti_pair();
    let qs = quic_pair();
    // Warm up every path (page faults, socket buffer autotuning).
    raw_stream(len, 2);
    tutti_stream(&ts, len, 2);
    tutti_stream(&qs, len, 2);
    let (mut rl, mut tl, mut rs, mut tsr, mut sl) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut ql, mut qsr) = (vec![], vec![]);
    for _ in 0..reps {
        rl.push(raw_latency(pings));
        sl.push(raw_latency_spin(pings));
        tl.push(tutti_latency(&ts, pings));
        ql.push(tutti_latency(&qs, pings));
        rs.push(raw_stream(len, 8));
        tsr.push(tutti_stream(&ts, len, 8));
        qsr.push(tutti_stream(&qs, len, 8));
    }
    let (rl, sl, tl, rs, tsr) = (median(rl), median(sl), median(tl), median(rs), median(tsr));
    let (ql, qsr) = (median(ql), median(qsr));
    println!("p2p over loopback TCP, medians of {reps} runs (same process, same run)");
    println!("{:<34} {:>12} {:>12} {:>8}", "", "raw socket", "tutti", "ratio");
    println!(
        "{:<34} {:>12.2} {:>12.2} {:>7.2}x",
        "8 B one-way latency, blocking (us)",
        rl,
        tl,
        tl / rl
    );
    println!(
        "{:<34} {:>12.2} {:>12.2} {:>7.2}x",
        "8 B one-way latency, spinning (us)",
        sl,
        tl,
        tl / sl
    );
    println!(
        "{:<34} {:>12.2} {:>12.2} {:>7.0}%",
        "64 MiB stream (GB/s)",
        rs,
        tsr,
        100.0 * tsr / rs
    );
    println!();
    println!("{:<34} {:>12} {:>12} {:>8}", "", "tutti tcp", "tutti quic", "ratio");
    println!("{:<34} {:>12.2} {:>12.2} {:>7.2}x", "8 B one-way latency (us)", tl, ql, ql / tl);
    println!(
        "{:<34} {:>12.2} {:>12.2} {:>7.0}%",
        "64 MiB stream (GB/s)",
        tsr,
        qsr,
        100.0 * qsr / tsr
    );
}
