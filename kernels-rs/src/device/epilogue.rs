//! The add + RMSNorm epilogue of a transformer layer's allreduce
//! (`crate::params::FusedEpilogue` states the math): the pieces the fused
//! kernels share (per-pack residual add and normalisation, the block
//! reduction of a row's sum of squares) and `add_rms_norm_<dt>`, the
//! separate kernel of the unfused path (our allreduce or NCCL, then this).
//!
//! Bitwise identity across ranks: every rank sums the same values in the
//! same order (rank order, then the residual), rounds once, squares the
//! rounded values lane by lane, reduces them with the same tree (butterfly
//! within each warp, then the warp partials in warp order) for the same
//! block size, and normalises with IEEE `sqrt.rn` and `div.rn`. No fused
//! multiply-add is formed (Rust does not contract `a * b + c`).
//!
//! ```text
//!   add_rms_norm, block b, rows b, b + grid, ...; thread t, packs j = t, t + threads, ...:
//!     pass 1: y = sum[r, j] + residual_in[r, j] (f32) -> residual_out[r, j] (rounded);
//!             s += x^2 over the rounded lanes
//!     block:  S = block_sum(s)                        (one bar.sync per row)
//!     pass 2: normed[r, j] = round(x * inv_rms(S) * w[j]), x re-read from residual_out
//!             (the thread's own stores: program order, no barrier)
//! ```

use super::pack::{aligned16, load_pack, store_pack, Acc, Element, Pack};
use super::ptx;
use crate::params::{EPILOGUE_NORM, EPILOGUE_WEIGHT_OFFSET, FUSED_WIDE_MAX_THREADS, MAX_CLUSTER_BLOCKS};
use crate::partition::{div_ceil, elems_in_pack};

/// Unrolls `$body` for `$k` in `0..FUSED_PACKS_PER_THREAD` (a thread's
/// packs of a row): constant indices keep the per-thread arrays of packs
/// in registers (a loop LLVM declines to unroll, its body being large,
/// would index them at run time and move them to local memory).
#[macro_export]
macro_rules! for_each_row_pack {
    ($k:ident => $body:block) => {
        $crate::for_each_row_pack!(@one $k 0 $body);
        $crate::for_each_row_pack!(@one $k 1 $body);
        $crate::for_each_row_pack!(@one $k 2 $body);
        $crate::for_each_row_pack!(@one $k 3 $body);
    };
    (@one $k:ident $n:literal $body:block) => {{
        #[allow(clippy::identity_op, clippy::erasing_op)]
        const $k: usize = $n;
        $body
    }};
}

const _: () = assert!(crate::params::FUSED_PACKS_PER_THREAD == 4, "for_each_row_pack! unrolls 4 packs");

/// Sum of the squares of the first `E::LANES` lanes of `pack`, in f32,
/// lane order.
#[inline(always)]
pub fn sum_squares<E: Element>(pack: &Pack) -> f32 {
    let a = E::to_acc(pack);
    let mut s = 0.0f32;
    for (k, v) in a.iter().enumerate() {
        if k < E::LANES {
            s += *v * *v;
        }
    }
    s
}

/// `1 / sqrt(sum_squares / hidden + eps)` with IEEE division and square
/// root (the same bits on every rank).
#[inline(always)]
pub fn inv_rms(sum_squares: f32, hidden: u32, eps: f32) -> f32 {
    1.0 / ptx::sqrt_rn_f32(sum_squares / hidden as f32 + eps)
}

/// The normalised pack: `round(x * inv * w)` lane by lane, `w = weight`
/// or `1 + weight` (`offset`), `x` the (rounded) residual pack.
#[inline(always)]
pub fn normalise<E: Element>(residual: &Pack, weight: &Pack, inv: f32, offset: bool) -> Pack {
    let x = E::to_acc(residual);
    let w = E::to_acc(weight);
    let mut out: Acc = [0.0; 8];
    for k in 0..8 {
        let scale = if offset { 1.0 + w[k] } else { w[k] };
        out[k] = x[k] * inv * scale;
    }
    E::round(&out)
}

/// `sum + residual` of one pack in f32 (sum lanes first), rounded once.
#[inline(always)]
pub fn add_residual<E: Element>(sum: &Pack, residual: &Pack) -> Pack {
    let mut acc = E::to_acc(sum);
    E::accumulate(&mut acc, residual);
    E::round(&acc)
}

