//! Memory layouts shared by the host and the kernels.
//!
//! Every struct here is `#[repr(C)]`, has its size pinned by a compile-time
//! assert, and is documented with *who writes it* and *who reads it*: that is
//! the part of the memory-ordering contract (ARCHITECTURE.md) a layout can
//! express. Raising [`MAX_RANKS`] to 16 is a one-constant change: every array
//! indexed by rank is sized by it and every unrolled rank loop is bounded by it.

use crate::ids::FLAG_PHASES;
pub use crate::partition::PACK_BYTES;

/// Largest world size a communicator supports.
pub const MAX_RANKS: usize = 8;
/// Largest grid (blocks per launch) of any kernel; flag arrays are per block.
pub const MAX_BLOCKS: usize = 128;
/// Threads per block of every allreduce kernel.
pub const THREADS_PER_BLOCK: u32 = 512;
/// Words of the init-time P2P transfer check, per direction and peer: a
/// 16 KiB burst of 16-byte stores (several pages, so a broken IOMMU mapping
/// of one page shows).
pub const P2P_CHECK_WORDS: usize = 4096;
/// The bit pattern a sentinel (OneShotPush) receive word holds until its
/// payload lands ("EMPTY"). Inputs whose elements equal the all-ones pattern
/// are canonicalised to the type's quiet NaN first, so no real payload word
/// is all ones.
pub const SENTINEL_EMPTY_WORD: u32 = 0xFFFF_FFFF;
/// AllGather's escape marker: a payload word that travels as this value is
/// either [`SENTINEL_EMPTY_WORD`] or this value itself, which the pack's
/// escape word tells apart (`device/all_gather_push.rs`).
pub const ALL_GATHER_ESCAPE_WORD: u32 = 0xFFFF_FFFE;

/// One rank's peer-visible signal block.
///
/// Placement: device memory exported over CUDA IPC (or a plain pointer inside
/// one process); host memory mapped into every rank for the HostStaged
/// transport. Written only by *remote* ranks through `st.release.sys`, read by
/// the owner through `ld.acquire.sys`; `abort` is the exception (owner writes,
/// peers read). Never written with atomics: peer atomics are not guaranteed
/// over PCIe nor to host memory.
#[repr(C, align(128))]
pub struct SignalBlock {
    /// `flags[phase][block][src]`: the last epoch rank `src`'s block `block`
    /// announced for `phase`. Monotonic (wrapping) per slot; compared with a
    /// wrap-aware `>=`, so no slot is ever reset.
    pub flags: [[[u32; MAX_RANKS]; MAX_BLOCKS]; FLAG_PHASES],
    /// Nonzero once this rank recorded an error (the error code). Peers poll
    /// it while they wait on this rank so that they fail fast, not by timeout.
    pub abort: u32,
    pub _pad0: [u32; 31],
    /// P2P check: `p2p_flag[src]` is [`p2p_flag`]`(src, salt)` once rank
    /// `src` has written its burst into `p2p_inbox[src]` and its own
    /// `p2p_outbox` (`st.release.sys` after a block barrier: data before flag).
    pub p2p_flag: [u32; MAX_RANKS],
    pub _pad1: [u32; 32 - MAX_RANKS],
    /// P2P check: the pattern the owner's kernel writes; peers read it
    /// (non-posted reads) after acquiring the owner's flag.
    pub p2p_outbox: [u32; P2P_CHECK_WORDS],
    /// P2P check: `p2p_inbox[src]` is the burst rank `src` wrote (posted writes).
    pub p2p_inbox: [[u32; P2P_CHECK_WORDS]; MAX_RANKS],
}

/// One rank's private kernel state (device memory, never seen by peers).
/// Read and written only by this rank's kernels; kernel boundaries on the
/// rank's stream order one call's update before the next call's read.
#[repr(C, align(128))]
pub struct LocalState {
    /// Abort, sentinel generations, arrivals, error claim (see [`Control`]).
    pub control: Control,
    /// Per-block epoch of the barrier-based (pull) kernels.
    pub barrier_epoch: [u32; MAX_BLOCKS],
    /// Unused since TwoShotPush and Hierarchical carry completion in the
    /// payload (their generations are in [`Control`]); kept so that the
    /// layout (and the counter seeding of the tests) stays as it was.
    pub two_shot_push_epoch: [u32; MAX_BLOCKS],
    pub hierarchical_epoch: [u32; MAX_BLOCKS],
    /// Per-block count of ring messages sent to the right neighbour.
    pub ring_sent: [u32; MAX_BLOCKS],
    /// Per-block count of ring messages received from the left neighbour.
    pub ring_received: [u32; MAX_BLOCKS],
    /// P2P check, per source rank: the last value of its `p2p_flag` this
    /// rank saw (not [`p2p_flag`]`(src, salt)`: the flag never arrived).
    pub p2p_flag_seen: [u32; MAX_RANKS],
    /// P2P check, per source rank: words of its burst into this rank's inbox
    /// that were wrong when read after its flag.
    pub p2p_pushed_bad: [u32; MAX_RANKS],
    /// P2P check, per source rank: words of its outbox read wrong after its flag.
    pub p2p_pulled_bad: [u32; MAX_RANKS],
}

