//! Ours and NCCL behind one trait, so one timing loop measures both on the
//! same buffers.
#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::ranks::{Buffers, Ranks};
use crate::any_buffer::{self, AnyBuffer};
use tp_allreduce::algorithm::Algorithm;
use tp_allreduce::comm::{Comm, Config};
use tp_allreduce::driver;
use tp_allreduce::error::{Error, Result};
use tp_allreduce::nccl::NcclComm;
use tp_allreduce::{Collective as Op, DType};

/// A group of communicators (ours or NCCL's) that can run a collective (allreduce, all-gather,
/// reduce-scatter) on rank r's buffers on its stream.
pub trait CommGroup: Sync {
    fn world(&self) -> usize;
    /// One `op` of rank `rank` (sum), queued on its stream.
    fn run(&self, op: Op, rank: usize, input: &AnyBuffer, output: &mut AnyBuffer) -> Result<()>;
    /// One `bufs.collective` on every rank (NCCL wraps them in one group call).
    fn issue_all(&self, bufs: &mut Buffers) -> Result<()> {
        for r in 0..self.world() {
            self.run(bufs.collective, r, &bufs.inputs[r], &mut bufs.outputs[r])?;
        }
        Ok(())
    }
    /// Whether per-rank graph capture works (not for single-thread NCCL
    /// over several GPUs, which needs one group call across ranks).
    fn capturable_per_rank(&self) -> bool {
        true
    }
    /// Collective post-capture step (register captured buffers).
    fn after_capture(&self) -> Result<()> {
        Ok(())
    }
    /// Collective step before the benchmark frees buffers it registered.
    fn release_buffers(&self) -> Result<()> {
        Ok(())
    }
    /// Checks for asynchronous errors after synchronisation.
    fn check(&self) -> Result<()> {
        Ok(())
    }
    /// What runs an `op` of `bytes` (a block for the all-gather and
    /// reduce-scatter), in a captured graph or eagerly: `auto` may choose
    /// differently for the two (an eager pull call stages its input).
    fn describe(&self, op: Op, bytes: usize, dtype: DType, capturing: bool) -> String;
    /// Roundings of a partial sum to the element type per output element,
    /// of what [`describe`](Self::describe) names.
    fn roundings(&self, op: Op, bytes: usize, dtype: DType, capturing: bool) -> usize;
}

/// Our communicators, one per rank (each on its rank's stream).
pub struct OurGroup<'a> {
    pub comms: &'a [Comm],
}

impl OurGroup<'_> {
    /// What an `op` of `bytes` runs (captured or eager).
    fn algorithm(&self, op: Op, bytes: usize, dtype: DType, capturing: bool) -> Algorithm {
        match op {
            Op::AllReduce => self.comms[0].plan_call(bytes, dtype, capturing, false).algorithm,
            _ => self.comms[0].plan_collective(op, bytes, capturing).algorithm,
        }
    }
}

impl CommGroup for OurGroup<'_> {
    fn world(&self) -> usize {
        self.comms.len()
    }
    fn run(&self, op: Op, rank: usize, input: &AnyBuffer, output: &mut AnyBuffer) -> Result<()> {
        any_buffer::run(&self.comms[rank], op, input, output)
    }
    fn after_capture(&self) -> Result<()> {
        Comm::register_graph_buffers_group(self.comms).map(|_| ())
    }
    fn release_buffers(&self) -> Result<()> {
        Comm::deregister_buffers_group(self.comms).map(|_| ())
    }
    fn check(&self) -> Result<()> {
        self.comms.iter().try_for_each(|c| c.check())
    }
    fn describe(&self, op: Op, bytes: usize, dtype: DType, capturing: bool) -> String {
        self.algorithm(op, bytes, dtype, capturing).name().to_string()
    }
    fn roundings(&self, op: Op, bytes: usize, dtype: DType, capturing: bool) -> usize {
        match op {
            Op::AllGather => 0,
            _ => self.algorithm(op, bytes, dtype, capturing).max_roundings(self.comms.len()),
        }
    }
}

/// NCCL communicators, one per rank, driven from this thread.
pub struct NcclGroup<'a> {
    pub comms: &'a [NcclComm],
    pub streams: &'a [Arc<CudaStream>],
}

impl CommGroup for NcclGroup<'_> {
    fn world(&self) -> usize {
        self.comms.len()
    }
    fn run(&self, op: Op, rank: usize, input: &AnyBuffer, output: &mut AnyBuffer) -> Result<()> {
        driver::bind(self.streams[rank].context())?;
        any_buffer::nccl_run(&self.comms[rank], op, input, output, &self.streams[rank])
    }
    fn issue_all(&self, bufs: &mut Buffers) -> Result<()> {
        // One thread drives every rank: NCCL needs them in one group call.
        cudarc::nccl::result::group_start().map_err(|e| Error::Nccl(format!("ncclGroupStart: {:?}", e.0)))?;
        let mut result = Ok(());
        for r in 0..self.world() {
            result = self.run(bufs.collective, r, &bufs.inputs[r], &mut bufs.outputs[r]);
            if result.is_err() {
                break;
            }
        }
        cudarc::nccl::result::group_end().map_err(|e| Error::Nccl(format!("ncclGroupEnd: {:?}", e.0)))?;
        result
    }
    fn capturable_per_rank(&self) -> bool {
        self.comms.len() == 1
    }
    fn describe(&self, _: Op, _: usize, _: DType, _: bool) -> String {
        "nccl".into()
    }
    fn roundings(&self, op: Op, _: usize, _: DType, _: bool) -> usize {
        match op {
            Op::AllGather => 0,
            _ => self.comms.len(),
        }
    }
}

/// A group of our communicators over `ranks`.
pub fn our_group(ranks: &Ranks, config: &Config) -> Result<Vec<Comm>> {
    Comm::from_streams(ranks.streams.clone(), config.clone())
}

/// NCCL communicators over `ranks` (distinct GPUs only), or why not.
pub fn nccl_group(ranks: &Ranks) -> std::result::Result<Vec<NcclComm>, String> {
    if !ranks.nccl_possible() {
        return Err("NCCL cannot place two ranks on one GPU".into());
    }
    if !tp_allreduce::nccl::available() {
        return Err("libnccl not found (cudarc loads libnccl.so from LD_LIBRARY_PATH)".into());
    }
    NcclComm::init_all(&ranks.ordinals).map_err(|e| e.to_string())
}
