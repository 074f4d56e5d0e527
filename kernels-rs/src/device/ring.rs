//! Ring: chunked, pipelined, neighbour-only writes — a reduce-scatter ring
//! followed by an all-gather ring (NCCL's ring, written as push-only FIFOs).
//!
//! ```text
//!   packs cut into N slices, each slice into one part per block, each part
//!   into chunks of C packs. Block b of rank r talks only to block b of
//!   r+1 (sends) and of r-1 (receives), through a FIFO of K slots in the
//!   receiver's scratch:
//!     send(m):  wait credit >= m+1-K (slot free); write slot m%K of right;
//!               release RingData flag = m+1 at right
//!     recv(m):  acquire RingData flag >= m+1; read slot m%K;
//!               release RingCredit flag = m+1 at left (slot free again)
//!   per chunk c (reduce-scatter, then all-gather):
//!     send(in[slice r])
//!     s = 1..N-2:  send(recv() + in[slice r-s])
//!     v = recv() + in[slice r+1];  out[slice r+1] = v;  send(v)
//!     s = 1..N-1:  m = recv();  out[slice r+1-s] = m;  send(m) unless last
//! ```
//! Each rank sends 2(N-1)/N·S, all to one neighbour: one outbound and one
//! inbound stream per GPU, the pattern PCIe sustains best at large sizes.
//! Partial sums travel in the element type (as in NCCL), so f16/bf16 results
//! carry up to N-1 roundings; each slice is completed by one rank and copied
//! by the others, so ranks are bitwise identical.
//!
//! Message counters are per block and never reset (wrap-aware compare); the
//! number of messages per call depends only on (count, N, grid), so every
//! rank's counters advance in lockstep. Chunk counts are padded with empty
//! messages so that every slice has the same number of chunks per block.

use super::pack::{aligned16, load_pack, store_pack, Element, Pack};
use super::ptx;
use super::sync::Ctx;
use crate::dtype_entry_points;
use crate::ids::{AlgorithmId, Phase};
use crate::layout::DeviceHandle;
use crate::partition::{div_ceil, elems_in_pack, even_part};

/// What to do with each received pack.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// First step: send this rank's input.
    SendInput,
    /// Reduce-scatter: received + input -> send.
    AddAndSend,
    /// Last reduce-scatter step: received + input -> output and send.
    AddStoreAndSend,
    /// All-gather: received -> output and send.
    StoreAndSend,
    /// Last all-gather step: received -> output.
    Store,
}

struct Channel {
    right: u32,
    left: u32,
    sent: u32,
    received: u32,
}

