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
//!    from the model (its asserted calibration points are within
//!    `calibration::TOLERANCE` = 20 % each, the error mostly shared between
//!    the two sides), 2 % when both were measured. Otherwise
//!    NCCL. This is the trap of docs/SOURCES.md [F3, F4] made a rule: on a PCIe topology
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

use tp_allreduce_kernels::ids::{Collective, DType};

use crate::algorithm::{self, Capabilities, IslandSplit};
use crate::algorithm::{Algorithm, Transport};
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

/// What may run on this communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Constraints {
    /// The transport the communicator settled on at init (host-staged when
    /// P2P is unsupported or the transfer check failed on a pair).
    pub transport: Transport,
    /// An NCCL communicator exists (NCCL loaded, ranks on distinct GPUs).
    pub nccl_available: bool,
    /// Hierarchical: the islands (two or more), if any.
    pub islands: Option<IslandSplit>,
    /// One-shot push handles messages up to this size.
    pub one_shot_push_max_bytes: usize,
    /// The copy-engine ring has staging.
    pub copy_engine: bool,
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
    /// topology derives them; the copy-engine ring available with P2P; no
    /// overrides.
    pub fn for_topology(view: &Topology) -> Constraints {
        let islands = view.island_split();
        // Per pair: only pairs across islands lack P2P (as init decides).
        let n = view.len();
        let inside_usable = islands.is_some_and(|s| {
            (0..n).all(|a| (0..n).all(|b| a == b || !s.together(a, b) || view.pair(a, b).p2p_usable()))
        });
        let transport = if view.all_p2p_usable() {
            Transport::PeerToPeer
        } else if inside_usable {
            Transport::PerPair
        } else {
            Transport::HostStaged
        };
        Constraints {
            transport,
            nccl_available: !view.has_shared_device(),
            islands,
            one_shot_push_max_bytes: crate::config::resolve_one_shot_push_max_bytes(
                crate::config::Config::ONE_SHOT_PUSH_AUTO,
                view.len(),
            ),
            copy_engine: !view.has_shared_device(),
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
            islands: self.islands,
            one_shot_push_max_bytes: self.one_shot_push_max_bytes,
            copy_engine: self.copy_engine,
            nccl_available: self.nccl_available,
        };
        algorithm::availability(algorithm, &caps, Some(bytes))
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
    /// The launch shape `(blocks, threads)` the tuning table measured for
    /// the chosen algorithm at this size (sentinel algorithms), if any.
    pub shape: Option<(u32, u32)>,
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

/// [`select`] for a fused call (`Comm::all_reduce_add_rms_norm`): every
/// candidate's time includes its epilogue (fused into OneShotPush and
/// OneShotPull, the separate `add_rms_norm` kernel after every other
/// algorithm and NCCL; [`CostModel::epilogue_us`]).
pub fn select_fused(
    topology: &Topology,
    world_size: usize,
    dtype: DType,
    bytes: usize,
    capturing: bool,
    constraints: &Constraints,
) -> Choice {
    match rank_view(topology, world_size) {
        Ok(view) => select_view(&CostModel::default(), None, &view, dtype, bytes, capturing, constraints, true),
        // No rank view: the plain selection says why (NCCL fallback).
        Err(_) => select(topology, world_size, dtype, bytes, capturing, constraints),
    }
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
    let view = match rank_view(topology, world_size) {
        Ok(view) => view,
        Err(e) => {
            return Choice {
                algorithm: Algorithm::Nccl,
                transport: constraints.transport,
                reason: format!("no rank view: {e}; NCCL fallback"),
                predicted_us: f64::NAN,
                nccl_predicted_us: f64::NAN,
                source: Source::Model,
                shape: None,
            }
        }
    };
    select_view(model, tuning, &view, dtype, bytes, capturing, constraints, false)
}

/// The topology as the `world_size` ranks see it: `topology` itself when it
/// has one GPU per rank, else its view for that world.
fn rank_view(topology: &Topology, world_size: usize) -> crate::Result<Cow<'_, Topology>> {
    if topology.len() == world_size {
        Ok(Cow::Borrowed(topology))
    } else {
        topology.for_world(world_size).map(Cow::Owned)
    }
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
    dtype: DType,
    /// The tuning table, if one applies.
    table: Option<&'a TuningTable>,
    /// The tuning entry covering this size, if any.
    entry: Option<&'a TuningEntry>,
    /// The tuning table's last entry for this dtype when `bytes` lies past
    /// it (no entry covers the size).
    past_table: Option<&'a TuningEntry>,
    /// A fused call: every time includes the epilogue.
    fused: bool,
}

