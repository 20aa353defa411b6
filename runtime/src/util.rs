//! Small OS helpers.

use std::io::Read;
use std::net::TcpStream;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Read exactly `buf.len()` bytes by `deadline`, however the peer splits them (a deadline for
/// the whole read, not per `read` call, so a peer dripping one byte at a time cannot stretch
/// it).
///
/// # Errors
/// `TimedOut` at the deadline, `UnexpectedEof` when the peer closes, or the socket's error.
pub(crate) fn read_exact_by(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<()> {
    use std::io::ErrorKind;
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!("deadline passed with {got} of {} bytes read", buf.len()),
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Block until `fd` is readable or `timeout` passes; true when readable.
pub(crate) fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

/// A self-pipe that wakes threads blocked in `poll` on its read end (abort, shutdown).
pub(crate) struct WakePipe {
    rx: RawFd,
    tx: RawFd,
}

impl WakePipe {
    pub(crate) fn new() -> std::io::Result<WakePipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(WakePipe { rx: fds[0], tx: fds[1] })
    }

    /// The descriptor to poll for `POLLIN`.
    pub(crate) fn fd(&self) -> RawFd {
        self.rx
    }

    /// Wake the pollers.
    pub(crate) fn wake(&self) {
        let b = 1u8;
        // SAFETY: writing one byte from a valid local to our own pipe; errors (full pipe) are
        // fine, a wake-up is already pending then.
        unsafe { libc::write(self.tx, (&b as *const u8).cast(), 1) };
    }

    /// Consume every pending wake-up (after `poll` reported the read end readable), so a
    /// backlog of them does not wake the next sleeper for nothing.
    pub(crate) fn drain(&self) {
        let mut sink = [0u8; 256];
        // SAFETY: reading into a local buffer from our own non-blocking pipe.
        while unsafe { libc::read(self.rx, sink.as_mut_ptr().cast(), sink.len()) }
            == sink.len() as isize
        {}
    }
}

impl Drop for WakePipe {
    fn drop(&mut self) {
        // SAFETY: closing the two descriptors this pipe created and owns.
        unsafe {
            libc::close(self.rx);
            libc::close(self.tx);
        }
    }
}

/// A count of live connections of one kind, decremented when dropped.
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Slot {
    pub(crate) fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        let mut cur = count.load(Ordering::SeqCst);
        loop {
            if cur >= max {
                return None;
            }
            match count.compare_exchange(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => return Some(Slot(count.clone())),
                Err(now) => cur = now,
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `d` scaled by a random factor in [0.5, 1.5): retries of many ranks at once spread out
/// instead of arriving together again.
pub(crate) fn jitter(d: Duration) -> Duration {
    let r = crate::auth::random::<2>().map_or(32768, u16::from_le_bytes);
    d.mul_f64(0.5 + f64::from(r) / 65536.0)
}

/// Ranks for an error message: all of them up to 16, then the first 16 and how many more.
pub(crate) fn list_ranks(ranks: &[usize]) -> String {
    const SHOWN: usize = 16;
    if ranks.len() <= SHOWN {
        return format!("{ranks:?}");
    }
    format!("{:?} and {} more", &ranks[..SHOWN], ranks.len() - SHOWN)
}
