//! Measured `auto` on a live communicator (see `select::measured` for the
//! design): rank 0's decision, the per-rank measurement loop every rank runs
//! in the same order, and the rebuild of the selection tables.
//!
//! Every step below is collective: each rank runs the same rendezvous
//! rounds in the same order whatever its own configuration, because every
//! branch is taken on rank 0's decision.

#![forbid(unsafe_code)]

use std::time::Instant;

use cudarc::driver::{sys, DeviceSlice};
use serde::{Deserialize, Serialize};

use super::Comm;
use crate::algorithm::Algorithm;
use crate::buffer::DeviceBuffer;
use crate::comm::{Element, ReduceOp};
use crate::driver;
use crate::error::{driver as driver_error, Error, Result};
use crate::select::cost_model::CostModel;
use crate::select::measured::{self, shapes, AutoMeasure, CacheKey, CacheRead, MeasuredCache, Sweep, Timing};
use crate::select::selection::SelectionTable;
use crate::select::tuning::TuningTable;
use crate::DType;

/// Where the communicator's selection comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum SelectionSource {
    /// The cost model alone.
    Model,
    /// A `tp-allreduce tune` table (the model where it has no entry).
    TuneTable(String),
    /// Measured `auto` for these dtypes (cached or measured at start).
    Measured(Vec<DType>),
}

/// Rank 0's decision, sent to every rank.
#[derive(Debug, Serialize, Deserialize)]
struct Decision {
    mode: AutoMeasure,
    /// Per dtype: the cached table (TOML) or `None`: measure.
    dtypes: Vec<(String, Option<String>)>,
}

/// A median (us), the launch shape that gave it (`None`: the default
/// rule), and whether every rank's output was right.
type Measured = (f64, Option<(u32, u32)>, bool);

/// The first bytes of rank 0's message when it has no table to send.
const NO_TABLE: &str = "no table: ";

/// Values of rank `rank`'s input: one period of [`PERIOD`] small integers
/// (exactly representable, so every summation order gives the exact f64
/// sum), repeated. The period is prime, so data moved by a power-of-two
/// offset never lands on an equal value pattern.
const PERIOD: usize = 4099;

fn input_period(rank: usize) -> Vec<f32> {
    (0..PERIOD).map(|j| (((j * 31 + rank * 17 + (j * j) % 13) % 15) as f32) - 7.0).collect()
}

/// The f64 reference of one period: the sum over every rank's inputs.
fn reference_period(world: usize) -> Vec<f32> {
    let mut sum = vec![0f64; PERIOD];
    for r in 0..world {
        for (s, v) in sum.iter_mut().zip(input_period(r)) {
            *s += v as f64;
        }
    }
    sum.into_iter().map(|s| s as f32).collect()
}

/// Element types the measurement runs (conversion through f32 is exact for
/// its small integers).
trait Measurable: Element + bytemuck::Pod {
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Measurable for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}
impl Measurable for half::f16 {
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}
impl Measurable for half::bf16 {
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

/// Whether `out` is the reference (compared by value: -0 equals +0).
fn matches_reference<T: Measurable>(out: &[T], reference: &[f32]) -> bool {
    out.chunks(PERIOD).all(|c| c.iter().zip(reference).all(|(o, r)| o.to_f32() == *r))
}

/// Per sample, the largest of every rank's value (little-endian f64s), and
/// whether every rank said its output was right (the last byte).
fn slowest_and_verdict(all: &[Vec<u8>], repeats: usize) -> (Vec<f64>, bool) {
    let mut worst = vec![0f64; repeats];
    let mut correct = true;
    for rank in all {
        let (samples, verdict) = rank.split_at(rank.len().saturating_sub(1));
        correct &= verdict == [1];
        for (k, chunk) in samples.chunks_exact(8).enumerate().take(repeats) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            worst[k] = worst[k].max(f64::from_le_bytes(b));
        }
    }
    (worst, correct)
}

