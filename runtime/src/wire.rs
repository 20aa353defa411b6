//! The one wire header every data frame starts with.
//!
//! Fixed layout, little-endian, 48 bytes. Encode and decode sit side by side so the layout is
//! written down exactly once; `docs/transport.md` reproduces this table word for word.
//!
//! | offset | size | field   | meaning                                                  |
//! |-------:|-----:|---------|----------------------------------------------------------|
//! | 0      | 2    | magic   | `0x7475` ("tu")                                          |
//! | 2      | 1    | kind    | 1 data, 2 keep-alive, 3 abort, 4 close, 5 probe          |
//! | 3      | 1    | op      | [`OpKind`] of the collective (fingerprint)               |
//! | 4      | 1    | dtype   | [`DType`] (fingerprint)                                  |
//! | 5      | 1    | redop   | reduction op code (fingerprint; 0 when none)             |
//! | 6      | 2    | settings| digest of the call's shared settings (fingerprint; 0 none) |
//! | 8      | 4    | group   | group id (0 = world; bit 31 marks point-to-point traffic) |
//! | 12     | 4    | src     | sender's global rank                                     |
//! | 16     | 8    | seq     | collective sequence number within the group             |
//! | 24     | 4    | step    | step (tag) within the collective                         |
//! | 28     | 4    | root    | root rank (fingerprint; `u32::MAX` when none)            |
//! | 32     | 8    | count   | element count of the whole collective (fingerprint)      |
//! | 40     | 8    | len     | payload bytes that follow this header                    |

use std::fmt;

/// Size of an encoded [`Header`] in bytes.
pub const HEADER_LEN: usize = 48;

/// Magic number at the start of every frame.
pub const MAGIC: u16 = 0x7475;

/// Operation kinds carried in the header's fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum OpKind {
    /// Point-to-point message.
    SendRecv = 1,
    /// Broadcast.
    Broadcast = 2,
    /// Reduce to a root.
    Reduce = 3,
    /// Allreduce.
    Allreduce = 4,
    /// Allgather (and allgatherv).
    Allgather = 5,
    /// Reduce-scatter (and reduce_scatter_v).
    ReduceScatter = 6,
    /// All-to-all (and all_to_all_v).
    AllToAll = 7,
    /// Gather to a root.
    Gather = 8,
    /// Scatter from a root.
    Scatter = 9,
    /// Barrier.
    Barrier = 10,
    /// Internal control traffic (rendezvous checks, group creation).
    Control = 11,
}

impl OpKind {
    /// Decode an op code; `None` for codes this build does not know.
    pub fn from_u8(v: u8) -> Option<OpKind> {
        use OpKind::*;
        Some(match v {
            1 => SendRecv,
            2 => Broadcast,
            3 => Reduce,
            4 => Allreduce,
            5 => Allgather,
            6 => ReduceScatter,
            7 => AllToAll,
            8 => Gather,
            9 => Scatter,
            10 => Barrier,
            11 => Control,
            _ => return None,
        })
    }

