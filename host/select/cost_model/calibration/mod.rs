//! The calibration points (measured or published figures the model must
//! reproduce: `points.rs`) and the residual table docs/COST-MODEL.md shows.

mod points;

use super::{CostModel, NcclTuning, NcclVariant, Options};
use crate::algorithm::{Algorithm, IslandSplit, Transport};

/// Largest residual an asserted point may have.
pub const TOLERANCE: f64 = 0.20;

/// What a calibration point predicts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Subject {
    Ours(Algorithm),
    NcclBest,
    Nccl(NcclVariant),
}

/// A measured (or derived) figure the model must reproduce.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    Us(f64),
    /// Predicted time divided by the best NCCL prediction.
    RatioToNccl(f64),
}

/// Whether a point is held to [`TOLERANCE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Our kernels as they are, and NCCL: within [`TOLERANCE`] (a test).
    Asserted,
    /// Reported only: another implementation of the algorithm, or a
    /// kernel design being replaced.
    Reference,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CalibrationPoint {
    /// An embedded topology (`topology::embedded`).
    pub topology: &'static str,
    pub world: usize,
    /// Ranks on each of the first `world / ranks_per_gpu` GPUs.
    pub ranks_per_gpu: usize,
    /// Consecutive islands of this many ranks (`--island-size`); 0: as the
    /// topology derives them.
    pub island_size: usize,
    pub bytes: usize,
    pub subject: Subject,
    pub transport: Transport,
    /// Which NCCL the figure was measured with (for NCCL subjects and
    /// ratios).
    pub nccl: NcclTuning,
    pub target: Target,
    pub role: Role,
    pub source: &'static str,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Residual {
    pub point: CalibrationPoint,
    /// In the target's unit (us or ratio).
    pub predicted: f64,
    pub target: f64,
    /// `(predicted - target) / target`.
    pub relative: f64,
}

const KB: usize = 1024;

/// Every calibration point (`points.rs`), graph-replay conditions.
pub fn calibration_points() -> &'static [CalibrationPoint] {
    &points::POINTS
}

/// The model's residual on every calibration point.
pub fn residuals(model: &CostModel) -> Vec<Residual> {
    calibration_points()
        .iter()
        .map(|&point| {
            let topo =
                crate::select::topology::embedded::by_name(point.topology).expect("calibration topology is embedded");
            let rpg = point.ranks_per_gpu.max(1);
            let devices: Vec<usize> = (0..point.world).map(|r| r / rpg).collect();
            let view = topo.for_ranks(&devices).expect("calibration ranks fit the topology");
            let mut opts = Options { nccl: point.nccl, ..Options::for_topology(&view) };
            if point.island_size > 0 {
                opts.islands = Some(
                    IslandSplit::consecutive(point.island_size, point.world)
                        .expect("calibration islands split the ranks"),
                );
            }
            let predict = |subject: Subject| -> f64 {
                match subject {
                    Subject::Ours(a) => model
                        .predict(&view, a, point.transport, point.bytes, &opts)
                        .map(|p| p.total_us())
                        .unwrap_or(f64::NAN),
                    Subject::NcclBest => model.predict_nccl_best(&view, point.transport, point.bytes, &opts).total_us(),
                    Subject::Nccl(v) => model.predict_nccl(&view, v, point.transport, point.bytes, &opts).total_us(),
                }
            };
            let (predicted, target) = match point.target {
                Target::Us(t) => (predict(point.subject), t),
                Target::RatioToNccl(r) => (predict(point.subject) / predict(Subject::NcclBest), r),
            };
            Residual { point, predicted, target, relative: (predicted - target) / target }
        })
        .collect()
}

/// The residuals as a markdown table (what docs/COST-MODEL.md shows).
pub fn residual_table(model: &CostModel) -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "| topology | ranks | size | subject | target | model | residual | check |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in residuals(model) {
        let p = r.point;
        let subject = match p.subject {
            Subject::Ours(a) => a.name().to_string(),
            Subject::NcclBest => "nccl (best)".into(),
            Subject::Nccl(v) => v.to_string(),
        };
        let (t, m) = match p.target {
            Target::Us(_) => (format!("{:.2} us", r.target), format!("{:.2} us", r.predicted)),
            Target::RatioToNccl(_) => (format!("{:.2}x NCCL", r.target), format!("{:.2}x NCCL", r.predicted)),
        };
        let ranks = if p.ranks_per_gpu > 1 {
            format!("{} on {} GPU", p.world, p.world / p.ranks_per_gpu)
        } else {
            p.world.to_string()
        };
        let check = match p.role {
            Role::Asserted => format!("±{:.0} %", 100.0 * TOLERANCE),
            Role::Reference => "reference".into(),
        };
        let _ = writeln!(
            s,
            "| {} | {ranks} | {} KB | {subject} | {t} | {m} | {:+.1} % | {check} |",
            p.topology,
            p.bytes / KB,
            100.0 * r.relative
        );
    }
    s
}
