//! One rank of a test job, started N times by the integration tests (directly or through
//! tutti-run). `tt-rank SCENARIO [ARGS]`; prints `OK <rank>` and exits 0 when the scenario
//! passed, prints the error and exits 1 otherwise.

use std::time::Duration;

use tutti_collectives::{verify, Comm, ReduceOp};

/// The grid of every collective and algorithm that the collectives' own tests run on threads.
#[path = "../../../collectives/tests/common/grid.rs"]
mod grid;
use tutti_runtime::auth::JobKey;
use tutti_runtime::store::StoreServer;

fn pattern(len: usize, src: usize, dst: usize, salt: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 131 + src * 31 + dst * 7 + salt) % 251) as u8).collect()
}

/// Ring exchange at several sizes, and interleaved tags received in reverse order.
fn p2p(c: &Comm) -> Result<(), String> {
    let (r, n) = (c.rank(), c.size());
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for (k, len) in [0usize, 1, 4096, 1 << 20, 8 << 20].into_iter().enumerate() {
        let mine = pattern(len, r, right, k);
        let mut got = vec![0u8; len];
        let m = c.sendrecv(&mine, right, &mut got, left, k as u32).map_err(|e| e.to_string())?;
        if m != len || got != pattern(len, left, r, k) {
            return Err(format!("ring exchange of {len} bytes from {left} is wrong"));
        }
    }
    if n >= 2 {
        if r == 0 {
            for t in 0..6u32 {
                c.send(&pattern(100 + t as usize * 1000, 0, 1, t as usize), 1, 100 + t)
                    .map_err(|e| e.to_string())?;
            }
        } else if r == 1 {
            for t in (0..6u32).rev() {
                let len = 100 + t as usize * 1000;
                let mut b = vec![0u8; len];
                c.recv(&mut b, 0, 100 + t).map_err(|e| e.to_string())?;
                if b != pattern(len, 0, 1, t as usize) {
                    return Err(format!("tag {t} payload wrong"));
                }
            }
        }
    }
    c.barrier().map_err(|e| e.to_string())?;
    Ok(())
}

/// Every collective at a few sizes, exact data.
fn collectives(c: &Comm) -> Result<(), String> {
    let (r, n) = (c.rank(), c.size());
    let e = |e: tutti_collectives::Error| e.to_string();
    for count in [0usize, 1, 7, 1000, 65_536 + 3, 1 << 20] {
        let op = ReduceOp::Sum;
        let inp = verify::input::<f32>(1, r, count, op);
        let mut out = vec![0f32; count];
        c.allreduce_from(&inp, &mut out, op).map_err(e)?;
        if verify::count_wrong(&out, |i| verify::reduced(1, n, i, op)) != 0 {
            return Err(format!("allreduce of {count} wrong"));
        }
        let root = count % n;
        let mut b =
            if r == root { verify::input::<i32>(2, root, count, op) } else { vec![0; count] };
        c.broadcast(&mut b, root).map_err(e)?;
        if b != verify::input::<i32>(2, root, count, op) {
            return Err(format!("broadcast of {count} wrong"));
        }
        let mut red = verify::input::<i64>(3, r, count, ReduceOp::Max);
        c.reduce(&mut red, ReduceOp::Max, root).map_err(e)?;
        if r == root && verify::count_wrong(&red, |i| verify::reduced(3, n, i, ReduceOp::Max)) != 0
        {
            return Err(format!("reduce of {count} wrong"));
        }
        let per = count / n.max(1) + 1;
        let mine = verify::input::<f32>(4, r, per, op);
        let mut all = vec![0f32; per * n];
        c.allgather(&mine, &mut all).map_err(e)?;
        if verify::count_wrong(&all, |i| verify::value(4, i / per, i % per, op)) != 0 {
            return Err(format!("allgather of {per} wrong"));
        }
        let full = verify::input::<f32>(5, r, per * n, op);
        let mut part = vec![0f32; per];
        c.reduce_scatter(&full, &mut part, op).map_err(e)?;
        if verify::count_wrong(&part, |i| verify::reduced(5, n, r * per + i, op)) != 0 {
            return Err(format!("reduce_scatter of {per} wrong"));
        }
        let a2a_in: Vec<i32> = (0..per * n).map(|i| (r * 100_000 + i) as i32).collect();
        let mut a2a_out = vec![0i32; per * n];
        c.all_to_all(&a2a_in, &mut a2a_out).map_err(e)?;
        for (i, v) in a2a_out.iter().enumerate() {
            let (src, j) = (i / per, i % per);
            if *v != (src * 100_000 + r * per + j) as i32 {
                return Err(format!("alltoall of {per} wrong"));
            }
        }
        let mut g = if r == root { vec![0f32; per * n] } else { Vec::new() };
        c.gather(&mine, &mut g, root).map_err(e)?;
        if r == root && verify::count_wrong(&g, |i| verify::value(4, i / per, i % per, op)) != 0 {
            return Err(format!("gather of {per} wrong"));
        }
        let src = if r == root { verify::input::<f32>(6, root, per * n, op) } else { Vec::new() };
        let mut s = vec![0f32; per];
        c.scatter(&src, &mut s, root).map_err(e)?;
        if verify::count_wrong(&s, |i| verify::value(6, root, r * per + i, op)) != 0 {
            return Err(format!("scatter of {per} wrong"));
        }
        c.barrier().map_err(e)?;
    }
    Ok(())
}

