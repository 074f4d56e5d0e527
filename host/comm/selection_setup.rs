//! Algorithm selection at init: the communicator's rank view of the machine
//! topology (rank 0 discovers it and shares it, so every rank models the
//! same machine), the constraints this communicator actually has, the
//! tuning table when one matches, and the precomputed selection table every
//! call looks up (a binary search, no allocation).

#![forbid(unsafe_code)]

use cudarc::driver::CudaContext;
use serde::{Deserialize, Serialize};

use super::setup::Setup;
use crate::algorithm::{Algorithm, IslandSplit, Transport};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::rendezvous::{all_gather_json, Rendezvous};
use crate::select::cost_model::{CostModel, CostParams};
use crate::select::selection::{Constraints, SelectionTable};
use crate::select::topology::Topology;
use crate::select::tuning::{Loaded, TuningTable};

/// The PCI bus id of the context's device, normalised.
fn bus_id(ctx: &CudaContext) -> Result<String> {
    let raw = crate::driver::pci_bus_id(ctx.cu_device())?;
    Ok(crate::select::topology::discover::normalize_bus_id(&raw))
}

/// Collective: the rank view (rank r on its GPU of the machine topology).
/// Rank 0 discovers the machine (or takes `TP_ALLREDUCE_TOPOLOGY`) and
/// sends the view to everyone. Returns the view and notes for the log.
pub(crate) fn rank_view(
    ctx: &CudaContext,
    rank: usize,
    world: usize,
    rdv: &dyn Rendezvous,
) -> Result<(Topology, Vec<String>)> {
    let mine = bus_id(ctx)?;
    let ids = rdv.all_gather(mine.as_bytes())?;
    let mut notes = Vec::new();
    let payload = if rank == 0 {
        let machine = match crate::select::topology::embedded::from_env()? {
            Some(t) => {
                notes.push(format!("topology `{}` from {}", t.name, crate::env::TOPOLOGY));
                t
            }
            None => crate::select::topology::discover::discover()?,
        };
        let wanted: Vec<String> = ids.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
        let devices: Option<Vec<usize>> =
            wanted.iter().map(|id| machine.gpus.iter().position(|g| g.pci_bus_id.eq_ignore_ascii_case(id))).collect();
        let view = match devices {
            Some(d) => machine.for_ranks(&d)?,
            None => {
                notes.push(format!(
                    "some ranks' GPUs ({wanted:?}) are not in the topology rank 0 sees; modelling rank r on GPU r"
                ));
                machine.for_world(world)?
            }
        };
        view.to_json()?.into_bytes()
    } else {
        Vec::new()
    };
    let all = rdv.all_gather(&payload)?;
    let text = String::from_utf8(all[0].clone())
        .map_err(|_| Error::Protocol { from: "rank 0".into(), what: "topology is not UTF-8".into() })?;
    Ok((Topology::from_json(&text)?, notes))
}

/// The islands the hierarchy uses and where they come from: the
/// configured groups (`Config::islands`), else consecutive islands of
/// `Config::island_size`, else the topology's (any shape), else none. A
/// configured shape that does not work is an error; the topology's is
/// only used when the kernel runs it. Pure.
pub(crate) fn islands(view: &Topology, config: &Config, world: usize) -> Result<Option<(IslandSplit, String)>> {
    let configured = |split: std::result::Result<IslandSplit, String>, what: &str| match split {
        Ok(s) if s.splits() => Ok(Some((s, format!("islands {s} {what}")))),
        Ok(s) => Err(Error::invalid(format!("islands {s}: at least two islands are needed"))),
        Err(why) => Err(Error::invalid(why)),
    };
    if let Some(groups) = &config.islands {
        return configured(IslandSplit::from_groups(groups, world), "configured");
    }
    if let Some(m) = config.island_size {
        return configured(IslandSplit::consecutive(m, world), "of island_size");
    }
    Ok(view.island_split().map(|s| (s, format!("islands {s} from the topology"))))
}

