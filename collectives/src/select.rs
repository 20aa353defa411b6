//! Algorithm choice: by collective, message size and world size, from a table measured with
//! collbench (`docs/algorithms.md`), overridable per call and with `TUTTI_ALGO`.

use std::collections::HashMap;
use std::fmt;

use crate::coll::Coll;

/// Algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algo {
    /// Segmented pipelined ring.
    Ring,
    /// Recursive doubling.
    RecursiveDoubling,
    /// Rabenseifner: recursive halving reduce-scatter + recursive doubling allgather.
    Rabenseifner,
    /// Recursive halving reduce-scatter.
    RecursiveHalving,
    /// Binomial tree (reduce + broadcast for allreduce).
    Tree,
    /// Pipelined chain.
    Chain,
    /// Bruck.
    Bruck,
    /// Pairwise exchange.
    Pairwise,
    /// Post every send and receive at once.
    PostAll,
    /// Root talks to every rank directly.
    Linear,
    /// Dissemination.
    Dissemination,
    /// Two-level: within each host, then across hosts, then within each host again.
    TwoLevel,
    /// Binomial scatter then ring allgather (broadcast).
    ScatterAllgather,
}

impl Algo {
    /// Every algorithm.
    pub const ALL: [Algo; 13] = [
        Algo::Ring,
        Algo::RecursiveDoubling,
        Algo::Rabenseifner,
        Algo::RecursiveHalving,
        Algo::Tree,
        Algo::Chain,
        Algo::Bruck,
        Algo::Pairwise,
        Algo::PostAll,
        Algo::Linear,
        Algo::Dissemination,
        Algo::TwoLevel,
        Algo::ScatterAllgather,
    ];

    /// Short name (collbench's algorithm column, `TUTTI_ALGO`).
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::RecursiveDoubling => "rd",
            Algo::Rabenseifner => "rabenseifner",
            Algo::RecursiveHalving => "halving",
            Algo::Tree => "tree",
            Algo::Chain => "chain",
            Algo::Bruck => "bruck",
            Algo::Pairwise => "pairwise",
            Algo::PostAll => "postall",
            Algo::Linear => "linear",
            Algo::Dissemination => "dissemination",
            Algo::TwoLevel => "twolevel",
            Algo::ScatterAllgather => "scatter_allgather",
        }
    }

    /// Parse a name or a common alias (`binomial`, `recursive_doubling`, `halving_doubling`,
    /// `hierarchical`, `van_de_geijn`).
    pub fn parse(s: &str) -> Option<Algo> {
        let s = s.trim().to_ascii_lowercase();
        let alias = match s.as_str() {
            "binomial" => "tree",
            "recursive_doubling" | "recursive-doubling" => "rd",
            "halving_doubling" | "halving-doubling" => "rabenseifner",
            "recursive_halving" | "recursive-halving" => "halving",
            "post_all" | "post-all" => "postall",
            "two_level" | "two-level" | "hierarchical" => "twolevel",
            "scatter-allgather" | "scatter+allgather" | "van_de_geijn" | "vandegeijn" => {
                "scatter_allgather"
            }
            other => other,
        };
        Algo::ALL.into_iter().find(|a| a.name() == alias)
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-collective algorithm overrides, e.g. from `TUTTI_ALGO=allreduce:ring,broadcast:chain`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides(pub HashMap<Coll, Algo>);

impl Overrides {
    /// Parse `coll:algo[,coll:algo…]`.
    ///
    /// # Errors
    /// A message naming the unknown collective or algorithm, or an algorithm that does not
    /// implement the collective.
    pub fn parse(s: &str) -> Result<Overrides, String> {
        let mut m = HashMap::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (c, a) = item
                .split_once(':')
                .ok_or_else(|| format!("TUTTI_ALGO item {item:?} is not coll:algo"))?;
            let coll = Coll::parse(c.trim())
                .ok_or_else(|| format!("TUTTI_ALGO: unknown collective {c:?}"))?;
            let algo =
                Algo::parse(a).ok_or_else(|| format!("TUTTI_ALGO: unknown algorithm {a:?}"))?;
            if !coll.algos().contains(&algo) {
                let names: Vec<&str> = coll.algos().iter().map(|a| a.name()).collect();
                return Err(format!(
                    "TUTTI_ALGO: {coll} has no algorithm {algo} (choose from {})",
                    names.join(", ")
                ));
            }
            m.insert(coll, algo);
        }
        Ok(Overrides(m))
    }
}

