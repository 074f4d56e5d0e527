//! Choosing the algorithm for a call: a pure function ([`select`]) and the
//! table a communicator builds once at init ([`SelectionTable`]) so that a
//! call only does a binary search over size buckets.
//!
//! # Rules, in order
//! 1. Overrides: the per-communicator override, then `TP_ALLREDUCE_ALGORITHM`
//!    (parsed by [`crate::env`]). An override that cannot run here is not an
//!    error: it is skipped and the reason says why.
//! 2. Candidates: our algorithms that can run under the [`Constraints`]
//!    (pull needs the P2P transport, host-staged runs push algorithms only,
//!    hierarchical needs islands, one-shot push has a size limit, the
//!    caller may disable any), each with a time: the tuning table's median
//!    where it measured that (algorithm, transport) at this size, else the
//!    cost model's prediction.
//! 3. Against NCCL, when NCCL is available: the fastest candidate is
//!    chosen only if it beats NCCL by a margin — 10 % when either time comes
//!    from the model (its calibration error is up to ~25 % per point, mostly
//!    shared between the two sides), 2 % when both were measured. Otherwise
//!    NCCL. This is the trap of CONTEXT.md made a rule: on a PCIe topology
//!    with more than two ranks nothing the model or the tuning table ranks
//!    slower than NCCL is ever picked (and the margin makes that hold for
//!    near-ties as well). Measurements replace predictions for the
//!    candidates they cover; the rule applies to the resulting ranking.
//! 4. NCCL unavailable: the fastest of ours, and the reason says so.
//!    Nothing of ours applicable: NCCL with the reasons. "Not applicable" is
//!    never an error.
//!
//! All ranks of a communicator must pick the same algorithm for the same
//! call: build the table from identical inputs (the gathered rank view, the
//! same tuning table) and compare [`SelectionTable::digest`] across ranks.

use std::borrow::Cow;
use std::fmt;

use tp_allreduce_kernels::ids::DType;

use crate::algorithm::{Algorithm, Transport};
use crate::algorithms::{self, Capabilities};
use crate::env;
use crate::error::Result;
use crate::select::cost_model::{CostModel, NcclTuning, Options};
use crate::select::topology::Topology;
use crate::select::tuning::{TuningEntry, TuningTable};

/// Ours must be predicted this much faster than NCCL when a model
/// prediction is involved.
pub const MODEL_MARGIN: f64 = 0.10;
/// The same when both sides were measured (run-to-run noise).
pub const MEASURED_MARGIN: f64 = 0.02;
/// `one_shot_push_max_bytes` of the default communicator configuration.
pub const DEFAULT_ONE_SHOT_PUSH_MAX_BYTES: usize = 512 << 10;

/// What may run on this communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Constraints {
    /// The transport the communicator settled on at init (host-staged when
    /// P2P is unsupported or the transfer check failed on a pair).
    pub transport: Transport,
    /// An NCCL communicator exists (NCCL loaded, ranks on distinct GPUs).
    pub nccl_available: bool,
    /// Hierarchical: consecutive islands of this many ranks.
    pub island_size: Option<usize>,
    /// One-shot push handles messages up to this size.
    pub one_shot_push_max_bytes: usize,
    /// Algorithms the caller rules out.
    pub disabled: Vec<Algorithm>,
    /// `Comm::set_algorithm` / `Config::algorithm`.
    pub communicator_override: Option<Algorithm>,
    /// `TP_ALLREDUCE_ALGORITHM`.
    pub env_override: Option<Algorithm>,
}

impl Constraints {
    /// Defaults for a rank view: P2P when every pair has usable P2P, else
    /// host-staged; NCCL available unless ranks share a GPU; islands as the
    /// topology derives them when they are consecutive; no overrides.
    pub fn for_topology(view: &Topology) -> Constraints {
        Constraints {
            transport: if view.all_p2p_usable() { Transport::PeerToPeer } else { Transport::HostStaged },
            nccl_available: !view.has_shared_device(),
            island_size: view.islands().and_then(|i| i.consecutive_size()),
            one_shot_push_max_bytes: DEFAULT_ONE_SHOT_PUSH_MAX_BYTES,
            disabled: Vec::new(),
            communicator_override: None,
            env_override: None,
        }
    }

