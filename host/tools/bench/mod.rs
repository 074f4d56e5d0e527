//! The benchmark engine behind `tp-allreduce bench` and `tune`: in-process
//! ranks (one per GPU, or several per GPU with `ranks_per_gpu`), graph replay
//! of many back-to-back allreduces (or eager calls), CUDA-event timing,
//! median with p10/p90, and every configuration checked against the
//! expected sum before it is timed. NCCL runs in the same process on the
//! same buffers as the baseline when its ranks are on distinct GPUs.

pub mod processes;
pub mod report;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaGraph, CudaStream};
use serde::{Deserialize, Serialize};

use crate::algorithm::{Algorithm, Transport};
use crate::comm::{Comm, Config};
use crate::driver::{self, DeviceMemory};
use crate::error::{Error, Result};
use crate::nccl::NcclComm;
use crate::DType;

/// What to run for one row: our selection, a forced algorithm, or NCCL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Selection {
    Auto,
    Forced(Algorithm),
}

impl Selection {
    pub fn name(&self) -> String {
        match self {
            Selection::Auto => "auto".into(),
            Selection::Forced(a) => a.name().into(),
        }
    }
}

impl std::str::FromStr for Selection {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(Selection::Auto)
        } else {
            Ok(Selection::Forced(s.parse()?))
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// CUDA-graph replay of `iterations` back-to-back allreduces per rank.
    Graph,
    /// `iterations` eager calls per rank per timed repeat.
    Eager,
}

#[derive(Clone, Debug)]
pub struct Options {
    /// Message sizes in bytes.
    pub sizes: Vec<usize>,
    pub dtype: DType,
    pub selections: Vec<Selection>,
    pub include_nccl: bool,
    pub mode: Mode,
    /// Allreduces per timed graph replay / eager repeat.
    pub iterations: usize,
    /// Timed repeats (the statistics are over these).
    pub repeats: usize,
    pub warmup: usize,
    pub gpus: Vec<usize>,
    pub ranks_per_gpu: usize,
    pub config: Config,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sizes: default_sizes(),
            dtype: DType::Bf16,
            selections: vec![Selection::Auto],
            include_nccl: true,
            mode: Mode::Graph,
            iterations: 100,
            repeats: 20,
            warmup: 3,
            gpus: vec![0],
            ranks_per_gpu: 1,
            config: Config::default(),
        }
    }
}

/// 1 KB .. 64 MB doubling, plus the 42 KB verify-pass message.
pub fn default_sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (0..=16).map(|i| 1024usize << i).collect();
    v.push(43_008);
    v.sort_unstable();
    v
}

/// One measured row.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Measurement {
    pub bytes: usize,
    pub dtype: String,
    /// `auto`, an algorithm name, or `nccl`.
    pub selection: String,
    /// What actually ran (for `auto`: the selection's choice).
    pub algorithm: String,
    pub world: usize,
    pub mode: String,
    pub median_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
    /// bytes / time.
    pub algbw_gbs: f64,
    /// algbw * 2(n-1)/n, the standard bus-bandwidth figure.
    pub busbw_gbs: f64,
    /// NCCL's median / ours, when NCCL ran the same size.
    pub speedup_vs_nccl: Option<f64>,
}

/// Statistics of a sample (microseconds).
pub fn percentiles(samples: &mut [f64]) -> (f64, f64, f64) {
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let pick = |q: f64| {
        if samples.is_empty() {
            return f64::NAN;
        }
        let idx = ((samples.len() - 1) as f64 * q).round() as usize;
        samples[idx]
    };
    (pick(0.5), pick(0.1), pick(0.9))
}

pub fn busbw(algbw: f64, world: usize) -> f64 {
    if world <= 1 {
        algbw
    } else {
        algbw * 2.0 * (world - 1) as f64 / world as f64
    }
}

/// Ranks of an in-process benchmark group: their contexts and streams.
pub struct Ranks {
    pub contexts: Vec<Arc<CudaContext>>,
    pub streams: Vec<Arc<CudaStream>>,
    pub ordinals: Vec<usize>,
}

impl Ranks {
    pub fn new(gpus: &[usize], ranks_per_gpu: usize) -> Result<Ranks> {
        driver::require_driver()?;
        let mut contexts = Vec::new();
        let mut streams = Vec::new();
        let mut ordinals = Vec::new();
        for &g in gpus {
            let ctx = CudaContext::new(g).map_err(|e| crate::error::driver("cuDevicePrimaryCtxRetain", e))?;
            // The benchmark orders all work explicitly per stream.
            // SAFETY: no buffer is shared across streams without explicit ordering.
            unsafe { ctx.disable_event_tracking() };
            for _ in 0..ranks_per_gpu {
                streams.push(ctx.new_stream().map_err(|e| crate::error::driver("cuStreamCreate", e))?);
                contexts.push(ctx.clone());
                ordinals.push(g);
            }
        }
        Ok(Ranks { contexts, streams, ordinals })
    }

