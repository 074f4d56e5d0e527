//! A tensor-parallel, transformer-shaped stack in candle on N GPUs (one
//! process per GPU), run twice per step: once with tp-allreduce's candle
//! ops, once with the cudarc NCCL op engines use today; prints the step time
//! of each and how far the outputs are apart, and exits non-zero when they
//! differ beyond bf16 tolerance.
//!
//! Each layer has two blocks (attention-shaped, MLP-shaped); each block is
//! a column-parallel linear (`hidden -> intermediate / world`), SiLU on the
//! MLP block, a row-parallel linear back to `hidden` (a partial sum on each
//! rank), then the epilogue: allreduce, `residual += sum`, RMSNorm. So a
//! step makes `2 x layers` allreduces of `tokens x hidden` elements (the
//! defaults: 61 layers x 2 of 3 x 7168 bf16 = 42 KB, a speculative-decoding
//! verify pass of a 61-layer model). The weights are random.
//!
//! ```text
//! cargo build --release --no-default-features --features candle --example candle_tp
//! tp-allreduce launch -n 2 --gpus 0,1 -- target/release/examples/candle_tp
//! ```
//! (benches/gpu/candle-gpu.sh does both on the GPU machine.) Options: `--help`.

use std::sync::Arc;
use std::time::Instant;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use candle_core::cuda_backend::cudarc::nccl;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tp_allreduce::candle::{AllReduce, FusedAddRmsNorm};
use tp_allreduce::{Comm, Config, RankEnv};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The options (`--name value`; `--help` lists them).
#[derive(Debug, Clone)]
struct Options {
    /// Transformer layers (two allreduces each).
    layers: usize,
    /// Tokens per step (rows of every allreduce).
    tokens: usize,
    /// Hidden size (columns of every allreduce).
    hidden: usize,
    /// Width of each block's column-parallel output, summed over the ranks.
    intermediate: usize,
    /// Timed steps per variant and mode.
    steps: usize,
    /// Also capture one step per variant in a CUDA graph and time replays.
    graph: bool,
    /// Seed of the weights and inputs.
    seed: u64,
}

const USAGE: &str = "candle_tp: tp-allreduce vs NCCL inside a tensor-parallel candle stack
usage: tp-allreduce launch -n N --gpus 0,1,.. -- candle_tp [options]
  --layers N        transformer layers, two allreduces each (61)
  --tokens N        tokens per step: rows of every allreduce (3)
  --hidden N        hidden size: columns of every allreduce (7168)
  --intermediate N  column-parallel width, summed over the ranks (4096)
  --steps N         timed steps per variant and mode (20)
  --graph BOOL      also capture a step in a CUDA graph and time replays (true)
  --seed N          seed of the weights and inputs (20261130)";

impl Options {
    fn parse(mut args: impl Iterator<Item = String>) -> std::result::Result<Options, String> {
        let mut o =
            Options { layers: 61, tokens: 3, hidden: 7168, intermediate: 4096, steps: 20, graph: true, seed: 20261130 };
        while let Some(flag) = args.next() {
            if flag == "--help" || flag == "-h" {
                return Err(USAGE.into());
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
            let bad = |_| format!("{flag}: invalid value {value:?}\n{USAGE}");
            match flag.as_str() {
                "--layers" => o.layers = value.parse().map_err(bad)?,
                "--tokens" => o.tokens = value.parse().map_err(bad)?,
                "--hidden" => o.hidden = value.parse().map_err(bad)?,
                "--intermediate" => o.intermediate = value.parse().map_err(bad)?,
                "--steps" => o.steps = value.parse().map_err(bad)?,
                "--graph" => o.graph = value.parse().map_err(|_| format!("{flag}: true or false\n{USAGE}"))?,
                "--seed" => o.seed = value.parse().map_err(bad)?,
                _ => return Err(format!("unknown option {flag}\n{USAGE}")),
            }
        }
        if o.layers == 0 || o.tokens == 0 || o.hidden == 0 || o.intermediate == 0 {
            return Err(format!("--layers, --tokens, --hidden and --intermediate must be positive\n{USAGE}"));
        }
        Ok(o)
    }
}

/// The cudarc NCCL allreduce as a candle op, shaped like the ones in
/// candle's `llama_multiprocess` example and mistral.rs: the baseline.
struct NcclAllReduce {
    comm: nccl::Comm,
}

impl NcclAllReduce {
    fn reduce<T: CudaDType + nccl::NcclType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
        &self,
        s: &CudaStorage,
        start: usize,
        count: usize,
    ) -> candle_core::Result<CudaStorage> {
        let device = s.device().clone();
        let src = s.as_cuda_slice::<T>()?.slice(start..start + count);
        // SAFETY: NCCL writes every element before any read.
        let mut dst = unsafe { device.alloc::<T>(count) }?;
        self.comm
            .all_reduce(&src, &mut dst, &nccl::ReduceOp::Sum)
            .map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?;
        Ok(CudaStorage::wrap_cuda_slice(dst, device))
    }
}