/// Rank-local control words, in the rank's private device memory
/// (`LocalState::control`), never written by peers.
///
/// * `abort`: sticky; set by every failing thread of any kernel of this rank
///   (`st.relaxed.gpu`), together with the peer-visible `SignalBlock::abort`
///   that peers poll (`st.release.sys`). Sentinel kernels read it at entry
///   (the flag kernels read the signal block's copy).
/// * `generation[r]`: launches of sentinel region `r` (`params::RegionId`) started on this rank (wrapping
///   u32; its parity picks the receive half). Read by every thread at entry
///   (one `ld.relaxed.gpu.v4` with `abort`), advanced by the last block of a
///   launch to arrive (`arrivals[r]`, counted after that block's pushes),
///   at the end of the kernel where it finishes late
///   (`sentinel::FINISH_GENERATION_LATE` and the fused kernels), else
///   right after the count.
/// * `error_claim`: elects the one thread that fills the error record
///   (`atom.cas.gpu`).
///
/// Kept in device memory (not in the peer-visible signal block) because the
/// arrival and claim atomics must never touch host memory, which is where
/// the signal block lives with the host-staged transport.
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Control {
    pub abort: u32,
    pub generation: [u32; 3],
    /// Blocks of the running launch of region `r` that have read
    /// `generation[r]` (reset to 0 by the last one). `[3]`: blocks of the
    /// running CopyEngineRing step kernel that have seen its flag.
    pub arrivals: [u32; 4],
    pub error_claim: u32,
    pub _pad: [u32; 23],
}

/// Where a kernel reports why it stopped. Pinned host memory mapped into the
/// device, so the host reads it without synchronising any stream.
///
/// Written once per communicator by the thread that wins
/// `Control::error_claim`: all fields with plain stores, then `published`
/// with `st.release.sys`. The host reads `published` (volatile) first and the
/// fields after an acquire fence.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErrorRecord {
    pub published: u32,
    /// A [`DeviceErrorCode`](crate::ids::DeviceErrorCode).
    pub code: u32,
    /// An [`AlgorithmId`](crate::ids::AlgorithmId).
    pub algorithm: u32,
    /// A [`Phase`](crate::ids::Phase).
    pub phase: u32,
    pub rank: u32,
    /// The rank waited on (or `u32::MAX`).
    pub peer: u32,
    pub block: u32,
    pub epoch: u32,
    /// The flag value waited for and the last value seen.
    pub expected: u32,
    pub observed: u32,
    /// How long the wait lasted before it gave up.
    pub waited_ns: u64,
    pub _pad: [u32; 4],
}

/// Addresses of one logical buffer on every rank, as *this* rank maps them
/// (the vLLM `RankData`). Pull kernels take a device pointer to one of these.
/// A zero entry means "not registered"; kernels refuse it.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerPointers {
    pub ptrs: [u64; MAX_RANKS],
}

/// How island members are arranged (consecutive islands of equal size
/// only; `island_count <= 1` otherwise). No kernel reads it any more: the
/// Hierarchical kernel takes its island tables by value
/// (`params::IslandPushParams`).
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IslandLayout {
    pub island_count: u32,
    pub island_size: u32,
    /// Island of this rank and its index inside it.
    pub my_island: u32,
    pub my_index: u32,
    /// `members[island][index]` = rank.
    pub members: [[u8; MAX_RANKS]; MAX_RANKS],
}

