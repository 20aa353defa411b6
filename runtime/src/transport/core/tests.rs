//! Tests of the connection core on a fake clock: `now` is whatever the test says, so dead-peer,
//! keep-alive and probe timing is checked to the instant without one real sleep.

use super::*;
use crate::wire::{DType, Fingerprint, OpKind, Tag};

const SEC: Duration = Duration::from_secs(1);

fn cfg() -> CoreConfig {
    CoreConfig {
        unexpected_limit: 1 << 20,
        park_above: 64 << 10,
        window: 1 << 20,
        probe_after: SEC,
        dead_after: 5 * SEC,
        keepalive: Some(SEC),
        lazy: false,
    }
}

/// Rank 0 of 2 with its link to rank 1 up at `t0`.
fn core(t0: Instant) -> Core {
    let mut c = Core::new(0, 2, cfg(), t0);
    c.link_up(1, t0);
    c
}

fn desc(seq: u64, count: u64) -> MsgDesc {
    MsgDesc {
        tag: Tag { group: 0, seq, step: 0 },
        fp: Fingerprint {
            op: OpKind::Allreduce,
            dtype: DType::U8,
            redop: 1,
            root: u32::MAX,
            count,
            settings: 0,
        },
    }
}

/// A data frame from rank 1 carrying `payload`.
fn frame(d: MsgDesc, payload: &[u8]) -> Vec<u8> {
    let mut v = Header::data(d, 1, payload.len()).encode().to_vec();
    v.extend_from_slice(payload);
    v
}

fn control(kind: FrameKind, src: usize) -> Vec<u8> {
    Header::control(kind, src, 0).encode().to_vec()
}

/// The kinds of the frames queued towards rank 1.
fn queued(c: &Core) -> Vec<FrameKind> {
    c.sendq(1)
        .iter()
        .map(|s| Header::decode(&s.hdr).map(|h| h.kind).expect("the core encodes valid headers"))
        .collect()
}

fn post_recv(c: &mut Core, d: MsgDesc, buf: &mut [u8]) -> OpId {
    // SAFETY: every test keeps `buf` alive and untouched until the operation finished.
    unsafe { c.post_recv(1, d, buf.as_mut_ptr(), buf.len(), Instant::now()) }
        .expect("posting succeeds")
        .0
}

#[test]
fn a_silent_peer_is_dead_exactly_at_dead_after_and_named() {
    let t0 = Instant::now();
    let mut c = core(t0);
    // The peer's engine is running: its first keep-alive came at once.
    assert_eq!(c.rx_bytes(1, &control(FrameKind::KeepAlive, 1), t0), HEADER_LEN);
    let mut buf = [0u8; 4];
    let id = post_recv(&mut c, desc(1, 4), &mut buf);
    let mut w = Waiter::new(id, t0, t0 + 60 * SEC);
    w.probed = true;
    // Until the limit the wait sleeps, and asks to be woken exactly at it.
    match c.poll_wait(&mut w, t0 + 4 * SEC) {
        Step::Sleep(t) => assert!(t <= t0 + 5 * SEC, "sleeps past the dead-peer limit"),
        other => panic!("alive peer: {other:?}"),
    }
    assert!(c.is_up(1));
    assert!(matches!(c.poll_wait(&mut w, t0 + 5 * SEC), Step::Again));
    assert!(!c.is_up(1), "the link is down at the limit");
    assert_eq!(c.take_down(), Some(1), "the driver is told to close the connection");
    match c.poll_wait(&mut w, t0 + 5 * SEC) {
        Step::Done(Err(Error::PeerLost { rank: 0, peer: 1, detail, .. })) => {
            assert!(detail.contains("nothing (not even a keep-alive)"), "{detail}")
        }
        other => panic!("expected the peer named as lost: {other:?}"),
    }
    assert!(c.poisoned().is_some());
}