/// Collective: the selection tables for this communicator (plain calls,
/// and fused calls built from the same inputs). Every rank must arrive at
/// the same plain table (checked through a digest), hence the same fused one.
/// The fifth value says where the choices come from (for the creation log),
/// the last which `tune` table was used, if any.
#[allow(clippy::type_complexity)]
pub(crate) fn build_table(
    mut view: Topology,
    setup: &Setup,
    config: &Config,
    nccl_available: bool,
    rdv: &dyn Rendezvous,
) -> Result<(SelectionTable, SelectionTable, Topology, Vec<String>, String, Option<String>)> {
    let world = view.len();
    // What the transfer check found, per pair: every pair with P2P, none
    // host-staged, only island-mates with the per-pair transport.
    for a in 0..world {
        for b in 0..world {
            if a != b {
                let p2p_ok = match setup.transport {
                    Transport::PeerToPeer => true,
                    Transport::HostStaged => false,
                    Transport::PerPair => setup.island_split.is_some_and(|s| s.together(a, b)),
                };
                view.set_p2p_check(a, b, p2p_ok);
            }
        }
    }
    let mut constraints = Constraints::for_topology(&view).with_env()?;
    constraints.transport = setup.transport;
    constraints.nccl_available = nccl_available;
    constraints.islands = setup.island_split;
    constraints.copy_engine = setup.layout.copy_engine_pieces > 0;
    constraints.one_shot_push_max_bytes =
        setup.layout.one_shot_push_max_packs as usize * tp_allreduce_kernels::layout::PACK_BYTES;
    // The allreduce tables: an algorithm of another collective forces only
    // that collective's calls.
    constraints.communicator_override =
        config.algorithm.filter(|a| a.collective() == tp_allreduce_kernels::ids::Collective::AllReduce);
    if config.batch_invariant {
        constraints.disabled.extend(Algorithm::BATCH_VARIANT);
        // NCCL is never chosen, not even as the bar to clear.
        constraints.nccl_available = false;
    }
    let mut notes = Vec::new();
    let mut tuning_used = "none".to_string();
    let mut source = "the cost model (no tuning table for this machine)".to_string();
    let tuning = match crate::env::tuning_file(&view.fingerprint(), world) {
        Some(path) => match TuningTable::load_for(&path, &view)? {
            Loaded::Usable(t) => {
                notes.push(format!("tuning table {} applies", path.display()));
                tuning_used = path.display().to_string();
                source = format!("tuning table {} (the cost model where it has no entry)", path.display());
                Some(t)
            }
            Loaded::Ignored { reason } => {
                notes.push(format!("no tuning table used: {reason}"));
                source = format!("the cost model (tuning table ignored: {reason})");
                None
            }
        },
        None => None,
    };
    if let Some(a) = constraints.communicator_override {
        source = format!("forced to {a} by the configuration");
    } else if let Some(a) = constraints.env_override {
        source = format!("forced to {a} by {} where it applies, else {source}", crate::env::ALGORITHM);
    }
    let model = CostModel::new(CostParams::default());
    let table = SelectionTable::build(&model, tuning.as_ref(), &view, &constraints);
    // Batch invariance: one fused path for every row count, the fused
    // one-shot push (cut into launches of whole rows at any size): the
    // fused kernels of other algorithms normalise with other block
    // reductions, and an unfused path rounds the sum before the residual
    // add. Which one depends on the row length only.
    let fused_constraints = if config.batch_invariant {
        Constraints { communicator_override: constraints.communicator_override.or(Some(Algorithm::OneShotPush)), ..constraints.clone() }
    } else {
        constraints.clone()
    };
    let fused = SelectionTable::build_fused(&model, tuning.as_ref(), &view, &fused_constraints);
    if config.batch_invariant && (table.chooses(Algorithm::Nccl) || fused.chooses(Algorithm::Nccl)) {
        let why = table.lookup(42 << 10, crate::DType::Bf16, true).reason.clone();
        return Err(Error::Config(format!(
            "batch_invariant: no algorithm whose results are independent of the message size runs on this \
             communicator (one-shot and two-shot push and pull; {}): {why}",
            setup.transport
        )));
    }
    let mine = TableSummary {
        digest: table.digest(),
        inputs: format!("topology {}, tuning table {tuning_used}, {constraints:?}", view.fingerprint()),
    };
    agree_on_tables(&all_gather_json(rdv, &mine)?)?;
    let tune_file = tuning.is_some().then_some(tuning_used);
    Ok((table, fused, view, notes, source, tune_file))
}

/// What a rank built its selection table from, and the table's digest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct TableSummary {
    pub digest: String,
    /// The inputs that may differ between ranks: topology fingerprint,
    /// tuning table, constraints.
    pub inputs: String,
}

/// Every rank must have built the same table; the error names the first
/// rank that did not and what its inputs were. Pure.
pub(crate) fn agree_on_tables(all: &[TableSummary]) -> Result<()> {
    let Some(first) = all.first() else { return Ok(()) };
    match all.iter().position(|s| s.digest != first.digest) {
        None => Ok(()),
        Some(r) if all[r].inputs == first.inputs => Err(Error::Config(format!(
            "rank {r} built a different selection table than rank 0 from the same inputs ({})",
            first.inputs
        ))),
        Some(r) => Err(Error::Config(format!(
            "ranks built different selection tables (different tuning files or TP_ALLREDUCE_* settings per rank):\n  \
             rank 0: {}\n  rank {r}: {}",
            first.inputs, all[r].inputs
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::select::topology::embedded;

    fn summary(digest: &str, inputs: &str) -> TableSummary {
        TableSummary { digest: digest.into(), inputs: inputs.into() }
    }

    #[test]
    fn equal_tables_agree_and_a_different_one_is_named_with_its_inputs() {
        assert!(agree_on_tables(&[summary("a", "x"), summary("a", "x"), summary("a", "x")]).is_ok());
        let err =
            agree_on_tables(&[summary("a", "nccl: false"), summary("a", "nccl: false"), summary("b", "nccl: true")])
                .unwrap_err()
                .to_string();
        assert!(err.contains("rank 2: nccl: true") && err.contains("rank 0: nccl: false"), "{err}");
    }

    /// 3 ranks on 2 GPUs (uneven placement). The constraints come from the
    /// gathered view and group-wide facts only, so every rank builds the
    /// same table whatever its own GPU holds.
    #[test]
    fn constraints_of_an_uneven_placement_are_the_same_on_every_rank() {
        let machine = embedded::default_topology();
        let view = machine.for_ranks(&[0, 0, 1]).unwrap();
        let json = view.to_json().unwrap();
        let tables: Vec<SelectionTable> = (0..3)
            .map(|_rank| {
                let view = Topology::from_json(&json).unwrap();
                let constraints = Constraints::for_topology(&view);
                assert!(!constraints.nccl_available, "ranks 0 and 1 share a GPU: no NCCL on any rank");
                SelectionTable::build(&CostModel::default(), None, &view, &constraints)
            })
            .collect();
        assert!(tables.iter().all(|t| t.digest() == tables[0].digest()));
    }
}
