//! Communicator configuration. Every rank of a communicator must use the
//! same values for the fields that shape shared memory (checked at init).

#![forbid(unsafe_code)]

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::algorithm::{Algorithm, Transport};
use crate::env;
pub use crate::select::measured::mode::AutoMeasure;

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
    /// Bound of a wait on a peer that has shown nothing of the current call
    /// yet: it may not have launched the call (first-call JIT, a model
    /// still loading). Once a wait of the call succeeded, `timeout` applies.
    /// A peer process that dies is noticed by the communicator's watchdog
    /// within ~0.1 s, whatever this bound.
    pub launch_timeout: Duration,
    /// Bound of every rendezvous step at init and registration.
    pub rendezvous_timeout: Duration,
    /// Largest message one kernel launch handles and the size of the eager
    /// staging buffer; longer messages are split into chunks of this size.
    pub max_chunk_bytes: usize,
    /// Largest message OneShotPush handles in one launch (longer messages
    /// are cut into launches). Its receive region holds two halves of
    /// `world - 1` copies of it. [`Config::ONE_SHOT_PUSH_AUTO`] (the
    /// default): `8 MiB / (world - 1)`, i.e. 16 MiB of receive region per
    /// rank at every world size. 0 disables OneShotPush.
    pub one_shot_push_max_bytes: usize,
    /// No effect any more (kept for compatibility, still validated):
    /// TwoShotPush and Hierarchical carry completion in the payload and run
    /// with any launch shape, like OneShotPush (`launch_shape`).
    pub push_blocks: u32,
    /// Launch shape `(blocks, threads)` of every sentinel (OneShotPush)
    /// launch, overriding the tuning table and the default rule
    /// (`TP_ALLREDUCE_SHAPE=BxT`). Threads: a multiple of 32 in 32..=1024;
    /// blocks: at least 1 and at most what stays resident with the other
    /// ranks of the GPU (checked at each call). Other algorithms ignore it.
    pub launch_shape: Option<(u32, u32)>,
    /// Use the two-rank specialisation of OneShotPush when the world size is
    /// 2 (`TP_ALLREDUCE_ONE_SHOT_PUSH_TP2=0` turns it off, to compare).
    pub one_shot_push_tp2: bool,
    /// Fused calls (`all_reduce_add_rms_norm`) over TwoShotPush or
    /// Hierarchical run their fused kernels (the owner of a share normalises
    /// whole rows, the all-gather carries residual and normed rows) instead
    /// of the allreduce followed by the separate `add_rms_norm` kernel
    /// (`TP_ALLREDUCE_FUSED_ISLAND_KERNELS=1`). Off by default: on 2 H200
    /// the fused kernels were slower (docs/RESULTS.md). Every rank must
    /// use the same value.
    pub fused_island_kernels: bool,
    /// Fused OneShotPush calls over a few long rows spread each row over the
    /// blocks of a thread-block cluster (sm_90 and newer, every rank's GPU;
    /// `TP_ALLREDUCE_FUSED_CLUSTERS=0` turns it off, to compare or to test
    /// the block-per-row kernels that older GPUs run). Every rank must use
    /// the same value.
    pub fused_clusters: bool,
    /// Fused OneShotPush calls of a block per row over at least two rows
    /// spread their push over a grid of more blocks than rows, where the
    /// outputs do not overlap the input (`TP_ALLREDUCE_FUSED_SPREAD_PUSH=0`
    /// turns it off, to compare). The same output bits either way, so
    /// ranks may differ.
    pub fused_spread_push: bool,
    /// Results that do not depend on the message size or the batch shape
    /// (`TP_ALLREDUCE_BATCH_INVARIANT=1`; what vLLM's `VLLM_BATCH_INVARIANT`
    /// and SGLang's deterministic inference ask of an allreduce): every
    /// size runs an algorithm that sums each element in rank order with one
    /// rounding (one-shot and two-shot push and pull give the same bits;
    /// the ring, hierarchical, the copy-engine ring and NCCL are not used),
    /// and fused calls run the fused one-shot push only, a block per row
    /// (no thread-block clusters, whose use depends on the row count).
    /// Every rank must use the same value.
    pub batch_invariant: bool,
    /// How the push algorithms' data travels (`TP_ALLREDUCE_WIRE`):
    /// lossless (the default, every kernel today), or fp8 / int8 with one
    /// f32 scale per 32 elements (issue 38; format and error bound in
    /// `tp_allreduce_kernels::wire`). **The lossy wires have no kernel yet:**
    /// [`Config::validate`], and so every communicator constructor, returns
    /// `Error::Unsupported` for them rather than running lossless silently.
    pub wire: crate::wire::WireFormat,
    /// With a lossy wire, messages below this many bytes use the lossless
    /// one (`TP_ALLREDUCE_WIRE_MIN_BYTES`); `None`: where the cost model
    /// predicts the compressed wire is faster (`plan --wire`).
    pub wire_min_bytes: Option<usize>,
    /// Sentinel kernels record per-launch timestamps into a ring the host
    /// reads with `Comm::trace_records` (`TP_ALLREDUCE_TRACE=1`; `bench
    /// --trace`). Costs a few instructions per launch.
    pub trace: bool,
    /// Test-only: start every protocol counter (OneShotPush generation, the
    /// flag kernels' per-block epochs and flags, the ring's message counters)
    /// at this value instead of 0, so that tests cross the 2^32 wrap after a
    /// few calls. Every rank must use the same value.
    #[doc(hidden)]
    pub test_initial_counter: Option<u32>,
    /// Most blocks of a pull kernel per launch.
    pub pull_max_blocks: u32,
    /// Ring: blocks (independent rings), FIFO slots per block, bytes per slot.
    pub ring_blocks: u32,
    pub ring_slots: u32,
    pub ring_chunk_bytes: usize,
    /// Hierarchical: ranks per island, consecutive ranks forming an island
    /// (`Some(4)` with 8 ranks: {0..3}, {4..7}). `None`: the islands come
    /// from `islands`, else from the topology (socket, root complex, PCIe
    /// switch boundaries).
    pub island_size: Option<usize>,
    /// Hierarchical: the islands explicitly, any shape (`[[0, 1, 2],
    /// [3, 4]]`; `TP_ALLREDUCE_ISLANDS=0,1,2/3,4`). Overrides `island_size`
    /// and the topology. At init the communicator stores here the islands
    /// it uses.
    pub islands: Option<Vec<Vec<usize>>>,
    pub transport: TransportPreference,
    /// Force one algorithm for the calls of its collective (NCCL: for every
    /// collective; `None`: the selection decides).
    pub algorithm: Option<Algorithm>,
    /// Capacity of the device table of registered buffers (graph slots
    /// included); each entry is 64 bytes.
    pub max_registered_buffers: usize,
    /// Run the init-time P2P transfer check (strongly recommended).
    pub check_p2p: bool,
    /// Create an NCCL communicator as fallback when NCCL is available and
    /// the ranks are on distinct GPUs.
    pub nccl_fallback: bool,
    /// Measured `auto` at communicator start (`select::measured`): `Off`
    /// (the cost model, or a `tune` table), `On` (a bounded sweep, cached
    /// per machine, driver, build, world, islands and dtype), `Full`.
    /// `None` (the default): `TP_ALLREDUCE_AUTO_MEASURE`, else `On`. Rank
    /// 0's value decides for every rank.
    pub auto_measure: Option<AutoMeasure>,
    /// The dtypes measured at start (`TP_ALLREDUCE_MEASURE_DTYPES`); other
    /// dtypes use the model unless `Comm::measure_selection` measures them.
    /// Rank 0's value decides for every rank.
    pub measure_dtypes: Vec<crate::DType>,
    /// Where measured tables are cached; `None`: `TP_ALLREDUCE_CACHE_DIR`,
    /// else `$XDG_CACHE_HOME/tp-allreduce`, else `~/.cache/tp-allreduce`.
    pub measure_cache_dir: Option<std::path::PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: Duration::from_secs(5),
            launch_timeout: Duration::from_secs(60),
            rendezvous_timeout: Duration::from_secs(60),
            max_chunk_bytes: 8 << 20,
            one_shot_push_max_bytes: Config::ONE_SHOT_PUSH_AUTO,
            push_blocks: 16,
            launch_shape: None,
            one_shot_push_tp2: true,
            fused_island_kernels: false,
            fused_clusters: true,
            fused_spread_push: true,
            batch_invariant: false,
            trace: false,
            wire: crate::wire::WireFormat::Lossless,
            wire_min_bytes: None,
            test_initial_counter: None,
            pull_max_blocks: 36,
            ring_blocks: 4,
            ring_slots: 4,
            ring_chunk_bytes: 64 << 10,
            island_size: None,
            islands: None,
            transport: TransportPreference::Auto,
            algorithm: None,
            max_registered_buffers: 8192,
            check_p2p: true,
            nccl_fallback: true,
            auto_measure: None,
            measure_dtypes: vec![crate::DType::Bf16],
            measure_cache_dir: None,
        }
    }
}