fn now_us() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

/// Loop allreduce over sizes from 4 KiB to 64 MiB until something fails; print the failure with
/// the wall-clock time it was seen.
fn loop_until_error(c: &Comm) -> Result<(), String> {
    let sizes = [1usize << 10, 16 << 10, 256 << 10, 4 << 20, 16 << 20];
    let mut bufs: Vec<Vec<f32>> = sizes.iter().map(|s| vec![1.0f32; *s]).collect();
    // One pass over the sizes first: links connect on first use, and once this job's are
    // connected it needs nothing else (not even the store).
    for b in bufs.iter_mut() {
        c.allreduce(b, ReduceOp::Max).map_err(|e| format!("{} {e}", now_us()))?;
    }
    // The peers this rank has no link to (`-`: none), for the tests that need such a pair.
    let t = c.group().transport();
    let unlinked: Vec<String> = (0..c.size())
        .filter(|p| *p != c.rank() && !t.is_connected(*p))
        .map(|p| p.to_string())
        .collect();
    println!(
        "UNLINKED {} {}",
        c.rank(),
        if unlinked.is_empty() { "-".into() } else { unlinked.join(",") }
    );
    // How each link goes (`-` for this rank): the tests check shared memory against the network.
    let kinds: Vec<&str> =
        (0..c.size()).map(|p| if p == c.rank() { "-" } else { t.link_kind(p) }).collect();
    println!("KINDS {} {}", c.rank(), kinds.join(","));
    println!("READY {}", c.rank());
    let mut i = 0usize;
    loop {
        let k = i % sizes.len();
        if let Err(e) = c.allreduce(&mut bufs[k], ReduceOp::Max) {
            // Return normally so the transport shuts down cleanly (close frames, drained
            // sockets), as a program that handles the error would.
            return Err(format!("{} {e}", now_us()));
        }
        i += 1;
    }
}