    /// Sets `env_override` from `TP_ALLREDUCE_ALGORITHM`.
    pub fn with_env(mut self) -> Result<Constraints> {
        self.env_override = crate::env::algorithm()?;
        Ok(self)
    }

    /// `Ok` when `algorithm` can run for a message of `bytes` on `world`
    /// ranks, else why not.
    pub fn available(&self, algorithm: Algorithm, world: usize, bytes: usize) -> std::result::Result<(), String> {
        if self.disabled.contains(&algorithm) {
            return Err(format!("{algorithm} is disabled"));
        }
        let caps = Capabilities {
            world,
            transport: self.transport,
            island_size: self.island_size,
            one_shot_push_max_bytes: self.one_shot_push_max_bytes,
            nccl_available: self.nccl_available,
        };
        algorithms::availability(algorithm, &caps, Some(bytes))
    }
}

/// Where a choice's time came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Model,
    Tuning,
    Override,
}

/// The selection's answer for one call.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub algorithm: Algorithm,
    pub transport: Transport,
    /// Why, with the numbers, for logs and `plan`.
    pub reason: String,
    /// Time of the chosen algorithm (measured or predicted, us); NaN when a
    /// forced algorithm has no prediction.
    pub predicted_us: f64,
    /// NCCL's time at this size (measured or predicted, us).
    pub nccl_predicted_us: f64,
    pub source: Source,
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}) {:.1} us vs NCCL {:.1} us: {}",
            self.algorithm, self.transport, self.predicted_us, self.nccl_predicted_us, self.reason
        )
    }
}

/// Selects with the default cost model and no tuning table. `topology` is
/// a rank view of `world_size` ranks, or a machine topology mapped with
/// [`Topology::for_world`].
pub fn select(
    topology: &Topology,
    world_size: usize,
    dtype: DType,
    bytes: usize,
    capturing: bool,
    constraints: &Constraints,
) -> Choice {
    select_with(&CostModel::default(), None, topology, world_size, dtype, bytes, capturing, constraints)
}

/// [`select`] with an explicit model and an optional tuning table (which
/// the caller has checked applies: [`TuningTable::applicability`]).
#[allow(clippy::too_many_arguments)]
pub fn select_with(
    model: &CostModel,
    tuning: Option<&TuningTable>,
    topology: &Topology,
    world_size: usize,
    dtype: DType,
    bytes: usize,
    capturing: bool,
    constraints: &Constraints,
) -> Choice {
    let view: Cow<'_, Topology> = if topology.len() == world_size {
        Cow::Borrowed(topology)
    } else {
        match topology.for_world(world_size) {
            Ok(v) => Cow::Owned(v),
            Err(e) => {
                return Choice {
                    algorithm: Algorithm::Nccl,
                    transport: constraints.transport,
                    reason: format!("no rank view: {e}; NCCL fallback"),
                    predicted_us: f64::NAN,
                    nccl_predicted_us: f64::NAN,
                    source: Source::Model,
                }
            }
        }
    };
    select_view(model, tuning, &view, dtype, bytes, capturing, constraints)
}

/// A time and where it came from.
#[derive(Clone, Copy, Debug)]
struct Timed {
    us: f64,
    source: Source,
}

/// The inputs of one selection, and the times they give each algorithm.
struct Selecting<'a> {
    model: &'a CostModel,
    view: &'a Topology,
    bytes: usize,
    opts: Options,
    c: &'a Constraints,
    /// The tuning entry covering this size, if any.
    entry: Option<&'a TuningEntry>,
    /// The tuning table's last entry for this dtype when `bytes` lies past
    /// it (no entry covers the size).
    past_table: Option<&'a TuningEntry>,
}