    /// Lower-case name as used in logs and collbench.
    pub fn name(self) -> &'static str {
        use OpKind::*;
        match self {
            SendRecv => "sendrecv",
            Broadcast => "broadcast",
            Reduce => "reduce",
            Allreduce => "allreduce",
            Allgather => "allgather",
            ReduceScatter => "reduce_scatter",
            AllToAll => "alltoall",
            Gather => "gather",
            Scatter => "scatter",
            Barrier => "barrier",
            Control => "control",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Element types, as carried in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum DType {
    /// Untyped bytes.
    U8 = 1,
    /// Signed 8-bit integer.
    I8 = 2,
    /// Signed 32-bit integer.
    I32 = 3,
    /// Signed 64-bit integer.
    I64 = 4,
    /// IEEE half precision.
    F16 = 5,
    /// bfloat16.
    BF16 = 6,
    /// IEEE single precision.
    F32 = 7,
    /// IEEE double precision.
    F64 = 8,
}

impl DType {
    /// All dtypes, in code order.
    pub const ALL: [DType; 8] = [
        DType::U8,
        DType::I8,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Decode a dtype code.
    pub fn from_u8(v: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u8 == v)
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// nccl-tests style name (`float`, `int32`, …).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::F32 => "float",
            DType::F64 => "double",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[repr(u8)]
pub enum FrameKind {
    /// A message: payload for a posted (or future) receive.
    Data = 1,
    /// Liveness probe; no payload, never matched.
    KeepAlive = 2,
    /// The sender aborted; the payload is a UTF-8 reason.
    Abort = 3,
    /// The sender is shutting down cleanly: no more frames follow. No payload.
    Close = 4,
    /// The sender has waited long for a message of the collective in the descriptor; the
    /// receiver compares it with its own operations of that collective. No payload.
    Probe = 5,
}

/// Where a message belongs: group, collective sequence number and step. Messages from one peer
/// with the same tag are delivered in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag {
    /// Group id (0 = world).
    pub group: u32,
    /// Collective sequence number within the group.
    pub seq: u64,
    /// Step within the collective.
    pub step: u32,
}

/// What every rank must agree on for one collective call; a mismatch is reported with both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    /// Operation.
    pub op: OpKind,
    /// Element type.
    pub dtype: DType,
    /// Reduction op code (0 when the operation does not reduce).
    pub redop: u8,
    /// Root rank, `u32::MAX` when the operation has none.
    pub root: u32,
    /// Element count of the whole collective.
    pub count: u64,
    /// Digest of the settings every rank must share for the call (the algorithm that runs, the
    /// pipeline segment size); 0 when there are none. Two ranks whose digests differ run
    /// different schedules: `TUTTI_ALGO` or `TUTTI_SEGMENT_BYTES` differ between them.
    pub settings: u16,
}

impl Fingerprint {
    /// Fingerprint of a plain point-to-point byte message.
    pub fn p2p(len: usize) -> Fingerprint {
        Fingerprint {
            op: OpKind::SendRecv,
            dtype: DType::U8,
            redop: 0,
            root: u32::MAX,
            count: len as u64,
            settings: 0,
        }
    }
}

/// A message descriptor: its tag and its fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsgDesc {
    /// Where the message belongs.
    pub tag: Tag,
    /// What the collective is.
    pub fp: Fingerprint,
}

impl fmt::Display for MsgDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let root =
            if self.fp.root == u32::MAX { "-".to_string() } else { self.fp.root.to_string() };
        let settings = if self.fp.settings == 0 {
            String::new()
        } else {
            format!(", settings {:#06x}", self.fp.settings)
        };
        write!(
            f,
            "{{op {}, dtype {}, redop {}, count {}, root {}{settings}, group {}, seq {}, step {}}}",
            self.fp.op,
            self.fp.dtype,
            self.fp.redop,
            self.fp.count,
            root,
            self.tag.group,
            self.tag.seq,
            self.tag.step
        )
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: FrameKind,
    /// Message descriptor (meaningful for data frames).
    pub desc: MsgDesc,
    /// Sender's global rank.
    pub src: u32,
    /// Payload length in bytes.
    pub len: u64,
}

/// Why a header could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderError {
    /// The first two bytes are not [`MAGIC`].
    #[error("bad magic {0:#06x} (not a tutti frame)")]
    Magic(u16),
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    Kind(u8),
    /// Unknown op code.
    #[error("unknown op code {0}")]
    Op(u8),
    /// Unknown dtype code.
    #[error("unknown dtype code {0}")]
    DType(u8),
}

impl Header {
    /// A data frame header.
    #[inline]
    pub fn data(desc: MsgDesc, src: usize, len: usize) -> Header {
        Header { kind: FrameKind::Data, desc, src: src as u32, len: len as u64 }
    }

    /// A control frame (keep-alive, abort) header.
    pub fn control(kind: FrameKind, src: usize, len: usize) -> Header {
        let desc = MsgDesc {
            tag: Tag { group: u32::MAX, seq: 0, step: 0 },
            fp: Fingerprint {
                op: OpKind::Control,
                dtype: DType::U8,
                redop: 0,
                root: u32::MAX,
                count: len as u64,
                settings: 0,
            },
        };
        Header { kind, desc, src: src as u32, len: len as u64 }
    }

