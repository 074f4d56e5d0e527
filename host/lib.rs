//! # tp-allreduce
//!
//! A fast, CUDA-graph-capturable allreduce for tensor-parallel inference on
//! the GPUs of one host, designed first for PCIe-only machines, with kernels
//! written in Rust (`kernels-rs`, compiled to PTX by `build.rs`).
//!
//! See README.md for the overview and ARCHITECTURE.md for the design; the
//! repository's `examples/` has complete programs (in-process group, one
//! process per GPU, CUDA-graph capture).
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! use tp_allreduce::{Comm, Config, DeviceBuffer, ReduceOp};
//!
//! fn main() -> tp_allreduce::Result<()> {
//!     // cudarc's CudaContext::new panics without a driver: probe first.
//!     if tp_allreduce::raw::device_count() == 0 {
//!         return Ok(());
//!     }
//!     // Two ranks on GPU 0, one stream each (like ncclCommInitAll).
//!     let ctx = CudaContext::new(0)?;
//!     let comms = Comm::from_streams(vec![ctx.new_stream()?, ctx.new_stream()?], Config::from_env()?)?;
//!     let mut buffers = Vec::new();
//!     for comm in &comms {
//!         buffers.push(DeviceBuffer::from_host(&comm.stream(), &[1.0f32; 1024])?);
//!     }
//!     for (comm, buffer) in comms.iter().zip(buffers.iter_mut()) {
//!         comm.all_reduce_in_place(buffer, &ReduceOp::Sum)?;
//!     }
//!     comms.iter().try_for_each(|comm| comm.synchronize())?;
//!     assert_eq!(buffers[1].to_host()?, vec![2.0f32; 1024]);
//!     Ok(())
//! }
//! ```

#![deny(unsafe_code)]

// `unsafe` is denied crate-wide and allowed (an inner `allow(unsafe_code)`
// attribute at the top of the file) in four rooms only: `driver` (every
// CUDA driver call and kernel launch), `comm::call` (the raw entry points,
// the call pipeline's launches, the error record), `comm::shm` (libc
// shared memory) and `nccl`. Most other files also say
// `#![forbid(unsafe_code)]`; `tests/suite/cpu.rs` checks the allow list.

/// Declares the library's internal modules: private, and public (doc
/// hidden, no API promise) with the `internals` feature, through which the
/// `tp-allreduce-cli` crate (the tool and the test suite) reaches them.
/// Without it, what only that crate uses is unused here (the lints that
/// would say so are off for these declarations only).
macro_rules! internal_modules {
    ($($name:ident),* $(,)?) => {
        $(
            #[cfg(feature = "internals")]
            #[doc(hidden)]
            pub mod $name;
            #[cfg(not(feature = "internals"))]
            #[allow(dead_code, unused_imports)]
            mod $name;
        )*
    };
}

internal_modules!(
    algorithm,
    buffer,
    comm,
    config,
    driver,
    element,
    embedded_ptx,
    env,
    error,
    nccl,
    rank_env,
    select,
    wire
);

#[cfg(feature = "candle")]
pub mod candle;
pub mod raw;
pub mod rendezvous;

/// Failure injection for the test suite (`testing` feature only).
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod test_hooks;
#[cfg(not(feature = "testing"))]
#[allow(dead_code)]
mod test_hooks;

/// Tests that run a peer as another user.
#[cfg(test)]
mod other_user;

/// The embedded PTX and every kernel entry the host launches, in one place
/// for the tool and the PTX checks (`embedded_ptx`, `algorithm::entries`).
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod kernels {
    pub use crate::algorithm::entries::*;
    pub use crate::embedded_ptx::*;
}

pub use algorithm::{Algorithm, Transport};
pub use buffer::DeviceBuffer;
pub use comm::{CallPlan, CollectivePlan, Comm, Element, FusedOptions, FusedPlan, ReduceOp, SelectionSource};
pub use config::{AutoMeasure, Config, TransportPreference};
pub use error::{DeviceFailure, Error, Result};
pub use rank_env::RankEnv;
pub use tp_allreduce_kernels::ids::{Collective, DType};

/// The README's Rust code, compiled as doc-tests (`cargo test --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
