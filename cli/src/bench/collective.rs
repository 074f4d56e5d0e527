//! Ours and NCCL behind one trait, so one timing loop measures both on the
//! same buffers.
#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::ranks::{Buffers, Ranks};
use crate::any_buffer::{self, AnyBuffer};
use tp_allreduce::comm::{Comm, Config};
use tp_allreduce::driver;
use tp_allreduce::error::{Error, Result};
use tp_allreduce::nccl::NcclComm;
use tp_allreduce::DType;

/// Something that can allreduce rank r's buffers on its stream.
pub trait Collective: Sync {
    fn world(&self) -> usize;
    /// One allreduce of rank `rank` (sum), queued on its stream.
    fn all_reduce(&self, rank: usize, input: &AnyBuffer, output: &mut AnyBuffer) -> Result<()>;
    /// One allreduce on every rank (NCCL wraps them in one group call).
    fn issue_all(&self, bufs: &mut Buffers) -> Result<()> {
        for r in 0..self.world() {
            self.all_reduce(r, &bufs.inputs[r], &mut bufs.outputs[r])?;
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
    fn describe(&self, bytes: usize, dtype: DType) -> String;
    fn roundings(&self, bytes: usize, dtype: DType) -> usize;
}

/// Our communicators, one per rank (each on its rank's stream).
pub struct OurGroup<'a> {
    pub comms: &'a [Comm],
}

impl Collective for OurGroup<'_> {
    fn world(&self) -> usize {
        self.comms.len()
    }
    fn all_reduce(&self, rank: usize, input: &AnyBuffer, output: &mut AnyBuffer) -> Result<()> {
        any_buffer::all_reduce(&self.comms[rank], input, output)
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
    fn describe(&self, bytes: usize, dtype: DType) -> String {
        self.comms[0].plan_call(bytes, dtype, true, false).algorithm.name().to_string()
    }
    fn roundings(&self, bytes: usize, dtype: DType) -> usize {
        self.comms[0].plan_call(bytes, dtype, true, false).algorithm.max_roundings(self.comms.len())
    }
}

/// NCCL communicators, one per rank, driven from this thread.
pub struct NcclGroup<'a> {
    pub comms: &'a [NcclComm],
    pub streams: &'a [Arc<CudaStream>],
}

impl Collective for NcclGroup<'_> {
    fn world(&self) -> usize {
        self.comms.len()
    }
    fn all_reduce(&self, rank: usize, input: &AnyBuffer, output: &mut AnyBuffer) -> Result<()> {
        driver::bind(self.streams[rank].context())?;
        any_buffer::nccl_all_reduce(&self.comms[rank], input, output, &self.streams[rank])
    }
    fn issue_all(&self, bufs: &mut Buffers) -> Result<()> {
        // One thread drives every rank: NCCL needs them in one group call.
        cudarc::nccl::result::group_start().map_err(|e| Error::Nccl(format!("ncclGroupStart: {:?}", e.0)))?;
        let mut result = Ok(());
        for r in 0..self.world() {
            result = self.all_reduce(r, &bufs.inputs[r], &mut bufs.outputs[r]);
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
    fn describe(&self, _: usize, _: DType) -> String {
        "nccl".into()
    }
    fn roundings(&self, _: usize, _: DType) -> usize {
        self.comms.len()
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
