//! A world's membership: what a group needs to rebuild itself over the survivors of a failure
//! or to take newcomers in (the store that outlives the ranks, the job's secret and id, the
//! members' stable ids, how to connect). Data only: [`crate::connect`] connects a membership,
//! [`crate::elastic`] decides the next one, [`crate::group::Group`] keeps the one it was made
//! from.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::options::Options;
use crate::store::{PrefixStore, Store};

/// What a group needs to rebuild itself over the survivors of a failure: the store that
/// outlives the ranks, the job's secret and id, its membership, and how to connect.
#[derive(Clone)]
pub(crate) struct Membership {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) token: String,
    pub(crate) job: u64,
    pub(crate) epoch: u64,
    /// Stable ids of the members, in rank order.
    pub(crate) ids: Vec<u64>,
    pub(crate) opts: Options,
    pub(crate) master_ip: Option<IpAddr>,
    pub(crate) launcher_fd: Option<i32>,
    /// This process joined the job at this epoch (a replacement), rather than starting it or
    /// staying on from the epoch before.
    pub(crate) joined: bool,
    /// `grow` calls made at this epoch (every member makes the same ones).
    pub(crate) grows: Arc<std::sync::atomic::AtomicU64>,
    /// When this membership's group was connected: a launcher notice after this about one of
    /// its members means that member is gone (a notice before it concerned an earlier process
    /// of the same launch rank).
    pub(crate) formed: Instant,
}

impl Membership {
    /// The store under the keys of one epoch's connections.
    pub(crate) fn epoch_store(&self, epoch: u64) -> Arc<dyn Store> {
        if epoch == 0 {
            return self.store.clone();
        }
        Arc::new(PrefixStore::new(self.store.clone(), format!("tutti/epoch/{epoch}/")))
    }

    /// The job id the transports of `epoch` authenticate with: connections of different
    /// epochs refuse each other.
    pub(crate) fn epoch_job(&self, epoch: u64) -> u64 {
        self.job ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}
