//! Choosing an algorithm: the machine's topology, the cost model that
//! predicts each algorithm's time on it, measured tuning tables, and the
//! per-communicator selection table every call looks up.
//!
//! * [`topology`] — GPUs, links and the rank view a communicator models.
//! * [`cost_model`] — predicted time per algorithm, size and topology.
//! * [`tuning`] — measured winners per size bucket (`tp-allreduce tune`).
//! * [`measured`] — measured `auto`: the table measured at communicator
//!   start, its cache, the rank-0 decision.
//! * [`selection`] — the pure choice (override > tuning > model, never
//!   slower than NCCL) and the precomputed [`SelectionTable`].

#![forbid(unsafe_code)]

pub mod cost_model;
pub mod selection;
pub mod topology;
pub mod measured;
pub mod tuning;

pub use selection::SelectionTable;
pub use topology::Topology;