/// Block-wide sum of every thread's `value`, returned to every thread
/// (bitwise the same on all of them), and whether any thread of the block
/// passed `stop` (a failed wait: the block must leave together). Every
/// thread of the block calls it with the block's warps full (the block
/// size is a multiple of 32, at most `FUSED_WIDE_MAX_THREADS`).
///
/// Tree: a butterfly inside each warp (each step adds two equal-bit
/// partners, so every lane ends with the same bits), lane 0 stores the
/// warp's partial into buffer `parity` of `scratch` (two buffers of 32), one `bar.red.or`
/// (also the block barrier), then every thread adds the partials in warp
/// order. The other buffer is written for the next row while a slow
/// thread may still read this one; the row after next writes this buffer
/// again only after every thread passed the next row's barrier, which it
/// reaches after reading.
#[inline(always)]
pub unsafe fn block_sum(value: f32, stop: bool, scratch: u32, parity: u32) -> (f32, bool) {
    let mut v = value;
    v += ptx::shfl_sync_bfly_f32(v, 16);
    v += ptx::shfl_sync_bfly_f32(v, 8);
    v += ptx::shfl_sync_bfly_f32(v, 4);
    v += ptx::shfl_sync_bfly_f32(v, 2);
    v += ptx::shfl_sync_bfly_f32(v, 1);
    let tid = ptx::thread_idx_x();
    let buffer = scratch + 128 * (parity & 1);
    if tid % 32 == 0 {
        ptx::st_shared_f32(buffer + 4 * (tid / 32), v);
    }
    // Orders the partials' stores before the loads below (CTA scope).
    let stop = ptx::bar_red_or(stop);
    let warps = ptx::block_dim_x().div_ceil(32);
    // Partials in warp order, four per load; quads past the block's warps
    // are not loaded (block-uniform branches).
    let mut total = 0.0f32;
    for quad in 0..8u32 {
        if 4 * quad < warps {
            let q = ptx::ld_shared_v4_f32(buffer + 16 * quad);
            for (k, partial) in q.iter().enumerate() {
                let w = 4 * quad + k as u32;
                if w == 0 {
                    total = *partial;
                } else if w < warps {
                    total += *partial;
                }
            }
        }
    }
    (total, stop)
}

/// Byte offset of the inbox's mbarriers (one per buffer) after its two
/// buffers of `MAX_CLUSTER_BLOCKS` words.
const INBOX_MBARRIERS: u32 = 2 * 8 * MAX_CLUSTER_BLOCKS;

/// Traps unless the launch's cluster is the one the parameters describe:
/// `blocks` blocks a cluster (at least 2: the cluster entries count every
/// block in `arrivals`, and a one-block launch would leave its count
/// unreset, `sentinel::count_block`; at most `MAX_CLUSTER_BLOCKS`, the
/// host's bound: the inbox holds that many words a buffer, and a larger
/// cluster would write over its mbarriers), this block's cluster rank
/// `blockIdx.x % blocks`, and slices of `slice` packs, one per thread,
/// that cover a row of `row_packs` packs (a pack no block polls would stay
/// in its receive slot). Called by every thread before the inbox opens.
#[inline(always)]
pub unsafe fn cluster_shape_check(blocks: u32, slice: u32, row_packs: u32) {
    let launched = ptx::cluster_nctarank();
    let mut wrong = launched != blocks || !(2..=MAX_CLUSTER_BLOCKS).contains(&blocks);
    wrong |= ptx::cluster_ctarank() != ptx::block_idx_x() % blocks;
    wrong |= slice > ptx::block_dim_x() || (slice as u64) * (blocks as u64) < row_packs as u64;
    if wrong {
        ptx::trap();
    }
}