    /// Encode into exactly [`HEADER_LEN`] bytes.
    #[inline]
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = self.kind as u8;
        b[3] = self.desc.fp.op as u8;
        b[4] = self.desc.fp.dtype as u8;
        b[5] = self.desc.fp.redop;
        b[6..8].copy_from_slice(&self.desc.fp.settings.to_le_bytes());
        b[8..12].copy_from_slice(&self.desc.tag.group.to_le_bytes());
        b[12..16].copy_from_slice(&self.src.to_le_bytes());
        b[16..24].copy_from_slice(&self.desc.tag.seq.to_le_bytes());
        b[24..28].copy_from_slice(&self.desc.tag.step.to_le_bytes());
        b[28..32].copy_from_slice(&self.desc.fp.root.to_le_bytes());
        b[32..40].copy_from_slice(&self.desc.fp.count.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decode the inverse of [`Header::encode`]. Never panics, whatever the bytes.
    ///
    /// # Errors
    /// [`HeaderError`] when the bytes are not a frame header this build understands.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, HeaderError> {
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let magic = u16_at(0);
        if magic != MAGIC {
            return Err(HeaderError::Magic(magic));
        }
        let kind = match b[2] {
            1 => FrameKind::Data,
            2 => FrameKind::KeepAlive,
            3 => FrameKind::Abort,
            4 => FrameKind::Close,
            5 => FrameKind::Probe,
            k => return Err(HeaderError::Kind(k)),
        };
        let op = OpKind::from_u8(b[3]).ok_or(HeaderError::Op(b[3]))?;
        let dtype = DType::from_u8(b[4]).ok_or(HeaderError::DType(b[4]))?;
        Ok(Header {
            kind,
            desc: MsgDesc {
                tag: Tag { group: u32_at(8), seq: u64_at(16), step: u32_at(24) },
                fp: Fingerprint {
                    op,
                    dtype,
                    redop: b[5],
                    root: u32_at(28),
                    count: u64_at(32),
                    settings: u16_at(6),
                },
            },
            src: u32_at(12),
            len: u64_at(40),
        })
    }
}

