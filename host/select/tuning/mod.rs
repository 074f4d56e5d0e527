//! The persisted tuning table: measured median times per algorithm and size
//! bucket on one machine, which replace the cost model's predictions where
//! they exist.
//!
//! # Key
//! A table is valid for one (GPU model, topology fingerprint, world size);
//! inside, entries are keyed by (dtype, bucket bytes). The fingerprint is
//! that of the communicator's *rank view* ([`Topology::for_ranks`]), so a
//! table measured on GPUs 0-3 of a 2-socket box does not apply to ranks on
//! GPUs 0,1,4,5. A table whose key does not match is ignored, with a reason
//! the caller logs ([`Applicability`]); it is never an error.
//!
//! # File format (TOML)
//! ```toml
//! format = 2
//!
//! [meta]
//! gpu_model = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
//! fingerprint = "e2c5c89df4a0737f"
//! world_size = 8
//! captured = true                 # medians from CUDA-graph replay
//! tool = "tp-allreduce tune 0.1.0"
//!
//! [[entry]]
//! dtype = "bf16"
//! bytes = 65536                   # the bucket: the size that was measured
//! winner = "hierarchical"
//! winner_transport = "p2p"
//!
//! [[entry.result]]
//! algorithm = "hierarchical"
//! transport = "p2p"
//! median_us = 12.4
//!
//! [[entry.result]]
//! algorithm = "one-shot-push"
//! transport = "p2p"
//! median_us = 14.1
//! blocks = 16                     # the launch shape that won (sentinel
//! threads = 256                   # algorithms only; format 2)
//!
//! [[entry.result]]
//! algorithm = "nccl"
//! transport = "p2p"
//! median_us = 27.9
//! ```
//! Format 1 (no `blocks`/`threads`) still loads: its results carry no shape
//! and launches use the default rule. `blocks` and `threads` come together.
//!
//! Malformed files give an `Error::Config` naming the file, and the line and
//! field (TOML and type errors come with line and column; semantic errors
//! name the entry and the line of its `[[entry]]` header).
//!
//! # The API `tp-allreduce tune` calls
//! ```text
//! let view = discover()?.for_ranks(&devices)?;            // the communicator's rank view
//! let meta = TuningMeta::for_topology(&view, "tp-allreduce tune 0.1.0");
//! let mut ms = Vec::new();
//! for dtype in dtypes {
//!     for &bytes in &tuning::default_buckets() {
//!         for (algorithm, transport) in what the communicator can run (NCCL included) {
//!             // every rank runs the same sequence; median over graph replays
//!             ms.push(Measurement { bucket_bytes: bytes, dtype, algorithm, transport, median_us });
//!         }
//!     }
//! }
//! let table = TuningTable::from_measurements(meta, ms)?;     // winners, validation
//! table.save(&TuningTable::default_path(&dir, &table.meta))?; // rank 0 only
//! ```
//! At init, a communicator calls [`TuningTable::load_for`] with its rank
//! view and passes the usable table to
//! [`SelectionTable::build`](crate::select::selection::SelectionTable::build).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tp_allreduce_kernels::ids::DType;

use crate::algorithm::{Algorithm, Transport};
use crate::error::{Error, Result};
use crate::select::topology::Topology;

/// The file format this build writes (it also reads [`FORMAT_NO_SHAPES`]).
pub const FORMAT: u32 = 2;
/// The previous format: the same without launch shapes.
pub const FORMAT_NO_SHAPES: u32 = 1;

/// Sizes `tp-allreduce tune` measures by default: 1 KiB to 64 MiB (the
/// sizes `bench` uses), doubling, plus 42 KiB (the verify-pass allreduce:
/// 3 tokens x hidden 7168 in bf16, docs/SOURCES.md \[F1\]).
pub fn default_buckets() -> Vec<usize> {
    let mut v: Vec<usize> = (10..=26).map(|k| 1usize << k).collect();
    v.push(42 * 1024);
    v.sort_unstable();
    v
}

