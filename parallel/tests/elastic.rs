//! Elastic data parallel across real processes (the `elastic_dp` example, one rank per
//! process, a store served by this test that outlives every rank): a rank SIGKILLed or
//! SIGSTOPped at a random step, over TCP and QUIC, at worlds 4 and 8; two ranks lost at once;
//! a second rank lost while the survivors agree; a replacement that joins and receives the
//! parameters and the optimizer's momentum. Every survivor finishes every step, and its
//! weights equal, bit for bit, a replay that used the smaller world from the step the
//! survivors report on (`elastic_dp --schedule`, ranks as threads over memory). Losing half
//! the world stops everyone with the cut-off error, at once. Nothing may hang: every wait
//! here has a deadline.
//!
//! `TUTTI_ELASTIC_SEED` repeats a run's random choices. The example is the one `cargo test`
//! builds for the whole package: `cargo test --test elastic` alone does not rebuild it.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tutti_runtime::auth::JobKey;
use tutti_runtime::store::StoreServer;

const TOKEN: &str = "elastic-test-secret-0123";

fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>");
    let path = dir.join("examples").join("elastic_dp");
    assert!(path.exists(), "{} is missing: cargo test builds the examples", path.display());
    path
}

fn lcg(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *seed >> 33
}

struct Job {
    children: Vec<Child>,
    lines: Vec<Arc<Mutex<Vec<String>>>>,
    /// How a rank is started (to start a replacement later).
    spawn: Box<dyn Fn(usize, bool) -> Child>,
    _store: StoreServer,
}

impl Job {
    fn start(n: usize, steps: u64, step_ms: u64, env: &[(&str, &str)]) -> Job {
        let store = StoreServer::start(
            "127.0.0.1:0".parse().expect("address"),
            n,
            Some(JobKey::from_token(TOKEN)),
        )
        .expect("store");
        let url = format!("tcp://{}", store.addr());
        let env: Vec<(String, String)> =
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let spawn = Box::new(move |r: usize, join: bool| {
            let mut c = Command::new(example());
            c.args(["--steps", &steps.to_string(), "--step-ms", &step_ms.to_string()])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("TUTTI_STORE", &url)
                .env("TUTTI_TOKEN", TOKEN)
                .env("TUTTI_CONNECT_TIMEOUT", "60")
                .env("TUTTI_JOIN", if join { "1" } else { "0" })
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            for (k, v) in &env {
                c.env(k, v);
            }
            c.spawn().expect("spawn a rank")
        });
        let mut job = Job { children: Vec::new(), lines: Vec::new(), spawn, _store: store };
        for r in 0..n {
            job.add(r, false);
        }
        job
    }

    /// Start rank `r` (a replacement that joins, with `join`); it is `children.len()` here.
    fn add(&mut self, r: usize, join: bool) -> usize {
        let mut child = (self.spawn)(r, join);
        let out = child.stdout.take().expect("stdout");
        let buf = Arc::new(Mutex::new(Vec::new()));
        let b2 = buf.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                b2.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        self.children.push(child);
        self.lines.push(buf);
        self.children.len() - 1
    }

    fn has(&self, r: usize, prefix: &str) -> Option<String> {
        let l = self.lines[r].lock().unwrap_or_else(|p| p.into_inner());
        l.iter().find(|x| x.starts_with(prefix)).cloned()
    }

