//! Every environment variable the library reads, in one place.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `TP_ALLREDUCE_ALGORITHM` | force an algorithm (`one-shot-push`, `two-shot-pull`, ..., `nccl`) | selection |
//! | `TP_ALLREDUCE_TRANSPORT` | `p2p` or `host-staged` | auto |
//! | `TP_ALLREDUCE_TIMEOUT_MS` | bound of every device-side wait | 5000 |
//! | `TP_ALLREDUCE_ISLAND_SIZE` | ranks per island for `hierarchical` | none |
//! | `TP_ALLREDUCE_PUSH_BLOCKS` | most blocks per push-kernel launch | 16 |

use std::time::Duration;

use crate::comm::{Config, TransportPreference};
use crate::error::{Error, Result};

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| Error::Config(format!("{name}={value}: not a valid value")))
}

/// Applies the environment knobs to `config`.
pub fn apply(config: &mut Config) -> Result<()> {
    if let Some(v) = var("TP_ALLREDUCE_ALGORITHM") {
        config.algorithm = Some(v.parse().map_err(|e: Error| Error::Config(format!("TP_ALLREDUCE_ALGORITHM: {e}")))?);
    }
    if let Some(v) = var("TP_ALLREDUCE_TRANSPORT") {
        config.transport = TransportPreference::Force(v.parse()?);
    }
    if let Some(v) = var("TP_ALLREDUCE_TIMEOUT_MS") {
        config.timeout = Duration::from_millis(parse("TP_ALLREDUCE_TIMEOUT_MS", &v)?);
    }
    if let Some(v) = var("TP_ALLREDUCE_ISLAND_SIZE") {
        config.island_size = Some(parse("TP_ALLREDUCE_ISLAND_SIZE", &v)?);
    }
    if let Some(v) = var("TP_ALLREDUCE_PUSH_BLOCKS") {
        config.push_blocks = parse("TP_ALLREDUCE_PUSH_BLOCKS", &v)?;
    }
    Ok(())
}
