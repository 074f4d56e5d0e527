//! Shared test helpers: GPU gating, fresh random inputs, the f64 CPU
//! reference, poisoning, tolerances, and running one allreduce on a group.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tp_allreduce::{Algorithm, Comm, DType, Element};

/// Serialises GPU tests: the residency limits assume one group per device
/// at a time, and concurrent groups could starve each other's barriers.
/// Prints `skipped: <why>` (`why` ends with the test's name in
/// parentheses; `.ci/count-skips` counts them) to the stderr handle
/// directly: libtest's capture only intercepts the print macros, and a skip
/// must be visible. One `write_all` of the whole line, so that concurrent
/// output cannot split it (`writeln!` writes its pieces separately).
/// The repository (this suite belongs to the `cli/` package).
pub fn repo() -> &'static std::path::Path {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest)
}

pub fn skipped(why: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("skipped: {why}\n").as_bytes());
}

pub fn gpu_lock() -> MutexGuard<'static, ()> {
    static LOCK: OnceLock<Mutex<()>> = OnceLock::new();
    LOCK.get_or_init(|| Mutex::new(())).lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether this machine is expected to run the GPU tests
/// (`TP_ALLREDUCE_REQUIRE_GPU=1`): then a test that cannot run what it
/// checks fails instead of skipping.
pub fn gpu_required() -> bool {
    std::env::var("TP_ALLREDUCE_REQUIRE_GPU").as_deref() == Ok("1")
}

/// A skip for want of something a GPU machine is expected to have (a
/// GPU, working P2P): visible, and a failure where `gpu_required`.
pub fn skipped_unless_required(why: &str) {
    if gpu_required() {
        panic!("{why}, but TP_ALLREDUCE_REQUIRE_GPU=1");
    }
    skipped(why);
}

/// GPUs the tests must see (`TP_ALLREDUCE_REQUIRE_GPUS`, 0 when unset). A
/// value that is not a number fails the test rather than reading as 0.
pub fn required_gpus(test: &str) -> usize {
    match std::env::var("TP_ALLREDUCE_REQUIRE_GPUS") {
        Err(_) => 0,
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{test}: TP_ALLREDUCE_REQUIRE_GPUS={v:?} is not a number of GPUs")),
    }
}

/// The second GPU's context, or `None` after a visible skip line
/// (`TP_ALLREDUCE_REQUIRE_GPUS=2` turns the skip into a failure).
pub fn second_gpu(test: &str) -> Option<Arc<CudaContext>> {
    let required = required_gpus(test);
    if tp_allreduce::driver::device_count() < 2 {
        assert!(required < 2, "{test}: fewer than two GPUs visible, but TP_ALLREDUCE_REQUIRE_GPUS={required}");
        skipped(&format!("needs 2 GPUs ({test})"));
        return None;
    }
    let ctx = CudaContext::new(1).expect("CudaContext::new(1)");
    // SAFETY: as for device 0 (`gpu`): work is ordered explicitly per stream.
    unsafe { ctx.disable_event_tracking() };
    Some(ctx)
}

/// The CUDA context of device 0, or `None` after printing a visible skip
/// line. With `TP_ALLREDUCE_REQUIRE_GPU=1` a missing GPU fails the test.
pub fn gpu(test: &str) -> Option<Arc<CudaContext>> {
    // Ranks of one process share a GPU through separate streams; give every
    // stream its own hardware queue so no rank's kernel queues behind
    // another's spinning barrier. Must be set before the first context.
    static SET: OnceLock<()> = OnceLock::new();
    SET.get_or_init(|| {
        if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
            std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32");
        }
        // Measured `auto` costs seconds per communicator: off for every
        // test whose subject it is not (gpu_measured_auto turns it on
        // through `Config`); children started by tests inherit it.
        if std::env::var_os(tp_allreduce::env::AUTO_MEASURE).is_none() {
            std::env::set_var(tp_allreduce::env::AUTO_MEASURE, "off");
        }
    });
    if tp_allreduce::driver::device_count() == 0 {
        skipped_unless_required(&format!("no CUDA device ({test})"));
        return None;
    }
    let ctx = CudaContext::new(0).expect("CudaContext::new(0)");
    // Tests order work explicitly on each rank's stream (and capture graphs).
    // SAFETY: no cudarc buffers are shared across streams without explicit
    // stream-ordered use in these tests.
    unsafe { ctx.disable_event_tracking() };
    Some(ctx)
}

