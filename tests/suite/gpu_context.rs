//! The caller's current CUDA context survives every public call of a
//! communicator. (Before, init and registration left the caller's thread
//! bound to the communicator's context, or to another GPU's: a runtime-API
//! caller such as PyTorch then silently switches device.)
//!
//! Each rank runs on its own thread. Before every call the thread binds a
//! context that is *not* the communicator's — none (null), a second,
//! non-primary context of GPU 0, and with two GPUs the other rank's GPU —
//! and checks afterwards that it is still the current one. With two GPUs
//! the ranks run on GPUs 0 and 1 (peer access, registration across GPUs);
//! with one, both share GPU 0.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaGraph, CudaSlice};
use rand::rngs::StdRng;
use tp_allreduce::driver::DeviceMemory;
use tp_allreduce::{Algorithm, Comm, Config, DType, ReduceOp};

use crate::common;

/// The calling thread's current context (0: none).
pub fn current() -> usize {
    tp_allreduce::driver::current_context().expect("cuCtxGetCurrent") as usize
}

/// Makes `ctx` (0: none) the calling thread's current context.
pub fn make_current(ctx: usize) {
    // SAFETY: `ctx` is null or a context the test keeps alive.
    let status = unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) };
    assert_eq!(status, sys::CUresult::CUDA_SUCCESS, "cuCtxSetCurrent");
}

/// Runs calls with a caller context bound, in turn from `callers`, and
/// records every call after which another context is current.
struct Checker {
    rank: usize,
    callers: Vec<usize>,
    calls: usize,
    failures: Vec<String>,
}

impl Checker {
    fn call<T>(&mut self, what: &str, f: impl FnOnce() -> T) -> T {
        let caller = self.callers[self.calls % self.callers.len()];
        self.calls += 1;
        make_current(caller);
        let out = f();
        let after = current();
        if after != caller {
            self.failures.push(format!(
                "rank {}: {what} returned with context {after:#x} current; the caller had {caller:#x}",
                self.rank
            ));
        }
        out
    }
}

const N: usize = 10_000;

/// Every rank's inputs of one call, and the check of one rank's output.
struct Case {
    inputs: Vec<Vec<f32>>,
}

impl Case {
    fn new(rng: &mut StdRng, world: usize) -> Case {
        Case { inputs: (0..world).map(|_| common::random_vec::<f32>(rng, N)).collect() }
    }

    fn check(&self, rank: usize, what: &str, out: &[f32]) -> Result<(), String> {
        common::check_sum(&self.inputs, out, 2).map_err(|e| format!("rank {rank}: {what}: {e}"))
    }
}

fn upload(ctx: &Arc<CudaContext>, data: &[f32]) -> DeviceMemory {
    let m = DeviceMemory::alloc(ctx, N * 4).unwrap();
    ctx.bind_to_thread().unwrap();
    tp_allreduce::driver::memcpy_htod(m.ptr(), bytemuck::cast_slice(data)).unwrap();
    m
}

fn poisoned(ctx: &Arc<CudaContext>) -> DeviceMemory {
    let m = DeviceMemory::alloc(ctx, N * 4).unwrap();
    ctx.bind_to_thread().unwrap();
    tp_allreduce::driver::memset_d8(m.ptr(), common::POISON, N * 4).unwrap();
    m
}

fn download(ctx: &Arc<CudaContext>, m: &DeviceMemory) -> Vec<f32> {
    ctx.bind_to_thread().unwrap();
    let mut host = vec![0f32; N];
    tp_allreduce::driver::memcpy_dtoh(bytemuck::cast_slice_mut(&mut host), m.ptr()).unwrap();
    host
}

