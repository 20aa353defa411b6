//! Notices from the launcher: which rank's process has ended.
//!
//! `tutti-run` hands each child the read end of a pipe of its own, named by
//! `TUTTI_LAUNCHER_FD`, and writes one line there for every rank whose process ends with a
//! failure: `dead RANK DESCRIPTION` (for example `dead 2 was killed by signal 9 (SIGKILL)`).
//! A rank that has rendezvoused reads that pipe on a thread of its own and fails each of the
//! process's transports as a lost connection to that rank would
//! ([`Transport::peer_died`]): operations with it fail naming it, the others fail through the
//! poison, and the peers are told. Every survivor on the node thus names the dead rank at once,
//! whatever the transport and even when the dead process's sockets outlive it (a forked child
//! holding them, a UDP socket nothing answers for); survivors on other nodes learn it from the
//! abort frames that follow.
//!
//! The pipe is trusted as the launcher is (it is inherited from the parent process). The
//! reader holds at most one line of [`MAX_NOTICE`] bytes; a longer one is skipped, a malformed
//! one is logged and ignored. When the launcher goes away the pipe ends and the thread with it.

use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use tracing::{debug, warn};

use crate::transport::Transport;

/// The variable naming the notice pipe's file descriptor.
pub const LAUNCHER_FD: &str = "TUTTI_LAUNCHER_FD";

/// The longest notice line, newline included.
pub const MAX_NOTICE: usize = 1024;

/// The line the launcher writes when `rank`'s process ended as `what` says ("was killed by
/// signal 9 (SIGKILL)", "exited with status 3"). Cut to [`MAX_NOTICE`] bytes on a character
/// boundary; newlines in `what` become spaces.
pub fn notice(rank: usize, what: &str) -> String {
    let mut line = format!("dead {rank} {}", what.replace(['\n', '\r'], " "));
    let mut cut = line.len().min(MAX_NOTICE - 1);
    while !line.is_char_boundary(cut) {
        cut -= 1;
    }
    line.truncate(cut);
    line.push('\n');
    line
}

/// The rank and description in one notice line (without its newline); `None` when malformed.
pub(crate) fn parse(line: &[u8]) -> Option<(usize, String)> {
    let text = std::str::from_utf8(line).ok()?;
    let rest = text.strip_prefix("dead ")?;
    let (rank, what) = rest.split_once(' ').unwrap_or((rest, "ended"));
    Some((rank.parse().ok()?, what.trim().to_string()))
}

/// The one reader of this process's notice pipe and the transports it fails.
struct Watcher {
    fd: RawFd,
    /// Each transport with the launch rank → its rank map (a shrunken world renumbers).
    transports: Vec<(Weak<dyn Transport>, Vec<usize>)>,
}

static WATCHER: Mutex<Option<Watcher>> = Mutex::new(None);

/// Held while a notice is applied (the reader holds strong references to the transports it
/// fails) and while a group lets its reference go ([`release`]): so the reader is never the
/// last to let a transport go, and a transport shuts down on the thread that dropped its last
/// group.
static APPLYING: Mutex<()> = Mutex::new(());

/// A group lets go of its `transport`: under the reader's lock (no notice is being applied,
/// so no reference of the reader's is alive), a reference that is not the last is dropped; the
/// last one is taken off the reader's list, so the reader cannot take it again, and returned,
/// for the caller to drop (to shut the transport down) outside the lock, which that may hold
/// for seconds (and may run Python code that drops other groups).
pub(crate) fn release(transport: Arc<dyn Transport>) -> Option<Arc<dyn Transport>> {
    let _held = APPLYING.lock().unwrap_or_else(|p| p.into_inner());
    if Arc::strong_count(&transport) > 1 {
        // Under the lock: two groups letting go at once see each other's reference.
        drop(transport);
        return None;
    }
    let mut w = WATCHER.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(w) = w.as_mut() {
        let gone = Arc::as_ptr(&transport);
        w.transports.retain(|(t, _)| !std::ptr::addr_eq(t.as_ptr(), gone));
    }
    Some(transport)
}

