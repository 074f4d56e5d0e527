//! Identifiers shared by host and device: element types, algorithms, barrier
//! phases and error codes. Each is a `u32` on the wire (kernel parameters and
//! the [`ErrorRecord`](crate::layout::ErrorRecord)).

/// Element type of an allreduce. All types are accumulated in `f32`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
}

impl DType {
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Name used in kernel entry points, bench ids and CLI flags.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }

    pub const fn from_u32(v: u32) -> Option<DType> {
        match v {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::Bf16),
            _ => None,
        }
    }
}

/// The allreduce algorithms implemented by kernels in this crate. The host's
/// `Algorithm` enum adds the NCCL fallback on top of these.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AlgorithmId {
    /// Every rank reads the whole buffer from every peer (vLLM 1-stage).
    OneShotPull = 1,
    /// Reduce-scatter by reads, all-gather by reads (vLLM 2-stage).
    TwoShotPull = 2,
    /// Every rank writes its buffer into every peer; completion in the payload.
    OneShotPush = 3,
    /// Reduce-scatter by writes, all-gather by writes, staggered peer order.
    TwoShotPush = 4,
    /// Chunked, pipelined neighbour-only writes.
    Ring = 5,
    /// Reduce inside islands, exchange one share across islands, gather.
    Hierarchical = 6,
    /// Not an allreduce: the init-time transfer check of each peer pair.
    P2pCheck = 7,
    /// Ring whose data moves with copy-engine peer copies; small kernels
    /// wait for each piece's flag and reduce it.
    CopyEngineRing = 8,
}

impl AlgorithmId {
    pub const ALLREDUCE: [AlgorithmId; 7] = [
        AlgorithmId::OneShotPull,
        AlgorithmId::TwoShotPull,
        AlgorithmId::OneShotPush,
        AlgorithmId::TwoShotPush,
        AlgorithmId::Ring,
        AlgorithmId::Hierarchical,
        AlgorithmId::CopyEngineRing,
    ];

    /// snake_case name: the kernel entry prefix (`one_shot_pull_bf16`).
    pub const fn kernel_prefix(self) -> &'static str {
        match self {
            AlgorithmId::OneShotPull => "one_shot_pull",
            AlgorithmId::TwoShotPull => "two_shot_pull",
            AlgorithmId::OneShotPush => "one_shot_push",
            AlgorithmId::TwoShotPush => "two_shot_push",
            AlgorithmId::Ring => "ring",
            AlgorithmId::Hierarchical => "hierarchical",
            AlgorithmId::P2pCheck => "p2p_check",
            AlgorithmId::CopyEngineRing => "copy_engine_ring",
        }
    }

    pub const fn from_u32(v: u32) -> Option<AlgorithmId> {
        match v {
            1 => Some(AlgorithmId::OneShotPull),
            2 => Some(AlgorithmId::TwoShotPull),
            3 => Some(AlgorithmId::OneShotPush),
            4 => Some(AlgorithmId::TwoShotPush),
            5 => Some(AlgorithmId::Ring),
            6 => Some(AlgorithmId::Hierarchical),
            7 => Some(AlgorithmId::P2pCheck),
            8 => Some(AlgorithmId::CopyEngineRing),
            _ => None,
        }
    }
}