/// Readies this block's cluster inbox (sm_90+ cluster entries; every
/// thread of every block of the cluster calls it once, before its first
/// [`cluster_sum`]): the block's last thread (not thread 0, which counts
/// the block at the generation barrier) initialises the inbox's two
/// mbarriers (one arrival a phase: thread 0's `expect_tx`) and fences the
/// initialisation for the cluster, then every thread arrives at the
/// cluster barrier (relaxed: the mbarrier fence is the only ordering
/// needed, and a release arrive compiles to `MEMBAR.ALL.GPU`, ~0.27 us
/// measured on H200). The matching wait is in round 1 of [`cluster_sum`],
/// before anything is sent.
#[inline(always)]
pub unsafe fn cluster_inbox_open(inbox: u32) {
    if ptx::thread_idx_x() == ptx::block_dim_x() - 1 {
        ptx::mbarrier_init(inbox + INBOX_MBARRIERS, 1);
        ptx::mbarrier_init(inbox + INBOX_MBARRIERS + 8, 1);
        ptx::fence_mbarrier_init_release_cluster();
    }
    ptx::barrier_cluster_arrive_relaxed();
}

/// Cluster-wide sum of every thread's `value` (sm_90+ entries launched
/// with a cluster), returned bitwise the same to every thread of the
/// cluster, and whether any thread of the cluster passed `stop`. Every
/// thread of every block of the cluster calls it, the same number of times
/// (the rows of a cluster and its stops are cluster-uniform); `round` is
/// the call's number, counting from 1.
///
/// Tree: [`block_sum`] in each block, then every thread adds the blocks'
/// totals in cluster-rank order.
///
/// Round 1 first waits on the cluster barrier that [`cluster_inbox_open`]
/// arrived at: every block's mbarriers are then initialised.
///
/// Exchange, one way (no barrier round trip): round `n` uses buffer and
/// mbarrier `n & 1`, in that mbarrier's phase `(n - 1) / 2`. Thread 0 of
/// each block arrives on its own mbarrier expecting `8 * blocks` bytes;
/// thread `c` of each block stores `{stop, total}` with `st.async` into
/// slot `[n & 1][rank]` of block `c`'s inbox, which completes 8 bytes on
/// block `c`'s mbarrier (a release at cluster scope); every thread waits
/// for its mbarrier's phase (acquire, cluster scope) and reads the words.
/// A block sends round `n + 2` into a buffer only after its mbarrier
/// completed round `n + 1`, which needs every block's round `n + 1` word,
/// which each block sends only after all its threads read round `n` (the
/// block barrier of `block_sum` orders the reads before the send's
/// release) — so no word is overwritten unread, and no transaction of
/// round `n + 2` reaches a phase before round `n`'s completed. No block
/// exits while another may still send to it: each waits for every word of
/// every round it takes part in. The waits are on blocks of the same
/// cluster, which are resident together and reach every round (their own
/// waits are bounded).
#[inline(always)]
pub unsafe fn cluster_sum(value: f32, stop: bool, scratch: u32, inbox: u32, round: u32) -> (f32, bool) {
    let (block_total, block_stop) = block_sum(value, stop, scratch, round & 1);
    if round == 1 {
        // The wait that pairs with `cluster_inbox_open`'s arrive (usually
        // long complete): every block's mbarriers are initialised before
        // anything is sent. Here, after the block barrier, the warp is
        // converged for the `.aligned` instruction, and it has one site.
        ptx::barrier_cluster_wait();
    }
    let blocks = ptx::cluster_nctarank();
    let buffer = inbox + 8 * MAX_CLUSTER_BLOCKS * (round & 1);
    let mbarrier = inbox + INBOX_MBARRIERS + 8 * (round & 1);
    let tid = ptx::thread_idx_x();
    if tid == 0 {
        ptx::mbarrier_arrive_expect_tx(mbarrier, 8 * blocks);
    }
    if tid < blocks {
        let word = (block_stop as u64) << 32 | block_total.to_bits() as u64;
        let slot = buffer + 8 * ptx::cluster_ctarank();
        ptx::st_async_shared_cluster_u64(
            ptx::map_shared_to_cta(slot, tid),
            word,
            ptx::map_shared_to_cta(mbarrier, tid),
        );
    }
    let parity = ((round - 1) / 2) & 1;
    while !ptx::mbarrier_try_wait_parity(mbarrier, parity) {}
    let mut total = 0.0f32;
    let mut any_stop = false;
    for cta in 0..MAX_CLUSTER_BLOCKS {
        if cta < blocks {
            let word = ptx::ld_shared_u64(buffer + 8 * cta);
            let partial = f32::from_bits(word as u32);
            total = if cta == 0 { partial } else { total + partial };
            any_stop |= (word >> 32) & 1 != 0;
        }
    }
    (total, any_stop)
}

