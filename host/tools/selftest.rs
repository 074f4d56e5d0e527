//! `tp-allreduce selftest`: the correctness check each launched rank runs
//! (used by the multi-process tests and by users to validate a machine).
//!
//! Every rank derives every rank's inputs from a shared seed, so each can
//! compute the f64 reference locally; outputs are poisoned before each call
//! and their hashes all-gathered to check that ranks agree bit for bit.
//! `fault` makes one rank SIGKILL itself mid-run: the others must get an
//! error within the timeout and exit cleanly.

use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext};

use crate::algorithm::Algorithm;
use crate::comm::{Comm, Config};
use crate::driver::{self, DeviceMemory};
use crate::error::{Error, Result};
use crate::tools::bench::{decode, random_bits, unit_roundoff};
use crate::DType;
use crate::RankEnv;

#[derive(Clone, Debug)]
pub struct SelftestOptions {
    pub sizes: Vec<usize>,
    pub dtypes: Vec<DType>,
    pub algorithms: Vec<Algorithm>,
    pub graph_allreduces: usize,
    pub graph_replays: usize,
    pub seed: u64,
    /// `(rank, after)`: that rank SIGKILLs itself after `after` eager calls.
    pub fault: Option<(usize, usize)>,
    pub config: Config,
}

fn fnv(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn case_seed(seed: u64, case: u64, rank: usize) -> u64 {
    seed ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((rank as u64 + 1) << 48) | 1
}

/// Checks `out` (raw bytes) against the sum of every rank's inputs.
fn check(dtype: DType, inputs: &[Vec<f64>], out: &[u8], roundings: usize) -> std::result::Result<(), String> {
    let got = decode(dtype, out);
    let u = unit_roundoff(dtype);
    for i in 0..got.len() {
        let (mut exact, mut mag) = (0.0, 0.0);
        for x in inputs {
            exact += x[i];
            mag += x[i].abs();
        }
        let tol = roundings as f64 * u * mag * 1.001 + inputs.len() as f64 * 6e-8 * mag + 1e-30;
        if (got[i] - exact).abs().is_nan() || (got[i] - exact).abs() > tol {
            return Err(format!("element {i}: got {} want {exact}", got[i]));
        }
    }
    Ok(())
}

/// Every rank's output hash must be equal.
fn agree(comm: &Comm, bytes: &[u8], what: &str) -> Result<()> {
    let hashes = comm.all_gather_bytes(&fnv(bytes).to_le_bytes())?;
    if hashes.iter().any(|h| h != &hashes[0]) {
        return Err(Error::InvalidUsage(format!("{what}: ranks differ bitwise")));
    }
    Ok(())
}

pub struct Summary {
    pub eager_cases: usize,
    pub graph_replays: usize,
    /// Register -> use -> deregister -> free rounds run, and in how many
    /// the new buffers reused the previous round's addresses.
    pub registration_rounds: usize,
    pub reused_addresses: usize,
    pub elapsed: Duration,
}

pub fn run(env: &RankEnv, opts: &SelftestOptions) -> Result<Summary> {
    let started = Instant::now();
    driver::require_driver()?;
    let ctx = CudaContext::new(env.device).map_err(|e| crate::error::driver("cuDevicePrimaryCtxRetain", e))?;
    // SAFETY: all work here is ordered explicitly on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(|e| crate::error::driver("cuStreamCreate", e))?;
    let mut comm = env.comm(stream.clone(), opts.config.clone())?;
    println!(
        "rank {}/{}: device {}, transport {} ({}), {} rank(s) on this GPU, NCCL {}",
        env.rank,
        env.world_size,
        env.device,
        comm.transport(),
        comm.transport_reason(),
        comm.ranks_on_device(),
        if comm.has_nccl() { "yes" } else { "no" }
    );
    let cu = stream.cu_stream();
    let mut eager_cases = 0usize;
    let eager = eager_checks(&ctx, &mut comm, env, opts, cu, &mut eager_cases);
    if let Err(e) = eager {
        if opts.fault.is_some() {
            // The dead rank shows up as a kernel timeout or as a broken
            // rendezvous, whichever this rank reached first.
            println!("rank {}: survived the fault: {e}", env.rank);
            return Ok(Summary {
                eager_cases,
                graph_replays: 0,
                registration_rounds: 0,
                reused_addresses: 0,
                elapsed: started.elapsed(),
            });
        }
        return Err(e);
    }
    if let Some((fault_rank, _)) = opts.fault {
        if fault_rank != env.rank {
            return Err(Error::InvalidUsage(format!(
                "rank {}: the fault on rank {fault_rank} was never noticed",
                env.rank
            )));
        }
    }
    // Graph path: capture `graph_allreduces` allreduces with a dependent
    // kernel between each, register after capture, replay with fresh inputs.
    let mut graph_replays = 0;
    for &algorithm in &opts.algorithms {
        if comm.set_algorithm(Some(algorithm)).is_err() || opts.graph_allreduces == 0 {
            continue;
        }
        graph_replays += graph_check(&ctx, &comm, env, opts, algorithm)?;
    }
    let (registration_rounds, reused_addresses) = registration_lifetime_check(&ctx, &mut comm, env, opts)?;
    comm.set_algorithm(None)?;
    Ok(Summary { eager_cases, graph_replays, registration_rounds, reused_addresses, elapsed: started.elapsed() })
}

/// Rounds of: allocate, register (one buffer with `register_buffer`, one
/// through a captured graph), run every pull algorithm on them, deregister,
/// free. The allocator tends to hand the next round the same addresses, so
/// a registration that outlived its buffer (a stale peer mapping or table
/// entry) shows up as the previous round's sum. Returns (rounds, rounds
/// whose buffers reused the previous round's addresses).
fn registration_lifetime_check(
    ctx: &std::sync::Arc<CudaContext>,
    comm: &mut Comm,
    env: &RankEnv,
    opts: &SelftestOptions,
) -> Result<(usize, usize)> {
    const ROUNDS: u64 = 3;
    // Above the 2 MiB granule, so each buffer is an allocation of its own.
    const COUNT: usize = 786_434;
    let world = env.world_size;
    let dtype = DType::F32;
    let nbytes = COUNT * dtype.size_bytes();
    let pulls: Vec<Algorithm> = opts
        .algorithms
        .iter()
        .copied()
        .filter(|a| a.reads_peer_inputs() && comm.set_algorithm(Some(*a)).is_ok())
        .collect();
    let Some(&graph_algorithm) = pulls.first() else {
        return Ok((0, 0));
    };
    let stream = comm.stream();
    let cu = stream.cu_stream();
    let mut previous: Option<(u64, u64)> = None;
    let mut reused = 0;
    for round in 0..ROUNDS {
        // Different data in the two buffers: a call that read the other
        // buffer's entry would not pass.
        let seed = case_seed(opts.seed, 2_000_000 + round, 0);
        let data = |seed: u64| -> (Vec<u8>, Vec<Vec<f64>>) {
            let all = (0..world).map(|r| random_bits(dtype, COUNT, seed ^ r as u64).1).collect();
            (random_bits(dtype, COUNT, seed ^ env.rank as u64).0, all)
        };
        let (registered_raw, registered_inputs) = data(seed);
        let (captured_raw, captured_inputs) = data(seed.rotate_left(17) ^ 0x00C0_FFEE);
        let registered = DeviceMemory::alloc(ctx, nbytes)?;
        let captured = DeviceMemory::alloc(ctx, nbytes)?;
        let output = DeviceMemory::alloc(ctx, nbytes)?;
        let second_output = DeviceMemory::alloc(ctx, nbytes)?;
        if previous == Some((registered.ptr(), captured.ptr())) {
            reused += 1;
        }
        previous = Some((registered.ptr(), captured.ptr()));
        driver::memcpy_htod(registered.ptr(), &registered_raw)?;
        driver::memcpy_htod(captured.ptr(), &captured_raw)?;
        let verify = |comm: &Comm, output: u64, inputs: &[Vec<f64>], algorithm: Algorithm, what: &str| {
            let mut out = vec![0u8; nbytes];
            driver::memcpy_dtoh(&mut out, output)?;
            check(dtype, inputs, &out, algorithm.max_roundings(world))
                .map_err(|e| Error::InvalidUsage(format!("registration round {round}, {what}: {e}")))?;
            agree(comm, &out, &format!("registration round {round}, {what}"))
        };
        comm.register_buffer(registered.ptr(), nbytes)?;
        for &algorithm in &pulls {
            comm.set_algorithm(Some(algorithm))?;
            driver::memset_d8(output.ptr(), 0x7F, nbytes)?;
            // SAFETY: both buffers hold COUNT f32 on this rank's context.
            unsafe { comm.all_reduce_raw(registered.ptr(), output.ptr(), COUNT, dtype, cu)? };
            comm.synchronize()?;
            let what = format!("{algorithm} on a register_buffer input");
            verify(comm, output.ptr(), &registered_inputs, algorithm, &what)?;
        }
        // The graph reads the registered buffer's entry once and the
        // captured input's (shared by two calls) twice.
        comm.set_algorithm(Some(graph_algorithm))?;
        let graph = driver::capture(&stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL, || {
            // SAFETY: as above.
            unsafe {
                comm.all_reduce_raw(registered.ptr(), second_output.ptr(), COUNT, dtype, cu)?;
                comm.all_reduce_raw(captured.ptr(), output.ptr(), COUNT, dtype, cu)?;
                comm.all_reduce_raw(captured.ptr(), output.ptr(), COUNT, dtype, cu)?;
            }
            Ok(())
        })?;
        let distinct = comm.register_graph_buffers()?;
        if distinct != 1 {
            return Err(Error::InvalidUsage(format!(
                "registration round {round}: 2 captured calls on one input registered {distinct} inputs, want 1"
            )));
        }
        driver::memset_d8(output.ptr(), 0x7F, nbytes)?;
        driver::memset_d8(second_output.ptr(), 0x7F, nbytes)?;
        graph.launch().map_err(|e| crate::error::driver("cuGraphLaunch", e))?;
        comm.synchronize()?;
        let what = format!("{graph_algorithm} graph replay, captured input");
        verify(comm, output.ptr(), &captured_inputs, graph_algorithm, &what)?;
        let what = format!("{graph_algorithm} graph replay, register_buffer input");
        verify(comm, second_output.ptr(), &registered_inputs, graph_algorithm, &what)?;
        comm.deregister_buffers()?;
        // The buffers are freed here, after every peer closed its mappings.
    }
    Ok((ROUNDS as usize, reused))
}

fn eager_checks(
    ctx: &std::sync::Arc<CudaContext>,
    comm: &mut Comm,
    env: &RankEnv,
    opts: &SelftestOptions,
    cu: sys::CUstream,
    eager_cases: &mut usize,
) -> Result<()> {
    let world = env.world_size;
    let mut case = 0u64;
    for &algorithm in &opts.algorithms {
        if let Err(why) = comm.set_algorithm(Some(algorithm)) {
            println!("rank {}: {algorithm} not available here: {why}", env.rank);
            continue;
        }
        for &dtype in &opts.dtypes {
            for &bytes in &opts.sizes {
                case += 1;
                let count = (bytes / dtype.size_bytes()).max(1);
                let nbytes = count * dtype.size_bytes();
                let inputs: Vec<Vec<f64>> =
                    (0..world).map(|r| random_bits(dtype, count, case_seed(opts.seed, case, r)).1).collect();
                let (raw, _) = random_bits(dtype, count, case_seed(opts.seed, case, env.rank));
                let input = DeviceMemory::alloc(ctx, nbytes)?;
                let output = DeviceMemory::alloc(ctx, nbytes)?;
                driver::memcpy_htod(input.ptr(), &raw)?;
                driver::memset_d8(output.ptr(), 0x7F, nbytes)?;
                if let Some((fault_rank, after)) = opts.fault {
                    if fault_rank == env.rank && *eager_cases == after {
                        println!("rank {}: fault injection: SIGKILL now", env.rank);
                        // SAFETY: raising a signal on ourselves.
                        unsafe { libc::raise(libc::SIGKILL) };
                    }
                }
                // SAFETY: both buffers hold `count` elements of `dtype`.
                unsafe { comm.all_reduce_raw(input.ptr(), output.ptr(), count, dtype, cu) }?;
                comm.synchronize()?;
                let mut out = vec![0u8; nbytes];
                driver::memcpy_dtoh(&mut out, output.ptr())?;
                check(dtype, &inputs, &out, algorithm.max_roundings(world))
                    .map_err(|e| Error::InvalidUsage(format!("{algorithm} {} {bytes} B: {e}", dtype.name())))?;
                agree(comm, &out, &format!("{algorithm} {} {bytes} B", dtype.name()))?;
                *eager_cases += 1;
            }
        }
    }
    Ok(())
}

fn graph_check(
    ctx: &std::sync::Arc<CudaContext>,
    comm: &Comm,
    env: &RankEnv,
    opts: &SelftestOptions,
    algorithm: Algorithm,
) -> Result<usize> {
    let world = env.world_size;
    let n = 4_099usize;
    let layers = opts.graph_allreduces;
    let stream = comm.stream();
    let x: Vec<DeviceMemory> = (0..=layers).map(|_| DeviceMemory::alloc(ctx, n * 4)).collect::<Result<_>>()?;
    let y: Vec<DeviceMemory> = (0..layers).map(|_| DeviceMemory::alloc(ctx, n * 4)).collect::<Result<_>>()?;
    let scale = 1.0 / world as f32;
    let graph = driver::capture(&stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL, || {
        for l in 0..layers {
            // SAFETY: x[l], y[l], x[l+1] hold n f32.
            unsafe {
                comm.all_reduce_raw(x[l].ptr(), y[l].ptr(), n, DType::F32, stream.cu_stream())?;
                crate::tools::elementwise::affine_raw(
                    ctx,
                    stream.cu_stream(),
                    y[l].ptr(),
                    x[l + 1].ptr(),
                    n,
                    DType::F32,
                    scale,
                    0.25,
                )?;
            }
        }
        Ok(())
    })?;
    let registered = comm.register_graph_buffers()?;
    if algorithm.reads_peer_inputs() && registered != layers {
        return Err(Error::InvalidUsage(format!("{algorithm}: {registered} of {layers} captured inputs registered")));
    }
    for rep in 0..opts.graph_replays {
        let seed = case_seed(opts.seed, 1_000_000 + rep as u64, 0);
        let inputs: Vec<Vec<f64>> = (0..world).map(|r| random_bits(DType::F32, n, seed ^ r as u64).1).collect();
        let (raw, _) = random_bits(DType::F32, n, seed ^ env.rank as u64);
        driver::memcpy_htod(x[0].ptr(), &raw)?;
        graph.launch().map_err(|e| crate::error::driver("cuGraphLaunch", e))?;
        comm.synchronize()?;
        let mut expect: Vec<f64> = (0..n).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
        for _ in 0..layers - 1 {
            for v in expect.iter_mut() {
                *v = world as f64 * (*v * scale as f64 + 0.25);
            }
        }
        let mut out = vec![0u8; n * 4];
        driver::memcpy_dtoh(&mut out, y[layers - 1].ptr())?;
        let got = decode(DType::F32, &out);
        for i in 0..n {
            if (got[i] - expect[i]).abs() > 1e-3 * (1.0 + expect[i].abs()) {
                return Err(Error::InvalidUsage(format!(
                    "{algorithm} graph replay {rep}: element {i} is {} want {}",
                    got[i], expect[i]
                )));
            }
        }
        agree(comm, &out, &format!("{algorithm} graph replay {rep}"))?;
    }
    // x and y are freed on return: peers must close their mappings first.
    comm.deregister_buffers()?;
    Ok(opts.graph_replays)
}
