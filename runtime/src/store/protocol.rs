//! Wire protocol of the TCP store (version 2).
//!
//! ```text
//! client                                              server
//!   ◄── nonce_s (16 B)
//!   hello: magic, version, rank, world, nonce_c,
//!          HMAC(k, "tutti-store-cli" ‖ nonce_s ‖ nonce_c ‖ rank ‖ world)  ──►
//!   ◄── Welcome(HMAC(k, "tutti-store-srv" ‖ nonce_s ‖ nonce_c ‖ rank ‖ world)) or Err
//!   request ‖ tag ──►   ◄── answer ‖ tag   …
//! ```
//!
//! Every message is a little-endian `u32` length, then that many bytes: postcard, and, when the
//! job has a key, a 32-byte tag `HMAC(k, "tutti-store-msg" ‖ direction ‖ nonce_s ‖ nonce_c ‖
//! sequence number ‖ body)`. Both sides prove the key over both fresh nonces before anything
//! else is said, so neither a stranger on the port nor a fake store learns or fakes anything;
//! the tags make every later message tamper-evident and bind it to its place in this
//! connection (no replay, reordering or splicing from another one). The server checks the
//! client's proof before it says anything about the job (world size, ranks). A job without a
//! key (explicitly insecure) runs the same protocol without the proofs and tags. Lengths are
//! checked against a limit before anything is allocated, and a message must arrive whole
//! within [`MESSAGE_DEADLINE`] of its first byte, so junk or a trickle on the port costs little.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::auth::JobKey;
use crate::util::read_exact_by;

/// Largest store message accepted, tag included.
pub const MAX_STORE_MESSAGE: usize = 256 << 10;
/// Longest key.
pub const MAX_KEY: usize = 1024;
/// Largest value.
pub const MAX_VALUE: usize = 128 << 10;
/// Largest hello accepted.
pub(super) const MAX_HELLO: usize = 256;
pub(super) const STORE_MAGIC: [u8; 8] = *b"TUTTISTR";
pub(super) const STORE_VERSION: u16 = 3;
/// Most keys one [`Request::GetAll`] may name (the client splits longer lists).
pub(super) const GET_ALL_KEYS: usize = 1024;
/// Words of the server's refusal of a get-all whose values exceed one message.
pub(super) const TOO_LARGE: &str = "ask for fewer keys at once";
/// From accepting a connection to the end of the hello exchange.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(2);
/// From a message's first byte to its last.
pub const MESSAGE_DEADLINE: Duration = Duration::from_secs(10);
const TAG: usize = 32;

/// The client's first message.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoreHello {
    /// `b"TUTTISTR"`.
    pub magic: [u8; 8],
    /// Protocol version.
    pub version: u16,
    /// Client's rank.
    pub rank: u32,
    /// Client's world size.
    pub world: u32,
    /// The client's fresh nonce.
    pub nonce: [u8; 16],
    /// The client's proof of the job key, when the job has one.
    pub mac: Option<[u8; 32]>,
}

/// What the proofs of the hello exchange cover.
pub(super) fn hello_proof(
    key: &JobKey,
    who: &[u8],
    nonce_s: &[u8; 16],
    hello: &StoreHello,
) -> [u8; 32] {
    key.mac(&[who, nonce_s, &hello.nonce, &hello.rank.to_le_bytes(), &hello.world.to_le_bytes()])
}

/// Label of the client's proof.
pub(super) const CLIENT_PROOF: &[u8] = b"tutti-store-cli";
/// Label of the server's proof.
pub(super) const SERVER_PROOF: &[u8] = b"tutti-store-srv";

/// A store request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[non_exhaustive]
pub enum Request {
    /// Set a key.
    Set {
        /// Key.
        key: String,
        /// Value.
        value: Vec<u8>,
    },
    /// Get a key, waiting up to `timeout_ms`.
    Get {
        /// Key.
        key: String,
        /// Wait limit.
        timeout_ms: u64,
    },
    /// Add to an integer key.
    Add {
        /// Key.
        key: String,
        /// Increment.
        delta: i64,
    },
    /// Delete a key.
    Delete {
        /// Key.
        key: String,
    },
    /// Are all keys set?
    Check {
        /// Keys.
        keys: Vec<String>,
    },
    /// Get several keys in one round, waiting up to `timeout_ms` for the last of them.
    GetAll {
        /// Keys.
        keys: Vec<String>,
        /// Wait limit.
        timeout_ms: u64,
    },
}