impl Config {
    /// The measured-`auto` mode in force: [`Config::auto_measure`], else
    /// `TP_ALLREDUCE_AUTO_MEASURE`, else on.
    pub fn auto_measure_mode(&self) -> crate::Result<AutoMeasure> {
        match self.auto_measure {
            Some(m) => Ok(m),
            None => Ok(env::auto_measure()?.unwrap_or_default()),
        }
    }

    /// `one_shot_push_max_bytes` default: `8 MiB / (world - 1)`.
    pub const ONE_SHOT_PUSH_AUTO: usize = usize::MAX;

    /// Largest `max_chunk_bytes` and `one_shot_push_max_bytes` (4 GiB): the
    /// kernels count a launch's 16-byte packs, and packs times ranks, in 32
    /// bits (and keep them below 2^31); larger sizes would wrap them.
    pub const MAX_LAUNCH_BYTES: usize = (1 << 31) / tp_allreduce_kernels::layout::MAX_RANKS
        * tp_allreduce_kernels::layout::PACK_BYTES;

    /// `one_shot_push_max_bytes` for a world of `world` ranks: the
    /// configured value, or the default rule for [`Self::ONE_SHOT_PUSH_AUTO`]
    /// (a multiple of 16 bytes).
    pub fn one_shot_push_capacity(&self, world: usize) -> usize {
        resolve_one_shot_push_max_bytes(self.one_shot_push_max_bytes, world)
    }