mod dtype_name {
    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};
    use tp_allreduce_kernels::ids::DType;

    pub fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let name = String::deserialize(d)?;
        DType::ALL
            .into_iter()
            .find(|t| t.name() == name.trim().to_ascii_lowercase())
            .ok_or_else(|| D::Error::custom(format!("unknown dtype `{name}`, expected f32, f16 or bf16")))
    }
}

mod transport_name {
    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    use crate::algorithm::Transport;

    pub fn serialize<S: Serializer>(t: &Transport, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(t.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Transport, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(|_| D::Error::custom(format!("unknown transport `{name}`, expected p2p or host-staged")))
    }
}

/// What a table was measured on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TuningMeta {
    /// [`Topology::gpu_model`] of the rank view.
    pub gpu_model: String,
    /// [`Topology::fingerprint`] of the rank view.
    pub fingerprint: String,
    pub world_size: usize,
    /// Medians from CUDA-graph replay (else eager launches).
    #[serde(default = "default_true")]
    pub captured: bool,
    /// What wrote the table (free text).
    #[serde(default)]
    pub tool: String,
    /// Only the candidates the cost model ranked near the top were
    /// measured (measured `auto`, `select::measured`): an algorithm without
    /// a result in an entry is not a candidate there. `tune` measures every
    /// algorithm (false), and an unmeasured one falls back to the model.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub candidates_only: bool,
}

fn default_true() -> bool {
    true
}

impl TuningMeta {
    /// The key of a table for this rank view.
    pub fn for_topology(view: &Topology, tool: impl Into<String>) -> TuningMeta {
        TuningMeta {
            gpu_model: view.gpu_model(),
            fingerprint: view.fingerprint(),
            world_size: view.len(),
            captured: true,
            tool: tool.into(),
            candidates_only: false,
        }
    }
}

/// One measured median.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timing {
    pub algorithm: Algorithm,
    #[serde(with = "transport_name")]
    pub transport: Transport,
    pub median_us: f64,
    /// The launch shape measured (the fastest of `tune`'s sweep), for
    /// algorithms whose grid is free (one-shot-push).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
}

impl Timing {
    /// `(blocks, threads)` when the result names a shape.
    pub fn shape(&self) -> Option<(u32, u32)> {
        self.blocks.zip(self.threads)
    }
}

/// All medians of one (dtype, size bucket).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TuningEntry {
    #[serde(with = "dtype_name")]
    pub dtype: DType,
    /// The size that was measured; the entry covers sizes up to it (down to
    /// the previous bucket).
    pub bytes: usize,
    pub winner: Algorithm,
    #[serde(with = "transport_name")]
    pub winner_transport: Transport,
    #[serde(rename = "result")]
    pub results: Vec<Timing>,
}

impl TuningEntry {
    /// The measured median of `algorithm` over `transport`. NCCL's own
    /// transport choice is not ours: any NCCL result matches.
    pub fn median_us(&self, algorithm: Algorithm, transport: Transport) -> Option<f64> {
        self.results
            .iter()
            .find(|t| t.algorithm == algorithm && (t.transport == transport || algorithm == Algorithm::Nccl))
            .map(|t| t.median_us)
    }

    /// The launch shape measured for `algorithm` over `transport`, if any.
    pub fn shape_of(&self, algorithm: Algorithm, transport: Transport) -> Option<(u32, u32)> {
        self.results.iter().find(|t| t.algorithm == algorithm && t.transport == transport).and_then(Timing::shape)
    }
}

/// The input of [`TuningTable::from_measurements`]: one median.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measurement {
    pub bucket_bytes: usize,
    pub dtype: DType,
    pub algorithm: Algorithm,
    pub transport: Transport,
    pub median_us: f64,
    /// The launch shape it was measured with (sentinel algorithms).
    pub shape: Option<(u32, u32)>,
}

/// A tuning table (one file).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TuningTable {
    pub format: u32,
    pub meta: TuningMeta,
    /// Sorted by (dtype, bytes) once loaded or built.
    #[serde(rename = "entry", default)]
    pub entries: Vec<TuningEntry>,
}

/// Whether a loaded table applies to the current rank view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applicability {
    Applies,
    /// Ignored; the reason is for the caller's log.
    Ignored(String),
}

