//! Every way a job finds itself, end to end across real processes: the README's main path
//! (`MASTER_ADDR`/`MASTER_PORT` only: rank 0 serves the store and generates the job secret),
//! a `file://` store, and a store on IPv6 loopback. Each job runs real collectives with exact
//! data and must finish within its deadline.

use std::path::Path;
use std::time::Duration;

use tutti_tests::{assert_all_ok, spawn_job_with, Rendezvous};

const EXE: &str = env!("CARGO_BIN_EXE_tt-rank");

fn run(scenario: &str, n: usize, extra: &[(&str, &str)], rdv: &Rendezvous) {
    let extra: Vec<(String, String)> =
        extra.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let (outs, killed) = spawn_job_with(
        Path::new(EXE),
        &[scenario],
        n,
        |_| extra.clone(),
        Duration::from_secs(120),
        rdv,
    );
    assert!(!killed, "{rdv:?} {scenario}: the job ran past its 120 s deadline");
    assert_all_ok(&outs, &format!("{rdv:?} {scenario}"));
}

#[test]
fn master_addr_only_tcp() {
    run("collectives", 3, &[], &Rendezvous::Master);
}

#[test]
fn master_addr_only_quic() {
    run("p2p", 3, &[("TUTTI_TRANSPORT", "quic"), ("TUTTI_SHM", "0")], &Rendezvous::Master);
}

#[test]
fn file_store() {
    let dir = std::env::temp_dir().join(format!("tutti-file-store-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // No secret given: rank 0 makes one and keeps it in the (private) store directory, which
    // tutti creates 0700; the last rank to leave removes it.
    run("collectives", 3, &[], &Rendezvous::File(dir.clone()));
    assert!(!dir.exists(), "the file store was left behind after a clean end");
    // A directory other users can enter is refused with the fix.
    std::fs::create_dir_all(&dir).unwrap();
    let e = tutti_runtime::store::FileStore::new(&dir).unwrap_err().to_string();
    assert!(e.contains("chmod 700"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ipv6_loopback_store_and_ranks() {
    // A host without IPv6 loopback must say so explicitly; the test never passes silently.
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        assert!(
            std::env::var_os("TUTTI_TEST_NO_IPV6").is_some(),
            "no IPv6 loopback (::1) on this host: enable it, or set TUTTI_TEST_NO_IPV6=1 to \
             run without this test"
        );
        eprintln!("TUTTI_TEST_NO_IPV6 set and no ::1: the IPv6 test did not run");
        return;
    }
    run("p2p", 3, &[], &Rendezvous::StoreAt("[::1]:0".parse().unwrap()));
}

/// This host's address towards the rest of the network (not loopback), if it has one.
fn host_ip() -> Option<std::net::IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("10.255.255.254:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn a_store_reachable_from_other_hosts_needs_a_secret() {
    let Some(ip) = host_ip() else {
        assert!(
            std::env::var_os("TUTTI_TEST_NO_HOST_IP").is_some(),
            "this host has no non-loopback address: give it one, or set TUTTI_TEST_NO_HOST_IP=1"
        );
        eprintln!("TUTTI_TEST_NO_HOST_IP set and no host address: the test did not run");
        return;
    };
    let port = std::net::TcpListener::bind((ip, 0)).unwrap().local_addr().unwrap().port();
    let master = |insecure: bool| {
        let mut env = vec![
            ("MASTER_ADDR".to_string(), ip.to_string()),
            ("MASTER_PORT".to_string(), port.to_string()),
        ];
        if insecure {
            env.push(("TUTTI_INSECURE".to_string(), "1".to_string()));
        }
        spawn_job_with(
            Path::new(EXE),
            &["connect"],
            2,
            move |_| env.clone(),
            Duration::from_secs(60),
            &Rendezvous::Master,
        )
    };
    // Without a secret: every rank refuses at once, saying how to give one.
    let (outs, killed) = master(false);
    assert!(!killed);
    for (r, o) in outs.iter().enumerate() {
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(!o.status.success(), "rank {r} started without a secret: {text}");
        assert!(text.contains("TUTTI_TOKEN") && text.contains("TUTTI_INSECURE=1"), "{text}");
    }
    // Explicitly insecure: it runs (and says so on every rank).
    let (outs, killed) = master(true);
    assert!(!killed);
    assert_all_ok(&outs, "TUTTI_INSECURE=1");
}

/// A fake two-node `srun` step on this host: only the variables srun sets (`SLURM_PROCID`,
/// `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_STEP_NODELIST`, `SLURM_JOB_ID`, `SLURM_STEP_ID`, …),
/// no `MASTER_ADDR`: rank 0's host comes from the node list and the port from the job id.
#[test]
fn srun_without_master_addr() {
    // A job id whose port is free here.
    let job = (1000u64..5000)
        .find(|j| {
            let p = tutti_runtime::rendezvous::slurm::port(*j, 0);
            std::net::TcpListener::bind(("127.0.0.1", p)).is_ok()
        })
        .expect("a free port in the Slurm range");
    let n = 4;
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut c = std::process::Command::new(EXE);
            c.arg("collectives");
            for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
                c.env_remove(k);
            }
            c.env_remove("TUTTI_STORE").env_remove("TUTTI_TOKEN");
            c.env("SLURM_JOB_ID", job.to_string())
                .env("SLURM_STEP_ID", "0")
                .env("SLURM_PROCID", r.to_string())
                .env("SLURM_LOCALID", (r % 2).to_string())
                .env("SLURM_NODEID", (r / 2).to_string())
                .env("SLURM_NTASKS", n.to_string())
                .env("SLURM_NNODES", "2")
                .env("SLURM_STEP_NODELIST", "localhost,127.0.0.1")
                .env("SLURM_JOB_NODELIST", "localhost,127.0.0.1")
                .env("TUTTI_CONNECT_TIMEOUT", "60");
            c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
            c.spawn().unwrap()
        })
        .collect();
    let outs: Vec<std::process::Output> =
        children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    assert_all_ok(&outs, "srun without MASTER_ADDR");
}
