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

/// The algorithms, each once: adding an algorithm is a line here, its
/// device file `device/<file>.rs` and its host file
/// `host/algorithm/<file>.rs` (ARCHITECTURE.md, "How to add an
/// algorithm"). Every list of algorithms is made from this one:
/// [`AlgorithmId`] here, the device modules, the host's `Algorithm` enum
/// and the table of host sides. A line reads
/// `Variant = id, file, "kebab-name", collective, completion;` where the
/// id is the algorithm's number in error records (never reused), `file`
/// also the kernel entries' prefix (`<file>_<dtype>`), the kebab-case name
/// the one every layer uses (CLI flags, environment knobs, bench ids,
/// tuning files), the [`Collective`] it implements, and how its kernels
/// know the data arrived ([`Completion`], which fixes how they launch).
///
/// `for_each_algorithm!(m)` calls the macro `m` with the list.
#[macro_export]
macro_rules! for_each_algorithm {
    ($then:ident) => {
        $then! {
            /// Every rank reads the whole buffer from every peer (vLLM 1-stage).
            OneShotPull = 1, one_shot_pull, "one-shot-pull", AllReduce, Barrier;
            /// Reduce-scatter by reads, all-gather by reads (vLLM 2-stage).
            TwoShotPull = 2, two_shot_pull, "two-shot-pull", AllReduce, Barrier;
            /// Every rank writes its buffer into every peer; completion in the payload.
            OneShotPush = 3, one_shot_push, "one-shot-push", AllReduce, Payload;
            /// Reduce-scatter by writes, all-gather by writes, staggered peer order.
            TwoShotPush = 4, two_shot_push, "two-shot-push", AllReduce, Payload;
            /// Chunked, pipelined neighbour-only writes.
            Ring = 5, ring, "ring", AllReduce, Barrier;
            /// Reduce inside islands, exchange one share across islands, gather.
            Hierarchical = 6, hierarchical, "hierarchical", AllReduce, Payload;
            /// Ring whose data moves with copy-engine peer copies; small kernels
            /// wait for each piece's flag and reduce it (large messages).
            CopyEngineRing = 8, copy_engine_ring, "copy-engine-ring", AllReduce, CopyEngine;
            /// All-gather: every rank writes its block into its slot of every
            /// peer's receive region (one-shot push's region and protocol);
            /// completion in the payload.
            AllGatherPush = 9, all_gather_push, "all-gather-push", AllGather, Payload;
            /// Reduce-scatter: every rank writes share d of its buffer into
            /// rank d's slot (one-shot push's region and protocol); completion
            /// in the payload.
            ReduceScatterPush = 10, reduce_scatter_push, "reduce-scatter-push", ReduceScatter, Payload;
            /// Hierarchical with its phases in three groups of blocks that run
            /// side by side (large messages: the links carry every phase at once).
            PipelinedHierarchical = 11, pipelined_hierarchical, "pipelined-hierarchical", AllReduce, Payload;
        }
    };
}

/// The collective an algorithm implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Collective {
    /// Every rank ends with the sum of every rank's buffer.
    AllReduce,
    /// Every rank ends with every rank's buffer, in rank order.
    AllGather,
    /// Every rank ends with its share of the sum (share r on rank r).
    ReduceScatter,
}

impl Collective {
    pub const ALL: [Collective; 3] = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter];

    /// The kebab-case name every layer uses (CLI flags, bench ids).
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::AllGather => "all-gather",
            Collective::ReduceScatter => "reduce-scatter",
        }
    }
}

/// How an algorithm's kernels know that a peer's data arrived, which also
/// fixes how they are launched (the register budget `build.rs` gives their
/// entries, the launch shapes the host may use).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Completion {
    /// Flags and barriers between ranks: `THREADS_PER_BLOCK`-thread blocks,
    /// a `DeviceHandle` pointer and scalars as parameters.
    Barrier,
    /// The payload carries its own completion (the sentinel kernels): one
    /// parameter struct by value, any block size up to
    /// `SENTINEL_MAX_THREADS`, as many blocks as stay resident.
    Payload,
    /// Flags raised after copy-engine copies, waited for by small step
    /// kernels: one parameter struct by value, any block size up to
    /// `SENTINEL_MAX_THREADS`.
    CopyEngine,
}

