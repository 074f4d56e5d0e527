//! `bench --fused`: the transformer layer's epilogue, allreduce + residual
//! add + RMSNorm over `rows x hidden` elements (default 3 x 7168 bf16, the
//! verify pass's 42 KB message), timed on the same buffers as
//!
//! | variant | what runs per layer |
//! |---|---|
//! | `fused` | `Comm::all_reduce_add_rms_norm` (the fused kernel where the fused selection picks one) |
//! | `ours+separate` | our allreduce (the plain selection), then the separate `add_rms_norm` kernel |
//! | `nccl+separate` | NCCL's allreduce, then the same separate kernel |
//! | `allreduce` | our allreduce alone (the bar the fused call is held to) |
//!
//! Every variant is checked against the f64 reference before it is timed;
//! the residual is updated in place, so the calls of a sample form a
//! dependent chain. The verify-pass scenario gets the same variants: 122 x
//! (layer epilogue + a dependent elementwise kernel) in one graph. This
//! file holds what the in-process and the one-process-per-rank runs share
//! (`fused_epilogue_runs.rs` runs them).
#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::CudaStream;
use serde::{Deserialize, Serialize};

use crate::any_buffer::{self, AnyBuffer};
use crate::fused_reference;
use crate::reference::{check_sum, decode, random_bits};
use tp_allreduce::algorithm::Algorithm;
use tp_allreduce::comm::Comm;
use tp_allreduce::error::{Error, Result};
use tp_allreduce::nccl::NcclComm;
use tp_allreduce::{DType, FusedOptions};

/// `rows x hidden` of the default fused scenario (the verify pass's 42 KB).
pub const DEFAULT_SHAPE: (usize, usize) = (3, 7168);
/// The RMSNorm epsilon of the benchmark.
pub const EPS: f32 = 1e-6;

/// What runs per layer (module table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Fused,
    OursSeparate,
    NcclSeparate,
    AllReduce,
}

impl Variant {
    pub const ALL: [Variant; 4] = [Variant::Fused, Variant::OursSeparate, Variant::NcclSeparate, Variant::AllReduce];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Fused => "fused",
            Variant::OursSeparate => "ours+separate",
            Variant::NcclSeparate => "nccl+separate",
            Variant::AllReduce => "allreduce",
        }
    }

    /// Whether the variant needs an NCCL communicator.
    pub fn needs_nccl(self) -> bool {
        self == Variant::NcclSeparate
    }
}

/// One measured variant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FusedRow {
    /// `fused`, `ours+separate`, `nccl+separate` or `allreduce`.
    pub variant: String,
    /// What ran: the algorithm, and `+ add_rms_norm` when the epilogue was
    /// the separate kernel.
    pub ran: String,
    pub rows: usize,
    pub hidden: usize,
    pub dtype: String,
    pub world: usize,
    pub mode: String,
    /// Per layer (one epilogue call).
    pub median_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
}

/// What variant `v` runs on `comm` for `rows x hidden` (capturing).
pub fn describe(v: Variant, comm: &Comm, rows: usize, hidden: usize, dtype: DType) -> String {
    let bytes = rows * hidden * dtype.size_bytes();
    match v {
        Variant::Fused => {
            let p = comm.plan_fused(rows, hidden, dtype, true);
            format!("{}{}", p.algorithm, if p.fused { " (fused)" } else { " + add_rms_norm" })
        }
        Variant::OursSeparate => format!("{} + add_rms_norm", comm.plan_call(bytes, dtype, true, false).algorithm),
        Variant::NcclSeparate => "nccl + add_rms_norm".into(),
        Variant::AllReduce => comm.plan_call(bytes, dtype, true, false).algorithm.to_string(),
    }
}

/// Roundings of the residual (and of the sum for `allreduce`) of `v`.
fn roundings(v: Variant, comm: &Comm, rows: usize, hidden: usize, dtype: DType) -> usize {
    let world = comm.world_size();
    let bytes = rows * hidden * dtype.size_bytes();
    let plain = comm.plan_call(bytes, dtype, false, false).algorithm.max_roundings(world);
    match v {
        Variant::Fused => {
            let p = comm.plan_fused(rows, hidden, dtype, false);
            if p.fused {
                1
            } else {
                p.algorithm.max_roundings(world) + 1
            }
        }
        Variant::OursSeparate => plain + 1,
        Variant::NcclSeparate => Algorithm::Nccl.max_roundings(world) + 1,
        Variant::AllReduce => plain,
    }
}

