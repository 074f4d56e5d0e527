//! Where a rank's memory is, as the algorithms' parameter templates need
//! it: every rank's region as this rank maps it, and with the per-pair
//! transport every rank's host-memory cross region. Init fills them in;
//! the templates resolve every peer address from them once.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::layout::ScratchLayout;

/// Where a rank's memory is, as the template needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RankMemory {
    /// Every rank's region (signal block | scratch | staging) as this rank
    /// maps it.
    pub region_bases: Vec<u64>,
    /// Offset of the scratch inside a region (the same on every rank).
    pub scratch_offset: u64,
    pub layout: ScratchLayout,
    /// This rank's `LocalState` (its `Control` is at offset 0).
    pub local_state: u64,
    /// Device address of this rank's mapped `ErrorRecord`.
    pub error_record: u64,
}

/// Where the cross slots and the abort words live with the per-pair
/// transport: each rank's host-memory cross region, as this rank maps it
/// (abort word at offset 0, the cross slots from `CROSS_SLOTS_OFFSET`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CrossRegions {
    pub bases: Vec<u64>,
    /// Distance between the two halves of the cross slots.
    pub half_bytes: u64,
}

/// Offset of the cross slots in a host-memory cross region (after the
/// abort word's line).
pub(crate) const CROSS_SLOTS_OFFSET: u64 = 128;