impl Selecting<'_> {
    fn time_of(&self, a: Algorithm) -> Option<Timed> {
        if let Some(us) = self.entry.and_then(|e| e.median_us(a, self.c.transport)) {
            return Some(Timed { us, source: Source::Tuning });
        }
        let p = self.model.predict(self.view, a, self.c.transport, self.bytes, &self.opts).ok()?;
        Some(Timed { us: p.total_us(), source: Source::Model })
    }

    fn choice(&self, algorithm: Algorithm, t: Option<Timed>, nccl: Timed, source: Source, reason: String) -> Choice {
        Choice {
            algorithm,
            transport: self.c.transport,
            reason,
            predicted_us: t.map_or(f64::NAN, |t| t.us),
            nccl_predicted_us: nccl.us,
            source,
        }
    }

    /// Rule 1: the first applicable override, and notes on skipped ones.
    fn overridden(&self) -> (Option<Algorithm>, String) {
        let mut notes = String::new();
        let forced =
            [(self.c.communicator_override, "the communicator's override"), (self.c.env_override, env::ALGORITHM)];
        for (forced, who) in forced {
            let Some(a) = forced else { continue };
            match self.c.available(a, self.view.len(), self.bytes) {
                Ok(()) => return (Some(a), format!("{notes}forced by {who}")),
                Err(why) => notes.push_str(&format!("{a} forced by {who} is not applicable ({why}); ")),
            }
        }
        (None, notes)
    }

    /// Rule 2: the fastest applicable algorithm of ours, and why the others
    /// were skipped.
    fn best_of_ours(&self) -> (Option<(Algorithm, Timed)>, Vec<String>) {
        let mut best: Option<(Algorithm, Timed)> = None;
        let mut skipped: Vec<String> = Vec::new();
        for a in Algorithm::OURS {
            if let Err(why) = self.c.available(a, self.view.len(), self.bytes) {
                skipped.push(why);
                continue;
            }
            match self.time_of(a) {
                Some(t) if best.is_none_or(|(_, b)| t.us < b.us) => best = Some((a, t)),
                Some(_) => {}
                None => skipped.push(format!("{a}: no prediction for this topology")),
            }
        }
        (best, skipped)
    }

    /// Rule 3: ours against NCCL with the margin for where the times came
    /// from.
    fn against_nccl(&self, a: Algorithm, t: Timed, nccl: Timed, notes: &str) -> Choice {
        let margin =
            if t.source == Source::Tuning && nccl.source == Source::Tuning { MEASURED_MARGIN } else { MODEL_MARGIN };
        let from = if t.source == Source::Tuning { "measured" } else { "predicted" };
        if t.us <= nccl.us * (1.0 - margin) {
            let why = format!("{notes}{a} {from} {:.1} us vs NCCL {:.1} us ({:.1}x)", t.us, nccl.us, nccl.us / t.us);
            return self.choice(a, Some(t), nccl, t.source, why);
        }
        let world = self.view.len();
        let rule = if self.view.is_pcie() && world > 2 { format!("PCIe with {world} ranks: ") } else { String::new() };
        let why = format!(
            "{notes}{rule}NCCL {:.1} us; the best of ours ({a}, {from} {:.1} us) is not at least {:.0} % faster",
            nccl.us,
            t.us,
            margin * 100.0
        );
        self.choice(Algorithm::Nccl, Some(nccl), nccl, nccl.source, why)
    }
}

fn select_view(
    model: &CostModel,
    tuning: Option<&TuningTable>,
    view: &Topology,
    dtype: DType,
    bytes: usize,
    capturing: bool,
    c: &Constraints,
) -> Choice {
    let entry = tuning.and_then(|t| t.lookup(dtype, bytes));
    let past_table = if entry.is_none() { tuning.and_then(|t| t.last(dtype)) } else { None };
    let s = Selecting {
        model,
        view,
        bytes,
        opts: Options { capturing, island_size: c.island_size, nccl: NcclTuning::Tuned },
        c,
        entry,
        past_table,
    };
    let nccl = s.time_of(Algorithm::Nccl).unwrap_or(Timed { us: f64::NAN, source: Source::Model });
    let (forced, notes) = s.overridden();
    if let Some(a) = forced {
        return s.choice(a, s.time_of(a), nccl, Source::Override, notes);
    }
    // Past the tuning table: never slower than NCCL where NCCL won the
    // largest measured size.
    if let Some(last) = s.past_table.filter(|e| e.winner == Algorithm::Nccl && c.nccl_available) {
        let why = format!(
            "{notes}beyond the tuning table (largest measured size {}): NCCL won there, so NCCL",
            human_bytes(last.bytes)
        );
        return s.choice(Algorithm::Nccl, Some(nccl), nccl, Source::Tuning, why);
    }
    match (s.best_of_ours(), c.nccl_available) {
        ((Some((a, t)), _), true) => s.against_nccl(a, t, nccl, &notes),
        ((Some((a, t)), _), false) => {
            let why = format!(
                "{notes}NCCL unavailable: fastest of ours is {a} ({:.1} us; NCCL would take ~{:.1} us)",
                t.us, nccl.us
            );
            s.choice(a, Some(t), nccl, t.source, why)
        }
        ((None, skipped), nccl_available) => {
            let tail = if nccl_available { "NCCL fallback" } else { "NCCL fallback, but NCCL is unavailable too" };
            let why = format!("{notes}none of ours applies ({}); {tail}", skipped.join("; "));
            s.choice(Algorithm::Nccl, Some(nccl), nccl, nccl.source, why)
        }
    }
}