/// The values of one scenario: every rank's input, the shared residual and
/// weight (bit patterns and values), from seeds every rank derives alike.
pub struct EpilogueData {
    pub dtype: DType,
    pub rows: usize,
    pub hidden: usize,
    pub inputs: Vec<Vec<f64>>,
    input_bits: Vec<Vec<u8>>,
    residual_bits: Vec<u8>,
    pub residual: Vec<f64>,
    weight_bits: Vec<u8>,
    pub weight: Vec<f64>,
}

impl EpilogueData {
    /// Bytes of one rank's `rows x hidden` input.
    pub fn bytes(&self) -> usize {
        self.rows * self.hidden * self.dtype.size_bytes()
    }

    pub fn new(world: usize, (rows, hidden): (usize, usize), dtype: DType, seed: u64) -> EpilogueData {
        let n = rows * hidden;
        let mix = |k: u64| seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let (input_bits, inputs): (Vec<_>, Vec<_>) =
            (0..world).map(|r| random_bits(dtype, n, mix(r as u64 + 1))).unzip();
        let (residual_bits, residual) = random_bits(dtype, n, mix(1000));
        let (weight_bits, weight) = random_bits(dtype, hidden, mix(2000));
        EpilogueData { dtype, rows, hidden, inputs, input_bits, residual_bits, residual, weight_bits, weight }
    }
}

/// One rank's buffers of the scenario.
pub struct EpilogueBuffers {
    pub input: AnyBuffer,
    pub residual: AnyBuffer,
    pub weight: AnyBuffer,
    pub normed: AnyBuffer,
    /// NCCL's output before the separate kernel.
    pub sum: AnyBuffer,
}

impl EpilogueBuffers {
    pub fn new(stream: &Arc<CudaStream>, data: &EpilogueData, rank: usize) -> Result<EpilogueBuffers> {
        let n = data.rows * data.hidden;
        Ok(EpilogueBuffers {
            input: AnyBuffer::from_bytes(stream, data.dtype, &data.input_bits[rank])?,
            residual: AnyBuffer::from_bytes(stream, data.dtype, &data.residual_bits)?,
            weight: AnyBuffer::from_bytes(stream, data.dtype, &data.weight_bits)?,
            normed: AnyBuffer::alloc(stream, data.dtype, n)?,
            sum: AnyBuffer::alloc(stream, data.dtype, n)?,
        })
    }

    /// Back to the scenario's input and residual, outputs poisoned.
    pub fn reset(&mut self, data: &EpilogueData, rank: usize) -> Result<()> {
        self.input.copy_bytes_from_host(&data.input_bits[rank])?;
        self.residual.copy_bytes_from_host(&data.residual_bits)?;
        self.normed.fill_bytes(0x7F)?;
        self.sum.fill_bytes(0x7F)
    }
}

/// One layer epilogue of `v` on `comm`'s stream (`nccl` for `nccl+separate`).
pub fn issue(v: Variant, comm: &Comm, nccl: Option<&NcclComm>, b: &mut EpilogueBuffers) -> Result<()> {
    let opts = FusedOptions { unfused: v == Variant::OursSeparate, ..FusedOptions::default() };
    match v {
        Variant::Fused | Variant::OursSeparate => {
            any_buffer::all_reduce_add_rms_norm(comm, &b.input, &mut b.residual, &b.weight, EPS, &mut b.normed, &opts)
        }
        Variant::NcclSeparate => {
            let nccl = nccl.ok_or_else(|| Error::Nccl("nccl+separate: no NCCL communicator".into()))?;
            any_buffer::nccl_all_reduce(nccl, &b.input, &mut b.sum, &comm.stream())?;
            any_buffer::add_rms_norm(comm, &b.sum, &mut b.residual, &b.weight, EPS, &mut b.normed, &opts)
        }
        Variant::AllReduce => any_buffer::all_reduce(comm, &b.input, &mut b.normed),
    }
}