/// What [`TuningTable::load_for`] found.
#[derive(Clone, Debug, PartialEq)]
pub enum Loaded {
    Usable(TuningTable),
    /// No file, or a table for another machine/world: the model decides.
    Ignored {
        reason: String,
    },
}

fn dtype_order(d: DType) -> u32 {
    d as u32
}

impl TuningTable {
    /// Builds a table from medians: groups them by (dtype, bucket), picks
    /// each bucket's winner (lowest median), validates.
    pub fn from_measurements(meta: TuningMeta, measurements: Vec<Measurement>) -> Result<TuningTable> {
        let mut entries: Vec<TuningEntry> = Vec::new();
        for m in measurements {
            let t = Timing {
                algorithm: m.algorithm,
                transport: m.transport,
                median_us: m.median_us,
                blocks: m.shape.map(|s| s.0),
                threads: m.shape.map(|s| s.1),
            };
            match entries.iter_mut().find(|e| e.dtype == m.dtype && e.bytes == m.bucket_bytes) {
                Some(e) => {
                    if e.results.iter().any(|r| r.algorithm == t.algorithm && r.transport == t.transport) {
                        return Err(Error::Config(format!(
                            "tuning measurements: {} over {} at {} {} bytes measured twice",
                            m.algorithm,
                            m.transport,
                            m.dtype.name(),
                            m.bucket_bytes
                        )));
                    }
                    e.results.push(t);
                }
                None => entries.push(TuningEntry {
                    dtype: m.dtype,
                    bytes: m.bucket_bytes,
                    winner: m.algorithm,
                    winner_transport: m.transport,
                    results: vec![t],
                }),
            }
        }
        for e in &mut entries {
            e.results.sort_by(|a, b| a.algorithm.cmp(&b.algorithm).then(a.transport.cmp(&b.transport)));
            if let Some(w) = e.results.iter().min_by(|a, b| a.median_us.total_cmp(&b.median_us)) {
                e.winner = w.algorithm;
                e.winner_transport = w.transport;
            }
        }
        let mut table = TuningTable { format: FORMAT, meta, entries };
        table.sort();
        table.validate(None)?;
        Ok(table)
    }

    fn sort(&mut self) {
        self.entries.sort_by_key(|e| (dtype_order(e.dtype), e.bytes));
    }

    /// Line of the `index`-th `[[entry]]` header in `text`.
    fn entry_line(text: Option<&str>, index: usize) -> String {
        text.and_then(|t| {
            t.lines()
                .enumerate()
                .filter(|(_, l)| l.trim_start().starts_with("[[entry]]"))
                .nth(index)
                .map(|(n, _)| format!(" (line {})", n + 1))
        })
        .unwrap_or_default()
    }