/// A store response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[non_exhaustive]
pub enum Response {
    /// Done.
    Ok,
    /// A value.
    Value(Vec<u8>),
    /// An integer.
    Int(i64),
    /// A yes/no answer.
    Bool(bool),
    /// The wait timed out.
    Timeout,
    /// The request failed.
    Err(String),
    /// The hello was accepted; the server's proof of the job key when the job has one.
    Welcome(Option<[u8; 32]>),
    /// The values of a [`Request::GetAll`], in its keys' order.
    Values(Vec<Vec<u8>>),
    /// A [`Request::GetAll`] ran out of time; the first of its keys still missing.
    TimeoutOn(String),
}

/// Decode one store message body. Never panics; this is the entry point fuzzing uses.
///
/// # Errors
/// A description of what is malformed.
pub fn decode_request(body: &[u8]) -> Result<Request, String> {
    postcard::from_bytes(body).map_err(|e| format!("malformed store request: {e}"))
}

/// Which end of a connection this is: it picks the direction labels of the tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Client,
    Server,
}

/// Tags on the messages of one authenticated connection.
pub(super) struct Seal {
    key: JobKey,
    nonces: [u8; 32],
    side: Side,
    sent: u64,
    received: u64,
}

impl Seal {
    pub(super) fn new(key: JobKey, nonce_s: &[u8; 16], nonce_c: &[u8; 16], side: Side) -> Seal {
        let mut nonces = [0u8; 32];
        nonces[..16].copy_from_slice(nonce_s);
        nonces[16..].copy_from_slice(nonce_c);
        Seal { key, nonces, side, sent: 0, received: 0 }
    }

    fn tag(&self, from_client: bool, seq: u64, body: &[u8]) -> [u8; 32] {
        let dir: &[u8] = if from_client { b"req" } else { b"rsp" };
        self.key.mac(&[b"tutti-store-msg", dir, &self.nonces, &seq.to_le_bytes(), body])
    }
}

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// One message as it goes on the wire: length, body, and its tag when `seal` is given.
pub(super) fn frame(seal: Option<&mut Seal>, v: &impl Serialize) -> std::io::Result<Vec<u8>> {
    let mut body = postcard::to_stdvec(v).map_err(|e| invalid(e.to_string()))?;
    if let Some(seal) = seal {
        let tag = seal.tag(seal.side == Side::Client, seal.sent, &body);
        seal.sent += 1;
        body.extend_from_slice(&tag);
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    Ok(buf)
}

/// The length a message's first 4 bytes announce, checked against `max` (and against the tag's
/// length when the connection is sealed) before anything is allocated for it.
///
/// # Errors
/// `InvalidData` for a length outside the limits.
pub(super) fn announced(len: [u8; 4], sealed: bool, max: usize) -> std::io::Result<usize> {
    let len = u32::from_le_bytes(len) as usize;
    let tag_len = if sealed { TAG } else { 0 };
    if len > max || len < tag_len {
        return Err(invalid(format!("message of {len} bytes is outside 0..={max}")));
    }
    Ok(len)
}

/// Check and strip the tag of a received message body (`seal` given), in order.
///
/// # Errors
/// `InvalidData` ("integrity check failed") when the tag is wrong.
pub(super) fn open(seal: Option<&mut Seal>, mut body: Vec<u8>) -> std::io::Result<Vec<u8>> {
    if let Some(seal) = seal {
        let len = body.len();
        let (msg, tag) = body.split_at(len - TAG);
        let want = seal.tag(seal.side == Side::Server, seal.received, msg);
        if !crate::auth::ct_eq(&want, tag) {
            return Err(invalid(format!(
                "integrity check failed on message {} of this connection: it was changed \
                 in transit or does not come from a holder of the job key",
                seal.received
            )));
        }
        seal.received += 1;
        body.truncate(len - TAG);
    }
    Ok(body)
}

/// Write one message (tagged when `seal` is given).
pub(super) fn send(
    s: &mut TcpStream,
    seal: Option<&mut Seal>,
    v: &impl Serialize,
) -> std::io::Result<()> {
    s.write_all(&frame(seal, v)?)
}

/// Read one message: its length by `first_by`, the rest within [`MESSAGE_DEADLINE`] of that
/// (and by `first_by` too when it is sooner), checked against `max` before allocating; its tag
/// checked and removed when `seal` is given.
///
/// # Errors
/// `TimedOut` when a deadline passes, `InvalidData` for an oversized message or a wrong tag (the
/// message says "integrity check failed"), or the socket's own error.
pub(super) fn recv(
    s: &mut TcpStream,
    seal: Option<&mut Seal>,
    max: usize,
    first_by: Instant,
) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_by(s, &mut len[..1], first_by)?;
    let rest_by = first_by.min(Instant::now() + MESSAGE_DEADLINE);
    read_exact_by(s, &mut len[1..], rest_by)?;
    let len = announced(len, seal.is_some(), max)?;
    let mut body = vec![0u8; len];
    read_exact_by(s, &mut body, rest_by)?;
    open(seal, body)
}