/// Start reading the launcher's notices on `fd`, before any transport exists (the first
/// connect calls it first thing), so a notice is stamped when it comes, not when a transport
/// is finally there to fail. The first call starts the reader thread (and marks `fd`
/// close-on-exec, so the process's own children do not take the notices); later calls with the
/// same descriptor do nothing.
pub(crate) fn listen(fd: RawFd) {
    let mut w = WATCHER.lock().unwrap_or_else(|p| p.into_inner());
    if w.as_ref().is_some_and(|w| w.fd == fd) {
        return;
    }
    // SAFETY: F_GETFD/F_SETFD on a descriptor number only reads and sets its flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        warn!(fd, "{LAUNCHER_FD}={fd} is not an open descriptor; launcher notices are off");
        return;
    }
    // SAFETY: as above.
    unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) };
    *w = Some(Watcher { fd, transports: Vec::new() });
    let spawned = std::thread::Builder::new().name("tutti-launcher".into()).spawn(move || read(fd));
    if let Err(e) = spawned {
        warn!("cannot start the launcher-notice thread: {e}");
        *w = None;
    }
}

/// Fail `transport` when the launcher behind `fd` reports a dead rank (`launch_ranks[r]` is the
/// launch rank of the transport's rank `r`). Notices that came after `since` (when its connect
/// began) but before this call are applied now: a member that died while the world connected
/// is named as one that dies later would be.
pub(crate) fn watch(
    fd: RawFd,
    transport: &Arc<dyn Transport>,
    launch_ranks: Vec<usize>,
    since: Instant,
) {
    listen(fd);
    {
        let mut w = WATCHER.lock().unwrap_or_else(|p| p.into_inner());
        let Some(w) = w.as_mut().filter(|w| w.fd == fd) else { return };
        w.transports.retain(|(t, _)| t.strong_count() > 0);
        w.transports.push((Arc::downgrade(transport), launch_ranks.clone()));
    }
    for (r, detail) in ended(&launch_ranks, &vec![since; launch_ranks.len()]) {
        transport.peer_died(r, &detail);
    }
}

/// The reader thread: blocks on the pipe (the launcher outlives us: our parent-death signal
/// ends us with it), applies each notice, and stops at the pipe's end.
fn read(fd: RawFd) {
    let mut line: Vec<u8> = Vec::with_capacity(MAX_NOTICE);
    let mut skipping = false;
    let mut buf = [0u8; 512];
    loop {
        // SAFETY: reading into a stack buffer of the given length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n <= 0 {
            debug!(fd, "the launcher's notice pipe ended");
            let mut w = WATCHER.lock().unwrap_or_else(|p| p.into_inner());
            if w.as_ref().is_some_and(|w| w.fd == fd) {
                *w = None;
            }
            return;
        }
        for &b in &buf[..n as usize] {
            if b != b'\n' {
                if line.len() < MAX_NOTICE {
                    line.push(b);
                } else {
                    skipping = true;
                }
                continue;
            }
            if !skipping {
                apply(&line);
            }
            line.clear();
            skipping = false;
        }
    }
}

/// Every notice this process received: launch rank, how it ended, when the notice came. One
/// line per process that ended (the launcher writes one each), so it stays small.
static ENDED: Mutex<Vec<(usize, String, Instant)>> = Mutex::new(Vec::new());

/// The members of a world being connected (launch rank `launch_ranks[i]`) that the launcher
/// reported ended after `since[i]`, in the order the notices came: each one's index and how it
/// ended. Each member has its own cutoff: a notice from before it concerned an earlier process
/// of that launch rank (a replacement has its predecessor's), so it is not counted.
fn ended(launch_ranks: &[usize], since: &[Instant]) -> Vec<(usize, String)> {
    let ended = ENDED.lock().unwrap_or_else(|p| p.into_inner());
    ended
        .iter()
        .filter_map(|(r, what, at)| {
            let i = launch_ranks.iter().position(|l| l == r)?;
            (*at > since[i]).then(|| (i, report(*r, what)))
        })
        .collect()
}