/// A fresh RNG per test run; the seed is printed so a failure can be
/// replayed with `TP_ALLREDUCE_TEST_SEED`.
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("TP_ALLREDUCE_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// Element types under test, with their f64 conversions and unit roundoff.
pub trait TestElem:
    Element + cudarc::driver::ValidAsZeroBits + Copy + Default + Send + Sync + std::fmt::Debug + 'static
{
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn to_bits32(self) -> u32;
    /// Unit roundoff of the type (half an ulp at 1.0).
    const UNIT_ROUNDOFF: f64;
}

impl TestElem for f32 {
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn to_bits32(self) -> u32 {
        self.to_bits()
    }
    const UNIT_ROUNDOFF: f64 = 5.960_464_477_539_063e-8; // 2^-24
}

impl TestElem for f16 {
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn to_bits32(self) -> u32 {
        self.to_bits() as u32
    }
    const UNIT_ROUNDOFF: f64 = 4.882_812_5e-4; // 2^-11
}

impl TestElem for bf16 {
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn to_bits32(self) -> u32 {
        self.to_bits() as u32
    }
    const UNIT_ROUNDOFF: f64 = 3.906_25e-3; // 2^-8
}

/// `n` fresh random values in [-1, 1), never exactly zero-filled.
pub fn random_vec<T: TestElem>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::from_f64(rng.gen_range(-1.0..1.0))).collect()
}

/// The byte every output is poisoned with before a run: 0x7F7F7F7F is
/// 3.4e38 in f32, 3.4e38 in bf16 and NaN in f16 — never a valid result here.
pub const POISON: u8 = 0x7F;

/// Checks `out` against the f64 sum of `inputs`, allowing `roundings`
/// roundings to `T` of partial sums (plus f32 accumulation error).
/// Returns a description of the first mismatches.
pub fn check_sum<T: TestElem>(inputs: &[Vec<T>], out: &[T], roundings: usize) -> Result<(), String> {
    let n = out.len();
    let world = inputs.len() as f64;
    let mut bad = Vec::new();
    let mut bad_count = 0usize;
    for i in 0..n {
        let mut exact = 0f64;
        let mut magnitude = 0f64;
        for input in inputs {
            let v = input[i].to_f64();
            exact += v;
            magnitude += v.abs();
        }
        let got = out[i].to_f64();
        let tol = roundings as f64 * T::UNIT_ROUNDOFF * magnitude * 1.001 + world * 6.0e-8 * magnitude + 1e-30;
        let ok = got.is_finite() == exact.is_finite() && (got - exact).abs() <= tol;
        if !ok {
            bad_count += 1;
            if bad.len() < 5 {
                bad.push(format!("[{i}] got {got:e} want {exact:e} (tol {tol:e})"));
            }
        }
    }
    if bad_count == 0 {
        Ok(())
    } else {
        Err(format!("{bad_count}/{n} elements wrong: {}", bad.join(", ")))
    }
}

/// Raw bits of a slice, to compare ranks bitwise.
pub fn bits<T: TestElem>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits32()).collect()
}

/// `world` streams on `ctx`, one per rank.
pub fn streams(ctx: &Arc<CudaContext>, world: usize) -> Vec<Arc<CudaStream>> {
    (0..world).map(|_| ctx.new_stream().expect("new_stream")).collect()
}

/// Byte offset of element `offset` of `buf` (for misaligned views).
pub fn ptr_of<T: TestElem>(stream: &CudaStream, buf: &CudaSlice<T>, offset: usize) -> u64 {
    let (p, _g) = buf.device_ptr(stream);
    p + (offset * std::mem::size_of::<T>()) as u64
}

/// How one allreduce case is run.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub algorithm: Algorithm,
    pub count: usize,
    /// Element offset of the input/output views (0 = 16-byte aligned).
    pub offset: usize,
    pub in_place: bool,
}

