//! What the tests of worlds rebuilt over real connections share: options for loopback with a
//! 10 s timeout, and a fresh file store.

use std::sync::Arc;
use std::time::Duration;

use tutti_runtime::rendezvous::TransportKind;
use tutti_runtime::store::{FileStore, Store};
use tutti_runtime::Options;

/// Options for transport `kind` on loopback, with a 10 s per-operation timeout.
pub(crate) fn options(kind: TransportKind) -> Options {
    let mut o = Options::from_lookup(|_| None).unwrap();
    o.transport = kind;
    o.timeout = Duration::from_secs(10);
    o.link.bind_ip = "127.0.0.1".parse().unwrap();
    o
}

/// An empty file store in the temporary directory, named by `name` and this process.
pub(crate) fn store(name: &str) -> Arc<dyn Store> {
    let d = std::env::temp_dir().join(format!("tutti-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    Arc::new(FileStore::new(&d).unwrap())
}