/// A synchronisation point of a kernel. Phases `0..FLAG_PHASES` own one flag
/// array each in the [`SignalBlock`](crate::layout::SignalBlock); the others
/// only appear in error records.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Pull algorithms: every rank's input is ready to be read.
    Start = 0,
    /// TwoShotPull: every rank's reduced slice is ready to be read.
    Mid = 1,
    /// Pull algorithms: every rank finished reading its peers' buffers.
    End = 2,
    /// The flag phases of the former (barrier-based) TwoShotPush and
    /// Hierarchical; kept so that the signal block's layout and old error
    /// records stay decodable. No kernel uses them any more.
    PushScatter = 3,
    PushGather = 4,
    HierScatter = 5,
    HierCross = 6,
    HierGather = 7,
    /// Ring: "message n is in your slot" (sender -> receiver).
    RingData = 8,
    /// Ring: "I consumed message n, its slot is free" (receiver -> sender).
    RingCredit = 9,
    /// OneShotPush: polling for a payload that carries its own completion.
    Payload = 10,
    /// Kernel start: the communicator was already aborted.
    Prologue = 11,
    /// TwoShotPush / Hierarchical: polling the reduce-scatter payload (a
    /// share's contributions from the other members).
    RsPayload = 12,
    /// TwoShotPush / Hierarchical: polling the all-gather payload (a
    /// share's final sum from its owner).
    AgPayload = 13,
    /// Hierarchical: polling the cross-island payload (a share's partial
    /// sums from the other islands' owners).
    CrossPayload = 14,
    /// CopyEngineRing: waiting for the flag of a staging slot the previous
    /// rank's copy engine fills.
    CeData = 15,
    /// CopyEngineRing: waiting for the next rank's "staging consumed"
    /// handshake of the previous call before copying into its staging.
    CeHandshake = 16,
}

/// Number of phases that own a flag array in the signal block.
pub const FLAG_PHASES: usize = 10;

impl Phase {
    pub const fn from_u32(v: u32) -> Option<Phase> {
        match v {
            0 => Some(Phase::Start),
            1 => Some(Phase::Mid),
            2 => Some(Phase::End),
            3 => Some(Phase::PushScatter),
            4 => Some(Phase::PushGather),
            5 => Some(Phase::HierScatter),
            6 => Some(Phase::HierCross),
            7 => Some(Phase::HierGather),
            8 => Some(Phase::RingData),
            9 => Some(Phase::RingCredit),
            10 => Some(Phase::Payload),
            11 => Some(Phase::Prologue),
            12 => Some(Phase::RsPayload),
            13 => Some(Phase::AgPayload),
            14 => Some(Phase::CrossPayload),
            15 => Some(Phase::CeData),
            16 => Some(Phase::CeHandshake),
            _ => None,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Phase::Start => "start barrier",
            Phase::Mid => "mid barrier",
            Phase::End => "end barrier",
            Phase::PushScatter => "push reduce-scatter",
            Phase::PushGather => "push all-gather",
            Phase::HierScatter => "island reduce-scatter",
            Phase::HierCross => "cross-island exchange",
            Phase::HierGather => "island all-gather",
            Phase::RingData => "ring data",
            Phase::RingCredit => "ring credit",
            Phase::Payload => "payload arrival",
            Phase::Prologue => "kernel prologue",
            Phase::RsPayload => "reduce-scatter payload arrival",
            Phase::AgPayload => "all-gather payload arrival",
            Phase::CrossPayload => "cross-island payload arrival",
            Phase::CeData => "copy-engine ring data flag",
            Phase::CeHandshake => "copy-engine ring staging handshake",
        }
    }
}

/// Error codes a kernel writes into the host-visible error record.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceErrorCode {
    None = 0,
    /// A bounded wait on a peer exceeded the communicator's timeout.
    Timeout = 1,
    /// A peer published its abort flag while this rank waited on it.
    PeerAborted = 2,
    /// A pull kernel found a null peer address: a graph-captured buffer that
    /// was never registered (`register_graph_buffers` not called).
    UnregisteredBuffer = 3,
    /// The launch does not fit the communicator's scratch layout (host bug).
    BadLaunch = 4,
    /// The P2P check read back a wrong pattern.
    P2pMismatch = 5,
    /// A peer's process exited while the communicator was in use (recorded
    /// by the host-side watchdog, never by a kernel).
    PeerExited = 6,
}

impl DeviceErrorCode {
    pub const fn from_u32(v: u32) -> Option<DeviceErrorCode> {
        match v {
            0 => Some(DeviceErrorCode::None),
            1 => Some(DeviceErrorCode::Timeout),
            2 => Some(DeviceErrorCode::PeerAborted),
            3 => Some(DeviceErrorCode::UnregisteredBuffer),
            4 => Some(DeviceErrorCode::BadLaunch),
            5 => Some(DeviceErrorCode::P2pMismatch),
            6 => Some(DeviceErrorCode::PeerExited),
            _ => None,
        }
    }
}
