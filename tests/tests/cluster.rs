//! Several hosts on one machine (`tests/cluster/cluster.sh`: network namespaces on a bridge, each
//! with IPv4 and IPv6, a decoy interface and a docker0 bridge): `tutti-run --nnodes` across hosts
//! with two ranks per host, every collective exact over TCP and QUIC (QUIC off loopback: path MTU
//! discovery and segmentation offload); IPv6 only; the interface chosen by route, by NCCL syntax
//! and, with a file store, with no master address — never loopback, the decoy or docker0; a host
//! whose link goes down mid-job named by every survivor within `TUTTI_DEAD_AFTER` + 1 s; ranks
//! sharing a host found, and on shaped links the cost model's choice (two-level), exact.
//!
//! Needs root and network namespaces (CI runs as root). A machine without them fails these tests,
//! unless `TUTTI_TEST_NO_NAMESPACES=1` says to skip them (printed).

use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/cluster/cluster.sh");
const RANK: &str = env!("CARGO_BIN_EXE_tt-rank");
const RUN: &str = env!("CARGO_BIN_EXE_tt-run");
const SECRET: &str = "cluster-test-secret-0123";

/// One cluster at a time in this process (they share the bridge's address plan); under
/// cargo-nextest, whose tests are processes, the `namespaces` group of .config/nextest.toml.
static ONE: Mutex<()> = Mutex::new(());

/// A cluster of `hosts` namespaces, taken down when dropped.
struct Cluster {
    name: String,
    hosts: usize,
}