impl CustomOp1 for NcclAllReduce {
    fn name(&self) -> &'static str {
        "nccl all_reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("nccl all_reduce needs a CUDA tensor")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("nccl all_reduce needs a contiguous tensor")
        };
        let out = match s.dtype() {
            DType::BF16 => self.reduce::<half::bf16>(s, start, end - start)?,
            DType::F16 => self.reduce::<half::f16>(s, start, end - start)?,
            DType::F32 => self.reduce::<f32>(s, start, end - start)?,
            other => candle_core::bail!("nccl all_reduce: unsupported dtype {other:?}"),
        };
        Ok((out, l.shape().clone()))
    }
}

/// One block's weights on this rank.
struct Block {
    column: Tensor,
    row: Tensor,
    norm: Tensor,
    activation: bool,
}

/// How a block's partial sum becomes the next block's input.
enum Epilogue<'a> {
    /// tp-allreduce's `FusedAddRmsNorm` (one per block, same weights).
    TpAllreduce(&'a [FusedAddRmsNorm]),
    /// The NCCL op, then the same add and RMSNorm written out in candle.
    Nccl(&'a NcclAllReduce),
}

const EPS: f64 = 1e-6;

/// The add and RMSNorm of the NCCL variant: the same candle operations as
/// `FusedAddRmsNorm`, so the two variants differ only in the allreduce.
fn nccl_epilogue(op: &NcclAllReduce, partial: &Tensor, residual: &Tensor, norm: &Tensor) -> Result<Tensor> {
    let sum = partial.apply_op1_no_bwd(op)?;
    let updated = (residual + &sum)?;
    residual.slice_set(&updated, 0, 0)?;
    let wide = updated.to_dtype(DType::F32)?;
    let inv_rms = (wide.sqr()?.mean_keepdim(D::Minus1)? + EPS)?.sqrt()?.recip()?;
    Ok(wide.broadcast_mul(&inv_rms)?.broadcast_mul(&norm.to_dtype(DType::F32)?)?.to_dtype(partial.dtype())?)
}

/// The buffers a step reads and writes, allocated once (outside any graph).
struct StepBuffers {
    input: Tensor,
    residual: Tensor,
    output: Tensor,
}

/// One step: `residual = input`, then every block; the final normed hidden
/// state goes to `output`. Temporaries are freed before returning, so a
/// captured step leaves no graph allocation behind.
fn step(blocks: &[Block], epilogue: &Epilogue, buffers: &StepBuffers) -> Result<()> {
    buffers.residual.slice_set(&buffers.input, 0, 0)?;
    let mut normed = buffers.input.clone();
    for (i, block) in blocks.iter().enumerate() {
        let mut h = normed.matmul(&block.column)?;
        if block.activation {
            h = h.silu()?;
        }
        let partial = h.matmul(&block.row)?;
        normed = match epilogue {
            Epilogue::TpAllreduce(norms) => norms[i].forward(&partial, &buffers.residual)?,
            Epilogue::Nccl(op) => nccl_epilogue(op, &partial, &buffers.residual, &block.norm)?,
        };
    }
    buffers.output.slice_set(&normed, 0, 0)?;
    Ok(())
}

fn main() {
    let options = match Options::parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(usage) => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    match run(&options) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("candle_tp: {e}");
            std::process::exit(1);
        }
    }
}

