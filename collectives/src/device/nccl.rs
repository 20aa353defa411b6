//! The NCCL fast path (feature `nccl`): a communicator over the same ranks as a tutti [`Comm`],
//! its unique id made by rank 0 and sent to the others over tutti's own (authenticated) group,
//! running collectives on [`CudaBuffer`]s with the same contracts as the staged path.
//!
//! NCCL is loaded at run time: without `libnccl.so.2` (or without a GPU) [`NcclComm::new`]
//! returns [`Error::CudaUnavailable`].

use cudarc::nccl::{result, sys};

use super::bytes;
use super::cuda::{CudaBuffer, CudaDevice};
use super::DeviceBuffer;
use crate::comm::Comm;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{Error, Result};

/// NCCL's own words for a failed call: the result code, its description and, when NCCL kept
/// one, the last error message (which says why, e.g. two ranks on one GPU).
fn describe(e: &result::NcclError, comm: sys::ncclComm_t) -> String {
    let text = |p: *const std::ffi::c_char| -> String {
        if p.is_null() {
            return String::new();
        }
        // SAFETY: NCCL returns a NUL-terminated string that stays valid until its next call
        // on this thread; it is copied at once.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().trim().to_string()
    };
    // SAFETY: both only read NCCL's error state; a null communicator asks for the last
    // error of this thread.
    let (what, last) =
        unsafe { (text(sys::ncclGetErrorString(e.0)), text(sys::ncclGetLastError(comm))) };
    let mut s = format!("{:?}: {what}", e.0);
    if !last.is_empty() {
        s.push_str(&format!(" ({last})"));
    }
    s
}

/// True when the NCCL library can be loaded.
pub fn library_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// `Ok` when the NCCL library can be loaded; otherwise [`Error::CudaUnavailable`] for `rank`,
/// saying which file names the loader tries and how to make a wheel's copy visible. Callers that
/// open a GPU before building an [`NcclComm`] check this first, so a missing NCCL is reported as
/// such rather than as a later failure.
///
/// # Errors
/// As above.
pub fn require_library(rank: usize) -> Result<()> {
    if library_present() {
        return Ok(());
    }
    Err(Error::CudaUnavailable {
        rank,
        detail: "the NCCL library is not installed here, or not under a name the loader tries \
                 (libnccl.so or libnccl.so.1; a wheel's lib folder has only libnccl.so.2: put a \
                 libnccl.so link to it on LD_LIBRARY_PATH)"
            .into(),
    })
}

/// An NCCL communicator bound to one GPU's copy stream.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    rank: usize,
    size: usize,
    stream: sys::cudaStream_t,
    device: std::sync::Arc<CudaDevice>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls are not concurrent;
// `&mut self`-free methods are serialised by the caller's collective contract (one call at a
// time per communicator, like every tutti communicator).
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

fn nccl_type(d: DType) -> Option<sys::ncclDataType_t> {
    Some(match d {
        DType::U8 => sys::ncclDataType_t::ncclUint8,
        DType::I8 => sys::ncclDataType_t::ncclInt8,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        _ => return None,
    })
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
    }
}