/// A wait with nothing posted to the peer (direct reads wait on its memory) gets the same rule:
/// dead at the limit after the later of its last traffic and the wait's start, never before it
/// was heard from, named, and the transport poisoned.
#[test]
fn a_wait_without_an_operation_applies_the_same_dead_peer_rule() {
    let t0 = Instant::now();
    let mut c = core(t0);
    assert!(!c.check_silent(1, t0, t0 + 30 * SEC), "never heard from: still starting");
    assert_eq!(c.rx_bytes(1, &control(FrameKind::KeepAlive, 1), t0 + SEC), HEADER_LEN);
    // The wait began at 3 s: silence counts from there, not from the last keep-alive at 1 s.
    assert!(!c.check_silent(1, t0 + 3 * SEC, t0 + 7 * SEC));
    assert!(c.is_up(1) && c.poisoned().is_none());
    assert!(c.check_silent(1, t0 + 3 * SEC, t0 + 8 * SEC), "silent 5 s into the wait: dead");
    assert!(!c.is_up(1));
    assert_eq!(c.take_down(), Some(1));
    match c.poisoned() {
        Some(Error::PeerLost { rank: 0, peer: 1, detail, .. }) => {
            assert!(detail.contains("nothing (not even a keep-alive)"), "{detail}")
        }
        other => panic!("expected the peer named as lost: {other:?}"),
    }
    assert!(!c.check_silent(1, t0, t0 + 60 * SEC), "a link already down is not failed twice");
    assert!(!c.check_silent(0, t0, t0 + 60 * SEC), "nor is this rank itself");
}

/// A peer that has sent nothing on the link yet may still be connecting the rest of its world
/// (at 256 ranks that took longer than the dead-peer limit, and healthy jobs failed): it is
/// waited for until the operation's deadline, which then names it. Its first frame starts the
/// dead-peer clock.
#[test]
fn a_peer_never_heard_from_is_waited_for_until_the_deadline_not_called_dead() {
    let t0 = Instant::now();
    let mut c = core(t0);
    let mut buf = [0u8; 4];
    let id = post_recv(&mut c, desc(1, 4), &mut buf);
    let mut w = Waiter::new(id, t0, t0 + 60 * SEC);
    w.probed = true;
    match c.poll_wait(&mut w, t0 + 59 * SEC) {
        Step::Sleep(_) => {}
        other => panic!("a peer still starting is not dead: {other:?}"),
    }
    assert!(c.is_up(1));
    assert!(c.lost_peers(t0 + 59 * SEC).is_empty(), "nor counted lost by the survivors' agreement");
    match c.poll_wait(&mut w, t0 + 60 * SEC) {
        Step::Done(Err(Error::Timeout { peer: 1, .. })) => {}
        other => panic!("expected the deadline, naming the peer: {other:?}"),
    }
    // Heard from at 20 s (its engine started): silence counts from there.
    let mut c = core(t0);
    let id = post_recv(&mut c, desc(1, 4), &mut buf);
    let mut w = Waiter::new(id, t0, t0 + 60 * SEC);
    w.probed = true;
    assert_eq!(c.rx_bytes(1, &control(FrameKind::KeepAlive, 1), t0 + 20 * SEC), HEADER_LEN);
    assert!(matches!(c.poll_wait(&mut w, t0 + 24 * SEC), Step::Sleep(_)));
    assert!(c.is_up(1));
    assert!(matches!(c.poll_wait(&mut w, t0 + 25 * SEC), Step::Again));
    assert!(!c.is_up(1), "silent for the dead-peer limit after it was heard: dead");
}

#[test]
fn traffic_and_a_late_wait_push_the_dead_line() {
    let t0 = Instant::now();
    let mut c = core(t0);
    let mut buf = [0u8; 4];
    let id = post_recv(&mut c, desc(1, 4), &mut buf);
    // A keep-alive at 3 s: silence counts from there.
    assert_eq!(c.rx_bytes(1, &control(FrameKind::KeepAlive, 1), t0 + 3 * SEC), HEADER_LEN);
    let mut w = Waiter::new(id, t0, t0 + 60 * SEC);
    w.probed = true;
    assert!(matches!(c.poll_wait(&mut w, t0 + 7 * SEC), Step::Sleep(_)));
    // The driver hearing any traffic of its own protocol counts too.
    c.heard(1, t0 + 7 * SEC);
    assert!(matches!(c.poll_wait(&mut w, t0 + 11 * SEC), Step::Sleep(_)));
    assert!(matches!(c.poll_wait(&mut w, t0 + 12 * SEC), Step::Again));
    assert!(!c.is_up(1));
    // A wait that starts late does not blame the peer for the time nobody waited.
    let mut c = core(t0);
    assert_eq!(c.rx_bytes(1, &control(FrameKind::KeepAlive, 1), t0), HEADER_LEN);
    let id = post_recv(&mut c, desc(1, 4), &mut buf);
    let mut w = Waiter::new(id, t0 + 100 * SEC, t0 + 200 * SEC);
    w.probed = true;
    assert!(matches!(c.poll_wait(&mut w, t0 + 104 * SEC), Step::Sleep(_)));
    assert!(matches!(c.poll_wait(&mut w, t0 + 105 * SEC), Step::Again));
}

