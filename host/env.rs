//! Every environment variable the library reads, declared in one place:
//! [`VARS`] (name, meaning, default) is the table; the functions below are
//! the only code that reads them.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `TP_ALLREDUCE_ALGORITHM` | force an algorithm for every call: `one-shot-pull`, `two-shot-pull`, `one-shot-push`, `two-shot-push`, `ring`, `hierarchical`, `nccl`; `auto` = the selection | `auto` |
//! | `TP_ALLREDUCE_TOPOLOGY` | model with this embedded topology instead of discovering the machine (`plan`, modelling) | discovery |
//! | `TP_ALLREDUCE_TUNING_FILE` | tuning table to load (TOML, see `tuning`) | `$XDG_CACHE_HOME/tp-allreduce/tuning-<fingerprint>-w<world>.toml` |
//! | `TP_ALLREDUCE_TRANSPORT` | force the transport: `p2p` or `host-staged` | auto (P2P if every pair passes the check) |
//! | `TP_ALLREDUCE_TIMEOUT_MS` | bound of every device-side wait on a peer, in ms | `5000` |
//! | `TP_ALLREDUCE_ISLAND_SIZE` | ranks per island for `hierarchical` (consecutive ranks) | from the topology |
//! | `TP_ALLREDUCE_PUSH_BLOCKS` | most blocks per push-kernel launch | `16` |

use std::path::PathBuf;

use crate::algorithm::Algorithm;
use crate::error::{Error, Result};

/// One declared environment variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvVar {
    pub name: &'static str,
    pub meaning: &'static str,
    pub default: &'static str,
}

pub const ALGORITHM: &str = "TP_ALLREDUCE_ALGORITHM";
pub const TOPOLOGY: &str = "TP_ALLREDUCE_TOPOLOGY";
pub const TUNING_FILE: &str = "TP_ALLREDUCE_TUNING_FILE";
pub const TRANSPORT: &str = "TP_ALLREDUCE_TRANSPORT";
pub const TIMEOUT_MS: &str = "TP_ALLREDUCE_TIMEOUT_MS";
pub const ISLAND_SIZE: &str = "TP_ALLREDUCE_ISLAND_SIZE";
pub const PUSH_BLOCKS: &str = "TP_ALLREDUCE_PUSH_BLOCKS";

/// The table of every variable (the module docs render the same table).
pub const VARS: &[EnvVar] = &[
    EnvVar {
        name: ALGORITHM,
        meaning: "force an algorithm for every call (one-shot-pull, two-shot-pull, one-shot-push, two-shot-push, ring, hierarchical, nccl); auto = the selection",
        default: "auto",
    },
    EnvVar {
        name: TOPOLOGY,
        meaning: "model with this embedded topology instead of discovering the machine",
        default: "discovery",
    },
    EnvVar {
        name: TUNING_FILE,
        meaning: "tuning table to load (TOML)",
        default: "$XDG_CACHE_HOME/tp-allreduce/tuning-<fingerprint>-w<world>.toml",
    },
    EnvVar { name: TRANSPORT, meaning: "force the transport: p2p or host-staged", default: "auto" },
    EnvVar { name: TIMEOUT_MS, meaning: "bound of every device-side wait on a peer, in ms", default: "5000" },
    EnvVar { name: ISLAND_SIZE, meaning: "ranks per island for hierarchical", default: "from the topology" },
    EnvVar { name: PUSH_BLOCKS, meaning: "most blocks per push-kernel launch", default: "16" },
];

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Parses a `TP_ALLREDUCE_ALGORITHM` value: `None` for `auto` (or empty).
pub fn parse_algorithm(value: &str) -> Result<Option<Algorithm>> {
    let v = value.trim();
    if v.is_empty() || v.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    v.parse::<Algorithm>().map(Some).map_err(|e| Error::Config(format!("{ALGORITHM}={value}: {e} (or auto)")))
}

/// The algorithm forced by `TP_ALLREDUCE_ALGORITHM`, if any.
pub fn algorithm_override() -> Result<Option<Algorithm>> {
    var(ALGORITHM).map_or(Ok(None), |v| parse_algorithm(&v))
}

/// The embedded topology named by `TP_ALLREDUCE_TOPOLOGY`, if any.
pub fn topology_override() -> Result<Option<crate::topology::Topology>> {
    var(TOPOLOGY)
        .map(|name| crate::topology::embedded::by_name(&name).map_err(|e| Error::Config(format!("{TOPOLOGY}: {e}"))))
        .transpose()
}

/// Where to look for the tuning table of a rank view with this
/// fingerprint and world size.
pub fn tuning_file(fingerprint: &str, world: usize) -> Option<PathBuf> {
    if let Some(p) = var(TUNING_FILE) {
        return Some(PathBuf::from(p));
    }
    let base =
        var("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("tp-allreduce").join(format!("tuning-{fingerprint}-w{world}.toml")))
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| Error::Config(format!("{name}={value}: not a valid value")))
}

/// Applies the knobs that shape a communicator to `config`.
pub fn apply(config: &mut crate::comm::Config) -> Result<()> {
    if let Some(a) = algorithm_override()? {
        config.algorithm = Some(a);
    }
    if let Some(v) = var(TRANSPORT) {
        config.transport = crate::comm::TransportPreference::Force(
            v.parse().map_err(|e: Error| Error::Config(format!("{TRANSPORT}: {e}")))?,
        );
    }
    if let Some(v) = var(TIMEOUT_MS) {
        config.timeout = std::time::Duration::from_millis(parse(TIMEOUT_MS, &v)?);
    }
    if let Some(v) = var(ISLAND_SIZE) {
        config.island_size = Some(parse(ISLAND_SIZE, &v)?);
    }
    if let Some(v) = var(PUSH_BLOCKS) {
        config.push_blocks = parse(PUSH_BLOCKS, &v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithm_values_parse() {
        assert_eq!(parse_algorithm("auto").unwrap(), None);
        assert_eq!(parse_algorithm(" ").unwrap(), None);
        assert_eq!(parse_algorithm("hierarchical").unwrap(), Some(Algorithm::Hierarchical));
        assert_eq!(parse_algorithm("ONE_SHOT_PUSH").unwrap(), Some(Algorithm::OneShotPush));
        assert_eq!(parse_algorithm("nccl").unwrap(), Some(Algorithm::Nccl));
        let e = parse_algorithm("fastest").unwrap_err().to_string();
        assert!(e.contains(ALGORITHM) && e.contains("fastest") && e.contains("two-shot-pull"), "{e}");
    }

    #[test]
    fn every_var_is_in_the_doc_table() {
        let doc = include_str!("env.rs");
        for v in VARS {
            assert!(v.name.starts_with("TP_ALLREDUCE_"));
            assert!(doc.contains(&format!("| `{}` |", v.name)), "{} missing from the module docs", v.name);
        }
    }
}
