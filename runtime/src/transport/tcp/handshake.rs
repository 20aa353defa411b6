//! The rank-to-rank connection handshake: who is calling, for which job, and proof of the key.
//!
//! ```text
//! client (the rank that dials)                  server (the rank dialled)
//!   Hello  48 B  magic "TUTTIHS1", version, world, from, to, job id, client nonce  ──►
//!   ◄── Challenge 49 B  status, server nonce, HMAC(key, "srv" ‖ hello ‖ server nonce)
//!   Proof  32 B  HMAC(key, "cli" ‖ hello ‖ server nonce)                          ──►
//!   ◄── Ack 1 B  status
//!   ◄── shared-memory Offer 80 B (where the server runs, pid, descriptor, nonce; `shm.rs`)
//!   Ack 80 B (attached or not)                                                     ──►
//! ```
//!
//! The last two messages decide whether the connection's frames go through shared memory
//! (ranks of one host) and are part of the handshake's one deadline; version 2 has them. Either
//! rank of a pair may dial (links connect on first use); version 3 adds `Crossed`, the refusal
//! of a dial that crossed the lower rank's own.
//!
//! Both sides prove they know the job key without sending it; the nonces make every proof
//! single-use. The server checks the client's proof before it looks at the job id, world size
//! or ranks, so a client without the key learns nothing about the job (only a protocol version
//! mismatch is answered earlier). A server that sees a bad magic, a wrong proof, a wrong job id,
//! world size or rank drops the connection with one `warn!` line. The whole exchange has one
//! deadline (`LinkConfig::handshake_timeout`, 2 s by default), however the bytes are split.
//! Parsing never panics and never allocates from what arrived.

use std::io::Write;
use std::net::TcpStream;
use std::time::Instant;

use crate::auth::JobKey;
use crate::util::read_exact_by;

/// Magic at the start of a handshake.
pub(crate) const HS_MAGIC: &[u8; 8] = b"TUTTIHS1";
/// Handshake protocol version.
pub(crate) const HS_VERSION: u16 = 3;
/// Length of a hello.
pub(crate) const HELLO_LEN: usize = 48;

/// What the client says first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) version: u16,
    pub(crate) world: u32,
    pub(crate) from: u32,
    pub(crate) to: u32,
    pub(crate) job: u64,
    pub(crate) nonce: [u8; 16],
}

/// Status codes in the challenge and the ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Status {
    Ok = 0,
    WrongJob = 1,
    WrongWorld = 2,
    WrongRank = 3,
    Duplicate = 4,
    BadVersion = 5,
    BadProof = 6,
    /// Both ranks dialled each other at once and the server (the lower rank) keeps its own
    /// dial: the client's is refused and it waits for the server's connection instead.
    Crossed = 7,
}

impl Status {
    fn from_u8(v: u8) -> Option<Status> {
        use Status::*;
        [Ok, WrongJob, WrongWorld, WrongRank, Duplicate, BadVersion, BadProof, Crossed]
            .into_iter()
            .find(|s| *s as u8 == v)
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::WrongJob => "it belongs to a different job (job id differs)",
            Status::WrongWorld => "it has a different world size",
            Status::WrongRank => "the rank numbers do not fit this server",
            Status::Duplicate => "that rank is already connected (duplicate rank?)",
            Status::BadVersion => "the protocol version differs",
            Status::BadProof => "authentication failed (different TUTTI_TOKEN?)",
            Status::Crossed => "the peer is dialling us too, and its connection is kept",
        }
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HsError {
    #[error("not a tutti handshake (bad magic)")]
    Magic,
    #[error("refused: {}", .0.describe())]
    Refused(Status),
    #[error("peer's proof of the job key is wrong (different TUTTI_TOKEN?)")]
    Proof,
    #[error("malformed handshake: {0}")]
    Malformed(&'static str),
    #[error("i/o during handshake: {0}")]
    Io(String),
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(HS_MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.world.to_le_bytes());
        b[16..20].copy_from_slice(&self.from.to_le_bytes());
        b[20..24].copy_from_slice(&self.to.to_le_bytes());
        b[24..32].copy_from_slice(&self.job.to_le_bytes());
        b[32..48].copy_from_slice(&self.nonce);
        b
    }

    /// Parse a hello; never panics.
    pub(crate) fn decode(b: &[u8]) -> Result<Hello, HsError> {
        if b.len() < HELLO_LEN {
            return Err(HsError::Malformed("short hello"));
        }
        if &b[0..8] != HS_MAGIC {
            return Err(HsError::Magic);
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        if b[10] != 0 || b[11] != 0 {
            return Err(HsError::Malformed("reserved bytes set"));
        }
        let mut job = [0u8; 8];
        job.copy_from_slice(&b[24..32]);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[32..48]);
        Ok(Hello {
            version: u16::from_le_bytes([b[8], b[9]]),
            world: u32_at(12),
            from: u32_at(16),
            to: u32_at(20),
            job: u64::from_le_bytes(job),
            nonce,
        })
    }
}

fn io(e: std::io::Error) -> HsError {
    HsError::Io(e.to_string())
}

fn write_timeout(s: &TcpStream, deadline: Instant) -> Result<(), HsError> {
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_write_timeout(Some(left.max(std::time::Duration::from_millis(1)))).map_err(io)
}

/// Client side: returns once the server accepted us, by `deadline`.
pub(crate) fn client(
    s: &mut TcpStream,
    key: &JobKey,
    hello: Hello,
    deadline: Instant,
) -> Result<(), HsError> {
    write_timeout(s, deadline)?;
    let hb = hello.encode();
    s.write_all(&hb).map_err(io)?;
    let mut ch = [0u8; 49];
    read_exact_by(s, &mut ch[..1], deadline).map_err(io)?;
    let status = Status::from_u8(ch[0]).ok_or(HsError::Malformed("unknown status"))?;
    if status != Status::Ok {
        return Err(HsError::Refused(status));
    }
    read_exact_by(s, &mut ch[1..], deadline).map_err(io)?;
    let nonce_s = &ch[1..17];
    if !key.verify(&[b"srv", &hb, nonce_s], &ch[17..49]) {
        return Err(HsError::Proof);
    }
    let proof = key.mac(&[b"cli", &hb, nonce_s]);
    s.write_all(&proof).map_err(io)?;
    let mut ack = [0u8; 1];
    read_exact_by(s, &mut ack, deadline).map_err(io)?;
    match Status::from_u8(ack[0]) {
        Some(Status::Ok) => Ok(()),
        Some(st) => Err(HsError::Refused(st)),
        None => Err(HsError::Malformed("unknown ack")),
    }
}

/// What the server expects of a client.
pub(crate) struct Expect<'a> {
    pub(crate) key: &'a JobKey,
    pub(crate) job: u64,
    pub(crate) world: u32,
    pub(crate) me: u32,
}

