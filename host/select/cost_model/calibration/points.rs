//! The calibration points: measured (or published) figures the model is
//! checked against. Data only; `super` computes the residuals.
//!
//! *Asserted* points must stay within [`super::TOLERANCE`]: our own
//! measurements of the kernels the model prices (docs/results/...), and
//! NCCL's figures wherever they come from. *Reference* points are
//! reported, never asserted: figures of another implementation (the
//! published one-shot push of docs/SOURCES.md [F16] has its own launch and
//! poll overheads), and our flag kernels, whose designs are being replaced.

use super::{CalibrationPoint, Role, Subject, Target};
use crate::algorithm::{Algorithm, Transport};
use crate::select::cost_model::{NcclAlgo, NcclProto, NcclTuning, NcclVariant};

const KB: usize = 1024;
const MB: usize = 1024 * KB;

const H200: &str = "h200-8x-nvswitch";
const SWITCH4: &str = "rtx-pro-6000-4x-switch";
const MOTIVATING: &str = "rtx-pro-6000-8x-pcie5-2socket";

const TUNED: &str = "measured here: docs/results/h200-x2/speed-exp-1/tuned.json (tuned launch shapes)";
const DEFAULT_SHAPES: &str = "measured here: docs/results/h200-x2/speed-exp-1/new.json (default launch shapes)";
const NCCL_H200: &str = "measured here: docs/results/h200-x2/speed-exp-1/new.json (NCCL 2.28.9 through cudarc, graphs)";
const MPS8: &str = "measured here: docs/results/h200-x2/speed-exp-1/mps8-new.json (8 processes on one H200, MPS)";
const TUNE_TABLE: &str = "measured here: docs/results/h200-x2/speed-exp-1/tuning.toml (tp-allreduce tune)";
const PUBLISHED: &str = "docs/SOURCES.md [F16]: published one-shot push vs NCCL, 4x RTX PRO 6000";

/// One-shot push on 2 H200 (one process per GPU), asserted.
const H200_PUSH: CalibrationPoint = CalibrationPoint {
    topology: H200,
    world: 2,
    ranks_per_gpu: 1,
    bytes: 0,
    subject: Subject::Ours(Algorithm::OneShotPush),
    transport: Transport::PeerToPeer,
    nccl: NcclTuning::Stock,
    target: Target::Us(0.0),
    role: Role::Asserted,
    source: TUNED,
};
const H200_NCCL: CalibrationPoint = CalibrationPoint { subject: Subject::NcclBest, source: NCCL_H200, ..H200_PUSH };
const H200_FLAG: CalibrationPoint = CalibrationPoint { role: Role::Reference, source: TUNE_TABLE, ..H200_PUSH };
const MPS8_PUSH: CalibrationPoint = CalibrationPoint { world: 8, ranks_per_gpu: 8, source: MPS8, ..H200_PUSH };

/// The published 4-GPU comparison (stock NCCL).
const SWITCH4_NCCL: CalibrationPoint =
    CalibrationPoint { topology: SWITCH4, world: 4, subject: Subject::NcclBest, source: PUBLISHED, ..H200_PUSH };
const SWITCH4_PUSH: CalibrationPoint =
    CalibrationPoint { subject: Subject::Ours(Algorithm::OneShotPush), role: Role::Reference, ..SWITCH4_NCCL };
const MOTIVATING_NCCL: CalibrationPoint =
    CalibrationPoint { topology: MOTIVATING, world: 8, nccl: NcclTuning::Tuned, ..SWITCH4_NCCL };

const fn us(base: CalibrationPoint, bytes: usize, us: f64) -> CalibrationPoint {
    CalibrationPoint { bytes, target: Target::Us(us), ..base }
}

const fn flag(algorithm: Algorithm, bytes: usize, target: f64, source: &'static str) -> CalibrationPoint {
    CalibrationPoint { subject: Subject::Ours(algorithm), source, ..us(H200_FLAG, bytes, target) }
}

