use std::os::fd::AsRawFd;

use proptest::prelude::*;

use super::*;
use std::os::fd::FromRawFd;

/// The rings of these tests.
const RING_BYTES: usize = RING_MAX;

/// Bytes 0, 1, 2, … (mod 251, so a shifted copy never matches).
fn pattern(from: usize, n: usize) -> Vec<u8> {
    (from..from + n).map(|i| (i % 251) as u8).collect()
}

#[test]
fn bytes_cross_the_ring_in_order_across_its_wrap() {
    let (mut a, mut b) = local_pair(RING_BYTES).unwrap();
    let chunk = RING_BYTES / 3 + 17;
    let mut sent = 0;
    let mut got = Vec::new();
    for _ in 0..10 {
        let data = pattern(sent, chunk);
        assert!(a.room().unwrap() >= chunk);
        // SAFETY: `chunk` readable bytes, within the room.
        unsafe { a.put(data.as_ptr(), chunk) };
        assert_eq!(b.avail().unwrap(), 0, "nothing is readable before it is published");
        a.publish();
        sent += chunk;
        let n = b.avail().unwrap();
        assert_eq!(n, chunk);
        let mut buf = vec![0u8; n];
        // SAFETY: `n` writable bytes, published.
        unsafe { b.take(buf.as_mut_ptr(), n) };
        b.release();
        got.extend_from_slice(&buf);
    }
    assert_eq!(got, pattern(0, sent));
    // And the other direction, which is the other ring.
    let data = pattern(5, 1000);
    // SAFETY: as above.
    unsafe { b.put(data.as_ptr(), data.len()) };
    b.publish();
    let mut buf = vec![0u8; 1000];
    assert_eq!(a.avail().unwrap(), 1000);
    // SAFETY: as above.
    unsafe { a.take(buf.as_mut_ptr(), 1000) };
    assert_eq!(buf, data);
}

#[test]
fn a_full_ring_has_no_room_until_the_reader_releases() {
    let (mut a, mut b) = local_pair(RING_BYTES).unwrap();
    let data = vec![9u8; RING_BYTES];
    // SAFETY: `RING_BYTES` readable bytes, the whole (empty) ring.
    unsafe { a.put(data.as_ptr(), RING_BYTES) };
    a.publish();
    assert_eq!(a.room().unwrap(), 0);
    let mut head = [0u8; 10];
    assert_eq!(b.peek(&mut head), 10);
    assert_eq!(a.room().unwrap(), 0, "a peek consumes nothing");
    b.skip(100);
    assert_eq!(a.room().unwrap(), 0, "room appears only once released");
    b.release();
    assert_eq!(a.room().unwrap(), 100);
}

#[test]
fn wake_ups_are_asked_for_only_by_a_sleeper_and_given_once() {
    let (mut a, mut b) = local_pair(RING_BYTES).unwrap();
    let x = [1u8; 8];
    // SAFETY: 8 readable bytes, within the room.
    unsafe { a.put(x.as_ptr(), 8) };
    assert!(!a.publish(), "nobody sleeps: no wake-up");
    assert!(b.arm_rx(), "input is there: the reader must not sleep");
    let mut buf = [0u8; 8];
    // SAFETY: 8 writable bytes, published.
    unsafe { b.take(buf.as_mut_ptr(), 8) };
    assert!(!b.release());
    assert!(!b.arm_rx(), "empty: the reader may sleep");
    // SAFETY: as above.
    unsafe { a.put(x.as_ptr(), 8) };
    assert!(a.publish(), "the reader sleeps: wake it");
    // SAFETY: as above.
    unsafe { a.put(x.as_ptr(), 8) };
    assert!(!a.publish(), "one wake-up per sleep");
    // The writer's side: a full ring, then room.
    let fill = vec![0u8; RING_BYTES - 16];
    // SAFETY: the rest of the room.
    unsafe { a.put(fill.as_ptr(), fill.len()) };
    a.publish();
    assert!(!a.arm_tx(), "full: the writer may sleep");
    let mut sink = vec![0u8; 16];
    // SAFETY: 16 writable bytes, published.
    unsafe { b.take(sink.as_mut_ptr(), 16) };
    assert!(b.release(), "the writer waits for room: wake it");
}

#[test]
fn a_peer_scribbling_positions_is_a_named_error_never_a_wild_read() {
    let (a, b) = local_pair(RING_BYTES).unwrap();
    // The writer's head far ahead of what the reader has read: more than a ring's worth.
    scribble(&b, true, RING_BYTES as u64 + 1);
    let e = b.avail().unwrap_err();
    assert!(e.contains("corrupted"), "{e}");
    assert!(b.arm_rx(), "a corrupt ring must not let the reader sleep past it");
    assert_eq!(b.peek(&mut [0u8; 4]), 0);
    // The reader's tail ahead of what the writer wrote.
    scribble(&a, false, 0);
    scribble(&b, false, 5);
    let e = a.room().unwrap_err();
    assert!(e.contains("read position"), "{e}");
}

