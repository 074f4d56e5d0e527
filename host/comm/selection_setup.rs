//! Algorithm selection at init: the communicator's rank view of the machine
//! topology (rank 0 discovers it and shares it, so every rank models the
//! same machine), the constraints this communicator actually has, the
//! tuning table when one matches, and the precomputed selection table every
//! call looks up (a binary search, no allocation).

#![forbid(unsafe_code)]

use cudarc::driver::CudaContext;

use super::setup::Setup;
use crate::algorithm::Transport;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::rendezvous::Rendezvous;
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

/// The island size the hierarchy uses: the configured one, else the one the
/// topology derives (consecutive ranks), else none.
pub(crate) fn island_size(view: &Topology, config: &Config) -> Option<usize> {
    config.island_size.or_else(|| view.islands().and_then(|i| i.consecutive_size()))
}

/// Collective: the selection table for this communicator. Every rank must
/// arrive at the same table (checked through a digest).
pub(crate) fn build_table(
    mut view: Topology,
    setup: &Setup,
    config: &Config,
    nccl_available: bool,
    rdv: &dyn Rendezvous,
) -> Result<(SelectionTable, Topology, Vec<String>)> {
    let world = view.len();
    let p2p_ok = setup.transport == Transport::PeerToPeer;
    for a in 0..world {
        for b in 0..world {
            if a != b {
                view.set_p2p_check(a, b, p2p_ok);
            }
        }
    }
    let mut constraints = Constraints::for_topology(&view).with_env()?;
    constraints.transport = setup.transport;
    constraints.nccl_available = nccl_available;
    constraints.island_size = (setup.islands.island_count >= 2).then_some(setup.islands.island_size as usize);
    constraints.one_shot_push_max_bytes =
        setup.layout.one_shot_push_max_packs as usize * tp_allreduce_kernels::layout::PACK_BYTES;
    constraints.communicator_override = config.algorithm;
    let mut notes = Vec::new();
    let tuning = match crate::env::tuning_file(&view.fingerprint(), world) {
        Some(path) => match TuningTable::load_for(&path, &view)? {
            Loaded::Usable(t) => {
                notes.push(format!("tuning table {} applies", path.display()));
                Some(t)
            }
            Loaded::Ignored { reason } => {
                notes.push(format!("no tuning table used: {reason}"));
                None
            }
        },
        None => None,
    };
    let model = CostModel::new(CostParams::default());
    let table = SelectionTable::build(&model, tuning.as_ref(), &view, &constraints);
    let digests = rdv.all_gather(table.digest().as_bytes())?;
    if digests.iter().any(|d| d != &digests[0]) {
        return Err(Error::Config(
            "ranks built different selection tables (different tuning files or TP_ALLREDUCE_* settings per rank)"
                .into(),
        ));
    }
    Ok((table, view, notes))
}
