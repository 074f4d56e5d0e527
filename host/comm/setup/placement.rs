//! Init step 1, placement: every rank says where it runs (process, GPU,
//! SM count, kernel occupancy, configuration shape) and derives from the
//! gathered list what the whole group uses. Everything group-wide depends
//! on the gathered list only, never on the rank's own GPU: ranks per GPU
//! may differ (3 ranks on 2 GPUs), and a decision that differed between
//! ranks (such as creating the NCCL fallback, a collective) would send
//! them into different rendezvous rounds.

#![forbid(unsafe_code)]

use cudarc::driver::CudaContext;
use serde::{Deserialize, Serialize};
use tp_allreduce_kernels::layout::THREADS_PER_BLOCK;

use super::process_token;
use crate::algorithm::entries::{fused_wide_entries, hot_entries, sentinel_entries};
use crate::algorithm::ResidentBlocks;
use crate::comm::watchdog::ProcessIdentity;
use crate::config::Config;
use crate::driver::{self, KernelModule};
use crate::error::{Error, Result};
use crate::rendezvous::all_gather_json;
use crate::rendezvous::Rendezvous;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Hello {
    pub(super) process: String,
    pub(super) device_uuid: String,
    pub(super) ordinal: usize,
    pub(super) sms: u32,
    pub(super) blocks_per_sm: u32,
    pub(super) shape: String,
    pub(super) salt: u32,
    /// This rank's GPU runs the cluster entries (`KernelModule::clusters`).
    #[serde(default)]
    pub(super) clusters: bool,
    pub(super) job: String,
    pub(super) nccl_fallback: bool,
    /// This rank's process (the watchdog of other processes' ranks).
    #[serde(default)]
    pub(super) process_identity: Option<ProcessIdentity>,
}

/// What step 1 agreed.
pub(super) struct Placement {
    pub(super) hellos: Vec<Hello>,
    /// `same_process[p]`: rank p runs in this rank's process.
    pub(super) same_process: Vec<bool>,
    pub(super) ranks_on_device: usize,
    /// Every rank on its own GPU and asking for NCCL (same on every rank).
    pub(super) nccl_eligible: bool,
    /// No two ranks share a GPU (same on every rank).
    pub(super) one_rank_per_gpu: bool,
    pub(super) pull_max_blocks: u32,
    pub(super) ring_blocks: u32,
    /// Fused calls spread rows over thread-block clusters: asked for
    /// (`Config::fused_clusters`) and every rank's GPU runs them, so every
    /// rank launches the same kernels (the same reduction tree, the same
    /// bits).
    pub(super) fused_clusters: bool,
    /// Rank 0's salt (P2P check patterns) and job id (shared-memory names).
    pub(super) salt: u32,
    pub(super) job: String,
}

/// Step 1: who is where, and the block limits every rank uses.
pub(super) fn agree_placement(
    ctx: &CudaContext,
    module: &KernelModule,
    rank: usize,
    rdv: &dyn Rendezvous,
    config: &Config,
) -> Result<Placement> {
    // The SMs this context may use (an MPS client may have fewer than the GPU).
    let sms = driver::context_sm_count(ctx)?;
    let mut blocks_per_sm = u32::MAX;
    for name in hot_entries() {
        blocks_per_sm = blocks_per_sm.min(module.max_blocks_per_sm(&name, THREADS_PER_BLOCK)?);
    }
    let salt: u32 = rand_u32();
    let hello = Hello {
        process: process_token().to_string(),
        device_uuid: driver::device_uuid(ctx.cu_device())?,
        ordinal: ctx.ordinal(),
        sms,
        blocks_per_sm,
        shape: config.shape_fingerprint(),
        salt,
        clusters: module.clusters,
        job: format!("{:016x}", (salt as u64) << 32 | rand_u32() as u64),
        nccl_fallback: config.nccl_fallback,
        process_identity: ProcessIdentity::of_self(),
    };
    let hellos = all_gather_json(rdv, &hello)?;
    if hellos.len() != rdv.world_size() || rank >= hellos.len() {
        return Err(Error::Protocol {
            from: "rendezvous".into(),
            what: format!("{} hellos for a world of {}", hellos.len(), rdv.world_size()),
        });
    }
    for (r, h) in hellos.iter().enumerate() {
        if h.shape != hello.shape {
            return Err(Error::invalid(format!(
                "rank {r} uses a different configuration than rank {rank}:\n  rank {r}: {}\n  rank {rank}: {}",
                h.shape, hello.shape
            )));
        }
    }
    Ok(Placement::from_hellos(hellos, rank, config))
}

