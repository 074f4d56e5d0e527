//! The `tp-allreduce` command-line tool's machinery (`bench | plan | tune |
//! inspect | launch | selftest | report`, the binary in `main.rs`) and the
//! helpers the integration tests share with it (`tests/suite` is this
//! package's test target).
//!
//! **Not part of the library API.** It reaches inside the library through
//! the doc-hidden `internals` feature of `tp-allreduce` (the selection and
//! cost model, the embedded PTX, the driver layer), which carries no API
//! promise; library users depend on `tp-allreduce` alone.
//!
//! Every file here says `#![forbid(unsafe_code)]`: device memory is
//! [`tp_allreduce::DeviceBuffer`], allreduces go through the safe
//! [`tp_allreduce::Comm::all_reduce`], kernels through the library's
//! `driver::elementwise`.
#![forbid(unsafe_code)]

pub mod any_buffer;
pub mod bench;
pub mod fused_reference;
pub mod inspect;
pub mod launcher;
pub mod logger;
pub mod plan;
pub mod reference;
pub mod selftest;
pub mod table;
pub mod topology_view;
