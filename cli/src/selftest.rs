//! `tp-allreduce selftest`: the correctness check each launched rank runs
//! (used by the multi-process tests and by users to validate a machine).
//!
//! Every rank derives every rank's inputs from a shared seed, so each can
//! compute the f64 reference locally; outputs are poisoned before each call
//! and their hashes all-gathered to check that ranks agree bit for bit.
//! `fault` makes one rank SIGKILL itself mid-run: the others must get an
//! error within the timeout and exit cleanly.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::any_buffer::{self, AnyBuffer};
use crate::reference::{check_sum, decode, random_bits};
use tp_allreduce::algorithm::Algorithm;
use tp_allreduce::buffer::DeviceBuffer;
use tp_allreduce::comm::{Comm, Config, ReduceOp};
use tp_allreduce::driver;
use tp_allreduce::driver::elementwise;
use tp_allreduce::error::{driver as driver_error, Error, Result};
use tp_allreduce::DType;
use tp_allreduce::RankEnv;

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
    /// `(rank, delay)`: that rank sleeps before its first allreduce (launch
    /// skew: the others wait within `Config::launch_timeout`).
    pub delay_first_call: Option<(usize, Duration)>,
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
    check_sum(dtype, inputs, &decode(dtype, out), roundings)
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
    let ctx = CudaContext::new(env.device).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
    let stream = ctx.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?;
    let mut comm = env.comm(stream, opts.config.clone())?;
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
    let mut eager_cases = 0usize;
    if let Err(e) = eager_checks(&mut comm, env, opts, &mut eager_cases) {
        if opts.fault.is_none() {
            return Err(e);
        }
        // The dead rank shows up as a kernel timeout or as a broken
        // rendezvous, whichever this rank reached first.
        println!("rank {}: survived the fault: {e}", env.rank);
        let elapsed = started.elapsed();
        return Ok(Summary { eager_cases, graph_replays: 0, registration_rounds: 0, reused_addresses: 0, elapsed });
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
        graph_replays += graph_check(&comm, env, opts, algorithm)?;
    }
    let (registration_rounds, reused_addresses) = registration_lifetime_check(&mut comm, env, opts)?;
    comm.set_algorithm(None)?;
    Ok(Summary { eager_cases, graph_replays, registration_rounds, reused_addresses, elapsed: started.elapsed() })
}

/// Buffers of one registration round: two inputs with different data, two
/// outputs, and every rank's input values of each input.
struct RoundBuffers {
    registered: DeviceBuffer<f32>,
    captured: DeviceBuffer<f32>,
    output: DeviceBuffer<f32>,
    second_output: DeviceBuffer<f32>,
    registered_inputs: Vec<Vec<f64>>,
    captured_inputs: Vec<Vec<f64>>,
}

impl RoundBuffers {
    /// Above the 2 MiB granule, so each buffer is an allocation of its own.
    const COUNT: usize = 786_434;

    fn new(stream: &Arc<CudaStream>, env: &RankEnv, seed: u64) -> Result<RoundBuffers> {
        let dtype = DType::F32;
        let data = |seed: u64| -> (Vec<u8>, Vec<Vec<f64>>) {
            let all = (0..env.world_size).map(|r| random_bits(dtype, Self::COUNT, seed ^ r as u64).1).collect();
            (random_bits(dtype, Self::COUNT, seed ^ env.rank as u64).0, all)
        };
        let (registered_raw, registered_inputs) = data(seed);
        let (captured_raw, captured_inputs) = data(seed.rotate_left(17) ^ 0x00C0_FFEE);
        let mut registered = DeviceBuffer::alloc(stream, Self::COUNT)?;
        let mut captured = DeviceBuffer::alloc(stream, Self::COUNT)?;
        registered.copy_bytes_from_host(&registered_raw)?;
        captured.copy_bytes_from_host(&captured_raw)?;
        Ok(RoundBuffers {
            registered,
            captured,
            output: DeviceBuffer::alloc(stream, Self::COUNT)?,
            second_output: DeviceBuffer::alloc(stream, Self::COUNT)?,
            registered_inputs,
            captured_inputs,
        })
    }

    fn addresses(&self) -> (u64, u64) {
        (self.registered.device_address(), self.captured.device_address())
    }
}

/// `output` against the sum of `inputs`, and every rank's output equal.
fn verify_f32(
    comm: &Comm,
    output: &DeviceBuffer<f32>,
    inputs: &[Vec<f64>],
    roundings: usize,
    what: &str,
) -> Result<()> {
    let out = output.to_host_bytes()?;
    check(DType::F32, inputs, &out, roundings).map_err(|e| Error::InvalidUsage(format!("{what}: {e}")))?;
    agree(comm, &out, what)
}