#[test]
fn keep_alives_go_out_on_idle_links_only() {
    let t0 = Instant::now();
    let mut c = core(t0);
    assert_eq!(c.poll_timeout(), Some(t0 + SEC));
    c.handle_timeout(t0 + SEC / 2);
    assert!(queued(&c).is_empty(), "not idle long enough");
    c.handle_timeout(t0 + SEC);
    assert_eq!(queued(&c), [FrameKind::KeepAlive]);
    // While a frame waits nothing more is queued (and no timer is pending for that link).
    c.handle_timeout(t0 + 3 * SEC);
    assert_eq!(queued(&c).len(), 1);
    assert_eq!(c.poll_timeout(), None);
    c.tx_done(1, HEADER_LEN, t0 + 3 * SEC);
    assert!(queued(&c).is_empty());
    assert_eq!(c.poll_timeout(), Some(t0 + 4 * SEC), "the interval restarts at the last write");
    // Without the core's keep-alives (QUIC keeps its own) there is never a timer.
    let mut q = Core::new(0, 2, CoreConfig { keepalive: None, ..cfg() }, t0);
    q.link_up(1, t0);
    q.handle_timeout(t0 + 10 * SEC);
    assert!(queued(&q).is_empty() && q.poll_timeout().is_none());
}

#[test]
fn keep_alives_come_at_least_four_times_per_dead_peer_limit() {
    // A peer that only receives from us is heard from through its keep-alives alone: with
    // the interval set at the dead-peer limit (`TUTTI_KEEPALIVE=1`, `TUTTI_DEAD_AFTER=1`),
    // one a little late would make it look dead. The core sends them at a quarter of the
    // limit then; a shorter interval is kept as set.
    let t0 = Instant::now();
    let link = |keepalive_interval, dead_after| crate::transport::LinkConfig {
        keepalive_interval,
        dead_after,
        ..crate::transport::LinkConfig::default()
    };
    for (every, dead, want) in [(SEC, SEC, SEC / 4), (SEC, 5 * SEC, SEC), (SEC / 10, SEC, SEC / 10)]
    {
        let cfg = CoreConfig::from_link(&link(every, dead), 64 << 10, true);
        let mut c = Core::new(0, 2, cfg, t0);
        c.link_up(1, t0);
        assert_eq!(c.poll_timeout(), Some(t0 + want), "{every:?} with {dead:?}");
        c.handle_timeout(t0 + want);
        assert_eq!(queued(&c), [FrameKind::KeepAlive], "{every:?} with {dead:?}");
    }
}

#[test]
fn a_long_wait_probes_once_and_a_conflicting_probe_is_a_mismatch() {
    let t0 = Instant::now();
    let mut c = core(t0);
    let mut buf = [0u8; 4];
    let id = post_recv(&mut c, desc(1, 4), &mut buf);
    let mut w = Waiter::new(id, t0, t0 + 60 * SEC);
    match c.poll_wait(&mut w, t0 + SEC / 2) {
        Step::Sleep(t) => assert_eq!(t, t0 + SEC, "woken for the probe"),
        other => panic!("{other:?}"),
    }
    c.rx_bytes(1, &control(FrameKind::KeepAlive, 1), t0 + SEC);
    assert!(matches!(c.poll_wait(&mut w, t0 + SEC), Step::Again));
    assert_eq!(queued(&c), [FrameKind::Probe]);
    let probe = Header::decode(&c.sendq(1)[0].hdr).expect("valid");
    assert_eq!(probe.desc, desc(1, 4), "the probe names the awaited collective");
    assert!(matches!(c.poll_wait(&mut w, t0 + 2 * SEC), Step::Sleep(_)));
    assert_eq!(queued(&c).len(), 1, "one probe per wait");
    // The peer probes the same collective with another count: both sides disagree.
    let mut h = Header::data(desc(1, 8), 1, 0);
    h.kind = FrameKind::Probe;
    c.rx_bytes(1, &h.encode(), t0 + 2 * SEC);
    match c.take_finished(id) {
        Some(Err(Error::Mismatch { rank: 0, peer: 1, .. })) => {}
        other => panic!("expected a mismatch: {other:?}"),
    }
    assert!(c.take_fresh_poison());
    assert_eq!(queued(&c).last(), Some(&FrameKind::Abort), "the peers are told");
}

