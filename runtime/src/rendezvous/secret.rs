//! Where a job's secret comes from, and the private places it is kept.
//!
//! In order: `TUTTI_TOKEN` or `TUTTI_TOKEN_FILE` (what `tutti-run` and multi-host jobs use); else,
//! when the store is on this host (a loopback `MASTER_ADDR`, or a file store), rank 0 makes one
//! and leaves it in a file only this user can read — `$XDG_RUNTIME_DIR/tutti` or
//! `/tmp/tutti-<uid>`, directory 0700 and file 0600, both checked to be ours — so a single-host
//! job needs no set-up and other users on the host still cannot join it; else the job refuses
//! to start unless `TUTTI_INSECURE=1` says to hand the secret out through the unauthenticated
//! store.

use std::fs::{DirBuilder, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::auth;
use crate::error::{Error, Result};

/// Shortest secret accepted from the user: 16 characters (a random hex token of 16 characters
/// carries 64 bits; `tutti-run` and rank 0 make 32 hex characters, 128 bits). The key is
/// stretched from it (`JobKey::from_token`), so each offline guess costs a stretch.
pub const MIN_TOKEN_LEN: usize = 16;

/// Check a secret given by the user (`what` names where it came from).
///
/// # Errors
/// [`Error::Config`] when it is shorter than [`MIN_TOKEN_LEN`] or has surrounding whitespace.
pub fn check_token(token: &str, what: &str) -> Result<()> {
    if token.trim() != token {
        return Err(Error::Config(format!("{what} has leading or trailing whitespace")));
    }
    if token.chars().count() < MIN_TOKEN_LEN {
        return Err(Error::Config(format!(
            "{what} has {} characters; a job secret needs at least {MIN_TOKEN_LEN} random ones \
             (e.g. `openssl rand -hex 16`)",
            token.chars().count()
        )));
    }
    Ok(())
}

/// Read a secret from a file that only its owner, this user, can read (`TUTTI_TOKEN_FILE`,
/// `tutti-run --token-file`). One trailing newline is dropped.
///
/// # Errors
/// [`Error::Config`] when the file is missing, not ours, readable by others, or its secret is
/// too short.
pub fn read_token_file(path: &Path) -> Result<String> {
    let bad = |d: String| Error::Config(format!("token file {}: {d}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    if meta.uid() != uid {
        return Err(bad(format!("owned by uid {}, not by this user ({uid})", meta.uid())));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(bad(format!(
            "mode {:04o} lets other users read it: chmod 600 {}",
            meta.mode() & 0o7777,
            path.display()
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let token = text.strip_suffix('\n').unwrap_or(&text).to_string();
    check_token(&token, &format!("the token in {}", path.display()))?;
    Ok(token)
}

/// Create `dir` (mode 0700) or check an existing one: a directory (not a link), owned by this
/// user, that nobody else can write to or list.
///
/// # Errors
/// [`Error::Config`] naming the directory and what is wrong with it.
pub fn private_dir(dir: &Path) -> Result<()> {
    let bad = |d: String| Error::Config(format!("directory {}: {d}", dir.display()));
    match DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) => return Err(bad(format!("cannot create it: {e}"))),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| bad(e.to_string()))?;
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    if !meta.file_type().is_dir() {
        return Err(bad("is not a directory (a symbolic link?)".into()));
    }
    if meta.uid() != uid {
        return Err(bad(format!(
            "owned by uid {}, not by this user ({uid}); another user may control it",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(bad(format!(
            "mode {:04o} lets other users in: chmod 700 {} (or use a fresh directory)",
            meta.mode() & 0o7777,
            dir.display()
        )));
    }
    Ok(())
}

/// Write `data` to `path` atomically (a fresh temporary file in the same directory, renamed),
/// readable by this user only.
///
/// # Errors
/// The file system's error.
pub(crate) fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let rnd: String = auth::random::<8>()
        .map_err(std::io::Error::other)?
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".tmp-{}-{rnd}", std::process::id()));
    let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
    f.write_all(data)?;
    drop(f);
    std::fs::rename(&tmp, path)
}

/// This user's private directory for single-host job secrets.
///
/// # Errors
/// As [`private_dir`].
pub fn local_dir() -> Result<PathBuf> {
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .map(|p| p.join("tutti"));
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let dir = base.unwrap_or_else(|| PathBuf::from(format!("/tmp/tutti-{uid}")));
    private_dir(&dir)?;
    Ok(dir)
}

/// A secret file rank 0 made for a single-host job; removed when dropped (by then every rank
/// has read it: they all connected to rank 0 with it).
#[derive(Debug)]
pub(crate) struct LocalSecret {
    pub(crate) path: PathBuf,
}

impl LocalSecret {
    /// Make a fresh secret at `path`.
    pub(crate) fn create(path: PathBuf) -> Result<(LocalSecret, String)> {
        let token = auth::random_token().map_err(Error::Config)?;
        write_private(&path, token.as_bytes())
            .map_err(|e| Error::Config(format!("writing {}: {e}", path.display())))?;
        Ok((LocalSecret { path }, token))
    }
}

impl Drop for LocalSecret {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Wait for rank 0's secret file at `path` and read it (it may not exist yet, or hold an older
/// job's secret: the caller tries again when the store refuses it).
///
/// # Errors
/// [`Error::Rendezvous`] when no file appears by `deadline`; [`Error::Config`] when the file is
/// not private.
pub(crate) fn wait_local(path: &Path, rank: usize, deadline: Instant) -> Result<String> {
    loop {
        if path.exists() {
            return read_token_file(path);
        }
        if Instant::now() >= deadline {
            return Err(Error::Rendezvous {
                rank,
                detail: format!(
                    "rank 0 did not leave the job secret in {} in time (is rank 0 on this host \
                     and running as this user? Across hosts, set TUTTI_TOKEN on every rank)",
                    path.display()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tutti-secret-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn tokens_must_be_long_enough_and_clean() {
        assert!(check_token("0123456789abcdef", "TUTTI_TOKEN").is_ok());
        for bad in ["short", "0123456789abcde", " 0123456789abcdef", "0123456789abcdef\n"] {
            let e = check_token(bad, "TUTTI_TOKEN").unwrap_err().to_string();
            assert!(e.contains("TUTTI_TOKEN"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn private_directories_and_token_files_are_checked() {
        let d = scratch("dir");
        private_dir(&d).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        // Others may list or write it: refused, naming the fix.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = private_dir(&d).unwrap_err().to_string();
        assert!(e.contains("chmod 700"), "{e}");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        // A symbolic link in its place: refused.
        let link = scratch("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        assert!(private_dir(&link).unwrap_err().to_string().contains("not a directory"));
        // A secret written privately reads back; made readable to others, it is refused.
        let f = d.join("t");
        write_private(&f, b"0123456789abcdef0123\n").unwrap();
        assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o777, 0o600);
        assert_eq!(read_token_file(&f).unwrap(), "0123456789abcdef0123");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_token_file(&f).unwrap_err().to_string().contains("chmod 600"));
        // A directory owned by another user (root-owned /): refused when we are not root.
        // SAFETY: getuid cannot fail.
        if unsafe { libc::getuid() } != 0 {
            assert!(private_dir(Path::new("/")).is_err());
        }
        let _ = std::fs::remove_file(&link);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_local_secret_is_removed_when_its_maker_drops_it() {
        let d = scratch("local");
        private_dir(&d).unwrap();
        let (s, token) = LocalSecret::create(d.join("job.token")).unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        assert_eq!(wait_local(&s.path, 1, deadline).unwrap(), token);
        let path = s.path.clone();
        drop(s);
        assert!(!path.exists());
        let e = wait_local(&path, 1, Instant::now() + Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("TUTTI_TOKEN"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