    /// The fields every rank must agree on, as one comparable string.
    pub(crate) fn shape_fingerprint(&self) -> String {
        format!(
            "chunk={} oneshot={} push_blocks={} pull_blocks={} ring={}x{}x{} islands={:?} {:?} transport={:?} table={} \
             counters={:?} fused_island={} fused_clusters={} tp2={} batch_invariant={} wire={} wire_min={:?}",
            self.max_chunk_bytes,
            self.one_shot_push_max_bytes,
            self.push_blocks,
            self.pull_max_blocks,
            self.ring_blocks,
            self.ring_slots,
            self.ring_chunk_bytes,
            self.island_size,
            self.islands,
            self.transport,
            self.max_registered_buffers,
            self.test_initial_counter,
            self.fused_island_kernels,
            self.fused_clusters,
            self.one_shot_push_tp2,
            self.batch_invariant,
            self.wire.name(),
            self.wire_min_bytes
        )
    }

    /// Checks value ranges; the message names the field.
    pub fn validate(&self) -> crate::Result<()> {
        if self.wire.is_lossy() {
            return Err(crate::error::Error::Unsupported(format!(
                "wire {}: the compressed-wire kernels are not built yet (issue 38: only the format, its CPU \
                 emulation and the cost model exist); use wire lossless (unset {})",
                self.wire.name(),
                env::WIRE
            )));
        }
        if self.batch_invariant {
            if let Some(a) = self.algorithm.filter(|a| Algorithm::BATCH_VARIANT.contains(a)) {
                return Err(crate::error::Error::invalid(format!(
                    "batch_invariant with algorithm {a}: its results depend on the message size; force one-shot-push, \
                     two-shot-push, one-shot-pull or two-shot-pull, or none"
                )));
            }
        }
        use crate::error::Error;
        let pack = tp_allreduce_kernels::layout::PACK_BYTES;
        let max_blocks = tp_allreduce_kernels::layout::MAX_BLOCKS as u32;
        if self.max_chunk_bytes < 4096 || self.max_chunk_bytes % pack != 0 {
            return Err(Error::invalid("max_chunk_bytes must be a multiple of 16 and at least 4096"));
        }
        if self.one_shot_push_max_bytes != Self::ONE_SHOT_PUSH_AUTO && self.one_shot_push_max_bytes % pack != 0 {
            return Err(Error::invalid(
                "one_shot_push_max_bytes must be a multiple of 16 (or Config::ONE_SHOT_PUSH_AUTO)",
            ));
        }
        let one_shot = Some(self.one_shot_push_max_bytes).filter(|&v| v != Self::ONE_SHOT_PUSH_AUTO);
        for (name, v) in [("max_chunk_bytes", Some(self.max_chunk_bytes)), ("one_shot_push_max_bytes", one_shot)] {
            if let Some(v) = v.filter(|&v| v > Self::MAX_LAUNCH_BYTES) {
                return Err(Error::invalid(format!(
                    "{name} is {v}, over Config::MAX_LAUNCH_BYTES ({}): the kernels count a launch's packs in 32 bits",
                    Self::MAX_LAUNCH_BYTES
                )));
            }
        }
        if let Some(shape) = self.launch_shape {
            env::check_launch_shape(shape).map_err(|why| Error::invalid(format!("launch_shape: {why}")))?;
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
        if !self.ring_slots.is_power_of_two() {
            // The ring picks slot `message % ring_slots` with a wrapping u32
            // message counter: only a power of two divides 2^32, so only
            // then does the slot sequence continue correctly across the wrap.
            return Err(Error::invalid(format!(
                "ring_slots must be a power of two (1, 2, 4, 8, ...), got {}: the slot index is a wrapping message \
                 counter modulo ring_slots",
                self.ring_slots
            )));
        }
        if self.ring_chunk_bytes < pack || self.ring_chunk_bytes % pack != 0 {
            return Err(Error::invalid("ring_chunk_bytes must be a positive multiple of 16"));
        }
        if self.max_registered_buffers < 2 {
            return Err(Error::invalid("max_registered_buffers must be at least 2"));
        }
        if self.timeout.is_zero() || self.rendezvous_timeout.is_zero() {
            return Err(Error::invalid("timeouts must be positive"));
        }
        if self.launch_timeout < self.timeout {
            return Err(Error::invalid(format!(
                "launch_timeout ({:?}) must be at least timeout ({:?})",
                self.launch_timeout, self.timeout
            )));
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
            c.launch_timeout = c.launch_timeout.max(t);
        }
        if let Some(t) = env::launch_timeout()? {
            c.launch_timeout = t;
        }
        if let Some(n) = env::island_size()? {
            c.island_size = Some(n);
        }
        if let Some(groups) = env::islands()? {
            c.islands = Some(groups);
        }
        if let Some(n) = env::push_blocks()? {
            c.push_blocks = n;
        }
        if let Some(shape) = env::launch_shape()? {
            c.launch_shape = Some(shape);
        }
        if let Some(on) = env::one_shot_push_tp2()? {
            c.one_shot_push_tp2 = on;
        }
        if let Some(on) = env::fused_island_kernels()? {
            c.fused_island_kernels = on;
        }
        if let Some(on) = env::fused_clusters()? {
            c.fused_clusters = on;
        }
        if let Some(on) = env::fused_spread_push()? {
            c.fused_spread_push = on;
        }
        if let Some(on) = env::batch_invariant()? {
            c.batch_invariant = on;
        }
        if let Some(on) = env::trace()? {
            c.trace = on;
        }
        if let Some(w) = env::wire()? {
            c.wire = w;
        }
        if let Some(n) = env::wire_min_bytes()? {
            c.wire_min_bytes = Some(n);
        }
        if let Some(mode) = env::auto_measure()? {
            c.auto_measure = Some(mode);
        }
        if let Some(dtypes) = env::measure_dtypes()? {
            c.measure_dtypes = dtypes;
        }
        c.validate()?;
        Ok(c)
    }
}

/// `one_shot_push_max_bytes` resolved for `world` ranks (see
/// [`Config::one_shot_push_max_bytes`]).
pub fn resolve_one_shot_push_max_bytes(configured: usize, world: usize) -> usize {
    if configured != Config::ONE_SHOT_PUSH_AUTO {
        return configured;
    }
    let budget = 8usize << 20;
    let pack = tp_allreduce_kernels::layout::PACK_BYTES;
    (budget / world.saturating_sub(1).max(1)) / pack * pack
}

impl Config {
    /// `(timeout, launch_timeout)` in nanoseconds, as the kernels read them.
    pub(crate) fn wait_bounds_ns(&self) -> (u64, u64) {
        let ns = |d: Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        (ns(self.timeout), ns(self.launch_timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No kernel implements a lossy wire: asking for one must fail loudly
    /// at construction (validate runs first in `Comm::from_rendezvous`),
    /// never fall back to lossless in silence.
    #[test]
    fn a_lossy_wire_is_refused_until_its_kernels_exist() {
        use crate::wire::{parse_wire, WireFormat};
        let mut c = Config::default();
        assert_eq!(c.wire, WireFormat::Lossless);
        assert!(c.validate().is_ok());
        for name in ["fp8", "int8"] {
            c.wire = parse_wire(name).unwrap();
            let err = c.validate().expect_err(name);
            assert!(matches!(err, crate::Error::Unsupported(_)), "{err}");
            let text = err.to_string();
            assert!(text.contains("not built yet") && text.contains(name) && text.contains(env::WIRE), "{text}");
        }
        c.wire = parse_wire("lossless").unwrap();
        c.wire_min_bytes = Some(1 << 20);
        assert!(c.validate().is_ok());
        assert!(parse_wire("fp16").is_err());
        // Ranks must agree on the wire.
        let a = Config::default().shape_fingerprint();
        let b = Config { wire_min_bytes: Some(4096), ..Config::default() }.shape_fingerprint();
        assert_ne!(a, b);
    }

    /// The kernels count a launch's packs (and packs times peers) in 32
    /// bits: sizes past [`Config::MAX_LAUNCH_BYTES`] would wrap them.
    #[test]
    fn validate_bounds_the_sizes_the_kernels_count_in_32_bits() {
        let with = |f: fn(&mut Config)| {
            let mut c = Config::default();
            f(&mut c);
            c.validate()
        };
        assert!(with(|_| ()).is_ok());
        type Change = fn(&mut Config);
        let too_big: [(&str, Change); 4] = [
            ("max_chunk_bytes", |c| c.max_chunk_bytes = 1 << 40),
            ("max_chunk_bytes", |c| c.max_chunk_bytes = (u32::MAX as usize + 1) * 16),
            ("one_shot_push_max_bytes", |c| c.one_shot_push_max_bytes = 1 << 40),
            ("one_shot_push_max_bytes", |c| c.one_shot_push_max_bytes = usize::MAX - 15),
        ];
        for (name, f) in too_big {
            let err = with(f).expect_err(name);
            assert!(matches!(err, crate::Error::InvalidUsage(_)) && err.to_string().contains(name), "{err}");
        }
        // The largest accepted sizes still keep packs x ranks below 2^31.
        let packs = (Config::MAX_LAUNCH_BYTES / tp_allreduce_kernels::layout::PACK_BYTES) as u64;
        assert!(packs * tp_allreduce_kernels::layout::MAX_RANKS as u64 <= 1 << 31);
        assert!(with(|c| c.max_chunk_bytes = Config::MAX_LAUNCH_BYTES).is_ok());
        assert!(with(|c| c.one_shot_push_max_bytes = Config::MAX_LAUNCH_BYTES).is_ok());
        assert!(with(|c| c.max_chunk_bytes = Config::MAX_LAUNCH_BYTES + 16).is_err());
        assert!(with(|c| c.one_shot_push_max_bytes = Config::ONE_SHOT_PUSH_AUTO).is_ok());
    }
}