/// Server side: returns the authenticated client's hello, by `deadline`. `accept_rank` decides
/// whether a client rank is welcome ([`Status::Ok`]: not yet connected) or why not.
pub(crate) fn server(
    s: &mut TcpStream,
    expect: &Expect<'_>,
    nonce_s: [u8; 16],
    accept_rank: impl FnOnce(u32) -> Status,
    deadline: Instant,
) -> Result<Hello, HsError> {
    write_timeout(s, deadline)?;
    let mut hb = [0u8; HELLO_LEN];
    // Read the magic first so junk is refused at once, without waiting for 48 bytes.
    read_exact_by(s, &mut hb[..8], deadline).map_err(io)?;
    if &hb[..8] != HS_MAGIC {
        return Err(HsError::Magic);
    }
    read_exact_by(s, &mut hb[8..], deadline).map_err(io)?;
    let hello = Hello::decode(&hb)?;
    let refuse = |s: &mut TcpStream, st: Status| {
        let _ = s.write_all(&[st as u8]);
        Err(HsError::Refused(st))
    };
    if hello.version != HS_VERSION {
        return refuse(s, Status::BadVersion);
    }
    let mut ch = [0u8; 49];
    ch[1..17].copy_from_slice(&nonce_s);
    ch[17..49].copy_from_slice(&expect.key.mac(&[b"srv", &hb, &nonce_s]));
    s.write_all(&ch).map_err(io)?;
    let mut proof = [0u8; 32];
    read_exact_by(s, &mut proof, deadline).map_err(io)?;
    // The proof first: only a holder of the key hears what is wrong with its hello.
    if !expect.key.verify(&[b"cli", &hb, &nonce_s], &proof) {
        return refuse(s, Status::BadProof);
    }
    if hello.job != expect.job {
        return refuse(s, Status::WrongJob);
    }
    if hello.world != expect.world {
        return refuse(s, Status::WrongWorld);
    }
    if hello.to != expect.me || hello.from >= expect.world || hello.from == expect.me {
        return refuse(s, Status::WrongRank);
    }
    match accept_rank(hello.from) {
        Status::Ok => {}
        st => return refuse(s, st),
    }
    s.write_all(&[Status::Ok as u8]).map_err(io)?;
    Ok(hello)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn hello_roundtrip() {
        let h = Hello { version: 1, world: 4, from: 3, to: 1, job: 99, nonce: [7; 16] };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        assert_eq!(Hello::decode(b"GET / HTTP/1.1\r\n"), Err(HsError::Malformed("short hello")));
        let mut junk = [0u8; 48];
        junk[..4].copy_from_slice(b"GET ");
        assert_eq!(Hello::decode(&junk), Err(HsError::Magic));
    }

    proptest! {
        #[test]
        fn hello_decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = Hello::decode(&b);
        }
    }
}