/// Returns whether every check passed on this rank.
fn run(options: &Options) -> Result<bool> {
    let Some(env) = RankEnv::from_env()? else {
        return Err("start me with `tp-allreduce launch -n N --gpus 0,1,.. -- <this binary>`".into());
    };
    let (rank, world) = (env.rank, env.world_size);
    if options.intermediate % world != 0 {
        return Err(
            format!("--intermediate {} is not a multiple of the world size {world}", options.intermediate).into()
        );
    }
    let cuda = CudaDevice::new_with_stream(env.device)?;
    // One stream per process: cudarc's cross-stream event tracking is not
    // needed, and a CUDA graph capture requires it off.
    // SAFETY: every tensor of this process lives on this one stream.
    unsafe { cuda.disable_event_tracking() };
    // candle uploads layout parameters of strided kernels from the host; a
    // graph capture needs them cached by an eager run (this thread's ops).
    let _param_cache = cuda.enable_cuda_graph_htod_cache();
    let device = Device::Cuda(cuda.clone());
    let comm = Arc::new(env.comm(cuda.cuda_stream(), Config::from_env()?)?);
    let nccl = NcclAllReduce { comm: nccl_comm(&comm, &cuda)? };

    let checks = single_allreduce_checks(options, &comm, &nccl, &device)?;
    let blocks = make_blocks(options, rank, world, &device)?;
    let norms = blocks
        .iter()
        .map(|b| FusedAddRmsNorm::new(comm.clone(), &b.norm, EPS))
        .collect::<candle_core::Result<Vec<_>>>()?;
    device.set_seed(options.seed)?; // the same input on every rank
    let input = Tensor::randn(0f32, 1.0, (options.tokens, options.hidden), &device)?.to_dtype(DType::BF16)?;
    let buffers = || -> Result<StepBuffers> {
        Ok(StepBuffers { input: input.clone(), residual: input.zeros_like()?, output: input.zeros_like()? })
    };
    let ours = (Epilogue::TpAllreduce(&norms), buffers()?);
    let theirs = (Epilogue::Nccl(&nccl), buffers()?);

    let mut rows = Vec::new();
    for (name, (epilogue, bufs)) in [("tp-allreduce", &ours), ("NCCL (cudarc)", &theirs)] {
        step(&blocks, epilogue, bufs)?; // warm-up: loads candle's kernels, NCCL's first call
        let ms = time_ms(&cuda, options.steps, || step(&blocks, epilogue, bufs))?;
        rows.push((name, "eager", ms));
    }
    let eager_diff = compare(&ours.1, &theirs.1)?;
    let mut graph_diff = None;
    if options.graph {
        match graph_rows(options, &cuda, &comm, &blocks, [&ours, &theirs]) {
            Ok(more) => {
                rows.extend(more);
                graph_diff = Some(compare(&ours.1, &theirs.1)?);
            }
            Err(e) => {
                if rank == 0 {
                    println!("graph mode failed, eager results only: {e}");
                }
            }
        }
    }
    let worst = gather_max(&comm, &rows)?;
    let limit = tolerance(&theirs.1.output)?;
    let ok_stack = eager_diff <= limit && graph_diff.is_none_or(|d| d <= limit);
    if rank == 0 {
        println!(
            "candle_tp: world {world}, {} layers x 2 allreduces of {} x {} bf16 ({} KB), intermediate {} ({} per rank)",
            options.layers,
            options.tokens,
            options.hidden,
            options.tokens * options.hidden * 2 / 1024,
            options.intermediate,
            options.intermediate / world
        );
        println!("single allreduce vs f64 reference (max |err| / bound): {checks}");
        println!("| allreduce | mode | step ms (max over ranks) | us per block (2 linears + epilogue) | max abs diff vs NCCL |");
        println!("|---|---|---|---|---|");
        for ((name, mode, _), ms) in rows.iter().zip(&worst) {
            let diff = match (*name, *mode) {
                ("tp-allreduce", "eager") => format!("{eager_diff:.3e}"),
                ("tp-allreduce", "graph") => graph_diff.map_or("-".into(), |d| format!("{d:.3e}")),
                _ => "-".into(),
            };
            println!("| {name} | {mode} | {ms:.3} | {:.2} | {diff} |", ms * 1e3 / (2 * options.layers) as f64);
        }
        println!("bf16 tolerance on the stack output: {limit:.3e} (16 ulps of its largest magnitude)");
    }
    let passed = ok_stack && checks.passed;
    if !passed {
        eprintln!("rank {rank}: FAILED (stack diff eager {eager_diff:.3e}, graph {graph_diff:?}, limit {limit:.3e}; {checks})");
    } else if rank == 0 {
        println!("PASSED: outputs match NCCL within bf16 tolerance on rank 0 (every rank checks its own)");
    }
    Ok(passed)
}

