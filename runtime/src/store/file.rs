//! A store in a shared directory.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::Store;
use crate::auth;
use crate::error::{Error, Result};

/// A store in a directory of a shared filesystem: one file per key, written atomically.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// Use (and create) `dir`.
    ///
    /// # Errors
    /// [`Error::Store`] when the directory cannot be created.
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|e| Error::Store {
            addr: dir.display().to_string(),
            detail: format!("cannot create the store directory: {e}"),
        })?;
        Ok(FileStore { dir })
    }

    fn path(&self, key: &str) -> PathBuf {
        // Keys may hold '/', so encode them as hex to get one flat, safe file name.
        let name: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("k{name}"))
    }

    fn err(&self, detail: String) -> Error {
        Error::Store { addr: self.dir.display().to_string(), detail }
    }

    fn write_atomic(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.path(key);
        let tmp = self.dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            auth::random::<8>()
                .map_err(|e| self.err(e))?
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        ));
        std::fs::write(&tmp, value).map_err(|e| self.err(format!("writing {key:?}: {e}")))?;
        std::fs::rename(&tmp, &path).map_err(|e| self.err(format!("renaming {key:?}: {e}")))
    }

    fn with_lock<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        use std::os::fd::AsRawFd;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join(".lock"))
            .map_err(|e| self.err(format!("opening the lock file: {e}")))?;
        // SAFETY: flock on a descriptor we own; released when `lock` is closed.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(self.err(format!("locking: {}", std::io::Error::last_os_error())));
        }
        f()
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.write_atomic(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            match std::fs::read(self.path(key)) {
                Ok(v) => return Ok(v),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(self.err(format!("reading {key:?}: {e}"))),
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
            let cur = match std::fs::read(self.path(key)) {
                Ok(v) => std::str::from_utf8(&v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| self.err(format!("key {key:?} is not an integer")))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
                Err(e) => return Err(self.err(format!("reading {key:?}: {e}"))),
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
