//! Sealed anonymous shared memory: a `memfd` one rank makes and another rank of its host maps.
//!
//! The maker creates the file, sizes it, seals it against resizing (so a peer cannot shrink it
//! under a mapping, which would make the next access fault) and stamps its first bytes with a
//! magic, a size word and a random nonce. The peer learns the maker's process id, descriptor
//! number and nonce over an authenticated link, opens `/proc/<pid>/fd/<n>` (the kernel allows
//! that only to the same user or root) and checks, in this order, the seals, that the file is a
//! regular file of our own user of the announced size, and the stamp. The file has no name: no
//! process of another user can open it, and the kernel frees it when the last descriptor and
//! mapping are gone, however the processes ended. Used by the shared-memory links
//! (`transport::tcp::shm`) and the collective windows ([`crate::window`]).

use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Bytes of the stamp at the start of every segment: magic (8), size word (4), padding (4),
/// nonce (16).
pub(crate) const STAMP: usize = 32;

/// One shared mapping, read and write; unmapped on drop.
pub(crate) struct Mapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; what is shared in it is accessed
// through atomics or raw copies whose callers keep the protocol.
unsafe impl Send for Mapping {}

pub(crate) fn os_err(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl Mapping {
    /// The first byte.
    #[inline]
    pub(crate) fn base(&self) -> *mut u8 {
        self.base
    }

    fn map(fd: RawFd, len: usize) -> Result<Mapping, String> {
        // SAFETY: a fresh shared mapping of a file we hold open; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mapping the segment"));
        }
        Ok(Mapping { base: p.cast(), len })
    }

    /// A new sealed segment of `len` bytes (at least [`STAMP`]) stamped with `magic`, `word`
    /// and `nonce`, mapped, and its descriptor.
    pub(crate) fn create(
        name: &CStr,
        len: usize,
        magic: &[u8; 8],
        word: u32,
        nonce: &[u8; 16],
    ) -> Result<(Mapping, OwnedFd), String> {
        // SAFETY: a valid C string; flags as documented.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(os_err("memfd_create"));
        }
        // SAFETY: `fd` is ours and open.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain calls on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_err("sizing the segment"));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(os_err("sealing the segment"));
        }
        let m = Mapping::map(fd.as_raw_fd(), len)?;
        // SAFETY: the first bytes are ours to write; nobody else maps the file yet.
        unsafe { std::ptr::copy_nonoverlapping(stamp(magic, word, nonce).as_ptr(), m.base, STAMP) };
        Ok((m, fd))
    }

    /// Open and map the segment of `len` bytes that process `pid` holds as descriptor `fd`,
    /// and check it is the one it stamped with `magic`, `word` and `nonce`: ours to use, of
    /// the right size, sealed.
    pub(crate) fn attach(
        pid: u32,
        fd: u32,
        len: usize,
        magic: &[u8; 8],
        word: u32,
        nonce: &[u8; 16],
    ) -> Result<Mapping, String> {
        let path = format!("/proc/{pid}/fd/{fd}\0");
        // SAFETY: a NUL-terminated path.
        let raw = unsafe {
            libc::open(
                path.as_ptr().cast(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK,
            )
        };
        if raw < 0 {
            return Err(os_err(&format!("opening {}", path.trim_end_matches('\0'))));
        }
        // SAFETY: `raw` is ours and open; it closes when this returns (the mapping stays).
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // Seals first: once sealed, the size cannot change between our check and our mapping.
        // SAFETY: plain call on our descriptor.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals < 0 || seals & need != need {
            return Err("the peer's segment is not sealed against resizing".into());
        }
        // SAFETY: zeroed stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on our descriptor into a local.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_err("fstat of the segment"));
        }
        // SAFETY: plain call.
        let me = unsafe { libc::geteuid() };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG
            || st.st_uid != me
            || st.st_size != len as libc::off_t
        {
            return Err(format!(
                "the peer's segment is not ours to use (owner {}, we are {me}; {} bytes, expected \
                 {len})",
                st.st_uid, st.st_size
            ));
        }
        let m = Mapping::map(fd.as_raw_fd(), len)?;
        let mut got = [0u8; STAMP];
        // SAFETY: reading the first bytes of our mapping into a local.
        unsafe { std::ptr::copy_nonoverlapping(m.base, got.as_mut_ptr(), STAMP) };
        if got != stamp(magic, word, nonce) {
            return Err("the segment at the peer's descriptor is not the one it announced".into());
        }
        Ok(m)
    }
}

fn stamp(magic: &[u8; 8], word: u32, nonce: &[u8; 16]) -> [u8; STAMP] {
    let mut s = [0u8; STAMP];
    s[..8].copy_from_slice(magic);
    s[8..12].copy_from_slice(&word.to_le_bytes());
    s[16..32].copy_from_slice(nonce);
    s
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