impl Cluster {
    /// Bring one up, or `None` (after saying why) where namespaces cannot be made here.
    fn up(hosts: usize, rate: Option<&str>) -> Option<Cluster> {
        let name = format!("tc{}", std::process::id() % 100_000);
        let mut cmd = Command::new("bash");
        cmd.args([SCRIPT, "up", &hosts.to_string(), "--name", &name]);
        if let Some(r) = rate {
            cmd.args(["--rate", r]);
        }
        let out = cmd.output().expect("bash");
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            // A machine that cannot make the hosts fails these tests, unless the user said to
            // skip them: a skip nobody asked for would pass without testing anything.
            assert!(
                std::env::var_os("TUTTI_TEST_NO_NAMESPACES").is_some(),
                "cannot bring the namespace cluster up (these tests need root and network \
                 namespaces): run as root, or set TUTTI_TEST_NO_NAMESPACES=1 to skip the \
                 cluster tests\n{err}"
            );
            eprintln!(
                "TUTTI_TEST_NO_NAMESPACES set and no namespace cluster ({}): the cluster tests \
                 did not run",
                err.trim()
            );
            return None;
        }
        Some(Cluster { name, hosts })
    }

    fn ns(&self, host: usize) -> String {
        format!("{}-h{host}", self.name)
    }

    /// `prog args…` on `host` (inheriting `env`), started.
    fn spawn(&self, host: usize, prog: &str, args: &[&str], env: &[(&str, &str)]) -> Child {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(host), prog]).args(args);
        for k in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TUTTI_STORE", "TUTTI_TOKEN"]
        {
            c.env_remove(k);
        }
        c.envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c.spawn().expect("ip netns exec")
    }

    /// A `tutti-run` per host, `per_host` ranks each, running `tt-rank args…`; the outputs.
    fn job(
        &self,
        per_host: usize,
        master: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Vec<Output> {
        self.job_of(RANK, per_host, master, args, env)
    }

    /// As [`job`](Cluster::job), running `prog args…`.
    fn job_of(
        &self,
        prog: &str,
        per_host: usize,
        master: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Vec<Output> {
        let port = "29811";
        let nodes = self.hosts.to_string();
        let nproc = per_host.to_string();
        let mut env = env.to_vec();
        env.push(("TUTTI_TOKEN", SECRET));
        env.push(("TUTTI_CONNECT_TIMEOUT", "60"));
        let children: Vec<Child> = (0..self.hosts)
            .map(|h| {
                let node = h.to_string();
                let mut a = vec!["--nnodes", &nodes, "--node-rank", &node, "--nproc", &nproc];
                a.extend(["--master-addr", master, "--master-port", port, "--grace", "1", "--"]);
                a.push(prog);
                a.extend(args);
                self.spawn(h, RUN, &a, &env)
            })
            .collect();
        wait_all(children, Duration::from_secs(180))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash").args([SCRIPT, "down", "--name", &self.name]).status();
    }
}

fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<Output> {
    let start = Instant::now();
    children
        .into_iter()
        .map(|mut c| {
            while c.try_wait().ok().flatten().is_none() {
                if start.elapsed() > limit {
                    let _ = c.kill();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            c.wait_with_output().expect("output")
        })
        .collect()
}

fn text(outs: &[Output]) -> String {
    outs.iter()
        .map(|o| {
            format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
        })
        .collect()
}

fn all_ok(outs: &[Output], ranks: usize, what: &str) {
    let t = text(outs);
    for (h, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "{what}: host {h} failed:\n{t}");
    }
    for r in 0..ranks {
        assert!(t.contains(&format!("OK {r}")), "{what}: rank {r} did not pass:\n{t}");
    }
}

/// Every rank's links (tt-rank's `LINKS` lines): shared memory to the ranks of its own host,
/// `net` to the others (ranks placed host by host, `per_host` each).
fn check_links(outs: &[Output], ranks: usize, per_host: usize, net: &str) {
    let t = text(outs);
    for r in 0..ranks {
        let links = t
            .lines()
            .find_map(|l| l.split_once(&format!("LINKS {r} ")).map(|x| x.1))
            .unwrap_or_else(|| panic!("rank {r} did not report its links:\n{t}"));
        for (p, k) in links.trim().split(',').enumerate() {
            let want = match p {
                _ if p == r => "-",
                _ if p / per_host == r / per_host => "shm",
                _ => net,
            };
            assert_eq!(k, want, "rank {r}'s link to rank {p}:\n{t}");
        }
    }
}

#[test]
fn every_collective_across_hosts_over_tcp_and_quic() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(c) = Cluster::up(3, None) else { return };
    for transport in ["tcp", "quic"] {
        // A mixed job: shared memory inside each host, TCP or QUIC between hosts.
        let outs = c.job(2, "10.77.0.1", &["collectives"], &[("TUTTI_TRANSPORT", transport)]);
        all_ok(&outs, 6, transport);
        check_links(&outs, 6, 2, transport);
    }
    // Full-size messages over QUIC off loopback (path MTU discovery, GSO, batched receives):
    // collbench's own check of every element of a 16 MiB allreduce and all-to-all.
    for coll in ["allreduce", "alltoall"] {
        let outs = c.job_of(
            env!("CARGO_BIN_EXE_tt-collbench"),
            1,
            "10.77.0.1",
            &[coll, "-b", "16M", "-e", "16M", "-n", "2", "-w", "1", "-c", "1"],
            &[("TUTTI_TRANSPORT", "quic")],
        );
        let t = text(&outs);
        assert!(outs.iter().all(|o| o.status.success()), "quic {coll} 16 MiB:\n{t}");
        assert!(t.contains("Out of bounds values : 0 OK"), "quic {coll} 16 MiB:\n{t}");
    }
    // IPv6 only: the master and every rank on the hosts' IPv6 addresses.
    let outs = c.job(2, "fd77::1", &["whereami"], &[]);
    all_ok(&outs, 6, "ipv6");
    for line in text(&outs).lines().filter_map(|l| l.split("ADDR ").nth(1)) {
        let addr = line.split_whitespace().nth(1).unwrap_or("");
        assert!(addr.starts_with("[fd77::"), "an IPv6 job advertised {addr}");
    }
}

/// Ranks sharing a host are found (3 hosts × 2 ranks), and on links much slower than loopback
/// (shaped to 200 Mbit/s) the choice follows the cost model: a 4 MiB allreduce goes two-level
/// (each host link carries 2(h−1)/h·S instead of the ring's 2(n−1)/n·S), and so do 6 MiB
/// all-gathers and reduce-scatters, exact on every rank.
#[test]
fn hosts_are_found_and_slow_links_choose_from_the_model() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(c) = Cluster::up(3, Some("200mbit")) else { return };
    let outs = c.job(2, "10.77.0.1", &["topology"], &[]);
    all_ok(&outs, 6, "topology");
    let t = text(&outs);
    for r in 0..6 {
        let line = t
            .lines()
            .find(|l| l.contains(&format!("TOPO {r} ")))
            .unwrap_or_else(|| panic!("rank {r} printed no topology:\n{t}"));
        assert!(line.contains("hosts 3 per_host Some(2) host_of 0,0,1,1,2,2"), "rank {r}: {line}");
        let scale: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
        assert!(scale >= 4.0, "rank {r}: 200 Mbit/s links measured as loopback: {line}");
        let algos: Vec<&str> = t
            .lines()
            .filter_map(|l| l.split_once(&format!("ALGO {r} ")).map(|(_, a)| a.trim()))
            .collect();
        assert_eq!(algos, ["twolevel", "twolevel"], "rank {r}:\n{t}");
        // All-gather and reduce-scatter of 6 MiB: two-level too (each host link carries
        // (h−1)/h·S instead of (n−1)/n·S), chosen and forced, exact.
        for what in ["GATHER", "SCATTER"] {
            let algos: Vec<&str> = t
                .lines()
                .filter_map(|l| l.split_once(&format!("{what} {r} ")).map(|(_, a)| a.trim()))
                .collect();
            assert_eq!(algos, ["twolevel", "twolevel"], "{what} rank {r}:\n{t}");
        }
    }
}

