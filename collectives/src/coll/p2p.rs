//! Point to point on a communicator: send, receive, sendrecv and batches of them, each one call
//! (ordered after earlier non-blocking calls, refused on a poisoned group, poisoning it on
//! failure) over the group's tagged messages.

use crate::comm::Comm;
use crate::dtype::{as_bytes, as_bytes_mut, Element};
use crate::error::Result;

impl Comm {
    /// Send `buf` to group rank `dst` under `tag` (see [`Group::send`](tutti_runtime::Group::send)).
    ///
    /// # Collective contract
    /// Point to point: `dst` calls [`Comm::recv`] from this rank with the same tag.
    ///
    /// # Errors
    /// As [`Group::send`](tutti_runtime::Group::send).
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        self.call_p2p("send", || Ok(self.group.send(dst, tag, as_bytes(buf))?))
    }

    /// Send `send` to `dst` while receiving `recv` from `src` (nccl-tests' sendrecv pattern);
    /// returns the elements received.
    ///
    /// # Collective contract
    /// Point to point, as [`Group::sendrecv`](tutti_runtime::Group::sendrecv).
    ///
    /// # Errors
    /// As [`Group::sendrecv`](tutti_runtime::Group::sendrecv).
    pub fn sendrecv<T: Element>(
        &self,
        send: &[T],
        dst: usize,
        recv: &mut [T],
        src: usize,
        tag: u32,
    ) -> Result<usize> {
        self.call_p2p("sendrecv", || {
            let got = self.group.sendrecv(dst, as_bytes(send), src, as_bytes_mut(recv), tag)?;
            Ok(got / size_of::<T>())
        })
    }

    /// Receive into `buf` from group rank `src` under `tag`; returns the elements received.
    ///
    /// # Collective contract
    /// Matches a [`Comm::send`] from `src`.
    ///
    /// # Errors
    /// As [`Group::recv`](tutti_runtime::Group::recv).
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<usize> {
        self.call_p2p("recv", || Ok(self.group.recv(src, tag, as_bytes_mut(buf))? / size_of::<T>()))
    }

    /// Several sends and receives posted together and waited for together (PyTorch's
    /// `batch_isend_irecv`); see [`Group::batch_p2p`](tutti_runtime::Group::batch_p2p). Returns the elements received per
    /// receive.
    ///
    /// # Collective contract
    /// Point to point: each send is matched by a receive with the same tag on its destination.
    ///
    /// # Errors
    /// As [`Group::batch_p2p`](tutti_runtime::Group::batch_p2p).
    pub fn batch_p2p<T: Element>(
        &self,
        sends: &[(usize, u32, &[T])],
        recvs: &mut [(usize, u32, &mut [T])],
    ) -> Result<Vec<usize>> {
        self.call_p2p("batch_p2p", || {
            let s: Vec<(usize, u32, &[u8])> =
                sends.iter().map(|(d, t, b)| (*d, *t, as_bytes(b))).collect();
            let mut r: Vec<(usize, u32, &mut [u8])> =
                recvs.iter_mut().map(|(src, t, b)| (*src, *t, as_bytes_mut(b))).collect();
            let got = self.group.batch_p2p(&s, &mut r)?;
            Ok(got.into_iter().map(|n| n / size_of::<T>()).collect())
        })
    }

    /// One point-to-point call ([`Comm::call`]), after this rank's small broadcasts as root
    /// are checked ([`Comm::settle_direct`]), as before any call on messages.
    fn call_p2p<R>(&self, op: &'static str, body: impl FnOnce() -> Result<R>) -> Result<R> {
        self.call(op, || {
            self.settle_direct()?;
            body()
        })
    }
}