#[inline(always)]
unsafe fn ring<E: Element>(handle: *const DeviceHandle, input: *const u8, output: *mut u8, count: u64) {
    let mut ctx = Ctx::new(handle, AlgorithmId::Ring);
    if !ctx.begin() {
        return;
    }
    let layout = &ctx.h.scratch_layout;
    let grid = ptx::grid_dim_x();
    if grid > layout.ring_blocks || layout.ring_slots == 0 || layout.ring_chunk_packs == 0 {
        if ctx.tid == 0 {
            ctx.bad_launch(grid);
        }
        return;
    }
    let lanes = E::LANES as u64;
    let packs = div_ceil(count, lanes);
    let world = ctx.world;
    let rank = ctx.rank;
    let block = ctx.block;
    let b = block as usize;
    let local = ctx.local();
    let slots = layout.ring_slots;
    let chunk = layout.ring_chunk_packs;
    let threads = ptx::block_dim_x() as u64;
    let tid = ctx.tid as u64;
    let in_aligned = aligned16(input as u64);
    let out_aligned = aligned16(output as u64);

    let part = |s: u32| {
        let (slice_start, slice_len) = even_part(packs, world as u64, s as u64);
        let (part_start, part_len) = even_part(slice_len, grid as u64, block as u64);
        (slice_start + part_start, part_len)
    };
    // Chunks per slice part: the same for every slice (padded).
    let mut longest = 0u64;
    for s in 0..world {
        let (_, len) = part(s);
        if len > longest {
            longest = len;
        }
    }
    let chunks = div_ceil(longest, chunk);

    let mut ch = Channel {
        right: (rank + 1) % world,
        left: (rank + world - 1) % world,
        sent: (*local).ring_sent[b],
        received: (*local).ring_received[b],
    };
    ctx.epoch = ch.sent;
    let my_slots = ctx.scratch(rank);
    let right_slots = ctx.scratch(ch.right);

    let mut failed = false;
    let mut c = 0u64;
    while c < chunks && !failed {
        // 2N-1 steps per chunk (2(N-1) sends, 2(N-1) receives); `slice` is
        // the slice the step works on.
        let steps = 2 * world - 1;
        let mut step_index = 0u32;
        while step_index < steps && !failed {
            let (step, slice) = if step_index == 0 {
                (Step::SendInput, rank)
            } else if step_index < world - 1 {
                (Step::AddAndSend, (rank + world - step_index) % world)
            } else if step_index == world - 1 {
                (Step::AddStoreAndSend, (rank + 1) % world)
            } else {
                let s = step_index - (world - 1); // all-gather step 1..N-1
                let st = if s == world - 1 { Step::Store } else { Step::StoreAndSend };
                (st, (rank + 1 + world - s) % world)
            };
            // Chunk c of (slice, part b): packs [first, first + len).
            let (part_first, part_len) = part(slice);
            let chunk_first = c * chunk;
            let len = if chunk_first >= part_len {
                0
            } else if part_len - chunk_first < chunk {
                part_len - chunk_first
            } else {
                chunk
            };
            let first = part_first + chunk_first;
            let receives = step != Step::SendInput;
            let sends = step != Step::Store;

            // Wait for the data (receive) and for a free slot at the right
            // neighbour (send): thread 0 and thread 1, then one barrier.
            let mut wait_failed = false;
            if receives && ctx.tid == 0 {
                ctx.epoch = ch.received.wrapping_add(1);
                wait_failed |= !ctx.wait_flag(Phase::RingData, ch.left, ch.received.wrapping_add(1));
            }
            if sends && ctx.tid == 1 {
                // Slot (sent % K) is free once message sent-K was consumed.
                let target = ch.sent.wrapping_add(1).wrapping_sub(slots);
                ctx.epoch = ch.sent.wrapping_add(1);
                wait_failed |= !ctx.wait_flag(Phase::RingCredit, ch.right, target);
            }
            if ptx::bar_red_or(wait_failed) {
                failed = true;
                break;
            }

            let recv_slot = my_slots.add(layout.ring_slot_offset(block, ch.received % slots) as usize);
            let send_slot = right_slots.add(layout.ring_slot_offset(block, ch.sent % slots) as usize);
            let mut j = tid;
            while j < len {
                let pack = first + j;
                let valid = elems_in_pack(count, lanes, pack);
                let vector_in = in_aligned && valid == lanes;
                let value: Pack = match step {
                    Step::SendInput => load_pack::<E>(input, pack, valid, vector_in),
                    Step::AddAndSend | Step::AddStoreAndSend => {
                        let mut acc = E::to_acc(&ptx::ld_global_v4_u32(recv_slot.add((j * 16) as usize) as *const u32));
                        E::accumulate(&mut acc, &load_pack::<E>(input, pack, valid, vector_in));
                        E::round(&acc)
                    }
                    Step::StoreAndSend | Step::Store => {
                        ptx::ld_global_v4_u32(recv_slot.add((j * 16) as usize) as *const u32)
                    }
                };
                if matches!(step, Step::AddStoreAndSend | Step::StoreAndSend | Step::Store) {
                    store_pack::<E>(output, pack, valid, out_aligned && valid == lanes, &value);
                }
                if sends {
                    ptx::st_global_v4_u32(send_slot.add((j * 16) as usize) as *mut u32, value);
                }
                j += threads;
            }

            // Publish: the data to the right neighbour, the freed slot to the
            // left one. bar.sync orders every thread's slot reads and writes
            // before the releases.
            ptx::bar_sync();
            if sends {
                if ctx.tid == 0 {
                    ptx::st_release_sys_u32(ctx.flag(ch.right, Phase::RingData, block, rank), ch.sent.wrapping_add(1));
                }
                ch.sent = ch.sent.wrapping_add(1);
            }
            if receives {
                if ctx.tid == 1 {
                    ptx::st_release_sys_u32(
                        ctx.flag(ch.left, Phase::RingCredit, block, rank),
                        ch.received.wrapping_add(1),
                    );
                }
                ch.received = ch.received.wrapping_add(1);
            }
            step_index += 1;
        }
        c += 1;
    }

    if failed {
        return;
    }
    if ctx.tid == 0 {
        (*local).ring_sent[b] = ch.sent;
        (*local).ring_received[b] = ch.received;
    }
}

dtype_entry_points!(
    ring,
    ring_f32,
    ring_f16,
    ring_bf16,
    (handle: *const DeviceHandle, input: *const u8, output: *mut u8, count: u64)
);