/// Capacities that decide the scratch layout; chosen by the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchConfig {
    pub world_size: u32,
    /// Largest message (in packs) one launch of a two-shot/ring/hierarchical
    /// kernel handles; the host splits longer messages.
    pub max_packs: u64,
    /// Largest message (in packs) of OneShotPush (0 disables it).
    pub one_shot_push_max_packs: u64,
    pub ring_blocks: u32,
    pub ring_slots: u32,
    pub ring_chunk_packs: u64,
    /// Hierarchical: the size of each island (`island_count` of them; 0
    /// disables it). Unequal islands are allowed (`crate::shares`).
    pub island_sizes: [u32; MAX_RANKS],
    pub island_count: u32,
    /// CopyEngineRing: pieces per shard (0 disables it).
    pub copy_engine_pieces: u32,
    pub enable_two_shot_pull: bool,
    pub enable_two_shot_push: bool,
    pub enable_ring: bool,
}

/// Byte offsets of each algorithm's region inside a rank's scratch buffer.
/// Regions never overlap, so calls of different algorithms may be in flight
/// on different ranks at once without touching each other's data.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScratchLayout {
    pub max_packs: u64,
    /// TwoShotPull: this rank's reduced slice, `two_shot_pull_packs` packs.
    pub two_shot_pull_offset: u64,
    pub two_shot_pull_packs: u64,
    /// OneShotPush: `[half 0|1][slot 0..world-1][one_shot_push_max_packs]`
    /// packs; slot `one_shot_push_slot(src, me)` holds source `src`'s payload.
    pub one_shot_push_offset: u64,
    pub one_shot_push_max_packs: u64,
    /// Bytes from half 0 to half 1 (`(world - 1) * max_packs * 16`).
    pub one_shot_push_half_bytes: u64,
    /// TwoShotPush (one island of every rank, `crate::shares`): per half,
    /// `world - 1` reduce-scatter then `world - 1` all-gather slots of
    /// `two_shot_push_share_packs` packs.
    pub two_shot_push_offset: u64,
    pub two_shot_push_share_packs: u64,
    pub two_shot_push_half_bytes: u64,
    /// Hierarchical (`crate::shares`): per half, each rank's reduce-scatter,
    /// cross and all-gather slots; the halves `hierarchical_half_bytes` apart.
    pub hierarchical_offset: u64,
    pub hierarchical_share_packs: u64,
    pub hierarchical_half_bytes: u64,
    /// Ring: `[ring_blocks][ring_slots][ring_chunk_packs]`.
    pub ring_offset: u64,
    pub ring_chunk_packs: u64,
    /// CopyEngineRing: staging `[2 (world - 1) steps][slot bytes]` (a slot
    /// holds a shard), then one flag line (128 B) per (step, piece), then the
    /// handshake line.
    pub copy_engine_offset: u64,
    pub copy_engine_slot_bytes: u64,
    pub copy_engine_flags_offset: u64,
    pub copy_engine_handshake_offset: u64,
    pub ring_blocks: u32,
    pub ring_slots: u32,
    /// Hierarchical: shares per launch (the largest island) and islands.
    pub island_shares: u32,
    pub island_count: u32,
    pub copy_engine_pieces: u32,
    pub _pad: u32,
    pub total_bytes: u64,
}

/// What a kernel needs to know about its communicator; one per rank, in
/// device memory, written by the host at init and never changed afterwards
/// (so graph replays can rely on it). Kernels take a pointer to it.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceHandle {
    pub rank: u32,
    pub world_size: u32,
    /// Bound of every spin-wait, read against `%globaltimer`.
    pub timeout_ns: u64,
    /// Address (in this rank's address space) of each rank's [`SignalBlock`].
    pub signals: [u64; MAX_RANKS],
    /// Address of each rank's scratch buffer (layout: `scratch_layout`).
    pub scratch: [u64; MAX_RANKS],
    /// This rank's [`LocalState`].
    pub local_state: u64,
    /// This rank's [`ErrorRecord`] (device address of pinned host memory).
    pub error_record: u64,
    pub scratch_layout: ScratchLayout,
    pub islands: IslandLayout,
    /// Bound of a wait on a peer that has shown nothing of the current call
    /// yet (it may not have launched it: first-call JIT, model-load skew);
    /// once a wait of the call succeeded, waits use `timeout_ns`.
    pub launch_timeout_ns: u64,
}

const fn div_ceil(a: u64, b: u64) -> u64 {
    if b == 0 {
        0
    } else {
        a.div_ceil(b)
    }
}

const fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Alignment of every scratch region (a cache line).
pub const SCRATCH_REGION_ALIGN: u64 = 128;

