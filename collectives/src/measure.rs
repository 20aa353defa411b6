//! The link measurement: which ranks share a host, and, across hosts, the links' per-message (α),
//! per-byte (β) and reduction (γ) costs, measured once per group at its first collective.
//!
//! It runs its collectives straight through the executor with fixed algorithms
//! (`Comm::execute`), never through the public collectives: nothing it calls can choose an
//! algorithm or start the measurement again, so it needs no guard.

use std::time::Instant;

use tracing::debug;

use crate::comm::Comm;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::model::Model;
use crate::select::Algo;
use crate::topo::Topology;

/// Messages of the measurement's latency measurement.
const SMALL: usize = 5;
/// Bytes of the measurement's local reduction (larger than a core's cache, as real buffers are).
const REDUCE: usize = 8 << 20;
/// Bytes per rank of the measurement's all-gather.
const BYTES: usize = 1 << 20;
/// Per-link bandwidth of that all-gather on loopback on the machine the built-in table was
/// measured on (2-core VM, 4 ranks over TCP), in bytes per second.
pub(crate) const REFERENCE_BW: f64 = 1.0e9;
/// Links at least this many times slower than the reference count as slower (`link_scale`).
const SLOW: f64 = 4.0;

/// Measure `comm`'s group, whose rank advertises `ip`: its topology, and the cost model when its
/// links are at least [`SLOW`] times slower than the reference (`None` otherwise, and on one
/// host). Every rank calls it at the same point; the slowest rank's times are everyone's.
pub(crate) fn measure(comm: &Comm, ip: std::net::IpAddr) -> Result<(Topology, Option<Model>)> {
    let n = comm.size();
    let key = match ip {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => v6.octets(),
    };
    let mut keys = vec![0u8; 16 * n];
    comm.exec_allgather(Algo::Ring, &key, &mut keys)?;
    let topo = Topology::from_keys(&keys.chunks(16).collect::<Vec<_>>());
    let hosts = topo.hosts();
    // Known from now on, so the timed ring below walks the ranks host by host (`on_ring`), as
    // every ring the choice will plan does: with ranks placed round-robin over hosts a ring in
    // rank order would cross hosts at every link and measure the links too slow.
    let _ = comm.sel.topo.set(std::sync::Arc::new(topo.clone()));
    if hosts < 2 {
        return Ok((topo, None));
    }
    let mut small = f64::MAX;
    for _ in 0..SMALL {
        let mut x = [0.0f64];
        let t = Instant::now();
        comm.exec_allreduce_f64(Algo::Tree, &mut x, ReduceOp::Sum)?;
        small = small.min(t.elapsed().as_secs_f64());
    }
    let mine = vec![0u8; BYTES];
    let mut all = vec![0u8; BYTES * n];
    let mut big = f64::MAX;
    for _ in 0..2 {
        let t = Instant::now();
        comm.exec_allgather(Algo::Ring, &mine, &mut all)?;
        big = big.min(t.elapsed().as_secs_f64());
    }
    let mut reduce = f64::MAX;
    let (mut acc, add) = (vec![0u8; REDUCE], vec![0u8; REDUCE]);
    for _ in 0..3 {
        let t = Instant::now();
        crate::kernel::reduce_into(DType::F32, ReduceOp::Sum, &mut acc, &add);
        reduce = reduce.min(t.elapsed().as_secs_f64());
    }
    let mut worst = [small, big, reduce];
    comm.exec_allreduce_f64(Algo::Tree, &mut worst, ReduceOp::Max)?;
    let [small, big, reduce] = worst;
    let steps = 2 * crate::model::ceil_log2(n);
    let bw = (n - 1) as f64 * BYTES as f64 / big.max(1e-9);
    let model = Model {
        alpha: small / steps as f64,
        beta: 1.0 / bw,
        beta_local: crate::model::LOCAL_BETA,
        gamma: reduce / REDUCE as f64,
    };
    let scale = REFERENCE_BW / bw;
    debug!(bw, scale, ?model, hosts, "link measurement");
    Ok((topo, (scale >= SLOW).then_some(model)))
}
