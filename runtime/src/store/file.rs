//! A store in a shared directory.

use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

/// A store in a directory of a shared filesystem: one file per key, written atomically.
///
/// The directory is created with mode 0700 (or, when it exists, must be a directory of this
/// user's that nobody else can enter), and every file is 0600. Rendezvous wraps it in a
/// [`SignedStore`](super::SignedStore) when the job has a secret, so a file changed or planted
/// by someone who can write there is refused, naming the key.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// Use (and create) `dir`.
    ///
    /// # Errors
    /// [`Error::Config`] when the directory cannot be created, is not this user's, or others
    /// can enter it.
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let dir = dir.into();
        crate::rendezvous::secret::private_dir(&dir)?;
        Ok(FileStore { dir })
    }

    /// A guard that, when dropped by each of the `world` ranks, counts them out; the last one
    /// out removes the directory (a job that ends cleanly leaves nothing behind).
    pub fn leaver(&self, world: usize) -> FileStoreLeaver {
        FileStoreLeaver { store: self.clone(), world }
    }

    fn path(&self, key: &str) -> PathBuf {
        // Keys may hold '/', so encode them as hex to get one flat, safe file name.
        let name: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("k{name}"))
    }

    fn err(&self, detail: String) -> Error {
        Error::Store { addr: self.dir.display().to_string(), detail }
    }

    fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match std::fs::read(self.path(key)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.err(format!("reading {key:?}: {e}"))),
        }
    }

    fn write_atomic(&self, key: &str, value: &[u8]) -> Result<()> {
        crate::rendezvous::secret::write_private(&self.path(key), value)
            .map_err(|e| self.err(format!("writing {key:?}: {e}")))
    }

    fn with_lock<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        use std::os::fd::AsRawFd;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(self.dir.join(".lock"))
            .map_err(|e| self.err(format!("opening the lock file: {e}")))?;
        // SAFETY: flock on a descriptor we own; released when `lock` is closed.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(self.err(format!("locking: {}", std::io::Error::last_os_error())));
        }
        f()
    }
}

/// See [`FileStore::leaver`].
#[derive(Debug)]
pub struct FileStoreLeaver {
    store: FileStore,
    world: usize,
}

impl Drop for FileStoreLeaver {
    fn drop(&mut self) {
        if let Ok(n) = self.store.add("tutti/left", 1) {
            if n >= self.world as i64 {
                let _ = std::fs::remove_dir_all(&self.store.dir);
            }
        }
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.write_atomic(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.read(key)? {
                return Ok(v);
            }
            if Instant::now() >= deadline {
                return Err(Error::StoreTimeout {
                    addr: self.describe(),
                    key: key.into(),
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.with_lock(|| {
            let cur = match self.read(key)? {
                Some(v) => std::str::from_utf8(&v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| self.err(format!("key {key:?} is not an integer")))?,
                None => 0,
            };
            let new = cur.wrapping_add(delta);
            self.write_atomic(key, new.to_string().as_bytes())?;
            Ok(new)
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        match std::fs::remove_file(self.path(key)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.err(format!("deleting {key:?}: {e}"))),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        Ok(keys.iter().all(|k| self.path(k).exists()))
    }

    fn describe(&self) -> String {
        format!("file://{}", self.dir.display())
    }
}