impl ScratchLayout {
    /// The layout for `config`. Pure: host code, tests and (through the
    /// handle) kernels all see the same numbers.
    pub const fn new(config: &ScratchConfig) -> ScratchLayout {
        let world = config.world_size as u64;
        let pack = PACK_BYTES as u64;
        let mut offset = 0u64;

        let two_shot_pull_packs = if config.enable_two_shot_pull { div_ceil(config.max_packs, world) } else { 0 };
        let two_shot_pull_offset = offset;
        offset = align_up(offset + two_shot_pull_packs * pack, SCRATCH_REGION_ALIGN);

        let one_shot_push_half_bytes = world.saturating_sub(1) * config.one_shot_push_max_packs * pack;
        let one_shot_push_offset = offset;
        offset = align_up(offset + 2 * one_shot_push_half_bytes, SCRATCH_REGION_ALIGN);

        // TwoShotPush: the island push with one island of every rank.
        let (two_shot_push_share_packs, two_shot_push_half_bytes) = if config.enable_two_shot_push && world >= 2 {
            let mut sizes = [0u32; MAX_RANKS];
            sizes[0] = config.world_size;
            let cap = div_ceil(config.max_packs, world);
            (cap, crate::shares::half_bytes(&sizes, 1, cap))
        } else {
            (0, 0)
        };
        let two_shot_push_offset = offset;
        offset = align_up(offset + 2 * two_shot_push_half_bytes, SCRATCH_REGION_ALIGN);

        let (island_shares, hierarchical_share_packs, hierarchical_half_bytes) = hierarchical_region(config);
        let hierarchical_offset = offset;
        offset = align_up(offset + 2 * hierarchical_half_bytes, SCRATCH_REGION_ALIGN);

        let (ring_blocks, ring_slots, ring_chunk_packs) = if config.enable_ring {
            (config.ring_blocks, config.ring_slots, config.ring_chunk_packs)
        } else {
            (0, 0, 0)
        };
        let ring_offset = offset;
        offset =
            align_up(offset + ring_blocks as u64 * ring_slots as u64 * ring_chunk_packs * pack, SCRATCH_REGION_ALIGN);

        // CopyEngineRing: one slot per step holds the largest shard (its
        // pieces at their offsets in the shard).
        let pieces = if world >= 2 { config.copy_engine_pieces as u64 } else { 0 };
        let steps = 2 * world.saturating_sub(1);
        let copy_engine_slot_bytes =
            if pieces > 0 { align_up(div_ceil(config.max_packs, world) * pack, 256) } else { 0 };
        let copy_engine_offset = offset;
        offset = align_up(offset + steps * copy_engine_slot_bytes, SCRATCH_REGION_ALIGN);
        let copy_engine_flags_offset = offset;
        offset += steps * pieces * COPY_ENGINE_FLAG_STRIDE;
        let copy_engine_handshake_offset = offset;
        if pieces > 0 {
            offset += COPY_ENGINE_FLAG_STRIDE;
        }
        offset = align_up(offset, SCRATCH_REGION_ALIGN);

        ScratchLayout {
            max_packs: config.max_packs,
            two_shot_pull_offset,
            two_shot_pull_packs,
            one_shot_push_offset,
            one_shot_push_max_packs: config.one_shot_push_max_packs,
            one_shot_push_half_bytes,
            two_shot_push_offset,
            two_shot_push_share_packs,
            two_shot_push_half_bytes,
            hierarchical_offset,
            hierarchical_share_packs,
            hierarchical_half_bytes,
            ring_offset,
            ring_chunk_packs,
            copy_engine_offset,
            copy_engine_slot_bytes,
            copy_engine_flags_offset,
            copy_engine_handshake_offset,
            ring_blocks,
            ring_slots,
            island_shares,
            island_count: if island_shares > 0 { config.island_count } else { 0 },
            copy_engine_pieces: pieces as u32,
            _pad: 0,
            total_bytes: offset,
        }
    }

    /// Byte offset of OneShotPush receive slot `slot` (half 0, pack 0); half
    /// 1 is `one_shot_push_half_bytes` further.
    pub const fn one_shot_push_slot_offset(&self, slot: u32) -> u64 {
        self.one_shot_push_offset + slot as u64 * self.one_shot_push_max_packs * PACK_BYTES as u64
    }

    /// Byte offset of ring slot `slot` of block `block`.
    pub const fn ring_slot_offset(&self, block: u32, slot: u32) -> u64 {
        self.ring_offset
            + ((block as u64 * self.ring_slots as u64 + slot as u64) * self.ring_chunk_packs) * PACK_BYTES as u64
    }

    /// Byte offset of the CopyEngineRing staging slot of `step`.
    pub const fn copy_engine_slot_offset(&self, step: u32) -> u64 {
        self.copy_engine_offset + step as u64 * self.copy_engine_slot_bytes
    }

