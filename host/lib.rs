//! # tp-allreduce
//!
//! A fast, CUDA-graph-capturable allreduce for tensor-parallel inference on
//! the GPUs of one host, designed first for PCIe-only machines, with kernels
//! written in Rust (`kernels-rs`, compiled to PTX by `build.rs`).
//!
//! See README.md for the overview and ARCHITECTURE.md for the design.

pub mod algorithm;
pub mod bench;
pub mod comm;
pub mod cost_model;
pub mod driver;
pub mod elementwise;
pub mod env;
pub mod error;
pub mod inspect;
pub mod launch;
pub mod nccl;
pub mod plan;
pub mod ptx;
pub mod rendezvous;
pub mod selection;
pub mod selftest;
pub mod topology;
pub mod tuning;

pub use algorithm::{Algorithm, Transport};
pub use comm::{CallPlan, Comm, Config, Element, ReduceOp, TransportPreference};
pub use error::{Error, Result};
pub use tp_allreduce_kernels::ids::DType;
