//! tutti-runtime: the transport layer of tutti.
//!
//! Point-to-point send and receive between the ranks of a job — over memory (ranks as threads) or
//! TCP (ranks as processes) — plus rendezvous from torchrun-style environment variables, a TCP
//! key-value store, groups and sub-groups, and typed errors that name who and what. Nothing here
//! knows what a collective is; `tutti-collectives` builds them on [`Transport`].
//!
//! ```
//! use tutti_runtime::Group;
//!
//! let groups = Group::mem_world(2);
//! std::thread::scope(|s| {
//!     for g in groups {
//!         s.spawn(move || {
//!             if g.rank() == 0 {
//!                 g.send(1, 7, b"hello").unwrap();
//!             } else {
//!                 let mut buf = [0u8; 5];
//!                 assert_eq!(g.recv(0, 7, &mut buf).unwrap(), 5);
//!                 assert_eq!(&buf, b"hello");
//!             }
//!         });
//!     }
//! });
//! ```

pub mod auth;
pub mod clock;
mod connect;
pub mod elastic;
pub mod error;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod group;
mod membership;
mod memfd;
mod options;
pub mod rendezvous;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod transport;
mod util;
pub mod window;
pub mod wire;

pub use error::{Error, OpContext, Result};
pub use group::Group;
pub use options::{host_cpus, HOST_CPUS_ENV};
pub use rendezvous::{init, init_from_env, init_on_store, launched, EnvInfo, Options, Secret};
pub use transport::{Op, OpId, Transport, TransportExt};
pub use wire::{DType, Fingerprint, MsgDesc, OpKind, Tag};