/// Checks rank `rank`'s outputs after one call of `v` from [`EpilogueBuffers::reset`].
pub fn check(v: Variant, comm: &Comm, b: &EpilogueBuffers, data: &EpilogueData, rank: usize) -> Result<()> {
    let (dtype, hidden, world) = (data.dtype, data.hidden, comm.world_size());
    let r = roundings(v, comm, data.rows, hidden, dtype);
    let normed = decode(dtype, &b.normed.to_host_bytes()?);
    let verdict = if v == Variant::AllReduce {
        check_sum(dtype, &data.inputs, &normed, r)
    } else {
        let e = fused_reference::expected(&data.inputs, &data.residual, Some(&data.weight), hidden, EPS as f64, false);
        let residual = decode(dtype, &b.residual.to_host_bytes()?);
        fused_reference::check(dtype, &e, &residual, Some(&normed), hidden, r, world)
    };
    verdict.map_err(|e| {
        Error::InvalidUsage(format!("benchmark correctness check failed for {} (rank {rank}): {e}", v.name()))
    })
}

/// The row of `v` from its per-layer samples.
pub fn row(v: Variant, ran: String, data: &EpilogueData, world: usize, mode: &str, samples: &mut [f64]) -> FusedRow {
    let (median_us, p10_us, p90_us) = super::stats::percentiles(samples);
    FusedRow {
        variant: v.name().into(),
        ran,
        rows: data.rows,
        hidden: data.hidden,
        dtype: data.dtype.name().into(),
        world,
        mode: mode.into(),
        median_us,
        p10_us,
        p90_us,
    }
}

/// The terminal lines of the fused rows (per layer, and what fusing saves).
pub fn render(rows: &[FusedRow]) -> String {
    use std::fmt::Write as _;
    let Some(first) = rows.first() else { return String::new() };
    let mut out = format!(
        "\nlayer epilogue: allreduce + residual add + RMSNorm, {} x {} {}, {} ranks, {} (us per layer)\n",
        first.rows, first.hidden, first.dtype, first.world, first.mode
    );
    for r in rows {
        let _ = writeln!(
            out,
            "  {:<14} {:>8.2}  [p10 {:.2} - p90 {:.2}]  {}",
            r.variant, r.median_us, r.p10_us, r.p90_us, r.ran
        );
    }
    let of = |name: &str| rows.iter().find(|r| r.variant == name).map(|r| r.median_us);
    if let (Some(f), Some(a)) = (of("fused"), of("allreduce")) {
        let _ = writeln!(out, "  fused - allreduce alone: {:+.2} us (target <= +0.5)", f - a);
    }
    if let (Some(f), Some(s)) = (of("fused"), of("ours+separate")) {
        let _ = writeln!(out, "  saved by fusing: {:.2} us per layer vs ours + separate kernel (target >= 1.5)", s - f);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_derives_the_same_data_and_ranks_differ() {
        let a = EpilogueData::new(3, (2, 128), DType::Bf16, 7);
        let b = EpilogueData::new(3, (2, 128), DType::Bf16, 7);
        assert_eq!(a.inputs, b.inputs);
        assert_eq!(a.residual, b.residual);
        assert_ne!(a.inputs[0], a.inputs[1]);
        assert_ne!(a.inputs[0], a.residual);
        assert_eq!(a.weight.len(), 128);
        assert_eq!(a.inputs[2].len(), 256);
    }

    #[test]
    fn the_summary_states_the_targets() {
        let r = |variant: &str, median_us: f64| FusedRow {
            variant: variant.into(),
            ran: "x".into(),
            rows: 3,
            hidden: 7168,
            dtype: "bf16".into(),
            world: 2,
            mode: "graph".into(),
            median_us,
            p10_us: median_us,
            p90_us: median_us,
        };
        let text = render(&[r("fused", 3.0), r("ours+separate", 5.0), r("allreduce", 2.75)]);
        assert!(text.contains("fused - allreduce alone: +0.25 us"), "{text}");
        assert!(text.contains("saved by fusing: 2.00 us"), "{text}");
        assert!(render(&[]).is_empty());
        assert_eq!(Variant::ALL.iter().filter(|v| v.needs_nccl()).count(), 1);
    }
}
