//! tutti-collectives: collectives built on point-to-point send and receive.
//!
//! Broadcast, reduce, allreduce, allgather(v), reduce-scatter(v), all-to-all(v), gather, scatter
//! and barrier, each with the algorithms the best runtimes use (segmented pipelined ring,
//! recursive doubling, Rabenseifner, binomial tree, pipelined chain, Bruck, pairwise exchange,
//! dissemination), chosen by size and world size. Algorithms are pure schedules ([`plan`]) run by
//! one executor over `tutti_runtime::Transport`; they never see a socket.
//!
//! ```
//! use tutti_collectives::{Comm, ReduceOp};
//!
//! let comms = Comm::mem_world(4);
//! std::thread::scope(|s| {
//!     for c in comms {
//!         s.spawn(move || {
//!             let mut x = vec![c.rank() as f32 + 1.0; 1000];
//!             c.allreduce(&mut x, ReduceOp::Sum).unwrap();
//!             assert!(x.iter().all(|v| *v == 10.0));
//!         });
//!     }
//! });
//! ```

pub mod algo;
mod call_lock;
pub(crate) mod coll;
mod comm;
mod config;
pub mod device;
mod direct;
pub mod dtype;
mod error;
mod exec;
pub mod kernel;
mod measure;
pub mod model;
mod nonblocking;
pub mod plan;
pub mod select;
mod shared;
pub mod tensor;
pub mod topo;
mod tune;
pub mod verify;

pub use coll::Coll;
pub use comm::{Comm, Stats};
pub use config::{parse_size, Config, DEFAULT_CHUNK, DEFAULT_SEGMENT};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{Error, Result};
pub use nonblocking::{Lent, Pending, Scope};
pub use select::Algo;
pub use shared::SharedBuffer;
pub use topo::Topology;
pub use tutti_runtime::{Error as RuntimeError, Group, Transport};

/// The README's example compiles (doc-test only).
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
