//! Per-job secrets: the token every rank proves it knows, and HMAC-SHA256 helpers.
//!
//! The token comes from `TUTTI_TOKEN` (set by `tutti-run` or the user), or, when that is unset,
//! rank 0 generates one and publishes it through the store (then the store is the trust anchor;
//! see `docs/security.md`). The token never travels on rank-to-rank connections: ranks prove
//! knowledge of it by challenge-response.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// A job's shared secret, reduced to a 32-byte HMAC key.
#[derive(Clone)]
pub struct JobKey([u8; 32]);

impl std::fmt::Debug for JobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobKey(…)")
    }
}

impl JobKey {
    /// Derive the key from a token string.
    pub fn from_token(token: &str) -> JobKey {
        let mut h = Sha256::new();
        h.update(b"tutti-job-key-v1\0");
        h.update(token.as_bytes());
        JobKey(h.finalize().into())
    }

    /// HMAC-SHA256 of the concatenated parts under this key.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        // Any key length is valid for HMAC, so construction cannot fail.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// Constant-time check of a MAC over the concatenated parts.
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let expected = self.mac(parts);
        tag.len() == 32 && expected.iter().zip(tag).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

/// Fresh random bytes from the OS.
///
/// # Errors
/// Fails only when the OS has no entropy source; the message says so.
pub fn random<const N: usize>() -> Result<[u8; N], String> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b).map_err(|e| format!("no OS randomness: {e}"))?;
    Ok(b)
}

/// A random token as 32 hex digits.
///
/// # Errors
/// As [`random`].
pub fn random_token() -> Result<String, String> {
    Ok(random::<16>()?.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_depends_on_token_and_parts() {
        let a = JobKey::from_token("a");
        let b = JobKey::from_token("b");
        let m = a.mac(&[b"x", b"y"]);
        assert!(a.verify(&[b"xy"], &m), "concatenation is what is authenticated");
        assert!(!b.verify(&[b"x", b"y"], &m));
        assert!(!a.verify(&[b"x", b"z"], &m));
        assert!(!a.verify(&[b"x", b"y"], &m[..31]));
    }

    #[test]
    fn hmac_sha256_known_answer() {
        // RFC 4231 test case 2 uses key "Jefe"; our key is derived, so check the derivation is
        // stable instead: a fixed token must always give the same MAC.
        let k = JobKey::from_token("tutti");
        assert_eq!(k.mac(&[b"abc"]), JobKey::from_token("tutti").mac(&[b"a", b"bc"]));
        assert_ne!(k.mac(&[b"abc"]), [0u8; 32]);
    }
}
