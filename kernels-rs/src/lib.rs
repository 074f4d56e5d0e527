//! tp-allreduce device code and the types the host and the device share.
//!
//! This crate is `#![no_std]` and compiles for two targets:
//!
//! * **the host** (any target with `std` available to the *caller*): only the
//!   shared `#[repr(C)]` layouts ([`layout`]), the by-value kernel
//!   parameters ([`params`]), the partition math
//!   ([`partition`]), the identifiers ([`ids`]) and the compressed wire
//!   format ([`wire`], no kernel uses it yet) exist. The host library
//!   `tp_allreduce` depends on this crate for them, so a layout change can never
//!   leave host and device disagreeing.
//! * **`nvptx64-nvidia-cuda`** (nightly, built by the host crate's `build.rs`,
//!   one PTX file per GPU architecture): additionally the [`device`] module with
//!   the inline-PTX support layer and one file per allreduce algorithm.
//!
//! Design decisions and their reasons are in ARCHITECTURE.md at the repository
//! root; the memory-ordering contract every kernel follows is stated there and
//! at each barrier in `device/sync.rs`.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, stdarch_nvptx, asm_experimental_arch))]

pub mod escape;
pub mod ids;
pub mod layout;
pub mod params;
pub mod partition;
pub mod shares;
pub mod wire;

#[cfg(target_arch = "nvptx64")]
pub mod device;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // A panic on the device is a bug in this crate (an index out of range).
    // `trap` aborts the kernel with an error the host sees as a launch failure
    // (CUDA_ERROR_LAUNCH_FAILED), never as a silently wrong result.
    device::ptx::trap()
}
