//! Communicator configuration. Every rank of a communicator must use the
//! same values for the fields that shape shared memory (checked at init).

#![forbid(unsafe_code)]

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::algorithm::{Algorithm, Transport};
use crate::env;

/// Which transport to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum TransportPreference {
    /// Peer-to-peer when every pair reports P2P and passes the transfer
    /// check; host-staged otherwise.
    #[default]
    Auto,
    /// Force one transport (init fails if it cannot work).
    Force(Transport),
}

/// Tunables of a communicator. `Config::default()` suits small-message
/// tensor-parallel inference; `Config::from_env()` applies the environment
/// knobs declared in [`crate::env`].
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Bound of every device-side wait on a peer. After it, the kernel
    /// records which rank it waited for and exits; the call returns
    /// `Error::Timeout` at the next check and the communicator is broken.
    pub timeout: Duration,
    /// Bound of every rendezvous step at init and registration.
    pub rendezvous_timeout: Duration,
    /// Largest message one kernel launch handles and the size of the eager
    /// staging buffer; longer messages are split into chunks of this size.
    pub max_chunk_bytes: usize,
    /// Largest message OneShotPush handles (its receive buffers hold three
    /// generations of `world` copies of it).
    pub one_shot_push_max_bytes: usize,
    /// Most blocks of a push kernel (OneShotPush, TwoShotPush, Hierarchical)
    /// per launch; their scratch is striped per block.
    pub push_blocks: u32,
    /// Most blocks of a pull kernel per launch.
    pub pull_max_blocks: u32,
    /// Ring: blocks (independent rings), FIFO slots per block, bytes per slot.
    pub ring_blocks: u32,
    pub ring_slots: u32,
    pub ring_chunk_bytes: usize,
    /// Hierarchical: ranks per island, consecutive ranks forming an island
    /// (`Some(4)` with 8 ranks: {0..3}, {4..7}). `None`: no hierarchy.
    pub island_size: Option<usize>,
    pub transport: TransportPreference,
    /// Force one algorithm for every call (`None`: the selection decides).
    pub algorithm: Option<Algorithm>,
    /// Capacity of the device table of registered buffers (graph slots
    /// included); each entry is 64 bytes.
    pub max_registered_buffers: usize,
    /// Run the init-time P2P transfer check (strongly recommended).
    pub check_p2p: bool,
    /// Create an NCCL communicator as fallback when NCCL is available and
    /// the ranks are on distinct GPUs.
    pub nccl_fallback: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(5),
            rendezvous_timeout: Duration::from_secs(60),
            max_chunk_bytes: 8 << 20,
            one_shot_push_max_bytes: 512 << 10,
            push_blocks: 16,
            pull_max_blocks: 36,
            ring_blocks: 4,
            ring_slots: 4,
            ring_chunk_bytes: 64 << 10,
            island_size: None,
            transport: TransportPreference::Auto,
            algorithm: None,
            max_registered_buffers: 8192,
            check_p2p: true,
            nccl_fallback: true,
        }
    }
}

impl Config {
    /// The fields every rank must agree on, as one comparable string.
    pub(crate) fn shape_fingerprint(&self) -> String {
        format!(
            "chunk={} oneshot={} push_blocks={} pull_blocks={} ring={}x{}x{} islands={:?} transport={:?} table={}",
            self.max_chunk_bytes,
            self.one_shot_push_max_bytes,
            self.push_blocks,
            self.pull_max_blocks,
            self.ring_blocks,
            self.ring_slots,
            self.ring_chunk_bytes,
            self.island_size,
            self.transport,
            self.max_registered_buffers
        )
    }

    /// Checks value ranges; the message names the field.
    pub fn validate(&self) -> crate::Result<()> {
        use crate::error::Error;
        let pack = tp_allreduce_kernels::layout::PACK_BYTES;
        let max_blocks = tp_allreduce_kernels::layout::MAX_BLOCKS as u32;
        if self.max_chunk_bytes < 4096 || self.max_chunk_bytes % pack != 0 {
            return Err(Error::invalid("max_chunk_bytes must be a multiple of 16 and at least 4096"));
        }
        if self.one_shot_push_max_bytes % pack != 0 {
            return Err(Error::invalid("one_shot_push_max_bytes must be a multiple of 16"));
        }
        for (name, v) in [
            ("push_blocks", self.push_blocks),
            ("pull_max_blocks", self.pull_max_blocks),
            ("ring_blocks", self.ring_blocks),
        ] {
            if v == 0 || v > max_blocks {
                return Err(Error::invalid(format!("{name} must be in 1..={max_blocks}")));
            }
        }
        if self.ring_slots == 0 || self.ring_chunk_bytes < pack || self.ring_chunk_bytes % pack != 0 {
            return Err(Error::invalid("ring_slots must be >= 1 and ring_chunk_bytes a positive multiple of 16"));
        }
        if self.max_registered_buffers < 2 {
            return Err(Error::invalid("max_registered_buffers must be at least 2"));
        }
        if self.timeout.is_zero() || self.rendezvous_timeout.is_zero() {
            return Err(Error::invalid("timeouts must be positive"));
        }
        Ok(())
    }
}

impl Config {
    /// `Config::default()` with the environment knobs applied (see the
    /// table in `crate::env`).
    pub fn from_env() -> crate::Result<Config> {
        let mut c = Config::default();
        if let Some(a) = env::algorithm()? {
            c.algorithm = Some(a);
        }
        if let Some(t) = env::transport()? {
            c.transport = TransportPreference::Force(t);
        }
        if let Some(t) = env::timeout()? {
            c.timeout = t;
        }
        if let Some(n) = env::island_size()? {
            c.island_size = Some(n);
        }
        if let Some(n) = env::push_blocks()? {
            c.push_blocks = n;
        }
        c.validate()?;
        Ok(c)
    }
}