#[test]
fn bytes_in_any_split_land_in_the_posted_buffer_and_deadline_names_progress() {
    let t0 = Instant::now();
    let payload: Vec<u8> = (0..100u8).collect();
    let bytes = frame(desc(1, 100), &payload);
    for cut in [1, 7, HEADER_LEN, HEADER_LEN + 1, bytes.len() - 1] {
        let mut c = core(t0);
        let mut buf = [0u8; 100];
        let id = post_recv(&mut c, desc(1, 100), &mut buf);
        assert_eq!(c.rx_bytes(1, &bytes[..cut], t0), cut);
        assert!(c.take_finished(id).is_none());
        assert_eq!(c.rx_bytes(1, &bytes[cut..], t0), bytes.len() - cut);
        assert_eq!(c.take_finished(id).map(|r| r.ok()), Some(Some(100)));
        assert_eq!(buf[..], payload[..]);
    }
    // A deadline reports how far the message got.
    let mut c = core(t0);
    let mut buf = [0u8; 100];
    let id = post_recv(&mut c, desc(1, 100), &mut buf);
    c.rx_bytes(1, &bytes[..HEADER_LEN + 30], t0);
    let mut w = Waiter::new(id, t0, t0 + SEC / 2);
    match c.poll_wait(&mut w, t0 + SEC / 2) {
        Step::Done(Err(Error::Timeout { peer: 1, ctx, .. })) => {
            assert_eq!((ctx.bytes_done, ctx.bytes), (30, 100))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_large_early_message_parks_until_its_receive_is_posted() {
    let t0 = Instant::now();
    let mut c = core(t0);
    let payload = vec![7u8; 100 << 10];
    let bytes = frame(desc(1, payload.len() as u64), &payload);
    // Only the header is taken; the payload stays with the driver.
    assert_eq!(c.rx_bytes(1, &bytes, t0), HEADER_LEN);
    assert!(c.rx_parked(1));
    let mut buf = vec![0u8; payload.len()];
    // SAFETY: `buf` outlives the operation.
    let (id, attached) = unsafe {
        c.post_recv(1, desc(1, payload.len() as u64), buf.as_mut_ptr(), buf.len(), Instant::now())
    }
    .expect("posted");
    assert!(attached && !c.rx_parked(1));
    // The driver reads straight into the receive buffer.
    let (ptr, room) = c.rx_direct(1, 1).expect("direct read offered");
    assert_eq!((ptr, room), (buf.as_mut_ptr(), payload.len()));
    // SAFETY: `rx_direct` offered `room` writable bytes at `ptr`.
    unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), ptr, room) };
    c.rx_direct_done(1, room, t0);
    assert_eq!(c.take_finished(id).map(|r| r.ok()), Some(Some(payload.len())));
    assert_eq!(buf, payload);
}

#[test]
fn a_wait_for_a_later_message_unparks_the_one_in_the_way() {
    let t0 = Instant::now();
    let mut c = core(t0);
    let big = vec![1u8; 100 << 10];
    assert_eq!(c.rx_bytes(1, &frame(desc(1, big.len() as u64), &big), t0), HEADER_LEN);
    let mut buf = [0u8; 4];
    // The next step of the same collective (same fingerprint).
    let mut other = desc(1, big.len() as u64);
    other.tag.step = 1;
    let id = post_recv(&mut c, other, &mut buf);
    let mut w = Waiter::new(id, t0, t0 + 60 * SEC);
    assert!(matches!(c.poll_wait(&mut w, t0), Step::Again));
    assert!(!c.rx_parked(1), "the frame in the way is buffered so the stream advances");
    assert_eq!(c.rx_bytes(1, &big, t0), big.len());
    assert_eq!(c.rx_bytes(1, &frame(other, &[9; 4]), t0), HEADER_LEN + 4);
    assert_eq!(c.take_finished(id).map(|r| r.ok()), Some(Some(4)));
}