    pub fn world(&self) -> usize {
        self.streams.len()
    }

    /// NCCL can run when every rank has its own GPU.
    pub fn nccl_possible(&self) -> bool {
        let mut o = self.ordinals.clone();
        o.sort_unstable();
        o.dedup();
        o.len() == self.ordinals.len()
    }
}

/// Per-rank device buffers of one size with random contents and the
/// expected sum.
pub struct Buffers {
    pub count: usize,
    pub dtype: DType,
    pub inputs: Vec<DeviceMemory>,
    pub outputs: Vec<DeviceMemory>,
    host_inputs: Vec<Vec<f64>>,
}

/// `n` pseudo-random values in [-1, 1) of `dtype`: their bytes and values.
pub(crate) fn random_bits(dtype: DType, n: usize, seed: u64) -> (Vec<u8>, Vec<f64>) {
    // A small xorshift: fresh values per rank and size, no dependency. The
    // seed goes through the splitmix64 finalizer first: seeds differing in a
    // few bits (rank, size index) must not give near-equal first values, or
    // a kernel reading another call's stale data could still pass the check.
    let mut x = {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) | 1
    };
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    let mut bytes = Vec::with_capacity(n * dtype.size_bytes());
    let mut values = Vec::with_capacity(n);
    for _ in 0..n {
        let v = next();
        match dtype {
            DType::F32 => {
                let f = v as f32;
                bytes.extend_from_slice(&f.to_le_bytes());
                values.push(f as f64);
            }
            DType::F16 => {
                let h = half::f16::from_f64(v);
                bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                values.push(h.to_f64());
            }
            DType::Bf16 => {
                let h = half::bf16::from_f64(v);
                bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                values.push(h.to_f64());
            }
        }
    }
    (bytes, values)
}

/// Values of raw `dtype` bytes.
pub(crate) fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect(),
        DType::F16 => {
            bytes.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64()).collect()
        }
        DType::Bf16 => {
            bytes.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64()).collect()
        }
    }
}

/// Half an ulp at 1.0 of `dtype` (tolerances of the correctness checks).
pub(crate) fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2f64.powi(-24),
        DType::F16 => 2f64.powi(-11),
        DType::Bf16 => 2f64.powi(-8),
    }
}

