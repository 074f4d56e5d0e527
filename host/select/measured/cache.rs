//! The cache of measured tables: one file per [`CacheKey`], which holds
//! everything that changes the answer, so a table from another machine,
//! driver, build, world, island split or dtype never applies.
//!
//! # File
//! `<dir>/measured-<key digest>.json`: a first line with the SHA-256 of
//! the rest, then JSON `{format, key, table}`. A file whose checksum,
//! format or key does not match (corrupt, truncated, written by another
//! build, copied from another machine) is refused with a reason the
//! caller logs once as a WARNING, and the table is measured again.
//!
//! # Writers
//! Rank 0 of a communicator is the only rank that reads or writes. Several
//! communicators (processes or threads) that finish measuring at once
//! serialise on an exclusive `flock` of `<file>.lock`; under it a writer
//! first reads the file again and keeps a valid table already there (the
//! first writer wins, later ones keep their own numbers for this run), else
//! writes a unique temporary file and renames it over the final name, so
//! a reader without the lock sees the old file or the whole new one, never
//! a torn one. The lock is not held while measuring (measuring takes
//! seconds and other communicators' ranks wait in bounded rendezvous).
//!
//! # Directory
//! [`Config::measure_cache_dir`](crate::config::Config::measure_cache_dir),
//! else `TP_ALLREDUCE_CACHE_DIR`, else `$XDG_CACHE_HOME/tp-allreduce`, else
//! `~/.cache/tp-allreduce`. A directory that cannot be created or written
//! (read-only, missing home) degrades to measuring at every start, with
//! one WARNING per start.

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::select::tuning::TuningTable;

/// The cache file format this build writes and reads.
pub const CACHE_FORMAT: u32 = 1;

/// Everything a measured table depends on. Two keys that differ in any
/// field never share a table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheKey {
    /// Topology fingerprint of the rank view (GPUs, links, which ranks
    /// share a GPU).
    pub fingerprint: String,
    pub gpu_model: String,
    /// `cuDriverGetVersion` (e.g. 13000).
    pub driver_version: i32,
    /// The kernel sources hash of this build (`kernels-rs/ptx/MANIFEST`).
    pub kernels_hash: String,
    /// The library version (host code changes launches too).
    pub library_version: String,
    pub world_size: usize,
    /// The island split (`0,1,2,3/4,5,6,7`) or `none`.
    pub islands: String,
    /// The transport the communicator settled on.
    pub transport: String,
    /// Whether NCCL was a candidate.
    pub nccl: bool,
    /// The configuration that shapes launches and buffers
    /// (`Config::shape_fingerprint`).
    pub config: String,
    pub dtype: String,
    /// The sweep that measured it (`on`, `full`).
    pub sweep: String,
}

impl CacheKey {
    /// 16 hex digits of the SHA-256 of the key (the file name).
    pub fn digest(&self) -> String {
        let json = serde_json::to_string(self).unwrap_or_default();
        hex(&Sha256::digest(json.as_bytes()))[..16].to_string()
    }