/// FNV-1a over 64-bit words, from `seed` (0 for none): the one hash every rank computes alike
/// for what must agree without a message — a sub-group's id from its parent's and its members,
/// a call's settings digest in its fingerprint. Not for anything an attacker chooses.
pub fn fnv1a(seed: u64, words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for w in words {
        h ^= w;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample() -> Header {
        Header::data(
            MsgDesc {
                tag: Tag { group: 7, seq: 1 << 40, step: 3 },
                fp: Fingerprint {
                    op: OpKind::Allreduce,
                    dtype: DType::BF16,
                    redop: 2,
                    root: u32::MAX,
                    count: 10007,
                    settings: 0,
                },
            },
            5,
            20014,
        )
    }

    #[test]
    fn roundtrip() {
        let h = sample();
        assert_eq!(Header::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn layout_is_little_endian_and_fixed() {
        let b = sample().encode();
        assert_eq!(&b[0..2], &[0x75, 0x74]);
        assert_eq!(b[2], 1);
        assert_eq!(b[3], OpKind::Allreduce as u8);
        assert_eq!(&b[8..12], &7u32.to_le_bytes());
        assert_eq!(&b[12..16], &5u32.to_le_bytes());
        assert_eq!(&b[40..48], &20014u64.to_le_bytes());
        let mut h = sample();
        h.desc.fp.settings = 0x1234;
        let b = h.encode();
        assert_eq!(&b[6..8], &[0x34, 0x12]);
        assert_eq!(Header::decode(&b), Ok(h));
        assert!(h.desc.to_string().contains("root -, settings 0x1234, group 7"), "{}", h.desc);
    }

    #[test]
    fn known_answer_bytes() {
        // Computed outside the crate from the layout table with Python's struct module:
        //   struct.pack('<HBBBBHIIQIIQQ', 0x7475, 1, 4, 6, 2, 0, 7, 5, 1 << 40, 3,
        //               0xffffffff, 10007, 20014).hex()
        let want = "75740104060200000700000005000000000000000001000003000000\
                    ffffffff17270000000000002e4e000000000000";
        let hex: String = sample().encode().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, want);
        // A keep-alive from rank 3: kind 2, op Control (11), dtype U8 (1), group and root
        // u32::MAX, nothing else.
        let want = "7574020b01000000ffffffff0300000000000000000000000000000\
                    0ffffffff00000000000000000000000000000000";
        let h = Header::control(FrameKind::KeepAlive, 3, 0);
        let hex: String = h.encode().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, want);
        assert_eq!(Header::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn every_code_is_fixed() {
        // The codes are the wire format: each decodes to its own variant and name, and the
        // codes next to the table's ends are refused.
        let ops = [
            (1, "sendrecv"),
            (2, "broadcast"),
            (3, "reduce"),
            (4, "allreduce"),
            (5, "allgather"),
            (6, "reduce_scatter"),
            (7, "alltoall"),
            (8, "gather"),
            (9, "scatter"),
            (10, "barrier"),
            (11, "control"),
        ];
        for (code, name) in ops {
            let op = OpKind::from_u8(code).unwrap_or_else(|| panic!("op code {code}"));
            assert_eq!((op as u8, op.name(), op.to_string()), (code, name, name.to_string()));
        }
        assert_eq!(OpKind::from_u8(0), None);
        assert_eq!(OpKind::from_u8(12), None);
        let dtypes = [
            (1, "uint8", 1),
            (2, "int8", 1),
            (3, "int32", 4),
            (4, "int64", 8),
            (5, "half", 2),
            (6, "bfloat16", 2),
            (7, "float", 4),
            (8, "double", 8),
        ];
        for (code, name, size) in dtypes {
            let d = DType::from_u8(code).unwrap_or_else(|| panic!("dtype code {code}"));
            assert_eq!(
                (d as u8, d.name(), d.to_string(), d.size()),
                (code, name, name.into(), size)
            );
        }
        assert_eq!(DType::from_u8(0), None);
        assert_eq!(DType::from_u8(9), None);
        for (k, kind) in [
            (1, FrameKind::Data),
            (2, FrameKind::KeepAlive),
            (3, FrameKind::Abort),
            (4, FrameKind::Close),
            (5, FrameKind::Probe),
        ] {
            let mut h = sample();
            h.kind = kind;
            let b = h.encode();
            assert_eq!(b[2], k);
            assert_eq!(Header::decode(&b), Ok(h));
        }
        let mut b = sample().encode();
        b[2] = 6;
        assert_eq!(Header::decode(&b), Err(HeaderError::Kind(6)));
    }

    #[test]
    fn descriptors_print_every_field() {
        // Mismatch errors print both descriptors this way.
        let mut d = sample().desc;
        assert_eq!(
            d.to_string(),
            "{op allreduce, dtype bfloat16, redop 2, count 10007, root -, group 7, \
             seq 1099511627776, step 3}"
        );
        d.fp.root = 3;
        assert!(d.to_string().contains("root 3, group 7"), "{d}");
    }

    #[test]
    fn rejects_bad_magic_and_codes() {
        let mut b = sample().encode();
        b[0] = 0;
        assert!(matches!(Header::decode(&b), Err(HeaderError::Magic(_))));
        let mut b = sample().encode();
        b[3] = 200;
        assert_eq!(Header::decode(&b), Err(HeaderError::Op(200)));
        let mut b = sample().encode();
        b[4] = 77;
        assert_eq!(Header::decode(&b), Err(HeaderError::DType(77)));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let mut b = [0u8; HEADER_LEN];
            b.copy_from_slice(&bytes);
            if let Ok(h) = Header::decode(&b) {
                prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
            }
        }
    }
}