/// The rows of this block: `first, first + stride, ...` below `rows`.
#[inline(always)]
pub fn block_rows() -> (u64, u64) {
    (ptx::block_idx_x() as u64, ptx::grid_dim_x() as u64)
}

/// `add_rms_norm_<dt>`: the separate epilogue kernel (module docs). Any
/// `hidden`, any element alignment (element-wise loads where a row is not
/// 16-byte aligned), `sum` may equal `normed`, `residual_in` may equal
/// `residual_out`. Launch: blocks over rows, threads a multiple of 32 up to
/// `FUSED_MAX_THREADS`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn add_rms_norm<E: Element>(
    sum: *const u8,
    residual_in: *const u8,
    residual_out: *mut u8,
    weight: *const u8,
    normed: *mut u8,
    rows: u32,
    hidden: u32,
    eps: f32,
    flags: u32,
) {
    let lanes = E::LANES as u64;
    let hidden64 = hidden as u64;
    let row_packs = div_ceil(hidden64, lanes);
    let elem = 16 / lanes;
    let norm = flags & EPILOGUE_NORM != 0;
    let offset = flags & EPILOGUE_WEIGHT_OFFSET != 0;
    let rows_aligned = (hidden64 * elem) % 16 == 0;
    let mut vector = rows_aligned && aligned16(sum as u64) && aligned16(residual_in as u64);
    vector &= aligned16(residual_out as u64) && (!norm || (aligned16(weight as u64) && aligned16(normed as u64)));
    let tid = ptx::thread_idx_x() as u64;
    let threads = ptx::block_dim_x() as u64;
    let scratch = ptx::reduction_scratch();
    let (first_row, row_stride) = block_rows();
    let mut parity = 0u32;
    let mut row = first_row;
    while row < rows as u64 {
        let at = (row * hidden64 * elem) as usize;
        // ---- Pass 1: residual add, sum of squares of the rounded values.
        let mut squares = 0.0f32;
        let mut j = tid;
        while j < row_packs {
            let valid = elems_in_pack(hidden64, lanes, j);
            let v = vector && valid == lanes;
            let s = load_pack::<E>(sum.add(at), j, valid, v);
            let r = load_pack::<E>(residual_in.add(at), j, valid, v);
            let out = add_residual::<E>(&s, &r);
            store_pack::<E>(residual_out.add(at), j, valid, v, &out);
            squares += sum_squares::<E>(&out);
            j += threads;
        }
        if norm {
            // ---- Block reduction (block-uniform: `norm` is a parameter).
            let (total, _) = block_sum(squares, false, scratch, parity);
            let inv = inv_rms(total, hidden, eps);
            // ---- Pass 2: re-read this thread's residual_out packs.
            let mut j = tid;
            while j < row_packs {
                let valid = elems_in_pack(hidden64, lanes, j);
                let v = vector && valid == lanes;
                let x = load_pack::<E>(residual_out.add(at), j, valid, v);
                let w = load_pack::<E>(weight, j, valid, v);
                store_pack::<E>(normed.add(at), j, valid, v, &normalise::<E>(&x, &w, inv, offset));
                j += threads;
            }
            parity ^= 1;
        }
        row += row_stride;
    }
}

const _: () = assert!(FUSED_WIDE_MAX_THREADS <= 32 * 32, "block_sum reads 32 warp partials");

macro_rules! add_rms_norm_entries {
    ($($name:ident => $elem:ty),* $(,)?) => {$(
        #[no_mangle]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            sum: *const u8,
            residual_in: *const u8,
            residual_out: *mut u8,
            weight: *const u8,
            normed: *mut u8,
            rows: u32,
            hidden: u32,
            eps: f32,
            flags: u32,
        ) {
            add_rms_norm::<$elem>(sum, residual_in, residual_out, weight, normed, rows, hidden, eps, flags)
        }
    )*};
}

add_rms_norm_entries!(
    add_rms_norm_f32 => super::pack::F32,
    add_rms_norm_f16 => super::pack::F16,
    add_rms_norm_bf16 => super::pack::Bf16,
);
