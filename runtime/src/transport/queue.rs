//! The frames of one connection, shared by the TCP and QUIC engines: what waits to be sent, and
//! where the frame being received goes.

use std::collections::VecDeque;

use crate::transport::matcher::RawBuf;
use crate::transport::OpId;
use crate::wire::{FrameKind, Header, MsgDesc, HEADER_LEN};

/// A frame's payload: the caller's posted buffer, or bytes the engine owns.
pub(crate) enum Payload {
    Borrowed(*const u8),
    Owned(Vec<u8>),
}

/// A frame waiting to be sent (or partly sent).
pub(crate) struct SendItem {
    /// The send it completes; `None` for control frames and forgotten sends.
    pub(crate) id: Option<OpId>,
    pub(crate) hdr: [u8; HEADER_LEN],
    pub(crate) data: Payload,
    pub(crate) len: usize,
    /// Bytes of header plus payload already handed over (to the kernel or to quinn).
    pub(crate) off: usize,
}

impl SendItem {
    /// A data frame of send `id` from the caller's `len` bytes at `data`.
    pub(crate) fn data(id: OpId, hdr: [u8; HEADER_LEN], data: *const u8, len: usize) -> SendItem {
        SendItem { id: Some(id), hdr, data: Payload::Borrowed(data), len, off: 0 }
    }

    /// A control frame (keep-alive, probe, close, abort) with its own payload.
    pub(crate) fn control(hdr: [u8; HEADER_LEN], data: Vec<u8>) -> SendItem {
        let len = data.len();
        SendItem { id: None, hdr, data: Payload::Owned(data), len, off: 0 }
    }

    /// Header plus payload bytes.
    pub(crate) fn total(&self) -> usize {
        HEADER_LEN + self.len
    }

    pub(crate) fn data_ptr(&self) -> *const u8 {
        match &self.data {
            Payload::Borrowed(p) => *p,
            Payload::Owned(v) => v.as_ptr(),
        }
    }

    pub(crate) fn payload(&self) -> &[u8] {
        match &self.data {
            Payload::Owned(v) => v,
            Payload::Borrowed(_) if self.len == 0 => &[],
            // SAFETY: a borrowed payload belongs to a send that is still posted (`forget` and
            // `abort_queue` replace it with a copy before the operation is dropped), so it is
            // readable for `len` bytes.
            Payload::Borrowed(p) => unsafe { std::slice::from_raw_parts(*p, self.len) },
        }
    }

    /// Replace a borrowed payload by a private copy (the operation is about to be dropped).
    fn own(&mut self) {
        if let Payload::Borrowed(_) = self.data {
            self.data = Payload::Owned(self.payload().to_vec());
        }
    }
}

/// Where the payload of the frame being received goes.
pub(crate) enum RxDest {
    Posted {
        id: OpId,
        buf: RawBuf,
    },
    /// Header read, no receive posted yet, too large to buffer eagerly (TCP only: the payload
    /// waits in the kernel).
    Parked(MsgDesc),
    Unexpected {
        desc: MsgDesc,
        data: Vec<u8>,
    },
    Abort(Vec<u8>),
    Discard,
}

/// The frame being received on a connection.
pub(crate) struct RxFrame {
    pub(crate) dest: RxDest,
    pub(crate) len: usize,
    pub(crate) done: usize,
}

/// Forget operation `op` on one connection: a frame arriving for it is read and dropped; a send
/// not started is withdrawn; a send partly handed over is finished from a private copy (so the
/// stream stays in sync) and completes nothing.
pub(crate) fn forget(cur: &mut Option<RxFrame>, sendq: &mut VecDeque<SendItem>, op: OpId) {
    if let Some(f) = cur.as_mut() {
        if matches!(f.dest, RxDest::Posted { id, .. } if id == op) {
            f.dest = RxDest::Discard;
        }
    }
    sendq.retain_mut(|s| {
        if s.id != Some(op) {
            return true;
        }
        if s.off == 0 {
            return false;
        }
        s.own();
        s.id = None;
        true
    });
}

/// The transport is poisoned: drop the frames not started, finish partly sent ones from private
/// copies, then send an abort frame with `reason`.
pub(crate) fn abort_queue(sendq: &mut VecDeque<SendItem>, rank: usize, reason: &[u8]) {
    sendq.retain(|s| s.off > 0);
    for s in sendq.iter_mut() {
        s.own();
        s.id = None;
    }
    let hdr = Header::control(FrameKind::Abort, rank, reason.len()).encode();
    sendq.push_back(SendItem::control(hdr, reason.to_vec()));
}

/// Payload bytes of `op` moved so far on this connection, if `op` is this connection's.
pub(crate) fn progress(cur: &Option<RxFrame>, sendq: &VecDeque<SendItem>, op: OpId) -> Option<u64> {
    if let Some(RxFrame { dest: RxDest::Posted { id, .. }, done, .. }) = cur {
        if *id == op {
            return Some(*done as u64);
        }
    }
    sendq.iter().find(|s| s.id == Some(op)).map(|s| s.off.saturating_sub(HEADER_LEN) as u64)
}