/// The NCCL communicator: rank 0's unique id travels through the
/// communicator's rendezvous.
fn nccl_comm(comm: &Comm, cuda: &CudaDevice) -> Result<nccl::Comm> {
    let mine: Vec<u8> = if comm.rank() == 0 {
        let id = nccl::Id::new().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
        id.internal().iter().map(|&c| c as u8).collect()
    } else {
        Vec::new()
    };
    let all = comm.all_gather_bytes(&mine)?;
    let root: [std::ffi::c_char; 128] =
        std::array::from_fn(|i| all[0].get(i).copied().unwrap_or(0) as std::ffi::c_char);
    nccl::Comm::from_rank(cuda.cuda_stream(), comm.rank(), comm.world_size(), nccl::Id::uninit(root))
        .map_err(|e| format!("ncclCommInitRank: {e:?}").into())
}

fn make_blocks(options: &Options, rank: usize, world: usize, device: &Device) -> Result<Vec<Block>> {
    let (hidden, shard) = (options.hidden, options.intermediate / world);
    device.set_seed(options.seed + 1 + rank as u64)?; // each rank its own shards
    let mut blocks = Vec::with_capacity(2 * options.layers);
    for index in 0..2 * options.layers {
        let random = |rows: usize, cols: usize, fan_in: usize| -> candle_core::Result<Tensor> {
            Tensor::randn(0f32, (1.0 / fan_in as f64).sqrt() as f32, (rows, cols), device)?.to_dtype(DType::BF16)
        };
        blocks.push(Block {
            column: random(hidden, shard, hidden)?,
            row: random(shard, hidden, options.intermediate)?,
            // Norm weights are replicated: the same on every rank.
            norm: Tensor::ones(hidden, DType::BF16, device)?,
            activation: index % 2 == 1,
        });
    }
    Ok(blocks)
}

/// Median wall time of one call over `steps` calls, in ms.
fn time_ms(cuda: &CudaDevice, steps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let stream = cuda.cuda_stream();
    let mut samples = Vec::with_capacity(steps);
    for _ in 0..steps.max(1) {
        stream.synchronize()?;
        let t = Instant::now();
        f()?;
        stream.synchronize()?;
        samples.push(t.elapsed().as_secs_f64() * 1e3);
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

/// Captures one step of each variant and times its replays.
fn graph_rows(
    options: &Options,
    cuda: &CudaDevice,
    comm: &Comm,
    blocks: &[Block],
    variants: [&(Epilogue, StepBuffers); 2],
) -> Result<Vec<(&'static str, &'static str, f64)>> {
    let stream = cuda.cuda_stream();
    let mut rows = Vec::new();
    for (name, (epilogue, bufs)) in ["tp-allreduce", "NCCL (cudarc)"].into_iter().zip(variants) {
        stream.synchronize()?;
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let captured = step(blocks, epilogue, bufs);
        let graph = stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)?;
        captured?;
        let graph = graph.ok_or("the capture recorded nothing")?;
        if matches!(epilogue, Epilogue::TpAllreduce(_)) {
            comm.register_graph_buffers()?; // collective: every rank captured the same step
        }
        graph.launch()?; // warm-up replay
        let ms = time_ms(cuda, options.steps, || Ok(graph.launch()?))?;
        rows.push((name, "graph", ms));
    }
    Ok(rows)
}

/// Each row's time, the maximum over the ranks.
fn gather_max(comm: &Comm, rows: &[(&str, &str, f64)]) -> Result<Vec<f64>> {
    let mine: Vec<u8> = rows.iter().flat_map(|r| r.2.to_le_bytes()).collect();
    let all = comm.all_gather_bytes(&mine)?;
    Ok((0..rows.len())
        .map(|i| {
            all.iter()
                .filter_map(|b| b.get(8 * i..8 * i + 8).map(|s| f64::from_le_bytes(s.try_into().unwrap_or([0; 8]))))
                .fold(0.0, f64::max)
        })
        .collect())
}

/// Max abs difference of the outputs and of the residuals.
fn compare(a: &StepBuffers, b: &StepBuffers) -> Result<f64> {
    let diff = |x: &Tensor, y: &Tensor| -> Result<f64> {
        let d = (x.to_dtype(DType::F32)? - y.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?;
        Ok(d.to_scalar::<f32>()? as f64)
    };
    Ok(diff(&a.output, &b.output)?.max(diff(&a.residual, &b.residual)?))
}

/// 16 bf16 ulps (2^-8 relative each) at the reference's largest
/// magnitude: room for a rounding that differs between two allreduces
/// (possible beyond 2 ranks, where the summation orders differ) to travel
/// through 122 layers. A wrong sum is off by the order of the values.
fn tolerance(reference: &Tensor) -> Result<f64> {
    let max = reference.to_dtype(DType::F32)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64;
    Ok(16.0 * max.max(1.0) / 256.0)
}

/// The result of [`single_allreduce_checks`].
struct Checks {
    passed: bool,
    summary: String,
}

impl std::fmt::Display for Checks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary)
    }
}