/// The first member that [`ended`] (see there), if any.
pub(crate) fn ended_since(launch_ranks: &[usize], since: &[Instant]) -> Option<(usize, String)> {
    ended(launch_ranks, since).into_iter().next()
}

/// Every member that [`ended`] (see there), by index, in order.
pub(crate) fn all_ended_since(launch_ranks: &[usize], since: &[Instant]) -> Vec<usize> {
    let mut v: Vec<usize> = ended(launch_ranks, since).into_iter().map(|(i, _)| i).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// What a survivor is told of launch rank `rank`, which ended as `what` says.
fn report(rank: usize, what: &str) -> String {
    format!("tutti-run reports that rank {rank} {what}")
}

fn apply(line: &[u8]) {
    let Some((rank, what)) = parse(line) else {
        warn!("ignoring a malformed launcher notice {:?}", String::from_utf8_lossy(line));
        return;
    };
    ENDED.lock().unwrap_or_else(|p| p.into_inner()).push((rank, what.clone(), Instant::now()));
    // Until the strong references below are dropped (see `APPLYING`).
    let _held = APPLYING.lock().unwrap_or_else(|p| p.into_inner());
    let live: Vec<(Arc<dyn Transport>, Option<usize>)> = {
        let w = WATCHER.lock().unwrap_or_else(|p| p.into_inner());
        w.as_ref().map_or_else(Vec::new, |w| {
            w.transports
                .iter()
                .filter_map(|(t, map)| {
                    Some((t.upgrade()?, map.iter().position(|launch| *launch == rank)))
                })
                .collect()
        })
    };
    let detail = report(rank, &what);
    for (t, here) in live {
        // A rank that is not in this transport's world (already shrunk away) is no news.
        if let Some(r) = here {
            t.peer_died(r, &detail);
        }
    }
}

/// torchrun's error file variable: where a failing worker leaves its error for the agent.
pub const ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";

/// Leave `message` (a fatal error) where torchrun looks for it, so that its "Root Cause"
/// summary shows tutti's message — rank, peer, operation — instead of `<N/A>`. Only under
/// torchrun (`TORCHELASTIC_ERROR_FILE` set). Written when a call fails (`Group::fail`, with the
/// call's error), when a transport finds its first failure itself (a lost peer, a peer's abort),
/// and when rendezvous fails; a later write replaces an earlier one, so after an elastic job
/// went on past a failure the file names what ended the process. The file is torch's own format:
/// `{"message": {"message": …, "extraInfo": {"py_callstack": …, "timestamp": …}}}`; torchrun
/// reads it only if the process then exits with a failure.
pub fn record_failure(message: &str) {
    let Some(path) = std::env::var_os(ERROR_FILE).filter(|p| !p.is_empty()) else { return };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let text = format!("TuttiError: {message}");
    let json = format!(
        "{{\"message\": {{\"message\": {}, \"extraInfo\": {{\"py_callstack\": {}, \"timestamp\": \"{now}\"}}}}}}",
        json_string(&text),
        json_string(&format!("{text}\n(tutti: no Python call stack; the message names the rank, peer and operation)")),
    );
    if let Err(e) = std::fs::write(&path, json) {
        warn!("cannot write torchrun's error file {}: {e}", std::path::Path::new(&path).display());
    }
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_escape_what_they_must() {
        assert_eq!(json_string("a\"b\\c\nd\u{1}é"), "\"a\\\"b\\\\c\\nd\\u0001é\"");
    }

    /// A notice counts for a membership formed before it, never for one formed after it (a
    /// replacement has its predecessor's launch rank), and names the member by its index in
    /// the world being connected.
    #[test]
    fn a_notice_counts_only_for_memberships_formed_before_it() {
        // Launch ranks far above any other test's, so the process-wide list is ours alone.
        let before = Instant::now();
        apply(b"dead 9005 was killed by signal 9 (SIGKILL)");
        let after = Instant::now();
        let members = [9001, 9003, 9005, 9007];
        let (i, what) = ended_since(&members, &[before; 4]).expect("reported");
        assert_eq!(i, 2);
        assert!(what.contains("rank 9005") && what.contains("SIGKILL"), "{what}");
        assert_eq!(ended_since(&members, &[after; 4]), None);
        assert_eq!(ended_since(&[9001, 9003], &[before; 2]), None);
        // A replacement of 9005 taken in after the notice has its own, later cutoff.
        assert_eq!(ended_since(&members, &[before, before, after, before]), None);
        apply(b"dead 9001 exited with status 3");
        assert_eq!(all_ended_since(&members, &[before; 4]), vec![0, 2]);
        assert_eq!(all_ended_since(&members, &[after; 4]), vec![0]);
    }

    #[test]
    fn notices_round_trip_and_stay_one_bounded_line() {
        let l = notice(2, "was killed by signal 9 (SIGKILL)");
        assert_eq!(l, "dead 2 was killed by signal 9 (SIGKILL)\n");
        assert_eq!(
            parse(l.trim_end().as_bytes()),
            Some((2, "was killed by signal 9 (SIGKILL)".into()))
        );
        let long = notice(7, &"é\nx".repeat(1000));
        assert!(long.len() <= MAX_NOTICE && long.ends_with('\n'));
        assert_eq!(long.matches('\n').count(), 1);
        assert_eq!(parse(long.trim_end().as_bytes()).map(|p| p.0), Some(7));
        assert_eq!(parse(b"dead 3"), Some((3, "ended".into())));
        for bad in [&b"dead"[..], b"dead x y", b"alive 1 ok", b"dead -1 z", b"\xff\xfe"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_notice_fails_every_transport_naming_the_dead_rank() {
        use std::time::Duration;

        use crate::testing::{self, Kind};
        use crate::transport::TransportExt;
        use crate::wire::{Fingerprint, MsgDesc, Tag};
        // Three ranks: rank 0 (the one the launcher tells) waits for rank 1, which never sends
        // and never dies; rank 2 waits for rank 0. The notice ends rank 0's wait naming rank 1,
        // and rank 0's abort frame ends rank 2's, naming rank 1 too.
        let mut fds = [0; 2];
        // SAFETY: pipe(2) fills the two-element array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let desc = MsgDesc { tag: Tag { group: 0, seq: 0, step: 0 }, fp: Fingerprint::p2p(4) };
        let kinds = [
            Kind::Mem,
            Kind::Tcp,
            #[cfg(feature = "quic")]
            Kind::Quic,
        ];
        for kind in kinds {
            let ts = testing::world(kind, 3).unwrap();
            watch(fds[0], &ts[0], vec![0, 1, 2], Instant::now());
            let errs: Vec<String> = std::thread::scope(|s| {
                let waits = [(0usize, 1usize), (2, 0)].map(|(me, from)| {
                    let t = &ts[me];
                    s.spawn(move || {
                        let mut buf = [0u8; 4];
                        t.recv(from, desc, &mut buf, Duration::from_secs(20)).unwrap_err()
                    })
                });
                std::thread::sleep(Duration::from_millis(200));
                let line = notice(1, "exited with status 3");
                // SAFETY: writing a byte string to the pipe made above.
                let n = unsafe { libc::write(fds[1], line.as_ptr().cast(), line.len()) };
                assert_eq!(n, line.len() as isize);
                waits.map(|w| w.join().unwrap().to_string()).into_iter().collect()
            });
            for e in &errs {
                assert!(
                    e.contains("rank 1") && e.contains("exited with status 3"),
                    "{kind:?}: {e}"
                );
            }
        }
        // SAFETY: closing our write end ends the reader thread.
        unsafe { libc::close(fds[1]) };
    }
}
