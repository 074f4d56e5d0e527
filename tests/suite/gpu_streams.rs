//! Calls of one rank on several streams (issue 13 item 4): a rank's calls
//! must never run concurrently, since kernels keep per-block state that
//! assumes they are serialised. On 2 H200s the unordered version gave wrong
//! sums in 4 of 20 trials (one-shot push), 2 of 20 (one-shot pull) and
//! timeouts (two-shot push).

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
    for algorithm in Algorithm::OURS {
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