/// One allreduce of fresh random bf16 input through each op (ours out of
/// place and in place, NCCL), against the sum computed in f64 on the CPU
/// from every rank's input (each rank regenerates all inputs from the seed).
fn single_allreduce_checks(
    options: &Options,
    comm: &Arc<Comm>,
    nccl: &NcclAllReduce,
    device: &Device,
) -> Result<Checks> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let shape = (options.tokens, options.hidden);
    let inputs: Vec<Tensor> = (0..world)
        .map(|r| {
            let mut rng = StdRng::seed_from_u64(options.seed ^ (0x9e37_79b9 + r as u64));
            let values: Vec<f32> = (0..shape.0 * shape.1).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
            Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(DType::BF16)
        })
        .collect::<candle_core::Result<_>>()?;
    let mut reference = Tensor::zeros(shape, DType::F64, &Device::Cpu)?;
    let mut magnitude = Tensor::zeros(shape, DType::F64, &Device::Cpu)?;
    for x in &inputs {
        let wide = x.to_dtype(DType::F64)?;
        magnitude = (magnitude + wide.abs()?)?;
        reference = (reference + wide)?;
    }
    let mine = inputs[rank].to_device(device)?;
    let all_reduce = AllReduce::new(comm.clone());
    let out_of_place = all_reduce.all_reduce(&mine)?;
    let in_place = mine.copy()?;
    all_reduce.all_reduce_in_place(&in_place)?;
    let baseline = mine.apply_op1_no_bwd(nccl)?;
    // Roundings to bf16 of partial sums: ours as the chosen algorithm says
    // (1 for most), NCCL's ring up to world - 1.
    let bytes = shape.0 * shape.1 * 2;
    let ours = comm.plan_call(bytes, tp_allreduce::DType::Bf16, false, false).algorithm.max_roundings(world);
    let mut passed = true;
    let mut parts = Vec::new();
    for (name, t, roundings) in
        [("ours out of place", &out_of_place, ours), ("ours in place", &in_place, ours), ("NCCL", &baseline, world - 1)]
    {
        let got = t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
        let err = (&got - &reference)?.abs()?;
        // Each rounding to bf16 errs by at most 2^-9 of the partial sum
        // (bounded by the sum of magnitudes); 2^-8 leaves slack for f32.
        let bound = ((&magnitude * (roundings.max(1) as f64 / 256.0))? + 1e-6 * world as f64)?;
        let excess = (&err - &bound)?.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        let worst = err.flatten_all()?.max(0)?.to_scalar::<f64>()?;
        passed &= excess <= 0.0;
        parts.push(format!("{name} {worst:.2e}{}", if excess <= 0.0 { " ok" } else { " OUT OF BOUND" }));
    }
    Ok(Checks { passed, summary: parts.join(", ") })
}