/// One rank's sequence: every public call of `Comm`, each with a caller
/// context bound, results checked against the f64 reference.
fn rank_script(rank: usize, mut comm: Comm, cases: &[Case], callers: Vec<usize>) -> Vec<String> {
    let ctx = comm.context().clone();
    let stream = comm.stream();
    let mut c = Checker { rank, callers, calls: 0, failures: Vec::new() };
    let mut errors = Vec::new();
    let mut expect = |what: &str, r: Result<(), String>| {
        if let Err(e) = r {
            errors.push(format!("{what}: {e}"));
        }
    };

    // Safe API (cudarc buffers), out of place and in place.
    let send: CudaSlice<f32> = stream.clone_htod(&cases[0].inputs[rank]).unwrap();
    let mut recv: CudaSlice<f32> = stream.alloc_zeros(N).unwrap();
    let r = c.call("all_reduce", || comm.all_reduce(&send, &mut recv, &ReduceOp::Sum));
    expect("all_reduce", r.map_err(|e| e.to_string()));
    expect("synchronize", c.call("synchronize", || comm.synchronize()).map_err(|e| e.to_string()));
    expect("all_reduce result", cases[0].check(rank, "all_reduce", &stream.clone_dtoh(&recv).unwrap()));
    let mut buf: CudaSlice<f32> = stream.clone_htod(&cases[1].inputs[rank]).unwrap();
    let r = c.call("all_reduce_in_place", || comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum));
    expect("all_reduce_in_place", r.map_err(|e| e.to_string()));
    expect("synchronize", c.call("synchronize", || comm.synchronize()).map_err(|e| e.to_string()));
    expect("in place result", cases[1].check(rank, "all_reduce_in_place", &stream.clone_dtoh(&buf).unwrap()));

    // Raw API into a registered buffer, read in place by a pull algorithm.
    comm.set_algorithm(Some(Algorithm::OneShotPull)).unwrap();
    let input = upload(&ctx, &cases[2].inputs[rank]);
    let output = poisoned(&ctx);
    let r = c.call("register_buffer", || comm.register_buffer(input.ptr(), N * 4));
    expect("register_buffer", r.map_err(|e| e.to_string()));
    // SAFETY: both buffers hold N f32 of this rank's context.
    let r = c.call("all_reduce_raw", || unsafe {
        comm.all_reduce_raw(input.ptr(), output.ptr(), N, DType::F32, stream.cu_stream())
    });
    expect("all_reduce_raw", r.map_err(|e| e.to_string()));
    expect("synchronize", c.call("synchronize", || comm.synchronize()).map_err(|e| e.to_string()));
    expect("registered result", cases[2].check(rank, "all_reduce_raw (registered)", &download(&ctx, &output)));

    // A captured pull call, registered afterwards and replayed.
    let captured_in = upload(&ctx, &cases[3].inputs[rank]);
    let captured_out = poisoned(&ctx);
    let graph: CudaGraph = tp_allreduce::driver::capture(
        &stream,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        // SAFETY: both buffers hold N f32 of this rank's context.
        || unsafe { comm.all_reduce_raw(captured_in.ptr(), captured_out.ptr(), N, DType::F32, stream.cu_stream()) },
    )
    .unwrap();
    let r = c.call("register_graph_buffers", || comm.register_graph_buffers());
    expect("register_graph_buffers", r.map(|_| ()).map_err(|e| e.to_string()));
    graph.launch().unwrap();
    expect("synchronize", c.call("synchronize", || comm.synchronize()).map_err(|e| e.to_string()));
    expect("replay result", cases[3].check(rank, "graph replay", &download(&ctx, &captured_out)));
    drop(graph);

    let r = c.call("deregister_buffers", || comm.deregister_buffers());
    expect("deregister_buffers", r.map(|_| ()).map_err(|e| e.to_string()));
    expect("check", c.call("check", || comm.check()).map_err(|e| e.to_string()));
    c.call("drop", move || drop(comm));
    // The buffers outlive the communicator (registered until deregistered).
    drop((input, output, captured_in, captured_out));
    c.failures.into_iter().chain(errors).collect()
}

#[test]
fn public_calls_restore_the_callers_context() {
    let test = "public_calls_restore_the_callers_context";
    let _lock = common::gpu_lock();
    let Some(ctx0) = common::gpu(test) else { return };
    let mut rng = common::rng(test);
    let ctx1 = if tp_allreduce::driver::device_count() >= 2 { common::second_gpu(test).unwrap() } else { ctx0.clone() };
    // The caller's own context: a second, non-primary one on GPU 0.
    let foreign = CudaContext::new_non_primary(0, 0).expect("cuCtxCreate");
    let rank_ctx = [ctx0.clone(), ctx1.clone()];
    let mut callers: Vec<Vec<usize>> = vec![vec![0, foreign.cu_ctx() as usize]; 2];
    if !Arc::ptr_eq(&ctx0, &ctx1) {
        // Each rank's caller also had the other GPU's context bound.
        callers[0].push(ctx1.cu_ctx() as usize);
        callers[1].push(ctx0.cu_ctx() as usize);
    }
    eprintln!("{test}: ranks on GPUs {} and {}", ctx0.ordinal(), ctx1.ordinal());

    let streams = rank_ctx.iter().map(|c| c.new_stream().unwrap()).collect();
    let config = Config {
        timeout: Duration::from_secs(3),
        launch_timeout: Duration::from_secs(3),
        rendezvous_timeout: Duration::from_secs(30),
        ..Config::default()
    };
    make_current(foreign.cu_ctx() as usize);
    let comms = Comm::from_streams(streams, config).expect("init");
    assert_eq!(current(), foreign.cu_ctx() as usize, "from_streams changed the caller's context");
    eprintln!("{test}: transport {} ({})", comms[0].transport(), comms[0].transport_reason());

    let cases: Vec<Case> = (0..4).map(|_| Case::new(&mut rng, 2)).collect();
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for (rank, comm) in comms.into_iter().enumerate() {
            let (cases, callers, failures) = (&cases, callers[rank].clone(), &failures);
            scope.spawn(move || {
                let found = rank_script(rank, comm, cases, callers);
                failures.lock().unwrap().extend(found);
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    eprintln!("{test}: {} failures", failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
