//! A communicator's settings ([`Config`]): the `TUTTI_*` variables of the collectives layer.

use crate::error::{Error, Result};
use crate::select::Overrides;

/// Default pipeline segment size in bytes (`TUTTI_SEGMENT_BYTES`).
pub const DEFAULT_SEGMENT: usize = 512 << 10;

/// Default allreduce chunk in bytes (`TUTTI_CHUNK_BYTES`): see [`Config::chunk`].
pub const DEFAULT_CHUNK: usize = 4 << 20;

/// Settings of a communicator.
#[derive(Debug, Clone)]
pub struct Config {
    /// Pipeline segment size in bytes. Default 512 KiB ([`DEFAULT_SEGMENT`]). Hazard: below
    /// 128 KiB large messages lose bandwidth to per-segment overhead; above a few MiB the
    /// pipeline has too few segments to overlap.
    pub segment: usize,
    /// Allreduces larger than this many bytes (and than two segments per rank) run as
    /// back-to-back allreduces of pieces this large, each a whole reduce-scatter and
    /// all-gather, on links as fast as loopback: a rank's block is then still in the
    /// processor's cache when the all-gather sends it, instead of read back from memory.
    /// Default 4 MiB ([`DEFAULT_CHUNK`]); 0 turns it off. Hazard: each piece pays the ring's
    /// `2(n-1)` latency steps again, which on slow links (where the cost model chooses, and
    /// pieces are never made) would cost more than the cache saves.
    pub chunk: usize,
    /// Per-collective algorithm overrides (`TUTTI_ALGO`). Default none: automatic choice.
    pub overrides: Overrides,
    /// Choose algorithms by timing them on the first calls of each size class (`TUTTI_TUNE=1`;
    /// see `tune.rs`). Default off: the built-in table. Hazard: the first few calls of each class
    /// run slower algorithms on purpose, and one small allreduce is added when a class is decided.
    pub tune: bool,
    /// Let the automatic choice read the peers' memory directly (`Algo::Direct`) where every
    /// rank of a group can map every other's (`TUTTI_DIRECT`, default on; `0` keeps every call
    /// on messages). Every rank must have the same setting. A forced `direct` runs either way.
    pub direct: bool,
    /// Let direct reads copy a peer's data straight out of its own buffers, one copy through
    /// the kernel (cross-memory attach), where the kernel allows it between every pair of the
    /// group's ranks (`TUTTI_SINGLE_COPY`, default on; `0` copies through the windows). Any
    /// rank's `0` turns it off for its whole group, at the group's first direct call.
    pub single_copy: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            segment: DEFAULT_SEGMENT,
            chunk: DEFAULT_CHUNK,
            overrides: Overrides::default(),
            tune: false,
            direct: true,
            single_copy: true,
        }
    }
}

impl Config {
    /// Defaults plus `TUTTI_ALGO`, `TUTTI_TUNE`, `TUTTI_DIRECT`, `TUTTI_SINGLE_COPY`,
    /// `TUTTI_SEGMENT_BYTES` and `TUTTI_CHUNK_BYTES`
    /// from the environment; an empty variable counts as unset (as the runtime's settings do).
    ///
    /// # Errors
    /// A configuration error ([`Error::Runtime`] holding `tutti_runtime::Error::Config`)
    /// naming the malformed variable.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        let bad = |detail: String| Error::Runtime(tutti_runtime::Error::Config(detail));
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        if let Some(v) = var("TUTTI_ALGO") {
            c.overrides = Overrides::parse(&v).map_err(bad)?;
        }
        // The switches: 1 or 0.
        for (k, slot) in [
            ("TUTTI_TUNE", &mut c.tune),
            ("TUTTI_DIRECT", &mut c.direct),
            ("TUTTI_SINGLE_COPY", &mut c.single_copy),
        ] {
            if let Some(v) = var(k) {
                *slot = match v.trim() {
                    "1" => true,
                    "0" => false,
                    _ => return Err(bad(format!("{k}={v:?}: expected 1 or 0"))),
                };
            }
        }
        if let Some(v) = var("TUTTI_SEGMENT_BYTES") {
            c.segment = v.trim().parse::<usize>().ok().filter(|s| *s > 0).ok_or_else(|| {
                bad(format!("TUTTI_SEGMENT_BYTES={v:?} is not a positive integer"))
            })?;
        }
        if let Some(v) = var("TUTTI_CHUNK_BYTES") {
            c.chunk = v.trim().parse::<usize>().map_err(|_| {
                bad(format!("TUTTI_CHUNK_BYTES={v:?} is not an integer (0 turns chunks off)"))
            })?;
        }
        Ok(c)
    }
}

/// Parse a size in bytes: `8`, `1K`, `32M`, `1G` (binary multiples, as nccl-tests write them).
///
/// # Errors
/// A message for anything else.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("{s:?} is not a size (like 8, 64K, 32M, 1G)"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_take_binary_suffixes_and_refuse_the_rest() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size(" 64k "), Ok(64 << 10));
        assert_eq!(parse_size("32M"), Ok(32 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        for bad in ["", "M", "1X", "1.5M", "-1", "99999999999999999999G"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }
}
