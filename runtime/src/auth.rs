//! Per-job secrets: the token every rank proves it knows, and HMAC-SHA256 helpers.
//!
//! Where the token comes from is `rendezvous::secret`'s business (`TUTTI_TOKEN`, a token file,
//! a private file on a single host, or — explicitly insecure — the store). It never travels on
//! rank-to-rank or store connections: both prove knowledge of the key derived from it
//! ([`JobKey::from_token`], PBKDF2) by challenge-response, and tag what they send with it.

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

/// PBKDF2-HMAC-SHA256 rounds that stretch a job secret into its key: each guess at a secret
/// costs an attacker this many HMACs (about 25 ms of one core).
pub const KDF_ROUNDS: u32 = 100_000;
const KDF_SALT: &[u8] = b"tutti-job-key-v2";

/// PBKDF2-HMAC-SHA256 (RFC 8018) with one 32-byte output block.
fn pbkdf2_sha256(password: &[u8], salt: &[u8], rounds: u32) -> [u8; 32] {
    let keyed = <Hmac<Sha256> as Mac>::new_from_slice(password)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    let mut m = keyed.clone();
    m.update(salt);
    m.update(&1u32.to_be_bytes());
    let mut u: [u8; 32] = m.finalize().into_bytes().into();
    let mut t = u;
    for _ in 1..rounds {
        let mut m = keyed.clone();
        m.update(&u);
        u = m.finalize().into_bytes().into();
        for (a, b) in t.iter_mut().zip(u) {
            *a ^= b;
        }
    }
    t
}

/// Keys derived in this process, by a digest of their secret: ranks of one job in one process
/// (tests, benchmarks) pay the stretch once.
static DERIVED: std::sync::Mutex<Vec<([u8; 32], JobKey)>> = std::sync::Mutex::new(Vec::new());

/// Environment variable in which a launcher hands its ranks the key it derived from the job
/// secret it also hands them (`TUTTI_TOKEN`), so each rank does not stretch the secret again:
/// [`JobKey::handoff`]'s value, the secret's SHA-256 and the key, in hex. A value for another
/// secret (a stale variable) is ignored. It is as sensitive as the secret itself, and travels
/// the same way (the rank's environment, readable only by its user).
pub const KEY_ENV: &str = "TUTTI_JOB_KEY";

impl JobKey {
    /// Derive the key from a job secret: PBKDF2-HMAC-SHA256 over [`KDF_ROUNDS`] rounds with a
    /// fixed salt (the secret is unique per job; the salt separates tutti's keys from other
    /// uses of the same string). Remembered for the process's later calls with the same secret;
    /// taken from [`KEY_ENV`] when the launcher derived it for this secret already.
    pub fn from_token(token: &str) -> JobKey {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut cache = DERIVED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, k)) = cache.iter().find(|(d, _)| *d == digest) {
            return k.clone();
        }
        let handed = std::env::var(KEY_ENV).ok().and_then(|v| Self::from_handoff(&digest, &v));
        let key =
            handed.unwrap_or_else(|| JobKey(pbkdf2_sha256(token.as_bytes(), KDF_SALT, KDF_ROUNDS)));
        if cache.len() >= 64 {
            cache.remove(0);
        }
        cache.push((digest, key.clone()));
        key
    }

    /// The value of [`KEY_ENV`] that hands this secret's key to a launcher's ranks.
    pub fn handoff(token: &str) -> String {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let key = Self::from_token(token);
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        format!("{}:{}", hex(&digest), hex(&key.0))
    }

    /// The key a [`KEY_ENV`] value carries, if it was made for the secret whose SHA-256 is
    /// `digest` (and is well formed).
    fn from_handoff(digest: &[u8; 32], value: &str) -> Option<JobKey> {
        let (d, k) = value.trim().split_once(':')?;
        let unhex = |s: &str| -> Option<[u8; 32]> {
            if s.len() != 64 {
                return None;
            }
            let mut out = [0u8; 32];
            for (i, o) in out.iter_mut().enumerate() {
                *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
            }
            Some(out)
        };
        (ct_eq(&unhex(d)?, digest)).then_some(())?;
        Some(JobKey(unhex(k)?))
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
        ct_eq(&self.mac(parts), tag)
    }
}

