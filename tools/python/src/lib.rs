//! `tutti._tutti`: the native half of the `tutti` Python package.
//!
//! Buffers cross as `(address, element count)` with a dtype name, taken by the Python half from
//! a torch tensor (`data_ptr()`), a numpy array (`__array_interface__`) or any writable buffer
//! (ctypes): no copy. The Python half keeps each buffer alive until its call returns or its
//! [`Work`] is waited for; this half checks alignment and never frees or keeps a buffer. Every
//! blocking wait releases the GIL.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tutti_collectives::{Comm as RComm, Element, Pending, ReduceOp};
use tutti_runtime::store::Store;

create_exception!(
    _tutti,
    TuttiError,
    PyRuntimeError,
    "A collective failed: the message names this rank, the peer and the operation. The group is unusable afterwards."
);

fn err(e: impl std::fmt::Display) -> PyErr {
    TuttiError::new_err(e.to_string())
}

/// A caller's buffer: address and element count. The Python half guarantees it stays valid
/// (and is not resized or freed) until the call that uses it has ended.
#[derive(Clone, Copy, Debug)]
struct Raw {
    addr: usize,
    count: usize,
}

impl Raw {
    /// # Safety
    /// The buffer is valid for `count` elements of `T` and nothing else uses it meanwhile.
    unsafe fn slice<'a, T>(self) -> &'a mut [T] {
        if self.count == 0 {
            return &mut [];
        }
        // SAFETY: forwarded contract; alignment and non-null checked in `check`.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.count) }
    }

    fn bytes(self, esize: usize) -> std::ops::Range<usize> {
        self.addr..self.addr + self.count * esize
    }
}

fn overlaps(a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> bool {
    a.start < b.end && b.start < a.end && !a.is_empty() && !b.is_empty()
}

/// What to run: one collective over raw buffers.
#[derive(Debug)]
enum Job {
    Allreduce {
        buf: Raw,
        op: ReduceOp,
    },
    Broadcast {
        buf: Raw,
        root: usize,
    },
    Reduce {
        buf: Raw,
        op: ReduceOp,
        root: usize,
    },
    Allgather {
        inp: Raw,
        out: Raw,
    },
    ReduceScatter {
        inp: Raw,
        out: Raw,
        op: ReduceOp,
    },
    AllToAll {
        inp: Raw,
        out: Raw,
    },
    /// An all-gather whose input is the output's own block (see [`Job::in_place`]).
    AllgatherInPlace {
        buf: Raw,
    },
    /// A reduce-scatter whose output is the input's own block.
    ReduceScatterInPlace {
        buf: Raw,
        op: ReduceOp,
    },
    /// An all-to-all whose input and output are the same buffer.
    AllToAllInPlace {
        buf: Raw,
    },
    AllToAllV {
        inp: Raw,
        send: Vec<usize>,
        out: Raw,
        recv: Vec<usize>,
    },
    Gather {
        inp: Raw,
        out: Raw,
        root: usize,
    },
    Scatter {
        inp: Raw,
        out: Raw,
        root: usize,
    },
    Barrier,
    /// Receive under `tag` from whichever rank sends first; its rank goes to `source`.
    RecvAny {
        tag: u32,
        buf: Raw,
        source: Arc<std::sync::atomic::AtomicI64>,
    },
    /// Point to point, in bytes: (peer, tag, buffer).
    Batch {
        sends: Vec<(usize, u32, Raw)>,
        recvs: Vec<(usize, u32, Raw)>,
    },
}

/// An element type by the name the Python half uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dt {
    F32,
    F64,
    F16,
    Bf16,
    I8,
    U8,
    I32,
    I64,
}

impl Dt {
    fn parse(s: &str) -> PyResult<Dt> {
        Ok(match s {
            "float32" => Dt::F32,
            "float64" => Dt::F64,
            "float16" => Dt::F16,
            "bfloat16" => Dt::Bf16,
            "int8" => Dt::I8,
            "uint8" => Dt::U8,
            "int32" => Dt::I32,
            "int64" => Dt::I64,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "tutti has no dtype {s:?} (float32, float64, float16, bfloat16, int8, uint8, int32, int64)"
                )))
            }
        })
    }

    fn size(self) -> usize {
        match self {
            Dt::F32 | Dt::I32 => 4,
            Dt::F64 | Dt::I64 => 8,
            Dt::F16 | Dt::Bf16 => 2,
            Dt::I8 | Dt::U8 => 1,
        }
    }
}