/// The automatic choice on one host (and over memory). `bytes` is the collective's S as
/// nccl-tests defines it (one rank's buffer for allreduce/broadcast/reduce, the whole gathered
/// or scattered buffer otherwise). Thresholds come from collbench runs on the reference machine
/// (`docs/algorithms.md`); on links measured slower than loopback the communicator chooses from
/// the cost model instead (`model.rs`).
pub fn choose(coll: Coll, bytes: usize, n: usize, uniform: bool) -> Algo {
    const K: usize = 1 << 10;
    match coll {
        Coll::Allreduce => match n {
            1 => Algo::RecursiveDoubling,
            2 if bytes <= 256 * K => Algo::RecursiveDoubling,
            2 => Algo::Ring,
            _ if bytes <= 256 * K => Algo::Tree,
            _ if bytes <= 4096 * K => Algo::Rabenseifner,
            _ => Algo::Ring,
        },
        Coll::Broadcast => {
            if bytes <= 256 * K || n <= 2 {
                Algo::Tree
            } else {
                Algo::Chain
            }
        }
        Coll::Reduce => Algo::Tree,
        Coll::Allgather => {
            // With 2 ranks, one whole-block exchange: at 64 MiB 0.83 of the segmented ring's
            // time (both move the same bytes; the ring's segments only pay off when forwarded).
            if uniform && (n == 2 || n.is_power_of_two() && bytes <= 4096 * K) {
                Algo::RecursiveDoubling
            } else if uniform && bytes <= 64 * K {
                Algo::Bruck
            } else {
                Algo::Ring
            }
        }
        Coll::ReduceScatter => {
            if n.is_power_of_two() && bytes <= 4096 * K {
                Algo::RecursiveHalving
            } else {
                Algo::Ring
            }
        }
        Coll::AllToAll => {
            // Bruck's log2(n) messages for tiny equal blocks from 4 ranks on: with 4 ranks
            // 0.67-0.77 of post-all's time at 8 B and 1 KiB blocks (even at 16 KiB), with 8
            // ranks 0.6; with 3 it is slower (two rounds one after the other for 2 messages).
            if uniform && n >= 4 && bytes / n <= 4 * K {
                Algo::Bruck
            } else if bytes / n.max(1) <= 32 * K {
                Algo::PostAll
            } else {
                Algo::Pairwise
            }
        }
        Coll::Gather | Coll::Scatter => Algo::Linear,
        Coll::Barrier => Algo::Dissemination,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_overrides() {
        let o = Overrides::parse("allreduce:ring, broadcast:binomial").unwrap();
        assert_eq!(o.0[&Coll::Allreduce], Algo::Ring);
        assert_eq!(o.0[&Coll::Broadcast], Algo::Tree);
        assert!(Overrides::parse("allreduce:bruck").unwrap_err().contains("no algorithm bruck"));
        assert!(Overrides::parse("nope:ring").unwrap_err().contains("unknown collective"));
        assert!(Overrides::parse("allreduce").is_err());
        assert_eq!(Overrides::parse("").unwrap(), Overrides::default());
    }

    #[test]
    fn every_choice_is_valid() {
        for c in Coll::ALL {
            for n in [1, 2, 3, 4, 7, 8, 16] {
                for b in [0, 8, 1 << 12, 1 << 20, 1 << 28] {
                    let a = choose(c, b, n, true);
                    assert!(c.algos().contains(&a), "{c} {a}");
                    let a = choose(c, b, n, false);
                    assert!(c.algos().contains(&a), "{c} {a}");
                }
            }
        }
    }
}