    /// Byte offset of the CopyEngineRing flag of `step`, `piece` (one
    /// 128-byte line each: lines written by a peer are never shared).
    pub const fn copy_engine_flag_offset(&self, step: u32, piece: u32) -> u64 {
        self.copy_engine_flags_offset
            + (step as u64 * self.copy_engine_pieces as u64 + piece as u64) * COPY_ENGINE_FLAG_STRIDE
    }
}

/// Hierarchical's `(shares, share_cap, half_bytes)` for `config`'s
/// islands: all zero unless they are two or more of a supported shape.
const fn hierarchical_region(config: &ScratchConfig) -> (u32, u64, u64) {
    let islands = config.island_count as usize;
    if islands < 2 || !crate::shares::shape_supported(&config.island_sizes, islands) {
        return (0, 0, 0);
    }
    let mut shares = 0u32;
    let mut g = 0;
    while g < islands {
        if config.island_sizes[g] > shares {
            shares = config.island_sizes[g];
        }
        g += 1;
    }
    let cap = div_ceil(config.max_packs, shares as u64);
    (shares, cap, crate::shares::half_bytes(&config.island_sizes, islands, cap))
}

/// Distance between two CopyEngineRing flags (a cache line).
pub const COPY_ENGINE_FLAG_STRIDE: u64 = 128;

// Layouts are pinned: a change here must be deliberate (and ARCHITECTURE.md
// updated), because host and device must agree byte for byte.
const _: () = assert!(core::mem::size_of::<SignalBlock>() == 188_672);
const _: () = assert!(core::mem::align_of::<SignalBlock>() == 128);
const _: () = assert!(core::mem::offset_of!(SignalBlock, abort) == 40_960);
const _: () = assert!(core::mem::offset_of!(SignalBlock, p2p_flag) == 41_088);
const _: () = assert!(core::mem::offset_of!(SignalBlock, p2p_outbox) == 41_216);
const _: () =
    assert!(core::mem::offset_of!(SignalBlock, p2p_inbox).is_multiple_of(16) && P2P_CHECK_WORDS.is_multiple_of(4));
const _: () = assert!(core::mem::size_of::<LocalState>() == 2_816);
const _: () = assert!(core::mem::offset_of!(LocalState, control) == 0);
const _: () = assert!(core::mem::size_of::<Control>() == 128);
const _: () = assert!(core::mem::offset_of!(Control, generation) == 4);
const _: () = assert!(core::mem::offset_of!(Control, arrivals) == 16);
const _: () = assert!(core::mem::offset_of!(Control, error_claim) == 32);
const _: () = assert!(core::mem::size_of::<ErrorRecord>() == 64);
const _: () = assert!(core::mem::size_of::<PeerPointers>() == 8 * MAX_RANKS);
const _: () = assert!(core::mem::size_of::<IslandLayout>() == 16 + MAX_RANKS * MAX_RANKS);
const _: () = assert!(core::mem::size_of::<ScratchLayout>() == 176);
const _: () = assert!(
    core::mem::size_of::<DeviceHandle>()
        == (32 + 16 * MAX_RANKS + 176 + 16 + MAX_RANKS * MAX_RANKS + 8).div_ceil(16) * 16
);
const _: () = assert!(core::mem::offset_of!(DeviceHandle, scratch_layout) == 32 + 16 * MAX_RANKS);
const _: () = assert!(MAX_RANKS <= 16, "the device-side rank unrolling covers at most 16 ranks");
const _: () = assert!(crate::shares::shape_supported(&[MAX_RANKS as u32 / 2, MAX_RANKS as u32 / 2], 2));
const _: () = assert!(MAX_BLOCKS as u32 * THREADS_PER_BLOCK <= 1 << 20);

/// The value rank `src` releases into every rank's `p2p_flag[src]` in the
/// init-time P2P check once its data is written. Never 0 (fresh memory).
pub const fn p2p_flag(src: u32, salt: u32) -> u32 {
    p2p_pattern(src, u32::MAX - 1, u32::MAX, salt) | 1
}

/// The word rank `src` writes into rank `dst`'s `p2p_inbox` (or, with
/// `dst == u32::MAX`, into its own `p2p_outbox`) in the init-time P2P check.
/// `salt` changes per communicator so stale memory cannot pass the check.
pub const fn p2p_pattern(src: u32, dst: u32, word: u32, salt: u32) -> u32 {
    let mut x = (src as u64) << 48 ^ (dst as u64) << 32 ^ (word as u64) << 16 ^ salt as u64;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    x as u32
}