/// Whether two byte strings are equal, in time that depends only on their lengths.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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
        // Two bytes wrong in the same bit: their differences must not cancel out.
        let mut t = m;
        t[0] ^= 1;
        t[1] ^= 1;
        assert!(!a.verify(&[b"x", b"y"], &t));
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// A key of at most 32 bytes, zero-padded: HMAC pads every key shorter than SHA-256's
    /// 64-byte block with zeros, so the padded key gives the same MACs as the RFC's key.
    fn padded(key: &[u8]) -> JobKey {
        let mut k = [0u8; 32];
        k[..key.len()].copy_from_slice(key);
        JobKey(k)
    }

    #[test]
    fn hmac_sha256_rfc4231_vectors() {
        // RFC 4231 section 4, test cases 1-4 (the ones whose keys fit in 32 bytes).
        let cases: [(Vec<u8>, Vec<u8>, &str); 4] = [
            (
                vec![0x0b; 20],
                b"Hi There".to_vec(),
                "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
            ),
            (
                b"Jefe".to_vec(),
                b"what do ya want for nothing?".to_vec(),
                "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
            ),
            (
                vec![0xaa; 20],
                vec![0xdd; 50],
                "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
            ),
            (
                (1..=25).collect(),
                vec![0xcd; 50],
                "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
            ),
        ];
        for (i, (key, data, want)) in cases.iter().enumerate() {
            let k = padded(key);
            assert_eq!(k.mac(&[data]).to_vec(), hex(want), "RFC 4231 case {}", i + 1);
            let (a, b) = data.split_at(data.len() / 3);
            assert!(k.verify(&[a, b], &hex(want)), "case {}: parts concatenate", i + 1);
        }
    }

    #[test]
    fn debug_never_shows_the_key() {
        let k = JobKey::from_token("secret");
        assert_eq!(format!("{k:?}"), "JobKey(…)");
    }

    #[test]
    fn random_tokens_are_fresh_hex() {
        let (a, b) = (random_token().unwrap(), random_token().unwrap());
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, b);
        assert_ne!(random::<16>().unwrap(), [0u8; 16]);
    }

    #[test]
    fn key_derivation_known_answer() {
        // Computed outside the crate with Python's hashlib and hmac:
        //   k = hashlib.pbkdf2_hmac("sha256", b"tutti", b"tutti-job-key-v2", 100000)
        //   hmac.new(k, b"abc", sha256).hexdigest()
        let k = JobKey::from_token("tutti");
        assert_eq!(
            k.0.to_vec(),
            hex("144dde8b9c5ba92584eeaf8946e5b6e19105d52ae5a1a9fa383a24deb0f924fc")
        );
        assert_eq!(
            k.mac(&[b"a", b"bc"]).to_vec(),
            hex("46a7ee44bc52df4dd5cb5d6acc70b0cfbe1ba47b086bf1b8851335342e76ebf7")
        );
        // RFC 7914 section 11's PBKDF2-HMAC-SHA256 vector (P "passwd", S "salt", c 1), first
        // 32 bytes.
        assert_eq!(
            pbkdf2_sha256(b"passwd", b"salt", 1).to_vec(),
            hex("55ac046e56e3089fec1691c22544b605f94185216dde0465e68b9d57c20dacbc")
        );
    }

    /// A launcher's hand-off gives its ranks the key it derived, only for the secret it was
    /// made for: another secret's digest, or a malformed value, is ignored.
    #[test]
    fn a_handoff_carries_the_key_for_its_own_secret_only() {
        let token = "handoff-test-secret-0123456789";
        let value = JobKey::handoff(token);
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let key = JobKey::from_handoff(&digest, &value).expect("its own secret");
        assert_eq!(key.0, pbkdf2_sha256(token.as_bytes(), KDF_SALT, KDF_ROUNDS));
        let other: [u8; 32] = Sha256::digest(b"another secret").into();
        assert!(JobKey::from_handoff(&other, &value).is_none());
        for bad in ["", ":", "zz:zz", &value[..100], &value.replace(':', ";")] {
            assert!(JobKey::from_handoff(&digest, bad).is_none(), "{bad:?}");
        }
    }
}
