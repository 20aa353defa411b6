//! Flow control over TCP, QUIC and in memory: a sender that runs ahead of a receiver that has posted
//! nothing waits once the peer's window is full; the receiver holds at most the window, and
//! everything arrives, in order and intact, once it posts.

use std::time::{Duration, Instant};

use crate::testing;
use crate::transport::engine::{Driver, Wired};
use crate::transport::{LinkConfig, OpId, Transport};
use crate::wire::{DType, Fingerprint, MsgDesc, OpKind, Tag};

const WINDOW: u64 = 1 << 20;
const MSG: usize = 1 << 20;
const COUNT: usize = 64;

fn desc(step: u32) -> MsgDesc {
    MsgDesc {
        tag: Tag { group: 0, seq: 1, step },
        fp: Fingerprint {
            op: OpKind::Broadcast,
            dtype: DType::U8,
            redop: 0,
            root: 0,
            count: MSG as u64,
            settings: 0,
        },
    }
}

fn cfg() -> LinkConfig {
    LinkConfig { connect_timeout: Duration::from_secs(60), window: WINDOW, ..LinkConfig::default() }
}

fn byte(step: usize, i: usize) -> u8 {
    (step * 31 + i / 4096) as u8
}

/// `kind`: what the link between the two must be (`Transport::link_kind`), so that a test of
/// one way never passes over another.
fn sender_waits_and_receiver_stays_bounded<T, D>(ts: Vec<T>, kind: &str)
where
    T: Transport + Wired<Driver = D> + Sync,
    D: Driver,
{
    let (t0, t1) = {
        let mut it = ts.into_iter();
        (it.next().unwrap(), it.next().unwrap())
    };
    let data: Vec<Vec<u8>> = (0..COUNT).map(|s| (0..MSG).map(|i| byte(s, i)).collect()).collect();
    let checked = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let (data, checked) = (&data, &checked);
        let sender = s.spawn(move || {
            // SAFETY: `data` outlives every operation: each is waited for below.
            let ids: Vec<OpId> = (0..COUNT)
                .map(|k| unsafe { t0.post_send(1, desc(k as u32), data[k].as_ptr(), MSG) }.unwrap())
                .collect();
            std::thread::sleep(Duration::from_millis(500));
            // The receiver has posted nothing yet: 64 MiB cannot all have left.
            let last_done = t0.test(ids[COUNT - 1]).unwrap().is_some();
            checked.wait();
            let deadline = Instant::now() + Duration::from_secs(60);
            for id in &ids[..COUNT - 1] {
                t0.wait(*id, deadline).unwrap();
            }
            if !last_done {
                t0.wait(ids[COUNT - 1], deadline).unwrap();
            }
            (last_done, t0)
        });
        checked.wait();
        let held = t1.engine().lock().core.unexpected_held();
        assert!(held <= WINDOW, "rank 1 holds {held} bytes nobody asked for (window {WINDOW})");
        let mut buf = vec![0u8; MSG];
        for (k, want) in data.iter().enumerate() {
            let d = Instant::now() + Duration::from_secs(60);
            // SAFETY: `buf` outlives the receive, which is waited for at once.
            let id = unsafe { t1.post_recv(0, desc(k as u32), buf.as_mut_ptr(), MSG) }.unwrap();
            assert_eq!(t1.wait(id, d).unwrap(), MSG);
            assert!(buf == *want, "message {k} differs");
        }
        let (last_done, t0) = sender.join().unwrap();
        assert!(!last_done, "every send completed although the receiver posted nothing");
        assert_eq!((t0.link_kind(1), t1.link_kind(0)), (kind, kind), "the link's kind");
        drop(t0);
    });
}

/// In memory the sender waits on the same credits (nothing fails at a fixed budget).
#[test]
fn mem() {
    sender_waits_and_receiver_stays_bounded(
        crate::transport::mem::MemTransport::world_with(2, &cfg()),
        "mem",
    );
}

#[test]
fn tcp() {
    let (ts, _store) = testing::tcp_world(2, &cfg()).unwrap();
    sender_waits_and_receiver_stays_bounded(ts, "tcp");
}

/// Over shared memory the ring holds what the kernel's buffers would; the window is the same.
#[test]
fn shm() {
    let (ts, _store) = testing::shm_world(2, &cfg()).unwrap();
    sender_waits_and_receiver_stays_bounded(ts, "shm");
}

#[cfg(feature = "quic")]
#[test]
fn quic() {
    let ts = testing::quic_world(2, &cfg()).unwrap();
    sender_waits_and_receiver_stays_bounded(ts, "quic");
}

/// A QUIC job's two ranks of one host: through the rings, under the mixed driver.
#[cfg(feature = "quic")]
#[test]
fn quic_shm() {
    let ts = testing::quic_hosts_world(2, &cfg(), |_| 0).unwrap();
    sender_waits_and_receiver_stays_bounded(ts, "shm");
}
