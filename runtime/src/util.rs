//! Small OS helpers.

use std::os::fd::RawFd;
use std::time::Duration;

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

    /// Consume pending wake-ups (after `poll` reported the read end readable).
    pub(crate) fn drain(&self) {
        let mut sink = [0u8; 64];
        // SAFETY: reading into a local buffer from our own non-blocking pipe.
        unsafe { libc::read(self.rx, sink.as_mut_ptr().cast(), sink.len()) };
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