/// The address each rank advertises, by route, by NCCL syntax and with a file store (no master
/// address): the host's eth0 address every time, never loopback, the decoy or docker0.
#[test]
fn the_right_interface_is_advertised() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(c) = Cluster::up(2, None) else { return };
    let check = |outs: &[Output], what: &str| {
        all_ok(outs, 4, what);
        let t = text(outs);
        let addrs: Vec<&str> = t
            .lines()
            .filter_map(|l| l.split("ADDR ").nth(1))
            .filter_map(|l| l.split_whitespace().nth(1))
            .collect();
        assert_eq!(addrs.len(), 4, "{what}:\n{t}");
        for a in addrs {
            assert!(a.starts_with("10.77.0."), "{what}: a rank advertised {a}");
        }
    };
    check(&c.job(2, "10.77.0.1", &["whereami"], &[]), "by route");
    check(&c.job(2, "10.77.0.1", &["whereami"], &[("TUTTI_SOCKET_IFNAME", "eth")]), "eth");
    check(
        &c.job(2, "10.77.0.1", &["whereami"], &[("TUTTI_SOCKET_IFNAME", "^docker,lo,decoy")]),
        "^docker,lo,decoy",
    );
    // A file store (namespaces share the file system) and no master address at all.
    let dir = std::env::temp_dir().join(format!("tutti-cluster-fs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let url = format!("file://{}", dir.display());
    let children: Vec<Child> = (0..2)
        .flat_map(|h| (0..2).map(move |l| (h, l)))
        .map(|(h, l)| {
            let rank = (h * 2 + l).to_string();
            c.spawn(
                h,
                RANK,
                &["whereami"],
                &[
                    ("RANK", &rank),
                    ("WORLD_SIZE", "4"),
                    ("TUTTI_STORE", &url),
                    ("TUTTI_TOKEN", SECRET),
                    ("TUTTI_CONNECT_TIMEOUT", "60"),
                ],
            )
        })
        .collect();
    let outs = wait_all(children, Duration::from_secs(120));
    let _ = std::fs::remove_dir_all(&dir);
    check(&outs, "file store, no master address");
}

/// A host whose link goes down mid-job (its bridge port set down: nothing is reset, nothing
/// answers): every survivor names one of its ranks within `TUTTI_DEAD_AFTER` + 1 s.
#[test]
fn a_host_that_drops_off_the_network_is_named() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(c) = Cluster::up(3, None) else { return };
    for transport in ["tcp", "quic"] {
        let env =
            [("TUTTI_TRANSPORT", transport), ("TUTTI_DEAD_AFTER", "2"), ("TUTTI_TIMEOUT", "60")];
        let mut env_all = env.to_vec();
        env_all.push(("TUTTI_TOKEN", SECRET));
        env_all.push(("TUTTI_CONNECT_TIMEOUT", "60"));
        let nodes: Vec<Child> = (0..3)
            .map(|h| {
                let node = h.to_string();
                let a = [
                    "--nnodes",
                    "3",
                    "--node-rank",
                    &node,
                    "--nproc",
                    "1",
                    "--master-addr",
                    "10.77.0.1",
                    "--master-port",
                    "29812",
                    "--grace",
                    "1",
                    "--",
                    RANK,
                    "loop",
                ];
                c.spawn(h, RUN, &a, &env_all)
            })
            .collect();
        // Let the job run, then cut host 2 off.
        std::thread::sleep(Duration::from_secs(3));
        let cut_us = tutti_tests::now_us();
        let status = Command::new("ip")
            .args(["link", "set", &format!("{}-v2", c.name), "down"])
            .status()
            .expect("ip");
        assert!(status.success());
        let outs = wait_all(nodes, Duration::from_secs(60));
        let _ = Command::new("ip").args(["link", "set", &format!("{}-v2", c.name), "up"]).status();
        let t = text(&outs[..2]);
        for r in 0..2 {
            let line = t
                .lines()
                .find(|l| l.starts_with(&format!("[{r}] ERR")))
                .unwrap_or_else(|| panic!("{transport}: rank {r} reported nothing:\n{t}"));
            assert!(line.contains("rank 2"), "{transport}: rank {r} does not name rank 2: {line}");
            let seen: u128 =
                line.split_whitespace().nth(2).and_then(|v| v.parse().ok()).unwrap_or(0);
            let took = seen.saturating_sub(cut_us);
            eprintln!("{transport}: rank {r} named rank 2 {took} us after the cut");
            // TUTTI_DEAD_AFTER (2 s) + 1 s.
            assert!(took < 3_000_000, "{transport}: rank {r} took {took} us: {line}");
        }
    }
}