fn parse_op(s: &str) -> PyResult<ReduceOp> {
    ReduceOp::parse(s).ok_or_else(|| {
        PyValueError::new_err(format!("tutti has no reduction {s:?} (sum, prod, min, max, avg)"))
    })
}

impl Job {
    /// Every buffer of the job, with whether it is written.
    fn buffers(&self) -> Vec<(Raw, bool)> {
        match self {
            Job::Allreduce { buf, .. }
            | Job::Broadcast { buf, .. }
            | Job::Reduce { buf, .. }
            | Job::AllgatherInPlace { buf }
            | Job::ReduceScatterInPlace { buf, .. }
            | Job::AllToAllInPlace { buf } => vec![(*buf, true)],
            Job::Allgather { inp, out }
            | Job::ReduceScatter { inp, out, .. }
            | Job::AllToAll { inp, out }
            | Job::AllToAllV { inp, out, .. }
            | Job::Gather { inp, out, .. }
            | Job::Scatter { inp, out, .. } => vec![(*inp, false), (*out, true)],
            Job::Barrier => vec![],
            Job::RecvAny { buf, .. } => vec![(*buf, true)],
            Job::Batch { sends, recvs } => sends
                .iter()
                .map(|(_, _, b)| (*b, false))
                .chain(recvs.iter().map(|(_, _, b)| (*b, true)))
                .collect(),
        }
    }

    /// The in-place form of a call whose buffers alias exactly as the in-place form lays them
    /// out, as torch programs write them (`all_gather_into_tensor(out, out.chunk(n)[rank])`,
    /// `reduce_scatter_tensor(inp.chunk(n)[rank], inp)`, `all_to_all_single(t, t)`); other
    /// calls unchanged. In place or not is each rank's own choice: the others may call either
    /// way.
    fn in_place(self, rank: usize, size: usize, esize: usize) -> Job {
        let at = |whole: Raw, part: Raw| {
            part.count > 0
                && whole.count == part.count * size
                && part.addr == whole.addr + rank * part.count * esize
        };
        match self {
            Job::Allgather { inp, out } if at(out, inp) => Job::AllgatherInPlace { buf: out },
            Job::ReduceScatter { inp, out, op } if at(inp, out) => {
                Job::ReduceScatterInPlace { buf: inp, op }
            }
            Job::AllToAll { inp, out }
                if inp.count > 0 && inp.addr == out.addr && inp.count == out.count =>
            {
                Job::AllToAllInPlace { buf: out }
            }
            j => j,
        }
    }