/// Runs one allreduce of fresh random inputs on every rank of `comms`
/// (in-process group) and checks every rank's output against the f64
/// reference and against each other, bitwise.
pub fn run_case<T: TestElem>(comms: &[Comm], rng: &mut StdRng, case: Case) -> Result<(), String> {
    let world = comms.len();
    let n = case.count;
    let inputs: Vec<Vec<T>> = (0..world).map(|_| random_vec::<T>(rng, n)).collect();
    let mut ins = Vec::with_capacity(world);
    let mut outs = Vec::with_capacity(world);
    for (r, c) in comms.iter().enumerate() {
        let s = c.stream();
        let mut host = vec![T::default(); case.offset];
        host.extend_from_slice(&inputs[r]);
        let input = s.clone_htod(&host).map_err(|e| format!("htod: {e:?}"))?;
        // SAFETY: poisoned below before any read.
        let output = unsafe { s.alloc::<T>(n + case.offset) }.map_err(|e| format!("alloc: {e:?}"))?;
        ins.push(input);
        outs.push(output);
    }
    for (r, c) in comms.iter().enumerate() {
        let s = c.stream();
        let dst = if case.in_place { &ins[r] } else { &outs[r] };
        let base = ptr_of(&s, dst, 0);
        if !case.in_place {
            // Poison the whole output (the offset prefix too: it must stay poisoned).
            // SAFETY: a live stream; the buffer holds n + offset elements.
            unsafe {
                tp_allreduce::driver::memset_d8_async(
                    base,
                    POISON,
                    (n + case.offset) * std::mem::size_of::<T>(),
                    s.cu_stream(),
                )
            }
            .map_err(|e| e.to_string())?;
        }
    }
    for (r, c) in comms.iter().enumerate() {
        let s = c.stream();
        let src = ptr_of(&s, &ins[r], case.offset);
        let dst = if case.in_place { src } else { ptr_of(&s, &outs[r], case.offset) };
        // SAFETY: both views are inside live buffers of n + offset elements.
        unsafe { c.all_reduce_raw(src, dst, n, T::DTYPE, s.cu_stream()) }
            .map_err(|e| format!("rank {r}: all_reduce: {e}"))?;
    }
    let mut results: Vec<Vec<T>> = Vec::with_capacity(world);
    for (r, c) in comms.iter().enumerate() {
        c.synchronize().map_err(|e| format!("rank {r}: {e}"))?;
        let s = c.stream();
        let buf = if case.in_place { &ins[r] } else { &outs[r] };
        let host = s.clone_dtoh(buf).map_err(|e| format!("dtoh: {e:?}"))?;
        if !case.in_place {
            let prefix_ok = host[..case.offset].iter().all(|x| x.to_bits32() == poison_bits::<T>());
            if !prefix_ok {
                return Err(format!("rank {r}: wrote before the output view"));
            }
        }
        results.push(host[case.offset..].to_vec());
    }
    let roundings = case.algorithm.max_roundings(world);
    for (r, out) in results.iter().enumerate() {
        check_sum(&inputs, out, roundings).map_err(|e| format!("rank {r}: {e}"))?;
    }
    let first = bits(&results[0]);
    for (r, out) in results.iter().enumerate().skip(1) {
        if bits(out) != first {
            return Err(format!("rank {r} differs bitwise from rank 0"));
        }
    }
    Ok(())
}

pub fn poison_bits<T: TestElem>() -> u32 {
    match std::mem::size_of::<T>() {
        4 => 0x7F7F_7F7F,
        _ => 0x7F7F,
    }
}

/// Element counts that cover 1 element to 8 MiB: odd counts, sizes that are
/// not multiples of 16 bytes, the 42 KB verify-pass message.
pub fn sizes_for(dtype: DType, max_bytes: usize) -> Vec<usize> {
    let elem = dtype.size_bytes();
    let bytes = [
        2usize, 4, 6, 14, 16, 18, 30, 34, 62, 130, 1_000, 4_094, 4_096, 16_386, 43_008, 65_538, 262_142, 1_048_578,
        4_194_306, 8_388_608,
    ];
    let mut counts: Vec<usize> = bytes.iter().filter(|&&b| b <= max_bytes).map(|b| (b / elem).max(1)).collect();
    counts.dedup();
    counts
}

/// Waits for child processes (bounded: after `limit` from `started` the
/// ones still running are killed), then returns their outputs and all of
/// their stdout and stderr as one text, also printed to stderr.
pub fn wait_for_children(
    mut children: Vec<std::process::Child>,
    started: std::time::Instant,
    limit: std::time::Duration,
) -> (Vec<std::process::Output>, String) {
    while children.iter_mut().any(|c| c.try_wait().ok().flatten().is_none()) {
        if started.elapsed() > limit {
            children.iter_mut().for_each(|c| drop(c.kill()));
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let outputs: Vec<_> = children.into_iter().map(|c| c.wait_with_output().expect("child output")).collect();
    let text: String = outputs
        .iter()
        .map(|o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
        .collect();
    eprintln!("{text}");
    (outputs, text)
}
