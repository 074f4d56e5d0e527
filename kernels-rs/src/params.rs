//! Parameters of the sentinel kernels (OneShotPush, TwoShotPush,
//! Hierarchical) and of the copy-engine ring's kernels, passed **by
//! value**, and the rank-local control words those kernels read at entry.
//!
//! Why by value: a `#[repr(C)]` struct parameter lives in the kernel's
//! `.param` space, which the GPU reads from its constant bank — no global
//! load on the path to the first peer store. The host builds one template per
//! rank at init (every peer address resolved) and fills `input`, `output`
//! and `count` per launch. Nothing in a parameter struct changes between
//! graph replays of one captured call: the per-call generation lives in
//! device memory ([`Control`]) and is advanced by the kernel itself.
//!
//! Kernel-side rules (see `device/one_shot_push.rs`): never take a reference
//! to the parameter struct and never index its arrays with a runtime value
//! (either makes LLVM copy the whole struct to local memory); use constant
//! indices (`for_each_rank!`) or a select chain.
//!
//! Host and device agree byte for byte: the sizes below are pinned here, and
//! a test parses each entry's `.param` declaration in the committed PTX and
//! compares it with `size_of` of the struct the host passes.

pub use crate::layout::Control;
use crate::layout::MAX_RANKS;
use crate::shares::{MAX_ISLANDS, MAX_OWNED};

/// The sentinel regions, each with its own generation counter in
/// [`Control::generation`] (re-exported from `layout`). A kernel's region
/// is a constant of the kernel.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionId {
    OneShotPush = 0,
    TwoShotPush = 1,
    Hierarchical = 2,
}

/// [`SentinelHeader::flags`] bit: record a [`TraceRecord`] per launch.
pub const FLAG_TRACE: u32 = 1;

/// Common header of every sentinel kernel's parameters.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SentinelHeader {
    /// This launch's input (the chunk's first element).
    pub input: u64,
    pub output: u64,
    /// Elements in this launch (> 0).
    pub count: u64,
    /// This rank's [`Control`] (device memory).
    pub control: u64,
    /// Mapped pinned [`ErrorRecord`](crate::layout::ErrorRecord).
    pub error_record: u64,
    /// Bound of every spin, against `%globaltimer`.
    pub timeout_ns: u64,
    /// Distance between the two halves of the receive region.
    pub half_bytes: u64,
    /// Device address of the trace ring (`TRACE_RECORDS` records), used when
    /// `flags & FLAG_TRACE`.
    pub trace: u64,
    pub rank: u32,
    pub world: u32,
    pub flags: u32,
    pub _pad0: u32,
    /// This rank's peer-visible abort word (`SignalBlock::abort`), written
    /// with the rank-local `Control::abort` when a kernel gives up.
    pub abort: u64,
    /// Bound of a wait on a peer that has shown nothing of this launch yet
    /// (it may not have launched it); `timeout_ns` bounds waits after that.
    pub launch_timeout_ns: u64,
}

/// Parameters of `one_shot_push_<dtype>` and `one_shot_push2_<dtype>`.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OneShotPushParams {
    pub h: SentinelHeader,
    /// `send_to[k]`, `k < world - 1`: where this rank's payload lands in rank
    /// `(rank + 1 + k) % world`'s receive region, half 0 (array order is the
    /// staggered visiting order).
    pub send_to: [u64; MAX_RANKS],
    /// `recv_from[k]`, `k < world - 1`: receive slot `k` of this rank's
    /// region, half 0; it holds the payload of source rank
    /// [`one_shot_push_source`]`(k, rank)`. Indexed by slot rather than by
    /// rank so that a kernel keeps `world - 1` packs in flight, not `world`.
    pub recv_from: [u64; MAX_RANKS],
    /// `source_abort[k]`: the peer-visible abort word of the source of slot
    /// `k` (slow path only).
    pub source_abort: [u64; MAX_RANKS],
}