/// Largest block of a kernel that runs with any block size (the
/// [`Completion::Payload`] and [`Completion::CopyEngine`] kernels, and the
/// fused entries marked [`WIDE_ENTRY_MARK`]).
pub const SENTINEL_MAX_THREADS: u32 = 1024;
/// Register budget (`.maxnreg`) of those entries: 65536 / 1024.
pub const SENTINEL_MAX_REGISTERS: u32 = 64;
/// Register budget of every other entry (512-thread blocks: 65536 / 512).
pub const DEFAULT_MAX_REGISTERS: u32 = 128;
/// What names a fused entry with one pack of a row per thread, launched
/// with blocks of up to `SENTINEL_MAX_THREADS` threads.
pub const WIDE_ENTRY_MARK: &str = "_wide_";

/// The register budget of kernel entry `name`: `build.rs` writes it into
/// the PTX as `.maxnreg` (Rust has no launch-bounds attribute) and the
/// host's checks read it back. Entries of algorithms whose kernels launch
/// with any block size get [`SENTINEL_MAX_REGISTERS`], so do the
/// [`WIDE_ENTRY_MARK`] entries; every other entry
/// [`DEFAULT_MAX_REGISTERS`]. (Host only: device code has no use for it.)
#[cfg(not(target_arch = "nvptx64"))]
pub fn max_registers(name: &str) -> u32 {
    let any_shape = AlgorithmId::ALL.iter().any(|a| a.any_block_size() && name.starts_with(a.kernel_prefix()));
    if any_shape || name.contains(WIDE_ENTRY_MARK) {
        SENTINEL_MAX_REGISTERS
    } else {
        DEFAULT_MAX_REGISTERS
    }
}

macro_rules! define_algorithm_ids {
    ($($(#[$doc:meta])* $variant:ident = $id:literal, $file:ident, $name:literal, $collective:ident, $completion:ident;)*) => {
        /// The algorithms implemented by kernels in this crate
        /// ([`for_each_algorithm`](crate::for_each_algorithm)), and the
        /// init-time transfer check. The host's `Algorithm` enum adds the
        /// NCCL fallback on top of the algorithms.
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum AlgorithmId {
            $($(#[$doc])* $variant = $id,)*
            /// Not an algorithm: the init-time transfer check of each peer pair.
            P2pCheck = 7,
        }

        impl AlgorithmId {
            /// Every algorithm (not the transfer check), in id order.
            pub const ALL: [AlgorithmId; [$($id),*].len()] = [$(AlgorithmId::$variant),*];

            /// snake_case name: the kernel entry prefix (`one_shot_pull_bf16`)
            /// and the name of the algorithm's files.
            pub const fn kernel_prefix(self) -> &'static str {
                match self {
                    $(AlgorithmId::$variant => stringify!($file),)*
                    AlgorithmId::P2pCheck => "p2p_check",
                }
            }

            /// The kebab-case name every layer uses (`one-shot-pull`).
            pub const fn name(self) -> &'static str {
                match self {
                    $(AlgorithmId::$variant => $name,)*
                    AlgorithmId::P2pCheck => "p2p-check",
                }
            }

            /// The collective it implements (`None` for the transfer check).
            pub const fn collective(self) -> Option<Collective> {
                match self {
                    $(AlgorithmId::$variant => Some(Collective::$collective),)*
                    AlgorithmId::P2pCheck => None,
                }
            }

            /// How its kernels know the data arrived (the transfer check:
            /// flags, one block).
            pub const fn completion(self) -> Completion {
                match self {
                    $(AlgorithmId::$variant => Completion::$completion,)*
                    AlgorithmId::P2pCheck => Completion::Barrier,
                }
            }

            pub const fn from_u32(v: u32) -> Option<AlgorithmId> {
                match v {
                    $($id => Some(AlgorithmId::$variant),)*
                    7 => Some(AlgorithmId::P2pCheck),
                    _ => None,
                }
            }
        }
    };
}

for_each_algorithm!(define_algorithm_ids);

impl AlgorithmId {
    /// A sentinel algorithm: the payload carries its completion
    /// ([`Completion::Payload`]).
    pub const fn sentinel(self) -> bool {
        matches!(self.completion(), Completion::Payload)
    }

    /// Its kernels launch with any block size up to
    /// [`SENTINEL_MAX_THREADS`] and take one parameter struct by value.
    pub const fn any_block_size(self) -> bool {
        matches!(self.completion(), Completion::Payload | Completion::CopyEngine)
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