/// `topology`: which host each rank is on and the link measurement's verdict, then a 4 MiB allreduce
/// by the automatic choice and one forced two-level, both checked element by element.
fn topology(comm: &Comm) -> Result<(), String> {
    let e = |e: tutti_collectives::Error| e.to_string();
    let topo = comm.topology().map_err(e)?;
    let hosts: Vec<String> = (0..comm.size()).map(|r| topo.host_of(r).to_string()).collect();
    println!(
        "TOPO {} hosts {} per_host {:?} host_of {} scale {:.1}",
        comm.rank(),
        topo.hosts(),
        topo.per_host(),
        hosts.join(","),
        comm.link_scale().map_err(e)?
    );
    let count = 1 << 20;
    for forced in [None, Some(tutti_collectives::Algo::TwoLevel)] {
        let c = forced.map_or_else(|| comm.clone(), |a| comm.with_algo(a));
        let mut x: Vec<f32> = (0..count).map(|i| ((i % 1000) * (comm.rank() + 1)) as f32).collect();
        let st = c.allreduce(&mut x, ReduceOp::Sum).map_err(e)?;
        let n = comm.size();
        let k = (n * (n + 1) / 2) as f32;
        if let Some(i) = (0..count).find(|&i| x[i] != (i % 1000) as f32 * k) {
            return Err(format!("{} allreduce: element {i} is {}", st.algo, x[i]));
        }
        println!("ALGO {} {}", comm.rank(), st.algo);
    }
    // All-gather and reduce-scatter of S = 6 MiB (at 6 ranks), chosen and forced two-level.
    let (n, r) = (comm.size(), comm.rank());
    let block = (1 << 20) / 4 * 6 / n;
    let val = |q: usize, i: usize| ((i % 1000) * (q + 1)) as f32;
    for forced in [None, Some(tutti_collectives::Algo::TwoLevel)] {
        let c = forced.map_or_else(|| comm.clone(), |a| comm.with_algo(a));
        let mine: Vec<f32> = (0..block).map(|i| val(r, r * block + i)).collect();
        let mut all = vec![0f32; n * block];
        let st = c.allgather(&mine, &mut all).map_err(e)?;
        if let Some(i) = (0..n * block).find(|&i| all[i] != val(i / block, i)) {
            return Err(format!("{} allgather: element {i} is {}", st.algo, all[i]));
        }
        println!("GATHER {r} {}", st.algo);
        let full: Vec<f32> = (0..n * block).map(|i| val(r, i)).collect();
        let mut out = vec![0f32; block];
        let st = c.reduce_scatter(&full, &mut out, ReduceOp::Sum).map_err(e)?;
        let k = (n * (n + 1) / 2) as f32;
        if let Some(i) = (0..block).find(|&i| out[i] != ((r * block + i) % 1000) as f32 * k) {
            return Err(format!("{} reduce_scatter: element {i} is {}", st.algo, out[i]));
        }
        println!("SCATTER {r} {}", st.algo);
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scenario = args.first().map(String::as_str).unwrap_or("p2p");
    match scenario {
        "exit" => {
            let rank: usize = std::env::var("RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
            let who: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(0);
            let code: i32 = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(3);
            if rank == who {
                std::thread::sleep(Duration::from_millis(200));
                std::process::exit(code);
            }
            println!("PID {}", std::process::id());
            std::thread::sleep(Duration::from_secs(120));
            return;
        }
        "killself" => {
            let rank: usize = std::env::var("RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
            let who: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(0);
            println!("PID {}", std::process::id());
            if rank == who {
                std::thread::sleep(Duration::from_millis(200));
                // SAFETY: signalling ourselves.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_secs(120));
            return;
        }
        "serve-store" => {
            // A store on its own (as a launcher serves one): `serve-store WORLD`; prints
            // `STORE <addr>` and serves until killed (at most 120 s).
            let world: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1);
            let key = std::env::var("TUTTI_TOKEN").ok().map(|t| JobKey::from_token(&t));
            let addr = "127.0.0.1:0".parse().expect("a socket address literal");
            match StoreServer::start(addr, world, key) {
                Ok(srv) => {
                    println!("STORE {}", srv.addr());
                    std::thread::sleep(Duration::from_secs(120));
                }
                Err(e) => println!("ERR {e}"),
            }
            return;
        }
        "grandchild" => {
            // Fork a process that keeps our output open and sleeps 60 s, print its pid, and
            // exit successfully: the launcher must neither hang on the pipe nor leave it behind.
            // SAFETY: the child only sleeps and exits (async-signal-safe calls).
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: in the forked child, only async-signal-safe calls.
                unsafe {
                    libc::sleep(60);
                    libc::_exit(0);
                }
            }
            println!("GRANDCHILD {pid}");
            return;
        }
        "sleep" => {
            println!("PID {}", std::process::id());
            std::thread::sleep(Duration::from_secs(120));
            return;
        }
        _ => {}
    }
    let comm = match Comm::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("ERR {e}");
            std::process::exit(1);
        }
    };
    if std::env::var_os("TUTTI_TIMEOUT").is_none() {
        comm.group().set_timeout(Duration::from_secs(60));
    }
    let r = match scenario {
        "p2p" => p2p(&comm),
        "collectives" | "grid" => {
            // `collectives [N]`: N rounds (default 1). `grid`: every collective with every
            // algorithm that can run here, every dtype and op (a mistake panics, naming it).
            let n: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1);
            // How this rank's links move their bytes, for the tests that check the choice.
            let t = comm.group().transport();
            // Links connect on first use: connect them all, so each says how it travels.
            let everyone: Vec<usize> = (0..comm.size()).collect();
            if let Err(e) = t.connect_peers(&everyone, Duration::from_secs(60)) {
                println!("ERR {e}");
                std::process::exit(1);
            }
            let kinds: Vec<&str> = (0..comm.size())
                .map(|p| if p == comm.rank() { "-" } else { t.link_kind(p) })
                .collect();
            println!("LINKS {} {}", comm.rank(), kinds.join(","));
            if scenario == "grid" {
                grid::every_grid(&comm, "processes");
                grid::every_dtype(&comm, "processes");
                Ok(())
            } else {
                (0..n).try_for_each(|_| collectives(&comm))
            }
        }
        "connect" => Ok(()),
        "whereami" => {
            // Print the address this rank published, then check everyone can talk.
            let addr = comm.group().local_addr().map_or("-".to_string(), |a| a.to_string());
            println!("ADDR {} {addr}", comm.rank());
            collectives(&comm)
        }
        "topology" => topology(&comm),
        "loop" => loop_until_error(&comm),
        "pairloop" => {
            // Ranks 2k and 2k + 1 exchange small messages, forever, and with no one else: a
            // lazily connected job where most pairs never connect. The error ends as in `loop`.
            let peer = comm.rank() ^ 1;
            let mut buf = [0u8; 64];
            let mut round = |i: u64| -> Result<(), String> {
                let e = |e: tutti_collectives::Error| format!("{} {e}", now_us());
                if peer >= comm.size() {
                    std::thread::sleep(Duration::from_millis(1));
                    return Ok(());
                }
                if comm.rank() % 2 == 0 {
                    comm.send(&i.to_le_bytes(), peer, 7).map_err(e)?;
                    comm.recv(&mut buf[..8], peer, 7).map_err(e)?;
                } else {
                    comm.recv(&mut buf[..8], peer, 7).map_err(e)?;
                    comm.send(&i.to_le_bytes(), peer, 7).map_err(e)?;
                }
                Ok(())
            };
            round(0).and_then(|()| {
                println!("READY {}", comm.rank());
                (1..).try_for_each(&mut round)
            })
        }
        "loop-pid" => {
            // As `loop`, after printing `PID <rank> <pid>` (for a test that kills one rank of a
            // job whose launcher it does not control, e.g. srun's or mpirun's). SIGTERM is
            // ignored: mpirun tears the whole job down (SIGTERM first, SIGKILL a while later)
            // as soon as one task dies, which on a loaded machine can end a survivor before it
            // has printed the error the test reads; SIGKILL still ends it.
            // SAFETY: setting a signal's disposition to "ignore" before any other thread of
            // ours handles signals.
            unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
            println!("PID {} {}", comm.rank(), std::process::id());
            loop_until_error(&comm)
        }
        "orphan" => {
            // `orphan WHO`: rank WHO forks a child that keeps its sockets open (for up to 30 s,
            // printing `ORPHAN <pid>`), then exits with status 3. Its peers, waiting on it in an
            // allreduce, see no reset and no unreachable port: only the launcher's notice can
            // tell them quickly. They print `ERR <wall-clock µs> <error>`.
            let who: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1);
            if comm.rank() == who {
                // Let the others enter the allreduce first.
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: the child only sleeps and exits (async-signal-safe calls).
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    // SAFETY: in the forked child, only async-signal-safe calls.
                    unsafe {
                        // Let go of the job's output, so nobody waits for this process's end.
                        libc::close(1);
                        libc::close(2);
                        libc::sleep(30);
                        libc::_exit(0);
                    }
                }
                println!("ORPHAN {pid}");
                println!("DIED {}", now_us());
                std::process::exit(3);
            }
            let mut x = vec![1.0f32; 1000];
            comm.allreduce(&mut x, ReduceOp::Sum)
                .map(|_| ())
                .map_err(|e| format!("{} {e}", now_us()))
        }
        "diverge" => {
            // `diverge WHO`: rank WHO calls an allreduce of a different length than the others
            // (a bug in the program): every rank fails, naming the disagreement.
            let who: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1);
            let n = if comm.rank() == who { 1001 } else { 1000 };
            let mut x = vec![1.0f32; n];
            comm.allreduce(&mut x, ReduceOp::Sum).map(|_| ()).map_err(|e| e.to_string())
        }
        "sendloop" => {
            // `sendloop ROUNDS BATCH BYTES`: a pipeline stage's send loop run ahead of its
            // consumer. Rank 0 posts BATCH sends of BYTES at once, ROUNDS times, to rank 1, which
            // takes them one by one with 1 ms of "compute" before each. Each rank prints its
            // peak resident memory: `HWM <rank> <KiB>`.
            let num = |i: usize, d: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(d);
            let (rounds, batch, bytes) = (num(1, 20), num(2, 64), num(3, 1 << 20));
            let r = if comm.rank() == 0 {
                let data: Vec<Vec<u8>> = (0..batch).map(|k| pattern(bytes, 0, 1, k)).collect();
                (0..rounds).try_for_each(|_| {
                    let sends: Vec<(usize, u32, &[u8])> =
                        data.iter().enumerate().map(|(k, d)| (1, k as u32, &d[..])).collect();
                    comm.batch_p2p(&sends, &mut []).map(|_| ()).map_err(|e| e.to_string())
                })
            } else if comm.rank() == 1 {
                let mut buf = vec![0u8; bytes];
                (0..rounds * batch).try_for_each(|i| {
                    std::thread::sleep(Duration::from_millis(1));
                    let k = i % batch;
                    comm.recv(&mut buf, 0, k as u32).map_err(|e| e.to_string())?;
                    if buf != pattern(bytes, 0, 1, k) {
                        return Err(format!("message {i} arrived wrong"));
                    }
                    Ok(())
                })
            } else {
                Ok(())
            };
            let hwm = std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("VmHWM:"))
                        .map(|v| v.trim().trim_end_matches("kB").trim().to_string())
                })
                .unwrap_or_default();
            println!("HWM {} {hwm}", comm.rank());
            r.and_then(|()| comm.barrier().map(|_| ()).map_err(|e| e.to_string()))
        }
        "compute" => {
            // Rank 0 computes (sleeps) before joining an allreduce the others already wait in.
            let secs: u64 = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(12);
            if comm.rank() == 0 {
                std::thread::sleep(Duration::from_secs(secs));
            }
            let mut x = vec![1.0f32; 1000];
            comm.allreduce(&mut x, ReduceOp::Sum).map_err(|e| e.to_string()).and_then(|_| {
                if x.iter().all(|v| *v == comm.size() as f32) {
                    Ok(())
                } else {
                    Err("wrong sum".into())
                }
            })
        }
        other => Err(format!("unknown scenario {other}")),
    };
    match r {
        Ok(()) => println!("OK {}", comm.rank()),
        Err(e) => {
            if ["loop", "loop-pid", "orphan", "pairloop"].contains(&scenario) {
                println!("ERR {e}");
            } else {
                println!("ERR rank {}: {e}", comm.rank());
            }
            drop(comm);
            if scenario == "loop-pid" {
                // Under mpirun and srun, whose teardown ends the whole job as soon as one task
                // exits non-zero: linger a moment, as a program cleaning up would, so a survivor
                // that learns of the loss a few milliseconds later (through an abort relayed
                // by the ranks linked to the victim) prints its error before the teardown.
                std::thread::sleep(Duration::from_millis(500));
            }
            std::process::exit(1);
        }
    }
}
