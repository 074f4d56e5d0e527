//! How a message is cut into packs, slices, per-block parts and chunks.
//! Pure integer math used by the kernels and by the host (launch geometry,
//! tests), so both sides agree by construction.

use crate::ids::DType;

/// The unit of every vector access: one `ld/st .v4.b32`.
pub const PACK_BYTES: usize = 16;

/// Elements of `dtype` in one 16-byte pack.
#[inline(always)]
pub const fn elems_per_pack(dtype: DType) -> usize {
    PACK_BYTES / dtype.size_bytes()
}

/// `ceil(a / b)`, 0 when `b == 0`.
#[inline(always)]
pub const fn div_ceil(a: u64, b: u64) -> u64 {
    if b == 0 {
        0
    } else {
        a.div_ceil(b)
    }
}

/// Number of 16-byte packs that hold `count` elements (the last pack may be
/// partial).
#[inline(always)]
pub const fn packs_for(count: u64, dtype: DType) -> u64 {
    div_ceil(count, elems_per_pack(dtype) as u64)
}

/// Bytes of `count` elements.
#[inline(always)]
pub const fn bytes_for(count: u64, dtype: DType) -> u64 {
    count * dtype.size_bytes() as u64
}

/// Part `index` of `total` items cut into `parts` contiguous parts of
/// `ceil(total / parts)` items: `(start, len)`. Trailing parts may be shorter
/// or empty; all parts together cover `0..total` exactly once.
#[inline(always)]
pub const fn even_part(total: u64, parts: u64, index: u64) -> (u64, u64) {
    let size = div_ceil(total, parts);
    let start = size * index;
    if start >= total {
        (total, 0)
    } else {
        let end = if start + size > total { total } else { start + size };
        (start, end - start)
    }
}

/// Elements of pack `pack` that hold real data in a message of `count`
/// elements with `per_pack` elements per pack (`per_pack` for every pack but
/// possibly the last).
#[inline(always)]
pub const fn elems_in_pack(count: u64, per_pack: u64, pack: u64) -> u64 {
    let start = pack * per_pack;
    if start >= count {
        0
    } else if count - start < per_pack {
        count - start
    } else {
        per_pack
    }
}

/// Wrap-aware `a >= b` for monotonically increasing 32-bit counters (epochs,
/// message sequence numbers). Correct while the two are less than 2^31 apart,
/// which the protocols guarantee (a peer is at most a few calls ahead).
#[inline(always)]
pub const fn seq_geq(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

/// Grid size for a push kernel whose scratch is striped into `max_blocks`
/// stripes of `stripe_packs` packs: enough blocks for `packs` at about
/// `packs_per_block` each, never fewer than the stripes require, never more
/// than `max_blocks`. Returns 0 if the message does not fit the stripes.
pub const fn push_grid(packs: u64, packs_per_block: u64, stripe_packs: u64, max_blocks: u32) -> u32 {
    if max_blocks == 0 {
        return 0;
    }
    let wanted = div_ceil(packs, if packs_per_block == 0 { 1 } else { packs_per_block });
    let needed = div_ceil(packs, stripe_packs);
    if stripe_packs == 0 || needed > max_blocks as u64 {
        return 0;
    }
    let mut grid = if wanted > needed { wanted } else { needed };
    if grid > max_blocks as u64 {
        grid = max_blocks as u64;
    }
    if grid == 0 {
        grid = 1;
    }
    grid as u32
}

/// Bytes per pack, as `u64` for address math.
pub const PACK: u64 = PACK_BYTES as u64;
