//! The job secret never appears on any process's command line during a tutti-run job, whether
//! tutti-run made it or was given one in a file.

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn cmdlines_containing(needle: &str) -> Vec<String> {
    let mut hits = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if let Ok(raw) = std::fs::read(e.path().join("cmdline")) {
            let text = String::from_utf8_lossy(&raw).replace('\0', " ");
            if text.contains(needle) {
                hits.push(format!("{}: {text}", e.file_name().to_string_lossy()));
            }
        }
    }
    hits
}

/// Start `tt-run --nproc 2 ... tt-rank sleep`, wait for both children's pids, and return the
/// launcher and the secret its first child was given.
fn start(extra: &[&str], env: &[(&str, &str)]) -> (std::process::Child, Vec<u32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tt-run"));
    cmd.args(["--nproc", "2", "--grace", "1"]).args(extra);
    cmd.args(["--", env!("CARGO_BIN_EXE_tt-rank"), "sleep"]);
    cmd.env_remove("TUTTI_TOKEN").envs(env.iter().copied()).stdout(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut pids = Vec::new();
    let mut line = String::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids.len() < 2 && Instant::now() < deadline {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if let Some(p) = line.split("PID ").nth(1) {
            pids.push(p.trim().parse().unwrap());
        }
    }
    assert_eq!(pids.len(), 2, "children did not start");
    let environ = std::fs::read(format!("/proc/{}/environ", pids[0])).unwrap();
    let secret = environ
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(b"TUTTI_TOKEN="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .expect("the child has its secret in its environment");
    (child, pids, secret)
}

fn stop(mut child: std::process::Child) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
}

#[test]
fn the_secret_is_never_on_a_command_line() {
    // tutti-run makes the secret.
    let (child, _, secret) = start(&[], &[]);
    assert!(secret.len() >= 32, "{secret}");
    let hits = cmdlines_containing(&secret);
    stop(child);
    assert!(hits.is_empty(), "secret visible in: {hits:?}");
    // tutti-run reads it from a private file.
    let dir = std::env::temp_dir().join(format!("tutti-secfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret");
    let given = format!("given-secret-{}-0123456789", std::process::id());
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&file)
            .unwrap();
        std::io::Write::write_all(&mut f, format!("{given}\n").as_bytes()).unwrap();
    }
    let path = file.to_string_lossy().into_owned();
    let (child, _, secret) = start(&["--token-file", &path], &[]);
    assert_eq!(secret, given);
    let hits = cmdlines_containing(&given);
    stop(child);
    assert!(hits.is_empty(), "secret visible in: {hits:?}");
    // A file others can read is refused, and so is a short secret.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tt-run"))
        .args(["--nproc", "1", "--token-file", &path, "--", "true"])
        .env_remove("TUTTI_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("chmod 600"));
    let out = Command::new(env!("CARGO_BIN_EXE_tt-run"))
        .args(["--nproc", "1", "--", "true"])
        .env("TUTTI_TOKEN", "short")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16"));
    let _ = std::fs::remove_dir_all(&dir);
}