    /// Semantic checks; `text` (the file) lets messages name lines.
    fn validate(&self, text: Option<&str>) -> Result<()> {
        if self.format != FORMAT && self.format != FORMAT_NO_SHAPES {
            return Err(Error::Config(format!(
                "format = {}: this build reads tuning tables of format {FORMAT_NO_SHAPES} and {FORMAT}",
                self.format
            )));
        }
        if self.meta.world_size == 0 {
            return Err(Error::Config("meta.world_size must be at least 1".into()));
        }
        if self.meta.fingerprint.len() != 16 || !self.meta.fingerprint.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(Error::Config(format!(
                "meta.fingerprint `{}` is not a topology fingerprint (16 hex digits)",
                self.meta.fingerprint
            )));
        }
        for (i, e) in self.entries.iter().enumerate() {
            let at = || format!("entry {}{} ({} bytes, {})", i + 1, Self::entry_line(text, i), e.bytes, e.dtype.name());
            if e.bytes == 0 {
                return Err(Error::Config(format!("{}: bytes must be positive", at())));
            }
            if e.results.is_empty() {
                return Err(Error::Config(format!("{}: no [[entry.result]]", at())));
            }
            for (k, r) in e.results.iter().enumerate() {
                Self::validate_result(&at(), k, r, &e.results[..k])?;
            }
            let fastest = e.results.iter().min_by(|a, b| a.median_us.total_cmp(&b.median_us)).expect("non-empty");
            let winner = e.results.iter().find(|r| r.algorithm == e.winner && r.transport == e.winner_transport);
            match winner {
                None => {
                    return Err(Error::Config(format!(
                        "{}: winner {} over {} has no result in the entry",
                        at(),
                        e.winner,
                        e.winner_transport
                    )))
                }
                Some(w) if w.median_us > fastest.median_us => {
                    return Err(Error::Config(format!(
                        "{}: winner {} ({} us) is slower than {} ({} us)",
                        at(),
                        e.winner,
                        w.median_us,
                        fastest.algorithm,
                        fastest.median_us
                    )))
                }
                Some(_) => {}
            }
            if self.entries[..i].iter().any(|q| q.dtype == e.dtype && q.bytes == e.bytes) {
                return Err(Error::Config(format!("{}: a second entry for the same dtype and bytes", at())));
            }
        }
        Ok(())
    }

    /// Checks of result `k` (0-based) of an entry; `at` names the entry,
    /// `earlier` are the entry's results before it.
    fn validate_result(at: &str, k: usize, r: &Timing, earlier: &[Timing]) -> Result<()> {
        if !(r.median_us.is_finite() && r.median_us > 0.0) {
            return Err(Error::Config(format!(
                "{}: result {} ({}): median_us = {} is not a positive time",
                at,
                k + 1,
                r.algorithm,
                r.median_us
            )));
        }
        if r.transport == Transport::HostStaged && !r.algorithm.supports_host_staged() && r.algorithm != Algorithm::Nccl
        {
            return Err(Error::Config(format!("{}: result {}: {} cannot run host-staged", at, k + 1, r.algorithm)));
        }
        if r.blocks.is_some() != r.threads.is_some() {
            return Err(Error::Config(format!(
                "{}: result {} ({}): blocks and threads come together",
                at,
                k + 1,
                r.algorithm
            )));
        }
        if let Some(shape) = r.shape() {
            crate::env::check_launch_shape(shape)
                .map_err(|why| Error::Config(format!("{}: result {} ({}): {why}", at, k + 1, r.algorithm)))?;
        }
        if earlier.iter().any(|q| q.algorithm == r.algorithm && q.transport == r.transport) {
            return Err(Error::Config(format!("{}: {} over {} listed twice", at, r.algorithm, r.transport)));
        }
        Ok(())
    }

    /// A table decoded from elsewhere (the measured cache), validated and
    /// sorted.
    pub fn checked(mut self) -> Result<TuningTable> {
        self.validate(None)?;
        self.sort();
        Ok(self)
    }

    /// Parses a table; `origin` (a path) prefixes every error message.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<TuningTable> {
        let mut table: TuningTable = toml::from_str(text)
            .map_err(|e| Error::Config(format!("tuning table {origin}: {}", e.to_string().trim_end())))?;
        table.validate(Some(text)).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("tuning table {origin}: {m}")),
            other => other,
        })?;
        table.sort();
        Ok(table)
    }

    pub fn to_toml_string(&self) -> Result<String> {
        let body = toml::to_string(self).map_err(|e| Error::Config(format!("encoding tuning table: {e}")))?;
        Ok(format!(
            "# tp-allreduce tuning table: median microseconds per algorithm and size bucket.\n\
             # Valid only for the topology fingerprint and world size in [meta]; re-run `tp-allreduce tune` after hardware changes.\n{body}"
        ))
    }

    pub fn load(path: &Path) -> Result<TuningTable> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading tuning table {}", path.display()), e))?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Writes the table (through a temporary file and a rename, so a reader
    /// never sees half a table).
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = self.to_toml_string()?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        }
        let tmp = path.with_extension(format!("toml.tmp{}", std::process::id()));
        std::fs::write(&tmp, text).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
        std::fs::rename(&tmp, path)
            .map_err(|e| Error::io(format!("renaming {} to {}", tmp.display(), path.display()), e))
    }

    /// `dir/tuning-<fingerprint>-w<world>.toml`.
    pub fn default_path(dir: &Path, meta: &TuningMeta) -> PathBuf {
        dir.join(format!("tuning-{}-w{}.toml", meta.fingerprint, meta.world_size))
    }

    /// Whether this table was measured on `view` (same fingerprint, GPU
    /// model and world size).
    pub fn applicability(&self, view: &Topology) -> Applicability {
        let fp = view.fingerprint();
        if self.meta.fingerprint != fp {
            return Applicability::Ignored(format!(
                "tuning table measured on topology {} ({}, {} ranks) does not match this topology {} ({}, {} ranks): ignored; re-run `tp-allreduce tune`",
                self.meta.fingerprint,
                self.meta.gpu_model,
                self.meta.world_size,
                fp,
                view.gpu_model(),
                view.len()
            ));
        }
        if self.meta.world_size != view.len() {
            return Applicability::Ignored(format!(
                "tuning table is for {} ranks, this communicator has {}: ignored",
                self.meta.world_size,
                view.len()
            ));
        }
        if self.meta.gpu_model != view.gpu_model() {
            return Applicability::Ignored(format!(
                "tuning table is for {}, these GPUs are {}: ignored",
                self.meta.gpu_model,
                view.gpu_model()
            ));
        }
        Applicability::Applies
    }

    /// Loads `path` for the rank view `view`: a missing file or a table of
    /// another machine is `Loaded::Ignored` with the reason; a malformed
    /// file is an error.
    pub fn load_for(path: &Path, view: &Topology) -> Result<Loaded> {
        if !path.exists() {
            return Ok(Loaded::Ignored { reason: format!("no tuning table at {}", path.display()) });
        }
        let table = Self::load(path)?;
        Ok(match table.applicability(view) {
            Applicability::Applies => Loaded::Usable(table),
            Applicability::Ignored(reason) => Loaded::Ignored { reason: format!("{}: {reason}", path.display()) },
        })
    }

    /// The largest measured entry for `dtype`.
    pub fn last(&self, dtype: DType) -> Option<&TuningEntry> {
        self.entries.iter().filter(|e| e.dtype == dtype).max_by_key(|e| e.bytes)
    }

    /// The measured time of `algorithm` over `transport` at `bytes` for
    /// `dtype`, from the measured neighbours only: between two measured
    /// buckets, the straight line through both medians in log(size) and
    /// log(time) (both must have a result); at or below the first bucket,
    /// the first's median; past the last bucket, none (the caller falls
    /// back). Where only the upper neighbour measured the algorithm, its
    /// median (an upper bound for a size below it).
    pub fn interpolated_us(&self, dtype: DType, bytes: usize, algorithm: Algorithm, transport: Transport) -> Option<f64> {
        let upper = self.lookup(dtype, bytes)?;
        let at_upper = upper.median_us(algorithm, transport)?;
        let lower = self.entries.iter().filter(|e| e.dtype == dtype && e.bytes < bytes).max_by_key(|e| e.bytes);
        let Some((lower, at_lower)) = lower.and_then(|l| l.median_us(algorithm, transport).map(|t| (l, t))) else {
            return Some(at_upper);
        };
        if upper.bytes == bytes || upper.bytes <= lower.bytes {
            return Some(at_upper);
        }
        let span = (upper.bytes as f64).ln() - (lower.bytes as f64).ln();
        let f = ((bytes as f64).ln() - (lower.bytes as f64).ln()) / span;
        Some((at_lower.ln() + f * (at_upper.ln() - at_lower.ln())).exp())
    }

    /// The entry covering `bytes` for `dtype`: the smallest measured bucket
    /// at or above `bytes` (sizes below the first bucket use the first;
    /// sizes above the last have none and fall back to the model).
    /// O(log n), no allocation.
    pub fn lookup(&self, dtype: DType, bytes: usize) -> Option<&TuningEntry> {
        let key = dtype_order(dtype);
        let lo = self.entries.partition_point(|e| dtype_order(e.dtype) < key);
        let hi = self.entries.partition_point(|e| dtype_order(e.dtype) <= key);
        let same = &self.entries[lo..hi];
        let i = same.partition_point(|e| e.bytes < bytes);
        same.get(i)
    }
}

#[cfg(test)]
mod tests;