/// Rounds of: allocate, register (one buffer with `register_buffer`, one
/// through a captured graph), run every pull algorithm on them, deregister,
/// free. The allocator tends to hand the next round the same addresses, so
/// a registration that outlived its buffer (a stale peer mapping or table
/// entry) shows up as the previous round's sum. Returns (rounds, rounds
/// whose buffers reused the previous round's addresses).
fn registration_lifetime_check(comm: &mut Comm, env: &RankEnv, opts: &SelftestOptions) -> Result<(usize, usize)> {
    const ROUNDS: u64 = 3;
    let pulls: Vec<Algorithm> = opts
        .algorithms
        .iter()
        .copied()
        .filter(|a| a.reads_peer_inputs() && comm.set_algorithm(Some(*a)).is_ok())
        .collect();
    if pulls.is_empty() {
        return Ok((0, 0));
    }
    let mut previous: Option<(u64, u64)> = None;
    let mut reused = 0;
    for round in 0..ROUNDS {
        // Different data in the two buffers: a call that read the other
        // buffer's entry would not pass.
        let seed = case_seed(opts.seed, 2_000_000 + round, 0);
        let mut bufs = RoundBuffers::new(&comm.stream(), env, seed)?;
        if previous == Some(bufs.addresses()) {
            reused += 1;
        }
        previous = Some(bufs.addresses());
        registration_round(comm, env, &pulls, &mut bufs, round)?;
        // The buffers are freed here, after every peer closed its mappings.
    }
    Ok((ROUNDS as usize, reused))
}

/// One round: `register_buffer` + every pull algorithm, then one graph of
/// the first pull algorithm reading both inputs, then deregistration.
fn registration_round(
    comm: &mut Comm,
    env: &RankEnv,
    pulls: &[Algorithm],
    bufs: &mut RoundBuffers,
    round: u64,
) -> Result<()> {
    let world = env.world_size;
    let sum = ReduceOp::Sum;
    comm.register_buffer(bufs.registered.device_address(), RoundBuffers::COUNT * 4)?;
    for &algorithm in pulls {
        comm.set_algorithm(Some(algorithm))?;
        bufs.output.fill_bytes(0x7F)?;
        comm.all_reduce(&bufs.registered, &mut bufs.output, &sum)?;
        comm.synchronize()?;
        let what = format!("registration round {round}, {algorithm} on a register_buffer input");
        verify_f32(comm, &bufs.output, &bufs.registered_inputs, algorithm.max_roundings(world), &what)?;
    }
    // The graph reads the registered buffer's entry once and the captured
    // input's (shared by two calls) twice.
    let graph_algorithm = pulls[0];
    comm.set_algorithm(Some(graph_algorithm))?;
    let graph = driver::capture(&comm.stream(), sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL, || {
        comm.all_reduce(&bufs.registered, &mut bufs.second_output, &sum)?;
        comm.all_reduce(&bufs.captured, &mut bufs.output, &sum)?;
        comm.all_reduce(&bufs.captured, &mut bufs.output, &sum)
    })?;
    let distinct = comm.register_graph_buffers()?;
    if distinct != 1 {
        return Err(Error::InvalidUsage(format!(
            "registration round {round}: 2 captured calls on one input registered {distinct} inputs, want 1"
        )));
    }
    bufs.output.fill_bytes(0x7F)?;
    bufs.second_output.fill_bytes(0x7F)?;
    graph.launch().map_err(|e| driver_error("cuGraphLaunch", e))?;
    comm.synchronize()?;
    let roundings = graph_algorithm.max_roundings(world);
    let what = format!("registration round {round}, {graph_algorithm} graph replay, captured input");
    verify_f32(comm, &bufs.output, &bufs.captured_inputs, roundings, &what)?;
    let what = format!("registration round {round}, {graph_algorithm} graph replay, register_buffer input");
    verify_f32(comm, &bufs.second_output, &bufs.registered_inputs, roundings, &what)?;
    comm.deregister_buffers().map(|_| ())
}