    /// The fields that differ from `other`, for the refusal message.
    fn differences(&self, other: &CacheKey) -> Vec<String> {
        let (a, b) = (serde_json::to_value(self).ok(), serde_json::to_value(other).ok());
        let (Some(serde_json::Value::Object(a)), Some(serde_json::Value::Object(b))) = (a, b) else {
            return vec!["key".into()];
        };
        a.iter().filter(|(k, v)| b.get(*k) != Some(v)).map(|(k, v)| format!("{k} {v} (here {})", b[k])).collect()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheFile {
    format: u32,
    key: CacheKey,
    table: TuningTable,
}

/// A cache file's key and table, or why it cannot be used.
pub type Decoded = std::result::Result<(CacheKey, TuningTable), String>;

/// What [`MeasuredCache::read`] found.
#[derive(Clone, Debug, PartialEq)]
pub enum CacheRead {
    /// A whole, valid table of exactly this key.
    Hit(TuningTable),
    /// No file for this key (the normal cold start).
    Miss,
    /// A file that must not be used; the reason is for one WARNING.
    Refused(String),
}

/// What [`MeasuredCache::write`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum WriteOutcome {
    Written(PathBuf),
    /// Another writer's valid table was already there; it was kept.
    KeptExisting(PathBuf),
}

/// A cache directory.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredCache {
    pub dir: PathBuf,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl MeasuredCache {
    /// The directory: `configured`, else `TP_ALLREDUCE_CACHE_DIR`, else the
    /// XDG cache home's `tp-allreduce`. `None` when none can be named.
    pub fn locate(configured: Option<&Path>) -> Option<MeasuredCache> {
        configured.map(Path::to_path_buf).or_else(crate::env::cache_dir).map(|dir| MeasuredCache { dir })
    }

    pub fn path(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(format!("measured-{}.json", key.digest()))
    }

    /// Encodes a table for `key` (checksum line + JSON).
    pub fn encode(key: &CacheKey, table: &TuningTable) -> crate::Result<String> {
        let body = serde_json::to_string_pretty(&CacheFile { format: CACHE_FORMAT, key: key.clone(), table: table.clone() })
            .map_err(|e| crate::error::Error::Config(format!("encoding the measured table: {e}")))?;
        Ok(format!("{}\n{body}", hex(&Sha256::digest(body.as_bytes()))))
    }

    /// Decodes `text` as a table of `key`; `Err` says why it is refused.
    pub fn decode(text: &str, key: &CacheKey) -> std::result::Result<TuningTable, String> {
        let (found, table) = Self::decode_any(text)?;
        if &found != key {
            return Err(format!("measured for another key: {}", found.differences(key).join(", ")));
        }
        Ok(table)
    }

    /// Decodes a whole, valid cache file of any key (`plan --measured`).
    pub fn decode_any(text: &str) -> Decoded {
        let (sum, body) = text.split_once('\n').ok_or("no checksum line (truncated or not a cache file)")?;
        if sum.trim() != hex(&Sha256::digest(body.as_bytes())) {
            return Err("checksum mismatch (truncated or corrupt)".into());
        }
        let file: CacheFile = serde_json::from_str(body).map_err(|e| format!("not a measured table: {e}"))?;
        if file.format != CACHE_FORMAT {
            return Err(format!("format {} (this build reads {CACHE_FORMAT})", file.format));
        }
        let table = file.table.checked().map_err(|e| e.to_string())?;
        if !table.meta.candidates_only || table.meta.world_size != file.key.world_size {
            return Err("the table inside does not match its key".into());
        }
        Ok((file.key, table))
    }

    /// Every cache file of the directory, decoded or with the reason it
    /// cannot be, sorted by path.
    pub fn list(&self) -> Vec<(PathBuf, Decoded)> {
        let Ok(dir) = std::fs::read_dir(&self.dir) else { return Vec::new() };
        let mut out: Vec<_> = dir
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("measured-") && n.ends_with(".json"))
            })
            .map(|p| {
                let decoded = std::fs::read_to_string(&p).map_err(|e| e.to_string()).and_then(|t| Self::decode_any(&t));
                (p, decoded)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Reads the table of `key`. Never an error: a file that cannot be
    /// used is `Refused` with the reason.
    pub fn read(&self, key: &CacheKey) -> CacheRead {
        let path = self.path(key);
        match std::fs::read_to_string(&path) {
            Ok(text) => match Self::decode(&text, key) {
                Ok(t) => CacheRead::Hit(t),
                Err(why) => CacheRead::Refused(format!("{}: {why}", path.display())),
            },
            // No file, or no directory yet (an unusable one warns at the write).
            Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => {
                CacheRead::Miss
            }
            Err(e) => CacheRead::Refused(format!("{}: {e}", path.display())),
        }
    }

    /// Writes `table` as the table of `key` unless a valid one is already
    /// there (see the module docs). `Err` says why it could not (a
    /// read-only or missing directory): the caller warns and carries on.
    pub fn write(&self, key: &CacheKey, table: &TuningTable) -> std::result::Result<WriteOutcome, String> {
        let path = self.path(key);
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("creating {}: {e}", self.dir.display()))?;
        let lock_path = path.with_extension("json.lock");
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| format!("opening {}: {e}", lock_path.display()))?;
        let _lock: Flock<File> = Flock::lock(lock_file, FlockArg::LockExclusive)
            .map_err(|(_, errno)| format!("locking {}: {errno}", lock_path.display()))?;
        if let CacheRead::Hit(_) = self.read(key) {
            return Ok(WriteOutcome::KeptExisting(path));
        }
        let text = Self::encode(key, table).map_err(|e| e.to_string())?;
        let tmp = self.dir.join(format!(
            ".measured-{}.tmp{}-{}",
            key.digest(),
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(format!("writing {}: {e}", path.display()));
        }
        Ok(WriteOutcome::Written(path))
    }
}

/// Rank 0's step after measuring: caches `table` in `cache`; the WARNING
/// to log when it cannot (no directory, read-only, ...), `None` when cached
/// or kept. Measuring goes on either way: the next start measures again.
pub fn store_or_warning(cache: Option<&MeasuredCache>, key: &CacheKey, table: &TuningTable) -> Option<String> {
    let Some(cache) = cache else {
        return Some(format!(
            "measured auto: no cache directory (set {} or HOME): measuring at every start",
            crate::env::CACHE_DIR
        ));
    };
    match cache.write(key, table) {
        Ok(WriteOutcome::Written(p)) => {
            log::debug!("measured auto: cached {}", p.display());
            None
        }
        Ok(WriteOutcome::KeptExisting(p)) => {
            log::debug!("measured auto: {} was written meanwhile; kept", p.display());
            None
        }
        Err(why) => Some(format!("measured auto: cannot cache the table ({why}): measuring at every start")),
    }
}
