//! The one error type of the library. Library code never panics or exits on
//! a CUDA, IPC, rendezvous or bad-input error: it returns one of these, and
//! each message names what failed and what to do about it.

#![forbid(unsafe_code)]

use std::fmt;

use tp_allreduce_kernels::ids::{AlgorithmId, DeviceErrorCode, Phase};
use tp_allreduce_kernels::layout::ErrorRecord;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {code} ({message})")]
    Driver { call: &'static str, code: String, message: String },

    /// The CUDA driver library could not be loaded (no NVIDIA driver).
    #[error("no CUDA driver: {0}")]
    NoDriver(String),

    /// The caller broke an API rule (lengths, dtypes, pointers, streams...).
    #[error("invalid usage: {0}")]
    InvalidUsage(String),

    /// The request is valid but this library does not implement it (e.g. a
    /// reduction other than sum); the message names the alternative.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// A kernel's bounded wait on a peer gave up. The communicator is broken.
    #[error("{0}")]
    Timeout(DeviceFailure),

    /// A peer rank aborted (its own error record names the cause).
    #[error("{0}")]
    PeerAborted(DeviceFailure),

    /// A kernel refused to run; see the failure's code.
    #[error("{0}")]
    Device(DeviceFailure),

    /// An earlier error broke the communicator; create a new one.
    #[error("communicator is unusable after an earlier error: {0}")]
    Broken(String),

    /// Rendezvous (all-gather of init data between ranks) failed.
    #[error("rendezvous: {0}")]
    Rendezvous(String),

    /// A rendezvous step did not complete in time.
    #[error("rendezvous timed out after {waited_ms} ms: {what}")]
    RendezvousTimeout { what: String, waited_ms: u64 },

    /// A peer sent a malformed, foreign or hostile rendezvous message.
    #[error("rendezvous protocol violation from {from}: {what}")]
    Protocol { from: String, what: String },

    /// CUDA IPC export/import failed.
    #[error("CUDA IPC: {0}")]
    Ipc(String),

    /// The init-time P2P transfer check failed on a pair (data corrupted).
    #[error("P2P check failed between rank {rank} and rank {peer}: {what}")]
    P2pCheck { rank: usize, peer: usize, what: String },

    /// NCCL (the fallback/baseline) failed or is not available.
    #[error("NCCL: {0}")]
    Nccl(String),

    /// Topology discovery, tuning-table or configuration file problems.
    #[error("configuration: {0}")]
    Config(String),

    /// An operating-system call failed (sockets, files, processes).
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { what: what.into(), source }
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidUsage(msg.into())
    }

    /// True for errors after which the communicator must be recreated.
    pub fn breaks_communicator(&self) -> bool {
        matches!(self, Error::Timeout(_) | Error::PeerAborted(_) | Error::Device(_) | Error::Broken(_))
    }
}

/// What a kernel wrote into its error record, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFailure {
    pub code: Option<DeviceErrorCode>,
    pub algorithm: Option<AlgorithmId>,
    pub phase: Option<Phase>,
    pub rank: u32,
    /// The rank waited on, if any.
    pub peer: Option<u32>,
    pub block: u32,
    pub epoch: u32,
    pub expected: u32,
    pub observed: u32,
    pub waited_ns: u64,
}

impl DeviceFailure {
    pub fn from_record(r: &ErrorRecord) -> Self {
        DeviceFailure {
            code: DeviceErrorCode::from_u32(r.code),
            algorithm: AlgorithmId::from_u32(r.algorithm),
            phase: Phase::from_u32(r.phase),
            rank: r.rank,
            peer: if r.peer == u32::MAX { None } else { Some(r.peer) },
            block: r.block,
            epoch: r.epoch,
            expected: r.expected,
            observed: r.observed,
            waited_ns: r.waited_ns,
        }
    }

    pub fn into_error(self) -> Error {
        match self.code {
            Some(DeviceErrorCode::Timeout) => Error::Timeout(self),
            Some(DeviceErrorCode::PeerAborted | DeviceErrorCode::PeerExited) => Error::PeerAborted(self),
            _ => Error::Device(self),
        }
    }
}

impl fmt::Display for DeviceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let algo = self.algorithm.map(|a| a.kernel_prefix()).unwrap_or("unknown kernel");
        let phase = self.phase.map(|p| p.name()).unwrap_or("unknown phase");
        match self.code {
            Some(DeviceErrorCode::Timeout) => write!(
                f,
                "timeout: rank {} waited {:.1} ms for rank {} in {} ({}, block {}, epoch {}: expected flag {}, saw {}); \
                 that rank's kernel did not get there. Either it is not running the same collective (crashed, hung, \
                 or issued a different sequence of calls), or its kernel could not start because other kernels held \
                 its GPU's SMs: another communicator's collective in flight on the same GPU (from another process, \
                 or graphs of two communicators replayed concurrently; eager calls of communicators in one process \
                 take turns), or a kernel running longer than the launch timeout; or one of the two ran two calls of \
                 this communicator at once (graphs replayed on unordered streams)",
                self.rank,
                self.waited_ns as f64 / 1e6,
                self.peer.map(|p| p.to_string()).unwrap_or_else(|| "?".into()),
                phase,
                algo,
                self.block,
                self.epoch,
                self.expected,
                self.observed
            ),
            Some(DeviceErrorCode::PeerAborted) => write!(
                f,
                "rank {} stopped in {} ({}) because rank {} aborted after its own error",
                self.rank,
                phase,
                algo,
                self.peer.map(|p| p.to_string()).unwrap_or_else(|| "?".into())
            ),
            Some(DeviceErrorCode::UnregisteredBuffer) => write!(
                f,
                "rank {}: {} ran on a graph-captured buffer that is not registered (never registered, or \
                 released by deregister_buffers()); call register_graph_buffers() on every rank after capture \
                 and before replay, and do not replay graphs captured before deregister_buffers()",
                self.rank, algo
            ),
            Some(DeviceErrorCode::BadLaunch) => write!(
                f,
                "rank {}: {} launch does not fit the communicator's scratch layout (internal error, detail {})",
                self.rank, algo, self.expected
            ),
            Some(DeviceErrorCode::P2pMismatch) => write!(f, "rank {}: P2P check mismatch", self.rank),
            Some(DeviceErrorCode::PeerExited) => write!(
                f,
                "rank {}: the process of rank {} exited while the communicator was in use (noticed by the \
                 watchdog after {:.1} ms); the communicator is broken",
                self.rank,
                self.peer.map(|p| p.to_string()).unwrap_or_else(|| "?".into()),
                self.waited_ns as f64 / 1e6
            ),
            _ => write!(f, "rank {}: unknown device error code", self.rank),
        }
    }
}

/// Converts a cudarc driver error with the name of the call that failed.
pub fn driver(call: &'static str, e: cudarc::driver::DriverError) -> Error {
    let code = format!("{:?}", e.0);
    let message = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Error::Driver { call, code, message }
}

/// `?` on cudarc's driver calls (e.g. `CudaContext::new`, `clone_dtoh`)
/// inside functions returning this crate's [`Result`].
impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        driver("a cudarc driver call", e)
    }
}