/// SIGKILLs this process when the fault injection says it is time.
fn maybe_inject_fault(env: &RankEnv, opts: &SelftestOptions, eager_cases: usize) {
    if let Some((fault_rank, after)) = opts.fault {
        if fault_rank == env.rank && eager_cases == after {
            println!("rank {}: fault injection: SIGKILL now", env.rank);
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn eager_checks(comm: &mut Comm, env: &RankEnv, opts: &SelftestOptions, eager_cases: &mut usize) -> Result<()> {
    let world = env.world_size;
    let stream = comm.stream();
    let mut case = 0u64;
    if let Some((rank, delay)) = opts.delay_first_call {
        if rank == env.rank {
            println!("rank {}: delaying the first call by {delay:?}", env.rank);
            std::thread::sleep(delay);
        }
    }
    for &algorithm in &opts.algorithms {
        if let Err(why) = comm.set_algorithm(Some(algorithm)) {
            println!("rank {}: {algorithm} not available here: {why}", env.rank);
            continue;
        }
        for &dtype in &opts.dtypes {
            for &bytes in &opts.sizes {
                case += 1;
                let count = (bytes / dtype.size_bytes()).max(1);
                let inputs: Vec<Vec<f64>> =
                    (0..world).map(|r| random_bits(dtype, count, case_seed(opts.seed, case, r)).1).collect();
                let (raw, _) = random_bits(dtype, count, case_seed(opts.seed, case, env.rank));
                let input = AnyBuffer::from_bytes(&stream, dtype, &raw)?;
                let mut output = AnyBuffer::alloc(&stream, dtype, count)?;
                output.fill_bytes(0x7F)?;
                maybe_inject_fault(env, opts, *eager_cases);
                any_buffer::all_reduce(comm, &input, &mut output)?;
                comm.synchronize()?;
                let out = output.to_host_bytes()?;
                let what = format!("{algorithm} {} {bytes} B", dtype.name());
                check(dtype, &inputs, &out, algorithm.max_roundings(world))
                    .map_err(|e| Error::InvalidUsage(format!("{what}: {e}")))?;
                agree(comm, &out, &what)?;
                *eager_cases += 1;
            }
        }
    }
    Ok(())
}

/// `layers` x (allreduce x[l] -> y[l], then x[l+1] = y[l] * scale + 0.25)
/// captured once, registered, replayed `graph_replays` times with fresh
/// inputs; returns the replays run.
fn graph_check(comm: &Comm, env: &RankEnv, opts: &SelftestOptions, algorithm: Algorithm) -> Result<usize> {
    let world = env.world_size;
    let n = 4_099usize;
    let layers = opts.graph_allreduces;
    let stream = comm.stream();
    let mut x: Vec<DeviceBuffer<f32>> = (0..=layers).map(|_| DeviceBuffer::alloc(&stream, n)).collect::<Result<_>>()?;
    let mut y: Vec<DeviceBuffer<f32>> = (0..layers).map(|_| DeviceBuffer::alloc(&stream, n)).collect::<Result<_>>()?;
    let scale = 1.0 / world as f32;
    let graph = driver::capture(&stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL, || {
        for l in 0..layers {
            comm.all_reduce(&x[l], &mut y[l], &ReduceOp::Sum)?;
            elementwise::affine(&stream, &y[l], &mut x[l + 1], scale, 0.25)?;
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
        x[0].copy_bytes_from_host(&random_bits(DType::F32, n, seed ^ env.rank as u64).0)?;
        graph.launch().map_err(|e| driver_error("cuGraphLaunch", e))?;
        comm.synchronize()?;
        // Every layer: an error in one rank's early layer shrinks by the
        // world size per later layer, so the last one alone would hide it.
        let mut out = Vec::new();
        for (l, expect) in layered_reference(&inputs, layers, world, scale).iter().enumerate() {
            out = y[l].to_host_bytes()?;
            let got = decode(DType::F32, &out);
            if let Some(i) = (0..n).find(|&i| (got[i] - expect[i]).abs() > 1e-3 * (1.0 + expect[i].abs())) {
                return Err(Error::InvalidUsage(format!(
                    "{algorithm} graph replay {rep}, allreduce {l}: element {i} is {} want {}",
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

/// Every layer's allreduce output of [`graph_check`] in f64.
fn layered_reference(inputs: &[Vec<f64>], layers: usize, world: usize, scale: f32) -> Vec<Vec<f64>> {
    let n = inputs.first().map_or(0, Vec::len);
    let mut expect: Vec<f64> = (0..n).map(|i| inputs.iter().map(|v| v[i]).sum()).collect();
    let mut all = Vec::with_capacity(layers);
    for _ in 0..layers {
        all.push(expect.clone());
        for v in expect.iter_mut() {
            *v = world as f64 * (*v * scale as f64 + 0.25);
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layered_reference_applies_the_layer_between_allreduces() {
        // 2 ranks, 3 layers: s, then 2 * (s/2 + 0.25) twice.
        let inputs = vec![vec![1.0, -0.5], vec![0.5, 0.25]];
        let got = layered_reference(&inputs, 3, 2, 0.5);
        assert_eq!(got, [vec![1.5, -0.25], vec![1.5 + 0.5, -0.25 + 0.5], vec![1.5 + 1.0, -0.25 + 1.0]]);
        assert_eq!(layered_reference(&inputs, 1, 2, 0.5), [[1.5, -0.25]]);
    }

    #[test]
    fn case_seeds_differ_by_rank_and_case() {
        let a = case_seed(7, 1, 0);
        assert_ne!(a, case_seed(7, 1, 1));
        assert_ne!(a, case_seed(7, 2, 0));
        assert_ne!(a, case_seed(8, 1, 0));
        assert_eq!(fnv(b""), 0xcbf2_9ce4_8422_2325);
        assert_ne!(fnv(b"a"), fnv(b"b"));
    }
}