    /// Refuse null or misaligned buffers, and a written buffer that overlaps another one.
    fn check(&self, dt: Dt) -> PyResult<()> {
        let esize =
            if matches!(self, Job::Batch { .. } | Job::RecvAny { .. }) { 1 } else { dt.size() };
        let bufs = self.buffers();
        for (b, _) in &bufs {
            if b.count > 0 && (b.addr == 0 || b.addr % esize != 0) {
                return Err(PyValueError::new_err(format!(
                    "a buffer at {:#x} is not aligned for {dt:?}",
                    b.addr
                )));
            }
        }
        for (i, (a, wa)) in bufs.iter().enumerate() {
            for (b, wb) in &bufs[i + 1..] {
                if (*wa || *wb) && overlaps(a.bytes(esize), b.bytes(esize)) {
                    return Err(PyValueError::new_err(
                        "the input and output buffers overlap: pass separate tensors",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Run it.
    ///
    /// # Safety
    /// Every buffer is valid as described by the Python half, and [`Job::check`] passed.
    unsafe fn run(&self, c: &RComm, dt: Dt) -> tutti_collectives::Result<()> {
        macro_rules! go {
            ($t:ty) => {
                // SAFETY: forwarded contract: valid, aligned, disjoint where written.
                unsafe { self.typed::<$t>(c) }
            };
        }
        match dt {
            Dt::F32 => go!(f32),
            Dt::F64 => go!(f64),
            Dt::F16 => go!(half::f16),
            Dt::Bf16 => go!(half::bf16),
            Dt::I8 => go!(i8),
            Dt::U8 => go!(u8),
            Dt::I32 => go!(i32),
            Dt::I64 => go!(i64),
        }
    }

    /// # Safety
    /// As [`Job::run`], with `T` the buffers' element type.
    unsafe fn typed<T: Element>(&self, c: &RComm) -> tutti_collectives::Result<()> {
        // SAFETY (every `slice` below): forwarded contract.
        unsafe {
            match self {
                Job::Allreduce { buf, op } => c.allreduce(buf.slice::<T>(), *op).map(drop),
                Job::Broadcast { buf, root } => c.broadcast(buf.slice::<T>(), *root).map(drop),
                Job::Reduce { buf, op, root } => c.reduce(buf.slice::<T>(), *op, *root).map(drop),
                Job::Allgather { inp, out } => c.allgather(inp.slice::<T>(), out.slice()).map(drop),
                Job::ReduceScatter { inp, out, op } => {
                    c.reduce_scatter(inp.slice::<T>(), out.slice(), *op).map(drop)
                }
                Job::AllToAll { inp, out } => c.all_to_all(inp.slice::<T>(), out.slice()).map(drop),
                Job::AllgatherInPlace { buf } => c.allgather_inplace(buf.slice::<T>()).map(drop),
                Job::ReduceScatterInPlace { buf, op } => {
                    c.reduce_scatter_inplace(buf.slice::<T>(), *op).map(drop)
                }
                Job::AllToAllInPlace { buf } => c.all_to_all_inplace(buf.slice::<T>()).map(drop),
                Job::AllToAllV { inp, send, out, recv } => {
                    c.all_to_all_v(inp.slice::<T>(), send, out.slice(), recv).map(drop)
                }
                Job::Gather { inp, out, root } => {
                    c.gather(inp.slice::<T>(), out.slice(), *root).map(drop)
                }
                Job::Scatter { inp, out, root } => {
                    c.scatter(inp.slice::<T>(), out.slice(), *root).map(drop)
                }
                Job::Barrier => c.barrier().map(drop),
                Job::RecvAny { tag, buf, source } => {
                    let (src, _) = c.group().recv_any(*tag, buf.slice::<u8>())?;
                    source.store(src as i64, std::sync::atomic::Ordering::SeqCst);
                    Ok(())
                }
                Job::Batch { sends, recvs } => {
                    let s: Vec<(usize, u32, &[u8])> =
                        sends.iter().map(|(p, t, b)| (*p, *t, &*b.slice::<u8>())).collect();
                    let mut r: Vec<(usize, u32, &mut [u8])> =
                        recvs.iter().map(|(p, t, b)| (*p, *t, b.slice::<u8>())).collect();
                    c.batch_p2p(&s, &mut r).map(drop)
                }
            }
        }
    }
}

/// A store the Python half hands over (an adapter around torch's store): `set(key, bytes)`,
/// `get(key, timeout_s) -> bytes` (raising `TimeoutError`), `add(key, delta) -> int`,
/// `delete(key) -> bool`, `check(keys) -> bool`.
struct PyStore {
    obj: Py<PyAny>,
    name: String,
}

impl PyStore {
    fn fail(&self, e: PyErr) -> tutti_runtime::Error {
        tutti_runtime::Error::Store { addr: self.name.clone(), detail: e.to_string() }
    }

    /// Refuse once the interpreter is exiting ([`at_exit`]): a thread of ours that asks for the
    /// GIL during finalization is ended in a way that aborts the process.
    fn open(&self) -> tutti_runtime::Result<()> {
        if EXITING.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tutti_runtime::Error::Store {
                addr: self.name.clone(),
                detail: "the Python interpreter is exiting".into(),
            });
        }
        Ok(())
    }
}

/// Set by [`at_exit`]: Python stores are not called any more.
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Called from an `atexit` handler: from now on, stores that are Python objects refuse every
/// request (a closing transport's abort note included) instead of taking the GIL.
#[pyfunction]
fn at_exit() {
    EXITING.store(true, std::sync::atomic::Ordering::SeqCst);
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> tutti_runtime::Result<()> {
        self.open()?;
        Python::with_gil(|py| {
            self.obj.call_method1(py, "set", (key, PyBytes::new(py, value))).map(drop)
        })
        .map_err(|e| self.fail(e))
    }

    fn get(&self, key: &str, timeout: Duration) -> tutti_runtime::Result<Vec<u8>> {
        self.open()?;
        Python::with_gil(|py| {
            match self.obj.call_method1(py, "get", (key, timeout.as_secs_f64())) {
                Ok(v) => v.extract::<Vec<u8>>(py).map_err(|e| self.fail(e)),
                Err(e) if e.is_instance_of::<PyTimeoutError>(py) => {
                    Err(tutti_runtime::Error::StoreTimeout {
                        addr: self.name.clone(),
                        key: key.to_string(),
                        after: timeout,
                    })
                }
                Err(e) => Err(self.fail(e)),
            }
        })
    }

    fn add(&self, key: &str, delta: i64) -> tutti_runtime::Result<i64> {
        self.open()?;
        Python::with_gil(|py| self.obj.call_method1(py, "add", (key, delta))?.extract::<i64>(py))
            .map_err(|e| self.fail(e))
    }

    fn delete(&self, key: &str) -> tutti_runtime::Result<bool> {
        self.open()?;
        Python::with_gil(|py| self.obj.call_method1(py, "delete", (key,))?.extract::<bool>(py))
            .map_err(|e| self.fail(e))
    }

    fn check(&self, keys: &[&str]) -> tutti_runtime::Result<bool> {
        self.open()?;
        Python::with_gil(|py| {
            let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
            self.obj.call_method1(py, "check", (keys,))?.extract::<bool>(py)
        })
        .map_err(|e| self.fail(e))
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
    fn detached_calls(&self) -> bool {
        // A thread of ours must not ask for the GIL while the interpreter finalizes.
        false
    }
}

/// A communicator: the ranks of a group and their connections.
#[pyclass(frozen, weakref, module = "tutti._tutti")]
struct Comm {
    /// Dropped without the GIL (see the `Drop` impl).
    inner: std::mem::ManuallyDrop<RComm>,
}

impl Comm {
    fn new(inner: RComm) -> Comm {
        Comm { inner: std::mem::ManuallyDrop::new(inner) }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and never used again.
        let inner = unsafe { std::mem::ManuallyDrop::take(&mut self.inner) };
        // Its last drop joins the worker thread and closes the transport, which may leave an
        // abort note in a store that is a Python object (torch's): that needs the GIL, which
        // this thread holds, so the drop runs without it.
        Python::with_gil(|py| py.allow_threads(move || drop(inner)));
    }
}

/// A collective started with `async_op`: `wait()` blocks (without the GIL) until it ended and
/// raises its error; `is_completed()` does not block.
#[pyclass(module = "tutti._tutti")]
struct Work {
    pending: Mutex<Option<Pending<()>>>,
    /// This rank and the collective, for a timed wait's message.
    rank: usize,
    kind: String,
    /// For a receive from any source: the sender's rank once it arrived (-1 before).
    source: Option<Arc<std::sync::atomic::AtomicI64>>,
    /// The outcome once known: `None` ok, `Some(message)` failed.
    outcome: Mutex<Option<Option<String>>>,
}

impl Work {
    fn settle(&self, r: tutti_collectives::Result<()>) {
        let mut o = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        *o = Some(r.err().map(|e| e.to_string()));
    }

    fn raise(&self) -> PyResult<bool> {
        match &*self.outcome.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(Some(msg)) => Err(TuttiError::new_err(msg.clone())),
            Some(None) => Ok(true),
            None => Ok(false),
        }
    }
}

#[pymethods]
impl Work {
    /// Block until the collective ended (bounded by the group's timeout); raise its error.
    /// Two threads may wait at once: the second returns when the first has the outcome. With
    /// `timeout_s` (seconds, > 0), raise `TimeoutError` if it has not ended by then; it goes on,
    /// and can be waited for again.
    #[pyo3(signature = (timeout_s=None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        // None, zero, negative, NaN, infinite or past `Duration`'s range: no limit.
        let limit =
            timeout_s.filter(|t| *t > 0.0).and_then(|t| Duration::try_from_secs_f64(t).ok());
        // The lock is taken and held without the GIL, so a waiter holds it until the outcome
        // is settled and a second waiter cannot return before then.
        let ended = py.allow_threads(|| {
            let mut g = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            let Some(p) = g.as_mut() else { return true };
            let Some(r) = p.wait_timeout(limit.unwrap_or(Duration::MAX)) else { return false };
            *g = None;
            self.settle(r);
            true
        });
        if !ended {
            return Err(PyTimeoutError::new_err(format!(
                "rank {}: {} (async) did not end within {:.3} s; it is still running and holds \
                 its tensors: wait again, or the group's timeout ends it",
                self.rank,
                self.kind,
                timeout_s.unwrap_or_default()
            )));
        }
        self.raise()
    }

    /// True once the collective ended (successfully or not). Never blocks, also while another
    /// thread waits for it.
    fn is_completed(&self) -> PyResult<bool> {
        let Ok(mut g) = self.pending.try_lock() else {
            // Another thread is inside `wait` (or a poisoned lock): the outcome says.
            return Ok(self.outcome.lock().unwrap_or_else(|e| e.into_inner()).is_some());
        };
        if let Some(p) = g.as_mut() {
            if let Some(r) = p.test() {
                *g = None;
                drop(g);
                self.settle(r);
            }
        }
        Ok(self.outcome.lock().unwrap_or_else(|e| e.into_inner()).is_some())
    }

    /// True when it ended without an error.
    fn is_success(&self) -> PyResult<bool> {
        Ok(self.is_completed()?
            && matches!(&*self.outcome.lock().unwrap_or_else(|e| e.into_inner()), Some(None)))
    }

    /// The error message, if it failed.
    fn exception(&self) -> Option<String> {
        self.outcome.lock().unwrap_or_else(|e| e.into_inner()).clone().flatten()
    }

    /// For a receive from any source, the rank whose message arrived (`None` before, or for
    /// other collectives).
    fn source_rank(&self) -> Option<usize> {
        let v = self.source.as_ref()?.load(std::sync::atomic::Ordering::SeqCst);
        usize::try_from(v).ok()
    }
}

/// A point-to-point entry as Python passes it: (peer, tag, (address, bytes)).
type PyP2p = (usize, u32, (usize, usize));

fn raw(b: (usize, usize)) -> Raw {
    Raw { addr: b.0, count: b.1 }
}

#[pymethods]
impl Comm {
    /// Rendezvous from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT — as set
    /// by torchrun, tutti-run, srun or mpirun — or TUTTI_STORE) and connect.
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<Comm> {
        py.allow_threads(RComm::from_env).map(Comm::new).map_err(err)
    }

    /// Rendezvous on a store someone else serves (the adapter around torch's store) and
    /// connect. `secret` is `("given", token)`, `("file", path)` or `("store", None)`.
    #[staticmethod]
    #[pyo3(signature = (rank, world, store, name, secret_kind, secret, master_ip, timeout_s, connect_timeout_s=None))]
    #[allow(clippy::too_many_arguments)]
    fn on_store(
        py: Python<'_>,
        rank: usize,
        world: usize,
        store: Py<PyAny>,
        name: String,
        secret_kind: &str,
        secret: Option<String>,
        master_ip: Option<String>,
        timeout_s: f64,
        connect_timeout_s: Option<f64>,
    ) -> PyResult<Comm> {
        use tutti_runtime::Secret;
        let secret = match (secret_kind, secret) {
            ("given", Some(t)) => Secret::Given(t),
            ("file", Some(p)) => Secret::LocalFile(p.into()),
            ("store", _) => Secret::ThroughStore,
            (k, _) => return Err(PyValueError::new_err(format!("unknown secret kind {k:?}"))),
        };
        let ip = match master_ip {
            Some(s) => Some(s.parse().map_err(|e| PyValueError::new_err(format!("{s:?}: {e}")))?),
            None => None,
        };
        let store: Arc<dyn Store> = Arc::new(PyStore { obj: store, name });
        py.allow_threads(|| {
            let mut opts = tutti_runtime::Options::from_env()?;
            if std::env::var_os("TUTTI_CONNECT").is_none() {
                // As gloo does (unless TORCH_GLOO_LAZY_INIT): the full mesh at init. Links
                // made later would look addresses up through torch's store, a Python object,
                // from tutti's own threads.
                opts.link.lazy = false;
            }
            if let Some(t) = connect_timeout_s.filter(|t| *t > 0.0) {
                opts.link.connect_timeout = Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX);
            }
            let g = tutti_runtime::init_on_store(rank, world, store, secret, ip, &opts)?;
            if timeout_s > 0.0 {
                // Past `Duration`'s range (or infinite): as long as a group waits.
                g.set_timeout(Duration::try_from_secs_f64(timeout_s).unwrap_or(Duration::MAX));
            }
            Ok::<_, tutti_runtime::Error>(g)
        })
        .map_err(err)
        .and_then(|g| {
            let cfg = tutti_collectives::Config::from_env().map_err(err)?;
            Ok(Comm::new(RComm::with_config(g, cfg)))
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// Ranks in the group.
    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    /// How this rank's link to each rank of the group goes, by rank: `"shm"` (shared memory,
    /// between ranks of one host), `"tcp"` or `"quic"` (the network), `"unconnected"` (no call
    /// has needed it yet: links connect on first use), `"-"` for this rank.
    fn links(&self) -> Vec<&'static str> {
        let g = self.inner.group();
        let t = g.transport();
        (0..g.size())
            .map(|p| if p == g.rank() { "-" } else { t.link_kind(g.global_rank(p)) })
            .collect()
    }

    /// A sub-communicator over `ranks` (every rank calls it; `None` where this rank is not in
    /// it).
    fn split(&self, py: Python<'_>, ranks: Vec<usize>) -> PyResult<Option<Comm>> {
        py.allow_threads(|| self.inner.split(&ranks)).map(|c| c.map(Comm::new)).map_err(err)
    }

    /// A sub-communicator over `ranks` named by `key`, made by its members only (torch calls
    /// a backend only on a new group's members).
    fn split_keyed(&self, py: Python<'_>, ranks: Vec<usize>, key: u64) -> PyResult<Option<Comm>> {
        py.allow_threads(|| self.inner.split_keyed(&ranks, key))
            .map(|c| c.map(Comm::new))
            .map_err(err)
    }

    /// Go on over the members `members` (ranks of this communicator, in their new order)
    /// as a new communicator (see `tutti_collectives::Comm::reconfigure`): this one is aborted
    /// first; the connect may take `timeout_s` seconds. Every member calls it with the same
    /// `uuid` and list.
    fn reconfigure(
        &self,
        py: Python<'_>,
        uuid: u64,
        members: Vec<usize>,
        timeout_s: f64,
    ) -> PyResult<Comm> {
        let within = Duration::try_from_secs_f64(timeout_s.max(0.001)).unwrap_or(Duration::MAX);
        py.allow_threads(|| self.inner.reconfigure(uuid, &members, within))
            .map(Comm::new)
            .map_err(err)
    }

    /// Stop everything, locally and at once: pending and later calls fail, naming `reason`,
    /// and the peers are told.
    fn abort(&self, py: Python<'_>, reason: &str) {
        py.allow_threads(|| self.inner.group().abort(reason));
    }

    /// What stopped this communicator, if anything: `(kind, message)`, with kind `"timeout"`
    /// (an operation ran past its timeout), `"remote"` (a peer aborted or failed and said so),
    /// `"aborted"` (this process aborted it) or `"error"` (a lost connection, a protocol or
    /// mismatch error).
    fn failure(&self) -> Option<(&'static str, String)> {
        use tutti_runtime::Error as E;
        let e = self.inner.group().failure()?;
        let msg = e.to_string();
        // Poison never nests (`Error::poisoned`): one level to look through.
        let cause = match &e {
            E::Poisoned(inner) => inner.as_ref(),
            e => e,
        };
        let kind = match cause {
            E::Timeout { .. } | E::AnySourceTimeout { .. } => "timeout",
            E::PeerAborted { .. } => "remote",
            E::Aborted { .. } => "aborted",
            _ => "error",
        };
        Some((kind, msg))
    }

    /// Set the per-operation timeout, in seconds (past `Duration`'s range: no limit).
    fn set_timeout(&self, timeout_s: f64) {
        if timeout_s > 0.0 {
            self.inner
                .group()
                .set_timeout(Duration::try_from_secs_f64(timeout_s).unwrap_or(Duration::MAX));
        }
    }

    /// Run one collective. `kind` names it; buffers are `(address, count)`; `op` a
    /// reduction name; `counts` the split sizes of `all_to_all_v` (send, recv); `p2p` the
    /// `(peer, tag, (address, bytes))` sends and receives of a batch. With `async_op` it
    /// starts on the communicator's worker and returns a [`Work`]; otherwise it blocks
    /// (without the GIL) and returns `None`.
    #[pyo3(signature = (kind, dtype, a=None, b=None, op=None, root=0, counts=None, sends=None, recvs=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        kind: &str,
        dtype: &str,
        a: Option<(usize, usize)>,
        b: Option<(usize, usize)>,
        op: Option<&str>,
        root: usize,
        counts: Option<(Vec<usize>, Vec<usize>)>,
        sends: Option<Vec<PyP2p>>,
        recvs: Option<Vec<PyP2p>>,
        async_op: bool,
    ) -> PyResult<Option<Work>> {
        let dt = Dt::parse(dtype)?;
        let need = |x: Option<(usize, usize)>, what: &str| {
            x.map(raw).ok_or_else(|| PyValueError::new_err(format!("{kind} needs {what}")))
        };
        let red = || parse_op(op.unwrap_or("sum"));
        let job = match kind {
            "allreduce" => Job::Allreduce { buf: need(a, "a buffer")?, op: red()? },
            "broadcast" => Job::Broadcast { buf: need(a, "a buffer")?, root },
            "reduce" => Job::Reduce { buf: need(a, "a buffer")?, op: red()?, root },
            "allgather" => Job::Allgather { inp: need(a, "an input")?, out: need(b, "an output")? },
            "reduce_scatter" => Job::ReduceScatter {
                inp: need(a, "an input")?,
                out: need(b, "an output")?,
                op: red()?,
            },
            "all_to_all" => Job::AllToAll { inp: need(a, "an input")?, out: need(b, "an output")? },
            "all_to_all_v" => {
                let (send, recv) =
                    counts.ok_or_else(|| PyValueError::new_err("all_to_all_v needs counts"))?;
                Job::AllToAllV { inp: need(a, "an input")?, send, out: need(b, "an output")?, recv }
            }
            "gather" => Job::Gather { inp: need(a, "an input")?, out: need(b, "an output")?, root },
            "scatter" => {
                Job::Scatter { inp: need(a, "an input")?, out: need(b, "an output")?, root }
            }
            "barrier" => Job::Barrier,
            "recv_any" => Job::RecvAny {
                tag: u32::try_from(root)
                    .map_err(|_| PyValueError::new_err(format!("tag {root} is too large")))?,
                buf: need(a, "a receive buffer")?,
                source: Arc::new(std::sync::atomic::AtomicI64::new(-1)),
            },
            "batch" => Job::Batch {
                sends: sends
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(p, t, b)| (p, t, raw(b)))
                    .collect(),
                recvs: recvs
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(p, t, b)| (p, t, raw(b)))
                    .collect(),
            },
            k => return Err(PyValueError::new_err(format!("tutti has no collective {k:?}"))),
        };
        let job = job.in_place(self.inner.rank(), self.inner.size(), dt.size());
        job.check(dt)?;
        let source = match &job {
            Job::RecvAny { source, .. } => Some(source.clone()),
            _ => None,
        };
        if async_op {
            // SAFETY: the Python half keeps every buffer alive and untouched until this
            // Work is waited for (torch's contract for async work, and the Work keeps them).
            let p = self.inner.submit(move |c| unsafe { job.run(c, dt) });
            return Ok(Some(Work {
                pending: Mutex::new(Some(p)),
                rank: self.inner.rank(),
                kind: kind.to_string(),
                source,
                outcome: Mutex::new(None),
            }));
        }
        // SAFETY: the buffers outlive this call, which the Python half makes while holding them.
        py.allow_threads(|| unsafe { job.run(&self.inner, dt) }).map_err(err)?;
        Ok(None)
    }
}

/// The private directory where single-host jobs keep their generated secret (made if
/// missing, checked to be this user's alone).
#[pyfunction]
fn local_secret_dir() -> PyResult<String> {
    tutti_runtime::rendezvous::secret::local_dir().map(|p| p.display().to_string()).map_err(err)
}

/// The native module.
#[pymodule]
fn _tutti(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Comm>()?;
    m.add_class::<Work>()?;
    m.add("TuttiError", m.py().get_type::<TuttiError>())?;
    m.add_function(wrap_pyfunction!(local_secret_dir, m)?)?;
    m.add_function(wrap_pyfunction!(at_exit, m)?)?;
    Ok(())
}