/// Parameters of `two_shot_push_<dtype>` and `hierarchical_<dtype>`: the
/// island push with payload completion (`crate::shares` has the share and
/// slot math; TwoShotPush is one island of every rank). Every address is
/// resolved by the host at init for half 0 and owned position 0 of the
/// share it names; the kernel adds the half, `16 * (e * share_cap + t)`
/// where a slot holds several owned shares, and `16 * t`.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IslandPushParams {
    pub h: SentinelHeader,
    /// Packs between consecutive owned positions of a slot (fixed per
    /// communicator: `ceil(max_packs / shares)`).
    pub share_cap: u64,
    /// Distance between the two halves of the cross slots: `h.half_bytes`
    /// when they sit in the receive region, another stride when they live
    /// in a host-memory region of their own (per-pair transport).
    pub cross_half_bytes: u64,
    /// Shares a launch is cut into (`S`, the largest island).
    pub shares: u32,
    /// Shares this rank sends in the reduce-scatter (`S` minus its own).
    pub sends: u32,
    /// Shares this rank owns (`e = 0..owned`: share `member_index + e * members`).
    pub owned: u32,
    /// Members of this rank's island and this rank's index in it.
    pub members: u32,
    pub member_index: u32,
    /// Islands (1 for TwoShotPush) and this rank's.
    pub islands: u32,
    pub island: u32,
    pub _pad0: u32,
    /// `send_share[s]`: the share of the `s`-th reduce-scatter send (the
    /// staggered order: shares of member `index + 1`, `index + 2`, ... first).
    pub send_share: [u8; MAX_RANKS],
    /// Rank of the source of reduce-scatter slot `q` (error records).
    pub rs_peer: [u8; MAX_RANKS],
    /// Rank that sends the all-gather value of send `s` (the share's owner).
    pub ag_peer: [u8; MAX_RANKS],
    /// `cross_peer[o][e]`: rank that sends cross slot `o` for owned share `e`.
    pub cross_peer: [[u8; MAX_OWNED]; MAX_ISLANDS - 1],
    pub _pad1: [u8; 4],
    /// Phase A: where send `s` lands (the owner's reduce-scatter slot of
    /// this rank, at the share's owned position).
    pub rs_to: [u64; MAX_RANKS],
    /// Phase B: reduce-scatter slot `q` of this rank.
    pub rs_from: [u64; MAX_RANKS],
    pub rs_abort: [u64; MAX_RANKS],
    /// `cross_to[o][e]`: where the partial of owned share `e` lands at its
    /// owner in the `o`-th other island (that owner's cross slot of this
    /// island, at the share's owned position there).
    pub cross_to: [[u64; MAX_OWNED]; MAX_ISLANDS - 1],
    /// Cross slot `o` of this rank.
    pub cross_from: [u64; MAX_ISLANDS],
    pub cross_abort: [[u64; MAX_OWNED]; MAX_ISLANDS - 1],
    /// All-gather slot of this rank at member `q` (the `q`-th other member).
    pub ag_to: [u64; MAX_RANKS],
    /// Phase D: the all-gather slot here that holds send `s`'s share, at
    /// the share's owned position.
    pub ag_from: [u64; MAX_RANKS],
    pub ag_abort: [u64; MAX_RANKS],
}

/// Parameters of `all_gather_<dtype>` and `reduce_scatter_<dtype>`: the
/// OneShotPush parameters (same receive region, same generation; the
/// template's addresses unchanged) and where the ranks' blocks lie.
/// AllGather: `h.input` is this rank's block of `h.count` elements, rank
/// `r`'s block of the output is at `h.output + r * block_bytes`.
/// ReduceScatter: rank `d`'s share of the input is at `h.input + d *
/// block_bytes`, `h.count` elements; `h.output` receives this rank's sum.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatherScatterParams {
    pub push: OneShotPushParams,
    /// Bytes from one rank's block (AllGather output) or share
    /// (ReduceScatter input) to the next rank's.
    pub block_bytes: u64,
    /// AllGather: bytes from a receive slot's pack 0 to its escape words
    /// (one u32 per pack, after the launch's packs: see
    /// [`all_gather_launch_packs`]). ReduceScatter: 0 (unused).
    pub escape_offset: u64,
}

/// Packs of one AllGather launch when a receive slot holds `slot_packs`
/// packs: the packs and, after them, one escape word (4 bytes) per pack
/// fit in the slot (`20 * n <= 16 * slot_packs`).
pub const fn all_gather_launch_packs(slot_packs: u64) -> u64 {
    slot_packs * 4 / 5
}

const _: () = assert!(core::mem::size_of::<GatherScatterParams>() == core::mem::size_of::<OneShotPushParams>() + 16);
const _: () = assert!(core::mem::align_of::<GatherScatterParams>() == 16);

/// [`CopyEngineParams::mode`]: reduce-scatter step (`out = in + staging`).
pub const CE_MODE_REDUCE: u32 = 0;
/// [`CopyEngineParams::mode`]: all-gather step (`out = staging`).
pub const CE_MODE_COPY: u32 = 1;