impl Buffers {
    pub fn new(ranks: &Ranks, bytes: usize, dtype: DType, seed: u64) -> Result<Buffers> {
        let count = (bytes / dtype.size_bytes()).max(1);
        let mut inputs = Vec::new();
        let mut outputs = Vec::new();
        let mut host_inputs = Vec::new();
        for (r, ctx) in ranks.contexts.iter().enumerate() {
            let (raw, values) = random_bits(dtype, count, seed ^ (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let input = DeviceMemory::alloc(ctx, raw.len())?;
            driver::memcpy_htod(input.ptr(), &raw)?;
            let output = DeviceMemory::alloc(ctx, raw.len())?;
            inputs.push(input);
            outputs.push(output);
            host_inputs.push(values);
        }
        Ok(Buffers { count, dtype, inputs, outputs, host_inputs })
    }

    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size_bytes()
    }

    /// Poisons every output (0x7F bytes: huge or NaN, never a valid sum).
    pub fn poison(&self, ranks: &Ranks) -> Result<()> {
        for (r, o) in self.outputs.iter().enumerate() {
            driver::bind(&ranks.contexts[r])?;
            driver::memset_d8(o.ptr(), 0x7F, self.bytes())?;
        }
        Ok(())
    }

    /// Checks every rank's output against the f64 sum (with `roundings`
    /// roundings to the element type allowed).
    pub fn verify(&self, ranks: &Ranks, roundings: usize, what: &str) -> Result<()> {
        let world = self.inputs.len();
        let u = unit_roundoff(self.dtype);
        for (r, o) in self.outputs.iter().enumerate() {
            driver::bind(&ranks.contexts[r])?;
            let mut raw = vec![0u8; self.bytes()];
            driver::memcpy_dtoh(&mut raw, o.ptr())?;
            let got = decode(self.dtype, &raw);
            for i in 0..self.count {
                let mut exact = 0.0;
                let mut mag = 0.0;
                for h in &self.host_inputs {
                    exact += h[i];
                    mag += h[i].abs();
                }
                let tol = roundings as f64 * u * mag * 1.001 + world as f64 * 6e-8 * mag + 1e-30;
                if (got[i] - exact).abs().is_nan() || (got[i] - exact).abs() > tol {
                    return Err(Error::InvalidUsage(format!(
                        "benchmark correctness check failed for {what}: rank {r} element {i} is {} but the sum is {exact}",
                        got[i]
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Something that can allreduce rank r's buffers on its stream.
pub trait Collective: Sync {
    fn world(&self) -> usize;
    /// # Safety
    /// Pointers are device buffers of `count` elements on rank r's context.
    unsafe fn all_reduce(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()>;
    /// One allreduce on every rank (NCCL wraps them in one group call).
    fn issue_all(&self, ranks: &Ranks, bufs: &Buffers) -> Result<()> {
        for r in 0..self.world() {
            driver::bind(&ranks.contexts[r])?;
            // SAFETY: the buffers hold `count` elements on rank r's context.
            unsafe {
                self.all_reduce(
                    r,
                    bufs.inputs[r].ptr(),
                    bufs.outputs[r].ptr(),
                    bufs.count,
                    bufs.dtype,
                    ranks.streams[r].cu_stream(),
                )?
            };
        }
        Ok(())
    }
    /// Whether per-rank graph capture works (not for single-thread NCCL
    /// over several GPUs, which needs one group call across ranks).
    fn capturable_per_rank(&self) -> bool {
        true
    }
    /// Collective post-capture step (register captured buffers).
    fn after_capture(&self) -> Result<()> {
        Ok(())
    }
    /// Collective step before the benchmark frees buffers it registered.
    fn release_buffers(&self) -> Result<()> {
        Ok(())
    }
    /// Checks for asynchronous errors after synchronisation.
    fn check(&self) -> Result<()> {
        Ok(())
    }
    fn describe(&self, bytes: usize, dtype: DType) -> String;
    fn roundings(&self, bytes: usize, dtype: DType) -> usize;
}

pub struct OurGroup<'a> {
    pub comms: &'a [Comm],
}

impl Collective for OurGroup<'_> {
    fn world(&self) -> usize {
        self.comms.len()
    }
    unsafe fn all_reduce(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.comms[rank].all_reduce_raw(send, recv, count, dtype, stream)
    }
    fn after_capture(&self) -> Result<()> {
        Comm::register_graph_buffers_group(self.comms).map(|_| ())
    }
    fn release_buffers(&self) -> Result<()> {
        Comm::deregister_buffers_group(self.comms).map(|_| ())
    }
    fn check(&self) -> Result<()> {
        self.comms.iter().try_for_each(|c| c.check())
    }
    fn describe(&self, bytes: usize, dtype: DType) -> String {
        self.comms[0].plan_call(bytes, dtype, true, false).algorithm.name().to_string()
    }
    fn roundings(&self, bytes: usize, dtype: DType) -> usize {
        self.comms[0].plan_call(bytes, dtype, true, false).algorithm.max_roundings(self.comms.len())
    }
}

pub struct NcclGroup<'a> {
    pub comms: &'a [NcclComm],
}

impl Collective for NcclGroup<'_> {
    fn world(&self) -> usize {
        self.comms.len()
    }
    unsafe fn all_reduce(
        &self,
        rank: usize,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.comms[rank].all_reduce(send, recv, count, dtype, stream)
    }
    fn issue_all(&self, ranks: &Ranks, bufs: &Buffers) -> Result<()> {
        // One thread drives every rank: NCCL needs them in one group call.
        cudarc::nccl::result::group_start().map_err(|e| Error::Nccl(format!("ncclGroupStart: {:?}", e.0)))?;
        let mut result = Ok(());
        for r in 0..self.world() {
            if let Err(e) = driver::bind(&ranks.contexts[r]) {
                result = Err(e);
                break;
            }
            // SAFETY: the buffers hold `count` elements on rank r's context.
            result = unsafe {
                self.all_reduce(
                    r,
                    bufs.inputs[r].ptr(),
                    bufs.outputs[r].ptr(),
                    bufs.count,
                    bufs.dtype,
                    ranks.streams[r].cu_stream(),
                )
            };
            if result.is_err() {
                break;
            }
        }
        cudarc::nccl::result::group_end().map_err(|e| Error::Nccl(format!("ncclGroupEnd: {:?}", e.0)))?;
        result
    }
    fn capturable_per_rank(&self) -> bool {
        self.comms.len() == 1
    }
    fn describe(&self, _: usize, _: DType) -> String {
        "nccl".into()
    }
    fn roundings(&self, _: usize, _: DType) -> usize {
        self.comms.len()
    }
}

fn event(ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| crate::error::driver("cuEventCreate", e))
}

fn sync_all(c: &dyn Collective, ranks: &Ranks) -> Result<()> {
    for (r, s) in ranks.streams.iter().enumerate() {
        driver::bind(&ranks.contexts[r])?;
        let synced = driver::synchronize(s);
        c.check()?;
        synced?;
    }
    Ok(())
}

/// Captures `body(rank, stream)` on every rank's stream into one graph per
/// rank (thread-local capture mode).
fn capture_per_rank(ranks: &Ranks, mut body: impl FnMut(usize, &CudaStream) -> Result<()>) -> Result<Vec<CudaGraph>> {
    let mut graphs = Vec::with_capacity(ranks.world());
    for (r, s) in ranks.streams.iter().enumerate() {
        graphs.push(driver::capture(s, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, || body(r, s))?);
    }
    Ok(graphs)
}

/// Replays every rank's graph `warmup + repeats` times; each sample is the
/// slowest rank's start-to-end time (microseconds) of one replay.
fn time_graph_replays(
    graphs: &[CudaGraph],
    ranks: &Ranks,
    warmup: usize,
    repeats: usize,
    mut sync: impl FnMut() -> Result<()>,
) -> Result<Vec<f64>> {
    let starts: Vec<CudaEvent> = ranks.contexts.iter().map(event).collect::<Result<_>>()?;
    let ends: Vec<CudaEvent> = ranks.contexts.iter().map(event).collect::<Result<_>>()?;
    let mut samples = Vec::with_capacity(repeats);
    for i in 0..warmup + repeats {
        for ((g, s), (start, end)) in graphs.iter().zip(&ranks.streams).zip(starts.iter().zip(&ends)) {
            start.record(s).map_err(|e| crate::error::driver("cuEventRecord", e))?;
            g.launch().map_err(|e| crate::error::driver("cuGraphLaunch", e))?;
            end.record(s).map_err(|e| crate::error::driver("cuEventRecord", e))?;
        }
        sync()?;
        if i >= warmup {
            samples.push(span_us(&starts, &ends)?);
        }
    }
    Ok(samples)
}

/// Verifies, then times `c` on `bufs`; returns per-allreduce microseconds
/// (one sample per timed repeat).
pub fn time_collective(c: &dyn Collective, ranks: &Ranks, bufs: &Buffers, opts: &Options) -> Result<Vec<f64>> {
    let what = c.describe(bufs.bytes(), bufs.dtype);
    bufs.poison(ranks)?;
    c.issue_all(ranks, bufs)?;
    sync_all(c, ranks)?;
    bufs.verify(ranks, c.roundings(bufs.bytes(), bufs.dtype), &what)?;

    let mut samples = Vec::with_capacity(opts.repeats);
    let mode = if opts.mode == Mode::Graph && !c.capturable_per_rank() { Mode::Eager } else { opts.mode };
    match mode {
        Mode::Graph => {
            let graphs = capture_per_rank(ranks, |r, s| {
                for _ in 0..opts.iterations {
                    // SAFETY: as in issue_all.
                    unsafe {
                        c.all_reduce(
                            r,
                            bufs.inputs[r].ptr(),
                            bufs.outputs[r].ptr(),
                            bufs.count,
                            bufs.dtype,
                            s.cu_stream(),
                        )?
                    };
                }
                Ok(())
            })?;
            c.after_capture()?;
            for g in &graphs {
                g.upload().map_err(|e| crate::error::driver("cuGraphUpload", e))?;
            }
            let replays = time_graph_replays(&graphs, ranks, opts.warmup, opts.repeats, || sync_all(c, ranks))?;
            samples.extend(replays.into_iter().map(|us| us / opts.iterations as f64));
            // The replays ran on the same buffers: check the result again.
            bufs.verify(ranks, c.roundings(bufs.bytes(), bufs.dtype), &what)?;
            // The buffers are freed after this size's rows.
            c.release_buffers()?;
        }
        Mode::Eager => {
            let starts: Vec<CudaEvent> = ranks.contexts.iter().map(event).collect::<Result<_>>()?;
            let ends: Vec<CudaEvent> = ranks.contexts.iter().map(event).collect::<Result<_>>()?;
            for i in 0..opts.warmup + opts.repeats {
                for (start, stream) in starts.iter().zip(&ranks.streams) {
                    start.record(stream).map_err(|e| crate::error::driver("cuEventRecord", e))?;
                }
                for _ in 0..opts.iterations {
                    c.issue_all(ranks, bufs)?;
                }
                for (end, stream) in ends.iter().zip(&ranks.streams) {
                    end.record(stream).map_err(|e| crate::error::driver("cuEventRecord", e))?;
                }
                sync_all(c, ranks)?;
                if i >= opts.warmup {
                    samples.push(span_us(&starts, &ends)? / opts.iterations as f64);
                }
            }
        }
    }
    Ok(samples)
}

/// The collective's span: the slowest rank's start-to-end time.
fn span_us(starts: &[CudaEvent], ends: &[CudaEvent]) -> Result<f64> {
    let mut worst = 0f64;
    for (s, e) in starts.iter().zip(ends) {
        let ms = s.elapsed_ms(e).map_err(|e| crate::error::driver("cuEventElapsedTime", e))?;
        worst = worst.max(ms as f64 * 1e3);
    }
    Ok(worst)
}

/// Device-to-device copy bandwidth of GPU `ctx`, counting bytes read plus
/// bytes written (GB/s), from a timed `cuMemcpyDtoDAsync` of `bytes`.
pub fn copy_bandwidth_gbs(ctx: &Arc<CudaContext>, bytes: usize) -> Result<f64> {
    let stream = ctx.new_stream().map_err(|e| crate::error::driver("cuStreamCreate", e))?;
    let a = DeviceMemory::alloc_zeroed(ctx, bytes)?;
    let b = DeviceMemory::alloc_zeroed(ctx, bytes)?;
    let (start, end) = (event(ctx)?, event(ctx)?);
    let mut samples = Vec::new();
    for i in 0..12 {
        start.record(&stream).map_err(|e| crate::error::driver("cuEventRecord", e))?;
        // SAFETY: a live stream of `ctx`; both buffers hold `bytes`.
        unsafe { driver::memcpy_dtod_async(b.ptr(), a.ptr(), bytes, stream.cu_stream())? };
        end.record(&stream).map_err(|e| crate::error::driver("cuEventRecord", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| crate::error::driver("cuEventElapsedTime", e))? as f64;
        if i >= 2 {
            samples.push(2.0 * bytes as f64 / (ms * 1e-3) / 1e9);
        }
    }
    Ok(percentiles(&mut samples).0)
}

/// Device-memory traffic of one allreduce, all ranks together, when every
/// rank is on the same GPU (every "peer" access is local HBM): what the
/// single-GPU large-message figure is normalised by.
pub fn local_traffic_bytes(algorithm: Algorithm, world: usize, bytes: usize) -> f64 {
    let n = world as f64;
    let s = bytes as f64;
    let per_rank = match algorithm {
        // read every rank's input, write the output
        Algorithm::OneShotPull => (n + 1.0) * s,
        // scatter: read S, write S/N; gather: read S, write S
        Algorithm::TwoShotPull => 3.0 * s + s / n,
        // push: read S, write N*S; poll-read N*S, write S (+ re-arm N*S)
        Algorithm::OneShotPush => 2.0 * s + 3.0 * n * s,
        // scatter r/w S; reduce read S, write S; gather read/write (N-1)/N S
        Algorithm::TwoShotPush | Algorithm::Hierarchical | Algorithm::Ring | Algorithm::Nccl => 6.0 * s,
    };
    per_rank * n
}

/// A group of our communicators over `ranks`.
pub fn our_group(ranks: &Ranks, config: &Config) -> Result<Vec<Comm>> {
    Comm::from_streams(ranks.streams.clone(), config.clone())
}

/// NCCL communicators over `ranks` (distinct GPUs only), or why not.
pub fn nccl_group(ranks: &Ranks) -> std::result::Result<Vec<NcclComm>, String> {
    if !ranks.nccl_possible() {
        return Err("NCCL cannot place two ranks on one GPU".into());
    }
    if !crate::nccl::available() {
        return Err("libnccl not found (cudarc loads libnccl.so from LD_LIBRARY_PATH)".into());
    }
    NcclComm::init_all(&ranks.ordinals).map_err(|e| e.to_string())
}

/// Sleeps briefly between configurations so clocks/thermals settle a bit.
pub fn settle() {
    std::thread::sleep(Duration::from_millis(5));
}

/// Date and time in UTC as `YYYY-MM-DDTHH:MM:SSZ` (no date crate needed).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil-from-days (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, (rem / 60) % 60, rem % 60)
}

pub(crate) fn driver_version() -> String {
    let mut v: i32 = 0;
    match driver::cu!(cuDriverGetVersion(&mut v)) {
        Ok(()) => format!("CUDA {}.{}", v / 1000, (v % 1000) / 10),
        Err(_) => "unknown".into(),
    }
}

/// Progress on stderr: one overwritten line.
pub struct Progress {
    total: usize,
    done: usize,
    enabled: bool,
}

impl Progress {
    pub fn new(total: usize) -> Progress {
        use std::io::IsTerminal;
        Progress { total, done: 0, enabled: std::io::stderr().is_terminal() }
    }
    pub fn step(&mut self, what: &str) {
        self.done += 1;
        if self.enabled {
            let width = 30;
            let filled = width * self.done / self.total.max(1);
            eprint!(
                "\r[{}{}] {}/{} {:<40}",
                "#".repeat(filled),
                " ".repeat(width - filled),
                self.done,
                self.total,
                what
            );
        } else {
            eprintln!("[{}/{}] {}", self.done, self.total, what);
        }
    }
    pub fn finish(&self) {
        if self.enabled {
            eprintln!();
        }
    }
}

/// Extra scenarios of a run.
#[derive(Clone, Debug, Default)]
pub struct Scenarios {
    /// 122 x 42 KB bf16 allreduces with a dependent kernel, one graph.
    pub verify_pass: bool,
    /// 2 ranks on one GPU, 64 MiB f32: fraction of copy bandwidth.
    pub efficiency: bool,
    /// Time of one tiny kernel per rank per graph step (launch floor).
    pub launch_floor: bool,
}

/// Runs the whole benchmark and returns the report.
pub fn run(opts: &Options, scenarios: &Scenarios, command_line: &str) -> Result<report::Report> {
    let ranks = Ranks::new(&opts.gpus, opts.ranks_per_gpu)?;
    let world = ranks.world();
    let mut comms = our_group(&ranks, &opts.config)?;
    let topology_fingerprint = comms[0].topology().fingerprint();
    let mut notes: Vec<String> = comms[0].notes().to_vec();
    notes.push(format!("auto selects (graph): {}", comms[0].selection().describe(opts.dtype, true)));
    let nccl = if opts.include_nccl {
        match nccl_group(&ranks) {
            Ok(n) => Some(n),
            Err(why) => {
                notes.push(format!("NCCL column absent: {why}"));
                None
            }
        }
    } else {
        None
    };
    if let Some(n) = &nccl {
        if n.len() > 1 && opts.mode == Mode::Graph {
            notes.push("NCCL over several GPUs from one thread cannot be captured per rank: its rows are eager".into());
        }
    }
    let mut selections = Vec::new();
    for sel in &opts.selections {
        match sel {
            Selection::Forced(a) if *a == Algorithm::Nccl => {}
            Selection::Forced(a) => match comms[0].set_algorithm(Some(*a)) {
                Ok(()) => selections.push(*sel),
                Err(e) => notes.push(format!("{a} skipped: {e}")),
            },
            Selection::Auto => selections.push(*sel),
        }
    }
    let total = opts.sizes.len() * (selections.len() + nccl.is_some() as usize)
        + if scenarios.verify_pass { 2 } else { 0 }
        + if scenarios.efficiency { 3 } else { 0 }
        + scenarios.launch_floor as usize;
    let mut progress = Progress::new(total);
    let mut measurements = Vec::new();
    for (i, &bytes) in opts.sizes.iter().enumerate() {
        let bufs = Buffers::new(&ranks, bytes, opts.dtype, 0x5EED ^ (i as u64) << 20)?;
        let mut rows = Vec::new();
        for sel in &selections {
            let forced = match sel {
                Selection::Auto => None,
                Selection::Forced(a) => Some(*a),
            };
            for c in comms.iter_mut() {
                c.set_algorithm(forced)?;
            }
            progress.step(&format!("{} {}", report::human_bytes(bytes), sel.name()));
            let group = OurGroup { comms: &comms };
            let ran = group.describe(bufs.bytes(), opts.dtype);
            let mut samples = time_collective(&group, &ranks, &bufs, opts)?;
            rows.push(measurement((bufs.bytes(), bufs.dtype), &sel.name(), &ran, world, opts, &mut samples));
            settle();
        }
        if let Some(n) = &nccl {
            progress.step(&format!("{} nccl", report::human_bytes(bytes)));
            let group = NcclGroup { comms: n };
            let mut o = opts.clone();
            if !group.capturable_per_rank() {
                o.mode = Mode::Eager;
            }
            let mut samples = time_collective(&group, &ranks, &bufs, &o)?;
            let nccl_row = measurement((bufs.bytes(), bufs.dtype), "nccl", "nccl", world, &o, &mut samples);
            for r in rows.iter_mut() {
                r.speedup_vs_nccl = Some(nccl_row.median_us / r.median_us);
            }
            rows.push(nccl_row);
        }
        measurements.extend(rows);
    }
    for c in comms.iter_mut() {
        c.set_algorithm(None)?;
    }
    let mut verify = Vec::new();
    if scenarios.verify_pass {
        progress.step("verify pass (auto)");
        verify.push(verify_pass(&OurGroup { comms: &comms }, &ranks, "auto")?);
        if let Some(n) = &nccl {
            progress.step("verify pass (nccl)");
            let g = NcclGroup { comms: n };
            if g.capturable_per_rank() {
                verify.push(verify_pass(&g, &ranks, "nccl")?);
            } else {
                notes.push("verify pass: NCCL over several GPUs from one thread is not captured; use the multi-process launcher".into());
            }
        }
    }
    drop(comms);
    let launch_floor_us = if scenarios.launch_floor {
        progress.step("launch floor");
        Some(launch_floor(&ranks)?)
    } else {
        None
    };
    let mut efficiency = Vec::new();
    if scenarios.efficiency {
        efficiency = large_message_efficiency(&opts.gpus, &opts.config, &mut progress)?;
    }
    progress.finish();
    let ctx = &ranks.contexts[0];
    Ok(report::Report {
        tool: "tp-allreduce bench".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        command_line: command_line.into(),
        date_utc: utc_now(),
        gpu_model: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
        driver: driver_version(),
        nccl: crate::nccl::version(),
        topology_fingerprint,
        world,
        ranks_per_gpu: opts.ranks_per_gpu,
        mode: format!("{:?}", opts.mode).to_lowercase(),
        iterations: opts.iterations,
        repeats: opts.repeats,
        notes,
        measurements,
        verify_pass: verify,
        efficiency,
        launch_floor_us,
    })
}

/// Per-step time of graphs of tiny dependent kernels replayed on every
/// rank's stream at once: the floor any one-kernel allreduce sits on when
/// these ranks share the GPU(s).
pub fn launch_floor(ranks: &Ranks) -> Result<f64> {
    const STEPS: usize = 200;
    let bufs: Vec<DeviceMemory> =
        ranks.contexts.iter().map(|c| DeviceMemory::alloc_zeroed(c, 64)).collect::<Result<_>>()?;
    let graphs = capture_per_rank(ranks, |r, s| {
        for _ in 0..STEPS {
            // SAFETY: 16 f32 in place in a 64-byte buffer.
            unsafe {
                crate::tools::elementwise::affine_raw(
                    &ranks.contexts[r],
                    s.cu_stream(),
                    bufs[r].ptr(),
                    bufs[r].ptr(),
                    16,
                    DType::F32,
                    1.0,
                    0.0,
                )?
            };
        }
        Ok(())
    })?;
    let sync = || ranks.streams.iter().try_for_each(|s| driver::synchronize(s));
    let mut samples: Vec<f64> =
        time_graph_replays(&graphs, ranks, 3, 10, sync)?.into_iter().map(|us| us / STEPS as f64).collect();
    Ok(percentiles(&mut samples).0)
}

/// One table row from per-allreduce samples (microseconds) of a message of
/// `bytes` bytes of `dtype`.
pub(crate) fn measurement(
    (bytes, dtype): (usize, DType),
    selection: &str,
    ran: &str,
    world: usize,
    opts: &Options,
    samples: &mut [f64],
) -> Measurement {
    let (median, p10, p90) = percentiles(samples);
    let algbw = bytes as f64 / (median * 1e-6) / 1e9;
    Measurement {
        bytes,
        dtype: dtype.name().into(),
        selection: selection.into(),
        algorithm: ran.into(),
        world,
        mode: format!("{:?}", opts.mode).to_lowercase(),
        median_us: median,
        p10_us: p10,
        p90_us: p90,
        algbw_gbs: algbw,
        busbw_gbs: busbw(algbw, world),
        speedup_vs_nccl: None,
    }
}

/// The motivating workload: 122 allreduces of 42 KB bf16, each followed by
/// a small dependent elementwise kernel, captured into one graph per rank.
pub fn verify_pass(c: &dyn Collective, ranks: &Ranks, selection: &str) -> Result<report::VerifyPass> {
    const ALLREDUCES: usize = 122;
    const BYTES: usize = 43_008;
    let dtype = DType::Bf16;
    let count = BYTES / 2;
    let world = c.world();
    let bufs = Buffers::new(ranks, BYTES, dtype, 0xF00D)?;
    // Correctness of one call first.
    bufs.poison(ranks)?;
    c.issue_all(ranks, &bufs)?;
    sync_all(c, ranks)?;
    bufs.verify(ranks, c.roundings(BYTES, dtype), "verify pass")?;
    let graphs = capture_per_rank(ranks, |r, s| {
        for _ in 0..ALLREDUCES {
            // in -> out (allreduce), out -> in (dependent layer: x/world).
            // SAFETY: both buffers hold `count` bf16 on rank r's context.
            unsafe {
                c.all_reduce(r, bufs.inputs[r].ptr(), bufs.outputs[r].ptr(), count, dtype, s.cu_stream())?;
                crate::tools::elementwise::affine_raw(
                    &ranks.contexts[r],
                    s.cu_stream(),
                    bufs.outputs[r].ptr(),
                    bufs.inputs[r].ptr(),
                    count,
                    dtype,
                    1.0 / world as f32,
                    0.0,
                )?;
            }
        }
        Ok(())
    })?;
    c.after_capture()?;
    let mut samples: Vec<f64> =
        time_graph_replays(&graphs, ranks, 3, 20, || sync_all(c, ranks))?.into_iter().map(|us| us / 1e3).collect();
    c.release_buffers()?;
    let (median, p10, p90) = percentiles(&mut samples);
    Ok(report::VerifyPass {
        selection: selection.into(),
        algorithm: c.describe(BYTES, dtype),
        allreduces: ALLREDUCES,
        bytes: BYTES,
        median_ms: median,
        p10_ms: p10,
        p90_ms: p90,
        per_allreduce_us: median * 1e3 / ALLREDUCES as f64,
    })
}

/// 2 ranks on the first GPU, 64 MiB f32: device-memory traffic per second
/// as a fraction of the device-to-device copy bandwidth measured now.
pub fn large_message_efficiency(
    gpus: &[usize],
    config: &Config,
    progress: &mut Progress,
) -> Result<Vec<report::Efficiency>> {
    let bytes = 64 << 20;
    let ranks = Ranks::new(&gpus[..1], 2)?;
    progress.step("copy bandwidth");
    let copy = copy_bandwidth_gbs(&ranks.contexts[0], 1 << 30)?;
    let cfg = Config { pull_max_blocks: 128, max_chunk_bytes: 64 << 20, ..config.clone() };
    let mut comms = our_group(&ranks, &cfg)?;
    let bufs = Buffers::new(&ranks, bytes, DType::F32, 0xB16)?;
    let opts = Options { iterations: 5, repeats: 10, warmup: 2, mode: Mode::Graph, ..Options::default() };
    let mut out = Vec::new();
    for algorithm in [Algorithm::OneShotPull, Algorithm::TwoShotPull] {
        progress.step(&format!("64 MB {algorithm}"));
        for c in comms.iter_mut() {
            c.set_algorithm(Some(algorithm))?;
        }
        let mut samples = time_collective(&OurGroup { comms: &comms }, &ranks, &bufs, &opts)?;
        let (median, _, _) = percentiles(&mut samples);
        let traffic = local_traffic_bytes(algorithm, 2, bytes);
        let achieved = traffic / (median * 1e-6) / 1e9;
        out.push(report::Efficiency {
            algorithm: algorithm.name().into(),
            world: 2,
            bytes,
            median_us: median,
            traffic_bytes: traffic,
            achieved_gbs: achieved,
            copy_gbs: copy,
            fraction_of_copy: achieved / copy,
        });
    }
    Ok(out)
}

/// What `tune` produced.
pub struct TuneOutcome {
    pub table: crate::select::tuning::TuningTable,
    pub path: std::path::PathBuf,
    pub measured: usize,
    pub seconds: f64,
}

/// `tp-allreduce tune`: every applicable algorithm (and NCCL when it can
/// run) per size bucket on this machine, graph replay, medians; writes the
/// tuning table the communicators of this machine and world size load.
pub fn tune(opts: &Options, out: Option<std::path::PathBuf>) -> Result<TuneOutcome> {
    use crate::select::tuning::{Measurement as TuneMeasurement, TuningMeta, TuningTable};
    let started = std::time::Instant::now();
    let ranks = Ranks::new(&opts.gpus, opts.ranks_per_gpu)?;
    let world = ranks.world();
    let mut comms = our_group(&ranks, &opts.config)?;
    let view = comms[0].topology().clone();
    let transport = comms[0].transport();
    let nccl = nccl_group(&ranks).ok();
    let algorithms: Vec<Algorithm> =
        Algorithm::OURS.into_iter().filter(|a| comms[0].set_algorithm(Some(*a)).is_ok()).collect();
    let total = opts.sizes.len() * (algorithms.len() + nccl.is_some() as usize);
    let mut progress = Progress::new(total);
    let mut measurements = Vec::new();
    for (i, &bytes) in opts.sizes.iter().enumerate() {
        let bufs = Buffers::new(&ranks, bytes, opts.dtype, 0x7E57 ^ (i as u64) << 24)?;
        for &a in &algorithms {
            progress.step(&format!("{} {a}", report::human_bytes(bytes)));
            for c in comms.iter_mut() {
                c.set_algorithm(Some(a))?;
            }
            let mut samples = time_collective(&OurGroup { comms: &comms }, &ranks, &bufs, opts)?;
            measurements.push(TuneMeasurement {
                bucket_bytes: bytes,
                dtype: opts.dtype,
                algorithm: a,
                transport,
                median_us: percentiles(&mut samples).0,
                shape: None,
            });
        }
        if let Some(n) = &nccl {
            progress.step(&format!("{} nccl", report::human_bytes(bytes)));
            let group = NcclGroup { comms: n };
            let mut o = opts.clone();
            if !group.capturable_per_rank() {
                o.mode = Mode::Eager;
            }
            let mut samples = time_collective(&group, &ranks, &bufs, &o)?;
            measurements.push(TuneMeasurement {
                bucket_bytes: bytes,
                dtype: opts.dtype,
                algorithm: Algorithm::Nccl,
                transport: Transport::PeerToPeer,
                median_us: percentiles(&mut samples).0,
                shape: None,
            });
        }
    }
    progress.finish();
    drop(comms);
    let measured = measurements.len();
    let meta = TuningMeta::for_topology(&view, format!("tp-allreduce tune {}", env!("CARGO_PKG_VERSION")));
    let table = TuningTable::from_measurements(meta, measurements)?;
    let path = match out {
        Some(p) => p,
        None => crate::env::tuning_file(&view.fingerprint(), world).ok_or_else(|| {
            Error::Config("no place for the tuning table: set TP_ALLREDUCE_TUNING_FILE or HOME".into())
        })?,
    };
    table.save(&path)?;
    Ok(TuneOutcome { table, path, measured, seconds: started.elapsed().as_secs_f64() })
}
