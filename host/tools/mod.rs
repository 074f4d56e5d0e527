//! The command-line tools (`tp-allreduce bench | plan | tune | inspect |
//! launch | selftest | report`) and the helpers the tests share with them.
//!
//! **Not part of the library API.** This module exists only with the
//! default-on cargo feature `tools`, is hidden from the documentation, and
//! may change in any release: it is public only so that the `tp-allreduce`
//! binary and the integration tests can reach it. Library users depend on
//! `tp-allreduce` with `default-features = false, features =
//! ["cuda-version-13000"]` (or `["candle"]`, docs/CANDLE.md).
//!
//! Every file here says `#![forbid(unsafe_code)]`: device memory is
//! [`crate::DeviceBuffer`], allreduces go through the safe
//! [`crate::Comm::all_reduce`], kernels through `tools::elementwise`.
#![forbid(unsafe_code)]

pub mod any_buffer;
pub mod bench;
pub mod elementwise;
pub mod fused_reference;
pub mod inspect;
pub mod launcher;
pub mod plan;
pub mod reference;
pub mod selftest;
pub mod table;
pub mod topology_view;
