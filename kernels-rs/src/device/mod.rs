//! Device code: compiled for `nvptx64-nvidia-cuda` only.
//!
//! * [`ptx`] — the support layer (ids, barriers, fences, flag loads/stores,
//!   vector loads/stores, timer, conversions). All inline PTX lives there.
//! * [`pack`] — element types, 16-byte packs, f32 accumulation.
//! * [`sync`] — bounded waits, the cross-rank barrier, error recording.
//! * [`sentinel`] — the sentinel kernels' entry load, generation advance,
//!   bounded slot wait, give-up path and trace.
//! * one file per algorithm, declared from the list of algorithms
//!   (`ids::for_each_algorithm`): [`one_shot_pull`], [`two_shot_pull`],
//!   [`one_shot_push`], [`two_shot_push`], [`ring`], [`hierarchical`],
//!   [`copy_engine_ring`], and beside allreduce [`all_gather_push`] and
//!   [`reduce_scatter_push`]; [`island_push`] is the body TwoShotPush and
//!   Hierarchical share; [`p2p_check`] the init-time transfer check,
//!   [`elementwise`] the `sum` and `affine` kernels of the tests and tools.
//! * the fused epilogue (allreduce + residual add + RMSNorm): [`epilogue`]
//!   (shared pieces and the separate `add_rms_norm` kernel),
//!   [`fused_one_shot_push`], [`fused_one_shot_pull`], [`fused_island_push`]
//!   (TwoShotPush and Hierarchical).
//!
//! Entry points are `#[no_mangle] extern "ptx-kernel"` functions named
//! `<algorithm>_<dtype>`. Sentinel kernels (OneShotPush, TwoShotPush,
//! Hierarchical, AllGatherPush, ReduceScatterPush) and the copy-engine
//! ring's kernels take one
//! `#[repr(C)]` parameter struct by value (`crate::params`); the others take
//! scalars and raw pointers (a `DeviceHandle` pointer first).

pub mod gather;
pub mod pack;
pub mod ptx;
pub mod sentinel;
pub mod sync;

pub mod elementwise;
pub mod epilogue;
pub mod fused_island_push;
pub mod fused_one_shot_pull;
pub mod fused_one_shot_push;
pub mod island_push;
pub mod p2p_check;

/// One module per algorithm of [`for_each_algorithm`](crate::for_each_algorithm):
/// `device/<file>.rs`.
macro_rules! algorithm_modules {
    ($($(#[$doc:meta])* $variant:ident = $id:literal, $file:ident, $name:literal, $collective:ident, $completion:ident;)*) => {
        $(pub mod $file;)*
    };
}
crate::for_each_algorithm!(algorithm_modules);

/// Defines the three `extern "ptx-kernel"` entry points (f32, f16, bf16) of
/// a kernel written once, generically over [`pack::Element`].
#[macro_export]
macro_rules! dtype_entry_points {
    ($generic:ident, $f32:ident, $f16:ident, $bf16:ident, ($($arg:ident : $ty:ty),* $(,)?)) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f32($($arg: $ty),*) {
            $generic::<$crate::device::pack::F32>($($arg),*)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f16($($arg: $ty),*) {
            $generic::<$crate::device::pack::F16>($($arg),*)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $bf16($($arg: $ty),*) {
            $generic::<$crate::device::pack::Bf16>($($arg),*)
        }
    };
}

/// Global index of this thread and the grid's thread count.
#[inline(always)]
pub fn grid_stride() -> (u64, u64) {
    let threads = ptx::block_dim_x() as u64;
    let first = ptx::block_idx_x() as u64 * threads + ptx::thread_idx_x() as u64;
    (first, ptx::grid_dim_x() as u64 * threads)
}
