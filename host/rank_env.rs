//! The environment contract of a process started by `tp-allreduce launch`
//! (or any launcher that sets the same variables, declared in [`crate::env`]):
//! its rank, the world size, the rendezvous id and the CUDA ordinal to use.

#![forbid(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::comm::Comm;
use crate::config::Config;
use crate::env;
use crate::error::{Error, Result};
use crate::rendezvous::Id;

/// The rank environment of a launched process.
#[derive(Clone, Debug)]
pub struct RankEnv {
    pub rank: usize,
    pub world_size: usize,
    pub id: Id,
    pub device: usize,
}

impl RankEnv {
    /// `Ok(None)` when the process was not started by a launcher
    /// (`TP_ALLREDUCE_RANK` unset); an error names a missing or malformed
    /// variable.
    pub fn from_env() -> Result<Option<RankEnv>> {
        let Some(rank) = env::launched_number(env::RANK)? else {
            return Ok(None);
        };
        let required = |name: &str| env::var(name).ok_or_else(|| Error::Config(format!("{name} is not set")));
        let world_size = env::launched_number(env::WORLD_SIZE)?
            .ok_or_else(|| Error::Config(format!("{} is not set", env::WORLD_SIZE)))?;
        Ok(Some(RankEnv {
            rank,
            world_size,
            id: required(env::ID)?.parse()?,
            device: env::launched_number(env::DEVICE)?.unwrap_or(0),
        }))
    }

    /// The communicator for this rank on `stream`.
    pub fn comm(&self, stream: Arc<CudaStream>, config: Config) -> Result<Comm> {
        Comm::from_rank_with_config(stream, self.rank, self.world_size, self.id.clone(), config)
    }
}