#[test]
fn protocol_violations_fail_the_link_naming_the_peer() {
    let t0 = Instant::now();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("undecodable", vec![0xff; HEADER_LEN]),
        ("claims source rank", {
            let mut f = frame(desc(1, 4), &[0; 4]);
            f[..HEADER_LEN].copy_from_slice(&Header::data(desc(1, 4), 0, 4).encode());
            f
        }),
        (
            "keep-alive frame with a payload",
            Header::control(FrameKind::KeepAlive, 1, 3).encode().to_vec(),
        ),
        (
            "after the peer's close",
            [control(FrameKind::Close, 1), control(FrameKind::KeepAlive, 1)].concat(),
        ),
    ];
    for (what, bytes) in cases {
        let mut c = core(t0);
        let mut buf = [0u8; 4];
        let id = post_recv(&mut c, desc(2, 4), &mut buf);
        c.rx_bytes(1, &bytes, t0);
        assert!(!c.is_up(1), "{what}: link still up");
        let err = c.poisoned().map(ToString::to_string).unwrap_or_default();
        assert!(err.contains(what) || what == "after the peer's close", "{what}: {err}");
        assert!(c.take_finished(id).is_some_and(|r| r.is_err()), "{what}: receive not failed");
    }
}

#[test]
fn a_peer_abort_poisons_with_its_reason_and_a_clean_close_does_not() {
    let t0 = Instant::now();
    let mut c = core(t0);
    let reason = b"rank 3 lost its connection to rank 2";
    let mut f = Header::control(FrameKind::Abort, 1, reason.len()).encode().to_vec();
    f.extend_from_slice(reason);
    c.rx_bytes(1, &f, t0);
    match c.poisoned() {
        Some(Error::PeerAborted { peer: 1, reason: r, .. }) => assert_eq!(r.as_bytes(), reason),
        other => panic!("{other:?}"),
    }
    // A close frame fails only what still needs the peer, and our close answers it.
    let mut c = core(t0);
    let mut buf = [0u8; 4];
    let id = post_recv(&mut c, desc(1, 4), &mut buf);
    c.rx_bytes(1, &control(FrameKind::Close, 1), t0);
    assert!(c.take_finished(id).is_some_and(|r| r.is_err()));
    assert!(c.poisoned().is_none());
    assert_eq!(queued(&c), [FrameKind::Close]);
    c.tx_done(1, HEADER_LEN, t0);
    assert!(c.tx_finished(1));
    // The end of the stream after that is the normal end.
    c.link_failed(1, LinkFail::Closed);
    assert!(c.poisoned().is_none());
}

#[test]
fn sends_complete_when_their_last_byte_is_written_and_cancel_keeps_the_stream_whole() {
    let t0 = Instant::now();
    let mut c = core(t0);
    let data = [5u8; 10];
    // SAFETY: `data` outlives the operations.
    let a =
        unsafe { c.post_send(1, desc(1, 10), data.as_ptr(), 10, Instant::now()) }.expect("posted");
    // SAFETY: as above.
    let b =
        unsafe { c.post_send(1, desc(2, 10), data.as_ptr(), 10, Instant::now()) }.expect("posted");
    c.tx_done(1, HEADER_LEN + 9, t0);
    assert!(c.take_finished(a).is_none());
    // Cancelling a partly written send finishes it from a private copy: the peer still gets a
    // whole frame.
    c.cancel(a);
    assert_eq!(c.sendq(1)[0].payload(), &data[..]);
    c.tx_done(1, 1 + HEADER_LEN + 10, t0);
    assert_eq!(c.take_finished(b).map(|r| r.ok()), Some(Some(10)));
    assert!(c.sendq(1).is_empty());
}

/// The core's fuzz entry point, on deterministic pseudo-random inputs (the fuzz target runs it
/// on arbitrary ones).
#[test]
fn arbitrary_streams_never_panic() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let valid = frame(desc(1, 8), &[1; 8]);
    for _ in 0..2000 {
        let len = (next() % 300) as usize;
        let mut data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        // Half the inputs start with a valid frame, so later bytes reach deeper states.
        if next() % 2 == 0 {
            data.splice(0..0, valid.iter().copied());
        }
        fuzz_stream(&data);
    }
}