/// The `elastic_dp` example (built by `cargo test --workspace`).
fn elastic_example() -> String {
    tutti_tests::example("elastic_dp").to_string_lossy().into_owned()
}

/// A network partition of an elastic data-parallel job, 8 ranks on 4 hosts (the store on host
/// 0): with host 3 cut off, the 6 ranks on the store's side agree, go on and finish every step
/// with equal weights, while the 2 cut off stop with the cut-off error; with hosts 2 and 3 cut
/// off at once, neither half is a strict majority and nobody goes on. No side hangs.
#[test]
fn a_partition_leaves_at_most_one_side_going_on() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(c) = Cluster::up(4, None) else { return };
    let prog = elastic_example();
    for cut in [vec![3usize], vec![2, 3]] {
        let env = [
            ("TUTTI_DEAD_AFTER", "2"),
            ("TUTTI_TIMEOUT", "20"),
            ("TUTTI_TOKEN", SECRET),
            ("TUTTI_CONNECT_TIMEOUT", "60"),
        ];
        let nodes: Vec<Child> = (0..4)
            .map(|h| {
                let node = h.to_string();
                let a = [
                    "--elastic",
                    "--nnodes",
                    "4",
                    "--node-rank",
                    &node,
                    "--nproc",
                    "2",
                    "--master-addr",
                    "10.77.0.1",
                    "--master-port",
                    "29813",
                    "--grace",
                    "1",
                    "--",
                    &prog,
                    "--steps",
                    "600",
                    "--step-ms",
                    "10",
                ];
                c.spawn(h, RUN, &a, &env)
            })
            .collect();
        std::thread::sleep(Duration::from_secs(4));
        for h in &cut {
            let s = Command::new("ip")
                .args(["link", "set", &format!("{}-v{h}", c.name), "down"])
                .status()
                .expect("ip");
            assert!(s.success());
        }
        let outs = wait_all(nodes, Duration::from_secs(120));
        for h in &cut {
            let _ = Command::new("ip")
                .args(["link", "set", &format!("{}-v{h}", c.name), "up"])
                .status();
        }
        let all = text(&outs);
        let what = format!("hosts {cut:?} cut off");
        for (h, o) in outs.iter().enumerate() {
            let t = text(std::slice::from_ref(o));
            let goes_on = cut.len() == 1 && !cut.contains(&h);
            if goes_on {
                assert!(o.status.success(), "{what}: host {h} failed:\n{all}");
                assert_eq!(t.matches("DONE").count(), 2, "{what}: host {h}:\n{t}");
                assert!(t.contains("RECOVERED"), "{what}: host {h} never recovered:\n{t}");
            } else {
                assert!(!o.status.success(), "{what}: host {h} went on:\n{all}");
                assert!(!t.contains("DONE"), "{what}: host {h} finished:\n{t}");
                let stopped = t
                    .lines()
                    .filter(|l| l.contains("] ERROR") && l.contains("cut off at membership"))
                    .count();
                assert_eq!(stopped, 2, "{what}: host {h}:\n{t}");
                if !cut.contains(&h) {
                    assert!(t.contains("not a strict majority"), "{what}: host {h}:\n{t}");
                }
            }
        }
        if cut.len() == 1 {
            let weights: Vec<&str> = all
                .lines()
                .filter_map(|l| l.split_once("DONE ").map(|(_, d)| d))
                .map(|d| d.split(" schedule ").next().unwrap_or_default())
                .collect();
            assert_eq!(weights.len(), 6, "{all}");
            assert!(weights.windows(2).all(|w| w[0] == w[1]), "survivors differ: {weights:?}");
        }
    }
}