/// Parameters of the copy-engine ring's kernels: the step kernel
/// `copy_engine_ring_<dtype>` (wait for the flag of one staging slot, reduce
/// or copy one piece, clear the flag) and the one-thread
/// `copy_engine_ring_handshake` (wait for "staging consumed" from the next
/// rank, clear it) and `copy_engine_ring_publish` (raise a peer's flag when
/// stream memory operations are unavailable).
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyEngineParams {
    /// Step kernel: this piece of the input (reduce) and of the output.
    pub input: u64,
    pub output: u64,
    /// Elements of the piece.
    pub count: u64,
    /// The staging slot the piece was copied into (this rank's memory).
    pub staging: u64,
    /// Step: this slot's flag (0 or 1) in this rank's memory. Handshake:
    /// this rank's handshake flag. Publish: the peer's flag to raise.
    pub flag: u64,
    /// Step with `last`: the previous rank's handshake flag, raised once
    /// this rank consumed every slot of the call.
    pub handshake: u64,
    /// This rank's [`Control`].
    pub control: u64,
    pub error_record: u64,
    pub timeout_ns: u64,
    /// This rank's peer-visible abort word, and the awaited peer's.
    pub abort: u64,
    pub peer_abort: u64,
    pub rank: u32,
    /// The rank awaited (error records).
    pub peer: u32,
    /// [`CE_MODE_REDUCE`] or [`CE_MODE_COPY`].
    pub mode: u32,
    /// Nonzero on the call's last step kernel.
    pub last: u32,
}

/// Records kept in the trace ring (indexed by `generation % TRACE_RECORDS`).
pub const TRACE_RECORDS: usize = 1024;

/// What thread 0 of block 0 of a traced launch records, `%globaltimer`
/// values (ns) written as they happen (no registers held for them).
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceRecord {
    /// First instruction of the kernel.
    pub entry_ns: u64,
    /// The control words (abort, generation) have arrived.
    pub loaded_ns: u64,
    /// Its first peer store was issued (0: the thread had no pack).
    pub first_store_ns: u64,
    /// Its last poll succeeded (0: no pack).
    pub last_poll_ns: u64,
    /// Just before it exits.
    pub exit_ns: u64,
    /// The launch's generation (identifies the call; records with
    /// consecutive generations are consecutive launches).
    pub generation: u32,
    /// `blocks << 16 | threads` of the launch.
    pub shape: u32,
    pub _pad: [u64; 2],
}

/// Receive slot of source `src` at receiver `dst` (`src != dst`): the sources
/// other than the receiver, in rank order (the own term comes from the input).
pub const fn one_shot_push_slot(src: u32, dst: u32) -> u32 {
    if src > dst {
        src - 1
    } else {
        src
    }
}

/// Source rank of receive slot `slot` at receiver `dst`: the inverse of
/// [`one_shot_push_slot`].
pub const fn one_shot_push_source(slot: u32, dst: u32) -> u32 {
    if slot >= dst {
        slot + 1
    } else {
        slot
    }
}

/// The receive half (0 or 1) of a launch with this generation. 2^32 is even,
/// so consecutive generations alternate halves across the u32 wrap too.
pub const fn sentinel_half(generation: u32) -> u32 {
    generation & 1
}

const _: () = assert!(core::mem::size_of::<SentinelHeader>() == 96);
const _: () = assert!(core::mem::offset_of!(SentinelHeader, rank) == 64);
const _: () = assert!(core::mem::size_of::<OneShotPushParams>() == 96 + 3 * 8 * MAX_RANKS);
const _: () = assert!(core::mem::offset_of!(OneShotPushParams, send_to) == 96);
const _: () = assert!(core::mem::align_of::<OneShotPushParams>() == 16);
const _: () = assert!(core::mem::size_of::<TraceRecord>() == 64);
// The host reads records as eight u64 words: stamps 0-4, then
// `generation | shape << 32`.
const _: () = assert!(core::mem::offset_of!(TraceRecord, exit_ns) == 32);
const _: () = assert!(core::mem::offset_of!(TraceRecord, generation) == 40);
const _: () = assert!(core::mem::offset_of!(TraceRecord, shape) == 44);
const _: () = assert!(core::mem::offset_of!(SentinelHeader, abort) == 80);
const _: () = assert!(core::mem::offset_of!(IslandPushParams, share_cap) == 96);
const _: () = assert!(core::mem::offset_of!(IslandPushParams, rs_to) == 184);
const _: () = assert!(
    core::mem::size_of::<IslandPushParams>()
        == (184 + 8 * (6 * MAX_RANKS + 2 * (MAX_ISLANDS - 1) * MAX_OWNED + MAX_ISLANDS)).div_ceil(16) * 16
);
const _: () = assert!(core::mem::size_of::<CopyEngineParams>() == 112);
// A kernel's RegionId indexes the three generation words.
const _: () = assert!(RegionId::Hierarchical as usize + 1 == 3);