#[test]
fn a_full_window_parks_even_small_messages_until_their_receive() {
    let t0 = Instant::now();
    let mut c = core(t0);
    let chunk = vec![3u8; 64 << 10];
    let d = |step: u32| {
        let mut d = desc(1, chunk.len() as u64);
        d.tag.step = step;
        d
    };
    // 16 messages of 64 KiB fill the 1 MiB window; each is buffered whole.
    for step in 0..16 {
        let f = frame(d(step), &chunk);
        assert_eq!(c.rx_bytes(1, &f, t0), f.len(), "message {step} within the window");
    }
    assert_eq!(c.unexpected_held(), 1 << 20);
    // The 17th parks: its header is read, its payload left to the driver (and the sender).
    let f = frame(d(16), &chunk);
    assert_eq!(c.rx_bytes(1, &f, t0), HEADER_LEN);
    assert!(c.rx_parked(1));
    // Taking a buffered message frees room but the parked one waits for its own receive...
    let mut buf = vec![0u8; chunk.len()];
    let id = post_recv(&mut c, d(0), &mut buf);
    assert_eq!(c.take_finished(id).map(|r| r.ok()), Some(Some(chunk.len())));
    assert!(c.rx_parked(1));
    // ... which attaches it: the payload goes straight into the posted buffer.
    let mut buf = vec![0u8; chunk.len()];
    // SAFETY: `buf` outlives the operation.
    let (id, attached) =
        unsafe { c.post_recv(1, d(16), buf.as_mut_ptr(), buf.len(), Instant::now()) }
            .expect("posted");
    assert!(attached && !c.rx_parked(1));
    assert_eq!(c.rx_bytes(1, &f[HEADER_LEN..], t0), chunk.len());
    assert_eq!(c.take_finished(id).map(|r| r.ok()), Some(Some(chunk.len())));
    assert_eq!(buf, chunk);
}

#[test]
fn the_rest_of_a_failed_receives_frame_is_dropped_not_written() {
    let t0 = Instant::now();
    let mut c = Core::new(0, 3, cfg(), t0);
    c.link_up(1, t0);
    c.link_up(2, t0);
    let payload = vec![0x11u8; 100 << 10];
    let bytes = frame(desc(1, payload.len() as u64), &payload);
    let mut buf = vec![0u8; payload.len()];
    let id = post_recv(&mut c, desc(1, payload.len() as u64), &mut buf);
    let half = HEADER_LEN + payload.len() / 2;
    assert_eq!(c.rx_bytes(1, &bytes[..half], t0), half);
    // Rank 2 breaks the protocol: everything fails, this receive included.
    c.rx_bytes(2, &[0xab; HEADER_LEN], t0);
    assert!(matches!(c.take_finished(id), Some(Err(_))));
    buf.fill(0x5a);
    // The caller may have freed the buffer: the rest of the frame is read and dropped.
    assert_eq!(c.rx_bytes(1, &bytes[half..], t0), bytes.len() - half);
    assert!(buf.iter().all(|b| *b == 0x5a), "bytes written into a failed receive's buffer");
}

/// Waits on a peer that follow each other closely are one run: the peer's silence counts from
/// the run's first wait, so a peer that lets each wait end short of the limit (a stopped peer
/// whose kernel still takes small messages, a little at a time) is named at the limit, not
/// never. A wait after a pause starts a run of its own (`traffic_and_a_late_wait_…`).
#[test]
fn back_to_back_waits_count_a_silent_peer_from_the_first() {
    let ms = Duration::from_millis;
    let t0 = Instant::now();
    let mut c = core(t0);
    let mut buf = [0u8; 4];
    assert_eq!(c.rx_bytes(1, &control(FrameKind::KeepAlive, 1), t0), HEADER_LEN);
    let id = post_recv(&mut c, desc(1, 4), &mut buf);
    // Waits of 1.2 s each, 200 ms apart, from 1 s on, each looking every 400 ms.
    let mut at = t0 + SEC;
    let mut dead_at = None;
    'waits: for k in 0..8u32 {
        let start = t0 + SEC + ms(1400) * k;
        let mut w = Waiter::new(id, start, t0 + 60 * SEC);
        w.probed = true;
        at = start;
        while at <= start + ms(1200) {
            match c.poll_wait(&mut w, at) {
                Step::Sleep(_) => assert!(c.is_up(1), "at {:?}", at - t0),
                Step::Again => {
                    dead_at = Some(at - t0);
                    break 'waits;
                }
                Step::Done(r) => panic!("at {:?}: {r:?}", at - t0),
            }
            at += ms(400);
        }
    }
    // Silent since 1 s (the run's first wait; its last traffic was at 0 s): dead at 6 s, in
    // the fourth wait, where each wait counting from its own start never reached the limit.
    assert_eq!(dead_at, Some(Duration::from_secs(6)), "last look at {:?}", at - t0);
    assert!(!c.is_up(1));
}