/// Every calibration point.
pub(super) const POINTS: [CalibrationPoint; 49] = [
    // 2 H200 over NVSwitch: one-shot push, the choice at every size.
    us(H200_PUSH, 4 * KB, 2.24),
    us(H200_PUSH, 16 * KB, 2.38),
    us(H200_PUSH, 42 * KB, 2.78),
    us(H200_PUSH, 64 * KB, 2.83),
    us(H200_PUSH, 256 * KB, 3.39),
    us(H200_PUSH, MB, 5.65),
    us(H200_PUSH, 8 * MB, 27.84),
    CalibrationPoint { source: DEFAULT_SHAPES, ..us(H200_PUSH, 4 * KB, 2.40) },
    CalibrationPoint { source: DEFAULT_SHAPES, ..us(H200_PUSH, 16 * KB, 2.66) },
    CalibrationPoint { source: DEFAULT_SHAPES, ..us(H200_PUSH, 42 * KB, 2.82) },
    CalibrationPoint { source: DEFAULT_SHAPES, ..us(H200_PUSH, 64 * KB, 2.92) },
    CalibrationPoint { source: DEFAULT_SHAPES, ..us(H200_PUSH, 256 * KB, 3.50) },
    CalibrationPoint { source: DEFAULT_SHAPES, ..us(H200_PUSH, MB, 5.71) },
    CalibrationPoint { source: DEFAULT_SHAPES, ..us(H200_PUSH, 8 * MB, 27.98) },
    // 2 H200: NCCL in the same bench.
    us(H200_NCCL, 4 * KB, 6.22),
    us(H200_NCCL, 16 * KB, 6.86),
    us(H200_NCCL, 42 * KB, 7.51),
    us(H200_NCCL, 64 * KB, 7.12),
    us(H200_NCCL, 256 * KB, 8.48),
    us(H200_NCCL, MB, 13.82),
    us(H200_NCCL, 8 * MB, 45.77),
    // 8 ranks sharing one H200 (MPS): one-shot push.
    us(MPS8_PUSH, 4 * KB, 5.98),
    us(MPS8_PUSH, 42 * KB, 6.45),
    us(MPS8_PUSH, 64 * KB, 7.07),
    // 2 H200: our flag kernels (reference).
    flag(Algorithm::OneShotPull, 4 * KB, 6.34, TUNE_TABLE),
    flag(Algorithm::TwoShotPull, 4 * KB, 10.34, TUNE_TABLE),
    flag(Algorithm::TwoShotPush, 4 * KB, 10.19, DEFAULT_SHAPES),
    flag(Algorithm::Ring, 4 * KB, 10.94, TUNE_TABLE),
    flag(Algorithm::Ring, MB, 38.73, TUNE_TABLE),
    flag(Algorithm::Ring, 8 * MB, 286.90, TUNE_TABLE),
    flag(Algorithm::OneShotPull, 8 * MB, 44.08, TUNE_TABLE),
    flag(Algorithm::TwoShotPush, 8 * MB, 114.43, DEFAULT_SHAPES),
    // The motivating machine: NCCL (asserted) and the deployment's pull.
    CalibrationPoint { source: "docs/SOURCES.md [F11]: tuned NCCL, 8 PCIe GPUs, 32 KB (LL)", ..us(MOTIVATING_NCCL, 32 * KB, 26.0) },
    CalibrationPoint { source: "docs/SOURCES.md [F11]: tuned NCCL, 8 PCIe GPUs, 256 KB", ..us(MOTIVATING_NCCL, 256 * KB, 37.0) },
    CalibrationPoint {
        subject: Subject::Nccl(NcclVariant { algo: NcclAlgo::Ring, proto: NcclProto::Ll }),
        source: "docs/SOURCES.md [F12]: NCCL's own cost model, ring LL small message, 8 PCIe GPUs",
        ..us(MOTIVATING_NCCL, KB, 20.0)
    },
    CalibrationPoint {
        subject: Subject::Ours(Algorithm::OneShotPull),
        target: Target::RatioToNccl(2.0),
        role: Role::Reference,
        source: "docs/SOURCES.md [F4]: vLLM's one-stage pull ~2x slower than NCCL on 8 PCIe GPUs (ratio applied to tuned NCCL)",
        ..us(MOTIVATING_NCCL, 42 * KB, 0.0)
    },
    CalibrationPoint {
        transport: Transport::HostStaged,
        nccl: NcclTuning::Stock,
        source: "docs/SOURCES.md [F1, F15]: NCCL ~200-250 us per 42 KB in the deployment; interpretation: NCCL through host memory",
        ..us(MOTIVATING_NCCL, 42 * KB, 225.0)
    },
    // The published 4-GPU comparison: NCCL (asserted), the published
    // kernel (reference).
    us(SWITCH4_PUSH, KB, 6.1),
    us(SWITCH4_NCCL, KB, 13.5),
    us(SWITCH4_PUSH, 16 * KB, 7.7),
    us(SWITCH4_NCCL, 16 * KB, 14.7),
    us(SWITCH4_PUSH, 32 * KB, 9.2),
    us(SWITCH4_NCCL, 32 * KB, 15.6),
    us(SWITCH4_PUSH, 128 * KB, 17.6),
    us(SWITCH4_NCCL, 128 * KB, 24.7),
    us(SWITCH4_PUSH, 512 * KB, 51.0),
    us(SWITCH4_NCCL, 512 * KB, 71.7),
    us(SWITCH4_PUSH, MB, 95.6),
    us(SWITCH4_NCCL, MB, 85.2),
];
