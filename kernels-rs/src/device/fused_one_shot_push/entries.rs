//! The entry points of the fused OneShotPush (`fused_one_shot_push.rs`):
//! one per (world, packs of a row per thread, cluster, spread push,
//! dtype).

use super::*;

macro_rules! fused_one_shot_push_entries {
    ($w:literal, $p:expr, $f32:ident, $f16:ident, $bf16:ident) => {
        fused_one_shot_push_entries!($w, $p, false, SPREAD_BY_FLAG, $f32, $f16, $bf16);
    };
    ($w:literal, $p:expr, $cluster:literal, $spread:expr, $f32:ident, $f16:ident, $bf16:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f32(p: FusedOneShotPushParams) {
            fused_one_shot_push::<$crate::device::pack::F32, $w, { $p }, $cluster, { $spread }>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f16(p: FusedOneShotPushParams) {
            fused_one_shot_push::<$crate::device::pack::F16, $w, { $p }, $cluster, { $spread }>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $bf16(p: FusedOneShotPushParams) {
            fused_one_shot_push::<$crate::device::pack::Bf16, $w, { $p }, $cluster, { $spread }>(p)
        }
    };
}

// Up to FUSED_PACKS_PER_THREAD packs per thread, any world / two ranks.
fused_one_shot_push_entries!(0, K, fused_one_shot_push_f32, fused_one_shot_push_f16, fused_one_shot_push_bf16);
fused_one_shot_push_entries!(2, K, fused_one_shot_push2_f32, fused_one_shot_push2_f16, fused_one_shot_push2_bf16);
// Up to FUSED_SHORT_ROW_PACKS_PER_THREAD packs per thread (rows of at most
// 1024 packs at 512 threads: hidden 8192 in f16/bf16): half the registers
// held across the wait.
fused_one_shot_push_entries!(
    0,
    SHORT_K,
    fused_one_shot_push_short_f32,
    fused_one_shot_push_short_f16,
    fused_one_shot_push_short_bf16
);
fused_one_shot_push_entries!(
    2,
    SHORT_K,
    fused_one_shot_push2_short_f32,
    fused_one_shot_push2_short_f16,
    fused_one_shot_push2_short_bf16
);
// One pack per thread (rows of at most FUSED_WIDE_MAX_THREADS packs, blocks
// of up to 1024 threads, 64 registers: build.rs's rule for `_wide_`), two
// ranks only: with the world read at run time the poll groups of up to 7
// sources spilled at 64 registers.
fused_one_shot_push_entries!(
    2,
    1,
    false,
    SPREAD_NEVER,
    fused_one_shot_push2_wide_f32,
    fused_one_shot_push2_wide_f16,
    fused_one_shot_push2_wide_bf16
);
// The same with the push spread over the grid (`EPILOGUE_SPREAD_PUSH`):
// the same output bits as `_wide`.
fused_one_shot_push_entries!(
    2,
    1,
    false,
    SPREAD_ALWAYS,
    fused_one_shot_push2_wide_spread_f32,
    fused_one_shot_push2_wide_spread_f16,
    fused_one_shot_push2_wide_spread_bf16
);

/// A row spread over the blocks of a cluster, one pack per thread (sm_90
/// and newer: launched with a cluster dimension of up to
/// `MAX_CLUSTER_BLOCKS` and at most `FUSED_MAX_THREADS` threads; the row's
/// sum of squares is reduced through distributed shared memory).
#[cfg(target_feature = "sm_90")]
mod cluster_entries {
    use super::*;
    fused_one_shot_push_entries!(
        0,
        1,
        true,
        SPREAD_NEVER,
        fused_one_shot_push_cluster_f32,
        fused_one_shot_push_cluster_f16,
        fused_one_shot_push_cluster_bf16
    );
    fused_one_shot_push_entries!(
        2,
        1,
        true,
        SPREAD_NEVER,
        fused_one_shot_push2_cluster_f32,
        fused_one_shot_push2_cluster_f16,
        fused_one_shot_push2_cluster_bf16
    );
}