#[test]
fn attaching_checks_the_segment_is_the_announced_one() {
    let nonce = [3u8; 16];
    let (_seg, fd) = Segment::create(&nonce, RING_BYTES).unwrap();
    let me = std::process::id();
    let raw = fd.as_raw_fd() as u32;
    assert!(Segment::attach(me, raw, &nonce, RING_BYTES).is_ok());
    let e = Segment::attach(me, raw, &[4u8; 16], RING_BYTES).err().unwrap();
    assert!(e.contains("not the one it announced"), "{e}");
    // An unsealed file of the right size: the peer could shrink it under our mapping.
    // SAFETY: a valid C string and flags.
    let plain = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(plain >= 0);
    // SAFETY: our descriptor.
    let plain = unsafe { OwnedFd::from_raw_fd(plain) };
    let size = segment_bytes(RING_BYTES) as libc::off_t;
    // SAFETY: plain call on our descriptor.
    let sized = unsafe { libc::ftruncate(plain.as_raw_fd(), size) };
    assert_eq!(sized, 0);
    let e = Segment::attach(me, plain.as_raw_fd() as u32, &nonce, RING_BYTES).err().unwrap();
    assert!(e.contains("sealed"), "{e}");
    // A sealed file of another size.
    // SAFETY: a valid C string and flags.
    let small = unsafe {
        libc::memfd_create(c"small".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
    };
    assert!(small >= 0);
    // SAFETY: our descriptor.
    let small = unsafe { OwnedFd::from_raw_fd(small) };
    // SAFETY: plain calls on our descriptor.
    unsafe {
        assert_eq!(libc::ftruncate(small.as_raw_fd(), 4096), 0);
        assert_eq!(
            libc::fcntl(
                small.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW
            ),
            0
        );
    }
    let e = Segment::attach(me, small.as_raw_fd() as u32, &nonce, RING_BYTES).err().unwrap();
    assert!(e.contains("bytes"), "{e}");
    // A descriptor that is not there.
    let e = Segment::attach(me, 999_999, &nonce, RING_BYTES).err().unwrap();
    assert!(e.contains("opening"), "{e}");
}

#[test]
fn rings_shrink_with_the_world_so_one_host_holds_at_most_768_mib_of_them() {
    assert_eq!(ring_for(1), RING_MAX);
    assert_eq!(ring_for(2), RING_MAX);
    assert_eq!(ring_for(28), 1 << 20);
    assert_eq!(ring_for(29), 512 << 10);
    assert_eq!(ring_for(64), 128 << 10);
    assert_eq!(ring_for(111), 64 << 10);
    assert_eq!(ring_for(100_000), RING_MIN);
    for w in 2..=111usize {
        let r = ring_for(w);
        assert!(r.is_power_of_two());
        assert!(w * (w - 1) * r <= 768 << 20, "world {w}: {r}-byte rings hold more than 768 MiB");
    }
    assert_eq!(super::super::shared_pair_bytes(64), 4096 + 2 * (128 << 10));
    // A segment whose ring size is not ours is refused before anything is opened.
    let e = Segment::attach(std::process::id(), 0, &[0; 16], 3 << 10).err().unwrap();
    assert!(e.contains("ring size"), "{e}");
}

#[test]
fn the_host_id_is_stable_and_names_the_boot() {
    let a = host_id();
    assert_eq!(a, host_id());
    assert_ne!(a[..16], [0u8; 16], "boot id read");
}

#[test]
fn setup_messages_round_trip() {
    let mut m = SetupMsg::new(Step::Offer, true, RING_BYTES);
    m.fd = 17;
    m.host = [5; 32];
    m.nonce = [6; 16];
    assert_eq!(SetupMsg::decode(&m.encode()), Ok(m));
    let mut b = m.encode();
    b[9] = 2;
    assert!(SetupMsg::decode(&b).is_err());
    b[9] = 1;
    b[8] = 9;
    assert!(SetupMsg::decode(&b).is_err());
}

proptest! {
    #[test]
    fn setup_decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..100)) {
        let _ = SetupMsg::decode(&b);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn ring_operations_from_a_broken_peer_never_panic(
        b in proptest::collection::vec(any::<u8>(), 0..300)
    ) {
        crate::fuzzing::shm_ring(&b);
    }
}