/// Size buckets of the selection table: 4 per doubling from 1 KiB to
/// 256 MiB, each bound a multiple of 16 bytes, then one bucket for
/// everything larger.
pub fn bucket_bounds() -> Vec<usize> {
    let mut v: Vec<usize> = Vec::new();
    for k in 10..28 {
        for q in 0..4 {
            let x = 2f64.powf(k as f64 + q as f64 / 4.0);
            let b = (x / 16.0).ceil() as usize * 16;
            if v.last() != Some(&b) {
                v.push(b);
            }
        }
    }
    v.push(1 << 28);
    v.push(usize::MAX);
    v
}

/// The selection precomputed for every (dtype, capturing, size bucket).
/// Built once at communicator init; [`SelectionTable::lookup`] is a binary
/// search over the bucket bounds and allocates nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct SelectionTable {
    bounds: Vec<usize>,
    /// `[(dtype * 2 + capturing) * bounds.len() + bucket]`.
    choices: Vec<Choice>,
    constraints: Constraints,
    fingerprint: String,
    world: usize,
}

impl SelectionTable {
    /// Evaluates the selection at each bucket's upper bound (the last,
    /// unbounded bucket at twice the previous bound) for every dtype, graph
    /// replay and eager. `tuning` must already be checked to apply to
    /// `view`.
    pub fn build(
        model: &CostModel,
        tuning: Option<&TuningTable>,
        view: &Topology,
        constraints: &Constraints,
    ) -> SelectionTable {
        let bounds = bucket_bounds();
        let at = |i: usize| {
            if bounds[i] == usize::MAX {
                bounds[i - 1].saturating_mul(2)
            } else {
                bounds[i]
            }
        };
        // The model does not depend on the dtype: evaluate it once per
        // (capturing, bucket) and only re-select for dtypes the tuning table
        // has entries for.
        let model_only: Vec<Choice> = [false, true]
            .into_iter()
            .flat_map(|capturing| (0..bounds.len()).map(move |i| (capturing, i)))
            .map(|(capturing, i)| select_view(model, None, view, DType::F32, at(i), capturing, constraints))
            .collect();
        let mut choices = Vec::with_capacity(DType::ALL.len() * model_only.len());
        for dtype in DType::ALL {
            for capturing in [false, true] {
                for i in 0..bounds.len() {
                    // Covered by a measured bucket, or past the largest one
                    // (where the "NCCL won there" rule applies).
                    let tuned = tuning.is_some_and(|t| t.lookup(dtype, at(i)).is_some() || t.last(dtype).is_some());
                    choices.push(if tuned {
                        select_view(model, tuning, view, dtype, at(i), capturing, constraints)
                    } else {
                        model_only[usize::from(capturing) * bounds.len() + i].clone()
                    });
                }
            }
        }
        SelectionTable {
            bounds,
            choices,
            constraints: constraints.clone(),
            fingerprint: view.fingerprint(),
            world: view.len(),
        }
    }

    fn index(&self, bytes: usize, dtype: DType, capturing: bool) -> usize {
        let bucket = self.bounds.partition_point(|&b| b < bytes);
        (dtype as usize * 2 + usize::from(capturing)) * self.bounds.len() + bucket.min(self.bounds.len() - 1)
    }

    /// The choice for a call. O(log buckets), no allocation.
    pub fn lookup(&self, bytes: usize, dtype: DType, capturing: bool) -> &Choice {
        &self.choices[self.index(bytes, dtype, capturing)]
    }

