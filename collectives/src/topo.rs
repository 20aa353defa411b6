//! Which ranks share a host, and the ring order that follows hosts.
//!
//! A communicator learns its topology at its first collective (with the link measurement, see
//! `Comm::link_scale`): every rank contributes the address it advertises to its peers, and ranks
//! with the same address share a host. Hosts are numbered in the order their lowest rank
//! appears. The ring algorithms then walk the ranks host by host — every rank of host 0 in rank
//! order, then host 1's, and so on — so each host's link carries one ring edge per direction
//! whatever the launcher's placement; when ranks are already placed host by host (as `tutti-run`
//! and torchrun number them) that order is the identity.

/// Host membership of a group's ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Host number of each rank (hosts numbered by their lowest rank).
    host: Vec<usize>,
}

impl Topology {
    /// Every one of `n` ranks on one host.
    pub fn flat(n: usize) -> Topology {
        Topology { host: vec![0; n] }
    }

    /// From one key per rank (equal keys: same host).
    pub fn from_keys<K: PartialEq>(keys: &[K]) -> Topology {
        let mut firsts: Vec<&K> = Vec::new();
        let host = keys
            .iter()
            .map(|k| match firsts.iter().position(|f| *f == k) {
                Some(h) => h,
                None => {
                    firsts.push(k);
                    firsts.len() - 1
                }
            })
            .collect();
        Topology { host }
    }

    /// From the host number of each rank (numbers need not be dense or ordered).
    pub fn from_hosts(hosts: &[usize]) -> Topology {
        Topology::from_keys(hosts)
    }

    /// Ranks.
    pub fn size(&self) -> usize {
        self.host.len()
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.host.iter().max().map_or(0, |m| m + 1)
    }

    /// The host of rank `r`.
    pub fn host_of(&self, r: usize) -> usize {
        self.host[r]
    }

    /// The ranks on host `h`, ascending.
    pub fn members(&self, h: usize) -> Vec<usize> {
        (0..self.host.len()).filter(|r| self.host[*r] == h).collect()
    }

    /// Ranks per host when every host has the same number.
    pub fn per_host(&self) -> Option<usize> {
        let h = self.hosts();
        if h == 0 {
            return None;
        }
        let l = self.host.len() / h;
        (0..h).all(|i| self.host.iter().filter(|x| **x == i).count() == l).then_some(l)
    }

    /// `(hosts, ranks per host)` when two-level schedules apply: at least 2 hosts with the same
    /// number, at least 2, of ranks on each.
    pub fn two_level(&self) -> Option<(usize, usize)> {
        let (h, l) = (self.hosts(), self.per_host()?);
        (h >= 2 && l >= 2).then_some((h, l))
    }

    /// The ring order: position → rank, host by host, ranks ascending within a host.
    pub fn ring(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.host.len()).collect();
        order.sort_by_key(|r| (self.host[*r], *r));
        order
    }

    /// True when the ring order is the rank order (ranks placed host by host).
    pub fn ring_is_identity(&self) -> bool {
        self.host.windows(2).all(|w| w[0] <= w[1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_by_first_rank_and_ring_by_host() {
        // Round-robin placement of 6 ranks on 3 hosts (as `srun --distribution=cyclic` does).
        let t = Topology::from_keys(&["b", "c", "a", "b", "c", "a"]);
        assert_eq!(t.hosts(), 3);
        assert_eq!((0..6).map(|r| t.host_of(r)).collect::<Vec<_>>(), [0, 1, 2, 0, 1, 2]);
        assert_eq!(t.members(1), [1, 4]);
        assert_eq!(t.per_host(), Some(2));
        assert_eq!(t.ring(), [0, 3, 1, 4, 2, 5]);
        assert_eq!(t.two_level(), Some((3, 2)));
        assert!(!t.ring_is_identity());
        // Block placement: the identity.
        let b = Topology::from_hosts(&[7, 7, 3, 3]);
        assert_eq!(b.ring(), [0, 1, 2, 3]);
        assert!(b.ring_is_identity());
        // Uneven hosts.
        let u = Topology::from_hosts(&[0, 0, 0, 1]);
        assert_eq!(u.per_host(), None);
        assert_eq!(u.two_level(), None);
        assert_eq!(Topology::from_hosts(&[0, 1, 2]).two_level(), None);
        assert_eq!(Topology::flat(3).hosts(), 1);
        assert_eq!(Topology::flat(3).per_host(), Some(3));
    }
}
