//! Entry points for fuzzing the decoders that read network input (`runtime/fuzz`). Each takes
//! arbitrary bytes and must never panic, whatever they are.

use crate::wire::{Header, HEADER_LEN};

/// Decode a wire header from the first 48 bytes; a decoded header must re-encode to the same
/// bytes.
pub fn wire_header(data: &[u8]) {
    if data.len() < HEADER_LEN {
        return;
    }
    let mut b = [0u8; HEADER_LEN];
    b.copy_from_slice(&data[..HEADER_LEN]);
    if let Ok(h) = Header::decode(&b) {
        assert_eq!(h.encode(), b, "header round trip");
    }
}

/// Parse a connection handshake hello.
pub fn handshake(data: &[u8]) {
    if let Ok(h) = crate::transport::tcp::handshake::Hello::decode(data) {
        let again = crate::transport::tcp::handshake::Hello::decode(&h.encode());
        assert_eq!(again, Ok(h), "hello round trip");
    }
}

/// Decode a store message body (what follows the length prefix) as each thing a peer may send:
/// a request (to the server), a hello (to the server, before authentication) and an answer (to
/// a client, possibly from a fake store).
pub fn store_request(data: &[u8]) {
    let _ = crate::store::decode_request(data);
    let _ = postcard::from_bytes::<crate::store::StoreHello>(data);
    let _ = postcard::from_bytes::<crate::store::Response>(data);
}

/// Feed a byte stream to one connection core (frames, matching, parking, the budget, timers on
/// a fake clock); see the core's `fuzz_stream`.
pub fn connection(data: &[u8]) {
    crate::transport::core::fuzz_stream(data);
}