impl NcclComm {
    /// Build the NCCL communicator of `comm`'s ranks on `device`.
    ///
    /// # Collective contract
    /// Every rank of `comm` calls it (rank 0's NCCL id travels over `comm`).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without the NCCL library; collective errors of the id
    /// exchange; [`Error::Device`] when NCCL cannot initialise.
    pub fn new(comm: &Comm, device: std::sync::Arc<CudaDevice>) -> Result<NcclComm> {
        let rank = comm.rank();
        require_library(rank)?;
        let err = |op: &'static str, e: result::NcclError| Error::Device {
            rank,
            op,
            detail: describe(&e, std::ptr::null_mut()),
        };
        let mut id = [0u8; 128];
        if rank == 0 {
            let uid = result::get_uniqueid().map_err(|e| err("ncclGetUniqueId", e))?;
            for (d, s) in id.iter_mut().zip(uid.internal.iter()) {
                *d = *s as u8;
            }
        }
        comm.broadcast(&mut id, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(id) {
            *d = s as std::ffi::c_char;
        }
        let mut raw = std::mem::MaybeUninit::<sys::ncclComm_t>::uninit();
        // SAFETY: `raw` is written by NCCL on success; the id is the one rank 0 created.
        unsafe {
            result::comm_init_rank(
                raw.as_mut_ptr(),
                comm.size() as i32,
                sys::ncclUniqueId { internal },
                rank as i32,
            )
            .map_err(|e| err("ncclCommInitRank", e))?;
        }
        // SAFETY: initialised by the successful call above.
        let raw = unsafe { raw.assume_init() };
        let stream = device.stream().cu_stream() as sys::cudaStream_t;
        Ok(NcclComm { comm: raw, rank, size: comm.size(), stream, device })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    fn ptr(
        &self,
        op: &'static str,
        b: &dyn DeviceBuffer,
        bytes: Option<usize>,
    ) -> Result<*mut std::ffi::c_void> {
        let bytes = bytes.ok_or_else(|| Error::InvalidArgument {
            rank: self.rank,
            op,
            detail: "the element count times its size overflows".into(),
        })?;
        let cb = b.as_any().downcast_ref::<CudaBuffer>().ok_or_else(|| Error::InvalidArgument {
            rank: self.rank,
            op,
            detail: "the buffer was not allocated by a CUDA device".into(),
        })?;
        if cb.len_bytes() < bytes {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op,
                detail: format!("buffer holds {} bytes, the call needs {bytes}", cb.len_bytes()),
            });
        }
        let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(cb.slice(), self.device.stream());
        Ok(p as usize as *mut std::ffi::c_void)
    }

    fn finish(
        &self,
        op: &'static str,
        r: std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        r.map_err(|e| self.error(op, &e))?;
        self.device.stream().synchronize().map_err(|e| Error::Device {
            rank: self.rank,
            op,
            detail: e.to_string(),
        })
    }

    fn dtype<T: Element>(&self, op: &'static str) -> Result<sys::ncclDataType_t> {
        nccl_type(T::DTYPE).ok_or_else(|| Error::InvalidArgument {
            rank: self.rank,
            op,
            detail: format!("NCCL has no {:?}", T::DTYPE),
        })
    }

    /// Allreduce of `count` elements of `buf` in place.
    ///
    /// # Collective contract
    /// As [`Comm::allreduce`].
    ///
    /// # Errors
    /// [`Error::Device`] for an NCCL failure; [`Error::InvalidArgument`] for a short buffer.
    pub fn allreduce<T: Element>(
        &self,
        buf: &dyn DeviceBuffer,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let p = self.ptr("allreduce", buf, bytes(&[count, size_of::<T>()]))?;
        let dt = self.dtype::<T>("allreduce")?;
        // SAFETY: `p` holds `count` elements (checked); the stream is synchronised before return.
        let r = unsafe { result::all_reduce(p, p, count, dt, nccl_op(op), self.comm, self.stream) };
        self.finish("allreduce", r)
    }

    /// Allreduce of `count` elements of `input` into `output`.
    ///
    /// # Collective contract
    /// As [`Comm::allreduce_from`].
    ///
    /// # Errors
    /// As [`NcclComm::allreduce`].
    pub fn allreduce_from<T: Element>(
        &self,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let i = self.ptr("allreduce", input, bytes(&[count, size_of::<T>()]))?;
        let o = self.ptr("allreduce", output, bytes(&[count, size_of::<T>()]))?;
        let dt = self.dtype::<T>("allreduce")?;
        // SAFETY: sizes checked; synchronised before return.
        let r = unsafe { result::all_reduce(i, o, count, dt, nccl_op(op), self.comm, self.stream) };
        self.finish("allreduce", r)
    }

    /// Allgather: `input` holds `count` elements, `output` `size() * count`.
    ///
    /// # Collective contract
    /// As [`Comm::allgather`].
    ///
    /// # Errors
    /// As [`NcclComm::allreduce`].
    pub fn allgather<T: Element>(
        &self,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        count: usize,
    ) -> Result<()> {
        let i = self.ptr("allgather", input, bytes(&[count, size_of::<T>()]))?;
        let o = self.ptr("allgather", output, bytes(&[self.size, count, size_of::<T>()]))?;
        let dt = self.dtype::<T>("allgather")?;
        // SAFETY: sizes checked; synchronised before return.
        let r = unsafe { result::all_gather(i, o, count, dt, self.comm, self.stream) };
        self.finish("allgather", r)
    }

    /// Reduce-scatter: `input` holds `size() * count` elements, `output` receives this rank's
    /// `count`.
    ///
    /// # Collective contract
    /// As [`Comm::reduce_scatter`].
    ///
    /// # Errors
    /// As [`NcclComm::allreduce`].
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let i = self.ptr("reduce_scatter", input, bytes(&[self.size, count, size_of::<T>()]))?;
        let o = self.ptr("reduce_scatter", output, bytes(&[count, size_of::<T>()]))?;
        let dt = self.dtype::<T>("reduce_scatter")?;
        // SAFETY: sizes checked; synchronised before return.
        let r =
            unsafe { result::reduce_scatter(i, o, count, dt, nccl_op(op), self.comm, self.stream) };
        self.finish("reduce_scatter", r)
    }

    /// Broadcast `count` elements of `buf` from `root`.
    ///
    /// # Collective contract
    /// As [`Comm::broadcast`].
    ///
    /// # Errors
    /// As [`NcclComm::allreduce`].
    pub fn broadcast<T: Element>(
        &self,
        buf: &dyn DeviceBuffer,
        count: usize,
        root: usize,
    ) -> Result<()> {
        self.check_root("broadcast", root)?;
        let p = self.ptr("broadcast", buf, bytes(&[count, size_of::<T>()]))?;
        let dt = self.dtype::<T>("broadcast")?;
        // SAFETY: size checked; synchronised before return.
        let r = unsafe { result::broadcast(p, p, count, dt, root as i32, self.comm, self.stream) };
        self.finish("broadcast", r)
    }

    /// Reduce `count` elements of every rank's `buf` into `root`'s `buf`, in place.
    ///
    /// # Collective contract
    /// As [`Comm::reduce`].
    ///
    /// # Errors
    /// As [`NcclComm::allreduce`]; [`Error::InvalidArgument`] for a root outside the group.
    pub fn reduce<T: Element>(
        &self,
        buf: &dyn DeviceBuffer,
        count: usize,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_root("reduce", root)?;
        let p = self.ptr("reduce", buf, bytes(&[count, size_of::<T>()]))?;
        let dt = self.dtype::<T>("reduce")?;
        // SAFETY: size checked; synchronised before return.
        let r = unsafe {
            result::reduce(p, p, count, dt, nccl_op(op), root as i32, self.comm, self.stream)
        };
        self.finish("reduce", r)
    }

    /// All-to-all: block `j` (`count` elements) of `input` goes to rank `j`, block `i` of
    /// `output` comes from rank `i` (NCCL has no all-to-all call: one group of sends and
    /// receives, one pair per peer, as NCCL's documentation describes).
    ///
    /// # Collective contract
    /// As [`Comm::all_to_all`].
    ///
    /// # Errors
    /// As [`NcclComm::allreduce`].
    pub fn all_to_all<T: Element>(
        &self,
        input: &dyn DeviceBuffer,
        output: &dyn DeviceBuffer,
        count: usize,
    ) -> Result<()> {
        let block = bytes(&[count, size_of::<T>()]);
        let total = bytes(&[self.size, count, size_of::<T>()]);
        let i = self.ptr("alltoall", input, total)?.cast::<u8>();
        let o = self.ptr("alltoall", output, total)?.cast::<u8>();
        let (dt, block) = (self.dtype::<T>("alltoall")?, block.unwrap_or(0));
        result::group_start().map_err(|e| self.error("alltoall", &e))?;
        let mut first = Ok(result::NcclStatus::Success);
        for peer in 0..self.size {
            // SAFETY: block `peer` of both buffers lies within the checked totals; the group
            // is ended below whatever happened, and the stream synchronised before return.
            let r = unsafe {
                result::send(
                    i.add(peer * block).cast(),
                    count,
                    dt,
                    peer as i32,
                    self.comm,
                    self.stream,
                )
                .and_then(|_| {
                    result::recv(
                        o.add(peer * block).cast(),
                        count,
                        dt,
                        peer as i32,
                        self.comm,
                        self.stream,
                    )
                })
            };
            if first.is_ok() {
                first = r;
            }
        }
        let end = result::group_end();
        self.finish("alltoall", first.and(end))
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        crate::comm::check_root(self.rank, self.size, op, root)
    }

    /// A failed NCCL call of `op`, in NCCL's words.
    fn error(&self, op: &'static str, e: &result::NcclError) -> Error {
        Error::Device { rank: self.rank, op, detail: describe(e, self.comm) }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: created by `ncclCommInitRank`, destroyed once.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}