    pub fn bounds(&self) -> &[usize] {
        &self.bounds
    }

    pub fn constraints(&self) -> &Constraints {
        &self.constraints
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Hex digest of every (bucket, algorithm, transport) plus the
    /// topology fingerprint: equal on every rank iff the ranks will choose
    /// alike. Exchange it at init.
    pub fn digest(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        eat(self.fingerprint.as_bytes());
        for (i, c) in self.choices.iter().enumerate() {
            eat(&(i as u64).to_le_bytes());
            eat(c.algorithm.name().as_bytes());
            eat(c.transport.name().as_bytes());
        }
        format!("{h:016x}")
    }

    /// Ranges of sizes with the same choice, for logs:
    /// `"<= 48 KiB: hierarchical; <= 512 KiB: ring; ..."`.
    pub fn describe(&self, dtype: DType, capturing: bool) -> String {
        let base = (dtype as usize * 2 + usize::from(capturing)) * self.bounds.len();
        let mut parts: Vec<String> = Vec::new();
        for i in 0..self.bounds.len() {
            let c = &self.choices[base + i];
            let last = i + 1 == self.bounds.len() || self.choices[base + i + 1].algorithm != c.algorithm;
            if last {
                let upto = if self.bounds[i] == usize::MAX {
                    "larger".to_string()
                } else {
                    format!("<= {}", human_bytes(self.bounds[i]))
                };
                parts.push(format!("{upto}: {}", c.algorithm));
            }
        }
        parts.join("; ")
    }
}

/// `43008` -> `"42 KiB"`, `1536` -> `"1.5 KiB"`.
pub fn human_bytes(b: usize) -> String {
    let (v, unit) = if b >= 1 << 20 {
        (b as f64 / (1u64 << 20) as f64, "MiB")
    } else if b >= 1 << 10 {
        (b as f64 / 1024.0, "KiB")
    } else {
        (b as f64, "B")
    };
    if (v - v.round()).abs() < 1e-9 {
        format!("{v:.0} {unit}")
    } else {
        format!("{v:.1} {unit}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::select::topology::embedded;
    use crate::select::tuning::{Measurement, TuningMeta};

    fn sizes() -> Vec<usize> {
        let mut v: Vec<usize> = (8..=25).map(|k| 1usize << k).collect();
        v.extend([43008, 3000, 100_000, 700_000]);
        v.sort_unstable();
        v
    }

    fn views() -> Vec<Topology> {
        let mut v = Vec::new();
        for name in embedded::names() {
            let t = embedded::by_name(name).unwrap();
            for world in [2, 3, 4, 6, 8] {
                if world <= t.len() {
                    v.push(t.for_world(world).unwrap());
                }
            }
        }
        v
    }

    #[test]
    fn overrides_win_in_order() {
        let view = embedded::default_topology();
        let mut c = Constraints::for_topology(&view);
        c.env_override = crate::env::parse_algorithm("ring").unwrap();
        let ch = select(&view, 8, DType::Bf16, 43008, true, &c);
        assert_eq!(ch.algorithm, Algorithm::Ring);
        assert_eq!(ch.source, Source::Override);
        assert!(ch.reason.contains("TP_ALLREDUCE_ALGORITHM"), "{}", ch.reason);
        c.communicator_override = Some(Algorithm::OneShotPull);
        let ch = select(&view, 8, DType::Bf16, 43008, true, &c);
        assert_eq!(ch.algorithm, Algorithm::OneShotPull, "forced even though slower than NCCL");
        assert!(ch.reason.contains("override"), "{}", ch.reason);
        // An override that cannot run is skipped, with the reason.
        let gpus = embedded::by_name("rtx-4090-8x-no-p2p").unwrap();
        let mut c = Constraints::for_topology(&gpus);
        c.communicator_override = Some(Algorithm::TwoShotPull);
        let ch = select(&gpus, 8, DType::Bf16, 43008, true, &c);
        assert_ne!(ch.algorithm, Algorithm::TwoShotPull);
        assert!(ch.reason.contains("not applicable"), "{}", ch.reason);
        c.env_override = Some(Algorithm::Nccl);
        assert_eq!(select(&gpus, 8, DType::Bf16, 43008, true, &c).algorithm, Algorithm::Nccl);
        assert!(crate::env::parse_algorithm("fastest").is_err());
    }

    #[test]
    fn never_slower_than_nccl_on_pcie_with_more_than_two_ranks() {
        let model = CostModel::default();
        for view in views() {
            let c = Constraints::for_topology(&view);
            let n = view.len();
            for &bytes in &sizes() {
                for capturing in [true, false] {
                    let ch = select(&view, n, DType::Bf16, bytes, capturing, &c);
                    let opts = Options { capturing, island_size: c.island_size, nccl: NcclTuning::Tuned };
                    let nccl = model.predict(&view, Algorithm::Nccl, c.transport, bytes, &opts).unwrap().total_us();
                    assert!((ch.nccl_predicted_us - nccl).abs() < 1e-9);
                    if ch.algorithm != Algorithm::Nccl && view.is_pcie() && n > 2 {
                        assert!(
                            ch.predicted_us < nccl,
                            "{} n={n} {bytes} B: picked {} at {:.1} us but NCCL is {:.1} us",
                            view.name,
                            ch.algorithm,
                            ch.predicted_us,
                            nccl
                        );
                    }
                    if ch.algorithm == Algorithm::OneShotPull && view.is_pcie() && n > 2 {
                        assert!(ch.predicted_us < nccl, "one-shot pull behind NCCL picked on {}", view.name);
                    }
                    // Whatever is picked is applicable.
                    assert!(c.available(ch.algorithm, n, bytes).is_ok(), "{}: {}", view.name, ch);
                }
            }
        }
    }

    #[test]
    fn one_shot_pull_is_not_picked_where_it_loses_to_nccl() {
        // The CONTEXT.md trap: 8 PCIe GPUs over two sockets, 42 KB.
        let view = embedded::default_topology();
        let mut c = Constraints::for_topology(&view);
        // Even with every other algorithm of ours disabled.
        c.disabled = vec![
            Algorithm::TwoShotPull,
            Algorithm::OneShotPush,
            Algorithm::TwoShotPush,
            Algorithm::Ring,
            Algorithm::Hierarchical,
        ];
        let ch = select(&view, 8, DType::Bf16, 43008, true, &c);
        assert_eq!(ch.algorithm, Algorithm::Nccl, "{ch}");
        assert!(ch.reason.contains("PCIe with 8 ranks"), "{}", ch.reason);
        // Without NCCL, the fastest of ours, and the reason says so.
        c.nccl_available = false;
        let ch = select(&view, 8, DType::Bf16, 43008, true, &c);
        assert_eq!(ch.algorithm, Algorithm::OneShotPull);
        assert!(ch.reason.contains("NCCL unavailable"), "{}", ch.reason);
    }

    #[test]
    fn no_p2p_picks_host_staged_push_or_nccl() {
        let view = embedded::by_name("rtx-4090-8x-no-p2p").unwrap();
        let c = Constraints::for_topology(&view);
        assert_eq!(c.transport, Transport::HostStaged);
        let mut ours = 0;
        for &bytes in &sizes() {
            let ch = select(&view, 8, DType::F16, bytes, true, &c);
            assert!(
                ch.algorithm == Algorithm::Nccl
                    || (ch.transport == Transport::HostStaged && ch.algorithm.supports_host_staged()),
                "{bytes}: {ch}"
            );
            ours += usize::from(ch.algorithm != Algorithm::Nccl);
        }
        assert!(ours > 0, "host-staged push should win somewhere against NCCL over host memory");
    }

    #[test]
    fn motivating_machine_beats_nccl_at_42_kb() {
        let view = embedded::default_topology();
        let ch = select(&view, 8, DType::Bf16, 43008, true, &Constraints::for_topology(&view));
        assert_ne!(ch.algorithm, Algorithm::Nccl, "{ch}");
        assert_ne!(ch.algorithm, Algorithm::OneShotPull);
        assert!(ch.predicted_us * 1.5 < ch.nccl_predicted_us, "{ch}");
    }

    #[test]
    fn shared_device_has_no_nccl_and_still_chooses() {
        let one = embedded::by_name("h200-8x-nvswitch").unwrap().for_ranks(&[0]).unwrap();
        let c = Constraints::for_topology(&one.for_world(4).unwrap());
        assert!(!c.nccl_available);
        let ch = select(&one, 4, DType::Bf16, 43008, true, &c);
        assert_ne!(ch.algorithm, Algorithm::Nccl, "{ch}");
        assert!(ch.reason.contains("NCCL unavailable"), "{}", ch.reason);
        let single = select(&one, 1, DType::Bf16, 4096, true, &Constraints::for_topology(&one));
        assert!(single.predicted_us.is_finite());
    }

    #[test]
    fn tuning_measurements_replace_predictions() {
        let view = embedded::default_topology();
        let c = Constraints::for_topology(&view);
        let meta = TuningMeta::for_topology(&view, "test");
        let m = |algorithm, median_us| Measurement {
            bucket_bytes: 65536,
            dtype: DType::Bf16,
            algorithm,
            transport: Transport::PeerToPeer,
            median_us,
        };
        // Measured: ring clearly beats NCCL, hierarchical is slow here.
        let table = TuningTable::from_measurements(
            meta.clone(),
            vec![m(Algorithm::Ring, 9.0), m(Algorithm::Hierarchical, 40.0), m(Algorithm::Nccl, 20.0)],
        )
        .unwrap();
        let ch = select_with(&CostModel::default(), Some(&table), &view, 8, DType::Bf16, 43008, true, &c);
        assert_eq!((ch.algorithm, ch.source), (Algorithm::Ring, Source::Tuning), "{ch}");
        // Measured: everything of ours behind NCCL -> NCCL, even where the
        // model would pick ours.
        let all = [
            Algorithm::OneShotPull,
            Algorithm::TwoShotPull,
            Algorithm::OneShotPush,
            Algorithm::TwoShotPush,
            Algorithm::Ring,
            Algorithm::Hierarchical,
        ];
        let mut ms: Vec<Measurement> = all.iter().map(|&a| m(a, 30.0)).collect();
        ms.push(m(Algorithm::Nccl, 25.0));
        let table = TuningTable::from_measurements(meta, ms).unwrap();
        let ch = select_with(&CostModel::default(), Some(&table), &view, 8, DType::Bf16, 43008, true, &c);
        assert_eq!(ch.algorithm, Algorithm::Nccl, "{ch}");
        assert_eq!(ch.source, Source::Tuning);
        // Past the table, where NCCL won the largest measured size: NCCL.
        let ch = select_with(&CostModel::default(), Some(&table), &view, 8, DType::Bf16, 1 << 22, true, &c);
        assert_eq!((ch.algorithm, ch.source), (Algorithm::Nccl, Source::Tuning), "{ch}");
        // Another dtype has no entries at all: the model decides.
        let ch = select_with(&CostModel::default(), Some(&table), &view, 8, DType::F32, 1 << 22, true, &c);
        assert_eq!(ch.source, Source::Model);
    }

    /// Issue 13 item 5, as seen on 2 H200s: the tuning table ended at
    /// 16 MB with NCCL winning there, and `auto` picked one-shot-pull for
    /// 32-64 MB (0.70-0.78x NCCL). Past the table the rule "never slower
    /// than NCCL" must hold: NCCL where NCCL won the largest measured size.
    #[test]
    fn past_the_tuning_table_nccl_stays_when_it_won_the_last_bucket() {
        let view = embedded::by_name("h200-8x-nvswitch").unwrap().for_world(2).unwrap();
        let c = Constraints::for_topology(&view);
        let model = CostModel::default();
        let m = |bucket_bytes, algorithm, median_us| Measurement {
            bucket_bytes,
            dtype: DType::Bf16,
            algorithm,
            transport: Transport::PeerToPeer,
            median_us,
        };
        let table = TuningTable::from_measurements(
            TuningMeta::for_topology(&view, "test"),
            vec![
                m(1 << 20, Algorithm::OneShotPull, 10.0),
                m(1 << 20, Algorithm::Nccl, 14.0),
                m(16 << 20, Algorithm::OneShotPull, 130.0),
                m(16 << 20, Algorithm::Nccl, 120.0),
            ],
        )
        .unwrap();
        for bytes in [32 << 20, 64 << 20] {
            // Precondition (what made the old selection wrong): the model
            // alone prefers one of ours at this size.
            let modelled = select_with(&model, None, &view, 2, DType::Bf16, bytes, true, &c);
            assert_ne!(modelled.algorithm, Algorithm::Nccl, "precondition: {modelled}");
            let ch = select_with(&model, Some(&table), &view, 2, DType::Bf16, bytes, true, &c);
            assert_eq!(ch.algorithm, Algorithm::Nccl, "{bytes} B: {ch}");
            assert!(ch.reason.contains("beyond the tuning table"), "{}", ch.reason);
            // The table built at init agrees.
            let built = SelectionTable::build(&model, Some(&table), &view, &c);
            assert_eq!(built.lookup(bytes, DType::Bf16, true).algorithm, Algorithm::Nccl);
        }
        // Where ours won the largest measured size, the model decides past it.
        let table = TuningTable::from_measurements(
            TuningMeta::for_topology(&view, "test"),
            vec![m(16 << 20, Algorithm::OneShotPull, 100.0), m(16 << 20, Algorithm::Nccl, 120.0)],
        )
        .unwrap();
        let ch = select_with(&model, Some(&table), &view, 2, DType::Bf16, 32 << 20, true, &c);
        assert_eq!(ch.source, Source::Model, "{ch}");
    }

    #[test]
    fn table_uses_tuning_only_where_measured() {
        let view = embedded::default_topology();
        let c = Constraints::for_topology(&view);
        let meta = TuningMeta::for_topology(&view, "test");
        let m = |algorithm, median_us| Measurement {
            bucket_bytes: 65536,
            dtype: DType::Bf16,
            algorithm,
            transport: Transport::PeerToPeer,
            median_us,
        };
        let tuning =
            TuningTable::from_measurements(meta, vec![m(Algorithm::Ring, 9.0), m(Algorithm::Nccl, 20.0)]).unwrap();
        let model = CostModel::default();
        let table = SelectionTable::build(&model, Some(&tuning), &view, &c);
        for dtype in DType::ALL {
            for bytes in [4096, 43008, 65536, 1 << 20] {
                let direct = select_with(&model, Some(&tuning), &view, 8, dtype, bytes, true, &c);
                let i = table.bounds().partition_point(|&b| b < bytes);
                let at = table.bounds()[i];
                let expected = select_with(&model, Some(&tuning), &view, 8, dtype, at, true, &c);
                assert_eq!(table.lookup(bytes, dtype, true), &expected);
                if dtype == DType::Bf16 && bytes == 43008 {
                    assert_eq!(direct.algorithm, Algorithm::Ring);
                    assert_eq!(table.lookup(bytes, dtype, true).source, Source::Tuning);
                }
            }
        }
        assert_eq!(table.lookup(43008, DType::F32, true).source, Source::Model);
    }

    #[test]
    fn table_lookup_matches_select_at_bounds() {
        let view = embedded::default_topology();
        let c = Constraints::for_topology(&view);
        let table = SelectionTable::build(&CostModel::default(), None, &view, &c);
        let bounds = table.bounds().to_vec();
        assert!(bounds.windows(2).all(|w| w[0] < w[1]));
        for (i, &b) in bounds.iter().enumerate().filter(|(_, &b)| b != usize::MAX) {
            for dtype in DType::ALL {
                let direct = select(&view, 8, dtype, b, true, &c);
                assert_eq!(table.lookup(b, dtype, true), &direct);
                // Anything in (previous bound, bound] maps to this bucket.
                let lo = if i == 0 { 0 } else { bounds[i - 1] + 1 };
                assert_eq!(table.lookup(lo, dtype, true), &direct);
            }
        }
        assert_eq!(
            table.lookup(usize::MAX, DType::F32, false).algorithm,
            table.lookup(1 << 30, DType::F32, false).algorithm
        );
        assert_eq!(table.digest(), SelectionTable::build(&CostModel::default(), None, &view, &c).digest());
        let mut forced = c.clone();
        forced.communicator_override = Some(Algorithm::Ring);
        assert_ne!(table.digest(), SelectionTable::build(&CostModel::default(), None, &view, &forced).digest());
        assert!(table.describe(DType::Bf16, true).contains("larger"));
    }
}
