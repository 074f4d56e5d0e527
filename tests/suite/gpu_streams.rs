//! Calls of one rank on several streams: a rank's calls must never run
//! concurrently, since kernels keep per-block state that assumes they are
//! serialised (unordered, 2 H200s gave wrong sums with one-shot push and
//! pull and timeouts with two-shot push). And the library never touches a
//! caller's stream after the call that received it returned: the caller
//! may destroy it.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaStream};
use tp_allreduce::{Algorithm, Comm, Config, DType, Element, Error};

use crate::common::{self, check_sum, random_vec, POISON};

const TRIALS: usize = 20;

fn group(ctx: &Arc<cudarc::driver::CudaContext>, world: usize) -> Vec<Comm> {
    let config =
        Config { timeout: Duration::from_secs(2), launch_timeout: Duration::from_secs(2), ..Config::default() };
    Comm::from_streams(common::streams(ctx, world), config).expect("group")
}

/// Every rank issues call A on its communicator's stream and call B on a
/// second stream right after, without waiting in between; both must be
/// right, for every algorithm, in every trial.
#[test]
fn eager_calls_on_two_streams_of_one_rank_do_not_overlap() {
    let Some(ctx) = common::gpu("eager_calls_on_two_streams_of_one_rank_do_not_overlap") else { return };
    let _lock = common::gpu_lock();
    let mut rng = common::rng("eager_calls_on_two_streams_of_one_rank_do_not_overlap");
    let world = 2;
    let mut comms = group(&ctx, world);
    let second: Vec<Arc<CudaStream>> = common::streams(&ctx, world);
    let n = 21_504; // 42 KB of bf16: the verify-pass size.
    let mut failures = Vec::new();
    for algorithm in Algorithm::allreduce_algorithms() {
        if comms.iter_mut().any(|c| c.set_algorithm(Some(algorithm)).is_err()) {
            continue;
        }
        for trial in 0..TRIALS {
            let inputs: Vec<[Vec<half::bf16>; 2]> =
                (0..world).map(|_| [random_vec(&mut rng, n), random_vec(&mut rng, n)]).collect();
            let mut bufs = Vec::new();
            for (r, c) in comms.iter().enumerate() {
                let s = c.stream();
                let ins = [s.clone_htod(&inputs[r][0]).unwrap(), s.clone_htod(&inputs[r][1]).unwrap()];
                let outs = [s.clone_htod(&vec![half::bf16::from_bits(0x7F7F); n]).unwrap(), s.alloc_zeros(n).unwrap()];
                bufs.push((ins, outs));
            }
            for (r, c) in comms.iter().enumerate() {
                c.stream().synchronize().unwrap();
                second[r].synchronize().unwrap();
                let (ins, outs) = &bufs[r];
                let s = c.stream();
                let p = |b: &cudarc::driver::CudaSlice<half::bf16>| common::ptr_of(&s, b, 0);
                // SAFETY: live buffers of n elements; live streams of the
                // communicator's context. The second output is poisoned first
                // on the second stream.
                unsafe {
                    tp_allreduce::driver::memset_d8_async(p(&outs[1]), POISON, n * 2, second[r].cu_stream()).unwrap();
                    c.all_reduce_raw(p(&ins[0]), p(&outs[0]), n, DType::Bf16, s.cu_stream())
                        .unwrap_or_else(|e| panic!("{algorithm} rank {r} call A: {e}"));
                    c.all_reduce_raw(p(&ins[1]), p(&outs[1]), n, DType::Bf16, second[r].cu_stream())
                        .unwrap_or_else(|e| panic!("{algorithm} rank {r} call B: {e}"));
                }
            }
            for (r, c) in comms.iter().enumerate() {
                second[r].synchronize().unwrap();
                if let Err(e) = c.synchronize() {
                    panic!("{algorithm} trial {trial}: rank {r}: {e}");
                }
            }
            for (call, name) in [(0usize, "A"), (1, "B")] {
                let all: Vec<Vec<half::bf16>> = inputs.iter().map(|i| i[call].clone()).collect();
                for (r, c) in comms.iter().enumerate() {
                    let out = c.stream().clone_dtoh(&bufs[r].1[call]).unwrap();
                    if let Err(e) = check_sum(&all, &out, algorithm.max_roundings(world)) {
                        failures.push(format!("{algorithm} trial {trial} rank {r} call {name}: {e}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Two calls of one communicator captured on two branches of one graph
/// could run concurrently: the second is refused with a clear error.
#[test]
fn captured_calls_on_forked_streams_are_refused() {
    let Some(ctx) = common::gpu("captured_calls_on_forked_streams_are_refused") else { return };
    let _lock = common::gpu_lock();
    let comms = group(&ctx, 2);
    let n = 4096usize;
    let c = &comms[0];
    let s = c.stream();
    let branch = ctx.new_stream().unwrap();
    let a = s.alloc_zeros::<f32>(n).unwrap();
    let b = s.alloc_zeros::<f32>(n).unwrap();
    s.synchronize().unwrap();
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    // Fork: the branch stream joins the capture through an event.
    let fork = ctx.new_event(None).unwrap();
    fork.record(&s).unwrap();
    branch.wait(&fork).unwrap();
    let (pa, pb) = (common::ptr_of(&s, &a, 0), common::ptr_of(&s, &b, 0));
    // SAFETY: live buffers of n f32 on streams of the communicator's context.
    let first = unsafe { c.all_reduce_raw(pa, pa, n, f32::DTYPE, s.cu_stream()) };
    // SAFETY: as above.
    let second = unsafe { c.all_reduce_raw(pb, pb, n, f32::DTYPE, branch.cu_stream()) };
    // Join and end the capture whatever happened, so the stream is usable.
    let join = ctx.new_event(None).unwrap();
    join.record(&branch).unwrap();
    s.wait(&join).unwrap();
    let _ = s.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    first.expect("the first captured call is fine");
    match second {
        Err(Error::InvalidUsage(msg)) => assert!(msg.contains("different streams"), "{msg}"),
        other => panic!("expected InvalidUsage for a forked capture, got {other:?}"),
    }
}

/// One stream per rank; `None`: the communicator's own.
type RankStreams = Vec<Option<Arc<CudaStream>>>;

/// One round of the temporary-stream tests: every rank runs call A on
/// `first[r]` and call B on `second[r]` (the communicator's own stream
/// where `None`), each into a poisoned output; returns the inputs and the
/// outputs. `between` runs after every rank's call A was queued, before
/// any call B: it takes call A's streams (and may drop them) and returns
/// call B's.
fn two_calls_per_rank(
    comms: &[Comm],
    rng: &mut rand::rngs::StdRng,
    n: usize,
    first: RankStreams,
    between: &mut dyn FnMut(RankStreams) -> RankStreams,
) -> TwoCalls {
    let world = comms.len();
    let inputs: Vec<[Vec<f32>; 2]> = (0..world).map(|_| [random_vec(rng, n), random_vec(rng, n)]).collect();
    let mut bufs = Vec::new();
    for (r, c) in comms.iter().enumerate() {
        let s = c.stream();
        let ins = [s.clone_htod(&inputs[r][0]).unwrap(), s.clone_htod(&inputs[r][1]).unwrap()];
        let poisoned = vec![f32::from_bits(0x7F7F_7F7F); n];
        let outs = [s.clone_htod(&poisoned).unwrap(), s.clone_htod(&poisoned).unwrap()];
        s.synchronize().unwrap();
        bufs.push((ins, outs));
    }
    let stream_of = |c: &Comm, s: &Option<Arc<CudaStream>>| s.as_ref().map_or(c.stream(), Arc::clone);
    let launch = |call: usize, streams: &RankStreams| {
        for (r, c) in comms.iter().enumerate() {
            let s = stream_of(c, &streams[r]);
            let (ins, outs) = &bufs[r];
            let p = |b: &cudarc::driver::CudaSlice<f32>| common::ptr_of(&c.stream(), b, 0);
            // SAFETY: live buffers of n elements (freed only after the
            // streams are synchronised); `s` is a live stream of the
            // communicator's context.
            unsafe { c.all_reduce_raw(p(&ins[call]), p(&outs[call]), n, DType::F32, s.cu_stream()) }
                .unwrap_or_else(|e| panic!("rank {r} call {call}: {e}"));
        }
    };
    launch(0, &first);
    let second = between(first);
    launch(1, &second);
    for (r, c) in comms.iter().enumerate() {
        if let Some(s) = &second[r] {
            s.synchronize().unwrap();
        }
        c.synchronize().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    let outputs = comms
        .iter()
        .zip(&bufs)
        .map(|(c, (_, outs))| [c.stream().clone_dtoh(&outs[0]).unwrap(), c.stream().clone_dtoh(&outs[1]).unwrap()])
        .collect();
    TwoCalls { inputs, outputs }
}

struct TwoCalls {
    inputs: Vec<[Vec<f32>; 2]>,
    outputs: Vec<[Vec<f32>; 2]>,
}

impl TwoCalls {
    fn check(&self, what: &str, algorithm: Algorithm) {
        let world = self.inputs.len();
        for call in 0..2 {
            let all: Vec<Vec<f32>> = self.inputs.iter().map(|i| i[call].clone()).collect();
            for (r, out) in self.outputs.iter().enumerate() {
                if let Err(e) = check_sum(&all, &out[call], algorithm.max_roundings(world)) {
                    panic!("{what}: {algorithm} rank {r} call {call}: {e}");
                }
            }
        }
    }
}

/// A caller's temporary stream: each rank calls on its communicator's
/// stream and on a temporary stream, everything is synchronised, the
/// temporary streams are destroyed, and the next round starts with a call
/// on the communicator's stream. The library must not touch the destroyed
/// stream (it once recorded an event on it there: SIGSEGV in cuEventRecord
/// in the second round).
#[test]
fn calls_after_a_temporary_stream_was_destroyed() {
    let Some(ctx) = common::gpu("calls_after_a_temporary_stream_was_destroyed") else { return };
    let _lock = common::gpu_lock();
    let mut rng = common::rng("calls_after_a_temporary_stream_was_destroyed");
    let world = 2;
    let mut comms = group(&ctx, world);
    for algorithm in [Algorithm::OneShotPush, Algorithm::OneShotPull, Algorithm::TwoShotPush] {
        if comms.iter_mut().any(|c| c.set_algorithm(Some(algorithm)).is_err()) {
            continue;
        }
        for round in 0..4 {
            let own: RankStreams = vec![None; world];
            let calls = two_calls_per_rank(&comms, &mut rng, 5_000, own, &mut |_| {
                common::streams(&ctx, world).into_iter().map(Some).collect()
            });
            // The temporary streams were dropped (cuStreamDestroy) when
            // `two_calls_per_rank` returned.
            calls.check(&format!("round {round}"), algorithm);
        }
    }
}

/// A temporary stream destroyed with a call still queued on it, and a new
/// stream created at once (the driver may hand out the same handle
/// address): the call on the new stream must still wait for the call on
/// the destroyed one. Streams are told apart by id, not by address.
#[test]
fn a_new_stream_at_a_destroyed_streams_address_is_ordered() {
    let Some(ctx) = common::gpu("a_new_stream_at_a_destroyed_streams_address_is_ordered") else { return };
    let _lock = common::gpu_lock();
    let mut rng = common::rng("a_new_stream_at_a_destroyed_streams_address_is_ordered");
    let world = 2;
    let mut comms = group(&ctx, world);
    // 8 MiB of f32: a call long enough that the next one would overlap it.
    let n = 2 << 20;
    let mut reused = 0;
    let rounds = 6;
    for algorithm in [Algorithm::OneShotPush, Algorithm::TwoShotPush] {
        if comms.iter_mut().any(|c| c.set_algorithm(Some(algorithm)).is_err()) {
            continue;
        }
        for round in 0..rounds {
            let first: RankStreams = common::streams(&ctx, world).into_iter().map(Some).collect();
            let calls = two_calls_per_rank(&comms, &mut rng, n, first, &mut |first| {
                // Destroy the streams with call A still queued, then make new ones.
                let old: Vec<usize> = first.iter().flatten().map(|s| s.cu_stream() as usize).collect();
                drop(first);
                let fresh: Vec<Option<Arc<CudaStream>>> = common::streams(&ctx, world).into_iter().map(Some).collect();
                reused += fresh.iter().flatten().zip(&old).filter(|(s, o)| s.cu_stream() as usize == **o).count();
                fresh
            });
            calls.check(&format!("round {round}"), algorithm);
        }
    }
    eprintln!("a new stream reused a destroyed stream's handle address in {reused} of {} cases", 2 * rounds * world);
}

/// Two graphs holding calls of one communicator, replayed at the same time
/// on unordered streams: the caller's mistake the library cannot see from
/// the host (documented on `register_graph_buffers`). The kernels of the
/// two replays share the rank's generation counter; what must never
/// happen is a wrong result reported as success: every round either gives
/// right sums on every rank or leaves an error on some rank.
#[test]
fn concurrent_replays_of_two_graphs_never_fail_silently() {
    let Some(ctx) = common::gpu("concurrent_replays_of_two_graphs_never_fail_silently") else { return };
    let _lock = common::gpu_lock();
    let mut rng = common::rng("concurrent_replays_of_two_graphs_never_fail_silently");
    let world = 2;
    let n = 1 << 18; // 1 MiB of f32: a multi-block one-shot push launch
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for round in 0..6 {
        let mut comms = group(&ctx, world);
        for c in comms.iter_mut() {
            c.set_algorithm(Some(Algorithm::OneShotPush)).unwrap();
        }
        let side: Vec<Arc<CudaStream>> = common::streams(&ctx, world);
        let inputs: Vec<[Vec<f32>; 2]> =
            (0..world).map(|_| [random_vec(&mut rng, n), random_vec(&mut rng, n)]).collect();
        let mut bufs = Vec::new();
        for (r, c) in comms.iter().enumerate() {
            let s = c.stream();
            let ins = [s.clone_htod(&inputs[r][0]).unwrap(), s.clone_htod(&inputs[r][1]).unwrap()];
            let outs = [s.alloc_zeros::<f32>(n).unwrap(), s.alloc_zeros::<f32>(n).unwrap()];
            s.synchronize().unwrap();
            bufs.push((ins, outs));
        }
        // Graph k of rank r: one allreduce of input k into output k,
        // captured on the rank's own stream.
        let mut graphs = Vec::new();
        for (r, c) in comms.iter().enumerate() {
            let s = c.stream();
            for k in 0..2 {
                s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
                let (ins, outs) = &bufs[r];
                let p = |b: &cudarc::driver::CudaSlice<f32>| common::ptr_of(&s, b, 0);
                // SAFETY: live buffers of n elements on a stream of the context.
                unsafe { c.all_reduce_raw(p(&ins[k]), p(&outs[k]), n, DType::F32, s.cu_stream()) }.unwrap();
                let g = s.end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
                graphs.push((r, k, g.unwrap().expect("a graph")));
            }
        }
        // Replay graph 0 on each rank's stream and graph 1 on its side
        // stream, unordered, several times.
        for _ in 0..4 {
            for (r, k, g) in &graphs {
                let stream = if *k == 0 { comms[*r].stream() } else { side[*r].clone() };
                // SAFETY: the graph's executable was built in this context.
                unsafe { sys::cuGraphLaunch(g.cu_graph_exec(), stream.cu_stream()) }.result().unwrap();
            }
        }
        let mut errors = Vec::new();
        for (r, c) in comms.iter().enumerate() {
            side[r].synchronize().ok();
            if let Err(e) = c.synchronize() {
                errors.push(format!("rank {r}: {e}"));
            }
        }
        let mut wrong = Vec::new();
        if errors.is_empty() {
            for k in 0..2 {
                let all: Vec<Vec<f32>> = inputs.iter().map(|i| i[k].clone()).collect();
                for (r, c) in comms.iter().enumerate() {
                    let out = c.stream().clone_dtoh(&bufs[r].1[k]).unwrap();
                    if let Err(e) = check_sum(&all, &out, 1) {
                        wrong.push(format!("rank {r} graph {k}: {e}"));
                    }
                }
            }
        }
        assert!(wrong.is_empty(), "round {round}: wrong sums and no error:\n{}", wrong.join("\n"));
        let outcome = if errors.is_empty() { "right sums".to_string() } else { errors[0].chars().take(90).collect() };
        *outcomes.entry(outcome).or_default() += 1;
    }
    eprintln!("concurrent replays, outcomes per round: {outcomes:?}");
}
