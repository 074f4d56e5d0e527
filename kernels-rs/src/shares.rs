//! Shares and ownership of the island push kernels (TwoShotPush and
//! Hierarchical with payload completion), and the slot layout of their
//! receive region. Pure integer math shared by the host (templates, scratch
//! sizes, tests) and the kernels, so both agree by construction.
//!
//! A launch over `packs` packs is cut into `S` shares of
//! `sh = ceil(packs / S)` packs (share `k` = packs `[k sh, (k+1) sh)`, the
//! last ones possibly shorter or empty). Islands `I_0 .. I_{m-1}` (sizes
//! `n_g`, unequal allowed) split the ranks; `S = max_g n_g`. The owner of
//! share `k` in island `g` is member `k mod n_g`, so member `j` owns shares
//! `j, j + n_g, j + 2 n_g, ...`: its `e`-th owned share is `k = j + e n_g`.
//! TwoShotPush is the one-island case (`m = 1`, `n_0 = S = world`).
//!
//! Receive slots are addressed by *owned position*: pack `t` of the owner's
//! `e`-th share sits at `e * share_cap + t`, where `share_cap` is fixed per
//! communicator (`ceil(max_packs / S)`), so every slot address is known at
//! init and a launch of any size uses a prefix of each share's positions.
//! Per rank and half, the region holds `n_g - 1` reduce-scatter slots (one
//! per other member), `m - 1` cross slots (one per other island) and
//! `n_g - 1` all-gather slots, each `owned_capacity` packs.

use crate::partition::div_ceil;

/// Most islands (each holds at least two ranks unless configured
/// otherwise; the kernel's cross tables are sized by this).
pub const MAX_ISLANDS: usize = 4;
/// Most shares one rank owns in one launch (`ceil(S / n_g)`); islands so
/// unequal that a member would own more are refused by the host.
pub const MAX_OWNED: usize = 4;

/// Packs per share of a launch over `packs` packs cut into `shares` shares.
#[inline(always)]
pub const fn share_packs(packs: u64, shares: u32) -> u64 {
    div_ceil(packs, shares as u64)
}

/// How many of `shares` shares member `index` of an island of `members`
/// owns: the `k < shares` with `k mod members == index`.
#[inline(always)]
pub const fn owned_count(shares: u32, members: u32, index: u32) -> u32 {
    if members == 0 || index >= shares {
        0
    } else {
        (shares - index).div_ceil(members)
    }
}

/// The member (index inside its island of `members`) that owns share `k`.
#[inline(always)]
pub const fn owner_index(k: u32, members: u32) -> u32 {
    k % members
}

/// Which of its owner's shares share `k` is (`e`, with `k = owner + e * members`).
#[inline(always)]
pub const fn owned_position(k: u32, members: u32) -> u32 {
    k / members
}

/// Packs of one receive slot of a rank in an island of `members`: room for
/// the most shares one member owns.
#[inline(always)]
pub const fn owned_capacity(shares: u32, members: u32, share_cap: u64) -> u64 {
    div_ceil(shares as u64, members as u64) * share_cap
}

/// Receive slots per half of a rank in an island of `members` out of
/// `islands`: reduce-scatter, cross, all-gather.
#[inline(always)]
pub const fn region_slots(members: u32, islands: u32) -> u32 {
    2 * (members - 1) + (islands - 1)
}

/// Which kind of receive slot (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotKind {
    /// Reduce-scatter: slot `q` holds island member `q` (`q + 1` from the
    /// receiver's own index on) contributions to the shares it owns.
    ReduceScatter,
    /// Cross: slot `o` holds island `o` (`o + 1` from the receiver's own
    /// island on) partial sums of the shares it owns.
    Cross,
    /// All-gather: slot `q` holds member `q`'s (as above) final sums.
    AllGather,
}

/// Byte offset, inside one half of the receive region of a rank in an
/// island of `members` out of `islands`, of slot `slot` of `kind`, owned
/// position 0.
#[inline(always)]
pub const fn slot_offset(kind: SlotKind, slot: u32, members: u32, islands: u32, capacity: u64) -> u64 {
    let index = match kind {
        SlotKind::ReduceScatter => slot,
        SlotKind::Cross => members - 1 + slot,
        SlotKind::AllGather => members - 1 + islands - 1 + slot,
    };
    index as u64 * capacity * crate::partition::PACK
}

/// The slot index of `source` among the `count` sources other than `me`
/// (sources in order, `me` left out): the reduce-scatter / all-gather slot
/// of member `source` at member `me`, or the cross slot of island `source`
/// at island `me`.
#[inline(always)]
pub const fn slot_of(source: u32, me: u32) -> u32 {
    if source > me {
        source - 1
    } else {
        source
    }
}

/// Inverse of [`slot_of`].
#[inline(always)]
pub const fn source_of(slot: u32, me: u32) -> u32 {
    if slot >= me {
        slot + 1
    } else {
        slot
    }
}

/// Whether `islands` (sizes of each, `count` of them) is a shape the
/// island push kernels run: 1 island (TwoShotPush) or 2..=MAX_ISLANDS,
/// every island non-empty, no member owning more than `MAX_OWNED` shares.
/// (The total is the world size, which `layout::MAX_RANKS` bounds.)
pub const fn shape_supported(sizes: &[u32], count: usize) -> bool {
    if count == 0 || count > MAX_ISLANDS || count > sizes.len() {
        return false;
    }
    let mut largest = 0;
    let mut smallest = u32::MAX;
    let mut g = 0;
    while g < count {
        if sizes[g] == 0 {
            return false;
        }
        if sizes[g] > largest {
            largest = sizes[g];
        }
        if sizes[g] < smallest {
            smallest = sizes[g];
        }
        g += 1;
    }
    largest.div_ceil(smallest) as usize <= MAX_OWNED
}

/// Bytes of one half of the cross slots when they live in a region of
/// their own (per-pair transport: host memory): the largest over the
/// islands of `(islands - 1) * owned_capacity` packs. Cross slot `o` of a
/// rank of an island of `n` sits at `o * owned_capacity(S, n, cap)` packs.
pub const fn cross_half_bytes(sizes: &[u32], count: usize, share_cap: u64) -> u64 {
    let mut shares = 0;
    let mut smallest = u32::MAX;
    let mut g = 0;
    while g < count {
        if sizes[g] > shares {
            shares = sizes[g];
        }
        if sizes[g] < smallest {
            smallest = sizes[g];
        }
        g += 1;
    }
    if count < 2 {
        return 0;
    }
    (count as u64 - 1) * owned_capacity(shares, smallest, share_cap) * crate::partition::PACK
}

/// Bytes of one half of the island push receive region, the same for every
/// rank: the largest over the islands of `region_slots * owned_capacity`
/// packs (each rank lays out its own half; the halves are this far apart).
pub const fn half_bytes(sizes: &[u32], count: usize, share_cap: u64) -> u64 {
    let mut shares = 0;
    let mut g = 0;
    while g < count {
        if sizes[g] > shares {
            shares = sizes[g];
        }
        g += 1;
    }
    let mut largest = 0;
    let mut g = 0;
    while g < count {
        let n = sizes[g];
        let packs = region_slots(n, count as u32) as u64 * owned_capacity(shares, n, share_cap);
        if packs > largest {
            largest = packs;
        }
        g += 1;
    }
    largest * crate::partition::PACK
}