// ---------------------------------------------------------------- fused epilogue

/// Receive slots a OneShotPush thread (plain and fused) polls back to back
/// before waiting on any. The cost model counts its rounds from it.
pub const ONE_SHOT_PUSH_POLL_GROUP: usize = 4;
/// Packs an island push thread (TwoShotPush, Hierarchical) loads or polls
/// back to back before any is used: bounds the packs held in registers
/// (1024-thread blocks have 64 registers a thread; groups of 4 spilled on
/// every architecture, groups of 2 do not). The cost model counts its
/// rounds from it.
pub const ISLAND_PUSH_GROUP: usize = 2;

/// [`FusedEpilogue::flags`] bit: normalise (RMSNorm) after the residual add;
/// without it the epilogue only adds the residual (`all_reduce_add`).
pub const EPILOGUE_NORM: u32 = 1;
/// [`FusedEpilogue::flags`] bit: scale by `1 + weight` (Gemma) instead of
/// `weight`.
pub const EPILOGUE_WEIGHT_OFFSET: u32 = 2;

/// [`FusedEpilogue::flags`] bit, fused OneShotPush block-per-row entries
/// only: the **spread push**. Every block of the grid pushes an equal
/// share of the whole message (`ceil(packs / blocks)` consecutive packs;
/// 32-bit pack indices: the host keeps a launch's packs below 2^31), and
/// block `b < rows` then owns row `b` (polls, adds, normalises it) as
/// without the bit. The host sets it only where the grid has more blocks
/// than rows and neither `normed` nor `residual_out` overlaps `input` (a
/// block may still push a row its owner has finished).
pub const EPILOGUE_SPREAD_PUSH: u32 = 4;

/// Threads per block of the fused kernels at most (their register budget is
/// that of every kernel but the plain sentinel ones: 65536 / 512).
pub const FUSED_MAX_THREADS: u32 = 512;
/// Packs of a row each thread of a fused kernel holds in registers between
/// the residual add and the normalisation.
pub const FUSED_PACKS_PER_THREAD: u32 = 4;
/// Packs of a row per thread of the `fused_one_shot_push*_short_<dt>`
/// entries: the same kernel holding half the packs (and registers) across
/// the wait, for rows of at most `FUSED_MAX_THREADS` x this many packs.
pub const FUSED_SHORT_ROW_PACKS_PER_THREAD: u32 = 2;
/// Threads per block of the `fused_one_shot_push*_wide_<dt>` entries at
/// most: one pack of a row per thread (rows of at most this many packs:
/// hidden 8192 in f16/bf16, 4096 in f32), built with the sentinel kernels'
/// register budget (65536 / 1024).
pub const FUSED_WIDE_MAX_THREADS: u32 = 1024;
/// Blocks per cluster of the `fused_one_shot_push*_cluster_<dt>` entries
/// (sm_90+) at most: the portable cluster size.
pub const MAX_CLUSTER_BLOCKS: u32 = 8;
/// Packs of a row per block the host aims for when it spreads a row over
/// a cluster (one pack per thread: four warps per block).
pub const CLUSTER_SLICE_PACKS: u32 = 128;
/// Longest row (in 16-byte packs) a fused kernel normalises: hidden 16384
/// in f16/bf16, 8192 in f32. Longer rows take the unfused path.
pub const FUSED_MAX_ROW_PACKS: u32 = FUSED_MAX_THREADS * FUSED_PACKS_PER_THREAD;

