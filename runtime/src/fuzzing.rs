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

/// Drive the two ends of a shared-memory ring with operations read from the bytes, as a broken
/// peer could: writes and reads of any size, and garbage written over the ring's positions. A
/// read never goes outside the ring, and never returns more than it holds.
pub fn shm_ring(data: &[u8]) {
    use crate::transport::tcp::shm::{local_pair, scribble, RING_MIN};
    const RING_BYTES: usize = RING_MIN;
    let Ok((mut a, mut b)) = local_pair(RING_BYTES) else { return };
    let mut buf = vec![0u8; RING_BYTES];
    for op in data.chunks(9) {
        let mut v = [0u8; 8];
        v[..op.len() - 1].copy_from_slice(&op[1..]);
        let v = u64::from_le_bytes(v);
        match op[0] % 4 {
            0 => {
                if let Ok(room) = a.room() {
                    let n = (v as usize % (RING_BYTES + 1)).min(room);
                    // SAFETY: `n <= RING_BYTES` readable bytes of `buf`, within the room.
                    unsafe { a.put(buf.as_ptr(), n) };
                    a.publish();
                }
            }
            1 => {
                if let Ok(n) = b.avail() {
                    assert!(n <= RING_BYTES, "avail {n} beyond the ring");
                    let n = n.min(v as usize % (RING_BYTES + 1));
                    // SAFETY: `n <= RING_BYTES` writable bytes, published.
                    unsafe { b.take(buf.as_mut_ptr(), n) };
                    b.release();
                }
            }
            2 => scribble(&b, v & 1 == 0, v >> 1),
            _ => {
                let _ = b.arm_rx();
                let _ = a.arm_tx();
                let _ = b.peek(&mut buf[..64]);
            }
        }
    }
}