    /// Wait until rank `r` printed a line starting with `prefix`.
    fn wait_line(&self, r: usize, prefix: &str, limit: Duration) -> bool {
        let t = Instant::now();
        while t.elapsed() < limit {
            if self.has(r, prefix).is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    fn signal(&self, r: usize, sig: i32) {
        // SAFETY: signalling a child this test started.
        unsafe { libc::kill(self.children[r].id() as i32, sig) };
    }

    /// Wait for the ranks in `which` to exit; their exit codes, or `None` for one that hung.
    fn wait_exit(&mut self, which: &[usize], limit: Duration) -> Vec<Option<i32>> {
        let t = Instant::now();
        loop {
            let done: Vec<Option<i32>> = which
                .iter()
                .map(|r| {
                    self.children[*r].try_wait().ok().flatten().map(|s| s.code().unwrap_or(-1))
                })
                .collect();
            if done.iter().all(Option::is_some) || t.elapsed() > limit {
                // Let the readers take the last lines.
                std::thread::sleep(Duration::from_millis(50));
                return done;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn all(&self, r: usize) -> String {
        self.lines[r].lock().unwrap_or_else(|p| p.into_inner()).join("\n")
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in self.children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The `DONE` line of a replay of `schedule` in memory, with the algorithms of the job: direct
/// reads, as a job's ranks of one host use them over TCP and QUIC alike (a float sum's bits
/// depend on the algorithm).
fn replay(schedule: &str) -> String {
    let out = Command::new(example())
        .args(["--schedule", schedule])
        .env("TUTTI_DIRECT", "1")
        .output()
        .expect("replay");
    assert!(out.status.success(), "replay of {schedule} failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

struct Case<'a> {
    name: &'a str,
    n: usize,
    transport: &'a str,
    sig: i32,
    /// How many ranks to lose, and the pause between the losses.
    victims: usize,
    gap_ms: u64,
    /// Start a replacement for the first victim once it is gone.
    replace: bool,
    /// Kill that replacement right after it asked to join (before or after it was taken in).
    replacement_dies: bool,
}

impl<'a> Case<'a> {
    /// One rank lost, no replacement.
    fn new(name: &'a str, n: usize, transport: &'a str, sig: i32) -> Case<'a> {
        Case {
            name,
            n,
            transport,
            sig,
            victims: 1,
            gap_ms: 0,
            replace: false,
            replacement_dies: false,
        }
    }
}

fn run(case: &Case<'_>, seed: u64) {
    let mut s = seed;
    let steps = 150;
    let env: Vec<(&str, &str)> =
        vec![("TUTTI_TRANSPORT", case.transport), ("TUTTI_DEAD_AFTER", "1")];
    let mut job = Job::start(case.n, steps, 8, &env);
    let what = format!("{} (seed {seed})", case.name);
    for r in 0..case.n {
        assert!(
            job.wait_line(r, "READY", Duration::from_secs(60)),
            "{what}: rank {r} never started"
        );
    }
    // Distinct victims, any rank (rank 0 too: the store is served here).
    let mut victims = Vec::new();
    while victims.len() < case.victims {
        let v = (lcg(&mut s) % case.n as u64) as usize;
        if !victims.contains(&v) {
            victims.push(v);
        }
    }
    let at = 5 + lcg(&mut s) % 60;
    assert!(
        job.wait_line(victims[0], &format!("STEP {at} "), Duration::from_secs(60)),
        "{what}: step {at} never came"
    );
    if case.gap_ms == 0 && case.sig != libc::SIGSTOP {
        // Lost together: all stopped first, so none can notice another's death (and check in
        // to the agreement) between this thread's signals, however it is scheduled.
        for v in &victims {
            job.signal(*v, libc::SIGSTOP);
        }
    }
    for (i, v) in victims.iter().enumerate() {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(case.gap_ms));
        }
        job.signal(*v, case.sig);
    }
    let mut survivors: Vec<usize> = (0..case.n).filter(|r| !victims.contains(r)).collect();
    if case.replace {
        // The survivors go on without it; the replacement joins at their next step.
        let v = victims[0];
        assert!(
            survivors.iter().all(|r| job.wait_line(*r, "RECOVERED", Duration::from_secs(60))),
            "{what}: the survivors did not recover"
        );
        let idx = job.add(v, true);
        if case.replacement_dies {
            // Killed once it asked to join, most likely before the others took it in: their
            // grow then fails to connect it, and they shrink back.
            assert!(job.wait_line(idx, "ASKING", Duration::from_secs(30)), "{what}");
            std::thread::sleep(Duration::from_millis(50));
            job.signal(idx, libc::SIGKILL);
        } else {
            assert!(
                job.wait_line(idx, "JOINED", Duration::from_secs(60)),
                "{what}: the replacement never joined:\n{}",
                job.all(idx)
            );
            survivors.push(idx);
        }
    }
    let codes = job.wait_exit(&survivors, Duration::from_secs(90));
    for (r, c) in survivors.iter().zip(&codes) {
        assert!(c.is_some(), "{what}: rank {r} hung after losing {victims:?}:\n{}", job.all(*r));
    }
    if survivors.len() * 2 <= case.n {
        // Not a strict majority left: everyone stops, saying it was cut off.
        for (r, c) in survivors.iter().zip(&codes) {
            let err = job.has(*r, "ERROR").unwrap_or_default();
            assert_eq!(*c, Some(1), "{what}: rank {r} should stop:\n{}", job.all(*r));
            assert!(
                err.contains("cut off") && err.contains("not a strict majority"),
                "{what}: {err}"
            );
        }
        return;
    }
    let mut done = Vec::new();
    for (r, c) in survivors.iter().zip(&codes) {
        assert_eq!(*c, Some(0), "{what}: rank {r} failed:\n{}", job.all(*r));
        let line =
            job.has(*r, "DONE").unwrap_or_else(|| panic!("{what}: rank {r} printed no DONE"));
        let newcomer = job.has(*r, "JOINED").is_some();
        assert!(newcomer || job.has(*r, "RECOVERED").is_some(), "{what}: rank {r} never recovered");
        done.push(line);
    }
    // Every survivor (and the replacement) has the same weights, and they are the replay's.
    let weights = |l: &str| l.split(" schedule ").next().unwrap_or_default().to_string();
    assert!(
        done.windows(2).all(|w| weights(&w[0]) == weights(&w[1])),
        "{what}: survivors differ: {done:?}"
    );
    let schedule = done[0].split(" schedule ").nth(1).expect("a schedule").to_string();
    let worlds: Vec<usize> =
        schedule.split(',').map(|p| p.split('x').next().unwrap().parse().unwrap()).collect();
    assert_eq!(worlds.first(), Some(&case.n), "{what}: {schedule}");
    let end = if case.replace && !case.replacement_dies { case.n } else { case.n - case.victims };
    assert_eq!(worlds.last(), Some(&end), "{what}: {schedule}");
    assert_eq!(done[0], replay(&schedule), "{what}: survivors differ from the replay");
    if case.sig == libc::SIGSTOP {
        for v in &victims {
            job.signal(*v, libc::SIGKILL);
        }
    }
}

fn seed() -> u64 {
    std::env::var("TUTTI_ELASTIC_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    })
}

#[test]
fn survivors_finish_every_step_with_the_replay_s_weights() {
    let base = seed();
    eprintln!("TUTTI_ELASTIC_SEED={base}");
    let kill = libc::SIGKILL;
    let stop = libc::SIGSTOP;
    let cases = [
        Case::new("tcp, 4 ranks, SIGKILL", 4, "tcp", kill),
        Case::new("quic, 4 ranks, SIGKILL", 4, "quic", kill),
        Case::new("tcp, 4 ranks, SIGSTOP", 4, "tcp", stop),
        Case::new("quic, 8 ranks, SIGKILL", 8, "quic", kill),
        Case::new("quic, 8 ranks, SIGSTOP", 8, "quic", stop),
        Case {
            replace: true,
            ..Case::new("tcp, 4 ranks, SIGKILL, a replacement joins", 4, "tcp", kill)
        },
        Case {
            replace: true,
            replacement_dies: true,
            ..Case::new("tcp, 4 ranks, SIGKILL, the replacement dies as it joins", 4, "tcp", kill)
        },
        Case { victims: 2, ..Case::new("tcp, 8 ranks, two at once", 8, "tcp", kill) },
        Case {
            victims: 2,
            gap_ms: 60,
            ..Case::new("tcp, 8 ranks, one during the agreement", 8, "tcp", kill)
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        let t = Instant::now();
        run(case, base.wrapping_add(i as u64));
        eprintln!("{}: {:.1} s", case.name, t.elapsed().as_secs_f64());
    }
}

#[test]
fn half_the_world_lost_stops_everyone_with_the_cut_off_error() {
    let base = seed();
    let case = Case { victims: 2, ..Case::new("tcp, 4 ranks, two lost", 4, "tcp", libc::SIGKILL) };
    run(&case, base);
}
