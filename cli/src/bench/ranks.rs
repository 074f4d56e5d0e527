//! The ranks of an in-process benchmark group (a context and a stream
//! each) and their buffers of one message size: fresh random inputs, the
//! outputs, and the check of every output against the f64 sum.
#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::any_buffer::AnyBuffer;
use crate::reference::{check_sum, decode, random_bits};
use tp_allreduce::driver;
use tp_allreduce::error::{driver as driver_error, Error, Result};
use tp_allreduce::{Collective, DType};

/// Ranks of an in-process benchmark group: their contexts and streams.
pub struct Ranks {
    pub contexts: Vec<Arc<CudaContext>>,
    pub streams: Vec<Arc<CudaStream>>,
    pub ordinals: Vec<usize>,
}

impl Ranks {
    /// `ranks_per_gpu` ranks on each of `gpus`. The benchmark uses only
    /// [`tp_allreduce::DeviceBuffer`]s, which order all work on their streams, so
    /// cudarc's event tracking is left as it is.
    pub fn new(gpus: &[usize], ranks_per_gpu: usize) -> Result<Ranks> {
        driver::require_driver()?;
        let mut ranks = Ranks { contexts: Vec::new(), streams: Vec::new(), ordinals: Vec::new() };
        for &g in gpus {
            let ctx = CudaContext::new(g).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
            for _ in 0..ranks_per_gpu {
                ranks.streams.push(ctx.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?);
                ranks.contexts.push(ctx.clone());
                ranks.ordinals.push(g);
            }
        }
        Ok(ranks)
    }

    pub fn world(&self) -> usize {
        self.streams.len()
    }

    /// NCCL can run when every rank has its own GPU.
    pub fn nccl_possible(&self) -> bool {
        let mut o = self.ordinals.clone();
        o.sort_unstable();
        o.dedup();
        o.len() == self.ordinals.len()
    }
}

/// Per-rank device buffers of one size with random contents and the
/// expected result: for the allreduce, input and output of the size; for
/// the all-gather, an input block of the size and an output of `world`
/// blocks; for the reduce-scatter, an input of `world` blocks and an output
/// block.
pub struct Buffers {
    /// Elements of the size (one block for the all-gather and reduce-scatter).
    pub count: usize,
    pub dtype: DType,
    pub collective: Collective,
    pub inputs: Vec<AnyBuffer>,
    pub outputs: Vec<AnyBuffer>,
    host_inputs: Vec<Vec<f64>>,
}

/// The seed of rank `rank`'s input in a run seeded with `seed`.
pub fn rank_seed(seed: u64, rank: usize) -> u64 {
    seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Buffers {
    /// Allreduce buffers of `bytes`.
    pub fn new(ranks: &Ranks, bytes: usize, dtype: DType, seed: u64) -> Result<Buffers> {
        Self::for_collective(ranks, Collective::AllReduce, bytes, dtype, seed)
    }

    /// Buffers of `collective` with `bytes` per block.
    pub fn for_collective(
        ranks: &Ranks,
        collective: Collective,
        bytes: usize,
        dtype: DType,
        seed: u64,
    ) -> Result<Buffers> {
        let count = (bytes / dtype.size_bytes()).max(1);
        let world = ranks.world();
        let (input_len, output_len) = match collective {
            Collective::AllReduce => (count, count),
            Collective::AllGather => (count, world * count),
            Collective::ReduceScatter => (world * count, count),
        };
        let mut bufs =
            Buffers { count, dtype, collective, inputs: Vec::new(), outputs: Vec::new(), host_inputs: Vec::new() };
        for (r, stream) in ranks.streams.iter().enumerate() {
            let (raw, values) = random_bits(dtype, input_len, rank_seed(seed, r));
            bufs.inputs.push(AnyBuffer::from_bytes(stream, dtype, &raw)?);
            bufs.outputs.push(AnyBuffer::alloc(stream, dtype, output_len)?);
            bufs.host_inputs.push(values);
        }
        Ok(bufs)
    }

    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size_bytes()
    }

    /// Poisons every output (0x7F bytes: huge or NaN, never a valid sum).
    pub fn poison(&mut self) -> Result<()> {
        self.outputs.iter_mut().try_for_each(|o| o.fill_bytes(0x7F))
    }

    /// Checks every rank's output against the f64 reference: the sum
    /// (with `roundings` roundings to the element type allowed), every
    /// rank's block bit for bit (all-gather), or the sum of block r on rank
    /// r (reduce-scatter).
    pub fn verify(&self, roundings: usize, what: &str) -> Result<()> {
        let n = self.count;
        for (r, o) in self.outputs.iter().enumerate() {
            let got = decode(self.dtype, &o.to_host_bytes()?);
            let checked = match self.collective {
                Collective::AllReduce => check_sum(self.dtype, &self.host_inputs, &got, roundings),
                Collective::AllGather => check_gathered(&self.host_inputs, &got, n),
                Collective::ReduceScatter => {
                    let shares: Vec<Vec<f64>> =
                        self.host_inputs.iter().map(|x| x[r * n..(r + 1) * n].to_vec()).collect();
                    check_sum(self.dtype, &shares, &got, roundings)
                }
            };
            checked.map_err(|e| {
                Error::InvalidUsage(format!("benchmark correctness check failed for {what}: rank {r} {e}"))
            })?;
        }
        Ok(())
    }
}

/// `got` is every rank's `n` inputs in rank order, bit for bit.
fn check_gathered(inputs: &[Vec<f64>], got: &[f64], n: usize) -> std::result::Result<(), String> {
    for (j, input) in inputs.iter().enumerate() {
        for (i, want) in input.iter().enumerate().take(n) {
            let g = got.get(j * n + i).copied().unwrap_or(f64::NAN);
            if g.to_bits() != want.to_bits() {
                return Err(format!("element {} (rank {j}'s element {i}) is {g}, not {want}", j * n + i));
            }
        }
    }
    Ok(())
}
