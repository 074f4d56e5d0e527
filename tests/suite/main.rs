//! The single integration-test binary, a test target of the
//! `tp-allreduce-cli` package (cli/Cargo.toml): it drives the library
//! (with its doc-hidden `testing` feature), the `tp-allreduce` binary and
//! the PTX. GPU tests skip visibly ("skipped: no CUDA device") without a
//! GPU; `TP_ALLREDUCE_REQUIRE_GPU=1` turns a skip into a failure (use it on
//! GPU machines).

mod common;

#[cfg(feature = "candle")]
mod candle;
mod cli;
mod cpu;
mod doc_paths;
mod gpu_allreduce;
mod gpu_batch_invariant;
mod gpu_collectives;
mod gpu_concurrent;
mod gpu_context;
mod gpu_errors;
mod gpu_foundation;
mod gpu_fused;
mod gpu_fused_graph;
mod gpu_fused_paths;
mod gpu_graph;
mod gpu_measured_auto;
mod gpu_mixed_placement;
mod gpu_payload_edges;
mod gpu_pcie_family;
mod gpu_pipelined;
mod gpu_streams;
mod gpu_teardown;
mod gpu_timeout;
mod gpu_transport;
mod gpu_uneven_placement;
mod gpu_vmm;
mod gpu_vmm_processes;
mod gpu_wrap;
mod imports;
mod multiprocess;
mod multiprocess_host_staged;
mod multiprocess_teardown;
mod ptx;
mod sentinel_model;
