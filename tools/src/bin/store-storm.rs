//! store-storm: many simulated ranks rendezvous against one store at once, as a large job's
//! start-up does, and the time until the last of them has its answer.
//!
//! ```text
//! store-storm [--ranks 16384] [--threads 64] [--mesh]
//! ```
//!
//! The store runs in a child process (`store-storm serve`, the same `StoreServer` rank 0 runs,
//! with a job secret), so each side holds one end of every connection within its descriptor
//! limit. Each simulated rank, on one of `--threads` client threads, does what a rank's
//! rendezvous does against the store, with the same messages: connect and prove the job secret,
//! claim its rank (`add`), read the job id rank 0 publishes (`get`), publish its signed address
//! (`set`), then read the addresses it connects to in one `get_all` — its ring neighbours and
//! its binomial-tree parent (what a ring-and-tree job connects to), or with `--mesh` every lower
//! rank (today's full mesh: O(n²) bytes in all, for a few thousand ranks at most). It keeps its
//! store connection open to the end, as a rank does.
//!
//! Prints the time to the last rank connected, to the last address published and to the last
//! answer, and the store's requests per second.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tutti_runtime::auth::JobKey;
use tutti_runtime::store::{SignedStore, Store, StoreServer, TcpStore};

const TOKEN: &str = "store-storm-secret";

fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on a local struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    lim.rlim_cur
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn serve(world: usize) -> ! {
    raise_fd_limit();
    let key = JobKey::from_token(TOKEN);
    let srv = match StoreServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), world, Some(key)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("store-storm serve: {e}");
            std::process::exit(1);
        }
    };
    println!("{}", srv.addr());
    // Until the parent closes our stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(srv);
    std::process::exit(0);
}

/// The ranks rank `r` of `n` reads addresses of: ring neighbours and binomial-tree parent, or
/// every lower rank.
fn needs(r: usize, n: usize, mesh: bool) -> Vec<usize> {
    if mesh {
        return (0..r).collect();
    }
    let mut v = vec![(r + 1) % n, (r + n - 1) % n];
    if r > 0 {
        v.push(r & (r - 1)); // binomial parent: clear the lowest set bit
    }
    v.sort_unstable();
    v.dedup();
    v.retain(|p| *p != r);
    v
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = arg(&args, "--ranks", 16384);
    if args.first().map(String::as_str) == Some("serve") {
        serve(n);
    }
    let threads: usize = arg(&args, "--threads", 64).clamp(1, n.max(1));
    let mesh = args.iter().any(|a| a == "--mesh");
    let limit = raise_fd_limit();
    if (n as u64) + 256 > limit {
        eprintln!("store-storm: {n} connections need more descriptors than the limit {limit}");
        std::process::exit(2);
    }
    let exe = std::env::current_exe().expect("own path");
    let mut child = Command::new(exe)
        .args(["serve", "--ranks", &n.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the store process");
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut first).expect("its address");
    let addr: SocketAddr = first.trim().parse().expect("an address");
    let key = JobKey::from_token(TOKEN);

    let start = Instant::now();
    let last_connected = Arc::new(AtomicU64::new(0));
    let last_published = Arc::new(AtomicU64::new(0));
    let last_answer = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(Barrier::new(threads));
    let mark = |a: &AtomicU64| a.fetch_max(start.elapsed().as_micros() as u64, Ordering::Relaxed);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (key, ready) = (key.clone(), ready.clone());
            let (lc, lp, la, reqs) = (
                last_connected.clone(),
                last_published.clone(),
                last_answer.clone(),
                requests.clone(),
            );
            s.spawn(move || {
                let mine: Vec<usize> = (t..n).step_by(threads).collect();
                let mut stores = Vec::with_capacity(mine.len());
                for &r in &mine {
                    let c = TcpStore::connect(addr, r, n, Some(&key), Duration::from_secs(300))
                        .unwrap_or_else(|e| panic!("rank {r}: {e}"));
                    let c = SignedStore::new(c, key.clone());
                    mark(&lc);
                    let claims = c.add(&format!("tutti/rank/{r}"), 1).expect("claim");
                    assert_eq!(claims, 1, "rank {r} claimed twice");
                    if r == 0 {
                        c.set("tutti/job", &7u64.to_le_bytes()).expect("job id");
                    }
                    stores.push(c);
                }
                for (&r, c) in mine.iter().zip(&stores) {
                    c.get("tutti/job", Duration::from_secs(300)).expect("job id");
                    c.set(
                        &format!("tutti/addr/{r}"),
                        format!("127.0.0.1:{}", 20000 + r % 40000).as_bytes(),
                    )
                    .expect("publish");
                    reqs.fetch_add(3, Ordering::Relaxed);
                    mark(&lp);
                }
                ready.wait();
                for (&r, c) in mine.iter().zip(&stores) {
                    let want = needs(r, n, mesh);
                    let keys: Vec<String> =
                        want.iter().map(|p| format!("tutti/addr/{p}")).collect();
                    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                    let got = c.get_all(&refs, Duration::from_secs(300)).expect("addresses");
                    assert_eq!(got.len(), want.len());
                    reqs.fetch_add(1, Ordering::Relaxed);
                    mark(&la);
                }
                drop(stores);
            });
        }
    });
    drop(child.stdin.take());
    let _ = child.wait();
    let ms = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1000.0;
    let total = ms(&last_answer) / 1000.0;
    println!(
        "store-storm: {n} ranks, {threads} client threads, {} addresses: last connected {:.0} ms, \
         last published {:.0} ms, last answer {:.0} ms ({:.0} requests/s, {} connections held)",
        if mesh { "every lower rank's" } else { "ring and tree" },
        ms(&last_connected),
        ms(&last_published),
        ms(&last_answer),
        requests.load(Ordering::Relaxed) as f64 / total.max(1e-9),
        n
    );
}