/// What the fused kernels do after the allreduce of a `rows x hidden`
/// message, per row `r` and element `c` (f32 arithmetic, one rounding per
/// output):
///
/// ```text
///   y[r,c]         = sum over ranks of input[r,c] (rank order) + residual_in[r,c]
///   residual_out[r,c] = round(y[r,c])
///   normed[r,c]    = round(x[r,c] * inv_rms(r) * w[c]),   x = residual_out as f32,
///   inv_rms(r)     = 1 / sqrt(sum_c x[r,c]^2 / hidden + eps),  w = weight or 1 + weight
/// ```
///
/// The sum of squares is a block reduction with a fixed tree for a given
/// block size, so every rank computes the same bits. Also the scalar
/// arguments of `fused_one_shot_pull_<dt>` and `add_rms_norm_<dt>`.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FusedEpilogue {
    /// `rows x hidden` elements, read (may equal `residual_out`).
    pub residual_in: u64,
    /// `rows x hidden` elements, written.
    pub residual_out: u64,
    /// `hidden` elements (0 without [`EPILOGUE_NORM`]).
    pub weight: u64,
    /// `rows x hidden` elements, written (0 without [`EPILOGUE_NORM`]).
    pub normed: u64,
    pub rows: u32,
    /// Elements per row.
    pub hidden: u32,
    pub eps: f32,
    /// [`EPILOGUE_NORM`], [`EPILOGUE_WEIGHT_OFFSET`].
    pub flags: u32,
}

/// Parameters of `fused_one_shot_push_<dtype>` and
/// `fused_one_shot_push2_<dtype>`: the OneShotPush parameters (same
/// receive region, same generation; `h.output` unused, `h.count` =
/// `rows x hidden`) and the epilogue. A block owns whole rows, or, in the
/// cluster entries, a slice of its cluster's rows.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FusedOneShotPushParams {
    pub push: OneShotPushParams,
    pub epilogue: FusedEpilogue,
    /// Cluster entries: blocks per cluster (the launch's cluster
    /// dimension, at most `MAX_CLUSTER_BLOCKS`; the kernel traps on a
    /// launch that disagrees). 0 in the other entries.
    pub cluster_blocks: u32,
    /// Cluster entries: packs of a row per block (`ceil(row_packs /
    /// cluster_blocks)`, at most the block's threads). Passed rather than
    /// derived from `%cluster_nctarank` and `%clusterid`: those read
    /// driver constants whose first load, a constant-cache miss, stood
    /// between the kernel's entry and its first loads (docs/RESULTS.md).
    pub cluster_slice_packs: u32,
    pub _pad0: u64,
}

const _: () = assert!(core::mem::size_of::<FusedEpilogue>() == 48);
const _: () =
    assert!(core::mem::size_of::<FusedOneShotPushParams>() == core::mem::size_of::<OneShotPushParams>() + 48 + 16);
const _: () = assert!(core::mem::offset_of!(FusedOneShotPushParams, epilogue) == 96 + 3 * 8 * MAX_RANKS);
const _: () = assert!(core::mem::align_of::<FusedOneShotPushParams>() == 16);
/// Parameters of `fused_two_shot_push_<dtype>` and
/// `fused_hierarchical_<dtype>`: the island push parameters (same receive
/// region and generation as `two_shot_push_<dtype>` / `hierarchical_<dtype>`;
/// `h.count` = `rows x hidden`; `h.output`: where Hierarchical keeps the
/// island partials of the owned rows between its phases B and C, `normed`
/// or, without RMSNorm, `input`) and the epilogue. Shares are whole rows
/// (`ceil(rows / S)` rows each); an all-gather position holds the new
/// residual pack and, `normed_slot_bytes` further on, the normalised pack.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FusedIslandPushParams {
    pub push: IslandPushParams,
    pub epilogue: FusedEpilogue,
    /// Byte distance, in an all-gather slot, from the residual pack of a
    /// position to its normalised pack (`16 * (share_cap / 2)`; the host
    /// keeps a share within `share_cap / 2` packs).
    pub normed_slot_bytes: u64,
    pub _pad0: u64,
}

const _: () =
    assert!(core::mem::size_of::<FusedIslandPushParams>() == core::mem::size_of::<IslandPushParams>() + 48 + 16);
const _: () =
    assert!(core::mem::offset_of!(FusedIslandPushParams, epilogue) == core::mem::size_of::<IslandPushParams>());
const _: () = assert!(core::mem::align_of::<FusedIslandPushParams>() == 16);
// Every warp's partial of a block reduction fits the 16-slot scratch.
const _: () = assert!(FUSED_MAX_THREADS <= FUSED_WIDE_MAX_THREADS && FUSED_WIDE_MAX_THREADS / 32 <= 32);