/// The INFO line rank 0 logs before measuring a dtype: the wait is
/// seconds, once per machine, and the user should know what it is.
fn measuring_line(mode: AutoMeasure, world: usize, dtype: DType, sweep: &Sweep, cache: Option<&std::path::Path>) -> String {
    let cached = match cache {
        Some(dir) => format!("cached in {} for later starts", dir.display()),
        None => "no cache directory, so every start measures".to_string(),
    };
    format!(
        "measured auto ({mode}, {world} ranks, {}): measuring the algorithms on this machine, up to {} sizes, \
         none started after {} s ({cached}; TP_ALLREDUCE_AUTO_MEASURE=off skips it) ...",
        dtype.name(),
        sweep.buckets.len(),
        sweep.budget.as_secs(),
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

impl Comm {
    /// Collective: measured `auto` for `dtypes` (every rank, same
    /// arguments; rank 0's decide), before any capture. Loads the cached
    /// table where one is valid, else measures ([`AutoMeasure::On`]'s sweep,
    /// or `Full` when so configured) and caches it; then rebuilds the
    /// selection from it. Communicators measure `Config::measure_dtypes` at
    /// construction (`Config::auto_measure`); engines call this for further
    /// dtypes. Nothing is measured while an algorithm is forced or a
    /// `tune` table applies.
    pub fn measure_selection(&mut self, dtypes: &[DType]) -> Result<()> {
        let mode = match self.config.auto_measure_mode()? {
            AutoMeasure::Full => AutoMeasure::Full,
            _ => AutoMeasure::On,
        };
        self.measured_auto(mode, dtypes)
    }

    /// Construction's step: `Config::auto_measure` for `Config::measure_dtypes`.
    pub(super) fn measure_at_start(&mut self) -> Result<()> {
        let mode = self.config.auto_measure_mode()?;
        let dtypes = self.config.measure_dtypes.clone();
        self.measured_auto(mode, &dtypes)
    }

    /// Where the selection comes from.
    pub fn selection_source(&self) -> &SelectionSource {
        &self.selection_source
    }

    /// The measured table the selection uses, if any.
    #[cfg(feature = "internals")]
    #[doc(hidden)]
    pub fn measured_table(&self) -> Option<&TuningTable> {
        self.measured.as_ref()
    }

    /// The cache key of this communicator's measured table for `dtype`.
    pub(crate) fn measure_cache_key(&self, dtype: DType, mode: AutoMeasure) -> Result<CacheKey> {
        Ok(CacheKey {
            fingerprint: self.topology.fingerprint(),
            gpu_model: self.topology.gpu_model(),
            driver_version: driver::driver_version()?,
            kernels_hash: crate::embedded_ptx::KERNEL_SOURCES_HASH.to_string(),
            library_version: env!("CARGO_PKG_VERSION").to_string(),
            world_size: self.world,
            islands: self.setup.island_split.map_or("none".to_string(), |s| s.to_string()),
            transport: self.setup.transport.to_string(),
            nccl: self.nccl.is_some(),
            config: self.config.shape_fingerprint(),
            dtype: dtype.name().to_string(),
            sweep: mode.name().to_string(),
        })
    }

    /// Rank 0: the mode and, per dtype, the cached table if one is valid.
    fn decide(&self, mode: AutoMeasure, dtypes: &[DType]) -> Result<Decision> {
        let mut decision = Decision { mode, dtypes: Vec::new() };
        if mode == AutoMeasure::Off {
            return Ok(decision);
        }
        let cache = MeasuredCache::locate(self.config.measure_cache_dir.as_deref());
        for &d in dtypes {
            let cached = match &cache {
                Some(c) => match c.read(&self.measure_cache_key(d, mode)?) {
                    CacheRead::Hit(t) => Some(t.to_toml_string()?),
                    CacheRead::Miss => None,
                    CacheRead::Refused(why) => {
                        log::warn!("measured auto: cached table refused, measuring again: {why}");
                        None
                    }
                },
                None => None,
            };
            decision.dtypes.push((d.name().to_string(), cached));
        }
        Ok(decision)
    }

    fn measured_auto(&mut self, mode: AutoMeasure, dtypes: &[DType]) -> Result<()> {
        let started = Instant::now();
        // Rank 0 decides: mode, dtypes, cached tables.
        // (A malformed variable failed construction before; never `?` here.)
        let forced = self.config.algorithm.is_some() || crate::env::algorithm().ok().flatten().is_some();
        let tuned = matches!(self.selection_source, SelectionSource::TuneTable(_));
        let mine = if self.rank == 0 {
            let mode = if forced || tuned { AutoMeasure::Off } else { mode };
            // Never an early return here: the other ranks wait for this
            // round. A failure to decide is a WARNING and the model.
            let decision = self.decide(mode, dtypes).unwrap_or_else(|e| {
                log::warn!("measured auto: cannot decide ({e}); the cost model decides");
                Decision { mode: AutoMeasure::Off, dtypes: Vec::new() }
            });
            serde_json::to_vec(&decision).unwrap_or_default()
        } else {
            Vec::new()
        };
        let all = self.rendezvous.all_gather(&mine)?;
        let decision: Decision = serde_json::from_slice(&all[0])
            .map_err(|e| Error::Protocol { from: "rank 0".into(), what: format!("measured-auto decision: {e}") })?;
        if decision.mode == AutoMeasure::Off || decision.dtypes.is_empty() {
            return Ok(());
        }
        let Some(sweep) = Sweep::for_mode(decision.mode) else { return Ok(()) };
        let mut tables = Vec::new();
        let mut measured_any = false;
        for (name, cached) in decision.dtypes {
            let dtype = DType::ALL.into_iter().find(|d| d.name() == name).ok_or_else(|| Error::Protocol {
                from: "rank 0".into(),
                what: format!("measured-auto dtype `{name}`"),
            })?;
            match cached {
                Some(text) => tables.push(TuningTable::from_toml_str(&text, "rank 0's cached measured table")?),
                None => {
                    measured_any = true;
                    if self.rank == 0 {
                        let cache = MeasuredCache::locate(self.config.measure_cache_dir.as_deref());
                        log::info!(
                            "{}",
                            measuring_line(decision.mode, self.world, dtype, &sweep, cache.as_ref().map(|c| c.dir.as_path()))
                        );
                    }
                    tables.extend(self.measure_dtype(dtype, decision.mode, &sweep)?);
                }
            }
        }
        let Some(merged) = measured::merge(tables) else { return Ok(()) };
        self.rebuild_selection(merged)?;
        let measured_dtypes: Vec<DType> = {
            let mut v: Vec<DType> = self.measured.iter().flat_map(|t| t.entries.iter().map(|e| e.dtype)).collect();
            v.dedup();
            v
        };
        if self.rank == 0 {
            if let Some(t) = &self.measured {
                for d in &measured_dtypes {
                    log::info!(
                        "measured auto ({}, {} ranks, {}): {} in {:.2} s; measured winners {}; selection {}",
                        decision.mode,
                        self.world,
                        d.name(),
                        if measured_any { "measured" } else { "loaded from the cache" },
                        started.elapsed().as_secs_f64(),
                        measured::describe(t, *d),
                        self.selection.describe(*d, true)
                    );
                }
            }
        }
        self.selection_source = SelectionSource::Measured(measured_dtypes);
        Ok(())
    }

    /// Rebuilds the plain and fused selection tables with `table` (merged
    /// with what was measured before, newer dtypes replacing older).
    fn rebuild_selection(&mut self, table: TuningTable) -> Result<()> {
        let merged = match self.measured.take() {
            Some(mut old) => {
                let fresh: Vec<DType> = table.entries.iter().map(|e| e.dtype).collect();
                old.entries.retain(|e| !fresh.contains(&e.dtype));
                measured::merge(vec![old, table])
                    .ok_or_else(|| Error::Config("measured auto: merging tables gave none".into()))?
            }
            None => table,
        };
        let model = CostModel::default();
        let plain = SelectionTable::build(&model, Some(&merged), &self.topology, &self.selection.constraints().clone());
        let fused = SelectionTable::build_fused(
            &model,
            Some(&merged),
            &self.topology,
            &self.fused_selection.constraints().clone(),
        );
        self.selection = plain;
        self.fused_selection = fused;
        self.measured = Some(merged);
        Ok(())
    }

    /// Measures one dtype (every rank), adopts rank 0's table, caches it
    /// (rank 0).
    fn measure_dtype(&mut self, dtype: DType, mode: AutoMeasure, sweep: &Sweep) -> Result<Option<TuningTable>> {
        let started = Instant::now();
        let saved_shape = self.config.launch_shape;
        let timings = match dtype {
            DType::F32 => self.sweep_dtype::<f32>(sweep, started),
            DType::F16 => self.sweep_dtype::<half::f16>(sweep, started),
            DType::Bf16 => self.sweep_dtype::<half::bf16>(sweep, started),
        };
        // Back to the selection and the configured shape whatever happened.
        self.config.algorithm = None;
        self.config.launch_shape = saved_shape;
        let timings = timings?;
        // Rank 0 sends its table, or why it has none (every rank then keeps
        // the model for this dtype): never an early return before the round.
        let key = if self.rank == 0 { Some(self.measure_cache_key(dtype, mode)) } else { None };
        let mine = match &key {
            Some(key) => match key
                .as_ref()
                .map_err(|e| Error::Config(e.to_string()))
                .and_then(|key| measured::table_from_timings(key, dtype, &timings))
                .and_then(|t| t.to_toml_string())
            {
                Ok(text) => text.into_bytes(),
                Err(e) => format!("{NO_TABLE}{e}").into_bytes(),
            },
            None => Vec::new(),
        };
        let gathered = self.rendezvous.all_gather(&mine)?;
        if let Some(why) = gathered.first().and_then(|b| b.strip_prefix(NO_TABLE.as_bytes())) {
            if self.rank == 0 {
                log::warn!("measured auto: {}; the cost model decides for {}", String::from_utf8_lossy(why), dtype.name());
            }
            return Ok(None);
        }
        let table = measured::adopt_rank0_table(&gathered)?;
        if let Some(Ok(key)) = &key {
            let cache = MeasuredCache::locate(self.config.measure_cache_dir.as_deref());
            if let Some(warning) = measured::cache::store_or_warning(cache.as_ref(), key, &table) {
                log::warn!("{warning}");
            }
        }
        Ok(Some(table))
    }

    /// The sweep of one element type: per bucket (while rank 0's budget
    /// lasts), every candidate, in the same order on every rank.
    fn sweep_dtype<T: Measurable>(&mut self, sweep: &Sweep, started: Instant) -> Result<Vec<Timing>> {
        let model = CostModel::default();
        let constraints = self.selection.constraints().clone();
        let reference = reference_period(self.world);
        let period: Vec<T> = input_period(self.rank).into_iter().map(T::from_f32).collect();
        let mut timings = Vec::new();
        for &bytes in &sweep.buckets {
            // Rank 0's clock bounds the sweep for everyone.
            let go = [u8::from(self.rank != 0 || started.elapsed() < sweep.budget)];
            if self.rendezvous.all_gather(&go)?[0] != [1] {
                break;
            }
            let count = (bytes / std::mem::size_of::<T>()).max(1);
            let values: Vec<T> = period.iter().copied().cycle().take(count).collect();
            let input = DeviceBuffer::from_host(&self.stream, &values)?;
            let mut output = DeviceBuffer::<T>::alloc(&self.stream, count)?;
            let mut list = measured::candidates(&model, &self.topology, &constraints, bytes, sweep.top_k);
            if self.nccl.is_some() && constraints.nccl_available {
                list.push(Algorithm::Nccl);
            }
            for a in list {
                let (median_us, shape, correct) = self.time_algorithm(a, &input, &mut output, &reference, sweep)?;
                if !correct && self.rank == 0 {
                    log::warn!(
                        "measured auto: {a} gave a wrong {} allreduce of {bytes} bytes on some rank: not chosen",
                        T::DTYPE.name()
                    );
                }
                timings.push(Timing { bytes, algorithm: a, transport: self.setup.transport, median_us, shape, correct });
            }
        }
        Ok(timings)
    }

    /// One algorithm at one size: the default rule's launch, and in a
    /// `full` sweep of a sentinel algorithm every candidate shape (the
    /// same list on every rank: the residency caps are the smallest of
    /// every rank's), a shape winning only when more than 1 % faster.
    fn time_algorithm<T: Measurable>(
        &mut self,
        algorithm: Algorithm,
        input: &DeviceBuffer<T>,
        output: &mut DeviceBuffer<T>,
        reference: &[f32],
        sweep: &Sweep,
    ) -> Result<Measured> {
        let (default_us, default_ok) = self.time_candidate(algorithm, input, output, reference, sweep)?;
        let sentinel = algorithm.kernel().is_some_and(|id| id.sentinel());
        // Each condition here is the same on every rank (`default_ok` is
        // every rank's verdict), so every rank enters the round below or
        // none does.
        if !sentinel || sweep.top_k != usize::MAX || !default_ok {
            return Ok((default_us, None, default_ok));
        }
        // A configured shape (`Config::launch_shape`, which ranks may set
        // differently) is what calls use: no sweep if any rank has one. The
        // flag travels in the same round as the caps.
        let configured = self.config.launch_shape.is_some();
        let mut mine: Vec<u8> =
            shapes::SWEEP_THREADS.iter().flat_map(|&t| self.setup.sentinel_resident.cap(t).to_le_bytes()).collect();
        mine.push(u8::from(configured));
        let all = self.rendezvous.all_gather(&mine)?;
        let caps_len = shapes::SWEEP_THREADS.len() * 4;
        if all.iter().any(|r| r.get(caps_len).copied() != Some(0)) {
            return Ok((default_us, None, default_ok));
        }
        let cap = |threads: u32| -> u32 {
            let k = shapes::SWEEP_THREADS.iter().position(|&t| t == threads).unwrap_or(usize::MAX);
            all.iter()
                .map(|r| r.chunks_exact(4).nth(k).map_or(0, |c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .min()
                .unwrap_or(0)
        };
        let bytes = output.num_bytes();
        let mut points = Vec::new();
        for shape in shapes::shape_candidates(bytes, bytes.div_ceil(16) as u64, cap) {
            self.set_launch_shape(Some(shape))?;
            let (us, ok) = self.time_candidate(algorithm, input, output, reference, sweep)?;
            // A shape that gives a wrong result is never picked.
            if ok {
                points.push((shape, us));
            }
        }
        self.set_launch_shape(None)?;
        Ok(match shapes::pick_over_default(Some(default_us), &points) {
            Some((shape, us)) => (us, shape, true),
            None => (default_us, None, true),
        })
    }

    /// One candidate: checked eagerly, captured, registered, replayed
    /// (each replay after a rendezvous barrier), checked again; returns
    /// the median of the slowest rank's per-allreduce time and whether
    /// every rank's output was right.
    fn time_candidate<T: Measurable>(
        &mut self,
        algorithm: Algorithm,
        input: &DeviceBuffer<T>,
        output: &mut DeviceBuffer<T>,
        reference: &[f32],
        sweep: &Sweep,
    ) -> Result<(f64, bool)> {
        let usable = self.set_algorithm(Some(algorithm)).is_ok();
        let mut samples: Vec<f64> = Vec::with_capacity(sweep.repeats);
        let mut correct = usable;
        if usable {
            output.fill_bytes(0x7F)?;
            self.all_reduce(input, output, &ReduceOp::Sum)?;
            self.synchronize()?;
            correct &= matches_reference(&output.to_host()?, reference);
            output.fill_bytes(0x7F)?;
            let graph = driver::capture(&self.stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, || {
                (0..sweep.iterations).try_for_each(|_| self.all_reduce(input, output, &ReduceOp::Sum))
            })?;
            self.register_graph_buffers()?;
            let timed = |flags| self.ctx.new_event(Some(flags)).map_err(|e| driver_error("cuEventCreate", e));
            let (start, end) =
                (timed(sys::CUevent_flags::CU_EVENT_DEFAULT)?, timed(sys::CUevent_flags::CU_EVENT_DEFAULT)?);
            for i in 0..sweep.warmup + sweep.repeats {
                // Every rank starts its replay together.
                self.rendezvous.all_gather(&[])?;
                start.record(&self.stream).map_err(|e| driver_error("cuEventRecord", e))?;
                graph.launch().map_err(|e| driver_error("cuGraphLaunch", e))?;
                end.record(&self.stream).map_err(|e| driver_error("cuEventRecord", e))?;
                self.synchronize()?;
                if i >= sweep.warmup {
                    let ms = start.elapsed_ms(&end).map_err(|e| driver_error("cuEventElapsedTime", e))?;
                    samples.push(ms as f64 * 1e3 / sweep.iterations as f64);
                }
            }
            correct &= matches_reference(&output.to_host()?, reference);
            drop(graph);
            self.deregister_buffers()?;
        } else {
            samples.resize(sweep.repeats, f64::NAN);
        }
        let mut mine: Vec<u8> = samples.iter().flat_map(|v| v.to_le_bytes()).collect();
        mine.push(u8::from(correct));
        let (worst, all_correct) = slowest_and_verdict(&self.rendezvous.all_gather(&mine)?, sweep.repeats);
        Ok((median(worst), all_correct))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_before_measuring_says_what_how_long_and_where_it_is_cached() {
        let sweep = Sweep::for_mode(AutoMeasure::On).unwrap();
        let line = measuring_line(AutoMeasure::On, 4, DType::Bf16, &sweep, Some(std::path::Path::new("/c/tp")));
        assert!(line.starts_with("measured auto (on, 4 ranks, bf16): measuring"), "{line}");
        assert!(line.contains(&format!("up to {} sizes", sweep.buckets.len())), "{line}");
        assert!(line.contains(&format!("after {} s", sweep.budget.as_secs())), "{line}");
        assert!(line.contains("cached in /c/tp"), "{line}");
        let line = measuring_line(AutoMeasure::On, 2, DType::F16, &sweep, None);
        assert!(line.contains("every start measures"), "{line}");
    }

    #[test]
    fn the_reference_is_exact_and_catches_a_shifted_or_missing_rank() {
        let world = 8;
        let reference = reference_period(world);
        assert!(reference.iter().all(|v| v.fract() == 0.0 && v.abs() <= 56.0));
        let sum: Vec<half::bf16> = reference.iter().map(|v| half::bf16::from_f32(*v)).collect();
        assert!(matches_reference(&sum, &reference));
        // A result shifted by a power-of-two offset differs somewhere.
        for shift in [1usize, 16, 256, 4096] {
            let shifted: Vec<half::bf16> = (0..PERIOD).map(|i| sum[(i + shift) % PERIOD]).collect();
            assert!(!matches_reference(&shifted, &reference), "shift {shift}");
        }
        // One rank missing from the sum.
        let missing: Vec<f32> = reference.iter().zip(input_period(3)).map(|(s, v)| s - v).collect();
        assert!(!matches_reference(&missing, &reference));
    }

    #[test]
    fn the_slowest_rank_sets_each_sample_and_one_wrong_rank_fails_the_candidate() {
        let rank = |v: &[f64], ok: bool| {
            let mut b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            b.push(u8::from(ok));
            b
        };
        let (w, ok) = slowest_and_verdict(&[rank(&[1.0, 5.0], true), rank(&[2.0, 4.0], true)], 2);
        assert_eq!((w, ok), (vec![2.0, 5.0], true));
        let (_, ok) = slowest_and_verdict(&[rank(&[1.0, 5.0], true), rank(&[2.0, 4.0], false)], 2);
        assert!(!ok);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
