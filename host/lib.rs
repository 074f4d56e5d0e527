//! # tp-allreduce
//!
//! A fast, CUDA-graph-capturable allreduce for tensor-parallel inference on
//! the GPUs of one host, designed first for PCIe-only machines, with kernels
//! written in Rust (`kernels-rs`, compiled to PTX by `build.rs`).
//!
//! See README.md for the overview and ARCHITECTURE.md for the design.

// `unsafe` lives only in `driver` (every CUDA driver call), `nccl`, `comm`'s
// raw entry point and call path, `comm::shm` (libc) and the CLI `tools`;
// every other module file says `#![forbid(unsafe_code)]` (`rendezvous`
// here, for all of its files).
pub mod algorithm;
pub mod comm;
pub mod config;
pub mod driver;
pub mod env;
pub mod error;
pub mod kernels;
pub mod nccl;
pub mod rank_env;
#[forbid(unsafe_code)]
pub mod rendezvous;
pub mod select;

#[cfg(feature = "tools")]
#[doc(hidden)]
pub mod tools;

pub use algorithm::{Algorithm, Transport};
pub use comm::{CallPlan, Comm, Element, ReduceOp};
pub use config::{Config, TransportPreference};
pub use error::{Error, Result};
pub use rank_env::RankEnv;
pub use tp_allreduce_kernels::ids::DType;