impl Selecting<'_> {
    fn time_of(&self, a: Algorithm) -> Option<Timed> {
        let epilogue = if self.fused { self.model.epilogue_us(a, self.bytes, self.opts.capturing) } else { 0.0 };
        if let (Some(table), Some(_)) = (self.table, self.entry) {
            // Between measured buckets: the measured neighbours, not the model.
            if let Some(us) = table.interpolated_us(self.dtype, self.bytes, a, self.c.transport) {
                return Some(Timed { us: us + epilogue, source: Source::Tuning });
            }
            if table.meta.candidates_only && a != Algorithm::Nccl {
                // Measured `auto` measured the model's leading candidates
                // only: one it did not measure is not a candidate here
                // (NCCL, the bar to clear, keeps its prediction).
                return None;
            }
        }
        let p = self.model.predict(self.view, a, self.c.transport, self.bytes, &self.opts).ok()?;
        Some(Timed { us: p.total_us() + epilogue, source: Source::Model })
    }

    fn choice(&self, algorithm: Algorithm, t: Option<Timed>, nccl: Timed, source: Source, reason: String) -> Choice {
        Choice {
            algorithm,
            transport: self.c.transport,
            reason,
            predicted_us: t.map_or(f64::NAN, |t| t.us),
            nccl_predicted_us: nccl.us,
            source,
            shape: self.entry.and_then(|e| e.shape_of(algorithm, self.c.transport)),
        }
    }

    /// Rule 1: the first applicable override, and notes on skipped ones.
    fn overridden(&self) -> (Option<Algorithm>, String) {
        let mut notes = String::new();
        let forced =
            [(self.c.communicator_override, "the communicator's override"), (self.c.env_override, env::ALGORITHM)];
        for (forced, who) in forced {
            // An algorithm of another collective forces only its own calls.
            let Some(a) = forced.filter(|a| a.collective() == Collective::AllReduce) else { continue };
            match self.c.available(a, self.view.len(), self.bytes) {
                Ok(()) => return (Some(a), format!("{notes}forced by {who}")),
                Err(why) => notes.push_str(&format!("{a} forced by {who} is not applicable ({why}); ")),
            }
        }
        (None, notes)
    }

    /// Rule 2: the fastest applicable allreduce algorithm of ours, and why
    /// the others were skipped.
    fn best_of_ours(&self) -> (Option<(Algorithm, Timed)>, Vec<String>) {
        let mut best: Option<(Algorithm, Timed)> = None;
        let mut skipped: Vec<String> = Vec::new();
        for a in Algorithm::allreduce_algorithms() {
            if let Err(why) = self.c.available(a, self.view.len(), self.bytes) {
                skipped.push(why);
                continue;
            }
            match self.time_of(a) {
                Some(t) if best.is_none_or(|(_, b)| t.us < b.us) => best = Some((a, t)),
                Some(_) => {}
                None if self.table.is_some_and(|t| t.meta.candidates_only) && self.entry.is_some() => {
                    skipped.push(format!("{a}: not among the measured candidates"))
                }
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

#[allow(clippy::too_many_arguments)]
fn select_view(
    model: &CostModel,
    tuning: Option<&TuningTable>,
    view: &Topology,
    dtype: DType,
    bytes: usize,
    capturing: bool,
    c: &Constraints,
    fused: bool,
) -> Choice {
    let entry = tuning.and_then(|t| t.lookup(dtype, bytes));
    let past_table = if entry.is_none() { tuning.and_then(|t| t.last(dtype)) } else { None };
    let s = Selecting {
        model,
        view,
        bytes,
        opts: Options { capturing, islands: c.islands, nccl: NcclTuning::Tuned },
        c,
        dtype,
        table: tuning,
        entry,
        past_table,
        fused,
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
        Self::build_for(model, tuning, view, constraints, false)
    }

    /// [`build`](Self::build) for fused calls (`Comm::all_reduce_add_rms_norm`):
    /// every candidate's time includes its epilogue (see [`select_fused`]).
    /// Built from the same inputs as the plain table, so ranks that agree
    /// on that one agree on this one.
    pub fn build_fused(
        model: &CostModel,
        tuning: Option<&TuningTable>,
        view: &Topology,
        constraints: &Constraints,
    ) -> SelectionTable {
        Self::build_for(model, tuning, view, constraints, true)
    }

    fn build_for(
        model: &CostModel,
        tuning: Option<&TuningTable>,
        view: &Topology,
        constraints: &Constraints,
        fused: bool,
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
            .map(|(capturing, i)| select_view(model, None, view, DType::F32, at(i), capturing, constraints, fused))
            .collect();
        let mut choices = Vec::with_capacity(DType::ALL.len() * model_only.len());
        for dtype in DType::ALL {
            for capturing in [false, true] {
                for i in 0..bounds.len() {
                    // Covered by a measured bucket, or past the largest one
                    // (where the "NCCL won there" rule applies).
                    let tuned = tuning.is_some_and(|t| t.lookup(dtype, at(i)).is_some() || t.last(dtype).is_some());
                    choices.push(if tuned {
                        select_view(model, tuning, view, dtype, at(i), capturing, constraints, fused)
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

    /// Whether any entry (any size, dtype, capture mode) chose `algorithm`.
    pub fn chooses(&self, algorithm: Algorithm) -> bool {
        self.choices.iter().any(|c| c.algorithm == algorithm)
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
            if let Some((blocks, threads)) = c.shape {
                eat(&blocks.to_le_bytes());
                eat(&threads.to_le_bytes());
            }
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

/// Ours or NCCL's for the all-gather and the reduce-scatter, per size
/// bucket of one rank's block (the all-gather's send, the
/// reduce-scatter's receive), graph replay and eager: ours where the cost
/// model predicts it at least [`MODEL_MARGIN`] faster than NCCL's ring (one
/// pass over `world` blocks), else NCCL's; ours wherever NCCL is
/// unavailable. Built at init from the plain table's inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct CollectiveTable {
    bounds: Vec<usize>,
    /// `[(collective index * 2 + capturing) * bounds.len() + bucket]`
    /// (all-gather 0, reduce-scatter 1).
    choices: Vec<CollectiveChoice>,
}

/// One entry of a [`CollectiveTable`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CollectiveChoice {
    pub algorithm: Algorithm,
    /// Ours at the bucket's bound (us, model); NaN when none of ours runs.
    pub ours_us: f64,
    /// NCCL's (us, model).
    pub nccl_us: f64,
}

impl CollectiveTable {
    pub fn build(model: &CostModel, view: &Topology, constraints: &Constraints) -> CollectiveTable {
        let bounds = bucket_bounds();
        let world = view.len();
        let mut choices = Vec::with_capacity(4 * bounds.len());
        for collective in [Collective::AllGather, Collective::ReduceScatter] {
            let ours = Algorithm::OURS.into_iter().find(|a| a.collective() == collective);
            for capturing in [false, true] {
                let opts = Options { capturing, islands: constraints.islands, nccl: NcclTuning::default() };
                for (i, &bound) in bounds.iter().enumerate() {
                    let block = if bound == usize::MAX { bounds[i - 1].saturating_mul(2) } else { bound };
                    let ours_us = ours
                        .filter(|a| constraints.available(*a, world, block).is_ok())
                        .and_then(|a| model.predict(view, a, constraints.transport, block, &opts).ok())
                        .map_or(f64::NAN, |p| p.total_us());
                    let nccl_us = model
                        .predict_nccl_collective(view, constraints.transport, block.saturating_mul(world), &opts)
                        .total_us();
                    // NaN (none of ours runs) never clears the margin.
                    let ours_clears = ours_us <= nccl_us * (1.0 - MODEL_MARGIN);
                    let algorithm = match ours {
                        Some(a) if ours_clears || !constraints.nccl_available => a,
                        _ => Algorithm::Nccl,
                    };
                    choices.push(CollectiveChoice { algorithm, ours_us, nccl_us });
                }
            }
        }
        CollectiveTable { bounds, choices }
    }

    /// The choice for a call moving `block_bytes` per rank. O(log
    /// buckets), no allocation. The all-reduce has none (its own table).
    pub fn lookup(&self, collective: Collective, block_bytes: usize, capturing: bool) -> Option<&CollectiveChoice> {
        let c = match collective {
            Collective::AllGather => 0,
            Collective::ReduceScatter => 1,
            Collective::AllReduce => return None,
        };
        let bucket = self.bounds.partition_point(|&b| b < block_bytes).min(self.bounds.len() - 1);
        self.choices.get((c * 2 + usize::from(capturing)) * self.bounds.len() + bucket)
    }

    /// Ranges of block sizes with the same choice, for logs.
    pub fn describe(&self, collective: Collective, capturing: bool) -> String {
        let mut parts: Vec<String> = Vec::new();
        let choice = |i: usize| self.lookup(collective, self.bounds[i], capturing).map(|c| c.algorithm);
        for i in 0..self.bounds.len() {
            if i + 1 == self.bounds.len() || choice(i + 1) != choice(i) {
                let upto = if self.bounds[i] == usize::MAX {
                    "larger".to_string()
                } else {
                    format!("<= {}", human_bytes(self.bounds[i]))
                };
                parts.push(format!("{upto}: {}", choice(i).map_or("-".into(), |a| a.to_string())));
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
mod tests;