impl Placement {
    /// What rank `me` derives from every rank's hello. Pure. Everything but
    /// `same_process` and `ranks_on_device` is the same on every rank: it
    /// depends on the gathered hellos only (ranks per GPU may differ).
    fn from_hellos(hellos: Vec<Hello>, me: usize, config: &Config) -> Placement {
        let ranks_on = |uuid: &str| hellos.iter().filter(|h| h.device_uuid == uuid).count();
        // Every rank's blocks must fit on its GPU together with the blocks of
        // the other ranks sharing it; all ranks use the smallest such limit.
        let resident_limit = hellos
            .iter()
            .map(|h| (h.sms as usize * h.blocks_per_sm.max(1) as usize / ranks_on(&h.device_uuid)).max(1))
            .min()
            .unwrap_or(1) as u32;
        // NCCL cannot run two ranks on one GPU; creating it is collective, so
        // the decision must not depend on this rank's own GPU (with 3 ranks
        // on 2 GPUs the lone rank would enter NCCL's rounds alone).
        let nccl_eligible = hellos.len() > 1 && hellos.iter().all(|h| h.nccl_fallback && ranks_on(&h.device_uuid) == 1);
        let one_rank_per_gpu = hellos.iter().all(|h| ranks_on(&h.device_uuid) == 1);
        let mine = &hellos[me];
        Placement {
            same_process: hellos.iter().map(|h| h.process == mine.process).collect(),
            ranks_on_device: ranks_on(&mine.device_uuid),
            nccl_eligible,
            one_rank_per_gpu,
            pull_max_blocks: config.pull_max_blocks.min(resident_limit),
            ring_blocks: config.ring_blocks.min(resident_limit),
            // Batch invariance: whether a row spreads over a cluster depends
            // on the row count, and so would the sum-of-squares tree.
            fused_clusters: config.fused_clusters && !config.batch_invariant && hellos.iter().all(|h| h.clusters),
            salt: hellos[0].salt,
            job: hellos[0].job.clone(),
            hellos,
        }
    }
}

fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let token = u128::from_str_radix(process_token(), 16).unwrap_or(0);
    let mut x = (t ^ token ^ (t >> 64)) as u64;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x as u32
}

/// [`ResidentBlocks`] from the loaded kernels' occupancy: the smallest over
/// every sentinel entry and every fused entry of one pack per thread (both
/// launch with up to 1024 threads), times the SM count, divided among the
/// ranks that share the GPU.
pub(crate) fn resident_blocks(module: &KernelModule, sms: u32, ranks_on_device: usize) -> Result<ResidentBlocks> {
    let mut table = [0u32; 32];
    for (i, cap) in table.iter_mut().enumerate() {
        let threads = 32 * (i as u32 + 1);
        let mut per_sm = u32::MAX;
        for name in sentinel_entries().into_iter().chain(fused_wide_entries()) {
            per_sm = per_sm.min(module.max_blocks_per_sm(&name, threads)?);
        }
        *cap = sms * per_sm / ranks_on_device.max(1) as u32;
    }
    Ok(ResidentBlocks(table))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(process: &str, gpu: &str, sms: u32) -> Hello {
        Hello {
            process: process.into(),
            device_uuid: gpu.into(),
            ordinal: 0,
            sms,
            blocks_per_sm: 1,
            shape: String::new(),
            salt: 7,
            clusters: true,
            job: "job".into(),
            nccl_fallback: true,
            process_identity: None,
        }
    }

    /// 3 ranks on 2 GPUs. Whether NCCL is created must not depend
    /// on the rank's own GPU (creating it is collective): the lone rank on GPU 1
    /// would enter NCCL's rounds while the others compared selection tables.
    #[test]
    fn an_uneven_placement_gives_every_rank_the_same_group_decisions() {
        let hellos = vec![hello("p", "gpu-a", 132), hello("p", "gpu-a", 132), hello("p", "gpu-b", 132)];
        let config = Config::default();
        let seen: Vec<Placement> = (0..3).map(|me| Placement::from_hellos(hellos.clone(), me, &config)).collect();
        assert_eq!(seen.iter().map(|p| p.ranks_on_device).collect::<Vec<_>>(), [2, 2, 1]);
        for p in &seen {
            assert!(!p.nccl_eligible, "two ranks share gpu-a: NCCL cannot run on any rank");
            let limits = (p.pull_max_blocks, p.ring_blocks, p.salt, &p.job);
            assert_eq!(limits, (seen[0].pull_max_blocks, seen[0].ring_blocks, 7, &seen[0].job));
            assert_eq!(p.same_process, [true, true, true]);
        }
        // 132 SMs shared by two ranks: 66 blocks each, the smallest limit.
        assert_eq!(seen[0].pull_max_blocks, config.pull_max_blocks.min(66));
    }

    #[test]
    fn nccl_needs_distinct_gpus_and_every_rank_asking_for_it() {
        let config = Config::default();
        let distinct = vec![hello("p", "gpu-a", 132), hello("q", "gpu-b", 132)];
        assert!(Placement::from_hellos(distinct.clone(), 1, &config).nccl_eligible);
        let mut one_declines = distinct.clone();
        one_declines[1].nccl_fallback = false;
        for me in 0..2 {
            assert!(!Placement::from_hellos(one_declines.clone(), me, &config).nccl_eligible);
        }
        assert!(!Placement::from_hellos(vec![hello("p", "gpu-a", 132)], 0, &config).nccl_eligible);
        let mixed = Placement::from_hellos(distinct, 0, &config);
        assert_eq!(mixed.same_process, [true, false]);
    }
}
