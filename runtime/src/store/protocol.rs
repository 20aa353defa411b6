//! Wire protocol of the TCP store: the server greets each connection with a 16-byte nonce; every
//! message after that is a little-endian `u32` length followed by that many bytes of postcard. The
//! client's first message is a [`StoreHello`] (with an HMAC of the nonce when the job has a
//! token); the server answers it, then serves one request at a time. Lengths are checked against
//! a limit before anything is allocated, so junk on the port costs nothing.

use std::io::{Read, Write};
use std::net::TcpStream;

use serde::{Deserialize, Serialize};

/// Largest store message accepted (values included).
pub const MAX_STORE_MESSAGE: usize = 64 << 20;
/// Largest hello accepted.
pub(super) const MAX_HELLO: usize = 1024;
pub(super) const STORE_MAGIC: [u8; 8] = *b"TUTTISTR";
pub(super) const STORE_VERSION: u16 = 1;

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
    /// HMAC(key, "store" ‖ nonce ‖ rank ‖ world) when the job has a token.
    pub mac: Option<[u8; 32]>,
}

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
}

/// Decode one store message body. Never panics; this is the entry point fuzzing uses.
///
/// # Errors
/// A description of what is malformed.
pub fn decode_request(body: &[u8]) -> Result<Request, String> {
    postcard::from_bytes(body).map_err(|e| format!("malformed store request: {e}"))
}

pub(super) fn write_frame(s: &mut TcpStream, v: &impl Serialize) -> std::io::Result<()> {
    let body = postcard::to_stdvec(v)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    s.write_all(&buf)
}

pub(super) fn read_frame(s: &mut TcpStream, max: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("message of {len} bytes exceeds the limit of {max}"),
        ));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok(body)
}
